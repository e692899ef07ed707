"""Format writers, one module each, registered by format name.

Adding a format: a module with a :class:`~imgpack.converters.base.Writer` subclass and one line
in :data:`_WRITERS`. Writers are imported on demand so that h5py or lmdb load only when used.
"""

from __future__ import annotations

import importlib

from imgpack.converters.base import Writer
from imgpack.errors import OptionError

_WRITERS = {
    "pt": "imgpack.converters.pt:PTWriter",
    "lmdb": "imgpack.converters.lmdb:LMDBWriter",
    "hdf5": "imgpack.converters.hdf5:HDF5Writer",
    "tfrecord": "imgpack.converters.tfrecord:TFRecordWriter",
}

#: The formats this imgpack writes and reads, in the order the CLI lists them.
FORMATS = tuple(_WRITERS)


def get_writer(fmt: str) -> type[Writer]:
    """The writer class of format ``fmt``."""
    try:
        target = _WRITERS[fmt]
    except KeyError:
        raise OptionError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}") from None
    module, name = target.split(":")
    cls: type[Writer] = getattr(importlib.import_module(module), name)
    return cls


__all__ = ["FORMATS", "Writer", "get_writer"]
