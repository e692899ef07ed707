"""DeviceLoader on the CPU: the same code path as on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgpack import convert, open_dataset
from imgpack.errors import ImgpackError, OptionError
from imgpack.loading.gpu import random_crop
from imgpack.readers import DeviceLoader, collate


@pytest.fixture
def raw(uniform_folder: Path, tmp_path: Path) -> Path:
    convert(uniform_folder, tmp_path / "raw", "pt", encoding="raw", size=16, progress=False)
    return tmp_path / "raw"


def everything(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ds = open_dataset(path)
    return collate(ds.__getitems__(range(len(ds))))  # type: ignore[return-value]


def keys(images: torch.Tensor) -> list[bytes]:
    return [img.contiguous().numpy().tobytes() for img in images]


def epoch(loader: DeviceLoader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def test_every_sample_once_per_epoch_with_its_label(raw: Path) -> None:
    images, labels = everything(raw)
    loader = DeviceLoader(raw, device="cpu", batch_size=7, progress=False)
    assert len(loader) == 9 and loader.images.dtype == torch.uint8
    got, got_labels = epoch(loader)
    assert sorted(keys(got)) == sorted(keys(images))
    by_key = dict(zip(keys(images), labels.tolist(), strict=True))
    assert [by_key[k] for k in keys(got)] == got_labels.tolist()


def test_order_per_epoch_and_seed(raw: Path) -> None:
    a = DeviceLoader(raw, device="cpu", batch_size=8, seed=1, progress=False)
    b = DeviceLoader(raw, device="cpu", batch_size=8, seed=1, progress=False)
    c = DeviceLoader(raw, device="cpu", batch_size=8, seed=2, progress=False)
    first = keys(epoch(a)[0])
    assert first == keys(epoch(b)[0])  # same seed, same order
    assert first != keys(epoch(c)[0])  # another seed
    a.set_epoch(1)
    second = keys(epoch(a)[0])
    assert second != first and sorted(second) == sorted(first)
    a.set_epoch(0)
    assert keys(epoch(a)[0]) == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtype_and_normalize(raw: Path, dtype: torch.dtype) -> None:
    images, _ = everything(raw)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    loader = DeviceLoader(
        raw, device="cpu", shuffle=False, dtype=dtype, normalize=(mean, std), progress=False
    )
    got, _ = epoch(loader)
    reference = (images.double() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std
    ).view(1, 3, 1, 1)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), reference, atol=tolerance)
    plain = DeviceLoader(raw, device="cpu", shuffle=False, dtype=dtype, progress=False)
    assert torch.allclose(epoch(plain)[0].double(), images.double() / 255, atol=tolerance / 10)


def test_horizontal_flip(raw: Path) -> None:
    images, _ = everything(raw)
    flipped = DeviceLoader(raw, device="cpu", shuffle=False, hflip=1.0, progress=False)
    assert torch.equal(epoch(flipped)[0], images.flip(-1))
    some = DeviceLoader(raw, device="cpu", shuffle=False, hflip=0.5, progress=False)
    got = epoch(some)[0]
    same = [torch.equal(g, i) for g, i in zip(got, images, strict=True)]
    mirrored = [torch.equal(g, i.flip(-1)) for g, i in zip(got, images, strict=True)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True)) and any(same) and any(mirrored)


def test_random_crop_takes_windows_of_the_padded_image(raw: Path) -> None:
    images, _ = everything(raw)
    pad = 2
    loader = DeviceLoader(raw, device="cpu", shuffle=False, crop_padding=pad, progress=False)
    got = epoch(loader)[0]
    assert got.shape == images.shape
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    offsets = set()
    for out, source in zip(got, padded, strict=True):
        matches = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out, source[:, dy : dy + 16, dx : dx + 16])
        ]
        assert matches
        offsets.update(matches)
    assert len(offsets) > 5  # offsets really vary
    assert torch.equal(random_crop(images, 0), images)


def test_drop_last(raw: Path) -> None:
    keep = DeviceLoader(raw, device="cpu", batch_size=25, progress=False)
    drop = DeviceLoader(raw, device="cpu", batch_size=25, drop_last=True, progress=False)
    assert len(keep) == 3 and [len(b[0]) for b in keep] == [25, 25, 10]
    assert len(drop) == 2 and [len(b[0]) for b in drop] == [25, 25]


def test_ddp_split_is_disjoint_and_complete(raw: Path) -> None:
    images, _ = everything(raw)
    parts = [
        keys(
            epoch(DeviceLoader(raw, device="cpu", rank=r, world_size=3, ddp=True, progress=False))[
                0
            ]
        )
        for r in range(3)
    ]
    flat = [k for part in parts for k in part]
    assert len(flat) == len(set(flat)) == len(images)
    assert sorted(flat) == sorted(keys(images))
    with pytest.raises(OptionError, match=r"torch\.distributed"):
        DeviceLoader(raw, device="cpu", ddp=True, progress=False)


def test_refuses_what_does_not_fit_with_the_numbers(raw: Path) -> None:
    with pytest.raises(
        ImgpackError,
        match=r"needs 0\.00 GiB on cpu \(60 images of 3x16x16 uint8\) but only 0\.00 GiB is available.*size=N",
    ):
        DeviceLoader(raw, device="cpu", memory_limit=10_000, progress=False)
    assert (
        len(
            DeviceLoader(
                raw, device="cpu", memory_limit=60 * 3 * 16 * 16 + 60 * 8, progress=False
            ).images
        )
        == 60
    )


def test_encoded_dataset_needs_a_size(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "png", "pt", encoding="png", progress=False)
    with pytest.raises(OptionError, match="needs images of one size"):
        DeviceLoader(tmp_path / "png", device="cpu", progress=False)
    loader = DeviceLoader(
        tmp_path / "png", device="cpu", size=8, workers=0, shuffle=False, progress=False
    )
    assert loader.images.shape == (60, 3, 8, 8)
    convert(uniform_folder, tmp_path / "raw8", "pt", encoding="raw", size=8, progress=False)
    assert torch.equal(epoch(loader)[0], everything(tmp_path / "raw8")[0])  # same resize as convert


def test_subset_and_bad_options(raw: Path) -> None:
    loader = DeviceLoader(raw, device="cpu", indices=[5, 6, 7], shuffle=False, progress=False)
    assert torch.equal(epoch(loader)[0], everything(raw)[0][5:8])
    with pytest.raises(OptionError, match="float dtype"):
        DeviceLoader(
            raw, device="cpu", dtype=torch.uint8, normalize=((0.5,), (0.5,)), progress=False
        )
