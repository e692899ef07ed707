"""imgpack beside the tools users would otherwise run, on the same images, in one run.

Peers: WebDataset (tar shards), LitData (``litdata.optimize`` chunks), MosaicML streaming
(MDS shards) and the ``tfrecord`` package (one TFRecord file and its index). Each stores the
image files' bytes as they are (none validates anything) and decodes them with Pillow when
read, as their documentation shows; imgpack converts with full validation and reads through its
own readers.

Generated, seeded image sets (reused between runs, under --data; --sets picks them):
  small:  50,000 32x32 PNGs in 10 classes (imgpack also stores them raw at 32x32)
  jpeg:   4,000 photo-like 500x375 JPEGs in 10 classes
  photos: --photos photo-like JPEGs of ImageNet's usual sizes (about 500x400, each size its
          own), where every peer decodes with simplejpeg too (the fastest decode a user of
          those tools could plug in), measured two ways at num_workers 0, 1 and 2:
          fit:        batches fitted to 224x224 (simplejpeg at the DCT scale Pillow's draft
                      picks, then imgpack's crop resize, in every tool); imgpack reads
                      open_dataset(size=224) + collate
          per sample: full-size images, one __getitem__ per sample (imgpack: ds[i]), batches
                      as lists (a list collate in every tool)
          against the limits measured in the same run: cores x (decode + fit), and cores x
          full decode, each in that many processes over the bytes in RAM

Measured per tool and set: conversion time and rate, output size, read rate through a
DataLoader at num_workers 0 and 2 (one shuffled epoch, batches of 256, the clock started at the
first batch), first-batch latency (iterator creation to first batch, worker start-up included),
and a check of every read epoch: the sample count and the label histogram must equal the
source's. Results: a table, --json, and a chart (--plot, PNG).

The peers need packages imgpack does not: the script sets up its own virtual environment
(--venv, default bench-data/peers-venv) with them and imgpack, then runs itself there. PyPI's
torchvision does not import beside the CPU build of torch, and MosaicML streaming imports it only
for names its vision datasets use: the environment goes without torchvision and a stub module
stands in for that import.

    python scripts/bench_peers.py [--small 50000] [--jpeg 4000] [--tools imgpack,webdataset,...]
    python scripts/bench_peers.py --sets photos [--photos 4000]
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_PACKAGES = ["webdataset", "litdata", "mosaicml-streaming", "tfrecord", "matplotlib"]
TOOLS = ("imgpack", "webdataset", "litdata", "mosaic", "tfrecord")
BATCH = 256

_STUB = {
    "torchvision/__init__.py": '"""Stand-in for torchvision (see bench_peers.py)."""\n',
    "torchvision/datasets.py": "class VisionDataset:\n    pass\n\n\nclass CIFAR10(VisionDataset):\n"
    "    pass\n",
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": "def to_tensor(pic):\n"
    "    raise NotImplementedError('torchvision stub')\n",
}


# -- the environment ---------------------------------------------------------------------------
def ensure_venv(venv: Path) -> Path:
    """The peers' virtual environment (created or reused) and the stub folder to import from."""
    python = venv / "bin" / "python"
    stamp = venv / ".peers-installed"
    want = " ".join(PEER_PACKAGES) + "\n" + (ROOT / "setup.cfg").read_text()
    want += (ROOT / "constraints.txt").read_text()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not stamp.exists() or stamp.read_text() != want:
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        constraints = ["-c", str(ROOT / "constraints.txt")]
        subprocess.run([*pip, *constraints, "-e", f"{ROOT}[plot]", *PEER_PACKAGES], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision"], check=False
        )
        stamp.write_text(want)
    stub = venv / "torchvision-stub"
    for name, text in _STUB.items():
        (stub / name).parent.mkdir(parents=True, exist_ok=True)
        (stub / name).write_text(text)
    return stub


