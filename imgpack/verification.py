"""``imgpack verify``: is an output intact?

The quick check (the default) reads every byte once more than a plain copy would:

1. the manifest against the files: each named file present, a regular file of the recorded size,
   with the recorded sha256 (files hashed in parallel);
2. every record against its stored checksum (:mod:`imgpack.checksum`; TFRecord's own CRCs),
   with the structure the reader checks on the way (offsets, headers, label ranges), so damage
   is named down to the sample.

``deep=True`` also decodes every record and checks its shape and label against the manifest.
Nothing raises for damage: every problem is a :class:`Problem` in the :class:`Report`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from imgpack.errors import ImgpackError, NotAnOutput
from imgpack.manifest import (
    MANIFEST_NAME,
    Companion,
    FileEntry,
    Manifest,
    file_problem,
    sha256_file,
)
from imgpack.opening import open_manifest
from imgpack.scan import valid_label
from imgpack.sources.listing import source_folder
from imgpack.storage.location import is_url, local_path
from imgpack.system import usable_cpus

#: Samples checked per step (one batch read, one progress update).
BATCH = 256


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an output: the file, the sample when one is to blame, and what."""

    file: str
    message: str
    sample: int | None = None
    #: Whether ``message`` names the file and sample itself (a reader's error does).
    named: bool = False

    def line(self) -> str:
        if self.named:
            return self.message
        where = self.file if self.sample is None else f"{self.file}: sample {self.sample}"
        return f"{where}: {self.message}"


