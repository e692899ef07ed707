"""The ``pt`` format: shards of tensors saved with ``torch.save``.

Each shard ``shard-NNNNN.pt`` loads with ``torch.load(path, mmap=True, weights_only=True)``:

- raw encoding: ``{"images": uint8 (n, H, W, C), "labels": int64 (n,), "paths": [str] * n}``
- encoded (original/png/jpeg): ``{"data": uint8 (total_bytes,), "offsets": int64 (n + 1,),
  "labels": int64 (n,), "paths": [str] * n}``; sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.

``paths`` are the samples' source paths, relative to the source folder; ``crc32c`` (int64
``(n,)``) each sample's checksum (:mod:`imgpack.checksum`: CRC-32C of its stored bytes, then its
label as int64 little-endian); ``output_id`` (str) the output's id, also in the manifest: a reader
refuses a shard of another output.

A shard is assembled in memory and saved when it reaches ``--shard-size`` (default 1 GiB), so
conversion memory is bounded by one shard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from imgpack.checksum import record_crc
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

    def _append(self, sample: Encoded) -> int:
        self._data += sample.payload
        self._offsets.append(len(self._data))
        self._labels.append(sample.label)
        self._paths.append(sample.path)
        self._crcs.append(record_crc(sample.payload, sample.label))
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

    def shard_samples(self, path: Path) -> int | None:
        try:
            shard = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            return len(shard["labels"])
        except Exception:
            return -1
