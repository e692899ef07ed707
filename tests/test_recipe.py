"""The training recipe's random crops: torchvision's box algorithm, drawn as a pure function of
``(seed, epoch, index)`` (the reading half's first step)."""

from __future__ import annotations

import io
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import jpeg_bytes, png_bytes, smooth_rgb
from PIL import Image

from imgpack import convert, open_dataset
from imgpack.errors import OptionError
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate
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


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical
    distribution functions (ties counted on both sides)."""
    a, b = np.sort(a), np.sort(b)
    at = np.concatenate([a, b])
    gap = np.searchsorted(a, at, side="right") / len(a) - np.searchsorted(
        b, at, side="right"
    ) / len(b)
    return float(np.abs(gap).max())


def box_features(top, left, height, width, image_h: int, image_w: int) -> dict[str, np.ndarray]:
    """What a box distribution is judged by: its area share, its aspect (log), where its centre
    lies (as a share of the image's height and width)."""
    top, left, height, width = (np.asarray(v, np.float64) for v in (top, left, height, width))
    return {
        "area": height * width / (image_h * image_w),
        "aspect": np.log(width / height),
        "centre y": (top + height / 2) / image_h,
        "centre x": (left + width / 2) / image_w,
    }


def torchvision_boxes(
    count: int, image_h: int, image_w: int, scale: tuple[float, float], seed: int
) -> dict[str, np.ndarray]:
    """``count`` boxes from the re-implementation of torchvision's ``get_params`` above, drawn
    with an independent generator (Python's ``random``, one number per draw in turn)."""
    rng = random.Random(seed)
    found = [
        torchvision_get_params(image_h, image_w, scale, (3 / 4, 4 / 3), lambda _: rng.random())
        for _ in range(count)
    ]
    return box_features(*np.array(found).T, image_h, image_w)


@pytest.mark.parametrize(("image_h", "image_w"), [(375, 500), (500, 333), (224, 224), (30, 100)])
def test_the_box_distribution_is_torchvisions(image_h: int, image_w: int) -> None:
    """10,000 boxes drawn by the recipe and 10,000 by torchvision's algorithm on an independent
    generator: their area shares, aspects and centres must pass a two-sample Kolmogorov-Smirnov
    test at the 0.001 level, and their centre-fallback shares agree. The same test rejects
    boxes drawn with another ``scale`` or ``ratio``: it can fail."""
    count = 10_000
    critical = math.sqrt(-math.log(0.001 / 2) / 2) * math.sqrt(2 / count)  # 0.0276

    def ours(scale: tuple[float, float], ratio: tuple[float, float]) -> dict[str, np.ndarray]:
        crop = RandomResizedCrop(224, scale=scale, ratio=ratio)
        boxes = crop.boxes(5, 0, np.arange(count), [image_h] * count, [image_w] * count)
        return box_features(boxes.top, boxes.left, boxes.height, boxes.width, image_h, image_w)

    reference = torchvision_boxes(count, image_h, image_w, (0.08, 1.0), seed=image_h * image_w)
    drawn = ours((0.08, 1.0), (3 / 4, 4 / 3))
    for name in reference:
        distance = ks_distance(drawn[name], reference[name])
        assert distance < critical, (name, distance, critical)
    whole = [float((d["area"] == 1.0).mean()) for d in (drawn, reference)]
    assert abs(whole[0] - whole[1]) < 4 * math.sqrt(max(whole[1], 1e-3) * 2 / count), whole
    for scale, ratio in (((0.2, 1.0), (3 / 4, 4 / 3)), ((0.08, 1.0), (1 / 2, 2))):
        other = ours(scale, ratio)
        assert max(ks_distance(other[n], reference[n]) for n in reference) > critical, (
            scale,
            ratio,
        )


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


# -- the readers: boxes drawn before the decode, in every process ---------------------------------
@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PNG and JPEG sources of different sizes, in two classes."""
    root = tmp_path_factory.mktemp("recipe") / "src"
    rng = np.random.default_rng(1)
    for k in range(24):
        height, width = int(rng.integers(24, 90)), int(rng.integers(24, 90))
        folder = root / ("a" if k % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(smooth_rgb(rng, height, width))
        name = folder / f"{k:02d}.{'png' if k % 3 else 'jpg'}"
        name.write_bytes(png_bytes(img) if k % 3 else jpeg_bytes(img))
    return root


def _expected(
    full: np.ndarray, box: tuple[int, int, int, int], size: int, flip: bool
) -> np.ndarray:
    """torchvision's ``RandomResizedCrop`` on a PIL image for this box: crop, then a bilinear
    resize; then the flip."""
    top, left, height, width = box
    img = Image.fromarray(full).crop((left, top, left + width, top + height))
    out = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR))
    return out[:, ::-1] if flip else out


@pytest.mark.parametrize(
    ("fmt", "encoding"), [("pt", "original"), ("webdataset", "jpeg"), ("lmdb", "raw")]
)
def test_a_reader_crops_each_sample_as_torchvision_would(
    photos: Path, tmp_path: Path, fmt: str, encoding: str
) -> None:
    out = tmp_path / "out"
    size = {"size": 48} if encoding == "raw" else {}
    convert(photos, out, fmt, encoding=encoding, progress=False, **size)  # type: ignore[arg-type]
    crop = RandomResizedCrop(20, scale=(0.3, 1.0))
    ds = open_dataset(out, recipe=crop, seed=11)
    plain = open_dataset(out)
    assert ds.image_shape == (3, 20, 20)
    ds.set_epoch(4)
    batch = collate(ds.__getitems__(list(range(len(ds)))))
    assert tuple(batch[0].shape) == (len(ds), 3, 20, 20)
    assert batch[1].tolist() == plain.targets
    for index in range(len(ds)):
        full = plain[index][0].permute(1, 2, 0).numpy()
        boxes = crop.boxes(11, 4, np.array([index]), [full.shape[0]], [full.shape[1]])
        box = (int(boxes.top[0]), int(boxes.left[0]), int(boxes.height[0]), int(boxes.width[0]))
        expected = _expected(full, box, 20, bool(boxes.flip[0])).astype(np.int64)
        found = batch[0][index].permute(1, 2, 0).numpy().astype(np.int64)
        source = plain.samples[index][0]
        stored_jpeg = encoding == "jpeg" or (encoding == "original" and source.endswith(".jpg"))
        if stored_jpeg:  # decoded at a reduced DCT scale where the box allows: close
            difference = np.abs(found - expected)
            assert difference.mean() < 2 and difference.max() < 48, (index, difference.max())
        else:  # PNG and raw: exactly torchvision's pixels
            assert np.array_equal(found, expected), index
        single = ds[index][0].permute(1, 2, 0).numpy().astype(np.int64)
        assert np.array_equal(single, found)  # ds[i]: the same crop as in a batch


def test_the_crops_follow_the_epoch_in_every_worker(photos: Path, tmp_path: Path) -> None:
    """Batches from ShardSampler carry their epoch: workers that persist across epochs, and
    any number of them, draw the same crops as one process."""
    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="png", progress=False)
    crop = RandomResizedCrop(16)

    def epochs(workers: int, persistent: bool) -> list[torch.Tensor]:
        ds = open_dataset(out, recipe=crop, seed=5)
        sampler = ShardSampler(ds, seed=1)
        loader = Loader(
            ds, batch_size=5, sampler=sampler, num_workers=workers, collate_fn=collate,
            persistent_workers=persistent,
        )  # fmt: skip
        found = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            found.append(torch.cat([images for images, _ in loader]))
        return found

    alone = epochs(0, False)
    assert not torch.equal(alone[0], alone[1])  # another epoch, other crops (and order)
    for workers, persistent in ((2, False), (2, True)):
        found = epochs(workers, persistent)
        assert all(torch.equal(a, b) for a, b in zip(alone, found, strict=True)), (
            workers,
            persistent,
        )


def test_a_recipe_is_refused_with_a_size_and_a_seed_must_be_whole(
    photos: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(photos, out, "pt", progress=False)
    with pytest.raises(OptionError, match="recipe= or size=, not both"):
        open_dataset(out, recipe=RandomResizedCrop(8), size=8)
    with pytest.raises(OptionError, match="invalid seed"):
        open_dataset(out, recipe=RandomResizedCrop(8), seed=1.5)
    with pytest.raises(OptionError, match="invalid recipe"):
        open_dataset(out, recipe="train")


def test_the_evaluation_crop_is_torchvisions_resize_then_centre_crop(
    photos: Path, tmp_path: Path
) -> None:
    """``CenterCrop(24, resize=28)``: one box in the stored image that Resize(28) then
    CenterCrop(24) would keep, resized in one step: within rounding of torchvision's two."""
    from imgpack.recipe import CenterCrop

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="png", progress=False)
    plain = open_dataset(out)
    ds = open_dataset(out, recipe=CenterCrop(24, resize=28))
    first = collate(ds.__getitems__(list(range(len(ds)))))[0]
    ds.set_epoch(3)
    assert torch.equal(collate(ds.__getitems__(list(range(len(ds)))))[0], first)  # no randomness
    for index in range(len(ds)):
        full = Image.fromarray(plain[index][0].permute(1, 2, 0).numpy())
        short, long = min(full.size), max(full.size)
        other = long * 28 // short
        resized = full.resize(
            (28, other) if full.width <= full.height else (other, 28), Image.Resampling.BILINEAR
        )
        top, left = round((resized.height - 24) / 2), round((resized.width - 24) / 2)
        expected = np.asarray(resized.crop((left, top, left + 24, top + 24)), np.int64)
        found = first[index].permute(1, 2, 0).numpy().astype(np.int64)
        assert np.abs(found - expected).mean() < 4, index
    assert CenterCrop(224).resize == 256
    with pytest.raises(OptionError, match="at least the crop"):
        CenterCrop(224, resize=200)


