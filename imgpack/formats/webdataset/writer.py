"""Writer of the ``webdataset`` format (layout in :mod:`imgpack.formats.webdataset.layout`)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

from imgpack.checksum import record_crc
from imgpack.formats.webdataset import layout
from imgpack.formats.writer_base import ShardedWriter, WriterConfig
from imgpack.images import Encoded, Kind


class WebDatasetWriter(ShardedWriter):
    """Writes samples as WebDataset tar shards, each with its ``.idx`` beside it."""

    def __init__(self, directory: Path, config: WriterConfig) -> None:
        super().__init__(directory, config)
        self._tar: tarfile.TarFile | None = None
        self._index: list[str] = []
        self._key = config.first_index  # 0 unless a part of a partitioned conversion

    def shard_name(self, index: int) -> str:
        return layout.shard_name(index)

    def _start_shard(self, path: Path) -> None:
        self._path = path
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self._index = []

    def _member(self, name: str, data: bytes) -> int:
        """Add one member; return the offset of its data in the tar."""
        assert self._tar is not None
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o444
        info.mtime = 0
        self._tar.addfile(info, io.BytesIO(data))
        # addfile leaves the offset past the data and its padding to the next 512-byte block.
        return self._tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    def _append(self, sample: Encoded) -> int:
        assert self._tar is not None
        start = self._tar.offset
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
        return self._tar.offset - start

    def companions_of(self, shard: Path) -> list[Path]:
        return [layout.index_path(shard)]

    def resume(self, state: dict[str, Any]) -> int:
        already = super().resume(state)
        self._key = self.config.first_index + self.durable
        return already

    def _end_shard(self) -> None:
        assert self._tar is not None
        self._tar.close()
        self._tar = None
        layout.index_path(self._path).write_text("".join(self._index), encoding="ascii")

    def _abort(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
