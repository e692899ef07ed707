"""Raw reads in every format against the in-RAM gather limit, side by side in one run.

One dataset, generated and seeded under --data (reused between runs): --count 32x32 PNGs in
10 classes, converted with `--encoding raw` to every format. Each format is read through
`DataLoader(batch_size=256, shuffle=True, collate_fn=imgpack.readers.collate)`,
num_workers=0, in three ways:
  - first epoch: a new reader (`verify=None`, the default), which checks each record's
    checksum the first time it reads it;
  - later epoch: the same reader again (checked records only looked up in its bitmap);
  - unchecked: a reader with `verify=False`.
And once more through `DataLoader(batch_sampler=ShardSampler(ds, window=len(ds)).batches(256),
collate_fn=collate)` (the same reader, a later epoch): a full shuffle as above, each batch one
array of indices instead of 256 Python ints drawn one by one; and through imgpack's
`Loader(ds, batch_size=256, sampler=ShardSampler(ds, window=len(ds)), collate_fn=collate)`,
which hands an imgpack reader the sampler's batches as index arrays through DataLoader's public
`batch_sampler=`.
The pt and webdataset outputs are read again written in --many-shards shards (a shuffled
batch then touches most of them). The limit is a bare `index_select` of the same shuffled batches from one in-RAM uint8 tensor
of all the images (no file, no label, no check): what any loader of these bytes can do at most
on this machine. Beside it, the DataLoader's own cost: a dataset that returns one prepared
batch each time, through `shuffle=True`, through a batch sampler that yields index arrays and
through `Loader` with `ShardSampler` batches.
With --from-disk the outputs are dropped from the page cache and read once before the rounds,
as a training run finds an output that was not in memory (the kernel then holds them in large
folios, mapped 2 MB at a time); by default they are read as the conversion left them.
Every figure is the best of --repeats rounds, the formats measured in turn
within each round, the limit at the start of each. On a machine whose memory bandwidth drifts
(a VM: the limit itself moved 1.7x between runs here), a share of the best limit says little;
so each format's Loader epoch is also paired with the limit measured just before and just after
it, and the share printed as "paired" is the median over rounds of the Loader rate over the mean
of those two limits.

    python scripts/bench_raw.py [--count 50000] [--formats pt,lmdb] [--repeats 3] [--from-disk]
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchlib import (
    index_select_limit,
    machine,
    make_png_folder,
    print_table,
    read_from_disk,
    save_json,
)
from torch.utils.data import DataLoader, Dataset, Sampler

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.loading import Loader, ShardSampler
from imgpack.loading.bench import measure
from imgpack.readers import Batch, collate


class PreparedBatch(Dataset[Any]):
    """The DataLoader's own cost: every batch is the same prepared one, read nowhere."""

    def __init__(self, count: int, batch: Batch) -> None:
        self.count, self.batch = count, batch

    def __len__(self) -> int:
        return self.count

    def __getitems__(self, indices: list[int]) -> Batch:
        return self.batch

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError


