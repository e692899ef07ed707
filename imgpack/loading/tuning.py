"""Loader settings: a reasoned starting point, and a short measured search.

The usual advice ("num_workers = 2-4x the cores, start at 4 and watch the GPU") ignores what
the format costs to read. Raw pixels (``--encoding raw``) are gathered by a memory copy, so
worker processes only add a hand-over per batch; encoded images need a decode per sample, which
imgpack's readers spread over threads in each process (``decode_threads``) and DataLoader over
worker processes: workers x threads should be the CPUs this process may use.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from imgpack.formats.batch import collate
from imgpack.formats.dataset_base import ImageDataset
from imgpack.loading.advice import RAW_WORKERS_REASON, measuring
from imgpack.system import usable_cpus


@dataclass
class LoaderSettings:
    """``DataLoader`` keyword arguments, with the reason for each value."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    reasons: dict[str, str] = field(default_factory=dict)
    #: The reader's ``decode_threads`` (not a DataLoader argument); ``None``: the reader's default.
    decode_threads: int | None = None

    def kwargs(self) -> dict[str, Any]:
        """The settings as ``DataLoader(**settings.kwargs())`` takes them."""
        out = asdict(self)
        del out["reasons"], out["decode_threads"]
        return out

    def reader_kwargs(self) -> dict[str, Any]:
        """The reader settings, as ``open_dataset(path, **settings.reader_kwargs())`` takes them."""
        return {} if self.decode_threads is None else {"decode_threads": self.decode_threads}


def loader_bound_advice(dataset: Dataset[Any]) -> str:
    """What to do when the training loop waits for ``dataset``'s batches, for what it is: no
    worker count of its own (``imgpack tune`` measures it), and only the remedies that apply."""
    if not _decodes(dataset):
        return (
            "measure num_workers for this raw output with 'imgpack tune OUTPUT' (its measured "
            "choice is the one to use: a worker's hand-over per batch costs about as much as "
            "the gather), or preload onto the device with DeviceLoader"
        )
    return (
        "measure num_workers for this encoded output with 'imgpack tune OUTPUT' (its measured "
        "choice is the one to use); raw pixels at the training size (--encoding raw --size N) "
        "need no decode, and DeviceLoader preloads onto the device"
    )


def _decodes(dataset: Dataset[Any]) -> bool:
    manifest = getattr(dataset, "manifest", None)
    return getattr(manifest, "encoding", "original") != "raw"


def recommend_loader_settings(dataset: Dataset[Any], gpu: bool | None = None) -> LoaderSettings:
    """A starting point for ``num_workers``, ``pin_memory``, ``persistent_workers`` and
    ``prefetch_factor``, from the CPUs this process may use (``os.sched_getaffinity``, not
    ``os.cpu_count()``), whether a GPU is present and whether the format needs decoding."""
    cpus = usable_cpus()
    gpu = torch.cuda.is_available() if gpu is None else gpu
    reasons: dict[str, str] = {}
    threads: int | None = None
    if not _decodes(dataset):
        workers = 0
        reasons["num_workers"] = RAW_WORKERS_REASON
        reasons["decode_threads"] = "nothing to decode"
    else:
        workers = max(1, cpus - 1) if cpus > 1 else 0
        threads = max(1, cpus // workers) if workers else cpus
        reasons["num_workers"] = (
            f"encoded images are decoded per sample: one worker per usable CPU ({cpus} by "
            "sched_getaffinity), keeping one for the training loop"
        )
        reasons["decode_threads"] = (
            f"each {'worker' if workers else 'batch'} decodes on {threads} thread(s): workers x "
            f"threads = {max(1, workers) * threads} for {cpus} CPUs, none oversubscribed"
        )
    reasons["pin_memory"] = (
        "a GPU is present: page-locked batches copy to it asynchronously"
        if gpu
        else "no GPU: pinning would only cost memory"
    )
    persistent = workers > 0
    reasons["persistent_workers"] = (
        "keeps the workers (and their open files and memory maps) across epochs"
        if persistent
        else "no workers to keep"
    )
    prefetch = 4 if workers else None
    reasons["prefetch_factor"] = (
        "4 batches per worker in flight smooth out slow samples"
        if workers
        else "only applies with workers"
    )
    return LoaderSettings(workers, bool(gpu), persistent, prefetch, reasons, threads)


@dataclass
class TuneResult:
    best: LoaderSettings
    #: The chosen candidate's median samples/s.
    samples_per_s: float
    #: ``(settings, median samples/s)`` for every candidate, in the order tried.
    table: list[tuple[LoaderSettings, float]]
    #: Every run's samples/s, per candidate (the table's order): the spread behind each median.
    runs: list[list[float]] = field(default_factory=list)
    #: Whether the chosen candidate ties the fastest (within the noise) rather than beating it.
    within_noise: bool = False


def _rate(
    dataset: Dataset[Any],
    settings: LoaderSettings,
    batch_size: int,
    batches: int,
    collate_fn: Callable[[Any], Any],
) -> float:
    if settings.decode_threads is not None and isinstance(dataset, ImageDataset):
        dataset = dataset.with_options(decode_threads=settings.decode_threads)
    count, start = 0, 0.0
    with measuring():  # the advice these runs would give is what they decide
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=not isinstance(dataset, IterableDataset),
            collate_fn=collate_fn,
            **settings.kwargs(),
        )
        iterator = iter(loader)
        for step in range(batches + 1):
            try:
                images, _ = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                images, _ = next(iterator)
            if step == 0:
                start = time.perf_counter()  # worker start-up and the first batch are not timed
            else:
                count += len(images)
        seconds = time.perf_counter() - start
        del iterator
    return count / seconds if seconds > 0 else 0.0


