"""Split folders: ROOT/train, ROOT/val, ... converted into DST/<split> with ONE label map (the
sorted union of the splits' classes), and a ROOT of split folders refused as a class list."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from imgpack import convert, convert_splits, open_dataset
from imgpack.cli import main
from imgpack.errors import ScanError


def _image(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for split, classes in (("train", ("cat", "dog", "bird")), ("val", ("cat", "dog"))):
        for c, name in enumerate(classes):
            for i in range(3):
                _image(root / split / name / f"{i}.png", 10 * c + i)
    return root


def test_splits_share_one_label_map(root: Path, tmp_path: Path) -> None:
    done = convert_splits(root, tmp_path / "out", "pt", progress=False)
    assert list(done) == ["train", "val"]
    train, val = open_dataset(tmp_path / "out" / "train"), open_dataset(tmp_path / "out" / "val")
    assert train.classes == val.classes == ["bird", "cat", "dog"]
    assert val.manifest.source["empty_classes"] == ["bird"]  # missing from val, label kept
    assert sorted(set(val.targets)) == [1, 2] and sorted(set(train.targets)) == [0, 1, 2]
    assert val.samples[0][0].endswith("val/cat/0.png")


def test_the_cli_converts_splits_and_refuses_them_as_classes(root: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(main, ["convert", str(root), str(tmp_path / "x"), "--format", "pt"])
    assert refused.exit_code == 1
    assert "(train, val) are dataset splits, not classes: use --splits" in refused.output
    assert "--no-splits" in refused.output and not (tmp_path / "x").exists()
    with pytest.raises(ScanError, match="dataset splits"):
        convert(root, tmp_path / "y", "pt", progress=False)
    result = runner.invoke(
        main, ["convert", str(root), str(tmp_path / "out"), "--format", "lmdb", "--splits", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "out/train: 9 samples" in result.output and "out/val: 6 samples" in result.output
    named = runner.invoke(
        main,
        ["convert", str(root), str(tmp_path / "only"), "--format", "pt", "--splits", "val", "-q"],
    )
    assert named.exit_code == 0, named.output
    assert [p.name for p in (tmp_path / "only").iterdir()] == ["val"]
    assert open_dataset(tmp_path / "only" / "val").classes == ["cat", "dog"]
    as_classes = runner.invoke(
        main, ["convert", str(root), str(tmp_path / "cls"), "--format", "pt", "--no-splits", "-q"]
    )
    assert as_classes.exit_code == 0, as_classes.output
    assert open_dataset(tmp_path / "cls").classes == ["train", "val"]


def test_a_missing_split_is_named(root: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="test: no such split folder"):
        convert_splits(root, tmp_path / "out", "pt", splits=["train", "test"], progress=False)


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_the_parts_of_splits_write_each_split_as_one_conversion_does(
    root: Path, tmp_path: Path, fmt: str
) -> None:
    """`--splits --num-parts K --part I`: each split's part writes its shards into DST/<split>
    (no merge), and the last part makes each split the single conversion's files, byte for
    byte."""
    whole = tmp_path / "whole"
    convert_splits(root, whole, fmt, shard_size=300, workers=1, progress=False)
    runner = CliRunner()
    for part in (1, 0):
        args = ["convert", str(root), str(tmp_path / "parts"), "--format", fmt, "--splits"]
        args += ["--num-parts", "2", "--part", str(part), "--shard-size", "300", "-q"]
        result = runner.invoke(main, [*args, "--workers", "2"])
        assert result.exit_code == 0, result.output
    for split in ("train", "val"):
        ours, theirs = tmp_path / "parts" / split, whole / split
        names = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in ours.iterdir()) == names and len(names) > 2
        for name in names:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (split, name)
