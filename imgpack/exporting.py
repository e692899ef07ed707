"""Writing an output back out as an image folder (``imgpack export OUT FOLDER``).

Every sample becomes ``FOLDER/<class>/<its source path below the class folder>``: the stored
bytes themselves where the output stored a JPEG or PNG, else a lossless PNG of the stored
pixels (raw outputs), named with ``.png`` added when the source name says another type
(``x.gif`` -> ``x.gif.png``). For an ``original`` output the stored bytes are the source file's
only where the conversion kept them (a JPEG or PNG that decodes to the policy's pixels as it
is); it stored a PNG of the policy's pixels for the others (EXIF-rotated JPEGs, alpha, palette,
16-bit), and that PNG is what comes back.
A sample's field values (:mod:`imgpack.fields`) become sidecar files beside its image,
``<its name without the extension>.<field>`` (text, JSON, decimal numbers, JSON lists; one absent
has none), as img2dataset writes ``x.txt`` and ``x.json``: converting the folder reads them back
(:mod:`imgpack.sources.folder.sidecars`; ``--field NAME:TYPE`` for the types other than ``txt``
and ``json``). Every class gets its folder, empty ones too, so converting the folder again gives
the same label map. The folder is written like an output: FOLDER locked, built in a temp folder beside it
and renamed into place complete, with a hidden ``.imgpack-export.json`` (ignored by the scan)
that lets ``--overwrite`` replace an earlier export.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from tqdm import tqdm

from imgpack import hf
from imgpack.errors import DataError, ImgpackError, OptionError
from imgpack.fields import Field, member_bytes
from imgpack.formats.dataset_base import ImageDataset, ReadOptions
from imgpack.images import Encoded, Kind, encode_pixels
from imgpack.options import ON_ERROR
from imgpack.publishing import (
    check_destination,
    clear_leftovers,
    inside,
    locked,
    publish,
    recover,
    temp_output,
)
from imgpack.readers import open_dataset
from imgpack.scan import IMAGE_EXTENSIONS
from imgpack.storage.destination import output_folder
from imgpack.storage.location import is_url, local_path

#: The marker an export leaves in its folder (hidden: the scan ignores it).
EXPORT_MARKER = ".imgpack-export.json"
_EXTENSIONS = {Kind.JPEG: (".jpg", ".jpeg"), Kind.PNG: (".png",)}


@dataclass
class Exported:
    """What :func:`export` wrote."""

    folder: Path
    files: int = 0
    kept: int = 0  # stored JPEG/PNG bytes written as they are
    #: Of ``kept``: PNGs the conversion stored for a source named as another type (``x.jpg.png``).
    renamed: int = 0
    encoded: int = 0  # raw records, written as a lossless PNG of the stored pixels
    skipped: list[dict[str, str]] = field(default_factory=list)


def export(
    output: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    on_error: str = "fail",
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    options: ReadOptions | None = None,
) -> Exported:
    """Write the imgpack output ``output`` as an image folder at ``folder``; see the module doc.

    ``on_error``: ``fail`` stops at the first damaged record (nothing is written); ``skip``
    leaves it out and lists it in the result (and in the marker file). Either may be a URL
    (``s3://...``): the output is read through the local cache (``options``: a
    :class:`~imgpack.formats.dataset_base.ReadOptions` with the storage options, the cache
    folder and its ``cache_limit``; the shards of ``pt``, ``tfrecord`` and ``webdataset`` outputs are fetched
    as the export reaches them), a folder in a bucket written in a scratch folder and uploaded,
    its marker last (:mod:`imgpack.storage`).
    """
    if on_error not in ON_ERROR:
        raise OptionError(f"invalid on_error {on_error!r}: expected one of {', '.join(ON_ERROR)}")
    options = ReadOptions.of(options, storage_options=storage_options, cache_dir=cache_dir)
    if is_url(folder):
        with output_folder(folder, options.storage_options, overwrite, EXPORT_MARKER) as local:
            done = export(output, local, on_error=on_error, progress=progress, options=options)
        done.folder = folder  # type: ignore[assignment]
        return done
    ds = open_dataset(output, options=replace(options, verify=True))
    _check_sidecars(ds)
    source, target = ds.root, local_path(folder)
    if inside(target, source):
        raise OptionError(f"{target}: must not be the output or inside it")
    if inside(source, target):
        raise OptionError(
            f"{target}: holds the output {source} being exported (--overwrite would delete it); "
            "export into a folder of its own"
        )
    with locked(target):
        recover(target, holding_lock=True)
        clear_leftovers(target)
        check_destination(target, overwrite, EXPORT_MARKER, "an imgpack export")
        with temp_output(target) as tmp:
            result = _write(ds, tmp, on_error, progress)
            ds.release_files()  # the shards it pinned (an output read lazily)
            marker = {
                "from": str(output).rstrip("/") if is_url(output) else str(source.resolve()),
                "output_id": ds.manifest.output_id,
                "files": result.files,
                "skipped": result.skipped,
            }
            (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            publish(tmp, target, replace=overwrite)
    result.folder = target
    return result


def _write(ds: ImageDataset, tmp: Path, on_error: str, progress: bool) -> Exported:
    manifest = ds.manifest
    result = Exported(tmp)
    for name in manifest.classes:
        try:
            (tmp / _plain(name, "class")).mkdir()
        except FileExistsError:  # two class names one folder (a case-insensitive filesystem)
            raise DataError(f"class {name!r}: its folder exists already (a name clash)") from None
        except OSError as exc:
            raise DataError(f"class {name!r}: cannot make its folder: {exc.strerror}") from None
    paths = ds.stored_paths()
    taken = _Names(set(manifest.classes))
    with tqdm(
        total=len(ds), unit="img", desc="export", file=sys.stderr, disable=not progress
    ) as bar:
        for index in range(len(ds)):
            bar.update(1)
            source = paths[index] if paths else None
            try:
                sample = next(ds.encoded(index, index + 1))
                folder = manifest.classes[sample.label] if manifest.classes else None
                name, data, kept, renamed = _file(sample, folder, source, index)
                taken.claim(name, index)
                sidecars = _sidecars(manifest.fields, sample, name)
                for sidecar, _ in sidecars:
                    taken.claim(sidecar, index)
                _create(tmp, name, data, index)
                for sidecar, content in sidecars:
                    _create(tmp, sidecar, content, index)
            except ImgpackError as exc:
                if on_error == "fail":
                    raise
                result.skipped.append({"sample": str(index), "reason": str(exc)})
                continue
            result.files += 1
            result.kept += kept
            result.renamed += renamed
            result.encoded += not kept
    return result


def _sidecars(fields: list[Field], sample: Encoded, name: str) -> list[tuple[str, bytes]]:
    """The sidecar files of an exported image ``name``: ``<its name without the extension>.<field>``
    for each field value the sample has, as a WebDataset member holds it (text, JSON, decimal
    numbers, JSON lists), what the folder source reads back (:mod:`imgpack.sources.folder.sidecars`)."""
    values = sample.fields or {}
    base = name.rsplit(".", 1)[0]
    return [
        (f"{base}.{f.name}", member_bytes(f, values[f.name]))
        for f in fields
        if values.get(f.name) is not None
    ]


def _file(
    sample: object, class_name: str | None, source: str | None, index: int
) -> tuple[str, bytes, bool, bool]:
    """``(relative name, bytes, kept, renamed)`` of one sample in the exported folder: kept,
    the stored bytes as they are; renamed, ``.png`` added to a name that says another type.
    ``class_name``: the sample's class folder (``None``: an unlabelled output, no class
    folders)."""

    assert isinstance(sample, Encoded)
    parts = PurePosixPath(source).parts if source else ()
    if parts and parts[0] == class_name:
        parts = parts[1:]
    rest = "/".join(_plain(p, "path") for p in parts) if parts else f"{index:08d}"
    name = rest if class_name is None else f"{_plain(class_name, 'class')}/{rest}"
    if sample.kind is Kind.RAW:
        pixels = np.frombuffer(sample.payload, np.uint8).reshape(
            sample.height, sample.width, sample.channels
        )
        data, kept = encode_pixels(pixels, Kind.PNG), False
        kind = Kind.PNG
    else:
        data, kept, kind = sample.payload, True, sample.kind
    renamed = not name.lower().endswith(_EXTENSIONS[kind])
    if renamed:
        name += _EXTENSIONS[kind][0]
    return name, data, kept, renamed and kept


#: The longest file name (in bytes) most filesystems take.
NAME_MAX = 255


def _plain(part: str, what: str) -> str:
    """A stored name used as a path component: never leads outside the folder, and comes back
    from ``imgpack convert`` as it went in (a hidden name would be ignored by the scan, which
    would drop the file or the whole class and change the label map)."""
    if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
        raise DataError(f"stored {what} name {part!r} cannot be a file name")
    if part.startswith("."):
        raise DataError(
            f"stored {what} name {part!r} would be a hidden file that imgpack convert (like "
            "torchvision's ImageFolder) ignores; it cannot be exported as it is"
        )
    if len(os.fsencode(part)) > NAME_MAX - 8:  # room for an added extension
        raise DataError(f"stored {what} name {part[:40]!r}... is too long for a file name")
    return part


class _Names:
    """The names an export has written: a second sample under a name already taken, or a file
    where a folder is (or the other way round), is refused, never overwritten. Names that
    differ only in case are told apart by the filesystem itself: every file is created with
    ``O_EXCL``, so on a case-insensitive one ``x.png`` after ``X.png`` is refused too."""

    def __init__(self, folders: set[str]) -> None:
        self.files: set[str] = set()
        self.folders = set(folders)

    def claim(self, name: str, index: int) -> None:
        parents = [str(p) for p in PurePosixPath(name).parents if str(p) != "."]
        if name in self.files or name in self.folders or any(p in self.files for p in parents):
            raise DataError(f"sample {index}: {name} clashes with another exported file or folder")
        self.files.add(name)
        self.folders.update(parents)


def _create(tmp: Path, name: str, data: bytes, index: int) -> None:
    """Write a new file ``tmp/name``; never replaces one (``O_EXCL``)."""
    path = tmp / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as out:
            out.write(data)
    except FileExistsError:
        raise DataError(f"sample {index}: {name} exists already (a name clash)") from None
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EILSEQ):
            raise DataError(f"sample {index}: cannot write {name}: {exc.strerror}") from None
        raise


# -- Hugging Face datasets ------------------------------------------------------------


def _check_sidecars(ds: ImageDataset) -> None:
    """Refuse fields whose sidecar files a scan would take for images (a field named like an
    image extension: ``x.webp`` beside ``x.png``)."""
    clash = [f.name for f in ds.manifest.fields if f".{f.name.lower()}" in IMAGE_EXTENSIONS]
    if clash:
        raise OptionError(
            f"{ds.root}: field(s) {', '.join(map(repr, clash))} would be sidecar files with an "
            "image's extension, read back as images: convert it with --fields naming the others "
            "first"
        )


def to_hf(output: ImageDataset | str | os.PathLike[str], cache_dir: str | None = None) -> Any:
    """An imgpack output (an open reader, or a local output folder) as a ``datasets.Dataset``
    with ``image`` (``Image``) and ``label`` (``ClassLabel``; a plain integer for an unlabelled
    output) columns and one per field (:func:`hf_feature`), in the output's order (built by a generator: bounded memory; the arrow
    files go to ``cache_dir`` or the datasets cache). :func:`imgpack.to_hf` takes URLs too."""
    datasets = hf.import_datasets()
    ds = open_dataset(output) if isinstance(output, (str, os.PathLike)) else output
    classes = list(ds.classes)
    label = datasets.ClassLabel(names=classes) if classes else datasets.Value("int64")
    columns = {f.name: hf_feature(datasets, f.type) for f in ds.manifest.fields}
    features = datasets.Features({"image": datasets.Image(), "label": label, **columns})
    # The output id in the generator's arguments: the datasets cache, keyed by them, never
    # returns the rows of an output that was replaced since.
    kwargs = {
        "reader": f"{type(ds).__module__}:{type(ds).__qualname__}",
        "root": str(Path(ds.root).resolve()),
        "output_id": ds.manifest.output_id,
    }
    return datasets.Dataset.from_generator(
        _rows, features=features, cache_dir=cache_dir, gen_kwargs=kwargs, keep_in_memory=False
    )


def _rows(reader: str, root: str, output_id: str) -> Any:
    module, _, name = reader.partition(":")
    ds = getattr(importlib.import_module(module), name)(root, verify=True)
    if ds.manifest.output_id != output_id:
        raise DataError(
            f"{root}: replaced since it was opened (output id {output_id}); open it again"
        )
    paths = ds.stored_paths()
    for index, sample in enumerate(ds.encoded(0, len(ds))):
        if sample.kind is Kind.RAW:
            pixels = np.frombuffer(sample.payload, np.uint8).reshape(
                sample.height, sample.width, sample.channels
            )
            data = encode_pixels(pixels, Kind.PNG)
        else:
            data = sample.payload
        name = paths[index] if paths else f"{index:08d}"
        row = {"image": {"bytes": data, "path": name}, "label": sample.label}
        for found in ds.manifest.fields:
            row[found.name] = hf_value(found, (sample.fields or {}).get(found.name))
        yield row


def hf_feature(datasets: Any, kind: str) -> Any:
    """The ``datasets`` feature of a field of type ``kind``: ``Value`` ``string``, ``binary``,
    ``int64`` or ``float32`` (``json``: its JSON text as a string), a ``List`` of int64 or
    float32 for the arrays."""
    if kind.endswith("[]"):
        return datasets.List(datasets.Value("int64" if kind == "int[]" else "float32"))
    names = {"str": "string", "json": "string", "bytes": "binary", "int": "int64"}
    return datasets.Value(names.get(kind, "float32"))


def hf_value(found: Field, value: Any) -> Any:
    """A field's value as its :func:`hf_feature` column holds it (``None`` stays null)."""
    if value is None:
        return None
    if found.type == "json":
        return found.encode(value).decode("utf-8")
    if found.type.endswith("[]"):
        return np.asarray(value).tolist()
    return value


__all__ = ["EXPORT_MARKER", "Exported", "export", "to_hf"]
