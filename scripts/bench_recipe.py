"""The training recipe's random-resized crop (224, flip) at the speed of the decoder, against the
loaders a user would otherwise write, side by side in one run.

Two image sets, generated and seeded under --data (reused between runs): --count photo-like
JPEGs of ImageNet's usual sizes (about 500x400, quality 90), and --big photo-like JPEGs of 2 to 6
megapixels. Each is converted to `pt` with `encoding="original"` (the JPEGs kept as they are) and
with `--resize shorter --size 256 --encoding jpeg` (the static half of the recipe, done once: the
resized images stored as JPEG, quality 95, as ImageNet recipes keep them). Every contender
reads the same stored JPEG bytes (the originals; imgpack's shorter-256 output aside) in shuffled
batches (64; 4 for the 2-6 MP set) through `DataLoader(num_workers=W)`, W in --workers, with torchvision's box
algorithm (`RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3))` + a flip; the same boxes
for every Python contender: `imgpack.recipe`'s draw):

  imgpack          open_dataset(out, recipe=RandomResizedCrop(224)): the box drawn before the
                   decode, the JPEG decoded at the smallest DCT scale that covers it
  imgpack 256      the same over the output converted with --resize shorter --size 256
  pillow           ImageFolder's path: PIL open + convert("RGB"), crop, resize (bilinear), flip
  simplejpeg       the best hand-written loader: simplejpeg full decode, crop, resize, flip
  dali             DALI's CPU pipeline (readers.file, decoders.image_random_crop, resize, flip)
                   over the same files, num_threads = max(1, W)
  limit            cores x one core's rate of imgpack's own decode of the same boxes
                   (recipe.decode_box, torch on one thread), measured just before and just
                   after each of imgpack's epochs

Every figure is the best of --repeats rounds (images/s); the ratios are imgpack's over each
contender at the same W, and over the best limit. "paired" is imgpack's epoch over the mean of
the limits measured around it, round by round (median and range): the machine's speed drifts
between rounds, and a best-of ratio pairs figures from different moments.

    python scripts/bench_recipe.py [--count 1000] [--big 48] [--workers 0,1,2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from benchlib import class_folders, machine, make_photo_folder, photo_pixels, print_table
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from imgpack import convert, open_dataset
from imgpack.recipe import RandomResizedCrop, crop_resize, decode_box
from imgpack.stored import jpeg_mode
from imgpack.system import usable_cpus

RECIPE = RandomResizedCrop(224)
#: Batch size of the ImageNet-size set (16 batches an epoch of 1,000).
BATCH = 64
#: Batch size of the 2-6 MP set: an epoch of 48 images is then 12 batches, six for each of two
#: workers. In batches of 16 (three), one worker decoded two while the other idled after one,
#: and the epoch measured that imbalance (0.75 of the limit at 2 workers, 0.90 at 1).
BIG_BATCH = 4
#: 2 to 6 megapixel sizes (H, W), landscape and portrait.
BIG_SIZES = ((1200, 1600), (1536, 2048), (1800, 2400), (2000, 3000), (2448, 2448), (3000, 2000))


def make_big_folder(root: Path, count: int, seed: int = 1) -> Path:
    """``count`` seeded photo-like JPEGs of 2 to 6 megapixels, quality 90, in 4 classes."""
    done = root / ".complete"
    if done.exists():
        return root
    rng = class_folders(root, 4, seed)
    for i in range(count):
        height, width = BIG_SIZES[i % len(BIG_SIZES)]
        pixels = photo_pixels(rng, height, width, i)
        Image.fromarray(pixels).save(root / f"class{i % 4:02d}" / f"b{i:05d}.jpg", quality=90)
    done.touch()
    return root


class Files(Dataset[Any]):
    """A folder's JPEGs with the recipe's boxes (drawn from each file's size, as imgpack draws
    them), read by ``read(data, box, flip)``: the hand-written loaders."""

    def __init__(self, paths: list[Path], read: Callable[[bytes, tuple[int, ...], bool], Any]):
        self.paths, self.read = paths, read
        sizes = [jpeg_mode(p.read_bytes(), 3) for p in paths]
        self.heights = np.array([s[0] for s in sizes if s], np.int64)
        self.widths = np.array([s[1] for s in sizes if s], np.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        idx = np.array([index], np.int64)
        boxes = RECIPE.boxes(0, 0, idx, self.heights[idx], self.widths[idx])
        box = (int(boxes.top[0]), int(boxes.left[0]), int(boxes.height[0]), int(boxes.width[0]))
        pixels = self.read(self.paths[index].read_bytes(), box, bool(boxes.flip[0]))
        return torch.from_numpy(np.array(pixels)).permute(2, 0, 1)  # a copy, as ToTensor makes


def pillow_read(data: bytes, box: tuple[int, ...], flip: bool) -> np.ndarray:
    """torchvision's path on a PIL image: decode whole, crop, resize bilinear, flip."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    top, left, height, width = box
    img = img.crop((left, top, left + width, top + height)).resize((224, 224), Image.BILINEAR)
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def simplejpeg_read(data: bytes, box: tuple[int, ...], flip: bool) -> np.ndarray:
    """A full simplejpeg decode, then the same crop, resize and flip."""
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
    return crop_resize(pixels, tuple(float(v) for v in box), (224, 224), flip)  # type: ignore[arg-type]


