"""What a node holds in its cache while it reads an output lazily from a bucket, from the
sampler's order.

A rank's stream of positions reads each shard from its first position to its last. The shard
is named for fetching ahead (:func:`schedule`'s hints) ``ahead`` shards before it is first read
(in the order shards are first read), and pinned in the cache from then until the stream has
handed out its last position plus ``lag`` more (the samples handed to DataLoader workers and
not read yet: :class:`~imgpack.loading.Loader` knows them). A node's ranks read in lockstep, so
a node holds, at each step, every shard live for one of its ranks: :func:`node_bytes` is the
most it holds at once, the least cache limit under which no shard is evicted while it is
still to be read (and none fetched twice in an epoch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_reads(shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shards of a stream (each position's shard) in the order they are first read, and
    the position of each first read."""
    found, positions = np.unique(shards, return_index=True)
    order = np.argsort(positions, kind="stable")
    return found[order], positions[order]


def last_reads(shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each shard of a stream and the position where it is read for the last time."""
    found, from_end = np.unique(shards[::-1], return_index=True)
    return found, len(shards) - 1 - from_end


def schedule(shards: np.ndarray, ahead: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """For a stream's shards: at the position where each shard is first read, the next
    ``ahead`` shards first read after it (to fetch ahead); and at each position where shards
    are read for the last time, those shards (to let go)."""
    sequence, at = first_reads(shards)
    names, positions = sequence.tolist(), at.tolist()
    hints = {positions[i]: names[i + 1 : i + 1 + ahead] for i in range(len(positions))}
    lasts: dict[int, list[int]] = {}
    for shard, position in zip(*last_reads(shards), strict=True):
        lasts.setdefault(int(position), []).append(int(shard))
    return hints, lasts


def live_intervals(
    shards: np.ndarray, ahead: int, lag: int, step: int = 1
) -> dict[int, tuple[int, int]]:
    """Each shard of a stream and the steps ``[start, stop)`` it is held: from when it is named
    (the first read of the shard ``ahead`` places before it; its own first read for the first
    ``ahead + 1``) to ``lag`` steps after its last read, both at the edges of the batches of
    ``step`` positions the sampler hands out (it names and lets go a batch at a time)."""
    sequence, at = first_reads(shards)
    named = at[np.maximum(np.arange(len(at)) - ahead, 0)] // step * step
    lasts = dict(zip(*(v.tolist() for v in last_reads(shards)), strict=True))
    return {
        int(shard): (int(start), -(-(int(lasts[int(shard)]) + lag + 1) // step) * step)
        for shard, start in zip(sequence.tolist(), named.tolist(), strict=True)
    }


def node_bytes(
    streams: Sequence[np.ndarray], shard_bytes: Sequence[int], ahead: int, lag: int, step: int = 1
) -> int:
    """The most bytes a node holds at once while its ranks read ``streams`` (each rank's
    shards, position by position, in lockstep): each shard from the earliest step a rank names
    it to the latest step a rank lets it go."""
    held: dict[int, tuple[int, int]] = {}
    for stream in streams:
        for shard, (start, stop) in live_intervals(stream, ahead, lag, step).items():
            low, high = held.get(shard, (start, stop))
            held[shard] = (min(low, start), max(high, stop))
    if not held:
        return 0
    steps = max(stop for _, stop in held.values()) + 1
    change = np.zeros(steps + 1, dtype=np.int64)
    for shard, (start, stop) in held.items():
        change[start] += shard_bytes[shard]
        change[stop] -= shard_bytes[shard]
    return int(np.cumsum(change).max())