@pytest.mark.parametrize("encoding", ["png", "jpeg"])
@pytest.mark.parametrize("resume_workers", [0, 2])
@pytest.mark.parametrize("through", ["loader", "dataloader"])
def test_the_crops_after_a_resume_are_the_epochs_on_other_workers_and_ranks(
    photos: Path, tmp_path: Path, resume_workers: int, through: str, encoding: str
) -> None:
    """Saved after 2 batches of epoch 1 with 2 workers, resumed by 2 ranks with 0 or 2 workers,
    through ``Loader`` (batches that carry their epoch) or a plain ``DataLoader`` over the
    sampler (Python ints: the reader takes the epoch the loaded state tells it): every crop read
    before and after is the one ``(seed, 1, index)`` gives, each sample once. PNG records take
    Pillow's path; JPEG ones the region decoder and torch's resize, in workers as in the
    process that drew the reference."""
    import hashlib

    from torch.utils.data import DataLoader

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding=encoding, progress=False)  # type: ignore[arg-type]
    crop = RandomResizedCrop(12)

    def digest(image: torch.Tensor) -> str:
        return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()

    reference = open_dataset(out, recipe=crop, seed=9)
    reference.set_epoch(1)
    expected = Counter(digest(reference[i][0]) for i in range(len(reference)))

    ds = open_dataset(out, recipe=crop, seed=9)
    sampler = ShardSampler(ds, seed=4)
    sampler.set_epoch(1)
    loader = Loader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate)
    seen: list[str] = []
    for step, (images, _) in enumerate(loader):
        seen += [digest(image) for image in images]
        if step == 1:
            state = loader.state_dict()
            break
    del loader
    for rank in range(2):
        fresh = open_dataset(out, recipe=crop, seed=9)  # its own epoch: 0
        ranked = ShardSampler(fresh, seed=4, num_replicas=2, rank=rank)
        made = {"batch_size": 4, "num_workers": resume_workers, "collate_fn": collate}
        if through == "loader":
            resumed = Loader(fresh, sampler=ranked, **made)
            resumed.load_state_dict(state)
        else:
            ranked.load_state_dict(state["sampler"])
            resumed = DataLoader(fresh, sampler=ranked, **made)
        seen += [digest(image) for images, _ in resumed for image in images]
    assert Counter(seen) == expected