# -- what every tool is measured on ------------------------------------------------------------
@dataclass
class Row:
    tool: str
    dataset: str
    stored: str
    convert_s: float
    convert_rate: float
    output_mib: float
    read_w0: float
    read_w2: float
    first_batch_w0_s: float
    first_batch_w2_s: float
    validates: bool
    read_w1: float = 0.0


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def decode_pil(data: bytes) -> Any:
    """What the peers' documentation does: Pillow, RGB, a uint8 CHW tensor."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        pixels = np.asarray(img.convert("RGB"))
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1)


def decode_sj_fit(data: bytes) -> Any:
    """simplejpeg at the DCT scale for 224x224, then the crop resize: a uint8 CHW tensor."""
    import torch
    from benchlib import decode_fit

    return torch.from_numpy(decode_fit(bytes(data))).permute(2, 0, 1)


def decode_sj_full(data: bytes) -> Any:
    """A full-size simplejpeg decode: a uint8 CHW tensor."""
    import torch
    from benchlib import decode_full

    return torch.from_numpy(decode_full(bytes(data))).permute(2, 0, 1)


#: The per-sample mode read through imgpack's collate (imgpack only).
IMGPACK_COLLATE = "per sample + imgpack collate"
#: How a peer decodes an image of a set (and of a photos mode).
DECODERS: dict[str, Callable[[bytes], Any]] = {
    "pillow": decode_pil,
    "fit": decode_sj_fit,
    "per sample": decode_sj_full,
    IMGPACK_COLLATE: decode_sj_full,
}


def list_collate(batch: list[tuple[Any, Any]]) -> tuple[list[Any], Any]:
    """Images as a list (sizes differ), labels stacked."""
    import torch

    return [image for image, _ in batch], torch.tensor([int(label) for _, label in batch])


def read_epoch(
    make_loader: Callable[[], Iterable[Any]], expected: collections.Counter[int]
) -> tuple[float, float]:
    """One epoch through a loader: ``(samples/s after the first batch, first-batch latency)``;
    the samples and the label histogram must be the source's."""
    start = time.perf_counter()
    iterator: Iterator[Any] = iter(make_loader())
    images, labels = next(iterator)
    latency = time.perf_counter() - start
    seen = collections.Counter(int(v) for v in labels)
    timed, clock = 0, time.perf_counter()
    for images, labels in iterator:
        seen.update(int(v) for v in labels)
        timed += len(images)
    seconds = time.perf_counter() - clock
    if seen != expected:
        missing = sum((expected - seen).values())
        extra = sum((seen - expected).values())
        raise SystemExit(
            f"label histogram differs from the source: {missing} missing, {extra} extra"
        )
    return (timed / seconds if seconds > 0 else float("inf")), latency


# -- the tools ---------------------------------------------------------------------------------
def imgpack_tool(
    src: Path, out: Path, raw: int | None, mode: str = "pillow"
) -> tuple[float, Callable[[int], Any]]:
    from benchlib import FIT, PerSample
    from torch.utils.data import DataLoader

    from imgpack import convert, open_dataset
    from imgpack.readers import collate

    options: dict[str, Any] = {"encoding": "raw", "size": raw} if raw else {}
    start = time.perf_counter()  # in this process, as the peers: full validation, all CPUs
    convert(src, out, "pt", progress=False, overwrite=True, **options)
    seconds = time.perf_counter() - start
    ds: Any = open_dataset(out, size=FIT) if mode == "fit" else open_dataset(out)
    collate_fn: Any = collate
    if mode.startswith("per sample"):  # ds[i]; the list collate, or imgpack's
        ds, collate_fn = PerSample(ds), list_collate if mode == "per sample" else collate

    def loader(workers: int) -> Any:
        return DataLoader(
            ds, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate_fn
        )

    return seconds, loader


