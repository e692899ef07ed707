"""Where the records of TFRecord files are: an imgpack ``tfrecord`` output's (through its
``.idx`` files), foreign files' (a file, a folder, a glob or a list, indexed in memory when no
``.idx`` is beside them, their classes and labels found by a scan), or an output streamed from a
bucket. :class:`Records` is what :class:`~imgpack.formats.tfrecord.reader.TFRecordDataset` and
:class:`~imgpack.formats.tfrecord.stream.TFRecordStream` read through.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from imgpack.decoding import Decoder
from imgpack.errors import DataError, ManifestError, OptionError
from imgpack.fields import Field
from imgpack.formats.dataset_base import check_file_order, check_output_id
from imgpack.formats.tfrecord import example, framing
from imgpack.images import ImagePolicy, Kind
from imgpack.manifest import MANIFEST_NAME, FileEntry, Manifest
from imgpack.opening import Opened, open_manifest, open_output
from imgpack.scan import MAX_CLASSES, valid_label
from imgpack.storage.files import LocalFiles
from imgpack.storage.lazy import LazyOutput
from imgpack.storage.location import filesystem, is_url
from imgpack.system import PerProcess

if TYPE_CHECKING:
    pass

Source = str | os.PathLike[str] | list[str] | list[Path]


@dataclass
class Shard:
    """One TFRecord file and the ``(offset, size)`` of its records (none for compressed files:
    ``compression`` is ``"GZIP"`` or ``"ZLIB"`` then)."""

    path: Path
    offsets: np.ndarray
    sizes: np.ndarray
    compression: str | None = None

    @classmethod
    def indexed(cls, path: Path, index: list[tuple[int, int]]) -> Shard:
        """An uncompressed file and its ``(offset, size)`` index."""
        array = np.asarray(index, dtype=np.int64).reshape(-1, 2)
        return cls(path, array[:, 0].copy(), array[:, 1].copy())

    @property
    def compressed(self) -> bool:
        return self.compression is not None

    def __len__(self) -> int:
        return len(self.offsets)


class Records:
    """Where the records of an imgpack ``tfrecord`` output or of foreign TFRecord files are, and
    how one record becomes ``(pixels, label)``. Shared by both readers; holds no open file."""

    def __init__(
        self,
        source: Source | Opened,
        check_crc: bool = True,
        label_offset: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.check_crc = check_crc
        #: Foreign files: each field's feature key and whether it is a list of texts
        #: (:class:`ForeignFeatures`); an imgpack output's fields are features by their names.
        self.field_keys: dict[str, tuple[str, bool]] = {}
        #: An output in a bucket read lazily (opened by the route over its cache entry):
        #: shards are found through their ``.idx`` files and fetched when first read.
        self.lazy: LazyOutput | None = None
        # An output streamed from a bucket: its URL, and the filesystem this process opened
        # for it (fsspec's async filesystems are not fork-safe: each process opens its own).
        self._url: str | None = None
        self._storage_options = storage_options
        self._fs: PerProcess[tuple[Any, str]] = PerProcess()
        #: The output as opened (:func:`~imgpack.opening.open_output`); for foreign files, an
        #: :class:`~imgpack.opening.Opened` made from their scan; ``None`` for a stream.
        self.opened: Opened | None = None
        if isinstance(source, str) and is_url(source):
            self._remote(source.rstrip("/"), label_offset, storage_options)
            return
        self.opened = source if isinstance(source, Opened) else None
        paths = [] if self.opened is not None else _resolve(source)  # type: ignore[arg-type]
        if len(paths) == 1 and paths[0].is_dir() and (paths[0] / MANIFEST_NAME).is_file():
            self.opened = open_output(paths[0])  # an imgpack output: its manifest read once
        if self.opened is not None:
            self.lazy = lazy = self.opened.lazy
            self.root = self.opened.root
            self.manifest = self.opened.manifest
            if self.manifest.format != "tfrecord":
                raise ManifestError(
                    f"{self.root}: holds format {self.manifest.format!r}, not 'tfrecord'"
                )
            prefix = str(self.manifest.options.get("prefix", "data"))
            check_file_order(
                self.root, self.manifest, lambda k, n: framing.shard_file_name(prefix, k, n)
            )
            self.foreign = False
            self.shards = [
                self._shard(self.root / f.path) if lazy is None else self._indexed(f)
                for f in self.manifest.files
            ]
            for entry, shard in zip(self.manifest.files, self.shards, strict=True):
                if len(shard) != entry.num_samples and not shard.compressed:
                    raise DataError(
                        f"{shard.path}: its .idx lists {len(shard)} records, the manifest says "
                        f"{entry.num_samples}"
                    )
            self.label_offset = int(
                self.manifest.options.get("label_offset", 0)
                if label_offset is None
                else label_offset
            )
            self._labels: list[int] | None = None
            self._paths: list[str] | None = None
        else:
            self.foreign = True
            self.label_offset = label_offset or 0
            self.shards = [self._shard(p) for p in _record_files(paths)]
            self.root = self.shards[0].path.parent
            self.manifest, self._labels, self._paths = self._scan_foreign()
            self.opened = Opened(self.root, self.manifest, LocalFiles(self.root), str(self.root))
        self.channels = int(self.manifest.image.get("channels", 3))
        self.policy = ImagePolicy()

    def _remote(
        self, url: str, label_offset: int | None, storage_options: dict[str, Any] | None
    ) -> None:
        """An imgpack output in a bucket, for streaming: the manifest and the small ``.idx``
        files are read, the shards opened as streams when iterated (nothing cached)."""
        self.manifest = open_manifest(url, storage_options)[1]  # the route's, manifest only
        if self.manifest.format != "tfrecord":
            raise ManifestError(f"{url}: holds format {self.manifest.format!r}, not 'tfrecord'")
        self._url = url
        fs, base = self.remote()
        self.root = url  # type: ignore[assignment]  # messages name the URL
        self.foreign = False
        self.shards = []
        try:
            for entry in self.manifest.files:
                remote = f"{base}/{entry.path}"
                kind = framing.compression_of(fs.cat_file(remote, start=0, end=12))
                if kind is not None:
                    count = entry.num_samples
                    offsets = sizes = np.full(count, -1, np.int64)
                else:
                    name = framing.index_path(Path(entry.path)).name
                    where = f"{url}/{name}"
                    index = framing.parse_index(fs.cat_file(f"{base}/{name}").decode(), where)
                    framing.check_index(Path(entry.path), index, entry.bytes)
                    array = np.asarray(index, dtype=np.int64).reshape(-1, 2)
                    offsets, sizes = array[:, 0].copy(), array[:, 1].copy()
                    if len(index) != entry.num_samples:
                        raise DataError(
                            f"{where}: lists {len(index)} records, the manifest says "
                            f"{entry.num_samples}"
                        )
                self.shards.append(Shard(remote, offsets, sizes, kind))  # type: ignore[arg-type]
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{url}: cannot read the output: {exc}") from None
        self.label_offset = int(
            self.manifest.options.get("label_offset", 0) if label_offset is None else label_offset
        )
        self._labels = None
        self._paths = None
        self.channels = int(self.manifest.image.get("channels", 3))
        self.policy = ImagePolicy()

    def remote(self) -> tuple[Any, str]:
        """The filesystem of the bucket the output is streamed from, opened in this process,
        and the output's path in it."""
        url = self._url
        assert url is not None
        return self._fs.get(lambda fresh: filesystem(url, self._storage_options, fresh=fresh))

    def open(self, shard: Shard) -> BinaryIO:
        """``shard`` as a sequential stream of frames (decompressed; from the bucket when the
        output is streamed from one)."""
        if self.lazy is not None:  # fetched (once), then read from the cache
            name = Path(shard.path).relative_to(self.root).as_posix()
            return framing.open_records(self.lazy.local(name))
        if self._url is None:
            return framing.open_records(shard.path)
        raw = self.remote()[0].open(shard.path, "rb", block_size=8 << 20)
        return framing.open_stream(raw, shard.compression)

    @staticmethod
    def _shard(path: Path) -> Shard:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such TFRecord file")
        kind = framing.compression(path)
        if kind is not None:
            return Shard(path, np.empty(0, np.int64), np.empty(0, np.int64), compression=kind)
        index = framing.read_index(path)
        return Shard.indexed(path, framing.build_index(path) if index is None else index)

    def _indexed(self, entry: FileEntry) -> Shard:
        """Shard ``entry`` of an output read lazily, from its ``.idx`` (checked against the
        manifest's size; the file itself is checked when fetched). Without one, the shard is
        fetched now to index it."""
        assert self.lazy is not None
        path = self.root / entry.path
        index = framing.read_index(path, entry.bytes)
        return (
            self._shard(self.lazy.local(entry.path))
            if index is None
            else Shard.indexed(path, index)
        )

    def _scan_foreign(self) -> tuple[Manifest, list[int], list[str] | None]:
        """One pass over foreign files: count records (compressed ones too), build the label map and
        collect the ``image/filename`` of every record (``None`` unless every record has one)."""
        scan = ForeignScan(self.label_offset)
        for shard in self.shards:
            count = 0
            with framing.open_records(shard.path) as fh:
                for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                    where = f"{shard.path} at offset {offset}"
                    scan.add(parse(data, where), where)
                    count += 1
            if shard.compressed:
                shard.offsets = np.full(count, -1, np.int64)
                shard.sizes = np.full(count, -1, np.int64)
            elif count != len(shard):
                raise DataError(
                    f"{shard.path}: its .idx lists {len(shard)} records, the file holds {count}"
                )
        first = str(self.shards[0].path)
        classes = scan.classes(first)
        files = [FileEntry(str(s.path), s.path.stat().st_size, len(s), "") for s in self.shards]
        fields, self.field_keys = scan.fields(first)
        manifest = Manifest(
            format="tfrecord",
            num_samples=len(scan.labels),
            classes=classes,
            encoding="original",
            image={"height": None, "width": None, "channels": 3},
            files=files,
            options={"label_offset": self.label_offset, "foreign": True},
            fields=fields,
        )
        return manifest, scan.labels, scan.paths

    @property
    def labels(self) -> list[int]:
        if self._labels is None:
            self._labels = [t for n in range(len(self.shards)) for t in self.shard_labels(n)]
        return self._labels

    def shard_labels(self, number: int) -> list[int]:
        """The labels of shard ``number``'s records (that file read through alone)."""
        wanted = {number: set(range(len(self.shards[number])))}
        return [label for _, _, _, label, _ in self.iterate(wanted)]

    @property
    def paths(self) -> list[str] | None:
        """The ``image/filename`` of every record, or ``None`` unless every record has one."""
        if self._paths is None and not self.foreign:
            paths: list[str] | None = []
            for number in range(len(self.shards)):
                found = self.shard_paths(number)
                paths = None if paths is None or found is None else paths + found
            self._paths = paths
        return self._paths

    def shard_paths(self, number: int) -> list[str] | None:
        """:attr:`paths` of shard ``number``'s records alone."""
        shard = self.shards[number]
        paths: list[str] | None = []
        with self.open(shard) as fh:
            for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                paths = collect_path(paths, parse(data, f"{shard.path} at offset {offset}"))
        return paths

    def stored(self, data: memoryview, where: str) -> tuple[bytes | np.ndarray, int]:
        """``(image, label)`` of one record's data: the ``image/encoded`` bytes, or for a RAW
        record its HWC uint8 pixels (the output id and the label checked)."""
        features = self.features(data, where)
        label = self.label(features, where)
        payload, shape = stored_image(features, where)
        if shape is not None:
            return np.frombuffer(payload, np.uint8).reshape(shape), label
        return payload, label

    def decoder(self, policy: ImagePolicy | None = None, threads: int | None = None) -> Decoder:
        """The decoder of this reader's records: foreign images go through the whole image
        policy (EXIF, alpha, modes), imgpack's own are decoded as stored."""
        return Decoder(self.channels, policy, threads, self.policy if self.foreign else None)

    def features(self, data: memoryview, where: str) -> dict[str, example.FeatureValue]:
        """A record's parsed features, its output id checked."""
        features = parse(data, where)
        self.check_output(features, where)
        return features

    def label(self, features: dict[str, example.FeatureValue], where: str) -> int:
        """A record's label (``label_offset`` taken off), checked against the label map."""
        label = record_label(features, where) - self.label_offset
        if not valid_label(label, len(self.manifest.classes)):
            raise DataError(f"{where}: label {label} outside 0..{len(self.manifest.classes) - 1}")
        if not self.foreign:  # an imgpack record names its class: the label must agree
            text = features.get("image/class/text") or [b""]
            name = self.manifest.classes[label] if self.manifest.classes else ""
            if text[0] != name.encode("utf-8", "surrogateescape"):
                raise DataError(
                    f"{where}: label {label} is class {name!r} in the manifest but the record "
                    f"says {text[0]!r} (the manifest's classes or label_offset were changed)"
                )
        return label

    @cached_property
    def _ids(self) -> frozenset[str]:
        """The output ids this output's shards carry."""
        return self.manifest.output_ids

    def check_output(
        self, features: dict[str, example.FeatureValue], where: str, number: int | None = None
    ) -> None:
        """Refuse a record of another output than the manifest this reader read (the output was
        replaced meanwhile): the id shard ``number`` carries, or for a record read without its
        shard's number one of the ids the output's shards carry (more than one in an appended
        output, each shard's first record checked exactly); foreign files and outputs without
        ids are not checked."""
        if self.foreign or not self.manifest.output_id:
            return
        found = (features.get(example.OUTPUT_ID_KEY) or [b""])[0]
        if number is not None:
            expected = self.manifest.file_output_id(number)
        else:
            text = found.decode("ascii", "replace") if isinstance(found, bytes) else found
            if text in self._ids:
                return
            expected = self.manifest.output_id
        check_output_id(expected, found, where, self.root)

    def check_first(self, number: int, fd: int) -> None:
        """Check the first record of shard ``number``, open as ``fd``, for the output id."""
        if self.foreign or not self.manifest.output_id or not len(self.shards[number]):
            return
        where = f"{self.shards[number].path} at offset 0"
        head = os.pread(fd, framing.HEADER_SIZE, 0)
        length = framing.read_length(head, where, self.check_crc)
        size = framing.HEADER_SIZE + length + framing.FOOTER_SIZE
        if size > os.fstat(fd).st_size:
            raise DataError(f"{where}: truncated record")
        frame = framing.unframe(os.pread(fd, size, 0), where, self.check_crc)
        self.check_output(parse(frame, where), where, number)

    def iterate(
        self, wanted: dict[int, set[int]] | None = None
    ) -> Iterator[tuple[int, int, bytes | np.ndarray, int, str]]:
        """Read shards sequentially: ``(shard, record, image, label, where)`` of the records in
        ``wanted`` (shard -> record numbers, shards in that order), or of every record; the
        image as :meth:`stored` gives it."""
        plan = (
            wanted
            if wanted is not None
            else {n: set(range(len(s))) for n, s in enumerate(self.shards)}
        )
        for number, records in plan.items():
            shard = self.shards[number]
            first = min(records) if records and not shard.compressed else 0
            start = int(shard.offsets[first]) if first else 0
            with self.open(shard) as fh:
                if start:
                    fh.seek(start)  # skip the records this reader does not need
                frames = framing.iter_frames(fh, str(shard.path), self.check_crc, start)
                for record, (offset, data) in enumerate(frames, start=first):
                    if record in records:
                        where = f"{shard.path} at offset {offset}"
                        image, label = self.stored(data, where)
                        yield number, record, image, label, where


