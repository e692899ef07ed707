"""A GZIP-compressed TFRecord file as SRC, cut into many shard tasks: what its conversion costs.

A compressed file has no random access: a shard task reads its records from a stream of the
file. --count small 32x32 PNGs (10 classes, seeded, under --data) are converted to one
TFRecord file, gzipped whole (as TensorFlow's GZIP option writes it), and converted to
`webdataset` in --shard-size shards (many shard tasks) by --workers processes, in a process of
its own, --rounds times: the wall time, the CPU time of the run and its pool, and the CPU time
of one plain decompression of the file beside them (the least any reader of it pays once).

--imgpack TREE runs another checkout's imgpack (its C extensions built): a before figure.

    python scripts/bench_compressed.py --count 16000
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from benchlib import machine, make_png_folder, save_json

RUN = """
import json, resource, sys, time
from imgpack import convert
src, out, shard_size, workers = sys.argv[1:5]
def cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
c, t = cpu(), time.perf_counter()
made = convert(src, out, "webdataset", shard_size=shard_size, workers=int(workers), progress=False)
print("RESULT " + json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": cpu() - c,
      "shards": len(made.files), "samples": made.num_samples}))
"""


def convert_once(
    src: Path, out: Path, shard_size: str, workers: int, tree: str
) -> dict[str, float]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", RUN, str(src), str(out), shard_size, str(workers)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree or None,
    )
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT ") :]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--count", type=int, default=16000)
    parser.add_argument("--shard-size", default="256KB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--imgpack", default="", help="run another checkout's imgpack")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from imgpack import convert

    print(f"machine: {machine()}")
    folder = make_png_folder(Path(args.data) / f"png32-{args.count}", args.count, 32, 10)
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gz-") as scratch:
        plain = Path(scratch) / "plain"
        convert(folder, plain, "tfrecord", shard_size="4GB", progress=False)
        (record,) = plain.glob("*.tfrecord")
        src = Path(scratch) / "src"
        src.mkdir()
        with open(record, "rb") as raw, gzip.open(src / "train.tfrecord", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        data = (src / "train.tfrecord").read_bytes()
        start = time.process_time()
        whole = len(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data))
        rows["decompress_s"] = time.process_time() - start
        print(f"SRC: one GZIP TFRecord file of {args.count} images, {len(data) / 2**20:.1f} MiB "
              f"({whole / 2**20:.1f} MiB inflated); one decompression of it: "
              f"{rows['decompress_s']:.2f} s of CPU")  # fmt: skip
        for round_ in range(args.rounds):
            out = Path(scratch) / f"out-{round_}"
            found = convert_once(src, out, args.shard_size, args.workers, args.imgpack)
            shutil.rmtree(out)
            rows.update({f"{k}_{round_}": float(v) for k, v in found.items()})
            print(f"round {round_}: {found['shards']} shards of {found['samples']} samples by "
                  f"{args.workers} workers in {found['wall_s']:.1f} s, "
                  f"{found['cpu_s']:.1f} s of CPU")  # fmt: skip
    save_json(args.json, {"machine": machine(), "compressed": rows})


if __name__ == "__main__":
    main()
