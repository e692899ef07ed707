"""Reader of the ``webdataset`` format (layout in :mod:`imgpack.formats.webdataset.layout`)."""

from __future__ import annotations

import json
import mmap
import os
import tarfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from imgpack.errors import DataError
from imgpack.formats.batch import Images
from imgpack.formats.dataset_base import (
    PreadDataset,
    Record,
    check_file_order,
    check_labels,
    check_output_id,
    joined_paths,
    new_batch_tensor,
    scratch_tensor,
)
from imgpack.formats.gather import Spread
from imgpack.formats.webdataset import layout

if TYPE_CHECKING:
    pass


class WebDatasetDataset(PreadDataset):
    """Map-style dataset over a ``webdataset`` output.

    The ``.idx`` beside each shard says where every image member's bytes are, so a sample is one
    ``os.pread`` from its tar, with no scan. Shards open lazily in the reading process. For
    sequential streaming with the ``webdataset`` library itself, see ``docs/formats/webdataset.md``.
    """

    lazy_files = True
    reads_fields = True

    format = "webdataset"

    def _prepare(self) -> None:
        check_file_order(self.root, self.manifest, lambda number, _: layout.shard_name(number))
        self._raw = self.manifest.encoding == "raw"
        self._paths = self.shard_files = [self.root / f.path for f in self.manifest.files]
        self._count_shards([f.num_samples for f in self.manifest.files])
        parts = [
            self._read_index(path, entry.num_samples, entry.bytes)
            for path, entry in zip(self._paths, self.manifest.files, strict=True)
        ]
        width = self._index_width
        table = np.concatenate(parts) if parts else np.empty((0, width), np.int64)
        self._offsets, self._sizes = table[:, 0].copy(), table[:, 1].copy()
        self._labels, self._crcs = table[:, 2].copy(), table[:, 3].copy()
        #: Each field's member data ``(offset, size)`` columns (``-1``: absent), in order.
        self._field_spots = [
            (table[:, 4 + 2 * k].copy(), table[:, 5 + 2 * k].copy())
            for k in range(len(self.manifest.fields))
        ]
        problem = check_labels(self._labels, len(self), len(self.classes))
        if problem:
            raise DataError(f"{self.root}: damaged index: {problem}")
        if self._raw:
            image = self.manifest.image
            self._shape = (int(image["height"]), int(image["width"]), self.channels)
            self._npy = layout.npy_header(self._shape)
            self._member_size = len(self._npy) + int(np.prod(self._shape))
            #: Whether every image member is the size the image shape gives (else each batch's
            #: are compared, and one that is not goes through the record path).
            self._regular = bool((self._sizes == self._member_size).all())
            #: Where the pixels lie, for batches spread over several shards.
            self._spread = (
                Spread(self._shard_of(np.arange(len(self))), self._offsets, len(self._npy))
                if len(self._starts) > 2
                else None
            )

    @property
    def _index_width(self) -> int:
        """Columns of a line of the index: four, then two per field."""
        return layout.INDEX_COLUMNS + 2 * len(self.manifest.fields)

    def _read_index(self, shard: Any, count: int, size: int) -> np.ndarray:
        """The index of ``shard`` (``size`` bytes, as the manifest says and the opening checked,
        or the fetch will), checked against it."""
        path = layout.index_path(shard)
        try:
            text = path.read_text(encoding="ascii")
            table = np.array(text.split(), dtype=np.int64).reshape(-1, self._index_width)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise DataError(f"{path}: cannot read the sample index: {exc}") from None
        if len(table) != count:
            raise DataError(f"{path}: lists {len(table)} samples, the manifest says {count}")
        if count and ((table[:, :2] < 0).any() or int((table[:, 0] + table[:, 1]).max()) > size):
            raise DataError(f"{path}: an entry points outside {shard.name} ({size} bytes)")
        for k in range(len(self.manifest.fields)):
            at, length = table[:, 4 + 2 * k], table[:, 5 + 2 * k]
            present = at >= 0
            if count and (
                (at < -1).any()
                or (length < 0).any()
                or (~present & (length != 0)).any()
                or int((at + length)[present].max(initial=0)) > size
            ):
                raise DataError(f"{path}: a field's entry points outside {shard.name}")
        return table

    def stored_sizes(self, chunk: int = 4096) -> np.ndarray:
        return self._sizes.copy() if self._encoded else super().stored_sizes(chunk)

    def _shard_sizes(self, number: int) -> np.ndarray:
        if not self._encoded:  # the raw pixels' fixed size, not the .npy member's
            return super()._shard_sizes(number)
        return self._sizes[self._first[number] : self._first[number + 1]].copy()

    def _load_targets(self) -> list[int]:
        return self._labels.tolist()

    def _shard_targets(self, number: int) -> list[int]:
        labels: list[int] = self._labels[self._first[number] : self._first[number + 1]].tolist()
        return labels

    def _load_paths(self) -> list[str] | None:
        return joined_paths([self._shard_paths(k) for k in range(len(self._paths))])

    def _shard_paths(self, number: int) -> list[str]:
        """The paths the metadata members of shard ``number`` hold (its tar read through)."""
        paths: list[str] = []
        shard = self._paths[number]
        try:
            with tarfile.open(self._local(number), "r:") as tar:
                for member in tar:
                    if member.name.endswith(self._metadata):
                        data = tar.extractfile(member)
                        assert data is not None
                        paths.append(str(json.loads(data.read())["path"]))
        except (OSError, tarfile.TarError, ValueError, KeyError) as exc:
            raise DataError(f"{shard}: cannot read the sample metadata: {exc}") from None
        expected = self.manifest.files[number].num_samples
        if len(paths) != expected:
            raise DataError(
                f"{shard}: holds {len(paths)} {self._metadata} members, expected {expected}"
            )
        return paths

    def _check_shard(self, number: int, fd: int) -> None:
        """The shard's index must describe its tar (:func:`check_index`), and the first
        sample's ``.json`` must carry this output's id."""
        start, stop = int(self._starts[number]), int(self._starts[number + 1])
        problem = check_index(fd, self._offsets[start:stop], self._sizes[start:stop])
        if problem:
            raise DataError(
                f"{layout.index_path(self._paths[number])}: does not match {self._paths[number].name}"
                f": {problem} (a damaged or edited index)"
            )
        expected = self.manifest.file_output_id(number)
        if not expected or not self.manifest.files[number].num_samples:
            return
        found = None
        try:
            with open(fd, "rb", closefd=False) as fh, tarfile.open(fileobj=fh, mode="r:") as tar:
                for _ in range(3 + len(self.manifest.fields)):  # image, .cls, fields, metadata
                    member = tar.next()
                    if member is None:
                        break
                    if member.name.endswith(self._metadata) and member.size < 1 << 20:
                        data = tar.extractfile(member)
                        found = json.loads(data.read()).get("output_id") if data else None
                        break
        except (OSError, tarfile.TarError, ValueError, AttributeError) as exc:
            raise DataError(f"{self._paths[number]}: cannot read its first sample: {exc}") from None
        check_output_id(expected, found, str(self._paths[number]), self.root)

    @property
    def _metadata(self) -> str:
        """The suffix of a sample's metadata member: ``.imgpack.json`` in an output with fields,
        whose ``.json`` may be a field (layout)."""
        return f".{layout.FIELDS_METADATA}" if self.manifest.fields else ".json"

    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        out: list[list[bytes | None]] = [[] for _ in self.manifest.fields]
        for index in indices.tolist():
            number = self._locate(index)[0]
            for column, data in zip(out, self._field_bytes(index, number), strict=True):
                column.append(data)
        return out

    def _field_bytes(self, index: int, number: int) -> list[bytes | None]:
        """The stored bytes (what the checksum covers) of sample ``index``'s fields, read from
        their members in shard ``number``; :class:`DataError` naming the sample for a member
        that does not hold its field's value."""
        fd = self._fd(number)
        found: list[bytes | None] = []
        for f, (starts, sizes) in zip(self.manifest.fields, self._field_spots, strict=True):
            at, size = int(starts[index]), int(sizes[index])
            if at < 0:
                found.append(None)
                continue
            data = os.pread(fd, size, at)
            try:
                if len(data) != size:
                    raise ValueError(f"cut short ({len(data)} of {size} bytes)")
                found.append(layout.field_stored(f, data))
            except (ValueError, DataError, UnicodeDecodeError) as exc:
                raise DataError(
                    f"{self._where(index, number)}: its {f.name!r} member does not hold a "
                    f"{f.type} value ({exc})"
                ) from None
        return found

    def _read(self, index: int, number: int) -> bytes:
        offset, size = int(self._offsets[index]), int(self._sizes[index])
        data = os.pread(self._fd(number), size, offset)
        if len(data) != size:
            raise DataError(
                f"{self._paths[number]}: sample {index} is cut short ({len(data)} of {size} bytes)"
            )
        return data

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        for index in indices.tolist():
            number = self._locate(index)[0]
            label, crc = int(self._labels[index]), int(self._crcs[index])
            fields = self._field_bytes(index, number) if self.manifest.fields else None
            yield Record(
                index, self._read(index, number), label, crc, str(self._paths[number]), fields
            )

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        labels = torch.from_numpy(self._labels[indices])
        if self._raw:
            gathered = None
            if self.checks.unchecked(indices):
                gathered = self._gather_checked(indices)
                if gathered is None:  # not the output's .npy arrays: the record path names it
                    self.checks.raw(self, indices)
            if gathered is None:
                gathered = self._gather_raw(indices)
            if gathered is not None:
                return gathered, labels
        records = self._records(indices)
        if self.verify:
            records = self.checks.records(self, records)
        if not self._raw:
            batch = list(records)
            images = self._decode([r.payload for r in batch], lambda k: self._where(batch[k].index))
            return images, labels
        out = new_batch_tensor((len(indices), *self._shape))
        rows = out.numpy().reshape(len(indices), -1)
        head = len(self._npy)
        for k, record in enumerate(records):
            data = record.payload
            if len(data) != head + rows.shape[1] or not data.startswith(self._npy):
                raise DataError(
                    f"{self._where(record.index)}: not a uint8 {self._shape} .npy array"
                )
            rows[k] = np.frombuffer(data, np.uint8, offset=head)
        return out.permute(0, 3, 1, 2), labels

    def _regular_members(self, indices: np.ndarray) -> bool:
        """Whether raw samples ``indices`` (at least one) each have an ``.npy`` member of the
        size the output's image shape gives (else the record path names the one that has not)."""
        return len(indices) > 0 and (
            self._regular or bool((self._sizes[indices] == self._member_size).all())
        )

    def _gather_members(self, indices: np.ndarray, out: torch.Tensor) -> None:
        """Row ``k`` of ``out`` (contiguous ``(n, width)`` uint8) is the first ``width`` bytes
        of sample ``indices[k]``'s image member, from the memory-mapped shards."""
        self._gather_rows(self._shards(indices), self._offsets[indices], out)

    def _gather_pixels(self, indices: np.ndarray, out: torch.Tensor) -> None:
        """Row ``k`` of ``out`` (contiguous ``(n, H * W * C)`` uint8) is the pixels of sample
        ``indices[k]``'s ``.npy`` member, from the memory-mapped shards."""
        if self._spread is None:
            self._rows_into(0, self._offsets[indices] + len(self._npy), out)
            return
        self._spread.gather(indices, out, self._windows, self._gather_rows)

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The whole ``.npy`` members of raw samples ``indices`` (what each checksum covers,
        with the fields' bytes where the output has fields: then ``None``), gathered from the
        memory-mapped shards."""
        if self.manifest.fields or not self._regular_members(indices):
            return None
        rows = scratch_tensor((len(indices), self._member_size))
        self._gather_members(indices, rows)
        return rows.numpy(), self._labels[indices], self._crcs[indices]

    def _gather_checked(self, indices: np.ndarray) -> torch.Tensor | None:
        """A raw batch read for the first time (or with ``verify=True``): the whole ``.npy``
        members gathered once, checked as gathered, their pixels copied into the batch (one
        gather from the shards instead of one to check and one to read). ``None`` when a
        member is not the output's ``.npy`` array: the record path names it."""
        found = self._raw_rows(indices)
        if found is None:
            return None
        members = found[0]
        self.checks.gathered(self, indices, *found)
        out = new_batch_tensor((len(indices), *self._shape))
        out.numpy().reshape(len(indices), -1)[:] = members[:, len(self._npy) :]
        return out.permute(0, 3, 1, 2)

    def _gather_raw(self, indices: np.ndarray) -> torch.Tensor | None:
        """A raw batch gathered from the memory-mapped shards, the pixels copied straight into
        the batch. The members' ``.npy`` headers are compared with the output's unless their
        checksums, which cover the headers, were checked (by default the first time this
        reader read each; ``verify=True``: just now). ``None`` when a member is not the
        output's ``.npy`` array: the record path names it."""
        if not self._regular_members(indices):
            return None
        if not (self.verify or self.checks.once):  # no checksum covered the headers
            heads = scratch_tensor((len(indices), len(self._npy)))
            self._gather_members(indices, heads)
            if not (heads.numpy() == np.frombuffer(self._npy, np.uint8)).all():
                return None
        out = new_batch_tensor((len(indices), *self._shape))
        self._gather_pixels(indices, out.view(len(indices), -1))
        return out.permute(0, 3, 1, 2)

    def _stored_bytes(self, record: Record) -> bytes:
        data = bytes(record.payload)
        if not self._raw:
            return data
        if len(data) != len(self._npy) + int(np.prod(self._shape)) or not data.startswith(
            self._npy
        ):
            raise DataError(f"{self._where(record.index)}: not a uint8 {self._shape} .npy array")
        return data[len(self._npy) :]

    def _one(self, index: int) -> tuple[bytes, int, str]:
        number = self._locate(index)[0]
        data, label = self._read(index, number), int(self._labels[index])
        if self.verify:
            fields = self._field_bytes(index, number) if self.manifest.fields else None
            self.checks.record(
                self, index, data, label, int(self._crcs[index]), str(self._paths[number]), fields
            )
        return data, label, self._where(index, number)

    def _where(self, index: int, number: int | None = None) -> str:
        if number is None:
            number = self._locate(index)[0]
        return f"{self._paths[number]}: sample {index} ({layout.KEY_FORMAT % index})"


def check_index(fd: int, offsets: np.ndarray, sizes: np.ndarray) -> str | None:
    """What is wrong with a shard's index rows (``offsets``, ``sizes`` of its image members),
    checked against the tar's own framing, or ``None``: each row must point just past a ustar
    member header whose size field is the row's size and whose name is ``<key>.<ext>`` with a
    key that grows from row to row and an image extension (not ``.cls`` or ``.json``). A
    duplicated, swapped or shifted line fails. One gather of 512-byte headers per shard."""
    if not len(offsets):
        return None
    size = os.fstat(fd).st_size
    if int(offsets.min()) < 512 or int((offsets + sizes).max()) > size:
        return "an entry points outside the tar"
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
        data = np.frombuffer(mapped, np.uint8)
        windows = np.lib.stride_tricks.as_strided(data, (size - 511, 512), (1, 1))
        heads = windows[offsets - 512].copy()
        del data, windows
    width = len(layout.KEY_FORMAT % 0)
    digits = heads[:, :width].astype(np.int64) - 48
    if ((digits < 0) | (digits > 9)).any() or (heads[:, width] != ord(".")).any():
        return "an entry does not point at a sample's image member"
    keys = digits @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64))
    if len(keys) > 1 and bool((keys[1:] <= keys[:-1]).any()):
        return "its entries are not in key order (a line repeated or moved)"
    ext = heads[:, width + 1 : width + 6]
    for other in (b"cls\0", b"json\0"):
        if (ext[:, : len(other)] == np.frombuffer(other, np.uint8)).all(axis=1).any():
            return "an entry points at a label or metadata member, not an image"
    octal = heads[:, 124:135].astype(np.int64) - 48
    if ((octal < 0) | (octal > 7)).any():
        return "an entry does not point just past a tar header"
    found = octal @ (8 ** np.arange(10, -1, -1, dtype=np.int64))
    if not np.array_equal(found, sizes):
        return "an entry's size is not its member's size"
    return None
