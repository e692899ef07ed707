"""TFRecord files without a manifest (a file, a folder of ``*.tfrecord``, a glob) as a source.

They are read with their labels (``image/class/label``, names from ``image/class/text``), in file
order, and every image goes through the image policy, as a folder's files would.

Each file is read through once by a scan task (:func:`scan_record_file`), which keeps where
each record lies and what the scan takes of it, and each conversion task reads its records a
stretch of a file at a time (:class:`RecordRangeFetcher`; a GZIP or ZLIB file, which has no
random access, as a stream from its start). A bucket folder of TFRecord files and nothing else
(but their ``.idx`` files) is read so in place, each stretch one ranged GET (the pipeline lists
it, :func:`imgpack.sources.listing.source_folder`): the samples, their order and the output are
a downloaded copy's.
"""

from __future__ import annotations

import base64
import bisect
import functools
import json
import os
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from imgpack.errors import DataError, ImageError, ScanError
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes, process_pixels
from imgpack.scan import Sample, SampleTable, Scan, listed_id
from imgpack.sources import listing
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    files_identity,
    has_subfolders,
    opened,
)
from imgpack.sources.output.source import scan_reader
from imgpack.sources.tfrecord.found import SCANNED, FileScan, Record, RecordTable
from imgpack.storage.location import TRANSFERS, filesystem, read_objects
from imgpack.system import each_task, lends_tasks


def tfrecord_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The TFRecord files ``src`` names (a folder holding ``*.tfrecord`` files, a glob, or a
    ``.tfrecord`` file), or ``None`` when it names none."""
    from imgpack.formats.tfrecord.records import tfrecord_files as files_of

    path = Path(src)
    if path.is_file() and path.suffix not in (".tfrecord", ".tfrecords"):
        return None  # a single file is taken for a TFRecord only by its name
    try:
        return files_of(src)
    except FileNotFoundError:
        return None


class TFRecordSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        if listing.remote_source(src) is not None:  # a bucket's listing: of TFRecord files only
            return bool(listed_records(src))
        return not has_subfolders(src) and bool(tfrecord_files(src))

    @functools.cached_property
    def remote(self) -> tuple[str, dict[str, Any]] | None:
        """TFRecord files in a bucket whose listing only SRC holds (read in place): their
        folder's URL and storage options."""
        return listing.remote_source(self.src) if self.src.is_dir() else None

    def check(self) -> None:
        if self.remote is not None:
            if not listed_records(self.src):
                raise FileNotFoundError(f"{self.remote[0]}: holds no TFRecord object")
            return
        if not tfrecord_files(self.src):
            raise FileNotFoundError(f"{self.src}: names no TFRecord file")

    def scan(self, request: ScanRequest) -> Scan:
        """Each file read through once (:func:`scan_record_files`: by the executor's tasks
        where it lends them) into what :class:`~imgpack.formats.tfrecord.reader.
        TFRecordDataset` reads of the files (:class:`Scanned`, through the same
        :func:`~imgpack.sources.output.source.scan_reader`), each sample's index its place in
        the files read one after the other (:class:`RecordRangeFetcher`)."""
        url, options, files = self._located
        self._identity = "" if url else files_identity([Path(f[0]) for f in files])
        found = listing.scanned_once(  # a part's or a resume's: no file read again
            self.src,
            "tfrecord",
            lambda: scan_record_files(url, options, files, request.runner),
            _scan_json,
            _from_json,
        )
        scanned = Scanned.of(url, files, found)
        del found  # (what the files' scans found, now in scanned)
        scan = scan_reader(self.src, scanned, request, scanned.origin)
        assert isinstance(scan.samples, SampleTable)  # (scan_reader's)
        scan.samples = scan.samples.placed(zip(*scanned.spots, strict=True))
        self._places = scanned.files
        return scan

    @functools.cached_property
    def _located(self) -> tuple[str, str, list[tuple[str, int, str]]]:
        """Where the files are (a bucket folder's URL, ``""`` for local files), the storage
        options as JSON, and ``(name, size, etag)`` of each file in order (a local file's
        name: its path)."""
        if self.remote is not None:
            url, options = self.remote
            return url, json.dumps(options, sort_keys=True), listed_records(self.src)
        files = tfrecord_files(self.src) or []
        return "", "{}", [(str(p), -1, "") for p in files]

    def identity(self, scan: Scan) -> str:
        """Local files' paths, sizes and modification times as the scan found them (``""`` in
        a bucket: the listing, every file's size and ETag, is in the output id)."""
        return getattr(self, "_identity", "")

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        url, options, _ = self._located
        places = getattr(self, "_places", ())
        return RecordRangeFetcher(url, options, run, places, self.identity(scan))


