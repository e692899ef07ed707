"""WebDataset shards other tools wrote, as a source (tars without an imgpack manifest).

SRC is a ``.tar`` file, a folder of ``.tar`` files (sorted by name) or a glob. Members are
grouped into samples by key as the ``webdataset`` package does (the member name up to the first
dot of its base name: ``000123.jpg``, ``000123.cls``), in the order the tars hold them. A sample's
image is its first member with an image extension (``jpg``, ``png``, ``webp``, ...); its label
is the integer in ``key.cls``, else the ``"label"`` of ``key.json`` (an integer or a class name);
see :func:`imgpack.sources.base.label_map` for the label map. A sample's source path is
``<tar name>/<image member name>``. A sample without an image or a label, or a key that appears
twice, stops the run naming it (``--on-error skip`` records it and goes on).

A bucket folder of ``.tar`` objects and nothing else is read in place (the pipeline lists it,
:func:`imgpack.sources.listing.source_folder`): each tar is read through once by a scan task
(:func:`scan_tar`), which keeps where each sample's members lie, and each conversion task reads
its samples' members with one ranged GET per stretch of a tar (:class:`TarRangeFetcher`); the
samples, their order and the output are those of a downloaded copy.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpack.errors import DataError, ImageError, OptionError, ScanError, first_line
from imgpack.fields import Field, member_value
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes
from imgpack.scan import UNLABELLED, Distinct, Sample, SampleTable, Scan, listed_id
from imgpack.sources import listing
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    empty_classes,
    files_identity,
    has_subfolders,
    kept_fields,
    label_map,
    opened,
)
from imgpack.sources.webdataset.found import Found, FoundTable
from imgpack.storage.location import TRANSFERS, filesystem, read_objects
from imgpack.system import each_task, lends_tasks

#: Member extensions (lower case) taken for a sample's image.
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm")


def tar_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The ``.tar`` files ``src`` names (a file, a folder of them, a glob), or ``None``."""
    text = os.fspath(src)
    if any(ch in text for ch in "*?["):
        found = [Path(p) for p in sorted(glob.glob(text)) if p.endswith(".tar")]
        return found or None
    path = Path(text)
    if path.is_file():
        return [path] if path.suffix == ".tar" else None
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".tar")
        return found or None
    return None


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name, as the ``webdataset`` package splits it."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext if dot else ""


class WebDatasetSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        if listing.remote_source(src) is not None:  # a bucket's listing: of tars only
            return bool(listed_tars(src))
        return not has_subfolders(src) and bool(tar_files(src))

    @functools.cached_property
    def remote(self) -> tuple[str, dict[str, Any]] | None:
        """Tars in a bucket whose listing only SRC holds (read in place): their folder's URL
        and storage options."""
        return listing.remote_source(self.src) if self.src.is_dir() else None

    def check(self) -> None:
        if self.remote is not None:
            if not listed_tars(self.src):
                raise FileNotFoundError(f"{self.remote[0]}: holds no .tar object")
            return
        if not tar_files(self.src):
            raise FileNotFoundError(f"{self.src}: names no .tar file")

    def files(self) -> list[Path]:
        files = tar_files(self.src) or []
        names = [p.name for p in files]
        if len(set(names)) != len(names):
            raise ScanError(f"{self.src}: names two tar files of one name (source paths start "
                            "with the tar's name): convert them separately")  # fmt: skip
        return files

    @property
    def labelled(self) -> bool:
        return bool(self.settings.get("labels", True))

    def scan(self, request: ScanRequest) -> Scan:
        labelled = self.labelled
        if not labelled and request.classes is not None:
            raise OptionError(
                "an unlabelled source has no classes: --classes-from does not apply to --no-labels"
            )
        # (tar name, the name errors give it, its listed content id, its samples)
        tars: list[tuple[str, str, int, Sequence[Found]]]
        remote = self.remote
        if remote is not None:
            listed = listed_tars(self.src)
            found_in = listing.scanned_once(  # a part's or a resume's: no tar read again
                self.src,
                f"webdataset labelled={labelled}",
                lambda: scan_tars(remote, listed, labelled, request.runner),
                lambda tar: [list(f) for f in tar],
                lambda kept: FoundTable(Found(*f) for f in kept),
            )
            tars = [(name, f"{remote[0]}/{name}", listed_id(tag), found)
                    for (name, _, tag), found in zip(listed, found_in, strict=True)]  # fmt: skip
            del found_in  # (each tar's found samples are let go as the table takes them)
        else:
            tars = [(p.name, str(p), 0, _samples(p, labelled)) for p in self.files()]
        # Two passes over what the scan found, holding no other object per sample: the label
        # values, member extensions and problems first; then the samples, packed, each tar's
        # found samples let go once they are in the table.
        unreadable: list[dict[str, str]] = []
        values = Distinct()  # what label_map makes the label map of
        extensions: dict[str, int] = {}  # how many samples have a member of each extension
        count = 0
        for name, shown, _, samples_found in tars:
            for f in samples_found:
                if f.problem is not None:
                    _bad(request, unreadable, shown, f.key, _where(name, f), f.problem)
                    continue
                count += 1
                values.index(f.value)
                for ext in f.others:
                    if ext != "cls" or not labelled:
                        extensions[ext] = extensions.get(ext, 0) + 1
        if labelled:
            classes, label_of = label_map(values.values, request.classes)
        else:
            classes, label_of = [], lambda _: UNLABELLED
        fields, names = _fields(extensions, count, request)
        samples = SampleTable()
        for k, (name, shown, tag, samples_found) in enumerate(tars):
            for f in samples_found:
                if f.problem is not None:
                    continue
                where = _where(name, f)
                label = label_of(f.value)
                if isinstance(label, str):
                    member = where.partition("/")[2]
                    _bad(request, unreadable, shown, split_key(member)[0], where, label)
                elif remote is not None:
                    samples.add(where, label, f.start, tag, size=f.size, span=f.end - f.start)
                else:
                    samples.add(where, label, len(samples), size=f.size)
            tars[k] = (name, shown, tag, [])
        if not samples and not unreadable:
            raise ScanError(f"{self.src}: its tar files hold no sample")
        return Scan(
            classes=classes,
            samples=samples,
            empty_classes=empty_classes(classes, samples.labels()),
            unreadable=unreadable,
            origin={"format": "webdataset", "foreign": True, "files": len(tars)},
            fields=fields,
            field_names=names,
        )

    def identity(self, scan: Scan) -> str:
        if self.remote is not None:
            return ""  # the listing (every tar's size and ETag) is in the output id
        return files_identity(self.files())

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        if self.remote is not None:
            url, options = self.remote
            options_json = json.dumps(options, sort_keys=True)
            return TarRangeFetcher(url, options_json, run, tuple(scan.fields))
        files = tuple(str(p) for p in self.files())
        return TarFetcher(files, self.identity(scan), run, tuple(scan.fields))


#: Member extensions taken as text and as JSON fields (any other is ``bytes``).
TEXT_MEMBERS = ("txt", "text")
JSON_MEMBERS = ("json", "jsn")


def _where(tar: str, found: Found) -> str:
    """The source path of a sample of ``tar``: its image member's, else its key's."""
    return f"{tar}/{found.image}" if found.image else f"{tar}/{found.key}"


def _fields(
    extensions: dict[str, int], count: int, request: ScanRequest
) -> tuple[list[Field], list[str]]:
    """The samples' other members as fields, by extension in the order first seen (those
    ``--fields`` names, if given): ``txt`` text, ``json`` JSON, any other bytes, or the type
    ``--field`` gives; optional where fewer than ``count`` samples (every one scanned) have
    one. ``extensions``: how many samples have each. And every such extension."""
    every = list(extensions)

    def infer(ext: str) -> Field:
        kind = "str" if ext in TEXT_MEMBERS else "json" if ext in JSON_MEMBERS else "bytes"
        return Field(ext, kind, optional=extensions[ext] < count)

    fields = kept_fields(every, request, infer, lambda ext: f"member extension {ext!r}")
    return fields, every


