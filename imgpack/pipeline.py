"""The conversion engine: scan, decode/validate/encode in parallel, write in order, publish atomically.

::

    SRC --scan--> ordered samples --> process pool: read + validate + encode (chunks, bounded window)
        --> one writer, in scan order --> files in a temp dir beside DST --> manifest --> rename to DST

The output depends only on the input and the options: the worker count changes the speed, never
the bytes. At most ``workers * WINDOW_PER_WORKER`` chunks are in flight, so memory stays bounded
by the chunk window plus what the writer buffers (for ``pt``, one shard), whatever the dataset
size. A failure or an interrupt removes the temp dir and leaves DST as it was.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import warnings
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

import imgpack
from imgpack.converters import get_writer
from imgpack.converters.base import WriterConfig
from imgpack.errors import ImageError, ImgpackError, OptionError
from imgpack.folder import Sample, read_class_list, scan_folder
from imgpack.images import (
    DEFAULT_MAX_PIXELS,
    Encoded,
    Encoding,
    ImagePolicy,
    parse_color,
    process_file,
)
from imgpack.manifest import MANIFEST_NAME, FileEntry, Manifest, sha256_file, write_manifest
from imgpack.units import parse_byte_size, parse_image_size

log = logging.getLogger(__name__)

ON_ERROR = ("fail", "skip")
#: Chunks in flight per worker: enough to keep every worker busy, few enough to bound memory.
WINDOW_PER_WORKER = 4
MAX_CHUNK = 32


@dataclass(frozen=True)
class Failure:
    """A source file that could not be converted, and why."""

    index: int
    path: str
    reason: str


Outcome = Encoded | Failure


def usable_cpus() -> int:
    """CPUs this process may run on (affinity-aware, unlike ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _process_chunk(
    root: str, items: Sequence[tuple[int, Sample]], policy: ImagePolicy, encoding: Encoding
) -> list[Outcome]:
    out: list[Outcome] = []
    for index, sample in items:
        try:
            out.append(process_file(index, root, sample.path, sample.label, policy, encoding))
        except ImageError as exc:
            out.append(Failure(index, exc.path, exc.reason))
    return out


def _ignore_sigint() -> None:
    # The parent handles Ctrl-C and tears the pool down; workers should not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it, else spawn.

    The workers run only imgpack's own read/decode/encode code (Pillow, numpy), never torch,
    OpenMP or logging, so forking a parent that holds other threads is safe here, as it is for
    torch's DataLoader workers. forkserver and spawn would re-run the caller's ``__main__``
    module in every worker (on Python 3.11 the forkserver does not preload it): for a training
    script that imports torch, seconds of start-up per worker.
    """
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _chunks(items: list[Any], largest: int) -> Iterator[list[Any]]:
    """Slices of ``items`` of 1, 2, 4, ... up to ``largest`` items: the first results arrive at
    once, later chunks amortise the per-task overhead."""
    start, size = 0, 1
    while start < len(items):
        yield items[start : start + size]
        start += size
        size = min(size * 2, largest)


def _outcomes(
    root: str,
    samples: Sequence[Sample],
    policy: ImagePolicy,
    encoding: Encoding,
    workers: int,
) -> Generator[Outcome, None, None]:
    """Process every sample and yield the outcomes in scan order."""
    numbered = list(enumerate(samples))
    if workers == 1:
        for item in numbered:
            yield from _process_chunk(root, [item], policy, encoding)
        return
    chunks = _chunks(numbered, max(1, min(MAX_CHUNK, len(numbered) // (workers * 8))))
    window: deque[Future[list[Outcome]]] = deque()
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in a multi-threaded process; see _pool_context.
        warnings.filterwarnings(
            "ignore",
            message=r".*use of fork\(\) may lead to deadlocks",
            category=DeprecationWarning,
        )
        executor = ProcessPoolExecutor(
            workers, mp_context=_pool_context(), initializer=_ignore_sigint
        )
        first = executor.submit(_process_chunk, root, [], policy, encoding)  # starts the workers
    try:
        first.result()
        for part in chunks:
            window.append(executor.submit(_process_chunk, root, part, policy, encoding))
            if len(window) >= workers * WINDOW_PER_WORKER:
                yield from window.popleft().result()
        while window:
            yield from window.popleft().result()
    except BrokenProcessPool:
        raise ImgpackError(
            "a conversion worker died unexpectedly (out of memory?); try fewer --workers"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such folder")
    if not src.is_dir():
        raise OptionError(f"{src}: not a folder (SRC must be an image folder SRC/<class>/<image>)")
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src or real_src in real_dst.parents:
        raise OptionError(f"{dst}: the output must not be inside the source folder {src}")
    if real_dst in real_src.parents:
        raise OptionError(f"{dst}: the output must not contain the source folder {src}")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{dst}: already exists (use --overwrite to replace it)")
        replaceable = (
            dst.is_dir()
            and not dst.is_symlink()
            and ((dst / MANIFEST_NAME).is_file() or not any(dst.iterdir()))
        )
        if not replaceable:
            raise FileExistsError(
                f"{dst}: exists and is not an imgpack output; refusing to replace it even with "
                "--overwrite (remove it yourself if that is what you want)"
            )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(tmp: Path, dst: Path) -> None:
    """Move the finished temp dir to ``dst``, replacing an old output only at the last moment."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".imgpack-old", dir=dst.parent))
        os.rename(dst, old / "out")
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dst)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str = "pt",
    *,
    encoding: str = "original",
    size: int | str | tuple[int, int] | None = None,
    quality: int = 90,
    resize: str = "crop",
    resample: str = "bilinear",
    grayscale: bool = False,
    background: str | tuple[int, int, int] = "white",
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    workers: int | None = None,
    shard_size: int | str | None = None,
    overwrite: bool = False,
    on_error: str = "fail",
    classes_from: str | os.PathLike[str] | None = None,
    progress: bool = True,
    **format_options: Any,
) -> Manifest:
    """Convert the image folder ``src`` into a ``format`` output at ``dst``.

    Args:
        src: image folder, ``src/<class>/**/<image>``; never modified.
        dst: output directory; must not exist unless ``overwrite`` (then it must be an imgpack
            output or empty, and is replaced only once the new output is complete).
        format: one of :data:`imgpack.converters.FORMATS`.
        encoding: ``original``, ``png``, ``jpeg`` or ``raw`` (``raw`` needs ``size``).
        size: ``N``, ``"HxW"`` or ``(H, W)``: resize every image (see ``resize``).
        quality: JPEG quality for ``encoding="jpeg"``.
        resize: ``crop`` (shorter side to fit, centre crop) or ``stretch``.
        resample: Pillow filter: nearest, bilinear, bicubic, lanczos or box.
        grayscale: store 1-channel luma instead of RGB.
        background: colour that transparent pixels are composited over.
        max_pixels: refuse images with more pixels (Pillow's decompression-bomb guard); ``None``
            turns the guard off.
        workers: processes that decode and encode; default: the usable CPUs.
        shard_size: bytes per shard for sharded formats (``"512MB"``, ``"1GiB"``, an int).
        on_error: ``fail`` stops at the first bad file (DST untouched); ``skip`` skips bad files
            and records them in the manifest.
        classes_from: reuse the label map of an imgpack output or of a text file (one class per
            line), so every split of a dataset shares one map.
        progress: show a tqdm progress bar on stderr.
        **format_options: options of the format's writer (see its docs page).

    Returns:
        The manifest written to ``dst/imgpack.json``.
    """
    writer_cls = get_writer(format)
    if on_error not in ON_ERROR:
        raise OptionError(f"invalid on_error {on_error!r}: expected one of {', '.join(ON_ERROR)}")
    enc = Encoding(encoding, quality)
    policy = ImagePolicy(
        size=parse_image_size(size) if size is not None else None,
        resize=resize,
        resample=resample,
        channels=1 if grayscale else 3,
        background=parse_color(background),
        max_pixels=max_pixels,
    )
    if enc.name == "raw" and policy.size is None:
        raise OptionError("encoding 'raw' needs a fixed image size: give --size N or HxW")
    if workers is None:
        workers = usable_cpus()
    if workers < 1:
        raise OptionError(f"invalid workers {workers!r}: expected 1 or more")
    if shard_size is not None and not writer_cls.sharded:
        raise OptionError(
            f"format {format!r} writes a single file; --shard-size does not apply to it"
        )
    shard_bytes = parse_byte_size(
        shard_size if shard_size is not None else writer_cls.default_shard_size, "shard size"
    )

    writer_cls.check_options(format_options)  # fail before a long scan, not after it
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, overwrite)
    classes = read_class_list(classes_from) if classes_from is not None else None
    scan = scan_folder(src, classes)
    config = WriterConfig(scan.classes, enc, policy, shard_bytes, len(scan.samples))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".imgpack-tmp", dir=dst.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the output is an ordinary folder
    try:
        writer = writer_cls(tmp, config, **format_options)
        skipped: list[dict[str, str]] = []
        count = 0
        bar = tqdm(
            total=len(scan.samples),
            unit="img",
            desc=f"{format}",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
        )
        outcomes = _outcomes(str(src), scan.samples, policy, enc, workers)
        with closing(outcomes), bar, writer:
            for outcome in outcomes:
                bar.update(1)
                if isinstance(outcome, Failure):
                    if on_error == "fail":
                        raise ImageError(
                            f"{src}/{outcome.path}",
                            f"{outcome.reason} (use --on-error skip to skip such files)",
                        )
                    log.info("skipped %s: %s", outcome.path, outcome.reason)  # summary lists them
                    skipped.append({"path": outcome.path, "reason": outcome.reason})
                    continue
                writer.add(outcome)
                count += 1
            if count == 0:
                raise ImgpackError(
                    f"{src}: every one of the {len(scan.samples)} image files was skipped; "
                    f"nothing to write (first: {skipped[0]['path']}: {skipped[0]['reason']})"
                )
        files = writer.close()
        image = policy.describe()
        manifest = Manifest(
            format=format,
            num_samples=count,
            classes=scan.classes,
            encoding=enc.name,
            image=image,
            files=[
                FileEntry(
                    f.path, (tmp / f.path).stat().st_size, f.num_samples, sha256_file(tmp / f.path)
                )
                for f in files
            ],
            options={
                "encoding": enc.name,
                "quality": enc.quality if enc.name == "jpeg" else None,
                "shard_size": shard_bytes if writer_cls.sharded else None,
                "on_error": on_error,
                "max_pixels": max_pixels,
                **writer.settings,
            },
            source={
                "path": str(src.resolve()),
                "image_files": len(scan.samples),
                "ignored_files": scan.ignored_files,
                "empty_classes": scan.empty_classes,
                "classes_from": str(classes_from) if classes_from is not None else None,
            },
            skipped=skipped,
            created_by=f"imgpack {imgpack.__version__}",
        )
        write_manifest(tmp, manifest)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
