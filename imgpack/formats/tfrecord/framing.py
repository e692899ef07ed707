"""TFRecord framing and ``.idx`` index files, as TensorFlow's record writer and DALI define them.

A TFRecord file is a sequence of records, each framed as::

    uint64  length          little-endian
    uint32  masked_crc32c(length bytes)
    bytes   data[length]
    uint32  masked_crc32c(data)

where ``masked_crc32c(x) = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32`` over CRC-32C
(Castagnoli). The ``.idx`` text file beside a shard has one line per record, ``offset size``, the
byte offset of the record's frame and the frame's full size (``16 + length``): the layout that
NVIDIA DALI's ``tfrecord2idx`` and the ``tfrecord`` package write.

CRC-32C comes from ``google-crc32c`` (C-accelerated; it falls back to its own pure-Python code
only when no compiled build exists for the platform).
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from imgpack.checksum import crc32c, crc32c_extend
from imgpack.errors import DataError

_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
HEADER_SIZE = 12  # length + its CRC
FOOTER_SIZE = 4
MASK_DELTA = 0xA282EAD8


def shard_file_name(prefix: str, number: int, total: int) -> str:
    """The name of shard ``number`` of ``total`` in a finished output: TensorFlow's
    ``prefix-NNNNN-of-MMMMM.tfrecord`` convention."""
    return f"{prefix}-{number:05d}-of-{total:05d}.tfrecord"


def masked_crc32c(data: bytes | memoryview) -> int:
    """TensorFlow's masked CRC-32C of ``data``."""
    return mask(crc32c(data))


_Crc = TypeVar("_Crc", int, np.ndarray)


