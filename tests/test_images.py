from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeFolder, png_bytes, reference_pixels
from PIL import Image

from imgpack.decoding import decode_stored
from imgpack.errors import DataError, ImageError, OptionError
from imgpack.images import (
    Encoding,
    ImagePolicy,
    Kind,
    apply_policy,
    parse_color,
    process_bytes,
    process_file,
    sniff,
)

POLICY = ImagePolicy()


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (b"\xff\xd8\xff\xe0", "JPEG"),
        (b"\x89PNG\r\n\x1a\n", "PNG"),
        (b"GIF89a", "GIF"),
        (b"BM\x00\x00", "BMP"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WEBP"),
        (b"II*\x00", "TIFF"),
        (b"hello", None),
        (b"", None),
    ],
)
def test_sniff(head: bytes, kind: str | None) -> None:
    assert sniff(head) == kind


def test_every_edge_case_matches_the_reference(edge_folder: FakeFolder) -> None:
    for rel, _ in edge_folder.images:
        data = (edge_folder.root / rel).read_bytes()
        pixels, _ = apply_policy(data, rel, POLICY)
        expected = reference_pixels(edge_folder.root / rel)
        assert pixels.dtype == np.uint8 and pixels.shape == expected.shape, rel
        np.testing.assert_array_equal(pixels, expected, err_msg=rel)


def test_exif_rotation_is_applied(edge_folder: FakeFolder) -> None:
    pixels, plain = apply_policy(
        (edge_folder.root / "ant/exif_rotated.jpg").read_bytes(), "x", POLICY
    )
    assert pixels.shape == (30, 16, 3)  # stored 16x30 (HxW), orientation 6 turns it
    assert not plain


def test_16_bit_is_rescaled_not_clipped() -> None:
    ramp = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    pixels, _ = apply_policy(png_bytes(Image.fromarray(ramp)), "x.png", POLICY)
    assert pixels[0, :, 0].tolist() == [0, 1, 128, 255]


def test_alpha_is_composited_over_the_background() -> None:
    rgba = np.array([[[200, 100, 0, 0], [200, 100, 0, 255], [200, 100, 0, 128]]], dtype=np.uint8)
    data = png_bytes(Image.fromarray(rgba, "RGBA"))
    white, _ = apply_policy(data, "x.png", POLICY)
    assert white[0].tolist() == [[255, 255, 255], [200, 100, 0], [227, 177, 127]]
    black, _ = apply_policy(data, "x.png", ImagePolicy(background=parse_color("black")))
    assert black[0].tolist() == [[0, 0, 0], [200, 100, 0], [100, 50, 0]]


def test_grayscale_option(edge_folder: FakeFolder) -> None:
    for rel in ("ant/plain.jpg", "bee/gray.png", "bee/rgba.png"):
        pixels, _ = apply_policy(
            (edge_folder.root / rel).read_bytes(), rel, ImagePolicy(channels=1)
        )
        np.testing.assert_array_equal(
            pixels, reference_pixels(edge_folder.root / rel, grayscale=True)
        )


@pytest.mark.parametrize("mode", ["crop", "stretch"])
def test_resize_modes(mode: str) -> None:
    img = Image.fromarray(np.zeros((10, 40, 3), dtype=np.uint8))
    pixels, plain = apply_policy(png_bytes(img), "x.png", ImagePolicy(size=(8, 8), resize=mode))
    assert pixels.shape == (8, 8, 3)
    assert not plain


def test_crop_keeps_the_centre() -> None:
    wide = np.zeros((10, 30, 3), dtype=np.uint8)
    wide[:, 10:20] = 255  # white centre third
    pixels, _ = apply_policy(
        png_bytes(Image.fromarray(wide)),
        "x.png",
        ImagePolicy(size=10, resize="crop", resample="nearest"),
    )
    assert (pixels == 255).all()
    stretched, _ = apply_policy(
        png_bytes(Image.fromarray(wide)),
        "x.png",
        ImagePolicy(size=10, resize="stretch", resample="nearest"),
    )
    assert (stretched[:, 0] == 0).all()


