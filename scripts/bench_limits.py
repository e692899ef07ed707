"""Validated conversion and JPEG reads against the physical limit of their work, side by side.

One image set, generated and seeded under --data (reused between runs): --count photo-like
JPEGs of ImageNet's usual sizes (sides of 333 to 500 pixels, most 500x375 or 375x500; about
500x400 on average), quality 90, in 10 classes, converted with `encoding="original"` (the bytes
kept, every file validated) to every format.

The limits, with the files' bytes in RAM, in `cores` processes at once (each decoding its
share; start-up not counted), each measured again right before the figure it is for, so that
it is what this machine's cores deliver in that minute:
  validate     simplejpeg decode at 1/8 DCT scale: the least a converter that validates every
               kept JPEG must do (every entropy-coded byte is decoded)
  validate+hash  the same, plus the checksums every stored byte gets from imgpack (CRC-32C and
               sha256 of the bytes): the least imgpack's converter does per file, were its
               writing spread over the cores as the decoding is
  decode       simplejpeg full decode (accurate DCT, fancy upsampling: imgpack's settings)
  decode+write the same, each process also writing the files' bytes to a new file of its own
               in --data (4 MB writes, closed in the time): the least a conversion with
               statistics on does, its output reaching the page cache at this machine's speed
  decode+fit   simplejpeg decode at the DCT scale Pillow's draft picks for 224x224, then
               imgpack.images.resize_pixels to 224x224 (crop, bilinear): the least any loader
               producing those pixels must do
  one core     the decode above in one process: the limit of a per-sample read (`ds[i]`)

The figures, each against its limit:
  convert      imgpack.convert(src, out, format=F, encoding="original", workers=cores)
               (vs validate, vs validate+hash, vs decode: with statistics on, the default,
               every kept JPEG is decoded in full; and vs decode+write), with the CPU time of the writing process
               and of its pool beside the CPU time of the decodes alone
  fit batches  open_dataset(out, size=224) + collate, DataLoader(batch_size=--batch,
               shuffle=True), num_workers 0, 1, 2  (vs decode+fit)
  full batches open_dataset(out) + collate: variable-size images, a list of tensors per batch,
               num_workers 0, 1, 2  (vs decode)
  per sample   ds[i] in shuffled order, decode_threads=1, in this process  (vs one core)
  samples      ds[i] through DataLoader(batch_size=--batch, collate_fn=imgpack's collate),
               num_workers 0, 1, 2: a list of full-size images per batch  (vs one core at 0 and
               1 workers, where one process decodes; vs decode, `cores` processes, from 2)

Every figure is measured in --repeats rounds, each round its limit (one pass) and then the figure
(one conversion or epoch): a ratio is the figure over its own round's limit, reported as the
median over the rounds (with their spread), beside the best figure. A read's clock starts at the
first batch (worker start-up not counted); every epoch's sample count is checked.

    python scripts/bench_limits.py [--count 4000] [--formats pt,lmdb] [--only convert,fit]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
from benchlib import (
    FIT,
    PerSample,
    decode_limit,
    machine,
    make_photo_folder,
    print_table,
    save_json,
)

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.loading.bench import measure
from imgpack.system import usable_cpus

PARTS = ("convert", "fit", "full", "sample", "samples")


# -- the figures: one round each ----------------------------------------------------------------
#: CPU seconds of each conversion by format: (this process, its pool's processes, wall).
CONVERT_CPU: dict[str, list[tuple[float, float, float]]] = {}


def convert_once(
    src: Path,
    out: Path,
    fmt: str,
    cores: int,
    _seed: int,
    shard_size: str | None = None,
) -> float:
    """Images/s of a validated conversion (encoding="original"; a sharded format by shard
    tasks); its CPU time is kept in :data:`CONVERT_CPU` under the format (the pool's processes
    are reaped when it ends, so they count)."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    sizes = {"shard_size": shard_size} if shard_size else {}
    manifest = convert(
        src, out, format=fmt, encoding="original", workers=cores, progress=False, **sizes
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    main, pool = (
        a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
        for a, b in zip(after, before, strict=True)
    )
    CONVERT_CPU.setdefault(fmt, []).append((main, pool, seconds))
    return manifest.num_samples / seconds


def read_once(ds: Any, workers: int, batch: int, seed: int) -> float:
    """Images/s of one shuffled epoch (every sample counted)."""
    count, seconds = measure(ds, workers, batch, seed=seed)
    assert count >= len(ds), (count, len(ds))
    return count / seconds


def per_sample_once(ds: Any, seed: int) -> float:
    """Images/s of ``ds[i]`` over every sample in a shuffled order."""
    order = np.random.default_rng(seed).permutation(len(ds)).tolist()
    start = time.perf_counter()
    for i in order:
        ds[i]
    return len(order) / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--data", type=Path, default=Path("bench-data"))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--only", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
    parser.add_argument("--workers", default="0,1,2", help="DataLoader num_workers to read with")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shard-size", default=None, help="the conversions' shard size")
    parser.add_argument("--json", help="also save the figures here")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    parts = set(args.only.split(","))
    workers = [int(w) for w in args.workers.split(",")]
    cores = usable_cpus()
    print(machine())
    src = make_photo_folder(args.data / f"photos-{args.count}", args.count)
    files = sorted(src.rglob("*.jpg"))
    payloads = [p.read_bytes() for p in files]
    mean = np.mean([simplejpeg.decode_jpeg_header(d)[:2] for d in payloads], axis=0)
    print(f"{len(files)} JPEGs, mean {mean[0]:.0f}x{mean[1]:.0f}, {cores} usable cores")

    def limit(name: str) -> float:
        """The limit ``name``, measured now (one pass)."""
        if name == "one core":
            return decode_limit("decode", payloads, 1, 1)
        return decode_limit(name, payloads, cores, 1, write_dir=args.data)

    def paired(key: str, name: str, once: Callable[[int], float], also: Sequence[str] = ()) -> None:
        """``--repeats`` rounds of the limit ``name`` (and those in ``also``) measured, then the
        figure: each ratio is the figure over the limit of its own round (this machine's speed
        drifts over the minutes a run takes, by as much as the differences measured); reported
        as the median ratio, with the best figure."""
        rates: list[float] = []
        ratios: dict[str, list[float]] = {limit_name: [] for limit_name in (name, *also)}
        for seed in range(args.repeats):
            near = {limit_name: limit(limit_name) for limit_name in ratios}
            rates.append(once(seed))
            for limit_name, value in near.items():
                ratios[limit_name].append(rates[-1] / value)
                seen.setdefault(limit_name, []).append(value)
        found[key] = {
            "rate": max(rates),
            "ratio": float(np.median(ratios[name])),
            "ratios": ratios[name],
            **{f"ratio of {n}": float(np.median(ratios[n])) for n in also},
        }
        shares = "; ".join(
            f"{np.median(r):.2f} of {limit_name} ({min(r):.2f}-{max(r):.2f})"
            for limit_name, r in ratios.items()
        )
        rows.append((f"{fmt}: {key}", f"{max(rates):,.0f}/s  {shares}"))

    seen: dict[str, list[float]] = {}
    rows: list[tuple[str, str]] = []
    figures: dict[str, Any] = {"limits": seen, "formats": {}}
    for fmt in formats:
        out = args.data / f"limits-{fmt}-{args.count}"
        found: dict[str, Any] = {}
        first = len(rows)
        if "convert" in parts or not (out / "imgpack.json").exists():
            size = args.shard_size
            converting = partial(convert_once, src, out, fmt, cores, shard_size=size)
            # With statistics on (the default) each kept JPEG is decoded in full: the full
            # decode is that conversion's limit; the 1/8-scale validation, with --no-stats.
            also = ["validate+hash", "decode", "decode+write"]
            paired("convert", "validate", converting, also=also)
            if fmt in ("pt", "tfrecord", "webdataset"):
                shards = len(open_dataset(out).manifest.files)
                rows.append((f"{fmt}: shard tasks wrote", f"{shards} shard(s)"))
            # Where the CPU goes, against the decodes alone (cores x count / the limit's rate).
            main, pool, wall = np.median(np.array(CONVERT_CPU[fmt]), axis=0)
            alone = cores * len(payloads) / float(np.median(seen["validate"][-args.repeats :]))
            found["convert"]["cpu"] = {"main": main, "pool": pool, "wall": wall, "decode": alone}
            rows.append(
                (
                    f"{fmt}: convert CPU",
                    f"{main:.2f} s writing process + {pool:.2f} s pool for {alone:.2f} s of "
                    f"decodes ({alone / (main + pool):.2f} of the CPU spent: the most this "
                    f"conversion could reach at perfect overlap); {wall:.2f} s x {cores} cores "
                    f"= {wall * cores:.2f} CPU-s (medians)",
                )
            )
        if "fit" in parts:
            ds = open_dataset(out, size=FIT)
            for w in workers:
                paired(f"fit w={w}", "decode+fit", partial(read_once, ds, w, args.batch))
        if "full" in parts:
            ds = open_dataset(out)
            for w in workers:
                paired(f"full w={w}", "decode", partial(read_once, ds, w, args.batch))
        if "sample" in parts:
            ds = open_dataset(out, decode_threads=1)
            paired("per sample", "one core", partial(per_sample_once, ds))
        if "samples" in parts:  # ds[i] through DataLoader, batched by imgpack's collate
            each = PerSample(open_dataset(out))
            for w in workers:
                # An image decodes on one core: one process decodes at 0 and 1 workers (the
                # main one or the worker), `cores` at once from 2 on.
                paired(
                    f"samples w={w}",
                    "one core" if w < 2 else "decode",
                    partial(read_once, each, w, args.batch),
                )
        figures["formats"][fmt] = found
        print_table("so far", rows[first:])
    for name, values in seen.items():
        rows.append((f"limit: {name}", f"{min(values):,.0f}-{max(values):,.0f}/s as measured"))
    print_table(f"{args.count} variable-size JPEGs, against the limits", rows)
    save_json(args.json, figures)


if __name__ == "__main__":
    main()
