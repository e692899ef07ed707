from __future__ import annotations

import pytest

from imgpack.errors import OptionError
from imgpack.units import format_bytes, parse_byte_size, parse_image_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", 512 * 10**6),
        ("1GiB", 2**30),
        ("1.5kb", 1500),
        ("4096", 4096),
        (100, 100),
        ("2 MiB", 2 * 2**20),
    ],
)
def test_byte_sizes(text: str | int, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5", "0", "1..2GB"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(OptionError, match="invalid size"):
        parse_byte_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("224", (224, 224)), ("256x320", (256, 320)), (32, (32, 32)), ((4, 5), (4, 5))],
)
def test_image_sizes(text: object, expected: tuple[int, int]) -> None:
    assert parse_image_size(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["0", "x3", "3x", "3x0", "big", (1, 2, 3)])
def test_bad_image_sizes(text: object) -> None:
    with pytest.raises(OptionError, match="invalid image size"):
        parse_image_size(text)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
