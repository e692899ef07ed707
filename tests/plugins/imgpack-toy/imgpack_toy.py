"""A toy imgpack format, and the smallest complete one: every payload in one file ``toy.bin``,
with ``toy.idx`` listing one JSON line per sample (offset, size, label, checksum, source path).

Small on purpose: it shows what a format plugin implements. The writer stores samples; the
reader implements the one required primitive, ``_records`` (and ``_load_paths`` to give the
source paths back) — batches, labels, ``verify``, ``export``, ``merge`` and converting from the
output all work from those."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from imgpack.checksum import record_crc
from imgpack.formats import FormatOption, FormatSpec
from imgpack.formats.dataset_base import ImageDataset, Record
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
        entry = {
            "offset": self._data.tell(),
            "size": len(sample.payload),
            "label": sample.label,
            "crc": record_crc(sample.payload, sample.label),
            "path": sample.path,
        }
        self._index.append(json.dumps(entry) + "\n")
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
        with open(self.root / "toy.idx") as index:
            self._index = [json.loads(line) for line in index]

    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        with open(self.root / "toy.bin", "rb") as data:
            for i in indices.tolist():
                entry = self._index[i]
                payload = os.pread(data.fileno(), entry["size"], entry["offset"])
                yield Record(i, payload, entry["label"], entry["crc"], f"{self.root}/toy.bin")

    def _load_paths(self) -> list[str] | None:
        return [entry["path"] for entry in self._index]