def candidate_settings(dataset: Dataset[Any], gpu: bool | None = None) -> list[LoaderSettings]:
    """The settings :func:`autotune_loader` tries by default: 0, 1, 2, 4, ... workers up to twice
    the usable CPUs, each with the recommended pinning and, for encoded images, its share of
    the CPUs as decode threads."""
    base = recommend_loader_settings(dataset, gpu)
    cpus = usable_cpus()
    counts = sorted({0, 1, *(2**k for k in range(1, 8) if 2**k <= 2 * cpus)})
    return [
        LoaderSettings(
            n,
            base.pin_memory,
            n > 0,
            4 if n else None,
            {"num_workers": f"candidate: {n} workers"},
            max(1, cpus // max(1, n)) if _decodes(dataset) else None,
        )
        for n in counts
    ]


#: The least relative margin between two medians that separates them (the machine's noise
#: when the runs' own spread is smaller).
NOISE = 0.10
#: How many times :func:`autotune_loader` measures each candidate by default.
REPEATS = 3


def autotune_loader(
    dataset: Dataset[Any],
    batch_size: int = 256,
    candidates: Iterable[LoaderSettings] | None = None,
    batches: int = 20,
    collate_fn: Callable[[Any], Any] = collate,
    repeats: int = REPEATS,
) -> TuneResult:
    """Measure each candidate ``repeats`` times (``batches`` batches after one warm-up batch;
    the candidates taken in turn, so a change of load falls on all of them) and choose by the
    medians: the cheapest candidate (fewest workers) whose median is within the noise of the
    fastest's. The noise is the larger of :data:`NOISE` and the spread of the two candidates'
    runs (``(max - min) / median``): one short run says too little to separate settings, and a
    margin inside the runs' own spread is no margin. Repeated runs on a quiet machine choose
    the same; where two settings tie, :attr:`TuneResult.within_noise` says so."""
    tried = list(candidates if candidates is not None else candidate_settings(dataset))
    if not tried:
        raise ValueError("autotune_loader needs at least one candidate")
    if repeats < 1:
        raise ValueError("autotune_loader needs repeats >= 1")
    runs: list[list[float]] = [[] for _ in tried]
    for _ in range(repeats):
        for row, settings in zip(runs, tried, strict=True):
            row.append(_rate(dataset, settings, batch_size, batches, collate_fn))
    medians = [statistics.median(row) for row in runs]
    table = list(zip(tried, medians, strict=True))
    top = max(range(len(tried)), key=lambda i: medians[i])
    ties = [
        i
        for i in range(len(tried))
        if medians[i] >= medians[top] / (1 + max(NOISE, spread(runs[top]), spread(runs[i])))
    ]
    chosen = min(ties, key=lambda i: (tried[i].num_workers, -medians[i]))
    best, rate = tried[chosen], medians[chosen]
    if chosen != top:
        fastest = tried[top]
        best.reasons["num_workers"] = (
            f"measured: {rate:,.0f} samples/s (median of {repeats}) with {_workers(best)}, "
            f"within noise of the fastest ({medians[top]:,.0f} with {_workers(fastest)}; "
            f"spread {spread(runs[top]):.0%}): the two tie, so the cheaper is chosen"
        )
        return TuneResult(best, rate, table, runs, within_noise=True)
    reason = _measured_reason(best, rate, table, _decodes(dataset))
    if reason:
        best.reasons["num_workers"] = reason
    return TuneResult(best, rate, table, runs)


def spread(rates: list[float]) -> float:
    """``(max - min) / median`` of one candidate's runs: 0 for a single run."""
    middle = statistics.median(rates) if rates else 0.0
    return (max(rates) - min(rates)) / middle if len(rates) > 1 and middle > 0 else 0.0


def _workers(settings: LoaderSettings) -> str:
    return f"{settings.num_workers} workers" if settings.num_workers else "no workers"


def _measured_reason(
    best: LoaderSettings, rate: float, table: list[tuple[LoaderSettings, float]], decodes: bool
) -> str:
    """Why the fastest candidate won, in measured figures (against the best with workers, or
    without: whichever kind lost), and for what the format costs to read."""
    others = [(s, r) for s, r in table if (s.num_workers > 0) != (best.num_workers > 0)]
    if not others:
        return ""
    other, other_rate = max(others, key=lambda row: row[1])
    if best.num_workers == 0:
        return (
            f"measured: {rate:,.0f} samples/s in the main process against {other_rate:,.0f} with "
            f"{other.num_workers} workers: handing each batch over from a worker costs more "
            "than reading it"
        )
    why = (
        "the decode parallelizes over processes"
        if decodes
        else "raw pixels, nothing to decode: here the workers' gathers in parallel outpaced "
        "the cost of handing each batch over"
    )
    return (
        f"measured: {rate:,.0f} samples/s with {best.num_workers} workers against "
        f"{other_rate:,.0f} in the main process: {why}"
    )


__all__ = [
    "LoaderSettings",
    "TuneResult",
    "autotune_loader",
    "candidate_settings",
    "loader_bound_advice",
    "recommend_loader_settings",
    "spread",
]
