"""Handing batches from DataLoader workers to the training process without a new shared-memory
segment per batch.

A tensor a worker returns travels as a shared-memory segment: torch creates one per tensor (the
kernel zeroes and maps every page of it), passes its descriptor over a socket round trip, and
frees it when the training process drops the batch. For small batches (32x32 images) that costs
more than reading the batch: a raw reader in two workers reached less than half of what
DataLoader delivers when a dataset hands over the same preallocated tensor every time.

Here each worker keeps a small pool of shared batch buffers. :func:`batch_buffer` lends one,
:func:`collate <imgpack.formats.dataset_base.collate>` returns the batch as a :class:`Handover`
(a plain ``(images, labels)`` tuple everywhere but in pickling), and the training process, as it
unpickles the batch, copies the images out of the buffer into memory of its own and marks the
buffer free again: no buffer is ever written while anything else can see it. Each buffer carries
a generation number in a header before the pixels; a batch whose buffer was lent out again
before it was received (it would take pickled bytes kept and unpickled late) raises instead of
returning another batch's pixels. Labels travel inline (no segment, no round trip).

Buffers are lent only in DataLoader workers and only for batches up to :data:`POOL_MAX_BYTES`
(above it the fixed cost per segment is small beside the copy); when every buffer is out, the
batch gets a fresh segment as before.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack.errors import DataError

#: Largest batch (bytes) served from the pool.
POOL_MAX_BYTES = 8 << 20
#: Buffers per worker at most (DataLoader keeps ``prefetch_factor`` batches per worker in flight).
POOL_SIZE = 8
_HEADER = 64  # bytes before the pixels: int64 generation (0: free), padding to a cache line
_FREE = 0

_pool: list[torch.Tensor] = []  # this worker's buffers (uint8, shared)
_pool_pid: int | None = None
_generation = itertools.count(1)


def _shared_bytes(count: int) -> torch.Tensor:
    try:  # what torch's default collate does in workers
        storage = (
            torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(count, device="cpu")
        )
        return torch.empty(0, dtype=torch.uint8).new(storage)
    except AttributeError:  # a torch without these internals
        return torch.zeros(count, dtype=torch.uint8).share_memory_()


def shared_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor in a shared-memory segment of its own."""
    numel = int(np.prod(shape))
    return _shared_bytes(numel * dtype.itemsize).view(dtype).reshape(tuple(shape))


def _gen_view(buffer: torch.Tensor) -> np.ndarray:
    return buffer[:8].numpy().view(np.int64)


def batch_buffer(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised tensor for a batch a DataLoader worker will hand over: a pooled shared
    buffer when one is free and the batch is small (see the module's notes), else a fresh
    shared segment."""
    global _pool, _pool_pid
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes > POOL_MAX_BYTES or nbytes == 0:
        return shared_tensor(shape, dtype)
    if _pool_pid != os.getpid():  # a fork: the parent's buffers are not this worker's
        _pool, _pool_pid = [], os.getpid()
    buffer = next(
        (b for b in _pool if len(b) >= _HEADER + nbytes and _gen_view(b)[0] == _FREE), None
    )
    if buffer is None:
        if len(_pool) >= POOL_SIZE:
            return shared_tensor(shape, dtype)
        buffer = _shared_bytes(_HEADER + nbytes)
        _pool.append(buffer)
    _gen_view(buffer)[0] = next(_generation)
    return buffer[_HEADER : _HEADER + nbytes].view(dtype).reshape(tuple(shape))


def _lent(images: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The pool buffer ``images`` lies in, and its generation, or ``None``."""
    if _pool_pid != os.getpid():
        return None
    pointer = images.untyped_storage().data_ptr()
    for buffer in _pool:
        if buffer.untyped_storage().data_ptr() == pointer:
            generation = int(_gen_view(buffer)[0])
            return (buffer, generation) if generation != _FREE else None
    return None


class Handover(tuple[Any, Any]):
    """``(images, labels)`` of a batch from a DataLoader worker: a plain tuple, but pickled so
    that the training process copies the images out of the worker's pooled buffer (and frees
    it) and gets the labels inline."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        images, labels = self
        inline = labels.numpy() if isinstance(labels, torch.Tensor) else labels
        lent = _lent(images) if isinstance(images, torch.Tensor) else None
        if lent is None:
            return _plain, (images, inline)
        buffer, generation = lent
        layout = (
            images.storage_offset(),
            tuple(images.shape),
            tuple(images.stride()),
            images.dtype,
        )
        return _received, (buffer, generation, layout, inline)


def _labels(labels: Any) -> Any:
    return torch.from_numpy(labels) if isinstance(labels, np.ndarray) else labels


def _plain(images: Any, labels: Any) -> tuple[Any, Any]:
    return images, _labels(labels)


def _received(
    buffer: torch.Tensor, generation: int, layout: tuple[Any, ...], labels: Any
) -> tuple[Any, Any]:
    """In the training process: the batch copied out of the worker's buffer, which is then
    marked free for the worker to lend again."""
    offset, shape, stride, dtype = layout
    flag = _gen_view(buffer)
    if int(flag[0]) != generation:
        raise DataError(
            "a batch's shared buffer was reused before the batch was received (its pickled "
            "bytes were kept and unpickled late); hand batches over as DataLoader does"
        )
    # ``offset`` counts elements of ``dtype`` from the start of the buffer's storage
    source = torch.empty(0, dtype=dtype).set_(buffer.untyped_storage(), offset, shape, stride)
    images = torch.empty_like(source)  # same strides: one straight copy
    images.copy_(source)
    flag[0] = _FREE
    _keep_mapped(buffer)
    return images, _labels(labels)


#: Bytes of worker buffers the training process keeps mapped (see :func:`_keep_mapped`).
KEEP_MAPPED_BYTES = 64 << 20
_mapped: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
_mapped_lock = threading.Lock()


def _keep_mapped(buffer: torch.Tensor) -> None:
    """Keep a worker's buffer mapped in the training process: torch finds the mapping again by
    the segment's identity when the buffer comes back, instead of mapping it anew and faulting
    its pages in for every batch. The most recently used, up to :data:`KEEP_MAPPED_BYTES`."""
    key = buffer.untyped_storage().data_ptr()
    with _mapped_lock:  # batches are unpickled in the main thread or a pin-memory thread
        _mapped[key] = buffer
        _mapped.move_to_end(key)
        total = sum(b.numel() for b in _mapped.values())
        while total > KEEP_MAPPED_BYTES and len(_mapped) > 1:
            _, old = _mapped.popitem(last=False)
            total -= old.numel()


def in_worker() -> bool:
    """Whether this process is a DataLoader worker."""
    return get_worker_info() is not None
