"""The map-style reader of TFRecord files: imgpack's ``tfrecord`` outputs and
``tf.train.Example`` files written by other tools (layout in ``docs/formats/framing.md``).

:class:`Records` knows where the records are and how one becomes ``(pixels, label)``; it serves
:class:`TFRecordDataset` (random access through the ``.idx`` files, or an index built in memory,
CRCs checked by default) and :class:`~imgpack.formats.framing.stream.TFRecordStream`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from imgpack.errors import DataError
from imgpack.formats.batch import Images, label_tensor
from imgpack.formats.dataset_base import (
    PreadDataset,
    ReadKeywords,
    ReadOptions,
    Record,
    new_batch_tensor,
)
from imgpack.formats.gather import byte_rows, take_windows
from imgpack.formats.tfrecord import example, framing
from imgpack.formats.tfrecord.layout import RawLayout, data_crcs_match
from imgpack.formats.tfrecord.records import (
    Records,
    Source,
    field_data,
    stored_image,
)
from imgpack.images import Encoded, Kind, stored_info
from imgpack.opening import Opened, open_output
from imgpack.storage.location import is_url

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: What a reader keeps of an encoded record it parsed (16 bytes a record): where its image
#: starts and stops in the record's data, its label, and the data CRC stored in its frame.
SPOT = np.dtype([("start", "<i4"), ("stop", "<i4"), ("label", "<i4"), ("crc", "<u4")])


@dataclass
class _Learned:
    """What a :class:`TFRecordDataset` learns in one process as it reads (its ``_here``)."""

    #: Where the pixels of each raw record this process checked start, and its label (start
    #: -1: not read yet).
    starts: np.ndarray | None = None
    labels: np.ndarray | None = None
    #: :data:`SPOT` of each encoded record this process parsed (start -1 where it has not):
    #: :meth:`TFRecordDataset._stored`.
    spots: np.ndarray | None = None


class TFRecordDataset(PreadDataset):
    """Map-style dataset over TFRecord files.

    ``opened``: an imgpack ``tfrecord`` output (opened, or its path), or TFRecord files written
    by other tools (a file, a folder of ``*.tfrecord``, a glob, or a list of them) with the conventional ImageNet keys.
    Records are found through the ``.idx`` beside each file, or an index built in memory. Foreign
    images go through imgpack's image policy (RGB, EXIF applied, alpha composited). CRCs are
    checked unless ``check_crc=False`` (``verify=True`` checks them whatever ``check_crc``
    says): on every read, but for the raw records of an imgpack output, which are checked the
    first time this reader reads them unless ``verify=True`` (as every format's raw records
    are: :class:`~imgpack.formats.dataset_base.ImageDataset`); a bad CRC or a truncated record
    raises :class:`~imgpack.errors.DataError` naming the file and offset. An imgpack output at a URL is read lazily (:mod:`imgpack.storage.lazy`): opening
    fetches its manifest and ``.idx`` files, each shard is fetched into the cache when first
    read.
    """

    format = "tfrecord"
    reads_fields = True
    lazy_files = True
    learns = _Learned

    def __init__(
        self,
        opened: Source | Opened,
        options: ReadOptions | None = None,
        *,
        check_crc: bool = True,
        label_offset: int | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        options = ReadOptions.of(options, **keywords)
        verify, decode_threads = options.verify, options.decode_threads
        source = opened
        if isinstance(source, (str, os.PathLike)) and is_url(source):  # shards fetched as read
            source = open_output(source, options, lazy=True)
        records = Records(source, check_crc if verify is None else verify, label_offset)
        assert records.opened is not None  # not a stream
        super().__init__(records.opened, options)
        self.records = records
        self.decoder = records.decoder(self.size_policy, decode_threads)
        compressed = [s for s in records.shards if s.compressed]
        if compressed:
            raise DataError(
                f"{compressed[0].path}: {compressed[0].compression}-compressed TFRecord files have "
                "no random access; read them with TFRecordStream"
            )
        self._count_shards([len(s) for s in records.shards])
        self._offsets = np.concatenate([s.offsets for s in records.shards] or [np.empty(0)])
        self._sizes = np.concatenate([s.sizes for s in records.shards] or [np.empty(0)])
        self.shard_files = [shard.path for shard in records.shards]
        raw = self.manifest.encoding == "raw" and bool(self.manifest.image.get("height"))
        self._layout: RawLayout | None = None
        if raw and not records.foreign and not self.manifest.fields:  # fields vary in size
            try:
                self._layout = RawLayout(self.manifest, records.label_offset)
            except ValueError:  # no fixed layout to match: every record through the parser
                self._layout = None

    def _check_shard(self, number: int, fd: int) -> None:
        self.records.check_first(number, fd)

    def _gather_raw(self, indices: np.ndarray, layout: RawLayout) -> tuple[Images, torch.Tensor]:
        """A batch of raw records sliced from the memory-mapped shards, each matched against
        the output's layout (a few byte comparisons, the frame's CRCs) and its pixels copied
        straight into the batch; a record that does not match goes through the generic path,
        which reads it as any record is read (and names what is wrong with it)."""
        size = layout.size
        known = self._known_raw(indices)
        if known is not None:  # every record checked already: where its pixels start, its label
            return self._gather_known(indices, self._shards(indices), layout, *known)
        shard_of = self._shard_of(indices)
        out = new_batch_tensor((len(indices), *layout.shape))
        rows = out.numpy().reshape(len(indices), size)
        labels = np.zeros(len(indices), np.int64)
        for number in np.unique(shard_of).tolist():
            mine = np.flatnonzero(shard_of == number)
            mapped = self._mapped(number)
            data = np.frombuffer(mapped, np.uint8)
            offsets, sizes = self._offsets[indices[mine]], self._sizes[indices[mine]]
            ok, found, starts = layout.match(data, offsets, sizes)
            if self.records.check_crc and ok.any():
                self._check_crcs(indices[mine], ok, mapped, data, offsets, sizes)
            labels[mine] = found
            self._remember_raw(indices[mine], ok, starts, found)
            if ok.all() and len(mine) == len(indices):  # one shard: straight into the batch
                take_windows(data, size, starts, out.view(-1, size))
            elif ok.any():
                rows[mine[ok]] = byte_rows(data, starts[ok], size)
            for pos in mine[~ok].tolist():  # the generic path names what is wrong
                [(_, frame, where)] = list(self._frames(indices[pos : pos + 1]))
                image, labels[pos] = self.records.stored(frame, where)
                if not isinstance(image, np.ndarray) or image.shape != layout.shape:
                    raise DataError(f"{where}: not a raw {layout.shape} image as the manifest says")
                rows[pos] = image.reshape(size)
        return out.permute(0, 3, 1, 2), torch.from_numpy(labels)

    def _known_raw(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(pixel starts, labels)`` of raw records ``indices`` when this process read every
        one of them before (its layout matched and, by default, its checksum was checked: raw
        records are checked once, in every format), else ``None``: the batch is matched as a
        first read is. ``verify=True`` matches and checks every read."""
        known = self._learned
        if self.verify or known.starts is None or known.labels is None:
            return None
        starts = known.starts[indices]
        if (starts < 0).any():
            return None
        return starts, known.labels[indices]

    def _remember_raw(
        self, indices: np.ndarray, ok: np.ndarray, starts: np.ndarray, labels: np.ndarray
    ) -> None:
        """Keep where the pixels of the raw records ``indices`` that matched (``ok``: the layout,
        and the checksum where it is checked) start, and their labels, for later reads."""
        if self.verify:
            return
        known = self._learned
        if known.starts is None or known.labels is None:
            known.starts, known.labels = (
                np.full(len(self), -1, np.int64),
                np.zeros(len(self), np.int64),
            )
        known.starts[indices[ok]] = starts[ok]
        known.labels[indices[ok]] = labels[ok]

    def _gather_known(
        self,
        indices: np.ndarray,
        shard_of: np.ndarray | None,
        layout: RawLayout,
        starts: np.ndarray,
        labels: np.ndarray,
    ) -> tuple[Images, torch.Tensor]:
        """A batch of records checked before (in shards ``shard_of``; ``None``: a one-shard
        output's): one gather of their pixels per shard (a sliding-window view of the
        memory-mapped file), nothing parsed or compared again."""
        out = new_batch_tensor((len(indices), *layout.shape))
        self._gather_rows(shard_of, starts, out.view(len(indices), layout.size))
        return out.permute(0, 3, 1, 2), torch.from_numpy(labels)

    def _check_crcs(
        self,
        indices: np.ndarray,
        ok: np.ndarray,
        mapped: Any,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
    ) -> None:
        """Check the data CRCs of the raw records ``indices`` that matched the layout (``ok``,
        cleared where a CRC does not match: the generic path then names the record). By
        default (``verify=None``) each record is checked the first time this reader reads it,
        as the other formats' raw records are; with ``verify=True``, on every read."""
        need = ok.copy()
        seen = self.checks.marks()
        if seen is not None:
            need &= seen[indices] == 0
        if not need.any():
            return
        good = data_crcs_match(mapped, data, offsets[need], sizes[need])
        ok[need] = good
        if seen is not None:
            seen[indices[need][good]] = 1

    def record(self, index: int) -> tuple[dict[str, example.FeatureValue], str]:
        """Record ``index``'s parsed features (frame CRCs and output id checked) and where it is."""
        [(_, frame, where)] = list(self._frames(self._indices([index])))
        return self.records.features(frame, where), where

    def encoded(
        self, start: int, stop: int, chunk: int = 256, paths: bool = True
    ) -> Iterator[Encoded]:
        """As :meth:`ImageDataset.encoded`: each record's ``image/encoded`` bytes as stored,
        with its label, ``image/filename`` (in the record: read whatever ``paths`` says),
        format and size (the frame CRCs checked)."""
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
                values = self._field_values_of(features, where)
                if shape is not None:
                    found[pos] = Encoded(path, label, payload, *shape, Kind.RAW, fields=values)
                    continue
                try:
                    kind, height, width, channels = stored_info(payload)
                except DataError as exc:
                    raise DataError(f"{where}: {exc}") from None
                found[pos] = Encoded(
                    path, label, payload, height, width, channels, kind, fields=values
                )
            yield from (sample for sample in found if sample is not None)

    def stored_sizes(self, chunk: int = 4096) -> np.ndarray:
        """Each record's framed size where the files are indexed (uncompressed: the record
        holds the image and its few features, the plan's estimate of it); compressed files'
        records are read for their images' sizes."""
        if not self._framed_sizes:
            return super().stored_sizes(chunk)
        sizes = [s.sizes for s in self.records.shards]
        return np.concatenate(sizes).astype(np.int64) if sizes else np.empty(0, np.int64)

    @functools.cached_property
    def _framed_sizes(self) -> bool:
        """Whether :meth:`stored_sizes` are the records' framed sizes (every file indexed)."""
        shards = self.records.shards
        indexed = [len(s.sizes) for s in shards if not s.compressed]
        return self._encoded and len(indexed) == len(shards) and sum(indexed) == len(self)

    def _load_targets(self) -> list[int]:
        return list(self.records.labels)

    def _shard_targets(self, number: int) -> list[int]:
        if self.records.foreign:  # the labels their scan found
            return super()._shard_targets(number)
        return self.records.shard_labels(number)

    def _shard_paths(self, number: int) -> list[str] | None:
        if self.records.foreign:
            return super()._shard_paths(number)
        return self.records.shard_paths(number)

    def _shard_sizes(self, number: int) -> np.ndarray:
        if not self._framed_sizes:  # raw pixels: their fixed size; else GZIP/ZLIB files
            return super()._shard_sizes(number)  # (each record's image read, every file's)
        return self.records.shards[number].sizes.astype(np.int64)

    def _field_values_of(
        self, features: dict[str, example.FeatureValue], where: str
    ) -> dict[str, Any] | None:
        """A record's field values (``None``: the output has no fields)."""
        if not self.manifest.fields:
            return None
        values: dict[str, Any] = {}
        for found in self.manifest.fields:
            data = field_data(found, features, self.records.field_keys, where)
            values[found.name] = None if data is None else found.decode(data)
        return values

    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        fields = self.manifest.fields
        out: list[list[bytes | None]] = [[b""] * len(indices) for _ in fields]
        for pos, frame, where in self._frames(indices):
            features = self.records.features(frame, where)
            for column, found in zip(out, fields, strict=True):
                column[pos] = field_data(found, features, self.records.field_keys, where)
        return out

    def _load_paths(self) -> list[str] | None:
        return self.records.paths

    def _frames(self, indices: np.ndarray) -> Iterator[tuple[int, memoryview, str]]:
        """``(position in indices, record data, where)``, read shard by shard in file order;
        the frame's CRCs are checked unless ``check_crc=False``."""
        shard_of = self._shard_of(indices)
        local = indices - self._starts[shard_of]
        for pos in np.lexsort((local, shard_of)).tolist():
            yield pos, *self._frame(int(shard_of[pos]), int(local[pos]), int(indices[pos]))

    def _frame(self, number: int, record: int, index: int) -> tuple[memoryview, str]:
        """Sample ``index``'s frame data (record ``record`` of shard ``number``) and where it
        lies; its CRCs checked unless ``check_crc=False``."""
        shard = self.records.shards[number]
        offset, size = int(shard.offsets[record]), int(shard.sizes[record])
        where = f"{shard.path} at offset {offset}"
        data = os.pread(self._fd(number), size, offset)
        try:
            return framing.unframe(data, where, self.records.check_crc), where
        except DataError as exc:  # name the sample too, and its source where it can be had
            raise DataError(f"{exc} (sample {index}{self._source(index)})") from None

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        found: list[Record | None] = [None] * len(indices)
        for pos, frame, where in self._frames(indices):
            _, label = self._stored(int(indices[pos]), frame, where)
            # The frame's own CRC-32C (checked in _frames) is the record's checksum.
            found[pos] = Record(int(indices[pos]), frame, label, None, where)
        yield from (r for r in found if r is not None)

    def _one(self, index: int) -> tuple[Any, int, str]:
        frame, where = self._frame(*self._locate(index), index)
        item, label = self._stored(index, frame, where)
        return item, label, where

    def _stored(self, index: int, frame: memoryview, where: str) -> tuple[Any, int]:
        """Record ``index``'s stored image and label from its frame's data. The first time this
        process reads an encoded record it is parsed (output id, label and class checked) and
        where its image bytes lie is kept; a later read of the same record (the data CRC stored
        in its frame the one seen then; the frame itself checked as every read's) takes the
        image from there and the label kept, nothing parsed again (~56 µs a record)."""
        crc = framing.stored_crc(frame)
        spots = self._learned.spots
        if crc is not None and spots is not None:
            start, stop, label, seen = spots[index].item()
            if start >= 0 and seen == crc:
                return frame[start:stop], label
        item, label = self.records.stored(frame, where)
        if crc is not None and isinstance(item, bytes):
            self._remember(index, frame, item, label, crc)
        return item, label

    def _remember(self, index: int, frame: memoryview, image: bytes, label: int, crc: int) -> None:
        """Keep where ``image``, the ``image/encoded`` value just parsed from ``frame``, lies in
        it: right after its entry's head as imgpack writes it. A record encoded otherwise (by
        another tool) is not kept, and is parsed on every read."""
        head = example.bytes_entry_head("image/encoded", len(image))
        data = bytes(frame)
        found = data.find(head)
        start = found + len(head)
        stop = start + len(image)
        if found < 0 or not data.startswith(image, start) or stop >= 1 << 31 or label >= 1 << 31:
            return
        learned = self._learned
        if learned.spots is None:
            learned.spots = np.zeros(len(self), SPOT)
            learned.spots["start"] = -1
        learned.spots[index] = (start, stop, label, crc)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        if self._layout is not None:
            return self._gather_raw(indices, self._layout)
        items: list[Any] = [None] * len(indices)
        labels = [0] * len(indices)
        wheres = [""] * len(indices)
        for pos, frame, where in self._frames(indices):
            items[pos], labels[pos] = self._stored(int(indices[pos]), frame, where)
            wheres[pos] = where
        return self.decoder.batch(items, wheres.__getitem__), label_tensor(labels)
