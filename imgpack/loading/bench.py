"""Loader throughput, measured the way training reads: through a real ``DataLoader``.

:class:`FolderDataset` is the baseline users would otherwise run: torchvision's ImageFolder
pattern (one Pillow decode per file in ``__getitem__``, RGB, as a uint8 CHW tensor), written here
so the comparison needs no torchvision.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm import tqdm

from imgpack.errors import ImageError, OptionError
from imgpack.formats.batch import collate
from imgpack.formats.dataset_base import ReadOptions
from imgpack.loading.advice import measuring
from imgpack.manifest import MANIFEST_NAME
from imgpack.readers import open_dataset
from imgpack.sources.folder.scan import scan_folder
from imgpack.storage.location import is_url


class FolderDataset(Dataset[tuple[torch.Tensor, int]]):
    """ImageFolder-style baseline: decode one file per ``__getitem__`` with Pillow."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        scan = scan_folder(root)
        self.root = Path(root)
        self.classes = scan.classes
        self.samples = [(str(self.root / s.path), s.label) for s in scan.samples]
        self.targets = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                pixels = np.array(img.convert("RGB"))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise ImageError(path, f"cannot be decoded: {exc}") from None
        return torch.from_numpy(pixels).permute(2, 0, 1), label


@dataclass
class BenchResult:
    name: str
    path: str
    workers: int
    batch_size: int
    samples: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": round(self.rate, 1)}


def open_for_bench(
    path: str | os.PathLike[str], read: ReadOptions | None = None
) -> tuple[str, Dataset[Any]]:
    """An imgpack output opens with its reader (with ``read``'s options); any other folder as
    the ImageFolder baseline."""
    if is_url(path) or (Path(path) / MANIFEST_NAME).is_file():
        ds = open_dataset(path, options=read)
        return f"{ds.manifest.format}/{ds.manifest.encoding}", ds
    return "folder (Pillow)", FolderDataset(path)


#: ``bench``'s default measurement: this many epochs of the dataset, at most
#: :data:`MOST_SAMPLES` samples, and at most :data:`MOST_SECONDS` seconds of reading.
EPOCHS = 3
MOST_SAMPLES = 20_000
MOST_SECONDS = 10.0


def default_samples(size: int) -> int:
    """Samples a measurement reads by default: :data:`EPOCHS` epochs of a dataset of ``size``,
    at most :data:`MOST_SAMPLES` (a small output is not read 60 times over)."""
    return max(1, min(EPOCHS * size, MOST_SAMPLES))


def measure(
    dataset: Dataset[Any],
    workers: int,
    batch_size: int | None = 256,
    max_samples: int | None = None,
    collate_fn: Callable[[Any], Any] | None = collate,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: Callable[[int], object] | None = None,
) -> tuple[int, float]:
    """Read ``max_samples`` samples (default: one epoch; more epochs when the dataset is
    smaller) in shuffled batches through a ``DataLoader``, stopping early after
    ``max_seconds``; return the samples counted and the seconds they took. Workers
    (persistent) first read two batches each, and the clock starts at the first batch of the
    measured pass, so start-up (processes, opening files) is not counted. ``batch_size=None``
    is for a dataset that yields whole batches itself; ``progress`` is told of each batch's
    samples."""
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=not isinstance(dataset, IterableDataset),  # a stream shuffles itself
        num_workers=workers,
        collate_fn=collate_fn if batch_size is not None else None,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    limit = max_samples or len(dataset)  # type: ignore[arg-type]
    if workers:  # every worker opens its files and reads a batch before the clock starts
        for step, _ in enumerate(loader):
            if step >= 2 * workers:
                break
    count = -1
    start = 0.0
    deadline = float("inf")
    done = False
    while not done:
        for images, *_ in loader:  # (images, labels, *fields)
            if count < 0:  # the clock starts at the first batch of the measured pass
                start = time.perf_counter()
                deadline = start + max_seconds if max_seconds else deadline
                count = 0
                continue
            count += len(images)
            if progress is not None:
                progress(len(images))
            done = count >= limit or time.perf_counter() >= deadline
            if done:
                break
    seconds = time.perf_counter() - start
    return count, seconds