# -- reading TFRecord files in place, local or in a bucket ----------------------------------
#: Bytes asked of the store at once while a file in a bucket is scanned (read through once).
SCAN_BLOCK = 16 << 20
#: Bytes a GET of a file in a bucket asks for at least, within its shard task's records: the
#: stretch a chunk of records needs and what follows it, which the task's next chunks take
#: from memory.
READ_AHEAD = 8 << 20


def listed_records(folder: Path) -> list[tuple[str, int, str]]:
    """``(name, size, etag)`` of the TFRecord objects a bucket listing holds at SRC's top, by
    name, when that is all it holds (no folder, no other visible object but their ``.idx``
    index files): files read in place; else ``[]``. Hidden ones count as a local folder's do
    (by their suffix)."""
    index = listing.store_folders(folder) or {}
    if any(name for name in index) or "" not in index:
        return []
    objects = sorted(listing.store_objects(folder, ""))
    visible = [o for o in objects if not o[0].startswith(".")]
    if not visible or any(not name.endswith(listing.RECORD_SUFFIXES) for name, _, _ in visible):
        return []
    return [o for o in objects if Path(o[0]).suffix in (".tfrecord", ".tfrecords")]


def scan_record_files(
    url: str, options: str, files: list[tuple[str, int, str]], runner: Any = None
) -> list[FileScan]:
    """Each file (``(name, size, etag)``: under the bucket folder ``url``, with storage
    ``options`` as JSON; a local path where ``url`` is ``""``) read through once, as a stream,
    nothing kept but its records' places and features: by ``runner``'s tasks, a file each,
    where the conversion's executor lends them (:func:`~imgpack.system.lends_tasks`), else
    here on a few threads."""
    items = [(url, options, name, size) for name, size, _ in files]
    if len(items) > 1 and lends_tasks(runner):
        tasks = each_task(
            runner, scan_record_file, items, lambda item: (_where(url, item[2]), "reading it")
        )
        return [result for _, result in tasks]
    with ThreadPoolExecutor(min(TRANSFERS, max(1, len(items)))) as pool:
        return list(pool.map(scan_record_file, items))


def scan_record_file(item: tuple[str, str, str, int]) -> FileScan:
    """A task: the records of one file (``(folder URL, storage options as JSON, file name,
    its listed size)``, :func:`scan_record_files`), read through as a stream, every frame's
    CRCs checked."""
    from imgpack.formats.tfrecord import framing
    from imgpack.formats.tfrecord.records import IMAGE_FEATURES, parse

    url, options, name, size = item
    where = _where(url, name)
    records = RecordTable()
    try:
        with _open(url, options, name, size) as raw:
            kind = framing.compression_of(raw.read(framing.HEADER_SIZE))
            raw.seek(0)
            stream = framing.open_stream(raw, kind)
            for offset, data in framing.iter_frames(stream, where):
                features = parse(data, f"{where} at offset {offset}")
                encoded = features.get("image/encoded")
                payload = len(encoded[0]) if encoded and isinstance(encoded[0], bytes) else -1
                features = {
                    k: v for k, v in features.items() if k in SCANNED or k not in IMAGE_FEATURES
                }
                framed = framing.HEADER_SIZE + len(data) + framing.FOOTER_SIZE
                records.append(Record(offset, framed, payload, features))
    except OSError as exc:
        raise ScanError(f"{where}: cannot be read: {exc}") from None
    except DataError as exc:
        raise ScanError(str(exc)) from None
    return FileScan(kind or "", records)


