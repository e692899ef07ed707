"""``convert SRC DST --append``: SRC's images added to the output at DST as a new version of it.

The appended samples are planned and written as any conversion by shard tasks is
(:mod:`imgpack.direct`), with three differences, all decided before an image is read:

    shards   numbered after the output's last one (TFRecord's ``-of-N`` is the count after the
             append), their samples numbered after its last sample
    classes  the output's, in its order (their labels kept), then SRC's new names in SRC's order
    id       a new output id for the new version (the plan's, with the old id in it); the old
             files keep theirs, recorded per file in the manifest (:attr:`imgpack.manifest.
             FileEntry.output_id`), which the readers check each file against

The old files are never written. The manifest that lists old and new files replaces the old one
last (a rename on a path, one PUT in a bucket): a reader that opened the output before reads
the old version whole, and a run killed midway leaves the old output, which ``--append
--resume`` finishes from its receipts.

A one-file output (``lmdb``, ``hdf5``; a local DST) cannot take new files beside its one: the
new version is built in a temp folder beside DST, under DST's lock, from a copy of the output
(:func:`seed`: its file hashed against its manifest first; LMDB's ``data.mdb`` copied as it is,
HDF5's records staged again, each checked against its checksum), the new samples written after
the old ones by the one writer with its checkpoints (``--append --resume`` goes on from them),
and the folder swapped with DST in one rename (``renameat2``'s exchange where the filesystem
has it) with the manifest inside. A reader that has the old file open keeps reading the old
version (the file stays while it is open); one that opens the file after the swap, with the
old manifest read, is told to open the output again. A run killed midway leaves the old output
as it was, byte for byte. The manifest records each append under
``source["appended"]`` (SRC, counts, the ids before and after, and the append's key), so that
a ``--resume`` of an append already committed returns the output as it is, and appending the
same SRC again is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from imgpack.errors import ManifestError, OptionError
from imgpack.formats.writer_base import Writer, WriterConfig
from imgpack.images import Encoded
from imgpack.manifest import Manifest, check_digests
from imgpack.opening import open_manifest, open_output
from imgpack.scan import UNLABELLED, Sample, SampleTable, Scan
from imgpack.stats import DatasetStats


def base_output(target: str, storage_options: dict[str, Any] | None) -> Manifest:
    """The manifest of the output at ``target`` that an append adds to: refused in one line
    where there is none, where it was made before imgpack recorded output ids (its files carry
    none, so a new version could not tell them from its own), or where it is one part of a
    partitioned conversion."""
    try:
        base = open_manifest(target, storage_options)[1]
    except ManifestError as exc:
        raise OptionError(
            f"--append adds to an existing imgpack output: {exc}; convert without --append to "
            "make one"
        ) from None
    if not base.output_id:
        raise OptionError(
            f"{target}: was made by an imgpack before 0.3 (its manifest has no output id); "
            "convert it again with this imgpack, then append to it"
        )
    if base.part is not None:
        raise OptionError(
            f"{target}: holds one part of a partitioned conversion; merge the parts first "
            "(imgpack merge), then append to the merged output"
        )
    return base


def combined_classes(base: Manifest, found: list[str], where: str) -> list[str]:
    """The label map after appending a source whose scan found classes ``found`` to ``base``:
    the output's classes in their order, then the new names in the source's order. An
    unlabelled output takes unlabelled images only, and a labelled one labelled images only."""
    if bool(base.classes) != bool(found):
        has = "no labels" if not base.classes else f"{len(base.classes)} classes"
        gives = "no labels" if not found else f"{len(found)} classes"
        raise OptionError(
            f"--append: the output has {has} and {where} gives {gives}; append images labelled "
            "as the output's are (or unlabelled to an unlabelled output)"
        )
    known = set(base.classes)
    return [*base.classes, *(name for name in found if name not in known)]


def relabelled(scan: Scan, classes: list[str]) -> Scan:
    """``scan`` (in its own order) with the label map ``classes``, which holds its classes:
    each sample's label is its class's position there."""
    if scan.classes == classes:
        return scan
    index = {name: k for k, name in enumerate(classes)}
    mapping = [index[name] for name in scan.classes]
    samples: Sequence[Sample]
    if isinstance(scan.samples, SampleTable):
        samples = scan.samples.relabelled(mapping)
    else:
        samples = [
            s if s.label == UNLABELLED else replace(s, label=mapping[s.label]) for s in scan.samples
        ]
    return replace(scan, classes=list(classes), samples=samples)


def check_compatible(base: Manifest, new: Manifest, dst: str) -> None:
    """Refuse, in one line naming the first difference, an append whose output would not be
    written as ``base`` was: another format, encoding, image policy (size, resize, channels,
    background), quality, statistics or format options, or other fields."""
    old_options, new_options = dict(base.options), dict(new.options)
    for unrelated in ("shard_size", "on_error", "max_pixels"):  # how it was written, not what
        old_options.pop(unrelated, None)
        new_options.pop(unrelated, None)
    pairs: list[tuple[str, Any, Any]] = [
        ("format", base.format, new.format),
        ("encoding", base.encoding, new.encoding),
        *(
            (f"image {key}", base.image.get(key), new.image.get(key))
            for key in sorted(set(base.image) | set(new.image))
        ),
        *(
            (f"option {key}", old_options.get(key), new_options.get(key))
            for key in sorted(set(old_options) | set(new_options))
        ),
        ("fields", [f.spec for f in base.fields], [f.spec for f in new.fields]),
    ]
    for what, old, given in pairs:
        if old != given:
            raise OptionError(
                f"{dst}: --append: the output's {what} is {old!r}, this conversion's {given!r}; "
                f"give the output's options (imgpack info {dst} shows them)"
            )


def last_key(base: Manifest) -> str | None:
    """The key of the last append recorded in ``base``, if any."""
    done = base.source.get("appended")
    if isinstance(done, list) and done and isinstance(done[-1], dict):
        key = done[-1].get("key")
        return key if isinstance(key, str) else None
    return None


def appended(base: Manifest, new: Manifest, key: str, one_file: bool = False) -> Manifest:
    """The manifest of ``base`` with the output ``new`` (the appended shards' own manifest:
    the combined classes, the new id) after it: every old file with the id it carries, the
    counts, skipped files and statistics of both, and the append recorded in ``source``.
    ``one_file``: ``new``'s files hold the old samples too (:func:`seed`), and replace
    ``base``'s; its ``num_samples`` counts the new ones only."""
    files = [replace(f, output_id=base.file_output_id(k)) for k, f in enumerate(base.files)]
    if one_file:
        files = []
    grown = len(new.classes) - len(base.classes)
    stats = None
    if base.stats is not None and new.stats is not None:
        old = dict(base.stats)
        if "per_class" in old:
            old["per_class"] = [*old["per_class"], *[0] * grown]
        total = DatasetStats.total([old, new.stats])
        stats = total.to_json() if total is not None else None
    record = {
        "path": new.source.get("path"),
        "image_files": new.source.get("image_files"),
        "samples": new.num_samples,
        "skipped": len(new.skipped),
        "new_classes": new.classes[len(base.classes) :],
        "output_id_before": base.output_id,
        "output_id": new.output_id,
        "key": key,
        "created_by": new.created_by,
    }
    done = base.source.get("appended")
    source = {**base.source, "appended": [*(done if isinstance(done, list) else []), record]}
    return replace(
        base,
        num_samples=base.num_samples + new.num_samples,
        classes=list(new.classes),
        files=[*files, *new.files],
        source=source,
        skipped=[*base.skipped, *new.skipped],
        output_id=new.output_id,
        part=None,
        stats=stats,
        created_by=new.created_by,
    )


def seed(
    writer: type[Writer],
    directory: Path,
    config: WriterConfig,
    previous: Path,
    manifest: Manifest,
) -> dict[str, Any]:
    """Make the empty temp folder ``directory`` start as the one-file output at ``previous``
    (:meth:`Writer.seed <imgpack.formats.writer_base.Writer.seed>`), whose files are hashed
    against ``manifest`` (its own, as the append read it: :func:`base_output`) first: what is
    added to is what was converted. Returns the writer's state to go on from."""
    from imgpack.formats.streaming import stored_samples  # (the readers import torch)
    from imgpack.readers import reader_class

    check_digests(
        previous,
        manifest,
        "its manifest records (the output is damaged or was changed after its conversion); "
        "nothing was appended: convert it again, or restore it from a copy",
    )

    def samples() -> Iterator[Encoded]:  # read only by a format that needs them (not LMDB)
        opened = open_output(str(previous))
        reader = reader_class(manifest.format)(opened, verify=True)
        yield from stored_samples(reader, 0, len(reader))

    return writer.seed(directory, config, previous, samples())


__all__ = [
    "appended",
    "base_output",
    "check_compatible",
    "combined_classes",
    "last_key",
    "relabelled",
    "seed",
]
