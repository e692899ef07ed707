"""WebDataset shards other tools wrote, as a source (tars without an imgpack manifest).

SRC is a ``.tar`` file, a folder of ``.tar`` files (sorted by name) or a glob. Members are
grouped into samples by key as the ``webdataset`` package does (the member name up to the first
dot of its base name: ``000123.jpg``, ``000123.cls``), in the order the tars hold them. A sample's
image is its first member with an image extension (``jpg``, ``png``, ``webp``, ...); its label
is the integer in ``key.cls``, else the ``"label"`` of ``key.json`` (an integer or a class name);
see :func:`imgpack.sources.base.label_map` for the label map. A sample's source path is
``<tar name>/<image member name>``. A sample without an image or a label, or a key that appears
twice, stops the run naming it (``--on-error skip`` records it and goes on).
"""

from __future__ import annotations

import glob
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpack.errors import DataError, ImageError, OptionError, ScanError, first_line
from imgpack.fields import Field, member_value
from imgpack.images import Encoded, Encoding, ImagePolicy, process_bytes
from imgpack.scan import UNLABELLED, Sample, Scan
from imgpack.sources.base import (
    Fetcher,
    ScanRequest,
    Source,
    changed_source,
    empty_classes,
    files_identity,
    has_subfolders,
    kept_fields,
    label_map,
    opened,
)

#: Member extensions (lower case) taken for a sample's image.
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm")


def tar_files(src: str | os.PathLike[str]) -> list[Path] | None:
    """The ``.tar`` files ``src`` names (a file, a folder of them, a glob), or ``None``."""
    text = os.fspath(src)
    if any(ch in text for ch in "*?["):
        found = [Path(p) for p in sorted(glob.glob(text)) if p.endswith(".tar")]
        return found or None
    path = Path(text)
    if path.is_file():
        return [path] if path.suffix == ".tar" else None
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".tar")
        return found or None
    return None


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name, as the ``webdataset`` package splits it."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext if dot else ""


class WebDatasetSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return not has_subfolders(src) and bool(tar_files(src))

    def check(self) -> None:
        if not tar_files(self.src):
            raise FileNotFoundError(f"{self.src}: names no .tar file")

    def files(self) -> list[Path]:
        files = tar_files(self.src) or []
        names = [p.name for p in files]
        if len(set(names)) != len(names):
            raise ScanError(f"{self.src}: names two tar files of one name (source paths start "
                            "with the tar's name): convert them separately")  # fmt: skip
        return files

    @property
    def labelled(self) -> bool:
        return bool(self.settings.get("labels", True))

    def scan(self, request: ScanRequest) -> Scan:
        # (source path, label value, extensions, the image member's size)
        found: list[tuple[str, Any, list[str], int]] = []
        unreadable: list[dict[str, str]] = []
        labelled = self.labelled
        if not labelled and request.classes is not None:
            raise OptionError(
                "an unlabelled source has no classes: --classes-from does not apply to --no-labels"
            )
        for path in self.files():
            for key, image, value, problem, extensions, size in _samples(path, labelled):
                where = f"{path.name}/{image}" if image else f"{path.name}/{key}"
                if problem is None:
                    found.append((where, value, extensions, size))
                else:
                    _bad(request, unreadable, path, key, where, problem)
        if labelled:
            classes, label_of = label_map([v for _, v, _, _ in found], request.classes)
        else:
            classes, label_of = [], lambda _: UNLABELLED
        fields, names = _fields(found, request, self.labelled)
        samples: list[Sample] = []
        for where, value, _, size in found:
            label = label_of(value)
            if isinstance(label, str):
                tar, _, member = where.partition("/")
                _bad(request, unreadable, Path(tar), split_key(member)[0], where, label)
            else:
                samples.append(Sample(where, label, len(samples), size=size))
        if not samples and not unreadable:
            raise ScanError(f"{self.src}: its tar files hold no sample")
        return Scan(
            classes=classes,
            samples=samples,
            empty_classes=empty_classes(classes, [s.label for s in samples]),
            unreadable=unreadable,
            origin={"format": "webdataset", "foreign": True, "files": len(self.files())},
            fields=fields,
            field_names=names,
        )

    def identity(self, scan: Scan) -> str:
        return files_identity(self.files())

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        files = tuple(str(p) for p in self.files())
        return TarFetcher(files, self.identity(scan), run, tuple(scan.fields))


#: Member extensions taken as text and as JSON fields (any other is ``bytes``).
TEXT_MEMBERS = ("txt", "text")
JSON_MEMBERS = ("json", "jsn")


def _fields(
    found: list[tuple[str, Any, list[str], int]], request: ScanRequest, labelled: bool
) -> tuple[list[Field], list[str]]:
    """The samples' other members as fields, by extension in the order first seen (those
    ``--fields`` names, if given): ``txt`` text, ``json`` JSON, any other bytes, or the type
    ``--field`` gives; optional where a sample lacks one. And every such extension."""
    seen: dict[str, int] = {}
    for _, _, extensions, _ in found:
        for ext in extensions:
            if ext != "cls" or not labelled:
                seen[ext] = seen.get(ext, 0) + 1
    every = list(seen)

    def infer(ext: str) -> Field:
        kind = "str" if ext in TEXT_MEMBERS else "json" if ext in JSON_MEMBERS else "bytes"
        return Field(ext, kind, optional=seen[ext] < len(found))

    fields = kept_fields(every, request, infer, lambda ext: f"member extension {ext!r}")
    return fields, every


def _bad(
    request: ScanRequest,
    unreadable: list[dict[str, str]],
    tar: Path,
    key: str,
    where: str,
    problem: str,
) -> None:
    if request.on_error == "fail":
        raise ScanError(
            f"{tar}: sample {key!r}: {problem} (use --on-error skip to convert without it, "
            "recorded as skipped)"
        )
    unreadable.append({"path": where, "reason": problem})


