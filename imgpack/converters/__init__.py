"""The format writers, under their public import path (a facade over :mod:`imgpack.formats`).

``from imgpack.converters import FORMATS, get_writer, PTWriter`` keeps working; each writer lives
in its format's package (``imgpack/formats/<name>/writer.py``) and loads on first use, so h5py or
lmdb are imported only when used. Every registered format's writer class is importable from here
by its name.
"""

from __future__ import annotations

import importlib
from typing import Any

from imgpack import formats
from imgpack.formats.writer_base import ShardedWriter, Writer, WriterConfig, WrittenFile


def get_writer(fmt: str) -> type[Writer]:
    """The writer class of format ``fmt``."""
    return formats.get(fmt).writer_class()


def _writers() -> dict[str, str]:
    """Class name -> module of every registered format's writer."""
    return {
        name: module for module, _, name in (spec.writer.partition(":") for spec in formats.specs())
    }


def __getattr__(name: str) -> Any:
    if name == "FORMATS":  # the registered formats, plugins included
        return formats.names()
    module = _writers().get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "ShardedWriter",
    "Writer",
    "WriterConfig",
    "WrittenFile",
    "get_writer",
    *_writers(),
]
