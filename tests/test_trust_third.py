"""Trust, third pass (#55): the wrong thing given to a command, bench on a damaged folder and
its bounded defaults."""

from __future__ import annotations

import json
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
    samples = rows[0]["samples"] if isinstance(rows, list) else rows["results"][0]["samples"]
    assert samples <= 3 * 8  # three epochs of an 8-image output, not 20,000 samples
    assert "bench:" in result.output  # the progress bar, on stderr
    quiet = CliRunner().invoke(
        main, ["bench", str(out), "--workers", "0", "-q", "--seconds", "0.01"]
    )
    assert quiet.exit_code == 0 and "bench:" not in quiet.output
