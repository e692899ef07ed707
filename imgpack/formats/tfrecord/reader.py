"""The map-style reader of TFRecord files: imgpack's ``tfrecord`` outputs and
``tf.train.Example`` files written by other tools (layout in ``docs/formats/framing.md``).

:class:`Records` knows where the records are and how one becomes ``(pixels, label)``; it serves
:class:`TFRecordDataset` (random access through the ``.idx`` files, or an index built in memory,
CRCs checked by default) and :class:`~imgpack.formats.framing.stream.TFRecordStream`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgpack.errors import DataError, ImageError, ManifestError
from imgpack.formats.dataset_base import (
    Images,
    PreadDataset,
    Record,
    arrays_to_batch,
    check_files,
    check_output_id,
)
from imgpack.formats.tfrecord import example, framing
from imgpack.images import Encoded, ImagePolicy, Kind, apply_policy, decode_stored, stored_info
from imgpack.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest

Source = str | os.PathLike[str] | list[str] | list[Path]


@dataclass
class Shard:
    """One TFRecord file and the ``(offset, size)`` of its records (none for compressed files:
    ``compression`` is ``"GZIP"`` or ``"ZLIB"`` then)."""

    path: Path
    offsets: np.ndarray
    sizes: np.ndarray
    compression: str | None = None

    @property
    def compressed(self) -> bool:
        return self.compression is not None

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
            check_files(self.root, self.manifest)
            self.foreign = False
            self.shards = [self._shard(self.root / f.path) for f in self.manifest.files]
            for entry, shard in zip(self.manifest.files, self.shards, strict=True):
                if len(shard) != entry.num_samples and not shard.compressed:
                    raise DataError(
                        f"{shard.path}: its .idx lists {len(shard)} records, the manifest says "
                        f"{entry.num_samples}"
                    )
            self.label_offset = int(
                self.manifest.options.get("label_offset", 0)
                if label_offset is None
                else label_offset
            )
            self._labels: list[int] | None = None
            self._paths: list[str] | None = None
        else:
            self.foreign = True
            self.label_offset = label_offset or 0
            self.shards = [self._shard(p) for p in _record_files(paths)]
            self.root = self.shards[0].path.parent
            self.manifest, self._labels, self._paths = self._scan_foreign()
        self.channels = int(self.manifest.image.get("channels", 3))
        self.policy = ImagePolicy()

    @staticmethod
    def _shard(path: Path) -> Shard:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such TFRecord file")
        kind = framing.compression(path)
        if kind is not None:
            return Shard(path, np.empty(0, np.int64), np.empty(0, np.int64), compression=kind)
        index = framing.read_index(path)
        if index is None:
            index = framing.build_index(path)
        array = np.asarray(index, dtype=np.int64).reshape(-1, 2)
        return Shard(path, array[:, 0].copy(), array[:, 1].copy())

    def _scan_foreign(self) -> tuple[Manifest, list[int], list[str] | None]:
        """One pass over foreign files: count records (compressed ones too), build the label map and
        collect the ``image/filename`` of every record (``None`` unless every record has one)."""
        labels: list[int] = []
        paths: list[str] | None = []
        names: dict[int, str] = {}
        for shard in self.shards:
            count = 0
            with framing.open_records(shard.path) as fh:
                for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                    features = _parse(data, f"{shard.path} at offset {offset}")
                    label = _label(features, f"{shard.path} at offset {offset}") - self.label_offset
                    labels.append(label)
                    text = features.get("image/class/text")
                    if text and isinstance(text[0], bytes):
                        names.setdefault(label, text[0].decode("utf-8", "replace"))
                    paths = _collect_path(paths, features)
                    count += 1
            if shard.compressed:
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
        return manifest, labels, paths

    @property
    def labels(self) -> list[int]:
        if self._labels is None:
            self._labels = [label for _, _, _, label in self.iterate(decode=False)]
        return self._labels

    @property
    def paths(self) -> list[str] | None:
        """The ``image/filename`` of every record, or ``None`` unless every record has one."""
        if self._paths is None and not self.foreign:
            paths: list[str] | None = []
            for shard in self.shards:
                with framing.open_records(shard.path) as fh:
                    for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                        paths = _collect_path(
                            paths, _parse(data, f"{shard.path} at offset {offset}")
                        )
            self._paths = paths
        return self._paths

    def sample(
        self, data: memoryview, where: str, decode: bool = True
    ) -> tuple[np.ndarray | None, int]:
        """``(HWC uint8 pixels, label)`` of one record's data."""
        features = self.features(data, where)
        label = self.label(features, where)
        if not decode:
            return None, label
        payload, shape = stored_image(features, where)
        try:
            if shape is not None:
                return np.frombuffer(payload, np.uint8).reshape(shape), label
            if self.foreign:
                return apply_policy(payload, where, self.policy)[0], label
            return decode_stored(payload, self.channels), label
        except (DataError, ImageError, KeyError, ValueError) as exc:
            raise DataError(f"{where}: {exc}") from None

    def features(self, data: memoryview, where: str) -> dict[str, example.FeatureValue]:
        """A record's parsed features, its output id checked."""
        features = _parse(data, where)
        self.check_output(features, where)
        return features

    def label(self, features: dict[str, example.FeatureValue], where: str) -> int:
        """A record's label (``label_offset`` taken off), checked against the label map."""
        label = _label(features, where) - self.label_offset
        if not 0 <= label < len(self.manifest.classes):
            raise DataError(f"{where}: label {label} outside 0..{len(self.manifest.classes) - 1}")
        return label

    def check_output(self, features: dict[str, example.FeatureValue], where: str) -> None:
        """Refuse a record of another output than the manifest this reader read (the output was
        replaced meanwhile); foreign files and outputs without ids are not checked."""
        if not self.foreign and self.manifest.output_id:
            found = features.get(example.OUTPUT_ID_KEY) or [b""]
            check_output_id(self.manifest.output_id, found[0], where, self.root)

    def check_first(self, number: int, fd: int) -> None:
        """Check the first record of shard ``number``, open as ``fd``, for the output id."""
        if self.foreign or not self.manifest.output_id or not len(self.shards[number]):
            return
        where = f"{self.shards[number].path} at offset 0"
        head = os.pread(fd, framing.HEADER_SIZE, 0)
        length = framing.read_length(head, where, self.check_crc)
        size = framing.HEADER_SIZE + length + framing.FOOTER_SIZE
        if size > os.fstat(fd).st_size:
            raise DataError(f"{where}: truncated record")
        frame = framing.unframe(os.pread(fd, size, 0), where, self.check_crc)
        self.check_output(_parse(frame, where), where)

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
            first = min(records) if records and not shard.compressed else 0
            start = int(shard.offsets[first]) if first else 0
            with framing.open_records(shard.path) as fh:
                if start:
                    fh.seek(start)  # skip the records this reader does not need
                frames = framing.iter_frames(fh, str(shard.path), self.check_crc, start)
                for record, (offset, data) in enumerate(frames, start=first):
                    if record in records:
                        pixels, label = self.sample(
                            data, f"{shard.path} at offset {offset}", decode
                        )
                        yield number, record, pixels, label


