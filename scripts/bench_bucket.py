"""Bucket to bucket: what a conversion's driver holds and reads when SRC and DST are in a bucket
(moto's S3 server, started here on 127.0.0.1, on the same CPUs).

For each --counts N (small 32x32 PNGs in 10 class folders, uploaded once) and each --executors
(the local pool of 2 workers; Ray: a local Ray of 2 CPUs started by the run — run the script in
a loopback-only network namespace then, see docs/scale.md), one conversion
`imgpack convert s3://bench/src-N s3://bench/dst-N --format webdataset --shard-size 256KB` in a
process of its own (shard tasks write the shards straight to the bucket), measured from outside
and inside it:
  - plan ready: from the start of convert() to the shard plan (listing + scan + plan: no image
    is read before it), against the listing alone (fs.find over SRC from another process);
  - first shard written: the first receipt the driver gets;
  - the driver's peak RSS (VmHWM) and its growth per image between the smallest and largest N;
  - this machine's peak scratch disk (the driver's listing folder and the local workers' shard
    folders: everything under the run's TMPDIR) and the cache's build folder, every 50 ms;
  - bytes that come back to the driver from the tasks (pickled receipts), against the output;
  - GET requests for SRC objects, counted in moto's request log: all of them, and those of
    part 0 of --num-parts 2 (its own objects only).

With --tars N, SRC is N such images as WebDataset tars of 1 MB another tool could have written
(the .tar files of a local webdataset conversion, nothing else), converted bucket to bucket read
in place and by the route that downloads them to the driver's scratch first: the time, the peak
scratch, and the GET requests for the tars (the scan's, then the ranged reads of the tasks).
With --tfrecords N, the same with TFRecord files of 1 MB (a local tfrecord conversion's
.tfrecord files, without its manifest and .idx files). --shard-size sets the output's shards
(256 KB by default: many shard tasks, each a GET or two).

With --together N, N such images in a bucket folder are converted bucket to bucket by
--num-parts 2, both parts started at the same moment (--rounds times): each part's plan and
end, and the LIST requests of SRC in all (one listing for both parts, or one each).

With --outputs N, SRC is an imgpack `pt` output of N such images in 1 MB shards, converted bucket
to bucket twice: the time, the bytes of SRC's files the driver fetched itself (none: scan tasks
and shard tasks read it), and the GETs of SRC's files. --imgpack runs another checkout's imgpack
(an earlier commit's, its C extensions built) for a before figure.

With --listing FOLDERSxPER (e.g. 8x2000; 0xN: N objects at the top level, a flat bucket), only
the listing of a bucket image folder of that many tiny objects, taken as a conversion takes it
(imgpack.sources.listing.source_folder): by threads of the driver, as an executor that runs no
tasks has it, and by tasks of a pool of 2 workers, alternating over --rounds: the wall time,
the driver's CPU and the workers' CPU.

    python scripts/bench_bucket.py [--counts 4000,16000,64000] [--executors local,ray]
    python scripts/bench_bucket.py --listing 8x2000
    python scripts/bench_bucket.py --tars 16000
    python scripts/bench_bucket.py --tfrecords 16000
    python scripts/bench_bucket.py --outputs 16000 [--imgpack OTHER_CHECKOUT]
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

from imgpack.storage.location import TRANSFERS as LISTING_FOLDERS

#: Run in the conversion's own process: when the plan was ready, the first receipt, the bytes
#: the tasks sent back and the peak RSS.
DRIVER = """
import json, pickle, sys, time
import imgpack.direct as direct
import imgpack.executors as executors
from imgpack import convert
marks, returned = {}, [0]
real_plan = direct.convert_to_bucket
def convert_to_bucket(*args, **kwargs):
    marks["plan"] = time.perf_counter()
    return real_plan(*args, **kwargs)
