"""A JPEG's region decoded alone (``imgpack/_jpegregion.c``; built where libjpeg-turbo's
headers were, else absent)."""

from typing_extensions import Buffer

def decode(
    data: Buffer, colorspace: str, denom: int, top: int, bottom: int, left: int, right: int
) -> tuple[bytearray, int, int, int, int, int, int]: ...
