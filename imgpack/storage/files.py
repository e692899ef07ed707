"""What a reader holds of an opened output's files (:class:`OutputFiles`).

An :class:`~imgpack.opening.Opened` output carries its files: :class:`LocalFiles` (a local
output, checked when opened), :class:`CachedFiles` (an output in a bucket fetched whole into the
checked cache, pinned there) or :class:`LazyFiles` (an output in a bucket whose data files are
fetched when a reader first uses them). Each reader, in each process, holds them through its
own :class:`FileHolder` (:meth:`OutputFiles.holder`): the pins that keep the cache from evicting
the files it reads, and the prefetch of the ones it reads next. The reader's release hook is a
callback: nothing here imports a reader.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from imgpack.storage.cache import EntryPin
from imgpack.storage.lazy import LazyOutput, Prefetcher, unpin

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

    def fetched_here(self, name: str) -> bool:
        """Whether this process fetched file ``name`` and checked it whole as it arrived (then
        a first read need not check its records one by one)."""
        return False

    def close(self) -> None:
        """Let go of what keeps these files in the cache (a fetched output's pin): for the
        one that opened them, once it is done reading."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"


class LocalFiles(OutputFiles):
    """A local output's files, checked when it was opened."""


class CachedFiles(OutputFiles):
    """An output in a bucket, fetched whole into the checked local cache
    (:class:`imgpack.storage.cache.OutputCache`): ``lmdb`` and ``hdf5``, one file each. Its entry
    stays pinned (no process evicts it) while these files are alive."""

    def __init__(self, root: Path, pin: EntryPin | None = None) -> None:
        super().__init__(root)
        self.pin = pin

    def close(self) -> None:
        if self.pin is not None:
            self.pin.close()


class LazyFiles(OutputFiles):
    """An output in a bucket whose data files are fetched into the cache when a reader first
    uses them (:class:`imgpack.storage.lazy.LazyOutput`): its manifest and index files are there."""

    def __init__(self, lazy: LazyOutput) -> None:
        super().__init__(lazy.root)
        self.lazy = self.output = lazy

    def holder(self, on_release: Callable[[str], None]) -> FileHolder:
        return LazyHolder(self, on_release)

    def fetched_here(self, name: str) -> bool:
        return self.output.fetched_here(name)


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

    def trim(self, keep: int | None = None) -> None:
        """Let go of the files used longest ago, beyond ``keep`` (default
        :data:`PINNED_FILES`)."""

    def release(self) -> None:
        """Let go of every file held, and of the files fetched ahead."""

    def prefetch(self, names: Sequence[str], depth: int) -> None:
        """The files to be read next, in order: the first ``depth`` fetched ahead."""

    def done(self, names: Sequence[str]) -> None:
        """Files no longer to be read by what this process hands out: what fetching them ahead
        pinned is let go."""

    def let_go(self, names: set[str]) -> None:
        """Files no later read of this epoch needs: their pins (and, with a cache limit, the
        reader's handles) are let go now, not when newer files push them out."""

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
        self.pid = os.getpid()

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

    def trim(self, keep: int | None = None) -> None:
        bounded = self.lazy.limit is not None
        while len(self.pins) > (PINNED_FILES if keep is None else keep):
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

    def done(self, names: Sequence[str]) -> None:
        if self.prefetcher is not None:
            self.prefetcher.done(names)

    def let_go(self, names: set[str]) -> None:
        bounded = self.lazy.limit is not None
        for name in [n for n in self.pins if n in names]:
            fd = self.pins.pop(name)
            if bounded:
                self.on_release(name)
            unpin(fd)

    def drop(self, _unpin: Callable[[int | None], None] | None = None) -> None:
        prefetcher, self.prefetcher = self.prefetcher, None
        if self.pid != os.getpid():  # a forked copy: the fork closed its descriptors
            self.pins.clear()
            return
        if prefetcher is not None:
            with contextlib.suppress(Exception):  # its threads stop, its pins go
                prefetcher.close()
        release = _unpin or unpin
        while self.pins:
            release(self.pins.popitem()[1])
