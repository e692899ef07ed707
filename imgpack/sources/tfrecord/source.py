"""TFRecord files without a manifest (a file, a folder of ``*.tfrecord``, a glob) as a source.

They are read with their labels (``image/class/label``, names from ``image/class/text``), in file
order, and every image goes through the image policy, as a folder's files would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from imgpack.errors import DataError, ImageError
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes, process_pixels
from imgpack.scan import Sample, Scan
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    files_identity,
    has_subfolders,
    opened,
)
from imgpack.sources.output.source import scan_reader


def tfrecord_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The TFRecord files ``src`` names (a folder holding ``*.tfrecord`` files, a glob, or a
    ``.tfrecord`` file), or ``None`` when it names none."""
    from imgpack.formats.tfrecord.records import tfrecord_files as files_of

    path = Path(src)
    if path.is_file() and path.suffix not in (".tfrecord", ".tfrecords"):
        return None  # a single file is taken for a TFRecord only by its name
    try:
        return files_of(src)
    except FileNotFoundError:
        return None


class TFRecordSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return not has_subfolders(src) and bool(tfrecord_files(src))

    def check(self) -> None:
        if not tfrecord_files(self.src):
            raise FileNotFoundError(f"{self.src}: names no TFRecord file")

    def scan(self, request: ScanRequest) -> Scan:
        from imgpack.formats.tfrecord.reader import TFRecordDataset

        ds = TFRecordDataset(str(self.src))  # as the fetcher opens it: the same files, in order
        origin = {"format": "tfrecord", "foreign": True, "files": len(ds.manifest.files)}
        return scan_reader(self.src, ds, request, origin)

    def identity(self, scan: Scan) -> str:
        return stat_identity(self.src)

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        return TFRecordFetcher(str(self.src), self.identity(scan), run)


def stat_identity(src: str | os.PathLike[str]) -> str:
    """The TFRecord files' paths, sizes and modification times, as a digest."""
    return files_identity(tfrecord_files(src) or [])


@dataclass(frozen=True)
class TFRecordFetcher(Fetcher):
    """One record of TFRecord files, through the image policy."""

    root: str
    identity: str
    run: str

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        from imgpack.formats.tfrecord.records import stored_image

        ds = opened(self.run, ("tfrecord", self.root, self.identity), self._open)
        try:
            features, where = ds.record(sample.index)
            payload, shape = stored_image(features, where)
        except DataError as exc:
            raise ImageError(sample.path, f"damaged record: {exc}") from None
        if shape is not None:
            pixels = np.frombuffer(payload, np.uint8).reshape(shape)
            return process_pixels(pixels, sample.path, sample.label, policy, encoding)
        return process_bytes(payload, sample.path, sample.label, policy, encoding)

    def _open(self) -> Any:
        from imgpack.formats.tfrecord.reader import TFRecordDataset

        if self.identity and stat_identity(self.root) != self.identity:
            raise changed_source(self.root)
        return TFRecordDataset(self.root)
