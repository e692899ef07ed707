"""Handing batches from DataLoader workers to the training process without a new shared-memory
segment per batch.

A tensor a worker returns travels as a shared-memory segment: torch creates one per tensor (the
kernel zeroes and maps every page of it), passes its descriptor over a socket round trip, and
frees it when the training process drops the batch. For small batches (32x32 images) that costs
more than reading the batch: a raw reader in two workers reached less than half of what
DataLoader delivers when a dataset hands over the same preallocated tensor every time.

Here :func:`collate <imgpack.formats.dataset_base.collate>` returns a batch from a worker as a
:class:`Handover` (a plain ``(images, labels)`` tuple everywhere but in pickling). Pickled, it
copies the images into one of a small pool of shared buffers the worker keeps, and the training
process, as it unpickles the batch, copies them out into memory of its own and marks the buffer
free again. Nothing else ever sees a pool buffer: it is written only there and read only here,
so no buffer is written while anything can still read it. A buffer travels to the training
process once (its descriptor, in a socket round trip); the training process keeps it while its
worker lives, and later batches in it carry only its name. Each buffer carries a generation
number in a header before the pixels: a batch whose buffer was lent out again before it was
received (pickled bytes kept and unpickled late) raises instead of returning another batch's
pixels. Labels travel inline (no segment, no round trip).

Only batches up to :data:`POOL_MAX_BYTES` go through the pool (above it the fixed cost per
segment is small beside the copies); when every buffer is out, or the batch is not a plain
tensor, it travels as torch sends any tensor.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack.errors import DataError

#: Largest batch (bytes) handed over through the pool.
POOL_MAX_BYTES = 8 << 20
#: Buffers per worker at most (DataLoader keeps ``prefetch_factor`` batches per worker in flight).
POOL_SIZE = 8
_HEADER = 64  # bytes before the pixels: int64 generation (0: free), padding to a cache line
_FREE = 0

_pool: list[torch.Tensor] = []  # this worker's buffers (uint8, shared)
_sent: set[int] = set()  # the buffers (by number) the training process already holds
_pool_pid: int | None = None
_pool_token = ""  # this worker's pool: names its buffers to the training process
_pool_lock = threading.Lock()  # batches are pickled in the queue's feeder thread
_generation = itertools.count(1)


def in_worker() -> bool:
    """Whether this process is a DataLoader worker."""
    return get_worker_info() is not None


def _shared_bytes(count: int) -> torch.Tensor:
    try:  # what torch's default collate does in workers
        storage = (
            torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(count, device="cpu")
        )
        return torch.empty(0, dtype=torch.uint8).new(storage)
    except AttributeError:  # a torch without these internals
        return torch.zeros(count, dtype=torch.uint8).share_memory_()


def shared_tensor(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new tensor in a shared-memory segment of its own."""
    numel = int(np.prod(shape))
    return _shared_bytes(numel * dtype.itemsize).view(dtype).reshape(tuple(shape))


def _gen_view(buffer: torch.Tensor) -> np.ndarray:
    return buffer[:8].numpy().view(np.int64)


def _lend(nbytes: int) -> tuple[int, torch.Tensor, int] | None:
    """A free pool buffer of at least ``nbytes``, marked with a new generation: ``(number,
    buffer, generation)``; ``None`` when every buffer is out and the pool is full."""
    global _pool, _pool_pid, _pool_token, _sent
    with _pool_lock:
        if _pool_pid != os.getpid():  # a fork: the parent's buffers are not this worker's
            _pool, _pool_pid, _pool_token, _sent = [], os.getpid(), os.urandom(8).hex(), set()
        number = next(
            (
                k
                for k, b in enumerate(_pool)
                if len(b) >= _HEADER + nbytes and _gen_view(b)[0] == _FREE
            ),
            None,
        )
        if number is None:
            if len(_pool) >= POOL_SIZE:
                return None
            _pool.append(_shared_bytes(_HEADER + nbytes))
            number = len(_pool) - 1
        buffer = _pool[number]
        generation = next(_generation)
        _gen_view(buffer)[0] = generation
        return number, buffer, generation


