"""The map-style reader of TFRecord files: imgpack's ``tfrecord`` outputs and
``tf.train.Example`` files written by other tools (layout in ``docs/formats/framing.md``).

:class:`Records` knows where the records are and how one becomes ``(pixels, label)``; it serves
:class:`TFRecordDataset` (random access through the ``.idx`` files, or an index built in memory,
CRCs checked by default) and :class:`~imgpack.formats.framing.stream.TFRecordStream`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import google_crc32c
import numpy as np
import torch

from imgpack.checksum import crcs_intact
from imgpack.decoding import Decoder
from imgpack.errors import DataError, ManifestError
from imgpack.formats.dataset_base import (
    Images,
    PreadDataset,
    ReadOptions,
    Record,
    byte_rows,
    check_file_order,
    check_output_id,
    label_tensor,
    new_batch_tensor,
    readonly_tensor,
    take_windows,
)
from imgpack.formats.tfrecord import example, framing
from imgpack.formats.tfrecord.example import example_features
from imgpack.images import Encoded, ImagePolicy, Kind, stored_info
from imgpack.lazy import LazyOutput
from imgpack.manifest import MANIFEST_NAME, FileEntry, Manifest
from imgpack.opening import LocalFiles, Opened, open_output
from imgpack.scan import MAX_CLASSES, valid_label
from imgpack.storage import filesystem, is_url, read_remote_manifest

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
        lazy: LazyOutput | None = None,
    ) -> None:
        self.check_crc = check_crc
        #: An output in a bucket read lazily (``source`` is its cache entry): shards are
        #: found through their ``.idx`` files and fetched when first read.
        self.lazy = lazy
        # An output streamed from a bucket: its URL, and the filesystem this process opened
        # for it (fsspec's async filesystems are not fork-safe: each process opens its own).
        self._url: str | None = None
        self._storage_options = storage_options
        self._fs: Any = None
        self._fs_pid: int | None = None
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
        self.manifest = read_remote_manifest(url, storage_options)[0]
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
        assert self._url is not None
        if self._fs is None or self._fs_pid != os.getpid():
            fresh = self._fs_pid is not None  # a forked copy must not reuse the parent's loop
            self._fs, self._base = filesystem(self._url, self._storage_options, fresh=fresh)
            self._fs_pid = os.getpid()
        return self._fs, self._base

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = state["_fs_pid"] = None  # opened again where it is used
        return state

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
        labels: list[int] = []
        paths: list[str] | None = []
        names: dict[int, str] = {}
        for shard in self.shards:
            count = 0
            with framing.open_records(shard.path) as fh:
                for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                    features = _parse(data, f"{shard.path} at offset {offset}")
                    label = _label(features, f"{shard.path} at offset {offset}") - self.label_offset
                    labels.append(label)
                    text = features.get("image/class/text")
                    if text and isinstance(text[0], bytes):
                        names.setdefault(label, text[0].decode("utf-8", "replace"))
                    paths = _collect_path(paths, features)
                    count += 1
            if shard.compressed:
                shard.offsets = np.full(count, -1, np.int64)
                shard.sizes = np.full(count, -1, np.int64)
            elif count != len(shard):
                raise DataError(
                    f"{shard.path}: its .idx lists {len(shard)} records, the file holds {count}"
                )
        if not labels:
            raise DataError(f"{self.shards[0].path}: no records")
        if min(labels) < 0:
            raise DataError(
                f"label {min(labels)} is negative (is label_offset={self.label_offset} right?)"
            )
        if max(labels) >= MAX_CLASSES:
            raise DataError(
                f"{self.shards[0].path}: label {max(labels)} is beyond the {MAX_CLASSES:,} classes "
                f"imgpack takes (is label_offset={self.label_offset} right?)"
            )
        classes = [names.get(i, str(i)) for i in range(max(labels) + 1)]
        files = [FileEntry(str(s.path), s.path.stat().st_size, len(s), "") for s in self.shards]
        manifest = Manifest(
            format="tfrecord",
            num_samples=len(labels),
            classes=classes,
            encoding="original",
            image={"height": None, "width": None, "channels": 3},
            files=files,
            options={"label_offset": self.label_offset, "foreign": True},
        )
        return manifest, labels, paths

    @property
    def labels(self) -> list[int]:
        if self._labels is None:
            self._labels = [label for _, _, _, label, _ in self.iterate()]
        return self._labels

    @property
    def paths(self) -> list[str] | None:
        """The ``image/filename`` of every record, or ``None`` unless every record has one."""
        if self._paths is None and not self.foreign:
            paths: list[str] | None = []
            for shard in self.shards:
                with self.open(shard) as fh:
                    for offset, data in framing.iter_frames(fh, str(shard.path), self.check_crc):
                        paths = _collect_path(
                            paths, _parse(data, f"{shard.path} at offset {offset}")
                        )
            self._paths = paths
        return self._paths

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
        features = _parse(data, where)
        self.check_output(features, where)
        return features

    def label(self, features: dict[str, example.FeatureValue], where: str) -> int:
        """A record's label (``label_offset`` taken off), checked against the label map."""
        label = _label(features, where) - self.label_offset
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

    def check_output(self, features: dict[str, example.FeatureValue], where: str) -> None:
        """Refuse a record of another output than the manifest this reader read (the output was
        replaced meanwhile); foreign files and outputs without ids are not checked."""
        if not self.foreign and self.manifest.output_id:
            found = features.get(example.OUTPUT_ID_KEY) or [b""]
            check_output_id(self.manifest.output_id, found[0], where, self.root)

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
        self.check_output(_parse(frame, where), where)

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


