"""Stored JPEG/PNG records decoded to HxWxC uint8 pixels, exactly as imgpack's readers decode
them, with numpy and the decoders only (no torch): the readers' :class:`~imgpack.decoding.Decoder`
builds on it, and a conversion worker measures what it stores with it (:mod:`imgpack.stats`)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from imgpack.errors import DataError
from imgpack.images import (
    Encoded,
    ImagePolicy,
    Kind,
    describe,
    pixel_sums,
    resize_pixels,
    strict_pillow,
)

try:
    import simplejpeg as _simplejpeg
except ImportError:  # Pillow decodes everything then
    _simplejpeg = None

#: What a stored record's bytes may be given as.
Payload = bytes | bytearray | memoryview
_JPEG = b"\xff\xd8\xff"
_PNG = b"\x89PNG\r\n\x1a\n"
_DRAFT_SCALES = (8, 4, 2, 1)


def draft_scale(height: int, width: int, size: tuple[int, int] | None) -> int:
    """The DCT scale denominator (8, 4, 2 or 1) Pillow's ``Image.draft`` picks to decode a
    ``height x width`` JPEG for ``size`` (H, W): the largest whose result still covers it."""
    if size is None or size[0] <= 0 or size[1] <= 0:
        return 1
    scale = min(width // size[1], height // size[0])
    return next((s for s in _DRAFT_SCALES if scale >= s), 1)


def widen(pixels: np.ndarray, channels: int) -> np.ndarray:
    """HxWx1 gray pixels widened to ``channels`` (replicated into R, G and B)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[2] == channels:
        return pixels
    if pixels.shape[2] == 1 and channels == 3:
        return np.repeat(pixels, 3, axis=2)
    raise DataError(f"stored image has {pixels.shape[2]} channels, expected {channels}")


def jpeg_mode(payload: Payload, channels: int) -> tuple[int, int, str] | None:
    """``(height, width, colorspace)`` simplejpeg decodes a stored JPEG to (``gray`` or
    ``rgb``, as ``channels`` allows), from its header; ``None`` for Pillow's path (a colour
    space simplejpeg does not give, or a header it declines). Raises what the header read
    raises (``ValueError``)."""
    assert _simplejpeg is not None
    height, width, colorspace, _ = _simplejpeg.decode_jpeg_header(payload)
    if colorspace == "Gray":
        return int(height), int(width), "gray"
    if colorspace in ("YCbCr", "RGB") and channels == 3:
        return int(height), int(width), "rgb"
    return None


