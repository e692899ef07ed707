"""Reader of the ``pt`` format (layout in ``docs/formats/pt.md`` and :mod:`imgpack.formats.pt.writer`)."""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgpack.errors import DataError
from imgpack.formats.dataset_base import (
    ImageDataset,
    Images,
    Record,
    check_file_order,
    check_labels,
    check_offsets,
    label_tensor,
    new_batch_tensor,
    shard_runs,
    void_rows,
)
from imgpack.formats.span import Span, SpanSlot
from imgpack.formats.writer_base import default_shard_name


class PTDataset(ImageDataset):
    """Dataset over a ``pt`` output. Shards are memory-mapped with
    ``torch.load(path, mmap=True, weights_only=True)`` on first use in each process; a raw batch
    is one ``index_select`` per shard it touches."""

    lazy_files = True

    format = "pt"

    def __init__(self, root: Any, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        check_file_order(self.root, self.manifest, lambda k, _: default_shard_name(self.format, k))
        self._count_shards([f.num_samples for f in self.manifest.files])
        self._raw = self.manifest.encoding == "raw"

    def memory_mapped(self) -> bool:
        return self._raw

    def _open(self) -> PTShards:
        count = len(self.manifest.files)
        return PTShards([None] * count, np.zeros(count, np.int64), np.zeros(count, np.int64))

    def _close(self, handles: Any) -> None:
        handles.spanning.close()

    def _release_file(self, name: str) -> None:
        shards = self.handles.loaded
        for number, entry in enumerate(self.manifest.files):
            if entry.path == name:
                shards[number] = None  # its tensors go when the last batch using them does

    def _shard(self, number: int) -> dict[str, Any]:
        shards = self.handles.loaded
        shard = shards[number]
        if shard is None:
            shard = shards[number] = self._load(number)
        return shard

    def _load(self, number: int) -> dict[str, Any]:
        entry = self.manifest.files[number]
        path = self.local_file(entry.path)
        try:
            shard = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise DataError(f"{path}: cannot load shard: {exc}") from None
        n = entry.num_samples
        if isinstance(shard, dict):
            self._check_output(shard.get("output_id"), str(path))
        keys = ("images", "labels") if self._raw else ("data", "offsets", "labels")
        if not isinstance(shard, dict) or any(k not in shard for k in keys):
            raise DataError(f"{path}: not a {self.manifest.encoding} shard (expected keys {keys})")
        labels = shard["labels"]
        problem = None
        if labels.dtype != torch.int64:
            problem = f"labels should be int64, found {labels.dtype}"
        else:
            problem = check_labels(labels.numpy(), n, len(self.classes))
        if problem is None and self._raw:
            image = self.manifest.image
            shape = (n, image["height"], image["width"], self.channels)
            if shard["images"].dtype != torch.uint8 or tuple(shard["images"].shape) != shape:
                problem = f"images should be uint8 {shape}, found {tuple(shard['images'].shape)}"
        elif problem is None:
            problem = check_offsets(shard["offsets"].numpy(), n, len(shard["data"]))
        paths, crcs = shard.get("paths"), shard.get("crc32c")
        if problem is None and paths is not None and len(paths) != n:
            problem = f"paths lists {len(paths)} samples, expected {n}"
        if problem is None and crcs is not None and tuple(crcs.shape) != (n,):
            problem = f"crc32c has shape {tuple(crcs.shape)}, expected ({n},)"
        if problem:
            raise DataError(f"{path}: damaged shard: {problem}")
        return shard

    def _load_targets(self) -> list[int]:
        return [
            t for i in range(len(self.manifest.files)) for t in self._shard(i)["labels"].tolist()
        ]

    def _load_paths(self) -> list[str] | None:
        shards = [self._shard(i) for i in range(len(self.manifest.files))]
        if any("paths" not in shard for shard in shards):
            return None
        return [str(p) for shard in shards for p in shard["paths"]]

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        shard_of = self._shard_of(indices)
        local = (indices - self._starts[shard_of]).tolist()
        for index, number, i in zip(indices.tolist(), shard_of.tolist(), local, strict=True):
            data, offsets, labels, crcs, where = self._columns(number)
            payload = data[i] if self._raw else data[offsets[i] : offsets[i + 1]]
            crc = int(crcs[i]) if crcs is not None else None
            yield Record(index, payload.data, int(labels[i]), crc, where)

    def _one(self, index: int) -> tuple[memoryview, int, str]:
        number, i = self._locate(index)
        data, offsets, labels, crcs, where = self._columns(number)
        payload = data[offsets[i] : offsets[i + 1]].data
        label = int(labels[i])
        if self.verify and crcs is not None:
            self._check_record(index, payload, label, int(crcs[i]), where)
        return payload, label, f"{where}: sample {index}"

    def _columns(self, number: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any, str]:
        """Shard ``number``'s data (images), offsets, labels and checksums as numpy views of
        its tensors, and its path: a record is a few array lookups (a tensor's is ~5 µs)."""
        shard = self._shard(number)
        columns = shard.get("_columns")
        if columns is None:
            crcs = shard.get("crc32c")
            columns = shard["_columns"] = (
                shard["images" if self._raw else "data"].numpy(),
                shard["offsets"].numpy() if not self._raw else np.empty(0, np.int64),
                shard["labels"].numpy(),
                crcs.numpy() if crcs is not None else None,
                str(self.root / self.manifest.files[number].path),
            )
        return columns

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        if self._raw:
            shard_of, local = self._placed(indices)
            out, labels = self._gather_raw(shard_of, local)
            if self._unchecked(indices):  # the first read of these records (or verify=True)
                rows = out.numpy().reshape(len(indices), -1)
                crcs = self._raw_crcs(shard_of, local)
                self._check_gathered(indices, rows, labels.numpy(), crcs)
            return out.permute(0, 3, 1, 2), labels
        records = self._records(indices)
        if self.verify:
            records = self._checked(records)
        batch = list(records)
        images = self._decode(
            [r.payload for r in batch],
            lambda k: f"{batch[k].where}: sample {batch[k].index}",
        )
        return images, label_tensor([r.label for r in batch])

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        shard_of, local = self._placed(indices)
        crcs = self._raw_crcs(shard_of, local)
        if crcs is None:
            return None  # written without checksums: the record path has nothing to check
        out, labels = self._gather_raw(shard_of, local)
        return out.numpy().reshape(len(indices), -1), labels.numpy(), crcs

    def _placed(self, indices: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The shard of each of ``indices`` (``None``: a one-shard output's) and its row there."""
        shard_of = self._shards(indices)
        return shard_of, indices if shard_of is None else indices - self._starts[shard_of]

    def _raw_crcs(self, shard_of: np.ndarray | None, local: np.ndarray) -> np.ndarray | None:
        """The stored checksums of rows ``local`` of shards ``shard_of`` (``None``: shard 0),
        or ``None`` when a shard has none (written without checksums)."""
        if shard_of is None:
            crcs = self._columns(0)[3]
            return None if crcs is None else crcs[local]
        out = np.empty(len(local), np.int64)
        order, runs = shard_runs(shard_of)
        for number, start, stop in runs:
            crcs = self._columns(number)[3]
            if crcs is None:
                return None
            rows = order[start:stop]
            out[rows] = crcs[local[rows]]
        return out

    def _gather_raw(
        self, shard_of: np.ndarray | None, local: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``local`` of shards ``shard_of`` (:meth:`_placed`) as a batch ``(n, H, W, C)``
        and their labels."""
        if shard_of is None:
            return self._gather_one(0, local)
        first = int(shard_of[0]) if len(shard_of) else 0
        if len(shard_of) == 0 or (shard_of == first).all():
            return self._gather_one(first, local)
        files = self.handles
        span = self._span(files.spanning, shard_of, self._paths, self._place_in_span)
        if span is not None:  # the shards in one range of addresses: one gather each
            out, got = self._batch(len(local)), torch.empty(len(local), dtype=torch.int64)
            width = out[0].numel()
            span.gather(files.images_at[shard_of] + local * width, out.view(-1, width))
            span.gather(files.labels_at[shard_of] + local * 8, got.view(torch.uint8).view(-1, 8))
            return out, got
        # Each shard's rows gathered and put in their places with one numpy assignment, rows
        # as single items (void_rows: a memcpy each), no scratch batch, no second pass.
        order, runs = shard_runs(shard_of)
        at = local[order]
        out = self._batch(len(local))
        rows = void_rows(out.numpy())
        labels = np.empty(len(local), np.int64)
        for number, start, stop in runs:
            images, shard_labels = self._rows(number)
            places, picked = order[start:stop], at[start:stop]
            rows[places] = images[picked]
            labels[places] = shard_labels[picked]
        return out, torch.from_numpy(labels)

    def _paths(self) -> list[Path]:
        return [self.root / entry.path for entry in self.manifest.files]

    def _place_in_span(self, span: Span, number: int) -> bool:
        """Shard ``number``'s file mapped into ``span``, where its images and labels lie in
        the span noted: whether both were found (torch maps a shard file whole, so its tensors
        lie as far apart as their zip records do)."""
        shard, path = self._shard(number), self.root / self.manifest.files[number].path
        at = tensor_offsets(path, [shard["images"], shard["labels"]])
        if at is None:
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            placed = span.place(number, fd)  # the mapping keeps the file, not the descriptor
        finally:
            os.close(fd)
        files, base = self.handles, int(span.bases[number])
        files.images_at[number], files.labels_at[number] = base + at[0], base + at[1]
        return placed

    def _rows(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``number``'s images as :func:`void_rows` (one item an image) and its labels,
        made once per shard and process."""
        shard = self._shard(number)
        found = shard.get("_rows")
        if found is None:
            images, labels = self._arrays(number)
            found = shard["_rows"] = (void_rows(images), labels)
        return found

    def _arrays(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``number``'s images and labels as numpy arrays (views of its tensors)."""
        images, _, labels, _, _ = self._columns(number)
        return images, labels

    def _gather_one(self, number: int, local: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``local`` of shard ``number``, straight into the batch ``(n, H, W, C)``."""
        out = self._batch(len(local))
        shard = self._shard(number)
        torch.index_select(shard["images"], 0, torch.from_numpy(local), out=out)
        return out, torch.from_numpy(self._arrays(number)[1][local])

    def _batch(self, count: int) -> torch.Tensor:
        image = self.manifest.image
        return new_batch_tensor((count, image["height"], image["width"], self.channels))


@dataclass
class PTShards:
    """A :class:`PTDataset`'s handles in one process: its loaded shards, and the span of
    their files with where each one's images and labels lie in it (set as each is placed)."""

    loaded: list[dict[str, Any] | None]
    images_at: np.ndarray
    labels_at: np.ndarray
    spanning: SpanSlot = field(default_factory=SpanSlot)


def tensor_offsets(path: Path, tensors: list[torch.Tensor]) -> list[int] | None:
    """Where the bytes of ``tensors`` (loaded from ``path`` by ``torch.load(mmap=True)``, each
    a whole storage, stored uncompressed) start in the file, or ``None`` where that cannot be
    told for sure. Their zip records' data offsets are read from the local headers; torch maps
    the file whole, so every loaded storage must sit at the same distance from its record."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            records = []
            for info in archive.infolist():
                parts = info.filename.split("/")
                if len(parts) < 3 or parts[-2] != "data" or not parts[-1].isdigit():
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    return None
                fh.seek(info.header_offset)
                header = fh.read(30)
                if len(header) != 30 or header[:4] != b"PK\x03\x04":
                    return None
                name_length, extra_length = struct.unpack("<HH", header[26:30])
                start = info.header_offset + 30 + name_length + extra_length
                if start + info.file_size > size:
                    return None
                records.append((start, info.file_size))
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    if not records:
        return None
    storages = [t.untyped_storage() for t in tensors]
    if any(t.storage_offset() or not t.is_contiguous() for t in tensors):
        return None
    pointers = sorted({s.data_ptr(): s.nbytes() for s in storages}.items())
    if len(pointers) > len(records):
        return None
    base = None  # the address of the file's first byte in torch's mapping
    by_start = dict(records)
    for record_start, record_size in records:
        guess = pointers[0][0] - record_start
        if pointers[0][1] == record_size and all(
            by_start.get(pointer - guess) == nbytes for pointer, nbytes in pointers
        ):
            base = guess
            break
    if base is None:
        return None
    return [s.data_ptr() - base for s in storages]
