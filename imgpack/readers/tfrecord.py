"""Readers of TFRecord files: imgpack's ``tfrecord`` outputs and ``tf.train.Example`` files
written by other tools (layout in ``docs/formats/tfrecord.md``).

- :class:`TFRecordDataset` is map-style: random access through the ``.idx`` files (or an index
  built in memory), CRCs checked by default.
- :class:`TFRecordStream` is an ``IterableDataset``: sequential reads with an optional shuffle
  buffer, split across DataLoader workers and DDP ranks.
"""

from __future__ import annotations

import glob
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from imgpack import tfexample, tfrecord
from imgpack.errors import DataError, ImageError, ManifestError
from imgpack.images import ImagePolicy, apply_policy, decode_stored
from imgpack.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from imgpack.readers.base import ImageDataset, Images, arrays_to_batch, collate

Source = str | os.PathLike[str] | list[str] | list[Path]


@dataclass
class Shard:
    """One TFRecord file and the ``(offset, size)`` of its records (none for GZIP files)."""

    path: Path
    offsets: np.ndarray
    sizes: np.ndarray
    gzip: bool = False

    def __len__(self) -> int:
        return len(self.offsets)


class Records:
    """Where the records of an imgpack ``tfrecord`` output or of foreign TFRecord files are, and
    how one record becomes ``(pixels, label)``. Shared by both readers; holds no open file."""

    def __init__(
        self, source: Source, check_crc: bool = True, label_offset: int | None = None
    ) -> None:
        self.check_crc = check_crc
        paths = _resolve(source)
        if len(paths) == 1 and paths[0].is_dir() and (paths[0] / MANIFEST_NAME).is_file():
            self.root = paths[0]
            self.manifest = read_manifest(self.root)
            if self.manifest.format != "tfrecord":
                raise ManifestError(
                    f"{self.root}: holds format {self.manifest.format!r}, not 'tfrecord'"
                )
            self.foreign = False
            self.shards = [self._shard(self.root / f.path) for f in self.manifest.files]
            self.label_offset = int(
                self.manifest.options.get("label_offset", 0)
                if label_offset is None
                else label_offset
            )
            self._labels: list[int] | None = None
        else:
            self.foreign = True
            self.label_offset = label_offset or 0
            self.shards = [self._shard(p) for p in _record_files(paths)]
            self.root = self.shards[0].path.parent
            self.manifest, self._labels = self._scan_foreign()
        self.channels = int(self.manifest.image.get("channels", 3))
        self.policy = ImagePolicy()

    @staticmethod
    def _shard(path: Path) -> Shard:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such TFRecord file")
        if tfrecord.is_gzip(path):
            return Shard(path, np.empty(0, np.int64), np.empty(0, np.int64), gzip=True)
        index = tfrecord.read_index(path)
        if index is None:
            index = tfrecord.build_index(path)
        array = np.asarray(index, dtype=np.int64).reshape(-1, 2)
        return Shard(path, array[:, 0].copy(), array[:, 1].copy())

    def _scan_foreign(self) -> tuple[Manifest, list[int]]:
        """One pass over foreign files: count records (GZIP ones too) and build the label map."""
        labels: list[int] = []
        names: dict[int, str] = {}
        for shard in self.shards:
            count = 0
            with tfrecord.open_records(shard.path) as fh:
                for offset, data in tfrecord.iter_frames(fh, str(shard.path), self.check_crc):
                    features = _parse(data, f"{shard.path} at offset {offset}")
                    label = _label(features, f"{shard.path} at offset {offset}") - self.label_offset
                    labels.append(label)
                    text = features.get("image/class/text")
                    if text and isinstance(text[0], bytes):
                        names.setdefault(label, text[0].decode("utf-8", "replace"))
                    count += 1
            if shard.gzip:
                shard.offsets = np.full(count, -1, np.int64)
                shard.sizes = np.full(count, -1, np.int64)
            elif count != len(shard):
                raise DataError(
                    f"{shard.path}: its .idx lists {len(shard)} records, the file holds {count}"
                )
        if not labels:
            raise DataError(f"{self.shards[0].path}: no records")
        if min(labels) < 0:
            raise DataError(
                f"label {min(labels)} is negative (is label_offset={self.label_offset} right?)"
            )
        classes = [names.get(i, str(i)) for i in range(max(labels) + 1)]
        files = [FileEntry(str(s.path), s.path.stat().st_size, len(s), "") for s in self.shards]
        manifest = Manifest(
            format="tfrecord",
            num_samples=len(labels),
            classes=classes,
            encoding="original",
            image={"height": None, "width": None, "channels": 3},
            files=files,
            options={"label_offset": self.label_offset, "foreign": True},
        )
        return manifest, labels

    @property
    def labels(self) -> list[int]:
        if self._labels is None:
            self._labels = [label for _, _, _, label in self.iterate(decode=False)]
        return self._labels

    def sample(
        self, data: memoryview, where: str, decode: bool = True
    ) -> tuple[np.ndarray | None, int]:
        """``(HWC uint8 pixels, label)`` of one record's data."""
        features = _parse(data, where)
        label = _label(features, where) - self.label_offset
        if not 0 <= label < len(self.manifest.classes):
            raise DataError(f"{where}: label {label} outside 0..{len(self.manifest.classes) - 1}")
        if not decode:
            return None, label
        encoded = features.get("image/encoded")
        if not encoded or not isinstance(encoded[0], bytes):
            raise DataError(f"{where}: no image/encoded bytes")
        payload = encoded[0]
        fmt = features.get("image/format") or [b""]
        try:
            if fmt[0] == b"RAW":
                shape = tuple(
                    int(features[k][0]) for k in ("image/height", "image/width", "image/channels")
                )
                return np.frombuffer(payload, np.uint8).reshape(shape), label
            if self.foreign:
                return apply_policy(payload, where, self.policy)[0], label
            return decode_stored(payload, self.channels), label
        except (DataError, ImageError, KeyError, ValueError) as exc:
            raise DataError(f"{where}: {exc}") from None

    def iterate(
        self, wanted: dict[int, set[int]] | None = None, decode: bool = True
    ) -> Iterator[tuple[int, int, np.ndarray | None, int]]:
        """Read shards sequentially: ``(shard, record, pixels, label)`` of the records in
        ``wanted`` (shard -> record numbers, shards in that order), or of every record."""
        plan = (
            wanted
            if wanted is not None
            else {n: set(range(len(s))) for n, s in enumerate(self.shards)}
        )
        for number, records in plan.items():
            shard = self.shards[number]
            first = min(records) if records and not shard.gzip else 0
            start = int(shard.offsets[first]) if first else 0
            with tfrecord.open_records(shard.path) as fh:
                fh.seek(start)  # skip the records this reader does not need
                frames = tfrecord.iter_frames(fh, str(shard.path), self.check_crc, start)
                for record, (offset, data) in enumerate(frames, start=first):
                    if record in records:
                        pixels, label = self.sample(
                            data, f"{shard.path} at offset {offset}", decode
                        )
                        yield number, record, pixels, label


