"""The base class of every reader, and the batch fast path they share.

Readers are map-style ``torch.utils.data.Dataset`` objects that hold paths, not handles: files,
memory maps and environments open lazily in the process that reads (and again after a fork), and
are dropped when the dataset is pickled, so a reader works with ``num_workers > 0`` under fork,
spawn and forkserver.

``DataLoader`` calls ``__getitems__`` with a whole batch of indices when a dataset has it. Readers
gather the batch in one operation and return a :class:`Batch`: a sequence of ``(image, label)``
pairs that torch's default collate accepts, which also carries the gathered tensors so that
:func:`collate` can hand them over without touching each sample.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import mmap
import operator
import os
import stat
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

from imgpack.decoding import Decoder, Payload, default_threads, run_threaded
from imgpack.decoding import arrays_to_batch as arrays_to_batch  # re-exported for readers
from imgpack.decoding import new_batch_tensor as new_batch_tensor
from imgpack.decoding import scratch_tensor as scratch_tensor
from imgpack.errors import (
    DataError,
    ManifestError,
    OptionError,
)
from imgpack.fields import Field
from imgpack.formats.batch import Batch, Images, field_column, label_tensor
from imgpack.formats.checking import Record as Record  # re-exported for the readers
from imgpack.formats.checking import RecordChecks
from imgpack.formats.gather import Windows, readonly_tensor, shard_runs, void_rows
from imgpack.formats.holding import Holds
from imgpack.formats.mapping import MappedFiles
from imgpack.formats.streaming import stored_samples
from imgpack.images import Encoded, ImagePolicy
from imgpack.manifest import Manifest
from imgpack.opening import MAX_IMAGE_BYTES as MAX_IMAGE_BYTES  # re-exported
from imgpack.opening import Opened, open_output
from imgpack.opening import ReadKeywords as ReadKeywords  # re-exported for the readers
from imgpack.opening import ReadOptions as ReadOptions  # re-exported
from imgpack.opening import check_files as check_files  # re-exported for the readers
from imgpack.recipe import Crop, jpeg_header, place, unflipped_box
from imgpack.scan import UNLABELLED, ShardScan
from imgpack.scan import joined_paths as joined_paths  # re-exported for the readers
from imgpack.stats import DatasetStats, against_labels
from imgpack.storage.files import PINNED_FILES as PINNED_FILES  # re-exported
from imgpack.storage.files import FileHolder
from imgpack.storage.lazy import LazyOutput, unpin
from imgpack.stored import decode_stored, stored_shape
from imgpack.units import parse_image_size

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _Keep:
    """The default of :meth:`ImageDataset.with_options`: keep the current setting."""


_KEEP = _Keep()
_D = TypeVar("_D", bound="ImageDataset")


def integer_index(index: Any, where: str) -> int:
    """``index`` as an int, as a sequence takes it (Python, NumPy and torch integers): a float
    or a string is a ``TypeError`` naming ``where``, never rounded or parsed."""
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(
            f"{where}: an index must be an integer, not {type(index).__name__} ({index!r})"
        ) from None


def integer_indices(indices: Any, where: str) -> np.ndarray:
    """``indices`` (a sequence, a NumPy array or a tensor) as a flat int64 array: anything but
    a one-dimensional run of integers is a ``TypeError`` naming ``where`` (a float is not
    truncated, a string not parsed, a 2-D array not flattened); the range is the caller's to
    check."""
    found = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    if found.ndim != 1:  # a 2-D array is not a batch of indices: flattening it misreads
        raise TypeError(
            f"{where}: indices must be one-dimensional (a sequence of sample indices), not an "
            f"array of shape {tuple(found.shape)}"
        )
    if found.size and found.dtype.kind not in "iu":
        raise TypeError(
            f"{where}: indices must be integers, not {found.dtype} values "
            f"({found.reshape(-1)[0]!r})"
        )
    return found.astype(np.int64, copy=False)


def decoded_values(found: Field, stored: Sequence[bytes | None]) -> list[Any]:
    """Field ``found``'s values from their stored bytes (``None`` stays ``None``; a tensor each
    for ``int[]`` and ``float[]``)."""
    values = [None if data is None else found.decode(data) for data in stored]
    if found.type in ("int[]", "float[]"):
        return [None if v is None else torch.from_numpy(v) for v in values]
    return values


def stored_column(found: Field, stored: Sequence[bytes | None]) -> Any:
    """Field ``found``'s column (:meth:`ImageDataset.field`) from its values' stored bytes, in
    sample order: how every reader, and a scan that stands for one, makes it."""
    return field_column(found.type, decoded_values(found, stored))


class ImageDataset(Dataset[tuple[Any, Any]], ABC):
    """Base class of the readers: ``ds[i]`` is ``(image, label)`` with a uint8 ``(C, H, W)`` image.

    Built from ``(opened, options)``: what :func:`~imgpack.opening.open_output` opened and one
    :class:`ReadOptions`. A path may be given instead (``PTDataset("./out", transform=f)``):
    it is opened by the same route, and the keywords are :class:`ReadOptions`' fields.

    Attributes named as torchvision's ``ImageFolder``: ``classes``, ``class_to_idx``,
    ``targets``, ``samples``. A subclass sets :attr:`format` and implements **one** primitive,
    :meth:`_records` (the stored records of some indices, undecoded); everything else —
    batches (:meth:`_gather`), labels, ``encoded`` for ``merge``/``export``/convert-from,
    ``verify`` — works from it. A reader overrides only its fast paths: :meth:`_open`
    (per-process handles), :meth:`_gather`, :meth:`_load_targets`, :meth:`_load_paths` (the
    stored source paths; the default: none stored), :meth:`_raw_rows`. An abstract
    :meth:`_records` left out is refused when the class is instantiated (it is an ``ABC``).

    ``verify``: check every record's CRC-32C as it is read (``True``), never (``False``), or by
    default (``None``) every encoded record as it is read (those reads are bound by the image
    decode) and every raw record **the first time** this reader reads it: a bitmap of checked
    records, shared by the DataLoader workers forked from the process that opened the reader
    (and by every epoch of theirs), so the first epoch pays the checksums and later ones only
    a bitmap lookup per batch. A mismatch raises :class:`~imgpack.errors.DataError` naming the
    file, the sample and its source path.

    ``size``: ``N`` or ``(H, W)`` resizes every image on read (``resize``: ``crop``, the
    default, or ``stretch``, bilinear, as the conversion's ``--size``); a JPEG is decoded at the
    largest DCT scale that still covers the size first (:mod:`imgpack.decoding`).
    ``decode_threads``: threads that decode a batch of encoded images (default: this process's
    share of the usable CPUs, so DataLoader workers and threads do not oversubscribe them).
    A path may be a URL (``s3://...``): the output is fetched into the local cache
    (``cache_dir``; ``storage_options`` for the filesystem) and read from there
    (:mod:`imgpack.storage`).

    Opening checks the manifest against the files (each a regular file of the recorded size,
    sample counts adding up), so a truncated or swapped file is refused before it is mapped.
    """

    format: ClassVar[str]
    #: Whether the reader reads a bucket's output lazily (:mod:`imgpack.storage.lazy`): data files
    #: fetched when first used, through :meth:`local_file`; else the whole output is fetched
    #: into the cache when it is opened.
    lazy_files: ClassVar[bool] = False
    #: What a format's reader learns in one process as it reads (where its records lie), made
    #: empty in each process that reads (:meth:`_here`; never pickled); ``None``: nothing.
    learns: ClassVar[type[Any] | None] = None
    #: Whether the format's reader reads per-sample fields (:meth:`_stored_fields`); an output
    #: with fields is refused by one that does not, never read with them dropped.
    reads_fields: ClassVar[bool] = False

    def __init__(
        self,
        opened: Opened | str | os.PathLike[str],
        options: ReadOptions | None = None,
        **keywords: Unpack[ReadKeywords],
    ) -> None:
        #: How this reader reads: ``options``, or the keywords of :class:`ReadOptions`.
        self.options = ReadOptions.of(options, **keywords)
        transform, target_transform = self.options.transform, self.options.target_transform
        verify, size, resize = self.options.verify, self.options.size, self.options.resize
        decode_threads = self.options.decode_threads
        #: What this reader holds in the process reading it (:meth:`_here`).
        self._proc: _Process | None = None
        #: The output this reader reads, as :func:`~imgpack.opening.open_output` opened it (a
        #: path given here is opened by that route: its manifest read once).
        self.opened: Opened = open_output(opened, self.options, lazy=self.lazy_files)
        self._lazy: LazyOutput | None = self.opened.lazy
        self.root = self.opened.root
        self.manifest: Manifest = self.opened.manifest
        if self.manifest.format != self.format:
            raise ManifestError(
                f"{self.root}: holds format {self.manifest.format!r}, not {self.format!r} "
                f"(open it with imgpack.open_dataset)"
            )
        if self.manifest.fields and not self.reads_fields:  # never read with its fields dropped
            raise ManifestError(
                f"{self.root}: its samples carry fields "
                f"({', '.join(f.spec for f in self.manifest.fields)}), which this imgpack's "
                f"{self.format} reader does not read; use an imgpack that does"
            )
        #: The output's fields by name, and their positions in a record.
        self.fields: dict[str, Field] = {f.name: f for f in self.manifest.fields}
        unknown = [name for name in self.options.fields if name not in self.fields]
        if unknown:
            raise OptionError(
                f"{self.root}: has no field {', '.join(map(repr, unknown))} (its fields: "
                f"{', '.join(self.fields) or 'none'})"
            )
        #: The verify policy: which records are checked, when (:mod:`~imgpack.formats.checking`).
        self.checks = RecordChecks(
            verify, self.manifest.encoding, len(self), fields=bool(self.manifest.fields)
        )
        self.classes: list[str] = list(self.manifest.classes)
        self.class_to_idx: dict[str, int] = self.manifest.class_to_idx
        self.transform = transform
        self.target_transform = target_transform
        self.channels: int = int(self.manifest.image.get("channels", 3))
        self.size_policy = (
            ImagePolicy(size=parse_image_size(size), resize=resize) if size is not None else None
        )
        self.decoder = Decoder(self.channels, self.size_policy, decode_threads)
        self._encoded = self.manifest.encoding != "raw"
        self._targets: list[int] | None = None
        self._samples: list[tuple[str, int]] | None = None
        self._stored_paths: list[str] | None = None
        #: The epoch whose random crops a batch without one of its own gets (:meth:`set_epoch`).
        self.epoch = 0
        self._prepare()

    def _prepare(self) -> None:
        """Read what the format needs of the opened output (its index, its layout), once, in
        the process that opens it: the hook a reader implements instead of a constructor of
        its own (one that takes options of its own, ``mmap=``, keeps a constructor)."""

    def _raw_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Raw records ``indices`` for checking in one pass: their pixels ``(n, bytes)``, labels
        and stored checksums (int64), or ``None`` to check through :meth:`_records` (formats
        without such a gather, outputs written without checksums)."""
        return None

    # -- per-process handles -------------------------------------------------------------
    def _open(self) -> Any:
        """Open the files of this output in the current process (default: nothing to open;
        :meth:`_records` opens what it reads)."""
        return None

    def _close(self, handles: Any) -> None:
        """Release handles opened by :meth:`_open`."""

    @property
    def handles(self) -> Any:
        """This process's handles, opened on first use and again after a fork."""
        here = self._here()
        if not here.opened:
            here.handles, here.opened = self._open(), True
        return here.handles

    def _here(self) -> _Process:
        """What this reader holds in this process: made on first use, and made anew in a
        forked or spawned process (the one pid check; the parent's handles, pins and maps are
        the parent's: the pins' copies of its descriptors are closed here)."""
        here = self._proc
        pid = os.getpid()
        if here is None or here.pid != pid:
            if here is not None:
                here.files.drop()
            holder = self.opened.files.holder(_weak_hook(self))
            maps = MappedFiles(self._file_bytes, self.root)
            learned = self.learns() if self.learns is not None else None
            here = self._proc = _Process(pid, holder, maps, learned=learned)
        return here

    @property
    def _learned(self) -> Any:
        """What this reader learned in this process (a :attr:`learns`)."""
        return self._here().learned

    # -- files of an output read lazily (the client: :mod:`imgpack.formats.holding`) ------
    @functools.cached_property
    def holds(self) -> Holds:
        """This reader's client of its output's files (:class:`~imgpack.formats.holding.Holds`)."""
        first = self._first if self._sharded else None
        return Holds(self.opened, self.checks, first, self.options.prefetch)

    def local_file(self, name: str) -> Path:
        """The local path of the output's file ``name``: for an output read lazily from a
        bucket, fetched on first use and pinned while this reader reads it (the last
        :attr:`pinned_files` files it used in this process, and every file of a batch being
        gathered); older ones are let go, so the cache may evict them (with a cache limit
        their handles are closed too: :meth:`_release_file`)."""
        if self._lazy is None:
            return self.root / name
        return self.holds.local(self._here(), name, self.pinned_files)

    def _release_file(self, name: str) -> None:
        """Close what this process's handles hold of file ``name`` (a lazily read output lets
        the file go: the hook this reader gives its :class:`~imgpack.storage.files.FileHolder`);
        formats that keep files open override it."""

    #: Files of a lazily read output this reader keeps pinned per process, the last ones it
    #: used (``None``: :data:`~imgpack.storage.files.PINNED_FILES`); a
    #: :class:`~imgpack.loading.ShardSampler` sets its window (:meth:`pin_files`).
    pinned_files: int | None = None

    def pin_files(self, count: int) -> None:
        """Keep the last ``count`` files used pinned in each process reading (a sampler that
        reads ``count`` shards at a time sets it: they stay in the cache while it reads them,
        and no more than them, so that a cache limit can hold what every process reads)."""
        self.pinned_files = max(1, int(count))

    @property
    def fetches_ahead(self) -> bool:
        """Whether :meth:`prefetch` does anything: an output read lazily, with ``prefetch``."""
        return self._lazy is not None and self.holds.fetches_ahead

    def read_past(self, shards: Sequence[int]) -> None:
        """Shards (by number) this process's sampler has handed out for the last time this
        epoch (and the reads behind it, :attr:`~imgpack.loading.ShardSampler.lag`): the pins
        that fetching them ahead took are let go, so that the cache may evict them."""
        if self._lazy is not None:
            self.holds.read_past(self._here(), shards)

    def prefetch(self, shards: Sequence[int]) -> None:
        """Shards (by number) about to be read, in order: for an output read lazily, the next
        ``options.prefetch`` of them are fetched in the background of this process (a sampler
        calls it; nothing happens for a local output)."""
        if self._lazy is not None:
            self.holds.prefetch(self._here(), shards)

    def release_files(self) -> None:
        """Let every file this reader pinned in this process go (a lazily read output)."""
        self._here().files.release()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc"] = None  # each process holds its own
        return state

    @property
    def verify(self) -> bool:
        """Whether every read is checked against its checksum (``verify=True``, or the default
        on an encoded output: :class:`~imgpack.formats.checking.RecordChecks`)."""
        return self.checks.every

    def __del__(
        self, _getpid: Callable[[], int] = os.getpid, _close: Callable[[int], None] = os.close
    ) -> None:
        # ``os`` is bound at definition: a dataset still alive at interpreter exit is deleted
        # after the module's globals are cleared.
        here = self.__dict__.get("_proc")
        if here is None or here.pid != _getpid():
            return
        if here.opened and here.handles is not None:
            try:  # noqa: SIM105 (``contextlib`` may be gone as well)
                self._close(here.handles)
            except Exception:
                pass
        here.maps.close(_close)
        try:  # noqa: SIM105
            here.files.drop(unpin)
        except Exception:
            pass

    def _check_output(self, found: Any, where: str, number: int = 0) -> None:
        """Refuse data file ``number`` when it does not carry the output id the manifest says
        it carries: the output was replaced (``convert --overwrite``) after the reader read its
        manifest, and serving the new files with what was read from the old ones would mix two
        outputs."""
        check_output_id(self.manifest.file_output_id(number), found, where, self.root)

    # -- fields ------------------------------------------------------------------------------
    def _stored_fields(self, indices: np.ndarray) -> list[list[bytes | None]]:
        """The stored bytes of every field (in the manifest's order) of samples ``indices``:
        one list per field, ``None`` where a sample has no value. Readers that
        :attr:`reads_fields` implement it."""
        raise NotImplementedError(f"the {self.format} reader reads no fields")

    def field(self, name: str, chunk: int = 65536) -> Any:
        """The whole column of field ``name``, in sample order, without decoding an image: an
        int64 or float32 tensor for an ``int`` or ``float`` field every sample has, else a
        list (``None`` where a sample has no value; a tensor each for ``int[]`` and
        ``float[]``). Its bytes are not checked against the records' checksums, which cover
        the images too (``imgpack verify`` checks everything)."""
        found = self._field(name)
        values: list[Any] = []
        for first in range(0, len(self), chunk):
            stored = self.stored_field(name, first, min(len(self), first + chunk), chunk)
            values += decoded_values(found, stored)
        return field_column(found.type, values)

    def stored_field(
        self, name: str, start: int = 0, stop: int | None = None, chunk: int = 65536
    ) -> list[bytes | None]:
        """The stored bytes of field ``name`` of samples ``start`` to ``stop`` (default: every
        sample), in order (``None`` where a sample has none): what :meth:`field` decodes, so
        that the fields of one output's shards read apart (:meth:`shard_scan`) make its
        column."""
        position = list(self.fields).index(self._field(name).name)
        stop = len(self) if stop is None else stop
        stored: list[bytes | None] = []
        for first in range(start, stop, chunk):
            indices = np.arange(first, min(stop, first + chunk), dtype=np.int64)
            column = self._stored_fields(indices)[position]
            stored += [None if data is None else bytes(data) for data in column]
        return stored

    def _field(self, name: str) -> Field:
        found = self.fields.get(name)
        if found is None:
            raise OptionError(
                f"{self.root}: has no field {name!r} (its fields: {', '.join(self.fields) or 'none'})"
            )
        return found

    def _field_values(self, indices: np.ndarray) -> tuple[Any, ...]:
        """The columns of the fields this reader reads (``fields=``) for samples ``indices``."""
        names = self.options.fields
        if not names:
            return ()
        stored = self._stored_fields(indices)
        positions = {name: k for k, name in enumerate(self.fields)}
        return tuple(stored_column(self.fields[n], stored[positions[n]]) for n in names)

    # -- the dataset protocol ------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose random crops (``recipe=``) the next reads draw, for batches that do
        not carry theirs (:meth:`imgpack.loading.ShardSampler.batches` does, and its
        ``set_epoch`` calls this): the name ``DistributedSampler`` and Hugging Face use."""
        self.epoch = int(epoch)

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """``(C, H, W)`` of every image this reader hands out (before ``transform``): the
        recipe's or the reader's ``size``, else the output's fixed size; ``None`` when sizes
        vary."""
        if self.options.recipe is not None:
            return (self.channels, *self.options.recipe.size)
        if self.size_policy is not None and self.size_policy.size is not None:
            return (self.channels, *self.size_policy.size)
        height, width = self.manifest.image.get("height"), self.manifest.image.get("width")
        return (self.channels, height, width) if height and width else None

    @property
    def stats(self) -> DatasetStats | None:
        """The statistics its conversion recorded of the stored samples (per-channel mean and
        std, height and width distributions, samples per class: :mod:`imgpack.stats`), or
        ``None`` for an output made before imgpack recorded them."""
        if self.manifest.stats is None:
            return None
        found = DatasetStats.from_json(self.manifest.stats, len(self.manifest.classes))
        return against_labels(found, self.targets, f"{self.root}/imgpack.json")

    @property
    def targets(self) -> list[int]:
        """The label of every sample, in order."""
        if self._targets is None:
            self._targets = self._load_targets()
        return self._targets

    def _load_targets(self) -> list[int]:
        """The label of every sample (default: read from the records, a chunk at a time)."""
        labels: list[int] = []
        for first in range(0, len(self), 4096):
            indices = np.arange(first, min(len(self), first + 4096), dtype=np.int64)
            labels.extend(record.label for record in self._records(indices))
        return labels

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(path, label)`` of every sample, in order, as torchvision's ``ImageFolder`` lists
        them: each stored source path (relative to the source folder) joined to the source
        folder the manifest records. Raises :class:`~imgpack.errors.ManifestError` for an output
        that stores no source paths (``lmdb`` outputs of imgpack 0.1)."""
        if self._samples is None:
            paths = self.stored_paths()
            if paths is None:
                raise ManifestError(
                    f"{self.root}: this output stores no source paths (written by "
                    f"{self.manifest.created_by or 'an older imgpack'}); convert it again to "
                    "have them"
                )
            base = self.manifest.source.get("path")
            joined = [os.path.join(base, p) for p in paths] if base else list(paths)
            self._samples = list(zip(joined, self.targets, strict=True))
        return self._samples

    def stored_paths(self) -> list[str] | None:
        """The stored source path of every sample (relative, POSIX), read once and kept."""
        if self._stored_paths is None:
            self._stored_paths = self._load_paths()
        return self._stored_paths

    def _load_paths(self) -> list[str] | None:
        """The stored source path of every sample (relative, POSIX), or ``None`` if not stored
        (the default)."""
        return None

    def _source(self, index: int) -> str:
        """`` (source PATH)`` for an error about sample ``index``, when the path can be had."""
        try:
            paths = self._load_paths()
        except Exception:  # the output is damaged already; the error names the sample anyway
            return ""
        return f" (source {paths[index]})" if paths and 0 <= index < len(paths) else ""

    # -- one data file at a time (the scan tasks of a conversion from this output) --------
    @property
    def shard_count(self) -> int:
        """The data files :meth:`shard_scan` reads one at a time (1: a one-file output)."""
        return len(self._first) - 1 if self._sharded else 1

    def shard_scan(self, number: int, fields: Sequence[str] = ()) -> ShardScan:
        """What a conversion from this output takes of data file ``number``'s samples, read
        from that file alone (a reader of a bucket's output fetches that one): their labels,
        stored source paths, stored sizes and the stored bytes of ``fields``. The whole
        output's (:attr:`targets`, :meth:`stored_paths`, :meth:`stored_sizes`,
        :meth:`stored_field`) are these, file after file."""
        if not self._sharded:
            stored = {name: self.stored_field(name) for name in fields}
            sizes = self.stored_sizes().tolist()
            return ShardScan(list(self.targets), self.stored_paths(), sizes, stored)
        start, stop = self._first[number], self._first[number + 1]
        return ShardScan(
            self._shard_targets(number),
            self._shard_paths(number),
            self._shard_sizes(number).tolist(),
            {name: self.stored_field(name, start, stop) for name in fields},
        )

    def _shard_targets(self, number: int) -> list[int]:
        """The labels of shard ``number``'s samples (default: the whole output's, sliced; a
        sharded format reads that shard only, and its whole labels are these joined)."""
        return self.targets[self._first[number] : self._first[number + 1]]

    def _shard_paths(self, number: int) -> list[str] | None:
        """:meth:`_shard_targets` for the stored source paths."""
        paths = self.stored_paths()
        return None if paths is None else paths[self._first[number] : self._first[number + 1]]

    def _shard_sizes(self, number: int) -> np.ndarray:
        """:meth:`_shard_targets` for the stored sizes (raw pixels: their fixed size)."""
        start, stop = self._first[number], self._first[number + 1]
        if not self._encoded:
            return np.full(stop - start, self._raw_bytes, np.int64)
        return self.stored_sizes()[start:stop]

    @property
    def _raw_bytes(self) -> int:
        """The bytes of one raw image (an output of fixed size)."""
        image = self.manifest.image
        return int(image["height"]) * int(image["width"]) * self.channels

    @abstractmethod
    def _records(self, indices: np.ndarray) -> Iterator[Record]:
        """The stored records of valid sample ``indices``, in that order, without decoding."""

    def _count_shards(self, counts: Sequence[int]) -> None:
        """Where each shard's samples start (``counts[k]`` samples in shard ``k``), for
        :meth:`_shard_of` and :meth:`_locate`."""
        self._starts = np.cumsum([0, *counts], dtype=np.int64)
        self._first: list[int] = self._starts.tolist()

    def _shard_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard holding each of samples ``indices``."""
        return np.searchsorted(self._starts, indices, side="right") - 1

    def _shards(self, indices: np.ndarray) -> np.ndarray | None:
        """:meth:`_shard_of`, or ``None`` for a one-shard output (every index is a row of shard
        0): what the raw gathers take, so that the common one-shard case skips the lookup."""
        return None if len(self._starts) == 2 else self._shard_of(indices)

    @functools.cached_property
    def _file_bytes(self) -> dict[str, int]:
        """The size the manifest records for each of the output's files, by name (made once:
        an output may have thousands of shards)."""
        return {Path(e.path).name: e.bytes for e in self.manifest.files}

    @property
    def _sharded(self) -> bool:
        return getattr(self, "_starts", None) is not None

    def _touched(self, indices: np.ndarray) -> list[int]:
        """The shards samples ``indices`` lie in (0: a one-file output)."""
        return np.unique(self._shard_of(indices)).tolist() if self._sharded else [0]

    def _locate(self, index: int) -> tuple[int, int]:
        """The shard holding sample ``index`` and its place there (a bisect: one sample's
        lookup in a fraction of :meth:`_shard_of`'s time)."""
        number = bisect.bisect_right(self._first, index) - 1
        return number, index - self._first[number]

    def _one(self, index: int) -> tuple[Payload | np.ndarray, int, str]:
        """Encoded sample ``index``'s stored image (checked as ``verify`` says), its label, and
        how an error names it: what ``ds[i]`` decodes. Formats override it with a lookup
        cheaper than :meth:`_records` for one record."""
        found = self._records(np.array([index], np.int64))
        record = next(self.checks.records(self, found) if self.verify else found)
        return record.payload, record.label, f"{record.where}: sample {record.index}"

    def encoded(
        self, start: int, stop: int, chunk: int = 256, paths: bool = True
    ) -> Iterator[Encoded]:
        """Samples ``start`` to ``stop`` as a writer takes them: the stored bytes as they are
        (checksums checked), with their labels, source paths, kinds and sizes. What
        ``imgpack merge``, ``export`` and a conversion from an output stream; the default reads
        :meth:`_records` (:func:`~imgpack.formats.streaming.stored_samples`). ``paths=False``:
        each path ``""`` where the format keeps them apart from the records (read whole, they
        are every file's: a reader of a bucket's output would fetch every shard for one)."""
        return stored_samples(self, start, stop, chunk, paths)

    def stored_sizes(self, chunk: int = 4096) -> np.ndarray:
        """The bytes of every sample's stored image (int64, in order): what a conversion from
        this output plans its shards by (the raw pixels' fixed size; by default each encoded
        record read once, unchecked; formats with an index of sizes override it)."""
        if not self._encoded:
            return np.full(len(self), self._raw_bytes, np.int64)
        sizes = np.empty(len(self), np.int64)
        for first in range(0, len(self), chunk):
            indices = np.arange(first, min(len(self), first + chunk), dtype=np.int64)
            for record in self._records(indices):
                sizes[record.index] = len(record.payload)
        return sizes

    def _stored_bytes(self, record: Record) -> bytes:
        """A record's image bytes as a writer takes them: the JPEG/PNG file, or the raw HWC
        pixels (formats that wrap pixels, like WebDataset's ``.npy`` members, unwrap them)."""
        return bytes(record.payload)

    def _gather(self, indices: np.ndarray) -> tuple[Images, torch.Tensor]:
        """Images and int64 labels of valid sample ``indices`` (an int64 array), in that order.

        The default reads :meth:`_records` (checked as ``verify`` says: every read with
        ``verify=True``, by default encoded reads and each raw record once) and decodes them
        with this reader's decoder; formats override it with their fast paths."""
        if self.manifest.encoding == "raw":
            self.checks.raw(self, indices)
            records = list(self._records(indices))
            image = self.manifest.image
            shape = (int(image["height"]), int(image["width"]), self.channels)
            arrays = [
                np.frombuffer(self._stored_bytes(r), np.uint8).reshape(shape) for r in records
            ]
            return arrays_to_batch(arrays), torch.tensor(
                [r.label for r in records], dtype=torch.int64
            )
        found = self._records(indices)
        records = list(self.checks.records(self, found) if self.verify else found)
        payloads = [self._stored_bytes(r) for r in records]
        where = [f"{r.where}: sample {r.index}" for r in records]
        images = self._decode(payloads, lambda k: where[k])
        return images, label_tensor([r.label for r in records])

    def _indices(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """``indices`` as int64 positions in ``0..n-1`` (negative ones counted from the end):
        ``TypeError`` for anything but integers (a float is not truncated, a string not parsed),
        ``IndexError`` for one out of range."""
        idx = integer_indices(indices, str(self.root))
        n = len(self)
        if not idx.size or int(idx.view(np.uint64).max()) < n:  # all in 0..n-1: one pass
            return idx
        lowest = int(idx.min())
        if lowest < -n or int(idx.max()) >= n:
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"index {bad} is out of range for {self.root} ({n} samples)")
        return np.where(idx < 0, idx + n, idx) if lowest < 0 else idx

    def _decode(
        self, payloads: Sequence[bytes | memoryview], where: Callable[[int], str]
    ) -> Images:
        """A batch of stored JPEG/PNG payloads decoded by this reader's decoder (its threads
        and ``size``); ``where(k)`` names the k-th one in errors."""
        return self.decoder.batch(payloads, where)

    def memory_mapped(self) -> bool:
        """Whether a batch of this output is gathered from memory-mapped raw pixels: one memory
        copy, cheaper than handing the batch from a DataLoader worker to the training process."""
        return False

    def with_options(
        self: _D,
        *,
        size: int | tuple[int, int] | str | _Keep | None = _KEEP,
        resize: str = "crop",
        decode_threads: int | _Keep | None = _KEEP,
        recipe: Crop | _Keep | None = _KEEP,
        seed: int | _Keep = _KEEP,
    ) -> _D:
        """A copy of this reader (same files, nothing reopened until used) with other ``size``
        (and ``resize``), ``decode_threads``, ``recipe`` or ``seed``; what is not given stays
        (a ``recipe`` replaces a ``size``, and the other way round)."""
        other = copy.copy(self)
        other.__dict__.update(self.__getstate__())  # no handles of this process shared
        if not isinstance(recipe, _Keep):
            kept = other.options.size if recipe is None else None
            other.options = replace(other.options, recipe=recipe, size=kept)
            if recipe is not None and isinstance(size, _Keep):
                size = None  # the recipe's crop has its size (both given: refused below)
        if not isinstance(seed, _Keep):
            other.options = replace(other.options, seed=seed)
        if not isinstance(size, _Keep):
            other.options = replace(other.options, size=size, resize=resize)
        if not isinstance(decode_threads, _Keep):
            other.options = replace(other.options, decode_threads=decode_threads)
        if not isinstance(size, _Keep):
            other.size_policy = (
                ImagePolicy(size=parse_image_size(size), resize=resize)
                if size is not None
                else None
            )
        threads = self.decoder.threads if isinstance(decode_threads, _Keep) else decode_threads
        other.decoder = Decoder(
            self.decoder.channels, other.size_policy, threads, self.decoder.foreign
        )
        return other

    def _fetch(self, indices: np.ndarray, epoch: int | None = None) -> tuple[Images, torch.Tensor]:
        """:meth:`_gather`, resized to ``size`` where the reader has one and the stored images
        are another size (raw outputs; encoded ones are resized as they are decoded)."""
        if self.options.recipe is not None:
            return self._cropped(indices, self.epoch if epoch is None else epoch)
        if not len(indices):  # an empty batch: no file is touched
            shape = self.image_shape
            empty: Images = torch.empty((0, *shape), dtype=torch.uint8) if shape is not None else []
            return empty, torch.empty(0, dtype=torch.int64)
        # The files of a batch stay pinned and open until it is gathered: a batch that spans
        # two windows of ShardSampler touches more of them than PINNED_FILES, and letting the
        # first go while the last are read would fetch and open them again.
        here = self._here()
        here.batch_depth += 1
        try:
            here.maps.check(lambda: self._touched(indices))
            if self._lazy is not None and self.checks.once:  # fetched here: checked whole
                self.holds.hold_batch(here, self._touched(indices), self.pinned_files)
            images, labels = self._gather(indices)
        finally:
            here.batch_depth -= 1
            if not here.batch_depth:
                here.files.trim(self.pinned_files)
        size = self.decoder.size
        if size is None or (isinstance(images, torch.Tensor) and tuple(images.shape[2:]) == size):
            return images, labels
        pixels = [img.permute(1, 2, 0).numpy() for img in images]
        return self.decoder.batch(pixels, lambda k: f"{self.root}: sample {indices[k]}"), labels

    def _cropped(self, indices: np.ndarray, epoch: int) -> tuple[Images, torch.Tensor]:
        """Samples ``indices`` under the recipe's random crop in ``epoch``: each box drawn from
        the stored image's size before it is decoded (:mod:`imgpack.recipe`), the decode doing
        what the box needs (a JPEG at the smallest DCT scale that covers it), resized to the
        recipe's size and flipped, on the decode threads."""
        recipe = self.options.recipe
        assert recipe is not None
        items: list[Any]
        headers: list[Any]
        here = self._here()
        here.batch_depth += 1
        try:
            here.maps.check(lambda: self._touched(indices))
            if self._encoded:
                found = self._records(indices)
                records = list(self.checks.records(self, found) if self.verify else found)
                items = [record.payload for record in records]
                labels = torch.tensor([record.label for record in records], dtype=torch.int64)
                names = [f"{record.where}: sample {record.index}" for record in records]
                # A JPEG's header is read once: for its size (the box) and for its decode.
                headers = [jpeg_header(item, self.channels) for item in items]
                sizes = [
                    (h[0], h[1]) if h is not None else self._stored_size(i, n)
                    for h, i, n in zip(headers, items, names, strict=True)
                ]
            else:
                images, labels = self._gather(indices)
                items = [image.permute(1, 2, 0).numpy() for image in images]
                headers = [None] * len(items)
                names = [f"{self.root}: sample {index}" for index in indices.tolist()]
                sizes = [item.shape[:2] for item in items]
        finally:
            here.batch_depth -= 1
            if not here.batch_depth:
                here.files.trim(self.pinned_files)
        heights = np.array([size[0] for size in sizes], np.int64)
        widths = np.array([size[1] for size in sizes], np.int64)
        boxes = recipe.boxes(self.options.seed, epoch, indices, heights, widths)
        # (B, C, H, W) in that order in memory: the crops torch resizes come out planar, and are
        # then placed with a plain copy (a transposing one costs half their resize).
        out = new_batch_tensor((len(indices), self.channels, *recipe.size))

        def crop(k: int) -> None:
            box = (boxes.top[k], boxes.left[k], boxes.height[k], boxes.width[k])
            try:
                pixels = unflipped_box(items[k], self.channels, box, recipe.size, headers[k])
                place(pixels, out[k], bool(boxes.flip[k]))
            except DataError as exc:
                raise DataError(f"{names[k]}: {exc}") from None

        threads = self.decoder.threads or default_threads()
        run_threaded(len(items), crop, threads if self._encoded else 1)
        return out, labels

    def _stored_size(self, item: Any, where: str) -> tuple[int, int]:
        """The (H, W) a stored record decodes to: from its header, else from its decode."""
        shape = stored_shape(item, self.channels)
        if shape is None:
            try:
                shape = decode_stored(item, self.channels).shape
            except DataError as exc:
                raise DataError(f"{where}: {exc}") from None
        return int(shape[0]), int(shape[1])

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        i, n = integer_index(index, str(self.root)), len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {self.root} ({n} samples)")
        image: Any
        label: Any
        if self._encoded and self.options.recipe is None:  # one record, nothing batched
            image, label = self._read_one(i + n if i < 0 else i)
        else:
            images, labels = self._fetch(np.array([i + n if i < 0 else i], np.int64))
            image, label = images[0], int(labels[0])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        if self.options.fields:
            columns = self._field_values(np.array([i + n if i < 0 else i], np.int64))
            return (image, label, *(_first(c) for c in columns))
        return image, label

    def _read_one(self, index: int) -> tuple[torch.Tensor, int]:
        """Encoded sample ``index`` decoded: :meth:`_one`, then the decoder (its ``size``)."""
        here = self._here()
        here.batch_depth += 1  # its file stays pinned until it is read (as in _fetch)
        try:
            here.maps.check(lambda: [self._locate(index)[0]] if self._sharded else [0])
            item, label, where = self._one(index)
            return self.decoder.single(item, where), label
        finally:
            here.batch_depth -= 1
            if not here.batch_depth:
                here.files.trim(self.pinned_files)

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        """Fetch a whole batch at once (``DataLoader`` calls this when it exists)."""
        epoch = getattr(indices, "epoch", None)  # a batch drawn for its epoch (EpochIndices)
        done = getattr(indices, "done", None)  # the shards its sampler is done with
        if done is not None and self._lazy is not None:
            self.holds.let_go(self._here(), done)
        wanted = self._indices(indices)
        images, labels = self._fetch(wanted, epoch)
        columns = self._field_values(wanted)
        if self.transform is None and self.target_transform is None:
            return Batch(images, labels, columns)
        imgs: list[Any] = list(images)
        targets: list[Any] = labels.tolist()
        if self.transform is not None:
            imgs = [self.transform(img) for img in imgs]
        if self.target_transform is not None:
            targets = [self.target_transform(t) for t in targets]
        return Batch(imgs, targets, columns)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={str(self.root)!r}, samples={len(self)}, "
            f"classes={len(self.classes)}, encoding={self.manifest.encoding!r})"
        )


def _first(column: Any) -> Any:
    value = column[0]
    return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value


class PreadDataset(ImageDataset):
    """A reader whose records are read with ``os.pread`` from an output's shard files: file
    descriptors open on first use in the reading process. Subclasses set :attr:`shard_files`."""

    shard_files: list[Path]

    def _open(self) -> ShardFiles:
        return ShardFiles()

    def _close(self, handles: Any) -> None:
        closers = [m.close for m in handles.maps.values()]
        closers += [functools.partial(os.close, fd) for fd in handles.fds.values()]
        for close in closers:  # each one, whatever another raised
            with contextlib.suppress(Exception):
                close()

    def _mapped(self, number: int) -> mmap.mmap | bytes:
        """Shard ``number`` memory-mapped (read-only): records are sliced from it as bytes,
        with no system call per record."""
        files = self.handles
        mapped = files.maps.get(number)
        if mapped is None:
            fd = self._fd(number)
            if os.fstat(fd).st_size == 0:
                return b""
            mapped = files.maps[number] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            self._here().maps.note(number, self._local(number))
        return mapped

    def _windows(self, number: int, width: int) -> Windows:
        """Shard ``number``'s bytes as rows of ``width`` bytes at any offset (no copy), made
        once per shard, width and process."""
        windows = self.handles.windows
        found = windows.get((number, width))
        if found is None:
            found = windows[(number, width)] = Windows(self._mapped_tensor(number), width)
        return found

    def _rows_into(self, number: int, starts: np.ndarray, out: torch.Tensor) -> None:
        """Row ``k`` of ``out`` (a contiguous ``(n, width)`` uint8 tensor) is the ``width``
        bytes of shard ``number`` at offset ``starts[k]`` (offsets inside the file, as its
        checked index gives them): one gather (:meth:`Windows.take`)."""
        self._windows(number, out.shape[1]).take(starts, out)

    def _mapped_tensor(self, number: int) -> torch.Tensor:
        """Shard ``number``'s bytes as a uint8 tensor over its memory map (read only), made
        once per shard and process."""
        tensors = self.handles.tensors
        found = tensors.get(number)
        if found is None:
            found = tensors[number] = readonly_tensor(np.frombuffer(self._mapped(number), np.uint8))
        return found

    def _gather_rows(
        self, shard_of: np.ndarray | None, starts: np.ndarray, out: torch.Tensor
    ) -> None:
        """:meth:`_rows_into` for a batch whose rows lie in shards ``shard_of`` (``None``: all
        in shard 0) at ``starts``: straight into ``out`` from one shard. From two, one of them
        holding at least half the batch (a webdataset output's default two shards): the whole
        batch is gathered from that one in one call, the other's rows standing in for one of
        its own (a call costs more than a few hot rows' copy), then the other's rows put over
        them with one numpy assignment (a memcpy a row: for a minority of rows cheaper than
        another ``index_select`` into scratch space and a copy from there). Otherwise each
        shard's rows are gathered with one numpy assignment, straight into their places."""
        if shard_of is None:
            self._rows_into(0, starts, out)
            return
        counts = np.bincount(shard_of)
        first = int(counts.argmax())
        if counts[first] == len(shard_of):
            self._rows_into(first, starts, out)
            return
        target, width = void_rows(out.numpy()), out.shape[1]
        if 2 * counts[first] >= len(shard_of) and np.count_nonzero(counts) == 2:
            elsewhere = shard_of != first
            others = np.flatnonzero(elsewhere)
            filled = starts.copy()
            filled[others] = starts[int(elsewhere.argmin())]
            self._rows_into(first, filled, out)
            other = int(shard_of[others[0]])
            target[others] = self._windows(other, width).rows[starts[others]]
            return
        order, runs = shard_runs(shard_of)
        ordered = starts[order]
        for number, start, stop in runs:
            target[order[start:stop]] = self._windows(number, width).rows[ordered[start:stop]]

    def _local(self, number: int) -> Path:
        """Shard ``number``'s local path (fetched first, for an output read lazily)."""
        path = self.shard_files[number]
        if self._lazy is None:
            return path
        return self.local_file(path.relative_to(self.root).as_posix())

    def _release_file(self, name: str) -> None:
        files = self.handles
        for number, path in enumerate(self.shard_files):
            if path.relative_to(self.root).as_posix() != name:
                continue
            files.tensors.pop(number, None)
            for key in [k for k in files.windows if k[0] == number]:
                del files.windows[key]
            mapped = files.maps.pop(number, None)
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a batch still views it: it goes later
                    mapped.close()
            fd = files.fds.pop(number, None)
            if fd is not None:
                os.close(fd)
            self._here().maps.forget(number)

    def _fd(self, number: int) -> int:
        fds = self.handles.fds
        if number not in fds:
            path = self._local(number)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            except OSError as exc:
                raise DataError(
                    f"{self.shard_files[number]}: cannot open: {exc.strerror}"
                ) from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise DataError(f"{self.shard_files[number]}: not a regular file")
                self._check_shard(number, fd)
            except BaseException:
                os.close(fd)
                raise
            fds[number] = fd
        return int(fds[number])

    def _check_shard(self, number: int, fd: int) -> None:
        """Check a shard file just opened (its output id); formats that store one override it."""


@dataclass
class ShardFiles:
    """A :class:`PreadDataset`'s handles in one process: file descriptors and memory maps of
    its shards, by shard number, opened on first use."""

    fds: dict[int, int] = field(default_factory=dict)
    maps: dict[int, mmap.mmap] = field(default_factory=dict)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # the maps' bytes
    windows: dict[tuple[int, int], Windows] = field(default_factory=dict)  # by shard, width


def _weak_hook(reader: ImageDataset) -> Callable[[str], None]:
    """``reader._release_file``, held weakly: the files' holder lives on the reader, and a strong
    hook would make a cycle that keeps a dropped reader (its LMDB environment, its maps) alive
    until a garbage collection."""
    method = weakref.WeakMethod(reader._release_file)

    def release(name: str) -> None:
        hook = method()
        if hook is not None:
            hook(name)

    return release


@dataclass
class _Process:
    """What a reader holds in one process (:meth:`ImageDataset._here`): never pickled, never
    shared with another process (a forked one makes its own)."""

    pid: int
    #: What the reader holds of the output's files here (pins of a lazily read output).
    files: FileHolder
    #: Files memory-mapped here, checked before each read (the SIGBUS guard).
    maps: MappedFiles
    #: The handles :meth:`ImageDataset._open` gave (``opened``: whether it was called).
    handles: Any = None
    opened: bool = False
    #: Batches being gathered now (their files stay pinned until they are read).
    batch_depth: int = 0
    #: What the format's reader learned here (:attr:`ImageDataset.learns`): where records lie,
    #: found while reading them; ``None`` for readers that keep nothing.
    learned: Any = None
    #: Files fetched here whose records were marked checked (:class:`~imgpack.formats.holding.Holds`).
    checked_whole: set[str] = field(default_factory=set)


def check_file_order(root: Path, manifest: Manifest, name: Callable[[int, int], str]) -> None:
    """The manifest of a sharded output must list its shards under the names its writer gives
    them, in order (``name(number, total)``): a manifest whose files were reordered or renamed
    would serve one shard's samples for another's. In an appended output, ``total`` is the
    count of shards when a shard was written: the end of the run of shards that carry its id."""
    total, first = len(manifest.files), 0
    part = manifest.part if isinstance(manifest.part, dict) else {}
    if type(part.get("first_shard")) is int and type(part.get("shards")) is int:
        # A part written by shard tasks: shards first.. of the whole output's (merging.py).
        first, total = part["first_shard"], part["shards"]
    ends = [total] * len(manifest.files)
    for number in range(len(manifest.files) - 2, -1, -1):  # each version's last shard, back
        same = manifest.file_output_id(number) == manifest.file_output_id(number + 1)
        ends[number] = ends[number + 1] if same else first + number + 1
    for number, entry in enumerate(manifest.files):
        total = ends[number]
        if entry.path != name(first + number, total):
            raise ManifestError(
                f"{root}: the manifest lists {entry.path} as shard {number}, which its writer "
                f"names {name(first + number, total)} (the manifest's files were edited or "
                "reordered)"
            )


def check_output_id(expected: str, found: Any, where: str, root: Path) -> None:
    """Raise :class:`DataError` when a data file's output id ``found`` is not the ``expected``
    one of the manifest a reader opened (no check for outputs written without ids)."""
    if isinstance(found, bytes):
        found = found.decode("ascii", "replace")
    if expected and found != expected:
        raise DataError(
            f"{where}: belongs to another output (id {found or 'none'}, this reader opened "
            f"{expected}): {root} was replaced after it was opened; open it again"
        )


def check_labels(labels: np.ndarray, count: int, num_classes: int) -> str | None:
    """What is wrong with a stored ``labels`` array of an output of ``count`` samples and
    ``num_classes`` classes, or ``None``."""
    if labels.shape != (count,):
        return f"labels has shape {tuple(labels.shape)}, expected ({count},)"
    if not num_classes:  # an unlabelled output: every label is UNLABELLED
        if count and (labels != UNLABELLED).any():
            return f"labels other than {UNLABELLED} in an output without classes"
        return None
    if count and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        return f"labels outside 0..{num_classes - 1}"
    return None


def check_offsets(offsets: np.ndarray, count: int, data_bytes: int) -> str | None:
    """What is wrong with the ``offsets`` of a ``data`` + ``offsets`` layout (sample ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``), or ``None``."""
    if offsets.shape != (count + 1,) or int(offsets[0]) != 0 or int(offsets[-1]) != data_bytes:
        return "offsets do not match the data"
    if bool((offsets[1:] < offsets[:-1]).any()):
        return "offsets are not increasing"
    return None


def decode_batch(
    payloads: Sequence[bytes | memoryview],
    channels: int,
    where: Callable[[int], str],
    threads: int | None = None,
) -> Images:
    """Decode stored JPEG/PNG payloads into a batch (see :class:`imgpack.decoding.Decoder`).

    ``where(k)`` names the k-th payload (file and sample or key) in the error a damaged one raises.
    """
    return Decoder(channels, threads=threads).batch(payloads, where)
