"""Hugging Face ``datasets`` (the ``[hf]`` extra; everything works offline).

In: see :mod:`imgpack.sources.hf` (a saved dataset as SRC); here, what the engine needs to know
of ``datasets.Dataset`` objects and saved ``DatasetDict`` folders.

Out: :func:`imgpack.exporting.to_hf` gives a ``datasets.Dataset`` with an ``image`` (``Image``) and a ``label``
(``ClassLabel``) column: the stored JPEG/PNG bytes as they are, raw pixels as lossless PNGs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imgpack.errors import OptionError, ScanError


def import_datasets() -> Any:
    try:
        import datasets  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise OptionError(
            "Hugging Face datasets need the datasets package: pip install 'imgpack[hf]'"
        ) from None
    return datasets


def is_dataset_dict_folder(src: Path) -> bool:
    return (src / "dataset_dict.json").is_file()


def is_dataset_object(value: object) -> bool:
    return type(value).__module__.startswith("datasets") and hasattr(value, "save_to_disk")


def dict_splits(src: Path) -> list[str]:
    """The splits of a saved ``DatasetDict``, in its order."""
    try:
        names = json.loads((src / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError) as exc:
        raise ScanError(f"{src}/dataset_dict.json: unreadable: {exc}") from None
    return [str(name) for name in names]
