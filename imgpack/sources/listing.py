"""A conversion source in a bucket: listed, or downloaded, into a local folder.

An image folder in a bucket is listed, not downloaded (the workers GET each sample's object,
:func:`source_folder` with ``listing_only``), as are a tree of images without labels, a folder
a label list's rows name, a folder of WebDataset tars and a folder of TFRecord files (read by
ranged GETs); other kinds are downloaded into a scratch folder first; an imgpack output is not
downloaded either: the folder only names it (:func:`remote_output`), and each process that reads
it opens it by its URL (the output source's scan tasks and shard tasks, each through its own
cache). Either way the scan's classes and order are those of a local copy of the same tree.

A listing is taken once per conversion: the run that lists SRC saves the listing in DST's work
folder (:func:`save_listing`), and the parts and resumes of that conversion read it from there
(:func:`source_location` with ``saved``) instead of listing SRC again, so they plan the very
samples it planned (one output id) without a LIST of SRC.

It sits with the storage layer (below the readers): ``imgpack verify`` of a bucket output takes
its files as they are through :func:`source_folder`.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import io
import json
import logging
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from imgpack.errors import (
    DataError,
    ImgpackError,
    ManifestError,
    ScanError,
    renamed,
)
from imgpack.manifest import MANIFEST_NAME, Manifest, manifest_bytes, sha256_file
from imgpack.opening import open_manifest
from imgpack.scan import listed_id
from imgpack.storage import claim
from imgpack.storage.cache import stats
from imgpack.storage.location import (
    TRANSFERS,
    Location,
    content_tag,
    filesystem,
    is_s3fs,
    is_url,
    local_path,
    no_bucket,
    remote_error,
)
from imgpack.system import each_task, lends_tasks

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TopLevel:
    """What a bucket SRC holds at its top level, as one delimiter listing says: its folders,
    and how many of its own objects are visible (not hidden), how many of those are ``.tar``
    and how many TFRecord files or their index files (:data:`RECORD_SUFFIXES`); ``is_object``:
    SRC is one object, not a folder."""

    folders: tuple[str, ...] = ()
    visible: int = 0
    tars: int = 0
    is_object: bool = False
    records: int = 0

    @property
    def visible_folders(self) -> int:
        return sum(not name.startswith(".") for name in self.folders)


@contextlib.contextmanager
def source_folder(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    listing_only: Callable[[TopLevel], bool] | None = None,
    runner: Any = None,
) -> Iterator[Path]:
    """A local folder holding what ``location`` holds: itself when local; a scratch copy of a
    URL's files (removed afterwards) when not, with what the store says of each object (its
    size and ETag or version) in :data:`STORE_LISTING`: a conversion identifies the source by
    those, not by the copy's modification times, so two conversions of one bucket (and the
    parts of one) get one output id.

    ``listing_only``: given what SRC holds at its top level (:class:`TopLevel`), whether to
    download nothing: the scratch folder then holds the listing only (:data:`STORE_LISTING`,
    :data:`STORE_FOLDERS`, and the URL in :data:`STORE_REMOTE`), and the conversion's workers
    read each object from the bucket (:func:`remote_source`). The listing is written to disk as
    it comes, the top level page by page, then one top-level folder at a time: the driver never
    holds the whole of it (nor, on S3, a flat bucket's millions of top-level objects).
    ``runner``: an executor that runs tasks (the conversion's pool, or Ray), whose workers list
    the folders, one task each (:func:`folder_lines`), so that parsing the store's pages is
    spread over their CPUs (the driver then holds the lines of the folders in flight, two per
    worker at most); else this process lists them, several at once on threads, each into a
    part file on disk."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    fs, root = filesystem(url, storage_options)
    scratch = Path(tempfile.mkdtemp(prefix="imgpack-src-"))
    try:
        try:
            part = scratch / ".imgpack-store-top.jsonl"
            options = json.dumps(storage_options or {}, sort_keys=True)
            with open(part, "wb") as out:
                top, shown = _list_top(fs, root, url, out, scratch, runner, options)
            if not top.is_object and not top.folders and not part.stat().st_size:
                raise ManifestError(f"{url}: nothing there")
            if listing_only is not None and listing_only(top):
                folders = list(top.folders)
                lister = _task_lister(runner, url, storage_options, len(folders))
                _write_listing(scratch, fs, root, (part, shown), folders, lister)
                remote = {"url": url, "storage_options": storage_options or {}}
                (scratch / STORE_REMOTE).write_text(json.dumps(remote, sort_keys=True))
            else:
                found = listed_objects(fs.find(root, detail=True))
                with open(part, "wb") as out:
                    shown = _write_objects(out, root, found)
                _write_listing(scratch, fs, root, (part, shown), [])
                with ThreadPoolExecutor(TRANSFERS) as pool:
                    list(pool.map(lambda f: _download(fs, f[0], root, scratch), found))
                del found
            part.unlink()
        except OSError as exc:
            raise remote_error(url, exc) from None
        fs.invalidate_cache(root)
        try:
            yield scratch
        except ImgpackError as exc:  # said of the scratch copy: named as the user named SRC
            raise renamed(exc, str(scratch), url) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _list_top(
    fs: Any, root: str, url: str, out: BinaryIO, scratch: Path, runner: Any, options: str
) -> tuple[TopLevel, int]:
    """SRC's top level by one delimiter listing: its folders (sorted), and its own objects'
    :data:`STORE_LISTING` lines written to ``out`` in path order; how many are visible. On S3
    page by page as the store returns them (1,000 keys a page, in key order: memory bounded by
    a page and the folders' names, :func:`top_range`), a top level of more than a page by
    ``runner``'s tasks where it lends them (:func:`_top_in_tasks`; ``options``: the storage
    options as JSON); elsewhere, for a bucket that keeps versions, and for SRC one object, with
    ``ls``."""
    s3 = is_s3fs(fs) and getattr(fs, "async_impl", False) and hasattr(fs, "_call_s3")
    if s3 and not getattr(fs, "version_aware", False):
        tasks = lends_tasks(runner)
        try:  # the first page here, then the rest by tasks; or every page here
            first = top_range((url, options, "", None, 1 if tasks else 0), fs, out)
        except FileNotFoundError:  # no bucket: said by ``ls`` below
            first = None
        if first is not None and (out.tell() or first.folders or first.rest is not None):
            found = [first]
            if first.rest is not None:
                found += _top_in_tasks(runner, url, options, first.rest, scratch)
            for part in found[1:]:
                assert isinstance(part.lines, Path)
                with open(part.lines, "rb") as held:
                    shutil.copyfileobj(held, out)
            shutil.rmtree(scratch / RANGE_PARTS, ignore_errors=True)
            folders = sorted({name for part in found for name in part.folders})
            visible, tars = sum(p.visible for p in found), sum(p.tars for p in found)
            records = sum(p.records for p in found)
            top = TopLevel(tuple(folders), visible, tars, records=records)
            return top, sum(p.shown for p in found)
    try:  # not S3, SRC one object, or nothing there: one ``ls``
        listed = fs.ls(root, detail=True)
    except FileNotFoundError as exc:
        missing = no_bucket(url, exc)
        if missing is not None:
            raise missing from None
        listed = []
    folders = sorted(_relative(i["name"], root) for i in listed if i.get("type") == "directory")
    files = sorted((i["name"], i) for i in listed if i.get("type") != "directory")
    names = [_relative(name, root) for name, _ in files]
    if "" in names:
        return TopLevel(tuple(folders), is_object=True), 0
    seen = [name for name in names if not name.startswith(".")]
    tars = sum(name.endswith(".tar") for name in seen)
    records = sum(name.endswith(RECORD_SUFFIXES) for name in seen)
    top = TopLevel(tuple(folders), len(seen), tars, records=records)
    return top, _write_objects(out, root, files)


#: The names of TFRecord files (as a local folder's are taken: :mod:`imgpack.sources.tfrecord`),
#: and of the index files DALI reads beside them (a conversion reads the files through and
#: takes no index).
RECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".idx")
#: LIST pages a task of the top level's listing asks before it hands the rest of its key range
#: back (:func:`top_range`): the driver splits the rest, so that the workers list at once.
RANGE_PAGES = 8
#: In the scratch folder while the top level is listed by tasks: each range's lines.
RANGE_PARTS = ".imgpack-store-ranges"
#: Above every ASCII key: the top level's keys range is cut here first, the keys past it (not
#: ASCII from their first character on) listed by one task.
_PAST_ASCII = "\x7f"


@dataclass
class TopRange:
    """What a task listed of the top level in a key range (:func:`top_range`)."""

    #: The :data:`STORE_LISTING` lines of its objects (or a file holding them), in key order.
    lines: bytes | Path
    folders: list[str]
    shown: int
    visible: int
    tars: int
    #: The last key listed when the range is not done (the rest starts after it), else None.
    rest: str | None
    records: int = 0


def top_range(
    item: tuple[str, str, str, str | None, int], fs: Any = None, out: BinaryIO | None = None
) -> TopRange:
    """A task: SRC's top level in the key range ``(after, until]`` (keys relative to SRC;
    ``until`` ``None``: to the end), at most ``pages`` LIST pages (``0``: every one); ``item``
    is the URL, its storage options as JSON, ``after``, ``until`` and ``pages``. Its lines go
    to ``out`` as each page comes (the driver's listing file), else into the result."""
    from fsspec.asyn import sync  # type: ignore[import-untyped]

    url, options, after, until, pages = item
    given, root = filesystem(url, json.loads(options) or None)
    fs = fs or given
    bucket, key, _ = fs.split_path(f"{root}/")
    held = io.BytesIO()
    lines = held if out is None else out
    found = TopRange(b"", [], 0, 0, 0, None)
    limit = None if until is None else key + until

    async def listed() -> None:
        asked: dict[str, Any] = {"Bucket": bucket, "Prefix": key, "Delimiter": "/"}
        if after:
            asked["StartAfter"] = key + after
        count, previous = 0, ""
        while True:
            page = await fs._call_s3("list_objects_v2", **asked)
            count += 1
            last = ""
            for folder in page.get("CommonPrefixes", []):
                name = folder["Prefix"]
                last = max(last, name)
                if limit is None or name <= limit:
                    found.folders.append(name[len(key) :].rstrip("/"))
            for entry in page.get("Contents", []):
                name = entry["Key"]
                last = max(last, name)
                if (limit is not None and name > limit) or name.endswith("/"):
                    continue  # past the range, or a folder marker
                if name < previous:
                    raise ScanError(f"{url}: the store listed its objects out of key order")
                previous = name
                info = {"size": entry.get("Size", 0), "ETag": entry.get("ETag", "")}
                found.shown += _write_objects(lines, root, [(f"{bucket}/{name}", info)])
                relative = name[len(key) :]
                if not relative.startswith("."):
                    found.visible += 1
                    found.tars += relative.endswith(".tar")
                    found.records += relative.endswith(RECORD_SUFFIXES)
            if not page.get("IsTruncated") or (limit is not None and last > limit):
                return
            if pages and count >= pages:
                found.rest = last[len(key) :]
                return
            asked["ContinuationToken"] = page["NextContinuationToken"]

    sync(fs.loop, listed)
    if out is None:
        found.lines = held.getvalue()
    return found


def _top_in_tasks(runner: Any, url: str, options: str, after: str, scratch: Path) -> list[TopRange]:
    """The top level after key ``after`` by ``runner``'s tasks: its keys range cut into a few
    ranges a worker each, every task listing :data:`RANGE_PAGES` pages and the rest of its
    range cut again (at keys between its last one and the range's end) for the next round,
    into as many ranges as keep every worker busy (a range where the keys crowd is cut in as
    many pieces as there are workers); the ranges' listings in key order, each on disk
    (``scratch``) until joined."""
    workers = max(2, int(getattr(runner, "workers", 0) or 2))
    pending: list[tuple[str, str | None]] = [*_cut(after, _PAST_ASCII, workers)]
    pending.append((_PAST_ASCII, None))
    done: list[tuple[str, TopRange]] = []
    parts = scratch / RANGE_PARTS
    parts.mkdir(exist_ok=True)
    while pending:
        items = [(url, options, low, high, RANGE_PAGES) for low, high in pending]
        pending = []
        tasks = each_task(
            runner, top_range, items, lambda i: (url, f"listing its keys after {i[2]!r}")
        )
        rests: list[tuple[str, str | None]] = []
        for (_, _, low, high, _), result in tasks:
            held = parts / f"{len(done)}.jsonl"
            held.write_bytes(result.lines if isinstance(result.lines, bytes) else b"")
            result.lines = held
            done.append((low, result))
            if result.rest is not None:
                rests.append((result.rest, high))
        each = max(2, -(-workers // max(1, sum(high is not None for _, high in rests))))
        for rest, high in rests:  # past ASCII (no end): one task to the end
            pending += [(rest, None)] if high is None else _cut(rest, high, each)
    return [result for _, result in sorted(done, key=lambda entry: entry[0])]


def _cut(low: str, high: str, count: int) -> list[tuple[str, str]]:
    """The key range ``(low, high]`` cut into up to ``count`` ranges, at keys between."""
    ranges = [(low, high)]
    while len(ranges) < count:
        widest = max(range(len(ranges)), key=lambda k: _room(*ranges[k]))
        start, end = ranges[widest]
        middle = _between(start, end)
        if middle is None:
            break
        ranges[widest : widest + 1] = [(start, middle), (middle, end)]
    return ranges


def _room(low: str, high: str) -> int:
    """How far apart two keys are at their first differing character (for the widest range)."""
    i = 0
    while i < len(low) and i < len(high) and low[i] == high[i]:
        i += 1
    lo = ord(low[i]) if i < len(low) else 0
    hi = ord(high[i]) if i < len(high) else 0
    return (hi - lo) * 128 ** max(0, 8 - i)


def _between(low: str, high: str) -> str | None:
    """A key strictly between ``low`` and ``high`` (``low < high``), or ``None`` where none is
    found among the ASCII keys: at the first character they differ, its middle, or one
    character further."""
    i = 0
    while i < len(low) and i < len(high) and low[i] == high[i]:
        i += 1
    if i >= len(high):
        return None
    lo = ord(low[i]) if i < len(low) else 0x1F
    hi = ord(high[i])
    if hi - lo >= 2 and hi <= 0x7F:
        middle = low[:i] + chr((lo + hi) // 2)
    elif hi - lo == 1 and i < len(low):
        rest = ord(low[i + 1]) if i + 1 < len(low) else 0x1F
        if 0x7F - rest < 2:
            return None
        middle = low[: i + 1] + chr((rest + 0x7F) // 2)
    else:
        return None
    return middle if low < middle < high else None


def listed_objects(found: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The objects of a ``find(..., detail=True)`` result, by path: folder markers and
    directory entries left out."""
    return sorted(
        (path, info)
        for path, info in found.items()
        if not path.endswith("/") and info.get("type", "file") != "directory"
    )


def _relative(path: str, root: str) -> str:
    return path.rstrip("/")[len(root) :].lstrip("/")


#: Lists SRC's top-level folders in order: ``(folder, its listing lines to read, visible
#: objects)``; the lines are read before the next folder is asked for.
Lister = Callable[[list[str]], Iterator[tuple[str, BinaryIO, int]]]


def _write_listing(
    scratch: Path,
    fs: Any,
    root: str,
    top: tuple[Path, int],
    folders: list[str],
    lister: Lister | None = None,
) -> None:
    """:data:`STORE_LISTING` and :data:`STORE_FOLDERS`: the lines of the top-level objects
    (``top``: the file holding them, and how many are visible), then each of ``folders`` in
    order, listed by ``lister`` (tasks of the conversion's workers) or else here, ``TRANSFERS``
    folders at once on threads, each into a part file of its own joined in order as it
    completes."""
    index: dict[str, list[int]] = {}
    with open(scratch / STORE_LISTING, "wb") as out:
        with open(top[0], "rb") as head:
            shutil.copyfileobj(head, out)
        if out.tell():
            index[""] = [0, out.tell(), top[1]]
        listed = lister(folders) if lister is not None else _threads(scratch, fs, root, folders)
        for name, lines, shown in listed:
            start = out.tell()
            shutil.copyfileobj(lines, out)
            if out.tell() > start:
                index[name] = [start, out.tell(), shown]
    (scratch / STORE_FOLDERS).write_text(json.dumps(index, sort_keys=True))


def _threads(
    scratch: Path, fs: Any, root: str, folders: list[str]
) -> Iterator[tuple[str, BinaryIO, int]]:
    """Each of ``folders`` listed here, ``TRANSFERS`` at once on threads, into part files (the
    lines of a folder wait on disk, not in memory, for the folders before it), in order; each
    read from its part file, removed once read."""
    parts = scratch / ".imgpack-store-parts"
    parts.mkdir()
    with ThreadPoolExecutor(TRANSFERS) as pool:
        window: collections.deque[tuple[str, Path, Any]] = collections.deque()
        pending = iter(enumerate(folders))
        while True:
            while len(window) < 2 * TRANSFERS:
                number, name = next(pending, (-1, ""))
                if number < 0:
                    break
                part = parts / f"{number}.jsonl"
                window.append((name, part, pool.submit(_list_folder_to, fs, root, name, part)))
            if not window:
                break
            name, part, future = window.popleft()
            shown = future.result()
            with open(part, "rb") as lines:
                yield name, lines, shown
            part.unlink()
    parts.rmdir()


def _task_lister(
    runner: Any, url: str, storage_options: dict[str, Any] | None, folders: int
) -> Lister | None:
    """The folders of SRC listed by ``runner``'s tasks, a folder each (two or more folders, an
    executor that runs tasks on workers that are there, or a cluster already running), else
    ``None`` (listed here: not worth a local Ray started and stopped for the listing alone)."""
    if folders < 2 or not lends_tasks(runner):
        return None
    options = json.dumps(storage_options or {}, sort_keys=True)

    def listed(names: list[str]) -> Iterator[tuple[str, BinaryIO, int]]:
        items = ((url, options, name) for name in names)
        for (_, _, name), result in each_task(
            runner, folder_lines, items, lambda item: (f"{url}/{item[2]}/", "listing it")
        ):
            yield name, io.BytesIO(result[0]), result[1]

    return listed


def folder_lines(item: tuple[str, str, str]) -> tuple[bytes, int]:
    """A task: the :data:`STORE_LISTING` lines of the objects under the top-level folder
    ``name`` of ``url`` (``item``: the URL, its storage options as JSON, the folder's name), and
    how many are visible; run in a worker, which asks the store itself."""
    url, options, name = item
    fs, root = filesystem(url, json.loads(options) or None)
    out = io.BytesIO()
    shown = _list_folder(fs, root, name, out)
    return out.getvalue(), shown


def _list_folder_to(fs: Any, root: str, name: str, part: Path) -> int:
    with open(part, "wb") as out:
        return _list_folder(fs, root, name, out)


def _list_folder(fs: Any, root: str, name: str, out: Any) -> int:
    """List the objects under ``root/name`` into the binary file ``out``; how many are visible.
    On S3 page by page as the store returns them (1,000 keys a page: memory bounded by a page);
    elsewhere with ``find`` (bounded by the folder)."""
    # s3fs's own page iterator (a private method of s3fs, used for s3fs alone); every other
    # filesystem lists with fsspec's public ``find``.
    if is_s3fs(fs) and getattr(fs, "async_impl", False) and hasattr(fs, "_iterdir"):
        from fsspec.asyn import sync

        bucket, key, _ = fs.split_path(f"{root}/{name}/")
        shown = [0]

        async def pages() -> None:
            async for info in fs._iterdir(bucket, delimiter="", prefix=key):
                if info.get("type", "file") != "directory" and not info["name"].endswith("/"):
                    shown[0] += _write_objects(out, root, [(info["name"], info)])

        sync(fs.loop, pages)
        return shown[0]
    found = fs.find(f"{root}/{name}", detail=True)
    fs.invalidate_cache(f"{root}/{name}")
    return _write_objects(out, root, listed_objects(found))


def _write_objects(out: Any, root: str, objects: Iterable[tuple[str, dict[str, Any]]]) -> int:
    """One :data:`STORE_LISTING` line per object; how many are visible (:func:`visible`)."""
    from imgpack.sources.folder.scan import visible

    shown = 0
    for path, info in objects:
        relative = path[len(root) :].lstrip("/")
        _check_key(relative, path)
        shown += visible(relative)
        line = json.dumps([relative, int(info.get("size") or 0), content_tag(info)])
        out.write(line.encode("ascii") + b"\n")
    return shown


def _check_key(relative: str, key: str) -> None:
    """Refuse an object whose key cannot be a path under SRC: an empty, ``.`` or ``..``
    segment (``a//b.png``, ``dots/../x.png``) would name another object's path or one outside
    the scratch folder, so it is neither dropped nor followed."""
    parts = relative.split("/")
    if not relative or any(part in ("", ".", "..") for part in parts) or "\0" in relative:
        raise ScanError(
            f"{key!r}: a key with an empty, '.' or '..' path segment; imgpack cannot take it "
            "as a path under SRC (it would be another object's path, or outside SRC): rename "
            "the object, or convert a SRC without it"
        )


#: In a scratch folder of a bucket source: one JSON line ``[relative path, size, "etag"]`` per
#: object as the store listed it (an ETag, version or generation: what identifies its content),
#: top-level objects first, then each top-level folder's, folders in sorted order (a hidden
#: file: no scan takes it).
STORE_LISTING = ".imgpack-store.jsonl"
#: Beside it: ``{folder: [first byte, end byte, visible objects]}`` of each top-level folder's
#: lines in :data:`STORE_LISTING` (``""``: the top-level objects).
STORE_FOLDERS = ".imgpack-store-folders.json"
#: In a scratch folder that holds a bucket source's listing only: its URL and storage options.
STORE_REMOTE = ".imgpack-remote.json"


#: In a scratch folder that stands for an imgpack output in a bucket, read in place (each
#: process opens it by its URL and fetches the files it reads into its own cache, as a reader
#: does): its URL, storage options and cache folder.
STORE_OUTPUT = ".imgpack-remote-output.json"
#: Beside it, the output's manifest as read (it lists the output's files with their sizes and
#: sha256): the "listing" of such a source, which a part or a resume takes instead of reading
#: it again, with the scan made of it (:func:`save_listing`). Not in the output id: the
#: manifest's id and files are in the scan's origin already.
STORE_MANIFEST = ".imgpack-remote-manifest.json"


def _name_output(
    scratch: Path, url: str, storage_options: dict[str, Any] | None, cache_dir: Location | None
) -> None:
    where = {
        "url": url,
        "storage_options": storage_options or {},
        "cache_dir": None if cache_dir is None else str(cache_dir),
    }
    (scratch / STORE_OUTPUT).write_text(json.dumps(where, sort_keys=True))


def remote_manifest(folder: Path) -> Manifest:
    """The manifest of the output in a bucket ``folder`` stands for, as read when the
    conversion (or the first of its runs, for a part or a resume) began."""
    url = (remote_output(folder) or ("",))[0]
    where = f"{url}/{MANIFEST_NAME}"
    try:
        return Manifest.from_json(json.loads((folder / STORE_MANIFEST).read_bytes()), where=where)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{where}: unreadable manifest: {exc}") from None


def remote_output(folder: Path) -> tuple[str, dict[str, Any], str | None] | None:
    """``(url, storage options, cache folder)`` of the imgpack output in a bucket ``folder``
    stands for (:func:`source_location`), else ``None``."""
    try:
        found = json.loads((folder / STORE_OUTPUT).read_text(encoding="utf-8"))
        cache = found["cache_dir"]
        return (
            str(found["url"]),
            dict(found["storage_options"]),
            None if cache is None else str(cache),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remote_source(folder: Path) -> tuple[str, dict[str, Any]] | None:
    """``(url, storage options)`` of the bucket source whose listing only ``folder`` holds
    (:func:`source_folder` with ``listing_only``), else ``None``."""
    try:
        found = json.loads((folder / STORE_REMOTE).read_text(encoding="utf-8"))
        return str(found["url"]), dict(found["storage_options"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_folders(folder: Path) -> dict[str, list[int]] | None:
    """The index of a bucket source's listing (:data:`STORE_FOLDERS`), else ``None``."""
    try:
        found = json.loads((folder / STORE_FOLDERS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def store_objects(folder: Path, top: str) -> Iterator[tuple[str, int, str]]:
    """``(relative path, size, etag)`` of the objects under the top-level folder ``top`` of a
    bucket source's listing, read from :data:`STORE_LISTING`."""
    start, end, _ = (store_folders(folder) or {}).get(top, (0, 0, 0))
    with open(folder / STORE_LISTING, "rb") as listing:
        listing.seek(start)
        for line in listing:  # one line at a time: the folder is never read whole
            if start >= end:
                return
            start += len(line)
            path, size, etag = json.loads(line)
            yield path, size, etag


def store_every_object(folder: Path) -> Iterator[tuple[str, int, str]]:
    """:func:`store_objects` of every top-level folder of a bucket source's listing (the top's
    own objects first), one line at a time."""
    for top in sorted(store_folders(folder) or {}):
        yield from store_objects(folder, top)


def replaced(url: str, listed: int, said: Sequence[str]) -> DataError | None:
    """The error for the object at ``url`` read with what the store ``said`` of it (its ETag
    and version) when that is not the content the listing named (``listed``:
    :func:`~imgpack.scan.listed_id`, ``0``: any), else ``None``."""
    if not listed or not said or listed in {listed_id(s) for s in said}:
        return None
    return DataError(
        f"{url}: the object was replaced after this conversion listed it (its ETag or version "
        "is not the listed one); nothing of it is committed: run the conversion again without "
        "--resume to list the bucket anew (parts read the listing saved in "
        "DST/.imgpack-work/listing: remove it first)"
    )


def listing_digest(folder: Path) -> str | None:
    """The sha256 of a bucket source's listing (what the store says of every object), else
    ``None``."""
    try:
        return sha256_file(folder / STORE_LISTING, chunk=1 << 20)
    except OSError:
        return None


def _download(fs: Any, remote: str, root: str, scratch: Path) -> None:
    relative = remote[len(root) :].lstrip("/")
    _check_key(relative, remote)  # listed already; never a path outside the scratch folder
    target = scratch / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(remote, str(target))
    stats.downloads += 1


@contextlib.contextmanager
def source_location(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    listing_only: Callable[[TopLevel], bool] | None = None,
    saved: str | None = None,
    runner: Any = None,
    shared: str | None = None,
) -> Iterator[Path]:
    """A local path holding the conversion source ``location``: for an imgpack output in a
    bucket, a scratch folder that names it (:func:`remote_output`; its readers open it by URL,
    ``cache_dir`` their cache folder); any other URL downloaded to a scratch folder, or only
    listed there when ``listing_only`` says so (:func:`source_folder`).

    ``saved``: where a listing of this source may have been saved (DST's work folder, for a part
    or a resume of a conversion): when one of ``location`` is there, intact, it is taken instead
    of listing (nothing of SRC is asked, not even whether it is an output). ``runner``: the
    conversion's executor, whose tasks list SRC's folders (:func:`source_folder`).

    ``shared``: who this process is among the parts of one conversion started together (for
    example ``"part 1 of 4"``), all of which would list SRC: while one of them lists it and
    scans it, and says so by a claim in ``saved`` (:mod:`imgpack.storage.claim`), the others
    wait for the listing and scan it saves there (:func:`save_listing`) and take them."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    held: claim.Claim | None = None
    if saved is not None:
        listed = listing_only is not None
        scratch = _saved_folder(url, storage_options, saved, cache_dir, listed)
        if scratch is None and shared is not None:
            scratch, held = claim.first(
                saved,
                SAVED_CLAIM,
                url,
                shared,
                lambda: _saved_folder(url, storage_options, saved, cache_dir, listed),
                storage_options,
            )
        if scratch is not None:
            try:
                yield scratch
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return
    with contextlib.ExitStack() as stack:
        if held is not None:
            stack.callback(held.release)
        with _listed(url, storage_options, cache_dir, listing_only, runner) as folder:
            if held is not None:
                if _saveable(folder):  # saved by the conversion: the claim goes then
                    held.settled = (folder / STORE_SAVED).exists
                else:  # nothing the others could take: they go on by themselves
                    held.release()
            yield folder


def _saveable(folder: Path) -> bool:
    """Whether :func:`save_listing` saves what ``folder`` holds (a bucket listing, or an
    output's manifest)."""
    return remote_source(folder) is not None or remote_output(folder) is not None


@contextlib.contextmanager
def _listed(
    url: str,
    storage_options: dict[str, Any] | None,
    cache_dir: Location | None,
    listing_only: Callable[[TopLevel], bool] | None,
    runner: Any,
) -> Iterator[Path]:
    """:func:`source_location` of the bucket source ``url`` when nothing of it is saved."""
    fs, root = filesystem(url, storage_options)
    try:
        is_output = fs.exists(f"{root}/{MANIFEST_NAME}")
    except OSError as exc:
        raise remote_error(url, exc) from None
    if is_output:  # read in place: every process opens it by its URL (remote_output)
        scratch = Path(tempfile.mkdtemp(prefix="imgpack-src-"))
        try:
            manifest = open_manifest(url, storage_options)[1]  # the route's one GET
            (scratch / STORE_MANIFEST).write_bytes(manifest_bytes(manifest))
            _name_output(scratch, url, storage_options, cache_dir)
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    with source_folder(url, storage_options, listing_only, runner) as folder:
        yield folder


# -- the listing saved for the parts and resumes of one conversion --------------------------
#: In the folder a listing is saved to (DST's work folder): its lines (:data:`STORE_LISTING`),
#: gzipped, then this head, written last: SRC's URL, the lines' sha256 and the folders' index.
SAVED_LINES = "listing.jsonl.gz"
SAVED_HEAD = "listing.json"
#: In a scratch folder whose listing is saved (read from a saved one, or saved by this run):
#: where (so it is not saved again).
STORE_SAVED = ".imgpack-store-saved"
#: Beside the saved listing while a part of the conversion lists SRC for the others to take
#: (:class:`imgpack.storage.claim.Claim`).
SAVED_CLAIM = "listing.claim.json"
#: In a scratch folder of a bucket source read in place: what the source's scan found inside
#: the listed objects (tars' members, TFRecord files' records), as gzipped JSON lines (a head
#: with the listing's digest, then one line per object: :func:`scanned_once`); saved beside
#: the listing as :data:`SAVED_SCAN`, so that the parts and resumes that read the listing read
#: no object through again.
STORE_SCAN = ".imgpack-store-scan.json.gz"
SAVED_SCAN = "scan.json.gz"
#: The layout of :data:`STORE_SCAN` (its head's ``"lines"``): one JSON line per object, read
#: one at a time. A scan saved in another layout is not taken (the source is scanned again).
_SCAN_LINES = 1
_CHUNK = 1 << 20


def scanned_once(
    folder: Path,
    kind: str,
    scan: Callable[[], list[T]],
    dump: Callable[[T], Any],
    load: Callable[[Any], T],
) -> list[T]:
    """What a source of ``kind`` finds inside each object ``folder``'s listing names: the scan
    kept with this very listing (a part's or a resume's, brought by a saved listing), each
    object's read by ``load``; else ``scan()``, each object's kept as ``dump`` makes it
    JSON-able, to be saved with the listing (:func:`save_listing`). A folder that is not a
    bucket listing is just scanned. The kept scan is written and read one object's line at a
    time: the driver never holds the text (a few hundred bytes a sample) of every object's."""
    if not _saveable(folder):
        return scan()
    kept = _kept_scan(folder, kind, load)
    if kept is not None:
        return kept
    found = scan()
    if not (folder / STORE_SAVED).exists():
        head = {"listing": _lines_digest(folder), "kind": kind, "lines": _SCAN_LINES}
        with (
            open(folder / STORE_SCAN, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed,
            io.TextIOWrapper(packed, encoding="utf-8") as out,
        ):
            out.write(json.dumps(head) + "\n")
            for item in found:
                out.write(json.dumps(dump(item)) + "\n")
    return found


def _kept_scan(folder: Path, kind: str, load: Callable[[Any], T]) -> list[T] | None:
    """The scan kept in ``folder`` for ``kind`` and this very listing, each object's line
    read by ``load``, else ``None``."""
    try:
        with gzip.open(folder / STORE_SCAN, "rt", encoding="utf-8") as held:
            head = json.loads(held.readline())
            if not isinstance(head, dict) or head.get("lines") != _SCAN_LINES:
                return None
            if head.get("kind") != kind or head.get("listing") != _lines_digest(folder):
                return None
            return [load(json.loads(line)) for line in held]
    except FileNotFoundError:
        return None
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        log.warning("%s: cannot be read (%s); the source is scanned again", STORE_SCAN, exc)
        return None


def _lines(folder: Path) -> Path:
    """What a bucket source's scratch folder holds of what the store said of it: a listing's
    lines, or an output's manifest."""
    return folder / (STORE_MANIFEST if remote_output(folder) is not None else STORE_LISTING)


def _lines_digest(folder: Path) -> str | None:
    try:
        return sha256_file(_lines(folder), chunk=1 << 20)
    except OSError:
        return None


def save_listing(folder: Path, fs: Any, root: str) -> bool:
    """Save the listing ``folder`` holds (a bucket source listed in place, :func:`source_folder`
    with ``listing_only``) in ``root`` of ``fs``: the lines, then the head. Nothing for another
    folder, or one whose listing was read from a saved one. Whether it was saved."""
    output = remote_output(folder)
    remote = remote_source(folder) or output
    if remote is None or (folder / STORE_SAVED).exists():
        return False
    digest = hashlib.sha256()
    with (
        open(_lines(folder), "rb") as lines,
        fs.open(f"{root}/{SAVED_LINES}", "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as packed,
    ):
        for chunk in iter(lambda: lines.read(_CHUNK), b""):
            digest.update(chunk)
            packed.write(chunk)
    head: dict[str, Any] = {
        "source": remote[0],
        "sha256": digest.hexdigest(),
        "folders": store_folders(folder) or {},
    }
    if output is not None:  # the lines are the output's manifest
        head["output"] = True
    if (folder / STORE_SCAN).is_file():  # the source's scan of the objects, checked as read
        scanned = (folder / STORE_SCAN).read_bytes()
        fs.pipe_file(f"{root}/{SAVED_SCAN}", scanned)
        head["scan"] = hashlib.sha256(scanned).hexdigest()
    fs.pipe_file(f"{root}/{SAVED_HEAD}", json.dumps(head, sort_keys=True).encode())
    (folder / STORE_SAVED).write_text(root)
    return True


def _same_output(scratch: Path, url: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether the output at ``url`` is still the one whose manifest ``scratch`` holds (one GET:
    an output replaced since its scan was saved is scanned again, not planned from the old)."""
    try:
        live = manifest_bytes(open_manifest(url, storage_options)[1])
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return (scratch / STORE_MANIFEST).read_bytes() == live


def _saved_folder(
    url: str,
    storage_options: dict[str, Any] | None,
    saved: str,
    cache_dir: Location | None = None,
    listed: bool = True,
) -> Path | None:
    """A scratch folder holding the listing of ``url`` saved at ``saved``, as
    :func:`source_folder` would have listed it (or, for an imgpack output, its manifest, as
    :func:`source_location` names it); ``None`` when none of ``url`` is saved there, or it
    cannot be read whole (then said, and SRC is listed again). ``listed``: whether a bucket
    folder's listing is taken (an output's always is)."""
    fs, root = filesystem(saved, storage_options)
    try:
        head = json.loads(fs.cat_file(f"{root}/{SAVED_HEAD}"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s/%s: cannot be read (%s); %s is listed again", saved, SAVED_HEAD, exc, url)
        return None
    if not isinstance(head, dict) or head.get("source") != url:
        return None  # another source's, left by a conversion this one replaces
    output = head.get("output") is True
    if not (output or listed):
        return None
    scratch = Path(tempfile.mkdtemp(prefix="imgpack-src-"))
    digest = hashlib.sha256()
    try:
        with (
            fs.open(f"{root}/{SAVED_LINES}", "rb") as raw,
            gzip.GzipFile(fileobj=raw, mode="rb") as packed,
            open(scratch / (STORE_MANIFEST if output else STORE_LISTING), "wb") as lines,
        ):
            for chunk in iter(lambda: packed.read(_CHUNK), b""):
                digest.update(chunk)
                lines.write(chunk)
        if digest.hexdigest() != head.get("sha256") or not isinstance(head.get("folders"), dict):
            raise ValueError("its lines are not those its head describes")
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        log.warning(
            "%s: the saved listing cannot be read (%s); %s is listed again", saved, exc, url
        )
        return None
    if output and not _same_output(scratch, url, storage_options):
        shutil.rmtree(scratch, ignore_errors=True)
        log.warning(
            "%s: replaced since the scan saved in %s was made; it is scanned again", url, saved
        )
        return None
    if not output:
        (scratch / STORE_FOLDERS).write_text(json.dumps(head["folders"], sort_keys=True))
    if isinstance(head.get("scan"), str):  # (else, or not intact: the source scans again)
        try:
            scanned = fs.cat_file(f"{root}/{SAVED_SCAN}")
            if hashlib.sha256(scanned).hexdigest() == head["scan"]:
                (scratch / STORE_SCAN).write_bytes(scanned)
        except OSError as exc:
            log.warning(
                "%s/%s: cannot be read (%s); %s is scanned again", saved, SAVED_SCAN, exc, url
            )
    if output:
        _name_output(scratch, url, storage_options, cache_dir)
    else:
        remote = {"url": url, "storage_options": storage_options or {}}
        (scratch / STORE_REMOTE).write_text(json.dumps(remote, sort_keys=True))
    (scratch / STORE_SAVED).write_text(saved)
    log.info("%s: not listed again; the listing saved in %s is this conversion's", url, saved)
    return scratch
