"""Helpers shared by the benchmark scripts: datasets, peak-memory sampling, tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model or platform.processor()}, {cpus} usable CPUs, {mem:.0f} GiB RAM, torch {torch.__version__}, Python {platform.python_version()}"


def make_png_folder(root: Path, count: int, size: int, classes: int, seed: int = 0) -> Path:
    """``count`` seeded ``size`` x ``size`` RGB PNGs in ``classes`` folders (reused if present)."""
    done = root / ".complete"
    if done.exists():
        return root
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, size, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, size, dtype=np.float32)[None, :, None]
    for c in range(classes):
        (root / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        a, b, c0 = rng.uniform(0, 255, size=(3, 3)).astype(np.float32)
        noise = rng.normal(0, 12, size=(size, size, 3)).astype(np.float32)
        pixels = np.clip(a + (b - a) * x + (c0 - a) * y + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(
            root / f"class{i % classes:02d}" / f"img{i:06d}.png", compress_level=1
        )
    done.touch()
    return root


def _tree_rss(pid: int) -> tuple[int, int]:
    """(RSS of pid, RSS of pid and all its descendants) in bytes, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            statm = Path(f"/proc/{entry}/statm").read_text().split()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = int(statm[1]) * page
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return rss.get(pid, 0), total


def run_with_peak_rss(cmd: Sequence[str], interval: float = 0.05) -> tuple[float, int, int]:
    """Run ``cmd``; return (seconds, peak RSS of the process, peak RSS of its whole tree)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_main = peak_tree = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal peak_main, peak_tree
        while not stop.is_set():
            main, tree = _tree_rss(proc.pid)
            peak_main, peak_tree = max(peak_main, main), max(peak_tree, tree)
            time.sleep(interval)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    _, err = proc.communicate()
    stop.set()
    thread.join()
    if proc.returncode:
        sys.exit(f"command failed: {' '.join(cmd)}\n{err}")
    return time.perf_counter() - start, peak_main, peak_tree


def best_of(repeats: int, fn: Callable[[], tuple[int, float]]) -> float:
    """Best samples/s over ``repeats`` runs of ``fn`` (which returns samples, seconds)."""
    rates = []
    for _ in range(repeats):
        count, seconds = fn()
        rates.append(count / seconds)
    return max(rates)


def read_from_disk(roots: Sequence[Path]) -> None:
    """Drop the files under ``roots`` from the page cache and read each once, so that what a
    benchmark reads next is held as after a read from disk (a training run reading an output
    that was not in memory), not as its writer left it: the kernel's readahead gathers the
    pages into large folios that a memory map can map 2 MB at a time, where written pages are
    mapped 4 KB each (Linux; elsewhere the files are only read)."""
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
            fd = os.open(path, os.O_RDONLY)
            try:
                if hasattr(os, "posix_fadvise"):
                    os.fsync(fd)  # dirty pages cannot be dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                while os.read(fd, 8 << 20):
                    pass
            finally:
                os.close(fd)


def index_select_limit(
    images: torch.Tensor, batch_size: int, samples: int, seed: int = 0
) -> tuple[int, float]:
    """The memory-bound limit: gather shuffled batches from an in-RAM uint8 tensor."""
    gen = torch.Generator().manual_seed(seed)
    n = len(images)
    count = 0
    start = time.perf_counter()
    while count < samples:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            batch = torch.index_select(images, 0, perm[i : i + batch_size])
            count += len(batch)
            if count >= samples:
                break
    return count, time.perf_counter() - start


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def save_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def class_folders(root: Path, classes: int, seed: int) -> np.random.Generator:
    """The class folders of a generated set, and the set's random generator."""
    for c in range(classes):
        (root / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
    return np.random.default_rng(seed)


def photo_pixels(rng: np.random.Generator, height: int, width: int, i: int) -> np.ndarray:
    """Photo ``i`` of a set: smooth light, a shape, sensor noise."""
    from imgpack.sample import synthetic_image

    kinds = ("circle", "square", "stripes", "triangle")
    img = synthetic_image(rng, height, width, kinds[i % len(kinds)])
    noise = rng.normal(0, 6, size=(height, width, 3))
    return np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)


