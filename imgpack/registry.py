"""What the format and source-kind registries share: a registry of named specs loaded lazily from
imgpack's own packages and the entry points of plugins, options of the ``-o``/``-s KEY=VALUE``
kind, and ``"module:Class"`` targets loaded with an install hint for what they need."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, Protocol, TypeVar

from imgpack.errors import OptionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Option:
    """One ``KEY=VALUE`` option of a format (``-o``) or a source kind (``-s``).

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


def check_options(what: str, options: Sequence[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``what`` (``format 'hdf5'``): the defaults of ``options`` updated with
    ``given``, parsed and checked; an unknown key is refused, naming the known ones."""
    known = {option.name for option in options}
    unknown = sorted(set(given) - known)
    if unknown:
        allowed = ", ".join(option.name for option in options) or "none"
        raise OptionError(f"{what} has no option {', '.join(unknown)} (its options: {allowed})")
    return {
        option.name: option.convert(given.get(option.name, option.default)) for option in options
    }


def load_target(
    what: str, target: str, requires: Sequence[str] = (), extra: str | None = None
) -> Any:
    """The object ``"module:name"`` names, once every module in ``requires`` imports; else an
    :class:`~imgpack.errors.OptionError` saying what to install for ``what``."""
    for required in requires:
        try:
            importlib.import_module(required)
        except ImportError:
            hint = f"pip install 'imgpack[{extra}]'" if extra else f"pip install {required}"
            raise OptionError(f"{what} needs the {required!r} package: {hint}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Named(Protocol):
    @property
    def name(self) -> str: ...


S = TypeVar("S", bound=Named)


class Registry(Generic[S]):
    """Specs by name: ``package.<name>.SPEC`` for each of ``builtin`` (in that order), then
    the plugins' entry points in ``group`` (a spec, or a function returning one), loaded on
    first use. A broken plugin is logged and left out, never breaks imgpack."""

    def __init__(
        self, what: str, spec_type: type[S], package: str, builtin: Sequence[str], group: str
    ) -> None:
        self.what, self.spec_type, self.package = what, spec_type, package
        self.builtin, self.group = tuple(builtin), group
        self._specs: dict[str, S] = {}
        self._loaded = False

    def _load(self) -> dict[str, S]:
        if self._loaded:
            return self._specs
        self._loaded = True
        for name in self.builtin:
            self._specs[name] = importlib.import_module(f"{self.package}.{name}").SPEC
        for point in entry_points(group=self.group):
            try:
                spec = point.load()
                if callable(spec) and not isinstance(spec, self.spec_type):
                    spec = spec()
                if not isinstance(spec, self.spec_type):
                    raise TypeError(
                        f"{point.value} is a {type(spec).__name__}, not a {self.spec_type.__name__}"
                    )
            except Exception as exc:  # a broken plugin must not break imgpack
                log.warning(
                    "%s plugin %r (%s) not loaded: %s", self.what, point.name, point.value, exc
                )
                continue
            if spec.name in self._specs:
                log.warning(
                    "%s plugin %r ignored: %s %r exists already",
                    self.what,
                    point.value,
                    self.what,
                    spec.name,
                )
                continue
            self._specs[spec.name] = spec
        return self._specs

    def register(self, spec: S, replace: bool = False) -> S:
        """Add ``spec`` (``replace=True`` to override one of the same name)."""
        if not isinstance(spec, self.spec_type):
            raise TypeError(
                f"register() takes a {self.spec_type.__name__}, not {type(spec).__name__}"
            )
        specs = self._load()
        if spec.name in specs and not replace and specs[spec.name] is not spec:
            raise ValueError(f"{self.what} {spec.name!r} is registered already (pass replace=True)")
        specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        self._load().pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names: imgpack's own first, then plugins."""
        return tuple(self._load())

    def specs(self) -> list[S]:
        return list(self._load().values())

    def has(self, name: str) -> bool:
        return name in self._load()

    def get(self, name: str) -> S:
        """The spec called ``name``; :class:`~imgpack.errors.OptionError` for an unknown one."""
        specs = self._load()
        try:
            return specs[name]
        except KeyError:
            raise OptionError(
                f"unknown {self.what} {name!r}: expected one of {', '.join(specs)}"
            ) from None