@dataclass
class Report:
    """What :func:`verify` found."""

    path: str
    deep: bool
    files: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        rate = self.bytes / self.seconds / (1 << 20) if self.seconds else 0.0
        state = "intact" if self.ok else f"DAMAGED ({len(self.problems)} problem(s))"
        mode = "deep" if self.deep else "quick"
        return (
            f"{self.path}: {state}: {self.files} file(s), {self.samples} sample(s), "
            f"{self.bytes / (1 << 20):.1f} MiB checked ({mode}) in {self.seconds:.1f} s "
            f"({rate:.0f} MiB/s)"
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def _check_file(root: Path, entry: FileEntry, bar: tqdm) -> list[Problem]:
    """The manifest's word on one file and its companions (index files) against the files
    (names were checked with the manifest)."""
    problems = []
    files: list[FileEntry | Companion] = [entry, *entry.companions]
    for one in files:
        path = root / one.path
        problem = file_problem(root, one)
        if problem is not None:
            bar.update(one.bytes)
            problems.append(Problem(str(path), problem))
            continue
        try:
            digest = sha256_file(path, progress=bar.update)
        except OSError as exc:
            problems.append(Problem(str(path), f"unreadable: {exc.strerror}"))
            continue
        if one.sha256 and digest != one.sha256:
            problems.append(
                Problem(str(path), "sha256 differs from the manifest (the file was changed)")
            )
    return problems


def _batches(count: int) -> Iterator[range]:
    for start in range(0, count, BATCH):
        yield range(start, min(count, start + BATCH))


def _check_records(dataset: Any, manifest: Manifest, part: range) -> list[Problem]:
    return [
        Problem(str(dataset.root), msg, index, named=True)
        for index, msg in _damaged(dataset, np.arange(part.start, part.stop, dtype=np.int64))
    ]


def _damaged(dataset: Any, indices: np.ndarray) -> Iterator[tuple[int, str]]:
    """``(index, problem)`` for every damaged record among ``indices`` (structure, label
    range, checksum), without decoding images: all at once, then each when one is."""
    try:
        dataset.checks.each(dataset, indices)
        return
    except ImgpackError:
        pass
    for index in indices.tolist():  # find each bad one
        try:
            dataset.checks.each(dataset, np.array([index], np.int64))
        except ImgpackError as exc:
            yield index, str(exc)


def _decode(dataset: Any, manifest: Manifest, part: range) -> list[Problem]:
    """Decode ``part`` and check each sample's shape and label against the manifest."""
    image = manifest.image
    channels = int(image.get("channels") or 3)
    fixed = image.get("height") is not None
    problems = []
    try:
        batch = dataset.__getitems__(list(part))
    except ImgpackError:
        batch = None
    for k, index in enumerate(part):
        try:
            pixels, label = batch[k] if batch is not None else dataset[index]
        except ImgpackError as exc:
            problems.append(Problem(str(dataset.root), str(exc), index, named=True))
            continue
        shape = tuple(pixels.shape)
        if shape[0] != channels or (fixed and shape[1:] != (image["height"], image["width"])):
            problems.append(Problem(str(dataset.root), f"decodes to shape {shape}", index))
        if not valid_label(int(label), len(manifest.classes)):
            problems.append(Problem(str(dataset.root), f"label {label} out of range", index))
    return problems


def verify(
    path: str | os.PathLike[str],
    deep: bool = False,
    workers: int | None = None,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Report:
    """Check the imgpack output at ``path``; see the module docstring for what is checked.
    A URL's files are downloaded as they are to a scratch folder and checked there.

    Args:
        deep: also decode every record and check its shape and label.
        workers: threads that hash files and check records (default: the usable CPUs).
        progress: tqdm progress bars on stderr.
    """
    if is_url(path):  # the files as the bucket holds them, in a scratch folder
        with source_folder(path, storage_options) as local:
            report = verify(local, deep, workers, progress)
        report.path = str(path).rstrip("/")
        report.problems = [  # named as the bucket names them
            replace(
                p,
                file=p.file.replace(str(local), report.path, 1),
                message=p.message.replace(str(local), report.path),
            )
            for p in report.problems
        ]
        return report
    root = local_path(path)
    started = time.perf_counter()
    report = Report(str(root), deep)
    try:  # the route's manifest-only opening: damage is reported, not refused
        manifest = open_manifest(root)[1]
    except (NotAnOutput, FileNotFoundError):
        raise  # the wrong folder given, not a damaged output
    except ImgpackError as exc:
        report.problems.append(Problem(str(root / MANIFEST_NAME), str(exc)))
        report.seconds = time.perf_counter() - started
        return report
    workers = workers or usable_cpus()
    report.files = len(manifest.files)
    report.bytes = manifest.total_bytes
    bar = tqdm(
        total=manifest.total_bytes + sum(c.bytes for e in manifest.files for c in e.companions),
        unit="B",
        unit_scale=True,
        desc="files",
        file=sys.stderr,
        disable=not progress,
    )
    with bar, ThreadPoolExecutor(workers) as pool:
        for found in pool.map(lambda e: _check_file(root, e, bar), manifest.files):
            report.problems.extend(found)
        counted = sum(f.num_samples for f in manifest.files)
        if counted != manifest.num_samples:
            report.problems.append(
                Problem(
                    str(root / MANIFEST_NAME),
                    f"the files hold {counted} samples, num_samples says {manifest.num_samples}",
                )
            )
        if report.ok or all(p.message.startswith("sha256") for p in report.problems):
            report.problems.extend(_check_samples(root, manifest, pool, deep, progress))
    report.samples = manifest.num_samples
    report.seconds = time.perf_counter() - started
    return report


def _check_samples(
    root: Path, manifest: Manifest, pool: ThreadPoolExecutor, deep: bool, progress: bool
) -> list[Problem]:
    """Every record's checksum (and, ``deep``, its decode), batch by batch in ``pool``."""
    from imgpack.readers import open_dataset

    try:
        dataset = open_dataset(root, verify=True)
    except ImgpackError as exc:
        return [Problem(str(root), str(exc))]
    problems: list[Problem] = []
    steps = [(_check_records, "records")] + ([(_decode, "decode")] if deep else [])
    for check, name in steps:
        with tqdm(
            total=len(dataset), unit="img", desc=name, file=sys.stderr, disable=not progress
        ) as bar:
            parts = list(_batches(len(dataset)))
            jobs = [pool.submit(check, dataset, manifest, part) for part in parts]
            for job, part in zip(jobs, parts, strict=True):
                problems.extend(job.result())
                bar.update(len(part))
    return problems
