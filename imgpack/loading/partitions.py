"""Node partitions of an epoch: each node reads its own contiguous run of shards.

A :class:`~imgpack.loading.ShardSampler` on several nodes cuts each epoch into ``partitions``
canonical parts (by default one per node), each a contiguous run of the epoch's shuffled shards
(a shard on a cut is split between its two parts at a sample), shuffled within windows as a
one-node epoch is. The epoch's global order takes one sample of each part in turn (part ``p``
holds positions ``p, p + P, p + 2P, ...``): a pure function of the dataset, the seed, the epoch
and ``P``, whatever the number of nodes, ranks or workers reading it, so a saved state (how many
positions of that order were consumed, and ``P``) resumes exactly on any of them.

Each step of training consumes the next ``R`` positions (``R`` ranks, one sample each).
:func:`deal` gives each rank one of them, preferring one in a part of its own node: node ``n``
of ``N`` owns parts ``p`` with ``p % N == n`` (with more nodes than parts, each part's positions
go round the nodes that share it). When ``N`` divides ``P`` (the default: ``P = N``), any ``R``
consecutive positions hold ``R / N`` of each node's parts, so every position of a step falls in
a part of the node that reads it: a node reads only its own shards, once an epoch (a shard on a
cut is read by the two nodes whose parts share it). Otherwise (a resume on a number of nodes
that does not divide ``P``) the positions left over go to the ranks still without one: exact
all the same, with some reads of other nodes' shards. A run that may resume on 1, 2, 3, 4 or 6
nodes keeps its locality on all of them with ``partitions=12``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from imgpack.errors import OptionError
from imgpack.units import whole_number


def ranks_per_node(given: int | None, num_replicas: int) -> int:
    """Ranks that share a node (and its cache): ``given``, else ``LOCAL_WORLD_SIZE`` (set by
    ``torchrun`` and Lightning), else all of them (one node). It must divide
    ``num_replicas``."""
    source = "ranks_per_node"
    if given is None:
        found = os.environ.get("LOCAL_WORLD_SIZE")
        if not found:
            return num_replicas
        source = "LOCAL_WORLD_SIZE"
        try:
            given = int(found)
        except ValueError:
            raise OptionError(f"invalid LOCAL_WORLD_SIZE {found!r}: expected a number") from None
    count = whole_number(given, source, 1)
    if num_replicas % count:
        raise OptionError(
            f"{source} {count} does not divide num_replicas {num_replicas}: every node must "
            "run the same number of ranks"
        )
    return count


def cut(
    sizes: Sequence[int],
    rng: np.random.Generator | None,
    window: int,
    partitions: int,
) -> list[np.ndarray]:
    """An epoch of shards of ``sizes`` cut into ``partitions`` parts (lengths within one of each
    other): the shards in random order (``rng=None``: in order), that sequence of samples cut
    into contiguous runs, then each part's samples shuffled within windows of ``window``
    consecutive shards (or pieces of one) of it."""
    starts = np.cumsum([0, *sizes], dtype=np.int64)
    total = int(starts[-1])
    picked = rng.permutation(len(sizes)) if rng is not None else np.arange(len(sizes))
    ends = np.cumsum([sizes[s] for s in picked], dtype=np.int64)
    bounds = [total * k // partitions for k in range(partitions + 1)]
    parts: list[np.ndarray] = []
    for part in range(partitions):
        low, high = bounds[part], bounds[part + 1]
        # the shards of the picked sequence that overlap [low, high), each as its samples there
        first = int(np.searchsorted(ends, low, side="right"))
        pieces = []
        at = low
        for k in range(first, len(picked)):
            if at >= high:
                break
            shard = int(picked[k])
            begin = int(ends[k]) - sizes[shard]  # where this shard starts in the sequence
            stop = min(high, int(ends[k]))
            offset = int(starts[shard])
            pieces.append(np.arange(offset + at - begin, offset + stop - begin, dtype=np.int64))
            at = stop
        if rng is None:
            parts.append(np.concatenate(pieces) if pieces else np.empty(0, np.int64))
            continue
        shuffled = [
            rng.permutation(np.concatenate(pieces[k : k + window]))
            for k in range(0, len(pieces), window)
        ]
        parts.append(np.concatenate(shuffled) if shuffled else np.empty(0, np.int64))
    return parts


def interleave(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One order of ``parts`` (lengths within one of each other), one sample of each in turn,
    and the part of each position."""
    count = len(parts)
    longest = max((len(p) for p in parts), default=0)
    table = np.full((longest, count), -1, dtype=np.int64)
    labels = np.broadcast_to(np.arange(count, dtype=np.int64), (longest, count))
    for k, part in enumerate(parts):
        table[: len(part), k] = part
    kept = table.ravel() >= 0
    return table.ravel()[kept], labels.ravel()[kept]


def split_order(order: np.ndarray, partitions: int) -> list[np.ndarray]:
    """An already made order cut into ``partitions`` contiguous parts (a :class:`Mix`'s)."""
    total = len(order)
    bounds = [total * k // partitions for k in range(partitions + 1)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(partitions)]


def deal(
    labels: np.ndarray,
    rounds: np.ndarray,
    rank: int,
    num_replicas: int,
    per_node: int,
    partitions: int,
) -> np.ndarray:
    """Which of each step's ``num_replicas`` positions rank ``rank`` reads: ``labels`` (the part
    of each position still to read, a multiple of ``num_replicas`` long) and ``rounds`` (each
    position's turn in the global order, ``position // partitions``) in; the column of each
    step (row) this rank takes out. Each rank of node ``n`` takes a position of one of ``n``'s
    parts while the step has one; the positions left take the ranks left, in order."""
    width = num_replicas
    rows = len(labels) // width
    nodes = num_replicas // per_node
    if nodes == 1:
        return np.full(rows, rank, dtype=np.int64)  # one node: the ranks interleave
    if nodes <= partitions:
        owner = labels % nodes
    else:  # more nodes than parts: each part's positions go round the nodes that share it
        sharing = np.bincount(np.arange(nodes) % partitions, minlength=partitions)
        owner = labels + partitions * (rounds % sharing[labels])
    owner = owner.reshape(rows, width)
    by_owner = np.argsort(owner, axis=1, kind="stable")  # columns grouped by node
    grouped = np.take_along_axis(owner, by_owner, axis=1)
    flat = (np.arange(rows, dtype=np.int64)[:, None] * nodes + owner).ravel()
    counts = np.bincount(flat, minlength=rows * nodes).reshape(rows, nodes)
    before = np.cumsum(counts, axis=1) - counts  # where each node's run starts in a row
    within = np.arange(width)[None, :] - np.take_along_axis(before, grouped, axis=1)
    taker = np.where(within < per_node, grouped * per_node + within, -1)
    columns = np.full((rows, width), -1, dtype=np.int64)
    row_of = np.repeat(np.arange(rows), width).reshape(rows, width)
    kept = taker >= 0
    columns[row_of[kept], taker[kept]] = by_owner[kept]
    if (~kept).any():  # positions beyond a node's ranks go to the ranks without one, in order
        left_rows, left_at = np.nonzero(~kept)
        left_columns = by_owner[left_rows, left_at]
        idle_rows, idle_ranks = np.nonzero(columns < 0)
        columns[idle_rows, idle_ranks] = left_columns  # both in row order, equal per row
    return columns[:, rank]
