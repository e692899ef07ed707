"""Handing batches from DataLoader workers to the training process through a pool of shared
buffers that are reused, instead of a new shared-memory segment per batch.

A tensor a worker returns travels as a shared-memory segment: torch creates one per tensor (the
kernel zeroes and maps every page of it, in the worker and again in the training process),
passes its descriptor over a socket round trip, and frees it when the training process drops
the batch. For small batches (32x32 images) that costs more than reading the batch; for large
ones (a batch of decoded photos, 100+ MB) mapping fresh pages costs about as much as decoding
the JPEGs into them.

Here each worker keeps a small pool of shared buffers. A reader in a worker asks
:func:`lease` for its batch tensor and gathers or decodes straight into a buffer;
:func:`collate <imgpack.formats.batch.collate>` returns the batch as a :class:`Handover`
(a plain ``(images, labels)`` tuple everywhere but in pickling), and pickled it carries only the
buffer's name and the batch's layout. The training process builds the batch as a view of the
buffer, no copy. A buffer is lent again only when nothing in either process can see it: the
worker's views are gone (a finalizer on the array its tensors are built on) and the training
process has dropped every view of the batch (the same, there; it marks the buffer free in a
header before the pixels). A batch that is forwarded on (``share_memory_``, a
``torch.multiprocessing`` queue, ``pin_memory``) is copied out of the buffer by torch first, so
the buffer is free again.

A buffer travels to the training process once (its descriptor, in a socket round trip); the
training process keeps it while its worker lives, and later batches in it carry only its name.
The header holds a generation number and the buffer's state (lent, sent, received), so the
pickled bytes of a batch can be unpickled once and only in the process that holds the buffer;
anything else raises instead of showing another batch's pixels. Labels travel inline.

A batch the pool cannot hold (every buffer out, the pool full) is allocated as before and
travels as torch sends any tensor; one gathered elsewhere (not :func:`lease`-d) up to
:data:`POOL_MAX_BYTES` is copied into a free buffer when it is pickled.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack.errors import DataError

#: Largest batch (bytes) not built in the pool that is copied into it when handed over.
POOL_MAX_BYTES = 8 << 20
#: Buffers per worker at most (DataLoader keeps ``prefetch_factor`` batches per worker in flight,
#: and the training process holds one or two).
POOL_SIZE = 8
# Header before the pixels, a cache line: int64 generation of the batch in the buffer; int64
# state, as the training process sees the buffer.
_HEADER = 64
_FREE, _SENT, _RECEIVED = 0, 1, 2


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


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):  # bfloat16 and the like: no numpy twin
        return None


class _Buffer:
    """One pooled buffer: the shared bytes, a numpy view of them and of the header."""

    __slots__ = ("array", "busy", "bytes", "header")

    def __init__(self, data: torch.Tensor) -> None:
        self.bytes = data  # uint8, shared
        self.array: np.ndarray = data.numpy()
        self.header: np.ndarray = self.array[:16].view(np.int64)  # generation, state
        self.busy = False  # this worker still has views of it

    def free(self, nbytes: int) -> bool:
        return not self.busy and int(self.header[1]) == _FREE and len(self.array) >= nbytes


class _Pool:
    """A process's buffers: shared ones in a DataLoader worker (handed over), private ones in
    the training process (batches read there). ``take`` runs in the reading thread and in the
    queue's feeder thread (pickling); finalizers run in whichever thread drops a view."""

    def __init__(self, shared: bool, size: int) -> None:
        self.pid = os.getpid()
        self.shared = shared
        self.size = size
        self.token = os.urandom(8).hex()  # names this pool's buffers to the training process
        self.buffers: list[_Buffer] = []
        self.sent: set[int] = set()  # buffers (by number) the training process already holds
        self.leased: dict[int, tuple[int, int]] = {}  # data pointer -> (number, generation)
        self.lock = threading.Lock()
        self.generation = itertools.count(1)
        #: In a worker: the arena images read one at a time go to (:func:`arena_tensor`), and
        #: the bytes of the last list of images sent (the next arena's size).
        self.arena: _Arena | None = None
        self.arena_lock = threading.Lock()
        self.sent_bytes = 0

    def _new(self, count: int) -> _Buffer:
        return _Buffer(
            _shared_bytes(count) if self.shared else torch.empty(count, dtype=torch.uint8)
        )

    def take(self, nbytes: int) -> tuple[int, _Buffer, int] | None:
        """A free buffer of ``nbytes`` after the header (at most twice that: a small batch does
        not hold a large buffer), marked busy with a new generation; ``None`` when the pool is
        full and nothing is free."""
        need = _HEADER + nbytes
        with self.lock:
            fitting = [
                k for k, b in enumerate(self.buffers) if b.free(need) and len(b.array) <= 2 * need
            ]
            if fitting:
                number = min(fitting, key=lambda k: len(self.buffers[k].array))
            elif len(self.buffers) < self.size:
                self.buffers.append(self._new(need))
                number = len(self.buffers) - 1
            else:  # replace a free buffer of the wrong size
                free = [k for k, b in enumerate(self.buffers) if b.free(0)]
                if not free:
                    return None
                number = free[0]
                self.buffers[number] = self._new(need)
                self.sent.discard(number)
            buffer = self.buffers[number]
            buffer.busy = True
            generation = next(self.generation)
            buffer.header[0] = generation
            return number, buffer, generation

    def release(self, number: int, buffer: _Buffer, pointer: int | None) -> None:
        """The process's last view of a buffer is gone (a finalizer: no lock, no allocation)."""
        if pointer is not None:
            self.leased.pop(pointer, None)
        buffer.busy = False


