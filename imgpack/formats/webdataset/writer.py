"""Writer of the ``webdataset`` format (layout in :mod:`imgpack.formats.webdataset.layout`)."""

from __future__ import annotations

from json.encoder import encode_basestring_ascii as quote
from pathlib import Path

from imgpack.checksum import record_crc
from imgpack.fields import extend_crc, member_bytes, stored_values
from imgpack.formats.webdataset import layout
from imgpack.formats.writer_base import HashedFile, ShardedWriter, WriterConfig
from imgpack.images import Encoded, Kind


def metadata(class_name: str | None, path: str, output_id: str) -> bytes:
    """A sample's ``.json`` member: exactly ``json.dumps`` of ``{"class", "path"}`` and
    ``"output_id"`` when there is one, keys sorted, each string quoted as ``json`` quotes it
    (ASCII, escapes as ``json`` writes them), without building a dict and encoding it."""
    name = "null" if class_name is None else quote(class_name)
    found = f', "output_id": {quote(output_id)}' if output_id else ""
    return f'{{"class": {name}{found}, "path": {quote(path)}}}'.encode("ascii")


#: Field types whose member holds the stored bytes themselves.
TEXT_LIKE = ("str", "bytes", "json")


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

    @classmethod
    def estimated_bytes(cls, stored: int, raw: bool = False) -> int:
        """The image member (a header block, its data padded to whole blocks; a ``.npy``
        header of 128 bytes before raw pixels), then ``.cls`` and ``.json``, a block of header
        and one of data each: 6,144 bytes for a 32x32 RGB raw sample."""
        data = stored + (128 if raw else 0)
        return layout.BLOCK + -(-data // layout.BLOCK) * layout.BLOCK + 4 * layout.BLOCK

    def _start_shard(self, path: Path) -> None:
        self._path = path
        self._fh = HashedFile(path)  # closed in _end_shard/_abort
        self._offset = 0
        self._index = []

    def _append(self, sample: Encoded) -> int:
        assert self._fh is not None
        key = layout.KEY_FORMAT % self._key
        self._key += 1
        payload = sample.payload
        if sample.kind is Kind.RAW:
            shape = (sample.height, sample.width, sample.channels)
            payload = layout.npy_header(shape) + payload
        ext = layout.extension(sample.kind, sample.path)
        name = self.config.class_name(sample.label)
        meta = metadata(name, sample.path, self.config.output_id)
        label = str(sample.label).encode("ascii")
        # Three writes a sample: the image's header, its bytes, then the rest (its padding and
        # the small .cls and .json members), each hashed as it is written.
        head = layout.member_header(f"{key}.{ext}", len(payload))
        parts = [layout.padding(len(payload)), layout.member(f"{key}.cls", label)]
        crc = record_crc(payload, sample.label)
        spots = ""
        if self.config.fields:
            values = sample.fields or {}
            stored = stored_values(self.config.fields, values)
            crc = extend_crc(crc, stored)
            at = self._offset + len(head) + len(payload) + sum(map(len, parts))
            for f, data in zip(self.config.fields, stored, strict=True):
                if data is None:
                    spots += " -1 0"
                    continue
                if f.type not in TEXT_LIKE:  # numbers as text (the stored bytes are binary)
                    data = member_bytes(f, values[f.name])
                parts.append(layout.member(f"{key}.{f.name}", data))
                spots += f" {at + layout.BLOCK} {len(data)}"
                at += len(parts[-1])
            parts.append(layout.member(f"{key}.{layout.FIELDS_METADATA}", meta))
        else:
            parts.append(layout.member(f"{key}.json", meta))
        tail = b"".join(parts)
        self._fh.write(head)
        self._fh.write(payload)
        self._fh.write(tail)
        self._index.append(
            f"{self._offset + len(head)} {len(payload)} {sample.label} {crc}{spots}\n"
        )
        added = len(head) + len(payload) + len(tail)
        self._offset += added
        return added

    def companions_of(self, shard: Path) -> list[Path]:
        return [layout.index_path(shard)]

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