def loader_rate(dataset: Dataset[Any], workers: int, batch: int, collate: Any = None) -> float:
    """Images/s of one shuffled epoch through DataLoader (worker start-up not counted). With
    workers, the epoch timed is the second: an epoch left midway would leave its prefetched
    batches to be decoded (and thrown away) when the next one starts, inside the timing."""
    loader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    if workers:  # a whole epoch: the workers started and warm, none left busy with it
        for _ in loader:
            pass
    start, count = time.perf_counter(), 0
    for batch in loader:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        count += len(images)
    return count / (time.perf_counter() - start)


def dali_rate(paths: list[Path], threads: int, batch: int) -> float | None:
    """Images/s of DALI's CPU pipeline over ``paths`` (one epoch), or ``None`` without DALI."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(
            files=[str(p) for p in paths], random_shuffle=True, name="reader"
        )
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=10,
        )
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    p.run()  # warm: threads started, the first batch decoded
    start, count = time.perf_counter(), 0
    while count < len(paths):
        images, _ = p.run()
        count += len(images)
    return count / (time.perf_counter() - start)


def limit_rate(payloads: list[bytes], heights: np.ndarray, widths: np.ndarray) -> float:
    """Cores x one core's rate of imgpack's decode of the recipe's boxes (in RAM): torch on
    one thread, as in a DataLoader worker (its resize kernel would use every core here)."""
    idx = np.arange(len(payloads), dtype=np.int64)
    boxes = RECIPE.boxes(0, 0, idx, heights, widths)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for k, data in enumerate(payloads):
            box = (boxes.top[k], boxes.left[k], boxes.height[k], boxes.width[k])
            decode_box(data, 3, box, RECIPE.size, bool(boxes.flip[k]))
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return usable_cpus() * len(payloads) / seconds


def pixel_difference(
    payloads: list[bytes], heights: np.ndarray, widths: np.ndarray
) -> tuple[float, float, float]:
    """How far imgpack's crops (the JPEG decoded at a reduced DCT scale where the box allows)
    are from the crop of a full decode of the same boxes (torchvision's path: the whole image
    decoded, then cropped, resized and flipped): the mean absolute difference per value, the
    99.9th percentile and the largest, over every image of the set."""
    idx = np.arange(len(payloads), dtype=np.int64)
    boxes = RECIPE.boxes(0, 0, idx, heights, widths)
    means, tails, peaks = [], [], []
    for k, data in enumerate(payloads):
        box = (boxes.top[k], boxes.left[k], boxes.height[k], boxes.width[k])
        flip = bool(boxes.flip[k])
        fast = decode_box(data, 3, box, RECIPE.size, flip).astype(np.int16)
        full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        exact = crop_resize(full, tuple(float(v) for v in box), RECIPE.size, flip)  # type: ignore[arg-type]
        difference = np.abs(fast - exact.astype(np.int16))
        means.append(float(difference.mean()))
        tails.append(float(np.percentile(difference, 99.9)))
        peaks.append(int(difference.max()))
    return float(np.mean(means)), float(np.max(tails)), float(np.max(peaks))


def run_set(
    name: str, src: Path, data: Path, workers: list[int], repeats: int, batch: int
) -> list[Any]:
    from imgpack.readers import collate

    paths = sorted(src.glob("*/*.jpg"))
    tag = f"{name.replace(' ', '')}-{len(paths)}"  # one output per image set
    original, shorter = data / f"recipe-{tag}-original", data / f"recipe-{tag}-256"
    if not (original / "imgpack.json").exists():
        shutil.rmtree(original, ignore_errors=True)
        convert(src, original, "pt", encoding="original", progress=False)
    if not (shorter / "imgpack.json").exists():
        shutil.rmtree(shorter, ignore_errors=True)
        convert(src, shorter, "pt", resize="shorter", size=256, encoding="jpeg", quality=95,
                progress=False)  # fmt: skip
    payloads = [p.read_bytes() for p in paths]
    files = {
        "pillow": Files(paths, pillow_read),
        "simplejpeg": Files(paths, simplejpeg_read),
    }
    heights, widths = files["pillow"].heights, files["pillow"].widths
    for out in (original, shorter):
        count = open_dataset(out).manifest.num_samples
        assert count == len(paths), f"{out}: {count} samples, the set has {len(paths)}"
    best: dict[tuple[str, int], float] = {}
    limits: list[float] = []
    paired: dict[int, list[float]] = {w: [] for w in workers}
    for _ in range(repeats):
        for w in workers:
            threads = max(1, w)
            # The limit just before and just after imgpack's epoch: their mean is the limit
            # this epoch ran against (the machine's speed drifts between rounds).
            before = limit_rate(payloads, heights, widths)
            ours = loader_rate(open_dataset(original, recipe=RECIPE), w, batch, collate)
            after = limit_rate(payloads, heights, widths)
            limits += [before, after]
            paired[w].append(ours / ((before + after) / 2))
            rates = {
                "imgpack": ours,
                "imgpack 256": loader_rate(open_dataset(shorter, recipe=RECIPE), w, batch, collate),
                "pillow": loader_rate(files["pillow"], w, batch),
                "simplejpeg": loader_rate(files["simplejpeg"], w, batch),
                "dali": dali_rate(paths, threads, batch) or 0.0,
            }
            for key, rate in rates.items():
                best[(key, w)] = max(best.get((key, w), 0.0), rate)
    limit = max(limits)
    mean, tail, peak = pixel_difference(payloads, heights, widths)
    rows = [
        (
            f"{name}: limit (cores x one-core decode of the boxes)",
            f"{limit:8,.0f} img/s, batches of {batch}",
        ),
        (
            f"{name}: imgpack's crops vs a full decode's",
            f"mean |difference| {mean:.2f}, 99.9th percentile {tail:.0f}, max {peak:.0f}"
            " (of 255, per value)",
        ),
    ]
    for w in workers:
        ours = best[("imgpack", w)]
        peers = {k: best[(k, w)] for k in ("pillow", "simplejpeg", "dali") if best[(k, w)]}
        top = max(peers.values()) if peers else 0.0
        rows.append(
            (
                f"{name}, {w} worker(s)",
                "  ".join(f"{k} {best[(k, w)]:7,.0f}" for k in ("imgpack", "imgpack 256"))
                + "  "
                + "  ".join(f"{k} {v:7,.0f}" for k, v in peers.items())
                + f"  | imgpack / best peer {ours / top:4.2f}x"
                + (f"  / dali {ours / peers['dali']:4.2f}x" if "dali" in peers else "")
                + f"  / limit {ours / limit:4.2f} (paired: median "
                + f"{float(np.median(paired[w])):4.2f}, {min(paired[w]):4.2f}-"
                + f"{max(paired[w]):4.2f})",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--big", type=int, default=48)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="bench-data")
    args = parser.parse_args()
    data = Path(args.data)
    workers = [int(w) for w in args.workers.split(",") if w]
    print(f"machine: {machine()}")
    rows: list[Any] = []
    if args.count:  # --count 0: the 2-6 MP set alone
        photos = make_photo_folder(data / f"photos-{args.count}", args.count)
        rows += run_set("imagenet-size", photos, data, workers, args.repeats, BATCH)
    if args.big:
        big = make_big_folder(data / f"big-photos-{args.big}", args.big)
        rows += run_set("2-6 MP", big, data, workers, args.repeats, BIG_BATCH)
    print_table(f"RandomResizedCrop(224) + flip, best of {args.repeats}", rows)


if __name__ == "__main__":
    main()
