"""The one piece of loader advice a read can prompt, given by the loader, never from inside a
read: a memory-mapped raw output read with DataLoader workers.

Raw pixels need no decode: a batch is one memory gather, and a worker process adds a hand-over
per batch that may cost as much. Whether it does depends on the machine, so the note states no
worker count of its own; ``imgpack tune`` measures it (:mod:`imgpack.loading.tuning`).
:class:`~imgpack.loading.Loader` gives the note when it starts an epoch with workers, once per
reader in a process; ``tune`` and ``bench`` measure workers without it, and ``profile``
prints it.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from imgpack.errors import PerformanceWarning
from imgpack.formats.dataset_base import ImageDataset

#: Why the starting point for raw pixels is ``num_workers=0``
#: (:func:`imgpack.loading.tuning.recommend_loader_settings`; ``imgpack tune`` measures it).
RAW_WORKERS_REASON = (
    "raw pixels: a batch is one memory gather in the training process, and a worker process "
    "adds a hand-over per batch that costs about as much (or load it all with DeviceLoader)"
)

#: The readers this process gave the note for (a reader is advised once, whatever its epochs
#: and loaders); weak, so a reader's lifetime is its own.
_advised: weakref.WeakSet[ImageDataset] = weakref.WeakSet()


def worker_note(dataset: Any, num_workers: int) -> str | None:
    """The note for reading ``dataset`` with ``num_workers`` DataLoader workers, or ``None``:
    only a memory-mapped raw reader (or a :class:`~imgpack.loading.Mix` of them) read with
    workers gets one."""
    readers = getattr(dataset, "datasets", [dataset])
    mapped = [d for d in readers if isinstance(d, ImageDataset) and d.memory_mapped()]
    if num_workers <= 0 or not mapped:
        return None
    names = ", ".join(f"{type(d).__name__}({str(d.root)!r})" for d in mapped[:2])
    return (
        f"{names}: read with num_workers={num_workers}. Raw pixels need no decode, so a worker "
        "process may cost more than it saves (a hand-over per batch): 'imgpack tune OUTPUT' "
        "measures num_workers on this machine, and its choice is the one to use"
    )


def advise_workers(dataset: Any, num_workers: int) -> None:
    """Warn (:class:`~imgpack.errors.PerformanceWarning`, one line with no source line of
    imgpack's) with :func:`worker_note`, once per reader in this process."""
    note = worker_note(dataset, num_workers)
    if note is None:
        return
    readers = [d for d in getattr(dataset, "datasets", [dataset]) if isinstance(d, ImageDataset)]
    if all(d in _advised for d in readers):
        return
    _advised.update(readers)
    warnings.warn_explicit(note, PerformanceWarning, filename="imgpack", lineno=0, module="imgpack")


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """No advice on workers while workers are what is measured (``tune``, ``bench``): the
    loader's note and torch's note on more workers than CPUs are silenced; DataLoader workers
    forked inside inherit the filters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        yield


__all__ = ["RAW_WORKERS_REASON", "advise_workers", "measuring", "worker_note"]
