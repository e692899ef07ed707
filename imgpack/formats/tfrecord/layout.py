"""The raw records of an imgpack ``tfrecord`` output, checked without parsing them.

imgpack writes every raw record with its keys in order and every value but the pixels and the
file name fixed by the output, so :class:`RawLayout` checks a batch of framed records with a
few byte comparisons (:meth:`RawLayout.match`) and :func:`data_crcs_match` their data CRCs,
records of one length at once. A record that does not match goes through the generic parser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import google_crc32c
import numpy as np
import torch

from imgpack.checksum import crcs_intact
from imgpack.formats.gather import byte_rows, readonly_tensor
from imgpack.formats.tfrecord import example, framing
from imgpack.formats.tfrecord.example import example_features
from imgpack.images import Encoded, Kind
from imgpack.manifest import Manifest

if TYPE_CHECKING:
    pass


class RawLayout:
    """The exact bytes of a raw record of one imgpack output, but its pixels and file name.

    imgpack writes its records with their keys in order and every value but ``image/encoded``
    and ``image/filename`` fixed by the output (the label and class text by the class). So a
    record is one of the output's :attr:`heads` (Example header aside, everything up to the
    pixels: channels, label, class text, colorspace, the pixels' field header), then the
    pixels, a file name entry, then the output's :attr:`tail` (format, height, width, output
    id). :meth:`find` checks a record against that with a few byte comparisons instead of
    parsing it; a record that does not match (TensorFlow rewrote it, another tool wrote it)
    goes through the generic Example parser, so both read the same records the same way.
    """

    _FILENAME = b"\x0a\x0eimage/filename\x12"  # an entry's key field, then its value's tag

    def __init__(self, manifest: Manifest, label_offset: int) -> None:
        image = manifest.image
        self.shape = (int(image["height"]), int(image["width"]), int(image.get("channels", 3)))
        self.size = int(np.prod(self.shape))
        self.label_offset = label_offset
        self.heads: list[bytes] = []
        label_positions = set()
        tail = b""
        for label, name in enumerate(manifest.classes):
            sample = Encoded("", label, b"", *self.shape, Kind.RAW)
            features = example_features(sample, name, label_offset, manifest.output_id)
            keys = sorted(features)
            if keys.index("image/encoded") + 1 != keys.index("image/filename"):
                raise ValueError("unexpected key order")  # never: the writer's keys
            before = keys[: keys.index("image/encoded")]
            entries = {k: example.encode_entry(k, features[k]) for k in before}
            head = b"".join(entries.values())
            self.heads.append(head + example.bytes_entry_head("image/encoded", self.size))
            label_entry = entries["image/class/label"]  # ends with the label's varint
            value = example.encode_varint(label + label_offset)
            label_positions.add(head.index(label_entry) + len(label_entry) - len(value))
            after = keys[keys.index("image/filename") + 1 :]
            tail = b"".join(example.encode_entry(k, features[k]) for k in after)
        if len(label_positions) > 1:
            raise ValueError("labels at different positions")
        self.label_at = label_positions.pop() if label_positions else 0
        self._heads_array: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.tail = tail
        self._tail = np.frombuffer(tail, np.uint8)
        self._name = np.frombuffer(self._FILENAME, np.uint8)

    def match(
        self, data: np.ndarray | torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Check framed records (at ``offsets``, of ``sizes`` bytes, in the file ``data``) against
        this layout, all at once: ``(matches, labels, pixel starts)``. The frame's length field
        is checked here, its CRCs are not (the caller checks them). A record that does not
        match goes through the generic parser."""
        if isinstance(data, np.ndarray):
            data = readonly_tensor(data)
        ok = (sizes >= 18) & (offsets >= 0) & (offsets + sizes <= len(data))
        offsets = np.where(ok, offsets, 0)
        sizes = np.where(ok, sizes, 18)
        end = offsets + sizes - 4  # where the data CRC starts

        def span(start: np.ndarray, width: int) -> np.ndarray:
            """``data[s : s + width]`` for each ``s`` of ``start``, as rows (a start too close
            to the end of the file is moved back: such a record does not match anyway)."""
            return byte_rows(data, start, width)

        head_bytes, head_sizes, head_masks = self._head_table
        name = len(self._FILENAME)
        if len(data) < max(18, self.size, head_bytes.shape[1], self.label_at + 3, 4 + name):
            return np.zeros(len(offsets), bool), np.zeros(len(offsets), np.int64), offsets
        # The frame: length (8 bytes), its CRC, then Example.features (tag 0x0A, a varint).
        frame = span(offsets, 16)
        length = frame[:, :8].copy().view("<u8")[:, 0]
        ok &= (length == sizes - 16) & (frame[:, 12] == 0x0A)
        size, used, valid = _varint3(frame[:, 13:16])
        pos = offsets + 13 + used
        ok &= valid & (pos + size == end)
        # The entries before the pixels: the class's head (its label's varint inside).
        head = span(pos, max(head_bytes.shape[1], self.label_at + 3))
        value, _, valid = _varint3(head[:, self.label_at : self.label_at + 3])
        labels = value - self.label_offset
        ok &= valid & (labels >= 0) & (labels < len(self.heads))
        labels = np.where(ok, labels, 0)
        width = head_bytes.shape[1]
        ok &= ((head[:, :width] == head_bytes[labels]) | head_masks[labels]).all(axis=1)
        starts = pos + head_sizes[labels]
        stops = starts + self.size
        tails = end - len(self.tail)
        ok &= (stops < tails) & (span(tails, len(self.tail)) == self._tail).all(axis=1)
        # Between them, exactly one image/filename entry: tag, a varint, the key.
        entry = span(stops, 4 + name)
        size, used, valid = _varint3(entry[:, 1:4])
        ok &= (entry[:, 0] == 0x0A) & valid & (stops + 1 + used + size == tails)
        key = np.zeros(len(offsets), bool)
        for n in (1, 2, 3):
            key |= (used == n) & (entry[:, 1 + n : 1 + n + name] == self._name).all(axis=1)
        ok &= key
        return ok, labels, starts

    @property
    def _head_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The heads as one padded ``(classes, longest)`` uint8 array, their lengths, and which
        columns lie past each head's end."""
        if self._heads_array is None:
            longest = max((len(h) for h in self.heads), default=0)
            table = np.zeros((max(1, len(self.heads)), longest), np.uint8)
            for k, head in enumerate(self.heads):
                table[k, : len(head)] = np.frombuffer(head, np.uint8)
            lengths = np.array([len(h) for h in self.heads] or [0], np.int64)
            beyond = np.arange(longest)[None, :] >= lengths[:, None]
            self._heads_array = table, lengths, beyond
        return self._heads_array


