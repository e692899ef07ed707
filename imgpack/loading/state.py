"""``Loader``: a ``DataLoader`` whose state counts what reached the training loop.

With ``num_workers > 0`` a ``DataLoader``'s sampler runs ahead of the training step (each worker
holds ``prefetch_factor`` batches): the sampler's own count says what was *sent*, not what was
*used*. :class:`Loader` counts the batches its iterator handed out, and its
:meth:`~Loader.state_dict` is the sampler's state at exactly that point, so a run stopped after
any batch resumes at the next one, on any number of workers (and, with
:class:`~imgpack.loading.ShardSampler`, of ranks).

Put it in a checkpoint like a model's state::

    torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, "ckpt.pt")
    ...
    loader.load_state_dict(torch.load("ckpt.pt")["loader"])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from imgpack.errors import OptionError
from imgpack.formats.dataset_base import ImageDataset
from imgpack.loading.sampler import Mix, ShardBatches, ShardSampler


class Loader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` (same arguments) with ``state_dict()`` /
    ``load_state_dict()``. The sampler must be a :class:`ShardSampler` (give ``sampler=``, or
    ``batch_sampler=`` one's :meth:`~ShardSampler.batches`; with neither, one is made from
    ``shuffle`` and ``seed=0``).

    With ``batch_size`` and an imgpack reader (or :class:`Mix`), each batch reaches the reader
    as one index array from :meth:`ShardSampler.batches` (the same indices in the same order as
    torch's ``BatchSampler`` over the sampler would give, one Python int at a time); and no
    profiler range is opened around each batch unless a profiler runs."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("sampler") is None and kwargs.get("batch_sampler") is None and not args:
            kwargs["sampler"] = ShardSampler(
                dataset, shuffle=bool(kwargs.pop("shuffle", False)), num_replicas=1, rank=0
            )
        super().__init__(dataset, *args, **kwargs)
        batches = self.batch_sampler
        sampler = batches.sampler if isinstance(batches, ShardBatches) else self.sampler
        if not isinstance(sampler, ShardSampler):
            raise OptionError(
                "Loader keeps state through its sampler: give sampler=ShardSampler(...) or "
                "batch_sampler=ShardSampler(...).batches(batch_size)"
            )
        self._shards = sampler
        self._taken = 0  # samples of this rank handed out by the running iteration
        # batch_size= with a ShardSampler: torch's BatchSampler would draw each batch one
        # Python int at a time; an imgpack reader (or Mix) takes the sampler's batches as
        # index arrays instead (the same indices in the same order, a third of a raw batch's
        # time saved). loader.sampler and loader.batch_sampler stay what DataLoader made.
        self._arrays: ShardBatches | None = None
        if type(batches) is BatchSampler and isinstance(dataset, ImageDataset | Mix):
            self._arrays = sampler.batches(batches.batch_size, batches.drop_last)

    @property
    def _index_sampler(self) -> Any:  # what DataLoader's iterators draw batches of indices from
        arrays = getattr(self, "_arrays", None)
        return arrays if arrays is not None else super()._index_sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._taken = 0
        batches = super().__iter__()
        while True:
            try:
                batch = _next(batches)
            except StopIteration:
                return
            self._taken += _count(batch, self.batch_size)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the last batch this loader handed out (prefetched batches
        are not counted): ``{"sampler": ...}``."""
        return {"sampler": self._shards.state_dict(self._taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or a ``StatefulDataLoader``'s: see
        :func:`~imgpack.loading.sampler_state`): the next iteration of the saved epoch (call
        ``sampler.set_epoch`` with it, or not at all) yields only what was not consumed."""
        self._shards.load_state_dict(state)  # a Loader's, or any state sampler_state reads
        self._taken = 0


def _next(batches: Any) -> Any:
    """The next batch of a ``DataLoader`` iterator. ``DataLoader`` opens a profiler range
    (``torch.autograd.profiler.record_function``) around every batch, which costs ~20 µs and
    slows every torch op inside it while no profiler is running: a third of a raw batch's
    time. Without a profiler the batch is fetched as the iterator's ``__next__`` does, without
    the range; with one (or an iterator without these internals) through ``__next__`` itself."""
    fetch = getattr(batches, "_next_data", None)
    if (
        fetch is None
        or getattr(batches, "_sampler_iter", None) is None
        or torch.autograd._profiler_enabled()
    ):
        return next(batches)
    data = fetch()
    batches._num_yielded += 1
    return data


def _count(batch: Any, batch_size: int | None) -> int:
    """Samples in a collated batch: the length of its labels where it has them."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        try:
            return len(batch[1])
        except TypeError:
            pass
    return int(batch_size or 1)


__all__ = ["Loader"]
