"""What a conversion will do, decided before any image is read (:class:`Plan`), and what the
manifest of its output records (:func:`manifest_for`): one module both engines import
(:mod:`imgpack.pipeline`'s one writer, :mod:`imgpack.direct`'s shard tasks)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from imgpack.errors import OptionError
from imgpack.executors import Job
from imgpack.fields import Field
from imgpack.formats.writer_base import WriterConfig
from imgpack.manifest import OUTPUT_ID_LENGTH, FileEntry, Manifest
from imgpack.options import ConvertOptions
from imgpack.scan import Sample, Scan
from imgpack.sources import listing
from imgpack.sources.base import Source
from imgpack.stats import DatasetStats
from imgpack.version import __version__


@dataclass(frozen=True)
class Plan:
    """What a conversion will do, decided before any image is read."""

    src: Path
    dst: Path
    options: ConvertOptions
    scan: Scan
    #: What SRC is and how its samples are read (:mod:`imgpack.sources`).
    source: Source
    #: ``"shards"`` when shard tasks write the output by a shard plan (:mod:`imgpack.direct`):
    #: other shard boundaries than one writer's, so another output id.
    layout: str = ""
    #: The manifest of the output this conversion appends to (``--append``): the plan's shards
    #: and samples come after its own (:mod:`imgpack.appending`).
    base: Manifest | None = None

    @property
    def first_shard(self) -> int:
        """The number of the plan's first shard in the output: after an appended output's."""
        return len(self.base.files) if self.base is not None else 0

    @property
    def first_sample(self) -> int:
        """The output position of the plan's first sample: after an appended output's."""
        return self.base.num_samples if self.base is not None else 0

    @property
    def job(self) -> Job:
        policy = self.options.policy
        encoding = replace(self.options.encoding_spec, measure=self.options.stats)
        fetch = self.source.fetcher(self.scan, policy, encoding, self.run)
        return Job(fetch, policy, encoding, stats=self.options.stats, fields=self.fields)

    @cached_property
    def fields(self) -> tuple[Field, ...]:
        """The fields the output keeps: every one the scan found, or those ``--fields`` names
        (in that order); :class:`~imgpack.errors.OptionError` for a name the source does not
        offer, or fields kept in a format that stores none."""
        offered = {f.name: f for f in self.scan.fields}
        names = self.scan.field_names or list(offered)
        has = ", ".join(names) or "none"
        typed = [f.name for f in self.options.typed_fields if f.name not in names]
        if typed:
            raise OptionError(
                f"--field: {self.where} has no field {', '.join(map(repr, typed))} (its fields: "
                f"{has})"
            )
        chosen = self.options.fields
        if chosen is None:
            kept = tuple(self.scan.fields)
        else:
            unknown = [name for name in chosen if name not in offered]
            if unknown:
                raise OptionError(
                    f"--fields: {self.where} has no field {', '.join(map(repr, unknown))} "
                    f"(its fields: {has})"
                )
            kept = tuple(offered[name] for name in chosen)
        if kept and not self.options.spec.stores_fields:
            raise OptionError(
                f"format {self.options.format!r} cannot store fields, and {self.where} has "
                f"{', '.join(f.spec for f in kept)}: convert to a format that stores them "
                "(each of imgpack's own does), or give --fields '' to convert without them"
            )
        return kept

    @cached_property
    def run(self) -> str:
        """A token unique to this run: the readers workers open for it belong to it."""
        return uuid.uuid4().hex

    @property
    def remote(self) -> str | None:
        """The URL of a bucket SRC read in place (its listing's or output's scratch folder is
        ``src``), else ``None``."""
        if not self.src.is_dir():
            return None
        remote = listing.remote_source(self.src) or listing.remote_output(self.src)
        return remote[0] if remote is not None else None

    @property
    def where(self) -> str:
        """SRC in messages: a bucket read in place by its URL, not the folder of its listing."""
        return self.remote or str(self.src)

    @property
    def bounds(self) -> tuple[int, int]:
        """The slice of the scan this conversion converts: all of it, or part ``part`` of
        ``num_parts`` contiguous, near-equal ranges."""
        total, parts, part = len(self.scan.samples), self.options.num_parts, self.options.part
        return total * part // parts, total * (part + 1) // parts

    @property
    def samples(self) -> Sequence[Sample]:
        """The samples this conversion converts, in scan order."""
        start, stop = self.bounds
        return self.scan.samples[start:stop]

    @property
    def unreadable(self) -> list[dict[str, str]]:
        """The folders and names the scan could not take, recorded by the first part only (so
        that merged parts list each once)."""
        return list(self.scan.unreadable) if self.options.part == 0 else []

    @property
    def part(self) -> dict[str, int] | None:
        """What the manifest records of a partitioned conversion."""
        if self.options.num_parts == 1:
            return None
        start, stop = self.bounds
        return {
            "index": self.options.part,
            "count": self.options.num_parts,
            "start": start,
            "stop": stop,
        }

    def writer_config(self) -> WriterConfig:
        opts = self.options
        return WriterConfig(
            format=opts.format,
            classes=self.scan.classes,
            encoding=opts.encoding_spec,
            policy=opts.policy,
            shard_size=opts.shard_size or 0,
            settings=dict(opts.format_options),
            output_id=self.output_id,
            first_index=self.first_sample + self.bounds[0],
            fields=self.fields,
        )

    @cached_property
    def output_id(self) -> str:
        """The id written into the manifest and every data file, so that a reader never mixes
        the files of two outputs (one replaced the other while it read).

        It depends only on what the output's bytes depend on: the options, the label map and
        every sample's path, label, size and modification time (not the source folder's
        location), so identical runs write identical bytes and a source that changed gives a
        new id. The parts of a partitioned conversion share the id of the whole. An append's
        depends on the output it appends to as well (its id: a new version of it)."""
        return self._identity(self.base.output_id if self.base is not None else None)

    @cached_property
    def append_key(self) -> str:
        """What an append of these samples is known by in the output's manifest, whatever
        version of the output it was appended to: its id without the base output's."""
        return self._identity(None)

    def _identity(self, base: str | None) -> str:
        opts = self.options
        digest = hashlib.sha256()
        head = {
            "imgpack": __version__,
            "format": opts.format,
            "options": opts.recorded(),
            "image": opts.policy.describe(),
            "classes": self.scan.classes,
            "origin": self.scan.origin,
            **({"layout": self.layout} if self.layout else {}),
            **({"fields": [f.spec for f in self.fields]} if self.fields else {}),
            **({"appended_to": base} if base is not None else {}),
        }
        # A bucket's objects are known by what the store says of each (its listing: sizes and
        # ETags), files by their stat; other sources' contents are in the origin already.
        listed = listing.listing_digest(self.src) if self.src.is_dir() else None
        if listed is not None:
            head["listing"] = listed
        digest.update(json.dumps(head, sort_keys=True).encode())
        stamp = self.source.stamp
        for sample in self.scan.samples:
            found = "" if listed is not None else stamp(sample)
            line = f"{sample.label}\t{found}\t{sample.path}\n"
            digest.update(line.encode("utf-8", "surrogateescape"))
        return digest.hexdigest()[:OUTPUT_ID_LENGTH]

    @cached_property
    def fingerprint(self) -> str:
        """What the output depends on: the source, its scan and the options (not the workers);
        a source file changed since an interrupted run started makes it differ."""
        digest = hashlib.sha256()
        # A bucket SRC's scratch copy has a new path every run: the store's stamps of every
        # object (in the output id) identify it.
        copied = any(
            (self.src / n).is_file() for n in (listing.STORE_LISTING, listing.STORE_MANIFEST)
        )
        source = "a bucket's copy" if copied else str(self.src.resolve())
        head = {"output": self.output_id, "source": source, "part": self.part}
        digest.update(json.dumps(head, sort_keys=True).encode())
        return digest.hexdigest()


