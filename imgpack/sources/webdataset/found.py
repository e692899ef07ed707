"""What the scan of one tar found: its samples in order (:class:`Found`), packed in a
:class:`FoundTable` so that the driver holds the scans of millions of tar members while it
makes the label map (about 70 bytes a sample where a :class:`Found` object takes 500)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any, NamedTuple

from imgpack.scan import Distinct, Packed


class Found(NamedTuple):
    """One sample of a tar as its scan found it."""

    key: str
    #: Its image member's name (``None``: it has none).
    image: str | None
    #: Its label value (``.cls`` or ``.json``; ``None`` unlabelled or none).
    value: Any
    #: Why it cannot be converted, or ``None``.
    problem: str | None
    #: Its other members' extensions.
    others: list[str]
    #: Its image member's size (``-1``: none).
    size: int
    #: Where its members lie in the tar: the first one's header to the last one's padded end.
    start: int
    end: int


#: The end of a sample's image name in :class:`FoundTable` when it has no image member.
_NO_IMAGE = -1


class FoundTable(Packed[Found]):
    """One tar's :class:`Found` samples, packed: keys and image names in one buffer, sizes and
    where the members lie in arrays, each distinct label value and set of other members kept
    once (a sample holds their positions), problems by sample. Indexing gives :class:`Found`
    objects, made as they are asked for."""

    def __init__(self, found: Iterable[Found] = ()) -> None:
        self._text = bytearray()
        self._key_ends = array("q")
        self._image_ends = array("q")  # _NO_IMAGE: none
        self._sizes = array("q")
        self._starts = array("q")
        self._stops = array("q")
        self._values = Distinct()
        self._value_of = array("i")
        self._others: list[tuple[str, ...]] = []
        self._others_at: dict[tuple[str, ...], int] = {}
        self._others_of = array("i")
        self._problems: dict[int, str] = {}
        for f in found:
            self.append(f)

    def append(self, found: Found) -> None:
        index = len(self)
        self._text += found.key.encode("utf-8", "surrogateescape")
        self._key_ends.append(len(self._text))
        if found.image is None:
            self._image_ends.append(_NO_IMAGE)
        else:
            self._text += found.image.encode("utf-8", "surrogateescape")
            self._image_ends.append(len(self._text))
        self._sizes.append(found.size)
        self._starts.append(found.start)
        self._stops.append(found.end)
        self._value_of.append(self._values.index(found.value))
        others = tuple(found.others)
        at = self._others_at.get(others)
        if at is None:
            at = self._others_at[others] = len(self._others)
            self._others.append(others)
        self._others_of.append(at)
        if found.problem is not None:
            self._problems[index] = found.problem

    def __len__(self) -> int:
        return len(self._key_ends)

    def _item(self, i: int) -> Found:
        begin = self._previous_end(i)
        key_end = self._key_ends[i]
        key = self._text[begin:key_end].decode("utf-8", "surrogateescape")
        image_end = self._image_ends[i]
        image = None
        if image_end != _NO_IMAGE:
            image = self._text[key_end:image_end].decode("utf-8", "surrogateescape")
        return Found(
            key,
            image,
            self._values.values[self._value_of[i]],
            self._problems.get(i),
            list(self._others[self._others_of[i]]),
            self._sizes[i],
            self._starts[i],
            self._stops[i],
        )

    def _previous_end(self, i: int) -> int:
        """Where sample ``i``'s key starts in the buffer: the end of the sample before."""
        if i == 0:
            return 0
        image_end = self._image_ends[i - 1]
        return image_end if image_end != _NO_IMAGE else self._key_ends[i - 1]
