"""A small, seeded sample image folder for demos and smoke runs (``imgpack sample DIR``).

Several classes of synthetic pictures (smooth gradients with shapes, so JPEG behaves as it does on
photos), mixing JPEG and PNG, sizes from 24 to 160 pixels and the modes RGB, L, RGBA and P.
The same ``seed`` always gives the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASS_NAMES = ("circle", "square", "stripes", "triangle", "noise")


def synthetic_image(rng: np.random.Generator, height: int, width: int, kind: str) -> Image.Image:
    """An RGB picture: a colour gradient with a shape drawn on it that depends on ``kind``."""
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    c0, c1, c2 = (rng.uniform(0, 255, size=3) for _ in range(3))
    pixels = np.clip(c0 + (c1 - c0) * x + (c2 - c0) * y, 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
    x0, y0 = int(width * rng.uniform(0.1, 0.4)), int(height * rng.uniform(0.1, 0.4))
    x1, y1 = int(width * rng.uniform(0.6, 0.9)), int(height * rng.uniform(0.6, 0.9))
    if kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif kind == "triangle":
        draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=fill)
    elif kind == "stripes":
        step = max(2, width // 8)
        for left in range(0, width, 2 * step):
            draw.rectangle((left, 0, left + step - 1, height), fill=fill)
    else:
        noise = rng.integers(0, 64, size=(height, width, 3), dtype=np.uint8)
        img = Image.fromarray(
            np.clip(pixels.astype(np.int16) + noise - 32, 0, 255).astype(np.uint8)
        )
    return img


def make_sample_folder(
    root: str | os.PathLike[str], num_images: int = 300, num_classes: int = 5, seed: int = 0
) -> Path:
    """Write ``num_images`` images spread over ``num_classes`` class folders under ``root``."""
    if not 1 <= num_classes <= len(CLASS_NAMES):
        raise ValueError(f"num_classes must be 1..{len(CLASS_NAMES)}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        kind = CLASS_NAMES[i % num_classes]
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        height, width = (int(v) for v in rng.integers(24, 161, size=2))
        img = synthetic_image(rng, height, width, kind)
        variant = i % 6
        if variant == 1:
            img = img.convert("L")
        elif variant == 2:
            alpha = Image.linear_gradient("L").resize(img.size)
            img = img.convert("RGBA")
            img.putalpha(alpha)
        elif variant == 3:
            img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        ext = "jpg" if variant in (0, 1, 4) else "png"
        if ext == "jpg":
            img.save(folder / f"{kind}_{i:04d}.jpg", quality=90)
        else:
            img.save(folder / f"{kind}_{i:04d}.png")
    return root
