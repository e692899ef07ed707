"""The ``imgpack.json`` manifest every output carries.

Schema version 1::

    {"imgpack": 1, "format": "pt", "num_samples": 500, "classes": ["cat", "dog"],
     "encoding": "raw", "image": {"height": 32, "width": 32, "channels": 3, ...},
     "files": [{"path": "shard-00000.pt", "bytes": 123, "num_samples": 500, "sha256": "...",
                "companions": [{"path": "...", "bytes": 45, "sha256": "..."}]}],
     "options": {...}, "source": {...}, "skipped": [{"path": "...", "reason": "..."}],
     "created_by": "imgpack 0.1.0", "output_id": "3f2a9c0d51e4b7a8"}

It is written last, after every data file is complete, so its presence marks a finished output.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from imgpack.errors import DataError, ManifestError, NotAnOutput
from imgpack.fields import Field, fields_from_json, fields_to_json
from imgpack.scan import IMAGE_EXTENSIONS
from imgpack.stats import DatasetStats

#: The encodings an output may record (:class:`imgpack.images.Encoding`).
ENCODING_NAMES = ("original", "jpeg", "png", "raw")

MANIFEST_NAME = "imgpack.json"
SCHEMA_VERSION = 1
#: Hex digits of an output id.
OUTPUT_ID_LENGTH = 16


@dataclass
class Companion:
    """A file that belongs to a data file (the ``.idx`` index of a TFRecord or WebDataset
    shard, which DALI and imgpack's readers use), with its size and checksum."""

    path: str
    bytes: int
    sha256: str


@dataclass
class FileEntry:
    """One data file of an output, with its size, sample count and checksum, and the files that
    belong to it (outputs of imgpack 0.4.0 and earlier list none)."""

    path: str
    bytes: int
    num_samples: int
    sha256: str
    companions: list[Companion] = field(default_factory=list)
    #: The output id this file carries, where it is not the manifest's: a file an earlier
    #: version of an appended output wrote (``convert --append``). ``""``: the manifest's.
    output_id: str = ""


@dataclass
class Manifest:
    """The parsed ``imgpack.json``."""

    format: str
    num_samples: int
    classes: list[str]
    encoding: str
    image: dict[str, Any]
    files: list[FileEntry]
    options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    created_by: str = ""
    #: Written into every data file too: a reader checks it when it opens one, so it never
    #: mixes the files of two outputs. ``""`` in outputs of imgpack before 0.3.
    output_id: str = ""
    #: Set for a part of a partitioned conversion: ``{"index", "count", "start", "stop"}``
    #: (the part's number, how many parts, its slice of the scan); a part written by shard
    #: tasks adds ``"first_shard"`` and ``"shards"``: its shards are those of the whole output.
    part: dict[str, int] | None = None
    #: The dataset statistics the conversion recorded (:class:`imgpack.stats.DatasetStats`'s
    #: JSON); ``None`` in outputs made before imgpack recorded them.
    stats: dict[str, Any] | None = None
    #: The per-sample fields beside the image and the label (:mod:`imgpack.fields`), in the
    #: order records store them; ``[]`` (no ``fields`` key) for an output without any.
    fields: list[Field] = field(default_factory=list)
    version: int = SCHEMA_VERSION

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.classes)}

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def file_output_id(self, number: int) -> str:
        """The output id data file ``number`` carries: its own (written by an earlier version of
        an appended output), else the manifest's (also for a number it does not list)."""
        own = self.files[number].output_id if 0 <= number < len(self.files) else ""
        return own or self.output_id

    @property
    def output_ids(self) -> frozenset[str]:
        """Every output id the data files of this output carry."""
        return frozenset(self.file_output_id(k) for k in range(len(self.files))) or frozenset(
            {self.output_id}
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["version"]
        if data["part"] is None:
            del data["part"]
        if data["stats"] is None:
            del data["stats"]
        if self.fields:
            data["fields"] = fields_to_json(self.fields)
        else:
            del data["fields"]
        for entry in data["files"]:  # formats without index files keep their manifests as before
            if not entry["companions"]:
                del entry["companions"]
            if not entry["output_id"]:  # the manifest's: said once, at the top
                del entry["output_id"]
        return {"imgpack": self.version, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "imgpack.json") -> Manifest:
        if not isinstance(data, dict) or "imgpack" not in data:
            raise ManifestError(f"{where}: not an imgpack manifest (no 'imgpack' schema version)")
        version = data["imgpack"]
        if version != SCHEMA_VERSION:
            raise ManifestError(
                f"{where}: manifest schema version {version!r} is not supported; this imgpack "
                f"reads version {SCHEMA_VERSION} (an output written by a newer imgpack needs a newer imgpack)"
            )
        fmt = data.get("format")
        if not isinstance(fmt, str) or not fmt:
            raise ManifestError(f"{where}: malformed manifest (format {fmt!r} is not a name)")
        try:
            if not isinstance(data["image"], dict):
                raise TypeError("image is not an object")
            encoding = data["encoding"]
            if encoding not in ENCODING_NAMES:
                raise ValueError(
                    f"encoding is {encoding!r}, expected one of {', '.join(ENCODING_NAMES)}"
                )
            image = dict(data["image"])
            for key in ("height", "width"):
                if image.get(key) is not None:
                    image[key] = _count(image[key], f"image.{key}", low=1)
            image["channels"] = _count(image.get("channels", 3), "image.channels", low=1)
            if image["channels"] not in (1, 3):
                raise ValueError(f"image.channels is {image['channels']}, expected 1 or 3")
            if encoding == "raw" and not (image.get("height") and image.get("width")):
                raise ValueError("a raw output needs image.height and image.width")
            classes = data["classes"]
            if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
                raise TypeError("classes is not a list of names")
            if len(set(classes)) != len(classes):
                raise ValueError("classes lists a name twice")
            files = [
                FileEntry(
                    path=_name(entry["path"]),
                    bytes=_count(entry["bytes"], "files.bytes"),
                    num_samples=_count(entry["num_samples"], "files.num_samples"),
                    sha256=str(entry.get("sha256", "")),
                    companions=[
                        Companion(
                            _name(c["path"]),
                            _count(c["bytes"], "files.companions.bytes"),
                            str(c["sha256"]),
                        )
                        for c in entry.get("companions", [])
                    ],
                    output_id=_output_id(entry.get("output_id", "")),
                )
                for entry in data["files"]
            ]
            num_samples = _count(data["num_samples"], "num_samples")
            named = [e.path for e in files] + [c.path for e in files for c in e.companions]
            if len(set(named)) != len(named) or MANIFEST_NAME in named:
                raise ValueError("files and their companions name one file twice")
            return cls(
                format=fmt,
                num_samples=num_samples,
                classes=list(classes),
                encoding=encoding,
                image=image,
                files=files,
                options=dict(data.get("options", {})),
                source=dict(data.get("source", {})),
                skipped=list(data.get("skipped", [])),
                created_by=str(data.get("created_by", "")),
                output_id=_output_id(data.get("output_id", "")),
                part=_part(data.get("part")),
                stats=_stats(data.get("stats"), len(classes), image, num_samples),
                fields=fields_from_json(data.get("fields"), where),
                version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(
                f"{where}: malformed manifest ({type(exc).__name__}: {exc})"
            ) from None


#: The largest count or size a manifest may hold: anything above cannot be real, and would
#: overflow the int64 arithmetic of the readers (numpy raises ``OverflowError`` there).
MAX_COUNT = 1 << 62


def _count(value: Any, name: str, low: int = 0) -> int:
    """An integer field: a JSON integer (not a float, not a bool) from ``low`` to
    :data:`MAX_COUNT`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNT:
        raise ValueError(
            f"{name} is {value!r}, expected an integer of at least {low} and at most 2**62"
        )
    return value


def _part(value: Any) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError("part is not an object")
    part = {key: _count(value[key], f"part.{key}") for key in ("index", "count", "start", "stop")}
    if not part["index"] < part["count"] or part["start"] > part["stop"]:
        raise ValueError(f"part {part} is not a part of a conversion")
    if "first_shard" in value or "shards" in value:  # written by shard tasks (direct.py)
        part["first_shard"] = _count(value.get("first_shard"), "part.first_shard")
        part["shards"] = _count(value.get("shards"), "part.shards")
        if part["first_shard"] > part["shards"]:
            raise ValueError(f"part {part} is not a part of a conversion")
    return part


def _stats(value: Any, classes: int, image: dict[str, Any], samples: int) -> dict[str, Any] | None:
    """The ``stats`` block, checked to add up and to be this manifest's: its classes,
    channels, samples and, for an output of one size, that size (the files' count is the
    readers' check, which names what is wrong)."""
    if value is None:
        return None
    found = DatasetStats.from_json(value, classes, image["channels"], samples)
    size = (image.get("height"), image.get("width"))
    if (
        all(size)
        and found.samples
        and (set(found.heights), set(found.widths))
        != (
            {size[0]},
            {size[1]},
        )
    ):
        raise ValueError(f"stats count sizes other than the output's {size[0]}x{size[1]}")
    return dict(value)


def _output_id(value: Any) -> str:
    if value == "":
        return value
    if not isinstance(value, str) or len(value) != OUTPUT_ID_LENGTH or value.strip(_HEX):
        raise ValueError(f"output_id {value!r} is not {OUTPUT_ID_LENGTH} hex digits")
    return value


_HEX = "0123456789abcdef"


def _name(value: Any) -> str:
    """A file name in an output: a plain relative name inside it."""
    if (
        not isinstance(value, str)
        or not value
        or value in (".", "..")
        or "/" in value
        or "\\" in value
    ):
        raise ValueError(f"file name {value!r} is not a plain name inside the output")
    return value


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``directory/imgpack.json``."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such imgpack output")
    if not path.is_file():
        raise NotAnOutput(not_an_output(directory))
    return read_manifest_file(path)


def read_manifest_file(path: Path) -> Manifest:
    """Read and validate the manifest file ``path`` (an output's, or a part's kept beside its
    shards: :func:`part_manifest_name`)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: unreadable manifest: {exc}") from None
    return Manifest.from_json(data, where=str(path))


def part_manifest_name(index: int, count: int) -> str:
    """Where a part written by shard tasks keeps its manifest until the whole output is
    committed (``.imgpack-part-1-of-3.json``): a part written into a folder of its own (to be
    merged) is read by ``imgpack merge`` from there; in a DST shared with the other parts, the
    last part's commit removes it."""
    return f".imgpack-part-{index}-of-{count}.json"


#: What :func:`part_manifest_name` gives, as a glob.
PART_MANIFEST_GLOB = ".imgpack-part-*-of-*.json"


def not_an_output(directory: Path) -> str:
    """What to say of ``directory``, given as an imgpack output but holding no manifest: an
    image folder is named as one, with the conversion that makes an output of it."""
    if not directory.is_dir():
        return f"{directory}: not an imgpack output (not a folder)"
    images = _images_within(directory)
    if images:
        return (
            f"{directory}: an image folder ({images}), not an imgpack output (no "
            f"{MANIFEST_NAME}); convert it first: imgpack convert {directory} OUT --format pt, "
            "then give OUT"
        )
    return (
        f"{directory}: not an imgpack output (no {MANIFEST_NAME}): give the folder imgpack "
        "convert wrote (an interrupted conversion leaves none: convert again)"
    )


def _images_within(folder: Path, look: int = 200) -> str:
    """``"images at its top"``, ``"class folders of images"`` or ``""``: a look at up to ``look``
    entries of ``folder`` and of its first few subfolders, no deeper."""
    try:
        with os.scandir(folder) as entries:
            top = [e for e in islice(entries, look) if not e.name.startswith(".")]
        if any(e.name.lower().endswith(IMAGE_EXTENSIONS) and e.is_file() for e in top):
            return "images at its top"
        for sub in [e for e in top if e.is_dir()][:8]:
            with os.scandir(sub.path) as entries:
                names = [e.name.lower() for e in islice(entries, look)]
            if any(name.endswith(IMAGE_EXTENSIONS) for name in names):
                return "class folders of images"
    except OSError:
        pass
    return ""


def manifest_bytes(manifest: Manifest) -> bytes:
    """``imgpack.json``'s bytes for ``manifest``."""
    return (json.dumps(manifest.to_json(), indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``imgpack.json`` durably (temp file, fsync, rename)."""
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(manifest_bytes(manifest))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)


def file_problem(root: Path, entry: FileEntry | Companion) -> str | None:
    """What is wrong with the file ``entry`` names in the output at ``root`` (missing, not a
    regular file, not of the recorded size), or ``None``. Cheap: one ``lstat``."""
    try:
        st = (root / entry.path).lstat()
    except OSError as exc:
        return f"missing ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != entry.bytes:
        return f"{st.st_size} bytes, the manifest says {entry.bytes}"
    return None


def check_digests(root: Path, manifest: Manifest, why: str) -> None:
    """Each file of ``manifest`` under ``root`` hashes to its recorded sha256, else
    :class:`~imgpack.errors.DataError` naming it: "its sha256 is not the one ``why``". For a
    one-file output (``lmdb``, ``hdf5``) read whole: its library follows the file's own
    pointers (LMDB maps it), so a damaged one could crash the process (a read past the file's
    end is a SIGBUS) before a record is checked."""
    for entry in manifest.files:
        path = root / entry.path
        if entry.sha256 and sha256_file(path) != entry.sha256:
            raise DataError(f"{path}: its sha256 is not the one {why}")


def sha256_file(
    path: Path, chunk: int = 1 << 22, progress: Callable[[int], object] | None = None
) -> str:
    """The sha256 of ``path``; ``progress`` is called with the size of each block read."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()
