"""The image policy: how every source image becomes the pixels imgpack stores.

One policy, applied at conversion and identical for every format (``docs/images.md``):

1. The content type comes from the file's first bytes (:func:`sniff`), never from its extension.
2. Pillow decodes the first frame; a decode error, a truncated file or an empty file is an
   :class:`~imgpack.errors.ImageError` naming the file.
3. EXIF orientation is applied (``ImageOps.exif_transpose``).
4. Every mode becomes 8-bit RGB (or 8-bit L with ``channels=1``):

   - ``1`` and ``L`` are replicated into R, G and B (``1`` gives 0 or 255);
   - ``I;16*`` and ``I`` are rescaled from 0..65535 to 0..255 as ``round(v * 255 / 65535)``
     (values outside 0..65535 are clipped first); ``F`` is clipped to 0..255 and rounded;
   - images with alpha (``RGBA``, ``LA``, ``PA``, or a ``P``/``L``/``RGB`` image with a
     transparency entry or colour key) are composited over the background colour (white by default):
     ``out = round((c * a + bg * (255 - a)) / 255)``;
   - ``CMYK``, ``YCbCr``, ``LAB``, ``HSV`` and ``P`` use Pillow's ``convert("RGB")`` (no ICC
     colour management);
   - 16-bit RGB PNGs are reduced to 8 bits by Pillow on decode (the high byte of each sample);
   - ``channels=1`` converts the RGB result with Pillow's ITU-R 601-2 luma (``convert("L")``).

5. With a size, the image is resized with Pillow (``bilinear`` by default) by ``crop`` (scale
   the shorter side to fit, then centre-crop: ``ImageOps.fit``), ``stretch`` (to exactly H x W,
   aspect ratio not kept), ``shorter`` (the shorter side to exactly N, the longer one to
   ``longer * N // shorter``, as torchvision's ``Resize(N)``; smaller images enlarged) or
   ``longer`` (the longer side to at most N, the shorter one to ``shorter * N // longer``;
   smaller images kept as they are, as FFCV's ``max_resolution``). The last two keep the
   aspect ratio, so the sizes vary (no ``raw`` encoding); an image already at its target size
   is not resized.

Encodings of the result: ``raw`` (HWC uint8 pixels), ``png`` (lossless), ``jpeg`` (lossy, at
``quality``) and ``original``: the source bytes when a plain decode of them already gives the
policy's pixels (a JPEG or PNG that is RGB or L, with no EXIF rotation, no alpha, not resized),
else a lossless PNG of the policy's pixels.
"""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
from PIL import Image, ImageColor, ImageFile, ImageOps

from imgpack import system
from imgpack.errors import DataError, ImageError, OptionError
from imgpack.jpegheader import plain_jpeg

try:
    import simplejpeg as _simplejpeg
except ImportError:  # Pillow validates everything then
    _simplejpeg = None
from imgpack.units import parse_image_size

try:  # the optional C extension (setup.py): one pass; numpy's blocks without it
    import imgpack._pixelsums as _pixelsums
except ImportError:  # pragma: no cover - built wherever a C compiler is
    _pixelsums = None  # type: ignore[assignment]

ENCODINGS = ("original", "png", "jpeg", "raw")
RESIZE_MODES = ("crop", "stretch", "shorter", "longer")
#: The resize modes that keep the aspect ratio: ``--size N`` is one side, the sizes vary.
ASPECT_MODES = ("shorter", "longer")
RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
}
#: Pillow's own decompression-bomb threshold (pixels); above it imgpack refuses the image.
DEFAULT_MAX_PIXELS = 89_478_485

# Content types by magic bytes: (prefix, offset, name).
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"BM", 0, "BMP"),
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"WEBP", 8, "WEBP"),
    (b"P1", 0, "PPM"),
    (b"P2", 0, "PPM"),
    (b"P3", 0, "PPM"),
    (b"P4", 0, "PPM"),
    (b"P5", 0, "PPM"),
    (b"P6", 0, "PPM"),
)
_KEEPABLE = ("JPEG", "PNG")


def sniff(data: bytes) -> str | None:
    """The image type of ``data`` from its magic bytes (Pillow's format name), or ``None``."""
    for magic, offset, name in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            if name == "WEBP" and data[:4] != b"RIFF":
                continue
            return name
    return None


