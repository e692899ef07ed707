"""The SIGBUS guard: files a reader memory-mapped in one process, checked before each read.

A memory-mapped file cut in place (truncated) while it is read is not an error but a SIGBUS
that kills the process at the first byte past its new end. :class:`MappedFiles` keeps, per
shard a reader mapped in this process, a descriptor of the file (it names the file mapped, even
if another is renamed over the path) and its size then; a read refuses, in one line, a batch
that touches a file that shrank since (its size asked once per mapped shard the batch touches),
and a file already shorter than the manifest says when it is mapped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from imgpack.errors import DataError

#: Up to this many files mapped, a read checks every one of them.
FEW = 4


class MappedFiles:
    """The files one reader memory-mapped in one process, by shard number (0 for one-file
    outputs). ``recorded``: the size the manifest records for each file, by name; ``root``: the
    output, named in messages."""

    def __init__(self, recorded: dict[str, int], root: Path) -> None:
        self.recorded = recorded
        self.root = root
        self._maps: dict[int, tuple[str, int, int]] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def note(self, number: int, path: str | os.PathLike[str]) -> None:
        """Shard ``number``'s file at ``path`` is memory-mapped now: a descriptor of it is kept
        with its size (refused when the file is shorter than the manifest says)."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        self.forget(number)
        size = os.fstat(fd).st_size
        recorded = self.recorded.get(Path(path).name)
        if recorded is not None and size < recorded:  # cut since the output was opened
            os.close(fd)
            raise DataError(
                f"{path}: {size:,} bytes now, {recorded:,} in the manifest: the file was cut "
                "while it was read (reading it would crash the process with SIGBUS); open the "
                f"output again ('imgpack verify {self.root}' names what is damaged)"
            )
        self._maps[number] = (str(path), fd, size)

    def check(self, touched: Callable[[], Iterable[int]]) -> None:
        """Refuse a read of the shards ``touched()`` gives (asked only when more than one file
        is mapped) if one of their files shrank since it was mapped. A file renamed over the
        path is not the mapped one: the mapping still holds the old file whole, and so does
        the descriptor."""
        if not self._maps:
            return  # nothing mapped in this process yet
        # A few files: each checked rather than the batch's shards found. The size is asked
        # by seeking the guard's own descriptor to the end (~0.25 µs; an fstat ~0.9 µs, most
        # of it building its result): nothing reads through that descriptor.
        if len(self._maps) <= FEW:
            entries = list(self._maps.values())
        else:
            entries = [self._maps[n] for n in touched() if n in self._maps]
        for path, fd, size in entries:
            now = os.lseek(fd, 0, os.SEEK_END)
            if now < size:
                raise DataError(
                    f"{path}: {now:,} bytes now, {size:,} when this process mapped it: the file "
                    "was cut while it was read (reading on would crash the process with "
                    f"SIGBUS); open the output again ('imgpack verify {self.root}' names what "
                    "is damaged)"
                )

    def forget(self, number: int, _close: Callable[[int], None] = os.close) -> None:
        """Shard ``number`` is no longer mapped here (its file let go)."""
        found = self._maps.pop(number, None)
        if found is not None:
            _close(found[1])

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        """Close every descriptor kept (``_close`` bound early: called at interpreter exit)."""
        while self._maps:
            _, fd, _ = self._maps.popitem()[1]
            try:  # noqa: SIM105 (``contextlib`` may be gone at interpreter exit)
                _close(fd)
            except Exception:
                pass
