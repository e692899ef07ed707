"""Every format side by side, in one run, on the same images.

Two datasets, generated and seeded under --data (reused between runs):
  raw: 50,000 32x32 PNGs (10 classes), stored raw (--size 32)
  jpeg: 4,000 photo-like 500x375 JPEGs (10 classes), stored as original bytes

Reported per format: raw reads through DataLoader(batch_size=256, shuffle=True,
collate_fn=imgpack.readers.collate) against the memory-bound limit (a bare in-RAM index_select
of the same batches); original-bytes reads against the ImageFolder-style Pillow loader at the
same num_workers; and converting the JPEG folder against cores x the bare single-core decode rate.

    python scripts/bench_formats.py [--formats pt,lmdb] [--raw-count 50000] [--jpeg-count 4000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from benchlib import (
    bare_decode_rate,
    best_of,
    index_select_limit,
    machine,
    make_jpeg_folder,
    make_png_folder,
    parallel_decode_rate,
    print_table,
    save_json,
)
from torch.utils.data._utils.collate import default_collate

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.formats.tfrecord import framing
from imgpack.loading.bench import FolderDataset, measure
from imgpack.readers import TFRecordStream, collate
from imgpack.sources.folder.scan import scan_folder
from imgpack.system import usable_cpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--raw-count", type=int, default=50_000)
    parser.add_argument("--jpeg-count", type=int, default=4_000)
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--workers", type=int, default=2, help="num_workers for the JPEG reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    data = Path(args.data)
    cores = usable_cpus()
    bs = 256
    results: dict[str, dict[str, float]] = {}

    png = make_png_folder(data / f"png32-{args.raw_count}", args.raw_count, 32, 10)
    jpg = make_jpeg_folder(data / f"jpeg500-{args.jpeg_count}", args.jpeg_count)
    jpeg_paths = [jpg / s.path for s in scan_folder(jpg).samples]

    raw_outputs, jpeg_outputs = {}, {}
    for fmt in formats:
        raw_outputs[fmt] = data / f"{fmt}-raw32-{args.raw_count}"
        shutil.rmtree(raw_outputs[fmt], ignore_errors=True)
        convert(png, raw_outputs[fmt], fmt, encoding="raw", size=32, progress=False)
        jpeg_outputs[fmt] = data / f"{fmt}-jpeg-{args.jpeg_count}"
        results[fmt] = {"convert_jpeg": 0.0, "decode": 0.0, "parallel_decode": 0.0}
    # The machine is noisy: each round measures the bare decode (one core, then every core) right
    # before each conversion; the best of the rounds is kept for each figure.
    for _ in range(args.repeats):
        for fmt in formats:
            r = results[fmt]
            r["decode"] = max(r["decode"], bare_decode_rate(jpeg_paths[:1000]))
            r["parallel_decode"] = max(
                r["parallel_decode"], parallel_decode_rate(jpeg_paths, cores)
            )
            shutil.rmtree(jpeg_outputs[fmt], ignore_errors=True)
            start = time.perf_counter()
            convert(jpg, jpeg_outputs[fmt], fmt, encoding="original", workers=cores, progress=False)
            r["convert_jpeg"] = max(
                r["convert_jpeg"], len(jpeg_paths) / (time.perf_counter() - start)
            )
    decode = max(r["decode"] for r in results.values())

    ref = open_dataset(raw_outputs[formats[0]])
    images = ref.__getitems__(range(len(ref))).images
    images = images.permute(0, 2, 3, 1).contiguous()  # HWC, as stored
    n = len(ref)
    limit = best_of(args.repeats, lambda: index_select_limit(images, bs, n))
    folder = FolderDataset(jpg)
    baseline = {w: 0.0 for w in (0, args.workers)}
    readers = {
        fmt: (open_dataset(raw_outputs[fmt]), open_dataset(jpeg_outputs[fmt])) for fmt in formats
    }
    for fmt, (raw, _) in readers.items():
        results[fmt]["raw_w0"] = best_of(
            args.repeats, lambda ds=raw: measure(ds, 0, bs, n, collate)
        )
    # Encoded reads: the baseline and every format in turn, at each num_workers, best of the rounds.
    for _ in range(args.repeats):
        for w in (0, args.workers):
            count, seconds = measure(folder, w, bs, len(folder), default_collate)
            baseline[w] = max(baseline[w], count / seconds)
            for fmt, (_, enc) in readers.items():
                count, seconds = measure(enc, w, bs, len(enc), collate)
                results[fmt][f"jpeg_w{w}"] = max(
                    results[fmt].get(f"jpeg_w{w}", 0.0), count / seconds
                )
    print(f"machine: {machine()}")
    print(
        f"raw: {n} images 32x32x3; jpeg: {len(jpeg_paths)} images 500x375; batch_size={bs}, shuffle=True"
    )
    print_table(
        "references",
        [
            ("in-RAM index_select limit (raw)", f"{limit:>12,.0f} samples/s"),
            *[
                (f"ImageFolder-style Pillow loader, workers={w}", f"{r:>12,.0f} samples/s")
                for w, r in baseline.items()
            ],
            ("bare single-core JPEG decode (best)", f"{decode:>12,.0f} images/s"),
        ],
    )
    for fmt in formats:
        r = results[fmt]
        rows = [
            (
                "raw reads, workers=0",
                f"{r['raw_w0']:>12,.0f} samples/s  {r['raw_w0'] / limit:6.1%} of the limit",
            )
        ]
        for w in (0, args.workers):
            rate = r[f"jpeg_w{w}"]
            rows.append(
                (
                    f"jpeg reads, workers={w}",
                    f"{rate:>12,.0f} samples/s  {rate / baseline[w]:6.2f}x the loader",
                )
            )
        conv, ideal, par = r["convert_jpeg"], cores * r["decode"], r["parallel_decode"]
        rows.append(
            (
                "convert jpeg (original)",
                f"{conv:>12,.0f} images/s  {conv / ideal:6.2f}x cores x decode",
            )
        )
        rows.append(("", f"{'':>21}{conv / par:6.2f}x a bare {cores}-process decode"))
        print_table(fmt, rows)
    if "tfrecord" in formats:
        out = jpeg_outputs["tfrecord"]
        mapped = readers["tfrecord"][1]
        streams = {
            "per sample": (TFRecordStream(out, shuffle_buffer=256), bs),
            "batched": (TFRecordStream(out, shuffle_buffer=256, batch_size=bs), None),
        }
        best: dict[str, float] = {}
        # The map-style reader and both stream modes in turn, best of the rounds.
        for _ in range(args.repeats):
            for w in (0, args.workers):
                count, seconds = measure(mapped, w, bs, len(mapped), collate)
                best[f"map w{w}"] = max(best.get(f"map w{w}", 0.0), count / seconds)
                for name, (stream, size) in streams.items():
                    # one epoch of samples (len() of a batched stream counts batches)
                    samples = stream.samples_per_rank()
                    count, seconds = measure(stream, w, size, samples, collate)
                    best[f"{name} w{w}"] = max(best.get(f"{name} w{w}", 0.0), count / seconds)
        rows = []
        for w in (0, args.workers):
            for name in streams:
                rate, ref = best[f"{name} w{w}"], best[f"map w{w}"]
                results["tfrecord"][f"stream_{name.replace(' ', '_')}_w{w}"] = rate
                rows.append(
                    (
                        f"TFRecordStream {name}, workers={w}",
                        f"{rate:>12,.0f} samples/s  {rate / ref:6.2f}x the map-style reader ({ref:,.0f})",
                    )
                )
        blob = os.urandom(64 << 20)
        start = time.perf_counter()
        for _ in range(8):
            framing.crc32c(blob)
        crc = 8 * len(blob) / (time.perf_counter() - start) / 2**30
        results["tfrecord"]["crc32c_gib_s"] = crc
        rows.append(("CRC-32C (google-crc32c)", f"{crc:>12.2f} GiB/s"))
        print_table("tfrecord stream and CRC", rows)
    if "hdf5" in formats:
        rows = []
        for compression in ("gzip", "lzf"):
            out = data / f"hdf5-raw32-{compression}-{args.raw_count}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            convert(
                png, out, "hdf5", encoding="raw", size=32, compression=compression, progress=False
            )
            seconds = time.perf_counter() - start
            ds = open_dataset(out)
            rate = best_of(1, lambda ds=ds: measure(ds, 0, bs, 20 * bs, collate))
            size = ds.manifest.total_bytes
            results[f"hdf5-{compression}"] = {"raw_w0": rate, "bytes": size, "convert_s": seconds}
            rows.append(
                (
                    f"raw, {compression}",
                    f"{size / 2**20:6.1f} MiB  {rate:>10,.0f} samples/s  convert {seconds:.1f} s",
                )
            )
        plain = open_dataset(raw_outputs["hdf5"])
        rows.insert(
            0,
            (
                "raw, none (contiguous, mmap)",
                f"{plain.manifest.total_bytes / 2**20:6.1f} MiB  {results['hdf5']['raw_w0']:>10,.0f} samples/s",
            ),
        )
        print_table("hdf5 compression (shuffled batches of 256, workers=0)", rows)
    save_json(
        args.json,
        {
            "machine": machine(),
            "limit": limit,
            "baseline": baseline,
            "decode": decode,
            "cores": cores,
            "formats": results,
        },
    )


if __name__ == "__main__":
    main()
