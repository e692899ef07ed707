"""Dataset statistics, recorded by the conversion: the per-channel mean and std of the stored
pixels (what ``Normalize(mean, std)`` needs), the distributions of height and width, and the
samples per class.

Exact and in one pass: each conversion worker sums every stored pixel and its square per channel
(integers, so nothing is rounded), the writing process adds up those sums in scan order, and the
manifest keeps the totals (``"stats"``). The mean and std are derived from them over all pixels
of all samples: not an average of per-image stds, the usual mistake. Parts, shard tasks and a
resumed run combine their sums the same way, so the figures do not depend on how the work was
split.

"Stored pixels" are what a reader returns without ``size=``: the decoded kept file, the PNG or
JPEG as written (a lossy JPEG's own pixels, not the ones before encoding), the raw array; a
grayscale file in an RGB output counts as its three equal channels, as the readers widen it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from imgpack.errors import DataError

if TYPE_CHECKING:
    pass

#: Per-channel sums of one image's pixels and of their squares
#: (:func:`imgpack.images.pixel_sums`; a worker measures what it stores with
#: :func:`imgpack.stored.measure`).
PixelSums = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class DatasetStats:
    """What a conversion records of its samples (``manifest.stats``, ``ds.stats``).

    ``sums``/``squares`` are ``None`` when the pixels were not measured (``--no-stats``); the
    sizes and class counts are always there."""

    channels: int
    classes: int
    samples: int = 0
    #: Pixels per channel counted in ``sums`` (height x width over every sample).
    pixels: int = 0
    sums: list[int] | None = None
    squares: list[int] | None = None
    heights: Counter[int] = field(default_factory=Counter)
    widths: Counter[int] = field(default_factory=Counter)
    per_class: list[int] = field(default_factory=list)
    #: Samples without a label (-1: an unlabelled output).
    unlabelled: int = 0

    @classmethod
    def empty(cls, channels: int, classes: int, pixels: bool = True) -> DatasetStats:
        zeros = [0] * channels if pixels else None
        return cls(channels, classes, sums=zeros, squares=list(zeros) if zeros else None,
                   per_class=[0] * classes)  # fmt: skip

    def add(self, label: int, height: int, width: int, sums: PixelSums | None) -> None:
        """Count one sample (its label, stored size and pixel sums)."""
        self.samples += 1
        self.heights[height] += 1
        self.widths[width] += 1
        if 0 <= label < self.classes:
            self.per_class[label] += 1
        else:
            self.unlabelled += 1
        if self.sums is None or self.squares is None:
            return
        if sums is None:  # a sample nobody measured: the pixel figures would be wrong
            self.sums = self.squares = None
            return
        self.pixels += height * width
        for c in range(self.channels):
            self.sums[c] += sums[0][c]
            self.squares[c] += sums[1][c]

    def merge(self, other: DatasetStats) -> None:
        """Add ``other``'s counts (another part, shard or run of the same output)."""
        if (other.channels, other.classes) != (self.channels, self.classes):
            raise ValueError("statistics of outputs with other channels or classes")
        self.samples += other.samples
        self.heights.update(other.heights)
        self.widths.update(other.widths)
        self.per_class = [a + b for a, b in zip(self.per_class, other.per_class, strict=True)]
        self.unlabelled += other.unlabelled
        if self.sums is None or self.squares is None or other.sums is None or other.squares is None:
            self.sums = self.squares = None
            return
        self.pixels += other.pixels
        self.sums = [a + b for a, b in zip(self.sums, other.sums, strict=True)]
        self.squares = [a + b for a, b in zip(self.squares, other.squares, strict=True)]

    @classmethod
    def total(cls, blocks: Iterable[dict[str, Any] | None]) -> DatasetStats | None:
        """The statistics of the pieces of one output (their JSON: shards' receipts, parts'
        manifests) added up, or ``None`` when there is none or one is not known (made by an
        imgpack that recorded none)."""
        found: DatasetStats | None = None
        for block in blocks:
            if block is None:
                return None
            piece = cls.from_json(block)
            if found is None:
                found = piece
            else:
                found.merge(piece)
        return found

    @property
    def measured(self) -> bool:
        """Whether the pixel mean and std are known."""
        return self.sums is not None and self.pixels > 0

    @property
    def mean(self) -> list[float] | None:
        """Per-channel mean of the stored pixels on the 0-1 scale (as ``Normalize`` takes it
        after ``ToTensor``/dividing by 255); ``None`` when not measured."""
        if not self.measured or self.sums is None:
            return None
        return [s / self.pixels / 255 for s in self.sums]

    @property
    def std(self) -> list[float] | None:
        """Per-channel standard deviation (population, over every pixel of every sample) on
        the 0-1 scale; ``None`` when not measured."""
        if not self.measured or self.sums is None or self.squares is None:
            return None
        n = self.pixels
        # n^2 * variance, exactly, in integers: no cancellation before the one division.
        return [
            (max(q * n - s * s, 0) ** 0.5) / n / 255
            for s, q in zip(self.sums, self.squares, strict=True)
        ]

    def normalize_line(self) -> str | None:
        """The line to paste into a torchvision transform, or ``None`` when not measured."""
        if self.mean is None or self.std is None:
            return None
        return f"Normalize(mean={_rounded(self.mean)}, std={_rounded(self.std)})"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "samples": self.samples,
            "channels": self.channels,
            "height": _distribution(self.heights),
            "width": _distribution(self.widths),
            "per_class": list(self.per_class),
        }
        if self.unlabelled:
            data["unlabelled"] = self.unlabelled
        if self.sums is not None and self.squares is not None:
            data.update(
                pixels=self.pixels,
                sum=list(self.sums),
                sum_of_squares=list(self.squares),
                mean=self.mean,
                std=self.std,
            )
        return data

    @classmethod
    def from_json(
        cls,
        data: Any,
        classes: int | None = None,
        channels: int | None = None,
        samples: int | None = None,
    ) -> DatasetStats:
        """Parse what :meth:`to_json` wrote; ``ValueError`` (or ``TypeError``, ``KeyError``)
        for anything else. ``mean`` and ``std`` are derived again from the sums.

        Checked to be statistics of some samples (its counts add up; its pixels fit its sizes;
        each sum fits 255 per pixel and its square sum; every number at most 2**62 pixels, so
        nothing overflows a float) and, where given, of the output they are for: ``classes``,
        ``channels`` and ``samples``. A checkpoint's, a receipt's or a part's statistics are
        read this way before they are added to an output's, and a manifest's before use."""
        if not isinstance(data, dict):
            raise TypeError("stats is not an object")
        width = _int(data["channels"], "stats.channels")
        if width not in (1, 3) or (channels is not None and width != channels):
            raise ValueError(
                f"stats.channels is {width}, the output has {channels or '1 or 3'} channel(s)"
            )
        per_class = [_int(v, "stats.per_class") for v in data["per_class"]]
        if classes is not None and len(per_class) != classes:
            raise ValueError(f"stats.per_class counts {len(per_class)} classes, not {classes}")
        found = cls(width, len(per_class), samples=_int(data["samples"], "stats.samples"))
        if samples is not None and found.samples != samples:
            raise ValueError(f"stats count {found.samples} samples, the output has {samples}")
        found.per_class = per_class
        found.unlabelled = _int(data.get("unlabelled", 0), "stats.unlabelled")
        found.heights = _counts(data["height"], "stats.height")
        found.widths = _counts(data["width"], "stats.width")
        if (
            sum(found.heights.values()) != found.samples
            or sum(found.widths.values()) != found.samples
            or sum(found.per_class) + found.unlabelled != found.samples
        ):
            raise ValueError(f"stats do not count its {found.samples} samples")
        if "sum" in data:
            found.pixels = _int(data["pixels"], "stats.pixels")
            found.sums = [_int(v, "stats.sum", LIMIT * 255) for v in data["sum"]]
            found.squares = [
                _int(v, "stats.sum_of_squares", LIMIT * 255 * 255) for v in data["sum_of_squares"]
            ]
            if len(found.sums) != width or len(found.squares) != width:
                raise ValueError(f"stats.sum and stats.sum_of_squares need {width} values")
            found._check_pixels()
        return found

    def _check_pixels(self) -> None:
        """The pixel count fits the sizes, and each channel's sums fit the pixel count (values
        0-255: a sum at most 255 per pixel, a sum of squares at most 255 times the sum and at
        least its square over the pixels)."""
        low = sum(h * n for h, n in self.heights.items()) * min(self.widths, default=0)
        high = sum(h * n for h, n in self.heights.items()) * max(self.widths, default=0)
        if len(self.heights) == 1 or len(self.widths) == 1:  # one side fixed: exact
            low = high = (
                sum(h * n for h, n in self.heights.items())
                * sum(w * n for w, n in self.widths.items())
                // max(1, self.samples)
            )
        if not low <= self.pixels <= min(high, LIMIT):
            raise ValueError(
                f"stats.pixels is {self.pixels}, which the sizes it counts cannot give "
                f"({low} to {high})"
            )
        assert self.sums is not None and self.squares is not None
        for s, q in zip(self.sums, self.squares, strict=True):
            if s > 255 * self.pixels or q > 255 * s or s * s > q * max(1, self.pixels):
                raise ValueError(
                    f"stats.sum {s} and stats.sum_of_squares {q} are not sums of "
                    f"{self.pixels} pixel values of 0-255"
                )

    def summary_lines(self) -> list[str]:
        """What ``imgpack info`` prints of them."""
        lines = []
        if self.mean is not None and self.std is not None:
            lines.append(f"mean:      {_rounded(self.mean)} (0-1 scale, per channel)")
            lines.append(f"std:       {_rounded(self.std)}")
            lines.append(f"normalize: {self.normalize_line()}")
        else:
            lines.append("mean/std:  not measured (converted with --no-stats)")
        lines.append(f"height:    {_describe(self.heights)}")
        lines.append(f"width:     {_describe(self.widths)}")
        if self.per_class:
            counts = sorted(self.per_class)
            lines.append(
                f"per class: {counts[0]} to {counts[-1]} samples (median {_median(counts)})"
            )
        if self.unlabelled:
            lines.append(f"unlabelled: {self.unlabelled} samples (label -1)")
        return lines


