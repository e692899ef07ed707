"""What validating a plain JPEG needs from its header, without Pillow's parser.

Validating a JPEG whose bytes are kept is a 1/8-scale libjpeg-turbo decode (0.5-0.7 ms for a
500x400 photo); Pillow's ``Image.open`` of the same file adds 0.2-0.3 ms of Python marker
parsing (every quantization table into a list, every APP segment into its ``info``). The
conversion needs four things from the header: the size, the number of components, that the
file is one frame, and that nothing rotates it. :func:`plain_jpeg` reads them from the markers
before the first scan, and answers only for the usual file: baseline, extended or progressive
Huffman, 8 bits, 1 or 3 components, well-formed segments, no APP1 (Exif or XMP: orientation),
no APP2 ``MPF`` (more frames) and no APP14 ``Adobe`` (colour transform). Anything else gets
``None``, and Pillow opens the file as before, so every decision and every error message is
Pillow's whenever this declines.
"""

from __future__ import annotations

from typing import NamedTuple

#: Start-of-frame markers of the Huffman-coded DCT processes libjpeg-turbo decodes and Pillow
#: opens as one frame: baseline, extended sequential, progressive.
_SOF = frozenset((0xC0, 0xC1, 0xC2))
#: Every other start of frame (lossless, hierarchical, arithmetic coding): Pillow decides.
_OTHER_SOF = frozenset((0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE))
_SOS, _DQT, _APP1, _APP2, _APP14 = 0xDA, 0xDB, 0xE1, 0xE2, 0xEE


class JpegHeader(NamedTuple):
    height: int
    width: int
    #: 1 (gray, Pillow's mode ``L``) or 3 (YCbCr or RGB, Pillow's ``RGB``).
    channels: int


def plain_jpeg(data: bytes | memoryview) -> JpegHeader | None:
    """The size and components of a usual single-frame, unrotated JPEG (see the module), or
    ``None`` for Pillow to look at. Reads the marker segments up to the first scan only:
    whether the entropy-coded data decodes is the decoder's to say."""
    end = len(data)
    if end < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos = 2
    header: JpegHeader | None = None
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None  # junk between segments: Pillow skips it, or not
        marker = data[pos + 1]
        if marker == _SOS:
            return header
        if not 0xC0 <= marker <= 0xFE or 0xD0 <= marker <= 0xD9:
            return None  # fill bytes, standalone markers, a second SOI: unusual here
        length = (data[pos + 2] << 8) | data[pos + 3]
        start, stop = pos + 4, pos + 2 + length
        if length < 2 or stop > end:
            return None
        if marker in _SOF:
            if header is not None or length < 8:
                return None
            bits, layers = data[start], data[start + 5]
            height = (data[start + 1] << 8) | data[start + 2]
            width = (data[start + 3] << 8) | data[start + 4]
            if bits != 8 or layers not in (1, 3) or length != 8 + 3 * layers:
                return None
            if not height or not width:
                return None
            header = JpegHeader(height, width, layers)
        elif _for_pillow(data, marker, start, stop):
            return None
        pos = stop
    return None


def _for_pillow(data: bytes | memoryview, marker: int, start: int, stop: int) -> bool:
    """Whether the segment of ``marker`` at ``start:stop`` is one Pillow must look at: another
    kind of frame, what may rotate the image (APP1: Exif, XMP), more frames (APP2 ``MPF``), a
    colour transform (APP14), quantization tables that do not fit their segment."""
    if marker in _OTHER_SOF or marker in (_APP1, _APP14):
        return True
    if marker == _APP2:
        return bytes(data[start : start + 4]) == b"MPF\x00"
    return marker == _DQT and not _tables_fit(data, start, stop)


def _tables_fit(data: bytes | memoryview, start: int, stop: int) -> bool:
    """Whether a DQT segment holds whole tables (Pillow refuses one that does not)."""
    while start < stop:
        size = 65 if data[start] >> 4 == 0 else 129
        start += size
    return start == stop
