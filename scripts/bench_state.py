"""What training state costs, and how random the shard-aware order is, in one run.

- Read rate: one epoch of a raw 32x32 `pt` output through `DataLoader(ds, batch_size=256,
  collate_fn=collate)` with `shuffle=True` (torch's RandomSampler), with
  `sampler=ShardSampler(ds)`, and through `imgpack.loading.Loader` with the same sampler (state
  tracking); num_workers=0 and 2, after one warm-up epoch, each measured in turn, best of
  --repeats.
- Resume: a Loader state saved half-way through an epoch, loaded into a new Loader; the time
  from `load_state_dict` to the first batch, against replaying the consumed batches.
- Randomness: the mean total-variation distance between each batch's label histogram and the
  dataset's (0: every batch looks like the dataset; near 1: one class per batch), for scan
  order, ShardSampler windows of 1, 8 and every shard, a rank's own batches on one node of 4
  ranks and on 2 and 4 nodes of 2 ranks (node partitions), and a full shuffle. The folder's classes
  are contiguous in scan order, so every shard holds one or two classes: the hard case.

    python scripts/bench_state.py [--count 50000] [--data bench-data]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
from benchlib import machine, make_png_folder, print_table, save_json
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate


def epoch_rate(loader: DataLoader) -> float:  # type: ignore[type-arg]
    start, seen = time.perf_counter(), 0
    for _, labels in loader:
        seen += len(labels)
    return seen / (time.perf_counter() - start)


def label_spread(order: np.ndarray, targets: np.ndarray, classes: int, batch: int) -> float:
    """Mean total-variation distance of batches' label histograms from the dataset's."""
    whole = np.bincount(targets, minlength=classes) / len(targets)
    distances = []
    for first in range(0, len(order) - batch + 1, batch):
        counts = np.bincount(targets[order[first : first + batch]], minlength=classes)
        distances.append(0.5 * np.abs(counts / batch - whole).sum())
    return float(np.mean(distances))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    data = Path(args.data)
    print(machine())
    png = make_png_folder(data / f"png32-{args.count}", args.count, 32, 10)
    out = data / f"state-pt-raw-{args.count}"
    if not (out / "imgpack.json").exists():
        convert(png, out, format="pt", encoding="raw", size=32, shard_size="4MB", progress=False)
    ds = open_dataset(out)
    epoch_rate(DataLoader(ds, batch_size=256, collate_fn=collate))  # pages in, records checked
    results: dict[str, float] = {}
    for workers in (0, 2):
        rates: dict[str, list[float]] = {"shuffle": [], "sampler": [], "loader": []}
        for _ in range(args.repeats):
            common = {"batch_size": 256, "collate_fn": collate, "num_workers": workers}
            rates["shuffle"].append(epoch_rate(DataLoader(ds, shuffle=True, **common)))
            rates["sampler"].append(epoch_rate(DataLoader(ds, sampler=ShardSampler(ds), **common)))
            rates["loader"].append(epoch_rate(Loader(ds, sampler=ShardSampler(ds), **common)))
        for name, values in rates.items():
            results[f"{name}_w{workers}"] = max(values)
    rows = []
    for workers in (0, 2):
        s, p, lo = (results[f"{k}_w{workers}"] for k in ("shuffle", "sampler", "loader"))
        rows.append((
            f"num_workers={workers}: shuffle=True / ShardSampler / Loader",
            f"{s:,.0f} / {p:,.0f} / {lo:,.0f} samples/s; Loader / DataLoader with the "
            f"sampler {lo / p:.2f}x, sampler / shuffle=True {p / s:.2f}x",
        ))  # fmt: skip

    half = len(ds) // 2 // 256
    saved = Loader(ds, batch_size=256, sampler=ShardSampler(ds), collate_fn=collate)
    it = iter(saved)
    start = time.perf_counter()
    for _ in range(half):
        next(it)
    replay = time.perf_counter() - start
    state = saved.state_dict()
    start = time.perf_counter()
    resumed = Loader(ds, batch_size=256, sampler=ShardSampler(ds), collate_fn=collate)
    resumed.load_state_dict(state)
    next(iter(resumed))
    results["resume_s"], results["replay_s"] = time.perf_counter() - start, replay
    rows.append((
        f"resume at {state['sampler']['consumed']:,} of {len(ds):,}",
        f"{results['resume_s'] * 1e3:.0f} ms to the first batch (replaying: "
        f"{results['replay_s'] * 1e3:.0f} ms)",
    ))  # fmt: skip

    targets, classes = np.asarray(ds.targets), len(ds.classes)
    orders = {
        "scan order": np.arange(len(ds)),
        "ShardSampler window=1": ShardSampler(ds, window=1).global_order(),
        "ShardSampler window=8 (default)": ShardSampler(ds).global_order(),
        "ShardSampler window=all": ShardSampler(ds, window=len(ds)).global_order(),
        "full shuffle": np.random.default_rng(0).permutation(len(ds)),
    }
    for nodes in (2, 4):  # a rank's own batches: its node's runs of shards, 2 ranks a node
        name = f"ShardSampler, {nodes} nodes x 2 ranks (rank 0's batches)"
        orders[name] = np.array(list(ShardSampler(ds, num_replicas=2 * nodes, rank=0,
                                                  ranks_per_node=2)))  # fmt: skip
    orders["ShardSampler, 1 node x 4 ranks (rank 0's batches)"] = np.array(
        list(ShardSampler(ds, num_replicas=4, rank=0))
    )
    shards = len(ds.manifest.files)
    for name, order in orders.items():
        spread = results[f"spread {name}"] = label_spread(order, targets, classes, 256)
        rows.append((f"label spread, {name}", f"{spread:.3f}"))
    rows.append(("shards", f"{shards} of ~{len(ds) // shards:,} samples"))
    print_table(f"pt raw 32x32, {len(ds):,} samples", rows)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