class PerSample:
    """A reader read one sample at a time (``ds[i]``: DataLoader finds no ``__getitems__``)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> Any:
        return self.ds[index]


def make_jpeg_folder(
    root: Path, count: int, height: int = 375, width: int = 500, classes: int = 10, seed: int = 0
) -> Path:
    """``count`` seeded photo-like JPEGs (smooth light, shapes, sensor noise), quality 90."""
    done = root / ".complete"
    if done.exists():
        return root
    rng = class_folders(root, classes, seed)
    for i in range(count):
        pixels = photo_pixels(rng, height, width, i)
        Image.fromarray(pixels).save(
            root / f"class{i % classes:02d}" / f"photo{i:05d}.jpg", quality=90
        )
    done.touch()
    return root


def bare_decode_rate(paths: Sequence[Path]) -> float:
    """Images/s of a bare single-core Pillow decode (open + load) of ``paths``, files in page cache."""
    for path in paths:  # warm the page cache
        path.read_bytes()
    start = time.perf_counter()
    for path in paths:
        with Image.open(path) as img:
            img.load()
    return len(paths) / (time.perf_counter() - start)


def _decode_files(paths: Sequence[Path]) -> int:
    for path in paths:
        with Image.open(path) as img:
            img.load()
    return len(paths)


def parallel_decode_rate(paths: Sequence[Path], processes: int) -> float:
    """Images/s of a bare Pillow decode split over ``processes`` processes (start-up excluded):
    what the machine's cores really deliver right now."""
    import multiprocessing

    parts = [list(paths[i::processes]) for i in range(processes)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(_decode_files, [p[:1] for p in parts])  # start the workers
        start = time.perf_counter()
        done = sum(pool.map(_decode_files, parts))
        return done / (time.perf_counter() - start)


# -- variable-size photos and the decode limits ---------------------------------------------------
#: ImageNet's usual sizes (H, W); some photos get odd sizes between 300 and 500 on each side.
PHOTO_SIZES = ((375, 500), (500, 375), (333, 500), (500, 333), (400, 500), (500, 500), (334, 500))
#: The size batches are fitted to (crop, bilinear), as a training pipeline would.
FIT = (224, 224)


def make_photo_folder(root: Path, count: int, classes: int = 10, seed: int = 0) -> Path:
    """``count`` seeded photo-like JPEGs of ImageNet's usual sizes (about 500x400 on average),
    quality 90, in ``classes`` class folders."""
    done = root / ".complete"
    if done.exists():
        return root
    rng = class_folders(root, classes, seed)
    for i in range(count):
        height, width = PHOTO_SIZES[int(rng.integers(len(PHOTO_SIZES)))]
        if rng.random() < 0.3:
            height, width = int(rng.integers(300, 501)), int(rng.integers(300, 501))
        pixels = photo_pixels(rng, height, width, i)
        Image.fromarray(pixels).save(root / f"class{i % classes:02d}" / f"p{i:05d}.jpg", quality=90)
    done.touch()
    return root


def decode_validate(data: bytes) -> Any:
    """What validating a kept JPEG must do at least: decode it at 1/8 DCT scale."""
    import simplejpeg

    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    return simplejpeg.decode_jpeg(
        data, min_height=-(-height // 8), min_width=-(-width // 8), strict=True
    )


def validate_and_hash(data: bytes) -> Any:
    """The least a converter writing imgpack's outputs does for every kept JPEG: validate it
    (:func:`decode_validate`) and take the checksums every stored byte gets (the record's
    CRC-32C, and its share of the shard's sha256 in the manifest)."""
    import hashlib

    from imgpack.checksum import crc32c

    crc32c(data)
    hashlib.sha256(data).digest()
    return decode_validate(data)


def decode_full(data: bytes) -> Any:
    """A full simplejpeg decode (accurate DCT, fancy upsampling): HxWx3 uint8."""
    import simplejpeg

    return simplejpeg.decode_jpeg(data, strict=True)


def decode_fit(data: bytes) -> Any:
    """The least work that gives a JPEG fitted to :data:`FIT`: simplejpeg at the DCT scale
    Pillow's draft picks for it, then imgpack's resize (crop, bilinear)."""
    import simplejpeg

    from imgpack.decoding import draft_scale
    from imgpack.images import ImagePolicy, resize_pixels

    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    scale = draft_scale(height, width, FIT)
    pixels = simplejpeg.decode_jpeg(
        data,
        min_height=-(-height // scale) if scale > 1 else 0,
        min_width=-(-width // scale) if scale > 1 else 0,
        strict=True,
    )
    return resize_pixels(pixels, ImagePolicy(size=FIT, resize="crop"))


DECODES: dict[str, Callable[[bytes], Any]] = {
    "validate": decode_validate,
    "validate+hash": validate_and_hash,
    "decode": decode_full,
    "decode+fit": decode_fit,
    # decode_full, and the bytes written to a new file (see _timed_decodes)
    "decode+write": decode_full,
}
_PAYLOADS: list[bytes] = []
#: Where a "+write" limit writes its files (the folder the measured conversions write to).
_WRITE_DIR: list[str] = []
#: Bytes a "+write" limit holds before a write: imgpack's writers' run (writer_base.WRITE_BUFFER).
_WRITE_RUN = 4 << 20


def _timed_decodes(args: tuple[str, int, int]) -> float:
    """Seconds this process takes for its share of the payloads. A ``+write`` work also writes
    each payload's bytes to a new file of its own (in runs of ``_WRITE_RUN``, closed within
    the time, removed after): the least a conversion adds to its decodes, the output's bytes
    reaching the page cache of the folder it writes to, at what this machine's kernel takes
    for fresh pages right now."""
    work, part, parts = args
    mine, fn = _PAYLOADS[part::parts], DECODES[work]
    for data in mine[:20]:  # warm up
        fn(data)
    if not work.endswith("+write"):
        start = time.perf_counter()
        for data in mine:
            fn(data)
        return time.perf_counter() - start
    path = os.path.join(_WRITE_DIR[0], f".limit-{os.getpid()}-{part}")
    held = bytearray()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for data in mine:
            fn(data)
            held += data
            if len(held) >= _WRITE_RUN:
                os.write(fd, held)
                held.clear()
        os.write(fd, held)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def decode_limit(
    work: str,
    payloads: Sequence[bytes],
    processes: int,
    repeats: int,
    write_dir: str | os.PathLike[str] = ".",
) -> float:
    """Images/s of ``work`` (a key of :data:`DECODES`) over ``payloads`` in RAM, split over
    ``processes`` processes running at once (the slowest sets the time; start-up not counted),
    best of ``repeats``: what this machine's cores deliver for that work right now. A
    ``+write`` work writes its files in ``write_dir``."""
    import multiprocessing

    _PAYLOADS[:] = payloads
    _WRITE_DIR[:] = [str(write_dir)]
    best = 0.0
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for _ in range(repeats):
            seconds = max(
                pool.map(_timed_decodes, [(work, k, processes) for k in range(processes)])
            )
            best = max(best, len(payloads) / seconds)
    return best