def _scan_json(found: FileScan) -> list[Any]:
    """A file's scan as JSON (:func:`imgpack.sources.listing.scanned_once`): a feature's values
    as ``{"b": [base64...]}``, ``{"i": [...]}`` or ``{"f": [...]}`` (``[]``: none)."""

    def values(found: list[Any]) -> Any:
        if not found:
            return []
        if isinstance(found[0], bytes):
            return {"b": [base64.b64encode(v).decode("ascii") for v in found]}
        return {"f" if isinstance(found[0], float) else "i": list(found)}

    records = [[r.offset, r.framed, r.payload, {k: values(v) for k, v in r.features.items()}]
               for r in found.records]  # fmt: skip
    return [found.compression, records]


def _from_json(kept: list[Any]) -> FileScan:
    """A file's scan from its JSON (:func:`_scan_json`)."""

    def values(found: Any) -> list[Any]:
        if not found:
            return []
        ((kind, items),) = found.items()
        if kind == "b":
            return [base64.b64decode(v) for v in items]
        return [float(v) for v in items] if kind == "f" else [int(v) for v in items]

    compression, records = kept
    found = RecordTable(
        Record(o, n, p, {k: values(v) for k, v in f.items()}) for o, n, p, f in records
    )
    return FileScan(compression, found)


def _where(url: str, name: str) -> str:
    """How messages name file ``name`` of the files under ``url`` (``""``: local paths)."""
    return f"{url}/{name}" if url else name


def _open(url: str, options: str, name: str, size: int = -1) -> Any:
    """File ``name`` of the files under ``url`` opened to be read through (``size``: as the
    listing says, so that no HEAD asks it first; ``-1``: asked)."""
    if not url:
        return open(name, "rb")
    fs, root = filesystem(url, json.loads(options) or None)
    known = {"size": size} if size >= 0 else {}
    return fs.open(f"{root}/{name}", "rb", block_size=SCAN_BLOCK, **known)


@dataclass
class Scanned:
    """The scan of TFRecord files in a bucket, as :func:`~imgpack.sources.output.source.
    scan_reader` reads a dataset (its manifest's classes and fields, its targets, stored paths,
    field columns and stored sizes): the scan of a local copy, one code path."""

    manifest: Any
    targets: list[int]
    paths: list[str] | None
    #: The records' features beyond the image's (their fields' values), by the index of each
    #: record that has any.
    features: dict[int, dict[str, Any]]
    keys: dict[str, tuple[str, bool]]
    sizes: array[int]
    origin: dict[str, Any]
    #: ``(index, span, listed)`` of each record: its place in the files read one after the
    #: other (a compressed file counts its records, not its bytes), its frame's bytes (``0``:
    #: in a compressed file), its file's listed content; three arrays.
    spots: tuple[array[int], array[int], array[int]]
    #: ``(name, first index, compression)`` of each file (:class:`RecordRangeFetcher`).
    files: tuple[tuple[str, int, str], ...]
    where: str

    @classmethod
    def of(cls, url: str, listed: list[tuple[str, int, str]], found: list[FileScan]) -> Scanned:
        """The scan of files ``listed`` under ``url`` (``""``: local paths) from what their
        scans ``found``."""
        from imgpack.formats.tfrecord.records import ForeignScan

        scan = ForeignScan()
        features: dict[int, dict[str, Any]] = {}
        framed, payloads = array("q"), array("q")
        spots = array("q"), array("q"), array("q")
        files: list[tuple[str, int, str]] = []
        first = 0
        for (name, size, tag), (kind, records) in zip(listed, found, strict=True):
            files.append((name, first, kind))
            content = listed_id(tag)
            for number, record in enumerate(records):
                scan.add(record.features, f"{_where(url, name)} at offset {record.offset}")
                others = {k: v for k, v in record.features.items() if k not in SCANNED}
                if others:  # (a field's values: nothing else of the record is kept)
                    features[len(framed)] = others
                framed.append(record.framed)
                payloads.append(record.payload)
                place = number if kind else record.offset
                spots[0].append(first + place)
                spots[1].append(0 if kind else record.framed)
                spots[2].append(content)
            first += len(records) if kind else max(size, records[-1].end if records else 0)
        where = _where(url, listed[0][0])
        classes = scan.classes(where)
        fields, keys = scan.fields(where)
        # As a local copy's reader sizes them: the frames, or where any file is compressed
        # (not indexed), the images.
        sizes = payloads if any(kind for kind, _ in found) else framed
        origin = {"format": "tfrecord", "foreign": True, "files": len(listed)}
        manifest = SimpleNamespace(classes=classes, fields=fields)
        return cls(manifest, scan.labels, scan.paths, features, keys, sizes, origin, spots,
                   tuple(files), where)  # fmt: skip

    def stored_paths(self) -> list[str] | None:
        return self.paths

    def stored_sizes(self) -> np.ndarray:
        return np.frombuffer(self.sizes, dtype=np.int64)

    def field(self, name: str) -> Any:
        """Field ``name``'s column, as a local copy's reader gives it."""
        from imgpack.formats.dataset_base import stored_column
        from imgpack.formats.tfrecord.records import field_data

        (found,) = (f for f in self.manifest.fields if f.name == name)
        stored = [
            field_data(found, self.features.get(i, {}), self.keys, self.where)
            for i in range(len(self.targets))
        ]
        return stored_column(found, stored)