class ArrayBatches(Sampler[np.ndarray]):
    """Shuffled batches of indices as arrays (no Python int per sample)."""

    def __init__(self, count: int, batch_size: int, seed: int) -> None:
        self.count, self.batch_size, self.seed = count, batch_size, seed

    def __len__(self) -> int:
        return -(-self.count // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        order = np.random.default_rng(self.seed).permutation(self.count)
        return iter(np.array_split(order, range(self.batch_size, self.count, self.batch_size)))


def floor(count: int, batch: Batch, sampler: Sampler[np.ndarray] | None) -> float:
    """Samples/s of one epoch of :class:`PreparedBatch` through ``DataLoader(batch_size=256,
    shuffle=True)``, or through ``batch_sampler=sampler``."""
    ds = PreparedBatch(count, batch)
    if sampler is None:
        loader = DataLoader(ds, batch_size=256, shuffle=True, collate_fn=collate)
    else:
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
    start = time.perf_counter()
    seen = sum(len(labels) for _, labels in loader)
    return seen / (time.perf_counter() - start)


def loader_floor(count: int, batch: Batch, seed: int) -> float:
    """Samples/s of one epoch of :class:`PreparedBatch` through imgpack's ``Loader`` with
    ``ShardSampler(...).batches(256)`` (one window: a full shuffle)."""
    sampler = ShardSampler(PreparedBatch(count, batch), seed=seed, window=count)
    return _epoch(Loader(sampler.dataset, batch_sampler=sampler.batches(256), collate_fn=collate))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--many-shards",
        type=int,
        default=64,
        help="also read pt and webdataset outputs of about this many shards (0: not)",
    )
    parser.add_argument(
        "--from-disk",
        action="store_true",
        help="drop the outputs from the page cache and read them once before the rounds",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    data = Path(args.data)
    src = make_png_folder(data / f"png32-{args.count}", args.count, 32, 10)
    print(f"machine: {machine()}")
    outputs = {}
    for fmt in formats:
        out = data / f"raw-{fmt}-{args.count}"
        if not (out / "imgpack.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            convert(src, out, fmt, encoding="raw", size=32, progress=False)
        outputs[fmt] = out
    for fmt in [f for f in ("pt", "webdataset") if f in formats and args.many_shards > 1]:
        out = data / f"raw-{fmt}-{args.count}-{args.many_shards}-shards"
        if not (out / "imgpack.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            total = sum(f.bytes for f in open_dataset(outputs[fmt]).manifest.files)
            size = total // args.many_shards
            convert(src, out, fmt, encoding="raw", size=32, progress=False, shard_size=size)
        shards = len(open_dataset(out).manifest.files)
        outputs[f"{fmt}, {shards} shards"] = out
    if args.from_disk:
        read_from_disk(list(outputs.values()))
    reference = open_dataset(outputs[formats[0]])
    images, _ = collate(reference.__getitems__(list(range(len(reference)))))
    in_ram = images.permute(0, 2, 3, 1).contiguous()  # (N, H, W, C), as the files hold them
    n = len(in_ram)
    del images, reference
    best: dict[str, dict[str, float]] = {name: {} for name in outputs}
    paired: dict[str, list[float]] = {name: [] for name in outputs}
    limits, floors, array_floors, loader_floors = [], [], [], []
    prepared = Batch(in_ram[:256].permute(0, 3, 1, 2), torch.zeros(256, dtype=torch.int64))
    for round_ in range(args.repeats):
        count, seconds = index_select_limit(in_ram, 256, n, seed=round_)
        limits.append(count / seconds)
        floors.append(floor(n, prepared, None))
        array_floors.append(floor(n, prepared, ArrayBatches(n, 256, round_)))
        loader_floors.append(loader_floor(n, prepared, round_))
        for fmt in outputs:
            rates = {}
            ds = open_dataset(outputs[fmt])
            rates["first"] = _rate(measure(ds, 0, 256, n, collate, seed=round_))
            rates["later"] = _rate(measure(ds, 0, 256, n, collate, seed=round_ + 100))
            rates["batches"] = batches_rate(ds, round_)
            before = _rate(index_select_limit(in_ram, 256, n, seed=round_))
            rates["loader"] = loader_rate(ds, round_)
            after = _rate(index_select_limit(in_ram, 256, n, seed=round_))
            paired[fmt].append(rates["loader"] / ((before + after) / 2))
            unchecked = open_dataset(outputs[fmt], verify=False)
            measure(unchecked, 0, 256, n, collate, seed=round_)  # its files opened, as above
            rates["unchecked"] = _rate(measure(unchecked, 0, 256, n, collate, seed=round_ + 100))
            for key, value in rates.items():
                best[fmt][key] = max(best[fmt].get(key, 0.0), value)
    limit = max(limits)
    rows = [
        ("in-RAM index_select (the limit)", f"{limit:>12,.0f} samples/s"),
        (
            "DataLoader alone, shuffle=True",
            f"{max(floors):>12,.0f} samples/s (a prepared batch each time: its own cost)",
        ),
        ("DataLoader alone, array batches", f"{max(array_floors):>12,.0f} samples/s"),
        ("Loader alone, ShardSampler batches", f"{max(loader_floors):>12,.0f} samples/s"),
    ]
    for fmt in outputs:
        r = best[fmt]
        rows.append(
            (
                fmt,
                f"first epoch {r['first']:>10,.0f} ({r['first'] / limit:5.1%})  "
                f"later {r['later']:>10,.0f} ({r['later'] / limit:5.1%})  "
                f"unchecked {r['unchecked']:>10,.0f} ({r['unchecked'] / limit:5.1%})  "
                f"first epoch {r['first'] / r['unchecked']:.2f}x unchecked  "
                f"ShardSampler batches {r['batches']:>10,.0f} ({r['batches'] / limit:5.1%})  "
                f"Loader {r['loader']:>10,.0f} ({r['loader'] / limit:5.1%}; paired "
                f"{float(np.median(paired[fmt])):5.1%})",
            )
        )
    state = "read from disk" if args.from_disk else "as written"
    print_table(
        f"raw 32x32, {n} samples, batch 256, shuffle=True, num_workers=0, outputs {state}", rows
    )
    save_json(
        args.json,
        {
            "machine": machine(),
            "count": n,
            "from_disk": args.from_disk,
            "limit": limit,
            "limits": limits,
            "dataloader_floor": max(floors),
            "dataloader_floor_array_batches": max(array_floors),
            "loader_floor": max(loader_floors),
            "formats": best,
            "paired_loader_shares": paired,
        },
    )


def batches_rate(ds: Any, seed: int) -> float:
    """Samples/s of one epoch through ``DataLoader(batch_sampler=ShardSampler(...).batches(256))``
    with one window over the whole dataset (a full shuffle, as ``shuffle=True``)."""
    sampler = ShardSampler(ds, seed=seed, window=len(ds))
    return _epoch(DataLoader(ds, batch_sampler=sampler.batches(256), collate_fn=collate))


def loader_rate(ds: Any, seed: int) -> float:
    """Samples/s of one epoch through imgpack's ``Loader(batch_size=256, sampler=ShardSampler(...))``,
    one window over the whole dataset (a full shuffle)."""
    sampler = ShardSampler(ds, seed=seed, window=len(ds))
    return _epoch(Loader(ds, batch_size=256, sampler=sampler, collate_fn=collate))


def _epoch(loader: Any) -> float:
    start = time.perf_counter()
    seen = sum(len(labels) for _, labels in loader)
    return seen / (time.perf_counter() - start)


def _rate(measured: tuple[int, float]) -> float:
    count, seconds = measured
    return count / seconds


if __name__ == "__main__":
    torch.manual_seed(0)
    np.random.seed(0)
    main()
