"""Reading a bucket output on two nodes, each with its own bounded cache (moto's S3 server on
127.0.0.1): what each node downloads, how full its cache gets, and its first epoch against a
warm one and against the store's own rate.

Each node is a process of its own (its own cache folder and download counters), reading with 2
ranks in lockstep (`ShardSampler(ds, num_replicas=4, rank=r, ranks_per_node=2)`, batches of 64
through `Loader`, num_workers=0, so that every fetch is counted in the node's process), the two
nodes at once. For each output (raw 32x32 images in `pt`; photo-like 500x375 JPEGs in
`webdataset`; shards of 1 MB), each reading setting (the default `window` 8 and `prefetch` 8,
and 2 and 2 for a small cache) and each `cache_limit` (a quarter and an eighth of the output,
raised to the sampler's `working_set()` where that is more):
  - bytes / share: what the node downloaded in the first epoch over its share of the output
    (half of it); target <= 1.05;
  - peak / limit: the cache's data files, sampled every 2 ms, over the limit; target <= 1.0;
  - fetches / shards read: the downloads of the first epoch over the shards the node's ranks
    read (target 1: each once);
  - cold / warm: the first epoch's rate over the second's (the same readers);
  - cold / store: the first epoch's bytes per second over the store's own rate (every shard
    fetched with one GET after the other, in the same node process, before the epochs).

    python scripts/bench_nodes.py [--data bench-data] [--raw-count 20000] [--jpeg-count 2000]
                                  [--store-link 400mbit]

By default the store (moto, a Python server) runs on the same 2 CPUs as the nodes, so a first
epoch is bounded by CPU: each fetched MB costs the node's client and moto CPU time the reads
need too. ``--store-link RATE`` (root) runs it all in a network namespace whose loopback passes
RATE bits per second, shared by the two nodes as a store's link would be: the first epoch is
then bounded by the store, as on a cluster whose nodes have CPU to spare beside their fetches.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
from bench_storage import arguments, behind_a_link, bucket, fresh_output, output_sets
from benchlib import machine, print_table, save_json

from imgpack import open_dataset
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate
from imgpack.storage.cache import stats as cache_stats
from imgpack.storage.lazy import cached_files

NODES, PER_NODE, BATCH = 2, 2, 64
#: Shard size of the outputs: about 60 shards each at the default counts.
SHARD = "1MB"
#: (window, prefetch) of the readers: the defaults, and small ones for a small cache.
READING = ((8, 8), (2, 2))


def _data_bytes(cache: Path) -> int:
    return sum(size for _, _, size in cached_files(cache))


def node(
    url: str,
    node_number: int,
    limit: int,
    cache: Path,
    queue: Any,
    reading: tuple[int, int],
    together: Any,
) -> None:
    """One node: its ranks read two epochs in lockstep; what it measured goes to ``queue``.
    ``together``: a barrier of the nodes, so that they measure the store, then each epoch, at
    the same time (a node's epoch never overlaps another's download of the whole output)."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    names = [f.path for f in open_dataset(url, cache_dir=cache / "probe").manifest.files]
    together.wait()
    start = time.perf_counter()
    fetched = sum(len(fs.cat_file(f"{url.removeprefix('s3://')}/{n}")) for n in names)
    store = fetched / (time.perf_counter() - start)
    loaders = []
    for local in range(PER_NODE):
        window, prefetch = reading
        ds = open_dataset(url, cache_dir=cache / "cache", cache_limit=limit, prefetch=prefetch)
        sampler = ShardSampler(ds, seed=3, num_replicas=NODES * PER_NODE, window=window,
                               rank=node_number * PER_NODE + local, ranks_per_node=PER_NODE)  # fmt: skip
        loaders.append(Loader(ds, batch_size=BATCH, sampler=sampler, collate_fn=collate))
    wanted: set[int] = set()  # the shards this node's ranks read this epoch
    for loader in loaders:
        sampler = loader.batch_sampler.sampler  # type: ignore[union-attr]
        wanted |= set(sampler.shards_read())
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _data_bytes(cache / "cache"))
            done.wait(0.002)

    rates, downloads = [], []
    for _epoch in range(2):
        before, fetches = cache_stats.downloaded_bytes, cache_stats.downloads
        watcher = threading.Thread(target=watch)
        together.wait()
        watcher.start()
        start, count = time.perf_counter(), 0
        for batches in zip(*loaders, strict=True):
            count += sum(len(labels) for _, labels in batches)
        seconds = time.perf_counter() - start
        done.set()
        watcher.join()
        done.clear()
        rates.append(count / seconds)
        downloads.append((cache_stats.downloaded_bytes - before, cache_stats.downloads - fetches,
                          (cache_stats.downloaded_bytes - before) / seconds))  # fmt: skip
    queue.put({"node": node_number, "store": store, "rates": rates, "downloads": downloads,
               "peak": peak[0], "shards": len(names), "wanted": len(wanted)})  # fmt: skip


