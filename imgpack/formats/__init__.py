"""The formats imgpack writes and reads, behind one registry of format specs.

Each format is a package ``imgpack.formats.<name>`` holding its codec (byte layout), its writer
and its reader, and a :class:`FormatSpec` named ``SPEC`` in its ``__init__``. The CLI's
``--format`` choices and ``-o`` help, the conversion engine, :func:`imgpack.open_dataset`, the
docs' option tables (checked by a test) and the test suite all take the list from here.

Adding a format to imgpack: its package plus one line in :data:`BUILTIN`. Another package adds
one without touching imgpack, either by calling :func:`register` or by declaring an entry point
in the ``imgpack.formats`` group that names a :class:`FormatSpec` (or a function returning one)::

    [options.entry_points]
    imgpack.formats =
        toy = toy_format:SPEC

Specs name their writer and reader as ``"module:Class"`` strings, so the registry imports no
format library (h5py, lmdb) until a format is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from imgpack.errors import ManifestError
from imgpack.registry import Option, Registry, check_options, load_target

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset
    from imgpack.formats.writer_base import Writer

#: imgpack's own formats, in the order the CLI lists them: one line per format.
BUILTIN = (
    "pt",
    "lmdb",
    "hdf5",
    "tfrecord",
    "webdataset",
)
#: The entry-point group other packages declare their formats in.
ENTRY_POINT_GROUP = "imgpack.formats"


#: One ``-o KEY=VALUE`` option of a format (see :class:`imgpack.registry.Option`).
FormatOption = Option


@dataclass(frozen=True)
class FormatSpec:
    """Everything imgpack needs to know about a format."""

    name: str
    #: ``"module:Class"`` of the :class:`~imgpack.formats.writer_base.Writer` subclass.
    writer: str
    #: ``"module:Class"`` of the :class:`~imgpack.formats.dataset_base.ImageDataset` subclass.
    reader: str
    #: One line for ``--help``.
    summary: str
    options: tuple[FormatOption, ...] = ()
    #: Whether the output rolls over to new files at ``--shard-size``.
    sharded: bool = False
    #: Default ``--shard-size`` in bytes (sharded formats).
    default_shard_size: int | None = None
    #: Modules the format needs beyond imgpack's own dependencies, and the pip extra that
    #: installs them (the install hint when one is missing).
    requires: tuple[str, ...] = ()
    extra: str | None = None
    #: Files the format's libraries create beside the data while it is read or written, which
    #: are no part of the output (LMDB's ``lock.mdb``): not uploaded, not checked.
    runtime_files: tuple[str, ...] = ()
    #: Whether the format stores per-sample fields (:mod:`imgpack.fields`).
    stores_fields: bool = False

    def __post_init__(self) -> None:
        if self.sharded and not self.default_shard_size:
            raise ValueError(f"format {self.name!r} is sharded but has no default_shard_size")

    def option(self, name: str) -> FormatOption:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(name)

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The format's settings: the defaults updated with ``options``, parsed and checked."""
        return check_options(f"format {self.name!r}", self.options, options)

    def writer_class(self) -> type[Writer]:
        cls: type[Writer] = load_target(
            f"format {self.name!r}", self.writer, self.requires, self.extra
        )
        return cls

    @property
    def appendable(self) -> bool:
        """Whether ``convert --append`` adds to an output of this format: a sharded one takes
        new shards; a one-file format, when its writer starts from a copy of the output
        (:meth:`~imgpack.formats.writer_base.Writer.seed`)."""
        from imgpack.formats.writer_base import ShardedWriter, Writer

        writer = self.writer_class()
        if self.sharded and issubclass(writer, ShardedWriter):
            return True
        return any("seed" in vars(k) for k in writer.__mro__ if k is not Writer)

    def reader_class(self) -> type[ImageDataset]:
        cls: type[ImageDataset] = load_target(
            f"format {self.name!r}", self.reader, self.requires, self.extra
        )
        return cls


_registry: Registry[FormatSpec] = Registry(
    "format", FormatSpec, "imgpack.formats", BUILTIN, ENTRY_POINT_GROUP
)


def register(spec: FormatSpec, replace: bool = False) -> FormatSpec:
    """Add ``spec`` to the registry (``replace=True`` to override a format of the same name)."""
    return _registry.register(spec, replace)


def unregister(name: str) -> None:
    """Remove a format from the registry (for tests and plugins that replace a format)."""
    _registry.unregister(name)


def names() -> tuple[str, ...]:
    """The registered format names: imgpack's own first, then plugins."""
    return _registry.names()


def specs() -> list[FormatSpec]:
    return _registry.specs()


def runtime_files() -> frozenset[str]:
    """The names of the files any format's reader makes beside an output's files (LMDB's
    ``lock.mdb``): never part of an output, so never uploaded."""
    return frozenset(name for spec in specs() for name in spec.runtime_files)


def get(name: str) -> FormatSpec:
    """The spec of format ``name``; :class:`~imgpack.errors.OptionError` for an unknown one."""
    return _registry.get(name)


def reader_for(name: str, where: str) -> type[ImageDataset]:
    """The reader of an output whose manifest (at ``where``) names format ``name``."""
    if not _registry.has(name):
        raise ManifestError(
            f"{where}: format {name!r} is not known to this imgpack (known: "
            f"{', '.join(names())}); if a plugin wrote it, install that plugin"
        )
    return _registry.get(name).reader_class()


def __getattr__(name: str) -> Any:
    if name == "FORMATS":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "FORMATS",
    "FormatOption",
    "FormatSpec",
    "get",
    "names",
    "reader_for",
    "register",
    "specs",
    "unregister",
]
