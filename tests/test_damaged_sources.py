"""Damaged source files: every type imgpack accepts x many kinds of damage x every encoding.

The invariant, for every file: it is either refused (skipped with its name and a reason), or it
reads back exactly the pixels a strict decode of it gives (JPEG re-encoding within the round-trip
tolerance). Nothing that converts may fail or differ at read time.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import jpeg_bytes, png_bytes, reference_pixels, smooth_rgb
from PIL import Image, ImageFile

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS


def _save(img: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()


def _sources() -> dict[str, bytes]:
    """One healthy file of every type and mode the policy handles."""
    rng = np.random.default_rng(7)
    rgb = Image.fromarray(smooth_rgb(rng, 40, 48))
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.fromarray(rng.integers(0, 256, (40, 48), dtype=np.uint8)))
    la = rgb.convert("LA")
    gray16 = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    exif = Image.Exif()
    exif[0x0112] = 6
    return {
        "jpeg": jpeg_bytes(rgb),
        "jpeg_progressive": jpeg_bytes(rgb, progressive=True),
        "jpeg_gray": jpeg_bytes(rgb.convert("L")),
        "jpeg_exif": jpeg_bytes(rgb, exif=exif.tobytes()),
        "png_rgb": png_bytes(rgb),
        "png_rgba": png_bytes(rgba),
        "png_la": png_bytes(la),
        "png_p": png_bytes(palette),
        "png_p_trns": png_bytes(palette, transparency=3),
        "png_16bit": png_bytes(gray16),
        "gif": _save(palette, "GIF"),
        "bmp": _save(rgb, "BMP"),
        "tiff": _save(rgb, "TIFF", compression="tiff_deflate"),
        "webp": _save(rgb, "WEBP", lossless=True),
        "ppm": _save(rgb, "PPM"),
    }


def _damages(data: bytes) -> dict[str, bytes]:
    """Damaged variants of ``data``: truncations, flipped bytes, zeroed runs, lying headers."""
    n = len(data)
    out = {}
    for cut in (0.3, 0.6, 0.9):
        out[f"cut{int(cut * 100)}"] = data[: int(n * cut)]
    out["cut_last"] = data[:-1]
    for at in (0.45, 0.7, 0.95):
        flipped = bytearray(data)
        flipped[int(n * at)] ^= 0x55
        out[f"flip{int(at * 100)}"] = bytes(flipped)
    zeroed = bytearray(data)
    zeroed[n // 2 : n // 2 + 24] = bytes(24)
    out["zeros"] = bytes(zeroed)
    header = bytearray(data)
    header[16:24] = b"\xff" * 8  # sizes or offsets of most headers
    out["header"] = bytes(header)
    return out


def _exif_garbage() -> bytes:
    """A JPEG whose APP1 Exif block is garbage: the EXIF is unreadable, the image is fine."""
    data = jpeg_bytes(Image.fromarray(smooth_rgb(np.random.default_rng(3), 24, 24)))
    app1 = b"Exif\x00\x00" + b"MM\x00*\x00\x00\x00\x08" + b"\xff" * 30
    return data[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + data[2:]


@pytest.fixture(scope="module")
def damaged_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("damaged") / "src"
    for name, data in _sources().items():
        folder = root / name
        folder.mkdir(parents=True)
        suffix = {"jpeg": "jpg", "png": "png", "gif": "gif", "bmp": "bmp", "tiff": "tif"}
        ext = suffix.get(name.split("_")[0], name)
        (folder / f"healthy.{ext}").write_bytes(data)
        for damage, damaged in _damages(data).items():
            (folder / f"{damage}.{ext}").write_bytes(damaged)
    (root / "jpeg" / "exif_garbage.jpg").write_bytes(_exif_garbage())
    return root


def _strict_reference(path: Path, size: tuple[int, int] | None) -> np.ndarray | None:
    """What a strict decode of ``path`` gives under the policy, or None if it does not decode."""
    try:
        with Image.open(path) as img:
            img.load()
    except Exception:
        return None
    try:
        return reference_pixels(path, size=size)
    except Exception:
        return None


CASES = [("original", None), ("png", None), ("jpeg", (24, 24)), ("raw", (16, 16))]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("encoding", "size"), CASES, ids=[c[0] for c in CASES])
def test_refused_or_exact(
    fmt: str, encoding: str, size: tuple[int, int] | None, damaged_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    manifest = convert(
        damaged_folder, out, fmt, encoding=encoding, size=size, on_error="skip", progress=False
    )
    skipped = {entry["path"]: entry["reason"] for entry in manifest.skipped}
    assert all(reason for reason in skipped.values())
    ds = open_dataset(out, verify=True)
    stored = [path for path, _ in ds.samples]
    assert len(stored) + len(skipped) == sum(1 for p in damaged_folder.rglob("*") if p.is_file())
    for index, full in enumerate(stored):
        rel = Path(full).relative_to(damaged_folder.resolve()).as_posix()
        reference = _strict_reference(damaged_folder / rel, size)
        assert reference is not None, f"{rel} converted, but a strict decode of it fails"
        image, _ = ds[index]
        got = image.permute(1, 2, 0).numpy()
        assert got.shape == reference.shape, rel
        if encoding == "jpeg":  # exactly what encoding the reference at quality 90 decodes to
            encoded = io.BytesIO()
            Image.fromarray(reference).save(encoded, format="JPEG", quality=90)
            reference = np.asarray(Image.open(encoded).convert("RGB"))
        assert np.array_equal(got, reference), rel
    # Every healthy file converts; truncated files never do.
    assert not [p for p in skipped if p.endswith(("healthy.jpg", "healthy.png"))]
    assert all(f"{name}/cut30" in " ".join(skipped) for name in ("jpeg", "png_rgb", "png_rgba"))


def test_a_callers_load_truncated_images_does_not_turn_validation_off(
    damaged_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    for workers in (1, 2):
        manifest = convert(
            damaged_folder,
            tmp_path / f"out{workers}",
            "pt",
            workers=workers,
            on_error="skip",
            progress=False,
        )
        skipped = {entry["path"] for entry in manifest.skipped}
        assert {"png_rgba/cut60.png", "jpeg/cut60.jpg", "png_16bit/cut90.png"} <= skipped
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting is left as it was


def test_outputs_without_a_pixel_limit_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-pixels 0 stores images larger than Pillow's own limit: readers must not refuse them."""
    src = tmp_path / "src" / "big"
    src.mkdir(parents=True)
    Image.fromarray(smooth_rgb(np.random.default_rng(1), 60, 60)).save(src / "a.png")
    expected = torch.from_numpy(reference_pixels(src / "a.png").copy())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 60x60 is a "bomb" to Pillow now
    convert(tmp_path / "src", tmp_path / "out", "hdf5", max_pixels=None, progress=False)
    image, _ = open_dataset(tmp_path / "out")[0]
    assert torch.equal(image.permute(1, 2, 0), expected)
