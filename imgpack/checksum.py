"""The per-record checksum every format stores (``docs/formats/*.md``).

A record's checksum is the CRC-32C (Castagnoli) of its stored payload followed by its label as
an 8-byte little-endian signed integer, so that a damaged label is caught as surely as damaged
pixels. Any CRC-32C library checks it::

    google_crc32c.value(payload + label.to_bytes(8, "little", signed=True))

CRC-32C comes from ``google-crc32c`` (C-accelerated, several GiB/s).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import google_crc32c
import numpy as np

_LABEL = struct.Struct("<q")


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """Plain CRC-32C of ``data``."""
    return int(google_crc32c.value(data if isinstance(data, bytes) else bytes(data)))


def crc32c_extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """The CRC-32C ``crc`` of some bytes, extended over ``data`` after them."""
    return int(google_crc32c.extend(crc, data if isinstance(data, bytes) else bytes(data)))


def record_crc(payload: bytes | bytearray | memoryview, label: int) -> int:
    """The checksum of one record: CRC-32C of ``payload`` then ``label`` (int64 LE)."""
    crc = google_crc32c.value(payload if isinstance(payload, bytes) else bytes(payload))
    return int(google_crc32c.extend(crc, _LABEL.pack(label)))


def record_crcs(rows: Iterable[Any], labels: Iterable[int]) -> list[int]:
    """:func:`record_crc` of many records: ``rows`` yields each payload as a NumPy row or
    bytes (one loop, no per-record object). The rows of a C-contiguous 2-D array are
    checksummed where they are, without a copy each."""
    value, extend, pack = google_crc32c.value, google_crc32c.extend, _LABEL.pack
    if isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.flags.c_contiguous:
        return [
            int(extend(value(row), pack(label))) for row, label in zip(rows, labels, strict=True)
        ]
    return [
        int(extend(value(row if isinstance(row, bytes) else row.tobytes()), pack(label)))
        for row, label in zip(rows, labels, strict=True)
    ]
