"""A Hugging Face dataset folder as a source (the ``[hf]`` extra; everything works offline).

SRC is a folder written by ``Dataset.save_to_disk`` (``state.json``, ``dataset_info.json``, arrow
files) — or, through :func:`imgpack.convert`, a ``datasets.Dataset`` object, written to a temp
folder beside DST first. The image column is the one whose feature is ``Image`` and the label
column the one that is a ``ClassLabel`` (or ``-s image_column=`` / ``-s label_column=``, also
``--image-column`` / ``--label-column``); the label map is the ``ClassLabel``'s names, in their
order. A ``DatasetDict`` folder (``dataset_dict.json``) is converted split by split with
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
from imgpack.hf import dict_splits, import_datasets, is_dataset_dict_folder
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes
from imgpack.manifest import sha256_file
from imgpack.scan import MAX_CLASSES, Sample, Scan
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

        files = [
            os.path.basename(path) if path else None
            for path in pc.struct_field(ds.data.column(image), "path").to_pylist()
        ]
        unique = len({f for f in files if f}) == len(files)
        paths = [
            f"{names[t]}/{f}" if unique and f else f"{names[t]}/{i:08d}.png"
            for i, (t, f) in enumerate(zip(labels, files, strict=True))
        ]
        classes, labels = relabel(self.src, names, labels, request.classes)
        return Scan(
            classes=classes,
            samples=[Sample(p, t, i) for i, (p, t) in enumerate(zip(paths, labels, strict=True))],
            empty_classes=empty_classes(classes, labels),
            origin={
                "format": "huggingface",
                "image_column": image,
                "label_column": label,
                "state_sha256": state_sha256(self.src),
            },
        )

    def identity(self, scan: Scan) -> str:
        return digest((scan.origin or {}).get("state_sha256"))

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        column = (scan.origin or {})["image_column"]
        return HFFetcher(str(self.src), column, self.identity(scan), run)


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

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        dataset = opened(self.run, ("hf", self.root, self.column, self.identity), self._open)
        item = dataset[sample.index][self.column]
        data = item.get("bytes") if item else None
        if not data:
            where = item.get("path") if item else None
            if not where:
                raise ImageError(sample.path, "the row has no image bytes")
            try:
                data = Path(where).read_bytes()
            except OSError as exc:
                raise ImageError(sample.path, f"cannot read {where}: {exc.strerror}") from None
        return process_bytes(data, sample.path, sample.label, policy, encoding)

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
