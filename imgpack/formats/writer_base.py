"""The small base class every format writer implements.

The conversion engine (:mod:`imgpack.pipeline`) hands a writer the encoded samples one by one,
in scan order, from a single thread. A writer owns the files it creates inside the (temporary)
output directory; the engine adds the manifest and moves the directory into place. The format's
options are parsed by its :class:`~imgpack.formats.FormatSpec` before the writer exists and
reach it as :attr:`WriterConfig.settings`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from imgpack.errors import DataError
from imgpack.fields import Field
from imgpack.images import Encoded, Encoding, ImagePolicy
from imgpack.manifest import Companion, FileEntry, Manifest, sha256_file
from imgpack.units import format_bytes

log = logging.getLogger(__name__)

#: Files of the engine's own in a temp output dir (the checkpoint), which writers leave alone.
KEEP_PREFIX = ".imgpack-"


def default_shard_name(fmt: str, index: int) -> str:
    """The name of shard ``index`` of a sharded format that does not name its own
    (``shard-00000.pt``); its reader checks the manifest's files against it."""
    return f"shard-{index:05d}.{fmt}"


@dataclass(frozen=True)
class WriterConfig:
    """What every writer is told about the output it writes."""

    format: str
    classes: list[str]
    encoding: Encoding
    policy: ImagePolicy
    #: Bytes per shard (sharded formats; 0 for single-file ones).
    shard_size: int = 0
    #: The format's options, parsed by its spec (``-o KEY=VALUE``).
    settings: dict[str, Any] = field(default_factory=dict)
    #: The output's id (:attr:`imgpack.manifest.Manifest.output_id`): every data file records it.
    output_id: str = ""
    #: The scan position of the first sample (non-zero for a part of a partitioned conversion):
    #: formats that number samples in their files (webdataset keys) start there, so the parts'
    #: numbers never collide and merged parts need no renumbering.
    first_index: int = 0
    #: The per-sample fields every sample carries (:attr:`Encoded.fields`), in stored order.
    fields: tuple[Field, ...] = ()

    def class_name(self, label: int) -> str | None:
        """The class of ``label``; ``None`` for an unlabelled sample (an output without
        classes)."""
        return self.classes[label] if self.classes else None


@dataclass(frozen=True)
class WrittenFile:
    """A finished data file, relative to the output directory, with its sha256 where the
    writer already computed it (the manifest then need not read the file again)."""

    path: str
    num_samples: int
    sha256: str = ""
    #: ``(name, sha256)`` of each file that belongs to it (:meth:`ShardedWriter.companions_of`).
    companions: list[tuple[str, str]] = field(default_factory=list)


class Writer(ABC):
    """Writes one output directory. Use as a context manager; :meth:`close` may be called twice.

    Subclasses implement :meth:`add` and :meth:`_finish`. A writer that can resume an interrupted
    conversion also keeps :attr:`durable` (how many samples its files hold completely, as of its
    last checkpoint) and implements :meth:`checkpoint_state` and :meth:`resume`; the engine saves
    a checkpoint whenever :attr:`durable` grows.
    """

    def __init__(self, directory: Path, config: WriterConfig) -> None:
        self.directory = directory
        self.config = config
        self.settings = config.settings
        self._files: list[WrittenFile] | None = None
        #: Samples complete in the files as of the last checkpoint (0: none, or no checkpoints).
        self.durable = 0

    def checkpoint_state(self) -> dict[str, Any]:
        """What :meth:`resume` needs to continue from :attr:`durable` samples (JSON-able)."""
        raise NotImplementedError(f"format {self.config.format!r} cannot resume")

    def resume(self, state: dict[str, Any]) -> int:
        """Continue, in a fresh writer over the same directory, from a :meth:`checkpoint_state`.

        Returns how many samples after the checkpoint the files already hold (written and made
        durable after the checkpoint was saved); the engine passes that many over. Files or
        bytes past the checkpoint that are not complete are removed or truncated here.
        """
        raise NotImplementedError(f"format {self.config.format!r} cannot resume")

    @classmethod
    def seed(
        cls, directory: Path, config: WriterConfig, previous: Path, samples: Iterable[Encoded]
    ) -> dict[str, Any]:
        """Make the empty ``directory`` hold the data of the finished output at ``previous``
        (this format's, checked, never modified; ``samples``: its stored samples, in order,
        read only when the format needs them) so that more samples are added after them
        (``convert --append`` of a one-file format). Returns the :meth:`resume` state of a
        writer over ``directory`` that has added none yet: :attr:`durable` and the
        checkpoints count the samples added, the files hold the old ones too."""
        raise NotImplementedError(f"format {config.format!r} cannot be appended to")

    @abstractmethod
    def add(self, sample: Encoded) -> None:
        """Append one sample; samples arrive in output order."""

    @abstractmethod
    def _finish(self) -> list[WrittenFile]:
        """Flush and close every file; return them in order."""

    def _abort(self) -> None:  # noqa: B027 - optional hook
        """Release handles after a failure (the engine deletes the directory)."""

    def close(self) -> list[WrittenFile]:
        """Finish the output and return its data files. Safe to call more than once."""
        if self._files is None:
            self._files = self._finish()
        return self._files

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._files is None:
            self._abort()
            self._files = []


