"""Reader of the ``hdf5`` format (layout in ``docs/formats/hdf5.md``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from imgpack.errors import DataError
from imgpack.fields import Field
from imgpack.formats.batch import Images
from imgpack.formats.dataset_base import (
    ImageDataset,
    Opened,
    ReadKeywords,
    ReadOptions,
    Record,
    check_labels,
    check_offsets,
    new_batch_tensor,
)
from imgpack.formats.gather import take_rows

if TYPE_CHECKING:
    from typing_extensions import Unpack


#: HDF5 chunk cache per open file on the chunked path (h5py's default is 1 MiB).
CHUNK_CACHE_BYTES = 64 << 20


def _refuse_outside_storage(f: Any, path: Any) -> None:
    """Refuse datasets whose bytes live outside the file: HDF5 external storage (raw bytes of
    any file the dataset names) and virtual datasets (mapped from other HDF5 files), anywhere
    in it (the fields' groups too). A hostile ``data.h5`` could otherwise hand out the bytes of
    an outside file as pixels or values."""
    found: list[tuple[str, Any]] = []
    f.visititems(
        lambda name, item: found.append((name, item)) if hasattr(item, "is_virtual") else None
    )
    for name, item in found:
        if item.is_virtual:
            raise DataError(
                f"{path}: dataset {name!r} is a virtual dataset (its data lives in other files); "
                "refused: an output's data must be inside it"
            )
        if item.external:
            raise DataError(
                f"{path}: dataset {name!r} uses external storage "
                f"({str(item.external[0][0])!r}); refused: an output's data "
                "must be inside it"
            )


class HDF5Dataset(ImageDataset):
    """Dataset over an ``hdf5`` output.

    Uncompressed datasets are contiguous: their bytes sit at a fixed offset in ``data.h5``
    (``Dataset.id.get_offset()``), which the reader memory-maps (read-only, copy-on-write) and
    gathers from in one numpy gather. Chunked or compressed datasets are read through h5py,
    a batch at a time in as few HDF5 calls as possible (sorted unique indices, contiguous runs),
    then put back in the requested order. ``mmap=False`` forces the h5py path.

    h5py handles are opened lazily in the reading process (never shared across a fork).
    """

    format = "hdf5"
    reads_fields = True

    def __init__(
        self,
        opened: Opened | str | os.PathLike[str],
        options: ReadOptions | None = None,
        *,
        mmap: bool = True,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        super().__init__(opened, options, **keywords)
        import h5py

        self.path = self.root / "data.h5"
        self._raw = self.manifest.encoding == "raw"
        self._name = "images" if self._raw else "data"
        # Read the layout once and let the file go: only paths cross into workers.
        try:
            with h5py.File(self.path, "r") as f:
                self._check_output(f.attrs.get("output_id"), str(self.path))
                _refuse_outside_storage(f, self.path)
                dset = f[self._name]
                self._shape = tuple(int(v) for v in dset.shape)
                offset = dset.id.get_offset()
                contiguous = dset.chunks is None and dset.compression is None
                self._offset = int(offset) if contiguous and offset is not None else None
                self._labels = np.asarray(f["labels"][...], dtype=np.int64)
                self._offsets = None if self._raw else np.asarray(f["offsets"][...], dtype=np.int64)
                crcs = f.get("crc32c")
                self._crcs = None if crcs is None else np.asarray(crcs[...], dtype=np.int64)
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise DataError(f"{self.path}: cannot read the HDF5 layout: {exc}") from None
        self._check_layout()
        self.mmap = bool(mmap) and (self._offset is not None or self._shape[0] == 0)
        if self._offset is not None:
            end = self._offset + int(np.prod(self._shape))
            if end > self.path.stat().st_size:
                raise DataError(f"{self.path}: damaged file: {self._name} runs past its end")

    def _check_layout(self) -> None:
        n = len(self)
        problem = check_labels(self._labels, n, len(self.classes))
        if problem is None and self._raw:
            image = self.manifest.image
            expected = (n, image["height"], image["width"], self.channels)
            if self._shape != expected:
                problem = f"images has shape {self._shape}, expected {expected}"
        elif problem is None:
            assert self._offsets is not None
            problem = check_offsets(self._offsets, n, self._shape[0])
        if problem is None and self._crcs is not None and self._crcs.shape != (n,):
            problem = f"crc32c has shape {self._crcs.shape}, expected ({n},)"
        if problem:
            raise DataError(f"{self.path}: damaged file: {problem}")

    def memory_mapped(self) -> bool:
        return self._raw and self.mmap

    def _open(self) -> Any:
        if self.mmap:
            nbytes = int(np.prod(self._shape))
            if nbytes == 0:
                return torch.empty(self._shape, dtype=torch.uint8)
            assert self._offset is not None
            # MAP_PRIVATE mapping of the file: pages load on first touch and are never written.
            try:
                whole = torch.from_file(
                    str(self.path), shared=False, size=self._offset + nbytes, dtype=torch.uint8
                )
            except RuntimeError:  # shorter than the mapping: replaced (said first), or cut
                self._check_open_output()
                raise DataError(
                    f"{self.path}: shorter than the {self._offset + nbytes} bytes its images "
                    "need (the file is damaged)"
                ) from None
            # Checked after mapping: a file replaced before the mapping has another id.
            self._check_open_output()
            self._here().maps.note(0, self.path)
            return whole[self._offset :].view(self._shape)
        import h5py

        try:
            handle = h5py.File(self.path, "r", rdcc_nbytes=CHUNK_CACHE_BYTES, rdcc_nslots=100_003)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot open: {exc}") from None
        try:
            self._check_output(handle.attrs.get("output_id"), str(self.path))
        except DataError:
            handle.close()
            raise
        return handle

    def _check_open_output(self) -> None:
        import h5py

        try:
            with h5py.File(self.path, "r") as f:
                found = f.attrs.get("output_id")
        except OSError as exc:
            raise DataError(f"{self.path}: cannot open: {exc}") from None
        self._check_output(found, str(self.path))

    def _close(self, handles: Any) -> None:
        if not isinstance(handles, torch.Tensor):
            handles.close()

    def _load_targets(self) -> list[int]:
        return self._labels.tolist()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_field_columns", None)  # read again where it is needed
        return state

    @property
    def _columns(self) -> list[tuple[list[bytes], np.ndarray | None]]:
        """Each field's stored bytes per sample and its presence (``None``: every sample has
        it), read whole from ``fields/`` the first time they are needed (and kept)."""
        found = self.__dict__.get("_field_columns")
        if found is None:
            found = self.__dict__["_field_columns"] = self._read_fields()
        return found

    def _read_fields(self) -> list[tuple[list[bytes], np.ndarray | None]]:
        import h5py

        columns: list[tuple[list[bytes], np.ndarray | None]] = []
        n = len(self)
        try:
            with h5py.File(self.path, "r") as f:
                for found in self.manifest.fields:
                    group = f["fields"][found.name]
                    values = group["values"]
                    if values.shape != (n,):
                        raise ValueError(f"field {found.name!r} has {values.shape[0]} values")
                    present = None
                    if found.optional:
                        present = np.asarray(group["present"][...], bool)
                        if present.shape != (n,):
                            raise ValueError(f"field {found.name!r}: presence of another length")
                    columns.append((_stored(found, values[...]), present))
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise DataError(f"{self.path}: cannot read the fields: {exc}") from None
        return columns

    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        out: list[list[bytes | None]] = []
        for stored, present in self._columns:
            if present is None:
                out.append([stored[i] for i in indices.tolist()])
            else:
                out.append([stored[i] if present[i] else None for i in indices.tolist()])
        return out

    def _field_bytes(self, index: int) -> list[bytes | None] | None:
        """Sample ``index``'s fields' stored bytes (``None``: an output without fields)."""
        if not self.manifest.fields:
            return None
        return [column[0] for column in self._stored_fields(np.array([index], np.int64))]

    def _load_paths(self) -> list[str] | None:
        import h5py

        try:
            with h5py.File(self.path, "r") as f:
                if "filenames" not in f:
                    return None
                names = f["filenames"].asstr()[...]
        except (OSError, KeyError, ValueError) as exc:
            raise DataError(f"{self.path}: cannot read the filenames: {exc}") from None
        if len(names) != len(self):
            raise DataError(
                f"{self.path}: filenames lists {len(names)} samples, expected {len(self)}"
            )
        return [str(name) for name in names]

    # -- reading ----------------------------------------------------------------------------
    def _read_rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows of the h5py dataset at ``indices`` (any order, repeats allowed), in that order."""
        dset = self.handles[self._name]
        unique, inverse = np.unique(indices, return_inverse=True)
        out = np.empty((len(unique), *self._shape[1:]), dtype=np.uint8)
        # Split the sorted unique indices into runs of consecutive rows: one HDF5 read per run.
        breaks = np.flatnonzero(np.diff(unique) != 1) + 1
        start = 0
        try:
            for run in np.split(unique, breaks):
                dset.read_direct(
                    out, np.s_[int(run[0]) : int(run[-1]) + 1], np.s_[start : start + len(run)]
                )
                start += len(run)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot read rows {run[0]}..{run[-1]}: {exc}") from None
        return out[inverse.reshape(-1)]

    def _payloads(self, indices: np.ndarray) -> list[Any]:
        """The stored bytes of ``indices``, in that order."""
        if self._raw:
            if self.mmap:
                return [self.handles[i].numpy().data for i in indices.tolist()]
            return [row.data for row in self._read_rows(indices)]
        assert self._offsets is not None
        starts, ends = self._offsets[indices], self._offsets[indices + 1]
        if self.mmap:
            data = self.handles
            return [
                data[a:b].numpy().data for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
            ]
        return self._read_spans(starts, ends)

    def _one(self, index: int) -> tuple[Any, int, str]:
        if not self.mmap or self._offsets is None:
            return super()._one(index)
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        payload = self.handles[start:end].numpy().data
        label, where = int(self._labels[index]), str(self.path)
        if self.verify and self._crcs is not None:
            fields = self._field_bytes(index)
            self.checks.record(self, index, payload, label, int(self._crcs[index]), where, fields)
        return payload, label, f"{where}: sample {index}"

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        payloads = self._payloads(indices)
        fields = self._stored_fields(indices) if self.manifest.fields else None
        for k, index in enumerate(indices.tolist()):
            crc = None if self._crcs is None else int(self._crcs[index])
            found = [column[k] for column in fields] if fields is not None else None
            yield Record(index, payloads[k], int(self._labels[index]), crc, str(self.path), found)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        labels = torch.from_numpy(self._labels[indices])
        if self._raw:
            if self.mmap:
                out = new_batch_tensor((len(indices), *self._shape[1:]))
                take_rows(self.handles, indices, out)
            else:
                out = torch.from_numpy(self._read_rows(indices))
            if self.checks.unchecked(indices):  # the first read of these records (or verify=True)
                crcs = self._crcs[indices] if self._crcs is not None else None
                rows = out.numpy().reshape(len(indices), -1)
                self.checks.gathered(self, indices, rows, labels.numpy(), crcs)
            return out.permute(0, 3, 1, 2), labels
        if self.verify:
            payloads = [r.payload for r in self.checks.records(self, self._records(indices))]
        else:
            payloads = self._payloads(indices)
        images = self._decode(payloads, lambda k: f"{self.path}: sample {indices[k]}")
        return images, labels

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self._crcs is None or self.manifest.fields:
            return None  # none stored, or they cover the fields too: checked record by record
        if self.mmap:
            pixels = np.empty((len(indices), *self._shape[1:]), np.uint8)
            take_rows(self.handles, indices, pixels)
        else:
            pixels = self._read_rows(indices)
        return pixels.reshape(len(indices), -1), self._labels[indices], self._crcs[indices]

    def _read_spans(self, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
        """Byte spans of the chunked ``data`` dataset: adjacent samples are read in one call."""
        dset = self.handles["data"]
        out: list[bytes] = [b""] * len(starts)
        run: list[int] = []
        run_end = 0

        def flush() -> None:
            lo = int(starts[run[0]])
            block = dset[lo:run_end].tobytes()
            for k in run:
                out[k] = block[int(starts[k]) - lo : int(ends[k]) - lo]

        # Samples in file order; a gap between them starts a new read.
        for k in np.argsort(starts, kind="stable").tolist():
            if run and starts[k] > run_end:
                flush()
                run = []
            run_end = max(run_end, int(ends[k])) if run else int(ends[k])
            run.append(k)
        if run:
            flush()
        return out


def _stored(found: Field, values: np.ndarray) -> list[bytes]:
    """A field's ``values`` dataset, read, as each sample's stored bytes (absent: empty)."""
    if found.type in ("int", "float"):
        dtype = "<i8" if found.type == "int" else "<f4"
        return [v.tobytes() for v in np.asarray(values).astype(dtype)]
    if found.type in ("str", "json"):
        return [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
    dtype = {"bytes": "u1", "int[]": "<i8", "float[]": "<f4"}[found.type]
    return [np.asarray(v).astype(dtype).tobytes() for v in values]
