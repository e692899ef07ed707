"""What scaling out costs and where it stops, in one run on the same images.

- Ray against the local engine: the JPEG folder (4,000 photo-like 500x375 JPEGs, original
  bytes, full validation) converted with the local process pool and with --executor ray on a
  local Ray of the same CPUs, in turn, best of --repeats; Ray's own start-up is timed apart
  (a cluster is started once, not per conversion). Both outputs are compared byte for byte.
- The single-writer ceiling of lmdb and hdf5: the same JPEGs, already read into memory, fed
  straight to the format's writer (no decode, no workers): the records/s and MB/s one writer
  absorbs, i.e. the conversion rate above which adding nodes no longer helps a single-file
  format. pt, tfrecord and webdataset are measured the same way for comparison.
- Partitioned conversion: the folder converted as --num-parts parts one after the other (as a
  Slurm array would run them, here on one machine), then `imgpack merge`, against one conversion.

Ray must not send traffic off the machine: run the script in a network namespace with only
loopback, as root:

    unshare -n sh -c 'ip link set lo up; python scripts/bench_scale.py [--count 4000]'
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine, make_jpeg_folder, print_table, save_json

from imgpack import convert, merge
from imgpack.converters import FORMATS
from imgpack.formats import get
from imgpack.formats.writer_base import WriterConfig
from imgpack.images import Encoded, Encoding, ImagePolicy, stored_info
from imgpack.sources.folder.scan import scan_folder


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "lock.mdb"}


def timed_convert(src: Path, dst: Path, **options: object) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    convert(src, dst, "lmdb", progress=False, **options)  # type: ignore[arg-type]
    return time.perf_counter() - start


def writer_ceiling(fmt: str, samples: list[Encoded], work: Path) -> tuple[float, float]:
    """(records/s, MB/s) that the format's writer absorbs from memory."""
    directory = work / f"ceiling-{fmt}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    spec = get(fmt)
    config = WriterConfig(
        format=fmt,
        classes=[f"class{c:02d}" for c in range(10)],
        encoding=Encoding("original"),
        policy=ImagePolicy(),
        shard_size=spec.default_shard_size or 0,
        settings=spec.check_options({}),
    )
    start = time.perf_counter()
    with spec.writer_class()(directory, config) as writer:
        for sample in samples:
            writer.add(sample)
    seconds = time.perf_counter() - start
    size = sum(len(s.payload) for s in samples)
    shutil.rmtree(directory)
    return len(samples) / seconds, size / seconds / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--data", default=None, help="keep generated data here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray

    work = Path(args.data or tempfile.mkdtemp(prefix="imgpack-scale-"))
    src = make_jpeg_folder(work / f"jpeg500-{args.count}", args.count)
    print(machine())

    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - started
    local = ray_time = float("inf")
    for _ in range(args.repeats):  # in turn, so that both see the same machine state
        local = min(local, timed_convert(src, work / "local", workers=2))
        ray_time = min(ray_time, timed_convert(src, work / "ray", executor="ray"))
    identical = files(work / "local") == files(work / "ray")
    ray.shutdown()
    rows = [
        ("local engine, 2 processes", f"{args.count / local:,.0f} img/s"),
        ("--executor ray, local Ray of 2 CPUs", f"{args.count / ray_time:,.0f} img/s"),
        ("ray / local", f"{local / ray_time:.2f}x"),
        ("Ray start-up (once per cluster)", f"{ray_start:.1f} s"),
        ("outputs byte-identical", str(identical)),
    ]
    print_table(f"convert {args.count} JPEGs to lmdb (original bytes, validated)", rows)

    paths = [src / s.path for s in scan_folder(src).samples]
    samples = []
    for i, path in enumerate(paths):
        payload = path.read_bytes()
        kind, height, width, channels = stored_info(payload)
        samples.append(Encoded(f"{i}.jpg", i % 10, payload, height, width, channels, kind))
    ceiling = {fmt: writer_ceiling(fmt, samples, work) for fmt in FORMATS}
    print_table(
        "one writer fed from memory (what a single-file format absorbs at most)",
        [(fmt, f"{rate:,.0f} records/s, {mb:,.0f} MB/s") for fmt, (rate, mb) in ceiling.items()],
    )

    one = timed_convert(src, work / "whole", workers=2)
    start = time.perf_counter()
    parts = []
    for part in range(args.parts):
        target = work / f"part{part}"
        shutil.rmtree(target, ignore_errors=True)
        convert(src, target, "lmdb", num_parts=args.parts, part=part, workers=2, progress=False)
        parts.append(target)
    converted = time.perf_counter() - start
    shutil.rmtree(work / "merged", ignore_errors=True)
    start = time.perf_counter()
    merge(parts, work / "merged", progress=False)
    merged = time.perf_counter() - start
    print_table(
        f"{args.parts} parts one after the other, then merge (lmdb)",
        [
            ("one conversion", f"{one:.2f} s"),
            (f"{args.parts} parts", f"{converted:.2f} s"),
            ("merge (records streamed)", f"{merged:.2f} s"),
        ],
    )
    save_json(
        args.json,
        {
            "machine": machine(),
            "count": args.count,
            "local_img_s": args.count / local,
            "ray_img_s": args.count / ray_time,
            "ray_start_s": ray_start,
            "identical": identical,
            "writer_ceiling": {k: {"records_s": r, "mb_s": m} for k, (r, m) in ceiling.items()},
            "parts": {"one_s": one, "parts_s": converted, "merge_s": merged},
        },
    )
    if not args.data:
        shutil.rmtree(work)
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
