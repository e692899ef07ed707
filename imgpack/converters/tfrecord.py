"""The ``tfrecord`` format: ``tf.train.Example`` records in TFRecord shards with DALI indexes.

Shards are ``<prefix>-NNNNN-of-MMMMM.tfrecord`` (``-o prefix=``, default ``data``), rolled over
at ``--shard-size``; each has ``<prefix>-NNNNN-of-MMMMM.idx`` beside it (``offset size`` per
record). Every record carries every key: ``image/encoded``, ``image/format`` (``JPEG``, ``PNG``
or ``RAW``), ``image/class/label`` (label + ``label_offset``), ``image/class/text``,
``image/height``, ``image/width``, ``image/channels``, ``image/colorspace`` (``RGB`` or
``Grayscale``) and ``image/filename``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from imgpack import tfexample, tfrecord
from imgpack.converters.base import ShardedWriter, WrittenFile
from imgpack.errors import OptionError
from imgpack.images import Encoded


def example_features(sample: Encoded, class_name: str, label_offset: int) -> dict[str, Any]:
    """The features of one sample's record."""
    return {
        "image/encoded": [sample.payload],
        "image/format": [sample.format.encode()],
        "image/class/label": [sample.label + label_offset],
        "image/class/text": [class_name.encode("utf-8")],
        "image/height": [sample.height],
        "image/width": [sample.width],
        "image/channels": [sample.channels],
        "image/colorspace": [b"RGB" if sample.channels == 3 else b"Grayscale"],
        "image/filename": [sample.path.encode("utf-8", "surrogateescape")],
    }


class TFRecordWriter(ShardedWriter):
    format = "tfrecord"
    options: ClassVar[dict[str, Any]] = {"prefix": "data", "label_offset": 0}
    default_shard_size = 256 << 20

    def __init__(self, directory: Path, config: Any, **options: Any) -> None:
        super().__init__(directory, config, **options)
        self.label_offset = int(self.settings["label_offset"])
        self._fh: BinaryIO | None = None

    @classmethod
    def _normalise(cls, settings: dict[str, Any]) -> dict[str, Any]:
        prefix = str(settings["prefix"])
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise OptionError(f"invalid prefix {prefix!r}: expected a plain file name prefix")
        try:
            label_offset = int(settings["label_offset"])
        except (TypeError, ValueError):
            raise OptionError(
                f"invalid label_offset {settings['label_offset']!r}: expected an integer"
            ) from None
        return {**settings, "prefix": prefix, "label_offset": label_offset}

    def shard_name(self, index: int) -> str:
        # The shard count is known only at the end; _finish renames to -NNNNN-of-MMMMM.
        return f".{self.settings['prefix']}-{index:05d}.partial"

    def _start_shard(self, path: Path) -> None:
        self._fh = open(path, "wb")  # noqa: SIM115 - closed in _end_shard/_abort
        self._index: list[tuple[int, int]] = []
        self._offset = 0

    def _append(self, sample: Encoded) -> int:
        assert self._fh is not None
        name = self.config.classes[sample.label]
        record = tfrecord.frame(
            tfexample.encode_example(example_features(sample, name, self.label_offset))
        )
        self._fh.write(record)
        self._index.append((self._offset, len(record)))
        self._offset += len(record)
        return len(record)

    def _end_shard(self) -> None:
        assert self._fh is not None
        path = Path(self._fh.name)
        self._fh.close()
        self._fh = None
        tfrecord.write_index(path.with_suffix(".tfrecord"), self._index)  # .partial -> .idx below

    def _finish(self) -> list[WrittenFile]:
        partial = super()._finish()
        total = len(partial)
        prefix = self.settings["prefix"]
        files = []
        for number, written in enumerate(partial):
            old = self.directory / written.path
            new = self.directory / f"{prefix}-{number:05d}-of-{total:05d}.tfrecord"
            os.rename(old, new)
            os.rename(tfrecord.index_path(old.with_suffix(".tfrecord")), tfrecord.index_path(new))
            files.append(WrittenFile(new.name, written.num_samples))
        return files

    def _abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