def test_awkward_images_are_cropped_like_any_other(tmp_path: Path) -> None:
    """A grayscale JPEG (kept one channel), a progressive JPEG, a CMYK JPEG and an EXIF-rotated
    one (both stored as PNGs of the policy's pixels), a 1-pixel-wide PNG (the fallback box):
    each crop against torchvision's on the reader's full decode of the same record."""
    rng = np.random.default_rng(3)
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    rgb = Image.fromarray(smooth_rgb(rng, 60, 80))
    (src / "gray.jpg").write_bytes(jpeg_bytes(rgb.convert("L")))
    (src / "progressive.jpg").write_bytes(jpeg_bytes(rgb, progressive=True))
    (src / "cmyk.jpg").write_bytes(jpeg_bytes(rgb.convert("CMYK")))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    (src / "rotated.jpg").write_bytes(jpeg_bytes(rgb, exif=exif.tobytes()))
    (src / "sliver.png").write_bytes(png_bytes(Image.fromarray(smooth_rgb(rng, 1, 40))))
    out = tmp_path / "out"
    convert(tmp_path / "src", out, "pt", progress=False)
    crop = RandomResizedCrop(8)
    ds, plain = open_dataset(out, recipe=crop, seed=2), open_dataset(out)
    batch = collate(ds.__getitems__(list(range(len(ds)))))[0]
    for index, (path, _) in enumerate(plain.samples):
        full = plain[index][0].permute(1, 2, 0).numpy()
        boxes = crop.boxes(2, 0, np.array([index]), [full.shape[0]], [full.shape[1]])
        box = (int(boxes.top[0]), int(boxes.left[0]), int(boxes.height[0]), int(boxes.width[0]))
        expected = _expected(full, box, 8, bool(boxes.flip[0])).astype(np.int64)
        found = batch[index].permute(1, 2, 0).numpy().astype(np.int64)
        assert found.shape == (8, 8, 3), path
        difference = np.abs(found - expected)
        assert difference.mean() < 2 and difference.max() < 48, (path, difference.max())
        if path.endswith(".png") or "rotated" in path or "cmyk" in path:  # stored as PNG
            assert np.array_equal(found, expected), path
        if "sliver" in path:  # too thin for the ratio: the centre fallback, full height
            assert box[2] == 1


