"""Hugging Face ``datasets`` (the ``[hf]`` extra; everything works offline).

In: see :mod:`imgpack.sources.hf` (a saved dataset as SRC); here, what the engine needs to know
of ``datasets.Dataset`` objects and saved ``DatasetDict`` folders.

Out: :func:`to_hf` gives a ``datasets.Dataset`` with an ``image`` (``Image``) and a ``label``
(``ClassLabel``) column: the stored JPEG/PNG bytes as they are, raw pixels as lossless PNGs.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from imgpack import formats
from imgpack.errors import DataError, OptionError, ScanError
from imgpack.images import Kind, encode_pixels
from imgpack.manifest import read_manifest

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset


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


def to_hf(output: ImageDataset | str | os.PathLike[str], cache_dir: str | None = None) -> Any:
    """An imgpack output (an open reader, or a local output folder) as a ``datasets.Dataset``
    with ``image`` (``Image``) and ``label`` (``ClassLabel``; a plain integer for an unlabelled
    output) columns, in the output's order (built by a generator: bounded memory; the arrow
    files go to ``cache_dir`` or the datasets cache). :func:`imgpack.to_hf` takes URLs too."""
    datasets = import_datasets()
    ds = _open(Path(output)) if isinstance(output, (str, os.PathLike)) else output
    classes = list(ds.classes)
    label = datasets.ClassLabel(names=classes) if classes else datasets.Value("int64")
    features = datasets.Features({"image": datasets.Image(), "label": label})
    # The output id in the generator's arguments: the datasets cache, keyed by them, never
    # returns the rows of an output that was replaced since.
    kwargs = {
        "reader": f"{type(ds).__module__}:{type(ds).__qualname__}",
        "root": str(Path(ds.root).resolve()),
        "output_id": ds.manifest.output_id,
    }
    return datasets.Dataset.from_generator(
        _rows, features=features, cache_dir=cache_dir, gen_kwargs=kwargs, keep_in_memory=False
    )


def _open(root: Path) -> ImageDataset:
    """The reader of the output folder ``root``, found by the format its manifest names."""
    manifest = read_manifest(root)
    return formats.reader_for(manifest.format, str(root))(root, manifest=manifest)


def _rows(reader: str, root: str, output_id: str) -> Any:
    module, _, name = reader.partition(":")
    ds = getattr(importlib.import_module(module), name)(root, verify=True)
    if ds.manifest.output_id != output_id:
        raise DataError(
            f"{root}: replaced since it was opened (output id {output_id}); open it again"
        )
    paths = ds.stored_paths()
    for index, sample in enumerate(ds.encoded(0, len(ds))):
        if sample.kind is Kind.RAW:
            pixels = np.frombuffer(sample.payload, np.uint8).reshape(
                sample.height, sample.width, sample.channels
            )
            data = encode_pixels(pixels, Kind.PNG)
        else:
            data = sample.payload
        name = paths[index] if paths else f"{index:08d}"
        yield {"image": {"bytes": data, "path": name}, "label": sample.label}
