"""What planning a conversion costs the driver against the number of images: time and memory.

Before the first image is read, a conversion scans SRC (every file's name and size), cuts the
shard plan from the sizes and derives the output id; each part of a partitioned conversion does
the same. This measures that work alone, as `imgpack convert --dry-run` does it (the same scan,
plan and id, nothing read or written), over image folders of --counts files in 100 class
folders (16-byte files named like images: the scan lists and stats them, it reads none); with
--labels, a CSV label list of those files (`path,label`, the list as SRC): the scan reads the
list and stats each row's file.

Each count runs in a fresh process: the seconds of `dry_run(...)`, then the peak of the memory
it allocates (Python's and numpy's, by tracemalloc, in a second run: tracemalloc slows it). The
slopes (least squares over the counts) and a projection to 100M images close the table; a
bucket's listing adds its LIST round trips (1,000 objects each) on top.

    python scripts/bench_plan.py [--counts 10000,30000,100000,300000] [--data bench-data]
                                 [--labels]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from benchlib import machine, print_table, save_json

CLASSES = 100

#: Run in a fresh process: the plan of SRC, timed, then its peak allocations.
PLAN = """
import json, sys, time, tracemalloc
from imgpack.pipeline import dry_run
def plan():
    return dry_run(sys.argv[1], sys.argv[2], "webdataset", shard_size="256MB")
start = time.perf_counter()
planned = plan()
seconds = time.perf_counter() - start
tracemalloc.start()  # again, for the memory it holds at its peak (Python's and numpy's)
plan()
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"seconds": seconds, "kib": peak / 1024, "images": planned.images,
                  "shards": len(planned.shards)}))
"""


def make_folder(root: Path, count: int) -> Path:
    """``count`` 16-byte files named like JPEGs in ``CLASSES`` class folders (made once)."""
    done = root / ".complete"
    if done.exists():
        return root
    for k in range(CLASSES):
        (root / f"c{k:03d}").mkdir(parents=True, exist_ok=True)
    blob = b"\xff\xd8\xff" + bytes(13)
    for i in range(count):
        fd = os.open(root / f"c{i % CLASSES:03d}" / f"{i:09d}.jpg", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, blob)
        os.close(fd)
    done.touch()
    return root


def make_list(root: Path) -> Path:
    """A label list of the folder ``root`` (:func:`make_folder`): every file, by class, with
    its class folder's name as its label (made once)."""
    listing = root / "list.csv"
    if not listing.exists():
        with open(listing.with_suffix(".part"), "w") as out:
            out.write("path,label\n")
            for folder in sorted(p for p in root.iterdir() if p.is_dir()):
                for name in sorted(os.listdir(folder)):
                    out.write(f"{folder.name}/{name},{folder.name}\n")
        listing.with_suffix(".part").rename(listing)
    return listing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="10000,30000,100000,300000")
    parser.add_argument("--data", type=Path, default=Path("bench-data"))
    parser.add_argument("--labels", action="store_true", help="SRC: a CSV label list")
    parser.add_argument("--json", help="also save the figures here")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",") if c]
    print(machine())
    rows: list[tuple[str, str]] = []
    found: dict[int, dict[str, float]] = {}
    for count in counts:
        src = make_folder(args.data / f"plan-{count}", count)
        if args.labels:
            src = make_list(src)
        done = subprocess.run(
            [sys.executable, "-c", PLAN, str(src), str(args.data / f"plan-{count}-out")],
            capture_output=True,
            text=True,
            check=True,
        )
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        assert figures["images"] == count, figures
        found[count] = figures
        rows.append(
            (
                f"{count:,} {'rows' if args.labels else 'images'}",
                f"{figures['seconds']:7.2f} s  {figures['kib'] / 1024:7.1f} MiB  "
                f"({figures['seconds'] / count * 1e6:.1f} µs and "
                f"{figures['kib'] * 1024 / count:.0f} B an image; {figures['shards']} shard(s))",
            )
        )
    if len(counts) > 1:
        x = np.array(counts, np.float64)
        slope_s = np.polyfit(x, [found[c]["seconds"] for c in counts], 1)[0]
        slope_b = np.polyfit(x, [found[c]["kib"] * 1024 for c in counts], 1)[0]
        rows.append(
            (
                "slope",
                f"{slope_s * 1e6:.1f} s and {slope_b * 1e6 / 2**30:.2f} GiB per 1M images",
            )
        )
        rows.append(
            (
                "projection, 100M images",
                f"{slope_s * 1e8 / 3600:.1f} h and {slope_b * 1e8 / 2**30:.0f} GiB of one "
                "process (plus a bucket's LIST round trips)",
            )
        )
    what = "a label list" if args.labels else "an image folder"
    print_table(f"Planning a conversion of {what} (scan, shard plan, output id)", rows)
    save_json(args.json, {"counts": found})


if __name__ == "__main__":
    main()