def stored_image(
    features: dict[str, example.FeatureValue], where: str
) -> tuple[bytes, tuple[int, int, int] | None]:
    """A record's ``image/encoded`` bytes, and their ``(height, width, channels)`` when they
    are raw pixels (``image/format`` ``RAW``)."""
    encoded = features.get("image/encoded")
    if not encoded or not isinstance(encoded[0], bytes):
        raise DataError(f"{where}: no image/encoded bytes")
    if (features.get("image/format") or [b""])[0] != Kind.RAW.value.encode():
        return encoded[0], None
    try:
        height, width, channels = (
            int(features[k][0]) for k in ("image/height", "image/width", "image/channels")
        )
    except (KeyError, IndexError, TypeError, ValueError):
        raise DataError(
            f"{where}: a RAW record needs image/height, image/width and image/channels"
        ) from None
    if len(encoded[0]) != height * width * channels:
        raise DataError(f"{where}: RAW image/encoded is not {height}x{width}x{channels} bytes")
    return encoded[0], (height, width, channels)


def tfrecord_files(source: Source) -> list[Path]:
    """The TFRecord files ``source`` names: files, folders (their ``*.tfrecord`` files) and
    globs, in order; ``FileNotFoundError`` when one names nothing."""
    return _record_files(_resolve(source))


