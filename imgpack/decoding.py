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

import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack.errors import DataError, ImageError, OptionError
from imgpack.handover import POOL_MAX_BYTES, arena_tensor, in_worker, lease, shared_tensor
from imgpack.images import ImagePolicy, apply_policy, resize_pixels
from imgpack.stored import Payload as Payload
from imgpack.stored import _place as _place
from imgpack.stored import _simplejpeg as _simplejpeg  # tests check the fast path is there
from imgpack.stored import decode_stored as decode_stored
from imgpack.stored import draft_scale as draft_scale
from imgpack.stored import stored_shape as stored_shape
from imgpack.system import usable_cpus

Images = torch.Tensor | list[torch.Tensor]


def default_threads() -> int:
    """Decode threads for this process: its share of the usable CPUs (all of them outside a
    DataLoader worker; ``cpus // num_workers``, at least 1, in one)."""
    cpus = usable_cpus()
    info = get_worker_info()
    return cpus if info is None else max(1, cpus // max(1, info.num_workers))


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
