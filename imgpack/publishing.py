"""Putting a finished output in place, and keeping two runs from writing the same one.

- :func:`locked`: a run holds ``.<name>.imgpack-lock`` beside DST (``flock``) from before it
  looks at DST until it has published; a second run to the same DST is refused at once.
- :func:`publish`: the finished temp dir becomes DST in one step. A new DST is renamed into
  place with ``RENAME_NOREPLACE``, so a DST that appeared meanwhile is never replaced; an old DST
  is swapped with ``renameat2(RENAME_EXCHANGE)``, so there is no moment without an output.
- Where the filesystem or the platform cannot exchange, the old output is first parked as
  ``.<name>.<random>.imgpack-old/out``, then the new one renamed in. A kill between the two
  renames leaves DST missing and the old output parked: :func:`recover`, which every imgpack
  command that meets DST runs first, puts it back.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from imgpack.errors import ConcurrentRunError, Interrupted, Terminated
from imgpack.manifest import MANIFEST_NAME

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".imgpack-lock"
PARKED_SUFFIX = ".imgpack-old"

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def _renameat2() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_RENAMEAT2 = _renameat2()


def rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; ``False`` where the platform or filesystem cannot do it
    (then nothing happened). Other failures raise ``OSError`` (``EEXIST``: ``dst`` exists)."""
    if _RENAMEAT2 is None:
        return False
    result = _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)  # type: ignore[operator]
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (links resolved): an input there would
    be replaced or deleted with the output (``--overwrite``)."""
    real, base = path.resolve(), folder.resolve()
    return real == base or base in real.parents


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def locked(dst: Path) -> Iterator[None]:
    """Hold DST's lock (creating DST's parent folder); raise :class:`ConcurrentRunError` when
    another process holds it."""
    if fcntl is None:
        yield
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(dst)
    fd = _take(path)
    if fd is None:
        raise ConcurrentRunError(
            f"{dst}: another imgpack run ({_holder(path)}) is writing it; wait for it to finish "
            f"or stop it (its lock: {path})"
        )
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still holding it: a waiting opener re-checks the inode
        os.close(fd)


def _take(path: Path) -> int | None:
    """A descriptor holding the lock at ``path``, or ``None`` if another process holds it."""
    assert fcntl is not None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder unlinked it before we locked: take the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        return f"pid {int(path.read_text().strip())}"
    except (OSError, ValueError):
        return "pid unknown"


def publish(tmp: Path, dst: Path, replace: bool) -> None:
    """Make the finished temp dir ``tmp`` the output ``dst`` in one step (see the module doc).

    Raises :class:`ConcurrentRunError` when ``dst`` exists and ``replace`` is false (it appeared
    while this run worked): nothing is replaced.
    """
    if not (dst.exists() or dst.is_symlink()):
        try:
            if rename2(tmp, dst, RENAME_NOREPLACE):
                return
        except FileExistsError:
            pass
        else:
            if not (dst.exists() or dst.is_symlink()):
                os.rename(tmp, dst)
                return
    if not replace and dst.is_dir() and not dst.is_symlink():
        try:  # an empty folder DST: rename() replaces a directory only while it is empty
            os.rename(tmp, dst)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not replace:
        raise ConcurrentRunError(
            f"{dst}: appeared while this conversion ran (another program wrote it); nothing was "
            "replaced (use --overwrite to replace it)"
        )
    parked = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=PARKED_SUFFIX, dir=dst.parent))
    if rename2(tmp, dst, RENAME_EXCHANGE):
        os.rename(tmp, parked / "out")  # the old output, now at tmp
    else:
        os.rename(dst, parked / "out")  # a kill from here to the next line: recover() undoes it
        os.rename(tmp, dst)
    shutil.rmtree(parked, ignore_errors=True)


def parked_outputs(dst: Path) -> list[Path]:
    """Old outputs of ``dst`` parked by a replacement that did not finish, newest first."""
    if not dst.parent.is_dir():
        return []
    found = [p for p in dst.parent.glob(f".{glob.escape(dst.name)}.*{PARKED_SUFFIX}") if p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def recover(dst: Path, holding_lock: bool = False) -> None:
    """Finish or undo a replacement of ``dst`` that a kill interrupted: put a parked old output
    back when ``dst`` is missing, remove parked ones when ``dst`` is in place. Without
    ``holding_lock``, does nothing while another run holds ``dst``'s lock (it may be mid-swap)."""
    if not parked_outputs(dst):
        return
    try:
        if holding_lock:
            _recover(dst)
        else:
            with locked(dst):
                _recover(dst)
    except ConcurrentRunError:
        return
    except OSError as exc:  # e.g. a read-only filesystem: leave it for a run that can
        log.warning("%s: could not restore the parked previous output: %s", dst, exc)


