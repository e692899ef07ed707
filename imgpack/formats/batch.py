"""A gathered batch (:class:`Batch`) and the collate that hands it over without a copy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from imgpack.decoding import new_batch_tensor
from imgpack.handover import Handover, in_worker

Images = torch.Tensor | list[torch.Tensor]


class Batch(Sequence[tuple[torch.Tensor, Any]]):
    """A gathered batch: ``images`` is a ``(B, C, H, W)`` uint8 tensor (or a list of ``(C, H, W)``
    tensors when sizes differ or a transform ran) and ``labels`` a ``(B,)`` tensor (or a list,
    after a ``target_transform``)."""

    __slots__ = ("images", "labels")

    def __init__(self, images: Images | list[Any], labels: torch.Tensor | list[Any]) -> None:
        self.images = images
        self.labels = labels

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
        return self.images[index], int(label) if isinstance(label, torch.Tensor) else label

    def __reduce__(self) -> tuple[Any, ...]:
        # From a DataLoader worker every tensor travels as a shared-memory file whose descriptor
        # the main process fetches in a round trip of its own: the labels (a few hundred bytes)
        # travel inline as a NumPy array instead, one round trip per batch fewer.
        labels = self.labels.numpy() if isinstance(self.labels, torch.Tensor) else self.labels
        return _rebuild_batch, (self.images, labels)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        # What torch's default collate walks (twice): one C++ call for all the image views and
        # one for all the labels, instead of a Python __getitem__ per sample.
        images = self.images.unbind(0) if isinstance(self.images, torch.Tensor) else self.images
        labels = self.labels.tolist() if isinstance(self.labels, torch.Tensor) else self.labels
        return zip(images, labels, strict=True)


def _rebuild_batch(images: Images | list[Any], labels: np.ndarray | list[Any]) -> Batch:
    return Batch(images, torch.from_numpy(labels) if isinstance(labels, np.ndarray) else labels)


def label_tensor(labels: list[int]) -> torch.Tensor:
    """An int64 tensor of ``labels`` (``torch.tensor`` of a list costs ~30 µs, this ~3)."""
    return torch.from_numpy(np.array(labels, dtype=np.int64))


def collate(batch: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
    """``collate_fn`` for imgpack readers: ``(images, labels)`` from a batch.

    A :class:`Batch` is handed over as it is (no per-sample work). Any other sequence of
    ``(image, label)`` pairs is stacked like torch's default collate would; images of different
    sizes come back as a list.
    """
    if isinstance(batch, Batch):
        images, labels = batch.images, batch.labels
    else:
        images = [sample[0] for sample in batch]
        labels = [sample[1] for sample in batch]
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
    return Handover(images, labels) if in_worker() else (images, labels)
