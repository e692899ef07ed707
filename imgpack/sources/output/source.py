"""An imgpack output as a source.

``imgpack convert OUT_A OUT_B --format F`` reads the samples of ``OUT_A`` in its order, with its
label map and the source paths it stores:

- when nothing that decides the stored bytes changes (same encoding and quality, same size,
  channels, resize, resampling and background), each record is **carried over as stored**,
  without decoding (its checksum is checked on the way): an ``original`` output keeps the
  original files' bytes through any number of hops;
- otherwise the stored image goes through the image policy again (:func:`imgpack.images.
  process_bytes` for JPEG/PNG records, :func:`~imgpack.images.process_pixels` for raw ones).

The new manifest's ``source`` records where the samples came from, and the source's own
``source`` under ``from``: the chain of conversions.

An output in a bucket is read in place, never downloaded by the driver: a scan task per data file
(:func:`scan_output_file`, on the executor's workers) opens the output by its URL, as a reader
does (a shard fetched into that machine's cache as it is read; ``lmdb``/``hdf5``, one file,
fetched whole there) and returns what the scan takes of that file's samples
(:meth:`~imgpack.formats.dataset_base.ImageDataset.shard_scan`); the driver joins them into what
the whole output's reader would give (:class:`ScannedOutput`), so the plan and the bytes are a
local copy's. Each shard task then reads its samples through its own reader of the URL.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from imgpack.errors import DataError, ImageError
from imgpack.fields import Field
from imgpack.images import Encoded, Encoding, ImagePolicy, Kind, process_bytes, process_pixels
from imgpack.manifest import MANIFEST_NAME, Manifest
from imgpack.scan import Sample, SampleTable, Scan, ShardScan, joined_paths
from imgpack.sources import listing
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    digest,
    empty_classes,
    forget,
    opened,
    relabel,
)
from imgpack.system import each_task, lends_tasks

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset


class OutputSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        if not src.is_dir():
            return False
        return (src / MANIFEST_NAME).is_file() or listing.remote_output(src) is not None

    @functools.cached_property
    def remote(self) -> tuple[str, dict[str, Any], str | None] | None:
        """An output in a bucket, read in place: its URL, storage options and the cache folder
        its readers fetch into (:func:`imgpack.sources.listing.remote_output`)."""
        return listing.remote_output(self.src) if self.src.is_dir() else None

    def scan(self, request: ScanRequest) -> Scan:
        from imgpack.readers import open_dataset

        if self.remote is None:
            ds = open_dataset(self.src, verify=False)
            return scan_reader(self.src, ds, request, _origin(ds.manifest))
        url, storage_options, cache_dir = self.remote
        manifest = listing.remote_manifest(self.src)  # read once, by the route to SRC
        names = tuple(f.name for f in _kept(manifest, request))
        found = listing.scanned_once(  # a part's or a resume's: no file read again
            self.src,
            f"output:{','.join(names)}",
            lambda: scan_output_files(
                url, storage_options, cache_dir, manifest, names, request.runner
            ),
            _shard_json,
            _shard_scan,
        )
        return scan_reader(url, ScannedOutput(manifest, found), request, _origin(manifest))

    def identity(self, scan: Scan) -> str:
        origin = scan.origin or {}
        return digest({k: origin.get(k) for k in ("output_id", "sha256")})

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        url, storage_options, cache_dir = self.remote or (str(self.src), {}, None)
        return OutputFetcher(
            url,
            carries_over(scan, policy, encoding),
            self.identity(scan),
            run,
            json.dumps(storage_options, sort_keys=True),
            cache_dir,
        )


def _origin(manifest: Manifest) -> dict[str, Any]:
    """What the new manifest records of an output read as SRC (its ``converted_from``)."""
    return {
        "format": manifest.format,
        "encoding": manifest.encoding,
        "image": dict(manifest.image),
        "options": dict(manifest.options),
        **output_identity(manifest),
        "from": dict(manifest.source),
    }


def _kept(manifest: Manifest, request: ScanRequest) -> list[Field]:
    """The fields of an output read as SRC that the conversion keeps (``--fields``)."""
    return [f for f in manifest.fields if request.fields is None or f.name in request.fields]


# -- an output in a bucket, scanned by tasks -------------------------------------------------
def scan_output_files(
    url: str,
    storage_options: dict[str, Any],
    cache_dir: str | None,
    manifest: Manifest,
    fields: tuple[str, ...],
    runner: Any = None,
) -> list[ShardScan]:
    """What the scan takes of each data file of the output at ``url`` (``manifest``; one item
    for a one-file format), in order: by ``runner``'s tasks, a file each, where the
    conversion's executor lends them (:func:`~imgpack.system.lends_tasks`), else here."""
    from imgpack.readers import reader_class

    count = len(manifest.files) if reader_class(manifest.format).lazy_files else 1
    identity = digest(output_identity(manifest))
    options = json.dumps(storage_options, sort_keys=True)
    run = uuid.uuid4().hex  # the readers these tasks open are this scan's
    items = [(url, options, cache_dir, identity, run, k, fields) for k in range(count)]
    if lends_tasks(runner):  # one file too: the driver fetches none
        named = [f"{url}/{e.path}" for e in manifest.files]
        tasks = each_task(runner, scan_output_file, items, lambda i: (named[i[5]], "reading it"))
        return [found for _, found in tasks]
    try:
        return [scan_output_file(item) for item in items]
    finally:
        forget()