def _bad(
    request: ScanRequest,
    unreadable: list[dict[str, str]],
    tar: str,
    key: str,
    where: str,
    problem: str,
) -> None:
    if request.on_error == "fail":
        raise ScanError(
            f"{tar}: sample {key!r}: {problem} (use --on-error skip to convert without it, "
            "recorded as skipped)"
        )
    unreadable.append({"path": where, "reason": problem})


def _samples(path: Path, labelled: bool = True) -> FoundTable:
    """Every sample of the tar file at ``path``, in order (:func:`samples_of`)."""
    try:
        with tarfile.open(path, "r:") as tar:
            return samples_of(tar, path.stat().st_size, labelled)
    except (OSError, tarfile.TarError) as exc:
        raise ScanError(f"{path}: not a readable tar file: {exc}") from None


def samples_of(tar: tarfile.TarFile, end: int, labelled: bool = True) -> FoundTable:
    """Every sample of ``tar`` (a file of ``end`` bytes, opened to be read through or as a
    stream), in order (``labelled``: each label read from its ``.cls`` or ``.json`` as the
    tar goes by; else none). Raises :class:`tarfile.TarError` or :class:`OSError` for a tar
    that cannot be read."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    spans: dict[str, list[int]] = {}
    texts: dict[str, dict[str, bytes]] = {}
    order: list[str] = []
    problems: dict[str, str] = {}
    last = None
    for member in _members(tar, end):
        if not member.isfile():
            continue
        key, ext = split_key(member.name)
        if member.offset_data + member.size > end:
            problems.setdefault(key, f"{member.name} declares {member.size:,} bytes, past "
                                f"the end of the tar ({end:,} bytes): a truncated file")  # fmt: skip
        if key != last and key in groups:
            problems.setdefault(key, "its members are not together in the tar (the key "
                                "appears twice)")  # fmt: skip
        last = key
        if key not in groups:
            groups[key], spans[key], texts[key] = {}, [member.offset, 0], {}
            order.append(key)
        spans[key][1] = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * 512
        ext = ext.lower()
        if ext not in groups[key]:
            groups[key][ext] = member
            if labelled and ext in ("cls", "json") and member.size <= 1 << 20:
                handle = tar.extractfile(member)  # now: a stream reads each member once
                texts[key][ext] = handle.read() if handle else b""
    out = FoundTable()
    for key in order:
        members = groups[key]
        kind = next((e for e in IMAGE_SUFFIXES if e in members), None)
        image = members[kind].name if kind is not None else None
        size = members[kind].size if kind is not None else -1
        value, problem = _label(members, texts[key]) if labelled else (None, None)
        if image is None:
            problem = "no image member (" + ", ".join(f".{e}" for e in members) + ")"
        others = [e for e in members if e != kind]
        start, stop = spans[key]
        out.append(Found(key, image, value, problems.get(key, problem), others, size, start, stop))
    return out


def _members(tar: tarfile.TarFile, end: int) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar`` (``end`` bytes) in order; where the tar ends inside the last
    one's data (its header declares more bytes than follow), that member still, and then the
    end: the scan names its sample instead of losing it or the whole tar."""
    member: tarfile.TarInfo | None = None
    while True:
        try:
            member = tar.next()
        except tarfile.ReadError:
            if member is not None and member.offset_data + member.size > end:
                return  # the last member yielded runs past the end: it is named as truncated
            raise
        if member is None:
            return
        yield member


def _label(members: dict[str, tarfile.TarInfo], texts: dict[str, bytes]) -> tuple[Any, str | None]:
    """The label value of a sample (its ``.cls``, else its ``.json``'s ``label``, whose bytes
    are in ``texts``), or why none."""
    for ext in ("cls", "json"):
        member = members.get(ext)
        if member is None or ext not in texts:
            continue
        text = texts[ext].decode("utf-8", "replace").strip()
        if ext == "cls":
            if text.isascii() and text.isdigit():
                return int(text), None
            return None, f"{member.name} holds {text[:40]!r}, not a label >= 0"
        try:
            value = json.loads(text).get("label")
        except (ValueError, AttributeError):
            return None, f"{member.name} is not a JSON object"
        if isinstance(value, bool) or not isinstance(value, (int, str)) or value in ("", None):
            return None, f'{member.name} has no "label" (an integer or a class name)'
        if isinstance(value, int) and value < 0:
            return None, f"{member.name}: label {value} is negative"
        return value, None
    return None, 'no label (.cls, or a .json with a "label")'


