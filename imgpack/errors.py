"""The exceptions imgpack raises.

Every error imgpack raises for bad input derives from :class:`ImgpackError`, except where a
precise built-in fits better (``FileNotFoundError``, ``FileExistsError``). Messages name the file,
the bad value and what is allowed, so the CLI can print them as they are.
"""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for a user: its first line, and the last one too when
    the first only introduces it (``Initialization failure from server:`` and a traceback);
    the class name when it has no message."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[-1]}"
    return lines[0]


class ImgpackError(Exception):
    """Base class of imgpack's own errors."""


class OptionError(ImgpackError, ValueError):
    """An option has a value imgpack does not accept."""


class ScanError(ImgpackError):
    """The source folder does not have the layout imgpack expects."""


class ImageError(ImgpackError):
    """A source image cannot be read, decoded or converted under the image policy."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[type[ImageError], tuple[str, str]]:
        return (type(self), (self.path, self.reason))


def renamed(exc: ImgpackError, old: str, new: str) -> ImgpackError:
    """``exc`` with ``old`` (the path of a scratch copy) said as ``new`` (what the user named, a
    URL) in its message; ``exc`` itself where its class cannot be made from a message."""
    if old not in str(exc):
        return exc
    if isinstance(exc, ImageError):
        return ImageError(exc.path.replace(old, new), exc.reason.replace(old, new))
    try:
        return type(exc)(str(exc).replace(old, new))
    except TypeError:
        return exc


class ManifestError(ImgpackError):
    """An ``imgpack.json`` is missing, unreadable, or of a version/format this imgpack can't read."""


class NotAnOutput(ManifestError):
    """A folder given where an imgpack output was expected holds no ``imgpack.json``."""


class DataError(ImgpackError):
    """A stored record is damaged or inconsistent with its manifest."""


class StorageError(ImgpackError, OSError):
    """Writing the output failed for a reason of the machine, not of the input: the disk is
    full, a quota is exceeded, the filesystem is read-only. Nothing was published."""


class ConcurrentRunError(ImgpackError):
    """Another imgpack run holds the output (or it changed under this one)."""


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM). Like ``KeyboardInterrupt``, not an ``Exception``:
    nothing that handles errors catches it, every cleanup runs."""

    def __init__(self, signum: int, note: str = "cleaned up, nothing half-written") -> None:
        super().__init__(signum, note)
        self.signum = signum
        #: What the run left behind, for the one-line message.
        self.note = note


class PerformanceWarning(UserWarning):
    """A setting that reads an output slower than another would (the message says which)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a conversion that kept its checkpoint: still a ``KeyboardInterrupt``, with
    :attr:`note` saying what was kept and how to continue."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        self.note = note
