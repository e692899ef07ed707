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
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from imgpack.errors import OptionError
from imgpack.stored import Payload, decode_stored, jpeg_mode, widen
from imgpack.tensors import readonly_tensor, torch_may_run
from imgpack.units import parse_image_size

if TYPE_CHECKING:
    import torch

try:
    import simplejpeg as _simplejpeg
except ImportError:  # Pillow decodes every JPEG whole then
    _simplejpeg = None

try:  # built where a C compiler and libjpeg-turbo's headers were (setup.py)
    import imgpack._jpegregion as _jpegregion
except ImportError:  # the whole image at a DCT scale (simplejpeg), then the crop
    _jpegregion = None  # type: ignore[assignment]

try:  # built where a C compiler was (setup.py)
    import imgpack._batchcopy as _batchcopy
except ImportError:  # torch copies (and flips) each crop into its slot
    _batchcopy = None  # type: ignore[assignment]

#: A stored JPEG's ``(height, width, colorspace)`` as :func:`imgpack.stored.jpeg_mode` reads
#: it from the header: a caller that has read it passes it on, so the header is read once.
Header = tuple[int, int, str]

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
    return _draws(seed, epoch, indices, np.array([draw], np.uint64))[:, 0]


def _draws(seed: int, epoch: int, indices: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """:func:`uniforms` for every draw number of ``draws`` (uint64) at once: a ``(len(indices),
    len(draws))`` array, in one pass over the samples (a batch's boxes take 23 draws each)."""
    key = _splitmix(np.full(1, seed & (2**64 - 1), np.uint64))
    key = _splitmix(key ^ np.uint64(epoch & (2**64 - 1)))
    with np.errstate(over="ignore"):
        x = _splitmix(key ^ (np.asarray(indices, np.int64).astype(np.uint64) * _GOLDEN))
        x = _splitmix(x[:, None] ^ draws[None, :])
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
        drawn = _draws(seed, epoch, indices, np.arange(_FLIP + 1, dtype=np.uint64))
        # Every try of every sample at once ((samples, TRIES) arrays): each sample's box is its
        # first try that fits, as torchvision's loop takes it.
        share, stretch = drawn[:, 0 : 2 * TRIES : 2], drawn[:, 1 : 2 * TRIES : 2]
        target = area[:, None] * (self.scale[0] + share * (self.scale[1] - self.scale[0]))
        aspect = np.exp(log_low + stretch * (log_high - log_low))
        w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
        h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
        found = fits.any(axis=1)
        first = fits.argmax(axis=1)  # the first try that fits (0 where none does)
        rows = np.arange(len(indices))
        box_h = np.where(found, h[rows, first], 0)
        box_w = np.where(found, w[rows, first], 0)
        top = np.floor(drawn[:, _TOP] * (height - box_h + 1)).astype(np.int64)
        left = np.floor(drawn[:, _LEFT] * (width - box_w + 1)).astype(np.int64)
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
        flip = drawn[:, _FLIP] < self.flip
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
    pixels: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    flip: bool,
    exact: bool = True,
) -> np.ndarray:
    """The ``box`` (top, left, height, width, in ``pixels``' coordinates) of HxWxC uint8
    ``pixels``, resized to ``size`` (H, W) with a bilinear filter (antialiased when it shrinks),
    flipped left to right when ``flip``. A box of whole pixels is cropped, then resized: what
    torchvision's ``RandomResizedCrop`` does to a PIL image; a box in a JPEG decoded at a
    reduced scale has fractional edges and is resized in one step from there (Pillow's
    ``resize(box=)``). ``exact=False`` (pixels already within a tolerance of the stored image's,
    a JPEG's): a box of whole pixels is resized by torch's antialiased bilinear kernel for
    uint8, what torchvision's ``RandomResizedCrop`` does to a tensor (within 1 of Pillow's, about
    3x faster), where torch's threads may run (:func:`imgpack.tensors.torch_may_run`)."""
    top, left, height, width = box
    gray = pixels.shape[2] == 1
    region = (float(left), float(top), float(left + width), float(top + height))
    target = (size[1], size[0])
    whole = all(v.is_integer() for v in region)
    if not exact and whole and not gray and torch_may_run():
        import torch  # a conversion (no crops) never imports it

        y, x, h, w = int(top), int(left), int(height), int(width)
        crop = torch.from_numpy(np.ascontiguousarray(pixels[y : y + h, x : x + w]))
        batch = crop.permute(2, 0, 1)[None]  # (1, C, H, W) over channels-last memory
        resized = torch.nn.functional.interpolate(
            batch, size=size, mode="bilinear", antialias=True, align_corners=False
        )
        chw = resized[0].flip(-1) if flip else resized[0]
        return chw.permute(1, 2, 0).numpy()  # HWC, over CHW memory: see place()
    img = Image.fromarray(pixels[:, :, 0] if gray else pixels)
    if whole:
        img = img.crop(region).resize(target, Image.Resampling.BILINEAR)
    else:
        img = img.resize(target, Image.Resampling.BILINEAR, box=region)
    out = np.asarray(img)
    if gray:
        out = out[:, :, None]
    return _flipped(out) if flip else out


