"""The JPEG header walk that lets a conversion validate a usual JPEG without Pillow's parser
(imgpack.jpegheader): it must read what Pillow reads, decline what Pillow must decide, and never
change a verdict (kept as it is, or the same error)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import smooth_rgb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import imgpack.images as images
from imgpack.errors import ImageError
from imgpack.images import Encoding, ImagePolicy, process_bytes
from imgpack.jpegheader import plain_jpeg

POLICY = ImagePolicy()


def _jpeg(pixels: np.ndarray, mode: str = "RGB", **save: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="JPEG", **save)
    return out.getvalue()


def _photos() -> dict[str, bytes]:
    rng = np.random.default_rng(11)
    rgb = smooth_rgb(rng, 75, 101)
    return {
        "baseline": _jpeg(rgb, quality=90),
        "gray": _jpeg(rgb, "L"),
        "progressive": _jpeg(rgb, progressive=True),
        "optimized 4:4:4": _jpeg(rgb, optimize=True, subsampling=0),
        "one pixel": _jpeg(rgb[:1, :1]),
        "with a comment and an ICC profile": _jpeg(rgb, comment=b"hi", icc_profile=b"\0" * 300),
    }


def _pillow_verdict(data: bytes, monkeypatch: pytest.MonkeyPatch) -> str:
    with monkeypatch.context() as patch:
        patch.setattr(images, "_kept_jpeg", lambda *args: None)
        return _verdict(data)


def _verdict(data: bytes) -> str:
    try:
        enc = process_bytes(data, "x.jpg", 3, POLICY, Encoding())
    except ImageError as exc:
        return f"error: {exc}"
    kept = enc.payload is data
    return f"{enc.kind} {enc.height}x{enc.width}x{enc.channels} label {enc.label} kept {kept}"


@pytest.mark.parametrize("name", sorted(_photos()))
def test_it_reads_what_pillow_reads(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _photos()[name]
    with Image.open(io.BytesIO(data)) as img:
        expected = (img.height, img.width, 1 if img.mode == "L" else 3)
    assert plain_jpeg(data) == expected
    assert _verdict(data) == _pillow_verdict(data, monkeypatch)
    assert _verdict(data).endswith("kept True")


def test_it_leaves_to_pillow_what_pillow_must_decide() -> None:
    rng = np.random.default_rng(12)
    rgb = smooth_rgb(rng, 40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the policy turns it, the bytes cannot be kept
    out = io.BytesIO()
    Image.fromarray(rgb).save(
        out, format="MPO", save_all=True, append_images=[Image.new("RGB", (30, 40))]
    )
    declined = {
        "exif": _jpeg(rgb, exif=exif.tobytes()),
        "xmp": _jpeg(rgb, xmp=b'<x tiff:Orientation="3"/>'),
        "cmyk (adobe)": _jpeg(rgb, "CMYK"),
        "mpo": out.getvalue(),
        "junk before a marker": _photos()["baseline"][:2] + b"\x00" + _photos()["baseline"][2:],
        "cut in the header": _photos()["baseline"][:100],
        "not a jpeg": b"\x89PNG\r\n\x1a\n" + bytes(40),
    }
    for name, data in declined.items():
        assert plain_jpeg(data) is None, name


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    photo=st.sampled_from(sorted(_photos())),
    edits=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
)
def test_a_damaged_header_gets_pillows_verdict(
    photo: str, edits: list[tuple[int, int]], cut: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes of the marker segments set to anything, the file cut anywhere: the fast path keeps
    a file only where Pillow's path keeps it, with the same size and components; any error is
    Pillow's, word for word."""
    data = bytearray(_photos()[photo])
    for at, value in edits:
        if at < len(data):
            data[at] = value
    damaged = bytes(data[:cut] if cut is not None else data)
    assert _verdict(damaged) == _pillow_verdict(damaged, monkeypatch)