def _varint3(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Varints of one to three bytes starting each row of ``b`` (``(n, 3)`` uint8): values,
    their lengths, and whether each ends within three bytes."""
    b = b.astype(np.int64)
    one, two = b[:, 0] < 0x80, (b[:, 0] >= 0x80) & (b[:, 1] < 0x80)
    three = (b[:, 0] >= 0x80) & (b[:, 1] >= 0x80) & (b[:, 2] < 0x80)
    low = b[:, 0] & 0x7F
    value = np.where(
        one,
        b[:, 0],
        np.where(two, low | b[:, 1] << 7, low | (b[:, 1] & 0x7F) << 7 | b[:, 2] << 14),
    )
    return value, np.where(one, 1, np.where(two, 2, 3)), one | two | three


_crc_value = google_crc32c.value  # CRC-32C of bytes (C)


def data_crcs_match(
    mapped: Any, data: np.ndarray | torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """Whether the data CRC of each framed record (at ``offsets`` of the file ``mapped``, whose
    bytes ``data`` views, of ``sizes`` bytes, each inside the file, its length field already
    found equal to what the index says) matches. The length's own CRC is left to the generic
    path and ``imgpack verify``: the length it guards was just checked."""
    ends = offsets + sizes - 4
    stored = byte_rows(data, ends, 4).copy().view("<u4")[:, 0]
    # Records of one length (a raw output's, but for labels of other varint widths) are
    # checked together: their data gathered into rows, one CRC for all (crcs_intact); the
    # stored CRCs unmasked.
    unmasked = framing.unmask(stored.astype(np.uint64))
    lengths = sizes - framing.HEADER_SIZE - framing.FOOTER_SIZE
    match = np.zeros(len(offsets), np.bool_)
    for length in np.unique(lengths).tolist() if len(lengths) > 1 else []:
        group = np.flatnonzero(lengths == length)
        if length > 0 and len(group) > 1:
            rows = byte_rows(data, offsets[group] + framing.HEADER_SIZE, length)
            match[group] = crcs_intact(rows, unmasked[group])
    rest = np.flatnonzero(~match)  # one by one: a group that failed, lone records
    data_spans = map(slice, (offsets[rest] + 12).tolist(), ends[rest].tolist())
    crcs = np.array(list(map(_crc_value, map(mapped.__getitem__, data_spans))), np.uint64)
    match[rest] = framing.mask(crcs) == stored[rest]
    return match
