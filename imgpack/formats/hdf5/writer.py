"""The ``hdf5`` format: one ``data.h5`` with the whole dataset in a few datasets.

Layout (``docs/formats/hdf5.md``):

- raw encoding: ``images`` uint8 ``(N, H, W, C)``;
- encoded: ``data`` uint8 ``(total_bytes,)`` and ``offsets`` int64 ``(N + 1,)``, sample ``i``
  being ``data[offsets[i]:offsets[i + 1]]``;
- always ``labels`` int64 ``(N,)``, ``filenames`` (UTF-8 strings, paths relative to SRC) and
  ``crc32c`` uint32 ``(N,)``, each sample's checksum (:mod:`imgpack.checksum`);
- root attributes ``imgpack`` (schema version), ``classes``, ``encoding``, ``height``, ``width``,
  ``channels``;
- an output with fields (:mod:`imgpack.fields`): a group ``fields`` with a group per field, by
  name, holding ``values`` (``(N,)``: int64 for ``int``, float32 for ``float``, variable-length
  UTF-8 strings for ``str`` and ``json`` (its compact text), variable-length uint8 for ``bytes``,
  variable-length int64 or float32 for ``int[]`` and ``float[]``) and, for an optional field,
  ``present`` (bool ``(N,)``; an absent value is 0 or empty).

Uncompressed datasets are contiguous, so the reader can memory-map them. A contiguous dataset
needs its final size when it is created, which is known only at the end (skipped files, encoded
sizes): the image bytes are streamed to a staging file beside ``data.h5`` and copied in, block by
block, at the end. Memory stays bounded; the image bytes are written twice. Every
:data:`BLOCK_RECORDS` samples (or :data:`BLOCK_BYTES`) the staging file and a journal of the
samples' labels, sizes, checksums and paths are flushed: an interrupted conversion resumes from
the last such block.

An append (``convert --append``) stages the output's own records first (:meth:`HDF5Writer.seed`),
checked against their checksums as they are read, then the new ones: ``data.h5`` is written whole
again, its old records' bytes as they were.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from imgpack.checksum import record_crc
from imgpack.errors import DataError
from imgpack.fields import Field, extend_crc, stored_values
from imgpack.formats.writer_base import Writer, WriterConfig, WrittenFile
from imgpack.images import Encoded
from imgpack.manifest import SCHEMA_VERSION

#: Bytes copied from the staging file per HDF5 write at the end.
COPY_BLOCK = 64 << 20
#: Target bytes per chunk when compression makes the datasets chunked.
DEFAULT_CHUNK = 1 << 20
#: A checkpoint every this many samples, or bytes, whichever comes first.
BLOCK_RECORDS = 1000
BLOCK_BYTES = 64 << 20


class HDF5Writer(Writer):
    def __init__(self, directory: Path, config: WriterConfig) -> None:
        super().__init__(directory, config)
        self.compression = self.settings["compression"]
        self.chunk_bytes = int(self.settings["chunk_size"])
        # "earliest" keeps the file readable by HDF5 1.10 tools (Debian's h5dump, h5ls).
        latest = self.settings["libver"] == "latest"
        self.libver = ("latest", "latest") if latest else ("earliest", "v110")
        self._staging_path = directory / ".data.staging"
        # Append mode: a resumed conversion continues the files an interrupted one left.
        self._staging = open(self._staging_path, "ab")  # noqa: SIM115 - closed in _finish/_abort
        self._journal = open(directory / ".data.journal", "ab")  # noqa: SIM115 - likewise
        self._labels: list[int] = []
        self._filenames: list[str] = []
        self._crcs: list[int] = []
        #: Each sample's fields' stored bytes (``None``: absent), in the manifest's order.
        self._fields: list[list[bytes | None]] = []
        self._offsets = [0]
        self._block_start = self._offsets[-1]
        #: Samples journaled (the last block's end), and of them the output's own before an
        #: append's (:meth:`seed`); :attr:`durable` counts the others.
        self._journaled = 0
        self._base = 0

    @classmethod
    def seed(
        cls, directory: Path, config: WriterConfig, previous: Path, samples: Iterable[Encoded]
    ) -> dict[str, Any]:
        """The output's own samples staged and journaled, as the first block of this one."""
        writer = cls(directory, config)
        try:
            for sample in samples:
                writer.add(sample)
            writer._end_block()
            writer._base, writer.durable = writer._journaled, 0
            return writer.checkpoint_state()
        finally:
            writer._abort()

    def add(self, sample: Encoded) -> None:
        self._staging.write(sample.payload)
        self._offsets.append(self._offsets[-1] + len(sample.payload))
        self._labels.append(sample.label)
        self._filenames.append(sample.path)
        crc = record_crc(sample.payload, sample.label)
        if self.config.fields:
            stored = stored_values(self.config.fields, sample.fields or {})
            crc = extend_crc(crc, stored)
            self._fields.append(stored)
        self._crcs.append(crc)
        pending = len(self._labels) - self._journaled
        if pending >= BLOCK_RECORDS or self._offsets[-1] - self._block_start >= BLOCK_BYTES:
            self._end_block()

    def _end_block(self) -> None:
        """Flush the staged bytes and journal the block's samples: a checkpoint."""
        lines = [
            json.dumps(
                [
                    self._labels[i],
                    self._offsets[i + 1] - self._offsets[i],
                    self._crcs[i],
                    self._filenames[i],
                    *([_journaled(self._fields[i])] if self.config.fields else []),
                ]
            )
            + "\n"
            for i in range(self._journaled, len(self._labels))
        ]
        self._staging.flush()
        self._journal.write("".join(lines).encode("utf-8", "surrogateescape"))
        self._journal.flush()
        self._journaled = len(self._labels)
        self.durable = self._journaled - self._base
        self._block_start = self._offsets[-1]

    def checkpoint_state(self) -> dict[str, Any]:
        state = {
            "records": self.durable,
            "staging_bytes": self._offsets[self._journaled],
            "journal_bytes": self._journal.tell(),
        }
        return {**state, "base": self._base} if self._base else state

    def resume(self, state: dict[str, Any]) -> int:
        """Cut the staging file and the journal back to the checkpoint; reload the journal and
        check every staged record against its journaled checksum (what is kept is checked as
        a merge checks what it copies). A checkpoint or journal that does not describe the
        staged bytes is refused."""
        bad = f"{self.directory}: damaged checkpoint or journal; convert again without --resume"
        state = {"base": 0, **state}
        keys = ("records", "staging_bytes", "journal_bytes", "base")
        if not all(type(state.get(k)) is int and state[k] >= 0 for k in keys):
            raise DataError(bad)
        staging, journal = self._staging_path, self.directory / ".data.journal"
        if (
            state["staging_bytes"] > staging.stat().st_size
            or state["journal_bytes"] > journal.stat().st_size
        ):
            raise DataError(f"{bad} (it points past the end of the staged files)")
        self._staging.truncate(state["staging_bytes"])
        self._journal.truncate(state["journal_bytes"])
        with open(journal, "rb") as fh, open(staging, "rb") as data:
            for line in fh.read().decode("utf-8", "surrogateescape").splitlines():
                try:
                    label, size, crc, path, *rest = json.loads(line)
                    stored = _from_journal(rest, len(self.config.fields))
                except (ValueError, TypeError, binascii.Error):
                    raise DataError(bad) from None
                if not (
                    all(type(v) is int for v in (label, size, crc))
                    and 0 <= size <= state["staging_bytes"]
                    and isinstance(path, str)
                ):
                    raise DataError(bad)
                payload = data.read(size)
                found = record_crc(payload, label) if len(payload) == size else None
                if found is not None and self.config.fields:
                    found = extend_crc(found, stored)
                if found != crc:
                    raise DataError(
                        f"{staging}: staged record {len(self._labels)} does not match its "
                        "checksum; convert again without --resume"
                    )
                self._labels.append(label)
                self._offsets.append(self._offsets[-1] + size)
                self._crcs.append(crc)
                self._filenames.append(path)
                if self.config.fields:
                    self._fields.append(stored)
        journaled = state["base"] + state["records"]
        if len(self._labels) != journaled or self._offsets[-1] != state["staging_bytes"]:
            raise DataError(f"{self.directory}: the journal does not match its checkpoint")
        self._base, self._journaled = state["base"], journaled
        self.durable = state["records"]
        self._block_start = self._offsets[-1]
        return 0

    def _dataset_options(self, shape: tuple[int, ...]) -> dict[str, Any]:
        options: dict[str, Any] = {"track_times": False}  # no timestamps: same input, same bytes
        if self.compression != "none":
            row = int(np.prod(shape[1:], dtype=np.int64)) or 1
            rows = max(1, min(shape[0], self.chunk_bytes // row)) if shape[0] else 1
            options.update(chunks=(rows, *shape[1:]), compression=self.compression)
            if self.compression == "gzip":
                options["shuffle"] = False
        return options

    def _finish(self) -> list[WrittenFile]:
        self._staging.close()
        self._journal.close()
        count = len(self._labels)
        total = self._offsets[-1]
        policy = self.config.policy
        path = self.directory / "data.h5"
        with h5py.File(path, "w", libver=self.libver, track_order=False) as f:
            f.attrs["imgpack"] = SCHEMA_VERSION
            f.attrs["classes"] = np.array(self.config.classes, dtype=h5py.string_dtype())
            f.attrs["encoding"] = self.config.encoding.name
            height, width = policy.fixed_size or (0, 0)
            f.attrs["height"], f.attrs["width"] = height, width
            f.attrs["channels"] = policy.channels
            if self.config.output_id:
                f.attrs["output_id"] = self.config.output_id
            if self.config.encoding.name == "raw":
                shape: tuple[int, ...] = (count, height, width, policy.channels)
                target = f.create_dataset("images", shape, np.uint8, **self._dataset_options(shape))
            else:
                shape = (total,)
                target = f.create_dataset("data", shape, np.uint8, **self._dataset_options(shape))
                f.create_dataset(
                    "offsets", data=np.asarray(self._offsets, np.int64), track_times=False
                )
            self._copy_staging(target, count, total)
            f.create_dataset("labels", data=np.asarray(self._labels, np.int64), track_times=False)
            f.create_dataset("crc32c", data=np.asarray(self._crcs, np.uint32), track_times=False)
            f.create_dataset(
                "filenames",
                data=np.array(self._filenames, dtype=h5py.string_dtype()),
                track_times=False,
            )
            if self.config.fields:
                group = f.create_group("fields", track_order=True)
                for k, found in enumerate(self.config.fields):
                    column = [stored[k] for stored in self._fields]
                    write_field(group.create_group(found.name), found, column)
        os.unlink(self._staging_path)
        os.unlink(self.directory / ".data.journal")
        return [WrittenFile("data.h5", count)]

    def _copy_staging(self, target: h5py.Dataset, count: int, total: int) -> None:
        """Copy the staged bytes into ``target`` a block at a time (bounded memory)."""
        staged = np.memmap(self._staging_path, np.uint8, "r") if total else np.empty(0, np.uint8)
        if target.ndim == 1:
            for start in range(0, total, COPY_BLOCK):
                stop = min(total, start + COPY_BLOCK)
                target[start:stop] = staged[start:stop]
        else:
            row = int(np.prod(target.shape[1:]))
            rows = staged.reshape(count, *target.shape[1:]) if count else staged
            step = max(1, COPY_BLOCK // max(row, 1))
            for start in range(0, count, step):
                stop = min(count, start + step)
                target[start:stop] = rows[start:stop]
        del staged

    def _abort(self) -> None:
        self._staging.close()
        self._journal.close()


#: The element dtype of each field type's variable-length values.
_ELEMENTS = {"bytes": np.uint8, "int[]": np.int64, "float[]": np.float32}


def write_field(group: Any, found: Field, column: list[bytes | None]) -> None:
    """One field's datasets in ``group`` from its stored bytes per sample (``None``: absent)."""
    if found.optional:
        present = np.array([v is not None for v in column], bool)
        group.create_dataset("present", data=present, track_times=False)
    if found.type in ("int", "float"):
        dtype = np.dtype("<i8" if found.type == "int" else "<f4")
        values = np.zeros(len(column), dtype)
        for i, data in enumerate(column):
            if data is not None:
                values[i] = np.frombuffer(data, dtype)[0]
        group.create_dataset("values", data=values, track_times=False)
        return
    if found.type in ("str", "json"):
        text = [b"" if data is None else data for data in column]
        kind = h5py.string_dtype("utf-8")
        group.create_dataset("values", data=np.array(text, dtype=kind), track_times=False)
        return
    element = np.dtype(_ELEMENTS[found.type])
    kind = h5py.vlen_dtype(element)
    values = np.empty(len(column), dtype=kind)
    for i, data in enumerate(column):
        values[i] = np.frombuffer(data or b"", element.newbyteorder("<")).astype(element)
    group.create_dataset("values", data=values, track_times=False)


def _journaled(stored: list[bytes | None]) -> list[str | None]:
    return [None if data is None else base64.b64encode(data).decode("ascii") for data in stored]


def _from_journal(rest: list[Any], count: int) -> list[bytes | None]:
    if not count:
        if rest:
            raise ValueError("fields in a journal of an output without")
        return []
    (found,) = rest
    if not isinstance(found, list) or len(found) != count:
        raise ValueError("not the output's fields")
    return [None if v is None else base64.b64decode(v, validate=True) for v in found]