def scan_output_file(
    item: tuple[str, str, str | None, str, str, int, tuple[str, ...]],
) -> ShardScan:
    """A task: :meth:`~imgpack.formats.dataset_base.ImageDataset.shard_scan` of data file
    ``number`` of the output at ``url`` (the output the driver planned from, else refused),
    read through this process's reader of it."""
    url, options, cache_dir, identity, run, number, fields = item
    ds = opened(
        run, ("output-scan", url, identity), lambda: _open(url, options, cache_dir, identity, False)
    )
    return ds.shard_scan(number, fields)


def _open(
    location: str, options: str, cache_dir: str | None, identity: str, verify: bool
) -> ImageDataset:
    """The output at ``location`` opened by its reader (a bucket's through ``cache_dir``),
    refused as changed unless it is the one ``identity`` names."""
    from imgpack.readers import open_dataset

    ds = open_dataset(
        location, storage_options=json.loads(options) or None, cache_dir=cache_dir, verify=verify
    )
    if identity and digest(output_identity(ds.manifest)) != identity:
        raise changed_source(location)
    return ds


def _shard_json(found: ShardScan) -> dict[str, Any]:
    """A data file's scan as JSON (:func:`imgpack.sources.listing.scanned_once`), each field's
    stored bytes in base64."""

    def text(data: bytes | None) -> str | None:
        return None if data is None else base64.b64encode(data).decode("ascii")

    fields = {name: [text(data) for data in stored] for name, stored in found.fields.items()}
    return {"targets": found.targets, "paths": found.paths, "sizes": found.sizes, "fields": fields}


def _shard_scan(kept: dict[str, Any]) -> ShardScan:
    def data(text: str | None) -> bytes | None:
        return None if text is None else base64.b64decode(text)

    fields = {name: [data(text) for text in stored] for name, stored in kept["fields"].items()}
    return ShardScan(list(kept["targets"]), kept["paths"], list(kept["sizes"]), fields)


class ScannedOutput:
    """An output's data files scanned apart (:func:`scan_output_files`), joined: it answers
    :func:`scan_reader` as the whole output's reader would (the same lists, made the same
    way)."""

    def __init__(self, manifest: Manifest, found: Sequence[ShardScan]) -> None:
        self.manifest = manifest
        self._found = found
        self.targets = [t for part in found for t in part.targets]

    def stored_paths(self) -> list[str] | None:
        return joined_paths([part.paths for part in self._found])

    def stored_sizes(self) -> np.ndarray:
        sizes = [s for part in self._found for s in part.sizes]
        return np.asarray(sizes, dtype=np.int64)

    def field(self, name: str) -> Any:
        from imgpack.formats.dataset_base import stored_column

        found = next(f for f in self.manifest.fields if f.name == name)
        stored = [data for part in self._found for data in part.fields[name]]
        return stored_column(found, stored)