#: Private buffers the training process keeps for its own large batches at most.
LOCAL_POOL_SIZE = 4
_pools: dict[bool, _Pool] = {}
_pool_guard = threading.Lock()


def _pool_of(shared: bool) -> _Pool:
    pool = _pools.get(shared)
    if pool is None or pool.pid != os.getpid():  # a fork: the parent's buffers are not ours
        with _pool_guard:
            pool = _pools.get(shared)
            if pool is None or pool.pid != os.getpid():
                pool = _pools[shared] = _Pool(shared, POOL_SIZE if shared else LOCAL_POOL_SIZE)
    return pool


def lease(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
    """An uninitialised tensor of ``shape`` in a pooled buffer, lent again once every view of it
    is gone; ``None`` when the pool has no room. In a DataLoader worker the buffer is shared and
    :class:`Handover` sends the batch without a copy. In the training process only batches over
    :data:`POOL_MAX_BYTES` are lent (private buffers): a new allocation that large is fresh
    pages, which the kernel zeroes and maps one by one on first touch, about 0.35 ms per
    500x375 image, as much as half its JPEG decode; smaller ones malloc recycles itself."""
    nbytes = math.prod(shape) * dtype.itemsize
    worker = in_worker()
    if not worker and nbytes <= POOL_MAX_BYTES:
        return None
    np_dtype = _numpy_dtype(dtype)
    if np_dtype is None:
        return None
    pool = _pool_of(shared=worker)
    taken = pool.take(nbytes)
    if taken is None:
        return None
    number, buffer, generation = taken
    array = np.ndarray(tuple(shape), np_dtype, buffer=buffer.array, offset=_HEADER)
    tensor = torch.from_numpy(array)  # its storage holds ``array``, and nothing else does
    pointer = tensor.untyped_storage().data_ptr()
    pool.leased[pointer] = (number, generation)
    weakref.finalize(array, pool.release, number, buffer, pointer)
    return tensor


#: Bytes of a worker's arena at least (:func:`arena_tensor`); more when the batches sent from it
#: are larger, so that a batch spans one or two arenas, not one per few images.
ARENA_BYTES = 32 << 20


class _Arena:
    """A leased buffer images are placed in one after another, and how much of it is used."""

    __slots__ = ("flat", "header", "used")

    def __init__(self, flat: torch.Tensor, header: np.ndarray) -> None:
        self.flat, self.header, self.used = flat, header, 0


def arena_tensor(shape: Sequence[int]) -> torch.Tensor | None:
    """In a DataLoader worker: an uninitialised uint8 tensor of ``shape`` in the worker's
    current arena, a buffer of at least :data:`ARENA_BYTES` lent by the pool (``None``
    elsewhere, for an image over a quarter of it, or when the pool has no room).

    Images read one at a time (``ds[i]``) are decoded into consecutive places of the arena, so
    that the list a batch of them makes travels as views of one or two buffers, not copied
    (:func:`_reduce_views`); a new arena is started when one is full or was sent (its pixels
    are the training process's until it drops them), as large as the last batch sent if that
    is more. Memory that is reused, not fresh pages the kernel zeroes for every image."""
    if not in_worker():
        return None
    pool = _pool_of(shared=True)
    nbytes = math.prod(shape)
    size = max(ARENA_BYTES, -(-pool.sent_bytes // (1 << 20)) << 20)
    if not 0 < nbytes <= size // 4:
        return None
    with pool.arena_lock:
        arena = pool.arena
        if arena is None or arena.used + nbytes > len(arena.flat) or int(arena.header[1]) != _FREE:
            pool.arena = None  # what is in it stays until its images are dropped
            flat = lease((size,))
            found = _leased_layout(pool, flat) if flat is not None else None
            if flat is None or found is None:
                return None
            arena = pool.arena = _Arena(flat, found[1].header)
        start = arena.used
        arena.used = start + -(-nbytes // 64) * 64  # each image on a cache line of its own
    return arena.flat[start : start + nbytes].view(tuple(shape))


def _dense_layout(images: torch.Tensor) -> torch.Tensor:
    """``images`` itself when its elements fill its storage span densely (contiguous, or a
    permuted view of a contiguous tensor, as imgpack's batches are), else a contiguous copy."""
    strides = images.stride()
    order = sorted(range(images.dim()), key=lambda d: -strides[d])
    if images.permute(*order).is_contiguous():
        return images
    return images.contiguous()


def _leased_layout(pool: _Pool, images: torch.Tensor) -> tuple[int, _Buffer, int, int] | None:
    """``(number, buffer, generation, byte offset)`` when ``images`` is a view of a leased
    buffer, else ``None``."""
    if images.device.type != "cpu":
        return None
    storage = images.untyped_storage()
    found = pool.leased.get(storage.data_ptr())
    if found is None:
        return None
    number, generation = found
    buffer = pool.buffers[number]
    if int(buffer.header[0]) != generation:
        return None
    return (
        number,
        buffer,
        generation,
        _HEADER + int(images.storage_offset()) * images.element_size(),
    )


class Handover(NamedTuple):
    """``(images, labels)`` of a batch from a DataLoader worker: a plain pair, but pickled so
    that the images travel through the worker's buffer pool and the labels inline. A named
    tuple, so that DataLoader's ``default_convert`` (``batch_size=None``: a dataset yielding
    whole batches) passes it on as it is instead of turning it into a list."""

    images: Any
    labels: Any

    def __reduce__(self) -> tuple[Any, ...]:
        images, labels = self
        inline = labels.numpy() if isinstance(labels, torch.Tensor) else labels
        if isinstance(images, list):
            return _reduce_views(images, inline)
        if not isinstance(images, torch.Tensor) or images.nbytes == 0:
            return _plain, (images, inline)
        pool = _pool_of(shared=True)
        found = _leased_layout(pool, images)
        if found is None:  # gathered elsewhere: copy a small batch into a free buffer
            if images.nbytes > POOL_MAX_BYTES or _numpy_dtype(images.dtype) is None:
                return _plain, (images, inline)
            taken = pool.take(images.nbytes)
            if taken is None:
                return _plain, (images, inline)
            number, buffer, generation = taken
            images = _dense_layout(images)
            offset = _HEADER // images.element_size()  # dense: the elements span nbytes from here
            target = torch.empty(0, dtype=images.dtype).set_(
                buffer.bytes.untyped_storage(), offset, images.shape, images.stride()
            )
            target.copy_(images)
            buffer.header[1] = _SENT
            pool.release(number, buffer, None)  # the worker keeps no view of the copy
            byte_offset = _HEADER
        else:
            number, buffer, generation, byte_offset = found
            if int(buffer.header[1]) != _FREE:  # pickled a second time: torch copies it
                return _plain, (images, inline)
            buffer.header[1] = _SENT  # lent again only once the training process drops it
        itemsize = images.element_size()
        layout = (
            byte_offset,
            tuple(images.shape),
            tuple(s * itemsize for s in images.stride()),
            images.dtype,
        )
        return _received, (*_addressed(pool, number, buffer), generation, layout, inline)


class HandoverWith(tuple):
    """``(images, labels, *columns)`` of a batch with fields from a DataLoader worker: the
    images and labels travel as :class:`Handover`'s do, the field columns inline (a tensor as
    a NumPy array: no shared-memory segment and round trip each); received as a plain tuple."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        columns = tuple(_inline(column) for column in self[2:])
        return _with_columns, (Handover(self[0], self[1]), columns)


def _inline(column: Any) -> Any:
    if isinstance(column, torch.Tensor):
        return ("tensor", column.numpy())
    if isinstance(column, list) and any(isinstance(v, torch.Tensor) for v in column):
        return ("tensors", [v.numpy() if isinstance(v, torch.Tensor) else v for v in column])
    return ("plain", column)


def _with_columns(pair: tuple[Any, Any], columns: tuple[tuple[str, Any], ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for kind, column in columns:
        if kind == "tensor":
            out.append(torch.from_numpy(column))
        elif kind == "tensors":
            out.append([torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in column])
        else:
            out.append(column)
    images, labels = pair
    return (images, labels, *out)


def _reduce_views(images: list[Any], inline: Any) -> tuple[Any, ...]:
    """A batch of images of different sizes (a list of uint8 tensors) travels as the names of
    the buffers they lie in and each image's layout there: the buffers they are views of (a
    reader decoded them into one, or into a worker's arena, :func:`arena_tensor`), each sent
    once; images anywhere else (or in a buffer already sent and not yet dropped) are copied
    into one free buffer (one copy, as torch's own sending makes, instead of a shared-memory
    segment per image); what no buffer can take goes as torch sends it."""
    if not images or not all(
        isinstance(image, torch.Tensor)
        and image.dtype == torch.uint8
        and image.device.type == "cpu"
        for image in images
    ):
        return _plain, (images, inline)
    pool = _pool_of(shared=True)
    pool.sent_bytes = sum(image.nbytes for image in images)
    groups: dict[int, tuple[_Buffer, int, list[tuple[int, int, Any, Any]]]] = {}
    sendable: dict[int, bool] = {}
    rest: list[int] = []
    for k, image in enumerate(images):
        found = _leased_layout(pool, image)
        if found is not None:
            number, buffer, generation, offset = found
            if sendable.setdefault(number, int(buffer.header[1]) == _FREE):
                group = groups.setdefault(number, (buffer, generation, []))
                group[2].append((k, offset, tuple(image.shape), tuple(image.stride())))
                continue
        rest.append(k)
    parts = []
    for number, (buffer, generation, layouts) in groups.items():
        buffer.header[1] = _SENT  # lent again only once the training process drops it
        parts.append((*_addressed(pool, number, buffer), generation, layouts))
    loose: list[tuple[int, torch.Tensor]] = []
    taken = pool.take(sum(images[k].nbytes for k in rest)) if rest else None
    if taken is not None:
        number, buffer, generation = taken
        layouts, offset = [], _HEADER
        for k in rest:
            image = images[k]
            # Copied in its own memory order (a CHW view of HWC pixels: a straight copy of the
            # HWC bytes, not a transposing one), with the same strides on the other side.
            order = sorted(range(image.dim()), key=lambda d: -image.stride()[d])
            source = image.permute(*order)
            place = buffer.bytes[offset : offset + image.nbytes].view(source.shape)
            place.copy_(source)
            target = place.permute(*sorted(range(image.dim()), key=order.__getitem__))
            layouts.append((k, offset, tuple(target.shape), tuple(target.stride())))
            offset += image.nbytes
        buffer.header[1] = _SENT
        pool.release(number, buffer, None)  # the worker keeps no view of the copies
        parts.append((*_addressed(pool, number, buffer), generation, layouts))
    else:
        loose = [(k, images[k]) for k in rest]
    return _received_views, (len(images), parts, loose, inline)


def _addressed(
    pool: _Pool, number: int, buffer: _Buffer
) -> tuple[tuple[str, int, int], torch.Tensor | None]:
    """What names buffer ``number`` to the training process: its key, and the buffer itself
    the first time (its descriptor passed in a socket round trip); after that the training
    process holds it, and its name is enough."""
    with pool.lock:
        sent = None if number in pool.sent else buffer.bytes
        pool.sent.add(number)
    return (pool.token, number, os.getpid()), sent


def _received_views(
    count: int,
    parts: list[tuple[tuple[str, int, int], torch.Tensor | None, int, list[Any]]],
    loose: list[tuple[int, torch.Tensor]],
    labels: Any,
) -> tuple[Any, Any]:
    """:func:`_received` for a list of images: those in each buffer views of one tensor over
    it (the buffer marked free when the last of them is gone), the loose ones as torch sent
    them, in the batch's order."""
    images: list[Any] = [None] * count
    for key, data, generation, layouts in parts:
        buffer = _held(key, data)
        _take_sent(buffer.header, generation)
        whole = buffer.array[_HEADER:]  # one array, held by the tensors' common storage
        flat = torch.from_numpy(whole)
        for k, offset, shape, strides in layouts:
            images[k] = torch.as_strided(flat, shape, strides, offset - _HEADER)
        weakref.finalize(whole, _set_free, buffer.header)
    for k, image in loose:
        images[k] = image
    return images, _labels(labels)


def _take_sent(header: np.ndarray, generation: int) -> None:
    """Mark a buffer received, once: its batch must be the one pickled (``generation``), sent
    and not received yet."""
    with _held_lock:
        if int(header[0]) != generation or int(header[1]) != _SENT:
            raise DataError(
                "a batch's shared buffer is not the batch's any more (its pickled bytes were "
                "unpickled twice, or kept and unpickled late); hand batches over as "
                "DataLoader does"
            )
        header[1] = _RECEIVED


def _labels(labels: Any) -> Any:
    return torch.from_numpy(labels) if isinstance(labels, np.ndarray) else labels


def _plain(images: Any, labels: Any) -> tuple[Any, Any]:
    return images, _labels(labels)


def _set_free(header: np.ndarray) -> None:
    header[1] = _FREE


def _received(
    key: tuple[str, int, int],
    data: torch.Tensor | None,
    generation: int,
    layout: tuple[Any, ...],
    labels: Any,
) -> tuple[Any, Any]:
    """In the training process: the batch as a view of the worker's buffer, which is marked
    free again when the last view of it is gone. ``data`` (the buffer) comes with the first
    batch a buffer holds; the training process keeps it (:func:`_held`) and finds it by ``key``
    after."""
    buffer = _held(key, data)
    byte_offset, shape, strides, dtype = layout
    header = buffer.header
    _take_sent(header, generation)
    array = np.ndarray(
        shape, _numpy_dtype(dtype), buffer=buffer.array, offset=byte_offset, strides=strides
    )
    images = torch.from_numpy(array)
    weakref.finalize(array, _set_free, header)
    return images, _labels(labels)


# The workers' buffers the training process holds: (pool token, number) -> buffer, and the pid
# of each pool's worker. A worker sends a buffer once and then only its name, so every buffer of
# a live worker stays here (they are the worker's pages: no memory of their own); those of
# workers that have exited are dropped when a new pool appears (batches still alive keep their
# buffer's pages through their own views).
_held_buffers: dict[tuple[str, int], _Buffer] = {}
_held_pids: dict[str, int] = {}
_held_lock = threading.Lock()  # batches are unpickled in the main thread or a pin-memory thread


def _held(key: tuple[str, int, int], data: torch.Tensor | None) -> _Buffer:
    token, number, pid = key
    with _held_lock:
        if data is not None:
            if token not in _held_pids:
                _drop_exited_pools()
                _held_pids[token] = pid
            buffer = _held_buffers[token, number] = _Buffer(data)
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