def _flipped(pixels: np.ndarray) -> np.ndarray:
    """HxWxC ``pixels`` flipped left to right, as a new contiguous array: through torch's flip
    where its threads may run (numpy copies a negatively strided view value by value: 227 µs
    for a 224x224 RGB crop against torch's 18 µs), else through numpy."""
    if not torch_may_run():
        return np.ascontiguousarray(pixels[:, ::-1])
    return readonly_tensor(pixels).flip(1).numpy()


def place(pixels: np.ndarray, out: torch.Tensor, flip: bool = False) -> None:
    """Copy HxWxC uint8 ``pixels`` (a crop) into ``out``, a CxHxW uint8 tensor (a batch's
    sample), flipped left to right when ``flip``. The crops torch resized are an HWC view of
    CxHxW memory: their planes are copied as they lie, each row reversed for a flip, with
    streaming stores (``imgpack._batchcopy``: the batch is written once and read by another
    process). The others are transposed on the way, through torch where its threads may run,
    else through numpy."""
    planes = pixels.transpose(2, 0, 1)
    if _batchcopy is not None and planes.flags.c_contiguous and out.is_contiguous():
        _batchcopy.place(planes.data, out.numpy().data, pixels.shape[1], flip)
        return
    if not torch_may_run():
        out.numpy()[:] = (pixels[:, ::-1] if flip else pixels).transpose(2, 0, 1)
        return
    chw = readonly_tensor(pixels).permute(2, 0, 1)
    out.copy_(chw.flip(-1) if flip else chw)


def decode_box(
    payload: Payload | np.ndarray,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    flip: bool,
    header: Header | None = None,
) -> np.ndarray:
    """A stored record's ``box`` (top, left, height, width in the stored image), resized to
    ``size`` and flipped when ``flip``: HxWxC uint8 (C = ``channels``). A JPEG is decoded at the
    smallest DCT scale whose scaled box still covers ``size``, only around the box where the
    region decoder was built (:func:`_region_jpeg`), else whole (simplejpeg), and resized
    within a tolerance (``crop_resize(exact=False)``); a PNG, or raw pixels (an array), in
    full, then cropped and resized as torchvision does to a PIL image. ``header``: the JPEG's
    :func:`jpeg_header`, where the caller read it already."""
    pixels = unflipped_box(payload, channels, box, size, header)
    return _flipped(pixels) if flip else pixels


def unflipped_box(
    payload: Payload | np.ndarray,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    header: Header | None = None,
) -> np.ndarray:
    """:func:`decode_box` before the flip: what a reader places into its batch, flipping it on
    the way (:func:`place`)."""
    top, left, height, width = box
    if isinstance(payload, np.ndarray):
        return widen(crop_resize(payload, (top, left, height, width), size, False), channels)
    pixels = None
    if _simplejpeg is not None and bytes(payload[:3]) == b"\xff\xd8\xff":
        if _jpegregion is not None:
            cropped = _region_jpeg(payload, channels, box, size, header)
            if cropped is not None:
                return cropped
        pixels = _scaled_jpeg(payload, channels, box, size, header)
    if pixels is not None:
        scaled, full = pixels
        sy, sx = scaled.shape[0] / full[0], scaled.shape[1] / full[1]
        region = (top * sy, left * sx, height * sy, width * sx)
        return widen(crop_resize(scaled, region, size, False, exact=False), channels)
    whole = decode_stored(payload, channels)
    return widen(crop_resize(whole, (top, left, height, width), size, False), channels)


