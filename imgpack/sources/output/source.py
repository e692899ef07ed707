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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from imgpack.errors import DataError, ImageError
from imgpack.fields import Field
from imgpack.images import Encoded, Encoding, ImagePolicy, Kind, process_bytes, process_pixels
from imgpack.manifest import MANIFEST_NAME, Manifest
from imgpack.scan import Sample, Scan
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    digest,
    empty_classes,
    opened,
    relabel,
)

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ImageDataset


class OutputSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_dir() and (src / MANIFEST_NAME).is_file()

    def scan(self, request: ScanRequest) -> Scan:
        from imgpack.readers import open_dataset

        ds = open_dataset(self.src, verify=False)
        manifest = ds.manifest
        origin: dict[str, Any] = {
            "format": manifest.format,
            "encoding": manifest.encoding,
            "image": dict(manifest.image),
            "options": dict(manifest.options),
            **output_identity(manifest),
            "from": dict(manifest.source),
        }
        return scan_reader(self.src, ds, request, origin)

    def identity(self, scan: Scan) -> str:
        origin = scan.origin or {}
        return digest({k: origin.get(k) for k in ("output_id", "sha256")})

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        return OutputFetcher(
            str(self.src), carries_over(scan, policy, encoding), self.identity(scan), run
        )


def _fields(ds: Any, request: ScanRequest) -> tuple[list[Field], dict[str, list[Any]]]:
    """The fields of an output read as SRC (those ``--fields`` names, if given; a
    ``--field`` type instead of the stored one), and each one's values, read whole."""
    given = {f.name: f for f in request.field_types}
    kept = [f for f in ds.manifest.fields if request.fields is None or f.name in request.fields]
    columns: dict[str, list[Any]] = {}
    for found in kept:
        column = ds.field(found.name)
        columns[found.name] = column if isinstance(column, list) else column.tolist()  # a tensor
    return [given.get(f.name, f) for f in kept], columns


def scan_reader(src: Path, ds: Any, request: ScanRequest, origin: dict[str, Any]) -> Scan:
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
    samples = [
        Sample(
            name,
            label,
            index,
            fields={k: v[index] for k, v in columns.items()} or None,
            size=sizes[index],
        )
        for index, (name, label) in enumerate(zip(names, labels, strict=True))
    ]
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

    root: str
    carry: bool
    identity: str
    run: str

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        ds = opened(self.run, ("output", self.root, self.identity), self._open)
        try:
            stored = next(ds.encoded(sample.index, sample.index + 1))
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
        from imgpack.readers import open_dataset

        ds = open_dataset(self.root, verify=True)
        found = digest(output_identity(ds.manifest))
        if self.identity and found != self.identity:
            raise changed_source(self.root)
        return ds