def parse_color(value: str | tuple[int, int, int]) -> tuple[int, int, int]:
    """A background colour: a name (``white``), ``#rrggbb`` or an ``(r, g, b)`` triple."""
    if isinstance(value, (tuple, list)):
        rgb = tuple(int(v) for v in value)
        if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
            raise OptionError(f"invalid background {value!r}: expected three values 0..255")
        return rgb[0], rgb[1], rgb[2]
    try:
        color = ImageColor.getrgb(str(value))
    except ValueError:
        raise OptionError(
            f"invalid background {value!r}: expected a colour name (white, black, ...) or #rrggbb"
        ) from None
    return color[0], color[1], color[2]


@dataclass(frozen=True)
class ImagePolicy:
    """How a source image becomes stored pixels. The defaults are the documented policy."""

    size: tuple[int, int] | None = None  # (H, W); an int N or "HxW" is accepted and normalised
    resize: str = "crop"
    resample: str = "bilinear"
    channels: int = 3
    background: tuple[int, int, int] = (255, 255, 255)
    max_pixels: int | None = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.size is not None:
            object.__setattr__(self, "size", parse_image_size(self.size))
        if self.resize not in RESIZE_MODES:
            raise OptionError(
                f"invalid resize mode {self.resize!r}: expected one of {', '.join(RESIZE_MODES)}"
            )
        if self.resize in ASPECT_MODES and self.size is not None and self.size[0] != self.size[1]:
            raise OptionError(
                f"--resize {self.resize} keeps the aspect ratio: give one side, --size N, not "
                f"{self.size[0]}x{self.size[1]}"
            )
        if self.resample not in RESAMPLE:
            raise OptionError(
                f"invalid resample {self.resample!r}: expected one of {', '.join(RESAMPLE)}"
            )
        if self.channels not in (1, 3):
            raise OptionError(
                f"invalid channels {self.channels!r}: expected 3 (RGB) or 1 (grayscale)"
            )
        if self.max_pixels is not None and self.max_pixels <= 0:
            raise OptionError(
                f"invalid max_pixels {self.max_pixels!r}: expected a positive number or None"
            )

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of every image under this policy, or ``None`` when sizes vary (no size,
        or a resize that keeps the aspect ratio)."""
        return self.size if self.resize not in ASPECT_MODES else None

    def target_size(self, height: int, width: int) -> tuple[int, int] | None:
        """``(H, W)`` an image of ``height`` x ``width`` is resized to (step 5), or ``None``
        when it is kept at its size."""
        if self.size is None:
            return None
        if self.resize not in ASPECT_MODES:
            return None if self.size == (height, width) else self.size
        side = self.size[0]
        short, long = min(height, width), max(height, width)
        if self.resize == "shorter":
            if short == side:
                return None
            other = max(1, long * side // short)
            return (side, other) if height <= width else (other, side)
        if long <= side:
            return None
        other = max(1, short * side // long)
        return (side, other) if height >= width else (other, side)

    def describe(self) -> dict[str, Any]:
        fixed = self.fixed_size
        described = {
            "height": fixed[0] if fixed else None,
            "width": fixed[1] if fixed else None,
            "channels": self.channels,
            "resize": self.resize if self.size else None,
            "resample": self.resample if self.size else None,
            "background": list(self.background),
        }
        if self.size is not None and fixed is None:  # one side (shorter or longer) of each
            described["size"] = self.size[0]
        return described


def size_words(image: dict[str, Any]) -> str:
    """An output's image size in words, from its manifest's ``image`` (:meth:`ImagePolicy.
    describe`): ``224x224``, ``shorter side 256 (aspect kept)``, ``as source``."""
    if image.get("height") and image.get("width"):
        return f"{image['height']}x{image['width']}"
    if image.get("size") and image.get("resize") == "shorter":
        return f"shorter side {image['size']} (aspect kept; smaller images enlarged)"
    if image.get("size") and image.get("resize") == "longer":
        return f"longer side at most {image['size']} (aspect kept; smaller images as they are)"
    return "as source"


@dataclass(frozen=True)
class Encoding:
    """How policy pixels are stored: ``original``, ``png``, ``jpeg`` (at ``quality``) or ``raw``."""

    name: str = "original"
    quality: int = 90
    #: Decode a kept JPEG whole while validating it and keep its pixel sums (the dataset
    #: statistics: :mod:`imgpack.stats`); else it is validated at 1/8 scale, which is faster.
    measure: bool = False

    def __post_init__(self) -> None:
        if self.name not in ENCODINGS:
            raise OptionError(
                f"invalid encoding {self.name!r}: expected one of {', '.join(ENCODINGS)}"
            )
        if not 1 <= self.quality <= 100:
            raise OptionError(f"invalid JPEG quality {self.quality!r}: expected 1..100")


class Kind(str, Enum):
    """What a stored payload is: the one name every format maps to its own code
    (LMDB's kind byte, TFRecord's ``image/format``, a WebDataset member's extension)."""

    RAW = "RAW"  # HWC uint8 pixels
    JPEG = "JPEG"  # a complete JPEG file
    PNG = "PNG"  # a complete PNG file


@dataclass
class Encoded:
    """One converted sample, as produced by :func:`process_file` for the writer."""

    path: str  # relative to the source root, POSIX
    label: int
    payload: bytes
    height: int
    width: int
    #: The channels of what ``payload`` holds: a kept grayscale JPEG/PNG is 1 even in an RGB
    #: output (readers widen it to the output's channels).
    channels: int
    kind: Kind
    #: Per-channel sums of the stored pixels and of their squares
    #: (:func:`imgpack.stats.pixel_sums`), set where they are known: ``None`` until measured.
    sums: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: The sample's field values by name (:mod:`imgpack.fields`), as the output keeps them
    #: (:meth:`~imgpack.executors.Job.convert` checks them against the output's fields);
    #: ``None``: the output has none.
    fields: dict[str, Any] | None = None


_strict_lock = threading.Lock()
_strict_users = 0
_strict_saved: tuple[int | None, bool] = (None, False)


@contextmanager
def strict_pillow() -> Iterator[None]:
    """Pillow as imgpack needs it, whatever the caller set: a truncated image raises (a training
    script's ``ImageFile.LOAD_TRUNCATED_IMAGES = True`` must not turn validation off), and
    imgpack's own pixel limit decides instead of Pillow's global one (with no limit set, Pillow
    warns of no decompression bomb either).

    Those are Pillow's globals: decode threads enter this together, so the first to enter saves
    them and the last to leave puts them back (saving and restoring in each thread would leave
    the limit off when two overlap)."""
    global _strict_users, _strict_saved
    with _strict_lock:
        if _strict_users == 0:
            _strict_saved = Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES
            Image.MAX_IMAGE_PIXELS = None
            ImageFile.LOAD_TRUNCATED_IMAGES = False
        _strict_users += 1
    try:
        yield
    finally:
        with _strict_lock:
            _strict_users -= 1
            if _strict_users == 0:
                Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = _strict_saved


def _strict_after_fork() -> None:
    """In a child forked while a decode thread was inside :func:`strict_pillow`: that thread
    does not exist here, so put Pillow's globals back and start over with a new lock."""
    global _strict_lock, _strict_users
    if _strict_users:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = _strict_saved
    _strict_lock, _strict_users = threading.Lock(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_strict_after_fork)


_PNG_CHUNK = struct.Struct(">I4s")


def check_png(data: bytes | memoryview, path: str) -> None:
    """Walk a PNG's chunks and check each one's CRC-32 and that ``IEND`` closes the file.

    Pillow does not check the CRCs of the image data (``IDAT``) and may stop inflating before the
    zlib checksum, so damaged image data can decode to wrong pixels without an error; the chunk
    CRCs catch it.
    """
    view = memoryview(data)
    offset = 8
    while True:
        if offset + 12 > len(view):
            raise ImageError(path, f"truncated PNG data (chunk header at byte {offset})")
        length, name = _PNG_CHUNK.unpack_from(view, offset)
        end = offset + 8 + length
        if end + 4 > len(view):
            raise ImageError(path, f"truncated PNG data (chunk {_chunk(name)} at byte {offset})")
        (crc,) = struct.unpack_from(">I", view, end)
        if zlib.crc32(view[offset + 4 : end]) != crc:
            raise ImageError(
                path, f"damaged PNG data (CRC mismatch in chunk {_chunk(name)} at byte {offset})"
            )
        if name == b"IEND":
            return
        offset = end + 4


def _to_rgb_array(img: Image.Image, background: tuple[int, int, int]) -> np.ndarray:
    """Bring any Pillow mode to an HxWx3 uint8 array under the policy."""
    mode = img.mode
    keyed = "transparency" in img.info  # a palette entry or a colour key marked transparent
    if mode == "RGB" and not keyed:
        return np.asarray(img)
    if mode == "1" or (mode == "L" and not keyed):
        gray = np.asarray(img.convert("L"))
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode.startswith("I;16") or mode == "I":
        wide = np.asarray(img.convert("I") if mode != "I" else img).astype(np.int64)
        wide = np.clip(wide, 0, 65535)
        gray = ((wide * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "F":
        gray = np.clip(np.rint(np.asarray(img)), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    has_alpha = mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info
    if has_alpha:
        rgba = np.asarray(img.convert("RGBA")).astype(np.uint32)
        alpha = rgba[:, :, 3:4]
        bg = np.asarray(background, dtype=np.uint32)
        out = (rgba[:, :, :3] * alpha + bg * (255 - alpha) + 127) // 255
        return out.astype(np.uint8)
    return np.asarray(img.convert("RGB"))


def resize_pixels(pixels: np.ndarray, policy: ImagePolicy) -> np.ndarray:
    """Resize HxWxC uint8 pixels as the policy says (step 5; :meth:`ImagePolicy.target_size`)."""
    target = policy.target_size(pixels.shape[0], pixels.shape[1])
    if target is None:
        return pixels
    height, width = target
    gray = pixels.ndim == 3 and pixels.shape[2] == 1
    img = Image.fromarray(pixels[:, :, 0] if gray else pixels)
    method = RESAMPLE[policy.resample]
    if policy.resize == "crop":
        img = ImageOps.fit(img, (width, height), method=method, centering=(0.5, 0.5))
    else:  # stretch, shorter, longer: to exactly the target (the last two keep the aspect)
        img = img.resize((width, height), method)
    out = np.asarray(img)
    return out[:, :, None] if gray else out


_OBJECT_REPR = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")


def describe(exc: BaseException) -> str:
    """``exc`` as a message that is the same in every run: object reprs with memory addresses
    (Pillow names its ``<_io.BytesIO object at 0x...>``) become "the data", so skip reasons and
    therefore manifests are deterministic."""
    text = _OBJECT_REPR.sub("the data", str(exc)).strip()
    return text or type(exc).__name__


def describe_content(data: bytes | memoryview) -> str:
    """What unrecognised ``data`` looks like, without quoting any of it: a message (and the
    manifest's skip list, which others may read) never carries a file's content."""
    head = bytes(data[:512])
    printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in head)
    kind = "text" if head and printable == len(head) else "binary data"
    return f"{kind}, {len(data)} bytes"


def _chunk(name: bytes) -> str:
    """A PNG chunk type for a message: its name when it is one (four ASCII letters)."""
    return repr(name.decode("ascii")) if len(name) == 4 and name.isalpha() else "of a bad type"


def _open(data: bytes, path: str, policy: ImagePolicy) -> tuple[Image.Image, str]:
    """Open ``data`` (headers only) and check its type and size; :func:`_load` decodes it."""
    if not data:
        raise ImageError(path, "empty file (0 bytes)")
    kind = sniff(data)
    if kind is None:
        raise ImageError(
            path,
            f"not an image: unrecognised content ({describe_content(data)}); "
            "expected JPEG, PNG, GIF, BMP, TIFF, WEBP or PPM data",
        )
    try:
        with strict_pillow():
            img = Image.open(io.BytesIO(data), formats=[kind])
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise ImageError(path, f"cannot decode {kind} data: {describe(exc)}") from None
    pixels = img.width * img.height
    if policy.max_pixels is not None and pixels > policy.max_pixels:
        raise ImageError(
            path,
            f"{img.width}x{img.height} = {pixels} pixels exceeds the limit of "
            f"{policy.max_pixels} (decompression-bomb guard); raise it with --max-pixels",
        )
    return img, kind


def _load(img: Image.Image, kind: str, path: str, draft: bool = False) -> None:
    """Decode the image, which validates the whole file: a truncated or broken file raises.

    ``draft`` (JPEG only) decodes at 1/8 scale with libjpeg's DCT scaling: every entropy-coded
    byte is still decoded, so truncated or broken data is caught as by a full decode, in about
    half the time. For checking a file whose bytes are kept, not for its pixels.
    """
    try:
        with strict_pillow():
            if draft and kind == "JPEG":
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise ImageError(path, f"cannot decode {kind} data: {describe(exc)}") from None


def _decodes_cleanly(data: bytes, height: int, width: int, gray: bool) -> bool:
    """Whether a JPEG decodes without an error or a warning through libjpeg-turbo (simplejpeg),
    at 1/8 scale: every entropy-coded byte is still decoded, so damage is caught as by a full
    decode, several times faster than Pillow's. ``False`` leaves the verdict to Pillow (which
    accepts whatever this accepts: the same library, and Pillow is the more lenient)."""
    if _simplejpeg is None:
        return False
    try:
        _simplejpeg.decode_jpeg(
            data,
            colorspace="gray" if gray else "rgb",
            min_height=-(-height // 8),  # the smallest scale simplejpeg offers: 1/8
            min_width=-(-width // 8),
            strict=True,
        )
    except (ValueError, TypeError):
        return False
    return True


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1 when there is none, or when the EXIF block cannot be parsed).
    Call it on a loaded image: for a PNG, Pillow decodes the image to look for EXIF."""
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:
        return 1


def _is_plain(img: Image.Image, kind: str, policy: ImagePolicy) -> bool:
    """Whether a plain decode of the file (Pillow, no EXIF handling, L replicated to RGB)
    already gives exactly the policy's pixels, so its bytes can be stored as they are."""
    return (
        kind in _KEEPABLE
        and (policy.size is None or policy.fixed_size is None)  # crop and stretch re-encode
        and policy.target_size(img.height, img.width) is None
        and getattr(img, "n_frames", 1) == 1
        and _orientation(img) == 1
        and "transparency" not in img.info
        and (img.mode == "L" or (img.mode == "RGB" and policy.channels == 3))
    )


def _policy_pixels(img: Image.Image, kind: str, path: str, policy: ImagePolicy) -> np.ndarray:
    """Steps 3-6 of the policy on a decoded image: HxWxC uint8."""
    try:
        if _orientation(img) != 1:
            img = ImageOps.exif_transpose(img) or img
        pixels = _to_rgb_array(img, policy.background)
    except Exception as exc:
        raise ImageError(
            path, f"cannot convert {kind} image (mode {img.mode}): {describe(exc)}"
        ) from None
    pixels = resize_pixels(pixels, policy)
    if policy.channels == 1:
        pixels = np.asarray(Image.fromarray(pixels).convert("L"))[:, :, None]
    return np.ascontiguousarray(pixels)


def apply_policy(data: bytes, path: str, policy: ImagePolicy) -> tuple[np.ndarray, bool]:
    """Decode ``data`` under ``policy``.

    Returns the HxWxC uint8 pixels and whether a plain decode of ``data`` already gives exactly
    these pixels (see :func:`_is_plain`).
    """
    img, kind = _open(data, path, policy)
    if kind == "PNG":
        check_png(data, path)
    _load(img, kind, path)
    return _policy_pixels(img, kind, path, policy), _is_plain(img, kind, policy)


def encode_pixels(pixels: np.ndarray, kind: Kind, quality: int = 90) -> bytes:
    """Encode HxWxC uint8 pixels as PNG (lossless) or JPEG (at ``quality``)."""
    img = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    out = io.BytesIO()
    if kind is Kind.PNG:
        img.save(out, format="PNG")
    else:
        img.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def read_regular_file(full: str, path: str) -> bytes:
    """The bytes of the regular file ``full`` (``path`` names it in errors; a link is
    followed). Anything else (a FIFO, a device, a socket) is refused without blocking
    (:func:`imgpack.system.read_regular_file`), so a FIFO never hangs the conversion."""
    try:
        return system.read_regular_file(full, follow_links=True)
    except system.NotRegularFile as exc:
        raise ImageError(path, f"not a regular file ({exc.kind}); only files are read") from None
    except OSError as exc:
        raise ImageError(path, f"cannot read: {exc.strerror or exc}") from None


def process_file(
    root: str, path: str, label: int, policy: ImagePolicy, encoding: Encoding
) -> Encoded:
    """Read, validate and encode one source file (runs in a conversion worker)."""
    return process_bytes(read_regular_file(f"{root}/{path}", path), path, label, policy, encoding)


def process_bytes(
    data: bytes, path: str, label: int, policy: ImagePolicy, encoding: Encoding
) -> Encoded:
    """Validate and encode the bytes of one image file (``path`` names it in errors)."""
    if encoding.name == "original" and policy.fixed_size is None:  # kept unless resized
        kept = _kept_jpeg(data, path, label, policy, encoding.measure)
        if kept is not None:
            return kept
    img, kind = _open(data, path, policy)
    if kind == "PNG":
        check_png(data, path)
    keepable = encoding.name == "original" or (encoding.name == "png" and kind == "PNG")
    # Decode (which validates) before anything reads EXIF: for a PNG, reading EXIF decodes the
    # image, and an error there must not be lost. A JPEG's EXIF comes from its header.
    if kind != "JPEG":
        _load(img, kind, path)
    if keepable and _is_plain(img, kind, policy):
        # The bytes are kept: decode them only to validate them, and copy no pixels.
        width, height = img.size
        if kind == "JPEG" and not _decodes_cleanly(data, height, width, img.mode == "L"):
            _load(img, kind, path, draft=True)  # Pillow decides (and says what is wrong)
        # What the kept bytes are: a grayscale file stays 1 channel (readers widen it to RGB).
        stored_channels = 1 if img.mode == "L" else 3
        kept = Encoded(path, label, data, height, width, stored_channels, Kind(kind))
        if kind == "PNG" and encoding.measure:  # decoded whole already, as the readers do
            kept.sums = pixel_sums(np.asarray(img), policy.channels)
        return kept
    if kind == "JPEG":
        _load(img, kind, path)
    return _encode(_policy_pixels(img, kind, path, policy), path, label, encoding)


def _kept_jpeg(
    data: bytes, path: str, label: int, policy: ImagePolicy, measure: bool = False
) -> Encoded | None:
    """The usual JPEG kept as it is, validated without Pillow: its header read by
    :func:`~imgpack.jpegheader.plain_jpeg` (a single frame, nothing that rotates it, gray or
    RGB) and its data decoded cleanly by libjpeg-turbo at 1/8 scale — or, to ``measure`` its
    pixels, whole, as the readers decode it; ``None`` for anything else (and for any doubt),
    which :func:`process_bytes` gives to Pillow as before."""
    if _simplejpeg is None or bytes(data[:3]) != b"\xff\xd8\xff":
        return None
    header = plain_jpeg(data)
    if header is None:
        return None
    height, width, channels = header
    if policy.target_size(height, width) is not None:
        return None  # resized: re-encoded
    if policy.max_pixels is not None and height * width > policy.max_pixels:
        return None  # Pillow's path refuses it, saying why
    if channels == 3 and policy.channels != 3:
        return None
    if measure:
        try:  # the call the readers make at full scale: the same pixels, and as strict
            pixels = _simplejpeg.decode_jpeg(
                data, colorspace="gray" if channels == 1 else "rgb", strict=True
            )
        except (ValueError, TypeError):
            return None
        kept = Encoded(path, label, data, height, width, channels, Kind.JPEG)
        kept.sums = pixel_sums(pixels, policy.channels)
        return kept
    if not _decodes_cleanly(data, height, width, channels == 1):
        return None
    return Encoded(path, label, data, height, width, channels, Kind.JPEG)


def process_pixels(
    pixels: np.ndarray, path: str, label: int, policy: ImagePolicy, encoding: Encoding
) -> Encoded:
    """Bring stored HWC uint8 pixels (1 or 3 channels) under ``policy`` and encode them: what a
    conversion from a raw output does."""
    img = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    return _encode(_policy_pixels(img, "raw", path, policy), path, label, encoding)


def _encode(pixels: np.ndarray, path: str, label: int, encoding: Encoding) -> Encoded:
    height, width, channels = pixels.shape
    if encoding.name == "raw":
        payload, stored = pixels.tobytes(), Kind.RAW
    elif encoding.name == "jpeg":
        payload, stored = encode_pixels(pixels, Kind.JPEG, encoding.quality), Kind.JPEG
    else:
        payload, stored = encode_pixels(pixels, Kind.PNG), Kind.PNG
    encoded = Encoded(path, label, payload, height, width, channels, stored)
    if encoding.measure and stored is not Kind.JPEG:  # lossless: these are the stored pixels
        encoded.sums = pixel_sums(pixels)  # (a JPEG's own are decoded by the worker's measure)
    return encoded


#: Pixels per row of the blocks :func:`pixel_sums` reduces (numpy sums down the columns of a
#: wide row, vectorised), and rows per block: its uint16 squares stay small (384 KB for RGB)
#: and its uint32 column sums exact (128 x 65,025 < 2**32).
_ROW_PIXELS, _BLOCK_ROWS = 512, 128


def pixel_sums(
    pixels: np.ndarray, channels: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The per-channel sums of uint8 ``pixels`` (HxWxC, or HxW gray) and of their squares, as
    exact integers: one pass of the C extension ``imgpack._pixelsums`` (0.06 ms for a 415x441
    RGB photo here), else :func:`numpy_pixel_sums` (0.27 ms), a conversion's other cost beside
    the decode. ``channels``: what a reader hands the image out as; gray counted as R, G and
    B alike when that is 3."""
    depth = pixels.shape[2] if pixels.ndim == 3 else 1
    if _pixelsums is not None and depth <= 4:
        found = _pixelsums.sums(np.ascontiguousarray(pixels, np.uint8).data, depth)
    else:
        found = numpy_pixel_sums(pixels)
    if depth == 1 and channels == 3:
        return found[0] * 3, found[1] * 3
    return found


def numpy_pixel_sums(pixels: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`pixel_sums` (without ``channels``) with numpy alone: the values laid out in wide
    rows of ``_ROW_PIXELS`` pixels, each block's columns summed in uint32 (its squares in
    uint16, exact for 0-255) into uint64 totals."""
    depth = pixels.shape[2] if pixels.ndim == 3 else 1
    flat = np.ascontiguousarray(pixels).reshape(-1)
    width = _ROW_PIXELS * depth
    whole = len(flat) // width * width
    rows = flat[:whole].reshape(-1, width)
    sums = np.zeros(width, np.uint64)
    squares = np.zeros(width, np.uint64)
    scratch = np.empty((min(_BLOCK_ROWS, len(rows)), width), np.uint16)
    for start in range(0, len(rows), _BLOCK_ROWS):
        block = rows[start : start + _BLOCK_ROWS]
        sums += np.add.reduce(block, axis=0, dtype=np.uint32)
        square = scratch[: len(block)]
        np.copyto(square, block)
        np.multiply(square, square, out=square)
        squares += np.add.reduce(square, axis=0, dtype=np.uint32)
    tail = flat[whole:].reshape(-1, depth).astype(np.uint64)
    by_channel = sums.reshape(-1, depth).sum(axis=0) + tail.sum(axis=0)
    squared = squares.reshape(-1, depth).sum(axis=0) + (tail * tail).sum(axis=0)
    return tuple(int(v) for v in by_channel), tuple(int(v) for v in squared)


def stored_info(payload: bytes) -> tuple[Kind, int, int, int]:
    """``(kind, height, width, channels)`` of a stored JPEG/PNG record, from its header only
    (nothing is decoded); :class:`DataError` for anything else."""
    kind = sniff(payload)
    if kind not in _KEEPABLE:
        raise DataError(f"stored record is not JPEG or PNG data ({describe_content(payload)})")
    try:
        with strict_pillow(), Image.open(io.BytesIO(payload), formats=[kind]) as img:
            width, height = img.size
            mode = img.mode
    except Exception as exc:
        raise DataError(f"cannot read the stored image's header: {describe(exc)}") from None
    return Kind(kind), height, width, 1 if mode == "L" else 3
