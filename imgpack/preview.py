"""A look at the data: a contact sheet of an output's samples, a row per class, read back through
the reader (so it shows what training sees, with any ``size=``): ``imgpack preview OUT``.

Each row holds the first ``per_class`` samples of its class in the output's order, every image
pasted at its own size (nothing is scaled for the sheet: a tile's pixels are the reader's) at
the top-left of a cell as large as the largest chosen image, the class name on the left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from imgpack.errors import OptionError
from imgpack.formats.dataset_base import ImageDataset

#: Pixels between cells, and the grey behind them.
GAP = 4
BACKGROUND = (48, 48, 48)
#: Rows a sheet shows when no classes are named (a thousand rows would not be a look).
MAX_ROWS = 32
#: The most pixels a sheet may take (about 300 MB of RGB, and as much again for the tiles
#: while they are read): more is refused by its size before it is drawn.
MAX_PIXELS = 100_000_000


@dataclass
class Sheet:
    """The contact sheet, and where each sample's tile is on it."""

    image: Image.Image
    #: ``(sample index, class name, x, y)`` of every tile's top-left corner.
    tiles: list[tuple[int, str, int, int]] = field(default_factory=list)
    #: Classes left out for :data:`MAX_ROWS` (named with ``classes=`` they are shown).
    left_out: int = 0


def _rows(
    ds: ImageDataset, per_class: int, classes: Sequence[str] | None
) -> list[tuple[str, list[int]]]:
    """``(class name, sample indices)`` of each row."""
    targets = np.asarray(ds.targets, dtype=np.int64)
    if not ds.classes:
        return [("(no label)", list(range(min(per_class, len(ds)))))]
    if classes is None:
        chosen = list(ds.classes)
    else:
        unknown = [name for name in classes if name not in ds.class_to_idx]
        if unknown:
            shown = ", ".join(ds.classes[:8]) + (", ..." if len(ds.classes) > 8 else "")
            raise OptionError(f"{ds.root}: no class {unknown[0]!r} (its classes: {shown})")
        chosen = list(classes)
    rows = []
    for name in chosen:
        found = np.flatnonzero(targets == ds.class_to_idx[name])[:per_class]
        rows.append((name, [int(i) for i in found]))
    return rows


def contact_sheet(
    ds: ImageDataset, per_class: int = 8, classes: Sequence[str] | None = None
) -> Sheet:
    """The contact sheet of ``ds`` (an imgpack reader): a row per class (``classes``, in that
    order, or the output's, at most :data:`MAX_ROWS`), ``per_class`` samples each."""
    if per_class < 1:
        raise OptionError(f"invalid per_class {per_class!r}: expected 1 or more")
    rows = _rows(ds, per_class, classes)
    left_out = 0
    if classes is None and len(rows) > MAX_ROWS:
        left_out, rows = len(rows) - MAX_ROWS, rows[:MAX_ROWS]
    images: dict[int, np.ndarray] = {}
    held = 0
    for index in (i for _, row in rows for i in row):
        images[index] = ds[index][0].numpy()  # (C, H, W) uint8, as training sees them
        held += images[index].shape[1] * images[index].shape[2]
        if held > MAX_PIXELS:  # the tiles alone are more than a sheet may be
            raise OptionError(_too_large(ds, f"its tiles pass {MAX_PIXELS:,} pixels"))
    cell_h = max((a.shape[1] for a in images.values()), default=1)
    cell_w = max((a.shape[2] for a in images.values()), default=1)
    margin = GAP + 7 * min(24, max(len(name) for name, _ in rows)) + GAP
    longest = max((len(row) for _, row in rows), default=1)
    width = margin + max(1, longest) * (cell_w + GAP)
    height = GAP + len(rows) * (cell_h + GAP)
    if width * height > MAX_PIXELS:
        raise OptionError(
            _too_large(ds, f"{width}x{height} pixels, over the {MAX_PIXELS:,} a sheet may take")
        )
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    tiles = []
    for r, (name, row) in enumerate(rows):
        y = GAP + r * (cell_h + GAP)
        draw.text((GAP, y + cell_h // 2 - 5), name[:24], fill=(230, 230, 230))
        for c, index in enumerate(row):
            x = margin + c * (cell_w + GAP)
            pixels = images[index].transpose(1, 2, 0)
            tile = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
            sheet.paste(tile.convert("RGB"), (x, y))
            tiles.append((index, name, x, y))
    return Sheet(sheet, tiles, left_out)


def _too_large(ds: ImageDataset, why: str) -> str:
    return (
        f"{ds.root}: the contact sheet would be too large ({why}): show fewer samples "
        "(--per-class), fewer classes (--classes) or smaller images (--size N)"
    )


__all__ = ["MAX_PIXELS", "Sheet", "contact_sheet"]
