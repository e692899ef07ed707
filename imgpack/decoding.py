"""Decoding stored records: the reader side of the image policy, fast.

Every reader decodes through here:

- **JPEG** records go to libjpeg-turbo through ``simplejpeg`` with accurate DCT and fancy
  upsampling (Pillow's settings, so the same pixels, about 2x faster), strictly, straight into the
  batch tensor. Whatever it declines (CMYK, 12-bit, arithmetic coding, a warning, damage) goes to
  Pillow, which decides: a record decodes to the same pixels, or fails the same way, either way.
- **PNG** records (and JPEGs without simplejpeg) go to Pillow, strictly.
- **Threads**: a batch is decoded by a small per-process thread pool (both decoders release the
  GIL), so ``num_workers=0`` uses every core without handing batches between processes. By
  default a process takes its share of the usable CPUs: all of them in the main process,
  ``cpus // num_workers`` in a DataLoader worker, so workers and threads never oversubscribe.
- **Decoding to a size** (``size=`` on the readers): a JPEG is decoded at the largest DCT scale
  (1/2, 1/4, 1/8) at which it still covers the size, exactly as Pillow's ``Image.draft`` picks
  it, then resized by the policy's method (``crop`` or ``stretch``, bilinear). Reference:
  ``draft`` + :func:`imgpack.images.resize_pixels` in Pillow give the same pixels.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from imgpack.errors import DataError, ImageError, OptionError
from imgpack.handover import POOL_MAX_BYTES, arena_tensor, in_worker, lease, shared_tensor
from imgpack.images import ImagePolicy, apply_policy, describe, resize_pixels, strict_pillow
from imgpack.system import usable_cpus

try:
    import simplejpeg as _simplejpeg
except ImportError:  # Pillow decodes everything then
    _simplejpeg = None

Images = torch.Tensor | list[torch.Tensor]
Payload = bytes | bytearray | memoryview
_JPEG = b"\xff\xd8\xff"
_PNG = b"\x89PNG\r\n\x1a\n"
_DRAFT_SCALES = (8, 4, 2, 1)


def default_threads() -> int:
    """Decode threads for this process: its share of the usable CPUs (all of them outside a
    DataLoader worker; ``cpus // num_workers``, at least 1, in one)."""
    cpus = usable_cpus()
    info = get_worker_info()
    return cpus if info is None else max(1, cpus // max(1, info.num_workers))


def draft_scale(height: int, width: int, size: tuple[int, int] | None) -> int:
    """The DCT scale denominator (8, 4, 2 or 1) Pillow's ``Image.draft`` picks to decode a
    ``height x width`` JPEG for ``size`` (H, W): the largest whose result still covers it."""
    if size is None or size[0] <= 0 or size[1] <= 0:
        return 1
    scale = min(width // size[1], height // size[0])
    return next((s for s in _DRAFT_SCALES if scale >= s), 1)


def _widen(pixels: np.ndarray, channels: int) -> np.ndarray:
    """HxWx1 gray pixels widened to ``channels`` (replicated into R, G and B)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[2] == channels:
        return pixels
    if pixels.shape[2] == 1 and channels == 3:
        return np.repeat(pixels, 3, axis=2)
    raise DataError(f"stored image has {pixels.shape[2]} channels, expected {channels}")


def _fast_jpeg(
    payload: Payload, channels: int, size: tuple[int, int] | None, out: np.ndarray | None
) -> np.ndarray | None:
    """A JPEG record's pixels through simplejpeg (written into ``out`` when it has their
    shape), or ``None`` for Pillow to decide. Gray stays one channel (the caller widens it)."""
    assert _simplejpeg is not None
    try:
        height, width, colorspace, _ = _simplejpeg.decode_jpeg_header(payload)
        if colorspace == "Gray":
            mode = "gray"
        elif colorspace in ("YCbCr", "RGB") and channels == 3:
            mode = "rgb"
        else:
            return None
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
        return _widen(pixels, channels)
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


# -- the thread pool ---------------------------------------------------------------------
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix="imgpack-decode"
            )
        return pool


def _forget_pools() -> None:  # a forked child has the parent's pools but none of their threads
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


#: By default, images smaller than this (pixels, as stored) are decoded in the calling thread:
#: for them handing work to pool threads costs more than it saves (Pillow's per-image Python
#: work holds the GIL). Measured with 2 threads against 1: 32x32 PNGs 0.54x, 32x32 JPEGs 0.74x,
#: 64x64 PNGs 1.81x, 64x64 JPEGs 0.86x, 96x96 JPEGs 1.14x, 256x256 JPEGs 1.91x.
THREADED_MIN_PIXELS = 64 * 64


def run_threaded(count: int, work: Callable[[int], None], threads: int) -> None:
    """``work(k)`` for every ``k < count``, on up to ``threads`` pool threads (contiguous
    chunks, two per thread); the first error, in order, is raised."""
    threads = min(threads, count)
    if threads <= 1:
        for k in range(count):
            work(k)
        return
    chunks = min(count, 2 * threads)
    bounds = [count * c // chunks for c in range(chunks + 1)]

    def chunk(c: int) -> None:
        for k in range(bounds[c], bounds[c + 1]):
            work(k)

    futures = [_pool(threads).submit(chunk, c) for c in range(chunks)]
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


class Decoder:
    """Decodes batches of stored records into batch tensors.

    ``channels``: of the output (gray records are widened). ``policy``: resize on read (its
    ``size``, ``resize`` and ``resample``), or ``None``. ``threads``: decode threads (``None``:
    :func:`default_threads`, decided in the process that decodes). ``foreign``: the payloads are
    source files, not imgpack records: they go through the whole image policy (EXIF, alpha,
    modes) of :func:`imgpack.images.apply_policy` with this policy.
    """

    def __init__(
        self,
        channels: int,
        policy: ImagePolicy | None = None,
        threads: int | None = None,
        foreign: ImagePolicy | None = None,
    ) -> None:
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise OptionError(f"invalid decode_threads {threads!r}: expected 1 or more, or None")
        self.channels = channels
        self.policy = policy if policy is not None and policy.size is not None else None
        self.threads = threads
        self.foreign = foreign

    @property
    def size(self) -> tuple[int, int] | None:
        return self.policy.size if self.policy is not None else None

    def one(self, item: Payload | np.ndarray, where: str, out: np.ndarray | None = None) -> Any:
        """HxWxC pixels of one record (a payload, or raw HWC pixels already read)."""
        try:
            if isinstance(item, np.ndarray):
                pixels = resize_pixels(item, self.policy) if self.policy is not None else item
                return _place(pixels, self.channels, out) if out is not None else pixels
            if self.foreign is not None:
                pixels = apply_policy(bytes(item), where, self.foreign)[0]
                if self.policy is not None:
                    pixels = resize_pixels(pixels, self.policy)
                return _place(pixels, self.channels, out) if out is not None else pixels
            return decode_stored(item, self.channels, self.policy, out)
        except ImageError as exc:
            raise DataError(str(exc)) from None
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None

    def single(self, item: Payload | np.ndarray, where: str) -> torch.Tensor:
        """One record as a ``(C, H, W)`` uint8 tensor of its own memory (``ds[i]``): the array
        the decoder made, wrapped as it is, or a copy where it is read-only (Pillow's), shared
        with the stored pixels, or not yet ``channels`` wide. In a DataLoader worker it is
        decoded into the worker's arena (:func:`imgpack.handover.arena_tensor`), from which a
        batch of such images reaches the training process without a copy."""
        if in_worker():
            shape = self._shape(item)
            out = arena_tensor(shape) if shape is not None else None
            if out is not None:
                self.one(item, where, out.numpy())
                return out.permute(2, 0, 1)
        pixels = self.one(item, where)
        if (
            isinstance(item, np.ndarray)
            or not pixels.flags.writeable
            or pixels.ndim != 3
            or pixels.shape[2] != self.channels
        ):
            shape = (pixels.shape[0], pixels.shape[1], self.channels)
            out = scratch_tensor(shape)
            _place(pixels, self.channels, out.numpy())
            return out.permute(2, 0, 1)
        return torch.from_numpy(pixels).permute(2, 0, 1)

    def _shape(self, item: Payload | np.ndarray) -> tuple[int, int, int] | None:
        if self.size is not None:
            return (*self.size, self.channels)
        if isinstance(item, np.ndarray):
            return (item.shape[0], item.shape[1], self.channels)
        if self.foreign is not None:
            return None
        return stored_shape(item, self.channels)

    def _default_threads(self, items: Sequence[Payload | np.ndarray]) -> int:
        """:func:`default_threads`, or 1 for images (as stored) under
        :data:`THREADED_MIN_PIXELS`."""
        threads = default_threads()
        if threads > 1 and items and self.foreign is None:
            first = items[0]
            shape = first.shape if isinstance(first, np.ndarray) else stored_shape(first, 1)
            if shape is not None and shape[0] * shape[1] < THREADED_MIN_PIXELS:
                return 1
        return threads

    def batch(self, items: Sequence[Payload | np.ndarray], where: Callable[[int], str]) -> Images:
        """A ``(B, C, H, W)`` uint8 batch of ``items`` (each decoded straight into its row), or
        a list of ``(C, H, W)`` tensors when their sizes differ. ``where(k)`` names the k-th
        record in the error a damaged one raises."""
        count = len(items)
        shapes = [self._shape(item) for item in items]
        if count == 1 and shapes[0] is not None:  # one image (``ds[i]``): no threads to ask,
            # and plain memory: the pool's buffers are for whole batches (in a worker, images
            # read one by one would each take a shared buffer and hold it in the batch)
            out = scratch_tensor((1, *shapes[0]))
            self.one(items[0], where(0), out.numpy()[0])
            return out.permute(0, 3, 1, 2)
        threads = self.threads or self._default_threads(items)
        if count and shapes[0] is not None and all(s == shapes[0] for s in shapes):
            out = new_batch_tensor((count, *shapes[0]))
            rows = out.numpy()
            run_threaded(count, lambda k: self.one(items[k], where(k), rows[k]), threads)
            return out.permute(0, 3, 1, 2)
        if count and all(s is not None for s in shapes):
            return self._ragged(items, shapes, where, threads)  # type: ignore[arg-type]
        arrays: list[Any] = [None] * count

        def decode(k: int) -> None:
            arrays[k] = self.one(items[k], where(k))

        run_threaded(count, decode, threads)
        return arrays_to_batch(arrays)

    def _ragged(
        self,
        items: Sequence[Payload | np.ndarray],
        shapes: list[tuple[int, int, int]],
        where: Callable[[int], str],
        threads: int,
    ) -> list[torch.Tensor]:
        """Images of different sizes, each decoded straight into its place in one batch
        buffer (lent from the pool where it has room: from a DataLoader worker the whole
        batch then travels as one buffer, :func:`imgpack.handover.Handover`)."""
        ends = list(itertools.accumulate(math.prod(shape) for shape in shapes))
        flat = new_batch_tensor((ends[-1],))
        data = flat.numpy()
        starts = [0, *ends[:-1]]
        rows = [data[a:b].reshape(shape) for a, b, shape in zip(starts, ends, shapes, strict=True)]
        run_threaded(len(items), lambda k: self.one(items[k], where(k), rows[k]), threads)
        return [
            flat[a:b].view(shape).permute(2, 0, 1)
            for a, b, shape in zip(starts, ends, shapes, strict=True)
        ]


def new_batch_tensor(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised tensor for a batch, lent from a pool (:func:`imgpack.handover.lease`)
    where one has room: in a DataLoader worker it reaches the training process without a copy,
    and a large batch in the training process reuses memory instead of fresh pages. When the
    pool has no room, a large batch in a worker is allocated in a shared-memory segment of its
    own (torch would copy it there to send it). Anything else is :func:`scratch_tensor`."""
    try:
        leased = lease(shape, dtype)
        if leased is not None:
            return leased
        if in_worker() and math.prod(shape) * dtype.itemsize > POOL_MAX_BYTES:
            return shared_tensor(shape, dtype)
        if dtype == torch.uint8:
            return scratch_tensor(shape)
        return torch.empty(tuple(shape), dtype=dtype)
    except (RuntimeError, MemoryError) as exc:
        raise DataError(
            f"cannot allocate a batch of shape {tuple(shape)}: {str(exc).splitlines()[0]}"
        ) from None


def scratch_tensor(shape: Sequence[int]) -> torch.Tensor:
    """An uninitialised uint8 tensor in numpy's (malloc's) memory: for a batch or its scratch
    space. torch's own allocator takes fresh pages from the kernel for allocations of a few
    hundred KB, call after call (2-3 page faults each measured here, with transparent huge
    pages: tens to hundreds of µs, the cost of a whole raw batch's gather); malloc reuses
    what the last one freed."""
    return torch.from_numpy(np.empty(tuple(shape), np.uint8))


def arrays_to_batch(arrays: list[np.ndarray]) -> Images:
    """HWC uint8 arrays to a ``(B, C, H, W)`` batch view, copied once into the batch tensor; a
    list of ``(C, H, W)`` tensors when sizes differ."""
    if arrays and all(a.shape == arrays[0].shape for a in arrays):
        out = new_batch_tensor((len(arrays), *arrays[0].shape))
        rows = out.numpy()
        for k, array in enumerate(arrays):
            rows[k] = array
        return out.permute(0, 3, 1, 2)
    return [torch.from_numpy(a if a.flags.writeable else a.copy()).permute(2, 0, 1) for a in arrays]