def run_bench(
    paths: Sequence[str | os.PathLike[str]],
    workers: Sequence[int] = (0, 2),
    batch_size: int = 256,
    max_samples: int | None = None,
    read: ReadOptions | None = None,
    max_seconds: float | None = MOST_SECONDS,
    progress: bool = False,
) -> list[BenchResult]:
    """Measure every path at every worker count, side by side in one run (``read``: how the
    outputs are opened: storage options, cache folder and limit). Each measurement reads
    ``max_samples`` (default :func:`default_samples` of the dataset) or for ``max_seconds``,
    whichever ends first; ``progress`` shows a bar on stderr. The readers' advice on workers
    is not given inside the rows that measure it."""
    opened = [(path, *open_for_bench(path, read)) for path in paths]
    plans = [
        max_samples or default_samples(len(dataset))  # type: ignore[arg-type]
        for _, _, dataset in opened
    ]
    bar = tqdm(
        total=sum(plans) * len(workers),
        unit="sample",
        unit_scale=True,
        desc="bench",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    results = []
    with bar, measuring():
        for (path, name, dataset), planned in zip(opened, plans, strict=True):
            for w in workers:
                bar.set_postfix_str(f"{name}, {w} workers")
                count, seconds = measure(
                    dataset, w, batch_size, planned, max_seconds=max_seconds, progress=bar.update
                )
                bar.update(max(0, planned - count))  # ended early by the clock
                results.append(BenchResult(name, str(path), w, batch_size, count, seconds))
    return results


def pyplot() -> Any:
    """matplotlib's ``pyplot`` drawing to files only, or :class:`OptionError` saying how to get
    it (the ``[plot]`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise OptionError(
            "--plot needs matplotlib: pip install 'imgpack[plot]' (or pip install matplotlib)"
        ) from None
    return plt


def plot_results(results: Sequence[BenchResult], path: str | os.PathLike[str]) -> Path:
    """Draw ``results`` as a bar chart (samples/s per loader, one bar per worker count) and save
    it as an image (its type from the extension: ``.png``, ``.svg``...). Needs matplotlib, the
    ``[plot]`` extra."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    loaders = list(dict.fromkeys((r.name, r.path) for r in results))
    workers = sorted({r.workers for r in results})
    rates = {(r.name, r.path, r.workers): r.rate for r in results}
    width = 0.8 / max(1, len(workers))
    figure, axes = plt.subplots(figsize=(8, 1.2 + 0.55 * len(loaders) * len(workers)))
    for k, count in enumerate(workers):
        rows = [i + k * width for i in range(len(loaders))]
        values = [rates.get((name, where, count), 0.0) for name, where in loaders]
        bars = axes.barh(rows, values, height=width, label=f"num_workers={count}")
        axes.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=3, fontsize=8)
    axes.set_yticks(
        [i + width * (len(workers) - 1) / 2 for i in range(len(loaders))],
        [f"{name}\n{Path(where).name}" for name, where in loaders],
        fontsize=8,
    )
    axes.invert_yaxis()
    positive = [rate for rate in rates.values() if rate > 0]
    logarithmic = bool(positive) and max(positive) > 30 * min(positive)
    if logarithmic:  # raw reads and decoded ones differ by orders of magnitude
        axes.set_xscale("log")
        axes.xaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels overlap
    scale = " (log scale)" if logarithmic else ""
    axes.set_xlabel(f"samples/s{scale}: DataLoader, shuffled batches")
    axes.set_title(f"imgpack bench (batch_size={results[0].batch_size})" if results else "")
    axes.legend(fontsize=8, loc="lower right")
    axes.margins(x=0.18)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