@dataclass(frozen=True)
class TarFetcher(Fetcher):
    """One sample's image member, read at its offset, through the image policy."""

    paths: tuple[str, ...]
    identity: str
    run: str
    #: The fields kept: each read from the sample's member of that extension.
    fields: tuple[Field, ...] = ()

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        name, _, member = sample.path.partition("/")
        members = opened(self.run, ("webdataset", self.identity), self._open)
        path, found = members.get(name, ("", {}))
        where = found.get(member)
        if where is None:
            raise ImageError(sample.path, "no such member (the tar changed since the scan)")
        offset, size = where
        try:
            with open(path, "rb") as fh:
                data = os.pread(fh.fileno(), size, offset)
        except OSError as exc:
            raise ImageError(sample.path, f"cannot read: {exc.strerror}") from None
        if len(data) != size:
            raise ImageError(sample.path, "the tar is truncated")
        encoded = process_bytes(data, sample.path, sample.label, policy, encoding)
        if self.fields:
            encoded.fields = self._values(sample.path, path, member, found)
        return encoded

    def _values(
        self, where: str, path: str, image: str, found: dict[str, tuple[int, int]]
    ) -> dict[str, Any]:
        """The sample's field values, each from its member (none: the value is absent)."""
        key = split_key(image)[0]
        members: dict[str, bytes] = {}
        with open(path, "rb") as fh:
            for f in self.fields:
                spot = found.get(f"{key}.{f.name}")
                if spot is None:
                    continue
                data = os.pread(fh.fileno(), spot[1], spot[0])
                if len(data) != spot[1]:
                    raise ImageError(where, f"member {key}.{f.name}: the tar is truncated")
                members[f"{key}.{f.name}"] = data
        return _field_values(where, image, members, self.fields)

    def _open(self) -> dict[str, tuple[str, dict[str, tuple[int, int]]]]:
        """Each tar's path and where its members' data are: read once per worker and run."""
        files = [Path(p) for p in self.paths]
        if self.identity and files_identity(files) != self.identity:
            raise changed_source(str(files[0].parent))
        index = {}
        for path in files:
            with tarfile.open(path, "r:") as tar:
                found = _members(tar, path.stat().st_size)
                members = {m.name: (m.offset_data, m.size) for m in found if m.isfile()}
            index[path.name] = (str(path), members)
        return index


# -- tars in a bucket, read in place ---------------------------------------------------------
#: Bytes asked of the store at once while a tar in a bucket is scanned (read through once).
SCAN_BLOCK = 16 << 20


def listed_tars(folder: Path) -> list[tuple[str, int, str]]:
    """``(name, size, etag)`` of the ``.tar`` objects a bucket listing holds at SRC's top, by
    name, when that is all it holds (no folder, no other visible object): tars read in place
    (:func:`imgpack.sources.listing.source_folder`); else ``[]``."""
    index = listing.store_folders(folder) or {}
    if any(name for name in index) or "" not in index:
        return []
    objects = sorted(listing.store_objects(folder, ""))
    visible = [o for o in objects if not o[0].startswith(".")]
    if not visible or any(not name.endswith(".tar") for name, _, _ in visible):
        return []
    return [o for o in objects if o[0].endswith(".tar")]