direct.convert_to_bucket = convert_to_bucket
def counted(real):
    def tasks(self, function, items):
        for item, result in real(self, function, items):
            marks.setdefault("first", time.perf_counter())
            returned[0] += len(pickle.dumps(result))
            yield item, result
    return tasks
for name in ("LocalExecutor", "RayExecutor"):
    cls = getattr(executors, name)
    cls.tasks = counted(cls.tasks)
import os
from imgpack.storage import cache as cache_module, lazy as lazy_module
driver, fetched = os.getpid(), [0]  # bytes of SRC files this process (not a worker) fetched
real_fetch = cache_module.fetch_file
def fetch_file(fs, remote, local, entry, url):
    if os.getpid() == driver:
        fetched[0] += entry.bytes
    return real_fetch(fs, remote, local, entry, url)
cache_module.fetch_file = lazy_module.fetch_file = fetch_file
src, dst, executor, parts, part, shard_size = sys.argv[1:7]
if sys.argv[7:] == ["download"]:  # the route bucket tars and TFRecords took before
    import imgpack.pipeline as pipeline
    pipeline._in_place = lambda options: None
start = time.perf_counter()
manifest = convert(src, dst, "webdataset", workers=2, progress=False, shard_size=shard_size,
                   executor=executor, num_parts=int(parts), part=int(part))
done = time.perf_counter()
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print("RESULT " + json.dumps({"plan_s": marks["plan"] - start, "first_s": marks["first"] - start,
      "total_s": done - start, "rss_kib": hwm, "samples": manifest.num_samples,
      "bytes": manifest.total_bytes, "shards": len(manifest.files), "returned": returned[0],
      "driver_fetched": fetched[0]}))