def mask(crc: _Crc) -> _Crc:
    """TensorFlow's mask of a CRC-32C (an int, or a uint64 array of them)."""
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: _Crc) -> _Crc:
    """The CRC-32C a masked one (:func:`mask`) was made from."""
    crc = (masked - MASK_DELTA) & 0xFFFFFFFF
    return ((crc << 15) | (crc >> 17)) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One framed record."""
    before, after = frame_around(data, b"", b"")
    return before + after


def frame_around(head: bytes, value: bytes | memoryview, tail: bytes) -> tuple[bytes, bytes]:
    """:func:`frame` of ``head + value + tail`` as the bytes before ``value`` and after it (the
    value, an image's bytes, is neither copied nor joined)."""
    length = _LENGTH.pack(len(head) + len(value) + len(tail))
    crc = crc32c_extend(crc32c_extend(crc32c(head), value), tail)
    return length + _CRC.pack(masked_crc32c(length)) + head, tail + _CRC.pack(mask(crc))


def read_length(header: bytes | memoryview, where: str, check_crc: bool = True) -> int:
    """The data length of a record from its 12-byte frame header (the length and the length's
    CRC); :class:`DataError` naming ``where`` when the header is short or its CRC is wrong.
    Every reader of frames goes through here."""
    if len(header) < HEADER_SIZE:
        raise DataError(f"{where}: truncated record header ({len(header)} bytes)")
    (length,) = _LENGTH.unpack_from(header)
    if check_crc:
        (length_crc,) = _CRC.unpack_from(header, 8)
        if length_crc != masked_crc32c(header[:8]):
            raise DataError(f"{where}: length CRC mismatch (damaged record header)")
    return int(length)


def unframe(buf: bytes | memoryview, where: str, check_crc: bool = True) -> memoryview:
    """The data of one framed record held whole in ``buf``; :class:`DataError` naming ``where``
    when it is truncated or a CRC does not match."""
    view = memoryview(buf)
    if len(view) < HEADER_SIZE + FOOTER_SIZE:
        raise DataError(f"{where}: truncated record ({len(view)} bytes)")
    length = read_length(view, where, check_crc)
    if len(view) != HEADER_SIZE + length + FOOTER_SIZE:
        raise DataError(
            f"{where}: record length {length} does not match its frame of {len(view)} bytes"
        )
    if check_crc:
        (data_crc,) = _CRC.unpack_from(view, HEADER_SIZE + length)
        if data_crc != masked_crc32c(view[HEADER_SIZE : HEADER_SIZE + length]):
            raise DataError(f"{where}: data CRC mismatch (damaged record)")
    return view[HEADER_SIZE : HEADER_SIZE + length]


def stored_crc(data: memoryview) -> int | None:
    """The masked data CRC stored after ``data``, the view :func:`unframe` returned of a frame
    held whole in its own buffer; ``None`` for any other view (its frame is not at hand)."""
    whole = data.obj
    if not isinstance(whole, bytes) or len(whole) != HEADER_SIZE + len(data) + FOOTER_SIZE:
        return None
    return int(_CRC.unpack_from(whole, len(whole) - FOOTER_SIZE)[0])


def compression(path: str | os.PathLike[str]) -> str | None:
    """``"GZIP"`` or ``"ZLIB"`` for a TFRecord file TensorFlow wrote with that
    ``compression_type``, ``None`` for a plain one. A ZLIB stream starts with a two-byte header
    (``0x78 ..``, a multiple of 31) that a plain file's first length byte can also be, so a file
    counts as ZLIB only when its first 12 bytes are not a valid record header."""
    with open(path, "rb") as fh:
        return compression_of(fh.read(HEADER_SIZE))


def compression_of(head: bytes) -> str | None:
    """:func:`compression` from a file's first 12 bytes."""
    if head[:2] == b"\x1f\x8b":
        return "GZIP"
    zlib_header = len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
    if zlib_header and not _valid_header(head):
        return "ZLIB"
    return None


def _valid_header(head: bytes) -> bool:
    if len(head) < HEADER_SIZE:
        return False
    (length_crc,) = _CRC.unpack_from(head, 8)
    return bool(length_crc == masked_crc32c(head[:8]))


def is_compressed(path: str | os.PathLike[str]) -> bool:
    return compression(path) is not None


class ZlibReader(io.BufferedReader):
    """A ZLIB-compressed TFRecord file (a path, or a binary file object it then owns),
    inflated in bounded pieces as it is read."""

    def __init__(self, path: str | os.PathLike[str] | BinaryIO) -> None:
        super().__init__(_Inflater(path), buffer_size=1 << 16)


class _Inflater(io.RawIOBase):
    PIECE = 1 << 20  # the most inflated at once

    def __init__(self, path: str | os.PathLike[str] | BinaryIO) -> None:
        if isinstance(path, (str, os.PathLike)):
            self._fh: Any = open(path, "rb")  # noqa: SIM115 - closed in close()
        else:
            self._fh = path
        self._inflate = zlib.decompressobj()
        self._pending = b""
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending and not self._done:
            data = self._inflate.unconsumed_tail or self._fh.read(1 << 16)
            if not data:
                self._pending, self._done = self._inflate.flush(), True
            else:
                try:
                    self._pending = self._inflate.decompress(data, self.PIECE)
                except zlib.error as exc:
                    raise DataError(f"{self._fh.name}: damaged ZLIB stream: {exc}") from None
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def close(self) -> None:
        self._fh.close()
        super().close()


def iter_frames(
    fh: BinaryIO, name: str, check_crc: bool = True, start: int = 0
) -> Iterator[tuple[int, memoryview]]:
    """``(offset, data)`` of every record of an open (possibly decompressing) stream positioned
    at byte ``start``."""
    offset = start
    compressed = isinstance(fh, (gzip.GzipFile, ZlibReader))
    while True:
        header = fh.read(HEADER_SIZE)
        if not header:
            return
        length = read_length(header, f"{name} at offset {offset}", check_crc)
        if compressed and length > MAX_COMPRESSED_RECORD:
            # A few MB of GZIP can inflate to gigabytes: refuse before holding them.
            raise DataError(
                f"{name}: record at offset {offset} (uncompressed) claims {length} bytes, more "
                f"than the {MAX_COMPRESSED_RECORD >> 20} MiB imgpack reads from a compressed "
                "(GZIP/ZLIB) stream"
            )
        rest = read_at_most(fh, length + FOOTER_SIZE)
        if len(rest) < length + FOOTER_SIZE:
            raise DataError(f"{name}: truncated record at offset {offset} (length {length})")
        yield offset, unframe(header + rest, f"{name} at offset {offset}", check_crc)
        offset += HEADER_SIZE + length + FOOTER_SIZE


#: Largest record read from a GZIP-compressed file: its length field cannot be checked against
#: the file's size, and decompression turns a small file into any amount of data.
MAX_COMPRESSED_RECORD = 256 << 20

#: Largest piece read at once: a damaged length field costs at most this much memory beyond
#: what the file really holds.
READ_PIECE = 16 << 20


def read_at_most(fh: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes of ``fh`` (fewer at the end of the stream), read in bounded pieces,
    so that a hostile length field never allocates more than the stream holds."""
    if size <= READ_PIECE:
        return fh.read(size)
    pieces = []
    while size > 0:
        piece = fh.read(min(size, READ_PIECE))
        if not piece:
            break
        pieces.append(piece)
        size -= len(piece)
    return b"".join(pieces)


def open_records(path: Path) -> BinaryIO:
    """Open a TFRecord file for sequential reading, decompressing GZIP and ZLIB files."""
    kind = compression(path)
    if kind == "GZIP":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == "ZLIB":
        return ZlibReader(path)
    return open(path, "rb")


def open_stream(fh: BinaryIO, kind: str | None) -> BinaryIO:
    """A binary file object (a file in a bucket, say) of compression ``kind`` as a stream of
    frames; the stream owns ``fh``."""
    if kind == "GZIP":
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    if kind == "ZLIB":
        return ZlibReader(fh)
    return fh


def parse_index(text: str, where: str) -> list[tuple[int, int]]:
    """The ``(offset, size)`` lines of an ``.idx`` file's text (``where`` names it)."""
    index = []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            offset, size = int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            raise DataError(
                f"{where}: line {number}: expected 'offset size', got {line!r}"
            ) from None
        index.append((offset, size))
    return index


def build_index(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of every record frame of an uncompressed file, by walking the lengths
    (each length's CRC is checked, the data is skipped)."""
    kind = compression(path)
    if kind is not None:
        raise DataError(
            f"{path}: a {kind}-compressed TFRecord file has no random access; read it with "
            "TFRecordStream"
        )
    index = []
    size = path.stat().st_size
    with open(path, "rb") as fh:
        offset = 0
        while offset < size:
            length = read_length(fh.read(HEADER_SIZE), f"{path} at offset {offset}")
            total = HEADER_SIZE + length + FOOTER_SIZE
            if offset + total > size:
                raise DataError(f"{path}: truncated record at offset {offset} (length {length})")
            index.append((offset, total))
            offset += total
            fh.seek(offset)
    return index


def index_path(path: Path) -> Path:
    """Where the ``.idx`` of a shard lives: ``x.tfrecord`` -> ``x.idx``; other names get ``.idx`` added."""
    return (
        path.with_suffix(".idx")
        if path.suffix == ".tfrecord"
        else path.with_name(path.name + ".idx")
    )


def write_index(path: Path, index: list[tuple[int, int]]) -> Path:
    target = index_path(path)
    target.write_text("".join(f"{offset} {size}\n" for offset, size in index))
    return target


def read_index(path: Path, file_size: int | None = None) -> list[tuple[int, int]] | None:
    """The ``.idx`` of ``path`` if there is one (``None`` otherwise), checked against the
    framing and ``path``'s size (``file_size``: the size it has, for a file not fetched yet)."""
    target = index_path(path)
    if not target.is_file():
        return None
    try:
        text = target.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{target}: unreadable index: {exc}") from None
    index = parse_index(text, str(target))
    check_index(path, index, file_size)
    return index


def check_index(path: Path, index: list[tuple[int, int]], file_size: int | None = None) -> None:
    """Check ``.idx`` entries against the framing: contiguous frames from byte 0, each at least
    a frame's overhead long, the last ending where the file (of ``file_size`` bytes, by default
    its size on disk) does. A stale or edited index is refused (:class:`DataError`) rather than
    trusted."""
    expected = 0
    for number, (offset, size) in enumerate(index, 1):
        if offset != expected or size < HEADER_SIZE + FOOTER_SIZE:
            raise DataError(
                f"{index_path(path)}: line {number}: record at {offset} of {size} bytes does not "
                f"match the framing (expected one at {expected}); rebuild it with imgpack index"
            )
        expected = offset + size
    size = path.stat().st_size if file_size is None else file_size
    if expected != size:
        raise DataError(
            f"{index_path(path)}: its records end at byte {expected}, {path.name} has {size} "
            "bytes; rebuild it with imgpack index"
        )
