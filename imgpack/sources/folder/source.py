"""The image folder as a source: its scan (:mod:`imgpack.sources.folder.scan`) and a fetcher that
reads each file under the root."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from imgpack.errors import ImageError, OptionError, ScanError
from imgpack.fields import Field
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes, process_file
from imgpack.scan import Sample, Scan
from imgpack.sources import listing
from imgpack.sources.base import Fetcher, ScanRequest, Source, file_stamp
from imgpack.sources.folder.scan import (
    SPLIT_NAMES,
    find_classes,
    printable,
    scan_folder,
    scan_listing,
)
from imgpack.sources.folder.sidecars import read_sidecars, sidecar_fields
from imgpack.storage import location


@dataclass(frozen=True)
class FileFetcher(Fetcher):
    """Reads ``root/<sample.path>``: the samples are files under one folder; and the fields
    kept from its sidecars (:mod:`imgpack.sources.folder.sidecars`)."""

    root: str
    fields: tuple[Field, ...] = ()

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        encoded = process_file(self.root, sample.path, sample.label, policy, encoding)
        if self.fields:
            try:
                encoded.fields = read_sidecars(self.root, sample.path, self.fields)
            except ValueError as exc:
                raise ImageError(sample.path, str(exc)) from None
        return encoded


@dataclass(frozen=True)
class ObjectFetcher(Fetcher):
    """Reads ``url/<sample.path>`` from object storage, in the worker (a pool process or a Ray
    task on any node): a bucket folder is never copied to the driver."""

    url: str
    #: The fsspec storage options, as JSON (the fetcher stays small and hashable).
    storage_options: str

    @classmethod
    def of(cls, remote: tuple[str, dict[str, Any]]) -> ObjectFetcher:
        """The fetcher of a bucket source read in place: ``(url, storage options)`` as
        :func:`imgpack.sources.listing.remote_source` gives them."""
        url, options = remote
        return cls(url, json.dumps(options, sort_keys=True))

    def prefetch(self, samples: Sequence[Sample]) -> None:
        """GET the objects of a chunk of samples at once (one GET after the other would wait
        a round trip per image): each ``__call__`` then takes its bytes from memory."""
        self.prefetch_keys([sample.path for sample in samples])

    def prefetch_keys(self, keys: Sequence[str]) -> None:
        """:meth:`prefetch` of the objects at ``keys`` under the URL."""
        if len(keys) < 2:
            return
        fs, root = _filesystem(self.url, self.storage_options)
        paths = [f"{root}/{key}" for key in keys]
        _FETCHED.clear()
        _FETCHED.update(zip(paths, location.read_objects(fs, paths), strict=True))

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        data = self.data(sample.path, sample.path, sample.listed)
        return process_bytes(data, sample.path, sample.label, policy, encoding)

    def data(self, key: str, name: str, listed: int) -> bytes:
        """The bytes of the object at ``key`` under the URL (prefetched, else one GET), with
        the content the listing named (``listed``, 0: any); ``name`` is the sample's path in
        errors."""
        fs, root = _filesystem(self.url, self.storage_options)
        path = f"{root}/{key}"
        found = _FETCHED.pop(path, None)
        if found is None:
            (found,) = location.read_objects(fs, [path])
        if isinstance(found, BaseException):
            raise ImageError(name, f"cannot read {self.url}/{key}: {found}") from None
        data, said = found
        replaced = listing.replaced(f"{self.url}/{key}", listed, said)
        if replaced is not None:
            raise replaced
        return data


#: Objects of the chunk being converted in this process (:meth:`ObjectFetcher.prefetch`): their
#: bytes and what the store said of them, or why they could not be read.
_FETCHED: dict[str, Any] = {}


def _filesystem(url: str, options: str) -> tuple[Any, str]:
    """The filesystem of ``url`` in this process: fsspec's instance cache starts afresh in a
    forked process, so a pool worker never uses the driver's."""
    return location.filesystem(url, json.loads(options) or None)


class FolderSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_dir()

    @property
    def remote(self) -> tuple[str, dict[str, Any]] | None:
        """A bucket folder whose listing only SRC holds (:func:`imgpack.listing.source_folder`):
        its URL and storage options."""
        return listing.remote_source(self.src) if self.src.is_dir() else None

    def check(self) -> None:
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such folder")
        if not self.src.is_dir():
            raise OptionError(
                f"{self.src}: not a folder (SRC must be an image folder SRC/<class>/<image>)"
            )

    def scan(self, request: ScanRequest) -> Scan:
        remote = self.remote
        if remote is not None:
            index = listing.store_folders(self.src) or {}
            folders = sorted(name for name, (_, _, shown) in index.items() if name and shown)
            if not request.allow_split_names:
                refuse_splits(remote[0], folders)
            objects = partial(listing.store_objects, self.src)
            top = listing.store_objects(self.src, "") if "" in index else ()
            scan = scan_listing(remote[0], folders, objects, request.classes, top)
            refuse_bucket_sidecars(remote[0], scan, request)
            refuse_unreadable(remote[0], scan, request)
            return scan
        if not request.allow_split_names:
            refuse_split_folders(self.src)
        scan = sidecar_fields(scan_folder(self.src, request.classes), request)
        refuse_unreadable(self.src, scan, request)
        return scan

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        remote = self.remote
        if remote is not None:
            return ObjectFetcher.of(remote)
        return FileFetcher(str(self.src), tuple(scan.fields))

    def stamp(self, sample: Sample) -> str:
        return file_stamp(f"{self.src}/{sample.path}")


def refuse_bucket_sidecars(url: str, scan: Scan, request: ScanRequest) -> None:
    """A bucket tree's images with sidecar files: refused (never dropped without a word), as
    fields are read from local sidecars only."""
    kept = sidecar_fields(scan, request).fields
    if kept:
        names = ", ".join(f.name for f in kept)
        raise OptionError(
            f"{url}: holds sidecar files of its images ({names}), which a folder in a bucket "
            "does not read as fields yet: copy it to a local folder, or give --fields '' to "
            "convert without them"
        )


def refuse_unreadable(src: str | Path, scan: Scan, request: ScanRequest) -> None:
    """With ``--on-error fail``, the first thing the scan could not take stops the run."""
    if scan.unreadable and request.on_error == "fail":
        first = scan.unreadable[0]
        more = f" (and {len(scan.unreadable) - 1} more)" if len(scan.unreadable) > 1 else ""
        raise ScanError(
            f"{printable(str(src))}/{first['path']}: {first['reason']}{more}; it would be "
            "left out (use --on-error skip to convert without it, recorded as skipped)"
        )


def refuse_split_folders(src: Path) -> None:
    """Refuse a SRC whose class folders would all be split names: converting ``train/`` and
    ``test/`` as two classes is never what was meant."""
    try:
        folders = find_classes(src)
    except (OSError, ScanError):
        return  # the scan reports it
    refuse_splits(str(src), folders)


def refuse_splits(src: str, folders: list[str]) -> None:
    """Refuse class folders that are all split names (see :func:`refuse_split_folders`)."""
    splits = [name for name in folders if name.lower() in SPLIT_NAMES]
    if splits and len(splits) == len(folders):
        raise ScanError(
            f"{src}: its folders ({', '.join(splits)}) are dataset splits, not classes: use "
            "--splits to convert each into DST/<split> with one shared label map, or --no-splits "
            "to convert them as classes"
        )