def against_labels(found: DatasetStats, targets: Sequence[int], where: str) -> DatasetStats:
    """``found`` (an output's recorded statistics) when its per-class counts are those of the
    labels the output holds (``targets``, in order; negative: unlabelled), else
    :class:`~imgpack.errors.DataError` naming ``where``: the manifest was edited or damaged."""
    counts = [0] * len(found.per_class)
    unlabelled = 0
    for label in targets:
        if label < 0:
            unlabelled += 1
        elif label < len(counts):
            counts[label] += 1
        else:
            counts.append(-1)  # a label past the classes: never what was recorded
    if counts != found.per_class or unlabelled != found.unlabelled:
        raise DataError(
            f"{where}: its stats count samples per class that the output's labels do not "
            f"({found.per_class[:8]} against {counts[:8]}): the manifest was edited or "
            "damaged ('imgpack verify' checks the files)"
        )
    return found


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, 4) for v in values]


def _distribution(counts: Counter[int]) -> dict[str, Any]:
    """A size distribution as the manifest keeps it: exact counts by value, with the range."""
    values = sorted(counts)
    return {
        "min": values[0] if values else None,
        "max": values[-1] if values else None,
        "counts": [[v, counts[v]] for v in values],
    }


def _counts(data: Any, name: str) -> Counter[int]:
    if not isinstance(data, dict) or not isinstance(data.get("counts"), list):
        raise TypeError(f"{name} is not a distribution")
    found: Counter[int] = Counter()
    for pair in data["counts"]:
        value, count = pair
        found[_int(value, name)] += _int(count, name)
    return found


#: The most any count of the statistics may be (as the manifest's integers): larger numbers
#: are refused by name, not an OverflowError where a mean is taken.
LIMIT = 1 << 62


def _int(value: Any, name: str, limit: int = LIMIT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} holds {value!r}, expected a count")
    if value > limit:
        raise ValueError(f"{name} holds a number of {len(str(value))} digits, past {limit}")
    return value


def _quantile(counts: Counter[int], q: float) -> int:
    """The ``q`` quantile (lower) of the values counted in ``counts``."""
    total = sum(counts.values())
    rank, seen = q * (total - 1), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > rank:
            return value
    return max(counts)


def _median(values: Iterable[int]) -> int:
    return _quantile(Counter(values), 0.5)


def _describe(counts: Counter[int]) -> str:
    if not counts:
        return "none"
    if len(counts) == 1:
        return f"{next(iter(counts))} (every sample)"
    low, high = min(counts), max(counts)
    median, p5, p95 = (_quantile(counts, q) for q in (0.5, 0.05, 0.95))
    return f"{low} to {high}, median {median}, 90% from {p5} to {p95}"


__all__ = ["DatasetStats", "PixelSums"]
