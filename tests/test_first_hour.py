"""What a new user meets first: messages and exits are the same for every destination, advice
comes once, in one line (tests/test_docs.py runs every page's code blocks as written)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.errors import OptionError

ROOT = Path(__file__).resolve().parent.parent


def test_device_loader_without_cuda_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from imgpack.loading import DeviceLoader

    src = build_uniform_folder(tmp_path / "images", count=4, size=8)
    convert(src, tmp_path / "out", format="pt", encoding="raw", size=8, progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptionError, match=r"no usable CUDA device.*device='cpu'"):
        DeviceLoader(tmp_path / "out", device="cuda", progress=False)


ADVICE = """
import warnings
from torch.utils.data import DataLoader
from imgpack import open_dataset
from imgpack.loading import Loader
from imgpack.readers import collate
ds = open_dataset(OUT)
for epoch in range(3):  # the loader advises (once per reader), never a read
    for _ in Loader(ds, batch_size=2, num_workers=1, collate_fn=collate):
        pass
for _ in DataLoader(ds, batch_size=2, num_workers=1, collate_fn=collate):
    pass  # a plain DataLoader's reads give no advice
"""


def test_the_num_workers_advice_is_one_line_once(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "images", count=12, size=8)
    out = tmp_path / "out"
    convert(src, out, format="pt", encoding="raw", size=8, progress=False)
    code = ADVICE.replace("OUT", repr(str(out)))
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "PerformanceWarning" in lines[0]
        and "imgpack tune" in lines[0]
        and "num_workers=0" not in lines[0]
    )


def test_destinations_get_the_same_words(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "images", count=6, size=8)
    runner = CliRunner()
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(main, ["convert", str(src), str(empty), "--format", "pt", "-q"])
    assert result.exit_code == 0, result.output
    assert len(open_dataset(empty)) == 6
    again = runner.invoke(main, ["convert", str(src), str(empty), "--format", "pt", "-q"])
    assert again.exit_code == 1 and "already exists (use --overwrite to replace it)" in again.output
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for extra in ([], ["--overwrite"]):
        refused = runner.invoke(main, ["convert", str(src), str(mine), "--format", "pt", *extra])
        assert refused.exit_code == 1
        assert "is not an imgpack output; refusing to replace it, with or without" in (
            refused.output
        )
    url = f"memory://first-hour-{tmp_path.name}/out"
    assert runner.invoke(main, ["convert", str(src), url, "--format", "pt", "-q"]).exit_code == 0
    bucket = runner.invoke(main, ["convert", str(src), url, "--format", "pt", "-q"])
    assert bucket.exit_code == 1
    assert f"{url}: already exists (use --overwrite to replace it)" in bucket.output


def test_help_names_what_each_command_takes() -> None:
    runner = CliRunner()
    assert "WebDataset" in runner.invoke(main, ["--help"]).output
    for command in ("info", "verify", "tune", "profile"):
        usage = runner.invoke(main, [command, "--help"]).output.splitlines()[0]
        assert usage.endswith("OUTPUT"), usage


def test_sample_makes_split_folders_that_convert_with_splits(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(
        main, ["sample", str(tmp_path / "dataset"), "--images", "10", "--splits", "train,val"]
    )
    assert made.exit_code == 0, made.output
    assert sorted(p.name for p in (tmp_path / "dataset").iterdir()) == ["train", "val"]
    args = ["convert", str(tmp_path / "dataset"), str(tmp_path / "out"), "-q", "--splits"]
    done = runner.invoke(main, [*args, "--format", "pt"])
    assert done.exit_code == 0, done.output
    train, val = open_dataset(tmp_path / "out" / "train"), open_dataset(tmp_path / "out" / "val")
    assert len(train) == len(val) == 10 and train.classes == val.classes
    assert train[0][0].numpy().tobytes() != val[0][0].numpy().tobytes()  # their own seeds
    bad = runner.invoke(main, ["sample", str(tmp_path / "x"), "--splits", "a,a"])
    assert bad.exit_code == 2 and "distinct non-empty names" in bad.output


def test_a_bucket_without_credentials_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("s3fs", reason="pip install 'imgpack[s3]'")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: no credentials
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    done = subprocess.run(
        [sys.executable, "-m", "imgpack.cli", "info", "s3://bucket/cats"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: object storage: Unable to locate credentials (check the credentials and the "
        "endpoint: AWS_* variables or --storage-option, see docs/storage.md)"
    )
