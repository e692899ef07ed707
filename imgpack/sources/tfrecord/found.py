"""What the scan of one TFRecord file found: each record's place and the features the
conversion takes of it (:class:`Record`), packed in a :class:`RecordTable` so that the driver
holds the scans of millions of records while it plans (about 70 bytes a record where a
:class:`Record` and its features took 650)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any, NamedTuple

from imgpack.scan import Distinct, Packed

#: The features a record's scan keeps beside its fields': its label, its class's name, its
#: file name (:class:`~imgpack.formats.tfrecord.records.ForeignScan` reads them).
LABEL, TEXT, NAME = "image/class/label", "image/class/text", "image/filename"
SCANNED = frozenset({LABEL, TEXT, NAME})


class Record(NamedTuple):
    """One record of a file, as its scan found it."""

    #: Where its frame starts in the file (uncompressed; in a compressed file, in its stream).
    offset: int
    #: Its frame's bytes, length and CRCs included.
    framed: int
    #: Its ``image/encoded`` bytes (``-1``: none).
    payload: int
    #: What :class:`~imgpack.formats.tfrecord.records.ForeignScan` takes of its features.
    features: dict[str, Any]

    @property
    def end(self) -> int:
        return self.offset + self.framed


class FileScan(NamedTuple):
    """One file, as its scan read it through."""

    #: ``"GZIP"`` or ``"ZLIB"`` for a compressed file, else ``""``.
    compression: str
    records: RecordTable


class RecordTable(Packed[Record]):
    """One file's :class:`Record` objects, packed: places and sizes in arrays, and of the
    usual record (one integer label, at most one class name and one file name, no other
    feature) its label in an array, its class name kept once (a position), its file name in
    one buffer; any other record's features kept as they were found. Indexing gives
    :class:`Record` objects, made as they are asked for; pickled small (a scan task's
    result)."""

    def __init__(self, records: Iterable[Record] = ()) -> None:
        self._offsets = array("q")
        self._framed = array("q")
        self._payloads = array("q")
        self._labels = array("q")
        self._texts = Distinct()
        self._text_at = array("i")  # -1: none
        self._names = bytearray()
        self._name_ends = array("q")
        self._named = bytearray()  # 1: it has a file name
        #: The features of each record that is not the usual one, by its place.
        self._odd: dict[int, dict[str, Any]] = {}
        for record in records:
            self.append(record)

    def append(self, record: Record) -> None:
        self._offsets.append(record.offset)
        self._framed.append(record.framed)
        self._payloads.append(record.payload)
        features = record.features
        label, text, name = (features.get(key) for key in (LABEL, TEXT, NAME))
        usual = (
            features.keys() <= SCANNED
            and _one(label, int)
            and (text is None or _one(text, bytes))
            and (name is None or _one(name, bytes))
        )
        if not usual:
            self._odd[len(self._labels)] = features
        self._labels.append(label[0] if usual and label else 0)
        self._text_at.append(self._texts.index(text[0]) if usual and text else -1)
        if usual and name:
            self._names += name[0]
        self._name_ends.append(len(self._names))
        self._named.append(1 if usual and name else 0)

    def __len__(self) -> int:
        return len(self._offsets)

    def _item(self, i: int) -> Record:
        features = self._odd.get(i)
        if features is None:
            features = {LABEL: [self._labels[i]]}
            if self._text_at[i] >= 0:
                features[TEXT] = [self._texts.values[self._text_at[i]]]
            if self._named[i]:
                start = self._name_ends[i - 1] if i else 0
                features[NAME] = [bytes(self._names[start : self._name_ends[i]])]
        return Record(self._offsets[i], self._framed[i], self._payloads[i], features)


def _one(values: Any, kind: type) -> bool:
    """Whether a feature's ``values`` are one value of exactly ``kind`` (a list, as the
    records' features are)."""
    return isinstance(values, list) and len(values) == 1 and type(values[0]) is kind
