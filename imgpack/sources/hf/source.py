"""A Hugging Face dataset folder as a source (the ``[hf]`` extra; everything works offline).

SRC is a folder written by ``Dataset.save_to_disk`` (``state.json``, ``dataset_info.json``, arrow
files) — or, through :func:`imgpack.convert`, a ``datasets.Dataset`` object, written to a temp
folder beside DST first. The image column is the one whose feature is ``Image`` and the label
column the one that is a ``ClassLabel`` (or ``-s image_column=`` / ``-s label_column=``, also
``--image-column`` / ``--label-column``); the label map is the ``ClassLabel``'s names, in their
order. The other columns are per-sample fields (:mod:`imgpack.fields`, typed from their
features: :func:`field_type`). A ``DatasetDict`` folder (``dataset_dict.json``) is converted split by split with
``--splits``. Each image's bytes go through the image policy as a folder's files would; a
sample's source path is ``<class>/<the image's file name>`` (``<class>/<index>.png`` when it has
none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpack.errors import ImageError, ScanError
from imgpack.fields import Field
from imgpack.hf import dict_splits, import_datasets, is_dataset_dict_folder
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes
from imgpack.manifest import sha256_file
from imgpack.scan import MAX_CLASSES, Sample, SampleTable, Scan
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    digest,
    empty_classes,
    kept_fields,
    opened,
    relabel,
)


def is_dataset_folder(src: Path) -> bool:
    return (src / "state.json").is_file() and (src / "dataset_info.json").is_file()


class HFSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return is_dataset_folder(src) or is_dataset_dict_folder(src)

    def scan(self, request: ScanRequest) -> Scan:
        if is_dataset_dict_folder(self.src):
            raise ScanError(
                f"{self.src}: a Hugging Face DatasetDict (splits "
                f"{', '.join(dict_splits(self.src))}): use --splits to convert each split into "
                "DST/<split> with one label map"
            )
        ds, image = load(self.src, self.settings.get("image_column"))
        label = column(ds.features, self.settings.get("label_column"), "ClassLabel")
        labels = [int(v) for v in ds[label]]
        names = class_names(ds.features, label, labels)
        # The file names only, straight from the arrow column: the image bytes stay on disk.
        import pyarrow.compute as pc  # type: ignore[import-untyped,import-not-found,unused-ignore]

        images = ds.data.column(image)
        files = [
            os.path.basename(path) if path else None
            for path in pc.struct_field(images, "path").to_pylist()
        ]
        # Each image's stored bytes, what the shard plan is cut from (-1: kept as a path only).
        lengths = pc.binary_length(pc.struct_field(images, "bytes")).to_pylist()
        sizes = [-1 if n is None else int(n) for n in lengths]
        unique = len({f for f in files if f}) == len(files)
        paths = [
            f"{names[t]}/{f}" if unique and f else f"{names[t]}/{i:08d}.png"
            for i, (t, f) in enumerate(zip(labels, files, strict=True))
        ]
        classes, labels = relabel(self.src, names, labels, request.classes)
        fields, every = hf_fields(ds, (image, label), request)
        samples = SampleTable()
        for i, (p, t) in enumerate(zip(paths, labels, strict=True)):
            samples.add(p, t, i, size=sizes[i])
        return Scan(
            classes=classes,
            samples=samples,
            empty_classes=empty_classes(classes, labels),
            origin={
                "format": "huggingface",
                "image_column": image,
                "label_column": label,
                "state_sha256": state_sha256(self.src),
            },
            fields=fields,
            field_names=every,
        )

    def stored_size(self, sample: Sample) -> int:
        return -1  # an image kept as a path only (no bytes in the column): planned as empty

    def identity(self, scan: Scan) -> str:
        return digest((scan.origin or {}).get("state_sha256"))

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        column = (scan.origin or {})["image_column"]
        return HFFetcher(str(self.src), column, self.identity(scan), run, tuple(scan.fields))


def field_type(feature: Any) -> str | None:
    """The field type of a column's feature: ``Value`` strings ``str``, binary ``bytes``,
    integers (and a ``ClassLabel``) ``int``, floats ``float``, booleans ``json``; a list of
    integers ``int[]``, of floats ``float[]``; other lists and dicts ``json``. ``None`` for
    what no field type holds (an ``Image``, ``Audio``, a timestamp)."""
    datasets = import_datasets()
    if isinstance(feature, datasets.ClassLabel):
        return "int"
    if isinstance(feature, datasets.Value):
        dtype = str(feature.dtype)
        if dtype in ("string", "large_string"):
            return "str"
        if dtype in ("binary", "large_binary"):
            return "bytes"
        if dtype.startswith(("int", "uint")):
            return "int"
        if dtype.startswith("float"):
            return "float"
        return "json" if dtype == "bool" else None
    inner = getattr(feature, "feature", None)
    if isinstance(feature, list) and len(feature) == 1:
        inner = feature[0]
    if inner is not None:
        kind = field_type(inner)
        if kind in ("int", "float") and not isinstance(inner, datasets.ClassLabel):
            return f"{kind}[]"
        return "json" if kind in ("str", "int", "float", "json") else None
    if isinstance(feature, dict):
        kinds = [field_type(v) for v in feature.values()]
        return "json" if all(k in ("str", "int", "float", "json") for k in kinds) else None
    return None


def hf_fields(ds: Any, own: tuple[str, ...], request: ScanRequest) -> tuple[list[Field], list[str]]:
    """The dataset's other columns as fields (those ``--fields`` names, if given; each of the
    type ``--field`` gives, else :func:`field_type`'s), optional where a row holds null; and
    the names of all of them."""
    every = [name for name in ds.features if name not in own]

    def infer(name: str) -> Field:
        kind = field_type(ds.features[name])
        if kind is None:
            raise ScanError(
                f"column {name!r} cannot be kept as a field: its feature "
                f"{ds.features[name]!r} is no field type; --fields NAME,... keeps only the ones "
                "it names"
            )
        return Field(name, kind, optional=ds.data.column(name).null_count > 0)

    fields = kept_fields(every, request, infer, lambda name: f"column {name!r}")
    return fields, every


def column(features: Any, given: str | None, kind: str) -> str:
    """The column named ``given``, else the first whose feature is ``kind`` (``Image`` or
    ``ClassLabel``)."""
    datasets = import_datasets()
    if given is not None:
        if given not in features:
            raise ScanError(f"no column {given!r} (columns: {', '.join(features)})")
        return given
    wanted = getattr(datasets, kind)
    found = next((n for n, f in features.items() if isinstance(f, wanted)), None)
    if found is None:
        flag = "--image-column" if kind == "Image" else "--label-column"
        raise ScanError(
            f"no column of type {kind} (columns: {', '.join(features)}); name it with {flag}"
        )
    return str(found)


def class_names(features: Any, label: str, labels: list[int]) -> list[str]:
    datasets = import_datasets()
    feature = features[label]
    if isinstance(feature, datasets.ClassLabel):
        return [str(name) for name in feature.names]
    if labels and min(labels) < 0:
        raise ScanError(f"column {label!r} holds negative labels")
    if labels and max(labels) >= MAX_CLASSES:
        raise ScanError(
            f"column {label!r} holds label {max(labels)}, beyond the {MAX_CLASSES:,} classes "
            "imgpack takes"
        )
    return [str(i) for i in range(max(labels) + 1)] if labels else []


def load(root: Path, image_column: str | None) -> tuple[Any, str]:
    """The saved dataset at ``root`` with its image column's bytes undecoded."""
    datasets = import_datasets()
    ds = datasets.load_from_disk(str(root))
    if isinstance(ds, datasets.DatasetDict):
        raise ScanError(
            f"{root}: a DatasetDict (splits {', '.join(ds)}): use --splits to convert each split "
            "into DST/<split> with one label map"
        )
    image = column(ds.features, image_column, "Image")
    return ds.cast_column(image, datasets.Image(decode=False)), image