def main() -> None:
    args = arguments(__doc__ or "", repeats=1, link=True)
    behind_a_link(args.store_link)
    print(machine())
    print(f"store link: {args.store_link or 'none (the store shares the CPUs)'}")
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as scratch, bucket():
        for name, (src, fmt, options) in output_sets(args, "webdataset").items():
            local = fresh_output(src, Path(scratch) / f"{fmt}-local", fmt, shard_size=SHARD,
                                 **options)  # fmt: skip
            url = f"s3://bench/nodes-{fmt}"
            fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
            files = open_dataset(local).manifest.files
            total = sum(f.bytes for f in files)
            for share, (window, prefetch) in [(s, r) for r in READING for s in (4, 8)]:
                need = 0  # the most either node holds at once
                for first in range(0, NODES * PER_NODE, PER_NODE):
                    probe = ShardSampler(
                        open_dataset(url, cache_dir=Path(scratch) / "probe", cache_limit="1TB",
                                     prefetch=prefetch),
                        seed=3, num_replicas=NODES * PER_NODE, rank=first,
                        ranks_per_node=PER_NODE, window=window,
                    )  # fmt: skip
                    probe.step = BATCH  # as the Loader of each rank sets it
                    need = max(need, probe.working_set(lag=BATCH) or 0)
                limit = max(total // share, need)
                context = multiprocessing.get_context("spawn")
                queue, together = context.Queue(), context.Barrier(NODES)
                nodes = [
                    context.Process(
                        target=node,
                        args=(
                            url,
                            n,
                            limit,
                            Path(scratch) / f"{fmt}-{share}-{window}-node{n}",
                            queue,
                            (window, prefetch),
                            together,
                        ),
                    )
                    for n in range(NODES)
                ]
                for process in nodes:
                    process.start()
                found = sorted((queue.get() for _ in nodes), key=lambda r: r["node"])
                for process in nodes:
                    process.join()
                for r in found:
                    cold_bytes, cold_fetches, cold_rate = r["downloads"][0]
                    key = (
                        f"{name}, window {window} prefetch {prefetch}, 1/{share}, node {r['node']}"
                    )
                    results[key] = {**r, "limit": limit, "total": total}
                    rows.append((key, (
                        f"bytes/share {cold_bytes / (total / NODES):.3f}  "
                        f"peak/limit {r['peak'] / limit:.2f}  "
                        f"fetches/shards read {cold_fetches}/{r['wanted']}  "
                        f"cold/warm {r['rates'][0] / r['rates'][1]:.2f}  "
                        f"cold/store {cold_rate / r['store']:.2f}  "
                        f"(limit {limit / total:.3f} of the output, {len(files)} shards)"
                    )))  # fmt: skip
    print_table("two nodes x two ranks, a cache each", rows)
    save_json(args.json, {"store_link": args.store_link, **results})


if __name__ == "__main__":
    main()