def webdataset_tool(
    samples: list[tuple[Path, int]], out: Path, ext: str, mode: str = "pillow"
) -> tuple[float, Callable[[int], Any]]:
    import webdataset as wds

    out.mkdir(parents=True)
    per_shard = max(1, len(samples) // 16)
    start = time.perf_counter()
    with wds.ShardWriter(str(out / "shard-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(samples):
            sink.write({"__key__": f"{i:08d}", ext: path.read_bytes(), "cls": label})
    seconds = time.perf_counter() - start
    urls = sorted(str(p) for p in out.glob("shard-*.tar"))

    def loader(workers: int) -> Any:
        pipeline = (
            wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
            .shuffle(1000)
            .to_tuple(ext, "cls")
            .map_tuple(DECODERS[mode], int)
            .batched(BATCH, partial=True, **collation(mode))
        )
        return wds.WebLoader(pipeline, batch_size=None, num_workers=workers)

    return seconds, loader


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def _litdata_decode(mode: str, item: dict[str, Any]) -> tuple[Any, int]:
    return DECODERS[mode](item["image"]), int(item["label"])


def collation(mode: str) -> dict[str, Any]:
    """The collate keyword of a peer's loader: full-size images of different sizes go in
    lists; anything else as the tool collates by default."""
    return {"collation_fn": list_collate} if mode == "per sample" else {}


def litdata_tool(
    samples: list[tuple[Path, int]], out: Path, mode: str = "pillow"
) -> tuple[float, Callable[[int], Any]]:
    import litdata

    start = time.perf_counter()
    litdata.optimize(
        fn=_litdata_item,
        inputs=[(str(p), label) for p, label in samples],
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=len(os.sched_getaffinity(0)),
        verbose=False,
        start_method="fork",
    )
    seconds = time.perf_counter() - start

    def loader(workers: int) -> Any:
        decode = functools.partial(_litdata_decode, mode)
        ds = litdata.StreamingDataset(str(out), shuffle=True, transform=decode)
        return litdata.StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, **loader_collate(mode)
        )

    return seconds, loader


def loader_collate(mode: str) -> dict[str, Any]:
    """:func:`collation` for a torch ``DataLoader``."""
    return {"collate_fn": list_collate} if mode == "per sample" else {}


def mosaic_tool(
    samples: list[tuple[Path, int]], out: Path, mode: str = "pillow"
) -> tuple[float, Callable[[int], Any]]:
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    start = time.perf_counter()
    columns = {"image": "bytes", "label": "int"}
    with MDSWriter(out=str(out), columns=columns, size_limit="64mb", progress_bar=False) as sink:
        for path, label in samples:
            sink.write({"image": path.read_bytes(), "label": label})
    seconds = time.perf_counter() - start

    class Decoded(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: int) -> tuple[Any, int]:
            item = super().__getitem__(index)
            return DECODERS[mode](item["image"]), int(item["label"])

    def loader(workers: int) -> Any:
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        ds = Decoded(local=str(out), shuffle=True, batch_size=BATCH)
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, **loader_collate(mode))

    return seconds, loader


def _tfrecord_decode(mode: str, record: dict[str, Any]) -> tuple[Any, int]:
    return DECODERS[mode](bytes(record["image"])), int(record["label"][0])


def tfrecord_tool(
    samples: list[tuple[Path, int]], out: Path, mode: str = "pillow"
) -> tuple[float, Callable[[int], Any]]:
    import tfrecord
    from tfrecord.tools.tfrecord2idx import create_index
    from tfrecord.torch.dataset import TFRecordDataset
    from torch.utils.data import DataLoader

    out.mkdir(parents=True)
    path, index = out / "data.tfrecord", out / "data.idx"
    start = time.perf_counter()
    writer = tfrecord.TFRecordWriter(str(path))
    for image, label in samples:
        writer.write({"image": (image.read_bytes(), "byte"), "label": (label, "int")})
    writer.close()
    create_index(str(path), str(index))
    seconds = time.perf_counter() - start

    def loader(workers: int) -> Any:
        ds = TFRecordDataset(
            str(path),
            str(index),
            {"image": "byte", "label": "int"},
            shuffle_queue_size=1024,
            transform=functools.partial(_tfrecord_decode, mode),
        )
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, **loader_collate(mode))

    return seconds, loader


