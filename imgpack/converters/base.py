"""The small base class every format writer implements.

The conversion engine (:mod:`imgpack.pipeline`) hands a writer the encoded samples one by one,
in scan order, from a single thread. A writer owns the files it creates inside the (temporary)
output directory; the engine adds the manifest and moves the directory into place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

from imgpack.errors import OptionError
from imgpack.images import Encoded, Encoding, ImagePolicy


@dataclass(frozen=True)
class WriterConfig:
    """What every writer is told about the output it writes."""

    classes: list[str]
    encoding: Encoding
    policy: ImagePolicy
    shard_size: int
    #: Samples the scan found: an upper bound (skipped files make the final count smaller).
    max_samples: int


@dataclass(frozen=True)
class WrittenFile:
    """A finished data file, relative to the output directory."""

    path: str
    num_samples: int


class Writer(ABC):
    """Writes one output directory. Use as a context manager; :meth:`close` may be called twice.

    Subclasses set :attr:`format`, may declare format options in :attr:`options` (name ->
    default), and implement :meth:`add` and :meth:`_finish`.
    """

    format: ClassVar[str]
    #: Format-specific options and their defaults; unknown options are refused.
    options: ClassVar[dict[str, Any]] = {}
    #: Whether the output rolls over to new files at ``--shard-size``.
    sharded: ClassVar[bool] = False
    #: Default ``--shard-size`` in bytes, for sharded formats.
    default_shard_size: ClassVar[int] = 1 << 30

    def __init__(self, directory: Path, config: WriterConfig, **options: Any) -> None:
        self.directory = directory
        self.config = config
        self.settings = self.check_options(options)
        self._files: list[WrittenFile] | None = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The format's settings: its defaults updated with ``options``, checked and normalised.
        The engine calls it before scanning, so a bad option fails at once."""
        unknown = sorted(set(options) - set(cls.options))
        if unknown:
            allowed = ", ".join(cls.options) or "none"
            raise OptionError(
                f"format {cls.format!r} has no option {', '.join(unknown)} (its options: {allowed})"
            )
        return cls._normalise({**cls.options, **options})

    @classmethod
    def _normalise(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """Check and convert the format's own settings (override in a format with options)."""
        return settings

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


class ShardedWriter(Writer):
    """A writer whose output rolls over to a new shard file once ``shard_size`` bytes are reached.

    Subclasses implement :meth:`_start_shard`, :meth:`_append` and :meth:`_end_shard`; a shard
    always holds at least one sample, so a single sample larger than the shard size gets a shard
    of its own.
    """

    sharded = True

    def __init__(self, directory: Path, config: WriterConfig, **options: Any) -> None:
        super().__init__(directory, config, **options)
        self._shards: list[WrittenFile] = []
        self._shard_bytes = 0
        self._shard_count = 0
        self._open = False

    def shard_name(self, index: int) -> str:
        return f"shard-{index:05d}.{self.format}"

    @abstractmethod
    def _start_shard(self, path: Path) -> None: ...

    @abstractmethod
    def _append(self, sample: Encoded) -> int:
        """Add the sample to the open shard; return the bytes it added."""

    @abstractmethod
    def _end_shard(self) -> None: ...

    def add(self, sample: Encoded) -> None:
        size = len(sample.payload)
        if self._open and self._shard_bytes + size > self.config.shard_size:
            self._roll()
        if not self._open:
            self._start_shard(self.directory / self.shard_name(len(self._shards)))
            self._open = True
            self._shard_bytes = 0
            self._shard_count = 0
        self._shard_bytes += self._append(sample)
        self._shard_count += 1

    def _roll(self) -> None:
        self._end_shard()
        self._shards.append(WrittenFile(self.shard_name(len(self._shards)), self._shard_count))
        self._open = False

    def _finish(self) -> list[WrittenFile]:
        if self._open:
            self._roll()
        return self._shards


def check_option(name: str, value: Any, allowed: tuple[Any, ...]) -> Any:
    """Validate a format option against its allowed values."""
    if value not in allowed:
        raise OptionError(
            f"invalid {name} {value!r}: expected one of {', '.join(map(str, allowed))}"
        )
    return value
