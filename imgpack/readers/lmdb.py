"""Reader of the ``lmdb`` format (layout in ``docs/formats/lmdb.md`` and :mod:`imgpack.lmdb_record`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from imgpack import lmdb_record
from imgpack.errors import DataError
from imgpack.readers.base import ImageDataset, Images, decode_batch, new_batch_tensor

# py-lmdb allows one Environment per file per process, so readers of the same output share one.
# Keyed by the data file's identity, so a replaced output (--overwrite) is opened afresh.
_environments: dict[tuple[str, int, int], Any] = {}
_environments_pid: int | None = None


def _environment(root: Path) -> Any:
    """This process's read-only environment for the output at ``root``."""
    import lmdb

    global _environments_pid
    if _environments_pid != os.getpid():
        # Inherited through a fork: LMDB handles must not be used in the child. Unmapping the
        # child's copy leaves the parent's untouched.
        for env in _environments.values():
            with contextlib.suppress(Exception):
                env.close()
        _environments.clear()
        _environments_pid = os.getpid()
    try:
        st = (root / "data.mdb").stat()
        ident = (str(root.resolve()), st.st_ino, st.st_mtime_ns)
        env = _environments.get(ident)
        if env is None:
            env = _environments[ident] = lmdb.open(
                str(root), readonly=True, lock=False, readahead=False, meminit=False, subdir=True
            )
    except (OSError, lmdb.Error) as exc:
        raise DataError(f"{root}: cannot open the LMDB environment: {exc}") from None
    return env


_KEY = lmdb_record.KEY_FORMAT.__mod__  # lmdb_record.key without the call overhead


class LMDBDataset(ImageDataset):
    """Dataset over an ``lmdb`` output.

    The environment opens lazily in the reading process (read-only, no lock file, no readahead,
    no meminit) and again after a fork. A batch is served from one read transaction with one
    ``Cursor.getmulti`` call; raw pixels are copied from the map straight into the batch tensor.
    """

    format = "lmdb"

    def __init__(self, root: Any, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        image = self.manifest.image
        self._raw = self.manifest.encoding == "raw"
        self._shape = (image["height"], image["width"], self.channels)
        if self._raw:
            # The fixed bytes every raw record of this output starts with, and its dimensions.
            head = lmdb_record.pack("RAW", self.channels, 0, self._shape[0], self._shape[1], b"")
            self._prefix = np.frombuffer(head[:8], np.uint8)
            self._dims = np.frombuffer(head[16:24], np.uint8)

    def _open(self) -> Any:
        return _environment(self.root)

    def _header(self, key: Any, value: Any) -> lmdb_record.RecordHeader:
        try:
            header = lmdb_record.unpack_header(value)
        except DataError as exc:
            raise DataError(f"{self.root}: record {bytes(key).decode()}: {exc}") from None
        if not 0 <= header.label < len(self.classes):
            raise DataError(
                f"{self.root}: record {bytes(key).decode()}: label {header.label} out of range"
            )
        if self._raw and (header.height, header.width, header.channels) != self._shape:
            raise DataError(
                f"{self.root}: record {bytes(key).decode()}: shape differs from the manifest"
            )
        return header

    def _raw_batch(self, keys: list[bytes], values: list[Any]) -> tuple[Images, torch.Tensor]:
        """Raw records as one batch, every header checked at once with numpy."""
        count = len(values)
        record = lmdb_record.HEADER_SIZE + int(np.prod(self._shape))
        blob = bytearray().join(values)  # the one copy out of the map
        if len(blob) != count * record:
            for key, value in zip(keys, values, strict=True):  # find the odd one out
                self._header(key, value)
            raise DataError(f"{self.root}: a record has the wrong size")
        rows = np.frombuffer(blob, np.uint8).reshape(count, record)
        labels = rows[:, 8:16].copy().view("<i8").reshape(count)
        good = (rows[:, :8] == self._prefix).all(axis=1) & (rows[:, 16:24] == self._dims).all(
            axis=1
        )
        good &= (labels >= 0) & (labels < len(self.classes))
        if not good.all():
            bad = int(np.flatnonzero(~good)[0])
            self._header(keys[bad], values[bad])  # raises the precise error
        labels_out = torch.from_numpy(labels.astype(np.int64))
        if get_worker_info() is None:
            # The batch is a view of the joined records that steps over each header.
            height, width, channels = self._shape
            images = torch.frombuffer(blob, dtype=torch.uint8).as_strided(
                (count, height, width, channels),
                (record, width * channels, channels, 1),
                lmdb_record.HEADER_SIZE,
            )
            return images.permute(0, 3, 1, 2), labels_out
        # In a DataLoader worker: into shared memory, which the hand-over needs anyway.
        out = new_batch_tensor((count, *self._shape))
        np.copyto(out.numpy().reshape(count, -1), rows[:, lmdb_record.HEADER_SIZE :])
        return out.permute(0, 3, 1, 2), labels_out

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        keys = list(map(_KEY, indices.tolist()))
        with self.handles.begin(buffers=True) as txn:
            # One read transaction for the batch. A loop of get() measured faster than
            # Cursor.getmulti() for random keys (py-lmdb 3.0), and keeps request order.
            get = txn.get
            values = [get(key) for key in keys]
            if None in values:
                missing = keys[values.index(None)]
                raise DataError(f"{self.root}: record {missing.decode()} is missing")
            if self._raw:
                return self._raw_batch(keys, values)
            labels = [
                self._header(key, value).label for key, value in zip(keys, values, strict=True)
            ]
            payloads = [bytes(value[lmdb_record.HEADER_SIZE :]) for value in values]
        images = decode_batch(
            payloads, self.channels, lambda k: f"{self.root}: record {keys[k].decode()}"
        )
        return images, torch.tensor(labels, dtype=torch.int64)

    def _load_targets(self) -> list[int]:
        with self.handles.begin(buffers=True) as txn:
            targets = [self._header(key, value).label for key, value in txn.cursor()]
        if len(targets) != len(self):
            raise DataError(
                f"{self.root}: holds {len(targets)} records, the manifest says {len(self)}"
            )
        return targets
