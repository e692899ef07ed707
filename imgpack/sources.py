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

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from imgpack.errors import DataError, ImageError, ScanError
from imgpack.executors import Job
from imgpack.folder import Sample, Scan
from imgpack.images import Encoded, Kind, process_bytes, process_pixels
from imgpack.manifest import MANIFEST_NAME, Manifest

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset


def is_output(src: Path) -> bool:
    return src.is_dir() and (src / MANIFEST_NAME).is_file()


def tfrecord_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The TFRecord files ``src`` names (a folder holding ``*.tfrecord`` files, a glob, or a
    ``.tfrecord`` file), or ``None`` when it names none."""
    from imgpack.formats.tfrecord.reader import tfrecord_files as files_of

    path = Path(src)
    if path.is_file() and path.suffix not in (".tfrecord", ".tfrecords"):
        return None  # a single file is taken for a TFRecord only by its name
    try:
        return files_of(src)
    except FileNotFoundError:
        return None


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
            **output_identity(manifest),
            "from": dict(manifest.source),
        }
    else:
        from imgpack.formats.tfrecord.reader import TFRecordDataset

        ds = TFRecordDataset(str(src))  # as fetch_tfrecord opens it: the same files, in order
        manifest = ds.manifest
        reader = "tfrecord"
        origin = {"format": "tfrecord", "foreign": True, "files": len(manifest.files)}
    source_classes = list(manifest.classes)
    labels = list(ds.targets)
    stored = ds.stored_paths()
    names = (
        [_plain_path(p) for p in stored]
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


def output_identity(manifest: Manifest) -> dict[str, Any]:
    """What identifies an imgpack output as a source: its id and its files' sha256 (recorded in
    the scan's ``origin``, compared by every worker that opens it)."""
    return {"output_id": manifest.output_id, "sha256": [e.sha256 for e in manifest.files]}


def source_identity(reader: str, src: Path, origin: dict[str, Any] | None) -> str:
    """What identifies the source a conversion planned (:attr:`Job.source_id`): an imgpack
    output's id and file hashes (in its scan's ``origin``), else the sizes and modification
    times of TFRecord files, as a short digest."""
    if reader == "output":
        head: Any = {k: (origin or {}).get(k) for k in ("output_id", "sha256")}
    elif reader == "tfrecord":
        head = _stat_signature(src)
    elif reader == "hf":
        head = (origin or {}).get("state_sha256")
    else:
        return ""
    return hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:32]


def _stat_signature(src: str | os.PathLike[str]) -> list[list[Any]]:
    files = tfrecord_files(src) or []
    out: list[list[Any]] = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            out.append([str(path), None])  # the file fails when it is read
            continue
        out.append([str(path), st.st_size, st.st_mtime_ns])
    return out


def _plain_path(path: str) -> str:
    """A stored source path as the new output records it: a NUL, which no file name and no
    HDF5 string can hold, written as ``\\x00``."""
    return path.replace("\0", "\\x00") if "\0" in path else path


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
    ds = per_process(("output", root, job.source_id), lambda: _open_output(root, job.source_id))
    try:
        stored = next(ds.encoded(sample.index, sample.index + 1))
    except DataError as exc:
        raise ImageError(sample.path, f"damaged record in the source output: {exc}") from None
    stored = replace(stored, path=sample.path, label=sample.label)
    if mode == "carry" and _KINDS.get(job.encoding.name, stored.kind) is stored.kind:
        return stored
    if stored.kind is Kind.RAW:
        pixels = np.frombuffer(stored.payload, np.uint8).reshape(
            stored.height, stored.width, stored.channels
        )
        return process_pixels(pixels, stored.path, stored.label, job.policy, job.encoding)
    return process_bytes(stored.payload, stored.path, stored.label, job.policy, job.encoding)


#: What a carried-over record must hold under each encoding (``original`` keeps either).
_KINDS = {"jpeg": Kind.JPEG, "png": Kind.PNG, "raw": Kind.RAW}


def fetch_tfrecord(job: Job, sample: Sample) -> Encoded:
    """One record of TFRecord files, through the image policy; runs in a conversion worker."""
    from imgpack.formats.tfrecord.reader import stored_image

    ds = per_process(("tfrecord", job.root, job.source_id), lambda: _open_tfrecord(job))
    try:
        features, where = ds.record(sample.index)
        payload, shape = stored_image(features, where)
    except DataError as exc:
        raise ImageError(sample.path, f"damaged record: {exc}") from None
    if shape is not None:
        pixels = np.frombuffer(payload, np.uint8).reshape(shape)
        return process_pixels(pixels, sample.path, sample.label, job.policy, job.encoding)
    return process_bytes(payload, sample.path, sample.label, job.policy, job.encoding)


#: Readers (and datasets) a worker opened, by source kind, path and identity (the source as the
#: run planned it), so that a worker reused by a later run (a pool worker, a Ray actor) never
#: serves an earlier run's source that was replaced since. Opened once per source, not per
#: sample; the few most recent are kept. A forked worker inherits the parent's entries;
#: readers reopen their handles after a fork.
_opened: OrderedDict[tuple[str, ...], Any] = OrderedDict()
KEEP_OPENED = 4


def per_process(key: tuple[str, ...], open_it: Callable[[], Any]) -> Any:
    """The object opened for ``key`` in this process, opened by ``open_it`` the first time."""
    if key in _opened:
        _opened.move_to_end(key)
        return _opened[key]
    found = _opened[key] = open_it()
    while len(_opened) > KEEP_OPENED:
        _opened.popitem(last=False)
    return found


def changed_source(root: str) -> DataError:
    return DataError(
        f"{root}: the source changed after this conversion planned it (replaced or rewritten "
        "while it ran); nothing was published: run the conversion again"
    )


def _open_output(root: str, expected: str) -> ImageDataset:
    from imgpack.readers import open_dataset

    ds = open_dataset(root, verify=True)
    if expected and source_identity("output", Path(root), output_identity(ds.manifest)) != expected:
        raise changed_source(root)
    return ds


def _open_tfrecord(job: Job) -> Any:
    from imgpack.formats.tfrecord.reader import TFRecordDataset

    if job.source_id and source_identity("tfrecord", Path(job.root), None) != job.source_id:
        raise changed_source(job.root)
    return TFRecordDataset(job.root)
