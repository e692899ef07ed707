"""Opening an output: the one route from a location to what a reader reads.

:func:`open_output` turns a location (a local folder or a URL) into an :class:`Opened`: the
folder its files are read from, its manifest (read once: one GET for a bucket), and its
:class:`OutputFiles`. A reader is built from that (``reader(opened, options)``) and never
resolves a location itself:

- a local output is put back first when a replacement of it was killed midway
  (:func:`imgpack.publishing.recover`), and its files are checked before any is mapped
  (:func:`check_files`): :class:`LocalFiles`;
- an output in a bucket is fetched whole into the checked local cache (:class:`CachedFiles`),
  or, for a reader that fetches each data file when it first reads it, opened lazily over a
  cache entry (:class:`LazyFiles`, :mod:`imgpack.storage.lazy`), whose files are checked as they
  arrive.

:func:`open_manifest` is the same route for the manifest alone (nothing checked or fetched:
``info``, ``verify``, which reports damage rather than refusing it, ``--classes-from``).
:class:`ReadOptions` is what a reader is built with beside what was opened, the same for every
format; the route reads its storage options, cache folder and limit. The files' classes live
in :mod:`imgpack.storage.files`: this module is the seam between storage and the readers, and
storage knows nothing of readers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from imgpack.errors import DataError, ManifestError, NotAnOutput, OptionError
from imgpack.manifest import (
    MANIFEST_NAME,
    PART_MANIFEST_GLOB,
    Manifest,
    file_problem,
    read_manifest,
    read_manifest_file,
)
from imgpack.publishing import recover
from imgpack.recipe import CenterCrop, Crop, RandomResizedCrop
from imgpack.storage.cache import fetch_output
from imgpack.storage.files import CachedFiles, LazyFiles, LocalFiles, OutputFiles
from imgpack.storage.lazy import LIMIT_VARIABLE, LazyOutput, cache_limit
from imgpack.storage.location import filesystem, is_url, local_path, read_remote_manifest
from imgpack.units import format_bytes, whole_number

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

#: The largest raw image a reader accepts (1 GiB: an 18,000 x 18,000 RGB image).
MAX_IMAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class ReadOptions:
    """How a reader reads, the same for every format: what :class:`~imgpack.formats.dataset_base.ImageDataset` documents for
    each. Give ``options=ReadOptions(...)`` to :func:`imgpack.open_dataset` or a reader, or the
    keywords of the same names (not both)."""

    transform: Callable[[torch.Tensor], Any] | None = None
    target_transform: Callable[[int], Any] | None = None
    verify: bool | None = None
    size: int | tuple[int, int] | str | None = None
    resize: str = "crop"
    decode_threads: int | None = None
    storage_options: dict[str, Any] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    #: An output read from a URL by a reader that fetches its files lazily: the most the cache
    #: holds beyond the files being read (``"200GB"``; default ``IMGPACK_CACHE_LIMIT``, else
    #: no limit). See :mod:`imgpack.storage.lazy`.
    cache_limit: int | str | None = None
    #: An output read lazily from a URL: shards fetched ahead in the background (up to
    #: :data:`~imgpack.storage.lazy.FETCH_THREADS` at once), in the order a sampler that gives hints
    #: (:class:`~imgpack.loading.ShardSampler`) will read them. The default, 8, is the
    #: sampler's default window: the next window arrives while this one is read.
    prefetch: int = 8
    #: The training recipe's random crop (:class:`imgpack.recipe.RandomResizedCrop`: each
    #: sample's box and flip drawn from ``(seed, epoch, index)`` before its decode) or the
    #: evaluation's centre crop (:class:`imgpack.recipe.CenterCrop`), resized to its size
    #: (``size`` and ``resize`` then do not apply).
    recipe: Crop | None = None
    #: The seed of the recipe's boxes.
    seed: int = 0
    #: Fields of the output to read with each sample (:mod:`imgpack.fields`), by name:
    #: ``ds[i]`` is then ``(image, label, *values)`` in this order.
    fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        whole_number(self.prefetch, "prefetch")
        if self.decode_threads is not None:
            whole_number(self.decode_threads, "decode_threads", 1)
        if self.resize not in ("crop", "stretch"):
            raise OptionError(f"invalid resize {self.resize!r}: expected 'crop' or 'stretch'")
        if self.recipe is not None and not isinstance(self.recipe, RandomResizedCrop | CenterCrop):
            raise OptionError(
                f"invalid recipe {self.recipe!r}: expected an imgpack.recipe.RandomResizedCrop "
                "(training) or CenterCrop (evaluation)"
            )
        if self.recipe is not None and self.size is not None:
            raise OptionError("give recipe= or size=, not both (the recipe's crop has a size)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise OptionError(f"invalid seed {self.seed!r}: expected an integer")
        if isinstance(self.fields, str):
            object.__setattr__(self, "fields", (self.fields,))
        names = tuple(self.fields)
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise OptionError(f"invalid fields {self.fields!r}: expected distinct field names")
        object.__setattr__(self, "fields", names)
        if self.verify not in (None, True, False):
            raise OptionError(f"invalid verify {self.verify!r}: expected None, True or False")

    @classmethod
    def of(cls, options: ReadOptions | None, **keywords: Unpack[ReadKeywords]) -> ReadOptions:
        """``options``, or the options the keywords give (those left at their defaults are
        not given); both at once is refused."""
        if options is not None and not isinstance(options, ReadOptions):
            raise OptionError(
                f"options= takes a ReadOptions, not {type(options).__name__} (give transform= "
                "and the other reading options by name, or options=ReadOptions(...))"
            )
        defaults = cls()
        unknown = sorted(set(keywords) - set(ReadKeywords.__annotations__))
        if unknown:
            raise TypeError(
                f"unexpected keyword(s) {', '.join(unknown)}: a reader takes "
                f"{', '.join(ReadKeywords.__annotations__)} and its format's own options"
            )
        given: dict[str, Any] = {k: v for k, v in keywords.items() if v is not getattr(defaults, k)}
        if options is None:
            return cls(**given)
        if given:
            raise OptionError(
                f"give either options= or the keyword(s) {', '.join(sorted(given))}, not both"
            )
        return options


class ReadKeywords(TypedDict, total=False):
    """:class:`ReadOptions`' fields as keywords: a reader given a path takes them as
    ``PTDataset(path, transform=...)`` (checked against ReadOptions' fields by a test)."""

    transform: Callable[[torch.Tensor], Any] | None
    target_transform: Callable[[int], Any] | None
    verify: bool | None
    size: int | tuple[int, int] | str | None
    resize: str
    decode_threads: int | None
    storage_options: dict[str, Any] | None
    cache_dir: str | os.PathLike[str] | None
    cache_limit: int | str | None
    prefetch: int
    recipe: Crop | None
    seed: int
    fields: tuple[str, ...] | list[str] | str


@dataclass(frozen=True)
class Opened:
    """An output, opened: the local folder its files are read from, its manifest, and its
    files; ``location`` is what was given (a URL names the output in messages)."""

    root: Path
    manifest: Manifest
    files: OutputFiles
    location: str

    @property
    def lazy(self) -> LazyOutput | None:
        return self.files.lazy


def open_output(
    location: str | os.PathLike[str] | Opened,
    options: ReadOptions | None = None,
    lazy: bool | Callable[[Manifest], bool] = False,
) -> Opened:
    """Open the output at ``location`` (an :class:`Opened` is returned as it is): its manifest
    read once, its files checked (a lazily read output's as they are fetched).

    ``options``: the :class:`ReadOptions` a reader is built with; the route reads its storage
    options, cache folder and limit (an output fetched whole is refused in one line, before
    anything is fetched, when it is larger than the limit). ``lazy``: whether a
    bucket's output is read lazily (its reader fetches each data file when it first reads it)
    rather than fetched whole, or a function of its manifest that says so (the reader its
    format names).
    """
    if isinstance(location, Opened):
        return location
    options = options or ReadOptions()
    storage_options, cache_dir, limit = (
        options.storage_options,
        options.cache_dir,
        options.cache_limit,
    )
    if is_url(location):
        url = str(location).rstrip("/")
        remote = _remote_manifest(url, storage_options)  # the one GET of the manifest
        manifest = remote[0]
        if lazy(manifest) if callable(lazy) else lazy:
            output = LazyOutput(url, storage_options, cache_dir, limit, remote=remote)
            check_files(output.root, manifest, present=False)
            return Opened(output.root, manifest, LazyFiles(output), url)
        bound = cache_limit(limit)
        if bound is not None and manifest.total_bytes > bound:  # refused before any fetch
            raise OptionError(
                f"{url}: a {manifest.format} output is fetched whole "
                f"({format_bytes(manifest.total_bytes)}), more than the cache limit of "
                f"{format_bytes(bound)}: raise the limit (cache_limit, --cache-limit, "
                f"{LIMIT_VARIABLE}) to at least that, or convert it to a sharded format "
                "(pt, tfrecord, webdataset), whose shards are fetched as they are read"
            )
        root, pin = fetch_output(url, storage_options, cache_dir, remote=remote)
        check_files(root, manifest)
        return Opened(root, manifest, CachedFiles(root, pin), url)
    root = local_path(location)
    manifest = _local_manifest(root)
    check_files(root, manifest)
    return Opened(root, manifest, LocalFiles(root), str(location))


def _local_manifest(root: Path) -> Manifest:
    """The manifest of the local output ``root``, put back first where a replacement of it was
    killed midway; a folder where a part was written by shard tasks apart from the others holds
    no ``imgpack.json`` but its part's manifest (:func:`read_part_manifest`), and is a part as
    one written by one writer is: read, checked and merged alike."""
    recover(root)
    return read_part_manifest(root) or read_manifest(root)


def _remote_manifest(url: str, storage_options: dict[str, Any] | None) -> tuple[Manifest, bytes]:
    """The manifest of the output at ``url`` and its bytes; as :func:`_local_manifest`, a
    prefix where a part was written by shard tasks apart from the others holds no
    ``imgpack.json`` but its part's manifest, and is that part."""
    try:
        return read_remote_manifest(url, storage_options)
    except NotAnOutput:
        fs, root = filesystem(url, storage_options)
        try:
            found = sorted(fs.glob(f"{root}/{PART_MANIFEST_GLOB}"))
        except OSError:
            found = []
        name = _one_part(url, [path.rsplit("/", 1)[-1] for path in found])
        if name is None:
            raise
    data = fs.cat_file(f"{root}/{name}")
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise ManifestError(f"{url}/{name}: unreadable manifest: {bad}") from None
    return _as_part(Manifest.from_json(parsed, where=f"{url}/{name}"), f"{url}/{name}"), data


def read_part_manifest(root: Path) -> Manifest | None:
    """The manifest of the part written by shard tasks in the folder ``root`` apart from the
    other parts (``.imgpack-part-I-of-K.json``: only the last part to finish a DST the parts
    share writes ``imgpack.json``), or ``None`` where it holds an output's own manifest or no
    part's."""
    if (root / MANIFEST_NAME).exists() or not root.is_dir():
        return None
    name = _one_part(str(root), sorted(p.name for p in root.glob(PART_MANIFEST_GLOB)))
    if name is None:
        return None
    return _as_part(read_manifest_file(root / name), str(root / name))


def _one_part(where: str, names: list[str]) -> str | None:
    """The one part manifest among ``names`` (sorted) found at ``where`` beside no
    ``imgpack.json``; ``None`` for none; refused for several (a DST the parts share, not all
    of them finished)."""
    if len(names) > 1:
        raise OptionError(
            f"{where}: holds the manifests of {len(names)} parts ({names[0]}, ...) and no "
            f"{MANIFEST_NAME}: a DST shared by parts that have not all finished; it becomes "
            "one output by running its last part again (it is neither read nor merged before)"
        )
    return names[0] if names else None


def _as_part(manifest: Manifest, where: str) -> Manifest:
    if manifest.part is None:
        raise ManifestError(f"{where}: not a part's manifest (no part record)")
    return manifest


def open_manifest(
    location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[Path | str, Manifest]:
    """The route's manifest-only opening: ``(where, manifest)`` of the output at ``location``,
    its files neither checked nor fetched (``imgpack info``, ``verify``, which reports damage
    rather than refusing it, and ``--classes-from``). A local output is put back first when a
    replacement of it was killed midway; a bucket's manifest is one GET."""
    if is_url(location):
        url = str(location).rstrip("/")
        return url, _remote_manifest(url, storage_options)[0]
    root = local_path(location)
    return root, _local_manifest(root)


def check_files(root: Path, manifest: Manifest, present: bool = True) -> None:
    """Check the files an output's manifest lists before any is opened or mapped: regular files
    (never a FIFO or a device) of exactly the recorded size, and per-file sample counts adding up
    to ``num_samples``. (Reading the manifest already refused names that are not plain names
    inside the output.) ``present=False``: the files are not there yet (a lazily read output,
    whose files are checked against their size and sha256 as they are fetched): counts only."""
    total = 0
    image_bytes = _raw_image_bytes(manifest)
    for entry in manifest.files:
        problem = file_problem(root, entry) if present else None
        if problem is not None:
            raise DataError(
                f"{root / entry.path}: {problem} (the output is damaged or incomplete; "
                "imgpack verify tells more)"
            )
        # Every sample takes at least a byte of its file, a raw one its pixels: counts and shapes
        # the files cannot hold are refused before any reader sizes an array by them.
        if entry.num_samples > entry.bytes or entry.num_samples * image_bytes > entry.bytes:
            raise ManifestError(
                f"{root / entry.path}: {entry.bytes} bytes cannot hold {entry.num_samples} "
                f"samples{' of ' + str(image_bytes) + ' bytes each' if image_bytes else ''} "
                "(the manifest is damaged)"
            )
        total += entry.num_samples
    if total != manifest.num_samples:
        raise ManifestError(
            f"{root}: the files hold {total} samples, the manifest says {manifest.num_samples}"
        )


def _raw_image_bytes(manifest: Manifest) -> int:
    """Bytes of one raw image the files must hold for each sample (0: encoded, or compressed)."""
    image = manifest.image
    if manifest.encoding != "raw" or not image.get("height") or not image.get("width"):
        return 0
    size = int(image["height"]) * int(image["width"]) * int(image.get("channels", 3))
    if size > MAX_IMAGE_BYTES:
        raise ManifestError(f"a raw image of {size} bytes is more than imgpack reads (1 GiB)")
    compressed = manifest.options.get("compression", "none") not in ("none", None)
    return 0 if compressed else size