def test_preview_shows_the_crops_training_sees(photos: Path, tmp_path: Path) -> None:
    """``imgpack preview OUT --recipe train --size N --epoch E``: each tile is the sample's crop
    in that epoch, as the reader gives it; ``--recipe`` without ``--size`` is refused."""
    from click.testing import CliRunner

    from imgpack.cli import main

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="png", progress=False)
    sheet = tmp_path / "sheet.png"
    args = ["preview", str(out), "-o", str(sheet), "--per-class", "3"]
    done = CliRunner().invoke(main, [*args, "--recipe", "train", "--size", "16", "--epoch", "2"])
    assert done.exit_code == 0, done.output
    ds = open_dataset(out, recipe=RandomResizedCrop(16), seed=0)
    ds.set_epoch(2)
    from imgpack.preview import contact_sheet

    expected = contact_sheet(ds, 3)
    with Image.open(sheet) as found:
        assert np.array_equal(np.asarray(found), np.asarray(expected.image))
    assert {tile[2:] for tile in expected.tiles}  # tiles were drawn
    refused = CliRunner().invoke(main, [*args, "--recipe", "eval"])
    assert refused.exit_code == 2 and "--recipe eval needs --size N" in refused.output


@pytest.mark.parametrize("workers", [0, 2])
def test_a_device_loader_streams_the_recipes_crops(
    photos: Path, tmp_path: Path, workers: int
) -> None:
    """``DeviceLoader(out, recipe=...)`` streams: every sample once an epoch, each the reader's
    own crop for that epoch (on 0 or 2 workers), with its label, then on the device in
    ``dtype`` and normalized; a state saved after some batches on ``workers`` resumes on
    another number of workers with exactly the rest of the epoch."""
    from imgpack.loading import DeviceLoader

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="original", progress=False)
    crop = RandomResizedCrop(12)
    reader = open_dataset(out, recipe=crop, seed=4)
    made = {"device": "cpu", "batch_size": 5, "seed": 4, "dtype": torch.uint8}
    loader = DeviceLoader(out, recipe=crop, workers=workers, **made)  # type: ignore[arg-type]
    assert len(loader) == 5
    for epoch in (0, 1):
        reader.set_epoch(epoch)
        expected = Counter(
            (reader[i][0].numpy().tobytes(), reader.targets[i]) for i in range(len(reader))
        )
        loader.set_epoch(epoch)
        batches = list(loader)
        found = Counter(
            (image.numpy().tobytes(), label)
            for images, labels in batches
            for image, label in zip(images, labels.tolist(), strict=True)
        )
        assert found == expected, epoch
        assert batches[0][0].shape == (5, 3, 12, 12) and batches[0][0].dtype == torch.uint8
    loader.set_epoch(1)
    taken = []
    for step, (images, _) in enumerate(loader):
        taken.append(images)
        if step == 1:
            state = loader.state_dict()
            break
    whole = [images for images, _ in loader]  # the same epoch, uninterrupted
    assert torch.equal(taken[0], whole[0]) and torch.equal(taken[1], whole[1])
    resumed = DeviceLoader(out, recipe=crop, workers=2 - workers, **made)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    rest = [images for images, _ in resumed]
    assert len(rest) == len(whole) - 2
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[2:], strict=True))

    floats = DeviceLoader(
        open_dataset(out, recipe=crop, seed=4),  # a reader with a recipe streams with it
        device="cpu",
        batch_size=5,
        seed=4,
        workers=0,
        normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
    )
    images, labels = next(iter(floats))
    plain = next(iter(DeviceLoader(out, recipe=crop, workers=0, **made)))[0]  # type: ignore[arg-type]
    assert images.dtype == torch.float32 and labels.dtype == torch.int64
    assert torch.allclose(images, (plain.float() / 255 - 0.5) / 0.25)