def shard_size_note(shard_size: int, largest: int) -> str:
    """The one line said when an image is larger than the shard size."""
    return (
        f"--shard-size {format_bytes(shard_size)} is smaller than an image ({format_bytes(largest)}):"
        " each such image is a shard of its own; a shard size of many images (the default) "
        "reads faster"
    )


class ShardedWriter(Writer):
    """A writer whose output rolls over to a new shard file once ``shard_size`` bytes are reached.

    Subclasses implement :meth:`_start_shard`, :meth:`_append` and :meth:`_end_shard`; a shard
    always holds at least one sample, so a single sample larger than the shard size gets a shard
    of its own.
    """

    def __init__(self, directory: Path, config: WriterConfig) -> None:
        super().__init__(directory, config)
        self._shards: list[WrittenFile] = []
        self._shard_bytes = 0
        self._shard_count = 0
        self._open = False
        self._warned = False  # of a sample larger than the shard size

    def shard_name(self, index: int) -> str:
        return default_shard_name(self.config.format, index)

    #: Bytes a sample adds to a shard beside its stored image, about (its label, checksum,
    #: path and the format's framing): what :meth:`estimated_bytes` adds.
    SAMPLE_OVERHEAD = 48

    @classmethod
    def estimated_bytes(cls, stored: int, raw: bool = False) -> int:
        """What a sample whose stored image is ``stored`` bytes (``raw``: its pixels) adds to a
        shard, as near as can be said before it is encoded: what a shard plan cuts by, so that
        ``--shard-size`` counts the bytes written, framing included, there too."""
        return stored + cls.SAMPLE_OVERHEAD

    @abstractmethod
    def _start_shard(self, path: Path) -> None: ...

    @abstractmethod
    def _append(self, sample: Encoded) -> int:
        """Add the sample to the open shard; return the bytes it added."""

    @abstractmethod
    def _end_shard(self) -> str | None:
        """Close the open shard; return its sha256 when the writer took it from the bytes it
        wrote (:class:`HashedFile`), ``None`` to have the finished file read back for it."""

    def add(self, sample: Encoded) -> None:
        size = len(sample.payload)
        if size > self.config.shard_size and not self._warned:
            self._warned = True
            log.warning("%s", shard_size_note(self.config.shard_size, size))
        if self._open and self._shard_bytes + size > self.config.shard_size:
            self._roll()
        self.open_shard()
        self._shard_bytes += self._append(sample)
        self._shard_count += 1

    def open_shard(self) -> None:
        """Start the next shard unless one is open: a shard written by a task of a shard plan
        (:mod:`imgpack.direct`) exists even when every one of its samples was skipped."""
        if not self._open:
            self._start_shard(self.directory / self.shard_name(len(self._shards)))
            self._open = True
            self._shard_bytes = 0
            self._shard_count = 0

    def _roll(self) -> None:
        written = self._end_shard()
        name = self.shard_name(len(self._shards))
        path = self.directory / name
        digest = written if written is not None else sha256_file(path)
        companions = {c.name: sha256_file(c) for c in self.companions_of(path)}
        self._shards.append(WrittenFile(name, self._shard_count, digest, [*companions.items()]))
        self._open = False
        self.durable = sum(shard.num_samples for shard in self._shards)

    def _finish(self) -> list[WrittenFile]:
        if self._open:
            self._roll()
        return self._shards

    def companions_of(self, shard: Path) -> list[Path]:
        """Files beside a finished shard that belong to it (its index file)."""
        return []

    def final_name(self, number: int, total: int) -> str:
        """The name of shard ``number`` of ``total`` in a finished output."""
        return self.shard_name(number)

    def link_parts(self, parts: Sequence[tuple[Path, Manifest]]) -> list[WrittenFile]:
        """The shards of a partitioned conversion's parts, in order, put into this writer's
        directory under this output's names as hard links: no data is copied (a copy where the
        filesystem cannot link, e.g. across filesystems). The parts stay as they were.

        Every part file is checked as the readers check it and never followed when it is a
        link: a regular file of the size its part's manifest records, whose linked (or copied)
        bytes hash to the recorded sha256, so a part replaced or edited after its manifest was
        checked is refused, not merged."""
        shards = [(root, entry) for root, manifest in parts for entry in manifest.files]
        written = []
        for number, (root, entry) in enumerate(shards):
            source = root / entry.path
            target = self.directory / self.final_name(number, len(shards))
            _link(source, target, entry.bytes, entry.sha256)
            listed = {c.path: c for c in entry.companions}  # none in parts of imgpack <= 0.4.0
            companions = []
            for companion, new in zip(
                self.companions_of(source), self.companions_of(target), strict=True
            ):
                known = listed.get(companion.name)
                if entry.companions and known is None:
                    raise DataError(f"{companion}: its part's manifest does not list it")
                if known is None:
                    _link(companion, new)
                else:
                    _link(companion, new, known.bytes, known.sha256)
                companions.append((new.name, known.sha256 if known else sha256_file(new)))
            written.append(WrittenFile(target.name, entry.num_samples, entry.sha256, companions))
        self._files = written
        return written


