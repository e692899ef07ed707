"""Outputs and sources in object storage (S3, GCS, Azure, any fsspec filesystem).

Wherever imgpack takes a path it also takes an fsspec URL (``s3://bucket/prefix``, ``gs://``,
``az://``, ``memory://``; ``file://`` is a local path). Credentials and endpoints come from each
filesystem's usual settings (for S3 the standard AWS variables and config files, including
``AWS_ENDPOINT_URL`` for MinIO and other S3-compatible stores); ``storage_options`` passes
anything else to the filesystem.

- **Reading an output** goes through a local cache (:class:`OutputCache`): its files are
  fetched once, checked against the manifest's size and sha256, and then read as local files,
  memory-mapped as any output is, so every fast path stays.
- **Writing an output** builds it in a local folder with the usual engine (a conversion: its
  build folder in the cache, :func:`build_folder`, kept for ``--resume`` when the run stops),
  then uploads its files concurrently, the manifest last: an object store has no rename, so
  ``imgpack.json`` is the commit point. A reader opens only an output whose manifest exists,
  and the manifest names exactly the files that belong; a conversion killed midway leaves
  none.
- **Reading a source** in a bucket: an image folder is listed, not downloaded (the workers GET
  each sample's object, :func:`source_folder` with ``listing_only``); other kinds (TFRecord or
  WebDataset files, a label list) are downloaded into a scratch folder first. Either way the
  scan's classes and order are those of a local copy of the same tree.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from imgpack.errors import (
    ImgpackError,
    ManifestError,
    OptionError,
    ScanError,
    StorageError,
    first_line,
)
from imgpack.manifest import MANIFEST_NAME, Manifest, read_manifest, sha256_file
from imgpack.publishing import leftovers
from imgpack.system import read_regular_file
from imgpack.units import parse_byte_size

log = logging.getLogger(__name__)

Location = str | os.PathLike[str]
#: Files transferred at once.
TRANSFERS = 8
#: The cache's size limit when neither ``max_bytes`` nor ``IMGPACK_CACHE_SIZE`` sets one.
DEFAULT_CACHE_BYTES = 100 << 30


def is_url(location: Any) -> bool:
    """Whether ``location`` names something an fsspec filesystem other than the local one holds
    (``file://`` URLs are local paths)."""
    if not isinstance(location, str) or "://" not in location:
        return False
    return not location.startswith("file://")


def local_path(location: Location) -> Path:
    """``location`` as a local path (a ``file://`` URL stripped of its scheme)."""
    text = os.fspath(location)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def filesystem(
    url: str, storage_options: dict[str, Any] | None = None, fresh: bool = False
) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``; a clear error when the scheme's package
    is missing (``pip install 'imgpack[s3]'``, ``'imgpack[gcs]'``). ``fresh``: a new instance,
    not fsspec's cached one (in a forked process, whose inherited instance is not usable)."""
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - fsspec comes with torch
        raise OptionError(f"{url}: URLs need fsspec (pip install fsspec)") from None
    try:
        options = {**(storage_options or {}), **({"skip_instance_cache": True} if fresh else {})}
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme)
        hint = f"pip install 'imgpack[{extra}]'" if extra else str(exc)
        raise OptionError(f"{url}: reading {scheme}:// needs another package: {hint}") from None
    except ValueError as exc:
        raise OptionError(f"{url}: {exc}") from None
    return fs, str(path).rstrip("/")