def state_sha256(root: Path) -> str:
    """What identifies a saved dataset's contents: the sha256 of its ``state.json`` (which
    lists its arrow files and their fingerprint)."""
    return sha256_file(root / "state.json")


@dataclass(frozen=True)
class HFFetcher(Fetcher):
    """One row's image through the image policy."""

    root: str
    column: str
    identity: str
    run: str
    #: The fields kept: each the row's value of that column.
    fields: tuple[Field, ...] = ()

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        dataset = opened(self.run, ("hf", self.root, self.column, self.identity), self._open)
        row = dataset[sample.index]
        item = row[self.column]
        data = item.get("bytes") if item else None
        if not data:
            where = item.get("path") if item else None
            if not where:
                raise ImageError(sample.path, "the row has no image bytes")
            try:
                data = Path(where).read_bytes()
            except OSError as exc:
                raise ImageError(sample.path, f"cannot read {where}: {exc.strerror}") from None
        encoded = process_bytes(data, sample.path, sample.label, policy, encoding)
        if self.fields:
            encoded.fields = {f.name: row[f.name] for f in self.fields}
        return encoded

    def _open(self) -> Any:
        """The saved dataset, refused when it is not the one the run planned."""
        root = Path(self.root)
        try:
            state = state_sha256(root)
        except OSError:
            state = ""
        if self.identity and digest(state) != self.identity:
            raise changed_source(self.root)
        return load(root, self.column)[0]