def scan_tars(
    remote: tuple[str, dict[str, Any]],
    tars: list[tuple[str, int, str]],
    labelled: bool,
    runner: Any = None,
) -> list[FoundTable]:
    """The samples of each tar in a bucket, each tar read through once (a stream, nothing
    kept): by ``runner``'s tasks, a tar each, where the conversion's executor lends them
    (:func:`~imgpack.system.lends_tasks`), else here on a few threads."""
    url, options = remote
    items = [(url, json.dumps(options, sort_keys=True), name, size, labelled)
             for name, size, _ in tars]  # fmt: skip
    if len(items) > 1 and lends_tasks(runner):
        tasks = each_task(runner, scan_tar, items, lambda item: (f"{url}/{item[2]}", "reading it"))
        return [result for _, result in tasks]
    with ThreadPoolExecutor(min(TRANSFERS, max(1, len(items)))) as pool:
        return list(pool.map(scan_tar, items))


def scan_tar(item: tuple[str, str, str, int, bool]) -> FoundTable:
    """The samples of one tar in a bucket: ``(folder URL, storage options as JSON, tar name,
    its listed size, labelled)``, read through as a stream."""
    url, options, name, size, labelled = item
    fs, root = filesystem(url, json.loads(options) or None)
    try:
        with (
            fs.open(f"{root}/{name}", "rb", block_size=SCAN_BLOCK, size=size) as stream,
            tarfile.open(fileobj=stream, mode="r|") as tar,
        ):
            return samples_of(tar, size, labelled)
    except (OSError, tarfile.TarError) as exc:
        raise ScanError(f"{url}/{name}: not a readable tar file: {exc}") from None


@dataclass(frozen=True)
class TarRangeFetcher(Fetcher):
    """Samples of tars in a bucket, read where they are: the members of each chunk's samples
    of one tar with one ranged GET (:attr:`Sample.index <imgpack.scan.Sample.index>` and
    :attr:`~imgpack.scan.Sample.span` say where), the store's ETag checked against the
    listing's; a tar is never downloaded whole."""

    url: str
    #: The fsspec storage options, as JSON (the fetcher stays small and hashable).
    storage_options: str
    #: The conversion run: what a process read ahead for one run is never taken by another.
    run: str
    #: The fields kept: each read from the sample's member of that extension.
    fields: tuple[Field, ...] = ()

    def prefetch(self, samples: Sequence[Sample]) -> None:
        """Read the members of a chunk of samples: a chunk's samples of one tar are one stretch
        of it, in the plan's order, read with what follows it (:data:`READ_AHEAD` bytes a
        GET), so that the next chunks find theirs read already."""
        _MEMBERS.clear()
        _MEMBERS.update(self._read(samples))

    def expect(self, samples: Sequence[Sample]) -> None:
        """The shard task's samples: a read ahead stops at their end in each tar."""
        _BOUNDS.clear()
        for sample in samples:
            key = self._key(sample.path.partition("/")[0])
            _BOUNDS[key] = max(_BOUNDS.get(key, 0), sample.index + sample.span)

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        members = _MEMBERS.pop(sample.path, None)
        if members is None:
            members = self._read([sample])[sample.path]
        if isinstance(members, BaseException):
            raise ImageError(sample.path, f"cannot read {self.url}: {members}") from None
        name, _, image = sample.path.partition("/")
        data = members.get(image)
        if data is None:
            raise ImageError(
                sample.path,
                f"no such member in {self.url}/{name} (the tar changed since it was scanned: convert again)",
            )
        encoded = process_bytes(data, sample.path, sample.label, policy, encoding)
        if self.fields:
            encoded.fields = _field_values(sample.path, image, members, self.fields)
        return encoded

    def _key(self, tar: str) -> str:
        return f"{self.run} {self.url}/{tar}"

    def _read(self, samples: Sequence[Sample]) -> dict[str, dict[str, bytes] | BaseException]:
        """The members of ``samples`` by name, per sample path (or why they cannot be read):
        from the stretch read last where it holds them, else read now, with what follows them
        up to :data:`READ_AHEAD` bytes within the shard task's samples (:meth:`expect`)."""
        runs: list[list[Sample]] = []
        for sample in samples:
            tar = sample.path.partition("/")[0]
            if runs and runs[-1][0].path.partition("/")[0] == tar:
                runs[-1].append(sample)
            else:
                runs.append([sample])
        wanted: list[tuple[list[Sample], str, int, int]] = []
        out: dict[str, dict[str, bytes] | BaseException] = {}
        for run in runs:
            tar = run[0].path.partition("/")[0]
            start = min(s.index for s in run)
            end = max(s.index + s.span for s in run)
            held = _STRETCH.get(self._key(tar))
            if (
                held is not None
                and held[0] == run[0].listed
                and held[1] <= start
                and end <= held[2]
            ):
                out.update((sample.path, held[3]) for sample in run)
            else:
                wanted.append((run, tar, start, end))
        if not wanted:
            return out
        fs, root = filesystem(self.url, json.loads(self.storage_options) or None)
        paths = [f"{root}/{tar}" for _, tar, _, _ in wanted]
        spans = [
            (start, max(end, min(start + READ_AHEAD, _BOUNDS.get(self._key(tar), 0))))
            for _, tar, start, end in wanted
        ]
        _STRETCH.clear()
        found_all = read_objects(fs, paths, spans)
        for (run, tar, start, end), found in zip(wanted, found_all, strict=True):
            members: dict[str, bytes] | BaseException
            if isinstance(found, BaseException):
                members = found
            else:
                data, said = found
                replaced = listing.replaced(f"{self.url}/{tar}", run[0].listed, said)
                if replaced is not None:
                    raise replaced
                members, whole = _stretch_members(data, f"{self.url}/{tar}", start)
                if isinstance(members, dict):
                    if whole < end - start:
                        members = DataError(
                            f"{self.url}/{tar}: ends at byte {start + len(data):,}, inside the "
                            "samples the scan found (the tar changed since it was scanned: convert again)"
                        )
                    else:
                        _STRETCH[self._key(tar)] = (
                            run[0].listed,
                            start,
                            start + whole,
                            members,
                        )
            out.update((sample.path, members) for sample in run)
        return out