def stored_image(
    features: dict[str, example.FeatureValue], where: str
) -> tuple[bytes, tuple[int, int, int] | None]:
    """A record's ``image/encoded`` bytes, and their ``(height, width, channels)`` when they
    are raw pixels (``image/format`` ``RAW``)."""
    encoded = features.get("image/encoded")
    if not encoded or not isinstance(encoded[0], bytes):
        raise DataError(f"{where}: no image/encoded bytes")
    if (features.get("image/format") or [b""])[0] != Kind.RAW.value.encode():
        return encoded[0], None
    try:
        height, width, channels = (
            int(features[k][0]) for k in ("image/height", "image/width", "image/channels")
        )
    except (KeyError, IndexError, TypeError, ValueError):
        raise DataError(
            f"{where}: a RAW record needs image/height, image/width and image/channels"
        ) from None
    if len(encoded[0]) != height * width * channels:
        raise DataError(f"{where}: RAW image/encoded is not {height}x{width}x{channels} bytes")
    return encoded[0], (height, width, channels)


def tfrecord_files(source: Source) -> list[Path]:
    """The TFRecord files ``source`` names: files, folders (their ``*.tfrecord`` files) and
    globs, in order; ``FileNotFoundError`` when one names nothing."""
    return _record_files(_resolve(source))


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


def _parse(data: memoryview, where: str) -> dict[str, example.FeatureValue]:
    try:
        return example.decode_example(data)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _collect_path(
    paths: list[str] | None, features: dict[str, example.FeatureValue]
) -> list[str] | None:
    """``paths`` with this record's ``image/filename`` added, or ``None`` once one lacks it."""
    value = features.get("image/filename")
    if paths is None or not value or not isinstance(value[0], bytes):
        return None
    paths.append(value[0].decode("utf-8", "surrogateescape"))
    return paths


def _label(features: dict[str, example.FeatureValue], where: str) -> int:
    value = features.get("image/class/label")
    if not value or not isinstance(value[0], int):
        raise DataError(f"{where}: no image/class/label")
    return value[0]