def parse_storage_options(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (``--storage-option``) as a dict; JSON values are decoded
    (``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``), others stay strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionError(f"invalid storage option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def no_bucket(url: str, exc: BaseException) -> ImgpackError | None:
    """The error naming ``url``'s bucket when ``exc`` says it does not exist (S3's
    ``NoSuchBucket``, which s3fs raises as a bare ``FileNotFoundError``), else ``None``."""
    if not isinstance(exc, FileNotFoundError) or "bucket" not in str(exc).lower():
        return None
    scheme, _, rest = url.partition("://")
    bucket = f"{scheme}://{rest.split('/', 1)[0]}"
    return StorageError(
        f"{url}: the bucket {bucket} does not exist (create it first, or check the name and "
        "the endpoint the filesystem uses: docs/storage.md)"
    )


def remote_error(url: str, exc: BaseException) -> ImgpackError:
    if isinstance(exc, ImgpackError):  # said already, with its URL
        return exc
    missing = no_bucket(url, exc)
    if missing is not None:
        return missing
    if isinstance(exc, FileNotFoundError):
        return ManifestError(
            f"{url}: not found (no such bucket or object; check the name, and the endpoint "
            "and credentials the filesystem uses)"
        )
    if isinstance(exc, PermissionError):
        return StorageError(f"{url}: access denied ({exc})")
    return StorageError(
        f"{url}: {type(exc).__name__}: {first_line(exc) if str(exc).strip() else ''}"
    )


def read_remote_manifest(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Manifest, bytes]:
    """The manifest of the output at ``url`` (validated) and its bytes."""
    fs, root = filesystem(url, storage_options)
    try:
        data = fs.cat_file(f"{root}/{MANIFEST_NAME}")
    except FileNotFoundError as exc:
        missing = no_bucket(url, exc)
        if missing is not None:
            raise missing from None
        raise ManifestError(
            f"{url}: not an imgpack output (no {MANIFEST_NAME}: nothing there, or a conversion "
            "still uploading or killed midway, which leaves none)"
        ) from None
    except OSError as exc:
        raise remote_error(url, exc) from None
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{url}/{MANIFEST_NAME}: unreadable manifest: {exc}") from None
    return Manifest.from_json(parsed, where=f"{url}/{MANIFEST_NAME}"), data


# -- the cache -----------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``IMGPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/imgpack``, else ``~/.cache/imgpack``."""
    if os.environ.get("IMGPACK_CACHE_DIR"):
        return Path(os.environ["IMGPACK_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "imgpack"


@dataclass
class CacheStats:
    """What the cache of this process did (for tests and logs)."""

    downloads: int = 0
    downloaded_bytes: int = 0
    refetched: int = 0


stats = CacheStats()


class OutputCache:
    """Local copies of outputs read from object storage, shared by every process of the machine.

    Layout: ``CACHE/outputs/<hash of the URL>-<output id>/`` holds the output's files and its
    manifest, exactly as a local output; ``.imgpack-cache.json`` beside them records each file's
    size and modification time once its sha256 matched the manifest. Fetching takes an
    exclusive ``flock`` on the entry's lock file, so DataLoader workers and DDP ranks opening
    the same output together download each file once (the others wait, then find it there).
    A file is downloaded to a temporary name and renamed into place only once checked. A cached
    file whose size or modification time changed since it was checked is hashed again, and
    fetched again if damaged. Entries are evicted least recently used first when the cache
    grows past ``max_bytes`` — never one another process is reading (each reader holds a shared
    lock on its entry).
    """

    def __init__(self, directory: Location | None = None, max_bytes: int | str | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        if max_bytes is None:
            max_bytes = os.environ.get("IMGPACK_CACHE_SIZE") or DEFAULT_CACHE_BYTES
        self.max_bytes = parse_byte_size(max_bytes, "cache size")

    def entry(self, url: str, manifest: Manifest, data: bytes) -> Path:
        name = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        version = manifest.output_id or hashlib.sha256(data).hexdigest()[:16]
        return self.directory / "outputs" / f"{name}-{version}"

    def fetch(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        remote: tuple[Manifest, bytes] | None = None,
    ) -> Fetched:
        """The local copy of the output at ``url``: fetched (what is missing, damaged or
        changed in the store), checked, and pinned while the caller holds the pin it returns.
        ``remote``: its manifest and bytes, when the caller read them already (one GET per
        open)."""
        manifest, data = remote or read_remote_manifest(url, storage_options)
        local = self.entry(url, manifest, data)
        fs, root = filesystem(url, storage_options)
        entries = _remote_files(fs, root, url, manifest)
        with contextlib.ExitStack() as stack:
            try:
                _safe_dirs(self.directory, local)
                stack.enter_context(_locked(local, fcntl.LOCK_EX))
            except StorageError:
                raise
            except OSError as exc:  # a cache that cannot be written: a complete entry is read
                if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                    if _complete(local, entries, data):
                        return Fetched(local, None)
                    raise StorageError(
                        f"{self.directory}: the cache folder cannot be written ({exc.strerror}) "
                        f"and holds no complete copy of {url}; set IMGPACK_CACHE_DIR (or "
                        "cache_dir=) to a writable folder"
                    ) from None
                raise StorageError(f"{local}: cannot use the cache entry: {exc.strerror}") from None
            _safe_dirs(self.directory, local)  # under the lock: an eviction may have removed it
            for stale in local.glob(".*.part"):  # left by a fetch that was killed
                stale.unlink(missing_ok=True)
            checked = _load_json(local / CHECKED)
            wanted = [e for e in entries if not _still_good(local, e, checked)]
            if wanted:
                with ThreadPoolExecutor(TRANSFERS) as pool:
                    done = pool.map(
                        lambda e: _fetch_file(fs, f"{root}/{e.path}", local, e, url), wanted
                    )
                    for entry, (path, size, mtime) in zip(wanted, done, strict=True):
                        checked[path] = [size, mtime, entry.sha256, entry.etag]
                _write_json(local / CHECKED, checked)
            manifest_path = local / MANIFEST_NAME
            try:
                same = read_regular_file(manifest_path) == data  # no link, FIFO or device
            except OSError:
                same = False
            if not same:
                _write_bytes(manifest_path, data)  # last: the entry is complete
            _write_bytes(local / ".imgpack-used", b"")
            pin = EntryPin(local)  # before the lock goes: no eviction can slip in between
        self.evict(keep=local)
        return Fetched(local, pin)

    def evict(self, keep: Path | None = None) -> None:
        """Remove least recently used entries until the cache fits ``max_bytes``."""
        outputs = self.directory / "outputs"
        if not outputs.is_dir():
            return
        entries = []
        for entry in outputs.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                used = entry / ".imgpack-used"
                stamp = used.stat().st_mtime if used.exists() else 0.0
                entries.append((stamp, entry, _folder_bytes(entry)))
        total = sum(size for _, _, size in entries)
        for _, entry, size in sorted(entries, key=lambda row: row[0]):
            if total <= self.max_bytes:
                break
            if keep is not None and entry == keep:
                continue
            with (
                contextlib.suppress(BlockingIOError),
                _locked(entry, fcntl.LOCK_EX | fcntl.LOCK_NB, ".pin"),
                _locked(entry, fcntl.LOCK_EX | fcntl.LOCK_NB),
            ):
                shutil.rmtree(entry, ignore_errors=True)
                total -= size
                log.info("cache: evicted %s (%d bytes)", entry, size)


@dataclass(frozen=True)
class Remote:
    """A file of an output in the store, as the cache fetches it: the manifest's size and
    sha256 (none for index files the manifest does not list), and the store's ETag/version."""

    path: str
    bytes: int
    sha256: str
    etag: str


def _remote_files(fs: Any, root: str, url: str, manifest: Manifest) -> list[Remote]:
    """The files to fetch, with the store's ETag of each: the manifest's data files and their
    companions (index files), each with its recorded size and sha256. An output of imgpack
    0.4.0 or earlier lists no companions: the files beside its shards that readers use (the ``.idx``
    of a ``tfrecord`` or ``webdataset`` shard) are taken from the listing, with no sha256 (the
    readers check each index against the framing it describes). One listing for all of them."""
    listed = [(e.path, e.bytes, e.sha256) for e in manifest.files]
    listed += [(c.path, c.bytes, c.sha256) for e in manifest.files for c in e.companions]
    names = {name for name, _, _ in listed} | {MANIFEST_NAME}
    guess = not any(e.companions for e in manifest.files)
    stems = {Path(e.path).stem for e in manifest.files}
    try:
        found = fs.find(root, detail=True)
    except OSError as exc:
        raise remote_error(url, exc) from None
    tags = {}
    extra = []
    for path, info in sorted(found.items()):
        name = path[len(root) :].lstrip("/")
        tags[name] = content_tag(info)
        if not guess or "/" in name or name in names or Path(name).stem not in stems:
            continue
        extra.append(Remote(name, int(info.get("size") or 0), "", tags[name]))
    return [Remote(name, size, sha, tags.get(name, "")) for name, size, sha in listed] + extra


def read_objects(fs: Any, paths: Sequence[str]) -> list[tuple[bytes, list[str]] | BaseException]:
    """Each object's bytes and what the store said of its content as it sent them (its ETag
    and version, where the protocol says: S3; ``[]`` elsewhere), or the exception that reading
    it raised; one GET each, all at once. s3fs's ``cat_file`` asks for each object's size first
    (a HEAD before every GET): on S3 the GET is made here, through s3fs's own client."""
    if not paths:
        return []
    if _is_s3fs(fs) and hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
        from fsspec.asyn import sync  # type: ignore[import-untyped]

        async def one(path: str) -> tuple[bytes, list[str]]:
            bucket, key, version = fs.split_path(path)
            given = {"VersionId": version} if version else {}
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **given)
            try:
                body = await response["Body"].read()
            finally:
                response["Body"].close()
            said = [str(response[k]) for k in ("ETag", "VersionId") if response.get(k)]
            return body, said

        async def every() -> list[Any]:
            return await asyncio.gather(*(one(p) for p in paths), return_exceptions=True)

        return list(sync(fs.loop, every))
    found = fs.cat_ranges(list(paths), None, None, on_error="return")
    return [f if isinstance(f, BaseException) else (bytes(f), []) for f in found]


def forget_listings(fs: Any, root: str) -> None:
    """Forget every cached listing of ``root`` and of the folders below it (fsspec's
    ``dircache``), so that the next ``ls``/``find`` asks the store."""
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        prefix = root.rstrip("/") + "/"
        for path in [p for p in list(cache) if str(p).startswith(prefix)]:
            fs.invalidate_cache(path)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def content_tag(info: dict[str, Any]) -> str:
    """What the store says identifies an object's content (ETag, version, generation)."""
    for key in ("VersionId", "ETag", "etag", "generation", "version_id", "md5Hash"):
        if info.get(key):
            return str(info[key])
    return ""


#: Per entry: ``{path: [size, mtime_ns, sha256, etag]}`` of each file once it was checked.
CHECKED = ".imgpack-cache.json"


def _safe_dirs(cache: Path, entry: Path) -> None:
    """Make ``cache/outputs/entry`` as real folders: a symbolic link (or anything but a folder)
    planted in a shared cache folder is refused, never followed."""
    for folder in (cache, entry.parent, entry):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(parents=folder == cache, exist_ok=True)
        st = os.lstat(folder)
        if folder != cache and not stat.S_ISDIR(st.st_mode):
            raise StorageError(
                f"{folder}: not a folder (a symbolic link or a file planted in the cache); "
                "refusing to use it: remove it"
            )


def _complete(local: Path, entries: list[Remote], data: bytes) -> bool:
    """Whether the cache entry ``local`` holds the manifest ``data`` and every file checked."""
    try:
        manifest_ok = read_regular_file(local / MANIFEST_NAME) == data
    except OSError:
        return False
    checked = _load_json(local / CHECKED)
    return manifest_ok and all(_still_good(local, e, checked) for e in entries)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def _locked(entry: Path, how: int, suffix: str = ".lock") -> Iterator[None]:
    """``flock`` on the entry's lock file: ``.lock`` serialises fetching, ``.pin`` is held
    shared by every process reading the entry (and taken exclusively to evict it)."""
    fd = os.open(str(entry) + suffix, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


class EntryPin:
    """A shared lock on a cache entry: no process evicts the entry while it is held. What reads
    the entry holds it (an opened output's files, a conversion reading an output as its
    source) and lets it go with :meth:`close`, or when it is garbage; a forked process shares
    the lock; a pickled copy holds none (the process that opened the output keeps it)."""

    def __init__(self, entry: Path) -> None:
        self.fd: int | None = os.open(
            str(entry) + ".pin", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644
        )
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                _close(fd)

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"fd": None}


class Fetched(NamedTuple):
    """An output's checked copy in the cache, and the pin that keeps it there (``None`` in a
    cache this user cannot write: nothing evicts from it either)."""

    path: Path
    pin: EntryPin | None


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_regular_file(path))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_bytes(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` by renaming a new file over it (a link there is replaced,
    never followed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    fd = _new_file(tmp)
    with open(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _new_file(path: Path) -> int:
    """A descriptor of a new regular file at ``path`` (never a link planted there)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_bytes(path, json.dumps(data).encode())


def _still_good(local: Path, entry: Remote, checked: dict[str, Any]) -> bool:
    """Whether the cached file is what was checked for this manifest and this object in the
    store: same size and mtime as when it was checked, against the same sha256 and ETag. A
    file that changed since, or whose object was replaced in the store, is fetched again."""
    try:
        st = (local / entry.path).lstat()
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == entry.bytes
        and checked.get(entry.path) == [st.st_size, st.st_mtime_ns, entry.sha256, entry.etag]
    )


def _fetch_file(fs: Any, remote: str, local: Path, entry: Remote, url: str) -> tuple[str, int, int]:
    """Make ``local/entry.path`` the checked file: a present copy that hashes right is kept
    (a changed stamp only), anything else is downloaded to a temporary name, checked, renamed."""
    target = local / entry.path
    if target.is_file() and not target.is_symlink() and target.stat().st_size == entry.bytes:
        if entry.sha256 and sha256_file(target) == entry.sha256:
            st = target.stat()
            return entry.path, st.st_size, st.st_mtime_ns
        if entry.sha256:
            stats.refetched += 1
            log.warning("cache: %s is damaged or stale; fetching it again", target)
    tmp = local / f".{entry.path}.{os.getpid()}.{threading.get_ident()}.part"
    os.close(_new_file(tmp))
    try:
        fs.get_file(remote, str(tmp))
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise remote_error(f"{url}/{entry.path}", exc) from None
    size = tmp.stat().st_size
    if size != entry.bytes or (entry.sha256 and sha256_file(tmp) != entry.sha256):
        tmp.unlink(missing_ok=True)
        raise StorageError(
            f"{url}/{entry.path}: the stored file is not what the manifest says ({size} bytes"
            f"{', another sha256' if size == entry.bytes else ''}): the output in the bucket is "
            "damaged or being replaced"
        )
    os.replace(tmp, target)
    stats.downloads += 1
    stats.downloaded_bytes += size
    st = target.stat()
    return entry.path, st.st_size, st.st_mtime_ns


def fetch_output(
    url: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    remote: tuple[Manifest, bytes] | None = None,
) -> Fetched:
    """The local, checked copy of the output at ``url`` and its pin (see :class:`OutputCache`);
    ``remote``: its manifest and bytes, when read already."""
    return OutputCache(cache_dir).fetch(url, storage_options, remote)


# -- sources and destinations ------------------------------------------------------------------
@contextlib.contextmanager
def source_folder(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    listing_only: Callable[[list[str]], bool] | None = None,
) -> Iterator[Path]:
    """A local folder holding what ``location`` holds: itself when local; a scratch copy of a
    URL's files (removed afterwards) when not, with what the store says of each object (its
    size and ETag or version) in :data:`STORE_LISTING`: a conversion identifies the source by
    those, not by the copy's modification times, so two conversions of one bucket (and the
    parts of one) get one output id.

    ``listing_only``: given SRC's top-level entries (folders as ``name/``, objects as ``name``),
    whether to download nothing: the scratch folder then holds the listing only
    (:data:`STORE_LISTING`, :data:`STORE_FOLDERS`, and the URL in :data:`STORE_REMOTE`), and the
    conversion's workers read each object from the bucket (:func:`remote_source`). The listing
    is taken one top-level folder at a time (several at once) and written to disk as it comes:
    the driver never holds the whole of it."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    fs, root = filesystem(url, storage_options)
    scratch = Path(tempfile.mkdtemp(prefix="imgpack-src-"))
    try:
        try:
            try:
                top = fs.ls(root, detail=True)  # one delimiter listing: folders and objects
            except FileNotFoundError as exc:
                missing = no_bucket(url, exc)
                if missing is not None:
                    raise missing from None
                top = []
            folders = sorted(
                _relative(info["name"], root) for info in top if info.get("type") == "directory"
            )
            files = sorted((info["name"], info) for info in top if info.get("type") != "directory")
            if not folders and not files:
                raise ManifestError(f"{url}: nothing there")
            names = [f"{name}/" for name in folders] + [_relative(n, root) for n, _ in files]
            if listing_only is not None and listing_only(sorted(names)):
                _write_listing(scratch, fs, root, files, folders)
                remote = {"url": url, "storage_options": storage_options or {}}
                (scratch / STORE_REMOTE).write_text(json.dumps(remote, sort_keys=True))
            else:
                found = listed_objects(fs.find(root, detail=True))
                _write_listing(scratch, fs, root, found, [])
                with ThreadPoolExecutor(TRANSFERS) as pool:
                    list(pool.map(lambda f: _download(fs, f[0], root, scratch), found))
                del found
        except OSError as exc:
            raise remote_error(url, exc) from None
        fs.invalidate_cache(root)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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


def _write_listing(
    scratch: Path,
    fs: Any,
    root: str,
    top: list[tuple[str, dict[str, Any]]],
    folders: list[str],
) -> None:
    """:data:`STORE_LISTING` and :data:`STORE_FOLDERS`: the objects ``top`` (listed already),
    then each of ``folders`` listed into a part file of its own, ``TRANSFERS`` folders at once,
    the parts joined in order as they complete."""
    index: dict[str, list[int]] = {}
    parts = scratch / ".imgpack-store-parts"
    parts.mkdir()
    with open(scratch / STORE_LISTING, "wb") as out, ThreadPoolExecutor(TRANSFERS) as pool:
        shown = _write_objects(out, root, top)
        if top:
            index[""] = [0, out.tell(), shown]
        window: collections.deque[tuple[str, Path, Any]] = collections.deque()
        pending = iter(enumerate(folders))
        while True:
            while len(window) < 2 * TRANSFERS:
                number, name = next(pending, (-1, ""))
                if number < 0:
                    break
                part = parts / f"{number}.jsonl"
                window.append((name, part, pool.submit(_list_folder, fs, root, name, part)))
            if not window:
                break
            name, part, future = window.popleft()
            shown, start = future.result(), out.tell()
            with open(part, "rb") as listed:
                shutil.copyfileobj(listed, out)
            part.unlink()
            if out.tell() > start:
                index[name] = [start, out.tell(), shown]
    parts.rmdir()
    (scratch / STORE_FOLDERS).write_text(json.dumps(index, sort_keys=True))


def _list_folder(fs: Any, root: str, name: str, part: Path) -> int:
    """List the objects under ``root/name`` into the file ``part``; how many are visible. On
    S3 page by page as the store returns them (1,000 keys a page: memory bounded by a page);
    elsewhere with ``find`` (bounded by the folder)."""
    with open(part, "wb") as out:
        # s3fs's own page iterator (a private method of s3fs, used for s3fs alone); every other
        # filesystem lists with fsspec's public ``find``.
        if _is_s3fs(fs) and getattr(fs, "async_impl", False) and hasattr(fs, "_iterdir"):
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


def _is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (whose private calls imgpack makes for S3 alone)."""
    return "s3" in _protocols(fs) and type(fs).__module__.split(".")[0] == "s3fs"


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


#: Where conversions to a bucket are built, under the cache folder: one folder per DST URL.
BUILDS = "builds"


def build_folder(url: str, cache_dir: Location | None = None) -> Path:
    """Where a conversion to the bucket ``url`` builds its output before the upload:
    ``<cache>/builds/<hash of the URL>/``. A run that stops keeps it (``--resume`` continues
    there); it is removed once the output is uploaded."""
    key = hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return OutputCache(cache_dir).directory / BUILDS / key


@contextlib.contextmanager
def output_folder(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    marker: str = MANIFEST_NAME,
    build: Path | None = None,
    resume: bool = False,
    skip: Collection[str] = (),
) -> Iterator[Path]:
    """Where a command writes ``location``: itself when local; for a URL a scratch path, whose
    files are uploaded when the block ends without an error (the manifest last, so the output
    appears whole or not at all). ``overwrite``: an output already at the URL is withdrawn (its
    manifest removed first: readers see no output rather than a mixed one) and replaced.
    ``marker``: the file that says what the destination holds and is written last
    (``imgpack.json``, or an export's marker).

    ``build``: the scratch folder to use (:func:`build_folder`), kept when the block fails so
    that a ``resume`` can continue in it; a ``resume`` whose build is complete (a run stopped
    while uploading) may replace the files that upload left at the URL. ``skip``: names of
    files not to upload (those a format's reader makes beside its files, as LMDB's lock)."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    fs, root = filesystem(url, storage_options)
    built = build is not None and (build / "out" / marker).is_file()  # an upload was stopped
    _check_remote_destination(fs, root, url, overwrite, marker, partial_ok=built and resume)
    if build is None:
        scratch = Path(tempfile.mkdtemp(prefix="imgpack-dst-"))
    else:
        build.mkdir(parents=True, exist_ok=True)
        scratch = build
        if built and not resume:
            log.warning("%s: a complete build of %s whose upload was stopped; building "
                        "again (--resume would upload it)", build / "out", url)  # fmt: skip
            shutil.rmtree(build / "out")
    try:
        yield scratch / "out"
        upload(scratch / "out", url, storage_options, marker, skip)
    except BaseException:
        if build is None or not _resumable_build(scratch / "out", marker):
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(scratch, ignore_errors=True)


def _resumable_build(out: Path, marker: str) -> bool:
    """Whether a build folder holds something ``--resume`` continues from: a complete output
    (stopped while uploading) or the temp dir of an interrupted conversion."""
    return (out / marker).is_file() or bool(leftovers(out))


def _check_remote_destination(
    fs: Any, root: str, url: str, overwrite: bool, marker: str, partial_ok: bool = False
) -> None:
    try:
        present = [f for f in fs.find(root) if not f.endswith("/")]
    except FileNotFoundError:
        present = []
    except OSError as exc:
        raise remote_error(url, exc) from None
    if not present:
        return
    names = {p[len(root) :].lstrip("/") for p in present}
    if marker not in names:
        if partial_ok:  # the files of an upload that was stopped
            return
        raise FileExistsError(
            f"{url}: already exists and holds no {marker}; refusing to replace it, with or "
            "without --overwrite (remove it yourself, or choose another destination; a run "
            "killed midway leaves such files)"
        )
    if not overwrite:
        raise FileExistsError(f"{url}: already exists (use --overwrite to replace it)")


def upload(
    local: Path,
    url: str,
    storage_options: dict[str, Any] | None = None,
    marker: str = MANIFEST_NAME,
    skip: Collection[str] = (),
) -> None:
    """Upload the files of the local folder ``local`` under ``url``, several at once: a
    ``marker`` (``imgpack.json``) already there is removed first, the new one is written after
    every other file (the commit), and files of the replaced output that the new one does not
    have are removed after. Files named in ``skip`` (a reader's runtime files) stay here."""
    fs, root = filesystem(url, storage_options)
    skipped = set(skip)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name not in skipped)
    names = {p.relative_to(local).as_posix() for p in files}
    try:
        before = {f[len(root) :].lstrip("/") for f in fs.find(root) if not f.endswith("/")}
    except FileNotFoundError:
        before = set()
    try:
        if marker in before:
            fs.rm_file(f"{root}/{marker}")  # withdrawn: no reader opens it from now on
        data = [p for p in files if p.relative_to(local).as_posix() != marker]
        with ThreadPoolExecutor(TRANSFERS) as pool:
            list(
                pool.map(
                    lambda p: fs.put_file(str(p), f"{root}/{p.relative_to(local).as_posix()}"),
                    data,
                )
            )
        if (local / marker).exists():
            fs.put_file(str(local / marker), f"{root}/{marker}")  # the commit
        for stale in sorted(before - names):
            fs.rm_file(f"{root}/{stale}")
    except OSError as exc:
        raise remote_error(url, exc) from None


def manifest_of(location: Location, storage_options: dict[str, Any] | None = None) -> Manifest:
    """The manifest of the output at ``location`` (a URL's read without fetching its files)."""
    if is_url(location):
        return read_remote_manifest(str(location), storage_options)[0]
    return read_manifest(local_path(location))


@contextlib.contextmanager
def source_location(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    listing_only: Callable[[list[str]], bool] | None = None,
) -> Iterator[Path]:
    """A local path holding the conversion source ``location``: an output in a bucket through
    the cache, any other URL (an image folder, TFRecord files) downloaded to a scratch folder,
    or only listed there when ``listing_only`` says so (:func:`source_folder`)."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    fs, root = filesystem(url, storage_options)
    try:
        is_output = fs.exists(f"{root}/{MANIFEST_NAME}")
    except OSError as exc:
        raise remote_error(url, exc) from None
    if is_output:
        fetched = fetch_output(url, storage_options, cache_dir)
        try:  # pinned while the conversion reads it
            yield fetched.path
        finally:
            if fetched.pin is not None:
                fetched.pin.close()
        return
    with source_folder(url, storage_options, listing_only) as folder:
        yield folder