def _resolve(source: Source) -> list[Path]:
    items = source if isinstance(source, list) else [source]
    paths: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if any(ch in text for ch in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"{text}: no file matches")
            paths.extend(Path(m) for m in matches)
        else:
            path = Path(text)
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file or folder")
            paths.append(path)
    return paths


def _record_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix in (".tfrecord", ".tfrecords")
            )
            if not found:
                raise FileNotFoundError(f"{path}: no *.tfrecord files in this folder")
            files.extend(found)
        else:
            files.append(path)
    return files


#: The features an image record's readers take for the image, its label and its name: every
#: other feature of a foreign file is a field.
IMAGE_FEATURES = frozenset(
    {
        "image/encoded", "image/format", "image/class/label", "image/class/text",
        "image/filename", "image/height", "image/width", "image/channels", "image/colorspace",
        example.OUTPUT_ID_KEY,
    }
)  # fmt: skip


@dataclass
class ForeignFeature:
    """What the records of foreign files hold under one feature key."""

    kinds: set[str] = field(default_factory=set)  # "bytes", "int", "float"
    records: int = 0
    single: bool = True  # every record with it holds one value
    text: bool = True  # every bytes value is UTF-8


class ForeignFeatures:
    """The features beyond :data:`IMAGE_FEATURES` foreign records hold, gathered as they are
    scanned, and the fields they make (:meth:`fields`)."""

    def __init__(self) -> None:
        self.seen: dict[str, ForeignFeature] = {}

    def add(self, features: dict[str, example.FeatureValue]) -> None:
        for key, values in features.items():
            if key in IMAGE_FEATURES:
                continue
            found = self.seen.setdefault(key, ForeignFeature())
            found.records += 1
            found.single &= len(values) == 1
            for value in values[:1]:
                kind = (
                    "bytes"
                    if isinstance(value, bytes)
                    else "int"
                    if isinstance(value, int)
                    else "float"
                )
                found.kinds.add(kind)
            if found.text and values and isinstance(values[0], bytes):
                try:
                    for value in values:
                        bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    found.text = False

    def fields(self, count: int, where: str) -> tuple[list[Field], dict[str, tuple[str, bool]]]:
        """The fields (in key order) and, by field name, its feature key and whether its values
        are a list of texts (kept as a JSON list). A key becomes a name with every character
        but letters, digits and ``_`` made ``_`` (``image/object/bbox/xmin`` ->
        ``image_object_bbox_xmin``)."""
        fields: list[Field] = []
        keys: dict[str, tuple[str, bool]] = {}
        for key in sorted(self.seen):
            found = self.seen[key]
            name = re.sub(r"[^A-Za-z0-9_]", "_", key)
            name = name if name[:1].isalpha() else f"f_{name}"
            kinds = found.kinds or {"int"}  # only empty lists: an empty int[]
            if len(kinds) > 1 or name in keys:
                raise DataError(
                    f"{where}: feature {key!r} holds {' and '.join(sorted(kinds))} values in "
                    "different records"
                    if len(kinds) > 1
                    else f"{where}: features {key!r} and "
                    f"{keys[name][0]!r} would be one field {name!r}"
                )
            (kind,) = kinds
            many = not found.single or not found.kinds
            text_list = False
            if kind == "bytes":
                kind = ("json" if many else "str") if found.text else "bytes"
                text_list = many and found.text
                if many and not found.text:
                    raise DataError(
                        f"{where}: feature {key!r} holds lists of bytes that are not text, which "
                        "no field type holds"
                    )
            elif many:
                kind += "[]"
            try:
                fields.append(Field(name, kind, optional=found.records < count))
            except OptionError as exc:
                raise DataError(f"{where}: feature {key!r} cannot be a field: {exc}") from None
            keys[name] = (key, text_list)
        return fields, keys


