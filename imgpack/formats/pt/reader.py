"""Reader of the ``pt`` format (layout in ``docs/formats/pt.md`` and :mod:`imgpack.formats.pt.writer`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from imgpack.errors import DataError
from imgpack.formats.batch import Images, label_tensor
from imgpack.formats.dataset_base import (
    ImageDataset,
    Record,
    check_file_order,
    check_labels,
    check_offsets,
    joined_paths,
    new_batch_tensor,
)
from imgpack.formats.gather import shard_runs, take_rows, void_rows
from imgpack.formats.pt.loading import load_shard
from imgpack.formats.writer_base import default_shard_name

if TYPE_CHECKING:
    pass


class PTDataset(ImageDataset):
    """Dataset over a ``pt`` output. Shards are memory-mapped with ``torch.load(path,
    mmap=True)`` through an unpickler restricted to a shard's globals
    (:func:`~imgpack.formats.pt.loading.load_shard`) on first use in each process; a raw batch
    is one numpy gather per shard it touches (never a parallel torch op: a forked process
    reads on)."""

    lazy_files = True
    reads_fields = True

    format = "pt"

    def _prepare(self) -> None:
        check_file_order(self.root, self.manifest, lambda k, _: default_shard_name(self.format, k))
        self._count_shards([f.num_samples for f in self.manifest.files])
        self._raw = self.manifest.encoding == "raw"

    def memory_mapped(self) -> bool:
        return self._raw

    def _open(self) -> PTShards:
        return PTShards([None] * len(self.manifest.files))

    def _close(self, handles: Any) -> None:
        handles.loaded[:] = [None] * len(handles.loaded)

    def _release_file(self, name: str) -> None:
        shards = self.handles.loaded
        for number, entry in enumerate(self.manifest.files):
            if entry.path == name:
                shards[number] = None  # its tensors go when the last batch using them does
                self._here().maps.forget(number)

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
            shard = load_shard(path)
        except Exception as exc:
            raise DataError(f"{path}: cannot load shard: {exc}") from None
        self._here().maps.note(number, path)
        n = entry.num_samples
        if isinstance(shard, dict):
            self._check_output(shard.get("output_id"), str(path), number)
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
        if problem is None and self.manifest.fields:
            problem = self._check_fields(shard.get("fields"), n)
            if problem is None:
                shard["_fields"] = self.__dict__.pop("_columns_found")
        if problem:
            raise DataError(f"{path}: damaged shard: {problem}")
        return shard

    def _check_fields(self, found: Any, n: int) -> str | None:
        """What is wrong with a shard's ``fields`` (``n`` samples), or ``None``; sets each
        column's numpy views aside (values, offsets, present, per field) for :meth:`_load`."""
        if not isinstance(found, dict):
            return "no fields, and the manifest lists some"
        columns: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        for f in self.manifest.fields:
            column = found.get(f.name)
            if not isinstance(column, dict) or not isinstance(column.get("values"), torch.Tensor):
                return f"no values of the field {f.name!r}"
            values = column["values"].numpy()
            want = FIELD_DTYPES[f.type]
            if values.dtype != want or values.ndim != 1:
                return f"field {f.name!r}: values should be 1-D {want}, found {values.dtype}"
            offsets = column.get("offsets")
            if f.type in ("int", "float"):
                if len(values) != n:
                    return f"field {f.name!r}: {len(values)} values, expected {n}"
                offsets = None
            else:
                if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64:
                    return f"field {f.name!r}: no int64 offsets"
                offsets = offsets.numpy()
                problem = check_offsets(offsets, n, len(values))
                if problem:
                    return f"field {f.name!r}: {problem}"
            present = column.get("present")
            if f.optional:
                if not isinstance(present, torch.Tensor) or tuple(present.shape) != (n,):
                    return f"field {f.name!r}: no presence column of {n} samples"
                present = present.numpy().astype(bool)
            else:
                present = None
            columns.append((values, offsets, present))
        self._columns_found = columns
        return None

    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        out: list[list[bytes | None]] = [[] for _ in self.manifest.fields]
        shard_of = self._shard_of(indices)
        local = (indices - self._starts[shard_of]).tolist()
        for number, i in zip(shard_of.tolist(), local, strict=True):
            for column, data in zip(out, self._field_bytes(number, i), strict=True):
                column.append(data)
        return out

    def _field_bytes(self, number: int, i: int) -> list[bytes | None]:
        """The stored bytes of row ``i`` of shard ``number``'s fields, in the manifest's
        order (``None``: absent)."""
        found: list[bytes | None] = []
        for values, offsets, present in self._shard_fields(number):
            if present is not None and not present[i]:
                found.append(None)
            elif offsets is None:
                found.append(values[i : i + 1].tobytes())
            else:
                found.append(values[offsets[i] : offsets[i + 1]].tobytes())
        return found

    def _shard_fields(
        self, number: int
    ) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
        found: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]
        found = self._shard(number)["_fields"]
        return found

    def _load_targets(self) -> list[int]:
        return [t for i in range(len(self.manifest.files)) for t in self._shard_targets(i)]

    def _shard_targets(self, number: int) -> list[int]:
        labels: list[int] = self._shard(number)["labels"].tolist()
        return labels

    def _load_paths(self) -> list[str] | None:
        return joined_paths([self._shard_paths(i) for i in range(len(self.manifest.files))])

    def _shard_paths(self, number: int) -> list[str] | None:
        shard = self._shard(number)
        return [str(p) for p in shard["paths"]] if "paths" in shard else None

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        shard_of = self._shard_of(indices)
        local = (indices - self._starts[shard_of]).tolist()
        for index, number, i in zip(indices.tolist(), shard_of.tolist(), local, strict=True):
            data, offsets, labels, crcs, where = self._columns(number)
            payload = data[i] if self._raw else data[offsets[i] : offsets[i + 1]]
            crc = int(crcs[i]) if crcs is not None else None
            fields = self._field_bytes(number, i) if self.manifest.fields else None
            yield Record(index, payload.data, int(labels[i]), crc, where, fields)

    def _one(self, index: int) -> tuple[memoryview, int, str]:
        number, i = self._locate(index)
        data, offsets, labels, crcs, where = self._columns(number)
        payload = data[offsets[i] : offsets[i + 1]].data
        label = int(labels[i])
        if self.verify and crcs is not None:
            fields = self._field_bytes(number, i) if self.manifest.fields else None
            self.checks.record(self, index, payload, label, int(crcs[i]), where, fields)
        return payload, label, f"{where}: sample {index}"

    def stored_sizes(self, chunk: int = 4096) -> np.ndarray:
        if self._raw:
            return super().stored_sizes(chunk)
        parts = [self._shard_sizes(k) for k in range(len(self.manifest.files))]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _shard_sizes(self, number: int) -> np.ndarray:
        if self._raw:
            return super()._shard_sizes(number)
        return np.diff(self._columns(number)[1]).astype(np.int64)

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
            if self.checks.unchecked(indices):  # the first read of these records (or verify=True)
                rows = out.numpy().reshape(len(indices), -1)
                crcs = self._raw_crcs(shard_of, local)
                self.checks.gathered(self, indices, rows, labels.numpy(), crcs)
            return out.permute(0, 3, 1, 2), labels
        records = self._records(indices)
        if self.verify:
            records = self.checks.records(self, records)
        batch = list(records)
        images = self._decode(
            [r.payload for r in batch],
            lambda k: f"{batch[k].where}: sample {batch[k].index}",
        )
        return images, label_tensor([r.label for r in batch])

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self.manifest.fields:
            return None  # the checksums cover the fields too: checked record by record
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
        # Each shard's rows put in their places with one numpy assignment, rows as single
        # items (void_rows: a memcpy each), no scratch batch, no second pass.
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
        take_rows(self._arrays(number)[0], local, out)
        return out, torch.from_numpy(self._arrays(number)[1][local])

    def _batch(self, count: int) -> torch.Tensor:
        image = self.manifest.image
        return new_batch_tensor((count, image["height"], image["width"], self.channels))


#: The dtype of each field type's stored values in a shard.
FIELD_DTYPES = {
    "int": np.dtype(np.int64),
    "float": np.dtype(np.float32),
    "int[]": np.dtype(np.int64),
    "float[]": np.dtype(np.float32),
    "str": np.dtype(np.uint8),
    "bytes": np.dtype(np.uint8),
    "json": np.dtype(np.uint8),
}


@dataclass
class PTShards:
    """A :class:`PTDataset`'s handles in one process: its shards, loaded on first use."""

    loaded: list[dict[str, Any] | None]
