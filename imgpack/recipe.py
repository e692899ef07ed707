"""The training recipe's random crops, drawn as a pure function of ``(seed, epoch, index)``.

:class:`RandomResizedCrop` draws each sample's box with torchvision's parameters and its
algorithm (``RandomResizedCrop.get_params``: ten tries at an area share in ``scale`` and a
log-uniform aspect ratio in ``ratio``, then the centre crop that fits the ratio), and a
horizontal flip with probability ``flip``. The random numbers are not a generator's stream but
a counter-based hash of ``(seed, epoch, index, draw)`` (SplitMix64): sample ``index`` of epoch
``epoch`` gets the same box whichever process draws it, in whatever batch, under any number of
workers, ranks or nodes, and after a resume from any saved state. A box is drawn from the
image's size alone, before it is decoded, so the decode can do only the work the box needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from imgpack.errors import OptionError
from imgpack.stored import Payload, decode_stored, jpeg_mode, widen
from imgpack.units import parse_image_size

try:
    import simplejpeg as _simplejpeg
except ImportError:  # Pillow decodes every JPEG whole then
    _simplejpeg = None

#: The tries torchvision makes before it falls back to the centre crop.
TRIES = 10
#: Draw numbers within a sample's stream: two per try, then the box's place, then the flip.
_TOP, _LEFT, _FLIP = 2 * TRIES, 2 * TRIES + 1, 2 * TRIES + 2

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of uint64 ``x`` (a bijection that scatters every input bit)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices: np.ndarray, draw: int) -> np.ndarray:
    """Draw number ``draw`` of each sample of ``indices`` in ``epoch``: floats in ``[0, 1)``
    (53 random bits each), a pure function of ``(seed, epoch, index, draw)``."""
    key = _splitmix(np.full(1, seed & (2**64 - 1), np.uint64))
    key = _splitmix(key ^ np.uint64(epoch & (2**64 - 1)))
    with np.errstate(over="ignore"):
        x = _splitmix(key ^ (np.asarray(indices, np.int64).astype(np.uint64) * _GOLDEN))
        x = _splitmix(x ^ np.uint64(draw))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class Boxes:
    """One box per sample, in the source image's pixels: rows ``top:top + height``, columns
    ``left:left + width``, then flipped left to right where ``flip``."""

    top: np.ndarray
    left: np.ndarray
    height: np.ndarray
    width: np.ndarray
    flip: np.ndarray


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` followed by
    ``RandomHorizontalFlip(flip)``: the box's content is resized to ``size`` (``N`` or
    ``(H, W)``)."""

    size: tuple[int, int]  # (H, W); an int N or "HxW" is accepted and normalised
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", parse_image_size(self.size))
        low, high = (float(v) for v in self.scale)
        if not 0 < low <= high <= 1:
            raise OptionError(f"invalid scale {self.scale!r}: expected 0 < low <= high <= 1")
        low_ratio, high_ratio = (float(v) for v in self.ratio)
        if not 0 < low_ratio <= high_ratio:
            raise OptionError(f"invalid ratio {self.ratio!r}: expected 0 < low <= high")
        if not 0 <= float(self.flip) <= 1:
            raise OptionError(f"invalid flip {self.flip!r}: expected a probability, 0 to 1")
        object.__setattr__(self, "scale", (low, high))
        object.__setattr__(self, "ratio", (low_ratio, high_ratio))
        object.__setattr__(self, "flip", float(self.flip))

    def boxes(
        self,
        seed: int,
        epoch: int,
        indices: np.ndarray,
        heights: np.ndarray,
        widths: np.ndarray,
    ) -> Boxes:
        """The boxes of samples ``indices`` in ``epoch`` (images of ``heights`` x ``widths``),
        torchvision's ``get_params`` for each, on the numbers :func:`uniforms` draws."""
        indices = np.asarray(indices, np.int64)
        height = np.asarray(heights, np.int64)
        width = np.asarray(widths, np.int64)
        area = (height * width).astype(np.float64)
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        found = np.zeros(len(indices), bool)
        box_h = np.zeros(len(indices), np.int64)
        box_w = np.zeros(len(indices), np.int64)
        for attempt in range(TRIES):
            share = uniforms(seed, epoch, indices, 2 * attempt)
            target = area * (self.scale[0] + share * (self.scale[1] - self.scale[0]))
            aspect = np.exp(
                log_low + uniforms(seed, epoch, indices, 2 * attempt + 1) * (log_high - log_low)
            )
            w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
            h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
            fits = ~found & (w > 0) & (w <= width) & (h > 0) & (h <= height)
            box_h[fits], box_w[fits] = h[fits], w[fits]
            found |= fits
        top = np.floor(uniforms(seed, epoch, indices, _TOP) * (height - box_h + 1)).astype(np.int64)
        left = np.floor(uniforms(seed, epoch, indices, _LEFT) * (width - box_w + 1)).astype(
            np.int64
        )
        # The fallback: the whole image, or its centre cut to the nearer end of ``ratio``.
        rest = ~found
        if rest.any():
            in_ratio = width[rest] / height[rest]
            w, h = width[rest].copy(), height[rest].copy()
            narrow = in_ratio < self.ratio[0]
            wide = in_ratio > self.ratio[1]
            h[narrow] = np.rint(w[narrow] / self.ratio[0]).astype(np.int64)
            w[wide] = np.rint(h[wide] * self.ratio[1]).astype(np.int64)
            box_h[rest], box_w[rest] = h, w
            top[rest] = (height[rest] - h) // 2
            left[rest] = (width[rest] - w) // 2
        flip = uniforms(seed, epoch, indices, _FLIP) < self.flip
        return Boxes(top, left, box_h, box_w, flip)


