"""Profiling the data loader: where the time goes, and who waits for whom.

:class:`TimedDataset` times every fetch, also inside DataLoader worker processes: each process
appends its timings to a file of its own in a folder the wrapper creates, and :meth:`stats`
reads them all back in the training process (a list kept in the dataset object would stay in
the worker that filled it). :class:`LoaderProfiler` measures, in the training process, the time
spent waiting for each batch against the time between batches — the "GPU starvation" share.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
from torch.utils.data import Dataset, get_worker_info

T = TypeVar("T")
_RECORD = struct.Struct("<dI")  # seconds per sample, samples in the fetch


def _summary(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    return {
        "count": int(values.size),
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "max": float(values.max()),
    }


class TimedDataset(Dataset[Any]):
    """Wraps a dataset and records how long each sample took to fetch, in whatever process
    fetched it. A batched fetch (``__getitems__``) counts as ``len(batch)`` samples of equal time.
    Attributes of the wrapped dataset (``classes``, ``manifest``...) pass through."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset
        self.log_dir = Path(tempfile.mkdtemp(prefix="imgpack-timing-"))
        self._fd: int | None = None
        self._pid: int | None = None
        #: Bytes of each timing file that :meth:`reset` marked as read.
        self._marks: dict[str, int] = {}
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.log_dir), True)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "log_dir": self.log_dir,
            "_fd": None,
            "_pid": None,
            "_marks": {},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # a copy in a worker: the parent owns (and removes) log_dir

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _record(self, seconds: float, count: int) -> None:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:
            info = get_worker_info()
            name = f"worker{info.id}-{pid}" if info is not None else f"main-{pid}"
            self._fd = os.open(
                self.log_dir / f"{name}.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
            )
            self._pid = pid
        os.write(self._fd, _RECORD.pack(seconds / max(count, 1), count))

    def __getitem__(self, index: int) -> Any:
        start = time.perf_counter()
        item = self.dataset[index]
        self._record(time.perf_counter() - start, 1)
        return item

    def __getitems__(self, indices: Sequence[int]) -> Any:
        start = time.perf_counter()
        getitems = getattr(self.dataset, "__getitems__", None)
        batch = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        self._record(time.perf_counter() - start, len(indices))
        return batch

    def _timings(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for path in sorted(self.log_dir.glob("*.bin")):
            raw = path.read_bytes()[self._marks.get(path.name, 0) :]
            usable = len(raw) - len(raw) % _RECORD.size
            rows = np.frombuffer(raw[:usable], dtype=np.dtype([("t", "<f8"), ("n", "<u4")]))
            worker = path.stem.rsplit("-", 1)[0]
            values = np.repeat(rows["t"], rows["n"])
            out[worker] = np.concatenate([out[worker], values]) if worker in out else values
        return out

    def stats(self) -> dict[str, Any]:
        """``count``, ``mean``, ``p50``, ``p95``, ``max`` (seconds per sample) over every fetch
        so far, and the same per process under ``per_worker`` (``worker0``, ..., ``main``)."""
        per = self._timings()
        everything = np.concatenate(list(per.values())) if per else np.empty(0)
        return {**_summary(everything), "per_worker": {k: _summary(v) for k, v in per.items()}}

    def reset(self) -> None:
        """Forget the timings taken so far. The timing files stay (persistent DataLoader workers
        keep appending to theirs): what they hold now is marked as read."""
        self._marks = {path.name: path.stat().st_size for path in self.log_dir.glob("*.bin")}

    def close(self) -> None:
        """Remove the timing files (done automatically when the wrapper is garbage-collected)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._cleanup()


class LoaderProfiler(Generic[T]):
    """Iterate a loader and time, in the training process, the wait for each batch (time
    inside ``next()``) against the time the consumer spent between batches.

    ::

        profiler = LoaderProfiler(loader)
        for images, labels in profiler:
            train_step(images, labels)
        print(profiler.summary())   # wait_share near 1: the loader is the bottleneck
    """

    def __init__(self, loader: Iterable[T], per_step: bool = False) -> None:
        self.loader = loader
        self.per_step = per_step
        self.waits: list[float] = []
        self.computes: list[float] = []
        self.samples = 0

    def __iter__(self) -> Iterator[T]:
        iterator = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            got = time.perf_counter()
            self.waits.append(got - start)
            self.samples += _batch_len(batch)
            yield batch
            self.computes.append(time.perf_counter() - got)

    def summary(self) -> dict[str, Any]:
        """Batches, samples, total and per-batch wait and consumer time, the wait share, and
        per step when ``per_step=True``. The first batch's wait includes worker start-up and is
        reported apart (``first_wait``) and left out of the rest."""
        waits = np.asarray(self.waits[1:])
        computes = np.asarray(self.computes[1:])
        wait, compute = float(waits.sum()), float(computes.sum())
        out: dict[str, Any] = {
            "batches": len(self.waits),
            "samples": self.samples,
            "first_wait": self.waits[0] if self.waits else 0.0,
            "wait_s": wait,
            "compute_s": compute,
            "wait_share": wait / (wait + compute) if wait + compute > 0 else 0.0,
            "wait_per_batch": _summary(waits),
            "compute_per_batch": _summary(computes),
        }
        if self.per_step:
            out["steps"] = [
                {"wait": w, "compute": c} for w, c in zip(self.waits, self.computes, strict=False)
            ]
        return out


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    try:
        return len(first)
    except TypeError:
        return 1


#: Batches (after the first) a verdict needs: fewer say too little about a steady state.
MIN_VERDICT_BATCHES = 10


def verdict(summary: dict[str, Any], threshold: float = 0.2, advice: str | None = None) -> str:
    """A sentence saying whether the loader or the consumer is the bottleneck, or that the
    figures are too few to tell. ``advice``: what to do when loader-bound, for the dataset
    measured (:func:`imgpack.loading.tuning.loader_bound_advice`)."""
    measured = summary["batches"] - 1
    if measured < MIN_VERDICT_BATCHES:
        return (
            f"too few batches for a verdict ({measured} after the first, which includes "
            f"start-up): measure at least {MIN_VERDICT_BATCHES} (--batches)"
        )
    share = summary["wait_share"]
    if summary["compute_s"] <= 0.01 * summary["wait_s"]:
        rate = summary["samples"] / max(summary["wait_s"] + summary["compute_s"], 1e-9)
        return (
            "no training step between batches: the loop only waited for data, so this measures "
            f"the loader (about {rate:,.0f} samples/s, the first batch included); give your "
            "step's time (--step-ms) for a verdict"
        )
    if share > threshold:
        return (
            f"loader-bound: the training loop waited for data {share:.0%} of the time; "
            + (advice or "measure the loader settings (imgpack tune), or preload onto the "
               "device (DeviceLoader)")
        )  # fmt: skip
    return f"consumer-bound: the loader kept up (the loop waited {share:.0%} of the time)"
