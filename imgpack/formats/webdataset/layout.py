"""The byte layout of a ``webdataset`` output, shared by its writer and reader.

Shards are POSIX (ustar) tar files ``data-000000.tar``, ``data-000001.tar``, ... Sample ``i`` of
the output (counted across shards, in scan order) is three consecutive members whose names share
the key ``%010d % i``, as WebDataset groups them (a part of a partitioned conversion counts from
its first scan position, so merged parts keep unique, increasing keys):

- ``<key>.<ext>``: the stored image. ``original``: the source file's bytes, with its extension
  (lower case) when it names the content (``jpg``/``jpeg`` for JPEG, ``png`` for PNG), else the
  content's (``jpg``, ``png``); ``png``/``jpeg`` encodings: ``.png``/``.jpg``; ``raw``: ``.npy``,
  a NumPy ``uint8`` array ``(H, W, C)``.
- ``<key>.cls``: the label in decimal ASCII (``b"3"``), as timm and OpenCLIP read it.
- ``<key>.json``: ``{"class": <class name>, "path": <source path relative to the source folder>,
  "output_id": <the output's id>}`` (a reader refuses a shard of another output).

An output with per-sample fields (:mod:`imgpack.fields`) adds, after ``<key>.cls``, one member
``<key>.<field name>`` for each field the sample has, in the manifest's order: text for ``str``
(UTF-8, as ``webdataset`` decodes ``.txt``), the bytes for ``bytes``, compact JSON for ``json``
(as it decodes ``.json``), decimal text for ``int`` and ``float`` (as ``.cls`` holds a label; a
float as Python's ``repr`` of its float32 value, which reads back to it), and a JSON list for ``int[]`` and
``float[]``; an absent value has no member. Its own metadata member is then
``<key>.imgpack.json``, so that a field named ``json`` (LAION's metadata) keeps its name. The
index gains two columns per field, ``offset size`` of its member's data (``-1 0``: absent), and
the checksum covers the fields' values (:func:`imgpack.fields.fields_crc`).

Members are written with mode ``0444``, owner ``0:0`` and ``mtime`` 0, so the same input gives
the same bytes (:func:`member_header`: the header Python's ``tarfile`` writes for them, built
without it), and a shard ends as ``tarfile`` ends one: two zero blocks, then zeros to a multiple
of 10,240 bytes. Beside each shard, ``data-000000.idx`` has one line per sample,
``offset size label crc32c``: where the image member's data starts in the tar, its size, the
label, and the record's checksum (:mod:`imgpack.checksum`: CRC-32C of the image member's bytes,
then the label as int64 little-endian), so a reader finds and checks any sample without scanning
the tar.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from imgpack.fields import Field, member_value
from imgpack.images import Kind

KEY_FORMAT = "%010d"
BLOCK = 512
#: A shard's size is a multiple of this (tar's blocking factor 20, as ``tarfile`` writes).
RECORD = 20 * BLOCK
INDEX_SUFFIX = ".idx"
INDEX_COLUMNS = 4  # offset size label crc32c (then offset size of each field's member)
#: The metadata member's extension in an output with fields (``<key>.json`` without).
FIELDS_METADATA = "imgpack.json"
#: Extensions a kept original file may keep, by content.
KEEPABLE_EXTENSIONS = {Kind.JPEG: ("jpg", "jpeg"), Kind.PNG: ("png",)}
EXTENSIONS = {Kind.JPEG: "jpg", Kind.PNG: "png", Kind.RAW: "npy"}


def shard_name(index: int) -> str:
    return f"data-{index:06d}.tar"


def index_path(shard: Path) -> Path:
    return shard.with_suffix(INDEX_SUFFIX)


def extension(kind: Kind, source_path: str) -> str:
    """The image member's extension for a payload of ``kind`` from ``source_path``."""
    suffix = source_path.rsplit(".", 1)[-1].lower() if "." in source_path else ""
    if suffix in KEEPABLE_EXTENSIONS.get(kind, ()):
        return suffix
    return EXTENSIONS[kind]


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The bytes a ``.npy`` file of a C-ordered uint8 array of ``shape`` starts with."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": "|u1", "fortran_order": False, "shape": tuple(shape)}
    )
    return out.getvalue()


def _template() -> bytes:
    """A ustar header's fixed fields: mode 0444, uid and gid 0, mtime 0, a regular file."""
    head = bytearray(BLOCK)
    head[100:108] = b"0000444\0"
    head[108:116] = b"0000000\0"
    head[116:124] = b"0000000\0"
    head[136:148] = b"00000000000\0"
    head[148:156] = b" " * 8  # the checksum field counts as spaces
    head[156:157] = b"0"
    head[257:265] = b"ustar\x0000"
    return bytes(head)


_TEMPLATE = _template()
#: The sum of the template's bytes: a header's checksum is this plus its name's and size's
#: bytes (the template holds zeros where they go), so no header is summed whole.
_TEMPLATE_SUM = sum(_TEMPLATE)


def member_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a member ``name`` (ASCII, at most 100 bytes) of ``size``
    bytes, exactly as ``tarfile`` writes it with the fields above (``ValueError`` where it
    would refuse)."""
    raw = name.encode("ascii")
    if len(raw) > 100 or not 0 <= size < 8**11:
        raise ValueError(f"{name!r} ({size} bytes) does not fit a ustar header")
    sized = b"%011o\0" % size
    head = bytearray(_TEMPLATE)
    head[: len(raw)] = raw
    head[124:136] = sized
    head[148:155] = b"%06o\0" % (_TEMPLATE_SUM + sum(raw) + sum(sized))
    return bytes(head)


def padding(size: int) -> bytes:
    """The zeros after a member's ``size`` bytes of data, to the next block."""
    return bytes(-size % BLOCK)


def member(name: str, data: bytes) -> bytes:
    """A whole member: its header, its data and the zeros to the next block."""
    return member_header(name, len(data)) + data + padding(len(data))


def field_stored(found: Field, data: bytes) -> bytes:
    """The bytes the checksum covers for a field member's ``data`` (the member's own for text,
    bytes and JSON; the encoded value for numbers and arrays)."""
    if found.type in ("str", "bytes", "json"):
        return data
    return found.encode(member_value(found, data))
