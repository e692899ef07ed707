"""The per-record checksum every format stores (``docs/formats/*.md``).

A record's checksum is the CRC-32C (Castagnoli) of its stored payload followed by its label as
an 8-byte little-endian signed integer, so that a damaged label is caught as surely as damaged
pixels. Any CRC-32C library checks it::

    google_crc32c.value(payload + label.to_bytes(8, "little", signed=True))

CRC-32C comes from ``google-crc32c`` (C-accelerated, several GiB/s).

Many records of one size are checked at once by :func:`records_intact`: one CRC-32C of their
payloads as they lie, one after another (in C, at memory speed), compared with what their
stored checksums combine to once each label's share is taken out. CRC-32C is linear:
``crc(a + b)`` is ``crc(a)`` times ``x**(8 * len(b))`` modulo the polynomial, plus ``crc(b)``
(zlib's ``crc32_combine``). Damage to one record's payload, label or checksum changes the two
sides' difference exactly when it would fail the record's own check (``x**k`` is invertible
modulo the polynomial), so a damaged record is caught as surely; damage to several records of
one group could cancel out, as likely as a random CRC-32C match (2**-32).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import google_crc32c
import numpy as np

_LABEL = struct.Struct("<q")


def content_digest(body: dict[str, Any]) -> str:
    """The sha256 of a JSON object's contents (keys sorted): what a receipt or a checkpoint
    carries of itself, so that an edit of it, even a consistent one, no longer matches."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


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


def _times_table(factor: int) -> list[list[int]]:
    """``[b][v]``: ``v << 8b`` times ``factor``: a product by ``factor`` in 4 lookups."""
    return [[_multiply(factor, v << (8 * b)) for v in range(256)] for b in range(4)]


#: Times ``x**64``: what the CRC of a payload is multiplied by when its 8-byte label follows.
_PAST_LABEL = _times_table(_shift(8))
#: The CRC-32C of the labels ``0 .. len - 1`` as 8 little-endian bytes (grown as needed).
_label_table = np.empty(0, np.uint32)


def _label_crcs(labels: np.ndarray) -> np.ndarray:
    """The CRC-32C of each label as 8 little-endian bytes (uint32), without a Python step per
    label: class numbers from a table, anything else per distinct value."""
    global _label_table
    labels = np.asarray(labels, np.int64)
    if not len(labels):
        return np.empty(0, np.uint32)
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= 1 << 20:
        distinct, where = np.unique(labels, return_inverse=True)
        crcs = [record_crc(b"", int(label)) for label in distinct.tolist()]
        return np.array(crcs, np.uint32)[where.reshape(-1)]
    if high >= len(_label_table):
        more = range(len(_label_table), min(max(high + 1, 2 * len(_label_table)), 1 << 20))
        grown = np.array([record_crc(b"", label) for label in more], np.uint32)
        _label_table = np.concatenate([_label_table, grown])
    return _label_table[labels]


#: Where each byte of a value starts in :func:`_moves`'s table (bytes in little-endian order).
_BYTE_ROWS = np.arange(4) * (GROUP * 256)


@lru_cache(maxsize=8)
def _moves(size: int) -> np.ndarray:
    """``4 * GROUP * 256`` uint32: at ``GROUP * 256 * b + 256 * k + v``, ``v << 8b`` times
    ``x**(8 * size * k)``: a CRC moved past ``k`` records of ``size`` bytes is the XOR of its
    4 bytes' entries (:data:`_BYTE_ROWS`)."""
    rows = np.empty((GROUP, 32), np.uint32)  # each bit moved past k records
    rows[0] = np.uint32(1) << _BITS
    shift = _shift(size)
    images = np.array([_multiply(shift, 1 << j) for j in range(32)], np.uint32)
    for k in range(1, GROUP):  # row k: row k - 1 times the shift, bit by bit
        bits = (rows[k - 1][:, None] >> _BITS) & 1
        rows[k] = np.bitwise_xor.reduce(np.where(bits == 1, images, 0), axis=1)
    value_bits = (np.arange(256)[:, None] >> np.arange(8)) & 1 == 1  # (256, 8)
    tables = np.empty((4, GROUP, 256), np.uint32)
    for byte in range(4):
        part = rows[:, None, 8 * byte : 8 * byte + 8]  # (GROUP, 1, 8)
        tables[byte] = np.bitwise_xor.reduce(np.where(value_bits, part, 0), axis=2)
    return tables.reshape(-1)


