"""Writer of the ``webdataset`` format (layout in :mod:`imgpack.formats.webdataset.layout`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imgpack.checksum import record_crc
from imgpack.formats.webdataset import layout
from imgpack.formats.writer_base import HashedFile, ShardedWriter, WriterConfig
from imgpack.images import Encoded, Kind


class WebDatasetWriter(ShardedWriter):
    """Writes samples as WebDataset tar shards, each with its ``.idx`` beside it."""

    def __init__(self, directory: Path, config: WriterConfig) -> None:
        super().__init__(directory, config)
        self._fh: HashedFile | None = None
        self._offset = 0
        self._index: list[str] = []
        self._key = config.first_index  # 0 unless a part of a partitioned conversion

    def shard_name(self, index: int) -> str:
        return layout.shard_name(index)

    def _start_shard(self, path: Path) -> None:
        self._path = path
        self._fh = HashedFile(path)  # closed in _end_shard/_abort
        self._offset = 0
        self._index = []

    def _member(self, name: str, data: bytes) -> int:
        """Add one member (its header, its data, zeros to the next block); return the offset of
        its data in the tar."""
        assert self._fh is not None
        self._fh.write(layout.member_header(name, len(data)))
        self._fh.write(data)
        pad = -len(data) % layout.BLOCK
        if pad:
            self._fh.write(bytes(pad))
        offset = self._offset + layout.BLOCK
        self._offset = offset + len(data) + pad
        return offset

    def _append(self, sample: Encoded) -> int:
        start = self._offset
        key = layout.KEY_FORMAT % self._key
        self._key += 1
        payload = sample.payload
        if sample.kind is Kind.RAW:
            shape = (sample.height, sample.width, sample.channels)
            payload = layout.npy_header(shape) + payload
        ext = layout.extension(sample.kind, sample.path)
        offset = self._member(f"{key}.{ext}", payload)
        self._member(f"{key}.cls", str(sample.label).encode("ascii"))
        meta = {"class": self.config.class_name(sample.label), "path": sample.path}
        if self.config.output_id:
            meta["output_id"] = self.config.output_id
        self._member(f"{key}.json", json.dumps(meta, sort_keys=True).encode("ascii"))
        crc = record_crc(payload, sample.label)
        self._index.append(f"{offset} {len(payload)} {sample.label} {crc}\n")
        return self._offset - start

    def companions_of(self, shard: Path) -> list[Path]:
        return [layout.index_path(shard)]

    def resume(self, state: dict[str, Any]) -> int:
        already = super().resume(state)
        self._key = self.config.first_index + self.durable
        return already

    def _end_shard(self) -> str:
        assert self._fh is not None
        end = self._offset + 2 * layout.BLOCK  # two zero blocks end the archive
        self._fh.write(bytes(2 * layout.BLOCK + -end % layout.RECORD))
        digest = self._fh.close()
        self._fh = None
        layout.index_path(self._path).write_text("".join(self._index), encoding="ascii")
        return digest

    def _abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
