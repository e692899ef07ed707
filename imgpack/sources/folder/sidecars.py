"""Sidecar files as per-sample fields: ``x.jpg`` with ``x.txt`` and ``x.json`` beside it, as
img2dataset writes a folder (:mod:`imgpack.fields`).

A file the folder's scan passed over as not an image (:data:`IGNORED_NOT_IMAGE`) whose name is an
image's without its extension plus another one (``cat/0001.jpg`` and ``cat/0001.txt``) is a
sidecar of that image: a field named by its extension, ``txt`` and ``text`` as text, ``json`` as
JSON, any other as bytes (``--field NAME:TYPE`` for another type; numbers as decimal text, arrays
as a JSON list), optional where an image has none. Sidecars stay in the manifest's list of files
passed over, with the reason :data:`SIDECAR` (every file of SRC is counted once). An extension
that cannot be a field's name is refused in one line unless ``--fields`` leaves it out.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from imgpack.errors import DataError
from imgpack.fields import Field, member_value
from imgpack.scan import Scan
from imgpack.sources.base import ScanRequest, kept_fields
from imgpack.sources.folder.scan import IGNORED_NOT_IMAGE

#: The reason a sidecar is listed with, among the files passed over.
SIDECAR = "a sidecar of an image, kept as its field"
TEXT = ("txt", "text")
JSON = ("json", "jsn")


def stem(path: str) -> str:
    """``path`` without its extension (``cat/0001.jpg`` -> ``cat/0001``)."""
    head, dot, _ = path.rpartition(".")
    return head if dot and "/" not in path[len(head) :] else path


def sidecar_fields(scan: Scan, request: ScanRequest) -> Scan:
    """``scan`` with the fields its sidecars make (those ``--fields`` names, if given), the
    kept sidecars listed as such."""
    candidates = [e for e in scan.ignored if e["reason"] == IGNORED_NOT_IMAGE]
    if not candidates or request.fields == ():
        return scan
    stems = {stem(sample.path) for sample in scan.samples}
    found: dict[str, str] = {}  # a sidecar's path: its extension
    for entry in candidates:
        path = entry["path"]
        head, dot, ext = path.rpartition(".")
        if dot and "/" not in ext and head in stems:
            found[path] = ext
    if not found:
        return scan
    counts = Counter(found.values())
    every = list(dict.fromkeys(found.values()))

    def infer(ext: str) -> Field:
        kind = "str" if ext in TEXT else "json" if ext in JSON else "bytes"
        return Field(ext, kind, optional=counts[ext] < len(scan.samples))

    fields = kept_fields(every, request, infer, lambda ext: f"sidecar files '*.{ext}'")
    kept = {f.name for f in fields}
    ignored = [
        {**e, "reason": SIDECAR} if found.get(e["path"]) in kept else e for e in scan.ignored
    ]
    scan.ignored, scan.fields, scan.field_names = ignored, fields, every
    return scan


def read_sidecars(root: str, path: str, fields: tuple[Field, ...]) -> dict[str, Any]:
    """The field values of the image ``root/path`` from its sidecars (none: absent); a
    sidecar that does not hold its field's value raises :class:`ValueError` naming it."""
    base = os.path.join(root, stem(path))
    values: dict[str, Any] = {}
    for f in fields:
        sidecar = f"{base}.{f.name}"
        try:
            data = Path(sidecar).read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ValueError(f"cannot read its sidecar {stem(path)}.{f.name}: {exc}") from None
        try:
            values[f.name] = member_value(f, data)
        except (ValueError, DataError) as exc:
            raise ValueError(f"its sidecar {stem(path)}.{f.name}: {exc}") from None
    return values
