"""Reading an output in a bucket lazily, through a bounded cache of its files.

Opening fetches the manifest and the small index files only. A data file (a shard) is fetched
the first time a reader uses it, checked against the manifest's size and sha256, and read from
the local copy (memory-mapped, as any local output). The cache is the one of
:class:`~imgpack.storage.cache.OutputCache` (``CACHE/outputs/<url hash>-<output id>/``), file by file:

- ``.<name>.checked``: the file's size, modification time, sha256 and ETag once checked; its
  modification time says when the file was last used (eviction order);
- ``.<name>.lock``: held exclusively while the file is fetched, so processes that need it at
  once (DataLoader workers, ranks) download it once;
- ``.<name>.pin``: held shared by every reader using the file — each reader pins the few files
  it reads now and lets the older ones go — and taken exclusively to evict it.

With a ``limit`` (bytes), fetching a file first evicts least recently used files that no reader
in any process has pinned, until the cache's data files fit the limit with it: the cache never
holds more than the limit plus the files being read. A file evicted and needed again is fetched
again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from imgpack.errors import StorageError
from imgpack.manifest import MANIFEST_NAME, Manifest
from imgpack.storage import cache as cache_module
from imgpack.storage.cache import (
    EntryPin,
    OutputCache,
    Remote,
    fetch_file,
    hold_fd,
    release_fd,
    remote_files,
    safe_dirs,
    write_bytes,
)
from imgpack.storage.location import filesystem, forks, keep_inherited, read_remote_manifest
from imgpack.system import read_regular_file
from imgpack.units import parse_byte_size

log = logging.getLogger(__name__)

#: The environment variable that gives ``cache_limit`` its default.
LIMIT_VARIABLE = "IMGPACK_CACHE_LIMIT"

#: GETs at once: a reader's prefetcher, and the index files fetched when an output is opened
#: (object stores serve parallel GETs of one client far faster than one after the other).
FETCH_THREADS = 4


def default_limit() -> int | None:
    value = os.environ.get(LIMIT_VARIABLE)
    return parse_byte_size(value, LIMIT_VARIABLE) if value else None


def cache_limit(limit: int | str | None) -> int | None:
    """The cache limit in bytes: ``limit`` given (``"200GB"``), else :data:`LIMIT_VARIABLE`,
    else ``None`` (no limit)."""
    return parse_byte_size(limit, "cache_limit") if limit is not None else default_limit()


class LazyOutput:
    """An output at ``url`` whose data files are fetched into the cache when first used."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        limit: int | str | None = None,
        remote: tuple[Manifest, bytes] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        cache = OutputCache(cache_dir)
        self.cache_dir = cache.directory
        self.limit = cache_limit(limit)
        #: The data files this process fetched (each checked whole as it arrived), and its pid.
        self._fetched: tuple[int, set[str]] = (os.getpid(), set())
        # The manifest and its bytes: read here, or given by the opener that read them.
        self.manifest, data = remote or read_remote_manifest(self.url, storage_options)
        self.root = cache.entry(self.url, self.manifest, data)
        fs, self._base = filesystem(self.url, storage_options)
        listed = remote_files(fs, self._base, self.url, self.manifest)
        data_files = {entry.path for entry in self.manifest.files}
        self._remote = {r.path: r for r in listed if r.path in data_files}
        index_files = [r for r in listed if r.path not in data_files]
        manifest_path = self.root / MANIFEST_NAME
        try:
            safe_dirs(self.cache_dir, self.root)
            with cache_module.locked(self.root, fcntl.LOCK_EX):  # index files, then the manifest
                # No whole-entry eviction while this output is read (the pin goes with it).
                self._entry_pin = EntryPin(self.root)
                _remove_stale_parts(self.root)
                missing = [r for r in index_files if not self._good(r)]
                if missing:
                    self._filesystem()
                    with ThreadPoolExecutor(FETCH_THREADS) as pool:
                        list(pool.map(self._fetch, missing))
                if not _same(manifest_path, data):
                    write_bytes(manifest_path, data)
        except StorageError:
            raise
        except OSError as exc:
            complete = all(self._good(r) for r in index_files) and _same(manifest_path, data)
            self._read_only(exc, complete)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fetched"] = (0, set())  # what the process it goes to fetches itself
        return state

    def file(self, name: str) -> Path:
        """The checked local copy of data file ``name`` (pin it first: :meth:`pin`)."""
        remote = self._remote[name]
        target = self.root / name
        try:
            with cache_module.locked(self.root / f".{name}", fcntl.LOCK_EX):
                if self._good(remote):
                    os.utime(self._marker(name))  # used now: last in the eviction order
                    return target
                reserved = self.make_room(name, remote.bytes)
                try:
                    self._fetch(remote)
                finally:
                    if reserved is not None:
                        reserved.unlink(missing_ok=True)
                pid, names = self._fetched
                if pid != os.getpid():
                    names = set()
                    self._fetched = (os.getpid(), names)
                names.add(name)
        except StorageError:
            raise
        except OSError as exc:
            self._read_only(exc, self._good(remote))
        return target

    def fetched_here(self, name: str) -> bool:
        """Whether this process fetched data file ``name`` (checked whole against the
        manifest's size and sha256 as it arrived): its records are as the writer wrote them,
        and a first read need not check them one by one. A copy found in the cache, checked
        by an earlier process, is not: it may have been damaged on disk since."""
        pid, names = self._fetched
        return pid == os.getpid() and name in names

    def local(self, name: str) -> Path:
        """The checked local copy of data file ``name``, pinned only while it is fetched: for
        a reader that opens it at once and reads it through (an open file reads on even if
        the cache evicts it meanwhile)."""
        fd = self.pin(name)
        try:
            return self.file(name)
        finally:
            unpin(fd)

    def pin(self, name: str) -> int | None:
        """A shared lock on data file ``name`` for a reader: no process evicts it while the
        returned descriptor is open (close it to let the file go); ``None`` in a cache this
        user cannot write (nothing evicts from it either)."""
        try:
            fd = os.open(self.root / f".{name}.pin", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                return None
            raise StorageError(f"{self.root}: cannot use the cache entry: {exc.strerror}") from None
        hold_fd(fd)  # a forked child does not keep the pin (it pins what it reads itself)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _read_only(self, exc: OSError, complete: bool) -> None:
        """A cache this user cannot write: what is there and checked is read; else one
        error that says what to do."""
        if exc.errno in _READ_ONLY:
            if complete:
                return
            raise StorageError(
                f"{self.cache_dir}: the cache folder cannot be written ({exc.strerror}) and "
                f"holds no checked copy of what {self.url} needs; set IMGPACK_CACHE_DIR (or "
                "cache_dir=) to a writable folder"
            ) from None
        raise StorageError(f"{self.root}: cannot use the cache entry: {exc.strerror}") from None

    def make_room(self, name: str, needed: int) -> Path | None:
        """Evict least recently used data files no reader has pinned, until the cache's data
        files, the fetches under way (each reserves its file's size) and ``needed`` more bytes
        for ``name`` fit the limit (as far as unpinned files allow); then reserve ``needed``
        bytes: the reservation returned, to remove once the file is fetched. All of it under
        the cache's room lock, so that fetches at once (prefetch threads, workers, ranks) do
        not each count the same free bytes."""
        if self.limit is None:
            return None
        with cache_module.locked(self.cache_dir / "outputs" / ".room", fcntl.LOCK_EX):
            self._evict(needed + reserved_bytes(self.cache_dir))
            reservation = self.root / f".{name}.{os.getpid()}.{threading.get_ident()}.reserve"
            write_bytes(reservation, str(needed).encode())
            return reservation

    def _evict(self, needed: int) -> None:
        assert self.limit is not None
        files = cached_files(self.cache_dir)
        total = sum(size for _, _, size in files)
        for _, path, size in sorted(files):
            if total + needed <= self.limit:
                return
            pin = path.with_name(f".{path.name}.pin")
            fd = hold_fd(os.open(pin, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                release_fd(fd)
                continue  # a reader uses it
            try:
                path.with_name(f".{path.name}.checked").unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                total -= size
            finally:
                release_fd(fd)

    def _marker(self, name: str) -> Path:
        """What says ``name`` was checked: ``.checked`` for data files (evictable), ``.kept``
        for index files (read when the output is opened, kept with it)."""
        return self.root / f".{name}.{'checked' if name in self._remote else 'kept'}"

    def _good(self, remote: Remote) -> bool:
        try:
            st = (self.root / remote.path).lstat()
            found = json.loads(read_regular_file(self._marker(remote.path)))
        except (OSError, ValueError):
            return False
        return stat.S_ISREG(st.st_mode) and found == [
            st.st_size,
            st.st_mtime_ns,
            remote.sha256,
            remote.etag,
        ]

    def _filesystem(self) -> Any:
        """This process's filesystem for the URL's store and options (:func:`fetching_filesystem`),
        which every lazy reader of the process shares."""
        return fetching_filesystem(self.url, self.storage_options)

    def _fetch(self, remote: Remote) -> None:
        name, size, mtime = fetch_file(
            self._filesystem(), f"{self._base}/{remote.path}", self.root, remote, self.url
        )
        write_bytes(
            self._marker(name), json.dumps([size, mtime, remote.sha256, remote.etag]).encode()
        )


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)

#: The lazy readers' filesystems in this process: ``{(scheme, options): ((pid, forks), fs)}``.
_filesystems: dict[tuple[str, str], tuple[tuple[int, int], Any]] = {}


def fetching_filesystem(url: str, storage_options: dict[str, Any] | None) -> Any:
    """The filesystem this process fetches ``url``'s files with, one per store and storage
    options for every reader of the process: one client and its connections (a client costs
    about 0.15 s of CPU to make, its service model and TLS context loaded again). A new one after
    each fork of this process: a forked child may hold the old one's sockets (see
    :data:`~imgpack.storage.location._inherited`), so the old one is kept, never closed."""
    options = json.dumps(storage_options or {}, sort_keys=True, default=repr)
    key, now = (url.partition("://")[0], options), (os.getpid(), forks())
    found = _filesystems.get(key)
    if found is not None and found[0] == now:
        return found[1]
    if found is not None:
        keep_inherited(found[1])
    fs = filesystem(url, storage_options, fresh=True)[0]
    _filesystems[key] = (now, fs)  # two threads at once: one is kept, the other used once
    return fs


def _same(path: Path, data: bytes) -> bool:
    try:
        return read_regular_file(path) == data  # no link, FIFO or device
    except OSError:
        return False


def _remove_stale_parts(entry: Path) -> None:
    """Remove the temporary files of fetches whose process is gone (killed mid-download);
    those of live processes are theirs (``.<name>.<pid>.<thread>.part``)."""
    for part in entry.glob(".*.part"):
        try:
            pid = int(part.name.rsplit(".", 3)[-3])
            os.kill(pid, 0)
        except ProcessLookupError:
            part.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


def reserved_bytes(cache_dir: Path) -> int:
    """Bytes reserved by fetches under way in the cache (``.<name>.<pid>.<thread>.reserve``
    holding the file's size); those of processes that are gone are removed."""
    total = 0
    for marker in (cache_dir / "outputs").glob("*/.*.reserve"):
        try:
            os.kill(int(marker.name.rsplit(".", 3)[-3]), 0)
            total += int(marker.read_bytes())
        except ProcessLookupError:
            marker.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue
    return total


def cached_files(cache_dir: Path) -> list[tuple[float, Path, int]]:
    """``(last used, path, bytes)`` of every data file fetched lazily into the cache."""
    found: list[tuple[float, Path, int]] = []
    outputs = cache_dir / "outputs"
    if not outputs.is_dir():
        return found
    for marker in outputs.glob("*/.*.checked"):
        path = marker.with_name(marker.name[1 : -len(".checked")])
        with contextlib.suppress(OSError):
            found.append((marker.stat().st_mtime, path, path.stat().st_size))
    return found


#: A prefetcher keeps at most this many times its depth of files pinned: the sampler lets
#: each go once it is read (:meth:`Prefetcher.done`); these are the ones it never named.
BACKSTOP = 8


class Prefetcher:
    """Fetches the files a reader will read next, in background threads of this process.

    :meth:`want` names them in the order they will be read (a sampler knows it): the first
    ``depth`` of each naming are queued, and fetched up to ``threads`` at once, earliest named
    first; each is pinned until the sampler is done with it (:meth:`done`: past its last read
    and the reads behind it) or this process's reader
    pins it itself (:meth:`taken`). Another process that needs a file being
    fetched waits for it (the file's lock), so no file is fetched twice. A file that cannot be
    fetched is left to the reader, which names it.
    """

    def __init__(self, lazy: LazyOutput, depth: int, threads: int = FETCH_THREADS) -> None:
        self.lazy, self.depth = lazy, depth
        self.threads = max(1, min(threads, depth))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[str] = deque()
        self._busy: set[str] = set()
        self._finished: set[str] = set()  # done with while being fetched
        self._pins: OrderedDict[str, int | None] = OrderedDict()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._paused = 0
        self.pid = os.getpid()  # its threads, pins and lock are this process's
        _prefetchers.add(self)

    def pause(self) -> None:
        """Start no fetch until :meth:`resume`, and wait for those under way to end."""
        with self._lock:
            self._paused += 1
            while self._busy and not self._closed:
                self._wake.wait()

    def resume(self) -> None:
        with self._lock:
            self._paused = max(0, self._paused - 1)
            self._wake.notify_all()

    def want(self, names: Sequence[str]) -> None:
        """The next files to be read, in order: the first ``depth`` are fetched. A sampler names
        them as it hands out positions, a batch or more before the reads: files named earlier
        and not fetched yet are nearer in the reading order and go first. The files fetched
        stay pinned until :meth:`done` (the reads lag the naming)."""
        wanted = list(dict.fromkeys(names))[: self.depth]
        with self._lock:
            known = {*self._queue, *self._busy, *self._pins}
            self._queue.extend(n for n in wanted if n not in known)
            while len(self._workers) < min(self.threads, len(self._queue)):
                worker = threading.Thread(target=self._run, name="imgpack-prefetch", daemon=True)
                worker.start()
                self._workers.append(worker)
            self._wake.notify_all()

    def done(self, names: Sequence[str]) -> None:
        """Files the sampler handed out for the last time (and the reads behind it): their
        prefetch pins go, and one still queued is not fetched."""
        with self._lock:
            for name in names:
                if name in self._pins:
                    unpin(self._pins.pop(name))
                elif name in self._busy:
                    self._finished.add(name)  # let go as soon as it is fetched
            if self._queue:
                gone = set(names)
                self._queue = deque(n for n in self._queue if n not in gone)

    def taken(self, name: str) -> None:
        """A reader of this process pinned ``name`` itself: the prefetch pin goes."""
        with self._lock:
            if name in self._pins:
                unpin(self._pins.pop(name))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            while self._pins:
                unpin(self._pins.popitem()[1])
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while (not self._queue or self._paused) and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                name = self._queue.popleft()
                self._busy.add(name)
            fd = self.lazy.pin(name)
            try:
                self.lazy.file(name)
            except Exception as exc:  # the reader meets it again and says what is wrong
                unpin(fd)
                log.debug("prefetch of %s failed: %s", name, exc)
                with self._lock:
                    self._busy.discard(name)
                    self._wake.notify_all()
                continue
            with self._lock:
                self._busy.discard(name)
                self._wake.notify_all()
                if self._closed or name in self._pins or name in self._finished:
                    self._finished.discard(name)
                    unpin(fd)
                    continue
                self._pins[name] = fd
                while len(self._pins) > BACKSTOP * self.depth:  # never let go by the sampler
                    unpin(self._pins.popitem(last=False)[1])


#: The live prefetchers of this process (weak), for :func:`quiet_fetches`.
_prefetchers: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


@contextlib.contextmanager
def quiet_fetches() -> Iterator[None]:
    """No prefetch under way in this process while the block runs: for a DataLoader that forks
    its workers. A fetch runs on fsspec's event loop thread; a process forked while a request
    is in flight drops that thread's objects, whose finalizers take the request's socket out of
    the epoll set parent and child share, and the parent's request then stalls until the
    client sends it again."""
    paused = [p for p in list(_prefetchers) if p.pid == os.getpid()]
    for prefetcher in paused:
        prefetcher.pause()
    try:
        yield
    finally:
        for prefetcher in paused:
            prefetcher.resume()


def unpin(fd: int | None, _close: Any = os.close) -> None:
    """Let a pinned file go (``None``: a read-only cache, nothing was pinned; a pin of the
    process this one was forked from: closed at the fork). ``os.close`` is bound at
    definition: readers still alive at interpreter exit call it late."""
    if fd is not None:
        release_fd(fd, _close)
