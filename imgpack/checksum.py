"""The per-record checksum every format stores (``docs/formats/*.md``).

A record's checksum is the CRC-32C (Castagnoli) of its stored payload followed by its label as
an 8-byte little-endian signed integer, so that a damaged label is caught as surely as damaged
pixels. Any CRC-32C library checks it::

    google_crc32c.value(payload + label.to_bytes(8, "little", signed=True))

CRC-32C comes from ``google-crc32c`` (C-accelerated, several GiB/s).

Many records of one size are checked at once by :func:`records_intact`: one CRC-32C of their
concatenation (in C, at memory speed), compared with what their stored checksums combine to
(CRC-32C is linear: ``crc(a + b)`` is ``crc(a)`` times ``x**(8 * len(b))`` modulo the
polynomial, plus ``crc(b)``; zlib's ``crc32_combine``). Damage in one record changes the
concatenation's CRC exactly when it changes the record's own (``x**k`` is invertible modulo the
polynomial), so a damaged record is caught as surely as by its own checksum; damage in several
records of one group could cancel out, as likely as a random CRC-32C match (2**-32).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from functools import lru_cache
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


#: CRC-32C's polynomial, bit-reflected (as the CRC is computed).
_POLY = 0x82F63B78
#: Records checked together by one CRC of their concatenation (:func:`records_intact`).
GROUP = 256
_BITS = np.arange(32, dtype=np.uint32)


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial, both bit-reflected (zlib's ``multmodp``)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _shift(count: int) -> int:
    """``x**(8 * count)`` modulo the polynomial: what a CRC is multiplied by when ``count``
    bytes follow (zlib's ``x2nmodp(count, 3)``)."""
    power, square = 1 << 31, 1 << 23  # 1, and x**8 (x**(2**3)), reflected
    while count:
        if count & 1:
            power = _multiply(square, power)
        square = _multiply(square, square)
        count >>= 1
    return power


@lru_cache(maxsize=8)
def _powers(size: int) -> np.ndarray:
    """``(GROUP, 32)`` uint32: row ``k`` holds bit ``j``'s CRC after ``k`` more records of
    ``size`` bytes (bit ``j`` times ``x**(8 * size * k)``): a record's checksum moved past the
    records after it is the XOR of the rows of its set bits."""
    shift = _shift(size)
    images = np.array([_multiply(shift, 1 << j) for j in range(32)], np.uint32)
    rows = np.empty((GROUP, 32), np.uint32)
    rows[0] = np.uint32(1) << _BITS
    for k in range(1, GROUP):  # row k: row k - 1 times the shift, bit by bit
        bits = (rows[k - 1][:, None] >> _BITS) & 1
        rows[k] = np.bitwise_xor.reduce(np.where(bits == 1, images, 0), axis=1)
    return rows


def _combined(crcs: np.ndarray, size: int) -> int:
    """The CRC-32C of the concatenation of records of ``size`` bytes whose CRCs are ``crcs``
    (at most :data:`GROUP` of them)."""
    moved = _powers(size)[len(crcs) - 1 :: -1] if len(crcs) else np.empty((0, 32), np.uint32)
    bits = (crcs.astype(np.uint32)[:, None] >> _BITS) & 1
    return int(np.bitwise_xor.reduce(np.where(bits == 1, moved, 0).ravel()))


def records_intact(rows: np.ndarray, labels: np.ndarray, crcs: np.ndarray) -> bool:
    """Whether every record matches its stored checksum (:func:`record_crc`): ``rows`` the
    payloads, a ``(n, width)`` uint8 array; ``labels`` and ``crcs`` int arrays. Checked
    :data:`GROUP` records at a time by one CRC of their concatenation (see the module doc):
    no Python step per record. ``False`` says some record in the batch does not match; find
    which with :func:`record_crcs`."""
    rows = np.ascontiguousarray(rows).reshape(len(rows), -1)
    count, width = rows.shape
    if count == 0:
        return True
    if int(np.asarray(crcs, np.int64).min()) < 0 or int(np.asarray(crcs).max()) >> 32:
        return False  # not a CRC-32C: the record path says which
    group = np.empty((min(count, GROUP), width + 8), np.uint8)
    for start in range(0, count, GROUP):
        stop = min(count, start + GROUP)
        part = group[: stop - start]
        part[:, :width] = rows[start:stop]
        part[:, width:] = labels[start:stop].astype("<i8").view(np.uint8).reshape(-1, 8)
        if int(google_crc32c.value(part)) != _combined(crcs[start:stop], width + 8):
            return False
    return True
