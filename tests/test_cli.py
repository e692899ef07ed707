from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FakeFolder, png_bytes
from PIL import Image

from imgpack.cli import main


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_convert_info_bench(uniform_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    code, out = run(
        "convert",
        str(uniform_folder),
        str(dst),
        "--format",
        "pt",
        "--encoding",
        "raw",
        "--size",
        "16",
        "-q",
    )
    assert code == 0, out
    assert "60 samples, 0 skipped" in out
    code, out = run("info", str(dst))
    assert code == 0 and "format:    pt" in out and "samples:   60" in out and "16x16" in out
    code, out = run("info", str(dst), "--json")
    assert json.loads(out)["num_samples"] == 60
    report = tmp_path / "bench.json"
    code, out = run(
        "bench",
        str(uniform_folder),
        str(dst),
        "--workers",
        "0",
        "--samples",
        "64",
        "--json",
        str(report),
    )
    assert code == 0, out
    assert "folder (Pillow)" in out and "pt/raw" in out
    rows = json.loads(report.read_text())
    assert [r["name"] for r in rows] == ["folder (Pillow)", "pt/raw"]
    assert all(r["samples"] >= 64 and r["samples_per_s"] > 0 for r in rows)


def test_bench_draws_its_table(
    uniform_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chart = tmp_path / "bench.png"
    args = ["bench", str(uniform_folder), "--workers", "0,1", "--samples", "32"]
    code, out = run(*args, "--plot", str(chart))
    assert code == 0, out
    assert f"chart: {chart}" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(chart) as img:
        assert img.width > 400 and img.height > 100
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the [plot] extra
    code, out = run(*args, "--plot", str(tmp_path / "again.png"))
    assert code != 0 and "pip install 'imgpack[plot]'" in out and "Traceback" not in out
    assert not (tmp_path / "again.png").exists()


def test_many_skipped_files_are_summarised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("imgpack.cli.SHOW_SKIPPED", 2)
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(5):
        (src / f"bad{i}.png").write_text("text")
    (src / "good.png").write_bytes(png_bytes(Image.new("RGB", (4, 4))))
    code, out = convert_skipping(tmp_path / "src", tmp_path / "o")
    assert code == 0, out
    assert out.count("  skipped ") == 2 and "... and 3 more skipped" in out


def convert_skipping(src: Path, dst: Path) -> tuple[int, str]:
    return run("convert", str(src), str(dst), "--format", "pt", "--on-error", "skip", "-q")


def test_skip_is_reported(bad_folder: FakeFolder, tmp_path: Path) -> None:
    code, out = convert_skipping(bad_folder.root, tmp_path / "o")
    assert code == 0, out
    assert "3 skipped" in out and "skipped cat/zero.jpg: empty file" in out


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["convert", "{missing}", "{dst}", "--format", "pt"], "no such folder", 1),
        (["convert", "{file}", "{dst}", "--format", "pt"], "not a folder", 2),
        (
            ["convert", "{src}", "{dst}", "--format", "zip"],
            "Invalid value for '--format': 'zip'",
            2,
        ),
        (
            ["convert", "{src}", "{dst}", "--format", "pt", "--encoding", "raw"],
            "needs a fixed image size",
            2,
        ),
        (["convert", "{src}", "{existing}", "--format", "pt"], "already exists", 1),
        (["convert", "{src}", "{dst}", "--format", "pt", "--size", "big"], "invalid image size", 2),
        (
            ["convert", "{src}", "{dst}", "--format", "pt", "--shard-size", "1XB"],
            "invalid shard size",
            2,
        ),
        (["convert", "{src}", "{dst}", "--format", "pt", "-o", "nokey"], "expected KEY=VALUE", 2),
        (
            ["convert", "{bad}", "{dst}", "--format", "pt", "-q"],
            "zero.jpg: empty file (0 bytes)",
            1,
        ),
        (["info", "{missing}"], "no such imgpack output", 1),
        (["info", "{src}"], "not an imgpack output", 1),
        (["bench", "{src}", "--workers", "x"], "expected worker counts", 2),
    ],
)
def test_bad_input_is_one_line_without_traceback(
    args: list[str],
    message: str,
    code: int,
    uniform_folder: Path,
    bad_folder: FakeFolder,
    tmp_path: Path,
) -> None:
    (tmp_path / "file.png").write_bytes(b"x")
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")  # an empty folder would be used
    paths = {
        "missing": str(tmp_path / "missing"),
        "file": str(tmp_path / "file.png"),
        "src": str(uniform_folder),
        "bad": str(bad_folder.root),
        "dst": str(tmp_path / "dst"),
        "existing": str(tmp_path / "existing"),
    }
    exit_code, out = run(*[a.format(**paths) for a in args])
    assert exit_code == code, out
    assert message in out
    assert "Traceback" not in out
    assert not (tmp_path / "dst").exists()


def test_sample_command(tmp_path: Path) -> None:
    code, out = run("sample", str(tmp_path / "s"), "--images", "12", "--classes", "3")
    assert code == 0, out
    assert len(list((tmp_path / "s").rglob("*.*"))) == 12
    code, out = run("sample", str(tmp_path / "s"))
    assert code == 1 and "not empty" in out


def test_real_subprocess(uniform_folder: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    cmd = [
        sys.executable,
        "-m",
        "imgpack.cli",
        "convert",
        str(uniform_folder),
        str(tmp_path / "o"),
        "--format",
        "pt",
        "--workers",
        "2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "60 samples" in done.stderr and "img/s" in done.stderr  # summary and tqdm's rate
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'o'}: already exists (use --overwrite to replace it)"
    ]
