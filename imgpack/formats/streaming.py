"""Streaming a reader's stored samples to a writer, as they are stored.

``imgpack merge`` (for formats it cannot link), ``export`` and a conversion from an output read
each sample's stored bytes (checked against their checksums), label, source path, kind and size
through a reader's ``encoded``: :func:`stored_samples` is its default, built on the reader's
``_records``; a format whose records say more (TFRecord's features) overrides ``encoded``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from imgpack.errors import DataError
from imgpack.formats.checking import CheckedReader, Record, RecordChecks
from imgpack.images import Encoded, Kind, stored_info
from imgpack.manifest import Manifest


class StreamedReader(CheckedReader, Protocol):
    """What :func:`stored_samples` needs of a reader."""

    manifest: Manifest
    channels: int
    checks: RecordChecks

    def stored_paths(self) -> list[str] | None: ...

    def _stored_bytes(self, record: Record) -> bytes: ...


def stored_samples(
    reader: StreamedReader, start: int, stop: int, chunk: int = 256, paths: bool = True
) -> Iterator[Encoded]:
    """Samples ``start`` to ``stop`` of ``reader`` as a writer takes them, ``chunk`` records
    read at a time (each path ``""`` unless ``paths``)."""
    stored = reader.stored_paths() if paths else None
    image = reader.manifest.image
    raw = reader.manifest.encoding == "raw"
    fields = reader.manifest.fields
    for first in range(start, stop, chunk):
        indices = np.arange(first, min(stop, first + chunk), dtype=np.int64)
        for record in reader.checks.records(reader, reader._records(indices)):
            payload = reader._stored_bytes(record)
            if raw:
                kind, height, width = Kind.RAW, int(image["height"]), int(image["width"])
                channels = reader.channels
            else:
                try:
                    kind, height, width, channels = stored_info(payload)
                except DataError as exc:
                    raise DataError(f"{record.where}: sample {record.index}: {exc}") from None
            path = stored[record.index] if stored is not None else ""
            values = None
            if fields and record.fields is not None:  # as the output holds them: same bytes
                values = {
                    f.name: None if data is None else f.decode(data)
                    for f, data in zip(fields, record.fields, strict=True)
                }
            yield Encoded(path, record.label, payload, height, width, channels, kind, fields=values)
