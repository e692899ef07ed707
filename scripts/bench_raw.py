"""Raw reads in every format against the in-RAM gather limit, side by side in one run.

One dataset, generated and seeded under --data (reused between runs): --count 32x32 PNGs in
10 classes, converted with `--encoding raw` to every format. Each format is read through
`DataLoader(batch_size=256, shuffle=True, collate_fn=imgpack.readers.collate)`,
num_workers=0, in three ways:
  - first epoch: a new reader (`verify=None`, the default), which checks each record's
    checksum the first time it reads it;
  - later epoch: the same reader again (checked records only looked up in its bitmap);
  - unchecked: a reader with `verify=False`.
The limit is a bare `index_select` of the same shuffled batches from one in-RAM uint8 tensor
of all the images (no file, no label, no check): what any loader of these bytes can do at most
on this machine. Every figure is the best of --repeats rounds, the formats measured in turn
within each round, the limit at the start of each.

    python scripts/bench_raw.py [--count 50000] [--formats pt,lmdb] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
from benchlib import index_select_limit, machine, make_png_folder, print_table, save_json

from imgpack import convert, open_dataset
from imgpack.loading.bench import measure
from imgpack.readers import collate

FORMATS = ("pt", "lmdb", "hdf5", "tfrecord", "webdataset")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--repeats", type=int, default=3)
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
    reference = open_dataset(outputs[formats[0]])
    images, _ = collate(reference.__getitems__(list(range(len(reference)))))
    in_ram = images.permute(0, 2, 3, 1).contiguous()  # (N, H, W, C), as the files hold them
    n = len(in_ram)
    del images, reference
    best: dict[str, dict[str, float]] = {f: {} for f in formats}
    limits = []
    for round_ in range(args.repeats):
        count, seconds = index_select_limit(in_ram, 256, n, seed=round_)
        limits.append(count / seconds)
        for fmt in formats:
            rates = {}
            ds = open_dataset(outputs[fmt])
            rates["first"] = _rate(measure(ds, 0, 256, n, collate, seed=round_))
            rates["later"] = _rate(measure(ds, 0, 256, n, collate, seed=round_ + 100))
            unchecked = open_dataset(outputs[fmt], verify=False)
            measure(unchecked, 0, 256, n, collate, seed=round_)  # its files opened, as above
            rates["unchecked"] = _rate(measure(unchecked, 0, 256, n, collate, seed=round_ + 100))
            for key, value in rates.items():
                best[fmt][key] = max(best[fmt].get(key, 0.0), value)
    limit = max(limits)
    rows = [("in-RAM index_select (the limit)", f"{limit:>12,.0f} samples/s")]
    for fmt in formats:
        r = best[fmt]
        rows.append(
            (
                fmt,
                f"first epoch {r['first']:>10,.0f} ({r['first'] / limit:5.1%})  "
                f"later {r['later']:>10,.0f} ({r['later'] / limit:5.1%})  "
                f"unchecked {r['unchecked']:>10,.0f} ({r['unchecked'] / limit:5.1%})  "
                f"first epoch {r['first'] / r['unchecked']:.2f}x unchecked",
            )
        )
    print_table(f"raw 32x32, {n} samples, batch 256, shuffle=True, num_workers=0", rows)
    save_json(
        args.json,
        {"machine": machine(), "count": n, "limit": limit, "limits": limits, "formats": best},
    )


def _rate(measured: tuple[int, float]) -> float:
    count, seconds = measured
    return count / seconds


if __name__ == "__main__":
    torch.manual_seed(0)
    np.random.seed(0)
    main()
