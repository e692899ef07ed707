"""Reader of the ``lmdb`` format (layout in ``docs/formats/lmdb.md`` and
:mod:`imgpack.formats.lmdb.record`)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack.errors import DataError
from imgpack.formats.batch import Images, label_tensor
from imgpack.formats.dataset_base import ImageDataset, Record, new_batch_tensor
from imgpack.formats.gather import byte_rows, take_windows
from imgpack.formats.lmdb import record
from imgpack.formats.lmdb.meta import check_meta
from imgpack.images import Kind
from imgpack.scan import UNLABELLED, valid_label

# py-lmdb allows one Environment per file per process, so readers of the same output share one,
# counted: (path, the data file's identity) -> [environment, readers using it]. The last reader
# to let go closes it, so a dropped reader leaves nothing mapped and nothing open. A replaced
# data.mdb (--overwrite) has a new identity, hence an environment of its own.
if TYPE_CHECKING:
    pass


_environments: dict[tuple[str, tuple[int, int, int]], list[Any]] = {}
_environments_pid: int | None = None


def acquire_environment(root: Path) -> Any:
    """This process's read-only environment for the output at ``root``; give it back with
    :func:`release_environment`."""
    import lmdb

    global _environments_pid
    if _environments_pid != os.getpid():
        # Inherited through a fork: LMDB handles must not be used in the child. Unmapping the
        # child's copy leaves the parent's untouched.
        for env, _ in _environments.values():
            with contextlib.suppress(Exception):
                env.close()
        _environments.clear()
        _environments_pid = os.getpid()
    try:
        st = (root / "data.mdb").stat()
        key = (str(root.resolve()), (st.st_dev, st.st_ino, st.st_mtime_ns))
        known = _environments.get(key)
        if known is not None:
            known[1] += 1
            return known[0]
        check_meta(root / "data.mdb")  # damage LMDB would follow past the file's end
        env = lmdb.open(
            str(root), readonly=True, lock=False, readahead=False, meminit=False, subdir=True
        )
        _environments[key] = [env, 1]
    except (OSError, lmdb.Error) as exc:
        raise DataError(f"{root}: cannot open the LMDB environment: {exc}") from None
    return env


def release_environment(env: Any) -> None:
    """One reader less for ``env``; the last one closes it."""
    for key, entry in list(_environments.items()):
        if entry[0] is env:
            entry[1] -= 1
            if entry[1] <= 0:
                del _environments[key]
                env.close()
            return


_KEY = record.KEY_FORMAT.__mod__  # record.key without the call overhead
#: Bytes of every raw record's start that the batch check reads (a version 2 header).
_HEAD = record.HEADER_SIZE


@dataclass
class _Learned:
    """What an :class:`LMDBDataset` learns in one process as it reads (its ``_here``)."""

    #: Where every record lies in this process's map of ``data.mdb`` (built once enough raw
    #: records were read through ``get``: :data:`SLOW_SHARE`).
    spans: _MapSpans | None = None
    #: Raw records this process read through ``get`` (negative: the spans cannot be built).
    slow_reads: int = 0


class LMDBDataset(ImageDataset):
    """Dataset over an ``lmdb`` output.

    The environment opens lazily in the reading process (read-only, no lock file, no readahead,
    no meminit) and again after a fork. A batch is served from one read transaction, a ``get``
    per record; raw pixels are copied from the map straight into the batch tensor.

    Raw records, once a process has read ``1/SLOW_SHARE`` of them that way, are served from a
    table of where each record lies in ``data.mdb`` (:class:`_MapSpans`), over the reader's
    own read-only mapping of the file: a batch is then a gather of headers (checked at once,
    the first time only) and one of pixels, no call per record.
    """

    format = "lmdb"
    learns = _Learned
    reads_fields = True

    def _prepare(self) -> None:
        image = self.manifest.image
        self._raw = self.manifest.encoding == "raw"
        self._shape = (image["height"], image["width"], self.channels)
        #: The bytes of a raw record's pixels (computed once: a batch read is ~100 µs).
        self._pixels = int(np.prod(self._shape)) if self._raw else 0
        if self._raw:
            # The fixed bytes every raw record of this output starts with (but the version, at
            # byte 4), and its dimensions.
            head = record.pack(Kind.RAW, self.channels, 0, self._shape[0], self._shape[1], "", b"")
            self._prefix = np.frombuffer(head[:8], np.uint8)
            self._dims = np.frombuffer(head[16:24], np.uint8)

    def memory_mapped(self) -> bool:
        return self._raw

    def _open(self) -> Any:
        # Its size first: LMDB maps the file whole and reads its pages at once (a file cut
        # since the output was opened is a SIGBUS there, not an error).
        self._here().maps.note(0, self.root / "data.mdb")
        env = acquire_environment(self.root)
        try:
            self._check_environment(env)
        except BaseException:
            release_environment(env)
            self._here().maps.forget(0)
            raise
        return env

    def _close(self, handles: Any) -> None:
        release_environment(handles)  # the spans' map of data.mdb goes with this process's state

    def _check_environment(self, env: Any) -> None:
        """The environment holds this output: its record count, and its id (the key
        ``__imgpack__``, when the manifest has an id)."""
        expected = self.manifest.output_id
        entries = env.stat()["entries"] - (1 if expected else 0)
        if expected:
            with env.begin() as txn:
                value = txn.get(record.META_KEY)
            try:
                found = json.loads(value)["output_id"] if value is not None else None
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{self.root}: unreadable {record.META_KEY.decode()} key") from None
            self._check_output(found, str(self.root / "data.mdb"))
        if entries != len(self):
            raise DataError(f"{self.root}: holds {entries} records, the manifest says {len(self)}")

    def _header(self, key: Any, value: Any) -> record.RecordHeader:
        try:
            header = record.unpack_header(value)
        except DataError as exc:
            raise DataError(f"{self.root}: record {bytes(key).decode()}: {exc}") from None
        if header.fields is not None and not self.manifest.fields:
            raise DataError(
                f"{self.root}: record {bytes(key).decode()}: holds fields (version 3), and "
                "the output lists none"
            )
        if not valid_label(header.label, len(self.classes)):
            raise DataError(
                f"{self.root}: record {bytes(key).decode()}: label {header.label} out of range"
            )
        if self._raw and (header.height, header.width, header.channels) != self._shape:
            raise DataError(
                f"{self.root}: record {bytes(key).decode()}: shape differs from the manifest"
            )
        return header

    def _raw_batch(self, keys: list[bytes], values: list[Any]) -> tuple[Images, torch.Tensor]:
        """Raw records as one batch, every header checked at once with numpy.

        The pixels are the last ``H * W * C`` bytes of each record (after the header and the
        path, whose length varies), so the batch is one join of those tails.
        """
        count = len(values)
        pixels = self._pixels
        lengths = np.fromiter(map(len, values), np.int64, count)
        if count and int(lengths.min()) >= _HEAD:
            labels = self._check_raw_heads(keys, values, lengths, pixels)
        else:  # tiny version 1 records, or an empty batch: one header at a time
            labels = np.array(
                [self._header(k, v).label for k, v in zip(keys, values, strict=True)], np.int64
            )
        labels_out = torch.from_numpy(labels.astype(np.int64))
        if get_worker_info() is None:
            blob = bytearray().join([v[-pixels:] for v in values])  # the one copy out of the map
            images = torch.frombuffer(blob, dtype=torch.uint8).view(count, *self._shape)
            return images.permute(0, 3, 1, 2), labels_out
        # In a DataLoader worker: straight into a pooled shared buffer, handed over without a copy.
        out = new_batch_tensor((count, *self._shape))
        rows = out.numpy().reshape(count, pixels)
        for k, value in enumerate(values):
            rows[k] = value[-pixels:]
        return out.permute(0, 3, 1, 2), labels_out

    def _check_raw_heads(
        self, keys: list[bytes], values: list[Any], lengths: np.ndarray, pixels: int
    ) -> np.ndarray:
        """Check every raw record's header at once; return the labels."""
        count = len(values)
        heads = np.frombuffer(bytearray().join([v[:_HEAD] for v in values]), np.uint8)
        good, labels = self._raw_heads(heads.reshape(count, _HEAD), lengths, pixels)
        if not good.all():
            bad = int(np.flatnonzero(~good)[0])
            self._header(keys[bad], values[bad])  # raises the precise error
            raise DataError(f"{self.root}: record {keys[bad].decode()} has the wrong size")
        return labels

    def _raw_heads(
        self, heads: np.ndarray, lengths: np.ndarray, pixels: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(good, labels)`` of raw records from their first ``_HEAD`` bytes (rows of
        ``heads``) and lengths: the fixed bytes, version, dimensions, label range and length."""
        count = len(heads)
        version = heads[:, 4]
        path_length = heads[:, 24:28].copy().view("<u4").reshape(count).astype(np.int64)
        expected = np.where(version == 1, record.V1_HEADER_SIZE, _HEAD + path_length) + pixels
        labels = heads[:, 8:16].copy().view("<i8").reshape(count)
        prefix = heads[:, :8] == self._prefix
        prefix[:, 4] = (version == 1) | (version == record.VERSION)
        good = prefix.all(axis=1) & (heads[:, 16:24] == self._dims).all(axis=1)
        if self.classes:
            good &= (labels >= 0) & (labels < len(self.classes)) & (lengths == expected)
        else:
            good &= (labels == UNLABELLED) & (lengths == expected)
        return good, labels

    def _check_heads(self, spans: _MapSpans, chunk: int = 1 << 16) -> None:
        """Check every record's header in the new map at once (a gather of 32 bytes a record,
        ``chunk`` records at a time), remembering the labels of those that check out: the
        first epoch's later batches then gather pixels only. A header that does not check out
        is left to the batch that reads it (the ``get`` path names the problem)."""
        pixels = self._pixels
        for first in range(0, len(spans.starts), chunk):
            part = slice(first, first + chunk)
            heads = byte_rows(spans.tensor, spans.starts[part], _HEAD)
            good, labels = self._raw_heads(heads, spans.lengths[part], pixels)
            spans.labels[part] = labels
            spans.checked[part] = good

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Raw records ``indices`` gathered from the map for the first reads' checksum pass (the
        pixels, the labels and the stored CRCs of headers that check out), once the reader
        has its map; ``None`` before, or for a header that does not check out or has no
        checksum (version 1): those are checked record by record, which names the problem."""
        spans = self._learned.spans
        if spans is None or spans.env is not self.handles or not len(indices):
            return None
        if self.manifest.fields:
            return None  # the checksums cover the fields too: checked record by record
        found = self._map_heads(spans, indices)
        if found is None or (found[0][:, 4] != record.VERSION).any():
            return None
        heads, labels = found
        pixels = self._pixels
        crcs = heads[:, 28:32].copy().view("<u4").reshape(len(indices)).astype(np.int64)
        ends = spans.starts[indices] + spans.lengths[indices]
        return byte_rows(spans.tensor, ends - pixels, pixels), labels.astype(np.int64), crcs

    def _map_heads(
        self, spans: _MapSpans, indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The headers of records ``indices`` gathered from the map, and their labels, when
        every one checks out (then remembered as checked); ``None`` otherwise."""
        lengths = spans.lengths[indices]
        if int(lengths.min()) < _HEAD:
            return None
        heads = byte_rows(spans.tensor, spans.starts[indices], _HEAD)
        good, labels = self._raw_heads(heads, lengths, self._pixels)
        if not good.all():
            return None
        spans.labels[indices], spans.checked[indices] = labels, True
        return heads, labels

    def _from_map(
        self, spans: _MapSpans, indices: np.ndarray
    ) -> tuple[Images, torch.Tensor] | None:
        """A raw batch gathered through ``spans``; ``None`` when a header does not check out
        (the ``get`` path then names what is wrong)."""
        count, pixels = len(indices), self._pixels
        if count == 0:
            return None
        if not self.verify and spans.checked[indices].all():  # headers checked before
            labels = spans.labels[indices]
        else:
            found = self._map_heads(spans, indices)
            if found is None:
                return None
            labels = found[1]
        out = new_batch_tensor((count, *self._shape))
        take_windows(spans.tensor, pixels, spans.tails(pixels)[indices], out.view(count, pixels))
        return out.permute(0, 3, 1, 2), torch.from_numpy(labels.astype(np.int64, copy=False))

    def _values(self, txn: Any, keys: list[bytes]) -> list[Any]:
        # A loop of get() measured faster than Cursor.getmulti() for random keys (py-lmdb 3.0),
        # and keeps request order.
        get = txn.get
        values = [get(key) for key in keys]
        if None in values:
            missing = keys[values.index(None)]
            raise DataError(f"{self.root}: record {missing.decode()} is missing")
        return values

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        keys = list(map(_KEY, indices.tolist()))
        with self.handles.begin(buffers=True) as txn:
            values = self._values(txn, keys)
            out = []
            for index, key, value in zip(indices.tolist(), keys, values, strict=True):
                header = self._header(key, value)
                payload = bytes(value[header.payload_offset :])
                where = f"{self.root}: record {key.decode()}"
                fields = self._fields_of(key, value, header)
                out.append(Record(index, payload, header.label, header.crc, where, fields))
        yield from out

    def _fields_of(
        self, key: bytes, value: Any, header: record.RecordHeader
    ) -> list[bytes | None] | None:
        """A record's fields' stored bytes (``None``: the output has no fields); a record of
        an output with fields must carry them (version 3)."""
        count = len(self.manifest.fields)
        if not count:
            return None
        where = f"{self.root}: record {key.decode()}"
        if header.fields is None:
            raise DataError(f"{where}: has no fields section, and the output has fields")
        start, stop = header.fields
        try:
            return record.split_fields(value[start:stop], count)
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None

    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        out: list[list[bytes | None]] = [[] for _ in self.manifest.fields]
        keys = list(map(_KEY, indices.tolist()))
        with self.handles.begin(buffers=True) as txn:
            for key, value in zip(keys, self._values(txn, keys), strict=True):
                found = self._fields_of(key, value, self._header(key, value))
                assert found is not None
                for column, data in zip(out, found, strict=True):
                    column.append(data)
        return out

    def _one(self, index: int) -> tuple[bytes, int, str]:
        key = _KEY(index)
        with self.handles.begin(buffers=True) as txn:
            (value,) = self._values(txn, [key])
            header = self._header(key, value)
            payload = bytes(value[header.payload_offset :])
            fields = self._fields_of(key, value, header) if self.verify else None
        where = f"{self.root}: record {key.decode()}"
        if self.verify:
            self.checks.record(self, index, payload, header.label, header.crc, where, fields)
        return payload, header.label, where

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        if self.manifest.fields:  # version 3 records: the record path (checked with the fields)
            return super()._gather(indices)
        if self._raw:
            self.checks.raw(self, indices)
            env = self.handles
            learned = self._learned
            spans = (
                learned.spans if learned.spans is not None and learned.spans.env is env else None
            )
            if spans is None and 0 <= len(self) // SLOW_SHARE <= learned.slow_reads:
                spans = learned.spans = _MapSpans.build(env, len(self), self.root / "data.mdb")
                if spans is None:  # a record is missing: the ``get`` path says which, always
                    learned.slow_reads = -(1 << 62)
                else:
                    self._check_heads(spans)
            if spans is not None:
                gathered = self._from_map(spans, indices)
                if gathered is not None:
                    return gathered
            learned.slow_reads += len(indices)
            keys = list(map(_KEY, indices.tolist()))
            with env.begin(buffers=True) as txn:  # one read transaction for the batch
                return self._raw_batch(keys, self._values(txn, keys))
        records = self._records(indices)
        if self.verify:
            records = self.checks.records(self, records)
        batch = list(records)
        images = self._decode([r.payload for r in batch], lambda k: batch[k].where)
        return images, label_tensor([r.label for r in batch])

    def _headers(self) -> list[record.RecordHeader]:
        with self.handles.begin(buffers=True) as txn:
            headers = [
                self._header(key, value)
                for key, value in txn.cursor()
                if bytes(key[:1]) != record.META_KEY[:1]
            ]
        if len(headers) != len(self):
            raise DataError(
                f"{self.root}: holds {len(headers)} records, the manifest says {len(self)}"
            )
        return headers

    def _load_targets(self) -> list[int]:
        return [header.label for header in self._headers()]

    def _load_paths(self) -> list[str] | None:
        paths = [header.path for header in self._headers()]
        return None if None in paths else [p for p in paths if p is not None]


#: A reader builds its map of record positions once it has read ``1/SLOW_SHARE`` of the
#: records through ``get``: a raw record read that way costs about 30 µs (the lookup, its header
#: and checksum checked in Python), building the map about 2.5 µs a record, so by then the map
#: costs no more than the slow reads already did (and a few reads never pay for it).
SLOW_SHARE = 12


#: Places in data.mdb where the first value's bytes are tried as its offset.
ANCHOR_TRIES = 4


class _MapSpans:
    """Where each record's value lies in ``data.mdb``, and a uint8 tensor over the reader's own
    read-only mapping of that file (``torch.from_file``: a plain private file mapping, no
    address arithmetic into LMDB's memory).

    LMDB hands out values as views into its memory map of ``data.mdb``, which maps the file
    from its first byte: two values' addresses differ by what their file offsets differ by.
    The build reads every record once (one ``get`` each), takes those differences, anchors
    them at the file offset of the first value (found in the file by its bytes), and checks
    every record's bytes at its offset against the value LMDB gave: a table that does not
    check out is not used (the ``get`` path serves the reader then). An output is never
    written after its conversion, so the offsets hold for as long as the file is the one
    mapped (the reader's truncation check covers a file cut meanwhile). A reader builds it only
    after reading ``1/SLOW_SHARE`` of the records the slow way. ``labels``: each record's label
    once its header was checked here (``checked``), so later batches gather the pixels only.
    """

    __slots__ = ("_tails", "checked", "env", "labels", "lengths", "starts", "tensor")

    def __init__(self, env: Any, tensor: torch.Tensor, starts: np.ndarray, lengths: np.ndarray):
        self.env, self.tensor, self.starts, self.lengths = env, tensor, starts, lengths
        self.labels = np.zeros(len(starts), np.int64)
        self.checked = np.zeros(len(starts), np.bool_)
        self._tails: tuple[int, np.ndarray] | None = None

    def tails(self, pixels: int) -> np.ndarray:
        """Where each record's last ``pixels`` bytes (a raw record's pixels) start in the file:
        made once, not per batch."""
        if self._tails is None or self._tails[0] != pixels:
            self._tails = (pixels, self.starts + self.lengths - pixels)
        return self._tails[1]

    @classmethod
    def build(cls, env: Any, count: int, path: Path) -> _MapSpans | None:
        if count == 0:
            return None
        addresses = np.empty(count, np.int64)
        lengths = np.empty(count, np.int64)
        with env.begin(buffers=True) as txn:
            get = txn.get
            for index in range(count):
                value = get(_KEY(index))
                if value is None:
                    return None  # the ``get`` path names the missing record
                addresses[index] = np.frombuffer(value, np.uint8).__array_interface__["data"][0]
                lengths[index] = len(value)
            first = int(np.argmin(addresses))
            anchor = bytes(get(_KEY(first)))
        size = path.stat().st_size
        tensor = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            at = mapped.find(anchor)
            # A page an earlier transaction freed may hold an old copy of the first value:
            # the offsets that check out for every record are the ones.
            for _ in range(ANCHOR_TRIES):
                if at < 0:
                    return None
                starts = addresses - addresses[first] + at
                if int((starts + lengths).max()) <= size:
                    table = cls(env, tensor, starts, lengths)
                    if table._agrees(env, count):
                        return table
                at = mapped.find(anchor, at + 1)
        return None

    def _agrees(self, env: Any, count: int) -> bool:
        """Whether every record's bytes at its offset are the value LMDB gives for it (one
        pass of a cursor, in key order: record 0 first)."""
        data = self.tensor.numpy().data  # a memoryview of the mapping: slices compare in C
        starts, index = self.starts.tolist(), 0
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                if bytes(key[:1]) == record.META_KEY[:1]:
                    continue
                if index >= count or key != _KEY(index):
                    return False
                start = starts[index]
                if data[start : start + len(value)] != value:
                    return False
                index += 1
        return index == count
