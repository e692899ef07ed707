"""The ``imgpack`` command: a thin click layer over the library.

Library errors become one-line messages and a non-zero exit (1 for a failure, 2 for a bad
option); a traceback only ever means a bug.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from imgpack import errors, formats, sources
from imgpack.errors import ImgpackError, OptionError, Terminated, first_line
from imgpack.images import ENCODINGS, RESAMPLE, RESIZE_MODES, size_words
from imgpack.options import ON_ERROR, ConvertOptions
from imgpack.scan import ignored_summary
from imgpack.units import format_bytes
from imgpack.version import __version__

if TYPE_CHECKING:
    from imgpack.formats.dataset_base import ReadOptions

F = TypeVar("F", bound=Callable[..., Any])
#: Skipped files the convert summary lists by name (the manifest lists them all).
SHOW_SKIPPED = 20


def _default(name: str) -> Any:
    return ConvertOptions.default(name)


def _format_options_help() -> str:
    """The ``-o`` help: every registered format's options, from the registry."""
    parts = []
    for spec in formats.specs():
        if spec.options:
            listed = "; ".join(f"{o.name} (default {o.default}): {o.help}" for o in spec.options)
            parts.append(f"{spec.name}: {listed}")
    return "A format option. " + ". ".join(parts) + "."


batch_size_option = click.option(
    "--batch-size", type=click.IntRange(min=1), default=256, show_default=True
)


