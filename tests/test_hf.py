"""Hugging Face datasets, offline: a Dataset or DatasetDict saved to disk converts like a folder
(image and ClassLabel columns found by type, the ClassLabel's order kept, splits like --splits),
a Dataset object converts from memory, and to_hf gives back equal pixels and labels."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from imgpack import convert, convert_splits, open_dataset, to_hf
from imgpack.cli import main
from imgpack.errors import ScanError

datasets = pytest.importorskip("datasets", reason="pip install 'imgpack[hf]' (test.sh does)")

NAMES = ["zebra", "ant", "moth"]  # not sorted: the ClassLabel's order is the label map


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _dataset(seed: int, count: int) -> object:
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(count):
        pixels = rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)
        data = _png(pixels) if i % 2 else _jpeg(pixels)
        images.append({"bytes": data, "path": f"img{seed}-{i}.{'png' if i % 2 else 'jpg'}"})
        labels.append(int(rng.integers(0, 2)))  # never the last class: it stays empty
    features = datasets.Features(
        {"picture": datasets.Image(), "kind": datasets.ClassLabel(names=NAMES)}
    )
    return datasets.Dataset.from_dict({"picture": images, "kind": labels}, features=features)


def _pixels(image: object) -> np.ndarray:
    return np.asarray(image.convert("RGB"))  # type: ignore[attr-defined]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    dd = datasets.DatasetDict({"train": _dataset(1, 12), "test": _dataset(2, 6)})
    dd.save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_a_dataset_dict_round_trips_through_imgpack(saved: Path, tmp_path: Path) -> None:
    refused = CliRunner().invoke(
        main, ["convert", str(saved), str(tmp_path / "x"), "--format", "pt"]
    )
    assert (
        refused.exit_code == 1 and "DatasetDict" in refused.output and "--splits" in refused.output
    )
    result = CliRunner().invoke(
        main, ["convert", str(saved), str(tmp_path / "out"), "--format", "lmdb", "--splits", "-q"]
    )
    assert result.exit_code == 0, result.output
    original = datasets.load_from_disk(str(saved))
    for split in ("train", "test"):
        ds = open_dataset(tmp_path / "out" / split)
        assert ds.classes == NAMES
        assert ds.targets == original[split]["kind"]
        back = to_hf(tmp_path / "out" / split, cache_dir=str(tmp_path / "cache"))
        assert back.features["label"].names == NAMES
        assert back["label"] == original[split]["kind"]
        for row, (image, _) in zip(original[split], ds, strict=True):
            assert np.array_equal(_pixels(row["picture"]), image.permute(1, 2, 0).numpy())
        for row, again in zip(original[split], back, strict=True):
            assert np.array_equal(_pixels(row["picture"]), _pixels(again["image"]))
            assert row["kind"] == again["label"]


def test_a_saved_dataset_and_a_dataset_object(tmp_path: Path) -> None:
    ds = _dataset(3, 8)
    ds.save_to_disk(str(tmp_path / "one"))
    manifest = convert(tmp_path / "one", tmp_path / "out", "pt", progress=False)
    assert manifest.classes == NAMES and manifest.num_samples == 8
    assert manifest.source["converted_from"]["image_column"] == "picture"
    assert open_dataset(tmp_path / "out").samples[0][0].endswith("img3-0.jpg")
    picked = ds.select([1, 3, 5])  # a selection of rows converts as itself
    convert(picked, tmp_path / "picked", "hdf5", progress=False)
    got = open_dataset(tmp_path / "picked")
    assert got.targets == picked["kind"]
    for row, (image, _) in zip(picked, got, strict=True):
        assert np.array_equal(_pixels(row["picture"]), image.permute(1, 2, 0).numpy())
    assert not any(p.name.endswith(".imgpack-hf") for p in tmp_path.iterdir())


def test_columns_by_name_and_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    plain = datasets.Dataset.from_dict(
        {
            "img": [{"bytes": _png(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)), "path": None}
                    for _ in range(3)],
            "y": [2, 0, 2],
        },
        features=datasets.Features({"img": datasets.Image(), "y": datasets.Value("int64")}),
    )  # fmt: skip
    plain.save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(ScanError, match="no column of type ClassLabel"):
        convert(tmp_path / "plain", tmp_path / "out", "pt", progress=False)
    result = CliRunner().invoke(
        main,
        ["convert", str(tmp_path / "plain"), str(tmp_path / "out"), "--format", "pt",
         "--label-column", "y", "-q"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ds = open_dataset(tmp_path / "out")
    assert ds.classes == ["0", "1", "2"] and ds.targets == [2, 0, 2]
    assert ds.samples[0][0].endswith("2/00000000.png")


def test_splits_of_a_dataset_dict_by_name(saved: Path, tmp_path: Path) -> None:
    done = convert_splits(saved, tmp_path / "out", "pt", splits=["test"], progress=False)
    assert list(done) == ["test"] and done["test"].classes == NAMES
