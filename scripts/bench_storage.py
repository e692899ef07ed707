"""Reading outputs from object storage: a real S3 API (moto's server, started here on 127.0.0.1).

Measured side by side in one run, for two outputs (50,000 32x32 images stored raw in `pt`;
4,000 photo-like 500x375 JPEGs stored as original bytes in `tfrecord`):
  - read rate of the local output, and of the same output opened from the bucket through a warm
    cache (the ratio: the cache should cost nothing once warm);
  - the first epoch from the bucket with an empty cache: open (download, check) + one epoch;
  - for the JPEG output, TFRecordStream streaming it from the bucket (nothing cached).
Reads: DataLoader(batch_size=256, shuffle=True, collate_fn=collate), num_workers=0, measured in
turn, best of --repeats rounds.

    python scripts/bench_storage.py [--data bench-data] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
from benchlib import machine, make_jpeg_folder, make_png_folder, print_table, save_json
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.loading.bench import measure
from imgpack.readers import TFRecordStream, collate
from imgpack.storage.cache import stats as cache_stats


def start_moto(log: Path | None = None) -> subprocess.Popen[bytes]:
    """moto's S3 server on 127.0.0.1 and the AWS variables pointing at it; ``log``: a file for
    its request log (one line per request)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb") if log is not None else subprocess.DEVNULL,
    )
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    for _ in range(150):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    raise SystemExit("moto's server did not start")


@contextlib.contextmanager
def bucket(log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """moto's S3 server (:func:`start_moto`) holding an empty bucket ``bench``, stopped when the
    block ends."""
    server = start_moto(log)
    try:
        fsspec.filesystem("s3").mkdir("bench")
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)  # a server holding many objects takes a while
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def fresh_output(src: Path, local: Path, fmt: str, **options: Any) -> Path:
    """``src`` converted into the local output ``local`` (replacing what a last run left)."""
    shutil.rmtree(local, ignore_errors=True)
    convert(src, local, fmt, progress=False, **options)
    return local


def arguments(
    doc: str, repeats: int, shards: bool = False, link: bool = False
) -> argparse.Namespace:
    """The options of the object-storage benchmarks (this one, bench_lazy.py and
    bench_nodes.py; ``shards``: the outputs are written in ``--shards`` shards; ``link``: the
    store can be reached through a link of ``--store-link`` bits per second, see
    :func:`behind_a_link`)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--raw-count", type=int, default=50_000)
    parser.add_argument("--jpeg-count", type=int, default=4_000)
    if shards:
        parser.add_argument("--shards", type=int, default=32)
    if link:
        parser.add_argument(
            "--store-link",
            default=None,
            metavar="RATE",
            help="reach the store through a link of RATE (tc's units: 400mbit, 1gbit)",
        )
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


#: Set in the process :func:`behind_a_link` starts, inside its network namespace.
LINKED = "IMGPACK_BENCH_LINK"


def behind_a_link(rate: str | None) -> None:
    """Run this script again in a network namespace of its own whose loopback (where moto's
    server and the readers talk) passes ``rate`` bits per second (``tc``'s token bucket), and
    exit with its status: a store whose link, not the CPUs it shares with the readers, bounds
    a download. Needs root (``unshare -n``). Nothing when ``rate`` is ``None`` or when this is
    already that process."""
    if rate is None or os.environ.get(LINKED):
        return
    if os.geteuid() != 0:
        raise SystemExit("--store-link needs root: it runs the benchmark in a namespace of its own")
    # The bucket must pass a 64 KiB loopback packet whole: burst 512 KiB.
    shaped = (
        "ip link set lo up && "
        f"tc qdisc add dev lo root tbf rate {shlex.quote(rate)} burst 512kb latency 50ms && "
        f"exec {shlex.join([sys.executable, *sys.argv])}"
    )
    env = {**os.environ, LINKED: rate}
    raise SystemExit(subprocess.run(["unshare", "-n", "sh", "-c", shaped], env=env).returncode)


def output_sets(
    args: argparse.Namespace, jpeg_format: str
) -> dict[str, tuple[Path, str, dict[str, Any]]]:
    """The two outputs measured: raw 32x32 images in ``pt``, photo-like JPEGs in
    ``jpeg_format``: ``{name: (image folder, format, convert options)}``."""
    data = Path(args.data)
    return {
        "pt raw 32x32": (
            make_png_folder(data / f"png32-{args.raw_count}", args.raw_count, 32, 10),
            "pt",
            {"encoding": "raw", "size": 32},
        ),
        f"{jpeg_format} jpeg": (
            make_jpeg_folder(data / f"jpeg500-{args.jpeg_count}", args.jpeg_count),
            jpeg_format,
            {},
        ),
    }


def main() -> None:
    args = arguments(__doc__ or "", repeats=3)
    data = Path(args.data)
    sets = output_sets(args, "tfrecord")
    print(f"machine: {machine()}")
    results: dict[str, dict[str, float]] = {}
    with bucket():
        for name, (src, fmt, options) in sets.items():
            local = fresh_output(src, data / f"storage-{fmt}", fmt, **options)
            url = f"s3://bench/{fmt}"
            start = time.perf_counter()
            convert(src, url, fmt, progress=False, overwrite=True, **options)
            upload_s = time.perf_counter() - start
            n = len(open_dataset(local))
            row: dict[str, float] = {"convert_to_bucket_s": upload_s}
            cold_runs, warm, plain, streamed = [], [], [], []
            for _ in range(args.repeats):
                cache = Path(tempfile.mkdtemp(prefix="imgpack-bench-cache-"))
                start = time.perf_counter()
                ds = open_dataset(url, cache_dir=cache)  # empty cache: download and check
                count, seconds = measure(ds, 0, 256, n, collate)
                cold_runs.append(n / (time.perf_counter() - start))
                count, seconds = measure(open_dataset(url, cache_dir=cache), 0, 256, n, collate)
                warm.append(count / seconds)
                count, seconds = measure(open_dataset(local), 0, 256, n, collate)
                plain.append(count / seconds)
                shutil.rmtree(cache, ignore_errors=True)
                if fmt == "tfrecord":
                    stream = TFRecordStream(url, batch_size=256)
                    start = time.perf_counter()
                    total = sum(len(labels) for _, labels in DataLoader(stream, batch_size=None))
                    streamed.append(total / (time.perf_counter() - start))
            row.update(
                local=max(plain),
                warm_cache=max(warm),
                first_epoch_from_bucket=max(cold_runs),
            )
            if streamed:
                row["stream_from_bucket"] = max(streamed)
            results[name] = row
            rows = [
                ("convert + upload", f"{upload_s:.1f} s ({n / upload_s:,.0f} images/s)"),
                ("local output", f"{row['local']:>12,.0f} samples/s"),
                (
                    "bucket, warm cache",
                    f"{row['warm_cache']:>12,.0f} samples/s  "
                    f"{row['warm_cache'] / row['local']:.2f}x local  (target >= 0.95x)",
                ),
                (
                    "bucket, first epoch (empty cache)",
                    f"{row['first_epoch_from_bucket']:>12,.0f} samples/s  "
                    f"{row['first_epoch_from_bucket'] / row['local']:.2f}x local",
                ),
            ]
            if streamed:
                rows.append(
                    (
                        "TFRecordStream from the bucket",
                        f"{row['stream_from_bucket']:>12,.0f} samples/s (no cache)",
                    )
                )
            print_table(f"{name} ({n} samples)", rows)
        print(f"\ndownloads this run: {cache_stats.downloads} files")
    save_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
