"""What a source scan produces: the ordered samples and the label map (below every source kind,
the engine and the executors, which all pass them around)."""

from __future__ import annotations

import copy
import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from imgpack.fields import Field

T = TypeVar("T")

#: Extensions (lower case) of files an image folder's scan picks up as images.
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".pgm",
    ".pbm",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".webp",
)

#: The label of a sample that has none (an unlabelled source: ``classes == []``).
UNLABELLED = -1
#: The most classes a source's integer labels may imply (its label map is ``0..max label``):
#: a label beyond it is refused by its row, never a label map of billions of names.
MAX_CLASSES = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One image of the source: its path relative to the source root (POSIX; for some sources
    a name the source gives it) and its label."""

    path: str
    label: int
    #: Where the source finds the sample again when it is not a file under the root: an index
    #: into an imgpack output or TFRecord files, a row of a dataset, a line of a label list,
    #: the offset of its first member in a tar in a bucket.
    index: int = -1
    #: A bucket object's content as the listing named it (:func:`listed_id` of its ETag or
    #: version; 0: not known): the worker that GETs it refuses another content.
    listed: int = field(default=0, compare=False)
    #: The values of the fields the scan found for it (a label list's other columns), by
    #: name; ``None`` where the source has none or reads them with the image.
    fields: Mapping[str, Any] | None = field(default=None, compare=False)
    #: The bytes of its image as SRC holds it, where the scan found them (a listed object, a
    #: stat'ed file, a tar member's header); ``-1``: not known (the shard plan asks the source,
    #: :meth:`~imgpack.sources.base.Source.stored_size`).
    size: int = field(default=-1, compare=False)
    #: Bytes the source reads the sample from, starting at :attr:`index`, where the sample is
    #: a stretch of a larger object (a tar in a bucket: its members, headers included); ``0``:
    #: not such a sample.
    span: int = field(default=0, compare=False)


def listed_id(etag: str) -> int:
    """A 63-bit number for a listed ETag or version (0 for none): what a sample carries to the
    worker that reads it, 8 bytes instead of the string."""
    if not etag:
        return 0
    return int.from_bytes(hashlib.sha256(etag.encode("utf-8")).digest()[:8], "big") >> 1 or 1


class Packed(Sequence[T]):
    """A sequence of records held packed (arrays, one buffer of text) and made as they are
    asked for: a subclass gives its length and :meth:`_item`; a slice is a list of records.
    Equal to any sequence of the same records."""

    def _item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._item(index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class Distinct:
    """Label values, each kept once in the order first seen (:attr:`values`), and the position
    of each: what millions of samples with a few distinct values hold instead of a value
    each. ``3`` and ``"3"`` are two values (as :func:`~imgpack.sources.base.label_map` sees
    them); a value that cannot be hashed (a JSON list or object) is kept each time."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._at: dict[tuple[type, Any], int] = {}

    def index(self, value: Any) -> int:
        """The position of ``value`` in :attr:`values` (added if new)."""
        try:
            key = (type(value), value)
            at = self._at.get(key)
            if at is None:
                at = self._at[key] = len(self.values)
                self.values.append(value)
            return at
        except TypeError:
            self.values.append(value)
            return len(self.values) - 1


