"""Conversion to a bucket by shards: workers write whole shards straight to DST.

For the sharded formats (``pt``, ``tfrecord``, ``webdataset``) with DST in object storage::

    plan     the scan, then a shard plan cut from it before any image is read: shard k holds
             scan positions bounds[k] to bounds[k+1], cut at --shard-size by each sample's
             source bytes as listed (raw: the record's fixed size), so every shard's final name
             is known before it is written (TFRecord's -of-N too)
    tasks    one task per shard (a pool process, a Ray task on any node) reads its samples
             from SRC, writes the shard with the format's own writer in a temp folder of its
             machine, uploads it under its final name, then its receipt (count, bytes,
             sha256, skipped files) under DST/.imgpack-work/<output id>/; a bucket SRC's
             listing is saved in DST/.imgpack-work/listing/, so that the other parts and a
             resume plan from it instead of listing SRC again
    commit   once every shard has a receipt, the manifest is made from the receipts and
             written last (readers see the output whole or not at all); the work folder is
             removed

A shard's bytes depend only on the plan and its own sources, so the executor, the worker
count, retries, resumes and the number of parts (``--num-parts K --part I``: part I writes
shards ``S*I//K`` to ``S*(I+1)//K`` of the one plan, and whichever part finishes last commits)
never change the output. Only receipts (a few hundred bytes per shard) come back to the driver.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from imgpack.appending import appended
from imgpack.checksum import content_digest
from imgpack.errors import ImageError, ImgpackError
from imgpack.executors import WORKER_DIED, Failure, Job, Outcome, TaskDied
from imgpack.formats import get as format_spec
from imgpack.formats.writer_base import ShardedWriter, WriterConfig, shard_size_note
from imgpack.manifest import (
    MANIFEST_NAME,
    Companion,
    FileEntry,
    Manifest,
    manifest_bytes,
    part_manifest_name,
)
from imgpack.planning import Plan, manifest_for
from imgpack.scan import Sample, SampleTable
from imgpack.sources import listing
from imgpack.stats import DatasetStats
from imgpack.storage import location
from imgpack.storage.cache import write_bytes

log = logging.getLogger(__name__)

#: :attr:`imgpack.pipeline.Plan.layout` of a conversion by shard tasks.
LAYOUT = "shards"
#: The folder under DST that holds an unfinished conversion's plan and receipts.
WORK = ".imgpack-work"
#: In it: the listing of a bucket SRC the conversion took (:func:`imgpack.sources.listing.
#: save_listing`), read by its parts and resumes instead of listing SRC again.
SAVED = f"{WORK}/listing"
#: In it on a local or shared path: a shard task's scratch folder (its name then a random tail),
#: where it writes its shard before the rename; a task of any part, running or killed.
SCRATCH = "imgpack-shard-"
#: Samples whose objects a shard task GETs at once (bounded memory, round trips overlapped).
FETCH_GROUP = 32


def applies(options: Any, dst: Any) -> bool:
    """Whether a conversion is written by shard tasks straight into DST: a sharded format (one
    whose writer is a :class:`~imgpack.formats.writer_base.ShardedWriter`) and DST in object
    storage. Every source kind plans its shards from its images' sizes
    (:func:`sample_sizes`), and every executor runs them: one that runs no tasks, or whose
    workers cannot reach DST (fsspec's per-process ``memory://``), converts each shard's
    samples and this process writes it (:func:`_write_shards`)."""
    return applies_locally(options) and location.is_url(dst)


def cut(sizes: Iterable[int], limit: int) -> list[int]:
    """The shard plan's boundaries for samples of ``sizes`` bytes, ``[0, b1, ..., n]``: as many
    shards as filling them in order gives (:func:`rollover`: each within ``limit``, or one
    sample), cut to near-equal bytes: each shard ends at the sample boundary nearest an equal
    share of what is left (the rest over the shards still to cut), or before it where that
    would pass ``limit``; where samples too coarse for that would need another shard, the
    shards filled in order. Equal shards keep every worker busy to the end of a conversion of
    a few shards, where a short last shard left workers idle (two shards on two workers, the
    second 0.56 of the first: busy 0.78 of the time). The sizes are held as one int64 each
    while the plan is cut."""
    ends = np.fromiter(sizes, np.int64)
    if not len(ends):
        return [0]
    np.cumsum(ends, out=ends)  # where each sample ends
    filled = _filled(ends, limit)
    if len(filled) <= 2:
        return filled
    return _equal_cut(ends, limit, len(filled) - 1) or filled


def _equal_cut(ends: np.ndarray, limit: int, shards: int) -> list[int] | None:
    """:func:`cut`'s near-equal boundaries in ``shards`` shards, for samples ending at
    ``ends`` (their running total); ``None`` where the samples are too coarse for that many."""
    count, total = len(ends), int(ends[-1])
    out = [0]
    for left in range(shards, 0, -1):  # the shards still to cut, this one included
        start = out[-1]
        first = int(ends[start - 1]) if start else 0
        if left == 1:
            if total - first > limit and count - start > 1:
                return None
            out.append(count)
            break
        target = first + (total - first) / left
        fits = int(np.searchsorted(ends, first + limit, side="right"))  # [start, fits) fit
        reach = int(np.searchsorted(ends, target, side="left"))  # the first reaching target
        if reach >= count:
            stop = count
        else:
            before = int(ends[reach - 1]) if reach else 0
            stop = reach + 1 if int(ends[reach]) - target < target - before else reach
        out.append(max(start + 1, min(stop, fits)))
        if out[-1] >= count:
            break
    return out


def rollover(sizes: Iterable[int], limit: int) -> list[int]:
    """Boundaries of shards filled in order, as a writer rolls over: a shard takes samples while
    it stays within ``limit`` bytes, and at least one. ``[0, b1, ..., n]``."""
    ends = np.fromiter(sizes, np.int64)
    if not len(ends):
        return [0]
    return _filled(np.cumsum(ends, out=ends), limit)


def _filled(ends: np.ndarray, limit: int) -> list[int]:
    """:func:`rollover` of samples ending at ``ends`` (their running total): a binary search
    per shard."""
    count, out = len(ends), [0]
    while out[-1] < count:
        start = out[-1]
        first = int(ends[start - 1]) if start else 0
        fits = int(np.searchsorted(ends, first + limit, side="right"))
        out.append(max(start + 1, fits))
    return out


@dataclass(frozen=True)
class ShardTask:
    """Everything a worker needs to write one shard (pickled to it: a Ray task on any node)."""

    job: Job
    config: WriterConfig
    number: int
    total: int
    start: int
    samples: list[Sample]
    url: str
    #: The fsspec storage options, as JSON.
    storage_options: str
    #: The receipt's path under DST.
    receipt: str
    on_error: str = "fail"
    #: Samples not to read, with why: the ones that kill their worker (found by the driver).
    excluded: dict[str, str] = field(default_factory=dict)
    #: The output's number of the plan's first shard (after an appended output's shards): the
    #: shard's file is named as shard ``first_shard + number`` of ``first_shard + total``.
    first_shard: int = 0

    @property
    def stop(self) -> int:
        return self.start + len(self.samples)


def write_shard(task: ShardTask) -> dict[str, Any]:
    """Read, convert and write one shard, upload it under its final name, then its receipt:
    ``{"shard", "start", "stop", "count", "skipped", "file"}`` (``file``: its manifest entry).
    With ``--on-error fail``, the first bad file is returned as ``{"failed": {...}}`` and
    nothing is uploaded."""
    return shard_from(task, _converted(task))


def _converted(task: ShardTask) -> Iterator[Outcome]:
    """Each sample of the task converted here, in order (a bad file, or one excluded, as a
    :class:`~imgpack.executors.Failure`)."""
    prefetch = getattr(task.job.fetch, "prefetch", None)
    expect = getattr(task.job.fetch, "expect", None)
    if expect is not None:
        expect(task.samples)
    for at in range(0, len(task.samples), FETCH_GROUP):
        group = task.samples[at : at + FETCH_GROUP]
        if prefetch is not None:
            prefetch([s for s in group if s.path not in task.excluded])
        for sample in group:
            reason = task.excluded.get(sample.path)
            if reason is not None:
                yield Failure(sample.path, reason)
                continue
            try:
                yield task.job.convert(sample)
            except ImageError as exc:
                yield Failure(exc.path, exc.reason)


def shard_from(task: ShardTask, outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """:func:`write_shard` with the task's samples converted already: ``outcomes``, one per
    sample in order (converted in this process, or by a pool for a driver that writes the
    shard itself: the same bytes)."""
    fs, root = location.filesystem(task.url, json.loads(task.storage_options) or None)
    skipped: list[dict[str, str]] = []
    tally = DatasetStats.empty(task.job.policy.channels, len(task.config.classes), task.job.stats)
    local_dst = not location.is_url(task.url)  # a folder on this machine: renamed in place
    scratch = f"{root}/{WORK}" if local_dst else None
    if scratch is not None:
        os.makedirs(scratch, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=SCRATCH, dir=scratch) as tmp:
        writer = format_spec(task.config.format).writer_class()(Path(tmp), task.config)
        assert isinstance(writer, ShardedWriter)
        with writer:
            writer.open_shard()
            for outcome in outcomes:
                if isinstance(outcome, Failure):
                    if task.on_error == "fail":
                        return {"failed": {"path": outcome.path, "reason": outcome.reason}}
                    skipped.append({"path": outcome.path, "reason": outcome.reason})
                    continue
                writer.add(outcome)
                tally.add(outcome.label, outcome.height, outcome.width, outcome.sums)
        (written,) = writer.close()
        local = Path(tmp) / written.path
        target = Path(tmp) / writer.final_name(
            task.first_shard + task.number, task.first_shard + task.total
        )
        companions = []
        for (name, digest), old, new in zip(
            written.companions, writer.companions_of(local), writer.companions_of(target),
            strict=True,
        ):  # fmt: skip
            assert old.name == name
            companions.append(Companion(new.name, old.stat().st_size, digest))
            _put(fs, old, f"{root}/{new.name}", local_dst)
        entry = FileEntry(
            target.name, local.stat().st_size, written.num_samples, written.sha256, companions
        )
        _put(fs, local, f"{root}/{target.name}", local_dst)
    names = [entry.path, *(c.path for c in entry.companions)]
    receipt = {
        "shard": task.number,
        "start": task.start,
        "stop": task.stop,
        "count": written.num_samples,
        "skipped": skipped,
        "file": asdict(entry),
        "stats": tally.to_json(),
        # What the store says of each object just uploaded: the commit refuses a shard object
        # the listing then names otherwise (swapped or rewritten since).
        "etags": {name: content_tag(fs.info(f"{root}/{name}")) for name in names},
        # The conversion it is for: another conversion's receipt copied over is refused.
        "output_id": task.config.output_id,
    }
    receipt["check"] = receipt_check(receipt)
    body = json.dumps(receipt, sort_keys=True).encode()
    if local_dst:  # whole or not at all, as a store's PUT is
        write_bytes(Path(root) / task.receipt, body)
    else:
        fs.pipe_file(f"{root}/{task.receipt}", body)
    return receipt


def _write(dest: Destination, name: str, data: bytes) -> None:
    """Write file ``name`` of DST: one PUT to a store; on a local or shared path a temp file
    renamed in (whole or not at all, as a PUT is), its folder made first."""
    if location.is_url(dest.url):
        dest.fs.pipe_file(f"{dest.root}/{name}", data)
        return
    target = Path(dest.root) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(target, data)


def _remove(dest: Destination, name: str) -> None:
    """Remove file or folder ``name`` of DST (fsspec's local ``rm`` would take a name with
    ``[`` for a pattern)."""
    if location.is_url(dest.url):
        with contextlib.suppress(FileNotFoundError):
            dest.fs.rm(f"{dest.root}/{name}", recursive=True)
        return
    target = Path(dest.root) / name
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def _put(fs: Any, file: Path, path: str, local: bool) -> None:
    """Put a written ``file`` at ``path`` of DST: renamed there on a local or shared path (the
    file was written beside it, in DST's work folder), uploaded to a store."""
    if local:
        os.replace(file, path)
    else:
        fs.put_file(str(file), path)


def content_tag(info: dict[str, Any]) -> str:
    """What identifies a written file's content: the store's (ETag, version), for a file on a
    local or shared path its inode, size and modification time (a file written again, or
    another renamed over it, has others), for fsspec's ``memory://`` its size and when it was
    written; ``""`` when the store says nothing of the kind (its shards cannot be committed)."""
    tag = location.content_tag(info)
    if tag:
        return tag
    if info.get("ino") is not None:
        return f"{info['ino']}:{info.get('size')}:{info.get('mtime')}"
    created = info.get("created")  # fsspec's memory://: when the file was written
    if created is None:
        return ""
    stamp = created.timestamp() if hasattr(created, "timestamp") else float(created)
    return f"{info.get('size')}:{stamp!r}"


def receipt_check(receipt: dict[str, Any]) -> str:
    """The sha256 of a receipt's contents (all but ``check``), as its worker wrote them: an
    edit (a checksum zeroed, a count changed) no longer matches it."""
    return content_digest({key: value for key, value in receipt.items() if key != "check"})


def _entry(data: dict[str, Any]) -> FileEntry:
    companions = [Companion(**c) for c in data.get("companions", [])]
    return FileEntry(data["path"], data["bytes"], data["num_samples"], data["sha256"], companions)


@dataclass
class Destination:
    """DST as the store lists it: its files (relative path -> size)."""

    url: str
    fs: Any
    root: str
    files: dict[str, int]
    #: What the store says identifies each file's content (ETag or version; "" unknown).
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def list(cls, url: str, storage_options: dict[str, Any] | None) -> Destination:
        fs, root = location.filesystem(url, storage_options)
        return cls(url, fs, root, *_files(fs, root, url))

    def relisted(self) -> Destination:
        """DST listed again (other parts and tasks write to it too), every listing of it and
        of the folders below it forgotten first: s3fs's ``invalidate_cache(path)`` forgets
        ``path`` and its parents only, and a cached listing of the work folder hid the
        receipts this very run wrote (a first ``--resume`` then did not commit)."""
        location.forget_listings(self.fs, self.root)
        return Destination(self.url, self.fs, self.root, *_files(self.fs, self.root, self.url))


def _files(fs: Any, root: str, url: str) -> tuple[dict[str, int], dict[str, str]]:
    """DST's files as listed: their sizes and content tags, by relative path."""
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    except OSError as exc:
        raise location.remote_error(url, exc) from None
    listed = [(path[len(root) :].lstrip("/"), info) for path, info in listing.listed_objects(found)]
    sizes = {name: int(info.get("size") or 0) for name, info in listed}
    return sizes, {name: content_tag(info) for name, info in listed}


def convert_to_bucket(
    plan: Plan, url: str, storage_options: dict[str, Any] | None, executor: Any
) -> Manifest:
    """Run a planned conversion (:class:`imgpack.pipeline.Plan`, its layout ``"shards"``) with
    shard tasks writing straight to the bucket ``url``; the manifest once every shard is
    written (this run's, or with ``--num-parts`` the last part's), else this part's summary."""
    options = plan.options
    url = url.rstrip("/")
    bounds, first, last = shard_plan(plan)
    total = len(bounds) - 1
    dest = Destination.list(url, storage_options)
    work = f"{WORK}/{plan.output_id}"
    committed = _check_destination(dest, plan, work)
    if committed is not None:
        return committed
    plan_file = {"output_id": plan.output_id, "format": options.format, "shards": total}
    try:  # the first write: a bucket that does not exist is named here
        _write(dest, f"{work}/plan.json", json.dumps(plan_file).encode())
        if not location.is_url(url):  # a path's folders are made; a store has none
            (Path(dest.root) / SAVED).mkdir(parents=True, exist_ok=True)
        listing.save_listing(plan.src, dest.fs, f"{dest.root}/{SAVED}")
    except (FileNotFoundError, PermissionError) as exc:
        raise location.remote_error(url, exc) from None
    names = shard_names(plan, total)
    done = set(_receipts(dest, work, plan, bounds, names)[0]) if options.resume else set()
    _write_shards(plan, url, storage_options, executor, bounds, range(first, last), done)
    receipts, bad = _receipts(dest, work, plan, bounds, names)
    if bad:
        path, problem = next(iter(sorted(bad.items())))
        raise ImgpackError(
            f"{url}/{path}: {problem}; nothing committed ({len(bad)} such receipt(s)): "
            "--resume writes those shards again"
        )
    if options.num_parts > 1:  # the last part to finish a DST the parts share commits it
        summary = _part_summary(plan, receipts, bounds, first, last, url)
        if not all(k in receipts for k in range(first, last)):
            return summary
        _keep_part(plan, dest, summary)
        if len(receipts) < total or not _every_part_kept(dest, options.num_parts):
            return summary
    elif len(receipts) < total:
        missing = next(k for k in range(total) if k not in receipts)
        raise ImgpackError(
            f"{url}: shard {missing} has no receipt though its task ended; nothing committed: "
            "--resume writes it again"
        )
    return commit(plan, dest, work, [receipts[k] for k in range(total)])


def _every_part_kept(dest: Destination, count: int) -> bool:
    """Whether every one of the ``count`` parts has kept its manifest in DST: the parts share
    it, and all have finished. A part written into a folder of its own finds only its own there
    (it is merged with the others), even one that holds every shard of a plan with fewer shards
    than parts."""
    listed = set(dest.relisted().files)
    return all(part_manifest_name(k, count) in listed for k in range(count))


def _write_shards(
    plan: Plan,
    url: str,
    storage_options: dict[str, Any] | None,
    executor: Any,
    bounds: Sequence[int],
    mine: Sequence[int],
    done: set[int],
    kept: bool = True,
) -> None:
    """Write shards ``mine`` of the plan cut at ``bounds`` into DST ``url`` by shard tasks,
    but those ``done`` (their receipts hold): each shard, then its receipt. ``kept``: whether
    what is written stays when a bad file stops the run (not in a temp folder that goes)."""
    options = plan.options
    total = len(bounds) - 1
    work = f"{WORK}/{plan.output_id}"
    config = replace(plan.writer_config(), shard_size=sys.maxsize)
    numbers = [k for k in mine if k not in done]
    # Said once, as the one writer says it. An image larger than the shard size is a shard of
    # its own, so the sizes are looked at again only where a shard holds one image.
    if options.shard_size and any(bounds[k + 1] - bounds[k] == 1 for k in range(total)):
        largest = max(sample_sizes(plan, framed=False), default=0)
        if largest > options.shard_size:
            log.warning("%s", shard_size_note(options.shard_size, largest))

    def task(k: int) -> ShardTask:  # made as it is sent: one shard's samples at a time
        return ShardTask(
            plan.job,
            replace(config, first_index=plan.first_sample + bounds[k]),
            k,
            total,
            bounds[k],
            list(plan.scan.samples[bounds[k] : bounds[k + 1]]),
            url,
            json.dumps(storage_options or {}, sort_keys=True),
            f"{work}/{receipt_name(k)}",
            options.on_error,
            first_shard=plan.first_shard,
        )

    count = sum(bounds[k + 1] - bounds[k] for k in mine)
    bar = tqdm(
        total=count,
        initial=count - sum(bounds[k + 1] - bounds[k] for k in numbers),
        unit="img",
        desc=options.format,
        file=sys.stderr,
        disable=not options.progress,
        dynamic_ncols=True,
    )
    with bar:
        workers = getattr(executor, "workers", None) or 0
        # Shard tasks, in rounds of one shard per worker. The shards of a last round short of
        # the workers (every shard, with fewer shards than workers) are converted by the pool
        # and written by this process, the same bytes, so that no worker idles while another
        # writes the last shard alone; and so is every shard where no task can write DST: a
        # path the workers may not share (a Ray cluster's nodes writing into this machine's
        # folder), a store only this process sees (fsspec's memory://), an executor that runs
        # no tasks.
        on_path = not location.is_url(url) and not getattr(executor, "local_machine", False)
        here = on_path or url.startswith("memory://") or not hasattr(executor, "tasks")
        last = len(numbers) if here else len(numbers) % workers if workers else 0
        by_tasks, by_this = numbers[: len(numbers) - last], numbers[len(numbers) - last :]
        if by_tasks:
            for sent, result in executor.tasks(write_shard, map(task, by_tasks)):
                receipt = result
                if isinstance(result, TaskDied):
                    receipt = _without_killers(plan, executor, sent)
                _raise_failed(plan, receipt, kept)
                bar.update(len(sent.samples))
        for k in by_this:
            written = task(k)
            # Closed as soon as the shard is written or the run stops (an error, SIGTERM): the
            # pool is shut down then, not when the generator is collected at exit.
            with contextlib.closing(executor.outcomes(written.job, written.samples)) as outcomes:
                receipt = shard_from(written, outcomes)
            _raise_failed(plan, receipt, kept)
            bar.update(len(written.samples))


def _raise_failed(plan: Plan, receipt: dict[str, Any], kept: bool) -> None:
    """The error a shard's result stands for when a bad file stopped it (``--on-error fail``);
    ``kept``: whether the shards written so far stay for ``--resume``."""
    if "failed" in receipt:
        failed = receipt["failed"]
        after = (
            "the shards written so far are kept: --resume continues"
            if kept
            else ("nothing was written")
        )
        raise ImageError(
            f"{plan.where}/{failed['path']}",
            f"{failed['reason']} (use --on-error skip to skip such files; {after})",
        )


def shard_plan(plan: Plan) -> tuple[list[int], int, int]:
    """The shard plan of the whole conversion (``[0, ..., n]``) and the shards ``first`` to
    ``last - 1`` that this part writes: near-equal shards (:func:`cut`), except for a raw
    output, whose shards are filled in order (:func:`rollover`): a raw reader gathers a batch
    from the shard holding most of its rows and copies the others' over (``formats.gather``),
    so one large first shard beside a short last one reads faster than two halves (webdataset,
    50,000 32x32 images in two shards: 0.35 of the in-RAM limit as halves, 0.40-0.42 filled
    in order), and a raw output is read many times for each time it is converted."""
    options = plan.options
    limit = options.shard_size or sys.maxsize
    raw = options.encoding_spec.name == "raw"
    bounds = (rollover if raw else cut)(sample_sizes(plan), limit)
    total = len(bounds) - 1
    part, parts = options.part, options.num_parts
    return bounds, total * part // parts, total * (part + 1) // parts


def shard_names(plan: Plan, total: int) -> list[str]:
    """Each shard's file name in the finished output (TFRecord's names hold ``-of-N``)."""
    with tempfile.TemporaryDirectory(prefix="imgpack-names-") as tmp:
        writer = format_spec(plan.options.format).writer_class()(Path(tmp), plan.writer_config())
        assert isinstance(writer, ShardedWriter)  # shard tasks write sharded formats only
        first = plan.first_shard
        return [writer.final_name(first + k, first + total) for k in range(total)]


def receipt_name(number: int) -> str:
    return f"shard-{number:05d}.json"


def receipts_in(folder: Path) -> int:
    """How many receipts the work folder of a local conversion by shard tasks holds (while
    it runs too: its tasks' scratch folders beside the receipts come and go)."""
    count = 0
    try:
        outputs = [p for p in (folder / WORK).iterdir() if not p.name.startswith(SCRATCH)]
    except OSError:
        return 0
    for output in outputs:
        try:
            names = os.listdir(output)
        except OSError:  # not a folder, or gone
            continue
        count += sum(1 for n in names if n.startswith("shard-") and n.endswith(".json"))
    return count


def _without_killers(plan: Plan, executor: Any, task: ShardTask) -> dict[str, Any]:
    """The receipt of a shard whose task died on every try: each of its samples converted
    alone finds the ones that kill their worker; with ``--on-error skip`` the shard is written
    again without them (they are recorded as skipped), else the first stops the run."""
    outcomes = executor.alone(plan.job, task.samples)
    killers = {
        o.path: o.reason for o in outcomes if isinstance(o, Failure) and o.reason == WORKER_DIED
    }
    if not killers:
        raise ImgpackError(
            f"the task writing shard {task.number} of {plan.where} died on every try, though "
            "none of its images kills a worker alone (out of memory? try fewer --workers or a "
            "smaller --shard-size)"
        )
    if task.on_error == "fail":
        path = next(iter(killers))
        return {"failed": {"path": path, "reason": killers[path]}}
    for path in killers:
        log.warning("%s: %s", path, WORKER_DIED)
    again = replace(task, excluded={**task.excluded, **killers})
    ((_, receipt),) = list(executor.tasks(write_shard, [again]))
    if isinstance(receipt, TaskDied):
        raise ImgpackError(
            f"the task writing shard {task.number} of {plan.where} died again without "
            f"{', '.join(killers)}; stopping"
        )
    return dict(receipt)


def sample_sizes(plan: Plan, framed: bool = True) -> Iterator[int]:
    """The bytes the shard plan counts for each sample, in scan order: what the format's writer
    adds to a shard for it (:meth:`~imgpack.formats.writer_base.ShardedWriter.estimated_bytes`)
    given a raw record's fixed size, else the source file's size as the store lists it (or as
    the file system says). ``framed=False``: those sizes as they are (what ``--dry-run``
    counts)."""
    opts = plan.options
    estimate = getattr(opts.spec.writer_class(), "estimated_bytes", None)
    if estimate is None or not framed:  # the image's bytes as they are
        estimate = _as_stored
    if opts.encoding_spec.name == "raw":
        fixed = opts.policy.fixed_size
        assert fixed is not None  # raw needs a fixed size (checked with the options)
        height, width = fixed
        record = estimate(height * width * opts.policy.channels, raw=True)
        for _ in plan.scan.samples:
            yield record
        return
    samples = plan.scan.samples
    for index in range(len(samples)):
        size = samples.size(index) if isinstance(samples, SampleTable) else samples[index].size
        if size < 0:
            size = max(0, plan.source.stored_size(samples[index]))  # -1: its task names it
        yield estimate(size)


def _as_stored(stored: int, raw: bool = False) -> int:
    return stored


def _check_destination(dest: Destination, plan: Plan, work: str) -> Manifest | None:
    """Refuse a DST that holds something else; withdraw an output being replaced
    (``--overwrite``: its manifest removed first); the manifest of this very conversion when it
    was committed already (a part or a ``--resume`` run after the last part finished)."""
    options = plan.options
    # A listing is no work, nor a task's scratch folder (another part's task writing a shard).
    held = [p for p in dest.files if not p.startswith((f"{SAVED}/", f"{WORK}/{SCRATCH}"))]
    others = sorted(
        {p.split("/")[1] for p in held if p.count("/") >= 2 and p.startswith(f"{WORK}/")}
        - {plan.output_id}
    )
    if others and not options.overwrite:
        raise FileExistsError(
            f"{dest.url}: holds the unfinished work of another conversion ({WORK}/{others[0]}: "
            "another source or other options); finish it with its own command and --resume, "
            "or replace it with --overwrite"
        )
    for other in others:  # replaced: its shards are overwritten, or removed at the commit
        _remove(dest, f"{WORK}/{other}")
    if MANIFEST_NAME in dest.files:
        manifest = _read_manifest(dest)
        if manifest.output_id == plan.output_id and (options.resume or options.num_parts > 1):
            return manifest
        if plan.base is not None:  # appended to: its manifest is replaced at the commit
            if manifest.output_id != plan.base.output_id:
                raise FileExistsError(
                    f"{dest.url}: was replaced or appended to while this append was planned; "
                    "nothing was written: run the append again"
                )
            return None
        if not options.overwrite:
            raise FileExistsError(f"{dest.url}: already exists (use --overwrite to replace it)")
        _remove(dest, MANIFEST_NAME)  # withdrawn: no reader opens it now
        return None
    ours = any(p.startswith(f"{work}/") for p in held)
    if held and not ours and not others:
        raise FileExistsError(
            f"{dest.url}: already exists and holds no {MANIFEST_NAME}; refusing to replace it, "
            "with or without --overwrite (remove it yourself, or choose another destination)"
        )
    return None


def _read_manifest(dest: Destination) -> Manifest:
    data = json.loads(dest.fs.cat_file(f"{dest.root}/{MANIFEST_NAME}"))
    return Manifest.from_json(data, f"{dest.url}/{MANIFEST_NAME}")


def _receipts(
    dest: Destination, work: str, plan: Plan, bounds: Sequence[int], names: Sequence[str]
) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
    """The receipts under ``work`` that hold (:func:`_receipt_problem`), by shard number, and
    the others, by receipt path, with what is wrong; the store is listed again (other parts
    write too). A worker writes a receipt only once its shard is uploaded, so a receipt whose
    shard is missing or changed is a bad one. ``bounds``: the plan's shard bounds; ``names``:
    each shard's file name."""
    fresh = dest.relisted()
    paths = [p for p in fresh.files if p.startswith(f"{work}/shard-") and p.endswith(".json")]
    found: dict[int, dict[str, Any]] = {}
    bad: dict[str, str] = {}
    if not paths:
        return found, bad
    blobs = _read_all(dest, [f"{dest.root}/{p}" for p in paths])
    for path in paths:
        blob: Any = blobs.get(f"{dest.root}/{path}")
        try:
            receipt = json.loads(blob)
            number = int(receipt["shard"])
            entry = _entry(receipt["file"])
        except (TypeError, ValueError, KeyError):
            bad[path] = "not a receipt imgpack wrote (unreadable)"
            continue
        problem = _receipt_problem(receipt, entry, path, work, plan, bounds, names, fresh)
        if problem is None:
            found[number] = receipt
        else:
            bad[path] = problem
    return found, bad


def _read_all(dest: Destination, paths: list[str]) -> dict[str, Any]:
    """The contents of ``paths`` in DST (an error in place of one that cannot be read): from a
    store in one batch of GETs; on a local path file by file (fsspec's local ``cat`` would take
    a name with ``[`` for a pattern)."""
    if location.is_url(dest.url):
        return dict(dest.fs.cat(paths, on_error="return"))
    found: dict[str, Any] = {}
    for path in paths:
        try:
            found[path] = Path(path).read_bytes()
        except OSError as exc:
            found[path] = exc
    return found


def _receipt_problem(
    receipt: dict[str, Any],
    entry: FileEntry,
    path: str,
    work: str,
    plan: Plan,
    bounds: Sequence[int],
    names: Sequence[str],
    listed: Destination,
) -> str | None:
    """What makes a receipt disagree with the plan, with itself, or with its shard's objects
    as listed (their sizes, and the ETags the worker recorded right after uploading them)."""
    if receipt.get("output_id") != plan.output_id:
        return (
            f"is another conversion's (output id {str(receipt.get('output_id'))[:16]!r}, this "
            f"one's {plan.output_id[:16]!r})"
        )
    if receipt.get("check") != receipt_check(receipt):
        return "does not match its own checksum (edited since its worker wrote it)"
    if (
        not isinstance(entry.sha256, str)
        or len(entry.sha256) != 64
        or entry.sha256.strip("0123456789abcdef")
    ):
        return "records no sha256 of its shard"
    number = int(receipt["shard"])
    if not 0 <= number < len(names) or path != f"{work}/{receipt_name(number)}":
        return f"names shard {number}, which is not the shard this receipt is for"
    if entry.path != names[number]:
        return f"names the file {entry.path!r}, not shard {number}'s {names[number]!r}"
    if (receipt.get("start"), receipt.get("stop")) != (bounds[number], bounds[number + 1]):
        return "holds other samples than the plan's shard"
    skipped = receipt.get("skipped")
    count = receipt.get("count")
    if (
        not isinstance(skipped, list)
        or not all(isinstance(s, dict) and {"path", "reason"} <= set(s) for s in skipped)
        or type(count) is not int
        or count != entry.num_samples
        or count + len(skipped) != bounds[number + 1] - bounds[number]
    ):
        return "counts its samples and skipped files inconsistently"
    for name, size in [(entry.path, entry.bytes), *((c.path, c.bytes) for c in entry.companions)]:
        if listed.files.get(name) != size:
            return f"{name} is not in the bucket at the {size:,} bytes it records"
    if "stats" in receipt:
        try:
            DatasetStats.from_json(
                receipt["stats"], len(plan.scan.classes), plan.options.policy.channels, count
            )
        except (TypeError, ValueError, KeyError) as exc:
            return f"holds statistics that are not those of its {count} samples ({exc})"
    etags = receipt.get("etags")
    if not isinstance(etags, dict):
        return "records no ETags of its uploaded objects"
    for name in [entry.path, *(c.path for c in entry.companions)]:
        tag = listed.tags.get(name, "")
        if etags.get(name) != tag or not tag:
            return f"{name} is not the object its task uploaded (its ETag is another)"
    return None


def _manifest(plan: Plan, receipts: Sequence[dict[str, Any]], unreadable: bool = True) -> Manifest:
    """The manifest of the shards ``receipts`` describe; ``unreadable``: whether it lists the
    files the scan could not take (the whole output, and its part 0, do)."""
    files = [_entry(r["file"]) for r in receipts]
    listed = plan.scan.unreadable if unreadable else []
    skipped = [*listed, *(s for r in receipts for s in r["skipped"])]
    tally = DatasetStats.total(r.get("stats") for r in receipts)  # an older receipt: None
    if not receipts:  # a part with no shard (fewer shards than parts): it adds nothing
        tally = DatasetStats.empty(plan.job.policy.channels, len(plan.scan.classes), plan.job.stats)
    count = sum(r["count"] for r in receipts)
    return manifest_for(plan, files, count, skipped, tally)


def commit(
    plan: Plan, dest: Destination, work: str, receipts: Sequence[dict[str, Any]]
) -> Manifest:
    """Write the manifest of the whole output from its shards' receipts, last; remove what an
    output replaced left and the work folder."""
    manifest = _whole(plan, receipts)
    keep = {MANIFEST_NAME, *(f.path for f in manifest.files)}
    keep |= {c.path for f in manifest.files for c in f.companions}
    listed = dest.relisted()
    for stale in sorted(p for p in listed.files if p not in keep and not p.startswith(f"{WORK}/")):
        _remove(dest, stale)
    _write(dest, MANIFEST_NAME, manifest_bytes(manifest))  # the commit
    _remove(dest, work)
    _remove(dest, SAVED)
    if not location.is_url(dest.url):  # on a path, the work folder itself goes too, with
        folder = Path(dest.root) / WORK  # what killed tasks left (every shard is written)
        for left in folder.glob(f"{SCRATCH}*"):
            shutil.rmtree(left, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
    return manifest


def _whole(plan: Plan, receipts: Sequence[dict[str, Any]]) -> Manifest:
    """The manifest of the whole output from every shard's receipt (an appended output's
    files first); an error when every sample was skipped."""
    manifest = _manifest(plan, receipts)
    manifest.part = None
    if not manifest.num_samples:
        first = manifest.skipped[0] if manifest.skipped else {"path": "?", "reason": "?"}
        raise ImgpackError(
            f"{plan.where}: every one of the {len(plan.scan.samples)} image files was skipped; "
            f"nothing to write (first: {first['path']}: {first['reason']})"
        )
    return appended(plan.base, manifest, plan.append_key) if plan.base is not None else manifest


def applies_locally(options: Any) -> bool:
    """Whether a conversion is written by shard tasks: every sharded format (its writer a
    :class:`~imgpack.formats.writer_base.ShardedWriter`). One part to a path is written in the
    output's temp folder (:func:`write_local`); with ``num_parts``, every part writes into DST
    itself (:func:`convert_to_bucket`, the path taken for a bucket prefix). ``lmdb``, ``hdf5``
    and a plugin's one-file format have one writer (:mod:`imgpack.pipeline`)."""
    return bool(options.spec.sharded) and issubclass(options.spec.writer_class(), ShardedWriter)


def write_local(plan: Plan, folder: Path, executor: Any) -> Manifest:
    """Run a planned conversion (its layout ``"shards"``) with shard tasks writing into the
    local ``folder`` (the output's temp folder beside DST, published by the caller): each task
    writes its shard there under its final name, by a rename, then its receipt under
    ``.imgpack-work/<output id>/``. Shards whose receipts hold (a resumed run) are not written
    again. Returns the manifest of the whole output, made from the receipts (not written); the
    work folder is removed. The same shards, byte for byte, as :func:`convert_to_bucket`
    uploads for the same plan."""
    url = str(folder)
    bounds = shard_plan(plan)[0]
    total = len(bounds) - 1
    work = f"{WORK}/{plan.output_id}"
    dest = Destination.list(url, None)
    names = shard_names(plan, total)
    work_folder = folder / WORK
    if work_folder.is_dir():
        for left in work_folder.iterdir():  # a killed task's scratch
            if left.name.startswith(SCRATCH):
                shutil.rmtree(left, ignore_errors=True)
    (folder / work).mkdir(parents=True, exist_ok=True)  # where the receipts go
    done = set(_receipts(dest, work, plan, bounds, names)[0])
    _write_shards(plan, url, None, executor, bounds, range(total), done, kept=False)
    receipts, bad = _receipts(dest, work, plan, bounds, names)
    if bad:  # the temp folder goes with the error: a new run writes every shard again
        path, problem = next(iter(sorted(bad.items())))
        raise ImgpackError(
            f"{folder}/{path}: {problem}; nothing was published ({len(bad)} such receipt(s)): "
            "run the same command again"
        )
    missing = [k for k in range(total) if k not in receipts]
    if missing:
        raise ImgpackError(
            f"{folder}: shard(s) {', '.join(map(str, missing[:5]))} have no receipt though "
            "their tasks ended; nothing was published: run the same command again"
        )
    manifest = _whole(plan, [receipts[k] for k in range(total)])
    shutil.rmtree(folder / WORK, ignore_errors=True)
    return manifest


def _part_summary(
    plan: Plan,
    receipts: dict[int, dict[str, Any]],
    bounds: Sequence[int],
    first: int,
    last: int,
    url: str,
) -> Manifest:
    """What a part that did not finish the output returns: its own shards' manifest entries,
    with the part record (the last part to finish commits the whole output; a finished part's
    summary is kept beside its shards by :func:`_keep_part`)."""
    mine = [receipts[k] for k in range(first, last) if k in receipts]
    # What the scan could not take is listed once, by part 0, as merge expects.
    manifest = _manifest(plan, mine, unreadable=plan.options.part == 0)
    total = len(bounds) - 1
    start, stop = bounds[first], bounds[last]  # a part with no shard: an empty range
    manifest.part = {
        "index": plan.options.part,
        "count": plan.options.num_parts,
        "start": start,
        "stop": stop,
        "pending": total - len(receipts),  # shards of other parts without a receipt yet
        # its shards carry the whole output's names (check_file_order), after an appended
        # output's own
        "first_shard": plan.first_shard + first,
        "shards": plan.first_shard + total,
    }
    log.info(
        "%s: part %d of %d written (%d shards); the output is committed by the last part to "
        "finish", url, plan.options.part, plan.options.num_parts, last - first,
    )  # fmt: skip
    return manifest


def _keep_part(plan: Plan, dest: Destination, manifest: Manifest) -> None:
    """Write a finished part's manifest beside its shards (:func:`part_manifest_name`): a part
    written into a folder of its own is then an output ``imgpack merge`` joins; in a DST the
    parts share, the last part's commit removes it with the other leftovers."""
    name = part_manifest_name(plan.options.part, plan.options.num_parts)
    _write(dest, name, manifest_bytes(manifest))


__all__ = [
    "WORK",
    "ShardTask",
    "applies",
    "applies_locally",
    "commit",
    "convert_to_bucket",
    "cut",
    "write_local",
    "write_shard",
]
