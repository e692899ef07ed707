"""What a reader holds of its output's files where it reads: the lazy cache's client.

An output read lazily from a bucket (:mod:`imgpack.storage.lazy`) has its data files fetched
when first used and pinned while a reader reads them; a sampler tells the reader which shards it
reads next (fetched ahead, :meth:`Holds.prefetch`) and which it is done with (let go,
:meth:`Holds.read_past`, :meth:`Holds.let_go`). :class:`Holds` is that client for one reader: it
knows the output's files and where each shard's samples start, and works on the holder of the
process reading (a :class:`~imgpack.storage.files.FileHolder`, kept in the reader's per-process
state), so it keeps no process state of its own and travels to DataLoader workers as it is.

A file this process fetched was checked whole against the manifest's sha256: where raw records
are checked once each, its records are marked checked at once (:meth:`Holds.local`), so the
first read of each does not check it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from imgpack.formats.checking import RecordChecks
from imgpack.opening import Opened
from imgpack.storage.files import FileHolder


class Here(Protocol):
    """What :class:`Holds` needs of a reader's per-process state."""

    files: FileHolder
    batch_depth: int
    checked_whole: set[str]


class Holds:
    """One reader's client of its output's files (``opened``): ``checks`` is its verify
    policy, ``first`` where each shard's samples start (``None``: a one-file output), ``depth``
    the files fetched ahead (``ReadOptions.prefetch``)."""

    def __init__(
        self, opened: Opened, checks: RecordChecks, first: Sequence[int] | None, depth: int
    ) -> None:
        self.opened, self.checks, self.first, self.depth = opened, checks, first, depth
        self.lazy = opened.lazy is not None
        #: Each data file's name in the manifest, by shard number, and the other way round.
        self.names = [entry.path for entry in opened.manifest.files]
        self.numbers = {name: number for number, name in enumerate(self.names)}

    @property
    def fetches_ahead(self) -> bool:
        """Whether :meth:`prefetch` does anything: an output read lazily, with a depth."""
        return self.lazy and self.depth > 0

    def local(self, here: Here, name: str, pinned: int | None) -> Path:
        """The local path of file ``name``: for an output read lazily, fetched on first use
        and pinned while the reader reads it (the last ``pinned`` files used here, and every
        file of a batch being gathered); older ones are let go, so the cache may evict them."""
        if not self.lazy:
            return self.opened.root / name
        path = here.files.hold(name)
        if not here.batch_depth:  # a batch keeps every file it touches until it is read
            here.files.trim(pinned)
        if self.checks.once and self.opened.files.fetched_here(name):
            self._checked_whole(here, name)
        return path

    def hold_batch(self, here: Here, shards: Iterable[int], pinned: int | None) -> None:
        """For an output read lazily whose raw records are checked once each (the caller
        asks only then: finding a batch's shards costs a search): the files of ``shards`` (a
        batch's) held, fetched where they are not in the cache, before the batch's records are
        checked, so that those this process just fetched are marked checked first."""
        if self.first is None:  # one file: held by the read itself
            return
        for number in shards:
            self.local(here, self.names[number], pinned)

    def _checked_whole(self, here: Here, name: str) -> None:
        """File ``name`` was fetched in this process, checked whole: its records are marked
        checked (once per file and process)."""
        if name in here.checked_whole:  # marked already (a file is held batch after batch)
            return
        here.checked_whole.add(name)
        number = self.numbers.get(name)
        marks = self.checks.marks()
        if number is None or marks is None or self.first is None:
            return
        marks[self.first[number] : self.first[number + 1]] = 1

    def _named(self, shards: Iterable[int]) -> list[str]:
        return [self.names[k] for k in shards if 0 <= k < len(self.names)]

    def read_past(self, here: Here, shards: Sequence[int]) -> None:
        """Shards the sampler has handed out for the last time this epoch: the pins that
        fetching them ahead took, and this process's own, are let go."""
        if not self.fetches_ahead:
            return
        names = self._named(shards)
        here.files.done(names)
        here.files.let_go(set(names))

    def let_go(self, here: Here, done: bytes) -> None:
        """Let go of this process's pins on the shards a batch says its sampler is done with
        (a bitmap over the output's files, ``np.packbits``)."""
        finished = np.unpackbits(np.frombuffer(done, np.uint8))[: len(self.names)]
        names = set(self._named(np.flatnonzero(finished).tolist()))
        if names:
            here.files.let_go(names)

    def prefetch(self, here: Here, shards: Sequence[int]) -> None:
        """Shards about to be read, in order: the next :attr:`depth` of them fetched in the
        background of this process (nothing for a local output)."""
        if self.fetches_ahead:
            here.files.prefetch(self._named(shards), self.depth)