def manifest_for(
    plan: Plan,
    files: list[FileEntry],
    count: int,
    skipped: list[dict[str, str]],
    stats: DatasetStats | None = None,
) -> Manifest:
    """The manifest of ``plan``'s output made of ``files``, holding ``count`` samples, with
    their ``stats`` (``None``: not known)."""
    opts, scan = plan.options, plan.scan
    return Manifest(
        format=opts.format,
        num_samples=count,
        classes=scan.classes,
        encoding=opts.encoding,
        image=opts.policy.describe(),
        files=files,
        options=opts.recorded(),
        source={
            "path": plan.remote or str(plan.src.resolve()),
            "image_files": len(scan.samples),
            "ignored_files": scan.ignored_files,
            "ignored": scan.ignored_reasons(),
            "empty_classes": scan.empty_classes,
            "classes_from": opts.classes_from,
            **_chain(scan),
        },
        skipped=skipped,
        created_by=f"imgpack {__version__}",
        output_id=plan.output_id,
        part=plan.part,
        stats=stats.to_json() if stats is not None else None,
        fields=list(plan.fields),
    )


def _chain(scan: Scan) -> dict[str, Any]:
    """What the manifest records of a source that is not an image folder: its format, its
    output id and its own ``source`` (so a manifest holds the whole chain of conversions)."""
    origin = scan.origin
    if origin is None:
        return {}
    keys = (
        "format",
        "encoding",
        "output_id",
        "foreign",
        "from",
        "image_column",
        "label_column",
        "file",
    )
    return {"converted_from": {k: origin[k] for k in keys if k in origin}}


__all__ = ["Plan", "manifest_for"]