#: Bytes a GET of a tar in a bucket asks for at least, within its shard task's samples: the
#: stretch a chunk of samples needs and what follows it, which the task's next chunks take from
#: memory.
READ_AHEAD = 8 << 20
#: Members of the chunk being converted in this process (:meth:`TarRangeFetcher.prefetch`), by
#: sample path: the members of its stretch of the tar by name, or why they could not be read.
_MEMBERS: dict[str, Any] = {}
#: Where the shard task this process runs ends in each tar it reads (:meth:`TarRangeFetcher.expect`).
_BOUNDS: dict[str, int] = {}
#: The stretches this process read last, by run and tar URL: ``(listed content, start, end,
#: members)``.
_STRETCH: dict[str, tuple[int, int, int, dict[str, bytes]]] = {}


def _stretch_members(
    data: bytes, where: str, start: int
) -> tuple[dict[str, bytes] | BaseException, int]:
    """The file members in ``data`` (a stretch of a tar from a member's header on, perhaps cut
    inside a member at its end: it was read ahead) by name, and the bytes they span, to the
    padded end of the last whole member."""
    members: dict[str, bytes] = {}
    whole = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            for member in tar:
                if member.offset_data + member.size > len(data):
                    break  # cut by the read's end: read again by the chunk that needs it
                if member.isfile():
                    handle = tar.extractfile(member)
                    members.setdefault(member.name, handle.read() if handle else b"")
                whole = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * 512
    except (OSError, tarfile.TarError) as exc:
        if not members:
            failed = DataError(
                f"{where}: bytes {start:,} on are not the members the scan found ({exc})"
            )
            return failed, 0
    return members, min(whole, len(data))


def _field_values(
    where: str, image: str, members: dict[str, bytes], fields: tuple[Field, ...]
) -> dict[str, Any]:
    """A sample's field values from its members (none: the value is absent)."""
    key = split_key(image)[0]
    values: dict[str, Any] = {}
    for f in fields:
        data = members.get(f"{key}.{f.name}")
        if data is None:
            continue
        try:
            values[f.name] = member_value(f, data)
        except (ValueError, DataError) as exc:
            reason = first_line(exc).removeprefix("member: ")
            raise ImageError(where, f"member {key}.{f.name}: {reason}") from None
    return values