"""


#: The driver's side alone, without a store: a listing of N objects in 10 class folders written
#: as a bucket source's scratch folder holds it, then the scan, the output id and the shard plan
#: of a conversion to a bucket, in a process of its own; its VmHWM after, less before.
PLANNING = """
import hashlib, json, sys, time
from dataclasses import replace
from pathlib import Path
import torch  # the driver has it loaded
from imgpack.sources import listing
from imgpack import direct, pipeline
from imgpack.options import ConvertOptions
count, folder = int(sys.argv[1]), Path(sys.argv[2])
index = {}
with open(folder / listing.STORE_LISTING, "wb") as out:
    for c in range(10):
        start = out.tell()
        for i in range(c, count, 10):
            tag = hashlib.md5(str(i).encode()).hexdigest()  # as random as a store's ETags
            entry = [f"class{c:02d}/img{i:07d}.png", 3300 + i % 7, f'"{tag}"']
            out.write(json.dumps(entry).encode() + b"\\n")
        index[f"class{c:02d}"] = [start, out.tell(), count // 10]
(folder / listing.STORE_FOLDERS).write_text(json.dumps(index))
(folder / listing.STORE_REMOTE).write_text(json.dumps({"url": "s3://b/src", "storage_options": {}}))
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
before = hwm()
start = time.perf_counter()
options = ConvertOptions.create("webdataset", shard_size="256KB", progress=False)
plan = replace(pipeline._plan(folder, "s3://b/dst", options, check_dst=False), layout="shards")
plan.output_id
bounds = direct.cut(direct.sample_sizes(plan), options.shard_size)
planned = time.perf_counter() - start
kib = hwm() - before
# The listing saved in DST's work folder (here a local folder), then read back as a part or a
# resume reads it instead of listing SRC.
import fsspec
saved = folder / "dst" / direct.SAVED
saved.mkdir(parents=True)
start = time.perf_counter()
listing.save_listing(folder, fsspec.filesystem("file"), str(saved))
save_s = time.perf_counter() - start
start = time.perf_counter()
scratch = listing._saved_folder("s3://b/src", None, str(saved))
read_s = time.perf_counter() - start
assert scratch is not None and listing.listing_digest(scratch) == listing.listing_digest(folder)
packed = sum(p.stat().st_size for p in saved.iterdir())
print("RESULT " + json.dumps({"kib": kib, "shards": len(bounds) - 1, "plan_s": planned,
      "save_s": save_s, "read_s": read_s, "saved_bytes": packed}))
"""


def planning_memory(count: int) -> dict[str, Any]:
    """The driver's peak RSS growth for listing, scan, output id and plan of ``count`` objects
    (no store: the listing file is written as a bucket source's scratch folder holds it)."""
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as folder:
        run = subprocess.run(
            [sys.executable, "-c", PLANNING, str(count), folder], capture_output=True, text=True
        )
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT ") :]))


def tree_bytes(paths: list[Path]) -> int:
    total = 0
    for root in paths:
        for folder, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
    return total


def run_driver(
    src: str,
    dst: str,
    cache: Path,
    executor: str,
    parts: int = 1,
    part: int = 0,
    download: bool = False,
    shard_size: str = "256KB",
) -> dict[str, Any]:
    """One conversion in a process of its own to ``shard_size`` shards, this machine's scratch
    and the cache's build folder sampled (``download``: by the route that downloads SRC
    first)."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-tmp-"))
    env = {**os.environ, "TMPDIR": str(scratch), "IMGPACK_CACHE_DIR": str(cache)}
    if IMGPACK_TREE:  # another checkout's imgpack (its C extensions built): a before figure
        env["PYTHONPATH"] = os.pathsep.join([IMGPACK_TREE, env.get("PYTHONPATH", "")])
    peaks = {"scratch": 0, "build": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peaks["scratch"] = max(peaks["scratch"], tree_bytes([scratch]))
            peaks["build"] = max(peaks["build"], tree_bytes([cache / "builds"]))
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, src, dst, executor, str(parts), str(part), shard_size]
            + (["download"] if download else []),
            env=env,
            capture_output=True,
            text=True,
            cwd=IMGPACK_TREE or None,  # (python -c puts the working folder first on the path)
        )
    finally:
        done.set()
        watcher.join()
        shutil.rmtree(scratch, ignore_errors=True)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT ") :]), **peaks}


#: ``--imgpack TREE``: the checkout whose imgpack the conversions run (default: this one).
IMGPACK_TREE = ""


def output_in_place(data: str, count: int, shard_size: str) -> dict[str, float]:
    """An imgpack ``pt`` output of ``count`` images in 1 MB shards, in the bucket, converted
    bucket to bucket to ``webdataset`` (the local pool of 2 workers), twice: the time, the plan,
    the bytes of SRC's files the driver fetched itself, and the GETs of SRC's data files."""
    from imgpack import convert

    print(f"machine: {machine()}")
    folder = make_png_folder(Path(data) / f"png32-{count}", count, 32, 10)
    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as scratch, bucket(log):
        made = convert(folder, Path(scratch) / "src", "pt", shard_size="1MB", progress=False)
        fs = fsspec.filesystem("s3")
        fs.put(str(Path(scratch) / "src"), f"bench/output-{count}", recursive=True)
        for round_ in range(2):
            cache = Path(tempfile.mkdtemp(prefix="bench-cache-"))
            at = log.stat().st_size
            run = run_driver(f"s3://bench/output-{count}", f"s3://bench/output-out-{count}-{round_}",
                             cache, "local", shard_size=shard_size)  # fmt: skip
            shutil.rmtree(cache, ignore_errors=True)
            requests = gets(log, f"output-{count}", at)
            row = {"total_s": run["total_s"], "plan_s": run["plan_s"],
                   "driver_fetched": float(run["driver_fetched"]), "gets": float(requests),
                   "source_bytes": float(made.total_bytes), "files": float(len(made.files))}  # fmt: skip
            rows.append(row)
            print(f"round {round_}: {run['total_s']:.1f} s (plan ready {run['plan_s']:.1f} s), "
                  f"the driver fetched {run['driver_fetched'] / 2**20:.2f} MiB of SRC's "
                  f"{made.total_bytes / 2**20:.1f} MiB ({len(made.files)} shards); {requests} "
                  f"GETs of SRC's files (manifest included)")  # fmt: skip
    return {f"{k}_{i}": v for i, row in enumerate(rows) for k, v in row.items()}


def together(data: str, count: int, rounds: int) -> dict[str, float]:
    """``count`` images in a bucket folder converted bucket to bucket by 2 parts started at the
    same moment (2 processes, each with a pool of 2 workers): each part's time to its plan and
    to its end, and the LIST requests of SRC in all."""
    print(f"machine: {machine()}")
    folder = make_png_folder(Path(data) / f"png32-{count}", count, 32, 10)
    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    row: dict[str, float] = {}
    with bucket(log):
        fs = fsspec.filesystem("s3")
        fs.put(str(folder), f"bench/together-{count}", recursive=True)
        fs.rm_file(f"bench/together-{count}/.complete")
        for round_ in range(rounds):
            at = log.stat().st_size
            found: list[dict[str, Any]] = [{}, {}]

            def part(k: int, round_: int = round_, found: list[dict[str, Any]] = found) -> None:
                cache = Path(tempfile.mkdtemp(prefix="bench-cache-"))
                found[k] = run_driver(f"s3://bench/together-{count}",
                                      f"s3://bench/together-out-{count}-{round_}", cache, "local",
                                      parts=2, part=k)  # fmt: skip
                shutil.rmtree(cache, ignore_errors=True)

            start = time.perf_counter()
            threads = [threading.Thread(target=part, args=(k,)) for k in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - start
            listed = lists(log, f"together-{count}", at)
            for k, run in enumerate(found):
                row[f"plan_s_{round_}_{k}"] = run["plan_s"]
                row[f"total_s_{round_}_{k}"] = run["total_s"]
            row[f"wall_s_{round_}"], row[f"lists_{round_}"] = wall, float(listed)
            print(f"round {round_}: both parts done in {wall:.1f} s; "
                  + "; ".join(f"part {k}: plan ready {r['plan_s']:.1f} s, done {r['total_s']:.1f} s"
                              for k, r in enumerate(found))
                  + f"; {listed} LIST requests of SRC")  # fmt: skip
    return row


def lists(log: Path, prefix: str, start: int) -> int:
    """LIST requests of objects under ``prefix`` in moto's log from byte ``start`` on."""
    text = log.read_bytes()[start:].decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return len(re.findall(rf'"GET /bench/?\?[^ ]*prefix={re.escape(prefix)}[^ ]* HTTP', text))


def gets(log: Path, prefix: str, start: int) -> int:
    """GET requests for objects under ``prefix`` in moto's log from byte ``start`` on."""
    text = log.read_bytes()[start:].decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the server colours some lines (206s)
    return len(re.findall(rf'"GET /bench/{re.escape(prefix)}/[^ ?]+ HTTP', text))


def listing_cpu(folders: int, per: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    """The listing of ``folders`` x ``per`` objects in moto, by threads and by pool tasks."""
    import resource

    from imgpack.executors import LocalExecutor
    from imgpack.sources.listing import source_folder

    def cpu() -> tuple[float, float]:
        own, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    found: dict[str, list[dict[str, float]]] = {"threads": [], "tasks": []}
    with bucket():
        fs = fsspec.filesystem("s3")
        keys = ([f"c{k}/img{i:06d}.jpg" for k in range(folders) for i in range(per)] if folders
                else [f"img{i:07d}.jpg" for i in range(per)])  # fmt: skip
        objects = {f"bench/listed/{key}": b"x" for key in keys}
        fs.pipe(objects)
        for _ in range(rounds):
            for name, runner in (("threads", None), ("tasks", LocalExecutor(2))):
                fs.invalidate_cache()
                (own, kids), start = cpu(), time.perf_counter()
                with source_folder("s3://bench/listed", None, lambda _: True, runner) as folder:
                    lines = (folder / ".imgpack-store.jsonl").read_bytes().count(b"\n")
                (own2, kids2), wall = cpu(), time.perf_counter() - start
                assert lines == len(keys), lines
                found[name].append({"wall": wall, "driver": own2 - own, "workers": kids2 - kids})
    for name, rows in found.items():

        def span(key: str, rows: list[dict[str, float]] = rows) -> str:
            values = sorted(row[key] for row in rows)
            return f"{values[0]:.2f}-{values[-1]:.2f} s"

        where = f"in {folders} folders" if folders else "at the top level (flat)"
        print(f"{name:8s} {len(keys)} objects {where}: wall {span('wall')}, "
              f"driver CPU {span('driver')}, workers CPU {span('workers')}")  # fmt: skip
    return found


def read_in_place(
    data: str, count: int, kind: str = "tars", shard_size: str = "256KB"
) -> dict[str, dict[str, float]]:
    """Bucket WebDataset tars (``kind`` "tars") or TFRecord files ("tfrecords") of ``count``
    images, 1 MB each, to a bucket ``webdataset`` of ``shard_size`` shards, read in place and
    downloaded first (the local pool of 2 workers)."""
    from imgpack import convert

    print(f"machine: {machine()}")
    folder = make_png_folder(Path(data) / f"png32-{count}", count, 32, 10)
    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    found: dict[str, dict[str, float]] = {}
    fmt, suffix = ("webdataset", ".tar") if kind == "tars" else ("tfrecord", ".tfrecord")
    with tempfile.TemporaryDirectory() as scratch, bucket(log):
        convert(folder, Path(scratch) / "src", fmt, shard_size="1MB", progress=False)
        files = sorted((Path(scratch) / "src").glob(f"*{suffix}"))  # (no manifest, no .idx)
        fs = fsspec.filesystem("s3")
        for file in files:
            fs.put_file(str(file), f"bench/{kind}-{count}/{file.name}")
        source = sum(t.stat().st_size for t in files)
        for route in ("in place", "downloaded"):
            cache = Path(tempfile.mkdtemp(prefix="bench-cache-"))
            at = log.stat().st_size
            dst = f"s3://bench/{kind}-out-{route.replace(' ', '-')}-{count}"
            run = run_driver(f"s3://bench/{kind}-{count}", dst, cache, "local",
                             download=route == "downloaded", shard_size=shard_size)  # fmt: skip
            shutil.rmtree(cache, ignore_errors=True)
            requests = gets(log, f"{kind}-{count}", at)
            found[route] = {"total_s": run["total_s"], "plan_s": run["plan_s"],
                            "peak_scratch": float(run["scratch"]), "gets": float(requests),
                            "source_bytes": float(source), "files": float(len(files))}  # fmt: skip
            print(f"{route:10s}: {run['total_s']:.1f} s (plan ready {run['plan_s']:.1f} s), "
                  f"peak scratch {run['scratch'] / 2**20:.2f} MiB for {source / 2**20:.1f} MiB "
                  f"of {kind} ({len(files)}), {requests} GETs of them")  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--counts", default="4000,16000,64000")
    parser.add_argument("--executors", default="local,ray")
    parser.add_argument(
        "--parts-up-to", type=int, default=None, help="measure part 0 of 2 up to this N only"
    )
    parser.add_argument(
        "--planning",
        default=None,
        help="only the driver's planning memory (no store) at these N, e.g. 64000,256000,1024000",
    )
    parser.add_argument(
        "--list-cpu-us",
        type=float,
        default=110.0,
        help="client CPU per listed object for the --planning projection (measured against "
        "moto on this machine: 95-125 us, almost all of it s3fs and botocore parsing the pages)",
    )
    parser.add_argument("--listing", default=None, help="FOLDERSxPER: the listing alone")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --listing")
    parser.add_argument("--tars", type=int, default=None, help="N: SRC WebDataset tars of N images")
    parser.add_argument(
        "--tfrecords", type=int, default=None, help="N: SRC TFRecord files of N images"
    )
    parser.add_argument(
        "--outputs", type=int, default=None, help="N: SRC an imgpack pt output of N images"
    )
    parser.add_argument(
        "--shard-size",
        default="256KB",
        help="with --tars, --tfrecords or --outputs: the output's shards",
    )
    parser.add_argument(
        "--together", type=int, default=None, help="N: 2 parts started at once on N images"
    )
    parser.add_argument("--imgpack", default="", help="run another checkout's imgpack")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.listing:
        folders, per = (int(v) for v in args.listing.split("x"))
        print(f"machine: {machine()}")
        save_json(
            args.json, {"machine": machine(), "listing": listing_cpu(folders, per, args.rounds)}
        )
        return
    global IMGPACK_TREE
    IMGPACK_TREE = args.imgpack
    if args.together:
        row = together(args.data, args.together, args.rounds)
        save_json(args.json, {"machine": machine(), "together": row})
        return
    if args.outputs:
        found_rows = output_in_place(args.data, args.outputs, args.shard_size)
        save_json(args.json, {"machine": machine(), "outputs": found_rows})
        return
    if args.tars or args.tfrecords:
        kind = "tars" if args.tars else "tfrecords"
        found = read_in_place(args.data, args.tars or args.tfrecords, kind, args.shard_size)
        save_json(args.json, {"machine": machine(), kind: found})
        return
    if args.planning:
        planned = [int(c) for c in args.planning.split(",")]
        rows = {count: planning_memory(count) for count in planned}
        for count, row in rows.items():
            print(f"{count:>9} objects: driver peak RSS +{row['kib'] / 1024:.1f} MiB, "
                  f"{row['shards']} shards; plan from the listing file {row['plan_s']:.2f} s; "
                  f"listing saved {row['save_s']:.2f} s ({row['saved_bytes'] / 2**20:.1f} MiB), "
                  f"read back {row['read_s']:.2f} s")  # fmt: skip
        first, last = planned[0], planned[-1]
        slope = (rows[last]["kib"] - rows[first]["kib"]) * 1024 / (last - first)
        per = {k: (rows[last][k] - rows[first][k]) / (last - first) * 1e6
               for k in ("plan_s", "save_s", "read_s")}  # fmt: skip
        print(f"planning: {slope:.0f} B per image ({first} -> {last}); per million objects: "
              f"plan {per['plan_s']:.1f} s, save {per['save_s']:.1f} s, read back "
              f"{per['read_s']:.1f} s")  # fmt: skip
        # The LIST round trips a first run makes (1,000 keys a page, LISTING_FOLDERS at once),
        # and the listing client's CPU (s3fs/botocore parse each page's XML in the driver's one
        # process, threads or not): whichever is longer.
        for latency in (0.05, 0.2):
            waited = 1e8 / 1000 * latency / LISTING_FOLDERS
            listed = max(waited, 1e8 * args.list_cpu_us * 1e-6)
            print(f"projected for 100M objects, {latency * 1e3:.0f} ms a LIST page and "
                  f"{args.list_cpu_us:.0f} us of client CPU per listed object: the first run "
                  f"lists in {listed / 3600:.1f} h and plans in {per['plan_s'] * 100 / 3600:.1f} "
                  f"h; a part or a resume reads the saved listing in "
                  f"{per['read_s'] * 100 / 60:.1f} min and plans in "
                  f"{per['plan_s'] * 100 / 3600:.1f} h")  # fmt: skip
        save_json(
            args.json, {"machine": machine(), "planning": rows, "slope": slope, "per_million": per}
        )
        return
    counts = [int(c) for c in args.counts.split(",")]
    executors = args.executors.split(",")
    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    print(f"machine: {machine()}")
    results: dict[str, dict[str, float]] = {}
    with bucket(log):
        fs = fsspec.filesystem("s3")  # the server's address is set now
        for count in counts:
            folder = make_png_folder(Path(args.data) / f"png32-{count}", count, 32, 10)
            start = time.perf_counter()
            fs.put(str(folder), f"bench/src-{count}", recursive=True)
            upload_s = time.perf_counter() - start
            fs.rm_file(f"bench/src-{count}/.complete")
            start = time.perf_counter()
            listed = len(fs.find(f"bench/src-{count}", refresh=True))
            listing_s = time.perf_counter() - start
            for executor in executors:
                cache = Path(tempfile.mkdtemp(prefix="bench-cache-"))
                at = log.stat().st_size
                src, dst = f"s3://bench/src-{count}", f"s3://bench/{executor}-{count}"
                whole = run_driver(src, dst, cache, executor)
                whole_gets = gets(log, f"src-{count}", at)
                half, part_gets = {"samples": 0}, 0
                if args.parts_up_to is None or count <= args.parts_up_to:
                    at = log.stat().st_size
                    part = f"s3://bench/{executor}-p-{count}"
                    half = run_driver(src, part, cache, executor, 2, 0)
                    part_gets = gets(log, f"src-{count}", at)
                shutil.rmtree(cache, ignore_errors=True)
                row = {
                    "images": float(listed),
                    "listing_s": listing_s,
                    "plan_s": whole["plan_s"],
                    "first_shard_s": whole["first_s"],
                    "total_s": whole["total_s"],
                    "rss_kib": float(whole["rss_kib"]),
                    "peak_scratch": float(whole["scratch"]),
                    "peak_build": float(whole["build"]),
                    "output_bytes": float(whole["bytes"]),
                    "shards": float(whole["shards"]),
                    "returned_bytes": float(whole["returned"]),
                    "gets": float(whole_gets),
                    "part0_samples": float(half["samples"]),
                    "part0_gets": float(part_gets),
                }
                results[f"{executor}-{count}"] = row
                out_mib = whole["bytes"] / 2**20
                print_table(
                    f"{count} images, bucket -> bucket, webdataset, {executor} (2 workers), "
                    f"{upload_s:.0f} s to upload",
                    [
                        ("listing alone (fs.find)", f"{listing_s:.2f} s for {listed} objects"),
                        ("plan ready (listing, scan, plan)", f"{whole['plan_s']:.2f} s"),
                        ("first shard written", f"{whole['first_s']:.2f} s after the start"),
                        ("whole conversion", f"{whole['total_s']:.1f} s"),
                        ("driver peak RSS", f"{whole['rss_kib'] / 1024:.0f} MiB"),
                        (
                            "peak scratch (driver + local workers)",
                            f"{whole['scratch'] / 2**20:.2f} MiB; build folder "
                            f"{whole['build'] / 2**20:.2f} MiB; output {out_mib:.1f} MiB in "
                            f"{whole['shards']} shards",
                        ),
                        (
                            "bytes back to the driver",
                            f"{whole['returned']:,} ({100 * whole['returned'] / whole['bytes']:.2f}"
                            "% of the output)",
                        ),
                        ("GETs of SRC objects", f"{whole_gets} for {whole['samples']} samples"),
                        ("part 0 of 2: GETs", f"{part_gets} for its {half['samples']} samples"),
                    ],
                )
        for executor in executors:
            small, large = results[f"{executor}-{counts[0]}"], results[f"{executor}-{counts[-1]}"]
            if len(counts) > 1:
                slope = (large["rss_kib"] - small["rss_kib"]) * 1024 / (counts[-1] - counts[0])
                print(f"\n{executor}: driver RSS growth {slope:.0f} B per image "
                      f"({counts[0]} -> {counts[-1]})")  # fmt: skip
                results[f"{executor}-rss_bytes_per_image"] = {"value": slope}
    save_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
