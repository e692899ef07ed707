"""The LMDB record: key and value layout shared by the ``lmdb`` writer and reader.

Keys are sample indices as ten ASCII digits, zero-padded (``b"0000000042"``), so LMDB's key
order is sample order. Values are a 24-byte little-endian header followed by the payload:

======  ====  ==========  ==========================================================
offset  size  type        field
======  ====  ==========  ==========================================================
0       4     bytes       magic ``b"IMGP"``
4       1     uint8       record version (1)
5       1     uint8       payload kind: 0 raw pixels, 1 JPEG, 2 PNG
6       1     uint8       channels (1 or 3)
7       1     uint8       reserved, 0
8       8     int64       label
16      4     uint32      height (pixels)
20      4     uint32      width (pixels)
24      n     bytes       payload: raw HWC uint8 pixels (height * width * channels bytes),
                          or a complete JPEG/PNG file
======  ====  ==========  ==========================================================

No pickle: any language reads it with a struct unpack.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from imgpack.errors import DataError

MAGIC = b"IMGP"
VERSION = 1
HEADER = struct.Struct("<4sBBBBqII")
HEADER_SIZE = HEADER.size  # 24
KEY_FORMAT = b"%010d"  # ten digits, zero-padded
KINDS = {"RAW": 0, "JPEG": 1, "PNG": 2}
KIND_NAMES = {code: name for name, code in KINDS.items()}


def key(index: int) -> bytes:
    """The key of sample ``index``."""
    return KEY_FORMAT % index


@dataclass(frozen=True)
class RecordHeader:
    kind: str
    channels: int
    label: int
    height: int
    width: int


def pack(kind: str, channels: int, label: int, height: int, width: int, payload: bytes) -> bytes:
    """A complete record value."""
    return HEADER.pack(MAGIC, VERSION, KINDS[kind], channels, 0, label, height, width) + payload


def unpack_header(value: bytes | memoryview) -> RecordHeader:
    """Parse and check the header of a record value; :class:`DataError` if it is not one."""
    if len(value) < HEADER_SIZE:
        raise DataError(f"record is {len(value)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, kind, channels, _, label, height, width = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise DataError(f"not an imgpack record (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise DataError(
            f"record version {version} is not supported; this imgpack reads version {VERSION} "
            "(a newer imgpack wrote it: upgrade imgpack)"
        )
    if kind not in KIND_NAMES:
        raise DataError(f"unknown payload kind {kind}")
    header = RecordHeader(KIND_NAMES[kind], channels, label, height, width)
    if header.kind == "RAW" and len(value) - HEADER_SIZE != height * width * channels:
        raise DataError(
            f"raw payload is {len(value) - HEADER_SIZE} bytes, expected {height}x{width}x{channels}"
        )
    return header
