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

Members are written with mode ``0444``, owner ``0:0`` and ``mtime`` 0, so the same input gives
the same bytes. Beside each shard, ``data-000000.idx`` has one line per sample,
``offset size label crc32c``: where the image member's data starts in the tar, its size, the
label, and the record's checksum (:mod:`imgpack.checksum`: CRC-32C of the image member's bytes,
then the label as int64 little-endian), so a reader finds and checks any sample without scanning
the tar.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from imgpack.images import Kind

KEY_FORMAT = "%010d"
INDEX_SUFFIX = ".idx"
INDEX_COLUMNS = 4  # offset size label crc32c
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