def _samples(
    path: Path, labelled: bool = True
) -> list[tuple[str, str | None, Any, str | None, list[str], int]]:
    """``(key, image member, label value, problem, other extensions, image size)`` of every
    sample of one tar, in order (``labelled``: the label read from ``.cls`` or ``.json``; else
    none; the image member's size, ``-1`` where it has none)."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    order: list[str] = []
    problems: dict[str, str] = {}
    last = None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in _members(tar, path):
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                end = path.stat().st_size
                if member.offset_data + member.size > end:
                    problems.setdefault(key, f"{member.name} declares {member.size:,} bytes, past "
                                        f"the end of the tar ({end:,} bytes): a truncated file")  # fmt: skip
                if key != last and key in groups:
                    problems.setdefault(key, "its members are not together in the tar (the key "
                                        "appears twice)")  # fmt: skip
                last = key
                if key not in groups:
                    groups[key] = {}
                    order.append(key)
                groups[key].setdefault(ext.lower(), member)
            out: list[tuple[str, str | None, Any, str | None, list[str], int]] = []
            for key in order:
                members = groups[key]
                kind = next((e for e in IMAGE_SUFFIXES if e in members), None)
                image = members[kind].name if kind is not None else None
                size = members[kind].size if kind is not None else -1
                value, problem = _label(tar, members) if labelled else (None, None)
                if image is None:
                    problem = "no image member (" + ", ".join(f".{e}" for e in members) + ")"
                others = [e for e in members if e != kind]
                out.append((key, image, value, problems.get(key, problem), others, size))
            return out
    except (OSError, tarfile.TarError) as exc:
        raise ScanError(f"{path}: not a readable tar file: {exc}") from None


def _members(tar: tarfile.TarFile, path: Path) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar`` in order; where the tar ends inside the last one's data (its
    header declares more bytes than follow), that member still, and then the end: the scan
    names its sample instead of losing it or the whole tar."""
    member: tarfile.TarInfo | None = None
    while True:
        try:
            member = tar.next()
        except tarfile.ReadError:
            if member is not None and member.offset_data + member.size > path.stat().st_size:
                return  # the last member yielded runs past the end: it is named as truncated
            raise
        if member is None:
            return
        yield member


def _label(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> tuple[Any, str | None]:
    """The label value of a sample (its ``.cls``, else its ``.json``'s ``label``), or why none."""
    for ext in ("cls", "json"):
        member = members.get(ext)
        if member is None or member.size > 1 << 20:
            continue
        handle = tar.extractfile(member)
        text = handle.read().decode("utf-8", "replace").strip() if handle else ""
        if ext == "cls":
            if text.isascii() and text.isdigit():
                return int(text), None
            return None, f"{member.name} holds {text[:40]!r}, not a label >= 0"
        try:
            value = json.loads(text).get("label")
        except (ValueError, AttributeError):
            return None, f"{member.name} is not a JSON object"
        if isinstance(value, bool) or not isinstance(value, (int, str)) or value in ("", None):
            return None, f'{member.name} has no "label" (an integer or a class name)'
        if isinstance(value, int) and value < 0:
            return None, f"{member.name}: label {value} is negative"
        return value, None
    return None, 'no label (.cls, or a .json with a "label")'


@dataclass(frozen=True)
class TarFetcher(Fetcher):
    """One sample's image member, read at its offset, through the image policy."""

    paths: tuple[str, ...]
    identity: str
    run: str
    #: The fields kept: each read from the sample's member of that extension.
    fields: tuple[Field, ...] = ()

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        name, _, member = sample.path.partition("/")
        members = opened(self.run, ("webdataset", self.identity), self._open)
        path, found = members.get(name, ("", {}))
        where = found.get(member)
        if where is None:
            raise ImageError(sample.path, "no such member (the tar changed since the scan)")
        offset, size = where
        try:
            with open(path, "rb") as fh:
                data = os.pread(fh.fileno(), size, offset)
        except OSError as exc:
            raise ImageError(sample.path, f"cannot read: {exc.strerror}") from None
        if len(data) != size:
            raise ImageError(sample.path, "the tar is truncated")
        encoded = process_bytes(data, sample.path, sample.label, policy, encoding)
        if self.fields:
            encoded.fields = self._values(sample.path, path, member, found)
        return encoded

    def _values(
        self, where: str, path: str, image: str, found: dict[str, tuple[int, int]]
    ) -> dict[str, Any]:
        """The sample's field values, each from its member (none: the value is absent)."""
        key = split_key(image)[0]
        values: dict[str, Any] = {}
        with open(path, "rb") as fh:
            for f in self.fields:
                spot = found.get(f"{key}.{f.name}")
                if spot is None:
                    continue
                data = os.pread(fh.fileno(), spot[1], spot[0])
                try:
                    if len(data) != spot[1]:
                        raise ValueError("the tar is truncated")
                    values[f.name] = member_value(f, data)
                except (ValueError, DataError) as exc:
                    reason = first_line(exc).removeprefix("member: ")
                    raise ImageError(where, f"member {key}.{f.name}: {reason}") from None
        return values

    def _open(self) -> dict[str, tuple[str, dict[str, tuple[int, int]]]]:
        """Each tar's path and where its members' data are: read once per worker and run."""
        files = [Path(p) for p in self.paths]
        if self.identity and files_identity(files) != self.identity:
            raise changed_source(str(files[0].parent))
        index = {}
        for path in files:
            with tarfile.open(path, "r:") as tar:
                found = _members(tar, path)
                members = {m.name: (m.offset_data, m.size) for m in found if m.isfile()}
            index[path.name] = (str(path), members)
        return index