def jpeg_header(payload: Payload, channels: int) -> Header | None:
    """A stored JPEG's ``(height, width, colorspace)`` from its header, as the crops decode it
    (:func:`imgpack.stored.jpeg_mode`); ``None`` for anything else (a PNG, a colour space or a
    header only Pillow takes, no simplejpeg): the decode and its size are then Pillow's."""
    if _simplejpeg is None or bytes(payload[:3]) != b"\xff\xd8\xff":
        return None
    try:
        return jpeg_mode(payload, channels)
    except (ValueError, TypeError):
        return None


#: The DCT scales a crop's JPEG is decoded at (1/8, 1/4, 1/2): libjpeg-turbo's scaled inverse
#: DCTs of the other eighths (3/8, 5/8, 7/8) were no faster on the benchmark's photos and moved
#: pixels further from a full decode's crop (mean |difference| 0.57 against 0.00, the largest
#: 129 against 28, on ImageNet-size photos: ``scripts/bench_recipe.py``).
SCALES = (8, 4, 2)


def _scale_factor(box: tuple[float, float, float, float], size: tuple[int, int]) -> int:
    """The smallest DCT scale of :data:`SCALES` (else 1) that keeps ``box`` at least ``size``."""
    _, _, box_h, box_w = box
    return next((k for k in SCALES if box_h / k >= size[0] and box_w / k >= size[1]), 1)


def _jpeg_plan(
    payload: Payload,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    header: Header | None = None,
) -> tuple[int, int, str, int] | None:
    """A stored JPEG's full height and width, the colour space it decodes to (``gray`` or
    ``rgb``) and the DCT scale the box allows (:func:`_scale_factor`), from its header (read
    here unless ``header`` is given); ``None`` for Pillow's path. Raises what the header read
    raises (``ValueError``)."""
    found = header if header is not None else jpeg_mode(payload, channels)
    if found is None:
        return None
    height, width, mode = found
    return height, width, mode, _scale_factor(box, size)


def _region_jpeg(
    payload: Payload,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    header: Header | None = None,
) -> np.ndarray | None:
    """:func:`unflipped_box` of a JPEG through libjpeg-turbo's partial decompression
    (``imgpack._jpegregion``): at the DCT scale :func:`_scaled_jpeg` takes, only the rows and
    the iMCU columns around the box are decoded, with a margin that holds every pixel the
    bilinear resize reads and the chroma upsampling's edge: the result is the scaled path's.
    ``None`` for the other paths (a colour space or damage the decoder declines)."""
    assert _jpegregion is not None
    top, left, height, width = box
    try:
        planned = _jpeg_plan(payload, channels, box, size, header)
        if planned is None:
            return None
        full_h, full_w, mode, factor = planned
        scaled_h, scaled_w = -(-full_h // factor), -(-full_w // factor)
        sy, sx = scaled_h / full_h, scaled_w / full_w
        top, left, height, width = top * sy, left * sx, height * sy, width * sx
        # Pillow's bilinear resize reads up to max(1, in/out) pixels beyond each output
        # pixel's span; two more cover the upsampling at a cropped edge.
        margin_y = math.ceil(max(1.0, height / size[0])) + 2
        margin_x = math.ceil(max(1.0, width / size[1])) + 2
        y0 = max(0, math.floor(top) - margin_y)
        y1 = min(scaled_h, math.ceil(top + height) + margin_y)
        x0 = max(0, math.floor(left) - margin_x)
        x1 = min(scaled_w, math.ceil(left + width) + margin_x)
        data, rows, cols, depth, xoffset, got_h, got_w = _jpegregion.decode(
            payload, mode, factor, y0, y1, x0, x1
        )
    except (ValueError, TypeError, OverflowError):
        return None
    if (got_h, got_w) != (scaled_h, scaled_w):  # not the scale the box was taken at
        return None
    pixels = np.frombuffer(data, np.uint8).reshape(rows, cols, depth)
    shifted = (top - y0, left - xoffset, height, width)
    return widen(crop_resize(pixels, shifted, size, False, exact=False), channels)


def _scaled_jpeg(
    payload: Payload,
    channels: int,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    header: Header | None = None,
) -> tuple[np.ndarray, tuple[int, int]] | None:
    """A JPEG decoded at the smallest DCT scale of :data:`SCALES` (else in full) that keeps the
    box at least ``size``, and the image's full (H, W); ``None`` for Pillow's path (a colour
    space or damage simplejpeg declines)."""
    assert _simplejpeg is not None
    try:
        planned = _jpeg_plan(payload, channels, box, size, header)
        if planned is None:
            return None
        height, width, mode, factor = planned
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
