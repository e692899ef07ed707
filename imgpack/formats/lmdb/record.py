"""The LMDB record: key and value layout shared by the ``lmdb`` writer and reader.

Keys are sample indices as ten ASCII digits, zero-padded (``b"0000000042"``), so LMDB's key
order is sample order. Values are a 32-byte little-endian header, the sample's source path and
the payload, which runs to the end of the value:

======  ====  ==========  ==========================================================
offset  size  type        field
======  ====  ==========  ==========================================================
0       4     bytes       magic ``b"IMGP"``
4       1     uint8       record version (2)
5       1     uint8       payload kind: 0 raw pixels, 1 JPEG, 2 PNG
6       1     uint8       channels (1 or 3)
7       1     uint8       reserved, 0
8       8     int64       label
16      4     uint32      height (pixels)
20      4     uint32      width (pixels)
24      4     uint32      path length ``p`` in bytes
28      4     uint32      checksum: CRC-32C of the payload, then the label as int64 LE
32      p     bytes       source path relative to the source folder (UTF-8)
32 + p  n     bytes       payload: raw HWC uint8 pixels (height * width * channels bytes),
                          or a complete JPEG/PNG file
======  ====  ==========  ==========================================================

Version 1 records (imgpack 0.1) have a 24-byte header (the first six fields) and no path; the
reader still reads them (with no checksum to check). No pickle: any language reads a record with a struct unpack.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from imgpack.checksum import record_crc
from imgpack.errors import DataError
from imgpack.images import Kind

MAGIC = b"IMGP"
VERSION = 2
HEADER = struct.Struct("<4sBBBBqIIII")
HEADER_SIZE = HEADER.size  # 32
#: The fields every version starts with, and the size of a version 1 header.
COMMON = struct.Struct("<4sBBBBqII")
V1_HEADER_SIZE = COMMON.size  # 24
KEY_FORMAT = b"%010d"  # ten digits, zero-padded
#: The one key that is not a sample: JSON ``{"num_samples": N, "output_id": ...}``. It sorts
#: after every sample key ('_' > '9'), so a cursor meets the samples first.
META_KEY = b"__imgpack__"
CODES = {Kind.RAW: 0, Kind.JPEG: 1, Kind.PNG: 2}
KINDS = {code: kind for kind, code in CODES.items()}


def key(index: int) -> bytes:
    """The key of sample ``index``."""
    return KEY_FORMAT % index


@dataclass(frozen=True)
class RecordHeader:
    kind: Kind
    channels: int
    label: int
    height: int
    width: int
    #: Where the payload starts in the value (after the header and the path).
    payload_offset: int
    #: The stored source path, or ``None`` in a version 1 record.
    path: str | None
    #: The stored checksum, or ``None`` in a version 1 record.
    crc: int | None


def pack(
    kind: Kind, channels: int, label: int, height: int, width: int, path: str, payload: bytes
) -> bytes:
    """A complete record value."""
    encoded_path = path.encode("utf-8", "surrogateescape")
    crc = record_crc(payload, label)
    header = HEADER.pack(
        MAGIC, VERSION, CODES[kind], channels, 0, label, height, width, len(encoded_path), crc
    )
    return b"".join((header, encoded_path, payload))


def unpack_header(value: bytes | memoryview) -> RecordHeader:
    """Parse and check the header of a record value; :class:`DataError` if it is not one."""
    if len(value) < V1_HEADER_SIZE:
        raise DataError(f"record is {len(value)} bytes, shorter than a record header")
    magic, version, code, channels, _, label, height, width = COMMON.unpack_from(value)
    if magic != MAGIC:
        raise DataError(f"not an imgpack record (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in (1, VERSION):
        raise DataError(
            f"record version {version} is not supported; this imgpack reads versions 1 and "
            f"{VERSION} (a newer imgpack wrote it: upgrade imgpack)"
        )
    if code not in KINDS:
        raise DataError(f"unknown payload kind {code}")
    path: str | None = None
    crc: int | None = None
    start = V1_HEADER_SIZE
    if version == VERSION:
        if len(value) < HEADER_SIZE:
            raise DataError(
                f"record is {len(value)} bytes, shorter than its {HEADER_SIZE}-byte header"
            )
        length, crc = struct.unpack_from("<II", value, 24)
        start = HEADER_SIZE + length
        if start > len(value):
            raise DataError(f"path length {length} runs past the end of the record")
        path = bytes(value[HEADER_SIZE:start]).decode("utf-8", "surrogateescape")
    header = RecordHeader(KINDS[code], channels, label, height, width, start, path, crc)
    if header.kind is Kind.RAW and len(value) - start != height * width * channels:
        raise DataError(
            f"raw payload is {len(value) - start} bytes, expected {height}x{width}x{channels}"
        )
    return header
