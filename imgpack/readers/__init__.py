"""The readers, under their public import path (a facade over :mod:`imgpack.formats`).

``from imgpack.readers import open_dataset, PTDataset, collate`` keeps working; each reader lives
in its format's package (``imgpack/formats/<name>/reader.py``) and loads its format library only
when first used. Every registered format's reader class is importable from here by its name.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from imgpack import formats
from imgpack.formats.dataset_base import Batch, ImageDataset, collate
from imgpack.manifest import read_manifest
from imgpack.publishing import recover

#: Readers that are not a format's default reader.
_OTHERS = {
    "TFRecordStream": "imgpack.formats.tfrecord.stream",
    "DeviceLoader": "imgpack.loading.gpu",
}


def reader_class(fmt: str) -> type[ImageDataset]:
    """The dataset class that reads format ``fmt``."""
    return formats.reader_for(fmt, "imgpack.readers.reader_class")


def open_dataset(path: str | os.PathLike[str], **kwargs: Any) -> ImageDataset:
    """Open the imgpack output at ``path`` with the reader its manifest names.

    ``kwargs`` go to the reader (``transform``, ``target_transform`` and format options).
    An output whose replacement (``convert --overwrite``) was killed midway is put back first
    (:func:`imgpack.publishing.recover`).
    """
    recover(Path(path))
    return formats.reader_for(read_manifest(path).format, str(path))(path, **kwargs)


def _readers() -> dict[str, str]:
    """Class name -> module of every registered format's reader, and the other readers."""
    found = {}
    for spec in formats.specs():
        module, _, name = spec.reader.partition(":")
        found[name] = module
    return {**found, **_OTHERS}


def __getattr__(name: str) -> Any:
    module = _readers().get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Batch", "ImageDataset", "collate", "open_dataset", "reader_class", *_readers()]
