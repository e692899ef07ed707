"""Opening an output: the one route from a location to what a reader reads.

:func:`open_output` turns a location (a local folder or a URL) into an :class:`Opened`: the
folder its files are read from, its manifest (read once: one GET for a bucket), and its
:class:`OutputFiles`. A reader is built from that (``reader(opened, options)``) and never
resolves a location itself:

- a local output is put back first when a replacement of it was killed midway
  (:func:`imgpack.publishing.recover`), and its files are checked before any is mapped
  (:func:`check_files`): :class:`LocalFiles`;
- an output in a bucket is fetched whole into the checked local cache (:class:`CachedFiles`),
  or, for a reader that fetches each data file when it first reads it, opened lazily over a
  cache entry (:class:`LazyFiles`, :mod:`imgpack.lazy`), whose files are checked as they
  arrive.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpack.errors import DataError, ManifestError, OptionError
from imgpack.lazy import LIMIT_VARIABLE, LazyOutput, Prefetcher, cache_limit, unpin
from imgpack.manifest import Manifest, file_problem, read_manifest
from imgpack.publishing import recover
from imgpack.storage import EntryPin, fetch_output, is_url, local_path, read_remote_manifest
from imgpack.units import format_bytes

#: The largest raw image a reader accepts (1 GiB: an 18,000 x 18,000 RGB image).
MAX_IMAGE_BYTES = 1 << 30


#: Files a reader of a lazily read output keeps pinned per process (the cache cannot evict
#: them): the ones it used last. ShardSampler's default window reads 8 shards at a time.
PINNED_FILES = 10


class OutputFiles:
    """Where a reader finds the files of an opened output: :meth:`path` of a file by its name
    in the manifest, and :meth:`holder`, what one reader holds of them in one process."""

    #: The output read lazily from a bucket (its data files fetched when first used), else
    #: ``None``: every file is at :meth:`path` already.
    lazy: LazyOutput | None = None

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        """The local path of the output's file ``name``."""
        return self.root / name

    def holder(self, on_release: Callable[[str], None]) -> FileHolder:
        """What one reader holds of these files in this process; ``on_release(name)`` is the
        reader's hook, called when a file it held is let go (to close its handles of it)."""
        return FileHolder(self, on_release)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"


class LocalFiles(OutputFiles):
    """A local output's files, checked when it was opened."""


class CachedFiles(OutputFiles):
    """An output in a bucket, fetched whole into the checked local cache
    (:class:`imgpack.storage.OutputCache`): ``lmdb`` and ``hdf5``, one file each. Its entry
    stays pinned (no process evicts it) while these files are alive."""

    def __init__(self, root: Path, pin: EntryPin | None = None) -> None:
        super().__init__(root)
        self.pin = pin


class LazyFiles(OutputFiles):
    """An output in a bucket whose data files are fetched into the cache when a reader first
    uses them (:class:`imgpack.lazy.LazyOutput`): its manifest and index files are there."""

    def __init__(self, lazy: LazyOutput) -> None:
        super().__init__(lazy.root)
        self.lazy = self.output = lazy

    def holder(self, on_release: Callable[[str], None]) -> FileHolder:
        return LazyHolder(self, on_release)


class FileHolder:
    """What one reader holds of an output's files in one process (its own: a reader's
    ``_Process`` keeps it, and a forked or spawned process makes another). Local and cached
    files are there already: holding one is its path."""

    def __init__(self, files: OutputFiles, on_release: Callable[[str], None]) -> None:
        self.files = files
        self.on_release = on_release

    def hold(self, name: str) -> Path:
        """The local path of file ``name``, there (fetched, for a lazily read output) and kept
        there until :meth:`trim` or :meth:`release` lets it go."""
        return self.files.path(name)

    def trim(self) -> None:
        """Let go of the files used longest ago, beyond :data:`PINNED_FILES`."""

    def release(self) -> None:
        """Let go of every file held, and of the files fetched ahead."""

    def prefetch(self, names: Sequence[str], depth: int) -> None:
        """The files to be read next, in order: the first ``depth`` fetched ahead."""

    def drop(self, _unpin: Callable[[int | None], None] | None = None) -> None:
        """Close what is held without the reader's hook (the reader is going: a fork's copy,
        or garbage; ``_unpin`` bound early by a finalizer at interpreter exit)."""


