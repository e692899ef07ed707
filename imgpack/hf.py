"""Hugging Face ``datasets`` (the ``[hf]`` extra; everything works offline).

In: see :mod:`imgpack.sources.hf` (a saved dataset as SRC); here, what the engine needs to know
of ``datasets.Dataset`` objects and saved ``DatasetDict`` folders.

Out: :func:`to_hf` gives a ``datasets.Dataset`` with an ``image`` (``Image``) and a ``label``
(``ClassLabel``) column: the stored JPEG/PNG bytes as they are, raw pixels as lossless PNGs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from imgpack.errors import OptionError, ScanError
from imgpack.images import Kind, encode_pixels


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


def to_hf(output: str | os.PathLike[str], cache_dir: str | None = None) -> Any:
    """The imgpack output at ``output`` as a ``datasets.Dataset`` with ``image`` (``Image``) and
    ``label`` (``ClassLabel``) columns, in the output's order (built by a generator: bounded
    memory; the arrow files go to ``cache_dir`` or the datasets cache)."""
    datasets = import_datasets()
    from imgpack.readers import open_dataset

    ds = open_dataset(output, verify=False)
    classes = list(ds.classes)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
    )
    # The output id in the generator's arguments: the datasets cache, keyed by them, never
    # returns the rows of an output that was replaced since.
    kwargs = {"root": str(Path(output).resolve()), "output_id": ds.manifest.output_id}
    return datasets.Dataset.from_generator(
        _rows, features=features, cache_dir=cache_dir, gen_kwargs=kwargs, keep_in_memory=False
    )


def _rows(root: str, output_id: str) -> Any:
    from imgpack.readers import open_dataset

    reader = open_dataset(root, verify=True)
    paths = reader.stored_paths()
    for index, sample in enumerate(reader.encoded(0, len(reader))):
        if sample.kind is Kind.RAW:
            pixels = np.frombuffer(sample.payload, np.uint8).reshape(
                sample.height, sample.width, sample.channels
            )
            data = encode_pixels(pixels, Kind.PNG)
        else:
            data = sample.payload
        name = paths[index] if paths else f"{index:08d}"
        yield {"image": {"bytes": data, "path": name}, "label": sample.label}
