"""Trust, third pass (#55): the wrong thing given to a command, bench on a damaged folder and
its bounded defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder

from imgpack.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("t") / "images", count=8, size=8)


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "{f}"],
        ["info", "{f}"],
        ["tune", "{f}"],
        ["profile", "{f}"],
        ["preview", "{f}", "-o", "{tmp}/p.png"],
        ["export", "{f}", "{tmp}/e"],
        ["merge", "{f}", "{f}", "{tmp}/m"],
    ],
)
def test_a_command_given_an_image_folder_says_so_in_one_line(
    args: list[str], folder: Path, tmp_path: Path
) -> None:
    argv = [a.format(f=folder, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert f"{folder}: an image folder (class folders of images), not an imgpack output" in lines[0]
    assert f"imgpack convert {folder} OUT" in lines[0] and "DAMAGED" not in lines[0]


def test_a_folder_of_nothing_is_not_called_interrupted_first(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert result.exit_code == 1
    assert "not an imgpack output (no imgpack.json): give the folder imgpack convert wrote" in (
        result.output
    )


def test_a_flat_folder_of_images_is_pointed_to_no_labels(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "f", count=2, size=8)
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, image in enumerate(sorted(src.rglob("*.png"))):
        image.rename(flat / f"{i}.png")
        (flat / f"{i}.txt").write_text("a caption")
    result = CliRunner().invoke(main, ["convert", str(flat), str(tmp_path / "o"), "--format", "pt"])
    assert result.exit_code == 1
    assert "to convert its 2 image(s) without labels, add --no-labels" in result.output


@pytest.mark.parametrize("workers", ["0", "2"])
def test_bench_names_a_damaged_image_of_a_folder_in_one_line(tmp_path: Path, workers: str) -> None:
    src = build_uniform_folder(tmp_path / "images", count=6, size=8)
    victim = sorted(src.rglob("*.png"))[2]
    victim.write_bytes(victim.read_bytes()[:40])
    result = CliRunner().invoke(main, ["bench", str(src), "--workers", workers, "-q"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert f"{victim}: cannot be decoded" in lines[0]


def test_bench_defaults_scale_with_the_output_and_show_progress(
    folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert (
        CliRunner().invoke(main, ["convert", str(folder), str(out), "--format", "pt"]).exit_code
        == 0
    )
    report = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", str(out), "--workers", "0", "--batch-size", "4",
                                       "--json", str(report)])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(report.read_text())
    samples = rows[0]["samples"]
    assert samples <= 3 * 8  # three epochs of an 8-image output, not 20,000 samples
    assert "bench:" in result.output  # the progress bar, on stderr
    quiet = CliRunner().invoke(
        main, ["bench", str(out), "--workers", "0", "-q", "--seconds", "0.01"]
    )
    assert quiet.exit_code == 0 and "bench:" not in quiet.output


def test_info_escapes_class_names(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=3, size=8)
    names = ["\x1b[31mred", "a\nsamples:   999", "rtl\u202eoverride"]
    for folder, name in zip(sorted(p for p in src.iterdir() if p.is_dir()), names, strict=False):
        folder.rename(src / name)
    out = tmp_path / "out"
    done = CliRunner().invoke(main, ["convert", str(src), str(out), "--format", "pt", "-q"])
    assert done.exit_code == 0, done.output
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\u202e" not in result.output
    assert "samples:   999" not in result.output.splitlines()
    assert "\\x1b[31mred" in result.output and "rtl\\u202eoverride" in result.output


@pytest.mark.parametrize("shape", [(2, 2), (1, 3)])
def test_an_index_array_of_the_wrong_shape_is_a_type_error(
    folder: Path, tmp_path: Path, shape: tuple[int, int]
) -> None:
    import numpy as np

    from imgpack.readers import open_dataset

    out = tmp_path / "out"
    assert (
        CliRunner().invoke(main, ["convert", str(folder), str(out), "--format", "pt"]).exit_code
        == 0
    )
    ds = open_dataset(out)
    with pytest.raises(TypeError, match="one-dimensional"):
        ds.__getitems__(np.zeros(shape, dtype=np.int64))
    assert len(ds.__getitems__(np.array([0, 1]))) == 2


def test_device_loader_normalizes_into_float32_unless_told(folder: Path, tmp_path: Path) -> None:
    import torch

    from imgpack.loading import DeviceLoader

    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["convert", str(folder), str(out), "--format", "pt",
                                     "--encoding", "raw", "--size", "8"]).exit_code == 0  # fmt: skip
    images, _ = next(iter(DeviceLoader(out, device="cpu", normalize="dataset", progress=False)))
    assert images.dtype == torch.float32
    images, _ = next(iter(DeviceLoader(out, device="cpu", progress=False)))
    assert images.dtype == torch.uint8
    with pytest.raises(Exception, match="cannot hold normalized values"):
        DeviceLoader(out, device="cpu", dtype=torch.uint8, normalize="dataset", progress=False)


@pytest.fixture(scope="module")
def small_output(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("o") / "out"
    assert (
        CliRunner().invoke(main, ["convert", str(folder), str(out), "--format", "pt"]).exit_code
        == 0
    )
    return out


@pytest.mark.parametrize("target", ["{out}/imgpack.json", "{out}/sheet.png", "{tmp}", "/dev/full"])
def test_preview_refuses_an_unwritable_or_inside_target_in_one_line(
    small_output: Path, tmp_path: Path, target: str
) -> None:
    manifest = (small_output / "imgpack.json").read_bytes()
    where = target.format(out=small_output, tmp=tmp_path)
    result = CliRunner().invoke(main, ["preview", str(small_output), "-o", where])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert (small_output / "imgpack.json").read_bytes() == manifest
    assert not (small_output / "sheet.png").exists()


def test_preview_sizes_the_sheet_by_its_longest_row_and_bounds_it(
    small_output: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from imgpack import preview
    from imgpack.readers import open_dataset

    ds = open_dataset(small_output)
    sheet = preview.contact_sheet(ds, per_class=1_000_000)
    per_row = max(sum(1 for t in sheet.tiles if t[1] == name) for name in ds.classes)
    cell = max(ds[i][0].shape[2] for i in range(len(ds)))
    assert sheet.image.width <= 8 + 7 * 24 + per_row * (cell + preview.GAP)
    monkeypatch.setattr(preview, "MAX_PIXELS", 200)
    result = CliRunner().invoke(main, ["preview", str(small_output), "-o", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and "the contact sheet would be too large" in result.output
    assert "--per-class" in result.output and not (tmp_path / "p.png").exists()


def test_a_shard_size_below_an_image_is_said_in_one_line(folder: Path, tmp_path: Path) -> None:
    args = ["convert", str(folder), str(tmp_path / "o"), "--format", "webdataset",
            "--shard-size", "10"]  # fmt: skip
    planned = CliRunner().invoke(main, [*args, "--dry-run"])
    assert planned.exit_code == 0
    assert "warning:   --shard-size 10 B is smaller than an image" in planned.output
    done = subprocess.run([sys.executable, "-m", "imgpack", *args, "-q"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "--shard-size 10 B" in line]
    assert len(warned) == 1 and "a shard of its own" in warned[0]


def test_two_paths_to_one_file_in_a_label_list_are_refused_by_line(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "f", count=2, size=8)
    images = sorted(src.rglob("*.png"))
    img = tmp_path / "img"
    img.mkdir()
    for i, image in enumerate(images):
        image.rename(img / f"{i}.png")
    listing = tmp_path / "labels.csv"
    listing.write_text("path,label\nimg/0.png,a\n./img/0.png,a\nimg/1.png,b\nimg/../img/1.png,b\n")
    out = tmp_path / "o"
    refused = CliRunner().invoke(main, ["convert", str(listing), str(out), "--format", "pt"])
    assert refused.exit_code == 1 and "line 3" in refused.output
    assert "./img/0.png is the file img/0.png names, listed on line 2" in refused.output
    done = CliRunner().invoke(main, ["convert", str(listing), str(out), "--format", "pt",
                                     "--on-error", "skip"])  # fmt: skip
    assert done.exit_code == 0, done.output
    from imgpack.readers import open_dataset

    assert len(open_dataset(out)) == 2
    skipped = json.loads((out / "imgpack.json").read_text())["skipped"]
    assert len(skipped) == 2 and "img/../img/1.png is the file img/1.png names" in str(skipped)


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "7", "null"])
def test_a_checkpoint_that_is_not_an_object_is_no_checkpoint(tmp_path: Path, text: str) -> None:
    """Not resumable, and no traceback: a run over it starts afresh (the checkpoint's checksum
    is read from an object only)."""
    from imgpack.pipeline import CHECKPOINT, Checkpoint

    (tmp_path / CHECKPOINT).write_text(text)
    assert Checkpoint.load(tmp_path) is None