def _dense_layout(images: torch.Tensor) -> torch.Tensor:
    """``images`` itself when its elements fill its storage span densely (contiguous, or a
    permuted view of a contiguous tensor, as imgpack's batches are), else a contiguous copy."""
    strides = images.stride()
    order = sorted(range(images.dim()), key=lambda d: -strides[d])
    if images.permute(*order).is_contiguous():
        return images
    return images.contiguous()


class Handover(tuple[Any, Any]):
    """``(images, labels)`` of a batch from a DataLoader worker: a plain tuple, but pickled so
    that the images travel through the worker's buffer pool and the labels inline."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        images, labels = self
        inline = labels.numpy() if isinstance(labels, torch.Tensor) else labels
        if not isinstance(images, torch.Tensor) or not 0 < images.nbytes <= POOL_MAX_BYTES:
            return _plain, (images, inline)
        lent = _lend(images.nbytes)
        if lent is None:
            return _plain, (images, inline)
        number, buffer, generation = lent
        images = _dense_layout(images)
        offset = _HEADER // images.element_size()  # dense: the elements span nbytes from here
        target = torch.empty(0, dtype=images.dtype).set_(
            buffer.untyped_storage(), offset, images.shape, images.stride()
        )
        target.copy_(images)
        layout = (offset, tuple(images.shape), tuple(images.stride()), images.dtype)
        # The buffer itself travels once (its descriptor passed in a socket round trip); after
        # that the training process holds it, and its name is enough.
        key = (_pool_token, number, os.getpid())
        with _pool_lock:
            sent = None if number in _sent else buffer
            _sent.add(number)
        return _received, (key, sent, generation, layout, inline)


def _labels(labels: Any) -> Any:
    return torch.from_numpy(labels) if isinstance(labels, np.ndarray) else labels


def _plain(images: Any, labels: Any) -> tuple[Any, Any]:
    return images, _labels(labels)


def _received(
    key: tuple[str, int, int],
    buffer: torch.Tensor | None,
    generation: int,
    layout: tuple[Any, ...],
    labels: Any,
) -> tuple[Any, Any]:
    """In the training process: the batch copied out of the worker's buffer, which is then
    marked free for the worker to lend again. ``buffer`` comes with the first batch a buffer
    holds; the training process keeps it (:func:`_held`) and finds it by ``key`` after."""
    buffer = _held(key, buffer)
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
    return images, _labels(labels)


# The workers' buffers the training process holds: (pool token, number) -> buffer, and the pid
# of each pool's worker. A worker sends a buffer once and then only its name, so every buffer of
# a live worker stays here (they are the worker's pages: no memory of their own); those of
# workers that have exited are dropped when a new pool appears.
_held_buffers: dict[tuple[str, int], torch.Tensor] = {}
_held_pids: dict[str, int] = {}
_held_lock = threading.Lock()


def _held(key: tuple[str, int, int], buffer: torch.Tensor | None) -> torch.Tensor:
    token, number, pid = key
    with _held_lock:  # batches are unpickled in the main thread or a pin-memory thread
        if buffer is not None:
            if token not in _held_pids:
                _drop_exited_pools()
                _held_pids[token] = pid
            _held_buffers[token, number] = buffer
            return buffer
        found = _held_buffers.get((token, number))
    if found is None:
        raise DataError(
            "a batch names a worker's shared buffer this process never received (its pickled "
            "bytes went to another process); hand batches over as DataLoader does"
        )
    return found


def _drop_exited_pools() -> None:
    for token, pid in list(_held_pids.items()):
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:  # alive, another user's (never a worker of ours): keep
            continue
        del _held_pids[token]
        for key in [k for k in _held_buffers if k[0] == token]:
            del _held_buffers[key]
