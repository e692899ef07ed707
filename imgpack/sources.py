"""Sources that are not image folders: an imgpack output, or TFRecord files other tools wrote.

``imgpack convert OUT_A OUT_B --format F`` reads the samples of ``OUT_A`` in its order, with its
label map and the source paths it stores:

- when nothing that decides the stored bytes changes (same encoding and quality, same size,
  channels, resize, resampling and background), each record is **carried over as stored**,
  without decoding (its checksum is checked on the way): an ``original`` output keeps the
  original files' bytes through any number of hops;
- otherwise the stored image goes through the image policy again (:func:`imgpack.images.
  process_bytes` for JPEG/PNG records, :func:`~imgpack.images.process_pixels` for raw ones).

TFRecord files without a manifest (a file, a folder of ``*.tfrecord``, a glob) are read with
their labels (``image/class/label``, names from ``image/class/text``) and every image goes
through the policy, as a folder's files would.

The new manifest's ``source`` records where the samples came from, and the source's own
``source`` under ``from``: the chain of conversions.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import numpy as np

from imgpack.errors import DataError, ImageError, ScanError
from imgpack.executors import Job
from imgpack.folder import Sample, Scan
from imgpack.formats.dataset_base import ImageDataset
from imgpack.images import Encoded, ImagePolicy, Kind, process_bytes, process_pixels
from imgpack.manifest import MANIFEST_NAME

#: Reader per (source, pid), opened on first use in each worker.
_readers: dict[tuple[str, int], ImageDataset] = {}


def is_output(src: Path) -> bool:
    return src.is_dir() and (src / MANIFEST_NAME).is_file()


def tfrecord_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The TFRecord files ``src`` names (a file, a folder holding them, a glob), or ``None``
    when it names none."""
    text = os.fspath(src)
    if any(ch in text for ch in "*?["):
        found = [Path(p) for p in sorted(glob.glob(text))]
    elif Path(text).is_dir():
        found = sorted(
            p
            for p in Path(text).iterdir()
            if p.is_file() and p.suffix in (".tfrecord", ".tfrecords")
        )
    else:
        found = [Path(text)] if Path(text).suffix in (".tfrecord", ".tfrecords") else []
    return [p for p in found if p.is_file()] or None


def scan_source(src: Path, classes: list[str] | None) -> tuple[Scan, str]:
    """The scan of an output or of TFRecord files, and what reads it (``output``/``tfrecord``).

    ``classes``: a label map to use instead of the source's; every class the source has must be
    in it, and labels are remapped by name.
    """
    if is_output(src):
        from imgpack.readers import open_dataset

        ds = open_dataset(src, verify=False)
        manifest = ds.manifest
        reader = "output"
        origin: dict[str, Any] = {
            "format": manifest.format,
            "encoding": manifest.encoding,
            "image": dict(manifest.image),
            "options": dict(manifest.options),
            "output_id": manifest.output_id,
            "sha256": [entry.sha256 for entry in manifest.files],
            "from": dict(manifest.source),
        }
    else:
        from imgpack.formats.tfrecord.reader import TFRecordDataset

        ds = TFRecordDataset([str(p) for p in tfrecord_files(src) or []])
        manifest = ds.manifest
        reader = "tfrecord"
        origin = {"format": "tfrecord", "foreign": True, "files": len(manifest.files)}
    source_classes = list(manifest.classes)
    labels = list(ds.targets)
    stored = ds.stored_paths()
    names = (
        list(stored)
        if stored is not None
        else [f"{source_classes[t]}/{i:08d}" for i, t in enumerate(labels)]
    )
    if classes is not None:
        unknown = sorted({source_classes[t] for t in set(labels)} - set(classes))
        if unknown:
            raise ScanError(
                f"{src}: class(es) {', '.join(map(repr, unknown))} are not in the given label map"
            )
        remap = [classes.index(c) if c in classes else -1 for c in source_classes]
        labels = [remap[t] for t in labels]
    else:
        classes = source_classes
    samples = [
        Sample(name, label, index)
        for index, (name, label) in enumerate(zip(names, labels, strict=True))
    ]
    present = set(labels)
    scan = Scan(
        classes=list(classes),
        samples=samples,
        empty_classes=[c for i, c in enumerate(classes) if i not in present],
        origin=origin,
    )
    return scan, reader


def carries_over(scan: Scan, job: Job) -> bool:
    """Whether the source's records can be stored as they are under ``job``'s options."""
    origin = scan.origin or {}
    if origin.get("foreign") or origin.get("encoding") != job.encoding.name:
        return False
    if (
        job.encoding.name == "jpeg"
        and origin.get("options", {}).get("quality") != job.encoding.quality
    ):
        return False
    return bool(origin.get("image") == job.policy.describe())


def fetch_stored(job: Job, sample: Sample) -> Encoded:
    """One sample of an imgpack output, carried over or re-encoded (see the module doc); runs in
    a conversion worker. ``job.root`` is ``"carry:"`` or ``"encode:"`` and the output's path."""
    mode, _, root = job.root.partition(":")
    ds = _reader(root, "output")
    try:
        stored = next(ds.encoded(sample.index, sample.index + 1))
    except DataError as exc:
        raise ImageError(sample.path, f"damaged record in the source output: {exc}") from None
    stored = Encoded(
        sample.path,
        sample.label,
        stored.payload,
        stored.height,
        stored.width,
        stored.channels,
        stored.kind,
    )
    if mode == "carry":
        return stored
    return _reencode(stored, job.policy, job)


def fetch_tfrecord(job: Job, sample: Sample) -> Encoded:
    """One record of TFRecord files, through the image policy; runs in a conversion worker."""
    ds = _reader(job.root, "tfrecord")
    try:
        [(_, frame, where)] = list(ds._frames(np.array([sample.index], np.int64)))
        features = _features(frame, where)
    except DataError as exc:
        raise ImageError(sample.path, f"damaged record: {exc}") from None
    encoded = features.get("image/encoded")
    if not encoded or not isinstance(encoded[0], bytes):
        raise ImageError(sample.path, "record has no image/encoded bytes")
    fmt = (features.get("image/format") or [b""])[0]
    if fmt == Kind.RAW.value.encode():
        dims = [int(features[k][0]) for k in ("image/height", "image/width", "image/channels")]
        pixels = np.frombuffer(encoded[0], np.uint8).reshape(dims)
        return process_pixels(pixels, sample.path, sample.label, job.policy, job.encoding)
    return process_bytes(encoded[0], sample.path, sample.label, job.policy, job.encoding)


def _features(frame: Any, where: str) -> dict[str, Any]:
    from imgpack.formats.tfrecord import example

    try:
        return dict(example.decode_example(frame))
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _reencode(stored: Encoded, policy: ImagePolicy, job: Job) -> Encoded:
    if stored.kind is Kind.RAW:
        pixels = np.frombuffer(stored.payload, np.uint8).reshape(
            stored.height, stored.width, stored.channels
        )
        return process_pixels(pixels, stored.path, stored.label, policy, job.encoding)
    return process_bytes(stored.payload, stored.path, stored.label, policy, job.encoding)


def _reader(root: str, kind: str) -> Any:
    key = (root, os.getpid())
    reader = _readers.get(key)
    if reader is None:
        if kind == "output":
            from imgpack.readers import open_dataset

            reader = open_dataset(root, verify=True)
        else:
            from imgpack.formats.tfrecord.reader import TFRecordDataset

            reader = TFRecordDataset([str(p) for p in tfrecord_files(root) or []])
        _readers[key] = reader
    return reader