def test_a_device_loader_refuses_what_a_recipe_replaces(photos: Path, tmp_path: Path) -> None:
    from imgpack.loading import DeviceLoader

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="original", progress=False)
    crop = RandomResizedCrop(12)
    for extra, says in (
        ({"size": 12}, "size"),
        ({"crop_padding": 2}, "crop_padding"),
        ({"hflip": 0.5}, "hflip"),
        ({"indices": [0, 1]}, "indices"),
    ):
        with pytest.raises(OptionError, match=says):
            DeviceLoader(out, device="cpu", recipe=crop, **extra)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="imgpack reader"):
        DeviceLoader(torch.utils.data.TensorDataset(torch.zeros(2)), device="cpu", recipe=crop)
    preloaded = DeviceLoader(out, device="cpu", size=12, progress=False, workers=0)
    streamed = DeviceLoader(out, device="cpu", recipe=crop, workers=0)
    with pytest.raises(OptionError, match="preloads"):
        streamed.load_state_dict(preloaded.state_dict())
    with pytest.raises(OptionError, match="streams a recipe"):
        preloaded.load_state_dict(streamed.state_dict())


def _noisy_jpeg(rng: np.random.Generator, height: int, width: int, **kwargs: object) -> bytes:
    """A photo-like JPEG: a smooth picture with grain (every block has detail to decode)."""
    pixels = smooth_rgb(rng, height, width).astype(np.int64)
    pixels += rng.integers(-8, 9, size=pixels.shape)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return jpeg_bytes(img.convert("L") if kwargs.pop("gray", False) else img, **kwargs)