class TFRecordDataset(PreadDataset):
    """Map-style dataset over TFRecord files.

    ``source``: an imgpack ``tfrecord`` output, or TFRecord files written by other tools (a file,
    a folder of ``*.tfrecord``, a glob, or a list of them) with the conventional ImageNet keys.
    Records are found through the ``.idx`` beside each file, or an index built in memory. Foreign
    images go through imgpack's image policy (RGB, EXIF applied, alpha composited). CRCs are
    checked unless ``check_crc=False`` (``verify=True`` checks them whatever ``check_crc``
    says); a bad CRC or a truncated record raises :class:`~imgpack.errors.DataError` naming the
    file and offset.
    """

    format = "tfrecord"

    def __init__(
        self,
        source: Source,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        check_crc: bool = True,
        label_offset: int | None = None,
        verify: bool | None = None,
    ) -> None:
        records = Records(source, check_crc if verify is None else verify, label_offset)
        super().__init__(
            records.root, transform, target_transform, manifest=records.manifest, verify=verify
        )
        self.records = records
        compressed = [s for s in records.shards if s.compressed]
        if compressed:
            raise DataError(
                f"{compressed[0].path}: {compressed[0].compression}-compressed TFRecord files have "
                "no random access; read them with TFRecordStream"
            )
        self._starts = np.cumsum([0, *(len(s) for s in records.shards)], dtype=np.int64)
        self.shard_files = [shard.path for shard in records.shards]

    def _check_shard(self, number: int, fd: int) -> None:
        self.records.check_first(number, fd)

    def record(self, index: int) -> tuple[dict[str, example.FeatureValue], str]:
        """Record ``index``'s parsed features (frame CRCs and output id checked) and where it is."""
        [(_, frame, where)] = list(self._frames(self._indices([index])))
        return self.records.features(frame, where), where

    def encoded(self, start: int, stop: int, chunk: int = 256) -> Iterator[Encoded]:
        """As :meth:`ImageDataset.encoded`: each record's ``image/encoded`` bytes as stored,
        with its label, ``image/filename``, format and size (the frame CRCs checked)."""
        for first in range(start, stop, chunk):
            indices = np.arange(first, min(stop, first + chunk), dtype=np.int64)
            found: list[Encoded | None] = [None] * len(indices)
            for pos, frame, where in self._frames(indices):
                features = self.records.features(frame, where)
                label = self.records.label(features, where)
                payload, shape = stored_image(features, where)
                names = features.get("image/filename") or [b""]
                path = (
                    names[0].decode("utf-8", "surrogateescape")
                    if isinstance(names[0], bytes)
                    else ""
                )
                if shape is not None:
                    found[pos] = Encoded(path, label, payload, *shape, Kind.RAW)
                    continue
                try:
                    kind, height, width, channels = stored_info(payload)
                except DataError as exc:
                    raise DataError(f"{where}: {exc}") from None
                found[pos] = Encoded(path, label, payload, height, width, channels, kind)
            yield from (sample for sample in found if sample is not None)

    def _load_targets(self) -> list[int]:
        return list(self.records.labels)

    def _load_paths(self) -> list[str] | None:
        return self.records.paths

    def _frames(self, indices: np.ndarray) -> Iterator[tuple[int, memoryview, str]]:
        """``(position in indices, record data, where)``, read shard by shard in file order;
        the frame's CRCs are checked unless ``check_crc=False``."""
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[shard_of]
        for pos in np.lexsort((local, shard_of)).tolist():
            shard = self.records.shards[int(shard_of[pos])]
            record = int(local[pos])
            offset, size = int(shard.offsets[record]), int(shard.sizes[record])
            where = f"{shard.path} at offset {offset}"
            data = os.pread(self._fd(int(shard_of[pos])), size, offset)
            try:
                frame = framing.unframe(data, where, self.records.check_crc)
            except DataError as exc:  # name the sample too, and its source where it can be had
                index = int(indices[pos])
                raise DataError(f"{exc} (sample {index}{self._source(index)})") from None
            yield pos, frame, where

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        found: list[Record | None] = [None] * len(indices)
        for pos, frame, where in self._frames(indices):
            _, label = self.records.sample(frame, where, decode=False)
            # The frame's own CRC-32C (checked in _frames) is the record's checksum.
            found[pos] = Record(int(indices[pos]), frame, label, None, where)
        yield from (r for r in found if r is not None)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        arrays: list[Any] = [None] * len(indices)
        labels = [0] * len(indices)
        for pos, frame, where in self._frames(indices):
            arrays[pos], labels[pos] = self.records.sample(frame, where)
        return arrays_to_batch(arrays), torch.tensor(labels, dtype=torch.int64)