def test_decompression_bomb_guard() -> None:
    data = png_bytes(Image.new("RGB", (100, 100)))
    with pytest.raises(
        ImageError, match=r"100x100 = 10000 pixels exceeds the limit of 5000 .*--max-pixels"
    ):
        apply_policy(data, "big.png", ImagePolicy(max_pixels=5000))
    pixels, _ = apply_policy(data, "big.png", ImagePolicy(max_pixels=None))
    assert pixels.shape == (100, 100, 3)
    assert Image.MAX_IMAGE_PIXELS is not None  # the global guard is restored


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty file"),
        (b"just some text", "not an image"),
        (png_bytes(Image.new("RGB", (64, 64)))[:60], "truncated PNG data"),
    ],
)
def test_bad_data_names_the_file(data: bytes, match: str) -> None:
    with pytest.raises(ImageError, match=f"^cls/bad.jpg: .*{match}"):
        apply_policy(data, "cls/bad.jpg", POLICY)


def test_truncated_jpeg_is_an_error(bad_folder: FakeFolder) -> None:
    with pytest.raises(ImageError, match=r"(?i)truncated"):
        apply_policy((bad_folder.root / "cat/truncated.jpg").read_bytes(), "t.jpg", POLICY)


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"cls/gone\.png: cannot read"):
        process_file(str(tmp_path), "cls/gone.png", 0, POLICY, Encoding())


def test_original_keeps_bytes_only_when_they_decode_to_the_policy(edge_folder: FakeFolder) -> None:
    root = str(edge_folder.root)
    kept = {
        "ant/plain.jpg",
        "ant/gray.jpg",
        "ant/png_named.jpg",
        "bee/gray.png",
        "bee/rgb.png",
        "bee/UPPER.PNG",
    }
    kept |= {
        "cat/nested/deeper/deep.png",
        "cat/nested/a.png",
        "cat/nested-x/b.png",
        "cat/café_ñ_日本.png",
        "cat/linked.png",
    }
    for rel, label in edge_folder.images:
        enc = process_file(root, rel, label, POLICY, Encoding("original"))
        same = enc.payload == (edge_folder.root / rel).read_bytes()
        assert same == (rel in kept), rel
        np.testing.assert_array_equal(
            decode_stored(enc.payload, 3), reference_pixels(edge_folder.root / rel), err_msg=rel
        )


def test_png_named_jpg_is_a_png(edge_folder: FakeFolder) -> None:
    enc = process_file(str(edge_folder.root), "ant/png_named.jpg", 0, POLICY, Encoding("original"))
    assert enc.kind is Kind.PNG


def test_jpeg_encoding_within_tolerance(edge_folder: FakeFolder) -> None:
    enc = process_file(str(edge_folder.root), "bee/rgb.png", 1, POLICY, Encoding("jpeg", 95))
    assert enc.kind is Kind.JPEG and enc.payload[:3] == b"\xff\xd8\xff"
    diff = np.abs(
        decode_stored(enc.payload, 3).astype(int)
        - reference_pixels(edge_folder.root / "bee/rgb.png")
    )
    assert diff.mean() < 3


def test_decode_stored_refuses_unexpected_modes() -> None:
    out = io.BytesIO()
    Image.new("RGBA", (2, 2)).save(out, format="PNG")
    with pytest.raises(DataError, match="mode RGBA"):
        decode_stored(out.getvalue(), 3)
    with pytest.raises(DataError, match="cannot decode"):
        decode_stored(b"garbage", 3)


def test_policy_validation() -> None:
    with pytest.raises(OptionError, match="resize mode"):
        ImagePolicy(resize="squash")
    with pytest.raises(OptionError, match="encoding"):
        Encoding("gif")
    with pytest.raises(OptionError, match="background"):
        parse_color("not-a-colour")


