"""GPU check: DeviceLoader against a pinned-memory DataLoader over the same .pt output.

Generates its own data (seeded), in one short run:
  - 50,000 images 32x32, stored raw (pt);
  - 10,000 images 224x224, stored raw (pt);
and for each, times epochs of DeviceLoader (preloaded uint8, per-batch float conversion and
normalization on the GPU) against DataLoader(pin_memory=True, num_workers=N, collate_fn=collate)
with the batch moved to the GPU and converted the same way. Prints samples/s and the ratio.

    python scripts/gpu_check.py [--workers 4] [--epochs 3] [--data bench-data]

On a machine without CUDA it exits with a message and status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.readers import DeviceLoader, collate

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_folder(root: Path, count: int, size: int, seed: int = 0) -> Path:
    done = root / ".complete"
    if done.exists():
        return root
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(64, size, size, 3), dtype=np.uint8)
    for i in range(count):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.roll(base[i % 64], shift=i // 64, axis=1)  # distinct, cheap to make
        Image.fromarray(pixels).save(folder / f"{i:06d}.png", compress_level=0)
    done.touch()
    return root


def time_epochs(batches: object, epochs: int, device: torch.device) -> float:
    """Samples/s over ``epochs`` epochs after one warm-up epoch; ``batches()`` yields GPU batches."""
    count = 0
    for epoch in range(epochs + 1):
        if epoch == 1:
            torch.cuda.synchronize(device)
            start, count = time.perf_counter(), 0
        for images, _ in batches():  # type: ignore[operator]
            count += len(images)
    torch.cuda.synchronize(device)
    return count / (time.perf_counter() - start)


def compare(out: Path, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """(DeviceLoader samples/s, DataLoader samples/s) over the output ``out``."""
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    preloaded = DeviceLoader(
        out,
        device=device,
        batch_size=args.batch_size,
        dtype=torch.float32,
        normalize=(MEAN, STD),
        progress=False,
    )
    loader = DataLoader(
        open_dataset(out), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        pin_memory=True, persistent_workers=args.workers > 0, collate_fn=collate,
    )  # fmt: skip

    def streamed() -> object:
        for images, labels in loader:
            x = images.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
            yield x, labels.to(device, non_blocking=True)

    return time_epochs(lambda: iter(preloaded), args.epochs, device), time_epochs(
        streamed, args.epochs, device
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--data", default="bench-data")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    print(
        f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, DataLoader num_workers={args.workers}"
    )
    print(f"{'dataset':<22} {'DeviceLoader':>14} {'DataLoader':>14} {'ratio':>7}")
    for count, size in ((50_000, 32), (10_000, 224)):
        data = Path(args.data)
        src = make_folder(data / f"gpu-png{size}-{count}", count, size)
        out = data / f"gpu-pt{size}-{count}"
        if not (out / "imgpack.json").exists():
            convert(src, out, "pt", encoding="raw", size=size, progress=False)
        gpu_rate, cpu_rate = compare(out, args, device)
        print(
            f"{f'{count} x {size}x{size}':<22} {gpu_rate:>14,.0f} {cpu_rate:>14,.0f} {gpu_rate / cpu_rate:>6.1f}x"
        )
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
