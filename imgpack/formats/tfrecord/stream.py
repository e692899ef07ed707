"""The streaming reader of TFRecord files (layout in ``docs/formats/tfrecord.md``): an
``IterableDataset`` with sequential reads, an optional shuffle buffer, split across DataLoader
workers and DDP ranks; GZIP-compressed files too."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from imgpack.formats.batch import collate, label_tensor
from imgpack.formats.tfrecord.records import Records, Source
from imgpack.handover import Handover, in_worker
from imgpack.images import ImagePolicy
from imgpack.units import parse_image_size

Item = tuple[bytes | np.ndarray, int, str]  # a stored image, its label, where it is


class TFRecordStream(IterableDataset[tuple[Any, Any]]):
    """Sequential reader of TFRecord files (GZIP-compressed ones too), as an ``IterableDataset``.

    Each epoch lists every record in file order (the file order shuffled per epoch when
    ``shuffle_buffer > 0``), gives each DDP rank one contiguous part and each DataLoader worker
    one contiguous part of its rank's, so every record is read once per epoch. Every rank gets
    the same count: with ``drop_remainder=False`` (default) the last ranks' parts wrap around to
    the first records (up to ``world_size - 1`` records read twice an epoch, like
    ``DistributedSampler``); with ``drop_remainder=True`` those ``N mod world_size`` records are
    left out of the epoch instead. ``shuffle_buffer`` samples are kept and drawn at random
    (seeded by ``seed``, the epoch, the rank and the worker). Call :meth:`set_epoch` each epoch.

    With ``batch_size=N`` the stream yields whole batches, ``(images (N, C, H, W), labels)``,
    each image copied once into the batch tensor: pass ``batch_size=None`` to the DataLoader.
    Without it, samples are yielded one by one for the DataLoader to batch.

    Record CRCs are checked unless ``check_crc=False``; ``verify=True`` checks them whatever
    ``check_crc`` says and ``verify=False`` skips them (the switch of the map-style readers).
    ``size``, ``resize`` and ``decode_threads`` as for the map-style readers
    (:class:`~imgpack.formats.dataset_base.ImageDataset`).

    ``source`` may be the URL of an imgpack ``tfrecord`` output in a bucket (``s3://...``;
    ``storage_options`` for the filesystem): its shards are streamed from there as they are read,
    nothing cached (:mod:`imgpack.storage`).
    """

    def __init__(
        self,
        source: Source,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        check_crc: bool = True,
        label_offset: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_remainder: bool = False,
        batch_size: int | None = None,
        verify: bool | None = None,
        size: int | tuple[int, int] | str | None = None,
        resize: str = "crop",
        decode_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"invalid batch_size {batch_size!r}: expected 1 or more, or None")
        self.batch_size = batch_size
        self.records = Records(
            source, check_crc if verify is None else verify, label_offset, storage_options
        )
        policy = ImagePolicy(size=parse_image_size(size), resize=resize) if size else None
        self.decoder = self.records.decoder(policy, decode_threads)
        self.classes = list(self.records.manifest.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform, self.target_transform = transform, target_transform
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        # In shared memory: persistent DataLoader workers keep their copy of the stream across
        # epochs, and must still see set_epoch() of the training process.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.rank, self.world_size = _distributed(rank, world_size)
        self.drop_remainder = drop_remainder

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the shuffle's seed) before iterating the DataLoader for it; workers,
        persistent ones too, see it when the epoch's iteration starts."""
        self._epoch[0] = int(epoch)

    def samples_per_rank(self) -> int:
        """Samples this rank reads per epoch (all its workers together)."""
        total = sum(len(s) for s in self.records.shards)
        return (
            total // self.world_size if self.drop_remainder else math.ceil(total / self.world_size)
        )

    def __len__(self) -> int:
        """What this rank's iteration yields per epoch, all its workers together: samples, or
        with ``batch_size`` batches (workers are given whole batches, so the count does not
        depend on ``num_workers``: only the rank's last batch can be short)."""
        samples = self.samples_per_rank()
        return samples if self.batch_size is None else math.ceil(samples / self.batch_size)

    def plan(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """``(shard, record)`` pairs this rank's ``worker`` reads this epoch, in read order."""
        order = list(range(len(self.records.shards)))
        if self.shuffle_buffer > 0:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        everything = [(s, r) for s in order for r in range(len(self.records.shards[s]))]
        per_rank = self.samples_per_rank()
        start = self.rank * per_rank
        mine = [everything[(start + k) % len(everything)] for k in range(per_rank)]
        unit = self.batch_size or 1  # split at batch boundaries
        units = math.ceil(len(mine) / unit)
        lo, hi = (units * worker) // num_workers, (units * (worker + 1)) // num_workers
        return mine[lo * unit : hi * unit]

    def _stored(self) -> Iterator[Item]:
        """This worker's ``(image, label, where)`` for the epoch, through the shuffle buffer
        (images as stored: the buffer holds encoded bytes, decoded when they leave it)."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        wanted: dict[int, set[int]] = {}
        repeats: dict[tuple[int, int], int] = {}
        for shard, record in self.plan(worker, workers):
            wanted.setdefault(shard, set()).add(record)
            repeats[shard, record] = repeats.get((shard, record), 0) + 1  # wrap-around repeats
        rng = random.Random(f"{self.seed}-{self.epoch}-{self.rank}-{worker}")
        buffer: list[Item] = []
        for shard, record, image, label, where in self.records.iterate(wanted):
            item = (image, label, where)
            for _ in range(repeats[shard, record]):
                if self.shuffle_buffer <= 0:
                    yield item
                elif len(buffer) < self.shuffle_buffer:
                    buffer.append(item)
                else:
                    k = rng.randrange(len(buffer))
                    yield buffer[k]
                    buffer[k] = item
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.batch_size is None:
            for image, label, where in self._stored():
                yield self._sample(self.decoder.one(image, where), label)
            return
        pending: list[Item] = []
        for item in self._stored():
            pending.append(item)
            if len(pending) == self.batch_size:
                yield self._batch(pending)
                pending = []
        if pending:
            yield self._batch(pending)

    def _batch(self, items: list[Item]) -> tuple[Any, Any]:
        """A whole batch, each image decoded straight into one tensor (no transforms set)."""
        images = self.decoder.batch([image for image, _, _ in items], lambda k: items[k][2])
        if self.transform is None and self.target_transform is None:
            labels = label_tensor([label for _, label, _ in items])
            return Handover(images, labels) if in_worker() else (images, labels)
        return collate(
            [self._sample(image, label) for image, (_, label, _) in zip(images, items, strict=True)]
        )

    def _sample(self, pixels: np.ndarray | torch.Tensor, label: int) -> tuple[Any, Any]:
        image: Any = pixels
        if isinstance(pixels, np.ndarray):
            writable = pixels if pixels.flags.writeable else pixels.copy()
            image = torch.from_numpy(writable).permute(2, 0, 1)
        target: Any = label
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return rank, world_size
