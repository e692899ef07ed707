"""The newest surfaces tried as a hostile user would: every bad argument of the sampler, Mix,
the read options and a saved state is one OptionError naming it, at construction."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.errors import OptionError
from imgpack.loading import Loader, Mix, ShardSampler


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    base = tmp_path_factory.mktemp("sizes")
    src = build_uniform_folder(base / "src", count=12, classes=2, size=16)
    for name, size in (("small", 8), ("large", 12)):
        convert(src, base / name, format="pt", encoding="raw", size=size, progress=False)
    return open_dataset(base / "small"), open_dataset(base / "large")


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"window": math.nan}, "window"),
        ({"window": 0}, "window"),
        ({"block_size": math.nan}, "block_size"),
        ({"rank": "0", "num_replicas": 2}, "rank"),
        ({"num_replicas": 2.5, "rank": 0}, "num_replicas"),
        ({"num_replicas": 2, "rank": 2}, "rank"),
    ],
)
def test_a_bad_sampler_argument_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    with pytest.raises(OptionError, match=named):
        ShardSampler(two_sizes[0], **keywords)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"weights": [math.nan, 1]}, "weights"),
        ({"weights": [math.inf, 1]}, "weights"),
        ({"weights": [math.inf, math.inf]}, "weights"),
        ({"weights": [-1, 2]}, "weights"),
        ({"weights": [0, 0]}, "weights"),
        ({"samples": 0}, "samples"),
        ({"samples": -5}, "samples"),
        ({"counts": [0, 0]}, "counts"),
        ({"counts": [math.nan, 1]}, "count"),
        ({"counts": [1]}, "counts"),
    ],
)
def test_a_bad_mix_argument_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    small = two_sizes[0]
    with pytest.raises(OptionError, match=named):
        Mix([small, small], **keywords)


def test_a_mix_of_image_sizes_is_refused_with_the_way_out(two_sizes: tuple[Any, Any]) -> None:
    small, large = two_sizes
    with pytest.raises(OptionError, match=r"3x8x8.*3x12x12.*size="):
        Mix([small, large])
    resized = open_dataset(large.root, size=8)
    mix = Mix([small, resized])  # one size: batches stack
    loader = Loader(mix, batch_size=24, sampler=ShardSampler(mix, seed=0))
    images, _ = next(iter(loader))
    assert tuple(images.shape) == (24, 3, 8, 8)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"prefetch": "x"}, "prefetch"),
        ({"prefetch": -1}, "prefetch"),
        ({"decode_threads": 0}, "decode_threads"),
        ({"resize": "squash"}, "resize"),
    ],
)
def test_a_bad_read_option_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    with pytest.raises(OptionError, match=named):
        open_dataset(two_sizes[0].root, **keywords)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": -1}, "epoch"),
        ({"epoch": "0"}, "epoch"),
        ({"consumed": 10**9}, "consumed"),
        ({"consumed": -1}, "consumed"),
        ({"imgpack_sampler": 99}, "version"),
    ],
)
def test_a_damaged_state_is_refused_when_loaded(
    two_sizes: tuple[Any, Any], change: dict[str, Any], match: str
) -> None:
    sampler = ShardSampler(two_sizes[0], seed=1)
    state = {**sampler.state_dict(), **change}
    with pytest.raises(OptionError, match=match):
        ShardSampler(two_sizes[0], seed=1).load_state_dict(state)
    with pytest.raises(OptionError, match="not an imgpack sampler state"):
        sampler.load_state_dict({"something": "else"})


def test_a_loader_state_resumes_a_sampler_and_the_other_way(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=20, classes=2, size=8)
    convert(src, tmp_path / "out", format="pt", progress=False)
    ds = open_dataset(tmp_path / "out")
    loader = Loader(ds, batch_size=4, sampler=ShardSampler(ds, seed=2))
    batches = iter(loader)
    next(batches)
    sampler = ShardSampler(ds, seed=2)
    sampler.load_state_dict(loader.state_dict())  # a Loader's state, into a bare sampler
    assert len(list(sampler)) == 16 and len(sampler) == 20  # len: the whole epoch