class ForeignScan:
    """What the scan of foreign TFRecord files gathers, record after record in file order
    (:meth:`add`): the labels (``label_offset`` taken off), the class names
    (``image/class/text``), every record's ``image/filename`` (``None`` once one lacks it) and
    the other features, which make the fields. Local files and files read in place in a bucket
    (:mod:`imgpack.sources.tfrecord`) are scanned by it alike."""

    def __init__(self, label_offset: int = 0) -> None:
        self.label_offset = label_offset
        self.labels: list[int] = []
        self.paths: list[str] | None = []
        self.names: dict[int, str] = {}
        self.others = ForeignFeatures()

    def add(self, features: dict[str, example.FeatureValue], where: str) -> None:
        """Take one record's features (``where``: its file and offset, for errors)."""
        self.others.add(features)
        label = record_label(features, where) - self.label_offset
        self.labels.append(label)
        text = features.get("image/class/text")
        if text and isinstance(text[0], bytes):
            self.names.setdefault(label, text[0].decode("utf-8", "replace"))
        self.paths = collect_path(self.paths, features)

    def classes(self, where: str) -> list[str]:
        """The label map (a label without a name is named by its number); the labels checked
        (``where``: the first file)."""
        labels = self.labels
        if not labels:
            raise DataError(f"{where}: no records")
        if min(labels) < 0:
            raise DataError(
                f"label {min(labels)} is negative (is label_offset={self.label_offset} right?)"
            )
        if max(labels) >= MAX_CLASSES:
            raise DataError(
                f"{where}: label {max(labels)} is beyond the {MAX_CLASSES:,} classes "
                f"imgpack takes (is label_offset={self.label_offset} right?)"
            )
        return [self.names.get(i, str(i)) for i in range(max(labels) + 1)]

    def fields(self, where: str) -> tuple[list[Field], dict[str, tuple[str, bool]]]:
        """:meth:`ForeignFeatures.fields` of every record taken."""
        return self.others.fields(len(self.labels), where)


