"""Readers: one torch ``Dataset`` per format, chosen by :func:`open_dataset` from the manifest.

Adding a format: a module with an :class:`~imgpack.readers.base.ImageDataset` subclass and one
line in :data:`_READERS`. Reader classes are importable from here (``from imgpack.readers import
PTDataset``) and load their format library only when first used.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from imgpack.errors import ManifestError
from imgpack.manifest import read_manifest
from imgpack.readers.base import Batch, ImageDataset, collate

_READERS = {
    "pt": "imgpack.readers.pt:PTDataset",
    "lmdb": "imgpack.readers.lmdb:LMDBDataset",
    "hdf5": "imgpack.readers.hdf5:HDF5Dataset",
    "tfrecord": "imgpack.readers.tfrecord:TFRecordDataset",
}


def reader_class(fmt: str) -> type[ImageDataset]:
    """The dataset class that reads format ``fmt``."""
    try:
        module, name = _READERS[fmt].split(":")
    except KeyError:
        raise ManifestError(f"no reader for format {fmt!r}; known: {', '.join(_READERS)}") from None
    cls: type[ImageDataset] = getattr(importlib.import_module(module), name)
    return cls


def open_dataset(path: str | os.PathLike[str], **kwargs: Any) -> ImageDataset:
    """Open the imgpack output at ``path`` with the reader its manifest names.

    ``kwargs`` go to the reader (``transform``, ``target_transform`` and format options).
    """
    return reader_class(read_manifest(path).format)(path, **kwargs)


#: Readers that are not the default of a format, importable from here all the same.
_OTHER_READERS = ("imgpack.readers.tfrecord:TFRecordStream", "imgpack.readers.gpu:DeviceLoader")


def __getattr__(name: str) -> Any:
    for target in (*_READERS.values(), *_OTHER_READERS):
        module, cls = target.split(":")
        if cls == name:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Batch",
    "DeviceLoader",
    "HDF5Dataset",
    "ImageDataset",
    "LMDBDataset",
    "PTDataset",
    "TFRecordDataset",
    "TFRecordStream",
    "collate",
    "open_dataset",
    "reader_class",
]
