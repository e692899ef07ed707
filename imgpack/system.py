"""Small facts about the machine and careful file reads, shared by the conversion and the
loading side."""

from __future__ import annotations

import errno
import os
import stat


def usable_cpus() -> int:
    """CPUs this process may run on (affinity-aware, unlike ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file at ``path``; ``OSError`` for anything else (a FIFO, a
    device, a link, a folder), found without blocking: opening a FIFO for reading would wait
    for a writer forever, and a device may never end."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
