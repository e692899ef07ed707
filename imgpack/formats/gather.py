"""Gathering rows of bytes into a batch, the readers' fast path: whole rows of a contiguous
array (:func:`take_rows`), or windows at any offsets of a file's bytes (:func:`take_windows`,
:func:`byte_rows`), with torch's ``index_select`` where it may run (:func:`torch_may_gather`: not
in a process forked with several threads) and numpy's fancy indexing, a memcpy a row, elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from imgpack.tensors import readonly_tensor as readonly_tensor  # re-exported for the readers
from imgpack.tensors import torch_may_run


def void_rows(data: np.ndarray) -> np.ndarray:
    """A C-contiguous array of ``n`` rows (``(n, width)`` uint8, or ``(n, H, W, C)``) as ``n``
    items of one row's bytes each: numpy's fancy indexing then copies a row with one memcpy
    (it copies a uint8 row element by element), ~0.4 µs a 3 KB row, gathering or placing."""
    flat = data.reshape(len(data), -1)
    return flat.view(np.dtype((np.void, flat.shape[1]))).reshape(len(data))


def shard_runs(shard_of: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """A batch's positions grouped by the shard holding each (``shard_of``): ``order`` (the
    positions sorted by shard, in batch order within one) and ``(shard, start, stop)`` of each
    shard's run in it. A reader gathers each run with one call into a contiguous slice, then
    puts the rows in batch order with one assignment, whatever the number of shards."""
    order = np.argsort(shard_of, kind="stable")
    ordered = shard_of[order]
    cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
    starts, stops = [0, *cuts], [*cuts, len(ordered)]
    numbers = ordered[starts].tolist() if len(ordered) else []
    return order, list(zip(numbers, starts, stops, strict=True))


def row_windows(data: Any, width: int) -> np.ndarray:
    """The bytes of ``data`` (a buffer: a memory map, bytes, a 1-D uint8 array) as a read-only
    array of ``len - width + 1`` items of ``width`` bytes: item ``s`` is the ``width`` bytes at
    offset ``s`` (no copy; numpy's fancy indexing of it gathers rows at any offsets, a memcpy
    each)."""
    size = len(data) if not isinstance(data, np.ndarray) else data.nbytes
    count = max(0, size - width + 1)
    return np.ndarray((count,), np.dtype((np.void, width)), buffer=data, strides=(1,))


def torch_may_gather() -> bool:
    """Whether a gather may use torch's ``index_select`` here: it runs on torch's intra-op
    threads (OpenMP), and GNU OpenMP's pool does not survive ``fork()``: a forked child that
    enters it after its parent did waits forever. So torch gathers in a process that was not
    forked (its pool is its own) or that runs torch on one thread (DataLoader workers: no
    OpenMP region is entered); elsewhere (a process forked with several threads) numpy
    copies the rows, single-threaded, at about half the speed (:mod:`imgpack.tensors`)."""
    return torch_may_run()


#: Gathers of fewer bytes than this copy their rows with numpy even where torch may gather:
#: waking torch's intra-op threads costs more than it saves on a few rows (measured with two
#: threads: 32 rows of 3 KB in 53 µs by ``index_select``, 23 µs by numpy; even at 128).
TORCH_GATHER_BYTES = 384 * 1024


def _torch_gathers(rows: int, width: int) -> bool:
    """Whether a gather of ``rows`` rows of ``width`` bytes goes through torch (else numpy)."""
    return rows * width >= TORCH_GATHER_BYTES and torch_may_gather()


def take_rows(
    rows: np.ndarray | torch.Tensor, index: np.ndarray, out: np.ndarray | torch.Tensor
) -> None:
    """``out[k] = rows[index[k]]`` for whole rows (a contiguous array whose first axis is the
    row; ``out`` contiguous, of the rows' shape): torch's ``index_select`` where
    :func:`torch_may_gather` and the gather is large (:data:`TORCH_GATHER_BYTES`), else
    numpy's fancy indexing (a memcpy a row)."""
    target = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
    if _torch_gathers(len(index), target.numel() // max(1, len(index)) * target.element_size()):
        source = rows if isinstance(rows, torch.Tensor) else readonly_tensor(rows)
        flat = source.reshape(len(source), -1)
        torch.index_select(flat, 0, torch.from_numpy(index), out=target.view(len(index), -1))
        return
    array = rows.numpy() if isinstance(rows, torch.Tensor) else rows
    void_rows(target.numpy())[:] = void_rows(array)[index]


def take_windows(
    data: np.ndarray | torch.Tensor, width: int, starts: np.ndarray, out: np.ndarray | torch.Tensor
) -> None:
    """Row ``k`` of ``out`` (contiguous ``(n, width)`` uint8) is ``data[starts[k] : starts[k] +
    width]`` (``data``: 1-D uint8, each row inside it): one gather over a sliding-window view
    (:meth:`Windows.take`, its views made for this one gather)."""
    source = data if isinstance(data, torch.Tensor) else readonly_tensor(data)
    target = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
    Windows(source, width).take(starts, target.view(-1, width))


class Windows:
    """The bytes of a file (``data``: a 1-D uint8 tensor, over its memory map) as rows of
    ``width`` bytes at any offset (no copy): a reader keeps one per shard and row width, and
    gathers a batch with :meth:`take`; each view is made on first use, once."""

    def __init__(self, data: torch.Tensor, width: int) -> None:
        self.data, self.width = data, width

    @functools.cached_property
    def rows(self) -> np.ndarray:
        """Item ``s`` is the ``width`` bytes at offset ``s`` (numpy's fancy indexing of it
        gathers rows at any offsets, a memcpy each)."""
        return row_windows(self.data.numpy(), self.width)

    @functools.cached_property
    def _tensor(self) -> torch.Tensor:
        """Row ``s`` is the ``width`` bytes at offset ``s`` (for ``index_select``)."""
        count = max(0, len(self.data) - self.width + 1)
        return self.data.as_strided((count, self.width), (1, 1))

    def take(self, starts: np.ndarray, out: torch.Tensor) -> None:
        """Row ``k`` of ``out`` (contiguous ``(n, width)`` uint8) is the ``width`` bytes at
        offset ``starts[k]`` (each inside the data): one gather, torch's or numpy's as
        :func:`take_rows` chooses."""
        if _torch_gathers(len(starts), self.width):
            torch.index_select(self._tensor, 0, torch.from_numpy(starts), out=out)
            return
        void_rows(out.numpy())[:] = self.rows[starts]


def byte_rows(data: torch.Tensor | np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """``(len(start), width)`` uint8: ``data[s : s + width]`` (``data``: 1-D uint8) for each
    ``s`` of ``start``, in one gather (:func:`take_windows`), a start past ``len(data) - width``
    moved back to it. ``data`` holds at least ``width`` bytes."""
    last = len(data) - width
    out = np.empty((len(start), width), np.uint8)
    take_windows(data, width, np.minimum(np.maximum(start, 0), last), out)
    return out


class Spread:
    """Where each sample's bytes lie in a sharded output whose samples are at fixed offsets
    (``shard_of``, ``starts``: one entry per sample), laid out once per reader for batches
    spread over its shards: most shuffled batches of an output with one large shard (a
    webdataset output's 256 MB first tar beside a short last one) hold a majority of rows
    there. :meth:`gather` then takes the whole batch from that shard with one gather, the
    others' rows standing in by one of its own, and copies the others' rows over them: the
    lookups made here once instead of each batch (a batch's shards, counts and stand-ins cost
    as much as its rows from the short shard, measured in a ``Loader`` epoch)."""

    def __init__(self, shard_of: np.ndarray, starts: np.ndarray, skip: int = 0) -> None:
        """``shard_of[i]`` is the shard holding sample ``i`` (the smallest integer type that
        holds the shard numbers keeps it), and its bytes start ``skip`` bytes past
        ``starts[i]`` (int64; kept as given, not copied: a reader's own offsets)."""
        self.shard_of = shard_of.astype(np.min_scalar_type(max(0, int(shard_of.max(initial=0)))))
        self.starts, self.skip = starts, skip
        self.main = int(np.bincount(shard_of).argmax()) if len(shard_of) else 0
        inside = shard_of == self.main
        stand_in = starts[int(inside.argmax())] if len(shard_of) else 0
        #: Each sample's start in the main shard, or the stand-in's for one elsewhere.
        self.main_starts = np.where(inside, starts, stand_in) + skip
        #: Whether each sample is elsewhere (``None``: every sample is in the main shard).
        self.away: np.ndarray | None = None if inside.all() else ~inside
        held = np.unique(shard_of)
        #: The one other shard holding samples (a two-shard output's), else ``None``.
        self.other = int(held[held != self.main][0]) if len(held) == 2 else None

    def gather(
        self,
        indices: np.ndarray,
        out: torch.Tensor,
        windows: Callable[[int, int], Windows],
        spread: Callable[[np.ndarray, np.ndarray, torch.Tensor], None],
    ) -> None:
        """Row ``k`` of ``out`` (contiguous ``(n, width)`` uint8) is the ``width`` bytes at
        sample ``indices[k]``'s start: ``windows(number, width)`` gives a shard's
        :class:`Windows`; a batch with most rows outside the main shard goes to
        ``spread(shard_of, starts, out)``, which gathers any mix."""
        width = out.shape[1]
        if self.away is None:
            windows(self.main, width).take(self.main_starts[indices], out)
            return
        others = np.flatnonzero(self.away[indices])
        if 2 * len(others) > len(indices):
            spread(self.shard_of[indices], self.starts[indices] + self.skip, out)
            return
        windows(self.main, width).take(self.main_starts[indices], out)
        if not len(others):
            return
        picked = indices[others]
        found, target = self.starts[picked] + self.skip, void_rows(out.numpy())
        if self.other is not None:
            target[others] = windows(self.other, width).rows[found]
            return
        order, runs = shard_runs(self.shard_of[picked])
        for number, start, stop in runs:
            chosen = order[start:stop]
            target[others[chosen]] = windows(number, width).rows[found[chosen]]