def field_data(
    found: Field,
    features: dict[str, example.FeatureValue],
    keys: dict[str, tuple[str, bool]],
    where: str,
) -> bytes | None:
    """Field ``found``'s stored bytes from a record's features (a foreign file's under its
    feature key in ``keys``, :meth:`ForeignFeatures.fields`; a list of texts as a JSON list)."""
    key, text_list = keys.get(found.name, (found.name, False))
    feature = features.get(key)
    if text_list and feature is not None:
        texts = [bytes(v).decode("utf-8") for v in feature]  # type: ignore[arg-type]
        return found.encode(texts)
    if feature is not None and not feature and found.type in ("int", "float", "str"):
        feature = None  # an empty list: no value
    return example.field_stored(found, feature, where)


def parse(data: memoryview, where: str) -> dict[str, example.FeatureValue]:
    try:
        return example.decode_example(data)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def collect_path(
    paths: list[str] | None, features: dict[str, example.FeatureValue]
) -> list[str] | None:
    """``paths`` with this record's ``image/filename`` added, or ``None`` once one lacks it."""
    value = features.get("image/filename")
    if paths is None or not value or not isinstance(value[0], bytes):
        return None
    paths.append(value[0].decode("utf-8", "surrogateescape"))
    return paths


def record_label(features: dict[str, example.FeatureValue], where: str) -> int:
    value = features.get("image/class/label")
    if not value or not isinstance(value[0], int):
        raise DataError(f"{where}: no image/class/label")
    return value[0]
