"""Benchmark of the pt format: 50,000 32x32 PNGs (10 classes), converted to pt raw, read back.

Reports, measured side by side in one run: the ImageFolder-style baseline (Pillow decode per file,
DataLoader num_workers=2), PTDataset through DataLoader(batch_size=256, shuffle=True) with
imgpack.readers.collate (num_workers 0 and 2) and with torch's default collate, a hand-written
in-RAM per-sample dataset (``X[i], int(Y[i])``) with torch's default collate, DataLoader's own
hand-over floor at num_workers=2 (a dataset returning the same preallocated batch, without and
with labels), and the memory-bound limit (a bare in-RAM index_select gather of the same
batches); plus conversion time and peak memory (RSS). The readers are measured in turn, round
after round (--repeats), best of the rounds.

    python scripts/bench_pt.py [--count 50000] [--data bench-data] [--json results.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    best_of,
    index_select_limit,
    machine,
    make_png_folder,
    print_table,
    run_with_peak_rss,
    save_json,
)
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from imgpack import open_dataset
from imgpack.loading.bench import FolderDataset, measure
from imgpack.readers import collate


class HandWritten(Dataset[tuple[torch.Tensor, int]]):
    """What a user writes for data already in RAM: one sample per ``__getitem__``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class Preallocated(Dataset[Any]):
    """DataLoader's own hand-over floor: every batch is the same preallocated tensor (with a
    preallocated label tensor when ``labels``), so a worker does no work but hand it over."""

    def __init__(self, batch: int, shape: tuple[int, ...], labels: bool) -> None:
        height, width, channels = shape
        self.images = torch.zeros((batch, channels, height, width), dtype=torch.uint8)
        self.labels = torch.zeros(batch, dtype=torch.int64) if labels else None
        self.count = 50_000

    def __len__(self) -> int:
        return self.count

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, Any]:
        n = len(indices)
        return self.images[:n], (self.labels[:n] if self.labels is not None else range(n))


def _as_is(batch: Any) -> Any:
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--baseline-samples", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    data = Path(args.data)
    src = make_png_folder(data / f"png32-{args.count}", args.count, 32, 10)
    dst = data / f"pt-raw32-{args.count}"
    shutil.rmtree(dst, ignore_errors=True)
    convert_cmd = [sys.executable, "-m", "imgpack.cli", "convert", str(src), str(dst)]
    convert_cmd += ["--format", "pt", "--encoding", "raw", "--size", "32", "--quiet"]
    seconds, rss_main, rss_tree = run_with_peak_rss(convert_cmd)

    ds = open_dataset(dst)
    bs, n = args.batch_size, len(ds)
    baseline = best_of(
        1, lambda: measure(FolderDataset(src), 2, bs, args.baseline_samples, default_collate)
    )
    images = torch.cat([ds._shard(i)["images"].clone() for i in range(len(ds.manifest.files))])
    labels = torch.cat([ds._shard(i)["labels"].clone() for i in range(len(ds.manifest.files))])
    hand = HandWritten(images.permute(0, 3, 1, 2), labels)
    floor = Preallocated(bs, tuple(images.shape[1:]), False)
    floor_labels = Preallocated(bs, tuple(images.shape[1:]), True)
    rates: dict[str, list[float]] = {}
    runs = {  # measured in turn, round after round; best of the rounds
        "pt_collate_w0": lambda: measure(ds, 0, bs, n, collate),
        "pt_default_w0": lambda: measure(ds, 0, bs, n, None),
        "hand_default_w0": lambda: measure(hand, 0, bs, n, None),
        "pt_collate_w2": lambda: measure(ds, 2, bs, n, collate),
        "floor_w2": lambda: measure(floor, 2, bs, n, _as_is),
        "floor_labels_w2": lambda: measure(floor_labels, 2, bs, n, _as_is),
        "limit": lambda: index_select_limit(images, bs, n),
    }
    for _ in range(args.repeats):
        for name, run in runs.items():
            samples, took = run()
            rates.setdefault(name, []).append(samples / took)
    best = {name: max(values) for name, values in rates.items()}
    pt_fast0, pt_fast2, pt_default0 = (
        best["pt_collate_w0"],
        best["pt_collate_w2"],
        best["pt_default_w0"],
    )
    limit = best["limit"]
    best_pt = max(pt_fast0, pt_fast2)

    print(f"machine: {machine()}")
    print(f"data: {n} images 32x32x3 in {src}, batch_size={bs}, shuffle=True")
    print_table(
        "conversion (pt raw)",
        [
            ("time", f"{seconds:.1f} s ({n / seconds:,.0f} images/s)"),
            ("peak RSS, main process", f"{rss_main / 2**20:,.0f} MiB"),
            ("peak RSS, with workers", f"{rss_tree / 2**20:,.0f} MiB"),
            ("output", f"{ds.manifest.total_bytes / 2**20:,.0f} MiB"),
        ],
    )
    print_table(
        "reads (samples/s)",
        [
            ("ImageFolder-style baseline, num_workers=2", f"{baseline:>12,.0f}"),
            ("PTDataset + collate, num_workers=0", f"{pt_fast0:>12,.0f}"),
            ("PTDataset + collate, num_workers=2", f"{pt_fast2:>12,.0f}"),
            ("PTDataset + default collate, num_workers=0", f"{pt_default0:>12,.0f}"),
            (
                "hand-written X[i], int(Y[i]) + default collate, w=0",
                f"{best['hand_default_w0']:>12,.0f}",
            ),
            ("floor: preallocated batch, num_workers=2", f"{best['floor_w2']:>12,.0f}"),
            ("floor: preallocated batch + labels, w=2", f"{best['floor_labels_w2']:>12,.0f}"),
            ("limit: in-RAM index_select", f"{limit:>12,.0f}"),
        ],
    )
    print_table(
        "ratios (best PTDataset + collate)",
        [
            ("of the index_select limit", f"{best_pt / limit:.1%}  (target >= 25%)"),
            ("vs the baseline", f"{best_pt / baseline:,.0f}x  (target >= 50x)"),
            ("fast collate vs default collate", f"{pt_fast0 / pt_default0:.1f}x"),
            (
                "default collate vs hand-written dataset",
                f"{pt_default0 / best['hand_default_w0']:.2f}x  (target >= 1.0x)",
            ),
            (
                "workers=2 vs the hand-over floor",
                f"{pt_fast2 / best['floor_w2']:.0%} (images only), "
                f"{pt_fast2 / best['floor_labels_w2']:.0%} (images + labels)  (target >= 80%)",
            ),
        ],
    )
    save_json(
        args.json,
        {
            "machine": machine(),
            "count": n,
            "convert_seconds": seconds,
            "convert_peak_rss_main": rss_main,
            "convert_peak_rss_tree": rss_tree,
            "baseline": baseline,
            "pt_collate_w0": pt_fast0,
            "pt_collate_w2": pt_fast2,
            "pt_default_collate_w0": pt_default0,
            "limit": limit,
            "rounds": rates,
        },
    )


if __name__ == "__main__":
    main()