class RawLayout:
    """The exact bytes of a raw record of one imgpack output, but its pixels and file name.

    imgpack writes its records with their keys in order and every value but ``image/encoded``
    and ``image/filename`` fixed by the output (the label and class text by the class). So a
    record is one of the output's :attr:`heads` (Example header aside, everything up to the
    pixels: channels, label, class text, colorspace, the pixels' field header), then the
    pixels, a file name entry, then the output's :attr:`tail` (format, height, width, output
    id). :meth:`find` checks a record against that with a few byte comparisons instead of
    parsing it; a record that does not match (TensorFlow rewrote it, another tool wrote it)
    goes through the generic Example parser, so both read the same records the same way.
    """

    _FILENAME = b"\x0a\x0eimage/filename\x12"  # an entry's key field, then its value's tag

    def __init__(self, manifest: Manifest, label_offset: int) -> None:
        image = manifest.image
        self.shape = (int(image["height"]), int(image["width"]), int(image.get("channels", 3)))
        self.size = int(np.prod(self.shape))
        self.label_offset = label_offset
        self.heads: list[bytes] = []
        label_positions = set()
        tail = b""
        for label, name in enumerate(manifest.classes):
            sample = Encoded("", label, b"", *self.shape, Kind.RAW)
            features = example_features(sample, name, label_offset, manifest.output_id)
            keys = sorted(features)
            if keys.index("image/encoded") + 1 != keys.index("image/filename"):
                raise ValueError("unexpected key order")  # never: the writer's keys
            before = keys[: keys.index("image/encoded")]
            entries = {k: example.encode_entry(k, features[k]) for k in before}
            head = b"".join(entries.values())
            self.heads.append(head + example.bytes_entry_head("image/encoded", self.size))
            label_entry = entries["image/class/label"]  # ends with the label's varint
            value = example.encode_varint(label + label_offset)
            label_positions.add(head.index(label_entry) + len(label_entry) - len(value))
            after = keys[keys.index("image/filename") + 1 :]
            tail = b"".join(example.encode_entry(k, features[k]) for k in after)
        if len(label_positions) > 1:
            raise ValueError("labels at different positions")
        self.label_at = label_positions.pop() if label_positions else 0
        self._heads_array: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.tail = tail
        self._tail = np.frombuffer(tail, np.uint8)
        self._name = np.frombuffer(self._FILENAME, np.uint8)

    def match(
        self, data: np.ndarray | torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Check framed records (at ``offsets``, of ``sizes`` bytes, in the file ``data``) against
        this layout, all at once: ``(matches, labels, pixel starts)``. The frame's length field
        is checked here, its CRCs are not (the caller checks them). A record that does not
        match goes through the generic parser."""
        if isinstance(data, np.ndarray):
            data = readonly_tensor(data)
        ok = (sizes >= 18) & (offsets >= 0) & (offsets + sizes <= len(data))
        offsets = np.where(ok, offsets, 0)
        sizes = np.where(ok, sizes, 18)
        end = offsets + sizes - 4  # where the data CRC starts

        def span(start: np.ndarray, width: int) -> np.ndarray:
            """``data[s : s + width]`` for each ``s`` of ``start``, as rows (a start too close
            to the end of the file is moved back: such a record does not match anyway)."""
            return byte_rows(data, start, width)

        head_bytes, head_sizes, head_masks = self._head_table
        name = len(self._FILENAME)
        if len(data) < max(18, self.size, head_bytes.shape[1], self.label_at + 3, 4 + name):
            return np.zeros(len(offsets), bool), np.zeros(len(offsets), np.int64), offsets
        # The frame: length (8 bytes), its CRC, then Example.features (tag 0x0A, a varint).
        frame = span(offsets, 16)
        length = frame[:, :8].copy().view("<u8")[:, 0]
        ok &= (length == sizes - 16) & (frame[:, 12] == 0x0A)
        size, used, valid = _varint3(frame[:, 13:16])
        pos = offsets + 13 + used
        ok &= valid & (pos + size == end)
        # The entries before the pixels: the class's head (its label's varint inside).
        head = span(pos, max(head_bytes.shape[1], self.label_at + 3))
        value, _, valid = _varint3(head[:, self.label_at : self.label_at + 3])
        labels = value - self.label_offset
        ok &= valid & (labels >= 0) & (labels < len(self.heads))
        labels = np.where(ok, labels, 0)
        width = head_bytes.shape[1]
        ok &= ((head[:, :width] == head_bytes[labels]) | head_masks[labels]).all(axis=1)
        starts = pos + head_sizes[labels]
        stops = starts + self.size
        tails = end - len(self.tail)
        ok &= (stops < tails) & (span(tails, len(self.tail)) == self._tail).all(axis=1)
        # Between them, exactly one image/filename entry: tag, a varint, the key.
        entry = span(stops, 4 + name)
        size, used, valid = _varint3(entry[:, 1:4])
        ok &= (entry[:, 0] == 0x0A) & valid & (stops + 1 + used + size == tails)
        key = np.zeros(len(offsets), bool)
        for n in (1, 2, 3):
            key |= (used == n) & (entry[:, 1 + n : 1 + n + name] == self._name).all(axis=1)
        ok &= key
        return ok, labels, starts

    @property
    def _head_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The heads as one padded ``(classes, longest)`` uint8 array, their lengths, and which
        columns lie past each head's end."""
        if self._heads_array is None:
            longest = max((len(h) for h in self.heads), default=0)
            table = np.zeros((max(1, len(self.heads)), longest), np.uint8)
            for k, head in enumerate(self.heads):
                table[k, : len(head)] = np.frombuffer(head, np.uint8)
            lengths = np.array([len(h) for h in self.heads] or [0], np.int64)
            beyond = np.arange(longest)[None, :] >= lengths[:, None]
            self._heads_array = table, lengths, beyond
        return self._heads_array


def _varint3(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Varints of one to three bytes starting each row of ``b`` (``(n, 3)`` uint8): values,
    their lengths, and whether each ends within three bytes."""
    b = b.astype(np.int64)
    one, two = b[:, 0] < 0x80, (b[:, 0] >= 0x80) & (b[:, 1] < 0x80)
    three = (b[:, 0] >= 0x80) & (b[:, 1] >= 0x80) & (b[:, 2] < 0x80)
    low = b[:, 0] & 0x7F
    value = np.where(
        one,
        b[:, 0],
        np.where(two, low | b[:, 1] << 7, low | (b[:, 1] & 0x7F) << 7 | b[:, 2] << 14),
    )
    return value, np.where(one, 1, np.where(two, 2, 3)), one | two | three


_crc_value = google_crc32c.value  # CRC-32C of bytes (C)


def data_crcs_match(
    mapped: Any, data: np.ndarray | torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """Whether the data CRC of each framed record (at ``offsets`` of the file ``mapped``, whose
    bytes ``data`` views, of ``sizes`` bytes, each inside the file, its length field already
    found equal to what the index says) matches. The length's own CRC is left to the generic
    path and ``imgpack verify``: the length it guards was just checked."""
    ends = offsets + sizes - 4
    stored = byte_rows(data, ends, 4).copy().view("<u4")[:, 0]
    # Records of one length (a raw output's, but for labels of other varint widths) are
    # checked together: their data gathered into rows, one CRC for all (crcs_intact); the
    # stored CRCs unmasked.
    unmasked = framing.unmask(stored.astype(np.uint64))
    lengths = sizes - framing.HEADER_SIZE - framing.FOOTER_SIZE
    match = np.zeros(len(offsets), np.bool_)
    for length in np.unique(lengths).tolist() if len(lengths) > 1 else []:
        group = np.flatnonzero(lengths == length)
        if length > 0 and len(group) > 1:
            rows = byte_rows(data, offsets[group] + framing.HEADER_SIZE, length)
            match[group] = crcs_intact(rows, unmasked[group])
    rest = np.flatnonzero(~match)  # one by one: a group that failed, lone records
    data_spans = map(slice, (offsets[rest] + 12).tolist(), ends[rest].tolist())
    crcs = np.array(list(map(_crc_value, map(mapped.__getitem__, data_spans))), np.uint64)
    match[rest] = framing.mask(crcs) == stored[rest]
    return match


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


#: What a reader keeps of an encoded record it parsed (16 bytes a record): where its image
#: starts and stops in the record's data, its label, and the data CRC stored in its frame.
SPOT = np.dtype([("start", "<i4"), ("stop", "<i4"), ("label", "<i4"), ("crc", "<u4")])


def _parse(data: memoryview, where: str) -> dict[str, example.FeatureValue]:
    try:
        return example.decode_example(data)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _collect_path(
    paths: list[str] | None, features: dict[str, example.FeatureValue]
) -> list[str] | None:
    """``paths`` with this record's ``image/filename`` added, or ``None`` once one lacks it."""
    value = features.get("image/filename")
    if paths is None or not value or not isinstance(value[0], bytes):
        return None
    paths.append(value[0].decode("utf-8", "surrogateescape"))
    return paths


def _label(features: dict[str, example.FeatureValue], where: str) -> int:
    value = features.get("image/class/label")
    if not value or not isinstance(value[0], int):
        raise DataError(f"{where}: no image/class/label")
    return value[0]


class TFRecordDataset(PreadDataset):
    """Map-style dataset over TFRecord files.

    ``source``: an imgpack ``tfrecord`` output, or TFRecord files written by other tools (a file,
    a folder of ``*.tfrecord``, a glob, or a list of them) with the conventional ImageNet keys.
    Records are found through the ``.idx`` beside each file, or an index built in memory. Foreign
    images go through imgpack's image policy (RGB, EXIF applied, alpha composited). CRCs are
    checked unless ``check_crc=False`` (``verify=True`` checks them whatever ``check_crc``
    says): on every read, but for the raw records of an imgpack output, which are checked the
    first time this reader reads them unless ``verify=True`` (as every format's raw records
    are: :class:`~imgpack.formats.dataset_base.ImageDataset`); a bad CRC or a truncated record
    raises :class:`~imgpack.errors.DataError` naming the file and offset. An imgpack output at a URL is read lazily (:mod:`imgpack.lazy`): opening
    fetches its manifest and ``.idx`` files, each shard is fetched into the cache when first
    read.
    """

    format = "tfrecord"
    lazy_files = True

    def __init__(
        self,
        source: Source | Opened,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        check_crc: bool = True,
        label_offset: int | None = None,
        verify: bool | None = None,
        size: int | tuple[int, int] | str | None = None,
        resize: str = "crop",
        decode_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        options: ReadOptions | None = None,
        cache_limit: int | str | None = None,
        prefetch: int = 8,
    ) -> None:
        options = ReadOptions.of(
            options,
            transform=transform,
            target_transform=target_transform,
            verify=verify,
            size=size,
            resize=resize,
            decode_threads=decode_threads,
            storage_options=storage_options,
            cache_dir=cache_dir,
            cache_limit=cache_limit,
            prefetch=prefetch,
        )
        verify, decode_threads = options.verify, options.decode_threads
        if isinstance(source, (str, os.PathLike)) and is_url(source):  # shards fetched as read
            source = open_output(source, options, lazy=True)
        records = Records(source, check_crc if verify is None else verify, label_offset)
        assert records.opened is not None  # not a stream
        super().__init__(records.opened, options=options)
        self.records = records
        self.decoder = records.decoder(self.size_policy, decode_threads)
        compressed = [s for s in records.shards if s.compressed]
        if compressed:
            raise DataError(
                f"{compressed[0].path}: {compressed[0].compression}-compressed TFRecord files have "
                "no random access; read them with TFRecordStream"
            )
        self._count_shards([len(s) for s in records.shards])
        self._offsets = np.concatenate([s.offsets for s in records.shards] or [np.empty(0)])
        self._sizes = np.concatenate([s.sizes for s in records.shards] or [np.empty(0)])
        self.shard_files = [shard.path for shard in records.shards]
        raw = self.manifest.encoding == "raw" and bool(self.manifest.image.get("height"))
        self._layout: RawLayout | None = None
        #: (pid, pixel start, label) of each raw record this process checked (-1: not yet).
        self._known: tuple[int, np.ndarray, np.ndarray] | None = None
        #: (pid, :data:`SPOT` of each encoded record this process parsed, start -1 where it
        #: has not): :meth:`_stored`.
        self._spots: tuple[int, np.ndarray] | None = None
        if raw and not records.foreign:
            try:
                self._layout = RawLayout(self.manifest, records.label_offset)
            except ValueError:  # no fixed layout to match: every record through the parser
                self._layout = None

    def _check_shard(self, number: int, fd: int) -> None:
        self.records.check_first(number, fd)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_known"] = state["_spots"] = None  # each process learns its own
        return state

    def _gather_raw(self, indices: np.ndarray, layout: RawLayout) -> tuple[Images, torch.Tensor]:
        """A batch of raw records sliced from the memory-mapped shards, each matched against
        the output's layout (a few byte comparisons, the frame's CRCs) and its pixels copied
        straight into the batch; a record that does not match goes through the generic path,
        which reads it as any record is read (and names what is wrong with it)."""
        size = layout.size
        known = self._known_raw(indices)
        if known is not None:  # every record checked already: where its pixels start, its label
            return self._gather_known(indices, self._shards(indices), layout, *known)
        shard_of = self._shard_of(indices)
        out = new_batch_tensor((len(indices), *layout.shape))
        rows = out.numpy().reshape(len(indices), size)
        labels = np.zeros(len(indices), np.int64)
        for number in np.unique(shard_of).tolist():
            mine = np.flatnonzero(shard_of == number)
            mapped = self._mapped(number)
            data = np.frombuffer(mapped, np.uint8)
            offsets, sizes = self._offsets[indices[mine]], self._sizes[indices[mine]]
            ok, found, starts = layout.match(data, offsets, sizes)
            if self.records.check_crc and ok.any():
                self._check_crcs(indices[mine], ok, mapped, data, offsets, sizes)
            labels[mine] = found
            self._remember_raw(indices[mine], ok, starts, found)
            if ok.all() and len(mine) == len(indices):  # one shard: straight into the batch
                take_windows(data, size, starts, out.view(-1, size))
            elif ok.any():
                rows[mine[ok]] = byte_rows(data, starts[ok], size)
            for pos in mine[~ok].tolist():  # the generic path names what is wrong
                [(_, frame, where)] = list(self._frames(indices[pos : pos + 1]))
                image, labels[pos] = self.records.stored(frame, where)
                if not isinstance(image, np.ndarray) or image.shape != layout.shape:
                    raise DataError(f"{where}: not a raw {layout.shape} image as the manifest says")
                rows[pos] = image.reshape(size)
        return out.permute(0, 3, 1, 2), torch.from_numpy(labels)

    def _known_raw(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(pixel starts, labels)`` of raw records ``indices`` when this process read every
        one of them before (its layout matched and, by default, its checksum was checked: raw
        records are checked once, in every format), else ``None``: the batch is matched as a
        first read is. ``verify=True`` matches and checks every read."""
        known = self._known
        if self.verify or known is None or known[0] != os.getpid():
            return None
        starts = known[1][indices]
        if (starts < 0).any():
            return None
        return starts, known[2][indices]

    def _remember_raw(
        self, indices: np.ndarray, ok: np.ndarray, starts: np.ndarray, labels: np.ndarray
    ) -> None:
        """Keep where the pixels of the raw records ``indices`` that matched (``ok``: the layout,
        and the checksum where it is checked) start, and their labels, for later reads."""
        if self.verify:
            return
        if self._known is None or self._known[0] != os.getpid():
            n = len(self)
            self._known = (os.getpid(), np.full(n, -1, np.int64), np.zeros(n, np.int64))
        self._known[1][indices[ok]] = starts[ok]
        self._known[2][indices[ok]] = labels[ok]

    def _gather_known(
        self,
        indices: np.ndarray,
        shard_of: np.ndarray | None,
        layout: RawLayout,
        starts: np.ndarray,
        labels: np.ndarray,
    ) -> tuple[Images, torch.Tensor]:
        """A batch of records checked before (in shards ``shard_of``; ``None``: a one-shard
        output's): one gather of their pixels per shard (a sliding-window view of the
        memory-mapped file), nothing parsed or compared again."""
        out = new_batch_tensor((len(indices), *layout.shape))
        self._gather_rows(shard_of, starts, out.view(len(indices), layout.size))
        return out.permute(0, 3, 1, 2), torch.from_numpy(labels)

    def _check_crcs(
        self,
        indices: np.ndarray,
        ok: np.ndarray,
        mapped: Any,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
    ) -> None:
        """Check the data CRCs of the raw records ``indices`` that matched the layout (``ok``,
        cleared where a CRC does not match: the generic path then names the record). By
        default (``verify=None``) each record is checked the first time this reader reads it,
        as the other formats' raw records are; with ``verify=True``, on every read."""
        need = ok.copy()
        seen = self._checked_marks()
        if seen is not None:
            need &= seen[indices] == 0
        if not need.any():
            return
        good = data_crcs_match(mapped, data, offsets[need], sizes[need])
        ok[need] = good
        if seen is not None:
            seen[indices[need][good]] = 1

    def record(self, index: int) -> tuple[dict[str, example.FeatureValue], str]:
        """Record ``index``'s parsed features (frame CRCs and output id checked) and where it is."""
        [(_, frame, where)] = list(self._frames(self._indices([index])))
        return self.records.features(frame, where), where

    def encoded(self, start: int, stop: int, chunk: int = 256) -> Iterator[Encoded]:
        """As :meth:`ImageDataset.encoded`: each record's ``image/encoded`` bytes as stored,
        with its label, ``image/filename``, format and size (the frame CRCs checked)."""
        for first in range(start, stop, chunk):
            indices = np.arange(first, min(stop, first + chunk), dtype=np.int64)
            found: list[Encoded | None] = [None] * len(indices)
            for pos, frame, where in self._frames(indices):
                features = self.records.features(frame, where)
                label = self.records.label(features, where)
                payload, shape = stored_image(features, where)
                names = features.get("image/filename") or [b""]
                path = (
                    names[0].decode("utf-8", "surrogateescape")
                    if isinstance(names[0], bytes)
                    else ""
                )
                if shape is not None:
                    found[pos] = Encoded(path, label, payload, *shape, Kind.RAW)
                    continue
                try:
                    kind, height, width, channels = stored_info(payload)
                except DataError as exc:
                    raise DataError(f"{where}: {exc}") from None
                found[pos] = Encoded(path, label, payload, height, width, channels, kind)
            yield from (sample for sample in found if sample is not None)

    def _load_targets(self) -> list[int]:
        return list(self.records.labels)

    def _load_paths(self) -> list[str] | None:
        return self.records.paths

    def _frames(self, indices: np.ndarray) -> Iterator[tuple[int, memoryview, str]]:
        """``(position in indices, record data, where)``, read shard by shard in file order;
        the frame's CRCs are checked unless ``check_crc=False``."""
        shard_of = self._shard_of(indices)
        local = indices - self._starts[shard_of]
        for pos in np.lexsort((local, shard_of)).tolist():
            yield pos, *self._frame(int(shard_of[pos]), int(local[pos]), int(indices[pos]))

    def _frame(self, number: int, record: int, index: int) -> tuple[memoryview, str]:
        """Sample ``index``'s frame data (record ``record`` of shard ``number``) and where it
        lies; its CRCs checked unless ``check_crc=False``."""
        shard = self.records.shards[number]
        offset, size = int(shard.offsets[record]), int(shard.sizes[record])
        where = f"{shard.path} at offset {offset}"
        data = os.pread(self._fd(number), size, offset)
        try:
            return framing.unframe(data, where, self.records.check_crc), where
        except DataError as exc:  # name the sample too, and its source where it can be had
            raise DataError(f"{exc} (sample {index}{self._source(index)})") from None

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        found: list[Record | None] = [None] * len(indices)
        for pos, frame, where in self._frames(indices):
            _, label = self._stored(int(indices[pos]), frame, where)
            # The frame's own CRC-32C (checked in _frames) is the record's checksum.
            found[pos] = Record(int(indices[pos]), frame, label, None, where)
        yield from (r for r in found if r is not None)

    def _one(self, index: int) -> tuple[Any, int, str]:
        frame, where = self._frame(*self._locate(index), index)
        item, label = self._stored(index, frame, where)
        return item, label, where

    def _stored(self, index: int, frame: memoryview, where: str) -> tuple[Any, int]:
        """Record ``index``'s stored image and label from its frame's data. The first time this
        process reads an encoded record it is parsed (output id, label and class checked) and
        where its image bytes lie is kept; a later read of the same record (the data CRC stored
        in its frame the one seen then; the frame itself checked as every read's) takes the
        image from there and the label kept, nothing parsed again (~56 µs a record)."""
        crc = framing.stored_crc(frame)
        spots = self._spots
        if crc is not None and spots is not None and spots[0] == os.getpid():
            start, stop, label, seen = spots[1][index].item()
            if start >= 0 and seen == crc:
                return frame[start:stop], label
        item, label = self.records.stored(frame, where)
        if crc is not None and isinstance(item, bytes):
            self._remember(index, frame, item, label, crc)
        return item, label

    def _remember(self, index: int, frame: memoryview, image: bytes, label: int, crc: int) -> None:
        """Keep where ``image``, the ``image/encoded`` value just parsed from ``frame``, lies in
        it: right after its entry's head as imgpack writes it. A record encoded otherwise (by
        another tool) is not kept, and is parsed on every read."""
        head = example.bytes_entry_head("image/encoded", len(image))
        data = bytes(frame)
        found = data.find(head)
        start = found + len(head)
        stop = start + len(image)
        if found < 0 or not data.startswith(image, start) or stop >= 1 << 31 or label >= 1 << 31:
            return
        if self._spots is None or self._spots[0] != os.getpid():
            spots = np.zeros(len(self), SPOT)
            spots["start"] = -1
            self._spots = (os.getpid(), spots)
        self._spots[1][index] = (start, stop, label, crc)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        if self._layout is not None:
            return self._gather_raw(indices, self._layout)
        items: list[Any] = [None] * len(indices)
        labels = [0] * len(indices)
        wheres = [""] * len(indices)
        for pos, frame, where in self._frames(indices):
            items[pos], labels[pos] = self._stored(int(indices[pos]), frame, where)
            wheres[pos] = where
        return self.decoder.batch(items, wheres.__getitem__), label_tensor(labels)
