"""The verify policy of a reader: which records are checked against their checksums, when.

``verify=True`` checks every record as it is read; ``False`` never; the default (``None``)
checks every encoded record as it is read (those reads are bound by the image decode) and every
raw record **the first time** the reader reads it, marked in a bitmap shared with the
DataLoader workers forked from the process that opened the reader (so the first epoch pays the
checksums and later ones a bitmap lookup per batch). :class:`RecordChecks` is that policy and
its marks; a reader asks it what to check and gives itself (:class:`CheckedReader`) to be
checked. It keeps no reference to the reader: a dropped reader is freed at once.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from imgpack.checksum import record_crc, record_crcs, records_intact
from imgpack.decoding import Payload
from imgpack.errors import DataError
from imgpack.fields import extend_crc


@dataclass(frozen=True)
class Record:
    """One stored record as a reader's ``_records`` yields it."""

    index: int
    payload: Any  # the stored bytes (bytes or a buffer)
    label: int
    crc: int | None  # the stored checksum; None where the output stores none
    where: str  # the file (and position) holding it, for messages
    #: The stored bytes of its fields in the manifest's order (``None``: absent), which its
    #: checksum covers (:func:`imgpack.fields.extend_crc`); ``None``: the output has none.
    fields: Sequence[bytes | None] | None = None


