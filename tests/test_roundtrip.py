"""Every format x every encoding: the pixels read back equal an independent decode of the source."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FakeFolder, reference_pixels

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS

# jpeg at quality 95 (4:2:0 chroma), images upscaled to 48x48 (two hold per-pixel random alpha,
# i.e. noise): mean absolute error per value, and the 99th percentile
# (single values at sharp colour edges can be far off, as chroma subsampling does).
JPEG_MEAN_TOLERANCE = 5.0
JPEG_P99_TOLERANCE = 32

CASES: list[tuple[str, dict[str, Any]]] = [
    ("original", {}),
    ("png", {}),
    ("jpeg", {"quality": 95, "size": 48}),
    ("raw", {"size": (12, 10)}),
    ("png", {"size": 16, "grayscale": True}),
    ("original", {"size": "9x13", "resize": "stretch"}),
]


def _expected(root: Path, rel: str, options: dict[str, Any]) -> np.ndarray:
    size = options.get("size")
    if isinstance(size, int):
        size = (size, size)
    elif isinstance(size, str):
        h, w = size.split("x")
        size = (int(h), int(w))
    if options.get("resize") == "stretch":
        from PIL import Image

        pixels = reference_pixels(root / rel)
        return np.asarray(
            Image.fromarray(pixels).resize((size[1], size[0]), Image.Resampling.BILINEAR)
        )
    return reference_pixels(root / rel, size=size, grayscale=options.get("grayscale", False))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("encoding", "options"), CASES, ids=lambda c: str(c))
def test_round_trip(
    fmt: str, encoding: str, options: dict[str, Any], edge_folder: FakeFolder, tmp_path: Path
) -> None:
    dst = tmp_path / "out"
    manifest = convert(
        edge_folder.root, dst, fmt, encoding=encoding, workers=2, progress=False, **options
    )
    assert manifest.num_samples == len(edge_folder.images)
    ds = open_dataset(dst)
    assert len(ds) == len(edge_folder.images)
    assert ds.classes == edge_folder.classes
    assert ds.class_to_idx == {c: i for i, c in enumerate(edge_folder.classes)}
    assert ds.targets == [label for _, label in edge_folder.images]
    source = edge_folder.root.resolve()
    assert ds.samples == [(os.path.join(source, rel), label) for rel, label in edge_folder.images]
    for i, (rel, label) in enumerate(edge_folder.images):
        image, target = ds[i]
        expected = torch.from_numpy(_expected(edge_folder.root, rel, options).copy()).permute(
            2, 0, 1
        )
        assert target == label, rel
        assert image.dtype == torch.uint8 and image.shape == expected.shape, rel
        if encoding == "jpeg":
            diff = (image.int() - expected.int()).abs()
            assert diff.float().mean() < JPEG_MEAN_TOLERANCE, rel
            assert diff.float().quantile(0.99) <= JPEG_P99_TOLERANCE, rel
        else:
            assert torch.equal(image, expected), rel


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_reads_match_single_reads(
    fmt: str, edge_folder: FakeFolder, tmp_path: Path
) -> None:
    convert(
        edge_folder.root, tmp_path / "raw", fmt, encoding="raw", size=8, progress=False, workers=1
    )
    convert(edge_folder.root, tmp_path / "enc", fmt, encoding="original", progress=False, workers=1)
    for name in ("raw", "enc"):
        ds = open_dataset(tmp_path / name)
        order = [5, 0, 5, len(ds) - 1, 3, -1]
        batch = ds.__getitems__(order)
        assert len(batch) == len(order)
        for got, i in zip(batch, order, strict=True):
            single = ds[i]
            assert torch.equal(got[0], single[0]) and got[1] == single[1]
