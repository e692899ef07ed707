"""What integrity costs, per format, in one run on the same images.

- Record checksums on reads: DataLoader(batch_size=256, shuffle=True, collate_fn=collate,
  num_workers=0) over raw 32x32 images and over original-bytes JPEGs, verify=False against
  verify=True, measured in turn (best of --repeats). Raw outputs also by default (verify=None:
  each record checked the first time the reader reads it): the first epoch of a fresh reader,
  and its second, against verify=False.
- imgpack verify (the quick check) against a plain `cat` of the same files, both from the page
  cache, in MB/s.
- Resuming: an `imgpack convert` of the JPEG folder (a subprocess; sharded formats with
  --resume-shard-size shards, so that there are checkpoints to keep) killed with SIGKILL at
  25/50/75% of its work (the time from its temp folder's creation, after start-up and the scan,
  to its end when uninterrupted); the share of the samples its checkpoint had kept, and the
  resumed run's wall time (start-up included) against the uninterrupted run's work time.

    python scripts/bench_integrity.py [--formats pt,lmdb] [--raw-count 20000] [--jpeg-count 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchlib import best_of, machine, make_jpeg_folder, make_png_folder, print_table, save_json
from torch.utils.data import DataLoader

from imgpack import convert, formats, open_dataset, verify
from imgpack.converters import FORMATS
from imgpack.pipeline import CHECKPOINT, leftovers
from imgpack.readers import collate


def read_rate(path: Path, verify_records: bool, samples: int) -> tuple[int, float]:
    ds = open_dataset(path, verify=verify_records)
    loader = DataLoader(ds, batch_size=256, shuffle=True, collate_fn=collate)
    start, seen = time.perf_counter(), 0
    for images, _ in loader:
        seen += len(images)
        if seen >= samples:
            break
    return seen, time.perf_counter() - start


def two_epochs(path: Path, verify_records: bool | None) -> tuple[float, float]:
    """Samples/s of a fresh reader's first and second epochs (with the default, ``None``: every
    record checked in the first, only the bitmap of checked records consulted in the second)."""
    ds = open_dataset(path, verify=verify_records)
    rates = []
    for _ in range(2):
        loader = DataLoader(ds, batch_size=256, shuffle=True, collate_fn=collate)
        start, seen = time.perf_counter(), 0
        for images, _ in loader:
            seen += len(images)
        rates.append(seen / (time.perf_counter() - start))
    return rates[0], rates[1]


def cat_rate(out: Path) -> float:
    files = [str(p) for p in out.iterdir() if p.is_file()]
    size = sum(os.path.getsize(f) for f in files)
    start = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return size / (time.perf_counter() - start) / 1e6


def verify_rate(out: Path) -> float:
    start = time.perf_counter()
    report = verify(out)
    assert report.ok, [p.line() for p in report.problems]
    return report.bytes / (time.perf_counter() - start) / 1e6


def convert_command(src: Path, out: Path, fmt: str, shard_size: str) -> list[str]:
    command = [sys.executable, "-m", "imgpack.cli", "convert", str(src), str(out), "-q"]
    command += ["--format", fmt, "--encoding", "original"]
    if formats.get(fmt).sharded:
        command += ["--shard-size", shard_size]
    return command


def _started(process: subprocess.Popen[bytes], out: Path) -> float:
    """Wait until ``process`` has created its temp folder (start-up and scan done)."""
    start = time.perf_counter()
    while not leftovers(out) and process.poll() is None:
        time.sleep(0.002)
    return time.perf_counter() - start


def uninterrupted(command: list[str], out: Path) -> float:
    """Seconds the conversion works, from its temp folder's creation to its end."""
    shutil.rmtree(out, ignore_errors=True)
    process = subprocess.Popen(command)
    _started(process, out)
    start = time.perf_counter()
    process.wait()
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds


def killed_then_resumed(
    command: list[str], out: Path, after: float, total: int
) -> tuple[float, float]:
    """Kill a conversion ``after`` seconds into its work (after start-up and the scan); return
    (the share of samples its checkpoint kept, the resumed run's seconds)."""
    process = subprocess.Popen(command, start_new_session=True)
    _started(process, out)
    time.sleep(after)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    if out.exists():  # it finished before the kill: nothing to resume
        shutil.rmtree(out)
        return 1.0, 0.0
    kept = 0
    for left in leftovers(out):
        try:  # killed before its first checkpoint was written: nothing kept
            kept = json.loads((left / CHECKPOINT).read_text())["position"]
        except FileNotFoundError:
            kept = 0
    start = time.perf_counter()
    subprocess.run([*command, "--resume"], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return kept / total, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--raw-count", type=int, default=20_000)
    parser.add_argument("--jpeg-count", type=int, default=4_000)
    parser.add_argument("--jpeg-reads", type=int, default=2_000)
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume-shard-size", default="8MB")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--reads-only", action="store_true", help="measure raw reads only (no verify, resume)"
    )
    args = parser.parse_args()
    names = args.formats.split(",")
    data = Path(args.data)
    print(machine())
    png = make_png_folder(data / f"png32-{args.raw_count}", args.raw_count, 32, 10)
    jpg = make_jpeg_folder(data / f"jpeg500-{args.jpeg_count}", args.jpeg_count)
    results: dict[str, dict[str, float]] = {}
    for fmt in names:
        r = results[fmt] = {}
        raw, enc = data / f"integrity-{fmt}-raw", data / f"integrity-{fmt}-jpeg"
        for out in (raw, enc):
            shutil.rmtree(out, ignore_errors=True)
        convert(png, raw, fmt, encoding="raw", size=32, progress=False)
        if args.reads_only:  # in turn, so that the machine's noise falls on both
            rates: dict[str, list[tuple[float, float]]] = {"off": [], "default": [], "on": []}
            for _ in range(args.repeats):
                rates["off"].append(two_epochs(raw, False))
                rates["default"].append(two_epochs(raw, None))
                rates["on"].append(two_epochs(raw, True))
            for mode, pairs in rates.items():
                r[f"{mode}_epoch1"] = max(p[0] for p in pairs)
                r[f"{mode}_epoch2"] = max(p[1] for p in pairs)
            rows = [
                (
                    f"raw reads, epoch {n}: default / verify=False",
                    f"{r[f'default_epoch{n}']:,.0f} / {r[f'off_epoch{n}']:,.0f} samples/s = "
                    f"{r[f'default_epoch{n}'] / r[f'off_epoch{n}']:.2f}x",
                )
                for n in (1, 2)
            ]
            rows.append((
                "raw reads, epoch 2: verify=True / verify=False",
                f"{r['on_epoch2']:,.0f} / {r['off_epoch2']:,.0f} samples/s = "
                f"{r['on_epoch2'] / r['off_epoch2']:.2f}x",
            ))  # fmt: skip
            print_table(fmt, rows)
            continue
        start = time.perf_counter()
        convert(jpg, enc, fmt, encoding="original", progress=False)
        r["convert_s"] = time.perf_counter() - start
        for name, out, count in (("raw", raw, args.raw_count), ("jpeg", enc, args.jpeg_reads)):
            off = best_of(args.repeats, lambda out=out, count=count: read_rate(out, False, count))
            on = best_of(args.repeats, lambda out=out, count=count: read_rate(out, True, count))
            r[f"{name}_reads"], r[f"{name}_reads_verified"] = off, on
            r[f"{name}_verify_ratio"] = on / off
        cat_rate(enc)  # warm the page cache for both
        r["cat_mb_s"] = max(cat_rate(enc) for _ in range(args.repeats))
        r["verify_mb_s"] = max(verify_rate(enc) for _ in range(args.repeats))
        out = data / f"integrity-{fmt}-killed"
        command = convert_command(jpg, out, fmt, args.resume_shard_size)
        whole = r["convert_wall_s"] = uninterrupted(command, out)
        for share in (0.25, 0.5, 0.75):
            kept, seconds = killed_then_resumed(command, out, share * whole, args.jpeg_count)
            r[f"kept_at_{int(share * 100)}"] = kept
            r[f"resume_time_at_{int(share * 100)}"] = seconds / whole
        rows = [
            (
                "raw reads, verify=False / True",
                f"{r['raw_reads']:,.0f} / {r['raw_reads_verified']:,.0f} samples/s = {r['raw_verify_ratio']:.2f}x",
            ),
            (
                "jpeg reads, verify=False / True",
                f"{r['jpeg_reads']:,.0f} / {r['jpeg_reads_verified']:,.0f} samples/s = {r['jpeg_verify_ratio']:.2f}x",
            ),
            (
                "imgpack verify / cat",
                f"{r['verify_mb_s']:,.0f} / {r['cat_mb_s']:,.0f} MB/s = {r['verify_mb_s'] / r['cat_mb_s']:.2f}x",
            ),
            (
                "killed at 25/50/75%: kept",
                " / ".join(f"{r[f'kept_at_{p}']:.0%}" for p in (25, 50, 75)),
            ),
            (
                "resume time / uninterrupted",
                " / ".join(f"{r[f'resume_time_at_{p}']:.2f}" for p in (25, 50, 75)),
            ),
        ]
        print_table(fmt, rows)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