class CheckedReader(Protocol):
    """What :class:`RecordChecks` needs of the reader it checks."""

    root: Path

    def _records(self, indices: np.ndarray) -> Iterator[Record]: ...

    def _raw_rows(
        self, indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None: ...

    def _source(self, index: int) -> str: ...


def shared_marks(count: int) -> np.ndarray:
    """``count`` zero bytes in an anonymous shared mapping (what forked workers share)."""
    return np.frombuffer(mmap.mmap(-1, max(1, count)), np.uint8)


class RecordChecks:
    """One reader's verify policy over ``count`` records of an output of ``encoding``.

    ``every``: whether every read is checked (``verify=True``, or the default on an encoded
    output); ``once``: whether raw records are checked once each (the default on a raw output;
    the marks are made now, so that workers forked later share them, and made again in a
    spawned one)."""

    def __init__(
        self, verify: bool | None, encoding: str, count: int, fields: bool = False
    ) -> None:
        self.every: bool = encoding != "raw" if verify is None else bool(verify)
        self.once: bool = verify is None and encoding == "raw"
        self._raw = encoding == "raw"
        #: Whether records carry fields: their checksums then cover the fields' bytes, which a
        #: gather of pixels does not hold, so raw records are checked record by record.
        self._fields = fields
        self._count = count
        self._seen: np.ndarray | None = shared_marks(count) if self.once else None
        #: Whether this process saw every mark set (marks are only ever set: it stays so).
        self._complete = False
        #: Samples asked about since the marks were last scanned whole.
        self._asked = 0

    def __getstate__(self) -> dict[str, Any]:  # a spawned process marks its own
        return {**self.__dict__, "_seen": None, "_complete": False, "_asked": 0}

    def all(self, reader: CheckedReader, chunk: int = 4096) -> None:
        """Check every record against its checksum (raising :class:`DataError` at the first
        damaged one), without decoding: what ``merge`` does with the shards it links."""
        for first in range(0, self._count, chunk):
            self.rows(reader, np.arange(first, min(self._count, first + chunk), dtype=np.int64))

    def marks(self) -> np.ndarray | None:
        """The bitmap of records checked (1 a checked record) where raw records are checked
        once each; ``None`` otherwise."""
        if not self.once:
            return None
        if self._seen is None:
            self._seen = shared_marks(self._count)
        return self._seen

    def unchecked(self, indices: np.ndarray) -> bool:
        """Whether raw records ``indices`` are to be checked now: always when every read is;
        by default when one of them was not checked yet."""
        if self.every:
            return True
        if self._complete:  # every record checked: no lookup at all
            return False
        seen = self.marks()
        if seen is None or not len(indices):
            return False
        if not seen[indices].all():
            return True
        self._note_checked(seen, len(indices))
        return False

    def _note_checked(self, seen: np.ndarray, asked: int) -> None:
        """A batch of ``asked`` records was found checked: once as many have been asked about
        as there are records (an epoch, or a subset read again and again), the marks are
        scanned whole, so that a reader whose every record is checked stops looking them up
        (one scan per ``count`` records read at most)."""
        self._asked += asked
        if self._asked >= self._count:
            self._asked = 0
            self._complete = bool(seen.all())

    def raw(self, reader: CheckedReader, indices: np.ndarray) -> None:
        """Check raw records ``indices`` before they are gathered: all of them when every read
        is checked; by default those not checked yet (then marked)."""
        if self.every:
            self.rows(reader, indices)
            return
        if self._complete:
            return
        seen = self.marks()
        if seen is None or not len(indices):
            return
        marks = seen[indices]
        if marks.all():  # every epoch after the first: one gather of 1-byte marks
            self._note_checked(seen, len(indices))
            return
        fresh = np.unique(indices[marks == 0])
        self.rows(reader, fresh)
        seen[fresh] = 1

    def gathered(
        self,
        reader: CheckedReader,
        indices: np.ndarray,
        rows: np.ndarray,
        labels: np.ndarray,
        crcs: np.ndarray | None,
    ) -> None:
        """Check raw records ``indices`` just gathered: ``rows`` their payloads ``(n, bytes)``
        as gathered for the batch (the pixels themselves in ``pt`` and ``hdf5``), their labels
        and stored checksums, in batch order. The bytes checked are the bytes returned, all at
        once (:func:`~imgpack.checksum.records_intact`) and gathered once; a mismatch goes to
        the record path, which names the record. Marked checked as :meth:`raw` marks them
        (call when :meth:`unchecked` says so)."""
        if crcs is None or self._fields:  # the record path compares what the rows lack
            self.raw(reader, indices)
            return
        if not records_intact(rows, labels, crcs):
            self.each(reader, np.unique(indices))  # names the damaged record
            head = ", ".join(map(str, indices[:8].tolist())) + (", ..." if len(indices) > 8 else "")
            raise DataError(
                f"{reader.root}: samples {head}: a checksum does not match "
                "('imgpack verify' names the damaged file)"
            )
        seen = None if self.every else self.marks()
        if seen is not None:
            seen[indices] = 1

    def rows(self, reader: CheckedReader, indices: np.ndarray) -> None:
        """Check records ``indices``: raw ones in one pass where the reader gathers them
        (its ``_raw_rows``), others record by record."""
        rows = reader._raw_rows(indices) if self._raw and not self._fields else None
        if rows is None:
            self.each(reader, indices)
            return
        pixels, labels, crcs = rows
        if records_intact(pixels, labels, crcs):  # all of them at once, the usual case
            return
        found = np.asarray(record_crcs(pixels, labels.tolist()), np.int64)
        bad = indices[found != crcs]
        if bad.size:  # the record path names the file, the sample and its source
            self.each(reader, bad)
            raise DataError(f"{reader.root}: sample {int(bad[0])}: checksum mismatch")

    def each(self, reader: CheckedReader, indices: np.ndarray) -> None:
        """Check records ``indices`` one by one; the first damaged one raises
        :class:`DataError` naming it."""
        for _ in self.records(reader, reader._records(indices)):
            pass

    def records(self, reader: CheckedReader, records: Iterator[Record]) -> Iterator[Record]:
        """``records``, each checked against its stored checksum (:mod:`imgpack.checksum`)."""
        for record in records:
            self.record(
                reader,
                record.index,
                record.payload,
                record.label,
                record.crc,
                record.where,
                record.fields,
            )
            yield record

    @staticmethod
    def record(
        reader: CheckedReader,
        index: int,
        payload: Payload,
        label: int,
        crc: int | None,
        where: str,
        fields: Sequence[bytes | None] | None = None,
    ) -> None:
        """Sample ``index``'s stored bytes, label and fields' bytes against its stored
        checksum (``None``: an output written without one); :class:`DataError` naming it when
        they differ."""
        if crc is None:
            return
        found = record_crc(payload, label)
        if fields is not None:
            found = extend_crc(found, fields)
        if found != crc:
            raise DataError(
                f"{where}: sample {index}{reader._source(index)}: checksum mismatch (damaged record)"
            )