def _recover(dst: Path) -> None:
    for number, folder in enumerate(parked_outputs(dst)):
        old = folder / "out"
        if number == 0 and old.is_dir() and not (dst.exists() or dst.is_symlink()):
            os.rename(old, dst)
            log.warning(
                "%s: restored the previous output, which a replacement killed midway had left "
                "at %s",
                dst,
                folder,
            )
        shutil.rmtree(folder, ignore_errors=True)


#: The suffix of the temp folders outputs are built in beside their destination.
TEMP_SUFFIX = ".imgpack-tmp"
#: A conversion's checkpoint in its temp folder: a folder holding one may be resumed, and is
#: left for ``--resume``; the others a killed run left are removed.
CHECKPOINT_NAME = ".imgpack-checkpoint.json"


def check_destination(
    dst: Path, overwrite: bool, marker: str = MANIFEST_NAME, what: str = "an imgpack output"
) -> None:
    """``dst`` may be written: it does not exist, it is an empty folder, or ``overwrite`` and
    it is ``what`` (a folder holding the file ``marker``). The same words for every command,
    local or bucket (:func:`imgpack.storage.destination.output_folder`)."""
    if not (dst.exists() or dst.is_symlink()):
        return
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        return  # an empty folder: filled by the publish (a rename over an empty folder)
    if not (dst.is_dir() and not dst.is_symlink() and (dst / marker).is_file()):
        raise FileExistsError(
            f"{dst}: already exists and is not {what}; refusing to replace it, with or without "
            "--overwrite (remove it yourself, or choose another destination)"
        )
    if not overwrite:
        raise FileExistsError(f"{dst}: already exists (use --overwrite to replace it)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def leftovers(dst: Path) -> list[Path]:
    """Temp dirs of conversions to ``dst`` that were killed before they could clean up."""
    if not dst.parent.is_dir():
        return []
    return sorted(
        p for p in dst.parent.glob(f".{glob.escape(dst.name)}.*{TEMP_SUFFIX}") if p.is_dir()
    )


def clear_leftovers(dst: Path) -> None:
    """Remove the temp dirs beside ``dst`` that nothing can resume (no checkpoint: a killed
    ``merge`` or ``export``, or a conversion killed before it wrote one). Call it holding DST's
    lock: no live run is writing them then."""
    for left in leftovers(dst):
        if not (left / CHECKPOINT_NAME).exists() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
            log.info("%s: removed, left by a run that was killed and cannot be resumed", left)


@contextlib.contextmanager
def temp_output(
    dst: Path, existing: Path | None = None, keep: Callable[[Path], str | None] | None = None
) -> Iterator[Path]:
    """A temp dir beside ``dst`` (same filesystem, so publishing is a rename), removed on error;
    ``existing`` is the temp dir of an interrupted conversion being resumed. ``keep``: for a
    run stopped by SIGTERM or Ctrl-C, the note that says why the dir is kept (a conversion's
    checkpoint of written samples), or ``None`` to remove it; the note goes into the
    :class:`~imgpack.errors.Terminated` or :class:`~imgpack.errors.Interrupted` raised."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if existing is not None:
        tmp = existing
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=TEMP_SUFFIX, dir=dst.parent))
        os.chmod(
            tmp, 0o777 & ~_umask()
        )  # mkdtemp makes it private; an output is an ordinary folder
    try:
        yield tmp
    except (KeyboardInterrupt, Terminated) as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        note = keep(tmp) if keep is not None else None
        if note:
            raise (
                Interrupted(note) if signum == signal.SIGINT else Terminated(signum, note)
            ) from None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
