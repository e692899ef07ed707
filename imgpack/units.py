"""Parsing and printing of the sizes and counts the CLI and the API accept."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from imgpack.errors import OptionError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_HW_RE = re.compile(r"^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$")


def parse_byte_size(value: int | str, name: str = "size") -> int:
    """Parse ``512MB``, ``1GiB``, ``1.5GB`` or a plain number of bytes into a positive int;
    ``name`` names the option in the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = _BYTES_RE.match(str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _BYTE_UNITS:
            raise OptionError(
                f"invalid {name} {value!r}: expected a number of bytes or a number with one of "
                "the units KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 512MB, 1GiB)"
            )
        number = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if number <= 0:
        raise OptionError(f"invalid {name} {value!r}: must be greater than zero")
    return number


def whole_number(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as an ``int`` of at least ``minimum`` (a Python or numpy integer; not a bool,
    a float or a string), else :class:`OptionError` naming ``name`` and what is allowed."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise OptionError(f"invalid {name} {value!r}: expected a whole number >= {minimum}")
    number = int(value.__index__())
    if number < minimum:
        raise OptionError(f"invalid {name} {value!r}: expected a whole number >= {minimum}")
    return number


def finite_numbers(values: Sequence[Any], name: str) -> list[float]:
    """``values`` as finite, non-negative floats, else :class:`OptionError` naming ``name``."""
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        numbers = [math.nan]
    if isinstance(values, str | bytes) or not all(math.isfinite(v) and v >= 0 for v in numbers):
        raise OptionError(f"invalid {name} {values!r}: expected a list of finite numbers >= 0")
    return numbers


def parse_image_size(value: int | str | tuple[int, int] | list[int]) -> tuple[int, int]:
    """Parse an image size: ``N`` (N x N), ``HxW``, or an ``(H, W)`` pair. Returns ``(H, W)``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise OptionError(f"invalid image size {value!r}: expected (height, width)")
        height, width = (int(v) for v in value)
    elif isinstance(value, int) and not isinstance(value, bool):
        height = width = value
    else:
        match = _HW_RE.match(str(value))
        if not match:
            raise OptionError(
                f"invalid image size {value!r}: expected N (a square N x N) or HxW, e.g. 224 or 256x320"
            )
        height = int(match.group(1))
        width = int(match.group(2)) if match.group(2) else height
    if height <= 0 or width <= 0:
        raise OptionError(f"invalid image size {value!r}: height and width must be positive")
    return height, width


def format_bytes(count: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