# -- the run -----------------------------------------------------------------------------------
def measure_tool(
    tool: str,
    dataset: str,
    src: Path,
    out_root: Path,
    raw: int | None,
    mode: str = "pillow",
    workers: Sequence[int] = (0, 2),
) -> Row:
    from imgpack.sources.folder.scan import scan_folder

    scan = scan_folder(src)
    samples = [(src / s.path, s.label) for s in scan.samples]
    expected = collections.Counter(label for _, label in samples)
    out = out_root / f"{tool}{'-raw' if raw else ''}-{dataset}"
    shutil.rmtree(out, ignore_errors=True)
    ext = "png" if dataset == "small" else "jpg"
    if tool == "imgpack":
        seconds, loader = imgpack_tool(src, out, raw, mode)
    elif tool == "webdataset":
        seconds, loader = webdataset_tool(samples, out, ext, mode)
    elif tool == "litdata":
        seconds, loader = litdata_tool(samples, out, mode)
    elif tool == "mosaic":
        seconds, loader = mosaic_tool(samples, out, mode)
    else:
        seconds, loader = tfrecord_tool(samples, out, mode)
    reads = {w: read_epoch(lambda w=w: loader(w), expected) for w in workers}
    stored = f"raw {raw}x{raw}" if raw else f"{ext} bytes"
    if mode != "pillow":
        stored += f", {mode}"
    print(f"  {tool:<10} {dataset:<6} {stored:<12} done", flush=True)
    return Row(
        tool=tool,
        dataset=dataset,
        stored=stored,
        convert_s=seconds,
        convert_rate=len(samples) / seconds,
        output_mib=folder_bytes(out) / 2**20,
        read_w0=reads[0][0],
        read_w2=reads[2][0],
        first_batch_w0_s=reads[0][1],
        first_batch_w2_s=reads[2][1],
        validates=tool == "imgpack",
        read_w1=reads[1][0] if 1 in reads else 0.0,
    )


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    sets = list(dict.fromkeys(r.dataset for r in rows))
    figure, axes = plt.subplots(1, len(sets) + 1, figsize=(5.2 * (len(sets) + 1), 4.2))
    for ax, dataset in zip(axes, sets, strict=False):
        mine = [r for r in rows if r.dataset == dataset]
        names = [f"{r.tool}\n{r.stored}" for r in mine]
        ys = range(len(mine))
        for k, (field, label) in enumerate((("read_w0", "workers=0"), ("read_w2", "workers=2"))):
            values = [getattr(r, field) for r in mine]
            bars = ax.barh([y + 0.4 * k for y in ys], values, height=0.4, label=label)
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2, fontsize=7)
        ax.set_yticks([y + 0.2 for y in ys], names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: minor labels overlap
        ax.set_title(f"reads, {dataset} set (samples/s, log)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.margins(x=0.25)
    ax = axes[-1]
    names = [f"{r.tool} {r.dataset}\n{r.stored}" for r in rows]
    values = [r.convert_rate for r in rows]
    bars = ax.barh(range(len(rows)), values, color="tab:green")
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2, fontsize=7)
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_title("conversion (images/s; only imgpack validates)", fontsize=9)
    ax.margins(x=0.25)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def inside(args: argparse.Namespace) -> None:
    import warnings

    # the tfrecord package warns for every worker whose part is shorter than its shuffle queue
    warnings.filterwarnings("ignore", message="Number of elements in the iterator is less")
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib import machine, make_jpeg_folder, make_png_folder

    data = Path(args.data).resolve()
    wanted = [name for name in args.sets.split(",") if name]
    sets = {}
    if "small" in wanted:
        sets["small"] = (make_png_folder(data / f"png32-{args.small}", args.small, 32, 10), 32)
    if "jpeg" in wanted:
        sets["jpeg"] = (make_jpeg_folder(data / f"jpeg500-{args.jpeg}", args.jpeg), None)
    out_root = data / "peers"
    out_root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    rows: list[Row] = []
    tools = [t for t in args.tools.split(",") if t]
    for dataset, (src, raw_size) in sets.items():
        for tool in tools:
            if tool == "imgpack" and raw_size:
                rows.append(measure_tool(tool, dataset, src, out_root, raw_size))
            rows.append(measure_tool(tool, dataset, src, out_root, None))
    photos: dict[str, Any] = {}
    if "photos" in wanted:
        photos = measure_photos(data, out_root, tools, args.photos)
    if rows:
        print_rows(rows)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": machine(), "rows": [asdict(r) for r in rows], "photos": photos},
                indent=1,
            )
            + "\n"
        )
    if args.plot and rows:
        plot(rows, Path(args.plot))
        print(f"chart: {args.plot}")