#: Writes of at least this many bytes are hashed in a thread while they are written.
PARALLEL_HASH = 1 << 20

#: The largest page a memory map takes a file's cached bytes in (a PMD: 2 MB with 4 KB pages).
FOLIO = 2 << 20

#: A shard's writes are held until this many bytes are due, then written up to a multiple of
#: :data:`FOLIO` from the file's start. A tar or TFRecord shard is made a member or record at a
#: time (a few KB), and the kernel caches a file in folios of the size and alignment it was
#: written in: written in aligned 2 MB runs, a shard is cached in folios that a reader's memory
#: map takes 2 MB at a time (as when it is read back from disk), not in 4 KB pages, and the
#: reads that follow a conversion gather rows with fewer TLB misses. Measured on a 268 MB raw
#: webdataset shard, 256 random rows a batch: 111 µs written through Python's 8 KB buffer,
#: 62 µs in aligned runs (the in-RAM gather of the same rows: 66 µs).
WRITE_BUFFER = 4 << 20


class HashedFile:
    """A new file, written from its start, whose sha256 is taken from the bytes as they are
    written: a finished shard is not read back to hash it (for the last shard, that read was
    the serial end of a conversion, with every worker idle). Everything written goes through
    :meth:`write` in order (no seeks), so the digest is the file's; it reaches the file in
    aligned runs (:data:`WRITE_BUFFER`), the rest at :meth:`flush` or :meth:`close`."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self._fh = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._digest = hashlib.sha256()
        self._pending = bytearray()
        self._offset = 0  # bytes written to the file

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < PARALLEL_HASH:
            self._digest.update(view)
            self._put(view)
            return view.nbytes
        # hashlib and the file both release the GIL on a large buffer: hash it in a thread
        # while the file takes it (a pt shard's data is one write, at the end of its shard).
        failed: list[BaseException] = []

        def update() -> None:
            try:
                self._digest.update(view)
            except BaseException as exc:  # re-raised below: a digest must never be wrong
                failed.append(exc)

        hashing = threading.Thread(target=update)
        hashing.start()
        try:
            self._put(view)
        finally:
            hashing.join()
        if failed:
            raise failed[0]
        return view.nbytes

    def _put(self, view: memoryview) -> None:
        """Hold ``view``'s bytes, or write what is held and as much of them as ends on a
        :data:`FOLIO` boundary of the file (at least :data:`FOLIO`) and hold the rest."""
        pending = self._pending
        if len(pending) + len(view) < WRITE_BUFFER:
            pending += view
            return
        end = self._offset + len(pending) + len(view)
        count = end - end % FOLIO - self._offset
        held = min(count, len(pending))
        with memoryview(pending) as mine:
            self._write_all([mine[:held], view[: count - held]])
        del pending[:held]
        pending += view[count - held :]
        self._offset += count

    def _write_all(self, parts: list[memoryview]) -> None:
        """Write ``parts`` in order with as few system calls as the kernel allows."""
        fd = self._fh.fileno()
        left = [part for part in parts if len(part)]
        while left:
            written = os.writev(fd, left)
            while left and written >= len(left[0]):
                written -= len(left.pop(0))
            if written:
                left[0] = left[0][written:]

    def flush(self) -> None:
        """Write what is held."""
        if self._pending:
            with memoryview(self._pending) as mine:
                self._write_all([mine])
            self._offset += len(self._pending)
            self._pending.clear()

    def close(self) -> str:
        """Write what is held and close the file; its sha256 (hex)."""
        try:
            self.flush()
        finally:
            self._fh.close()
        return self._digest.hexdigest()


def _link(source: Path, target: Path, size: int | None = None, sha256: str = "") -> None:
    """Put ``source`` at ``target``: a hard link of the very file checked (a copy of it across
    filesystems). ``source`` must be a regular file, not a link (``size`` bytes and hashing to
    ``sha256`` when given); anything else raises :class:`DataError` naming it."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise DataError(f"{source}: cannot be merged: {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{source}: cannot be merged: not a regular file")
        if size is not None and st.st_size != size:
            raise DataError(
                f"{source}: {st.st_size} bytes, its part's manifest says {size} (the part is "
                "damaged or was replaced)"
            )
        try:
            os.link(source, target, follow_symlinks=False)
            linked = os.lstat(target)
            if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
                raise DataError(f"{source}: replaced while it was being merged")
            digest = _read_fd(fd) if sha256 else ""
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            with open(target, "xb") as out:
                digest = _read_fd(fd, out)
        if sha256 and digest != sha256:
            raise DataError(
                f"{source}: its bytes are not what its part's manifest records (sha256 "
                "differs): the part is damaged or was replaced while merging"
            )
    finally:
        os.close(fd)


def _read_fd(fd: int, copy_to: BinaryIO | None = None) -> str:
    """The sha256 of the open file ``fd`` (read from its start), each block also written to
    ``copy_to`` when given."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def file_entries(directory: Path, files: list[WrittenFile]) -> list[FileEntry]:
    """The manifest entries of finished data files in ``directory``: size as it is, sha256 as
    the writer computed it when it finished the file (else read now)."""
    return [
        FileEntry(
            f.path,
            (directory / f.path).stat().st_size,
            f.num_samples,
            f.sha256 or sha256_file(directory / f.path),
            [Companion(name, (directory / name).stat().st_size, sha) for name, sha in f.companions],
        )
        for f in files
    ]
