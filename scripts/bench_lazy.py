"""Reading an output from a bucket lazily, through a bounded cache (moto's S3 server, started
here on 127.0.0.1): the first (cold) epoch against a warm one.

For each output (raw 32x32 images in `pt`; photo-like 500x375 JPEGs in `webdataset` and in
`tfrecord`), measured
side by side in one run, best of --repeats rounds:
  - cold: open from the bucket with an empty cache and read one epoch with
    `ShardSampler(ds, seed=...)` (shards fetched when first read, the next `prefetch` fetched
    ahead in the background); and the same with `cache_limit` a quarter of the output, with
    the peak size of the cache's data files during that epoch;
  - warm: a second epoch from the same reader (every shard cached);
  - local: the same sampler over the local output (the read itself, no storage), and
    `shuffle=True` (torch's RandomSampler) over it: the sampler's cost or gain (both by
    readers past their first epoch, as the warm one is: a first epoch checks each raw
    record's checksum once);
  - local, first epoch: a new reader's first epoch of the local output (it opens every shard
    and checks each raw record's checksum once, as a first epoch from the bucket does);
  - download only: every shard fetched with one GET after the other (the store's rate, the
    physical limit of a first epoch that must bring every byte over). A first epoch from the
    bucket can be no faster than the lesser of this and the local first epoch.
Reads: DataLoader(batch_size=256, sampler=ShardSampler, collate_fn=collate), num_workers=0.
The CPU seconds this process and moto's server used (download only, the cold epoch, the warm
one) say what the first epoch costs beyond the read and the transfer on this machine, where the
store runs on the reader's CPUs.

    python scripts/bench_lazy.py [--data bench-data] [--repeats 2]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import torch
from bench_storage import arguments, bucket, fresh_output, output_sets
from benchlib import machine, print_table, save_json
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.loading import ShardSampler
from imgpack.readers import collate
from imgpack.storage.lazy import cached_files


def epoch_count(ds: Any, seed: int) -> int:
    """One epoch through a ShardSampler: the samples read."""
    loader = DataLoader(ds, batch_size=256, sampler=ShardSampler(ds, seed=seed), collate_fn=collate)
    return sum(len(labels) for _, labels in loader)


def epoch(ds: Any, seed: int) -> float:
    """Samples per second of one epoch through a ShardSampler."""
    start = time.perf_counter()
    count = epoch_count(ds, seed)
    return count / (time.perf_counter() - start)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shuffled_epoch(ds: Any, seed: int) -> float:
    """Samples per second of one epoch with ``shuffle=True`` (a full shuffle)."""
    loader = DataLoader(
        ds,
        batch_size=256,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=collate,
    )
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return count / (time.perf_counter() - start)


def main() -> None:
    args = arguments(__doc__ or "", repeats=2, shards=True)
    data = Path(args.data)
    sets = output_sets(args, "webdataset")
    src, _, options = sets["webdataset jpeg"]
    sets["tfrecord jpeg"] = (src, "tfrecord", options)  # the same photos, TFRecord framing
    print(f"machine: {machine()}")
    results: dict[str, dict[str, float]] = {}
    with bucket() as server:
        for name, (src, fmt, options) in sets.items():
            local = fresh_output(src, data / f"lazy-{fmt}", fmt, **options)
            total = sum(f.bytes for f in open_dataset(local).manifest.files)
            shard = max(1, total // args.shards)
            convert(src, local, fmt, progress=False, overwrite=True, shard_size=shard, **options)
            url = f"s3://bench/lazy-{fmt}"
            convert(src, url, fmt, progress=False, overwrite=True, shard_size=shard, **options)
            limit = total // 4
            fs = fsspec.filesystem("s3")
            keys = [f"bench/lazy-{fmt}/{f.path}" for f in open_dataset(local).manifest.files]
            scratch = Path(tempfile.mkdtemp(prefix="imgpack-bench-get-"))
            start, mine, its = time.perf_counter(), time.process_time(), cpu_s(server.pid)
            for key in keys:  # the store's own rate: every shard, one after the other
                fs.get_file(key, str(scratch / Path(key).name))
            download_s = time.perf_counter() - start
            cpu = {"download": (time.process_time() - mine, cpu_s(server.pid) - its)}
            shutil.rmtree(scratch, ignore_errors=True)
            cold, bounded, warm, plain, shuffled, peaks, first = [], [], [], [], [], [], []
            # The local output read by readers past their first epoch, as the warm bucket
            # epoch is (a first epoch also checks every raw record's checksum once).
            local_ds, shuffled_ds = open_dataset(local), open_dataset(local)
            epoch(local_ds, 0)
            shuffled_epoch(shuffled_ds, 0)
            for round_ in range(args.repeats):
                # A cache a quarter of the output, from empty: its peak size, and the epoch.
                cache = Path(tempfile.mkdtemp(prefix="imgpack-bench-lazy-"))
                peak, done = [0], threading.Event()

                def watch(cache: Path = cache, peak: list[int] = peak, done: Any = done) -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], sum(s for _, _, s in cached_files(cache)))
                        done.wait(0.01)

                watcher = threading.Thread(target=watch)
                watcher.start()
                start = time.perf_counter()
                ds = open_dataset(url, cache_dir=cache, cache_limit=limit)
                n = epoch_count(ds, round_)
                bounded.append(n / (time.perf_counter() - start))
                done.set()
                watcher.join()
                peaks.append(peak[0])
                ds.release_files()
                shutil.rmtree(cache, ignore_errors=True)
                # An unbounded cache: the first epoch from empty, then a warm one.
                cache = Path(tempfile.mkdtemp(prefix="imgpack-bench-lazy-"))
                start, mine, its = time.perf_counter(), time.process_time(), cpu_s(server.pid)
                ds = open_dataset(url, cache_dir=cache)
                cold.append(epoch_count(ds, round_) / (time.perf_counter() - start))
                cpu["cold"] = (time.process_time() - mine, cpu_s(server.pid) - its)
                mine = time.process_time()
                warm.append(epoch(ds, round_))
                cpu["warm"] = (time.process_time() - mine, 0.0)
                plain.append(epoch(local_ds, round_))
                start = time.perf_counter()  # a new reader's first epoch of the local output
                first.append(
                    epoch_count(open_dataset(local), round_) / (time.perf_counter() - start)
                )
                shuffled.append(shuffled_epoch(shuffled_ds, round_))
                ds.release_files()
                shutil.rmtree(cache, ignore_errors=True)
            row = {
                "samples": float(n),
                "output_bytes": float(total),
                "cache_limit": float(limit),
                "peak_cache_bytes": float(max(peaks)),
                "local": max(plain),
                "local_shuffle": max(shuffled),
                "local_first": max(first),
                "warm": max(warm),
                "cold": max(cold),
                "cold_quarter_cache": max(bounded),
                "download_only": n / download_s,
                **{f"cpu_s_{k}_reader": v[0] for k, v in cpu.items()},
                **{f"cpu_s_{k}_store": v[1] for k, v in cpu.items()},
            }
            results[name] = row
            print_table(
                f"{name} ({n} samples, {args.shards} shards, {total / 2**20:.1f} MiB)",
                [
                    (
                        "local output, ShardSampler",
                        f"{row['local']:>12,.0f} samples/s  "
                        f"{row['local'] / row['local_shuffle']:.2f}x shuffle=True",
                    ),
                    ("local output, shuffle=True", f"{row['local_shuffle']:>12,.0f} samples/s"),
                    (
                        "local output, a reader's first epoch",
                        f"{row['local_first']:>12,.0f} samples/s  "
                        f"{row['local_first'] / row['local']:.2f}x later epochs",
                    ),
                    (
                        "download only (GET every shard)",
                        f"{row['download_only']:>12,.0f} samples/s  "
                        f"({total / 2**20 / download_s:.0f} MiB/s)",
                    ),
                    (
                        "bucket, warm epoch",
                        f"{row['warm']:>12,.0f} samples/s  {row['warm'] / row['local']:.2f}x local",
                    ),
                    (
                        "bucket, first (cold) epoch",
                        f"{row['cold']:>12,.0f} samples/s  {row['cold'] / row['warm']:.2f}x warm, "
                        f"{row['cold'] / row['download_only']:.2f}x download only, "
                        f"{row['cold'] / min(row['download_only'], row['local_first']):.2f}x "
                        "the lesser of the two",
                    ),
                    (
                        "  with cache_limit = output / 4",
                        f"{row['cold_quarter_cache']:>12,.0f} samples/s  "
                        f"{row['cold_quarter_cache'] / row['warm']:.2f}x warm",
                    ),
                    (
                        "CPU seconds (reader / moto)",
                        "  ".join(f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in cpu.items()),
                    ),
                    (
                        "  peak cache / limit",
                        f"{row['peak_cache_bytes'] / 2**20:.1f} / {limit / 2**20:.1f} MiB "
                        f"(output {total / 2**20:.1f} MiB)",
                    ),
                ],
            )
    save_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
