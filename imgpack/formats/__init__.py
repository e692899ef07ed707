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

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from imgpack.errors import ManifestError, OptionError

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset
    from imgpack.formats.writer_base import Writer

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class FormatOption:
    """One ``-o KEY=VALUE`` option of a format.

    ``parse`` turns a value (a string from the command line, or any Python value) into the
    setting, raising :class:`~imgpack.errors.OptionError` (or ``ValueError``/``TypeError``) for a
    bad one; ``choices``, when given, are checked after it.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any] = str
    choices: tuple[Any, ...] | None = None

    def convert(self, value: Any) -> Any:
        try:
            result = self.parse(value)
        except OptionError:
            raise
        except (TypeError, ValueError) as exc:
            raise OptionError(f"invalid {self.name} {value!r}: {exc}") from None
        if self.choices is not None and result not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise OptionError(f"invalid {self.name} {value!r}: expected one of {allowed}")
        return result


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
        known = {option.name for option in self.options}
        unknown = sorted(set(options) - known)
        if unknown:
            allowed = ", ".join(option.name for option in self.options) or "none"
            raise OptionError(
                f"format {self.name!r} has no option {', '.join(unknown)} (its options: {allowed})"
            )
        return {
            option.name: option.convert(options.get(option.name, option.default))
            for option in self.options
        }

    def writer_class(self) -> type[Writer]:
        cls: type[Writer] = _load_class(self, self.writer)
        return cls

    def reader_class(self) -> type[ImageDataset]:
        cls: type[ImageDataset] = _load_class(self, self.reader)
        return cls


def _load_class(spec: FormatSpec, target: str) -> Any:
    module, _, name = target.partition(":")
    for required in spec.requires:
        try:
            importlib.import_module(required)
        except ImportError:
            extra = (
                f"pip install 'imgpack[{spec.extra}]'" if spec.extra else f"pip install {required}"
            )
            raise OptionError(
                f"format {spec.name!r} needs the {required!r} package: {extra}"
            ) from None
    return getattr(importlib.import_module(module), name)


_registry: dict[str, FormatSpec] = {}
_loaded = False


def register(spec: FormatSpec, replace: bool = False) -> FormatSpec:
    """Add ``spec`` to the registry (``replace=True`` to override a format of the same name)."""
    if not isinstance(spec, FormatSpec):
        raise TypeError(f"register() takes a FormatSpec, not {type(spec).__name__}")
    _load()
    if spec.name in _registry and not replace and _registry[spec.name] is not spec:
        raise ValueError(f"format {spec.name!r} is registered already (pass replace=True)")
    _registry[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a format from the registry (for tests and plugins that replace a format)."""
    _load()
    _registry.pop(name, None)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in BUILTIN:
        _registry[name] = importlib.import_module(f"imgpack.formats.{name}").SPEC
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            spec = point.load()
            if callable(spec) and not isinstance(spec, FormatSpec):
                spec = spec()
            if not isinstance(spec, FormatSpec):
                raise TypeError(f"{point.value} is a {type(spec).__name__}, not a FormatSpec")
        except Exception as exc:  # a broken plugin must not break imgpack
            log.warning("format plugin %r (%s) not loaded: %s", point.name, point.value, exc)
            continue
        if spec.name in _registry:
            log.warning(
                "format plugin %r ignored: format %r exists already", point.value, spec.name
            )
            continue
        _registry[spec.name] = spec


def names() -> tuple[str, ...]:
    """The registered format names: imgpack's own first, then plugins."""
    _load()
    return tuple(_registry)


def specs() -> list[FormatSpec]:
    _load()
    return list(_registry.values())


def get(name: str) -> FormatSpec:
    """The spec of format ``name``; :class:`~imgpack.errors.OptionError` for an unknown one."""
    _load()
    try:
        return _registry[name]
    except KeyError:
        raise OptionError(
            f"unknown format {name!r}: expected one of {', '.join(_registry)}"
        ) from None


def reader_for(name: str, where: str) -> type[ImageDataset]:
    """The reader of an output whose manifest (at ``where``) names format ``name``."""
    _load()
    if name not in _registry:
        raise ManifestError(
            f"{where}: format {name!r} is not known to this imgpack (known: "
            f"{', '.join(_registry)}); if a plugin wrote it, install that plugin"
        )
    return _registry[name].reader_class()


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
