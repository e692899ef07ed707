"""A crop copied into its slot of a batch, each row reversed when flipped
(``imgpack/_batchcopy.c``; built where a C compiler was, else absent)."""

from typing_extensions import Buffer

def place(
    src: Buffer, dst: Buffer, width: int, flip: bool = False, portable: bool = False
) -> None: ...
