"""imgpack: pack image folders into fast training formats and read them back with PyTorch.

Importing :mod:`imgpack` is cheap: :func:`convert` and :func:`open_dataset` import their
machinery (torch, the format libraries) on first call.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from imgpack.errors import ImgpackError
from imgpack.version import __version__

__all__ = [
    "ImgpackError",
    "__version__",
    "convert",
    "convert_splits",
    "export",
    "merge",
    "open_dataset",
    "to_hf",
    "verify",
]

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset
    from imgpack.manifest import Manifest
    from imgpack.verification import Report


def convert(src: Any, dst: Any, format: str = "pt", **options: Any) -> Manifest:
    """Convert the image folder ``src`` into ``dst``; see :func:`imgpack.pipeline.convert`."""
    from imgpack.pipeline import convert as _convert

    return _convert(src, dst, format=format, **options)


def open_dataset(path: Any, **kwargs: Any) -> ImageDataset:
    """Open an imgpack output as a torch Dataset; see :func:`imgpack.readers.open_dataset`."""
    from imgpack.readers import open_dataset as _open_dataset

    return _open_dataset(path, **kwargs)


def verify(path: Any, deep: bool = False, **kwargs: Any) -> Report:
    """Check an imgpack output for damage; see :func:`imgpack.verification.verify`."""
    from imgpack.verification import verify as _verify

    return _verify(path, deep=deep, **kwargs)


def merge(parts: Any, dst: Any, **kwargs: Any) -> Manifest:
    """Join the parts of a partitioned conversion; see :func:`imgpack.merging.merge`."""
    from imgpack.merging import merge as _merge

    return _merge(parts, dst, **kwargs)


def convert_splits(root: Any, dst: Any, format: str = "pt", **options: Any) -> dict[str, Manifest]:
    """Convert each split folder of ``root`` into ``dst/<split>`` with one label map; see
    :func:`imgpack.pipeline.convert_splits`."""
    from imgpack.pipeline import convert_splits as _convert_splits

    return _convert_splits(root, dst, format, **options)


def export(output: Any, folder: Any, **kwargs: Any) -> Any:
    """Write an imgpack output back as an image folder; see :func:`imgpack.exporting.export`."""
    from imgpack.exporting import export as _export

    return _export(output, folder, **kwargs)


def to_hf(output: Any, **kwargs: Any) -> Any:
    """An imgpack output (a path, a URL or an open reader) as a Hugging Face
    ``datasets.Dataset``; see :func:`imgpack.exporting.to_hf`."""
    from imgpack.exporting import to_hf as _to_hf
    from imgpack.readers import open_dataset

    if isinstance(output, (str, os.PathLike)):
        output = open_dataset(output, verify=False)
    return _to_hf(output, **kwargs)