def _scaled_path(data: bytes, box: tuple[int, int, int, int], size: int, flip: bool) -> np.ndarray:
    """The crop through the whole image decoded at the box's DCT scale (the path without the
    region decoder)."""
    from imgpack import recipe

    found = recipe._scaled_jpeg(data, 3, box, (size, size))
    assert found is not None
    scaled, (full_h, full_w) = found
    sy, sx = scaled.shape[0] / full_h, scaled.shape[1] / full_w
    region = (box[0] * sy, box[1] * sx, box[2] * sy, box[3] * sx)
    return recipe.widen(recipe.crop_resize(scaled, region, (size, size), flip), 3)


def test_the_region_decoder_is_built_where_libjpeg_turbo_is() -> None:
    """The region decoder is compiled where a C compiler and libjpeg-turbo's headers are (this
    suite's machines and CI: the tests below then run it, not the fallback)."""
    from imgpack import recipe

    if not Path("/usr/include/jpeglib.h").exists():
        pytest.skip("no libjpeg headers here: the recipe decodes through simplejpeg")
    assert recipe._jpegregion is not None


@pytest.mark.parametrize(
    ("height", "width", "options"),
    [
        (375, 500, {}),  # 4:2:0, ImageNet's usual size
        (500, 333, {"subsampling": 0}),  # 4:4:4, portrait
        (300, 410, {"gray": True}),
        (240, 320, {"progressive": True}),
        (1200, 1600, {}),  # boxes at 1/4 and 1/8 scale
        (1, 300, {}),  # 1 pixel high: the fallback box
        (97, 131, {"subsampling": 1}),  # 4:2:2, sizes that are no multiple of a block
    ],
)
def test_a_region_decode_gives_the_scaled_decodes_pixels(
    height: int, width: int, options: dict[str, object]
) -> None:
    """Only the rows and the iMCU columns around the box are decoded (with a margin for the
    resize's reach and the upsampling's edge): the crop is the whole scaled image's, at most 2
    apart (torch's resize kernel against Pillow's; a box's edges shifted by a whole number of
    pixels are rounded once more), for boxes
    anywhere, edges included; and against torchvision's crop of the full decode within the
    tolerance the docs state."""
    from imgpack import recipe

    if recipe._jpegregion is None:
        pytest.skip("built without the region decoder")
    rng = np.random.default_rng(height * width)
    data = _noisy_jpeg(rng, height, width, **options)
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    crop = RandomResizedCrop(64)
    count = 60
    boxes = crop.boxes(5, 0, np.arange(count), np.full(count, height), np.full(count, width))
    scales = set()
    for k in range(count):
        box = (int(boxes.top[k]), int(boxes.left[k]), int(boxes.height[k]), int(boxes.width[k]))
        flip = bool(boxes.flip[k])
        found = recipe._region_jpeg(data, 3, box, (64, 64), None)
        assert found is not None and found.shape == (64, 64, 3), box
        found = found[:, ::-1] if flip else found
        scaled = _scaled_path(data, box, 64, flip)
        assert np.abs(found.astype(np.int64) - scaled).max() <= 2, box
        expected = _expected(full, box, 64, flip).astype(np.int64)
        difference = np.abs(found.astype(np.int64) - expected)
        assert difference.mean() < 2 and difference.max() < 48, (box, difference.max())
        assert np.array_equal(recipe.decode_box(data, 3, box, (64, 64), flip), found)
        scales.add(recipe._scale_factor(box, (64, 64)))
    if height >= 1200:
        assert len(scales) >= 2  # several DCT scales, each with its region


