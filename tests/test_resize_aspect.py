"""Conversion that keeps the aspect ratio: ``--resize shorter`` (the shorter side to exactly N,
as torchvision's ``Resize(N)``) and ``--resize longer`` (the longer side at most N, as FFCV's
``max_resolution``), through every format and the encodings that hold images of different
sizes; ``raw`` refuses them in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import jpeg_bytes, png_bytes, reference_pixels, smooth_rgb
from PIL import Image

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import OptionError
from imgpack.images import ImagePolicy

#: (height, width) of the sources: landscape, portrait, far from square, small, at 20 already.
SIZES = [(30, 40), (40, 30), (16, 64), (10, 12), (20, 20), (20, 33)]


def torchvision_size(height: int, width: int, n: int) -> tuple[int, int]:
    """torchvision's ``Resize(n)`` output size, as its ``_compute_resized_output_size`` says."""
    short, long = min(height, width), max(height, width)
    new_short, new_long = n, int(n * long / short)
    return (new_short, new_long) if height <= width else (new_long, new_short)


def ffcv_size(height: int, width: int, n: int) -> tuple[int, int]:
    """The longer side at most ``n``, the other one scaled and floored; smaller kept."""
    if max(height, width) <= n:
        return height, width
    return (n, width * n // height) if height >= width else (height * n // width, n)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("aspect") / "src"
    rng = np.random.default_rng(0)
    for k, (height, width) in enumerate(SIZES):
        folder = root / ("a" if k % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(smooth_rgb(rng, height, width))
        (folder / f"{k}.png").write_bytes(png_bytes(img))
        (folder / f"{k}j.jpg").write_bytes(jpeg_bytes(img))
    return root


def _size(path: Path) -> tuple[int, int]:
    with Image.open(path) as img:
        return img.height, img.width


def _sources(src: Path) -> list[Path]:
    return sorted(src.rglob("*.*"), key=lambda p: (p.parent.name, p.name))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["shorter", "longer"])
def test_every_format_stores_the_aspect_kept_pixels(
    src: Path, tmp_path: Path, fmt: str, mode: str
) -> None:
    out = tmp_path / "out"
    convert(src, out, fmt, encoding="original", size=20, resize=mode, progress=False)
    ds = open_dataset(out)
    assert ds.image_shape is None  # sizes vary
    image = ds.manifest.image
    assert (image["height"], image["width"], image["resize"], image["size"]) == (
        None, None, mode, 20,
    )  # fmt: skip
    expected_size = torchvision_size if mode == "shorter" else ffcv_size
    kept = resized = 0
    for index, (path, sample) in enumerate(zip(_sources(src), ds.encoded(0, len(ds)), strict=True)):
        height, width = _size(path)
        target = expected_size(height, width, 20)
        pixels = ds[index][0].permute(1, 2, 0).numpy()
        assert pixels.shape[:2] == target, (path, pixels.shape)
        if target == (height, width):  # not resized: the source's bytes, kept
            assert sample.payload == path.read_bytes(), path
            kept += 1
            continue
        resized += 1
        reference = Image.fromarray(reference_pixels(path)).resize(
            target[::-1], Image.Resampling.BILINEAR
        )
        assert np.array_equal(pixels, np.asarray(reference)), path  # a lossless PNG of them
    assert kept and resized


@pytest.mark.parametrize("encoding", ["jpeg", "png"])
def test_re_encoded_outputs_have_the_same_sizes(src: Path, tmp_path: Path, encoding: str) -> None:
    out = tmp_path / "out"
    convert(src, out, "pt", encoding=encoding, size=20, resize="shorter", progress=False)
    ds = open_dataset(out)
    for index, path in enumerate(_sources(src)):
        height, width = _size(path)
        pixels = ds[index][0].permute(1, 2, 0).numpy().astype(np.int64)
        target = torchvision_size(height, width, 20)
        assert pixels.shape[:2] == target
        reference = np.asarray(
            Image.fromarray(reference_pixels(path)).resize(target[::-1], Image.Resampling.BILINEAR),
            np.int64,
        )
        if encoding == "png":  # lossless; a JPEG source's pixels are its decode's
            assert np.array_equal(pixels, reference) or path.suffix == ".jpg"
        assert np.abs(pixels - reference).mean() < 6  # JPEG at quality 90


def test_the_sizes_are_torchvisions_and_ffcvs_on_awkward_ratios() -> None:
    for height in range(1, 90, 7):
        for width in range(1, 90, 5):
            for n in (1, 7, 32, 224):
                shorter = ImagePolicy(size=n, resize="shorter").target_size(height, width)
                assert (shorter or (height, width)) == torchvision_size(height, width, n)
                longer = ImagePolicy(size=n, resize="longer").target_size(height, width)
                assert (longer or (height, width)) == ffcv_size(height, width, n) or min(
                    ffcv_size(height, width, n)
                ) == 0  # a sliver floored to 0 is kept at 1 pixel
                assert min(longer or (1, 1)) >= 1


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (
            {"encoding": "raw", "size": 20, "resize": "shorter"},
            "encoding 'raw' needs one image size",
        ),
        ({"resize": "longer"}, "--resize longer needs --size N"),
        ({"size": "20x30", "resize": "shorter"}, "give one side, --size N, not 20x30"),
    ],
)
def test_what_cannot_keep_the_aspect_is_refused_in_one_line(
    src: Path, tmp_path: Path, options: dict[str, object], says: str
) -> None:
    with pytest.raises(OptionError, match=says):
        convert(src, tmp_path / "out", "pt", progress=False, **options)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
    flags = [f"--{k}={v}" for k, v in options.items()]
    args = ["convert", str(src), str(tmp_path / "out"), "--format", "pt", *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output


def test_info_and_the_dry_run_say_the_policy(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = CliRunner()
    args = ["convert", str(src), str(out), "--format", "pt", "--size", "20", "--resize", "longer"]
    args.append("-q")
    planned = runner.invoke(main, [*args, "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert "stored at longer side at most 20 (aspect kept" in planned.output
    assert runner.invoke(main, args).exit_code == 0
    shown = runner.invoke(main, ["info", str(out)])
    assert "image:     longer side at most 20 (aspect kept" in shown.output
    manifest = json.loads((out / "imgpack.json").read_text())
    heights, widths = manifest["stats"]["height"], manifest["stats"]["width"]
    assert max(heights["max"], widths["max"]) == 20 and heights["min"] == 5  # 16x64 -> 5x20


def test_crop_and_stretch_outputs_are_the_same_bytes_as_before(src: Path, tmp_path: Path) -> None:
    """The manifest's image of a fixed size has no "size" key: outputs and ids as before."""
    assert ImagePolicy(size=20).describe() == {
        "height": 20,
        "width": 20,
        "channels": 3,
        "resize": "crop",
        "resample": "bilinear",
        "background": [255, 255, 255],
    }
    convert(src, tmp_path / "out", "pt", size=20, progress=False)
    assert "size" not in json.loads((tmp_path / "out" / "imgpack.json").read_text())["image"]
