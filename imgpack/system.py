"""Small facts about the machine and careful file reads, shared by the conversion and the
loading side."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from imgpack.errors import ScanError

T = TypeVar("T")


def usable_cpus() -> int:
    """CPUs this process may run on (affinity-aware, unlike ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class NotRegularFile(OSError):
    """What :func:`read_regular_file` found was not a regular file (:attr:`kind` says what)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)
        self.kind = kind


def file_kind(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file's is, in words."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a file"


def read_regular_file(path: str | os.PathLike[str], follow_links: bool = False) -> bytes:
    """The bytes of the regular file at ``path``; :class:`NotRegularFile` for anything else (a
    FIFO, a device, a folder, a link unless ``follow_links``), found without blocking: opening a
    FIFO for reading would wait for a writer forever, and a device may never end. Reads of the
    size ``fstat`` gave until one finds the end: two calls for a file that does not change."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise NotRegularFile(str(path), "a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(str(path), file_kind(st.st_mode))
        parts = [os.read(fd, st.st_size + 1)]
        while parts[-1]:
            parts.append(os.read(fd, 1 << 20))
        return parts[0] if len(parts) == 2 else b"".join(parts)
    finally:
        os.close(fd)


def lends_tasks(executor: Any) -> bool:
    """Whether a conversion's ``executor`` (:mod:`imgpack.executors`) can take a plan's store
    requests (listing SRC, sizing a label list's objects) as tasks: it runs tasks
    (``TaskExecutor``) on workers that are there, not a local Ray it would start and stop for
    a few seconds of listing."""
    return hasattr(executor, "tasks") and not getattr(executor, "starts_ray", False)


@dataclass(frozen=True)
class TaskDied:
    """What an executor's ``tasks`` (:mod:`imgpack.executors`) gives for a task whose worker
    died on every try (killed by a signal: a decoder's crash, the OOM killer), alone in its
    process."""


def each_task(
    runner: Any,
    function: Callable[[Any], Any],
    items: Iterable[Any],
    died: Callable[[Any], tuple[str, str]],
    error: type[Exception] = ScanError,
) -> Iterator[tuple[Any, Any]]:
    """``runner.tasks(function, items)``: ``(item, result)`` in the items' order, a task whose
    worker died on every try raised as ``error``, in the words ``died(item)`` gives: what the
    task was about and what its worker did (``("s3://b/x.tar", "reading it")``)."""
    for item, result in runner.tasks(function, items):
        if isinstance(result, TaskDied):
            what, doing = died(item)
            raise error(
                f"{what}: the worker {doing} died on every try (out of memory? try fewer --workers)"
            )
        yield item, result


def copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy the regular file ``src`` to the new file ``dst`` inside the kernel
    (``copy_file_range``: a filesystem that shares extents, such as XFS or Btrfs, shares them
    instead of copying bytes), else by ``shutil.copyfile``."""
    import shutil

    copy_range = getattr(os, "copy_file_range", None)
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while copy_range is not None and done < size:
                step = copy_range(fin.fileno(), fout.fileno(), min(size - done, 1 << 30))
                if step == 0:
                    break
                done += step
        except OSError as exc:  # not offered across these filesystems: copy it here
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        if done < size:
            fin.seek(done)
            fout.seek(done)
            shutil.copyfileobj(fin, fout, 1 << 20)


class PerProcess(Generic[T]):
    """A value that belongs to the process that made it (a filesystem client with its event
    loop, a handle): made on first use, made again in a forked or spawned process (one pid
    check), never pickled."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._value: T | None = None

    def get(self, make: Callable[[bool], T]) -> T:
        """This process's value; ``make(fresh)`` makes it, ``fresh`` saying that another
        process made one before (a fork's copy must not reuse what the parent's holds)."""
        pid = os.getpid()
        if self._pid != pid or self._value is None:
            self._value = make(self._pid is not None)
            self._pid = pid
        return self._value

    def __getstate__(self) -> dict[str, Any]:
        return {"_pid": None, "_value": None}