def count_option(flag: str, default: int, help: str) -> Callable[[F], F]:
    """An option taking a count of 1 or more."""
    return click.option(
        flag, type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


def json_option(what: str) -> Callable[[F], F]:
    return click.option(
        "--json", "json_path", type=click.Path(path_type=Path), help=f"Also write the {what} here."
    )


def storage_options(func: F) -> F:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--cache-dir`` for commands that take
    URLs (``s3://``, ``gs://``...) and read outputs from them."""
    func = click.option(
        "--cache-dir",
        default=None,
        help="Where outputs read from a URL are cached [default: IMGPACK_CACHE_DIR, else "
        "~/.cache/imgpack].",
    )(func)
    return storage_option_only(func)


def cache_limit_option(func: F) -> F:
    """``--cache-limit SIZE`` for commands that read an output from a URL lazily."""
    return click.option(
        "--cache-limit",
        default=None,
        metavar="SIZE",
        help="The most the cache holds beyond the files being read, e.g. 200GB (outputs read "
        "from a URL; pt, tfrecord and webdataset shards are fetched when first read and the "
        "least recently used evicted) [default: IMGPACK_CACHE_LIMIT, else no limit].",
    )(func)


def reading_options(func: F) -> F:
    """``--storage-option``, ``--cache-dir`` and ``--cache-limit``: commands that read an
    output (a folder or a URL) the way training does."""
    return storage_options(cache_limit_option(func))


def _read_options(
    storage_option: tuple[str, ...], cache_dir: str | None, cache_limit: str | None
) -> ReadOptions:
    from imgpack.formats.dataset_base import ReadOptions
    from imgpack.units import parse_byte_size

    return ReadOptions(
        storage_options=_storage(storage_option),
        cache_dir=cache_dir,
        cache_limit=parse_byte_size(cache_limit, "--cache-limit") if cache_limit else None,
    )


def storage_option_only(func: F) -> F:
    """``--storage-option KEY=VALUE`` alone (commands that read no output through the cache)."""
    return click.option(
        "--storage-option",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="Passed to the fsspec filesystem of a URL (repeatable; JSON values decoded), e.g. "
        "endpoint_url=http://127.0.0.1:9000 or anon=true.",
    )(func)


def _storage(items: tuple[str, ...]) -> dict[str, Any] | None:
    from imgpack.storage.location import parse_storage_options

    return parse_storage_options(items) or None


def friendly_errors(func: F) -> F:
    """Turn user-facing errors into click exceptions (one line, non-zero exit)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (Terminated, KeyboardInterrupt) as exc:
            signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            note = getattr(exc, "note", "cleaned up, nothing half-written")
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            click.echo(f"Error: stopped by {name}; {printable_line(note)}", err=True)
            raise SystemExit(128 + signum) from None
        except Exception as exc:
            raise _user_facing(exc) from None

    return wrapper  # type: ignore[return-value]


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
# Marks that reorder or hide text on a terminal (bidirectional overrides and isolates, zero
# width marks, the line and paragraph separators): shown as escapes, never obeyed.
_CONTROL.update(
    {
        c: f"\\u{c:04x}"
        for c in [0x061C, 0x200B, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F),
                  *range(0x2066, 0x206A), 0xFEFF]
    }
)  # fmt: skip


def printable_line(text: str) -> str:
    """``text`` as one line: control characters (a newline in a file name) escaped, so a message
    can never forge a second line; bytes that are not UTF-8 as ``\\xNN``."""
    return (
        text.encode("utf-8", "surrogateescape")
        .decode("utf-8", "backslashreplace")
        .translate(_CONTROL)
    )


def _user_facing(exc: Exception) -> Exception:
    """The click exception to show for ``exc`` (one line), or ``exc`` itself for a bug."""
    message = worker_error(exc)
    if message is not None:
        # torch re-raises from a frame that references the error: a cycle that keeps the
        # DataLoader's workers alive until a garbage collection, which waits 5 s for each.
        traceback.clear_frames(exc.__traceback__)
        return click.ClickException(printable_line(message))
    if isinstance(exc, OptionError):
        return click.UsageError(printable_line(str(exc)))
    if isinstance(exc, (ImgpackError, FileExistsError, FileNotFoundError, NotADirectoryError)):
        return click.ClickException(printable_line(str(exc)))
    if isinstance(exc, PermissionError):
        return click.ClickException(printable_line(f"{exc.filename}: permission denied"))
    if type(exc).__module__.startswith(_STORAGE_CLIENTS):
        return click.ClickException(
            printable_line(
                f"object storage: {first_line(exc)} (check the credentials and the "
                "endpoint: AWS_* variables or --storage-option, see docs/storage.md)"
            )
        )
    return exc


#: The packages whose errors mean a bucket's credentials or endpoint, not a bug of imgpack.
_STORAGE_CLIENTS = (
    "botocore.",
    "aiobotocore.",
    "s3fs.",
    "gcsfs.",
    "google.auth.",
    "google.api_core.",
)


#: The user-facing errors whose tracebacks a DataLoader worker sends are shown as one line.
_USER_ERRORS = {
    *(
        f"imgpack.errors.{cls.__name__}"
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, ImgpackError)
    ),
    "FileNotFoundError",
    "PermissionError",
    "IsADirectoryError",
}


def worker_error(exc: BaseException) -> str | None:
    """The one-line message of a user-facing error raised in a DataLoader worker, or ``None``.

    torch re-raises a worker's exception in the main process with the worker's whole traceback
    in its message ("Caught DataError in DataLoader worker process 0. Original Traceback ...");
    its last line is ``module.Class: message``.
    """
    text = str(exc)
    if "in DataLoader worker process" not in text or "Original Traceback" not in text:
        return None
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    if not sep or name not in _USER_ERRORS:
        return None
    return message


def _on_sigterm(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM must not interrupt the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(signum)


def _handle_sigterm(ctx: click.Context) -> None:
    """Treat SIGTERM (what Slurm, Kubernetes and systemd send) as Ctrl-C is treated, for the
    length of the command."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


@click.group()
@click.version_option(__version__, prog_name="imgpack")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Pack image folders into LMDB, HDF5, TFRecord, WebDataset or .pt, and read them fast
    with PyTorch."""
    _handle_sigterm(ctx)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="imgpack: %(levelname)s: %(message)s",
    )


#: What is written: the format, its shards and options, what DST may be, bad files.
OUTPUT_OPTIONS = (
    click.option(
        "--format",
        "fmt",
        type=click.Choice(formats.names()),
        required=True,
        help="Output format: " + "; ".join(f"{s.name}: {s.summary}" for s in formats.specs()) + ".",
    ),
    click.option(
        "--shard-size",
        default=None,
        help="Bytes per shard of sharded formats: 512MB, 1GiB, ... [default: "
        + ", ".join(
            f"{s.name} {format_bytes(s.default_shard_size or 0)}"
            for s in formats.specs()
            if s.sharded
        )
        + "].",
    ),
    click.option(
        "--overwrite", is_flag=True, help="Replace DST if it is an existing imgpack output."
    ),
    click.option(
        "--resume",
        is_flag=True,
        help="Continue an interrupted conversion of the same SRC, DST and options from its last "
        "checkpoint; the output is the same as an uninterrupted run's.",
    ),
    click.option(
        "--append",
        is_flag=True,
        help="Add SRC's images to the existing output at DST: as new shards after its last one "
        "(pt, tfrecord, webdataset; its files untouched), or as a new version of its one file "
        "built from a copy and swapped in (lmdb, hdf5, on a path). The same format and "
        "options, new classes after its own; the manifest is replaced last.",
    ),
    click.option(
        "--on-error",
        type=click.Choice(ON_ERROR),
        default=_default("on_error"),
        show_default=True,
        help="fail: stop at a bad file, DST untouched; skip: skip and record it in the manifest.",
    ),
    click.option(
        "--classes-from",
        type=click.Path(path_type=Path),
        default=None,
        help="Reuse the label map of an imgpack output or a text file (one class per line).",
    ),
    click.option(
        "--fields",
        "fields",
        default=None,
        metavar="NAME,...",
        help="The source's per-sample fields to keep (a label list's other columns), in this "
        "order; '' keeps none. Default: every field the source has (the summary lists them).",
    ),
    click.option(
        "--field",
        "field_types",
        multiple=True,
        metavar="NAME:TYPE",
        help="Take the source's field NAME as TYPE instead of the inferred one: str, bytes, int, "
        "float, json, int[], float[], optional with a trailing ? (e.g. boxes:json).",
    ),
    click.option(
        "--no-stats",
        is_flag=True,
        help="Do not measure the stored pixels for the dataset's mean and std (imgpack info): "
        "kept JPEGs are then validated at 1/8 scale instead of decoded whole, which is faster. "
        "Sizes and class counts are recorded either way.",
    ),
    click.option("--compression", default=None, help="Alias of -o compression=VALUE (hdf5)."),
    click.option("--label-offset", default=None, help="Alias of -o label_offset=VALUE (tfrecord)."),
    click.option(
        "--option",
        "-o",
        "format_options",
        multiple=True,
        metavar="KEY=VALUE",
        help=_format_options_help(),
    ),
)


#: The image policy: what every stored image is (docs/images.md).
IMAGE_OPTIONS = (
    click.option(
        "--encoding",
        type=click.Choice(ENCODINGS),
        default=_default("encoding"),
        show_default=True,
        help="original: source bytes when they decode to the policy's pixels, else lossless PNG; "
        "png/jpeg: re-encode; raw: pixels (needs --size).",
    ),
    click.option("--size", default=None, help="Resize to N x N or HxW (e.g. 224, 256x320)."),
    click.option(
        "--resize",
        type=click.Choice(RESIZE_MODES),
        default=_default("resize"),
        show_default=True,
        help="crop: shorter side to fit, then centre crop; stretch: ignore the aspect ratio; "
        "shorter: the shorter side to N, aspect kept (torchvision's Resize(N)); longer: the "
        "longer side at most N, aspect kept (smaller images as they are).",
    ),
    click.option(
        "--resample",
        type=click.Choice(list(RESAMPLE)),
        default=_default("resample"),
        show_default=True,
    ),
    click.option(
        "--quality",
        type=click.IntRange(1, 100),
        default=_default("quality"),
        show_default=True,
        help="JPEG quality.",
    ),
    click.option("--grayscale", is_flag=True, help="Store 1-channel luma instead of RGB."),
    click.option(
        "--background", default="white", show_default=True, help="Colour under transparent pixels."
    ),
    click.option(
        "--max-pixels",
        type=int,
        default=_default("max_pixels"),
        show_default=True,
        help="Refuse larger images (decompression-bomb guard); 0 turns the guard off.",
    ),
)


#: What SRC is and how it is read (docs/sources.md).
SOURCE_GROUP = (
    click.option(
        "--source",
        "source_kind",
        type=click.Choice(sources.names()),
        default=None,
        help="What SRC is [default: detected]: "
        + "; ".join(f"{s.name}: {s.summary}" for s in sources.specs())
        + ".",
    ),
    click.option(
        "--source-option",
        "-s",
        "source_options",
        multiple=True,
        metavar="KEY=VALUE",
        help="An option of SRC's kind (docs/sources.md): "
        + "; ".join(
            f"{s.name}: {', '.join(o.name for o in s.options)}"
            for s in sources.specs()
            if s.options
        )
        + ".",
    ),
    click.option(
        "--labels",
        "labels_file",
        type=click.Path(path_type=Path),
        default=None,
        help="A CSV or JSON Lines list of path,label rows; paths relative to SRC (--source labels "
        "-s file=FILE).",
    ),
    click.option(
        "--no-labels",
        is_flag=True,
        help="Convert every image under SRC without labels: label -1, no classes (--source "
        "unlabelled).",
    ),
    click.option(
        "--image-column",
        default=None,
        help="Hugging Face dataset SRC: the image column [default: by type] (-s image_column=).",
    ),
    click.option(
        "--label-column",
        default=None,
        help="Hugging Face dataset or label list SRC: the label column [default: by type; a list's "
        "'label'] (-s label_column=).",
    ),
    click.option(
        "--splits",
        is_flag=False,
        flag_value="auto",
        default=None,
        metavar="[NAMES]",
        help="SRC holds split folders (train, val, test...): convert each into DST/<split> with one "
        "shared label map; or name them: --splits train,val.",
    ),
    click.option(
        "--no-splits",
        is_flag=True,
        help="Convert top-level folders named like splits (train, test) as classes.",
    ),
)


#: Where and how the work runs: workers, parts, executor, progress.
RUN_OPTIONS = (
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=None,
        help="Processes [default: usable CPUs].",
    ),
    click.option(
        "--num-parts",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Split the conversion into this many parts (contiguous slices of the scan); "
        "convert each with --part, join them with imgpack merge.",
    ),
    click.option(
        "--part",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Which part to convert, 0 to --num-parts minus 1 (e.g. $SLURM_ARRAY_TASK_ID).",
    ),
    click.option(
        "--executor",
        type=click.Choice(["local", "ray"]),
        default="local",
        show_default=True,
        help="Where images are decoded and encoded: a local process pool, or Ray tasks on a cluster "
        "(pip install 'imgpack[ray]'); the output is the same bytes.",
    ),
    click.option(
        "--ray-address",
        default=None,
        help="The Ray cluster for --executor ray [default: RAY_ADDRESS, else a local Ray].",
    ),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
    click.option(
        "--dry-run",
        is_flag=True,
        help="Print the plan (images, classes, files, estimated bytes, what the scan skips) "
        "and stop: nothing is read or written.",
    ),
)


def option_group(options: tuple[Callable[[F], F], ...]) -> Callable[[F], F]:
    """The click options of one group, applied in their order (as stacked decorators are)."""

    def apply(func: F) -> F:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


@main.command()
@click.argument("src")
@click.argument("dst")
@option_group(OUTPUT_OPTIONS)
@option_group(IMAGE_OPTIONS)
@option_group(SOURCE_GROUP)
@option_group(RUN_OPTIONS)
@storage_options
@friendly_errors
def convert(
    src: str, dst: str, storage_option: tuple[str, ...], cache_dir: str | None, **given: Any
) -> None:
    """Convert SRC (an image folder SRC/<class>/<image>, an imgpack output, a label list, TFRecord
    or WebDataset files: docs/sources.md) into DST. Either may be a URL
    (s3://bucket/prefix, gs://..., memory://...; see docs/storage.md)."""
    from imgpack.pipeline import convert as run_convert
    from imgpack.pipeline import convert_splits
    from imgpack.storage.location import is_url

    started = time.perf_counter()
    splits = given.pop("splits")
    if splits is not None and given["no_splits"]:
        raise click.UsageError("give --splits or --no-splits, not both")
    if given["labels_file"] is not None and given["no_labels"]:
        raise click.UsageError(
            "give --labels FILE (a label list's labels) or --no-labels (no labels), not both"
        )
    executor = _executor_spec(given.pop("executor"), given.pop("ray_address"))
    planning = given.pop("dry_run")
    settings = convert_options(given)
    if planning:
        from imgpack.pipeline import dry_run

        if splits is not None:
            raise click.UsageError("--dry-run plans one SRC: run it on each split folder")
        planned = dry_run(src, dst, options=settings, executor=executor,
                          storage_options=_storage(storage_option), cache_dir=cache_dir)  # fmt: skip
        click.echo("\n".join(printable_line(line) for line in planned.lines()))
        _skipped_lines(planned.skipped, "the conversion lists them all in its manifest")
        return
    if splits is not None:
        if is_url(src) or is_url(dst):
            raise click.UsageError("--splits reads and writes local folders")
        names = None if splits == "auto" else [n.strip() for n in splits.split(",") if n.strip()]
        done = convert_splits(src, dst, splits=names, options=settings, executor=executor)
        for name, manifest in done.items():
            _summary(f"{dst}/{name}", manifest, time.perf_counter() - started)
        return
    manifest = run_convert(
        src,
        dst,
        options=settings,
        executor=executor,
        storage_options=_storage(storage_option),
        cache_dir=cache_dir,
    )
    _summary(dst, manifest, time.perf_counter() - started)


def convert_options(given: dict[str, Any]) -> ConvertOptions:
    """The :class:`ConvertOptions` of the option groups' values: the flags named like its fields
    pass as they are; the others say how they map."""
    given = dict(given)
    options = _key_values(given.pop("format_options"), "--option")
    for alias in ("compression", "label_offset"):  # aliases of -o KEY=VALUE
        value = given.pop(alias)
        if value is not None:
            options[alias] = value
    return ConvertOptions.create(
        given.pop("fmt"),
        max_pixels=given.pop("max_pixels") or None,  # 0: no guard
        progress=not given.pop("quiet"),
        allow_split_names=given.pop("no_splits"),
        source=given.pop("source_kind"),
        source_options=_key_values(given.pop("source_options"), "--source-option"),
        labels=given.pop("labels_file"),
        stats=not given.pop("no_stats"),
        format_options=options,
        **given,
    )


def _executor_spec(executor: str, ray_address: str | None) -> str:
    """``--executor`` and ``--ray-address`` as one executor spec (:func:`imgpack.executors.create`)."""
    if ray_address is None:
        return executor
    if executor != "ray":
        raise click.UsageError("--ray-address is for --executor ray")
    return ray_address if ray_address.startswith("ray://") else f"ray:{ray_address}"


def _key_values(items: tuple[str, ...], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict (dashes in keys read as underscores)."""
    found: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint=flag)
        found[key.replace("-", "_")] = value
    return found


def _summary(dst: str, manifest: Any, seconds: float) -> None:
    """The last lines of a conversion: counts, size, time, and the skipped files."""
    click.echo(
        f"{dst}: {manifest.num_samples} samples, {len(manifest.skipped)} skipped, "
        f"{format_bytes(manifest.total_bytes)} in {len(manifest.files)} file(s), {seconds:.1f} s",
        err=True,
    )
    pending = (manifest.part or {}).get("pending")
    if pending:
        click.echo(
            f"  part {manifest.part['index']} of {manifest.part['count']}: its shards are in "
            f"{dst}; {pending} shard(s) of the other parts are still to be written, and the "
            "last part to finish writes imgpack.json (docs/scale.md)",
            err=True,
        )
    if manifest.fields:
        kept = ", ".join(f.spec for f in manifest.fields)
        click.echo(
            printable_line(f"  fields kept: {kept} (--fields NAME,... keeps some)"), err=True
        )
    _skipped_lines(manifest.skipped, f"all listed in {dst}/imgpack.json", err=True)
    if manifest.source.get("ignored_files"):
        click.echo(printable_line(f"  {_ignored(manifest)}"), err=True)


def _ignored(manifest: Any) -> str:
    """What the conversion of ``manifest`` ignored, by reason where it recorded them."""
    count = int(manifest.source.get("ignored_files") or 0)
    return ignored_summary(count, manifest.source.get("ignored"))


def _skipped_lines(skipped: list[dict[str, str]], where: str, err: bool = False) -> None:
    """The first :data:`SHOW_SKIPPED` skipped files, by name with why, then how many more
    (and ``where`` they all are)."""
    for skip in skipped[:SHOW_SKIPPED]:
        click.echo(printable_line(f"  skipped {skip['path']}: {skip['reason']}"), err=err)
    if len(skipped) > SHOW_SKIPPED:
        more = len(skipped) - SHOW_SKIPPED
        click.echo(f"  ... and {more} more skipped ({where})", err=err)


@main.command()
@click.argument("parts", nargs=-1, required=True)
@click.argument("dst")
@click.option("--overwrite", is_flag=True, help="Replace DST if it is an imgpack output.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@storage_options
@friendly_errors
def merge(
    parts: tuple[str, ...],
    dst: str,
    overwrite: bool,
    quiet: bool,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
) -> None:
    """Join the parts of a conversion made with --num-parts/--part (PART...) into DST: the same
    samples, labels and order as one conversion. Sharded formats are hard-linked (no copy)."""
    from imgpack.merging import merge as run_merge

    started = time.perf_counter()
    manifest = run_merge(
        parts,
        dst,
        overwrite=overwrite,
        progress=not quiet,
        storage_options=_storage(storage_option),
        cache_dir=cache_dir,
    )
    seconds = time.perf_counter() - started
    click.echo(
        f"{dst}: {manifest.num_samples} samples from {len(parts)} parts, "
        f"{format_bytes(manifest.total_bytes)} in {len(manifest.files)} file(s), {seconds:.1f} s",
        err=True,
    )


@main.command()
@click.argument("output")
@click.argument("folder")
@click.option(
    "--on-error",
    type=click.Choice(ON_ERROR),
    default="fail",
    show_default=True,
    help="fail: stop at a damaged record, nothing written; skip: leave it out and list it.",
)
@click.option("--overwrite", is_flag=True, help="Replace FOLDER if it is an earlier export.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reading_options
@friendly_errors
def export(
    output: str,
    folder: str,
    on_error: str,
    overwrite: bool,
    quiet: bool,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
    cache_limit: str | None,
) -> None:
    """Write the imgpack output OUTPUT back as an image folder FOLDER/<class>/<image>: the stored
    JPEG/PNG bytes as they are (an original output gives back the source files), else lossless
    PNGs of the stored pixels."""
    from imgpack.exporting import export as run_export

    started = time.perf_counter()
    done = run_export(
        output,
        folder,
        on_error=on_error,
        overwrite=overwrite,
        progress=not quiet,
        options=_read_options(storage_option, cache_dir, cache_limit),
    )
    click.echo(
        f"{folder}: {done.files} files ({done.kept} stored JPEG/PNG bytes as they are, "
        f"{done.renamed} of them PNGs the conversion stored for another type of source; "
        f"{done.encoded} raw records as PNG), {len(done.skipped)} skipped, "
        f"{time.perf_counter() - started:.1f} s",
        err=True,
    )
    for skip in done.skipped[:SHOW_SKIPPED]:
        click.echo(f"  skipped sample {skip['sample']}: {skip['reason']}", err=True)


@main.command(name="formats")
def list_formats() -> None:
    """List the formats this imgpack writes and reads (plugins included), with their options."""
    for spec in formats.specs():
        shards = f", shards of {format_bytes(spec.default_shard_size or 0)}" if spec.sharded else ""
        click.echo(f"{spec.name}: {spec.summary}{shards}")
        for option in spec.options:
            click.echo(f"  -o {option.name}=...  (default {option.default}) {option.help}")


@main.command()
@click.argument("dst", metavar="OUTPUT")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@storage_option_only
@friendly_errors
def info(dst: str, as_json: bool, storage_option: tuple[str, ...]) -> None:
    """Summarise the imgpack output OUTPUT (a folder or a URL) from its manifest."""
    from imgpack.opening import open_manifest
    from imgpack.stats import DatasetStats

    _, manifest = open_manifest(dst, _storage(storage_option))  # a local one put back first
    if as_json:
        click.echo(json.dumps(manifest.to_json(), indent=1, ensure_ascii=False))
        return
    image = manifest.image
    size = size_words(image)
    classes = ", ".join(manifest.classes[:8]) + (", ..." if len(manifest.classes) > 8 else "")
    lines = [
        f"path:      {dst}",
        f"format:    {manifest.format}",
        f"samples:   {manifest.num_samples}",
        f"classes:   {len(manifest.classes)} ({classes})"
        if manifest.classes
        else "classes:   none (unlabelled: every label is -1)",
        f"encoding:  {manifest.encoding}",
        f"image:     {size}, {image.get('channels')} channel(s)",
        *([f"fields:    {', '.join(f.spec for f in manifest.fields)}"] if manifest.fields else []),
        f"files:     {len(manifest.files)}, {format_bytes(manifest.total_bytes)}",
        f"skipped:   {len(manifest.skipped)}",
        f"ignored:   {_ignored(manifest)}",
        f"created:   {manifest.created_by}",
    ]
    if manifest.part is not None:  # one part of a partitioned conversion, not yet merged
        part = manifest.part
        lines.append(
            f"part:      --part {part['index']} of --num-parts {part['count']} (image files "
            f"{part['start']} to {part['stop']} of the scan): imgpack merge joins the parts"
        )
    appends = manifest.source.get("appended")
    if isinstance(appends, list) and appends and isinstance(appends[-1], dict):
        last = appends[-1]
        lines.append(
            f"appended:  {len(appends)} time(s); last {last.get('samples')} samples from "
            f"{last.get('path')}"
        )
    if manifest.stats is None:
        lines.append("stats:     none (made before imgpack recorded them; convert again for them)")
    else:
        lines.extend(DatasetStats.from_json(manifest.stats).summary_lines())
    lines.append(f"preview:   imgpack preview {dst} -o preview.png (a contact sheet per class)")
    click.echo("\n".join(printable_line(line) for line in lines))  # names from the manifest


@main.command()
@click.argument("dst", metavar="OUTPUT")
@click.option(
    "-o",
    "--output",
    "sheet_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("preview.png"),
    show_default=True,
    help="The PNG to write.",
)
@click.option("--per-class", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--classes", default=None, help="Rows for these classes, in this order: --classes cat,dog."
)
@click.option(
    "--size", default=None, help="Read the images at N x N or HxW, as open_dataset(size=) does."
)
@click.option(
    "--recipe",
    type=click.Choice(["train", "eval"]),
    default=None,
    help="Show the crops training sees: train, RandomResizedCrop(--size) and a flip; eval, "
    "Resize(8/7 of --size) then CenterCrop(--size).",
)
@click.option("--epoch", type=click.IntRange(min=0), default=0, show_default=True,
              help="The epoch whose crops --recipe train shows.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="The crops' seed.")
@reading_options
@friendly_errors
def preview(
    dst: str,
    sheet_path: Path,
    per_class: int,
    classes: str | None,
    size: str | None,
    recipe: str | None,
    epoch: int,
    seed: int,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
    cache_limit: str | None,
) -> None:
    """Write a contact sheet of OUTPUT (a folder or a URL): a row per class, labelled, of its
    first samples read back through the reader, as training sees them (with --recipe, the
    crops of that epoch)."""
    from imgpack.preview import contact_sheet
    from imgpack.readers import open_dataset
    from imgpack.storage.location import is_url

    options = replace(_read_options(storage_option, cache_dir, cache_limit), size=size)
    if recipe is not None:
        from imgpack.recipe import CenterCrop, RandomResizedCrop
        from imgpack.units import parse_image_size

        if size is None:
            raise click.UsageError(f"--recipe {recipe} needs --size N (the crop's size)")
        side = parse_image_size(size)
        crop = RandomResizedCrop(side) if recipe == "train" else CenterCrop(side)
        options = replace(options, size=None, recipe=crop, seed=seed)
    dataset = open_dataset(dst, options=options)
    dataset.set_epoch(epoch)
    if not is_url(dst) and sheet_path.resolve().is_relative_to(Path(dst).resolve()):
        raise click.UsageError(
            f"-o {sheet_path}: inside the output {dst}; write the sheet elsewhere (an output's "
            "folder holds only what its manifest lists)"
        )
    names = [n.strip() for n in classes.split(",") if n.strip()] if classes else None
    sheet = contact_sheet(dataset, per_class, names)
    try:
        sheet.image.save(sheet_path, format="PNG")
    except OSError as exc:
        if sheet_path.is_file():
            sheet_path.unlink(missing_ok=True)  # no half-written sheet
        why = exc.strerror or str(exc)
        message = printable_line(f"{sheet_path}: cannot write the sheet: {why}")
        raise click.ClickException(message) from None
    rows = len({name for _, name, _, _ in sheet.tiles})
    more = f"; {sheet.left_out} more classes left out (name them with --classes)"
    click.echo(
        f"{sheet_path}: {len(sheet.tiles)} samples in {rows} row(s), "
        f"{sheet.image.width}x{sheet.image.height} pixels{more if sheet.left_out else ''}"
    )


@main.command(name="verify")
@click.argument("dst", metavar="OUTPUT")
@click.option("--deep", is_flag=True, help="Also decode every record; check shape and label.")
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Threads [default: usable CPUs]."
)
@json_option("report")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@storage_option_only
@friendly_errors
def verify_command(
    dst: str,
    deep: bool,
    workers: int | None,
    json_path: Path | None,
    quiet: bool,
    storage_option: tuple[str, ...],
) -> None:
    """Check OUTPUT for damage: files against the manifest (size, sha256), every record's checksum,
    and with --deep every decode. One line per problem, a summary last; exit 1 when damaged."""
    from imgpack.verification import verify

    report = verify(
        dst,
        deep=deep,
        workers=workers,
        progress=not quiet,
        storage_options=_storage(storage_option),
    )
    for problem in report.problems:
        click.echo(problem.line())
    click.echo(report.summary())
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if not report.ok:
        raise SystemExit(1)


def _parse_workers(value: str) -> list[int]:
    try:
        workers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        workers = []
    if not workers or any(w < 0 for w in workers):
        raise click.BadParameter(
            f"{value!r}: expected worker counts like 0,2,4", param_hint="--workers"
        )
    return workers


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--workers", default="0,2", show_default=True, help="Comma-separated num_workers values."
)
@batch_size_option
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=None,
    help="Samples to read per measurement [default: 3 epochs, at most 20,000].",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Most seconds of reading per measurement.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@json_option("results")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw the table as a chart into this image file (.png, .svg; needs imgpack[plot]).",
)
@reading_options
@friendly_errors
def bench(
    paths: tuple[str, ...],
    workers: str,
    batch_size: int,
    samples: int | None,
    seconds: float,
    quiet: bool,
    json_path: Path | None,
    plot_path: Path | None,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
    cache_limit: str | None,
) -> None:
    """Read throughput of image folders and imgpack outputs (folders or URLs), side by side
    through a DataLoader."""
    from imgpack.loading.bench import pyplot, run_bench
    from imgpack.storage.location import is_url

    for path in paths:
        if not is_url(path) and not Path(path).exists():
            raise click.BadParameter(f"{path!r} does not exist", param_hint="PATHS")
    if plot_path is not None:
        pyplot()  # before measuring: a missing matplotlib fails at once
    read = _read_options(storage_option, cache_dir, cache_limit)
    results = run_bench(paths, _parse_workers(workers), batch_size, samples, read, seconds,
                        progress=not quiet)  # fmt: skip
    width = max(len(r.name) for r in results)
    click.echo(f"{'loader':<{width}}  {'workers':>7}  {'samples/s':>11}  path")
    for r in results:
        click.echo(f"{r.name:<{width}}  {r.workers:>7}  {r.rate:>11,.0f}  {r.path}")
    if json_path is not None:
        json_path.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    if plot_path is not None:
        from imgpack.loading.bench import plot_results

        click.echo(f"chart: {plot_results(results, plot_path)}")


@main.command()
@click.argument("dst", metavar="OUTPUT")
@batch_size_option
@count_option("--batches", 20, "Batches timed per candidate.")
@click.option(
    "--workers",
    default=None,
    help="num_workers candidates to try, e.g. 0,2,4 [default: 0, 1, 2, 4, ... up to 2x the CPUs].",
)
@count_option(
    "--repeats", 3, "Runs per candidate (taken in turn); the choice goes by their medians."
)
@json_option("table")
@reading_options
@friendly_errors
def tune(
    dst: str,
    batch_size: int,
    batches: int,
    workers: str | None,
    repeats: int,
    json_path: Path | None,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
    cache_limit: str | None,
) -> None:
    """Recommend DataLoader settings for OUTPUT, then measure candidates and name the one to use
    (the fastest, unless the recommended one is within the machine's noise of it)."""
    from imgpack.loading.tuning import (
        LoaderSettings,
        autotune_loader,
        candidate_settings,
        recommend_loader_settings,
    )
    from imgpack.readers import open_dataset

    dataset = open_dataset(dst, options=_read_options(storage_option, cache_dir, cache_limit))
    advice = recommend_loader_settings(dataset)
    click.echo("starting point (a guess from the CPUs, the GPU and the format; measured below):")
    for key, value in advice.kwargs().items():
        click.echo(f"  {key:<18} {value!s:<6} {advice.reasons[key]}")
    if advice.decode_threads is not None:
        click.echo(
            f"  {'decode_threads':<18} {advice.decode_threads!s:<6} "
            f"{advice.reasons['decode_threads']}"
        )
    candidates = candidate_settings(dataset)
    if workers is not None:
        by_workers = {c.num_workers: c for c in candidates}
        candidates = [
            by_workers.get(n) or LoaderSettings(n, advice.pin_memory, n > 0, 4 if n else None)
            for n in _parse_workers(workers)
        ]
    result = autotune_loader(dataset, batch_size, candidates, batches, repeats=repeats)
    click.echo(
        f"\nmeasured ({repeats} run(s) of {batches} batches of {batch_size} per candidate, in "
        "turn, each after one warm-up batch; median and spread, min-max):"
    )
    click.echo(
        f"  {'num_workers':>11}  {'decode_threads':>14}  {'pin_memory':>10}  {'samples/s':>11}"
        f"  {'spread':>17}"
    )
    for (settings, rate), runs in zip(result.table, result.runs, strict=True):
        mark = "  <- chosen" if settings is result.best else ""
        threads = "-" if settings.decode_threads is None else settings.decode_threads
        low_high = f"{min(runs):,.0f}-{max(runs):,.0f}"
        click.echo(
            f"  {settings.num_workers:>11}  {threads!s:>14}  {settings.pin_memory!s:>10}  "
            f"{rate:>11,.0f}  {low_high:>17}{mark}"
        )
    best = result.best.kwargs()
    reader = result.best.reader_kwargs()
    opened = "".join(f", {k}={v}" for k, v in reader.items())
    click.echo(f"\n{result.best.reasons.get('num_workers', '')}")
    click.echo(
        f"recommended: ds = imgpack.open_dataset({str(dst)!r}{opened})\n"
        f"             DataLoader(ds, batch_size={batch_size}, "
        + ", ".join(f"{k}={v}" for k, v in best.items())
        + ", collate_fn=imgpack.readers.collate)"
    )
    if json_path is not None:
        rows = [
            {
                **s.kwargs(),
                **s.reader_kwargs(),
                "samples_per_s": round(r, 1),
                "runs": [round(x, 1) for x in runs],
            }
            for (s, r), runs in zip(result.table, result.runs, strict=True)
        ]
        report = {
            "best": {**best, **reader},
            "reason": result.best.reasons.get("num_workers"),
            "within_noise": result.within_noise,
        }
        json_path.write_text(json.dumps({**report, "table": rows}, indent=1) + "\n")


@main.command()
@click.argument("dst", metavar="OUTPUT")
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="DataLoader num_workers.",
)
@batch_size_option
@click.option("--batches", type=click.IntRange(min=2), default=50, show_default=True)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="Simulated training step per batch (your step's time).",
)
@json_option("report")
@reading_options
@friendly_errors
def profile(
    dst: str,
    workers: int,
    batch_size: int,
    batches: int,
    step_ms: float,
    json_path: Path | None,
    storage_option: tuple[str, ...],
    cache_dir: str | None,
    cache_limit: str | None,
) -> None:
    """Profile a short pass over OUTPUT: per-sample fetch times (workers included) and how long
    the training loop waits for each batch."""
    from torch.utils.data import DataLoader

    from imgpack.loading.advice import worker_note
    from imgpack.loading.profiling import LoaderProfiler, TimedDataset, verdict
    from imgpack.loading.tuning import loader_bound_advice
    from imgpack.readers import collate, open_dataset

    read = _read_options(storage_option, cache_dir, cache_limit)
    dataset = open_dataset(dst, options=read)
    timed = TimedDataset(dataset)
    loader = DataLoader(
        timed,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        collate_fn=collate,
    )
    profiler = LoaderProfiler(loader)
    step = 0
    while step < batches:  # as many epochs as --batches takes: a small output has few a pass
        before = step
        for _ in profiler:
            if step_ms:
                time.sleep(step_ms / 1000)
            step += 1
            if step >= batches:
                break
        if step == before:  # an empty output: no epoch yields a batch
            break
    fetch, loop = timed.stats(), profiler.summary()
    timed.close()
    ms = 1000.0
    click.echo(f"fetch per sample ({fetch['count']} samples, {workers} workers):")
    click.echo(
        f"  mean {fetch['mean'] * ms:.3f} ms  p50 {fetch['p50'] * ms:.3f} ms  p95 {fetch['p95'] * ms:.3f} ms  max {fetch['max'] * ms:.3f} ms"
    )
    for name, row in fetch["per_worker"].items():
        click.echo(f"  {name:<8} {row['count']:>7} samples  mean {row['mean'] * ms:.3f} ms")
    click.echo(
        f"training loop ({loop['batches']} batches; the first, with start-up, took {loop['first_wait']:.2f} s):"
    )
    click.echo(
        f"  waiting for data {loop['wait_s']:.2f} s, between batches {loop['compute_s']:.2f} s"
    )
    click.echo(verdict(loop, advice=loader_bound_advice(dataset)))
    note = worker_note(dataset, workers)  # the advice the loader would give, said here
    if note is not None:
        click.echo(f"note: {note}")
    if json_path is not None:
        json_path.write_text(json.dumps({"fetch": fetch, "loop": loop}, indent=1) + "\n")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@friendly_errors
def index(files: tuple[Path, ...]) -> None:
    """Write the .idx (one "offset size" line per record) beside each TFRecord file in FILES."""
    from imgpack.formats.tfrecord import framing

    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        records = framing.build_index(path)
        target = framing.write_index(path, records)
        click.echo(f"{target}: {len(records)} records", err=True)


@main.command()
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--images", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--classes", type=click.IntRange(1, 5), default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--splits",
    metavar="NAMES",
    default=None,
    help="Comma-separated split folders (e.g. train,val), each a sample folder of --images "
    "images with its own seed: a SRC for convert --splits.",
)
@friendly_errors
def sample(dst: Path, images: int, classes: int, seed: int, splits: str | None) -> None:
    """Write a small seeded sample image folder to DST (for trying imgpack out)."""
    from imgpack.sample import make_sample_folder

    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: already exists and is not empty")
    names = [name.strip() for name in splits.split(",")] if splits is not None else []
    if splits is not None and (not all(names) or len(set(names)) != len(names)):
        raise OptionError(f"--splits {splits!r}: give distinct non-empty names, e.g. train,val")
    for i, name in enumerate(names):
        make_sample_folder(dst / name, images, classes, seed + i)
    if not names:
        make_sample_folder(dst, images, classes, seed)
    each = f" in each of {', '.join(names)}" if names else ""
    click.echo(f"{dst}: {images} images in {classes} classes{each}", err=True)


if __name__ == "__main__":
    main()
