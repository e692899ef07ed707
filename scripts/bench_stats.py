"""What recording the dataset statistics costs a conversion, side by side in one run.

One seeded folder of photo-like JPEGs (ImageNet's usual sizes, quality 90) under --data, reused
between runs. Each round converts it with the default (statistics: every kept JPEG decoded
whole and its pixels summed per channel) and with --no-stats (kept JPEGs validated at 1/8
scale), in turn, as `imgpack convert` subprocesses; also `--encoding raw --size 224` both ways,
where the pixels are in hand anyway. Every figure is the best of --repeats rounds; the ratio is
what to read (the machine's speed moves between runs).

With --sums, only the per-channel sums of one 416x440 RGB image (the set's mean size) by each
path of imgpack.images.pixel_sums: the C extension's AVX2 loop (where the CPU has AVX2), its
portable loop, and numpy alone, in turn over --repeats rounds (best of each).

    python scripts/bench_stats.py [--count 2000] [--repeats 3] [--format webdataset]
    python scripts/bench_stats.py --sums
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import machine, make_photo_folder, print_table, save_json


def _convert(src: Path, dst: Path, fmt: str, *extra: str) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "imgpack", "convert", str(src), str(dst), "--format", fmt, "-q",
         *extra],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(done.stderr)
    return time.perf_counter() - start


def sums_times(repeats: int, calls: int = 2000) -> dict[str, float]:
    """Microseconds per image of each sums path, best of ``repeats`` rounds of ``calls``."""
    import numpy as np

    from imgpack import images

    pixels = np.random.default_rng(0).integers(0, 256, (416, 440, 3), dtype=np.uint8)
    built = images._pixelsums
    paths = {"numpy": lambda: images.numpy_pixel_sums(pixels)}
    if built is not None:
        paths["C, portable"] = lambda: built.sums(pixels.data, 3, True)
        paths["C (AVX2 where the CPU has it)"] = lambda: built.sums(pixels.data, 3)
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            for _ in range(calls if name != "numpy" else calls // 10):
                run()
            took = (time.perf_counter() - start) / (calls if name != "numpy" else calls // 10)
            best[name] = min(best[name], took * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="/tmp/imgpack-bench-stats")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--format", default="webdataset")
    parser.add_argument("--sums", action="store_true", help="only the sums' paths, per image")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.sums:
        found = sums_times(args.repeats)
        print(machine())
        print_table(
            f"per-channel sums of a 416x440 RGB image, best of {args.repeats}",
            [(name, f"{us:7.1f} us") for name, us in found.items()],
        )
        save_json(args.json, {"machine": machine(), "sums_us": found})
        return
    data = Path(args.data)
    src = make_photo_folder(data / f"photos-{args.count}", args.count)
    cases = {
        "original, stats": ("--encoding", "original"),
        "original, --no-stats": ("--encoding", "original", "--no-stats"),
        "raw 224, stats": ("--encoding", "raw", "--size", "224"),
        "raw 224, --no-stats": ("--encoding", "raw", "--size", "224", "--no-stats"),
    }
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, extra in cases.items():
            best[name] = min(best[name], _convert(src, data / "out", args.format, *extra))
    shutil.rmtree(data / "out", ignore_errors=True)
    rates = {name: args.count / seconds for name, seconds in best.items()}
    rows = [(name, f"{rates[name]:8,.0f} images/s") for name in cases]
    for kind in ("original", "raw 224"):
        share = rates[f"{kind}, stats"] / rates[f"{kind}, --no-stats"]
        rows.append((f"{kind}: with stats / without", f"{share:.2f}"))
    print(machine())
    print_table(f"{args.count} JPEGs to {args.format}, best of {args.repeats}", rows)
    save_json(args.json, {"machine": machine(), "rates": rates})


if __name__ == "__main__":
    main()
