"""A label list as a source: the layout Kaggle and many annotation tools export.

The list is a CSV file (a header row naming the columns, then one row per image) or a JSON Lines
file (``.jsonl``/``.ndjson``: one object per line), with a path column (``path``) and a label
column (``label``); ``-s path_column=`` and ``-s label_column=`` name others. A path is relative
to SRC (``--labels FILE``: SRC is the folder the paths are relative to) or to the list's folder
(the list as SRC), absolute, or a URL (``s3://...``, read in the workers through fsspec). Samples
keep the list's order and its paths as written. Each image's size is known before any is read
(a file's stat; the URLs' sizes asked of their stores in bulk), so the output is planned shard
by shard and written by shard tasks, as an image folder's is. With ``--labels FILE`` and SRC a
bucket folder, SRC is listed, not downloaded: each relative path names the object at that path
under SRC (``./`` and ``..`` resolved, never above SRC), sized and known by the listing, and
each worker GETs its own rows' objects.

Labels are class names or integers. When every label is an integer ``>= 0`` they are the labels
and the classes are ``"0"`` to the largest; otherwise the classes are the sorted names. With
``--classes-from`` the names are looked up in that label map (integers are positions in it).

The list's other columns are per-sample fields (:mod:`imgpack.fields`), typed from their values
(:func:`~imgpack.fields.infer_field`) or as ``--field NAME:TYPE`` says; ``--fields`` keeps some.

A row that cannot be taken (no such file, a label that is not a class of the given label map, a
path listed twice, a line that is not UTF-8, a missing column, a field value that is not its
type) stops the run naming its line, or with ``--on-error skip`` is recorded as skipped
(``"<list>:<line>"`` when the row names no path).
"""

from __future__ import annotations

import csv
import functools
import heapq
import itertools
import json
import os
import posixpath
import stat
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from imgpack.errors import DataError, ImageError, OptionError, ScanError, first_line
from imgpack.fields import Field, from_text, infer_field
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes, read_regular_file
from imgpack.manifest import sha256_file
from imgpack.scan import UNLABELLED, Distinct, Sample, SampleTable, Scan, listed_id
from imgpack.sources import listing
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    digest,
    empty_classes,
    file_stamp,
    kept_fields,
    label_map,
)
from imgpack.sources.folder.source import ObjectFetcher

#: Listed objects looked up among a list's rows at once (SRC a bucket folder).
_LOOKUP_BATCH = 1 << 12
#: Bytes of a label list read at a time: the list is never held whole (100M rows are GBs).
_BLOCK = 1 << 20

#: The suffixes of files taken for a label list when given as SRC.
LIST_SUFFIXES = (".csv", ".jsonl", ".ndjson")


def is_url(path: str) -> bool:
    return "://" in path


class LabelListSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_file() and src.suffix.lower() in LIST_SUFFIXES

    @property
    def list_file(self) -> Path:
        given = self.settings.get("file")
        return Path(given) if given is not None else self.src

    @property
    def root(self) -> Path:
        """The folder relative paths start from."""
        return self.src if self.settings.get("file") is not None else self.list_file.parent

    @functools.cached_property
    def remote(self) -> tuple[str, dict[str, Any]] | None:
        """With ``--labels FILE``, SRC a bucket folder whose listing only SRC holds
        (:func:`imgpack.sources.listing.source_folder`): its URL and storage options."""
        if self.settings.get("file") is None or not self.src.is_dir():
            return None
        return listing.remote_source(self.src)

    def check(self) -> None:
        if not self.list_file.is_file():
            raise FileNotFoundError(f"{self.list_file}: no such label list")
        if self.settings.get("file") is not None and not self.src.is_dir():
            raise OptionError(
                f"{self.src}: not a folder (with --labels FILE, SRC is the folder the list's "
                "paths are relative to)"
            )

    def scan(self, request: ScanRequest) -> Scan:
        rows, values, unreadable = self._rows(request)
        if self.remote is not None:
            rows = self._with_listed_sizes(rows, request, unreadable)
        rows = _with_url_sizes(rows, request.runner)
        used = sorted(set(rows.labels()))  # the values of the rows still taken
        classes, label_of = label_map([values[k] for k in used], request.classes)
        labels = {k: label_of(values[k]) for k in used}
        fields, names = self._fields(rows, request)
        numbers = {k: label for k, label in labels.items() if isinstance(label, int)}
        if not names and len(numbers) == len(labels):
            # Every row taken as it is (a list of paths and labels): the rows' table is the
            # samples', labelled, not a second copy of it.
            samples = rows.relabelled([numbers.get(k, UNLABELLED) for k in range(len(values))])
        else:
            samples = self._taken(rows, labels, fields, request, unreadable)
        del rows
        if not samples and not unreadable:
            raise ScanError(f"{self.list_file}: lists no image")
        origin = {
            "format": "labels",
            "file": str(self.list_file.resolve()),
            "sha256": sha256_file(self.list_file, _BLOCK),
        }
        return Scan(
            classes=classes,
            samples=samples,
            empty_classes=empty_classes(classes, samples.labels()),
            unreadable=unreadable,
            origin=origin,
            fields=fields,
            field_names=names,
        )

    def _taken(
        self,
        rows: SampleTable,
        labels: Mapping[int, int | str],
        fields: list[Field],
        request: ScanRequest,
        unreadable: list[dict[str, str]],
    ) -> SampleTable:
        """The rows as samples: each with its label (``labels``: the label of each label
        value's position, or why there is none) and its fields' values; a row with neither is
        bad."""
        samples = SampleTable()
        for row in rows:
            label = labels[row.label]
            found, problem = self._values(fields, row.fields or {})
            if isinstance(label, str) or problem is not None:
                self._bad(request, unreadable, row.index, row.path, problem or str(label))
            else:
                samples.append(replace(row, label=label, fields=found))
        return samples

    def _with_listed_sizes(
        self, rows: SampleTable, request: ScanRequest, unreadable: list[dict[str, str]]
    ) -> SampleTable:
        """The rows, those naming objects under SRC (a bucket folder) with each object's size
        and listed ETag (:func:`~imgpack.scan.listed_id`) from SRC's listing (read once, one
        line at a time); a row whose object the listing lacks is bad. Each listed object is
        looked up among the rows by its key's hash (8 bytes a row, sorted), then by its key:
        no dict of every row's key."""
        assert self.remote is not None
        hashed = np.zeros(len(rows), np.int64)
        under = np.zeros(len(rows), bool)
        for k, row in enumerate(rows):
            if _under_src(row.path):
                hashed[k], under[k] = hash(bucket_key(row.path)), True
        order = np.flatnonzero(under)
        order = order[np.argsort(hashed[order], kind="stable")]
        hashed = hashed[order]
        sizes = np.full(len(rows), -2, np.int64)  # -2: not listed
        etags = np.zeros(len(rows), np.int64)
        objects = listing.store_every_object(self.src)
        while batch := list(itertools.islice(objects, _LOOKUP_BATCH)):
            wanted = np.fromiter((hash(path) for path, _, _ in batch), np.int64, len(batch))
            first = np.searchsorted(hashed, wanted)
            hits = first < len(hashed)
            hits[hits] = hashed[first[hits]] == wanted[hits]
            for j in np.flatnonzero(hits).tolist():
                path, size, etag = batch[j]
                at = int(first[j])
                while at < len(hashed) and hashed[at] == wanted[j]:  # (hashes may collide)
                    k = int(order[at])
                    if bucket_key(rows[k].path) == path:  # (two rows never name one object)
                        sizes[k], etags[k] = size, listed_id(etag)
                        break
                    at += 1
        del hashed, order
        kept = SampleTable()
        for k, row in enumerate(rows):
            if not under[k]:
                kept.append(row)
            elif sizes[k] != -2:
                kept.append(replace(row, size=int(sizes[k]), listed=int(etags[k])))
            else:
                where = f"{self.remote[0]}/{bucket_key(row.path)}"
                problem = f"{row.path}: no such object ({where})"
                self._bad(request, unreadable, row.index, row.path, problem)
        return kept

    def _fields(self, rows: SampleTable, request: ScanRequest) -> tuple[list[Field], list[str]]:
        """The list's other columns as fields, in the list's order (those ``--fields`` names,
        if given): each of the type given (``--field NAME:TYPE``) or inferred from its values
        (:func:`infer_field`); and the names of all of them."""
        none: Mapping[str, Any] = {}
        records = [row.fields or none for row in rows]  # each row's other columns
        names: dict[str, None] = {}
        for record in records:
            names.update((k, None) for k in record)
        if not names:
            records.clear()
        every = list(names)
        text = not self._json_lines
        found = kept_fields(
            every,
            request,
            lambda name: infer_field(name, [r.get(name) for r in records], text=text),
            lambda name: f"{self.list_file}: column {name!r}",
        )
        return found, every

    def _values(
        self, fields: list[Field], record: Mapping[str, Any]
    ) -> tuple[dict[str, Any] | None, str | None]:
        """One row's field values (each as its field holds it), or why the row is refused."""
        if not fields:
            return None, None
        values: dict[str, Any] = {}
        for f in fields:
            value = record.get(f.name)
            if value is None or (not self._json_lines and value == ""):
                value = None
            elif not self._json_lines:
                try:
                    value = from_text(f.type, value)
                except ValueError as exc:
                    return None, f"column {f.name!r} ({f.type}): {exc}"
            elif f.type == "bytes" and isinstance(value, str):
                value = value.encode("utf-8")  # JSON has no bytes: a text's UTF-8
            try:
                values[f.name] = f.value(value, "row")
            except DataError as exc:
                return None, first_line(exc).removeprefix("row: ")
        return values, None

    @property
    def _json_lines(self) -> bool:
        return self.list_file.suffix.lower() in (".jsonl", ".ndjson")

    def _rows(self, request: ScanRequest) -> tuple[SampleTable, list[Any], list[dict[str, str]]]:
        """Every good row as a sample, packed (its line as its index, its file's size, ``-1``
        for a URL's; its other columns as its fields; as its label, the position of its label
        value in the list of distinct values), that list, and the bad rows skipped so far."""
        path_key = self.settings["path_column"]
        label_key = self.settings["label_column"]
        rows = SampleTable()
        values = Distinct()  # a list's few label values, each kept once
        unreadable: list[dict[str, str]] = []
        # Each good row's file, hashed (8 bytes a row, where a dict of the files took 100):
        # two rows naming one file are found once every row is read.
        files = array("q")
        # What is wrong with each bad row, in line order: said at once where it stops the run.
        bad: list[tuple[int, str | None, str]] = []
        # A row keeps its other columns only (the fields' values): none, in a list of paths
        # and labels.
        own = (path_key, label_key)
        for line, record, problem in self._records():
            path = record.get(path_key) if record is not None else None
            identity: Any = None
            size = -1
            if record is not None and problem is None:
                problem, identity, size = self._problem(record, path_key, label_key)
            if problem is None and isinstance(path, str):
                files.append(hash(identity))
                assert record is not None  # (a row without a problem has one)
                others = {k: v for k, v in record.items() if k not in own} or None
                rows.add(path, values.index(record[label_key]), line, fields=others, size=size)
                continue
            named = path if isinstance(path, str) else None
            bad.append((line, named, problem or "unreadable row"))
            if request.on_error == "fail":
                break
        rows, repeated = self._without_repeats(rows, files)
        for line, named, problem in heapq.merge(bad, repeated):
            self._bad(request, unreadable, line, named, problem)
        return rows, values.values, unreadable

    def _without_repeats(
        self, rows: SampleTable, files: array[int]
    ) -> tuple[SampleTable, list[tuple[int, str | None, str]]]:
        """``rows`` without those that name the file an earlier row names (``./img/0.png``
        and ``img/0.png``, ``img/../img/1.png``, a link: one file, never a second sample),
        and why each of those is refused, in line order. ``files``: each row's file, hashed;
        rows whose hashes are equal are compared by their files."""
        hashed = np.frombuffer(files, dtype=np.int64)
        ordered = np.sort(hashed)
        repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
        del ordered
        if not len(repeated):
            return rows, []
        alike = np.isin(hashed, repeated)
        first: dict[Any, int] = {}  # each file of those rows: the first row naming it
        refused: dict[int, tuple[int, str | None, str]] = {}
        for k in np.flatnonzero(alike).tolist():
            row = rows[k]
            found = self._file(row.path)
            identity = found[0] if not isinstance(found, str) else ("gone since", k)
            earlier = rows[first.setdefault(identity, k)]
            if earlier.index == row.index:
                continue
            if earlier.path == row.path:
                problem = f"{row.path} is listed already, on line {earlier.index}"
            else:
                problem = (
                    f"{row.path} is the file {earlier.path} names, listed on line {earlier.index}"
                )
            refused[k] = (row.index, row.path, problem)
        if not refused:
            return rows, []
        kept = SampleTable()
        for k, row in enumerate(rows):
            if k not in refused:
                kept.append(row)
        return kept, list(refused.values())

    def _problem(
        self,
        record: dict[str, Any],
        path_key: str,
        label_key: str,
    ) -> tuple[str | None, Any, int]:
        """What is wrong with one row (or ``None``), the file it names (:meth:`_file`) and
        that file's size (``-1`` for a URL)."""
        path, value = record.get(path_key), record.get(label_key)
        if not isinstance(path, str) or not path.strip():
            return f"no {path_key!r} value", None, -1
        if value is None or value == "":
            return f"no {label_key!r} value", None, -1
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return f"label {value!r} is neither a class name nor an integer", None, -1
        if isinstance(value, int) and value < 0:
            return f"label {value} is negative", None, -1
        found = self._file(path)
        if isinstance(found, str):
            return found, None, -1
        return None, *found

    def _file(self, path: str) -> tuple[Any, int] | str:
        """The file a row's path names, as one value for every path to it, and its size
        (``-1`` for a URL: asked of its store once every row is read); or why there is
        none."""
        if self.remote is not None and _under_src(path):
            key = bucket_key(path)
            if key == ".." or key.startswith("../"):
                return (
                    f"{path}: not under SRC (with --labels FILE, a relative path names an "
                    "object under SRC and may not climb above it)"
                )
            return ("object", key), -1  # sized from SRC's listing once every row is read
        if is_url(path):
            return path, -1
        try:
            st = os.stat(self._full(path))
        except (OSError, ValueError):
            return f"{path}: no such file"
        if not stat.S_ISREG(st.st_mode):
            return f"{path}: no such file"
        return st.st_dev << 64 | st.st_ino, st.st_size

    def _records(self) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
        """``(line, row, problem)`` for every row of the list, read as they come."""
        bad: dict[int, str] = {}
        lines = self._lines(bad)
        if self._json_lines:
            for number, text in enumerate(lines, 1):
                if number in bad:
                    yield number, None, bad[number]
                elif text.strip():
                    yield number, *_json_row(text)
            return
        reader = csv.reader(lines)
        header = next(reader, None)
        if 1 in bad or header is None:
            raise ScanError(f"{self.list_file}: line 1: {bad.get(1, 'empty list')}")
        columns = [c.strip() for c in header]
        for key in (self.settings["path_column"], self.settings["label_column"]):
            if key not in columns:
                flag = "path_column" if key == self.settings["path_column"] else "label_column"
                raise ScanError(
                    f"{self.list_file}: line 1: no {key!r} column (columns: {', '.join(columns)});"
                    f" name it with -s {flag}=NAME"
                )
        start = reader.line_num
        while True:
            try:
                values = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:  # a field over csv's limit, a NUL byte, ...
                raise ScanError(
                    f"{self.list_file}: line {reader.line_num}: not a CSV row ({exc}); is this "
                    "file a CSV label list?"
                ) from None
            number = start + 1
            start = reader.line_num
            if number in bad:
                yield number, None, bad[number]
            elif not any(v.strip() for v in values):
                continue
            elif len(values) != len(columns):
                yield number, None, f"{len(values)} values, the header names {len(columns)}"
            else:
                yield number, dict(zip(columns, (v.strip() for v in values), strict=True)), None

    def _lines(self, bad: dict[int, str]) -> Iterator[str]:
        """The list's lines as text, in order, read :data:`_BLOCK` bytes at a time: a line
        that is not UTF-8 comes as an empty line, why in ``bad`` by its number (set before
        it comes). Lines end where :meth:`bytes.splitlines` ends them."""
        for number, raw in enumerate(self._raw_lines(), 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad[number] = f"not valid UTF-8 text ({exc.reason} at byte {exc.start})"
                yield "\n"

    def _raw_lines(self) -> Iterator[bytes]:
        """The list's lines as bytes, without a UTF-8 byte order mark at its start (spreadsheet
        programs write one)."""
        rest, start = b"", True
        try:
            with self.list_file.open("rb") as fh:
                while block := fh.read(_BLOCK):
                    lines = (rest + block).splitlines(keepends=True)
                    rest = lines.pop()  # perhaps not whole yet (or a CR before its LF)
                    if lines and start:
                        lines[0], start = lines[0].removeprefix(b"\xef\xbb\xbf"), False
                    yield from lines
        except OSError as exc:
            raise ScanError(
                f"{self.list_file}: cannot read the label list: {exc.strerror}"
            ) from None
        if rest:
            yield rest.removeprefix(b"\xef\xbb\xbf") if start else rest

    def _full(self, path: str) -> str:
        """The file a row's local path names (as the workers read it: no :mod:`pathlib` for
        each of millions of rows, which keeps every name part it sees)."""
        return path if os.path.isabs(path) else os.path.join(self._root_text, path)

    @functools.cached_property
    def _root_text(self) -> str:
        return str(self.root)

    def _bad(
        self,
        request: ScanRequest,
        unreadable: list[dict[str, str]],
        line: int,
        path: str | None,
        problem: str,
    ) -> None:
        where = f"{self.list_file}: line {line}"
        if request.on_error == "fail":
            raise ScanError(
                f"{where}: {problem} (use --on-error skip to convert without it, recorded as "
                "skipped)"
            )
        unreadable.append(
            {"path": path or f"{self.list_file.name}:{line}", "reason": f"line {line}: {problem}"}
        )

    def stored_size(self, sample: Sample) -> int:
        return -1  # every size the scan could find is in Sample.size (a URL's store may lack one)

    def identity(self, scan: Scan) -> str:
        return digest((scan.origin or {}).get("sha256"))

    def stamp(self, sample: Sample) -> str:
        # A bucket SRC's objects are known by its listing (in the output id), URLs by nothing.
        if is_url(sample.path) or (self.remote is not None and _under_src(sample.path)):
            return "-"
        return file_stamp(self._full(sample.path))

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        if self.remote is not None:
            return LabelListFetcher(
                str(self.root), self.list_file.name, ObjectFetcher.of(self.remote)
            )
        return LabelListFetcher(str(self.root), self.list_file.name)


def _under_src(path: str) -> bool:
    """Whether a row's path is relative to SRC (not a URL, not absolute)."""
    return not is_url(path) and not os.path.isabs(path)


def bucket_key(path: str) -> str:
    """A relative row path as the key under a bucket SRC that a copy of it on disk would
    resolve it to: ``./`` and ``a/../`` resolved, doubled slashes collapsed."""
    return posixpath.normpath(path)


def _with_url_sizes(rows: SampleTable, runner: Any = None) -> SampleTable:
    """``rows`` with each URL row's object size as its store lists it (``-1`` where it has
    none: the task that reads it names it), asked by ``runner``'s workers where it lends them
    (:func:`~imgpack.storage.location.object_sizes_in_tasks`)."""
    urls = [row.path for row in rows if is_url(row.path)]
    if not urls:
        return rows
    from imgpack.storage.location import object_sizes_in_tasks

    sizes = iter(object_sizes_in_tasks(urls, runner))
    sized = SampleTable()
    for row in rows:
        sized.append(replace(row, size=next(sizes)) if is_url(row.path) else row)
    return sized


def _json_row(text: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, f"not a JSON object ({exc})"
    if not isinstance(value, dict):
        return None, f"not a JSON object (a {type(value).__name__})"
    return value, None


@dataclass(frozen=True)
class LabelListFetcher(Fetcher):
    """Reads a listed image: a file (relative to ``root``, or absolute) or a URL; with
    ``objects``, a relative path is the object at its :func:`bucket_key` under SRC, a bucket
    folder (the listed content, GET in chunks)."""

    root: str
    list_file: str
    objects: ObjectFetcher | None = None

    def prefetch(self, samples: Sequence[Sample]) -> None:
        if self.objects is not None:
            keys = [bucket_key(s.path) for s in samples if _under_src(s.path)]
            self.objects.prefetch_keys(keys)

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        path = sample.path
        try:
            if self.objects is not None and _under_src(path):
                data = self.objects.data(bucket_key(path), path, sample.listed)
            elif is_url(path):
                data = _read_url(path)
            else:
                full = path if os.path.isabs(path) else f"{self.root}/{path}"
                data = read_regular_file(full, path)
            return process_bytes(data, path, sample.label, policy, encoding)
        except ImageError as exc:  # named by its line too: the row to fix
            raise ImageError(
                exc.path, f"{exc.reason} ({self.list_file} line {sample.index})"
            ) from None


def _read_url(url: str) -> bytes:
    from imgpack.storage.location import filesystem, read_objects

    fs, where = filesystem(url)
    if "file" in _protocols(fs):  # file:///dev/zero: a device, read only as a regular file
        return read_regular_file(where, url)
    try:
        (found,) = read_objects(fs, [where])  # one GET (no HEAD first)
    except Exception as exc:  # fsspec backends raise their own errors
        found = exc
    if isinstance(found, BaseException):
        raise ImageError(url, f"cannot read: {type(found).__name__}: {found}") from None
    return found[0]


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