def _pillow(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return np.asarray(img)


def test_stored_jpegs_decode_to_pillows_pixels(edge_folder: FakeFolder) -> None:
    """decode_stored takes JPEGs through simplejpeg: exactly Pillow's pixels for every JPEG of
    the test folder (baseline, progressive, grayscale, EXIF-tagged) and TensorFlow's reference
    photographs; CMYK goes to Pillow (which refuses it as stored data, as before)."""
    import imgpack.decoding as decoding
    from imgpack.formats.tfrecord import example, framing

    assert decoding._simplejpeg is not None  # a dependency: the fast path is what is tested
    payloads = [
        p.read_bytes() for p in sorted(edge_folder.root.rglob("*")) if p.is_file()
        and p.read_bytes()[:3] == b"\xff\xd8\xff"
    ]  # fmt: skip
    data_dir = Path(__file__).resolve().parent / "data"
    with framing.open_records(data_dir / "tensorflow-written-real.tfrecord") as fh:
        for _, record in framing.iter_frames(fh, "real"):
            encoded = example.decode_example(record)["image/encoded"][0]
            if isinstance(encoded, bytes) and encoded[:3] == b"\xff\xd8\xff":
                payloads.append(encoded)
    checked = 0
    for payload in payloads:
        expected = _pillow(payload)
        if expected.ndim == 3 and expected.shape[2] == 4:  # CMYK: not a storable record
            with pytest.raises(DataError):
                decode_stored(payload, 3)
            continue
        gray = expected.ndim == 2
        got = decode_stored(payload, 3)
        want = np.repeat(expected[:, :, None], 3, axis=2) if gray else expected
        assert np.array_equal(got, want)
        if gray:
            assert np.array_equal(decode_stored(payload, 1)[:, :, 0], expected)
        checked += 1
    assert checked >= 6


def test_a_jpeg_simplejpeg_declines_is_decided_by_pillow() -> None:
    import simplejpeg

    rng = np.random.default_rng(2)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(out, format="JPEG")
    data = out.getvalue()
    # Entropy data cut short, then EOI: libjpeg warns ("premature end of data segment"),
    # simplejpeg's strict mode refuses, Pillow decodes; the record reads as Pillow decodes it.
    warned = data[: len(data) * 2 // 3] + b"\xff\xd9"
    with pytest.raises(ValueError, match="premature end of data segment"):
        simplejpeg.decode_jpeg(warned, strict=True)
    assert np.array_equal(decode_stored(warned, 3), _pillow(warned))
    with pytest.raises(DataError, match="cannot decode stored image"):
        decode_stored(data[: len(data) // 2], 3)  # truncated: refused by both


def test_kept_jpegs_are_validated_by_simplejpeg_with_pillows_verdicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation of a kept JPEG goes through a 1/8-scale simplejpeg decode first; whatever it
    refuses, Pillow decides. Same verdict (kept, or the same error) as Pillow alone on damaged
    variants: cut short, bytes flipped in the entropy data, an early end marker."""
    from conftest import jpeg_bytes, smooth_rgb

    import imgpack.images as images

    rng = np.random.default_rng(5)
    base = jpeg_bytes(Image.fromarray(smooth_rgb(rng, 120, 160)))
    gray = jpeg_bytes(Image.fromarray(smooth_rgb(rng, 64, 48)).convert("L"))
    variants = [base, gray, base[: len(base) // 2], base[:-200] + b"\xff\xd9", gray[:-2]]
    for k in range(12):
        flipped = bytearray(base)
        flipped[len(base) // 3 + 97 * k] ^= 1 << (k % 8)
        variants.append(bytes(flipped))

    def verdict(data: bytes) -> str:
        try:
            enc = process_bytes(data, "x.jpg", 0, POLICY, Encoding())
        except ImageError as exc:
            return f"error: {exc}"
        return f"kept {enc.kind} {enc.height}x{enc.width}x{enc.channels}"

    assert images._simplejpeg is not None
    fast = [verdict(v) for v in variants]
    monkeypatch.setattr(images, "_simplejpeg", None)
    assert fast == [verdict(v) for v in variants]
    assert fast[0].startswith("kept") and fast[2].startswith("error")
