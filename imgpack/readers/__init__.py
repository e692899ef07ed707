"""The readers, under their public import path (a facade over :mod:`imgpack.formats`).

``from imgpack.readers import open_dataset, PTDataset, collate`` keeps working; each reader lives
in its format's package (``imgpack/formats/<name>/reader.py``) and loads its format library only
when first used. Every registered format's reader class is importable from here by its name.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from imgpack import formats
from imgpack.errors import ManifestError, NotAnOutput
from imgpack.formats.batch import Batch, collate
from imgpack.formats.dataset_base import ImageDataset, ReadOptions
from imgpack.opening import open_output
from imgpack.storage.location import is_url

#: Readers that are not a format's default reader.
_OTHERS = {
    "TFRecordStream": "imgpack.formats.tfrecord.stream",
    "DeviceLoader": "imgpack.loading.gpu",
}


def reader_class(fmt: str) -> type[ImageDataset]:
    """The dataset class that reads format ``fmt``."""
    return formats.reader_for(fmt, "imgpack.readers.reader_class")


def open_dataset(
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    options: ReadOptions | None = None,
    **kwargs: Any,
) -> ImageDataset:
    """Open the imgpack output at ``path`` with the reader its manifest names.

    ``path`` may be a URL (``s3://bucket/out``, ``gs://``, ``memory://``...): the output is
    fetched into the local cache (``cache_dir``, default the user's cache folder) and read from
    there; ``storage_options`` go to the fsspec filesystem (:mod:`imgpack.storage`).
    ``kwargs`` are :class:`~imgpack.opening.ReadOptions`' fields (``transform``,
    ``target_transform``, ``size``, ``decode_threads``, ...), or ``options`` gives them as one
    value, every format the same; other keywords are the format's own (``check_crc`` and
    ``label_offset`` for ``tfrecord``, ``mmap`` for ``hdf5``). An output whose replacement
    (``convert --overwrite``) was killed midway is put back first
    (:func:`imgpack.publishing.recover`). The output is opened once
    (:func:`imgpack.opening.open_output`: one manifest read, one GET for a bucket) and its
    reader built from what was opened.
    """
    named = {f.name for f in fields(ReadOptions)}
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in named}  # the rest: format options
    options = ReadOptions.of(options, **given)
    where: dict[str, Any] = {"storage_options": storage_options, "cache_dir": cache_dir}
    changed = {k: v for k, v in where.items() if v is not None and v != getattr(options, k)}
    options = replace(options, **changed) if changed else options
    try:  # the one route: the manifest read once, the files checked (or fetched) once
        opened = open_output(path, options, lazy=lambda m: reader_class(m.format).lazy_files)
    except NotAnOutput:
        folder = Path(path)
        if not is_url(path) and _holds_tfrecords(folder):
            raise ManifestError(
                f"{folder}: holds TFRecord files but no imgpack.json (not an imgpack output): "
                f"read them with imgpack.readers.TFRecordDataset({str(folder)!r}) or "
                "TFRecordStream, or convert them with imgpack convert"
            ) from None
        raise
    reader = formats.reader_for(opened.manifest.format, str(path))
    return reader(opened, options=options, **kwargs)  # by name: a plugin's (root, **kwargs) too


def _holds_tfrecords(folder: Path) -> bool:
    from imgpack.formats.tfrecord.records import tfrecord_files

    if folder.is_file():
        return folder.suffix in (".tfrecord", ".tfrecords")
    try:
        return bool(tfrecord_files(folder))
    except FileNotFoundError:
        return False


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


__all__ = [
    "Batch",
    "ImageDataset",
    "ReadOptions",
    "collate",
    "open_dataset",
    "reader_class",
    *_readers(),
]