def _resolve(source: Source) -> list[Path]:
    items = source if isinstance(source, list) else [source]
    paths: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if any(ch in text for ch in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"{text}: no file matches")
            paths.extend(Path(m) for m in matches)
        else:
            path = Path(text)
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file or folder")
            paths.append(path)
    return paths


def _record_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix in (".tfrecord", ".tfrecords")
            )
            if not found:
                raise FileNotFoundError(f"{path}: no *.tfrecord files in this folder")
            files.extend(found)
        else:
            files.append(path)
    return files


def _parse(data: memoryview, where: str) -> dict[str, tfexample.FeatureValue]:
    try:
        return tfexample.decode_example(data)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _label(features: dict[str, tfexample.FeatureValue], where: str) -> int:
    value = features.get("image/class/label")
    if not value or not isinstance(value[0], int):
        raise DataError(f"{where}: no image/class/label")
    return value[0]


class TFRecordDataset(ImageDataset):
    """Map-style dataset over TFRecord files.

    ``source``: an imgpack ``tfrecord`` output, or TFRecord files written by other tools (a file,
    a folder of ``*.tfrecord``, a glob, or a list of them) with the conventional ImageNet keys.
    Records are found through the ``.idx`` beside each file, or an index built in memory. Foreign
    images go through imgpack's image policy (RGB, EXIF applied, alpha composited). CRCs are
    checked unless ``check_crc=False``; a bad CRC or a truncated record raises
    :class:`~imgpack.errors.DataError` naming the file and offset.
    """

    format = "tfrecord"

    def __init__(
        self,
        source: Source,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        check_crc: bool = True,
        label_offset: int | None = None,
    ) -> None:
        records = Records(source, check_crc, label_offset)
        super().__init__(records.root, transform, target_transform, manifest=records.manifest)
        self.records = records
        if any(s.gzip for s in records.shards):
            raise DataError(
                f"{next(s.path for s in records.shards if s.gzip)}: GZIP-compressed files have no "
                "random access; read them with TFRecordStream"
            )
        self._starts = np.cumsum([0, *(len(s) for s in records.shards)], dtype=np.int64)

    def _open(self) -> dict[int, int]:
        return {}  # shard number -> file descriptor, opened on first use

    def _close(self, handles: Any) -> None:
        for fd in handles.values():
            os.close(fd)

    def _fd(self, number: int) -> int:
        fds = self.handles
        if number not in fds:
            fds[number] = os.open(self.records.shards[number].path, os.O_RDONLY)
        return int(fds[number])

    def _load_targets(self) -> list[int]:
        return list(self.records.labels)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[shard_of]
        arrays: list[Any] = [None] * len(indices)
        labels = [0] * len(indices)
        # Group by shard and read each shard's records in file order.
        for pos in np.lexsort((local, shard_of)).tolist():
            shard = self.records.shards[int(shard_of[pos])]
            record = int(local[pos])
            offset, size = int(shard.offsets[record]), int(shard.sizes[record])
            where = f"{shard.path} at offset {offset}"
            data = os.pread(self._fd(int(shard_of[pos])), size, offset)
            frame = tfrecord.unframe(data, where, self.records.check_crc)
            arrays[pos], labels[pos] = self.records.sample(frame, where)
        return arrays_to_batch(arrays), torch.tensor(labels, dtype=torch.int64)


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
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"invalid batch_size {batch_size!r}: expected 1 or more, or None")
        self.batch_size = batch_size
        self.records = Records(source, check_crc, label_offset)
        self.classes = list(self.records.manifest.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.transform, self.target_transform = transform, target_transform
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, seed, 0
        self.rank, self.world_size = _distributed(rank, world_size)
        self.drop_remainder = drop_remainder

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all its workers together)."""
        total = sum(len(s) for s in self.records.shards)
        return (
            total // self.world_size if self.drop_remainder else math.ceil(total / self.world_size)
        )

    def plan(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """``(shard, record)`` pairs this rank's ``worker`` reads this epoch, in read order."""
        order = list(range(len(self.records.shards)))
        if self.shuffle_buffer > 0:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        everything = [(s, r) for s in order for r in range(len(self.records.shards[s]))]
        per_rank = len(self)
        start = self.rank * per_rank
        mine = [everything[(start + k) % len(everything)] for k in range(per_rank)]
        lo, hi = (len(mine) * worker) // num_workers, (len(mine) * (worker + 1)) // num_workers
        return mine[lo:hi]

    def _decoded(self) -> Iterator[tuple[np.ndarray, int]]:
        """This worker's ``(pixels, label)`` for the epoch, through the shuffle buffer."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        wanted: dict[int, set[int]] = {}
        repeats: dict[tuple[int, int], int] = {}
        for shard, record in self.plan(worker, workers):
            wanted.setdefault(shard, set()).add(record)
            repeats[shard, record] = repeats.get((shard, record), 0) + 1  # wrap-around repeats
        rng = random.Random(f"{self.seed}-{self.epoch}-{self.rank}-{worker}")
        buffer: list[tuple[np.ndarray, int]] = []
        for shard, record, pixels, label in self.records.iterate(wanted):
            assert pixels is not None
            for _ in range(repeats[shard, record]):
                if self.shuffle_buffer <= 0:
                    yield pixels, label
                elif len(buffer) < self.shuffle_buffer:
                    buffer.append((pixels, label))
                else:
                    k = rng.randrange(len(buffer))
                    yield buffer[k]
                    buffer[k] = (pixels, label)
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.batch_size is None:
            for pixels, label in self._decoded():
                yield self._sample(pixels, label)
            return
        pending: list[tuple[np.ndarray, int]] = []
        for item in self._decoded():
            pending.append(item)
            if len(pending) == self.batch_size:
                yield self._batch(pending)
                pending = []
        if pending:
            yield self._batch(pending)

    def _batch(self, items: list[tuple[np.ndarray, int]]) -> tuple[Any, Any]:
        """A whole batch, decoded images copied once into one tensor (no transforms set)."""
        if self.transform is None and self.target_transform is None:
            labels = torch.tensor([label for _, label in items], dtype=torch.int64)
            return arrays_to_batch([pixels for pixels, _ in items]), labels
        return collate([self._sample(pixels, label) for pixels, label in items])

    def _sample(self, pixels: np.ndarray, label: int) -> tuple[Any, Any]:
        writable = pixels if pixels.flags.writeable else pixels.copy()
        image: Any = torch.from_numpy(writable).permute(2, 0, 1)
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
