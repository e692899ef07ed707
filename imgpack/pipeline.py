"""The conversion engine, as its four stages::

    plan     SRC + ConvertOptions -> the scan (ordered samples, label map) and the writer's config
    process  an executor reads + validates + encodes every sample, yielding them in scan order
    write    one writer stores them in a temp dir beside DST; --on-error decides on bad files;
             a checkpoint is saved whenever the writer has made more samples durable
    publish  the manifest is written last, then the temp dir is renamed to DST

The output depends only on the input and the options: the worker count and the executor change
the speed, never the bytes. Memory stays bounded by the executor's window plus what the writer
buffers (for ``pt``, one shard), whatever the dataset size. A failure or an interrupt removes the
temp dir and leaves DST as it was.

A conversion that was killed (no chance to clean up) leaves its temp dir with its last checkpoint:
``--resume`` continues it from there when SRC, DST and the options are the same (checked by a
fingerprint), redoing at most one checkpoint of work, and writes the same bytes an uninterrupted
run writes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, closing, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from imgpack import appending, direct, executors, formats, hf, sources
from imgpack.checksum import content_digest
from imgpack.errors import (
    DataError,
    ImageError,
    ImgpackError,
    ManifestError,
    OptionError,
    ScanError,
    StorageError,
)
from imgpack.executors import Executor, Failure, Outcome
from imgpack.formats.writer_base import (
    KEEP_PREFIX,
    Writer,
    WrittenFile,
    file_entries,
    shard_size_note,
)
from imgpack.images import Encoded, size_words
from imgpack.manifest import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    write_manifest,
)
from imgpack.opening import open_manifest
from imgpack.options import ConvertOptions
from imgpack.planning import Plan, manifest_for
from imgpack.publishing import (
    CHECKPOINT_NAME,
    check_destination,
    clear_leftovers,
    inside,
    leftovers,
    locked,
    parked_outputs,
    publish,
    recover,
    temp_output,
)
from imgpack.scan import by_reason, ignored_summary
from imgpack.sources.base import ScanRequest, forget
from imgpack.sources.folder.scan import SPLIT_NAMES, find_classes, find_splits, read_class_list
from imgpack.sources.listing import TopLevel, source_location
from imgpack.stats import DatasetStats, PixelSums
from imgpack.storage.destination import build_folder, output_folder
from imgpack.storage.location import is_url, local_path
from imgpack.units import format_bytes

log = logging.getLogger(__name__)

#: The checkpoint in a temp output dir (removed before publishing); its name starts with the
#: writers' KEEP_PREFIX, so no writer removes it.
CHECKPOINT = CHECKPOINT_NAME
assert CHECKPOINT.startswith(KEEP_PREFIX)


@dataclass
class Checkpoint:
    """Where an interrupted conversion stood: scan samples consumed, samples written (all of
    them durable in the files), the files skipped so far, and the writer's own state."""

    fingerprint: str
    position: int = 0
    count: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    writer: dict[str, Any] = field(default_factory=dict)
    #: The statistics of the ``count`` samples written (:class:`~imgpack.stats.DatasetStats`'s
    #: JSON); ``None`` when not known (a checkpoint of an imgpack that kept none).
    stats: dict[str, Any] | None = None

    #: Whether the checkpoint read matches the checksum it was written with (an edit of it,
    #: even a consistent one, does not); not saved.
    intact: bool = field(default=True, compare=False, repr=False)

    def save(self, directory: Path) -> None:
        tmp = directory / (CHECKPOINT + ".tmp")
        body = asdict(self)
        del body["intact"]
        body["check"] = content_digest(body)
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, directory / CHECKPOINT)

    @classmethod
    def load(cls, directory: Path) -> Checkpoint | None:
        """The checkpoint in ``directory``, or ``None`` when there is none or it is not one
        (damaged, another layout): such a folder cannot be resumed."""
        try:
            data = json.loads((directory / CHECKPOINT).read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                return None
            check = data.pop("check", None)
            data.pop("intact", None)
            found = cls(**data)
            found.intact = check == content_digest(data)
        except (OSError, ValueError, TypeError, UnicodeDecodeError):
            return None
        ints = (found.position, found.count)
        if (
            not isinstance(found.fingerprint, str)
            or not all(type(v) is int and v >= 0 for v in ints)
            or not isinstance(found.skipped, list)
            or not all(
                isinstance(s, dict) and set(s) == {"path", "reason"} and
                all(isinstance(v, str) for v in s.values())
                for s in found.skipped
            )
            or not isinstance(found.writer, dict)
        ):  # fmt: skip
            return None
        return found

    def check(self, plan: Plan, directory: Path) -> None:
        """Refuse a checkpoint whose counts do not add up for ``plan`` (edited, or damaged):
        resuming from it would skip or repeat samples. The writer checks its files itself."""
        unreadable = plan.unreadable
        problem = None
        if not self.intact:
            problem = "it does not match the checksum it was written with (edited since)"
        elif self.position > len(plan.samples):
            problem = f"position {self.position} is past the {len(plan.samples)} samples"
        elif self.skipped[: len(unreadable)] != unreadable:
            problem = "its skipped files do not start with the scan's unreadable ones"
        elif self.stats is not None and (why := _stats_problem(self.stats, self.count, plan)):
            problem = f"its statistics {why}"
        elif self.count + len(self.skipped) - len(unreadable) != self.position:
            problem = (
                f"{self.count} written + {len(self.skipped) - len(unreadable)} skipped is not its "
                f"position {self.position}"
            )
        else:
            consumed = {sample.path for sample in plan.samples[: self.position]}
            stray = [
                s["path"] for s in self.skipped[len(unreadable) :] if s["path"] not in consumed
            ]
            if stray:
                problem = f"it lists {stray[0]!r} as skipped, which is not a sample it passed"
        if problem:
            raise damaged_checkpoint(directory, problem)


def _stats_problem(stats: dict[str, Any], count: int, plan: Plan) -> str | None:
    """What is wrong with a checkpoint's statistics of its ``count`` samples written, for
    ``plan``'s output (its classes and channels), or ``None``."""
    try:
        DatasetStats.from_json(stats, len(plan.scan.classes), plan.options.policy.channels, count)
    except (KeyError, TypeError, ValueError) as exc:
        return f"are not those of its {count} samples written ({exc})"
    return None


def damaged_checkpoint(directory: Path, problem: str) -> DataError:
    """The error for a checkpoint that cannot be resumed, and what to do about it."""
    return DataError(
        f"{directory}: damaged checkpoint ({problem}); it cannot be resumed: remove it and "
        "convert without --resume"
    )


@dataclass
class Written:
    """What the write stage produced."""

    files: list[WrittenFile]
    count: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    #: What the conversion recorded of the samples; ``None`` when not known (resumed from a
    #: checkpoint that kept none).
    stats: DatasetStats | None = None


def plan(src: str | os.PathLike[str], dst: str | os.PathLike[str], options: ConvertOptions) -> Plan:
    """Resolve SRC's kind, check the paths and scan the source (options are already valid)."""
    return _plan(src, dst, options, check_dst=True)


def _plan(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: ConvertOptions,
    check_dst: bool,
    runner: Executor | None = None,
) -> Plan:
    """:func:`plan`; ``runner``: the conversion's executor, whose workers may take the scan's
    store requests (:attr:`ScanRequest.runner <imgpack.sources.base.ScanRequest.runner>`)."""
    src_path, dst_path = Path(src), Path(dst)
    source = sources.resolve(src_path, options.source, options.source_options)
    source.check()
    if check_dst:
        _check_paths(src_path, dst_path, options.overwrite)
    classes = _class_list(options.classes_from) if options.classes_from is not None else None
    if options.classes is not None:
        classes = list(options.classes)
    request = ScanRequest(
        classes,
        options.on_error,
        options.allow_split_names,
        options.typed_fields,
        options.fields,
        runner,
    )
    the_plan = Plan(src_path, dst_path, options, source.scan(request), source)
    the_plan.fields  # noqa: B018 - refuses an unknown --fields name, or fields a format cannot store
    return the_plan


def process(
    plan: Plan, executor: Executor | None = None, start: int = 0
) -> Generator[Outcome, None, None]:
    """The outcome of every sample from scan position ``start`` on, in scan order (the local
    process pool unless told otherwise)."""
    if executor is None:
        executor = executors.create(None, plan.options.workers)
    return executor.outcomes(plan.job, plan.samples[start:])


def write(
    plan: Plan,
    directory: Path,
    outcomes: Generator[Outcome, None, None],
    resume: Checkpoint | None = None,
) -> Written:
    """Store the outcomes with the format's writer in ``directory``, applying ``--on-error`` and
    saving a checkpoint whenever the writer makes more samples durable. With ``resume``, the
    outcomes start at its position and the writer continues from its state."""
    opts = plan.options
    writer = opts.spec.writer_class()(directory, plan.writer_config())
    state = resume or Checkpoint(plan.fingerprint, skipped=plan.unreadable)
    skipped, count, position = list(state.skipped), state.count, state.position
    # The statistics of every sample counted (for the manifest), and of the durable ones only
    # (for the checkpoint); the samples between them wait in ``marks``.
    tally, durable = _tallies(plan, state)
    # Samples after the checkpoint that the writer's files hold already: passed over. A
    # checkpoint refused here leaves no file of the writer's open.
    try:
        already = writer.resume(state.writer) if resume is not None else 0
        if resume is not None and writer.durable - already != state.count:
            raise damaged_checkpoint(
                directory,
                f"it counts {state.count} samples written, its files hold "
                f"{writer.durable - already}",
            )
    except BaseException:
        writer.__exit__(*sys.exc_info())  # the writer aborted, as a failed write leaves it
        raise
    # (count, position, skipped) after each sample, and the sample's figures for the statistics
    marks: deque[tuple[int, int, int, Figures]] = deque()
    checkpoints = _can_checkpoint(writer)
    if checkpoints and resume is None:
        state.writer = writer.checkpoint_state()
        state.save(directory)
    saved = writer.durable
    total = len(plan.samples)
    bar = tqdm(
        total=total,
        initial=position,
        unit="img",
        desc=opts.format,
        file=sys.stderr,
        disable=not opts.progress,
        dynamic_ncols=True,
    )
    with closing(outcomes), bar, writer:
        for outcome in outcomes:
            bar.update(1)
            position += 1
            if isinstance(outcome, Failure):
                if opts.on_error == "fail":
                    raise ImageError(
                        f"{plan.where}/{outcome.path}",
                        f"{outcome.reason} (use --on-error skip to skip such files)",
                    )
                log.info("skipped %s: %s", outcome.path, outcome.reason)  # summary lists them
                skipped.append({"path": outcome.path, "reason": outcome.reason})
                continue
            if already:
                already -= 1
            else:
                writer.add(outcome)
            count += 1
            if tally is not None:
                tally.add(*_figures(outcome))
            if not checkpoints:
                continue
            marks.append((count, position, len(skipped), _figures(outcome)))
            if writer.durable > saved:
                while True:
                    done, at, skips, figures = marks.popleft()
                    if durable is not None:
                        durable.add(*figures)
                    if done >= writer.durable:
                        break
                Checkpoint(
                    state.fingerprint,
                    at,
                    writer.durable,
                    skipped[:skips],
                    writer.checkpoint_state(),
                    durable.to_json() if durable is not None else None,
                ).save(directory)
                saved = writer.durable
        if count == 0 and plan.part is None:
            raise ImgpackError(
                f"{plan.where}: every one of the {total} image files was skipped; nothing to write "
                f"(first: {skipped[0]['path']}: {skipped[0]['reason']})"
            )
    return Written(writer.close(), count, skipped, tally)


def _tallies(plan: Plan, state: Checkpoint) -> tuple[DatasetStats | None, DatasetStats | None]:
    """Two statistics to count on from ``state``: ``None`` when its samples' are not known."""
    if state.count and state.stats is None:
        log.info("resuming from a checkpoint without statistics: the output records none")
        return None, None

    def start() -> DatasetStats:
        if state.stats is not None:
            return DatasetStats.from_json(state.stats)
        channels, classes = plan.options.policy.channels, len(plan.scan.classes)
        return DatasetStats.empty(channels, classes, plan.options.stats)

    return start(), start()


#: What the statistics count of a sample (:meth:`DatasetStats.add`): label, height, width, sums.
Figures = tuple[int, int, int, PixelSums | None]


def _figures(outcome: Encoded) -> Figures:
    """What the statistics need of a sample, without its payload (kept until it is durable)."""
    return outcome.label, outcome.height, outcome.width, outcome.sums


def _can_checkpoint(writer: Writer) -> bool:
    """Whether the writer's format can resume (it implements the checkpoint hooks)."""
    return type(writer).checkpoint_state is not Writer.checkpoint_state


def build_manifest(plan: Plan, directory: Path, written: Written) -> Manifest:
    """The manifest of the finished files in ``directory``."""
    files = file_entries(directory, written.files)
    return manifest_for(plan, files, written.count, written.skipped, written.stats)


def _resume_note(tmp: Path) -> str | None:
    """What a run stopped by SIGTERM or Ctrl-C says when its temp dir holds a checkpoint of
    written samples (the dir is kept for ``--resume``), else ``None`` (it is removed)."""
    checkpoint = Checkpoint.load(tmp)
    if checkpoint is not None and checkpoint.writer.get("layout") == direct.LAYOUT:
        shards = direct.receipts_in(tmp)
        if not shards:
            return None
        return (
            f"kept {tmp} with {shards} shard(s) written: run the same command with --resume "
            "to continue from there"
        )
    if checkpoint is None or not checkpoint.writer or checkpoint.count == 0:
        return None
    return (
        f"kept {tmp} with {checkpoint.count} samples written: run the same command with "
        "--resume to continue from there"
    )


def _resumable(the_plan: Plan) -> tuple[Path | None, Checkpoint | None]:
    """The leftover temp dir of an interrupted run of this very conversion, with its checkpoint."""
    fingerprint = the_plan.fingerprint
    others = []
    for candidate in leftovers(the_plan.dst):
        checkpoint = Checkpoint.load(candidate)
        if checkpoint is None:
            log.warning("%s: holds no usable checkpoint, nothing to resume; remove it", candidate)
        elif not checkpoint.intact and checkpoint.fingerprint != fingerprint:
            # Whose it is cannot be told: its own checksum says it was damaged or edited.
            raise damaged_checkpoint(candidate, "it does not match its own checksum")
        elif checkpoint.fingerprint == fingerprint:
            if not checkpoint.writer:  # killed before its writer started: nothing kept
                shutil.rmtree(candidate)
                return None, None
            checkpoint.check(the_plan, candidate)
            return candidate, checkpoint
        else:
            others.append(candidate)
    if others:
        raise OptionError(
            f"{others[0]}: left by a conversion to {the_plan.dst} with another source or other "
            "options, so it cannot be resumed with these; run the same command as before with "
            "--resume, or remove it and convert without --resume"
        )
    log.info("%s: no interrupted conversion to resume; starting from the beginning", the_plan.dst)
    return None, None


def convert(
    src: str | os.PathLike[str] | Any,
    dst: str | os.PathLike[str],
    format: str = "pt",
    *,
    options: ConvertOptions | None = None,
    executor: Executor | str | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> Manifest:
    """Convert ``src`` into a ``format`` output at ``dst``.

    Args:
        src: what to convert (:mod:`imgpack.sources`): an image folder ``src/<class>/**/<image>``,
            an imgpack output, a label list, TFRecord or WebDataset files, a Hugging Face dataset
            folder or ``datasets.Dataset`` object, or any of them as a URL; never modified.
        dst: output directory; must not exist unless ``overwrite`` (then it must be an imgpack
            output or empty, and is replaced only once the new output is complete).
        format: a registered format (:func:`imgpack.formats.names`).
        options: a ready :class:`~imgpack.options.ConvertOptions` (then ``format`` and
            ``kwargs`` must not be given), else built from ``format`` and ``kwargs``:
        **kwargs: ``encoding`` (``original``, ``png``, ``jpeg`` or ``raw``; ``raw`` needs
            ``size``), ``size`` (``N``, ``"HxW"`` or ``(H, W)``), ``quality`` (JPEG),
            ``resize`` (``crop``, ``stretch``, or ``shorter``/``longer`` with one ``size``:
            the aspect ratio kept), ``resample`` (Pillow filter), ``grayscale``,
            ``background`` (colour under transparent pixels), ``max_pixels`` (``None``: no
            decompression-bomb guard), ``workers`` (default: the usable CPUs), ``shard_size``
            (``"512MB"``, ``"1GiB"``, an int), ``overwrite``, ``resume``, ``append`` (add SRC's
            images to the output at ``dst`` as new shards: :mod:`imgpack.appending`),
            ``on_error`` (``fail`` stops at the
            first bad file, DST untouched; ``skip`` records bad files in the manifest),
            ``classes_from`` (the label map of an imgpack output or a text file), ``progress``
            (a tqdm bar on stderr); the source's: ``source`` (its kind, default detected),
            ``source_options``, ``labels`` (a label list), ``no_labels``, ``image_column``,
            ``label_column``; any other keyword is an option of the format (its docs page).
        executor: where the per-image work runs: ``"local"`` (default: a process pool of
            ``workers``), ``"ray"`` (Ray tasks on the cluster at ``RAY_ADDRESS``, else a local
            Ray started for the run; ``pip install 'imgpack[ray]'``), ``"ray://HOST:PORT"`` or
            ``"ray:ADDRESS"`` (the cluster at that address), or an
            :class:`~imgpack.executors.Executor`. The output is the same bytes with every one.
        storage_options: for ``src`` or ``dst`` given as URLs (``s3://...``): passed to the
            fsspec filesystem (:mod:`imgpack.storage`).
        cache_dir: where an output read from a URL is cached (default: the user's cache folder).

    Returns:
        The manifest written to ``dst/imgpack.json``.

    SRC and DST are resolved once — a URL source fetched (an output through the cache,
    anything else to a scratch folder), a ``datasets.Dataset`` saved beside DST, a URL DST built
    in its build folder of the cache (kept for ``resume`` when the run stops) and uploaded with
    its manifest last — and the engine runs once.
    """
    try:
        return _convert_any(src, dst, format, options, executor, storage_options, cache_dir, kwargs)
    finally:
        forget()  # what this process opened of SRC for the run (its workers' go with them)


def _convert_any(
    src: str | os.PathLike[str] | Any,
    dst: str | os.PathLike[str],
    format: str,
    options: ConvertOptions | None,
    executor: Executor | str | None,
    storage_options: dict[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    kwargs: dict[str, Any],
) -> Manifest:
    """:func:`convert`."""
    options = _options(format, options, kwargs)
    runner = executors.create(executor, options.workers)
    if options.append:  # imgpack.appending: new shards after DST's, its manifest replaced last
        with _append_plan(src, dst, options, runner, storage_options, cache_dir, True) as plan:
            if plan.base is None:  # committed already (--resume): the output as it is
                return open_manifest(_target(dst), storage_options)[1]
            if plan.layout != direct.LAYOUT:  # one file (lmdb, hdf5): a new version of it
                return _append_to_file(plan, runner)
            return direct.convert_to_bucket(plan, _target(dst), storage_options, runner)
    # A bucket DST is built in a folder of the cache kept when the run stops: --resume goes on.
    build = build_folder(str(dst), cache_dir) if is_url(dst) else None
    if build is not None and not options.spec.sharded:  # lmdb, hdf5: one file, one writer
        log.warning("%s: %s (in %s)", str(dst).rstrip("/"), one_file_note(options.spec.name), build)
    destination = output_folder(
        dst,
        storage_options,
        options.overwrite,
        build=build,
        resume=options.resume,
        skip=formats.runtime_files(),
    )
    with ExitStack() as stack:
        if hf.is_dataset_object(src):  # saved beside where the output is built
            local_dst = Path(stack.enter_context(destination))
            local_src = stack.enter_context(_saved_dataset(src, local_dst))
        else:
            local_src = stack.enter_context(
                _source(src, dst, options, storage_options, cache_dir, runner)
            )
            source = sources.resolve(Path(local_src), options.source, options.source_options)
            in_place = (  # parts by shard tasks on a shared path: written there, as a bucket
                not is_url(dst) and options.num_parts > 1 and direct.applies_locally(options)
            )
            if direct.applies(options, dst) or in_place:  # shard tasks write DST
                source.check()
                the_plan = replace(
                    _plan(local_src, dst, options, check_dst=False, runner=runner),
                    layout=direct.LAYOUT,
                )
                return direct.convert_to_bucket(the_plan, _target(dst), storage_options, runner)
            local_dst = Path(stack.enter_context(destination))
        if is_url(dst):  # the bucket's output was checked; the build is this run's
            options = replace(options, overwrite=False)
        if build is not None and options.resume and (local_dst / MANIFEST_NAME).is_file():
            manifest = _built(Path(local_src), local_dst, options)  # stopped while uploading
        else:
            manifest = _convert_local(Path(local_src), local_dst, options, runner)
        if is_url(src):  # the source as the user named it, not the scratch copy
            manifest.source["path"] = str(src).rstrip("/")
            write_manifest(Path(local_dst), manifest)
        return manifest


def one_file_note(fmt: str) -> str:
    """What a conversion of one-file format ``fmt`` (``lmdb``, ``hdf5``) to a bucket says: where
    the file is built."""
    return (
        f"{fmt} is one file, written by one process: it is built whole on this machine's disk "
        "and uploaded once complete, so that disk needs room for the whole output (pt, "
        "tfrecord and webdataset shards are written to the bucket by the workers)"
    )


@dataclass
class DryRun:
    """What ``convert`` would do, found without reading an image or writing anything
    (``imgpack convert ... --dry-run``)."""

    src: str
    dst: str
    format: str
    #: The image files the conversion would read (its part of them with ``num_parts``).
    images: int
    classes: list[str]
    #: Files the scan cannot take (named with why); bad images are found only by reading them.
    skipped: list[dict[str, str]]
    ignored_files: int
    #: The files the scan passed over, by path with why (hidden, not an image, ...).
    ignored: list[dict[str, str]]
    empty_classes: list[str]
    #: Bytes the images would take: exact for ``raw``, the source files' sizes otherwise
    #: (what ``original`` keeps; a re-encode differs).
    estimated_bytes: int
    #: The data files, by name; for sharded formats cut by :attr:`estimated_bytes`' sizes.
    shards: list[str]
    #: Whether :attr:`shards` is the plan the conversion follows (shard tasks writing to a
    #: bucket), not an estimate of where one writer will roll over.
    shards_exact: bool
    #: The shard size in bytes (0: one file), and the largest image's estimated bytes.
    shard_size: int = 0
    largest_image: int = 0
    #: The images as the manifest will describe them (:meth:`ImagePolicy.describe`).
    image: dict[str, Any] = field(default_factory=dict)
    #: The fields the output will keep, as ``NAME:TYPE``.
    fields: list[str] = field(default_factory=list)
    #: ``--append``: the samples and files of the output DST holds, which the plan follows.
    appended_to: tuple[int, int] | None = None

    def lines(self) -> list[str]:
        """What ``--dry-run`` prints (the skipped files by name are the caller's to list)."""
        shown = ", ".join(self.classes[:8]) + (", ..." if len(self.classes) > 8 else "")
        shards = (
            self.shards if len(self.shards) <= 4 else [*self.shards[:2], "...", self.shards[-1]]
        )
        lines = [
            f"dry run: nothing read or written; {self.src} -> {self.dst} ({self.format})",
            f"images:    {self.images}, stored at {size_words(self.image)}",
            f"classes:   {len(self.classes)} ({shown})" if self.classes else "classes:   none",
            *([f"fields:    {', '.join(self.fields)}"] if self.fields else []),
            f"bytes:     about {format_bytes(self.estimated_bytes)} of images",
            f"files:     {len(self.shards)} "
            f"({'as planned' if self.shards_exact else 'estimated'}: {', '.join(shards)})"
            if self.shards
            else "files:     1",
            f"skipped:   {len(self.skipped)} by the scan (bad images are found when they are read)",
            "ignored:   " + ignored_summary(self.ignored_files, by_reason(self.ignored)),
        ]
        if self.appended_to is not None:
            samples, files = self.appended_to
            lines.insert(
                1, f"append:    after the {samples} samples in {files} file(s) {self.dst} holds"
            )
        if self.largest_image > self.shard_size > 0:
            lines.append(f"warning:   {shard_size_note(self.shard_size, self.largest_image)}")
        if is_url(self.dst) and not self.shard_size:
            lines.append(f"note:      {one_file_note(self.format)}")
        if self.empty_classes:
            lines.append(
                f"empty:     {', '.join(self.empty_classes)} (class folders with no image)"
            )
        return lines


def dry_run(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str = "pt",
    *,
    options: ConvertOptions | None = None,
    executor: Executor | str | None = None,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> DryRun:
    """The plan :func:`convert` would follow with these arguments: scanned as it scans (a
    bucket image folder listed, nothing downloaded), DST checked as it checks it, nothing
    read or written. Raises what :func:`convert` would raise before reading an image."""
    options = _options(format, options, kwargs)
    runner = executors.create(executor, options.workers)  # made, not started
    with ExitStack() as stack:
        if options.append:
            the_plan = stack.enter_context(
                _append_plan(src, dst, options, runner, storage_options, cache_dir, lock=False)
            )
            exact = the_plan.layout == direct.LAYOUT  # lmdb, hdf5: a new version of the file
        else:
            local = stack.enter_context(
                _source(src, dst, options, storage_options, cache_dir, runner)
            )
            the_plan = _plan(local, dst, options, check_dst=not is_url(dst), runner=runner)
            exact = direct.applies_locally(options)
        sizes = list(direct.sample_sizes(the_plan, framed=False))
        framed = list(direct.sample_sizes(the_plan)) if options.spec.sharded else sizes
        shards: list[str] = []
        if exact:  # the shard plan the tasks follow, and this part's shards of it
            the_plan = replace(the_plan, layout=direct.LAYOUT)
            bounds, first, last = direct.shard_plan(the_plan)
            shards = direct.shard_names(the_plan, len(bounds) - 1)[first:last]
            start, stop = bounds[first], bounds[last]
        else:  # one writer: this part's samples, where it would roll over by their sizes
            start, stop = the_plan.bounds
            if options.spec.sharded:
                cuts = direct.rollover(framed[start:stop], options.shard_size or sys.maxsize)
                shards = direct.shard_names(the_plan, len(cuts) - 1)
        where = the_plan.where
    return DryRun(
        src=str(src) if is_url(src) else where,
        dst=str(dst),
        format=options.format,
        images=stop - start,
        classes=list(the_plan.scan.classes),
        skipped=the_plan.unreadable,
        ignored_files=the_plan.scan.ignored_files,
        ignored=list(the_plan.scan.ignored),
        empty_classes=list(the_plan.scan.empty_classes),
        estimated_bytes=sum(sizes[start:stop]),
        shards=shards,
        shards_exact=exact,
        shard_size=options.shard_size or 0 if options.spec.sharded else 0,
        largest_image=max(sizes[start:stop], default=0),
        image=options.policy.describe(),
        fields=[f.spec for f in the_plan.fields],
        appended_to=(the_plan.base.num_samples, len(the_plan.base.files))
        if the_plan.base is not None
        else None,
    )


def _source(
    src: Any,
    dst: str | os.PathLike[str],
    options: ConvertOptions,
    storage_options: dict[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    runner: Executor,
) -> AbstractContextManager[Path]:
    """SRC as a local path for the conversion to DST (:func:`source_location`): a bucket image
    folder listed by ``runner``'s tasks, or read from the listing a part or a resume of this
    conversion saved in DST (or, while another part lists it, will save there)."""
    return source_location(
        src,
        storage_options,
        cache_dir,
        _in_place(options),
        _saved(dst, options),
        runner=runner,
        shared=_sharing(options),
    )


def _sharing(options: ConvertOptions) -> str | None:
    """Who this run is among the parts of a conversion that share one listing of a bucket SRC
    (parts by shard tasks: the first to list it saves it in DST's work folder while the others
    wait for it), else ``None``."""
    if options.num_parts > 1 and direct.applies_locally(options):
        return f"part {options.part} of {options.num_parts}"
    return None


def _target(dst: str | os.PathLike[str]) -> str:
    """DST as shard tasks write it: a URL, or an absolute path."""
    return str(dst).rstrip("/") if is_url(dst) else str(local_path(dst).absolute())


@contextmanager
def _append_plan(
    src: Any,
    dst: str | os.PathLike[str],
    options: ConvertOptions,
    runner: Executor,
    storage_options: dict[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    lock: bool,
) -> Iterator[Plan]:
    """The plan of an append of SRC to the output at DST, SRC open while it is used (DST's lock
    held too where ``lock`` and DST is a path); its ``base`` is ``None`` when that append is
    the output's last one already and ``--resume`` was given, or this is a part of it (another
    part committed it); else that is refused. The parts of an append (``--num-parts``) plan it
    from the same output and write into DST, as the parts of any conversion by shard tasks do:
    whichever finishes last commits."""
    target = _target(dst)
    if hf.is_dataset_object(src):
        raise OptionError(
            "--append: save the datasets.Dataset (save_to_disk) and append its folder"
        )
    with ExitStack() as stack:
        if not is_url(dst):
            path = Path(target)
            none = OptionError(
                f"{target}: --append adds to an existing output, and there is none; convert "
                "without --append to make one"
            )
            if not (path.is_dir() or parked_outputs(path)):
                raise none
            lock = lock and options.num_parts == 1  # parts write DST at once, as any parts do
            if lock:
                stack.enter_context(locked(path))
            recover(path, holding_lock=lock)  # a replacement killed midway: put back first
            if not path.is_dir():
                raise none
        base = appending.base_output(target, storage_options)
        local_src = stack.enter_context(
            _source(src, dst, options, storage_options, cache_dir, runner)
        )
        source = sources.resolve(Path(local_src), options.source, options.source_options)
        by_shards = direct.applies_locally(options)
        if not by_shards and is_url(dst):
            raise OptionError(
                f"--append: a {options.format} output is one file, rebuilt on one disk to add "
                "to it: copy it from the bucket, append to the copy, and upload that"
            )
        source.check()
        first = _plan(local_src, dst, options, check_dst=False, runner=runner)
        classes = appending.combined_classes(base, first.scan.classes, first.where)
        scan = appending.relabelled(first.scan, classes)
        layout = direct.LAYOUT if by_shards else ""
        the_plan = replace(first, scan=scan, layout=layout, base=base)
        appending.check_compatible(base, manifest_for(the_plan, [], 0, []), target)
        if appending.last_key(base) == the_plan.append_key:
            if not (options.resume or options.num_parts > 1):
                raise OptionError(
                    f"{target}: the images of {the_plan.where} are its last append already; "
                    "appending them again would hold each twice, so nothing was done"
                )
            the_plan = replace(the_plan, base=None)
        yield the_plan


def _append_to_file(the_plan: Plan, executor: Executor) -> Manifest:
    """``--append`` to a one-file output at a local DST (its lock held): the new version built
    in a temp folder beside it from a copy of it (:func:`imgpack.appending.seed`), the new
    samples written after the old by the one writer with its checkpoints, the folder swapped
    with DST, its manifest inside."""
    base, options = the_plan.base, the_plan.options
    assert base is not None
    existing, checkpoint = _resumable(the_plan) if options.resume else (None, None)
    with (
        _storage_errors(the_plan.dst),
        temp_output(the_plan.dst, existing, keep=_resume_note) as tmp,
    ):
        if checkpoint is None:
            # A run killed while the copy is made is recognised, and starts again.
            Checkpoint(the_plan.fingerprint, skipped=the_plan.unreadable).save(tmp)
            writer = options.spec.writer_class()
            state = appending.seed(writer, tmp, the_plan.writer_config(), the_plan.dst, base)
            checkpoint = Checkpoint(the_plan.fingerprint, skipped=the_plan.unreadable, writer=state)
            checkpoint.save(tmp)
        outcomes = process(the_plan, executor, checkpoint.position)
        written = write(the_plan, tmp, outcomes, checkpoint)
        new = build_manifest(the_plan, tmp, written)
        manifest = appending.appended(base, new, the_plan.append_key, one_file=True)
        write_manifest(tmp, manifest)
        _carry_over(the_plan.dst, tmp, base)
        publish(tmp, the_plan.dst, replace=True)
    (the_plan.dst / CHECKPOINT).unlink(missing_ok=True)
    return manifest


def _carry_over(dst: Path, tmp: Path, base: Manifest) -> None:
    """What else DST holds beside the output's files (a user's notes, a preview), linked into
    the new version ``tmp`` before it replaces DST, so that an append loses none of it."""
    own = {MANIFEST_NAME, CHECKPOINT, *formats.runtime_files(), *(f.path for f in base.files)}
    for entry in sorted(os.listdir(dst)):
        there, here = dst / entry, tmp / entry
        if entry in own or here.exists():
            continue
        if there.is_symlink():
            os.symlink(os.readlink(there), here)
        elif there.is_dir():
            shutil.copytree(there, here, symlinks=True, copy_function=os.link)
        else:
            os.link(there, here)


def _in_place(options: ConvertOptions) -> Callable[[TopLevel], bool] | None:
    """For a bucket SRC, given what it holds at its top level: whether the workers read its
    objects where they are (nothing downloaded first). So for an image folder: the kind asked
    for, or the one detection picks when no visible object sits at SRC's top level (every other
    built-in kind needs a file there) and no plugin adds a kind that could claim it; for
    WebDataset tars: a folder of ``.tar`` objects and nothing else visible (read by ranged
    GETs); for TFRecord files, a folder of them and nothing else visible but their ``.idx``
    files (the same); for ``--no-labels``, a tree of images or such tars; and for ``--labels
    FILE``, the folder its rows' paths are relative to."""
    if options.source == sources.FALLBACK:
        return lambda top: True
    if options.source in ("unlabelled", "labels") and (
        options.source == "unlabelled" or options.source_options.get("file") is not None
    ):
        return lambda top: not top.is_object  # a tree; --labels FILE: its rows' objects
    if options.source == "webdataset":
        return _only_tars
    if options.source == "tfrecord":
        return _only_records
    if options.source is not None or set(sources.names()) - set(sources.BUILTIN):
        return None
    return lambda top: (
        _only_tars(top) or _only_records(top) or (not top.is_object and not top.visible)
    )


def _only_tars(top: TopLevel) -> bool:
    """Whether a bucket SRC's top level is WebDataset tars read in place: ``.tar`` objects and
    nothing else visible (no folder, no other object)."""
    return not top.visible_folders and top.visible > 0 and top.tars == top.visible


def _only_records(top: TopLevel) -> bool:
    """Whether a bucket SRC's top level is TFRecord files read in place: ``.tfrecord`` (or
    ``.tfrecords``) objects and nothing else visible but their ``.idx`` index files."""
    return not top.visible_folders and top.visible > 0 and top.records == top.visible


def _saved(dst: str | os.PathLike[str], options: ConvertOptions) -> str | None:
    """Where a part or a resume of a conversion to ``dst`` finds the bucket SRC's listing the
    conversion took (:data:`imgpack.direct.SAVED`, written by shard tasks' runs); ``None`` for a
    run that lists SRC itself."""
    if not (options.resume or options.num_parts > 1):
        return None
    return f"{_target(dst)}/{direct.SAVED}"


def _class_list(source: str) -> list[str]:
    """``--classes-from``: an imgpack output's label map (its manifest, read by the route), or a
    text file with one class per line."""
    if not Path(source).is_dir():
        return read_class_list(source)
    try:
        return list(open_manifest(source)[1].classes)
    except ManifestError as exc:
        raise ScanError(f"cannot take the classes from {source}: {exc}") from None


def _built(src: Path, dst: Path, options: ConvertOptions) -> Manifest:
    """The complete output a run to a bucket built in ``dst`` before it was stopped while
    uploading: resumed by uploading it again, if it is this conversion's (the same output id)."""
    with locked(dst):
        manifest = read_manifest(dst)
        if manifest.output_id != _plan(src, dst, options, check_dst=False).output_id:
            raise OptionError(
                f"{dst}: holds a complete output of another conversion (another source or "
                "other options), so it cannot be resumed with these; remove it, or convert "
                "without --resume"
            )
    return manifest


def _options(format: str, options: ConvertOptions | None, kwargs: dict[str, Any]) -> ConvertOptions:
    if options is None:
        return ConvertOptions.create(format, **kwargs)
    if kwargs or format != "pt":
        raise OptionError("give either options= or format and keyword options, not both")
    return options


def _convert_local(src: Path, dst: Path, options: ConvertOptions, executor: Executor) -> Manifest:
    """The engine: plan, process, write and publish one output at the local ``dst``."""
    with locked(dst):
        recover(dst, holding_lock=True)
        clear_leftovers(dst)
        the_plan = _plan(src, dst, options, check_dst=True, runner=executor)
        if direct.applies_locally(options):  # (its parts were written in place: convert)
            the_plan = replace(the_plan, layout=direct.LAYOUT)  # shard tasks write it
        with _storage_errors(the_plan.dst):
            return _convert(the_plan, executor)


@contextmanager
def _storage_errors(dst: Path) -> Iterator[None]:
    """An error writing the output beside ``dst`` that comes from the machine (a full disk, a
    read-only filesystem: :func:`storage_problem`) raised as a :class:`StorageError` saying
    that nothing was published."""
    try:
        yield
    except ImgpackError:
        raise
    except Exception as exc:
        reason = storage_problem(exc, dst.parent)
        if reason is None:
            raise
        raise StorageError(
            f"{dst}: cannot write the output: {reason}; nothing was published and {dst} is as "
            "it was"
        ) from None


#: errno values that mean the machine cannot store the output, whatever the input.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


#: Free bytes below which a write error on a filesystem is taken for a full disk.
NEARLY_FULL = 1 << 20


def storage_problem(exc: BaseException, directory: Path) -> str | None:
    """What says that ``exc``, raised while writing in ``directory``, comes from the disk being
    full (or a quota, a read-only filesystem), or ``None``. h5py reports the errno only in its
    message; torch (``unexpected pos``) and LMDB (``Input/output error``) lose it, so a failed
    write on a filesystem with (nearly) no free space left counts as a full disk too."""
    code = getattr(exc, "errno", None)
    if code in _STORAGE_ERRNOS:
        return os.strerror(code)
    text = str(exc)
    for code in _STORAGE_ERRNOS:
        if os.strerror(code) in text or f"errno = {code}," in text:
            return os.strerror(code)
    try:
        fs = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    if fs.f_bavail * fs.f_frsize < NEARLY_FULL:
        return os.strerror(errno.ENOSPC)
    return None


@contextmanager
def _saved_dataset(dataset: Any, dst: Path) -> Iterator[Path]:
    """A ``datasets.Dataset`` object saved (its rows as they are, selections applied) to a temp
    folder beside ``dst``, removed afterwards."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".imgpack-hf", dir=dst.parent))
    try:
        dataset.save_to_disk(str(folder))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _convert(the_plan: Plan, executor: Executor | None) -> Manifest:
    """Run a planned conversion (its DST locked)."""
    options = the_plan.options
    existing, checkpoint = _resumable(the_plan) if options.resume else (None, None)
    if not options.resume:
        for left in leftovers(the_plan.dst):
            log.warning(
                "%s: left by an interrupted conversion to %s; resume it with --resume (same "
                "source and options), or remove it",
                left,
                the_plan.dst,
            )
    start = checkpoint.position if checkpoint is not None else 0
    with temp_output(the_plan.dst, existing, keep=_resume_note) as tmp:
        by_shards = the_plan.layout == direct.LAYOUT
        if checkpoint is None:  # at once: a run killed from here on can be recognised
            writer = {"layout": direct.LAYOUT} if by_shards else {}
            Checkpoint(the_plan.fingerprint, skipped=the_plan.unreadable, writer=writer).save(tmp)
        if by_shards:  # shard tasks write whole shards; receipts say which are done
            manifest = direct.write_local(the_plan, tmp, executor)
        else:
            outcomes = process(the_plan, executor, start)
            written = write(the_plan, tmp, outcomes, checkpoint)
            manifest = build_manifest(the_plan, tmp, written)
        write_manifest(tmp, manifest)
        publish(tmp, the_plan.dst, replace=options.overwrite)
    # Removed only now: a run killed before the rename can still be resumed.
    (the_plan.dst / CHECKPOINT).unlink(missing_ok=True)
    return manifest


def convert_splits(
    root: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str = "pt",
    *,
    splits: Sequence[str] | None = None,
    options: ConvertOptions | None = None,
    executor: Executor | str | None = None,
    **kwargs: Any,
) -> dict[str, Manifest]:
    """Convert each split folder of ``root`` (``train``, ``val``, ``test``... or the ``splits``
    named) into ``dst/<split>``, with ONE label map: the sorted union of the splits' classes (or
    ``classes_from``), so a class missing from a split keeps its label there. Each split is an
    output of its own, converted and published as :func:`convert` does. Returns the manifests
    by split."""
    root_path, dst_path = Path(root), Path(dst)
    if not root_path.is_dir():
        raise FileNotFoundError(f"{root_path}: no such folder")
    dataset_dict = hf.is_dataset_dict_folder(root_path)
    if splits:
        names = list(splits)
    else:
        names = hf.dict_splits(root_path) if dataset_dict else find_splits(root_path)
    if not names:
        raise ScanError(
            f"{root_path}: no split folders (expected some of {', '.join(SPLIT_NAMES)}; name them "
            "with --splits train,val)"
        )
    for name in names:
        if not (root_path / name).is_dir() or name.startswith(".") or "/" in name:
            raise FileNotFoundError(f"{root_path / name}: no such split folder")
    options = _options(format, options, kwargs)
    if options.append:
        raise OptionError(
            "--append adds one SRC to one output: append each split's folder to its output "
            "(imgpack convert ROOT/train DST/train --append ...)"
        )
    if options.classes is None and options.classes_from is None and dataset_dict:
        # The splits share the ClassLabel feature: its names, in their order, are the label map.
        first = sources.resolve(root_path / names[0], options.source, options.source_options)
        options = replace(options, classes=tuple(first.scan(ScanRequest()).classes))
    elif options.classes is None and options.classes_from is None:
        union = sorted({c for name in names for c in find_classes(root_path / name)})
        options = replace(options, classes=tuple(union))
    dst_path.mkdir(parents=True, exist_ok=True)
    runner = executors.create(executor, options.workers)
    # Each split as `convert` makes it: by shard tasks, its parts written into DST/<split>.
    return {
        name: convert(root_path / name, dst_path / name, options=options, executor=runner)
        for name in names
    }


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    if inside(dst, src):
        raise OptionError(f"{dst}: the output must not be inside the source folder {src}")
    if inside(src, dst):
        raise OptionError(f"{dst}: the output must not contain the source folder {src}")
    check_destination(dst, overwrite)


__all__ = [
    "DryRun",
    "Plan",
    "Written",
    "build_manifest",
    "convert",
    "convert_splits",
    "dry_run",
    "plan",
    "process",
    "write",
]
