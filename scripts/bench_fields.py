"""What per-sample fields cost: reading a caption with every image, and converting with fields.

One image set, generated and seeded under --data (reused between runs): --count photo-like
JPEGs of ImageNet's usual sizes (scripts/benchlib.py), and a JSON Lines label list of them with a
LAION-like caption (40-160 characters of text) and a JSON object (url, width, similarity) per
image. Each --formats output is written twice from that list, with `encoding="original"`: with
the caption field (`fields=("caption",)`) and without any (`fields=""`), the same images.

  read   open_dataset(out, size=224) through DataLoader(batch_size=256, shuffle=True,
         collate_fn=imgpack's collate), num_workers 0, 1 and 2 (the fit path: decode at the DCT
         scale that covers 224x224, then resize), the output with the caption read with
         `fields=("caption",)`: its rate over the rate without, in the same round
  convert  imgpack.convert(list, out, F, encoding="original", workers=cores), every field kept
         (caption and JSON) against `fields=""`, alternating: its rate over the rate without

Each ratio is the median over --repeats rounds (the two measured back to back in each, their
order alternating), with the spread. The budget (issue #43): reading with a caption at least
0.95 of the rate without it, converting with fields at least 0.95 of the rate without.

    python scripts/bench_fields.py [--count 2000] [--formats pt,webdataset] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from benchlib import machine, make_photo_folder, print_table, save_json

from imgpack import convert, open_dataset
from imgpack.loading.bench import measure
from imgpack.system import usable_cpus

#: The text captions are drawn from, word by word.
TEXT = (
    "a photo of the small red house by a lake at dawn with mountains behind and a boat on the "
    "shore seen from above in winter light soft focus high detail studio portrait of a dog"
)


def make_list(photos: Path, path: Path, seed: int = 0) -> Path:
    """A JSON Lines list of every photo under ``photos`` with a caption and a JSON object."""
    rng = np.random.default_rng(seed)
    words = TEXT.split(" ")
    lines = []
    for image in sorted(photos.glob("*/*.jpg")):
        caption = " ".join(rng.choice(words, int(rng.integers(8, 30))))
        meta = {
            "url": f"https://example.com/{image.parent.name}/{image.name}",
            "width": 500,
            "similarity": round(float(rng.random()), 4),
        }
        row = {"path": str(image.resolve()), "label": image.parent.name, "caption": caption}
        lines.append(json.dumps(row | {"meta": meta}))
    path.write_text("\n".join(lines) + "\n")
    return path


def convert_rate(src: Path, out: Path, fmt: str, fields: tuple[str, ...] | str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = convert(src, out, fmt, encoding="original", fields=fields, workers=usable_cpus(),
                       progress=False)  # fmt: skip
    return manifest.num_samples / (time.perf_counter() - start)


def read_rate(out: Path, workers: int, fields: tuple[str, ...], seed: int) -> float:
    ds = open_dataset(out, size=224, fields=fields)
    count, seconds = measure(ds, workers, 256, seed=seed)
    assert count >= len(ds), (count, len(ds))
    return count / seconds


def spread(ratios: list[float]) -> str:
    return f"{float(np.median(ratios)):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--formats", default="pt,webdataset")
    parser.add_argument("--data", default="bench-data")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--only", default="convert,read", help="convert, read or both")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    data = Path(args.data)
    photos = make_photo_folder(data / f"photos-{args.count}", args.count)
    src = make_list(photos, data / f"captions-{args.count}.jsonl")
    formats = [f for f in args.formats.split(",") if f]
    workers = [int(w) for w in args.workers.split(",") if w]
    print(f"machine: {machine()}")
    reads: dict[str, list[float]] = {}
    converts: dict[str, list[float]] = {}
    parts = args.only.split(",")
    for fmt in formats:
        with_out, without_out = data / f"fields-{fmt}-with", data / f"fields-{fmt}-without"
        for round_ in range(args.repeats if "convert" in parts else 0):
            pair = [("with", ("caption", "meta")), ("without", "")]
            rates = {}
            for name, fields in pair if round_ % 2 == 0 else pair[::-1]:
                out = data / f"fields-{fmt}-convert-{name}"
                rates[name] = convert_rate(src, out, fmt, fields)
                shutil.rmtree(out, ignore_errors=True)
            converts.setdefault(fmt, []).append(rates["with"] / rates["without"])
        if not (with_out / "imgpack.json").exists():
            convert(src, with_out, fmt, encoding="original", fields=("caption",), progress=False)
        if not (without_out / "imgpack.json").exists():
            convert(src, without_out, fmt, encoding="original", fields="", progress=False)
        for w in workers if "read" in parts else []:
            key = f"{fmt}, {w} worker(s)"
            for round_ in range(args.repeats):
                pair = [("with", with_out, ("caption",)), ("without", without_out, ())]
                rates = {}
                for name, out, fields in pair if round_ % 2 == 0 else pair[::-1]:
                    rates[name] = read_rate(out, w, fields, seed=round_)
                reads.setdefault(key, []).append(rates["with"] / rates["without"])
    rows = [(f"convert {fmt}, with / without fields", spread(r)) for fmt, r in converts.items()]
    rows += [(f"fit read {key}, caption / none", spread(r)) for key, r in reads.items()]
    print_table(f"{args.count} photos, encoding original, --repeats {args.repeats}", rows)
    save_json(args.json, {"machine": machine(), "convert": converts, "read": reads})


if __name__ == "__main__":
    main()
