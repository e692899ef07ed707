"""Dataset statistics: recorded by the conversion, exact against numpy over what the readers
return, the same however the work was split, printed by ``imgpack info``, used by
``DeviceLoader(normalize="dataset")``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from imgpack import convert, merge, open_dataset
from imgpack.cli import main
from imgpack.errors import DataError, ManifestError, OptionError
from imgpack.images import pixel_sums
from imgpack.loading import DeviceLoader
from imgpack.sample import make_sample_folder
from imgpack.stats import DatasetStats

CASES = [
    ("pt", "raw", {"size": 24}),
    ("lmdb", "original", {}),
    ("hdf5", "png", {}),
    ("tfrecord", "jpeg", {}),
    ("webdataset", "original", {"grayscale": True}),
]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats") / "src"
    make_sample_folder(root, 45, 3, seed=7)
    return root


def _numpy_stats(ds) -> tuple[np.ndarray, np.ndarray, Counter, Counter, Counter]:
    """Mean and std over every pixel the reader returns (float64), sizes and labels."""
    total = squares = None
    count = 0
    heights, widths, labels = Counter(), Counter(), Counter()
    for i in range(len(ds)):
        image, label = ds[i]
        planes = image.numpy().reshape(image.shape[0], -1).astype(np.float64)
        total = planes.sum(1) if total is None else total + planes.sum(1)
        squares = (planes**2).sum(1) if squares is None else squares + (planes**2).sum(1)
        count += planes.shape[1]
        heights[image.shape[1]] += 1
        widths[image.shape[2]] += 1
        labels[int(label)] += 1
    mean = total / count
    std = np.sqrt(squares / count - mean**2)
    return mean / 255, std / 255, heights, widths, labels


@pytest.mark.parametrize(("fmt", "encoding", "extra"), CASES)
def test_stats_equal_numpy_over_the_read_pixels(
    fmt: str, encoding: str, extra: dict, src: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(src, out, fmt, encoding=encoding, progress=False, workers=2, **extra)
    ds = open_dataset(out)
    stats = ds.stats
    assert stats is not None and stats.samples == len(ds) == 45
    mean, std, heights, widths, labels = _numpy_stats(ds)
    assert np.allclose(stats.mean, mean, rtol=0, atol=1e-6)
    assert np.allclose(stats.std, std, rtol=0, atol=1e-6)
    assert stats.heights == heights and stats.widths == widths
    assert stats.per_class == [labels[k] for k in range(len(ds.classes))]
    assert len(stats.mean) == (1 if extra.get("grayscale") else 3)


def test_stats_are_the_same_through_parts_and_shard_sizes(src: Path, tmp_path: Path) -> None:
    whole = convert(src, tmp_path / "whole", "webdataset", progress=False)
    small = convert(src, tmp_path / "small", "webdataset", shard_size=20_000, progress=False)
    assert len(small.files) > 1
    parts = []
    for part in range(3):
        parts.append(tmp_path / f"part{part}")
        convert(src, parts[-1], "webdataset", num_parts=3, part=part, progress=False)
    merged = merge(parts, tmp_path / "merged", progress=False)
    assert whole.stats == small.stats == merged.stats
    assert merged.stats is not None and merged.stats["samples"] == 45


def test_no_stats_keeps_sizes_and_classes_and_says_so(src: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "o"), "--format", "lmdb", "-q", "--no-stats"]
    )
    assert result.exit_code == 0, result.output
    stats = open_dataset(tmp_path / "o").stats
    assert stats is not None and stats.mean is None and stats.samples == 45
    assert sum(stats.per_class) == 45
    info = CliRunner().invoke(main, ["info", str(tmp_path / "o")])
    assert "mean/std:  not measured (converted with --no-stats)" in info.output
    with pytest.raises(OptionError, match="--no-stats"):
        DeviceLoader(tmp_path / "o", device="cpu", dtype=torch.float32, normalize="dataset")


def test_info_prints_the_normalize_line_and_the_preview_command(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "o", "pt", encoding="raw", size=16, progress=False)
    stats = open_dataset(tmp_path / "o").stats
    result = CliRunner().invoke(main, ["info", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert f"normalize: {stats.normalize_line()}" in result.output
    assert "height:    16 (every sample)" in result.output
    assert f"preview:   imgpack preview {tmp_path / 'o'}" in result.output


def test_an_output_made_before_stats_has_none_and_says_so(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "old"
    convert(src, out, "pt", encoding="raw", size=16, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    del manifest["stats"]  # what imgpack wrote before it recorded statistics
    (out / "imgpack.json").write_text(json.dumps(manifest))
    assert open_dataset(out).stats is None
    result = CliRunner().invoke(main, ["info", str(out)])
    assert "stats:     none (made before imgpack recorded them" in result.output
    with pytest.raises(OptionError, match="made before imgpack recorded them"):
        DeviceLoader(out, device="cpu", dtype=torch.float32, normalize="dataset")


def test_device_loader_normalizes_with_the_recorded_stats(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "o", "pt", encoding="raw", size=16, progress=False)
    ds = open_dataset(tmp_path / "o")
    loader = DeviceLoader(ds, device="cpu", dtype=torch.float32, normalize="dataset",
                          shuffle=False, progress=False)  # fmt: skip
    images, _ = next(iter(loader))
    mean = torch.tensor(ds.stats.mean).reshape(1, -1, 1, 1)
    std = torch.tensor(ds.stats.std).reshape(1, -1, 1, 1)
    raw = torch.stack([ds[i][0] for i in range(len(images))]).float() / 255
    assert torch.allclose(images, (raw - mean) / std, atol=1e-5)
    everything = torch.cat([b for b, _ in DeviceLoader(ds, device="cpu", dtype=torch.float32,
                            normalize="dataset", shuffle=False, progress=False)])  # fmt: skip
    # Over the whole dataset the normalized pixels have mean 0 and std 1, per channel.
    flat = everything.transpose(0, 1).reshape(3, -1).double()
    assert torch.allclose(flat.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(
        flat.std(1, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-5
    )


def test_a_tampered_stats_block_is_a_malformed_manifest(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    convert(src, out, "pt", encoding="raw", size=16, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    manifest["stats"]["samples"] = 44
    (out / "imgpack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code != 0 and "malformed manifest" in result.output


def test_pixel_sums_and_the_combination_are_exact() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in [(5, 7), (9, 2)]]
    tally = DatasetStats.empty(3, 1)
    for image in images:
        tally.add(0, image.shape[0], image.shape[1], pixel_sums(image))
    everything = np.concatenate([i.reshape(-1, 3) for i in images]).astype(np.int64)
    assert tally.sums == everything.sum(0).tolist()
    assert tally.squares == (everything**2).sum(0).tolist()
    again = DatasetStats.from_json(json.loads(json.dumps(tally.to_json())))
    assert again == tally


@pytest.mark.parametrize("built", ["simd", "portable", "numpy"])
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 3), (1, 1), (9, 2, 3), (17, 513, 3), (300, 300), (441, 415, 3), (1000, 3001, 3),
     (5, 7, 4), (0, 4, 3), (33, 97, 2), (2, 16, 3), (3, 32, 4)],
)  # fmt: skip
def test_pixel_sums_are_exact_for_any_shape(
    shape: tuple[int, ...], built: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sums of values and of squares, per channel, as exact integers, by the C extension (its
    AVX2 path where the CPU has one, and its portable one) and by numpy alone: images smaller
    than a block row or a run of lanes, exactly one AVX2 run, with a tail, gray (counted as 3
    channels when read as RGB), gray with alpha, RGBA, empty, larger than a block, a strided
    view, and the largest values everywhere (no column or lane sum overflows)."""
    from imgpack import images

    if built == "numpy":
        monkeypatch.setattr(images, "_pixelsums", None)
    elif built == "portable":
        assert images._pixelsums is not None
        built_in = images._pixelsums

        class Portable:
            @staticmethod
            def sums(buffer: Any, depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
                return built_in.sums(buffer, depth, True)

        monkeypatch.setattr(images, "_pixelsums", Portable)
    rng = np.random.default_rng(len(shape) * 1000 + shape[0])
    image = rng.integers(0, 256, size=shape, dtype=np.uint8)
    for pixels in (image, np.full_like(image, 255), image[::2, ::3]):
        values = pixels.reshape(-1, 1 if pixels.ndim == 2 else pixels.shape[2]).astype(np.int64)
        sums, squares = values.sum(0).tolist(), (values**2).sum(0).tolist()
        assert pixel_sums(pixels) == (tuple(sums), tuple(squares))
        if pixels.ndim == 2:
            assert pixel_sums(pixels, 3) == (tuple(sums * 3), tuple(squares * 3))


def test_the_pixel_sums_extension_is_built_where_a_c_compiler_is() -> None:
    """``imgpack._pixelsums`` needs only a C compiler (this suite's machines and CI have one:
    the conversions below sum through it, not the fallback)."""
    import shutil

    from imgpack import images

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the sums are numpy's")
    assert images._pixelsums is not None


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s, m: s.update(samples=s["samples"] - 1), "samples"),
        (lambda s, m: s["width"]["counts"][0].__setitem__(1, s["width"]["counts"][0][1] + 1),
         "do not count"),
        (lambda s, m: s.update(pixels=s["pixels"] * 2), "stats.pixels"),
        (lambda s, m: s.update(channels=1, sum=s["sum"][:1], sum_of_squares=s["sum_of_squares"][:1]),
         "stats.channels is 1, the output has 3"),
        (lambda s, m: s.update(sum=[10**400] * 3), "digits"),
        (lambda s, m: s.update(sum=[s["pixels"] * 256] * 3), "not sums of"),
        (lambda s, m: m.update(num_samples=m["num_samples"] + 0) or s["height"]["counts"].append([99, 0]),
         "other than the output's 16x16"),
    ],
)  # fmt: skip
def test_a_manifest_whose_stats_contradict_it_is_refused_by_name(
    src: Path, tmp_path: Path, edit: object, words: str
) -> None:
    """Checked against the manifest before anything uses them: info and ds.stats name the
    field in one line (no OverflowError traceback for a sum of 10**400)."""
    out = tmp_path / "o"
    convert(src, out, "pt", encoding="raw", size=16, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    edit(manifest["stats"], manifest)  # type: ignore[operator]
    (out / "imgpack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "malformed manifest" in result.output and words in result.output, result.output
    with pytest.raises(ManifestError, match="malformed manifest"):
        open_dataset(out)


def test_per_class_counts_against_the_labels_are_checked_before_use(
    src: Path, tmp_path: Path
) -> None:
    """A manifest whose per-class counts add up but contradict the labels the output holds
    (a sample moved from one class's count to another's) is refused by ds.stats, naming the
    manifest."""
    out = tmp_path / "o"
    convert(src, out, "pt", encoding="raw", size=16, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    counts = manifest["stats"]["per_class"]
    manifest["stats"]["per_class"] = [counts[0] - 1, counts[1] + 1, *counts[2:]]
    (out / "imgpack.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="stats count samples per class"):
        open_dataset(out).stats  # noqa: B018