@dataclass(frozen=True)
class RecordRangeFetcher(Fetcher):
    """Records of TFRecord files, local or in a bucket, read where they are: each chunk's
    records of one file with one read of a stretch of it (:attr:`Sample.index
    <imgpack.scan.Sample.index>` and :attr:`~imgpack.scan.Sample.span` say where; in a bucket a
    ranged GET, the store's ETag checked against the listing's); a compressed file as a stream
    from its start, kept open while the task reads on. A file is never downloaded whole."""

    url: str
    #: The fsspec storage options, as JSON (the fetcher stays small and hashable).
    storage_options: str
    #: The conversion run: what a process read ahead for one run is never taken by another.
    run: str
    #: ``(name, first index, compression)`` of each file, in order (:class:`Scanned`).
    files: tuple[tuple[str, int, str], ...]
    #: Local files' paths, sizes and modification times as the scan found them: a worker
    #: refuses files that changed since (``""``: files in a bucket, known by their ETags).
    identity: str = ""

    def prefetch(self, samples: Sequence[Sample]) -> None:
        """Read the records of a chunk of samples: a chunk's records of one file are one
        stretch of it, read with what follows it (:data:`READ_AHEAD` bytes a GET), so that the
        next chunks find theirs read already."""
        _RECORDS.clear()
        _RECORDS.update(self._read(samples))

    def expect(self, samples: Sequence[Sample]) -> None:
        """The shard task's samples: a read ahead stops at their end in each file. A compressed
        file's stream this process holds is kept where the task reads that file (it reads on
        from it when its records come later in the file: a file cut into many shard tasks is
        read through about once per process, not once per task from its start); the others
        are closed."""
        _BOUNDS.clear()
        for sample in samples:
            name, first, _ = self._file(sample.index)
            key, end = self._key(name), sample.index - first + max(sample.span, 1)
            _BOUNDS[key] = max(_BOUNDS.get(key, 0), end)
        for key in [k for k in _STREAM if k not in _BOUNDS]:
            _STREAM.pop(key).close()

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        from imgpack.formats.tfrecord.records import parse, stored_image

        data = _RECORDS.pop(sample.index, None)
        if data is None:
            data = self._read([sample])[sample.index]
        if isinstance(data, DataError):
            raise ImageError(sample.path, f"damaged record: {data}") from None
        if isinstance(data, BaseException):
            where = _where(self.url, self._file(sample.index)[0])
            raise ImageError(sample.path, f"cannot read {where}: {data}") from None
        record, where = data
        try:
            payload, shape = stored_image(parse(record, where), where)
        except DataError as exc:
            raise ImageError(sample.path, f"damaged record: {exc}") from None
        if shape is not None:
            pixels = np.frombuffer(payload, np.uint8).reshape(shape)
            return process_pixels(pixels, sample.path, sample.label, policy, encoding)
        return process_bytes(payload, sample.path, sample.label, policy, encoding)

    @functools.cached_property
    def _firsts(self) -> list[int]:
        return [first for _, first, _ in self.files]

    def _file(self, index: int) -> tuple[str, int, str]:
        return self.files[bisect.bisect_right(self._firsts, index) - 1]

    def _key(self, name: str) -> str:
        return f"{self.run} {self.url}/{name}"

    def _read(self, samples: Sequence[Sample]) -> dict[int, Any]:
        """Each sample's ``(frame data, where)`` by index (or why it cannot be read): from the
        stretch read last where it holds them, else read now (a compressed file's from its
        stream)."""
        runs: list[tuple[tuple[str, int, str], list[Sample]]] = []
        for sample in samples:
            file = self._file(sample.index)
            if runs and runs[-1][0] == file:
                runs[-1][1].append(sample)
            else:
                runs.append((file, [sample]))
        out: dict[int, Any] = {}
        wanted: list[tuple[str, int, list[Sample], int, int]] = []
        for (name, first, kind), run in runs:
            if kind:
                out.update(self._streamed(name, first, kind, run))
                continue
            start = min(s.index for s in run) - first
            end = max(s.index + s.span for s in run) - first
            held = _STRETCH.get(self._key(name))
            if (
                held is not None
                and held[0] == run[0].listed
                and held[1] <= start
                and end <= held[2]
            ):
                out.update(self._frames(name, first, run, held[1], held[3]))
            else:
                wanted.append((name, first, run, start, end))
        if not wanted:
            return out
        spans = [
            (start, max(end, min(start + READ_AHEAD, _BOUNDS.get(self._key(name), 0))))
            for name, _, _, start, end in wanted
        ]
        _STRETCH.clear()
        names = [name for name, _, _, _, _ in wanted]
        for (name, first, run, start, end), found in zip(
            wanted, self._fetch(names, spans), strict=True
        ):
            if isinstance(found, BaseException):
                out.update((s.index, found) for s in run)
                continue
            data, said = found
            replaced = listing.replaced(_where(self.url, name), run[0].listed, said)
            if replaced is not None:
                raise replaced
            if len(data) < end - start:
                cut = OSError(
                    f"it ends at byte {start + len(data):,}, inside the records the scan found "
                    "(the file changed since it was scanned: convert again)"
                )
                out.update((s.index, cut) for s in run)
                continue
            _STRETCH[self._key(name)] = (run[0].listed, start, start + len(data), data)
            out.update(self._frames(name, first, run, start, data))
        return out

    def _fetch(
        self, names: list[str], spans: list[tuple[int, int]]
    ) -> list[tuple[bytes, list[str]] | BaseException]:
        """The bytes ``[start, end)`` of each file and what the store said of its content
        (:func:`~imgpack.storage.location.read_objects`: one GET each, all at once); local
        files read here, once checked unchanged since the scan."""
        if self.url:
            fs, root = filesystem(self.url, json.loads(self.storage_options) or None)
            return read_objects(fs, [f"{root}/{name}" for name in names], spans)
        if self.identity:
            opened(self.run, ("tfrecord", self.identity), self._unchanged)
        found: list[tuple[bytes, list[str]] | BaseException] = []
        for name, (start, end) in zip(names, spans, strict=True):
            try:
                with open(name, "rb") as fh:
                    found.append((os.pread(fh.fileno(), end - start, start), []))
            except OSError as exc:
                found.append(exc)
        return found

    def _unchanged(self) -> bool:
        """Refuse local files that changed since the scan (once per worker and run)."""
        paths = [Path(name) for name, _, _ in self.files]
        if paths and files_identity(paths) != self.identity:
            raise changed_source(str(paths[0].parent))
        return True

    def _frames(
        self, name: str, first: int, run: list[Sample], start: int, data: bytes
    ) -> dict[int, Any]:
        """The frame data of ``run``'s records in ``data`` (a stretch of file ``name`` from
        byte ``start``), each frame's CRCs checked (a damaged one: its error)."""
        from imgpack.formats.tfrecord import framing

        out: dict[int, Any] = {}
        view = memoryview(data)
        for sample in run:
            offset = sample.index - first
            where = f"{_where(self.url, name)} at offset {offset}"
            frame = view[offset - start : offset - start + sample.span]
            try:
                out[sample.index] = (framing.unframe(frame, where), where)
            except DataError as exc:
                out[sample.index] = exc
        return out

    def _streamed(self, name: str, first: int, kind: str, run: list[Sample]) -> dict[int, Any]:
        """The frame data of ``run``'s records of the compressed file ``name``, read on from
        the stream this process holds open on it (:data:`_STREAM`), or from a new one at its
        start."""
        key = self._key(name)
        where = _where(self.url, name)
        wanted = sorted(s.index - first for s in run)
        opened(self.run, ("tfrecord", "streams"), _Streams)  # closed when the run is forgotten
        held = _STREAM.pop(key, None)
        if held is None or held.number > wanted[0]:
            _close_streams()
            if held is not None:
                held.close()
            try:
                if self.identity:
                    opened(self.run, ("tfrecord", self.identity), self._unchanged)
                held = _Stream(_open(self.url, self.storage_options, name), kind, where)
            except OSError as exc:
                return {s.index: exc for s in run}
            details = getattr(held.raw, "details", None) or {}
            said = [str(details[k]) for k in ("ETag", "VersionId") if details.get(k)]
            replaced = listing.replaced(where, run[0].listed, said)
            if replaced is not None:
                held.close()
                raise replaced
        out: dict[int, Any] = {}
        try:
            for record in wanted:
                while held.number <= record:
                    offset, data = next(held.frames)
                    if held.number == record:
                        out[first + record] = (bytes(data), f"{where} at offset {offset}")
                    held.number += 1
        except (StopIteration, OSError, DataError) as exc:
            held.close()
            problem = exc if not isinstance(exc, StopIteration) else OSError("it ends early")
            for s in run:
                out.setdefault(s.index, problem)
            return out
        _STREAM[key] = held  # for the chunks still to come, and this process's next task
        return out