def test_the_region_decoder_refuses_what_it_cannot_do() -> None:
    """Damaged data, a CMYK JPEG, a region outside the image: the region decoder declines
    (``ValueError``), and the crop goes through the other paths, which name what is wrong."""
    from imgpack import recipe
    from imgpack.errors import DataError

    if recipe._jpegregion is None:
        pytest.skip("built without the region decoder")
    rng = np.random.default_rng(9)
    data = _noisy_jpeg(rng, 120, 160)
    decode = recipe._jpegregion.decode
    pixels, rows, cols, channels, xoffset, height, width = decode(data, "rgb", 2, 10, 20, 30, 50)
    assert (rows, channels, height, width) == (10, 3, 60, 80)
    assert xoffset <= 30 and xoffset + cols >= 50 and len(pixels) == rows * cols * 3
    for bad in [("rgb", 2, 0, 61, 0, 10), ("rgb", 1, 5, 5, 0, 10), ("rgb", 3, 0, 1, 0, 1)]:
        with pytest.raises(ValueError):
            decode(data, *bad)
    with pytest.raises(ValueError, match="colorspace"):
        decode(data, "cmyk", 1, 0, 1, 0, 1)
    cut = data[: len(data) // 2]
    with pytest.raises(ValueError, match="cannot decode the JPEG"):
        decode(cut, "rgb", 1, 0, 120, 0, 160)
    assert recipe._region_jpeg(cut, 3, (0, 0, 120, 160), (32, 32), None) is None
    with pytest.raises(DataError):
        recipe.decode_box(b"\xff\xd8\xff" + bytes(100), 3, (0, 0, 10, 10), (8, 8), False)
    cmyk = jpeg_bytes(Image.fromarray(smooth_rgb(rng, 40, 40)).convert("CMYK"))
    assert recipe._region_jpeg(cmyk, 3, (0, 0, 40, 40), (8, 8), None) is None
    assert recipe.jpeg_header(cmyk, 3) is None and recipe.jpeg_header(cut, 3) == (120, 160, "rgb")
    with pytest.raises(DataError, match="CMYK"):  # never a stored record: conversion makes RGB
        recipe.decode_box(cmyk, 3, (0, 0, 40, 40), (8, 8), False)


@pytest.mark.parametrize("portable", [False, True])
def test_a_crop_is_placed_into_its_slot_row_by_row_and_flipped(portable: bool) -> None:
    """``imgpack._batchcopy`` copies a planar crop into its batch slot (streaming stores where
    the CPU has AVX2, the plain loop with ``portable``), each row reversed for a flip: numpy's
    copy, for rows shorter and longer than a 32-byte store, of no multiple of it, and slots at
    every alignment; a crop and a slot of other sizes are refused."""
    from imgpack import recipe

    if recipe._batchcopy is None:
        pytest.skip("built without the batch copy")
    place = recipe._batchcopy.place
    rng = np.random.default_rng(11)
    for width in (1, 7, 31, 32, 33, 64, 100, 224, 225):
        for rows, shift in ((1, 0), (3, 1), (9, 13), (672, 31)):
            src = rng.integers(0, 256, (rows, width), dtype=np.uint8)
            for flip in (False, True):
                room = np.zeros(rows * width + 64, np.uint8)
                slot = room[shift : shift + rows * width]
                place(src.data, slot.data, width, flip, portable)
                expected = src[:, ::-1] if flip else src
                assert np.array_equal(slot.reshape(rows, width), expected), (width, rows, flip)
                assert not room[:shift].any() and not room[shift + rows * width :].any()
    with pytest.raises(ValueError, match="bytes"):
        place(bytes(12), bytearray(13), 4)
    with pytest.raises(ValueError, match="rows of 5"):
        place(bytes(12), bytearray(12), 5)
    with pytest.raises(TypeError):
        place(bytes(12), bytes(12), 4)  # a slot that cannot be written


@pytest.mark.parametrize("way", ["batchcopy", "torch", "numpy"])
def test_every_way_of_placing_a_crop_gives_the_same_slot(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``place`` copies a crop into its CxHxW slot, flipped or not, by the C copy, by torch
    (no extension) or by numpy (where torch's threads may not run): the same bytes, for a
    planar crop (torch's resize output) and an interleaved one (Pillow's)."""
    from imgpack import recipe

    if way == "batchcopy" and recipe._batchcopy is None:
        pytest.skip("built without the batch copy")
    if way != "batchcopy":
        monkeypatch.setattr(recipe, "_batchcopy", None)
    if way == "numpy":
        monkeypatch.setattr(recipe, "torch_may_run", lambda: False)
    chw = np.random.default_rng(0).integers(0, 256, (3, 40, 37), dtype=np.uint8)
    for pixels in (chw.transpose(1, 2, 0), np.ascontiguousarray(chw.transpose(1, 2, 0))):
        for flip in (False, True):
            out = torch.zeros((3, 40, 37), dtype=torch.uint8)
            recipe.place(pixels, out, flip)
            expected = np.ascontiguousarray(chw[:, :, ::-1] if flip else chw)
            assert np.array_equal(out.numpy(), expected), (flip, pixels.flags.c_contiguous)


def test_the_batch_copy_and_torch_place_the_same_crops(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of random crops (flipped and not, JPEG and PNG records) is the same whether the
    crops are placed by ``imgpack._batchcopy`` or by torch, and each crop is ``decode_box``'s."""
    from imgpack import recipe

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="original", progress=False)
    crop = RandomResizedCrop(24, scale=(0.3, 1.0))
    ds = open_dataset(out, recipe=crop, seed=3)
    indices = list(range(len(ds)))
    built = collate(ds.__getitems__(indices))
    monkeypatch.setattr(recipe, "_batchcopy", None)
    plain = collate(open_dataset(out, recipe=crop, seed=3).__getitems__(indices))
    assert torch.equal(built[0], plain[0]) and built[1].tolist() == plain[1].tolist()
    payloads = [bytes(e.payload) for e in ds.encoded(0, len(ds))]
    sizes = [Image.open(io.BytesIO(p)).size for p in payloads]  # (W, H)
    heights = np.array([h for _, h in sizes])
    widths = np.array([w for w, _ in sizes])
    boxes = crop.boxes(3, 0, np.array(indices), heights, widths)
    assert boxes.flip.any() and not boxes.flip.all()
    for k, payload in enumerate(payloads):
        box = (boxes.top[k], boxes.left[k], boxes.height[k], boxes.width[k])
        expected = recipe.decode_box(payload, 3, box, (24, 24), bool(boxes.flip[k]))
        assert np.array_equal(built[0][k].permute(1, 2, 0).numpy(), expected), k


def test_region_decodes_run_side_by_side_in_threads() -> None:
    """The decoder lets go of the GIL: crops decoded by 4 threads at once are the crops one
    thread decodes."""
    from concurrent.futures import ThreadPoolExecutor

    from imgpack import recipe

    if recipe._jpegregion is None:
        pytest.skip("built without the region decoder")
    rng = np.random.default_rng(4)
    images = [_noisy_jpeg(rng, 300, 400) for _ in range(4)]
    crop = RandomResizedCrop(32)
    boxes = crop.boxes(1, 0, np.arange(64), np.full(64, 300), np.full(64, 400))
    jobs = [
        (
            images[k % 4],
            (int(boxes.top[k]), int(boxes.left[k]), int(boxes.height[k]), int(boxes.width[k])),
            bool(boxes.flip[k]),
        )
        for k in range(64)
    ]
    alone = [recipe.decode_box(data, 3, box, (32, 32), flip) for data, box, flip in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda j: recipe.decode_box(j[0], 3, j[1], (32, 32), j[2]), jobs))
    assert all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))


def test_without_the_region_decoder_the_crops_are_the_same(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine without libjpeg-turbo's headers builds no region decoder: the reader's crops
    then come from the whole image at the DCT scale, at most 2 apart."""
    from imgpack import recipe

    out = tmp_path / "out"
    convert(photos, out, "pt", encoding="jpeg", progress=False)
    crop = RandomResizedCrop(24, scale=(0.3, 1.0))
    with_region = collate(open_dataset(out, recipe=crop, seed=3).__getitems__(list(range(24))))
    monkeypatch.setattr(recipe, "_jpegregion", None)
    without = collate(open_dataset(out, recipe=crop, seed=3).__getitems__(list(range(24))))
    assert with_region[1].tolist() == without[1].tolist()
    difference = (with_region[0].to(torch.int64) - without[0].to(torch.int64)).abs()
    assert int(difference.max()) <= 2