class LazyHolder(FileHolder):
    """A reader's pins on the files of a lazily read output, in one process: the last
    :data:`PINNED_FILES` files it used (and every file of a batch being gathered: the reader
    calls :meth:`trim` between batches), each a shared lock that keeps the cache from evicting
    it. With a cache limit a file let go is closed by the reader's hook too, so that its
    space can come back; without one the reader keeps it open and mapped, as a local output's
    (no re-opening every epoch; a file evicted meanwhile is read from the open copy, which was
    checked)."""

    def __init__(self, files: LazyFiles, on_release: Callable[[str], None]) -> None:
        super().__init__(files, on_release)
        self.lazy: LazyOutput = files.output
        self.pins: OrderedDict[str, int | None] = OrderedDict()
        self.prefetcher: Prefetcher | None = None

    def hold(self, name: str) -> Path:
        if name in self.pins:
            self.pins.move_to_end(name)
            return self.files.path(name)
        fd = self.lazy.pin(name)  # before the fetch: nothing evicts it in between
        try:
            path = self.lazy.file(name)
        except BaseException:
            unpin(fd)
            raise
        self.pins[name] = fd
        if self.prefetcher is not None:
            self.prefetcher.taken(name)
        return path

    def trim(self) -> None:
        bounded = self.lazy.limit is not None
        while len(self.pins) > PINNED_FILES:
            old, fd = self.pins.popitem(last=False)
            if bounded:
                self.on_release(old)
            unpin(fd)

    def release(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        while self.pins:
            name, fd = self.pins.popitem(last=False)
            self.on_release(name)
            unpin(fd)

    def prefetch(self, names: Sequence[str], depth: int) -> None:
        if depth <= 0:
            return
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(self.lazy, depth)
        self.prefetcher.want(list(names))

    def drop(self, _unpin: Callable[[int | None], None] | None = None) -> None:
        release = _unpin or unpin
        while self.pins:
            release(self.pins.popitem()[1])


@dataclass(frozen=True)
class Opened:
    """An output, opened: the local folder its files are read from, its manifest, and its
    files; ``location`` is what was given (a URL names the output in messages)."""

    root: Path
    manifest: Manifest
    files: OutputFiles
    location: str

    @property
    def lazy(self) -> LazyOutput | None:
        return self.files.lazy


def open_output(
    location: str | os.PathLike[str] | Opened,
    options: Any = None,
    lazy: bool | Callable[[Manifest], bool] = False,
) -> Opened:
    """Open the output at ``location`` (an :class:`Opened` is returned as it is): its manifest
    read once, its files checked (a lazily read output's as they are fetched).

    ``options``: a :class:`~imgpack.formats.dataset_base.ReadOptions` (read here by name, for
    its storage options, cache folder and limit: an output fetched whole is refused in one
    line, before anything is fetched, when it is larger than the limit). ``lazy``: whether a
    bucket's output is read lazily (its reader fetches each data file when it first reads it)
    rather than fetched whole, or a function of its manifest that says so (the reader its
    format names).
    """
    if isinstance(location, Opened):
        return location
    storage_options = getattr(options, "storage_options", None)
    cache_dir = getattr(options, "cache_dir", None)
    limit = getattr(options, "cache_limit", None)
    if is_url(location):
        url = str(location).rstrip("/")
        remote = read_remote_manifest(url, storage_options)  # the one GET of the manifest
        manifest = remote[0]
        if lazy(manifest) if callable(lazy) else lazy:
            output = LazyOutput(url, storage_options, cache_dir, limit, remote=remote)
            check_files(output.root, manifest, present=False)
            return Opened(output.root, manifest, LazyFiles(output), url)
        bound = cache_limit(limit)
        if bound is not None and manifest.total_bytes > bound:  # refused before any fetch
            raise OptionError(
                f"{url}: a {manifest.format} output is fetched whole "
                f"({format_bytes(manifest.total_bytes)}), more than the cache limit of "
                f"{format_bytes(bound)}: raise the limit (cache_limit, --cache-limit, "
                f"{LIMIT_VARIABLE}) to at least that, or convert it to a sharded format "
                "(pt, tfrecord, webdataset), whose shards are fetched as they are read"
            )
        root, pin = fetch_output(url, storage_options, cache_dir, remote=remote)
        check_files(root, manifest)
        return Opened(root, manifest, CachedFiles(root, pin), url)
    root = local_path(location)
    recover(root)  # a replacement killed midway: the previous output put back first
    manifest = read_manifest(root)
    check_files(root, manifest)
    return Opened(root, manifest, LocalFiles(root), str(location))


def check_files(root: Path, manifest: Manifest, present: bool = True) -> None:
    """Check the files an output's manifest lists before any is opened or mapped: regular files
    (never a FIFO or a device) of exactly the recorded size, and per-file sample counts adding up
    to ``num_samples``. (Reading the manifest already refused names that are not plain names
    inside the output.) ``present=False``: the files are not there yet (a lazily read output,
    whose files are checked against their size and sha256 as they are fetched): counts only."""
    total = 0
    image_bytes = _raw_image_bytes(manifest)
    for entry in manifest.files:
        problem = file_problem(root, entry) if present else None
        if problem is not None:
            raise DataError(
                f"{root / entry.path}: {problem} (the output is damaged or incomplete; "
                "imgpack verify tells more)"
            )
        # Every sample takes at least a byte of its file, a raw one its pixels: counts and shapes
        # the files cannot hold are refused before any reader sizes an array by them.
        if entry.num_samples > entry.bytes or entry.num_samples * image_bytes > entry.bytes:
            raise ManifestError(
                f"{root / entry.path}: {entry.bytes} bytes cannot hold {entry.num_samples} "
                f"samples{' of ' + str(image_bytes) + ' bytes each' if image_bytes else ''} "
                "(the manifest is damaged)"
            )
        total += entry.num_samples
    if total != manifest.num_samples:
        raise ManifestError(
            f"{root}: the files hold {total} samples, the manifest says {manifest.num_samples}"
        )


def _raw_image_bytes(manifest: Manifest) -> int:
    """Bytes of one raw image the files must hold for each sample (0: encoded, or compressed)."""
    image = manifest.image
    if manifest.encoding != "raw" or not image.get("height") or not image.get("width"):
        return 0
    size = int(image["height"]) * int(image["width"]) * int(image.get("channels", 3))
    if size > MAX_IMAGE_BYTES:
        raise ManifestError(f"a raw image of {size} bytes is more than imgpack reads (1 GiB)")
    compressed = manifest.options.get("compression", "none") not in ("none", None)
    return 0 if compressed else size