class _Stream:
    """A compressed file read on record after record: the file, its decompressing stream, its
    frames and the number of the next one."""

    def __init__(self, raw: Any, kind: str, where: str) -> None:
        from imgpack.formats.tfrecord import framing

        self.raw = raw
        self.stream = framing.open_stream(raw, kind)
        self.frames = framing.iter_frames(self.stream, where)
        self.number = 0

    def close(self) -> None:
        self.stream.close()  # (a GzipFile leaves the file it was given open)
        self.raw.close()


#: Records of the chunk being converted in this process (:meth:`RecordRangeFetcher.prefetch`),
#: by sample index: ``(frame data, where)``, or why it could not be read.
_RECORDS: dict[int, Any] = {}
#: Where the shard task this process runs ends in each file it reads (``expect``).
_BOUNDS: dict[str, int] = {}
#: The stretch this process read last, by run and file URL: ``(listed content, start, end,
#: bytes)``.
_STRETCH: dict[str, tuple[int, int, int, bytes]] = {}
#: The compressed file this process reads on, by run and file URL: chunks and shard tasks read
#: on from it in order, each process its own, until a chunk of another file or run, or an
#: earlier record, needs a new one; a shard task that reads another file closes it
#: (:meth:`RecordRangeFetcher.expect`), as does the end of the run.
_STREAM: dict[str, _Stream] = {}


def _close_streams() -> None:
    for held in _STREAM.values():
        held.close()
    _STREAM.clear()


class _Streams:
    """This process's streams among the run's opened sources (:func:`~imgpack.sources.base.
    opened`): closed with them when the run ends (:func:`~imgpack.sources.base.forget`)."""

    def close(self) -> None:
        _close_streams()
