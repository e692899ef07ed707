"""One process does a piece of work that others started beside it would repeat.

The parts of a conversion started together each need the listing of a bucket SRC. The first to
start *claims* it: it writes a small claim object in a folder they share (DST's work folder)
and keeps it fresh while it lists; a part that finds a live claim waits for what the claimer
saves instead of listing too (:func:`first`). Parts of a job array start at the same moment,
and several try to claim before any sees a claim: a claim is created only where there is none
(S3's conditional write, ``If-None-Match: *``; a hard link on a path), so one of them creates it
and the others wait. Where the store has no such write, the last write is kept: each claimer
reads its claim back after a pause (:data:`SETTLE`, longer than its own write took) and the
one whose claim stands does the work.

A claim is a courtesy, not a lock: two parts whose claims both seem to stand (a store without
conditional writes and a write slower than the pause) both do the work (the same work, the same
result). The parts that find one stale claim write theirs over it, each reads its own back
after the pause, and the last write is kept. A claim that stops
changing (its process killed, its machine gone) or disappears (its process failed and took it
back) lets a waiting part go on by itself. Staleness is judged by the waiter's own clock (how
long the claim has not changed), never by comparing clocks of two machines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from imgpack.storage.cache import write_bytes
from imgpack.storage.location import filesystem, is_url, local_path

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two writes of a live claim.
BEAT = 5.0
#: Seconds a waiter gives a claim that has not changed before it goes on by itself.
STALE = 60.0
#: Seconds between two looks of a waiter.
POLL = 1.0
#: Seconds a claimer waits before it reads its claim back (at least 4 times its write's).
SETTLE = 1.0


class Claim:
    """A claim on ``what`` (for example a source's URL), written as ``name`` in the folder
    ``folder`` (a URL or a path) and kept fresh on a thread until :meth:`release`, or until
    ``settled()`` says what the waiters wait for is there (then it is taken back at once);
    ``who`` says in a waiter's log who does the work."""

    def __init__(
        self,
        folder: str,
        name: str,
        what: str,
        who: str,
        storage_options: dict[str, Any] | None = None,
        settled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.folder, self.name, self.what, self.who = folder.rstrip("/"), name, what, who
        self.storage_options = storage_options
        self.settled = settled
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made: list[Path] = []  # the folders the claim made (a path), innermost first
        #: What :meth:`take` did: ``"created"`` (where there was none: it stands), ``"lost"``
        #: (there was one), ``"written"`` (over whatever was there: read back to know), or
        #: ``"unwritten"`` (the store refused it: the work is done here, as without claims).
        self._taken = "unwritten"
        self._wrote = 0.0  # seconds the write took

    def _path(self) -> tuple[Any, str]:
        return _located(self.folder, self.name, self.storage_options)

    def _body(self, beat: int) -> bytes:
        body = {"what": self.what, "who": self.who, "token": self._token, "beat": beat}
        return json.dumps(body, sort_keys=True).encode()

    def _write(self, beat: int, create: bool = False) -> bool:
        """Write the claim (one PUT, or a rename or link on a path: never half-written); with
        ``create``, only where there is none, if the store can (whether it was so created:
        :class:`FileExistsError` where there is one)."""
        body = self._body(beat)
        if is_url(self.folder):
            fs, path = self._path()
            if create:
                try:
                    fs.pipe_file(path, body, mode="create")  # If-None-Match: * on S3
                    return True
                except (TypeError, ValueError, NotImplementedError):
                    pass  # a store without conditional writes: the last write is kept
            fs.pipe_file(path, body)
            return False
        folder = local_path(self.folder)
        if not self._made:
            self._made = [f for f in (folder, *folder.parents) if not f.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        if not create:
            write_bytes(folder / self.name, body)  # a rename: never half-written
            return False
        written = folder / f".{self.name}.{self._token}"
        write_bytes(written, body)
        try:
            os.link(written, folder / self.name)  # where there is none, whole
            return True
        except FileExistsError:
            raise
        except OSError:  # a filesystem without hard links: the last rename is kept
            os.replace(written, folder / self.name)
            return False
        finally:
            written.unlink(missing_ok=True)

    def take(self, over: bool = False) -> Claim:
        """Claim, where there is no claim yet, or ``over`` the one there (a stale claim, which
        every part that gave up on it may write over at the same moment: the last write is
        kept, and each reads its own back); :meth:`stands` says whether this one is the one
        kept. A store that refuses the write is left to the work itself to name (the claim is
        only a courtesy to the waiting parts)."""
        began = time.monotonic()
        try:
            self._taken = "created" if self._write(0, create=not over) else "written"
        except FileExistsError:
            self._taken = "lost"
        except OSError as exc:
            log.debug("%s/%s: not written (%s)", self.folder, self.name, exc)
        self._wrote = time.monotonic() - began
        return self

    def stands(self) -> bool:
        """Whether this claim is the one kept: created where there was none, or (where the
        store cannot create only) read back after :data:`SETTLE` as written (a claim written at
        the same moment by another process may have replaced it); if so, it is kept fresh
        from now on. One that could not be written or read stands: the work is then done
        here, as without claims."""
        if self._taken == "lost":
            return False
        if self._taken == "unwritten":
            return True
        if self._taken == "written":
            time.sleep(max(SETTLE, 4 * self._wrote))
            try:
                fs, path = self._path()
                if _read(fs, path, strict=True).get("token") != self._token:
                    return False
            except (OSError, ValueError):
                return True
        self._thread = threading.Thread(target=self._beat, name="imgpack-claim", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        beat = 0
        while not self._stop.wait(BEAT):
            if self.settled():
                self._take_back()
                return
            beat += 1
            try:
                fs, path = self._path()
                if _read(fs, path).get("token") != self._token:
                    return  # taken over by a process that found this one stale: it is theirs
                self._write(beat)
            except OSError as exc:  # a waiter then goes on by itself: slower, never wrong
                log.debug("%s/%s: not renewed (%s)", self.folder, self.name, exc)

    def release(self) -> None:
        """Stop keeping the claim fresh and take it back if it is still this one's, so a waiter
        goes on at once (the work failed, or it is saved)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._take_back()

    def _take_back(self) -> None:
        with contextlib.suppress(OSError):
            fs, path = self._path()
            if _read(fs, path).get("token") == self._token:
                fs.rm_file(path)
        for made in self._made:  # the folders the claim made, where nothing else is now
            try:
                made.rmdir()
            except OSError:
                break


def _located(folder: str, name: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The filesystem of ``folder`` and the path of its claim ``name`` in it."""
    fs, root = filesystem(folder, storage_options)
    return fs, f"{root.rstrip('/')}/{name}"


def _read(fs: Any, path: str, strict: bool = False) -> dict[str, Any]:
    """The claim at ``path``, or ``{}`` where there is none (or none that can be read; with
    ``strict``, one that cannot be read for a reason other than its absence raises)."""
    try:
        body = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        if strict:
            raise
        return {}
    return body if isinstance(body, dict) else {}


def wait_for(
    folder: str,
    name: str,
    what: str,
    ready: Callable[[], T | None],
    storage_options: dict[str, Any] | None = None,
) -> T | None:
    """What ``ready()`` gives once it gives something, while a live claim on ``what`` is at
    ``folder``/``name`` (the caller asked ``ready()`` once already); ``None`` when there is
    none, or it stopped changing for :data:`STALE` seconds, or it went with nothing ready:
    then the caller does the work itself."""
    return _waited(folder, name, what, ready, storage_options)[0]


def _waited(
    folder: str,
    name: str,
    what: str,
    ready: Callable[[], T | None],
    storage_options: dict[str, Any] | None,
) -> tuple[T | None, dict[str, Any]]:
    """:func:`wait_for`, and the stale claim it gave up on (``{}`` for none)."""
    fs, path = _located(folder, name, storage_options)
    seen: dict[str, Any] = {}
    since = time.monotonic()
    said = False
    while True:
        claim = _read(fs, path)
        if claim.get("what") != what:  # none (or another's): saved just before it went, or not
            return (ready() if seen else None), {}
        if claim != seen:
            seen, since = claim, time.monotonic()
        elif time.monotonic() - since > STALE:
            log.warning(
                "%s: %s claimed it but said nothing for %.0f s; this process goes on by itself",
                what,
                claim.get("who", "another process"),
                STALE,
            )
            return None, claim
        if not said:  # (a warning: the only sign of life of a process that may wait long)
            log.warning(
                "%s: %s is on it (its claim is in %s); this process waits for what it saves",
                what,
                claim.get("who", "another process"),
                folder,
            )
            said = True
        time.sleep(POLL)
        found = ready()
        if found is not None:
            return found, {}


def first(
    folder: str,
    name: str,
    what: str,
    who: str,
    ready: Callable[[], T | None],
    storage_options: dict[str, Any] | None = None,
) -> tuple[T | None, Claim | None]:
    """``(what ready() gave, None)`` once another process's claim on ``what`` led to it, or
    ``(None, claim)``: this process holds the claim and does the work (release it when done).
    The caller asked ``ready()`` once already."""
    while True:
        found, stale = _waited(folder, name, what, ready, storage_options)
        if found is not None:
            return found, None
        # A stale claim is no longer anyone's: written over, then read back. (Removed and
        # created anew, two parts that gave up on it at once could each create theirs.)
        fs, path = _located(folder, name, storage_options)
        over = bool(stale) and _read(fs, path) == stale
        held = Claim(folder, name, what, who, storage_options).take(over=over)
        if held.stands():
            return None, held
        held.release()  # claimed at the same moment by another, whose claim stands: wait for it
