"""The ``tfrecord`` format: ``tf.train.Example`` records in TFRecord shards with DALI indexes.

Shards are ``<prefix>-NNNNN-of-MMMMM.tfrecord`` (``-o prefix=``, default ``data``), rolled over
at ``--shard-size``; each has ``<prefix>-NNNNN-of-MMMMM.idx`` beside it (``offset size`` per
record). Every record carries every key: ``image/encoded``, ``image/format`` (``JPEG``, ``PNG``
or ``RAW``), ``image/class/label`` (label + ``label_offset``), ``image/class/text``,
``image/height``, ``image/width``, ``image/channels``, ``image/colorspace`` (``RGB`` or
``Grayscale``, of the stored bytes) and ``image/filename``; and ``imgpack/output_id``, the
output's id (a reader refuses a record of another output). An output with per-sample fields
(:mod:`imgpack.fields`) adds each value a sample has as a feature under the field's name
(:func:`imgpack.formats.tfrecord.example.field_features`), covered by the record's CRCs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from imgpack.formats.tfrecord import example, framing
from imgpack.formats.tfrecord.example import example_features
from imgpack.formats.writer_base import HashedFile, ShardedWriter, WriterConfig, WrittenFile
from imgpack.images import Encoded

#: Encoded feature entries a writer remembers (the repeating ones: labels, sizes, class names).
_ENTRIES = 4096


class TFRecordWriter(ShardedWriter):
    #: The record's framing (16 bytes) and its ``tf.train.Example`` beside the image: the
    #: label, class name, file name, format, sizes and output id (about 300 bytes measured).
    SAMPLE_OVERHEAD = 300

    def __init__(self, directory: Path, config: WriterConfig) -> None:
        super().__init__(directory, config)
        self.label_offset = int(self.settings["label_offset"])
        self._fh: HashedFile | None = None
        self._entries: dict[tuple[str, Any], bytes] = {}

    def shard_name(self, index: int) -> str:
        # The shard count is known only at the end; _finish renames to -NNNNN-of-MMMMM.
        return f".{self.settings['prefix']}-{index:05d}.partial"

    def _start_shard(self, path: Path) -> None:
        self._fh = HashedFile(path)  # closed in _end_shard/_abort
        self._index: list[tuple[int, int]] = []
        self._offset = 0

    def _entry(self, key: str, values: Any) -> bytes:
        """``example.encode_entry``, remembered for the features whose values repeat (all but
        the file name): most of a record is the same few entries."""
        if key == "image/filename" or "/" not in key:  # a path, or a field's value
            return example.encode_entry(key, values)
        cache = self._entries
        found = cache.get((key, tuple(values)))
        if found is None:
            if len(cache) >= _ENTRIES:
                cache.clear()
            found = cache[(key, tuple(values))] = example.encode_entry(key, values)
        return found

    def _append(self, sample: Encoded) -> int:
        assert self._fh is not None
        name = self.config.class_name(sample.label) or ""
        features = example_features(sample, name, self.label_offset, self.config.output_id)
        if self.config.fields:
            features.update(example.field_features(self.config.fields, sample.fields or {}))
        head, tail = example.encode_example_around(features, "image/encoded", self._entry)
        before, after = framing.frame_around(head, sample.payload, tail)
        size = len(before) + len(sample.payload) + len(after)
        self._fh.write(before)
        self._fh.write(sample.payload)
        self._fh.write(after)
        self._index.append((self._offset, size))
        self._offset += size
        return size

    def _end_shard(self) -> str:
        assert self._fh is not None
        path = Path(self._fh.name)
        digest = self._fh.close()
        self._fh = None
        framing.write_index(path.with_suffix(".tfrecord"), self._index)  # .partial -> .idx below
        return digest

    def companions_of(self, shard: Path) -> list[Path]:
        return [framing.index_path(shard.with_suffix(".tfrecord"))]

    def final_name(self, number: int, total: int) -> str:
        return framing.shard_file_name(self.settings["prefix"], number, total)

    def _finish(self) -> list[WrittenFile]:
        partial = super()._finish()
        files = []
        for number, written in enumerate(partial):
            old = self.directory / written.path
            new = self.directory / self.final_name(number, len(partial))
            os.rename(old, new)
            index = self.companions_of(new)[0]
            os.rename(self.companions_of(old)[0], index)
            (_, digest), *_ = written.companions
            files.append(
                WrittenFile(new.name, written.num_samples, written.sha256, [(index.name, digest)])
            )
        return files

    def _abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
