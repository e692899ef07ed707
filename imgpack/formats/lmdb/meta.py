"""A check of an LMDB file's meta pages before LMDB maps it.

LMDB maps ``data.mdb`` and follows the page numbers the file itself holds, starting from the
meta page with the newest transaction: its tree roots and its last page. A file damaged there
(its size unchanged, so the manifest's size check passes) points LMDB past the file's end,
and reading a mapped page past the end of its file is a SIGBUS that kills the process (a
reader, ``imgpack verify``, a merge) instead of an error. This reads both meta pages (LMDB's
layout on 64-bit machines) and refuses such a file in one line; a file it does not recognise
is left to LMDB, which names it (``MDB_INVALID``).
"""

from __future__ import annotations

import struct
from pathlib import Path

from imgpack.errors import DataError

MAGIC = 0xBEEFC0DE
VERSION = 1
#: A tree without pages (an empty database) has this root.
NO_PAGE = 2**64 - 1
#: The page header, then the meta: magic, version, address, map size, the two trees (the free
#: pages' and the main one: pad (the free tree's holds the page size), flags, depth, branch,
#: leaf and overflow pages, entries, root), the last page used, the transaction id.
_HEADER = 16
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")


def check_meta(path: Path) -> None:
    """Refuse ``path`` (an LMDB ``data.mdb``) when the meta page LMDB would use points past
    the file's end; a file too short for its meta pages, or of another layout, is left to
    LMDB."""
    try:
        with open(path, "rb") as fh:
            first = fh.read(_HEADER + _META.size)
            size = fh.seek(0, 2)
            meta0 = (
                _META.unpack_from(first, _HEADER) if len(first) == _HEADER + _META.size else None
            )
            if meta0 is None or meta0[0] != MAGIC or meta0[1] != VERSION:
                return
            page_size = meta0[4]  # the free tree's pad
            if page_size < _HEADER + _META.size or size < 2 * page_size:
                return
            fh.seek(page_size)
            second = fh.read(_HEADER + _META.size)
    except OSError:
        return  # the open that follows names it
    meta1 = _META.unpack_from(second, _HEADER)
    if meta1[0] != MAGIC or meta1[1] != VERSION:
        return
    meta = meta1 if meta1[-1] > meta0[-1] else meta0  # the newer transaction, as LMDB picks
    pages, last = size // page_size, meta[-2]
    roots = [meta[11], meta[19]]  # the free tree's and the main tree's
    if last >= pages or any(root != NO_PAGE and root > last for root in roots):
        raise DataError(
            f"{path}: its meta page points past the file's end (page "
            f"{max(last, *(r for r in roots if r != NO_PAGE))} of {pages}): the file is damaged; "
            "convert the output again, or restore it from a copy"
        )
