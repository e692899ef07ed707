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

A record of an output with per-sample fields (:mod:`imgpack.fields`) is version 3: the same
header (its checksum also covering the fields), then the fields section's length ``f`` (uint64 at
offset 32), the path (at 40), the fields section, and the payload (at ``40 + p + f``, to the
end). The section is, for each field in the manifest's order, a presence byte (0 absent, 1
present) and, when present, the stored bytes' length (uint64) and the bytes: exactly what the
checksum extends over after the label (:func:`imgpack.fields.extend_crc`). Records without fields
stay version 2.

Version 1 records (imgpack 0.1) have a 24-byte header (the first six fields) and no path; the
reader still reads them (with no checksum to check). No pickle: any language reads a record with a struct unpack.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import google_crc32c

from imgpack.checksum import record_crc
from imgpack.errors import DataError
from imgpack.images import Kind

MAGIC = b"IMGP"
VERSION = 2
#: The version of a record with a fields section.
FIELDS_VERSION = 3
_LENGTH = struct.Struct("<Q")
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
    #: Where the fields section lies in the value, ``(start, stop)`` (version 3), else ``None``.
    fields: tuple[int, int] | None = None


def pack(
    kind: Kind,
    channels: int,
    label: int,
    height: int,
    width: int,
    path: str,
    payload: bytes,
    fields: Sequence[bytes | None] | None = None,
) -> bytes:
    """A complete record value (version 3 with ``fields``, the stored bytes of each field in
    the manifest's order, ``None`` absent; else version 2)."""
    encoded_path = path.encode("utf-8", "surrogateescape")
    crc = record_crc(payload, label)
    if fields is None:
        header = HEADER.pack(
            MAGIC, VERSION, CODES[kind], channels, 0, label, height, width, len(encoded_path), crc
        )
        return b"".join((header, encoded_path, payload))
    section = fields_section(fields)
    crc = int(google_crc32c.extend(crc, section))
    header = HEADER.pack(
        MAGIC, FIELDS_VERSION, CODES[kind], channels, 0, label, height, width, len(encoded_path),
        crc,
    )  # fmt: skip
    return b"".join((header, _LENGTH.pack(len(section)), encoded_path, section, payload))


def fields_section(stored: Sequence[bytes | None]) -> bytes:
    """A version 3 record's fields section (what the checksum extends over)."""
    parts: list[bytes] = []
    for data in stored:
        parts.append(b"\x00" if data is None else b"\x01" + _LENGTH.pack(len(data)) + data)
    return b"".join(parts)


def split_fields(section: bytes | memoryview, count: int) -> list[bytes | None]:
    """The stored bytes of ``count`` fields from a fields section; :class:`DataError` for a
    section that does not hold exactly that."""
    data = bytes(section)
    out: list[bytes | None] = []
    at = 0
    for _ in range(count):
        if at >= len(data) or data[at] not in (0, 1):
            raise DataError("damaged fields section (a presence byte is not 0 or 1)")
        present, at = data[at], at + 1
        if not present:
            out.append(None)
            continue
        if at + 8 > len(data):
            raise DataError("damaged fields section (cut short)")
        (length,) = _LENGTH.unpack_from(data, at)
        at += 8
        if at + length > len(data):
            raise DataError("damaged fields section (a value runs past its end)")
        out.append(data[at : at + length])
        at += length
    if at != len(data):
        raise DataError(f"the fields section holds {len(data) - at} bytes more than its fields")
    return out


def unpack_header(value: bytes | memoryview) -> RecordHeader:
    """Parse and check the header of a record value; :class:`DataError` if it is not one."""
    if len(value) < V1_HEADER_SIZE:
        raise DataError(f"record is {len(value)} bytes, shorter than a record header")
    magic, version, code, channels, _, label, height, width = COMMON.unpack_from(value)
    if magic != MAGIC:
        raise DataError(f"not an imgpack record (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in (1, VERSION, FIELDS_VERSION):
        raise DataError(
            f"record version {version} is not supported; this imgpack reads versions 1 to "
            f"{FIELDS_VERSION} (a newer imgpack wrote it: upgrade imgpack)"
        )
    if code not in KINDS:
        raise DataError(f"unknown payload kind {code}")
    path: str | None = None
    crc: int | None = None
    fields: tuple[int, int] | None = None
    start = V1_HEADER_SIZE
    if version in (VERSION, FIELDS_VERSION):
        head = HEADER_SIZE + (8 if version == FIELDS_VERSION else 0)
        if len(value) < head:
            raise DataError(f"record is {len(value)} bytes, shorter than its {head}-byte header")
        length, crc = struct.unpack_from("<II", value, 24)
        start = head + length
        if start > len(value):
            raise DataError(f"path length {length} runs past the end of the record")
        path = bytes(value[head:start]).decode("utf-8", "surrogateescape")
        if version == FIELDS_VERSION:
            (section,) = _LENGTH.unpack_from(value, HEADER_SIZE)
            if start + section > len(value):
                raise DataError(f"fields section of {section} bytes runs past the record's end")
            fields, start = (start, start + section), start + section
    header = RecordHeader(KINDS[code], channels, label, height, width, start, path, crc, fields)
    if header.kind is Kind.RAW and len(value) - start != height * width * channels:
        raise DataError(
            f"raw payload is {len(value) - start} bytes, expected {height}x{width}x{channels}"
        )
    return header
