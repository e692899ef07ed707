"""Per-sample fields beside the image and the label: captions, metadata, extra targets.

A field has a name and a type. The types, and the one value each holds per sample:

==========  =================================================  ==============================
type        value                                              stored bytes (the checksum's)
==========  =================================================  ==============================
``str``     text (``str``; UTF-8, no lone surrogates)          its UTF-8
``bytes``   bytes                                              themselves
``int``     an integer in int64's range (not a ``bool``)       8 bytes, little-endian
``float``   a number, kept as float32 (as TFRecord's           4 bytes, little-endian IEEE 754
            ``float_list`` and torch's default keep it)
``json``    any JSON value but a bare ``null`` (objects,       its compact JSON text (UTF-8)
            lists, numbers, text; ``null`` inside them)
``int[]``   a 1-D int64 array (any length, 0 included)         8 bytes each, little-endian
``float[]`` a 1-D float32 array                                4 bytes each, little-endian
==========  =================================================  ==============================

A type ending in ``?`` (``str?``) is optional: a sample may lack the field (its value is
``None``; a ``json`` field's bare ``null`` is its absence). A required field missing from a sample is an error that names the sample. The
output's manifest lists its fields in order (``"fields": [{"name": ..., "type": ...}]``, absent
when there are none: an output without fields is byte for byte what it was before fields).

A record's checksum covers its fields: after the payload and the label (:mod:`imgpack.checksum`),
each field in the manifest's order, as a presence byte (0 absent, 1 present) and, when present,
its stored bytes' length (8 bytes, little-endian) and the bytes (:func:`fields_crc`). A record
without fields keeps its checksum.

Names are what every format stores a field under (a TFRecord feature, a WebDataset member's
extension, an HDF5 dataset, a ``pt`` tensor): a letter, then letters, digits or ``_``, at most 64;
never one of imgpack's own keys (:data:`RESERVED`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from imgpack.errors import DataError, ManifestError, OptionError

#: The field types (:class:`Field`), each optional with a trailing ``?``.
TYPES = ("str", "bytes", "int", "float", "json", "int[]", "float[]")

#: Names imgpack's formats use for their own data: no field takes one.
RESERVED = frozenset(
    {
        "image", "images", "label", "labels", "cls", "path", "paths", "key", "data", "offsets",
        "crc", "crcs", "crc32c", "output_id", "jpg", "jpeg", "png", "npy", "idx", "imgpack",
    }
)  # fmt: skip

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_INT64 = struct.Struct("<q")
_LENGTH = struct.Struct("<Q")
_INT_LIMIT = 1 << 63


@dataclass(frozen=True)
class Field:
    """One field of an output: its ``name``, its ``type`` (one of :data:`TYPES`) and whether a
    sample may lack it (``optional``)."""

    name: str
    type: str
    optional: bool = False

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.type not in TYPES:
            raise OptionError(
                f"field {self.name!r}: unknown type {self.type!r} (the types: {', '.join(TYPES)}, "
                "each optional with a trailing '?')"
            )

    @classmethod
    def parse(cls, spec: str) -> Field:
        """A field from ``NAME:TYPE`` (``--field caption:str``, ``score:float?``)."""
        name, sep, kind = spec.partition(":")
        if not sep:
            raise OptionError(f"invalid field {spec!r}: expected NAME:TYPE (as caption:str)")
        optional = kind.endswith("?")
        return cls(name.strip(), kind.strip().removesuffix("?"), optional)

    @property
    def spec(self) -> str:
        """``NAME:TYPE`` (with ``?`` when optional), as :meth:`parse` reads it."""
        return f"{self.name}:{self.type}{'?' if self.optional else ''}"

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "type": self.type + ("?" if self.optional else "")}

    def value(self, value: Any, where: str) -> Any:
        """``value`` as this field holds it (see the module's table), or
        :class:`~imgpack.errors.DataError` naming ``where`` and what is wrong: a missing
        required value, a value of another type, an integer out of int64's range, a number
        that is not finite, text that is not UTF-8."""
        if value is None:
            if self.optional:
                return None
            raise DataError(
                f"{where}: no value for the field {self.name!r} ({self.type}, required)"
            )
        try:
            return _NORMAL[self.type](value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise DataError(f"{where}: field {self.name!r} ({self.type}): {exc}") from None

    def encode(self, value: Any) -> bytes:
        """The stored bytes of a value :meth:`value` returned (not ``None``)."""
        return _ENCODE[self.type](value)

    def decode(self, data: bytes | memoryview) -> Any:
        """The value of stored bytes :meth:`encode` made; :class:`DataError` for bytes no value
        of this type encodes to."""
        try:
            return _DECODE[self.type](bytes(data))
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise DataError(f"field {self.name!r} ({self.type}): stored bytes: {exc}") from None


def check_name(name: Any) -> str:
    """``name`` when a field may take it, else :class:`~imgpack.errors.OptionError` in one
    line that says why."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise OptionError(
            f"invalid field name {name!r}: a letter, then letters, digits or '_' (at most 64)"
        )
    if name.lower() in RESERVED:
        raise OptionError(
            f"the field name {name!r} is one of imgpack's own keys ({', '.join(sorted(RESERVED))})"
        )
    return name


