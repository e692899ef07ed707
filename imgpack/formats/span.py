"""Several shard files mapped read-only one after another into one range of address space.

A raw batch spread over several shards is then one gather, as over one shard: row ``k`` is at
``base[shard] + offset`` of a single uint8 tensor, whatever shard holds it (a gather per shard
and a pass to put the rows in batch order cost more than the copy itself for small rows). The
range is reserved first (an anonymous ``PROT_NONE`` mapping: address space only, no memory),
then each file is mapped over its part of it with ``MAP_FIXED`` (each at a page boundary)
when a batch first reads it, as its own mapping would be.

Linux only (the one place ``mmap`` with a chosen address is reached here, through ``ctypes``);
elsewhere, or where mapping fails, :func:`reserve_span` returns ``None`` and readers gather shard
by shard as before. Reads stay inside each file: readers gather at offsets their checked
indexes give, never in the gaps between files.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # the same on every Linux architecture
_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or sys.maxsize < 1 << 32:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class Span:
    """A range of address space with a place for each of several files, each mapped read-only
    into its place when first needed (:meth:`place`): :attr:`data` (uint8) holds file ``k``'s
    bytes at ``bases[k]`` onwards once it is placed. Unmapped by :meth:`close` (or when
    collected): nothing may read :attr:`data` after that, so it never leaves the reader that
    made it."""

    def __init__(self, address: int, length: int, sizes: list[int], bases: np.ndarray) -> None:
        self._address, self._length, self._sizes = address, length, sizes
        self.bases = bases
        self.placed = np.zeros(len(sizes), bool)
        buffer = (ctypes.c_uint8 * length).from_address(address)
        self.data = torch.frombuffer(buffer, dtype=torch.uint8)
        self._windows: dict[int, torch.Tensor] = {}

    def place(self, number: int, fd: int) -> bool:
        """Map file ``number`` (``fd``, open for reading) into its place. ``False`` (nothing
        mapped) when it is not the size it had when the span was made."""
        if self.placed[number]:
            return True
        size = self._sizes[number]
        if not self._length or os.fstat(fd).st_size != size:
            return False
        if size:
            where = self._address + int(self.bases[number])
            flags = mmap.MAP_SHARED | _MAP_FIXED
            if _LIBC is None or _LIBC.mmap(where, size, mmap.PROT_READ, flags, fd, 0) != where:
                return False
        self.placed[number] = True
        return True

    def windows(self, width: int) -> torch.Tensor:
        """``(len - width + 1, width)``: row ``s`` is the ``width`` bytes at ``s`` (no copy)."""
        found = self._windows.get(width)
        if found is None:
            rows = max(0, self._length - width + 1)
            found = self._windows[width] = self.data.as_strided((rows, width), (1, 1))
        return found

    def gather(self, at: np.ndarray, out: torch.Tensor) -> None:
        """Row ``k`` of ``out`` (contiguous ``(n, width)`` uint8) is the ``width`` bytes at
        ``at[k]`` of the span (``bases[file] + offset``, in a placed file, each row inside
        it): one ``index_select``."""
        torch.index_select(self.windows(out.shape[1]), 0, torch.from_numpy(at), out=out)

    def close(self) -> None:
        if self._length and _LIBC is not None:
            self._windows.clear()
            _LIBC.munmap(self._address, self._length)
        self._length = 0

    def __del__(self) -> None:
        self.close()


@dataclass
class SpanSlot:
    """A reader's span in one process: reserved on first use, each file placed when a batch
    first needs it; given up (``span`` ``None`` from then on) where it cannot be had or a
    file cannot be placed, and the reader gathers shard by shard."""

    span: Span | None = None
    tried: bool = False

    def covering(
        self,
        shard_of: np.ndarray,
        paths: Callable[[], Sequence[Path]] | None,
        place: Callable[[Span, int], bool],
    ) -> Span | None:
        """The span with files ``shard_of`` placed (``place(span, k)`` maps file ``k``), or
        ``None``. ``paths()``: the files (the span is reserved for their sizes on first use);
        ``None``: no span for this reader (an output read lazily: its files come and go)."""
        if not self.tried:
            self.tried = True
            if paths is not None:
                self.span = reserve_span([os.stat(path).st_size for path in paths()])
        span = self.span
        if span is not None and not span.placed[shard_of].all():
            for number in np.unique(shard_of[~span.placed[shard_of]]).tolist():
                if not place(span, number):
                    self.close()
                    return None
        return span

    def close(self) -> None:
        if self.span is not None:
            self.span.close()
            self.span = None


def reserve_span(sizes: Sequence[int]) -> Span | None:
    """A :class:`Span` for files of ``sizes`` bytes (none mapped yet), or ``None`` where this
    platform cannot (or the address space cannot be had)."""
    if _LIBC is None or not sizes:
        return None
    rounded = [-(-size // _PAGE) * _PAGE for size in sizes]
    bases = np.cumsum([0, *rounded[:-1]], dtype=np.int64)
    length = int(sum(rounded))
    if not length:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = _LIBC.mmap(None, length, 0, flags, -1, 0)  # PROT_NONE: address space only
    if address in (None, _FAILED):
        return None
    return Span(address, length, list(sizes), bases)


__all__ = ["Span", "SpanSlot", "reserve_span"]
