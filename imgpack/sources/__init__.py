"""What imgpack converts from, behind one registry of source specs (as :mod:`imgpack.formats`
is for what it writes).

Each source kind is a package ``imgpack.sources.<name>`` holding a
:class:`~imgpack.sources.base.Source` subclass (its scan and its fetcher) and a
:class:`SourceSpec` named ``SPEC`` in its ``__init__``. SRC's kind is the first, in
:data:`BUILTIN` order, whose ``detect`` says yes (plugins are asked before the image folder, the
fallback), unless the user names it (``--source KIND``, or ``--labels FILE`` and ``--no-labels``,
which name ``labels`` and ``unlabelled``). Its options (``-s KEY=VALUE``) are parsed by its spec.

Adding a source kind to imgpack: its package plus one line in :data:`BUILTIN`. Another package
adds one without touching imgpack, by declaring an entry point in the ``imgpack.sources`` group
that names a :class:`SourceSpec` (or calling :func:`register`)::

    [options.entry_points]
    imgpack.sources =
        toy = toy_source:SPEC
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imgpack.registry import Option, Registry, check_options, load_target

if TYPE_CHECKING:
    from imgpack.sources.base import Source

#: imgpack's own source kinds, in the order SRC is matched against them.
BUILTIN = (
    "output",
    "hf",
    "tfrecord",
    "webdataset",
    "labels",
    "folder",
    "unlabelled",
)
#: The kind a SRC that no other kind recognises is taken for (asked last, after plugins).
FALLBACK = "folder"
ENTRY_POINT_GROUP = "imgpack.sources"

#: A source kind's ``-s KEY=VALUE`` options are declared as a format's ``-o`` ones are.
SourceOption = Option


def optional_text(value: Any) -> str | None:
    """A source option's text value; ``None`` (the default) stays ``None``."""
    return None if value is None else str(value)


@dataclass(frozen=True)
class SourceSpec:
    """Everything imgpack needs to know about a source kind."""

    name: str
    #: ``"module:Class"`` of the :class:`~imgpack.sources.base.Source` subclass.
    source: str
    #: One line for ``--help`` and the docs.
    summary: str
    options: tuple[SourceOption, ...] = ()
    #: Whether SRC is matched against this kind; ``False``: only when asked for by name.
    detected: bool = True
    #: Modules the kind needs beyond imgpack's own dependencies, and the pip extra.
    requires: tuple[str, ...] = ()
    extra: str | None = None

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The kind's settings: the defaults updated with ``options``, parsed and checked."""
        return check_options(f"source {self.name!r}", self.options, options)

    def source_class(self, check_requires: bool = True) -> type[Source]:
        """The kind's class (``check_requires``: refuse, with the install hint, when a module
        it needs is missing; detection does not need them)."""
        requires = self.requires if check_requires else ()
        cls: type[Source] = load_target(f"source {self.name!r}", self.source, requires, self.extra)
        return cls

    def open(self, src: Path, options: Mapping[str, Any] | None = None) -> Source:
        """A source of this kind for ``src`` with ``options`` (checked)."""
        return self.source_class()(src, self.check_options(options or {}))


_registry: Registry[SourceSpec] = Registry(
    "source kind", SourceSpec, "imgpack.sources", BUILTIN, ENTRY_POINT_GROUP
)


def register(spec: SourceSpec, replace: bool = False) -> SourceSpec:
    """Add ``spec`` to the registry (``replace=True`` to override a kind of the same name)."""
    return _registry.register(spec, replace)


def unregister(name: str) -> None:
    """Remove a source kind from the registry (for tests and plugins that replace one)."""
    _registry.unregister(name)


def names() -> tuple[str, ...]:
    """The registered source kinds: imgpack's own first, then plugins."""
    return _registry.names()


def specs() -> list[SourceSpec]:
    return _registry.specs()


def get(name: str) -> SourceSpec:
    """The spec of kind ``name``; :class:`~imgpack.errors.OptionError` for an unknown one."""
    return _registry.get(name)


def detect(src: Path) -> SourceSpec:
    """The kind of ``src``: the first that recognises it, plugins before the fallback."""
    candidates = [s for s in specs() if s.detected and s.name != FALLBACK]
    for spec in candidates:
        if spec.source_class(check_requires=False).detect(src):
            return spec
    return get(FALLBACK)


def resolve(src: Path, kind: str | None = None, options: Mapping[str, Any] | None = None) -> Source:
    """The source for SRC: of kind ``kind``, else the detected one, with its ``options``."""
    spec = get(kind) if kind else detect(src)
    return spec.open(src, options)


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "FALLBACK",
    "SourceOption",
    "SourceSpec",
    "detect",
    "get",
    "names",
    "optional_text",
    "register",
    "resolve",
    "specs",
    "unregister",
]
