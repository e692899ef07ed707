"""A folder of images without labels, for pretraining, embedding or deduplication runs, or
WebDataset tars without labels (LAION-style ``key.jpg`` + ``key.txt`` + ``key.json``: the other
members are fields, :mod:`imgpack.sources.webdataset.source`).

Every image file under SRC (recursively, hidden files and folders ignored, in the image folder's
order: folders sorted by path, the files of each sorted by name) becomes a sample with label
:data:`~imgpack.scan.UNLABELLED` (-1); the output's label map is empty. Only when asked for
(``--no-labels``, ``no_labels=True``): a folder without class folders is refused otherwise, as a
mistake is likelier than an unlabelled dataset.

A bucket SRC is listed, not downloaded (:func:`imgpack.sources.listing.source_folder`): its
images are taken from the listing in the same order, and each conversion worker reads its own
samples' objects from the bucket (:class:`~imgpack.sources.folder.source.ObjectFetcher`), as
for a bucket image folder; a bucket folder of tars only is read as WebDataset tars are, in
place (:class:`~imgpack.sources.webdataset.source.TarRangeFetcher`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from imgpack.errors import OptionError, ScanError
from imgpack.images import Encoding, ImagePolicy
from imgpack.scan import UNLABELLED, Sample, SampleTable, Scan
from imgpack.sources import listing
from imgpack.sources.base import Fetcher, ScanRequest, Source, file_stamp
from imgpack.sources.folder.scan import IMAGE_EXTENSIONS, scan_unlabelled_listing, walk_images
from imgpack.sources.folder.sidecars import sidecar_fields
from imgpack.sources.folder.source import (
    FileFetcher,
    ObjectFetcher,
    refuse_bucket_sidecars,
    refuse_unreadable,
)
from imgpack.sources.webdataset.source import WebDatasetSource


class UnlabelledSource(Source):
    """Images without labels: a folder's images, or the samples of WebDataset tars (a
    ``.tar`` file, a folder of them, a glob: :class:`WebDatasetSource` with ``labels`` off,
    which needs no ``.cls``)."""

    @functools.cached_property
    def remote(self) -> tuple[str, dict[str, Any]] | None:
        """A bucket tree whose listing only SRC holds: its URL and storage options."""
        return listing.remote_source(self.src) if self.src.is_dir() else None

    @functools.cached_property
    def _tars(self) -> WebDatasetSource | None:
        """WebDataset tars (a bucket's read in place too), without labels."""
        if not WebDatasetSource.detect(self.src):
            return None
        return WebDatasetSource(self.src, {**self.settings, "labels": False})

    def check(self) -> None:
        if self._tars is not None:
            return self._tars.check()
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such folder")
        if not self.src.is_dir():
            raise OptionError(
                f"{self.src}: not a folder; --no-labels converts every image under a folder "
                "SRC (any layout, no classes). A label list is converted with --labels FILE, "
                "its rows' labels kept"
            )

    def scan(self, request: ScanRequest) -> Scan:
        if self._tars is not None:
            return self._tars.scan(request)
        if request.classes is not None:
            raise OptionError(
                "an unlabelled source has no classes: --classes-from does not apply to --no-labels"
            )
        if self.remote is not None:
            return self._scan_listing(self.remote[0], request)
        unreadable: list[dict[str, str]] = []
        ignored: list[dict[str, str]] = []
        sizes: list[int] = []
        paths = walk_images(self.src, "", unreadable, ignored, sizes)
        if not paths and not unreadable:
            raise ScanError(
                f"{self.src}: found no image files. Images are recognised by the extensions "
                f"{', '.join(IMAGE_EXTENSIONS)} (any case)"
            )
        samples = SampleTable()  # packed, with the sizes the shard plan is cut from
        samples.extend(paths, UNLABELLED, sizes)
        scan = Scan(
            classes=[],
            samples=samples,
            ignored_files=len(ignored),
            ignored=ignored,
            unreadable=unreadable,
        )
        scan = sidecar_fields(scan, request)
        refuse_unreadable(self.src, scan, request)
        return scan

    def _scan_listing(self, url: str, request: ScanRequest) -> Scan:
        """The scan of a bucket tree from its listing: every top-level folder's objects and the
        top's own, in :func:`walk_images`'s order."""
        objects = listing.store_every_object(self.src)
        paths, sizes, listed, ignored = scan_unlabelled_listing(url, objects)
        samples = SampleTable()
        samples.extend(paths, UNLABELLED, sizes, listed)
        scan = Scan(classes=[], samples=samples, ignored_files=len(ignored), ignored=ignored)
        refuse_bucket_sidecars(url, scan, request)
        return scan

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        if self._tars is not None:
            return self._tars.fetcher(scan, policy, encoding, run)
        if self.remote is not None:
            return ObjectFetcher.of(self.remote)
        return FileFetcher(str(self.src), tuple(scan.fields))

    def identity(self, scan: Scan) -> str:
        return self._tars.identity(scan) if self._tars is not None else ""

    def stamp(self, sample: Sample) -> str:
        if self._tars is not None:
            return self._tars.stamp(sample)
        return file_stamp(Path(self.src, sample.path))
