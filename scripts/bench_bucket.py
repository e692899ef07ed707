"""Bucket to bucket: what a conversion's driver holds and reads when SRC and DST are in a bucket
(moto's S3 server, started here on 127.0.0.1, on the same CPUs).

For each --counts N (small 32x32 PNGs in 10 class folders, uploaded once), one conversion
`imgpack convert s3://bench/src-N s3://bench/dst-N --format webdataset` in a process of its own
(the local pool, --workers 2), measured from outside and inside it:
  - listing: the time fs.find takes over SRC (what the scan waits for);
  - first encoded image: from the start of the conversion to the first outcome the writer
    receives (listing, scan and the first chunk);
  - the driver's peak RSS (VmHWM) and its growth per image between the two largest N;
  - the driver's peak local disk for SRC (scratch folders imgpack-src-*) and for DST (the
    build folder in the cache), sampled every 50 ms;
  - GET requests for SRC objects, counted in moto's request log: all of them, and those of
    part 0 of --num-parts 2 (its own objects only?);
  - the output's bytes, which still pass through the driver's single writer (every format).

    python scripts/bench_bucket.py [--counts 4000,16000] [--data bench-data]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
from bench_storage import bucket
from benchlib import machine, make_png_folder, print_table, save_json

#: Run in the conversion's own process: the time to the first outcome and the peak RSS.
DRIVER = """
import json, sys, time
import imgpack.pipeline as pipeline
from imgpack import convert
real, first = pipeline.write, []
def write(plan, directory, outcomes, resume=None):
    def timed():
        for outcome in outcomes:
            if not first:
                first.append(time.perf_counter())
            yield outcome
    return real(plan, directory, timed(), resume)
pipeline.write = write
src, dst, parts, part = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
manifest = convert(src, dst, "webdataset", workers=2, progress=False, num_parts=parts, part=part)
done = time.perf_counter()
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print("RESULT " + json.dumps({"first_s": first[0] - start, "total_s": done - start,
      "rss_kib": hwm, "samples": manifest.num_samples, "bytes": manifest.total_bytes}))
"""


def tree_bytes(paths: list[Path]) -> int:
    total = 0
    for root in paths:
        for folder, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
    return total


def run_driver(src: str, dst: str, cache: Path, parts: int = 1, part: int = 0) -> dict[str, Any]:
    """One conversion in a process of its own, its scratch and build folders sampled."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-tmp-"))
    env = {**os.environ, "TMPDIR": str(scratch), "IMGPACK_CACHE_DIR": str(cache)}
    peaks = {"src": 0, "dst": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peaks["src"] = max(peaks["src"], tree_bytes(list(scratch.glob("imgpack-src-*"))))
            peaks["dst"] = max(peaks["dst"], tree_bytes([cache / "builds"]))
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, src, dst, str(parts), str(part)],
            env=env,
            capture_output=True,
            text=True,
        )
    finally:
        done.set()
        watcher.join()
        shutil.rmtree(scratch, ignore_errors=True)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return {
        **json.loads(line[len("RESULT ") :]),
        "peak_src": peaks["src"],
        "peak_dst": peaks["dst"],
    }


def gets(log: Path, prefix: str, start: int) -> int:
    """GET requests for objects under ``prefix`` in moto's log from byte ``start`` on."""
    text = log.read_bytes()[start:].decode("utf-8", "replace")
    return len(re.findall(rf'"GET /bench/{re.escape(prefix)}/[^ ?]+ HTTP', text))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--counts", default="4000,16000")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    print(f"machine: {machine()}")
    results: dict[str, dict[str, float]] = {}
    with bucket(log):
        fs = fsspec.filesystem("s3")  # the server's address is set now
        for count in counts:
            folder = make_png_folder(Path(args.data) / f"png32-{count}", count, 32, 10)
            fs.put(str(folder), f"bench/src-{count}", recursive=True)
            fs.rm_file(f"bench/src-{count}/.complete")
            start = time.perf_counter()
            listed = len(fs.find(f"bench/src-{count}", refresh=True))
            listing_s = time.perf_counter() - start
            cache = Path(tempfile.mkdtemp(prefix="bench-cache-"))
            at = log.stat().st_size
            whole = run_driver(f"s3://bench/src-{count}", f"s3://bench/dst-{count}", cache)
            whole_gets = gets(log, f"src-{count}", at)
            at = log.stat().st_size
            half = run_driver(f"s3://bench/src-{count}", f"s3://bench/p0-{count}", cache, 2, 0)
            part_gets = gets(log, f"src-{count}", at)
            shutil.rmtree(cache, ignore_errors=True)
            row = {
                "images": float(listed),
                "listing_s": listing_s,
                "first_image_s": whole["first_s"],
                "total_s": whole["total_s"],
                "rss_kib": float(whole["rss_kib"]),
                "peak_src_scratch": float(whole["peak_src"]),
                "peak_dst_build": float(whole["peak_dst"]),
                "output_bytes": float(whole["bytes"]),
                "gets": float(whole_gets),
                "part0_samples": float(half["samples"]),
                "part0_gets": float(part_gets),
            }
            results[str(count)] = row
            print_table(
                f"{count} images, bucket -> bucket, webdataset, local pool (2 workers)",
                [
                    ("listing (fs.find)", f"{listing_s:.2f} s for {listed} objects"),
                    ("first encoded image", f"{whole['first_s']:.2f} s after the start"),
                    ("whole conversion", f"{whole['total_s']:.1f} s"),
                    ("driver peak RSS", f"{whole['rss_kib'] / 1024:.0f} MiB"),
                    ("driver scratch for SRC", f"{whole['peak_src'] / 2**20:.2f} MiB (peak)"),
                    (
                        "driver build folder for DST",
                        f"{whole['peak_dst'] / 2**20:.1f} MiB (peak; output "
                        f"{whole['bytes'] / 2**20:.1f} MiB)",
                    ),
                    ("GETs of SRC objects", f"{whole_gets} for {whole['samples']} samples"),
                    ("part 0 of 2: GETs", f"{part_gets} for its {half['samples']} samples"),
                ],
            )
        if len(counts) > 1:
            small, large = results[str(counts[0])], results[str(counts[-1])]
            slope = (large["rss_kib"] - small["rss_kib"]) * 1024 / (counts[-1] - counts[0])
            print(f"\ndriver RSS growth: {slope:.0f} B per image ({counts[0]} -> {counts[-1]})")
            results["rss_bytes_per_image"] = {"value": slope}
    save_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