@dataclass(frozen=True)
class CenterCrop:
    """The evaluation half: torchvision's ``Resize(resize)`` then ``CenterCrop(size)`` (the
    shorter side to ``resize``, the centre ``size`` taken), as one box in the stored image,
    resized in one bilinear step (within rounding of torchvision's two steps). No randomness:
    the same box in every epoch."""

    size: tuple[int, int]  # (H, W); an int N or "HxW" is accepted and normalised
    resize: int = 0  # the shorter side before the crop; 0: 8/7 of the crop (256 for 224)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", parse_image_size(self.size))
        resize = int(self.resize) or round(max(self.size) * 8 / 7)
        if resize < max(self.size):
            raise OptionError(
                f"invalid resize {self.resize!r}: the shorter side must be at least the crop "
                f"({max(self.size)})"
            )
        object.__setattr__(self, "resize", resize)

    def boxes(
        self,
        seed: int,
        epoch: int,
        indices: np.ndarray,
        heights: np.ndarray,
        widths: np.ndarray,
    ) -> Boxes:
        """The centre boxes (``seed`` and ``epoch`` play no part)."""
        height = np.asarray(heights, np.int64)
        width = np.asarray(widths, np.int64)
        short = np.minimum(height, width)
        # torchvision's Resize(resize): the shorter side to ``resize``, the longer floored.
        resized_h = np.where(height <= width, self.resize, height * self.resize // short)
        resized_w = np.where(height <= width, width * self.resize // short, self.resize)
        crop_h, crop_w = self.size
        top = np.rint((resized_h - crop_h) / 2.0)  # torchvision's CenterCrop
        left = np.rint((resized_w - crop_w) / 2.0)
        scale_y, scale_x = height / resized_h, width / resized_w
        return Boxes(
            top * scale_y,
            left * scale_x,
            crop_h * scale_y,
            crop_w * scale_x,
            np.zeros(len(height), bool),
        )


#: The crops a reader takes as ``recipe=``.
Crop = RandomResizedCrop | CenterCrop


class EpochIndices(np.ndarray):
    """A batch's sample indices that carry the epoch they were drawn for
    (:meth:`imgpack.loading.ShardSampler.batches` yields them): a reader's random crops follow
    the epoch of the batch, not the one the reader was last told, so DataLoader workers that
    persist across epochs draw each epoch's boxes. For an output read lazily, ``done`` also
    carries the shards the sampler is done with this epoch (a bitmap, ``np.packbits``): the
    worker reading the batch lets its pins on them go."""

    epoch: int
    done: bytes | None

    def __new__(cls, indices: np.ndarray, epoch: int, done: bytes | None = None) -> EpochIndices:
        found = np.asarray(indices, np.int64).view(cls)
        found.epoch = int(epoch)
        found.done = done
        return found

    def __array_finalize__(self, obj: object) -> None:
        self.epoch = int(getattr(obj, "epoch", 0))
        self.done = getattr(obj, "done", None)

    def __reduce__(self) -> tuple[object, ...]:  # to a worker: the indices, epoch and done
        return _epoch_indices, (np.asarray(self), self.epoch, self.done)


def _epoch_indices(indices: np.ndarray, epoch: int, done: bytes | None = None) -> EpochIndices:
    return EpochIndices(indices, epoch, done)


def crop_resize(
    pixels: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int], flip: bool
) -> np.ndarray:
    """The ``box`` (top, left, height, width, in ``pixels``' coordinates) of HxWxC uint8
    ``pixels``, resized to ``size`` (H, W) with Pillow's bilinear filter, flipped left to right
    when ``flip``. A box of whole pixels is cropped, then resized: what torchvision's
    ``RandomResizedCrop`` does to a PIL image; a box in a JPEG decoded at a reduced scale has
    fractional edges and is resized in one step from there (Pillow's ``resize(box=)``)."""
    top, left, height, width = box
    gray = pixels.shape[2] == 1
    img = Image.fromarray(pixels[:, :, 0] if gray else pixels)
    region = (float(left), float(top), float(left + width), float(top + height))
    target = (size[1], size[0])
    if all(v.is_integer() for v in region):
        img = img.crop(region).resize(target, Image.Resampling.BILINEAR)
    else:
        img = img.resize(target, Image.Resampling.BILINEAR, box=region)
    out = np.asarray(img)
    if gray:
        out = out[:, :, None]
    return out[:, ::-1] if flip else out


def decode_box(
    payload: Payload | np.ndarray,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    flip: bool,
) -> np.ndarray:
    """A stored record's ``box`` (top, left, height, width in the stored image), resized to
    ``size`` and flipped when ``flip``: HxWxC uint8 (C = ``channels``). A JPEG is decoded at the
    smallest DCT scale whose scaled box still covers ``size`` (libjpeg-turbo through
    ``simplejpeg``), the box taken from that; a PNG, or raw pixels (an array), in full."""
    top, left, height, width = box
    if isinstance(payload, np.ndarray):
        return widen(crop_resize(payload, (top, left, height, width), size, flip), channels)
    pixels = None
    if _simplejpeg is not None and bytes(payload[:3]) == b"\xff\xd8\xff":
        pixels = _scaled_jpeg(payload, channels, box, size)
    if pixels is not None:
        scaled, full = pixels
        sy, sx = scaled.shape[0] / full[0], scaled.shape[1] / full[1]
        region = (top * sy, left * sx, height * sy, width * sx)
        return widen(crop_resize(scaled, region, size, flip), channels)
    whole = decode_stored(payload, channels)
    return widen(crop_resize(whole, (top, left, height, width), size, flip), channels)


#: The DCT scales a crop's JPEG is decoded at (1/8, 1/4, 1/2): libjpeg-turbo's scaled inverse
#: DCTs of the other eighths (3/8, 5/8, 7/8) were no faster on the benchmark's photos and moved
#: pixels further from a full decode's crop (mean |difference| 0.57 against 0.00, the largest
#: 129 against 28, on ImageNet-size photos: ``scripts/bench_recipe.py``).
SCALES = (8, 4, 2)


def _scaled_jpeg(
    payload: Payload,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
) -> tuple[np.ndarray, tuple[int, int]] | None:
    """A JPEG decoded at the smallest DCT scale of :data:`SCALES` (else in full) that keeps the
    box at least ``size``, and the image's full (H, W); ``None`` for Pillow's path (a colour
    space or damage simplejpeg declines)."""
    assert _simplejpeg is not None
    try:
        found = jpeg_mode(payload, channels)
        if found is None:
            return None
        height, width, mode = found
        _, _, box_h, box_w = box
        factor = next((k for k in SCALES if box_h / k >= size[0] and box_w / k >= size[1]), 1)
        pixels = _simplejpeg.decode_jpeg(
            payload,
            colorspace=mode,
            min_height=-(-height // factor),
            min_width=-(-width // factor),
            strict=True,
        )
    except (ValueError, TypeError):
        return None
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels, (int(height), int(width))