def _fast_jpeg(
    payload: Payload, channels: int, size: tuple[int, int] | None, out: np.ndarray | None
) -> np.ndarray | None:
    """A JPEG record's pixels through simplejpeg (written into ``out`` when it has their
    shape), or ``None`` for Pillow to decide. Gray stays one channel (the caller widens it)."""
    assert _simplejpeg is not None
    try:
        found = jpeg_mode(payload, channels)
        if found is None:
            return None
        height, width, mode = found
        scale = draft_scale(height, width, size)
        shape = (-(-height // scale), -(-width // scale), 1 if mode == "gray" else 3)
        buffer = out if out is not None and out.shape == shape and scale == 1 else None
        pixels = _simplejpeg.decode_jpeg(
            payload,
            colorspace=mode,
            min_height=shape[0] if scale > 1 else 0,
            min_width=shape[1] if scale > 1 else 0,
            buffer=buffer,
            strict=True,
        )
    except (ValueError, TypeError):
        return None  # damaged, a warning, or unsupported: Pillow gives the answer
    if pixels.shape[:2] != shape[:2]:  # a scale Pillow's draft would not pick
        return None
    return pixels


def _pillow(payload: Payload, channels: int, size: tuple[int, int] | None) -> np.ndarray:
    """A stored JPEG/PNG record's pixels through Pillow (gray stays one channel)."""
    try:
        with strict_pillow(), Image.open(io.BytesIO(payload), formats=["JPEG", "PNG"]) as img:
            if size is not None and img.format == "JPEG":
                img.draft(img.mode, (size[1], size[0]))
            img.load()
            mode = img.mode
            pixels = np.asarray(img)  # one copy out of Pillow; read-only
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise DataError(f"cannot decode stored image: {describe(exc)}") from None
    if mode == "L":
        return pixels[:, :, None]
    if mode == "RGB" and channels == 3:
        return pixels
    raise DataError(
        f"stored image decodes to mode {mode}, expected {'L' if channels == 1 else 'RGB or L'}"
    )


def decode_stored(
    payload: Payload,
    channels: int,
    policy: ImagePolicy | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode a stored JPEG/PNG record into HxWxC uint8 (C = ``channels``).

    ``policy`` (its ``size``, ``resize`` and ``resample``) resizes on read, a JPEG decoded at the
    DCT scale :func:`draft_scale` picks. ``out`` (HxWxC, writable): the pixels are written there
    when their shape matches, and ``out`` is returned. Otherwise the array returned may be
    read-only: copy it before handing it to torch.

    Only the JPEG and PNG decoders are used, strictly (a truncated record raises), with no pixel
    limit (the conversion applied its own). Raises :class:`~imgpack.errors.DataError` when the
    bytes do not decode to 8-bit L or RGB.
    """
    size = policy.size if policy is not None else None
    pixels = None
    if _simplejpeg is not None and bytes(payload[:3]) == _JPEG:
        pixels = _fast_jpeg(payload, channels, size, out)
    if pixels is None:
        pixels = _pillow(payload, channels, size)
    if policy is not None and size is not None:
        pixels = resize_pixels(pixels, policy)
    return _place(pixels, channels, out)


def _place(pixels: np.ndarray, channels: int, out: np.ndarray | None) -> np.ndarray:
    """``pixels`` widened to ``channels``, in ``out`` when given (unless already there)."""
    if out is None:
        return widen(pixels, channels)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[:2] != out.shape[:2]:
        raise DataError(
            f"stored image is {pixels.shape[0]}x{pixels.shape[1]}, expected "
            f"{out.shape[0]}x{out.shape[1]}"
        )
    if pixels.shape[2] != out.shape[2] and not (pixels.shape[2] == 1 and out.shape[2] == 3):
        raise DataError(f"stored image has {pixels.shape[2]} channels, expected {out.shape[2]}")
    if not np.shares_memory(pixels, out):
        out[...] = pixels  # a gray image is broadcast into R, G and B
    return out


def stored_shape(payload: Payload, channels: int) -> tuple[int, int, int] | None:
    """``(height, width, channels)`` a stored JPEG/PNG record decodes to, from its header
    (nothing decoded), or ``None`` when the header cannot tell (the decode will say why)."""
    head = bytes(payload[:32])
    try:
        if head[:3] == _JPEG and _simplejpeg is not None:
            height, width, _, _ = _simplejpeg.decode_jpeg_header(payload)
            return int(height), int(width), channels
        if head[:8] == _PNG and head[12:16] == b"IHDR":
            return int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big"), channels
    except (ValueError, TypeError):
        pass
    return None


def measure(encoded: Encoded, channels: int) -> Encoded:
    """``encoded`` with its :attr:`~imgpack.images.Encoded.sums` set (for the dataset statistics,
    :mod:`imgpack.stats`): from its raw pixels, or from its payload decoded as the readers decode
    it, in ``channels``. Runs in the conversion worker."""
    if encoded.sums is not None:
        return encoded
    if encoded.kind is Kind.RAW:
        shape = (encoded.height, encoded.width, encoded.channels)
        pixels = np.frombuffer(encoded.payload, np.uint8).reshape(shape)
    else:  # decoded as the readers decode it for this output
        pixels = decode_stored(encoded.payload, channels)
    encoded.sums = pixel_sums(pixels, channels)
    return encoded


__all__ = ["Payload", "decode_stored", "draft_scale", "measure", "stored_shape"]
