"""A shard-aware sampler with exact, elastic mid-epoch state, and mixing several outputs.

:class:`ShardSampler` takes the names of torch's ``DistributedSampler`` (``shuffle``, ``seed``,
``num_replicas``, ``rank``, ``drop_last``, :meth:`~ShardSampler.set_epoch`), so it drops in for
it, and adds two things:

- **Locality.** An epoch's order shuffles the output's shards (for single-file outputs,
  ``block_size`` runs of consecutive samples), then the samples within each window of
  ``window`` consecutive shards of that order: the whole dataset is shuffled, but a stretch of
  the epoch touches only ``window`` shards, so a small cache (or page cache) holds what is read.
- **State.** The epoch's *global order* depends only on the dataset, the seed and the epoch,
  never on the number of ranks or DataLoader workers. On one node, rank ``r`` of ``R`` reads
  positions ``r, r + R, ...`` of what is left of that order; on several, each step's ``R``
  positions are dealt so that a node reads its own runs of shards
  (:mod:`~imgpack.loading.partitions`). :meth:`~ShardSampler.state_dict` says how many
  positions of the order were consumed, so a run saved on 8 ranks resumes on 4 (or 3) with
  exactly the samples not yet consumed, each once. :class:`imgpack.loading.Loader` (and
  torchdata's ``StatefulDataLoader``) count what reached the training loop, not what workers
  prefetched.

Ranks get equal counts: as ``DistributedSampler`` does, the rest of an epoch is padded with its
own first samples to a multiple of ``num_replicas`` (``drop_last=False``) or cut to one
(``drop_last=True``); only those pad samples are read twice.

:class:`Mix` joins outputs into one dataset (labels kept apart or merged by class name) and
:class:`ShardSampler` draws its epochs by weights: deterministic, resumable the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from imgpack.errors import OptionError
from imgpack.formats.dataset_base import integer_index, integer_indices
from imgpack.loading.partitions import cut, deal, interleave, split_order
from imgpack.loading.partitions import ranks_per_node as node_ranks
from imgpack.loading.working_set import node_bytes, schedule
from imgpack.recipe import EpochIndices
from imgpack.units import finite_numbers, format_bytes, whole_number

#: Samples per block of a single-file output (``lmdb``, ``hdf5``), read as its "shards".
BLOCK_SIZE = 1024
#: Shards (or blocks) whose samples are shuffled together.
WINDOW = 8
STATE_VERSION = 1


def _rank_and_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None:
        num_replicas = whole_number(num_replicas, "num_replicas", 1)
    if rank is not None:
        rank = whole_number(rank, "rank")
    if num_replicas is None or rank is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if num_replicas is None:
            num_replicas = torch.distributed.get_world_size() if distributed else 1
        if rank is None:
            rank = torch.distributed.get_rank() if distributed else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise OptionError(
            f"invalid rank {rank} of num_replicas {num_replicas}: expected 0..num_replicas-1"
        )
    return rank, num_replicas


def shard_sizes(dataset: Any, block_size: int = BLOCK_SIZE) -> list[int]:
    """Samples per shard of ``dataset`` in order: an imgpack output's data files, in blocks of
    ``block_size`` for one-file outputs and datasets without a manifest."""
    manifest = getattr(dataset, "manifest", None)
    counts = [f.num_samples for f in manifest.files] if manifest is not None else []
    if len(counts) > 1 and sum(counts) == len(dataset):
        return [c for c in counts if c]
    n = len(dataset)
    return [min(block_size, n - start) for start in range(0, n, block_size)]


def shard_order(
    sizes: Sequence[int], rng: np.random.Generator | None, window: int = WINDOW
) -> np.ndarray:
    """A permutation of ``range(sum(sizes))``: shards in random order, samples shuffled within
    each window of ``window`` consecutive shards of it (``rng=None``: in order)."""
    starts = np.cumsum([0, *sizes], dtype=np.int64)
    if rng is None:
        return np.arange(starts[-1], dtype=np.int64)
    picked = rng.permutation(len(sizes))
    parts = []
    for first in range(0, len(picked), max(1, window)):
        group = picked[first : first + max(1, window)]
        block = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in group])
        parts.append(rng.permutation(block))
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _fingerprint(dataset: Any) -> str:
    """What identifies a dataset's samples for a saved state: its length and, for an imgpack
    reader, its output id (a :class:`Mix`: its parts and weights)."""
    if isinstance(dataset, Mix):
        head: Any = [dataset.counts, [_fingerprint(d) for d in dataset.datasets]]
    else:
        manifest = getattr(dataset, "manifest", None)
        head = [len(dataset), getattr(manifest, "output_id", "") or ""]
    return hashlib.sha256(json.dumps(head).encode()).hexdigest()[:16]


class ShardSampler(Sampler[int]):
    """Shard-aware, resumable ``DistributedSampler`` for imgpack readers (see the module doc).

    Args:
        dataset: a map-style reader of any format (local or from a bucket), or a :class:`Mix`.
        shuffle: shuffle each epoch (shards, then samples within windows); else scan order.
        seed: the same seed on every rank.
        num_replicas, rank: default to ``torch.distributed`` when it is initialised, else 1, 0.
        drop_last: cut the epoch to a multiple of ``num_replicas`` instead of padding it.
        window: shards shuffled together (more: closer to a full shuffle, more shards in use).
        block_size: samples per "shard" of single-file outputs (``lmdb``, ``hdf5``).
        ranks_per_node: ranks that share a node and its cache (default ``LOCAL_WORLD_SIZE``,
            which ``torchrun`` sets, else every rank: one node).
        partitions: the epoch's canonical parts, each a contiguous run of shards read by one
            node (default: the number of nodes; :mod:`~imgpack.loading.partitions`). A loaded
            state brings its own, so a run resumed on another number of nodes reads the same
            order.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        window: int = WINDOW,
        block_size: int = BLOCK_SIZE,
        ranks_per_node: int | None = None,
        partitions: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.seed = whole_number(seed, "seed")
        self.rank, self.num_replicas = _rank_and_world(num_replicas, rank)
        self.ranks_per_node = node_ranks(ranks_per_node, self.num_replicas)
        self.nodes = self.num_replicas // self.ranks_per_node
        self.partitions = (
            self.nodes if partitions is None else whole_number(partitions, "partitions", 1)
        )
        self.window = whole_number(window, "window", 1)
        self.block_size = whole_number(block_size, "block_size", 1)
        self.epoch = 0
        self._sizes = shard_sizes(dataset, self.block_size)
        self._id = _fingerprint(dataset)
        #: Samples this rank hands out before they are read (a DataLoader's workers hold
        #: batches ahead): a shard is let go that many positions after its last read
        #: (:class:`~imgpack.loading.Loader` sets it).
        self.lag = 0
        #: Positions handed out at once (a batch of :meth:`batches`; ``Loader`` sets it): shards
        #: are named and let go at batch edges.
        self.step = 1
        self.check_cache_limit()
        pin = getattr(dataset, "pin_files", None)
        if callable(pin):
            pin(self.window)  # a window's shards stay pinned while read, no more
        self._resume: tuple[int, int] | None = None  # (epoch, consumed) from a loaded state
        self._start = 0  # global positions consumed before the running iteration started
        self._yielded = 0  # samples the running iteration has yielded (this rank)

    # -- the order ---------------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's order of sample indices, the same on every rank and for any number of
        ranks and workers."""
        return self._epoch_order(epoch)[0]

    def _epoch_order(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The epoch's global order and the part of each position (``None``: one part)."""
        epoch = self.epoch if epoch is None else epoch
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        if isinstance(self.dataset, Mix):
            order = self.dataset.epoch_order(rng, self.window, self.block_size)
            if self.partitions == 1:
                return order, None
            return interleave(split_order(order, self.partitions))
        if self.partitions == 1:
            return shard_order(self._sizes, rng, self.window), None
        return interleave(cut(self._sizes, rng, self.window, self.partitions))

    def _rank_part(
        self,
        order: np.ndarray,
        start: int,
        labels: np.ndarray | None = None,
        rank: int | None = None,
    ) -> np.ndarray:
        """What rank ``rank`` (default: this sampler's) reads of ``order`` from ``start``."""
        rank = self.rank if rank is None else rank
        rest = order[start:]
        parts = labels[start:] if labels is not None else None
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif len(rest) % self.num_replicas:
            pad = self.num_replicas - len(rest) % self.num_replicas
            rest = np.concatenate([rest, np.resize(rest, pad)])
            if parts is not None:
                parts = np.concatenate([parts, np.resize(parts, pad)])
        if parts is None or self.nodes == 1:
            return rest[rank :: self.num_replicas]
        parts = parts[: len(rest)]
        rounds = (start + np.arange(len(rest), dtype=np.int64)) // self.partitions
        columns = deal(parts, rounds, rank, self.num_replicas, self.ranks_per_node, self.partitions)
        steps = np.arange(len(columns), dtype=np.int64) * self.num_replicas
        return rest[steps + columns]

    def _begin(self) -> int:
        """Global positions already consumed in this epoch: a loaded state's, else none."""
        resume = self._resume
        return resume[1] if resume is not None and resume[0] == self.epoch else 0

    def __iter__(self) -> Iterator[int]:
        indices, start = self._positions()
        return _Positions(self, indices.tolist(), start)

    def _positions(self) -> tuple[np.ndarray, int]:
        """What this rank reads of the epoch: its part of what is left of the global order,
        and the global positions consumed before it (``(indices, start)``)."""
        start = self._begin()
        order, labels = self._epoch_order()
        return self._rank_part(order, start, labels), start

    def _started(self, start: int) -> None:
        """An iteration that began at ``start`` yields its first item: a loaded state is used
        up by it, and the sampler's count is its. Not when the iteration is made: a
        ``DataLoader`` with workers makes two (``iter`` in its iterator's ``__init__`` and
        again in ``_reset``) and draws from the second only."""
        self._resume = None
        self._start, self._yielded = start, 0

    def batches(self, batch_size: int, drop_last: bool = False) -> ShardBatches:
        """This sampler as a batch sampler: ``DataLoader(ds, batch_sampler=sampler.batches(256),
        collate_fn=collate)``. The same order, state and epochs (it is this sampler's); each
        batch is one int64 array of indices instead of ``batch_size`` Python ints drawn one by
        one, which a raw batch's gather costs less than (``drop_last``: leave out a last batch
        shorter than ``batch_size``, as ``BatchSampler`` does)."""
        return ShardBatches(self, batch_size, drop_last)

    def _schedule(
        self, indices: list[int] | np.ndarray
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """For a reader that fetches ahead (an output read lazily from a bucket): at the
        position where each shard is first read, the next shards first read after it, in
        order, as many as the reader fetches ahead (its ``options.prefetch``); and at the
        position where each is read for the last time, that shard
        (:func:`~imgpack.loading.working_set.schedule`). Empty for readers without
        ``prefetch`` and for outputs read by blocks."""
        files = getattr(getattr(self.dataset, "manifest", None), "files", None)
        if not getattr(self.dataset, "fetches_ahead", False) or not len(indices):
            return {}, {}  # a local output: nothing to fetch, no work per epoch
        if files is None or len(files) != len(self._sizes) or len(files) < 2:
            return {}, {}
        ahead = int(self.dataset.options.prefetch)  # type: ignore[attr-defined]
        return schedule(self._shards_of(np.asarray(indices, np.int64)), ahead)

    def shards_read(self) -> list[int]:
        """The shards this rank reads samples of in this epoch (what is left of it, after a
        loaded state), sorted: on several nodes, the ones its node's cache fetches for it."""
        indices, _ = self._positions()
        return np.unique(self._shards_of(np.asarray(indices, np.int64))).tolist()

    def _shards_of(self, indices: np.ndarray) -> np.ndarray:
        starts = np.cumsum(self._sizes, dtype=np.int64)
        return np.searchsorted(starts, indices, side="right")

    def working_set(self, lag: int | None = None) -> int | None:
        """Bytes this sampler's node holds at once in the cache while it reads this epoch (an
        output read lazily with a cache limit; else ``None``): every shard from when a rank of
        the node names it for fetching ahead until ``lag`` (default :attr:`lag`) positions
        after its last read there, plus one shard being fetched
        (:func:`~imgpack.loading.working_set.node_bytes`)."""
        lazy = getattr(getattr(self.dataset, "opened", None), "lazy", None)
        files = getattr(getattr(self.dataset, "manifest", None), "files", None)
        if lazy is None or lazy.limit is None or not files:
            return None
        if len(files) == 1:  # one data file, read by blocks: it is fetched whole
            return int(files[0].bytes)
        if len(files) != len(self._sizes):
            return None
        order, labels = self._epoch_order()
        node = self.rank // self.ranks_per_node
        ranks = range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
        streams = [self._shards_of(self._rank_part(order, 0, labels, r)) for r in ranks]
        ahead = int(getattr(self.dataset.options, "prefetch", 0))  # type: ignore[attr-defined]
        sizes = [entry.bytes for entry in files]
        held = node_bytes(streams, sizes, ahead, self.lag if lag is None else lag, self.step)
        return min(held + max(sizes), sum(sizes))

    def check_cache_limit(self) -> None:
        """Refuse, in one line naming the minimum, a cache limit below :meth:`working_set`:
        under it the cache would pass its limit (what is being read is pinned) or evict shards
        still to be read, and fetch them twice in an epoch."""
        need = self.working_set()
        if need is None:
            return
        lazy = self.dataset.opened.lazy  # type: ignore[attr-defined]
        if lazy.limit >= need:
            return
        raise OptionError(
            f"{lazy.url}: cache_limit {format_bytes(lazy.limit)} is below what one node holds "
            f"while it reads this output with this sampler: {format_bytes(need)} (its window "
            f"of {self.window} shards, the {self.dataset.options.prefetch} fetched ahead, "  # type: ignore[attr-defined]
            f"{self.lag} samples handed out ahead of the reads, one shard being fetched); give "
            f"cache_limit >= {need}, or a smaller window= or prefetch="
        )

    @property
    def _total(self) -> int:
        """Positions in an epoch's global order (a :class:`Mix`: its samples per epoch), known
        without building the order: ``state_dict`` runs at every batch under torchdata."""
        return sum(self.dataset.counts) if isinstance(self.dataset, Mix) else sum(self._sizes)

    def __len__(self) -> int:
        """This rank's samples in a whole epoch, as ``DistributedSampler`` counts them; also
        while a loaded state resumes the epoch (which then yields only what is left): a
        training loop that counts its steps across a resume (Lightning ends the epoch at
        ``len(loader)`` batches, counting those before the checkpoint) ends it right."""
        if self.drop_last:
            return self._total // self.num_replicas
        return -(-self._total // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on (as ``DistributedSampler``).
        After :meth:`load_state_dict`, setting the saved epoch keeps its consumed count. The
        dataset is told too (a reader's random crops follow the epoch: ``ds.set_epoch``)."""
        self.epoch = int(epoch)
        told = getattr(self.dataset, "set_epoch", None)
        if callable(told):
            told(self.epoch)

    # -- state -------------------------------------------------------------------------------
    def consumed(self, samples: int | None = None) -> int:
        """Global positions of this epoch consumed once ``samples`` of this rank's (default:
        every sample this sampler has yielded) reached the training loop."""
        local = self._yielded if samples is None else samples
        return min(self._total, self._start + local * self.num_replicas)

    def state_dict(self, samples: int | None = None) -> dict[str, Any]:
        """The state to resume from: the seed, the epoch and how many positions of the epoch's
        global order were consumed (``samples``: this rank's samples handed to the training
        loop so far this epoch; default: what the sampler yielded)."""
        return {
            "imgpack_sampler": STATE_VERSION,
            "dataset": self._id,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "window": self.window,
            "block_size": self.block_size,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "consumed": self.consumed(samples),
            "partitions": self.partitions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (saved with any number of ranks and workers), or from
        a state that holds one (:func:`sampler_state`: a ``Loader``'s, a ``StatefulDataLoader``'s
        of any number of workers): the next iteration of the saved epoch yields only what was
        not consumed. A state of another dataset, seed or order is refused with
        :class:`~imgpack.errors.OptionError`."""
        state = sampler_state(state)
        mine = self.state_dict()
        for key, what in (
            ("dataset", "another dataset (its samples or output id differ)"),
            ("seed", f"another seed ({state.get('seed')!r}, this sampler has {self.seed})"),
            ("shuffle", "another shuffle setting"),
            ("window", "another window"),
            ("block_size", "another block_size"),
        ):
            if state.get(key) != mine[key]:
                raise OptionError(f"the saved loader state is of {what}; it cannot resume here")
        partitions = state.get("partitions", 1)  # a state saved before partitions: one
        if type(partitions) is not int or partitions < 1:
            raise OptionError(f"the saved loader state is damaged: partitions {partitions!r}")
        self.partitions = partitions  # the order is the saved run's, whatever the nodes now
        consumed, epoch = state.get("consumed"), state.get("epoch")
        if (
            type(consumed) is not int
            or type(epoch) is not int
            or epoch < 0
            or not 0 <= consumed <= self._total
        ):
            raise OptionError(
                f"the saved loader state is damaged: epoch {epoch!r} and consumed {consumed!r} "
                f"must be whole numbers, epoch >= 0 and consumed 0..{self._total}"
            )
        self.set_epoch(epoch)  # the dataset is told too: its random crops follow the epoch
        self._resume = (epoch, consumed)
        self._start, self._yielded = consumed, 0


def _one_image_shape(datasets: Sequence[Any]) -> None:
    """Refuse datasets whose images have different fixed shapes (a batch of a :class:`Mix`
    mixes them: ``collate`` could not stack it); readers with a ``transform`` may change the
    shape and pass."""
    shapes: dict[tuple[int, ...], int] = {}
    for number, ds in enumerate(datasets):
        shape = getattr(ds, "image_shape", None)
        if shape is not None and getattr(ds, "transform", None) is None:
            shapes.setdefault(tuple(shape), number)
    if len(shapes) > 1:
        (a, i), (b, j) = list(shapes.items())[:2]
        raise OptionError(
            f"Mix: dataset {i} gives images of {'x'.join(map(str, a))} (C x H x W) and dataset "
            f"{j} of {'x'.join(map(str, b))}; a batch could not be stacked: open them at one "
            "size (open_dataset(..., size=(H, W)))"
        )


def sampler_state(state: Any) -> dict[str, Any]:
    """The :class:`ShardSampler` state in ``state``: itself, or the one inside a
    :class:`~imgpack.loading.Loader`'s state or a torchdata ``StatefulDataLoader``'s (with or
    without workers: the state of the sampler's iteration as of the last batch it handed
    out). torchdata's own ``load_state_dict`` needs the number of workers it was saved with;
    a sampler loaded with this resumes under any number."""
    if isinstance(state, dict):
        if "imgpack_sampler" in state:
            if state["imgpack_sampler"] != STATE_VERSION:
                raise OptionError(
                    f"an imgpack sampler state of version {state['imgpack_sampler']!r}; this "
                    f"imgpack reads version {STATE_VERSION}"
                )
            return state
        if isinstance(state.get("sampler"), dict):  # Loader.state_dict()
            return sampler_state(state["sampler"])
        snapshot = state.get("_snapshot")  # StatefulDataLoader with workers
        main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else state
        if isinstance(main, dict):
            for key in ("_sampler_iter_state", "_index_sampler_state"):
                inner = main.get(key)
                if isinstance(inner, dict):
                    # batch_size= wraps the sampler in torchdata's BatchSampler
                    inner = inner.get("sampler_iter_state", inner)
                    if isinstance(inner, dict) and "imgpack_sampler" in inner:
                        return sampler_state(inner)
    raise OptionError(
        "not an imgpack sampler state: expected ShardSampler.state_dict(), Loader.state_dict() "
        "or a StatefulDataLoader's state_dict() over a ShardSampler"
    )


class _Fetching:
    """What a sampler iteration tells a reader that fetches ahead, as it hands out positions:
    the shards to fetch ahead where each shard is first read, and the shards it is done with
    :attr:`ShardSampler.lag` positions after each is last read (the reader lets their pins
    go: :meth:`~imgpack.formats.dataset_base.ImageDataset.read_past`)."""

    def __init__(self, sampler: ShardSampler, indices: list[int] | np.ndarray) -> None:
        self.dataset = sampler.dataset
        hints, lasts = sampler._schedule(indices)
        self.hints = sorted(hints.items())  # (position, shards to fetch) in position order
        self.lasts = sorted(lasts.items())  # (position, shards read there for the last time)
        self.lag = sampler.lag
        #: The shards let go so far this epoch (what each batch tells the worker reading it).
        self.finished = np.zeros(len(sampler._sizes), dtype=bool) if self.lasts else None

    def __bool__(self) -> bool:
        return bool(self.hints or self.lasts)

    def advance(self, stop: int) -> None:
        """Positions before ``stop`` are handed out."""
        while self.hints and self.hints[0][0] < stop:
            self.dataset.prefetch(self.hints.pop(0)[1])  # type: ignore[attr-defined]
        done: list[int] = []
        while self.lasts and self.lasts[0][0] < stop - self.lag:
            done += self.lasts.pop(0)[1]
        if done:
            self.dataset.read_past(done)  # type: ignore[attr-defined]
            if self.finished is not None:
                self.finished[done] = True

    def done(self) -> bytes | None:
        """The shards let go so far, as the bitmap a batch carries (``None``: nothing to
        tell)."""
        return None if self.finished is None else np.packbits(self.finished).tobytes()


class _Positions(Iterator[int]):
    """A :class:`ShardSampler` iteration: counts what it yields, and is ``Stateful`` for
    torchdata's ``StatefulDataLoader`` (which snapshots it as each batch is dispatched)."""

    def __init__(self, sampler: ShardSampler, indices: list[int], start: int) -> None:
        self.sampler, self.indices, self.at, self.start = sampler, indices, 0, start
        self.fetching = _Fetching(sampler, indices)
        self.begun = False

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if not self.begun:
            self.begun = True
            self.sampler._started(self.start)
        if self.at >= len(self.indices):
            raise StopIteration
        if self.fetching:
            self.fetching.advance(self.at + 1)
        self.at += 1
        self.sampler._yielded = self.at
        return self.indices[self.at - 1]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(self.at)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        fresh = iter(self.sampler)
        assert isinstance(fresh, _Positions)
        self.indices, self.at, self.fetching = fresh.indices, 0, fresh.fetching
        self.start, self.begun = fresh.start, False


class ShardBatches(Sampler[np.ndarray]):
    """A :class:`ShardSampler` read a batch at a time (:meth:`ShardSampler.batches`): each item
    is an int64 array of up to ``batch_size`` indices, for ``DataLoader(batch_sampler=...)``.
    Epochs (``set_epoch``) and state are the sampler's, in samples, as with the sampler itself;
    :class:`~imgpack.loading.Loader` and torchdata's ``StatefulDataLoader`` resume it alike."""

    def __init__(self, sampler: ShardSampler, batch_size: int, drop_last: bool = False) -> None:
        if int(batch_size) < 1:
            raise OptionError(f"batch_size must be 1 or more, got {batch_size!r}")
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), bool(drop_last)

    def __len__(self) -> int:
        samples = len(self.sampler)
        if self.drop_last:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        return _Batches(self, *self.sampler._positions())

    def set_epoch(self, epoch: int) -> None:
        """:meth:`ShardSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self, samples: int | None = None) -> dict[str, Any]:
        """:meth:`ShardSampler.state_dict` (``samples`` of this rank handed out so far)."""
        return self.sampler.state_dict(samples)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`ShardSampler.load_state_dict`."""
        self.sampler.load_state_dict(state)


class _Batches(Iterator[np.ndarray]):
    """A :class:`ShardBatches` iteration: slices of the rank's positions, counted in samples
    as :class:`_Positions` counts them, and ``Stateful`` the same way."""

    def __init__(self, batches: ShardBatches, indices: np.ndarray, start: int) -> None:
        self.batches, self.indices, self.at, self.start = batches, indices, 0, start
        self.epoch = batches.sampler.epoch  # carried by every batch (EpochIndices)
        self.fetching = _Fetching(batches.sampler, indices)
        self.begun = False

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        if not self.begun:
            self.begun = True
            self.batches.sampler._started(self.start)
        size, start = self.batches.batch_size, self.at
        stop = min(start + size, len(self.indices))
        if stop <= start or (self.batches.drop_last and stop - start < size):
            raise StopIteration
        sampler = self.batches.sampler
        if self.fetching:  # shards first read in this batch fetched ahead, others let go
            self.fetching.advance(stop)
        self.at = sampler._yielded = stop
        return EpochIndices(self.indices[start:stop], self.epoch, self.fetching.done())

    def state_dict(self) -> dict[str, Any]:
        return self.batches.sampler.state_dict(self.at)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.sampler.load_state_dict(state)
        fresh = iter(self.batches)
        assert isinstance(fresh, _Batches)
        self.indices, self.at, self.fetching = fresh.indices, 0, fresh.fetching
        self.start, self.begun = fresh.start, False


class Mix(Dataset[tuple[Any, Any]]):
    """Several datasets as one, drawn by weight each epoch by :class:`ShardSampler`.

    Args:
        datasets: imgpack readers (or any map-style datasets with ``classes``).
        weights: each dataset's share of an epoch (normalised); default: proportional to size.
        samples: samples per epoch (default: the datasets' total); or ``counts``:
        counts: absolute samples per epoch from each dataset (instead of weights and samples).
        labels: ``"separate"`` (default): each dataset's labels shifted past the previous
            ones' classes, ``classes`` concatenated (a ``cat`` of the first and one of the second
            stay two classes); ``"by_name"``: one label map, the sorted union of class names,
            labels remapped by name (a ``cat`` is a ``cat`` in both).

    A dataset drawn more often than it has samples repeats (a new shard-aware order for each
    pass); one drawn less is a different subset each epoch. Index ``i`` of the mix is sample
    ``i - offset`` of the dataset whose range holds it, whatever the epoch, so workers need no
    epoch. The epoch's order interleaves the datasets evenly: in every prefix of it each
    dataset's share is its weight within one sample.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset[Any]],
        weights: Sequence[float] | None = None,
        samples: int | None = None,
        counts: Sequence[int] | None = None,
        labels: str = "separate",
    ) -> None:
        if not datasets:
            raise OptionError("Mix needs at least one dataset")
        self.datasets = list(datasets)
        sizes = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        self.offsets = np.cumsum([0, *sizes], dtype=np.int64)
        if counts is not None:
            if weights is not None or samples is not None:
                raise OptionError("give counts, or weights and samples, not both")
            if isinstance(counts, str | bytes) or len(counts) != len(sizes):
                raise OptionError(f"invalid counts {counts!r}: one count per dataset")
            self.counts = [whole_number(c, "count (in counts)") for c in counts]
            if not sum(self.counts):
                raise OptionError(f"invalid counts {counts!r}: not all 0 (an epoch of nothing)")
        else:
            w = np.asarray(
                finite_numbers(weights if weights is not None else sizes, "weights"), np.float64
            )
            if len(w) != len(sizes) or w.sum() <= 0:
                raise OptionError(
                    f"invalid weights {weights!r}: one finite weight >= 0 per dataset, not all 0"
                )
            total = sum(sizes) if samples is None else whole_number(samples, "samples", 1)
            exact = w / w.sum() * total
            counts_ = np.floor(exact).astype(np.int64)
            rest = np.argsort(-(exact - counts_), kind="stable")[: total - int(counts_.sum())]
            counts_[rest] += 1  # largest remainders: the counts add up to ``total``
            self.counts = counts_.tolist()
        for size, count in zip(sizes, self.counts, strict=True):
            if count and not size:
                raise OptionError("a dataset with no samples cannot be drawn from")
        if labels not in ("separate", "by_name"):
            raise OptionError(f"invalid labels {labels!r}: expected 'separate' or 'by_name'")
        _one_image_shape(self.datasets)
        self.labels = labels
        names = [list(getattr(d, "classes", [])) for d in self.datasets]
        if labels == "by_name":
            self.classes = sorted({c for group in names for c in group})
            index = {c: i for i, c in enumerate(self.classes)}
            self._remap = [np.array([index[c] for c in g], np.int64) for g in names]
        else:
            self.classes = [c for group in names for c in group]
            shift = np.cumsum([0, *[len(g) for g in names]])[:-1]
            self._remap = [
                np.arange(len(g), dtype=np.int64) + s for g, s in zip(names, shift, strict=True)
            ]
        self.class_to_idx = (
            {c: i for i, c in enumerate(self.classes)} if labels == "by_name" else {}
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        part = int(np.searchsorted(self.offsets, index, side="right") - 1)
        if not 0 <= part < len(self.datasets):
            raise IndexError(f"index {index} is out of range for a Mix of {len(self)} samples")
        return part, index - int(self.offsets[part])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        part, local = self._locate(integer_index(index, "Mix"))
        image, label = self.datasets[part][local]
        return image, self._label(part, label)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        idx = integer_indices(indices, "Mix")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise IndexError(f"index {bad} is out of range for a Mix of {len(self)} samples")
        parts = np.searchsorted(self.offsets, idx, side="right") - 1
        out: list[Any] = [None] * len(idx)
        for part in np.unique(parts).tolist():
            rows = np.flatnonzero(parts == part)
            local = (idx[rows] - self.offsets[part]).tolist()
            ds = self.datasets[part]
            got = ds.__getitems__(local) if hasattr(ds, "__getitems__") else [ds[i] for i in local]
            for row, (image, label) in zip(rows.tolist(), got, strict=True):
                out[row] = (image, self._label(part, label))
        return out

    def _label(self, part: int, label: Any) -> Any:
        return int(self._remap[part][int(label)]) if isinstance(label, int | np.integer) else label

    def epoch_order(
        self, rng: np.random.Generator | None, window: int = WINDOW, block_size: int = BLOCK_SIZE
    ) -> np.ndarray:
        """One epoch's indices into the mix: ``counts[i]`` samples of dataset ``i`` in its
        shard-aware order (passes repeated as needed), interleaved evenly."""
        streams, keys = [], []
        for part, (ds, count) in enumerate(zip(self.datasets, self.counts, strict=True)):
            if not count:
                continue
            sizes = shard_sizes(ds, block_size)
            passes = -(-count // sum(sizes))
            drawn = np.concatenate([shard_order(sizes, rng, window) for _ in range(passes)])
            streams.append(drawn[:count] + self.offsets[part])
            jitter = rng.random(count) if rng is not None else np.full(count, 0.5)
            keys.append((np.arange(count) + jitter) / count)
        order = np.argsort(np.concatenate(keys), kind="stable")
        return np.concatenate(streams)[order]


__all__ = ["Mix", "ShardBatches", "ShardSampler", "sampler_state", "shard_order", "shard_sizes"]
