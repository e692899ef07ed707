"""Node partitions (``ShardSampler(ranks_per_node=..., partitions=...)``): each node reads its own
runs of shards, every sample once an epoch across all ranks, and a state resumes exactly on
any number of nodes, ranks and workers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.errors import OptionError
from imgpack.loading import Loader, ShardSampler
from imgpack.loading.sampler import shard_order
from imgpack.readers import collate

COUNT = 403  # not a multiple of anything below: the pads and the cuts are exercised


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pt output of ~40 shards of uneven sizes, labelled by class."""
    base = tmp_path_factory.mktemp("nodes")
    src = build_uniform_folder(base / "src", count=COUNT, classes=7, size=6)
    out = base / "out"
    convert(src, out, "pt", encoding="raw", size=6, progress=False, shard_size=1200)
    return out


def _shard_of(ds: Any) -> np.ndarray:
    starts = np.cumsum([0, *[f.num_samples for f in ds.manifest.files]])
    return lambda indices: np.searchsorted(starts, np.asarray(indices), side="right") - 1  # type: ignore[return-value]


def _ranks(ds: Any, nodes: int, per_node: int, **options: Any) -> list[ShardSampler]:
    world = nodes * per_node
    return [
        ShardSampler(ds, seed=5, num_replicas=world, rank=r, ranks_per_node=per_node, **options)
        for r in range(world)
    ]


def test_each_node_reads_its_own_shards_every_sample_once(output: Path) -> None:
    ds = open_dataset(output)
    shards = len(ds.manifest.files)
    assert shards >= 30
    shard_of = _shard_of(ds)
    for nodes, per_node in ((2, 2), (3, 1), (4, 2)):
        samplers = _ranks(ds, nodes, per_node)
        assert all(s.partitions == nodes for s in samplers)  # the default: one part per node
        parts = [list(s) for s in samplers]
        assert len({len(p) for p in parts}) == 1  # equal counts, as DistributedSampler's
        seen = Counter(i for p in parts for i in p)
        assert set(seen) == set(range(COUNT))
        assert sum(seen.values()) - COUNT == (-COUNT) % (nodes * per_node)  # only the pad
        by_node = [
            set(shard_of([i for r in range(per_node) for i in parts[n * per_node + r]]).tolist())
            for n in range(nodes)
        ]
        shared = sum(len(s) for s in by_node) - shards
        assert shared <= nodes - 1 + 1, (nodes, shared)  # a shard on each cut (and a pad)
        for r, sampler in enumerate(samplers):  # what each rank says it reads
            assert sampler.shards_read() == sorted(set(shard_of(parts[r]).tolist()))
        for n in range(nodes):  # a node's samples: its share, within a pad
            mine = sum(len(parts[n * per_node + r]) for r in range(per_node))
            assert abs(mine - COUNT / nodes) <= per_node


def test_the_ranks_of_one_node_interleave_as_before(output: Path) -> None:
    """One node (the default without LOCAL_WORLD_SIZE): the order and the deal are exactly
    the ones of a sampler without partitions, so saved states and runs are unchanged."""
    ds = open_dataset(output)
    sizes = [f.num_samples for f in ds.manifest.files]
    one = ShardSampler(ds, seed=5, num_replicas=3, rank=1)
    assert one.partitions == 1 and one.nodes == 1
    order = shard_order(sizes, np.random.default_rng([5, 0]), 8)
    assert np.array_equal(one.global_order(), order)
    padded = np.concatenate([order, order[: (-COUNT) % 3]])
    assert list(one) == padded[1::3].tolist()


def test_ranks_per_node_comes_from_torchrun(output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = open_dataset(output)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    sampler = ShardSampler(ds, num_replicas=4, rank=3)
    assert (sampler.ranks_per_node, sampler.nodes, sampler.partitions) == (2, 2, 2)
    with pytest.raises(OptionError, match="LOCAL_WORLD_SIZE 2 does not divide num_replicas 3"):
        ShardSampler(ds, num_replicas=3, rank=0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(OptionError, match="invalid LOCAL_WORLD_SIZE"):
        ShardSampler(ds, num_replicas=4, rank=0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(OptionError, match="ranks_per_node 3 does not divide num_replicas 4"):
        ShardSampler(ds, num_replicas=4, rank=0, ranks_per_node=3)
    with pytest.raises(OptionError, match="partitions"):
        ShardSampler(ds, num_replicas=4, rank=0, partitions=0)


def _lockstep(
    loaders: list[Loader], take: int | None, index: dict[bytes, int]
) -> tuple[list[int], dict[str, Any]]:
    """What ranks in lockstep read: the sample indices of ``take`` batches each (all of the
    epoch with ``None``), and rank 0's state after them."""
    seen: list[int] = []
    iters = [iter(loader) for loader in loaders]
    steps = 0
    while take is None or steps < take:
        try:
            batches = [next(it) for it in iters]
        except StopIteration:
            break
        for images, _ in batches:
            seen += [index[image.numpy().tobytes()] for image in images]
        steps += 1
    return seen, loaders[0].state_dict()


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bytes, int]]:
    """A raw output of distinct images, and each image's index: what a rank read is known
    from its batches alone."""
    base = tmp_path_factory.mktemp("numbered")
    src = build_uniform_folder(base / "src", count=COUNT, classes=5, size=4)
    out = base / "out"
    convert(src, out, "pt", encoding="raw", size=4, progress=False, shard_size=600)
    ds = open_dataset(out)
    index = {ds[i][0].numpy().tobytes(): i for i in range(len(ds))}
    assert len(index) == COUNT
    return out, index


@pytest.mark.parametrize(
    ("save", "resume"),
    [
        ((2, 2, 2), (1, 1, 0)),
        ((2, 2, 2), (3, 1, 2)),
        ((2, 2, 0), (2, 2, 2)),
        ((3, 1, 1), (2, 2, 0)),
    ],
)
def test_a_state_saved_on_some_nodes_resumes_exactly_on_others(
    numbered: tuple[Path, dict[bytes, int]],
    save: tuple[int, int, int],
    resume: tuple[int, int, int],
) -> None:
    """(nodes, ranks per node, workers) on each side: what was read before the save and after
    the resume is the epoch, each sample once (and the pad of each side)."""
    root, index = numbered
    ds = open_dataset(root)

    def loaders(nodes: int, per_node: int, workers: int) -> list[Loader]:
        return [
            Loader(ds, batch_size=4, sampler=s, num_workers=workers, collate_fn=collate)
            for s in _ranks(ds, nodes, per_node)
        ]

    before, state = _lockstep(loaders(*save), 5, index)
    assert state["sampler"]["partitions"] == save[0]
    resumed = loaders(*resume)
    for loader in resumed:
        loader.load_state_dict(state)
    assert all(loader.batch_sampler.sampler.partitions == save[0] for loader in resumed)
    after, _ = _lockstep(resumed, None, index)
    seen = Counter(before + after)
    assert set(seen) == set(range(COUNT))
    repeated = sum(seen.values()) - COUNT
    assert repeated <= resume[0] * resume[1] - 1, repeated  # the resumed side's pad only
