"""Joining the parts of a partitioned conversion into one output (``imgpack merge``).

``imgpack convert SRC PART --num-parts K --part I`` converts the I-th of K contiguous slices of
SRC's scan, with SRC's whole label map, into a complete output whose manifest records the part.
:func:`merge` checks that the given outputs are exactly the K parts of one conversion, then
builds one output equal in samples, labels, pixels, source paths and order to a single
conversion of SRC:

- sharded formats (``pt``, ``tfrecord``, ``webdataset``, any format whose writer is a
  :class:`~imgpack.formats.writer_base.ShardedWriter`): the parts' shards are hard-linked in
  order under the output's names — no data is copied (copied only across filesystems), and the
  parts stay as they were;
- single-file formats (``lmdb``, ``hdf5``): every part's records are streamed, checksums
  checked, through the format's writer, a bounded chunk at a time.

The parts share their conversion's output id, so shards need no rewrite. The merged output is
published like a conversion: DST locked, built in a temp folder beside it, manifest last.

Parts written by shard tasks (the default for sharded formats of an image folder) into folders
of their own hold their part's manifest under :func:`~imgpack.manifest.part_manifest_name`
(only a DST the parts share gets an ``imgpack.json``, from the last part to finish); the route
opens a part by it (:func:`~imgpack.opening.open_output`). Their shards already
carry the whole output's names, so the merged files are the single conversion's, byte for
byte.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from imgpack import formats
from imgpack.errors import DataError, OptionError
from imgpack.formats.dataset_base import ImageDataset, ReadOptions
from imgpack.formats.writer_base import ShardedWriter, WriterConfig, WrittenFile, file_entries
from imgpack.images import Encoding, ImagePolicy
from imgpack.manifest import Manifest, check_digests, write_manifest
from imgpack.opening import Opened, open_manifest, open_output
from imgpack.publishing import (
    check_destination,
    clear_leftovers,
    inside,
    locked,
    publish,
    recover,
    temp_output,
)
from imgpack.stats import DatasetStats
from imgpack.storage.destination import output_folder
from imgpack.storage.location import is_url, local_path
from imgpack.version import __version__

#: Manifest fields every part of one conversion has in common.
SHARED = ("format", "classes", "encoding", "image", "options", "output_id", "fields")


def merge(
    parts: Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Manifest:
    """Join the parts of one partitioned conversion into the output ``dst``; see the module doc.

    Parts and ``dst`` may be URLs (``s3://...``): parts are read through the local cache, a
    ``dst`` in a bucket is built in a scratch folder and uploaded, its manifest last
    (:mod:`imgpack.storage`).

    Raises :class:`~imgpack.errors.OptionError` when ``parts`` are not exactly the parts of one
    conversion (another conversion's part, a missing or repeated part, an output that is not a
    part), naming the offending outputs.
    """
    if is_url(dst):
        with output_folder(dst, storage_options, overwrite, skip=formats.runtime_files()) as local:
            return merge(parts, local, progress=progress, storage_options=storage_options,
                         cache_dir=cache_dir)  # fmt: skip
    if not parts:
        raise OptionError("give the parts to merge")
    # Each part opened by the one route (a part in a bucket fetched whole into the cache).
    where = ReadOptions(storage_options=storage_options, cache_dir=cache_dir, verify=True)
    opened = [open_output(p, where) for p in parts]
    roots = [o.root for o in opened]
    target = local_path(dst)
    for root in roots:
        if inside(root, target) or inside(target, root):
            raise OptionError(
                f"{target}: the output must not be, hold or lie inside a part ({root}); merge "
                "into a folder of its own"
            )
    # Pinned before the check: each part's reader (its manifest, and for streamed formats its
    # open files) is what is checked and what is merged; a part replaced meanwhile is refused.
    readers = [_pinned_reader(o) for o in opened]
    ordered = check_parts(roots, [reader.manifest for reader in readers])
    by_root = dict(zip(roots, readers, strict=True))
    with locked(target):
        recover(target, holding_lock=True)
        clear_leftovers(target)
        check_destination(target, overwrite)
        with temp_output(target) as tmp:
            files = _join(ordered, [by_root[root] for root, _ in ordered], tmp, progress)
            for root, manifest in ordered:
                if open_manifest(root)[1] != manifest:
                    raise DataError(
                        f"{root}: the part was replaced while it was being merged; nothing was "
                        "published: merge again"
                    )
            manifest = _merged_manifest(ordered, tmp, files)
            write_manifest(tmp, manifest)
            publish(tmp, target, replace=overwrite)
    return manifest


def _pinned_reader(opened: Opened) -> ImageDataset:
    """The reader of a part, as opened for merging (its manifest read and its files checked:
    :func:`~imgpack.opening.open_output`), with the files of a format that streams its records
    opened now, so that what is merged is what was checked."""
    from imgpack.readers import reader_class

    reader = reader_class(opened.manifest.format)(opened, verify=True)
    if not isinstance(reader.manifest.part, dict):
        return reader  # check_parts refuses it
    if not issubclass(formats.get(reader.manifest.format).writer_class(), ShardedWriter):
        # Before its library maps it: damage is an error, not a SIGBUS.
        check_digests(
            Path(opened.root),
            opened.manifest,
            "its part's manifest records (the part is damaged or was changed after its "
            "conversion); nothing was merged: convert that part again",
        )
        reader.handles  # noqa: B018 - opens the files
        reader.stored_paths()
    return reader


def check_parts(roots: list[Path], manifests: list[Manifest]) -> list[tuple[Path, Manifest]]:
    """The parts in order, once each checked to be exactly the parts of one conversion."""
    slices: list[dict[str, int]] = []
    for root, manifest in zip(roots, manifests, strict=True):
        if manifest.part is None:
            raise OptionError(
                f"{root}: not a part of a partitioned conversion (made without --num-parts)"
            )
        slices.append(manifest.part)
    first_root, first = roots[0], manifests[0]
    count = slices[0]["count"]
    for root, manifest, part in zip(roots[1:], manifests[1:], slices[1:], strict=True):
        for name in SHARED:
            if getattr(manifest, name) != getattr(first, name):
                raise OptionError(
                    f"{root} and {first_root} are parts of different conversions (their {name} "
                    "differ); merge the parts of one conversion"
                )
        if part["count"] != count:
            raise OptionError(
                f"{root} is part of {part['count']} and {first_root} of {count}: parts of "
                "different conversions"
            )
    by_index: dict[int, Path] = {}
    for root, part in zip(roots, slices, strict=True):
        if part["index"] in by_index:
            raise OptionError(
                f"part {part['index']} of {count} is given twice: {by_index[part['index']]}, {root}"
            )
        by_index[part["index"]] = root
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise OptionError(
            f"part(s) {', '.join(map(str, missing))} of {count} missing (given: "
            f"{', '.join(map(str, sorted(by_index)))}); merge all {count} parts"
        )
    order = sorted(range(len(roots)), key=lambda k: slices[k]["index"])
    for root, manifest, part in zip(roots, manifests, slices, strict=True):
        _check_slice(root, manifest, part)
    stop = 0
    for k in order:
        if slices[k]["start"] != stop:
            raise OptionError(
                f"{roots[k]}: its slice of the scan does not follow the previous part's"
            )
        stop = slices[k]["stop"]
    if stop != first.source.get("image_files", stop):
        raise OptionError(f"the parts cover {stop} of {first.source['image_files']} source files")
    return [(roots[k], manifests[k]) for k in order]


def _check_slice(root: Path, manifest: Manifest, part: dict[str, int]) -> None:
    """A part's slice of the scan must hold what its manifest says it converted: every scan
    position written or skipped (part 0 also lists the files the scan could not take)."""
    if not all(type(part.get(k)) is int for k in ("index", "count", "start", "stop")):
        raise OptionError(f"{root}: its manifest's part record is damaged")
    if not (0 <= part["index"] < part["count"] and 0 <= part["start"] <= part["stop"]):
        raise OptionError(f"{root}: its manifest's part record is out of range (damaged)")
    span, held = part["stop"] - part["start"], manifest.num_samples + len(manifest.skipped)
    # Part 0's skipped files also list what the scan could not take (not in any slice).
    adds_up = held >= span if part["index"] == 0 else held == span
    if not adds_up:
        raise OptionError(
            f"{root}: holds {manifest.num_samples} samples and {len(manifest.skipped)} skipped "
            f"files for a slice of {span} (its manifest is damaged)"
        )


def _join(
    ordered: list[tuple[Path, Manifest]],
    readers: list[ImageDataset],
    directory: Path,
    progress: bool,
) -> list[WrittenFile]:
    """The merged data files in ``directory`` (the parts' shards linked, or one file streamed)."""
    first = ordered[0][1]
    spec = formats.get(first.format)
    writer = spec.writer_class()(directory, _writer_config(first))
    with writer:
        if isinstance(writer, ShardedWriter):
            linked = writer.link_parts(ordered)  # each file's bytes: its recorded sha256
            for reader in readers:  # and each record: its checksum, as a stream is checked
                reader.checks.all(reader)
            return linked
        total = sum(manifest.num_samples for _, manifest in ordered)
        bar = tqdm(
            total=total,
            unit="img",
            desc=f"merge {first.format}",
            file=sys.stderr,
            disable=not progress,
        )
        with bar:
            for reader, (_, manifest) in zip(readers, ordered, strict=True):
                for sample in reader.encoded(0, manifest.num_samples):
                    writer.add(sample)
                    bar.update(1)
    return writer.close()


def _writer_config(manifest: Manifest) -> WriterConfig:
    """The config the parts' writers had, rebuilt from a part's manifest."""
    spec = formats.get(manifest.format)
    image, options = manifest.image, manifest.options
    size = (image["height"], image["width"]) if image.get("height") else None
    own = {option.name for option in spec.options}
    encoding = Encoding(manifest.encoding, options.get("quality") or Encoding().quality)
    return WriterConfig(
        format=manifest.format,
        classes=list(manifest.classes),
        encoding=encoding,
        policy=ImagePolicy(size=size, channels=int(image.get("channels", 3))),
        shard_size=int(options.get("shard_size") or 0),
        settings=spec.check_options({k: v for k, v in options.items() if k in own}),
        output_id=manifest.output_id,
        fields=tuple(manifest.fields),
    )


def _merged_manifest(
    ordered: list[tuple[Path, Manifest]], directory: Path, files: list[WrittenFile]
) -> Manifest:
    first = ordered[0][1]
    # Linked files are the parts' bytes, checked against their sha256 as they were linked.
    checked = file_entries(directory, files)
    return Manifest(
        format=first.format,
        num_samples=sum(manifest.num_samples for _, manifest in ordered),
        classes=list(first.classes),
        encoding=first.encoding,
        image=dict(first.image),
        files=checked,
        options=dict(first.options),
        source=dict(first.source),
        skipped=[skip for _, manifest in ordered for skip in manifest.skipped],
        created_by=f"imgpack {__version__}",
        output_id=first.output_id,
        stats=_stats_json(DatasetStats.total(manifest.stats for _, manifest in ordered)),
        fields=list(first.fields),
    )


def _stats_json(stats: DatasetStats | None) -> dict[str, Any] | None:
    return stats.to_json() if stats is not None else None


__all__ = ["check_parts", "merge"]
