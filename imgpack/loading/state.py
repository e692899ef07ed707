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

from torch.utils.data import DataLoader

from imgpack.errors import OptionError
from imgpack.formats.dataset_base import ImageDataset
from imgpack.loading.advice import advise_workers
from imgpack.loading.sampler import Mix, ShardBatches, ShardSampler
from imgpack.storage.lazy import quiet_fetches


class Loader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` (same arguments) with ``state_dict()`` /
    ``load_state_dict()``. The sampler must be a :class:`ShardSampler` (give ``sampler=``, or
    ``batch_sampler=`` one's :meth:`~ShardSampler.batches`; with neither, one is made from
    ``shuffle`` and ``seed=0``).

    With ``batch_size`` and a ``sampler=ShardSampler(...)`` over an imgpack reader (or
    :class:`Mix`), the loader is made with ``batch_sampler=sampler.batches(batch_size,
    drop_last)``, DataLoader's public way to hand each batch over as one index array (the same
    indices in the same order as torch's ``BatchSampler`` over the sampler, not one Python int
    at a time); ``loader.batch_sampler`` is then that :class:`ShardBatches`. Only DataLoader's
    public API is used: no private name of a class torch changes often."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("sampler") is None and kwargs.get("batch_sampler") is None and not args:
            kwargs["sampler"] = ShardSampler(
                dataset, shuffle=bool(kwargs.pop("shuffle", False)), num_replicas=1, rank=0
            )
        given = kwargs.get("sampler")
        if (
            not args
            and isinstance(given, ShardSampler)
            and isinstance(dataset, ImageDataset | Mix)
            and kwargs.get("batch_sampler") is None
            and kwargs.get("batch_size", 1) is not None
            and "shuffle" not in kwargs  # DataLoader's own error says shuffle and sampler clash
        ):
            batch_size, drop_last = kwargs.pop("batch_size", 1), kwargs.pop("drop_last", False)
            del kwargs["sampler"]
            kwargs["batch_sampler"] = given.batches(batch_size, drop_last)
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
        # What the workers hold ahead (prefetch_factor batches each) and the batch being
        # read: a shard's pin is let go that many samples after its last read is handed out.
        size = getattr(self.batch_sampler, "batch_size", None) or 1
        sampler.lag = size * (self.num_workers * (self.prefetch_factor or 0) + 1)
        sampler.step = size
        sampler.check_cache_limit()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        advise_workers(self.dataset, self.num_workers)  # the loader advises, never a read
        self._taken = 0
        size = getattr(self.batch_sampler, "batch_size", None)
        with quiet_fetches():  # the workers fork with no fetch of this process under way
            batches = super().__iter__()
        for batch in batches:
            self._taken += _count(batch, size)
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


def _count(batch: Any, batch_size: int | None) -> int:
    """Samples in a collated batch: the length of its labels where it has them."""
    if isinstance(batch, tuple | list) and len(batch) == 2:
        try:
            return len(batch[1])
        except TypeError:
            pass
    return int(batch_size or 1)


__all__ = ["Loader"]
