"""Per-channel sums of uint8 values and of their squares (``imgpack/_pixelsums.c``; built where
a C compiler was, else absent)."""

from typing_extensions import Buffer

def sums(
    buffer: Buffer, depth: int, portable: bool = False, /
) -> tuple[tuple[int, ...], tuple[int, ...]]: ...