def _fields(ds: Any, request: ScanRequest) -> tuple[list[Field], dict[str, list[Any]]]:
    """The fields of an output read as SRC (those ``--fields`` names, if given; a
    ``--field`` type instead of the stored one), and each one's values, read whole."""
    given = {f.name: f for f in request.field_types}
    kept = _kept(ds.manifest, request)
    columns: dict[str, list[Any]] = {}
    for found in kept:
        column = ds.field(found.name)
        columns[found.name] = column if isinstance(column, list) else column.tolist()  # a tensor
    return [given.get(f.name, f) for f in kept], columns


def scan_reader(src: Path | str, ds: Any, request: ScanRequest, origin: dict[str, Any]) -> Scan:
    """The scan of a dataset (an imgpack output, TFRecord files): its samples in its order, its
    label map (or ``request.classes``, remapped by name), its stored source paths and the size
    of each stored image (:meth:`~imgpack.formats.dataset_base.ImageDataset.stored_sizes`)."""
    source_classes = list(ds.manifest.classes)
    labels = [int(t) for t in ds.targets]
    stored = ds.stored_paths()
    names = (
        [plain_path(p) for p in stored]
        if stored is not None
        else [
            f"{source_classes[t] if t >= 0 else 'unlabelled'}/{i:08d}" for i, t in enumerate(labels)
        ]
    )
    classes, labels = relabel(src, source_classes, labels, request.classes)
    fields, columns = _fields(ds, request)
    sizes = ds.stored_sizes().tolist()  # what the shard plan is cut from
    samples = SampleTable()
    for index, (name, label) in enumerate(zip(names, labels, strict=True)):
        samples.add(name, label, index, size=sizes[index])
    samples.set_columns(columns)
    return Scan(
        classes=classes,
        samples=samples,
        empty_classes=empty_classes(classes, labels),
        origin=origin,
        fields=fields,
        field_names=[f.name for f in ds.manifest.fields],
    )


def output_identity(manifest: Manifest) -> dict[str, Any]:
    """What identifies an imgpack output as a source: its id and its files' sha256 (recorded in
    the scan's ``origin``, compared by every worker that opens it)."""
    return {"output_id": manifest.output_id, "sha256": [e.sha256 for e in manifest.files]}


def plain_path(path: str) -> str:
    """A stored source path as the new output records it: a NUL, which no file name and no
    HDF5 string can hold, written as ``\\x00``."""
    return path.replace("\0", "\\x00") if "\0" in path else path


def carries_over(scan: Scan, policy: ImagePolicy, encoding: Encoding) -> bool:
    """Whether the source's records can be stored as they are under these options."""
    origin = scan.origin or {}
    if origin.get("foreign") or origin.get("encoding") != encoding.name:
        return False
    if encoding.name == "jpeg" and origin.get("options", {}).get("quality") != encoding.quality:
        return False
    return bool(origin.get("image") == policy.describe())


#: What a carried-over record must hold under each encoding (``original`` keeps either).
_KINDS = {"jpeg": Kind.JPEG, "png": Kind.PNG, "raw": Kind.RAW}


@dataclass(frozen=True)
class OutputFetcher(Fetcher):
    """One sample of an imgpack output, carried over or re-encoded (see the module doc)."""

    #: The output: a local path, or a URL read in place (through ``cache_dir``).
    root: str
    carry: bool
    identity: str
    run: str
    storage_options: str = "{}"
    cache_dir: str | None = None

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        ds = opened(self.run, ("output", self.root, self.identity), self._open)
        try:  # the sample's path is the scan's: the output's paths are never read whole here
            stored = next(ds.encoded(sample.index, sample.index + 1, paths=False))
        except DataError as exc:
            raise ImageError(sample.path, f"damaged record in the source output: {exc}") from None
        stored = replace(stored, path=sample.path, label=sample.label)
        if self.carry and _KINDS.get(encoding.name, stored.kind) is stored.kind:
            return stored
        if stored.kind is Kind.RAW:
            pixels = np.frombuffer(stored.payload, np.uint8).reshape(
                stored.height, stored.width, stored.channels
            )
            return process_pixels(pixels, stored.path, stored.label, policy, encoding)
        return process_bytes(stored.payload, stored.path, stored.label, policy, encoding)

    def _open(self) -> ImageDataset:
        return _open(self.root, self.storage_options, self.cache_dir, self.identity, True)