def _moved(values: np.ndarray, size: int) -> int:
    """XOR over ``i`` of ``values[i]`` moved past the ``len(values) - 1 - i`` records of
    ``size`` bytes after it (at most :data:`GROUP` values): what the CRCs of consecutive
    records combine to. One lookup per byte of each value, all XORed together."""
    count = len(values)
    rows = np.arange((count - 1) * 256, -1, -256)[:, None] + _BYTE_ROWS  # (count, 4)
    at = rows + np.ascontiguousarray(values, "<u4").view(np.uint8).reshape(count, 4)
    return int(np.bitwise_xor.reduce(_moves(size).take(at.ravel()))) if count else 0


def _rows_combine_to(rows: np.ndarray, values: np.ndarray, past: list[list[int]] | None) -> bool:
    """Whether the CRC-32C of ``rows`` ((n, width) uint8, C-contiguous) one after another,
    times ``past`` (a :func:`_times_table`; ``None``: 1), equals ``values`` (the rows' own
    CRCs, times the same) combined: :data:`GROUP` rows at a time."""
    count, width = rows.shape
    for start in range(0, count, GROUP):
        stop = min(count, start + GROUP)
        c = int(google_crc32c.value(rows[start:stop]))
        if past is not None:
            c = (
                past[0][c & 0xFF]
                ^ past[1][(c >> 8) & 0xFF]
                ^ past[2][(c >> 16) & 0xFF]
                ^ past[3][c >> 24]
            )
        if c != _moved(values[start:stop], width):
            return False
    return True


def _crc_values(crcs: np.ndarray) -> np.ndarray | None:
    """``crcs`` as uint32, or ``None`` when one is not a CRC-32C at all (negative, too big)."""
    stored = np.asarray(crcs, np.int64)
    if len(stored) and (int(stored.min()) < 0 or int(stored.max()) >> 32):
        return None
    return stored.astype(np.uint32)


def records_intact(rows: np.ndarray, labels: np.ndarray, crcs: np.ndarray) -> bool:
    """Whether every record matches its stored checksum (:func:`record_crc`): ``rows`` the
    payloads, a ``(n, width)`` uint8 array; ``labels`` and ``crcs`` int arrays. Checked
    :data:`GROUP` records at a time, with no Python step per record: one CRC of the payloads
    as they lie (``c``, in C), against the stored checksums ``s`` with each label's CRC ``d``
    taken out and moved into place (``s = c * x**64 + d`` for one record; see the module
    doc). ``False`` says some record does not match; find which with :func:`record_crcs`."""
    rows = np.ascontiguousarray(rows).reshape(len(rows), -1)
    stored = _crc_values(crcs)
    if stored is None:
        return False  # not a CRC-32C: the record path says which
    if not len(rows):
        return True
    return _rows_combine_to(rows, stored ^ _label_crcs(np.asarray(labels)), _PAST_LABEL)


def crcs_intact(rows: np.ndarray, crcs: np.ndarray) -> bool:
    """Whether the plain CRC-32C of each row of ``rows`` (``(n, width)`` uint8) is ``crcs``,
    checked as :func:`records_intact` checks records (no label)."""
    rows = np.ascontiguousarray(rows).reshape(len(rows), -1)
    stored = _crc_values(crcs)
    return stored is not None and (not len(rows) or _rows_combine_to(rows, stored, None))
