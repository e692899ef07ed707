"""The training recipe's random crops: torchvision's box algorithm, drawn as a pure function of
``(seed, epoch, index)`` (the reading half's first step)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from imgpack.errors import OptionError
from imgpack.recipe import TRIES, RandomResizedCrop, uniforms


def torchvision_get_params(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], draw
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, line for line, its random numbers taken
    from ``draw(k)`` (uniform in [0, 1)) instead of torch's generator."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for attempt in range(10):
        target_area = area * (scale[0] + draw(2 * attempt) * (scale[1] - scale[0]))
        aspect_ratio = math.exp(
            log_ratio[0] + draw(2 * attempt + 1) * (log_ratio[1] - log_ratio[0])
        )
        w = int(round(math.sqrt(target_area * aspect_ratio)))  # noqa: RUF046 (torchvision's own)
        h = int(round(math.sqrt(target_area / aspect_ratio)))  # noqa: RUF046 (torchvision's own)
        if 0 < w <= width and 0 < h <= height:
            i = math.floor(draw(20) * (height - h + 1))  # torch.randint(0, height - h + 1)
            j = math.floor(draw(21) * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))  # noqa: RUF046 (torchvision's own)
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))  # noqa: RUF046 (torchvision's own)
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    ("scale", "ratio"),
    [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.35, 1.0), (1.0, 1.0)), ((0.9, 1.0), (2, 3))],
)
def test_the_boxes_are_torchvisions_on_the_same_numbers(
    scale: tuple[float, float], ratio: tuple[float, float]
) -> None:
    rng = np.random.default_rng(0)
    count = 3000
    heights = rng.integers(1, 600, count)
    widths = rng.integers(1, 600, count)
    heights[:50], widths[:50] = 1, rng.integers(200, 900, 50)  # slivers: the fallback
    indices = rng.permutation(10**6)[:count]
    crop = RandomResizedCrop(224, scale=scale, ratio=ratio, flip=0.5)
    boxes = crop.boxes(7, 3, indices, heights, widths)
    fallbacks = 0
    for k in range(count):
        index = indices[k : k + 1]
        draw = lambda d, index=index: float(uniforms(7, 3, index, d)[0])  # noqa: E731
        expected = torchvision_get_params(int(heights[k]), int(widths[k]), scale, ratio, draw)
        found = (boxes.top[k], boxes.left[k], boxes.height[k], boxes.width[k])
        assert tuple(map(int, found)) == expected, (k, heights[k], widths[k])
        assert found[0] >= 0 and found[0] + found[2] <= heights[k]
        assert found[1] >= 0 and found[1] + found[3] <= widths[k]
        fallbacks += expected[2:] == (int(heights[k]), int(widths[k])) or heights[k] == 1
    assert fallbacks >= 50  # the slivers took the centre fallback


def test_a_box_is_a_pure_function_of_seed_epoch_and_index() -> None:
    crop = RandomResizedCrop(32)
    heights, widths = np.full(1000, 300), np.full(1000, 400)
    every = crop.boxes(1, 0, np.arange(1000), heights, widths)
    order = np.random.default_rng(5).permutation(1000)
    shuffled = crop.boxes(1, 0, order, heights, widths)  # other batches, another order
    for field in ("top", "left", "height", "width", "flip"):
        assert np.array_equal(getattr(shuffled, field), getattr(every, field)[order]), field
    single = crop.boxes(1, 0, np.array([417]), heights[:1], widths[:1])
    assert single.top[0] == every.top[417] and single.flip[0] == every.flip[417]
    for seed, epoch in ((2, 0), (1, 1)):
        other = crop.boxes(seed, epoch, np.arange(1000), heights, widths)
        assert (other.top != every.top).mean() > 0.9  # another epoch or seed: other boxes


def test_the_numbers_are_uniform_and_the_flip_is_fair() -> None:
    values = uniforms(0, 0, np.arange(200_000), 5)
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean() - 0.5) < 0.005 and abs(np.median(values) - 0.5) < 0.005
    counts = np.histogram(values, bins=20, range=(0, 1))[0]
    assert counts.min() > 0.9 * counts.mean()
    draws = np.stack([uniforms(3, 1, np.arange(50_000), d) for d in range(4)])
    assert np.abs(np.corrcoef(draws) - np.eye(4)).max() < 0.02  # the draws are independent
    flips = (
        RandomResizedCrop(8, flip=0.5)
        .boxes(0, 0, np.arange(20_000), [64] * 20_000, [64] * 20_000)
        .flip
    )
    assert abs(flips.mean() - 0.5) < 0.02
    none = RandomResizedCrop(8, flip=0.0).boxes(0, 0, np.arange(100), [64] * 100, [64] * 100).flip
    assert not none.any()


def test_the_area_shares_follow_scale() -> None:
    crop = RandomResizedCrop(8, scale=(0.25, 0.5), ratio=(1.0, 1.0))
    boxes = crop.boxes(0, 0, np.arange(20_000), [400] * 20_000, [400] * 20_000)
    share = boxes.height * boxes.width / 160_000
    assert share.min() >= 0.24 and share.max() <= 0.51 and abs(share.mean() - 0.375) < 0.01
    assert (boxes.height == boxes.width).all()
    assert TRIES == 10


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"scale": (0.5, 0.2)}, "invalid scale"),
        ({"scale": (0, 1)}, "invalid scale"),
        ({"ratio": (2, 1)}, "invalid ratio"),
        ({"flip": 1.5}, "invalid flip"),
        ({"size": "0"}, "size"),
    ],
)
def test_bad_parameters_are_refused_in_one_line(options: dict[str, object], says: str) -> None:
    given = {"size": 224, **options}
    with pytest.raises(OptionError, match=says):
        RandomResizedCrop(**given)  # type: ignore[arg-type]
