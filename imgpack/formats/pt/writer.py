"""The ``pt`` format: shards of tensors saved with ``torch.save``.

Each shard ``shard-NNNNN.pt`` loads with ``torch.load(path, mmap=True, weights_only=True)``:

- raw encoding: ``{"images": uint8 (n, H, W, C), "labels": int64 (n,), "paths": [str] * n}``
- encoded (original/png/jpeg): ``{"data": uint8 (total_bytes,), "offsets": int64 (n + 1,),
  "labels": int64 (n,), "paths": [str] * n}``; sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

``paths`` are the samples' source paths, relative to the source folder; ``crc32c`` (int64
``(n,)``) each sample's checksum (:mod:`imgpack.checksum`: CRC-32C of its stored bytes, then its
label as int64 little-endian, then its fields' bytes: :func:`imgpack.fields.fields_crc`);
``output_id`` (str) the output's id, also in the manifest: a reader refuses a shard of another
output.

An output with fields (:mod:`imgpack.fields`) has ``fields``: one dict per field, by name:
``values`` (int64 ``(n,)`` for ``int``, float32 ``(n,)`` for ``float``; for the others the values
one after another: uint8 bytes for ``str`` (UTF-8), ``bytes`` and ``json`` (its text), int64 or
float32 elements for ``int[]`` and ``float[]``) with ``offsets`` (int64 ``(n + 1,)``: sample
``i``'s are ``values[offsets[i]:offsets[i + 1]]``), and for an optional field ``present`` (bool
``(n,)``; an absent value is 0 or empty).

A shard is assembled in memory and saved when it reaches ``--shard-size`` (default 256 MiB), so
a conversion's memory is bounded by one shard per worker (each writes its own shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgpack.checksum import record_crc
from imgpack.fields import Field, fields_crc
from imgpack.formats.writer_base import HashedFile, ShardedWriter
from imgpack.images import Encoded


class PTWriter(ShardedWriter):
    def _start_shard(self, path: Path) -> None:
        self._path = path
        self._data = bytearray()
        self._offsets = [0]
        self._labels: list[int] = []
        self._paths: list[str] = []
        self._crcs: list[int] = []
        self._fields: list[list[Any]] = [[] for _ in self.config.fields]

    def _append(self, sample: Encoded) -> int:
        self._data += sample.payload
        self._offsets.append(len(self._data))
        self._labels.append(sample.label)
        self._paths.append(sample.path)
        crc = record_crc(sample.payload, sample.label)
        if self.config.fields:
            values = sample.fields or {}
            crc = fields_crc(crc, self.config.fields, values)
            for column, f in zip(self._fields, self.config.fields, strict=True):
                column.append(values.get(f.name))
        self._crcs.append(crc)
        return len(sample.payload)

    def _end_shard(self) -> str:
        data = torch.from_numpy(np.frombuffer(self._data, dtype=np.uint8))
        labels = torch.tensor(self._labels, dtype=torch.int64)
        common: dict[str, object] = {
            "labels": labels,
            "paths": self._paths,
            "crc32c": torch.tensor(self._crcs),
        }
        if self.config.output_id:
            common["output_id"] = self.config.output_id
        if self.config.fields:
            common["fields"] = {
                f.name: field_tensors(f, column)
                for f, column in zip(self.config.fields, self._fields, strict=True)
            }
        if self.config.encoding.name == "raw":
            height, width = self.config.policy.fixed_size or (0, 0)
            shape = (len(self._labels), height, width, self.config.policy.channels)
            payload = {"images": data.reshape(shape), **common}
        else:
            offsets = torch.tensor(self._offsets, dtype=torch.int64)
            payload = {"data": data, "offsets": offsets, **common}
        shard = HashedFile(self._path)
        try:
            torch.save(payload, shard)  # type: ignore[arg-type]  # a file-like object it writes
        finally:
            digest = shard.close()
        del data, payload
        self._data = bytearray()
        return digest


def field_tensors(found: Field, values: list[Any]) -> dict[str, torch.Tensor]:
    """One shard's column of field ``found`` (``values``: one per sample, ``None`` absent) as
    the layout above stores it."""
    out: dict[str, torch.Tensor] = {}
    if found.optional:
        out["present"] = torch.tensor([v is not None for v in values], dtype=torch.bool)
    if found.type in ("int", "float"):
        dtype = np.int64 if found.type == "int" else np.float32
        out["values"] = torch.from_numpy(np.array([v or 0 for v in values], dtype=dtype))
        return out
    if found.type in ("int[]", "float[]"):
        dtype = np.int64 if found.type == "int[]" else np.float32
        parts = [np.asarray(v, dtype) if v is not None else np.zeros(0, dtype) for v in values]
    else:
        parts = [
            np.frombuffer(found.encode(v), np.uint8) if v is not None else np.zeros(0, np.uint8)
            for v in values
        ]
    lengths = np.array([len(p) for p in parts], np.int64)
    out["offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    joined = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    out["values"] = torch.from_numpy(np.ascontiguousarray(joined))
    return out