def measure_photos(data: Path, out_root: Path, tools: list[str], count: int) -> dict[str, Any]:
    """The photos set: every tool decoding with simplejpeg, fitted batches and per-sample
    reads at num_workers 0, 1 and 2, each against its limit measured in this run."""
    from benchlib import decode_limit, make_photo_folder

    src = make_photo_folder(data / f"photos-{count}", count)
    payloads = [path.read_bytes() for path in sorted(src.rglob("*.jpg"))]
    cores = len(os.sched_getaffinity(0))
    limits = {
        "fit": decode_limit("decode+fit", payloads, cores, 2),
        "per sample": decode_limit("decode", payloads, cores, 2),
    }
    rows = [
        measure_tool(tool, "photos", src, out_root, None, mode, (0, 1, 2))
        for mode in limits
        for tool in tools
    ]
    if "imgpack" in tools:  # ds[i] with imgpack's collate: the batch handed over in one buffer
        rows.append(
            measure_tool("imgpack", "photos", src, out_root, None, IMGPACK_COLLATE, (0, 1, 2))
        )
    limits[IMGPACK_COLLATE] = limits["per sample"]
    print(
        f"\n{count} variable-size photos, every tool decoding with simplejpeg; limits: "
        f"cores x (decode + fit to 224) {limits['fit']:,.0f}/s, cores x full decode "
        f"{limits['per sample']:,.0f}/s ({cores} processes, bytes in RAM)"
    )
    print("\n| tool | reads | w=0 | of limit | w=1 | of limit | w=2 | of limit |")
    print("|" + " --- |" * 2 + " ---: |" * 6)
    for r in rows:
        mode = r.stored.split(", ", 1)[1]
        limit = limits[mode]
        cells = " | ".join(
            f"{rate:,.0f} | {rate / limit:.2f}" for rate in (r.read_w0, r.read_w1, r.read_w2)
        )
        print(f"| {r.tool} | {mode} | {cells} |")
    print("\nevery read epoch: sample count and label histogram equal to the source's")
    return {"limits": limits, "rows": [asdict(r) for r in rows]}


def print_rows(rows: list[Row]) -> None:
    header = (
        "| tool | set | stored | convert | images/s | output MiB | read w=0 | read w=2 "
        "| 1st batch w=0 | 1st batch w=2 |"
    )
    print("\n" + header + "\n|" + " --- |" * 10)
    for r in rows:
        note = "" if r.validates else " (no validation)"
        print(
            f"| {r.tool} | {r.dataset} | {r.stored} | {r.convert_s:.1f} s{note} | "
            f"{r.convert_rate:,.0f} | {r.output_mib:,.1f} | {r.read_w0:,.0f} | {r.read_w2:,.0f} "
            f"| {r.first_batch_w0_s:.2f} s | {r.first_batch_w2_s:.2f} s |"
        )
    print("\nevery read epoch: sample count and label histogram equal to the source's")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=50_000, help="32x32 PNGs")
    parser.add_argument("--jpeg", type=int, default=4_000, help="500x375 JPEGs")
    parser.add_argument("--photos", type=int, default=4_000, help="variable-size JPEGs")
    parser.add_argument("--sets", default="small,jpeg", help="of small,jpeg,photos")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--venv", default=None, help="default: DATA/peers-venv")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="save the chart here (PNG)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    venv = Path(args.venv or Path(args.data) / "peers-venv").resolve()
    stub = ensure_venv(venv)
    env = {**os.environ, "PYTHONPATH": str(stub)}
    cmd = [str(venv / "bin" / "python"), str(Path(__file__).resolve()), *sys.argv[1:], "--inside"]
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
