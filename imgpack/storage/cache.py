"""The local cache of outputs read from object storage (:class:`OutputCache`).

An output in a bucket is read through a local copy: its files are fetched once, checked against
the manifest's size and sha256, and then read as local files, memory-mapped as any output is,
so every fast path stays. The helpers here (locks, checked writes, the files to fetch) are the
ones :mod:`imgpack.storage.lazy` builds its file-by-file cache on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from imgpack.errors import (
    StorageError,
)
from imgpack.manifest import MANIFEST_NAME, Manifest, sha256_file
from imgpack.storage.location import (
    TRANSFERS,
    Location,
    content_tag,
    filesystem,
    read_remote_manifest,
    remote_error,
)
from imgpack.system import read_regular_file
from imgpack.units import parse_byte_size

log = logging.getLogger(__name__)

#: The cache's size limit when neither ``max_bytes`` nor ``IMGPACK_CACHE_SIZE`` sets one.
DEFAULT_CACHE_BYTES = 100 << 30


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
    #: Files taken from another version of the same output in the cache (an appended output's
    #: old files), linked instead of downloaded.
    reused: int = 0


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
        entries = remote_files(fs, root, url, manifest)
        with contextlib.ExitStack() as stack:
            try:
                safe_dirs(self.directory, local)
                stack.enter_context(locked(local, fcntl.LOCK_EX))
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
            safe_dirs(self.directory, local)  # under the lock: an eviction may have removed it
            for stale in local.glob(".*.part"):  # left by a fetch that was killed
                stale.unlink(missing_ok=True)
            checked = _load_json(local / CHECKED)
            wanted = [e for e in entries if not _still_good(local, e, checked)]
            if wanted:
                with ThreadPoolExecutor(TRANSFERS) as pool:
                    done = pool.map(
                        lambda e: fetch_file(fs, f"{root}/{e.path}", local, e, url), wanted
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
                write_bytes(manifest_path, data)  # last: the entry is complete
            write_bytes(local / ".imgpack-used", b"")
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
                locked(entry, fcntl.LOCK_EX | fcntl.LOCK_NB, ".pin"),
                locked(entry, fcntl.LOCK_EX | fcntl.LOCK_NB),
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


def remote_files(fs: Any, root: str, url: str, manifest: Manifest) -> list[Remote]:
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


#: Per entry: ``{path: [size, mtime_ns, sha256, etag]}`` of each file once it was checked.
CHECKED = ".imgpack-cache.json"


def safe_dirs(cache: Path, entry: Path) -> None:
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


#: The descriptors of ``flock`` locks this process holds on cache files for a while (a fetch's
#: lock, an eviction's, a reader's pin), each with the process that opened it. A lock belongs
#: to the open file, which a forked child shares: a child that kept its copy would hold a
#: parent's fetch lock after the parent let go (every process waiting for that file would wait
#: forever) and keep a pin the parent dropped (its file could never be evicted). So a child
#: closes its copies at once, and never closes them again (:func:`release_fd`).
_held: dict[int, int] = {}


def hold_fd(fd: int) -> int:
    """``fd`` (a lock file just opened) noted as held by this process, until
    :func:`release_fd`."""
    _held[fd] = os.getpid()
    return fd


def release_fd(
    fd: int,
    _close: Callable[[int], None] = os.close,
    _getpid: Callable[[], int] = os.getpid,
    _fds: dict[int, int] = _held,
) -> None:
    """Close ``fd`` from :func:`hold_fd`, if this process opened it (a copy from the parent
    was closed at the fork). What it uses is bound at definition: readers collected at
    interpreter exit call it after modules are cleared."""
    if _fds.get(fd) == _getpid():
        del _fds[fd]
        try:  # noqa: SIM105 - contextlib may be cleared by then
            _close(fd)
        except OSError:
            pass


def _close_inherited() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


@contextlib.contextmanager
def locked(entry: Path, how: int, suffix: str = ".lock") -> Iterator[None]:
    """``flock`` on the entry's lock file: ``.lock`` serialises fetching, ``.pin`` is held
    shared by every process reading the entry (and taken exclusively to evict it). A process
    forked meanwhile does not hold it (:func:`hold_fd`)."""
    fd = hold_fd(os.open(str(entry) + suffix, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        release_fd(fd)


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
        """Let the entry go. ``os.close`` is bound at definition, and nothing else from a
        module is used: a pin collected at interpreter exit runs after modules are cleared."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:  # noqa: SIM105 - contextlib may be cleared by then
                _close(fd)
            except OSError:
                pass

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


def write_bytes(path: Path, data: bytes) -> None:
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
    write_bytes(path, json.dumps(data).encode())


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


def fetch_file(fs: Any, remote: str, local: Path, entry: Remote, url: str) -> tuple[str, int, int]:
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
    if _reused(local, entry, tmp):
        os.replace(tmp, target)
        stats.reused += 1
        st = target.stat()
        return entry.path, st.st_size, st.st_mtime_ns
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


def _reused(local: Path, entry: Remote, tmp: Path) -> bool:
    """Whether ``entry`` was linked at ``tmp`` from the cache entry of another version of the
    same output (same URL, another output id: the output was appended to, and its old files
    are the same bytes), its size and sha256 checked there. Cache files are only ever replaced
    by a rename, never written in place, so a linked file keeps the bytes it was hashed with."""
    if not entry.sha256:
        return False
    prefix = local.name.rsplit("-", 1)[0]
    for other in sorted(local.parent.glob(f"{prefix}-*")):
        found = other / entry.path
        if other == local or other.is_symlink() or not found.is_file() or found.is_symlink():
            continue
        try:
            if found.stat().st_size != entry.bytes:
                continue
            os.link(found, tmp)
        except OSError:  # evicted meanwhile, or a filesystem without hard links
            tmp.unlink(missing_ok=True)
            continue
        if tmp.stat().st_size == entry.bytes and sha256_file(tmp) == entry.sha256:
            return True
        tmp.unlink(missing_ok=True)
    return False


def fetch_output(
    url: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    remote: tuple[Manifest, bytes] | None = None,
) -> Fetched:
    """The local, checked copy of the output at ``url`` and its pin (see :class:`OutputCache`);
    ``remote``: its manifest and bytes, when read already."""
    return OutputCache(cache_dir).fetch(url, storage_options, remote)
