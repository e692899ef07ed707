"""Hugging Face ``datasets`` in and out (the ``[hf]`` extra; everything works offline).

In: SRC may be a folder written by ``Dataset.save_to_disk`` (``state.json``,
``dataset_info.json``, arrow files) — or, through :func:`imgpack.convert`, a ``datasets.Dataset``
object, written to a temp folder beside DST first. The image column is the one whose feature is
``Image`` and the label column the one that is a ``ClassLabel`` (or ``--image-column`` /
``--label-column``); the label map is the ``ClassLabel``'s names, in their order. A
``DatasetDict`` folder (``dataset_dict.json``) is converted split by split like ``--splits``.
Each image's bytes go through the image policy as a folder's files would; a sample's source path
is ``<class>/<the image's file name>`` (``<class>/<index>.png`` when it has none).

Out: :func:`to_hf` gives a ``datasets.Dataset`` with an ``image`` (``Image``) and a ``label``
(``ClassLabel``) column: the stored JPEG/PNG bytes as they are, raw pixels as lossless PNGs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from imgpack.errors import ImageError, OptionError, ScanError
from imgpack.executors import Job
from imgpack.folder import Sample, Scan
from imgpack.images import Encoded, Kind, encode_pixels, process_bytes
from imgpack.sources import per_process


def import_datasets() -> Any:
    try:
        import datasets  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        raise OptionError(
            "Hugging Face datasets need the datasets package: pip install 'imgpack[hf]'"
        ) from None
    return datasets


def is_dataset_folder(src: Path) -> bool:
    return (src / "state.json").is_file() and (src / "dataset_info.json").is_file()


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


def column(features: Any, given: str | None, kind: str) -> str:
    """The column named ``given``, else the first whose feature is ``kind`` (``Image`` or
    ``ClassLabel``)."""
    datasets = import_datasets()
    if given is not None:
        if given not in features:
            raise ScanError(f"no column {given!r} (columns: {', '.join(features)})")
        return given
    wanted = getattr(datasets, kind)
    found = next((n for n, f in features.items() if isinstance(f, wanted)), None)
    if found is None:
        flag = "--image-column" if kind == "Image" else "--label-column"
        raise ScanError(
            f"no column of type {kind} (columns: {', '.join(features)}); name it with {flag}"
        )
    return str(found)


def class_names(features: Any, label: str, labels: list[int]) -> list[str]:
    datasets = import_datasets()
    feature = features[label]
    if isinstance(feature, datasets.ClassLabel):
        return [str(name) for name in feature.names]
    if labels and min(labels) < 0:
        raise ScanError(f"column {label!r} holds negative labels")
    return [str(i) for i in range(max(labels) + 1)] if labels else []


def load(root: Path, image_column: str | None) -> tuple[Any, str]:
    """The saved dataset at ``root`` with its image column's bytes undecoded."""
    datasets = import_datasets()
    ds = datasets.load_from_disk(str(root))
    if isinstance(ds, datasets.DatasetDict):
        raise ScanError(
            f"{root}: a DatasetDict (splits {', '.join(ds)}): use --splits to convert each split "
            "into DST/<split> with one label map"
        )
    image = column(ds.features, image_column, "Image")
    return ds.cast_column(image, datasets.Image(decode=False)), image


def scan_dataset(
    root: Path, classes: list[str] | None, image_column: str | None, label_column: str | None
) -> Scan:
    """The samples of a saved dataset, in its row order."""
    ds, image = load(root, image_column)
    label = column(ds.features, label_column, "ClassLabel")
    labels = [int(v) for v in ds[label]]
    names = class_names(ds.features, label, labels)
    # The file names only, straight from the arrow column: the image bytes stay on disk.
    import pyarrow.compute as pc  # type: ignore[import-untyped,import-not-found,unused-ignore]

    files = [
        os.path.basename(path) if path else None
        for path in pc.struct_field(ds.data.column(image), "path").to_pylist()
    ]
    unique = len({f for f in files if f}) == len(files)
    paths = [
        f"{names[t]}/{f}" if unique and f else f"{names[t]}/{i:08d}.png"
        for i, (t, f) in enumerate(zip(labels, files, strict=True))
    ]
    if classes is not None:
        unknown = sorted({names[t] for t in set(labels)} - set(classes))
        if unknown:
            raise ScanError(f"{root}: class(es) {', '.join(unknown)} are not in the label map")
        labels = [classes.index(names[t]) for t in labels]
        names = classes
    state = _state_sha256(root)
    present = set(labels)
    return Scan(
        classes=list(names),
        samples=[Sample(p, t, i) for i, (p, t) in enumerate(zip(paths, labels, strict=True))],
        empty_classes=[c for i, c in enumerate(names) if i not in present],
        origin={
            "format": "huggingface",
            "image_column": image,
            "label_column": label,
            "state_sha256": state,
        },
    )


def fetch(job: Job, sample: Sample) -> Encoded:
    """One row's image through the image policy (in a conversion worker); ``job.root`` is
    ``<image column>:<dataset folder>``."""
    column, _, root = job.root.partition(":")
    dataset = per_process(("hf", job.root, job.source_id), lambda: _open(job, Path(root), column))
    item = dataset[sample.index][column]
    data = item.get("bytes") if item else None
    if not data:
        where = item.get("path") if item else None
        if not where:
            raise ImageError(sample.path, "the row has no image bytes")
        try:
            data = Path(where).read_bytes()
        except OSError as exc:
            raise ImageError(sample.path, f"cannot read {where}: {exc.strerror}") from None
    return process_bytes(data, sample.path, sample.label, job.policy, job.encoding)


def _open(job: Job, root: Path, column: str) -> Any:
    """The saved dataset at ``root``, refused when it is not the one the run planned."""
    from imgpack.sources import changed_source, source_identity

    try:
        state = _state_sha256(root)
    except OSError:
        state = ""
    if job.source_id and source_identity("hf", root, {"state_sha256": state}) != job.source_id:
        raise changed_source(str(root))
    return load(root, column)[0]


def _state_sha256(root: Path) -> str:
    """What identifies a saved dataset's contents: the sha256 of its ``state.json`` (which
    lists its arrow files and their fingerprint)."""
    return hashlib.sha256((root / "state.json").read_bytes()).hexdigest()


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