class SampleTable(Packed[Sample]):
    """A source's samples, packed: their paths in one buffer, their labels, indices, sizes and
    spans in arrays — about 75 bytes per sample where :class:`Sample` objects take 280 — so
    that a driver holds the scan of millions of images, whatever the source kind. The fields a
    scan found (:attr:`Sample.fields`) are held as one column per field (:meth:`set_columns`)
    or, where each sample has its own, one mapping per sample. Indexing gives :class:`Sample`
    objects (a slice: a list of them)."""

    def __init__(self) -> None:
        self._paths = bytearray()
        self._ends = array("q")
        self._labels = array("i")
        self._index = array("q")
        self._sizes = array("q")
        self._listed = array("q")
        self._spans = array("q")
        #: Each sample's fields, where they were given one by one (else ``None``).
        self._fields: list[Mapping[str, Any] | None] | None = None
        #: The fields' values as columns, where they were given so (else ``None``).
        self._columns: dict[str, Sequence[Any]] | None = None

    def extend(
        self,
        paths: Iterable[str],
        label: int,
        sizes: Iterable[int] | None = None,
        listed: Iterable[int] | None = None,
    ) -> None:
        """Append ``paths`` with ``label`` (and their source sizes in bytes, else unknown; and
        what the listing said of their content, :attr:`Sample.listed`)."""
        sizes = iter(sizes) if sizes is not None else None
        listed = iter(listed) if listed is not None else None
        if self._columns is not None or self._fields is not None:
            raise ValueError("samples with fields are added one by one")
        for path in paths:  # (inline: an image folder's scan adds millions)
            self._paths += path.encode("utf-8", "surrogateescape")
            self._ends.append(len(self._paths))
            self._labels.append(label)
            self._index.append(-1)
            self._sizes.append(next(sizes) if sizes is not None else -1)
            self._listed.append(next(listed) if listed is not None else 0)
            self._spans.append(0)

    def add(
        self,
        path: str,
        label: int,
        index: int = -1,
        listed: int = 0,
        fields: Mapping[str, Any] | None = None,
        size: int = -1,
        span: int = 0,
    ) -> None:
        """Append one sample (the arguments of :class:`Sample`)."""
        if self._columns is not None:
            raise ValueError("a table whose fields are columns takes no more samples")
        if fields is not None and self._fields is None:
            self._fields = [None] * len(self)
        self._paths += path.encode("utf-8", "surrogateescape")
        self._ends.append(len(self._paths))
        self._labels.append(label)
        self._index.append(index)
        self._sizes.append(size)
        self._listed.append(listed)
        self._spans.append(span)
        if self._fields is not None:
            self._fields.append(fields)

    def append(self, sample: Sample) -> None:
        """Append ``sample``, every attribute of it."""
        self.add(
            sample.path,
            sample.label,
            sample.index,
            sample.listed,
            sample.fields,
            sample.size,
            sample.span,
        )

    def set_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Give every sample its fields from ``columns`` (one value per sample, by field
        name, in the samples' order); nothing where ``columns`` is empty."""
        if not columns:
            return
        if self._fields is not None or any(len(c) != len(self) for c in columns.values()):
            raise ValueError("the columns must give each sample of the table its fields")
        self._columns = dict(columns)

    def __len__(self) -> int:
        return len(self._ends)

    def _item(self, i: int) -> Sample:
        start = self._ends[i - 1] if i else 0
        path = self._paths[start : self._ends[i]].decode("utf-8", "surrogateescape")
        fields: Mapping[str, Any] | None = None
        if self._columns is not None:
            fields = {name: column[i] for name, column in self._columns.items()}
        elif self._fields is not None:
            fields = self._fields[i]
        return Sample(
            path,
            self._labels[i],
            self._index[i],
            listed=self._listed[i],
            fields=fields,
            size=self._sizes[i],
            span=self._spans[i],
        )

    def size(self, index: int) -> int:
        """The source size in bytes of sample ``index`` as listed, ``-1`` when not known."""
        return self._sizes[index]

    def labels(self) -> list[int]:
        """Every sample's label, in order (without making its :class:`Sample`)."""
        return self._labels.tolist()

    def relabelled(self, mapping: Sequence[int]) -> SampleTable:
        """These samples with each label ``k`` made ``mapping[k]`` (:data:`UNLABELLED` kept);
        the rest is shared with this table (a scan's table takes no samples once made)."""
        other = copy.copy(self)
        other._labels = array("i", (v if v == UNLABELLED else mapping[v] for v in self._labels))
        return other

    def placed(self, spots: Iterable[tuple[int, int, int]]) -> SampleTable:
        """These samples each given ``(index, span, listed)`` from ``spots`` (one per sample,
        in order): where a source finds them in the objects it reads (the rest shared, as
        :meth:`relabelled` shares it)."""
        other = copy.copy(self)
        other._index, other._spans, other._listed = array("q"), array("q"), array("q")
        for index, span, listed in spots:
            other._index.append(index)
            other._spans.append(span)
            other._listed.append(listed)
        if len(other._index) != len(self):
            raise ValueError("one spot for each sample")
        return other


@dataclass
class Scan:
    """What a source's scan found, in the order the output keeps."""

    classes: list[str]
    samples: Sequence[Sample]
    empty_classes: list[str] = field(default_factory=list)
    ignored_files: int = 0
    #: The files passed over, ``{"path": ..., "reason": ...}`` (hidden, not an image, ...):
    #: with :attr:`samples` and :attr:`unreadable`, every file the scan saw.
    ignored: list[dict[str, str]] = field(default_factory=list)
    #: What the scan could not take (folders it could not list, bad rows of a label list):
    #: ``{"path": ..., "reason": ...}``, recorded as skipped.
    unreadable: list[dict[str, str]] = field(default_factory=list)
    #: When SRC is not an image folder: what the manifest records of it (its format, output id,
    #: its own source), which also goes into the output id.
    origin: dict[str, Any] | None = None
    #: The per-sample fields the source offers beyond the image and the label
    #: (:mod:`imgpack.fields`), in the order the output keeps them.
    fields: list[Field] = field(default_factory=list)
    #: The names of every field the source has, kept or not (``--fields`` names some): what
    #: an unknown name is told; empty: those of :attr:`fields`.
    field_names: list[str] = field(default_factory=list)

    def ignored_reasons(self) -> dict[str, int]:
        """How many files the scan passed over, by why."""
        return by_reason(self.ignored)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.classes)}


def by_reason(entries: Iterable[dict[str, str]]) -> dict[str, int]:
    """How many of ``entries`` (``{"path", "reason"}``) there are for each reason."""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["reason"]] = counts.get(entry["reason"], 0) + 1
    return counts


def ignored_summary(count: int, reasons: dict[str, int] | None) -> str:
    """``N other file(s) ignored`` with how many for each reason, when known (a manifest made
    before imgpack recorded them has the count only)."""
    text = f"{count} other file(s) ignored"
    if reasons:
        text += " (" + "; ".join(f"{n} {why}" for why, n in sorted(reasons.items())) + ")"
    return text


def valid_label(label: int, num_classes: int) -> bool:
    """Whether ``label`` is a label of an output with ``num_classes`` classes: ``0..n-1``, or
    :data:`UNLABELLED` when the output has no classes."""
    return 0 <= label < num_classes if num_classes else label == UNLABELLED


@dataclass(frozen=True)
class ShardScan:
    """What :meth:`~imgpack.formats.dataset_base.ImageDataset.shard_scan` reads of one data file's samples, in order."""

    targets: list[int]
    #: The stored source paths, ``None`` where the file stores none.
    paths: list[str] | None
    sizes: list[int]
    #: Each field asked for: its values' stored bytes (:meth:`~imgpack.formats.dataset_base.ImageDataset.stored_field`).
    fields: dict[str, list[bytes | None]]


def joined_paths(
    parts: Iterable[list[str] | None],
) -> list[str] | None:
    """Shards' stored paths joined into the output's: ``None`` where a shard stores none."""
    paths: list[str] = []
    for part in parts:
        if part is None:
            return None
        paths += part
    return paths
