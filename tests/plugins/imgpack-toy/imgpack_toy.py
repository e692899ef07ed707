"""A toy imgpack format: every payload in one file ``toy.bin``, with ``toy.idx`` listing
``offset size label`` per sample. Small on purpose: it shows what a format plugin implements."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from imgpack.formats import FormatOption, FormatSpec
from imgpack.formats.dataset_base import ImageDataset, Images, arrays_to_batch, decode_batch
from imgpack.formats.writer_base import Writer, WrittenFile
from imgpack.images import Encoded

SPEC = FormatSpec(
    name="toy",
    writer="imgpack_toy:ToyWriter",
    reader="imgpack_toy:ToyDataset",
    summary="a toy format from a plugin",
    options=(FormatOption("greeting", "hello", "written into toy.txt"),),
)


class ToyWriter(Writer):
    def __init__(self, directory: Any, config: Any) -> None:
        super().__init__(directory, config)
        self._data = open(directory / "toy.bin", "wb")  # noqa: SIM115
        self._index: list[str] = []

    def add(self, sample: Encoded) -> None:
        self._index.append(f"{self._data.tell()} {len(sample.payload)} {sample.label}\n")
        self._data.write(sample.payload)

    def _finish(self) -> list[WrittenFile]:
        self._data.close()
        (self.directory / "toy.idx").write_text("".join(self._index))
        (self.directory / "toy.txt").write_text(self.settings["greeting"])
        return [WrittenFile("toy.bin", len(self._index))]

    def _abort(self) -> None:
        self._data.close()


class ToyDataset(ImageDataset):
    format = "toy"

    def __init__(self, root: Any, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        table = np.loadtxt(self.root / "toy.idx", dtype=np.int64, ndmin=2)
        self._offsets, self._sizes, self._labels = table[:, 0], table[:, 1], table[:, 2]

    def _open(self) -> int:
        return os.open(self.root / "toy.bin", os.O_RDONLY)

    def _close(self, handles: Any) -> None:
        os.close(handles)

    def _load_targets(self) -> list[int]:
        return self._labels.tolist()

    def _load_paths(self) -> list[str] | None:
        return None

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        payloads = [
            os.pread(self.handles, int(self._sizes[i]), int(self._offsets[i])) for i in indices
        ]
        labels = torch.from_numpy(self._labels[indices])
        if self.manifest.encoding == "raw":
            image = self.manifest.image
            shape = (image["height"], image["width"], self.channels)
            return arrays_to_batch(
                [np.frombuffer(p, np.uint8).reshape(shape) for p in payloads]
            ), labels
        return decode_batch(payloads, self.channels, lambda k: f"toy sample {indices[k]}"), labels