def parse_fields(specs: Iterable[str]) -> list[Field]:
    """Fields from ``NAME:TYPE`` strings, each name once."""
    found = [Field.parse(spec) for spec in specs]
    return _unique(found)


def fields_from_json(data: Any, where: str = "imgpack.json") -> list[Field]:
    """An output's fields as its manifest lists them (``[]`` when it lists none)."""
    if data is None:
        return []
    try:
        if not isinstance(data, list):
            raise TypeError("fields is not a list")
        found = []
        for entry in data:
            kind = str(entry["type"])
            found.append(Field(str(entry["name"]), kind.removesuffix("?"), kind.endswith("?")))
        return _unique(found)
    except (KeyError, TypeError, OptionError) as exc:
        raise ManifestError(f"{where}: malformed fields ({exc})") from None


def fields_to_json(fields: Sequence[Field]) -> list[dict[str, str]]:
    return [f.to_json() for f in fields]


def sample_values(fields: Sequence[Field], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One sample's values of ``fields`` (each checked: :meth:`Field.value`), by name; a
    value for a name that is not a field is left out by the caller, not here."""
    return {f.name: f.value(values.get(f.name), where) for f in fields}


def fields_crc(crc: int, fields: Sequence[Field], values: Mapping[str, Any]) -> int:
    """The record checksum ``crc`` (of the payload and the label) extended over a sample's
    field ``values`` (as :meth:`Field.value` returned them), in ``fields``' order: a presence
    byte, then the stored bytes' length and the bytes (:func:`extend_crc`)."""
    return extend_crc(crc, stored_values(fields, values))


def stored_values(fields: Sequence[Field], values: Mapping[str, Any]) -> list[bytes | None]:
    """The stored bytes of a sample's field ``values``, in ``fields``' order (``None``: absent)."""
    out: list[bytes | None] = []
    for f in fields:
        value = values.get(f.name)
        out.append(None if value is None else f.encode(value))
    return out


def extend_crc(crc: int, stored: Iterable[bytes | memoryview | None]) -> int:
    """``crc`` extended over a record's stored field bytes in the manifest's order (``None``:
    absent): what a reader checks a record's fields with, without decoding them."""
    for data in stored:
        if data is None:
            crc = google_crc32c.extend(crc, b"\x00")
            continue
        crc = google_crc32c.extend(crc, b"\x01" + _LENGTH.pack(len(data)))
        crc = google_crc32c.extend(crc, bytes(data))
    return int(crc)


def infer_field(name: str, values: Sequence[Any], text: bool = False) -> Field:
    """The field a source's column ``name`` holds, from its ``values`` (one per sample, ``None``
    or ``""`` where a sample has none: the field is then optional). ``text``: the values are
    text as a CSV holds them, typed ``int`` when every one is an integer, else ``float`` when
    every one is a number, else ``str`` (a CSV column of JSON text is ``--field NAME:json``).
    Otherwise JSON values: integers ``int``, numbers ``float``, text ``str``, flat lists of
    integers ``int[]`` or of numbers ``float[]``, and anything else (objects, nested lists,
    ``true``, a column of mixed kinds) ``json``."""
    present = [v for v in values if v is not None and not (text and v == "")]
    optional = len(present) < len(values)
    kinds = {_kind(v, text) for v in present}
    if not kinds:
        found = "str"
    elif len(kinds) == 1:
        found = kinds.pop()
    elif kinds <= {"int", "float"}:
        found = "float"
    elif kinds <= {"int[]", "float[]"}:
        found = "float[]"
    else:
        found = "str" if text else "json"
    return Field(name, found, optional)


def from_text(kind: str, value: str) -> Any:
    """A CSV cell's text as the value of a field of type ``kind`` (``json`` and the arrays are
    JSON text in a cell); :class:`ValueError` when it is not JSON."""
    if kind in ("json", "int[]", "float[]"):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
    if kind == "bytes":
        return value.encode("utf-8")
    return value


def _kind(value: Any, text: bool) -> str:
    if text:
        stripped = str(value).strip()
        if re.fullmatch(r"[+-]?\d{1,18}", stripped):
            return "int"
        try:
            return "float" if math.isfinite(float(stripped)) else "str"
        except ValueError:
            return "str"
    if isinstance(value, bool):
        return "json"
    if isinstance(value, int):
        return "int" if -_INT_LIMIT <= value < _INT_LIMIT else "json"
    if isinstance(value, float):
        return "float" if math.isfinite(value) else "json"
    if isinstance(value, str):
        return "str"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return "int[]" if all(isinstance(v, int) for v in value) else "float[]"
    return "json"


def member_bytes(found: Field, value: Any) -> bytes:
    """A value (as :meth:`Field.value` returned it) as a file or archive member holds it, the
    way the ``webdataset`` package and a reader by eye take it: text (UTF-8) for ``str``, the
    bytes for ``bytes``, compact JSON for ``json``, decimal text for ``int`` and ``float`` (a
    float as Python's ``repr`` of its float32 value, which reads back to it), a JSON list for
    ``int[]`` and ``float[]``."""
    if found.type in ("int", "float"):
        return repr(value).encode("ascii")
    if found.type in ("int[]", "float[]"):
        return _json_text(np.asarray(value).tolist()).encode("ascii")
    return found.encode(value)


def member_value(found: Field, data: bytes) -> Any:
    """The value of a member's ``data`` (:func:`member_bytes`' form; text with surrounding
    whitespace for numbers, as a hand-written ``.cls``-like member holds them), checked as
    :meth:`Field.value` checks it: :class:`ValueError` or :class:`DataError` for data that
    holds no value of the field's type."""
    if found.type in ("int", "float", "int[]", "float[]"):
        text = data.decode("utf-8").strip()
        value: Any = json.loads(text) if found.type.endswith("[]") else text
        return found.value(value, "member")
    if found.type == "json":
        return found.value(json.loads(data.decode("utf-8")), "member")
    return found.decode(data)


def _unique(found: list[Field]) -> list[Field]:
    names = [f.name for f in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise OptionError(f"field(s) named more than once: {', '.join(twice)}")
    return found


# -- the types ---------------------------------------------------------------------------------
def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, not {type(value).__name__}")
    value.encode("utf-8")  # a lone surrogate (undecodable bytes) is refused here
    return value


def _bytes(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, not {type(value).__name__}")
    return bytes(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)  # 3.0 from a JSON or CSV number
        elif isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            value = int(value)
        else:
            raise TypeError(f"expected an integer, not {value!r}")
    value = int(value)
    if not -_INT_LIMIT <= value < _INT_LIMIT:
        raise OverflowError(f"{value} is out of int64's range")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"expected a number, not {value!r}")
    if isinstance(value, str):
        value = float(value.strip())  # ValueError names the text
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected a number, not {type(value).__name__}")
    with np.errstate(over="ignore"):  # too large for float32: inf, refused below
        found = float(np.float32(value))
    if not math.isfinite(found):
        raise ValueError(f"{value!r} is not a finite float32")
    return found


def _json(value: Any) -> Any:
    _json_text(value)  # refused here when JSON cannot hold it
    return value


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a JSON value ({exc})") from None


def _array(value: Any, kinds: str, what: str) -> np.ndarray:
    """``value`` (a list, a tuple or a 1-D array) as a 1-D array of ``kinds`` of numbers."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not hasattr(value, "__len__"):
        raise TypeError(f"expected a list of {what}, not {type(value).__name__}")
    array = np.asarray(value) if len(value) else np.zeros(0, np.int64)
    if array.ndim != 1:
        raise ValueError(f"expected a flat list of {what}, not one of shape {array.shape}")
    if array.dtype.kind not in kinds:
        raise TypeError(f"expected a list of {what}, not of {array.dtype} values")
    return array


def _ints(value: Any) -> np.ndarray:
    array = _array(value, "iuf", "integers")
    if array.dtype.kind == "f" and not (np.isfinite(array) & (array == np.round(array))).all():
        raise TypeError("expected a list of integers, not of fractions")
    if array.dtype.kind == "u" and (array >= _INT_LIMIT).any():
        raise OverflowError("a value is out of int64's range")
    if array.dtype.kind == "f" and (np.abs(array) >= 2.0**63).any():
        raise OverflowError("a value is out of int64's range")
    return array.astype("<i8")


def _floats(value: Any) -> np.ndarray:
    with np.errstate(over="ignore"):  # too large for float32: inf, refused below
        array = _array(value, "iuf", "numbers").astype("<f4")
    if not np.isfinite(array).all():
        raise ValueError("a value is not a finite float32")
    return array


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _decode_int(data: bytes) -> int:
    if len(data) != 8:
        raise ValueError(f"{len(data)} bytes, not 8")
    return int(_INT64.unpack(data)[0])


def _decode_float(data: bytes) -> float:
    if len(data) != 4:
        raise ValueError(f"{len(data)} bytes, not 4")
    return float(np.frombuffer(data, "<f4")[0])


def _decode_ints(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes: not whole int64 values")
    return np.frombuffer(data, "<i8").copy()


def _decode_floats(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes: not whole float32 values")
    return np.frombuffer(data, "<f4").copy()


_NORMAL: dict[str, Any] = {
    "str": _text,
    "bytes": _bytes,
    "int": _int,
    "float": _float,
    "json": _json,
    "int[]": _ints,
    "float[]": _floats,
}
_ENCODE: dict[str, Any] = {
    "str": lambda v: v.encode("utf-8"),
    "bytes": bytes,
    "int": _INT64.pack,
    "float": lambda v: np.float32(v).astype("<f4").tobytes(),
    "json": lambda v: _json_text(v).encode("utf-8"),
    "int[]": lambda v: np.ascontiguousarray(v, "<i8").tobytes(),
    "float[]": lambda v: np.ascontiguousarray(v, "<f4").tobytes(),
}
_DECODE: dict[str, Any] = {
    "str": _decode_text,
    "bytes": bytes,
    "int": _decode_int,
    "float": _decode_float,
    "json": lambda data: json.loads(data.decode("utf-8")),
    "int[]": _decode_ints,
    "float[]": _decode_floats,
}
