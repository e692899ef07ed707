"""A gathered batch (:class:`Batch`) and the collate that hands it over without a copy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from imgpack.decoding import new_batch_tensor
from imgpack.handover import Handover, HandoverWith, in_worker

Images = torch.Tensor | list[torch.Tensor]


class Batch(Sequence[tuple[Any, ...]]):
    """A gathered batch: ``images`` is a ``(B, C, H, W)`` uint8 tensor (or a list of ``(C, H, W)``
    tensors when sizes differ or a transform ran) and ``labels`` a ``(B,)`` tensor (or a list,
    after a ``target_transform``); ``fields`` the columns of the fields read with it
    (``fields=``: :func:`field_column`), in that order."""

    __slots__ = ("fields", "images", "labels")

    def __init__(
        self,
        images: Images | list[Any],
        labels: torch.Tensor | list[Any],
        fields: tuple[Any, ...] = (),
    ) -> None:
        self.images = images
        self.labels = labels
        self.fields = fields

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[torch.Tensor, Any]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        label = self.labels[index]
        label = int(label) if isinstance(label, torch.Tensor) else label
        if self.fields:
            return (self.images[index], label, *(_item(c, index) for c in self.fields))
        return self.images[index], label

    def __reduce__(self) -> tuple[Any, ...]:
        # From a DataLoader worker every tensor travels as a shared-memory file whose descriptor
        # the main process fetches in a round trip of its own: the labels (a few hundred bytes)
        # travel inline as a NumPy array instead, one round trip per batch fewer.
        labels = self.labels.numpy() if isinstance(self.labels, torch.Tensor) else self.labels
        return _rebuild_batch, (self.images, labels, self.fields)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        # What torch's default collate walks (twice): one C++ call for all the image views and
        # one for all the labels, instead of a Python __getitem__ per sample.
        images = self.images.unbind(0) if isinstance(self.images, torch.Tensor) else self.images
        labels = self.labels.tolist() if isinstance(self.labels, torch.Tensor) else self.labels
        if self.fields:
            columns = [c.tolist() if isinstance(c, torch.Tensor) else c for c in self.fields]
            return zip(images, labels, *columns, strict=True)
        return zip(images, labels, strict=True)


def _item(column: Any, index: int) -> Any:
    value = column[index]
    return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value


def _rebuild_batch(
    images: Images | list[Any], labels: np.ndarray | list[Any], fields: tuple[Any, ...] = ()
) -> Batch:
    found = torch.from_numpy(labels) if isinstance(labels, np.ndarray) else labels
    return Batch(images, found, fields)


def field_column(kind: str, values: list[Any]) -> Any:
    """A batch's values of one field of type ``kind`` (:mod:`imgpack.fields`): an int64 or
    float32 tensor for ``int`` and ``float`` when every sample has a value, else a list (text,
    bytes, JSON values, ``None`` for an absent one, and a tensor each for ``int[]`` and
    ``float[]``: their lengths differ)."""
    if kind in ("int", "float") and all(v is not None for v in values):
        return torch.tensor(values, dtype=torch.int64 if kind == "int" else torch.float32)
    return values


def label_tensor(labels: list[int]) -> torch.Tensor:
    """An int64 tensor of ``labels`` (``torch.tensor`` of a list costs ~30 µs, this ~3)."""
    return torch.from_numpy(np.array(labels, dtype=np.int64))


def collate(batch: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """``collate_fn`` for imgpack readers: ``(images, labels)`` from a batch, and the columns
    of the fields read with it after them (``fields=``: ``(images, labels, captions, ...)``,
    each as :func:`field_column` makes it).

    A :class:`Batch` is handed over as it is (no per-sample work). Any other sequence of
    ``(image, label, *values)`` tuples is stacked like torch's default collate would; images
    of different sizes come back as a list, field values as lists (numbers as tensors).
    """
    columns: tuple[Any, ...]
    if isinstance(batch, Batch):
        images, labels, columns = batch.images, batch.labels, batch.fields
    else:
        images = [sample[0] for sample in batch]
        labels = [sample[1] for sample in batch]
        width = len(batch[0]) if len(batch) else 2
        columns = tuple(_column([sample[k] for sample in batch]) for k in range(2, width))
    if (
        isinstance(images, list)
        and images
        and isinstance(images[0], torch.Tensor)
        and all(img.shape == images[0].shape for img in images)
    ):
        out = new_batch_tensor((len(images), *images[0].shape), images[0].dtype)
        images = torch.stack(images, out=out)
    if isinstance(labels, list) and all(isinstance(label, int) for label in labels):
        labels = torch.tensor(labels, dtype=torch.int64)
    if columns:
        return (
            HandoverWith((images, labels, *columns)) if in_worker() else (images, labels, *columns)
        )
    return Handover(images, labels) if in_worker() else (images, labels)


def _column(values: list[Any]) -> Any:
    """Values of one field from separate samples, as :func:`field_column` batches them."""
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.int64)
    if values and all(isinstance(v, float) for v in values):
        return torch.tensor(values, dtype=torch.float32)
    return values
