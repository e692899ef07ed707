"""Seeded fake image folders for the tests, and an independent decode to compare against."""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from PIL import Image, ImageOps

T = TypeVar("T")


def traced(make: Callable[[], T]) -> tuple[T, int, int]:
    """What ``make()`` returns, with the bytes of what it allocated that are still held once
    it returns and at its peak (tracemalloc, started just before it): a driver's memory per
    sample, measured."""
    tracemalloc.start()
    try:
        made = make()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return made, held, peak


# Nothing a test does may reach the network: Hugging Face datasets stay offline.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Nor the user's cache: outputs read from buckets and conversions to buckets (their build
# folders) go to a cache of this test process, removed when it ends (subprocesses inherit it).
_CACHE = tempfile.mkdtemp(prefix="imgpack-test-cache-")
os.environ["IMGPACK_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

BACKGROUND = (255, 255, 255)


def smooth_rgb(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth RGB picture (gradient + a block), so JPEG errors stay small as on photos."""
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    a, b, c = (rng.uniform(0, 255, size=3) for _ in range(3))
    pixels = a + (b - a) * x + (c - a) * y
    pixels[height // 4 : height // 2, width // 4 : width // 2] = rng.uniform(0, 255, size=3)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def jpeg_bytes(img: Image.Image, **kwargs: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=92, **kwargs)
    return out.getvalue()


def png_bytes(img: Image.Image, **kwargs: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG", **kwargs)
    return out.getvalue()


@dataclass
class FakeFolder:
    """What the factory wrote: the root, the expected classes and the valid images in scan order."""

    root: Path
    classes: list[str]
    images: list[tuple[str, int]] = field(default_factory=list)  # (relative path, label)
    bad: dict[str, str] = field(default_factory=dict)  # relative path -> what is wrong


def build_edge_folder(root: Path, seed: int = 0, with_bad: bool = False) -> FakeFolder:
    """Every case the image policy and the scan must handle, in a few dozen small files."""
    rng = np.random.default_rng(seed)
    classes = ["ant", "bee", "cat", "dog_empty"]
    for name in classes:
        (root / name).mkdir(parents=True)
    files: dict[str, bytes] = {}

    def rgb(h: int = 20, w: int = 28) -> Image.Image:
        return Image.fromarray(smooth_rgb(rng, h, w), "RGB")

    # ant: plain and EXIF-rotated JPEGs, CMYK and grayscale JPEGs, a PNG named .jpg
    files["ant/plain.jpg"] = jpeg_bytes(rgb())
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    files["ant/exif_rotated.jpg"] = jpeg_bytes(rgb(16, 30), exif=exif.tobytes())
    files["ant/cmyk.jpg"] = jpeg_bytes(rgb().convert("CMYK"))
    files["ant/gray.jpg"] = jpeg_bytes(rgb().convert("L"))
    files["ant/png_named.jpg"] = png_bytes(rgb(12, 14))
    # bee: every PNG mode
    gray16 = (smooth_rgb(rng, 18, 22)[:, :, 0].astype(np.uint16) * 257) + rng.integers(
        0, 200, (18, 22)
    ).astype(np.uint16)
    files["bee/gray16.png"] = png_bytes(Image.fromarray(gray16))
    pal = rgb(16, 16).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    files["bee/palette_transparent.png"] = png_bytes(pal, transparency=3)
    files["bee/palette_opaque.png"] = png_bytes(
        rgb(16, 16).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    )
    la = rgb().convert("L").convert("LA")
    la.putalpha(Image.fromarray(rng.integers(0, 256, (20, 28), dtype=np.uint8)))
    files["bee/la.png"] = png_bytes(la)
    rgba = rgb().convert("RGBA")
    rgba.putalpha(Image.fromarray(rng.integers(0, 256, (20, 28), dtype=np.uint8)))
    files["bee/rgba.png"] = png_bytes(rgba)
    files["bee/gray.png"] = png_bytes(rgb().convert("L"))
    files["bee/bilevel.png"] = png_bytes(rgb().convert("1"))
    files["bee/rgb.png"] = png_bytes(rgb(24, 20))
    files["bee/UPPER.PNG"] = png_bytes(rgb(10, 10))
    # cat: nested folders, non-ASCII names, other containers
    files["cat/nested/deeper/deep.png"] = png_bytes(rgb())
    files["cat/nested/a.png"] = png_bytes(rgb())
    files["cat/nested-x/b.png"] = png_bytes(rgb())
    files["cat/café_ñ_日本.png"] = png_bytes(rgb())
    files["cat/anim.gif"] = _gif_bytes(rgb())
    files["cat/pic.bmp"] = _save(rgb(), "BMP")
    files["cat/pic.webp"] = _save(rgb(), "WEBP", lossless=True)
    # ignored: hidden files and folders, non-image extensions
    files["cat/.hidden.png"] = png_bytes(rgb())
    files["cat/.cache/x.png"] = png_bytes(rgb())
    files["cat/notes.txt"] = b"not an image, and not named like one\n"
    if with_bad:
        files["cat/truncated.jpg"] = jpeg_bytes(rgb(64, 64))[:300]
        files["cat/zero.jpg"] = b""
        files["cat/text_named.jpg"] = b"hello, I am text\n"
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / ".hidden_class").mkdir()
    (root / ".hidden_class" / "x.png").write_bytes(png_bytes(rgb()))
    # a symlinked image (outside the tree) and a symlink loop
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    (outside / "target.png").write_bytes(png_bytes(rgb()))
    os.symlink(outside / "target.png", root / "cat" / "linked.png")
    os.symlink(root / "cat", root / "cat" / "nested" / "loop")

    bad = {}
    if with_bad:
        bad = {
            "cat/text_named.jpg": "not an image",
            "cat/truncated.jpg": "truncated",
            "cat/zero.jpg": "empty file",
        }
    images = []
    for label, name in enumerate(classes):
        found = []
        for rel in files:
            parts = rel.split("/")
            if parts[0] != name or any(p.startswith(".") for p in parts) or rel.endswith(".txt"):
                continue
            if rel in bad:
                continue
            found.append(rel)
        if name == "cat":
            found.append("cat/linked.png")
        found.sort(key=lambda r: (r.rsplit("/", 1)[0], r.rsplit("/", 1)[1]))
        images.extend((rel, label) for rel in found)
    return FakeFolder(root, classes, images, bad)


def _save(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()


def _gif_bytes(img: Image.Image) -> bytes:
    frames = [img.convert("P"), img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).convert("P")]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    return out.getvalue()


def reference_pixels(
    path: Path,
    size: tuple[int, int] | None = None,
    grayscale: bool = False,
    background: tuple[int, int, int] = BACKGROUND,
) -> np.ndarray:
    """An independent decode under the documented policy, HxWxC uint8."""
    with Image.open(path) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
        mode = img.mode
        if mode in ("I;16", "I;16B", "I;16L", "I"):
            v = np.asarray(img, dtype=np.float64)
            gray = np.floor(np.clip(v, 0, 65535) * 255 / 65535 + 0.5).astype(np.uint8)
            pixels = np.stack([gray] * 3, axis=2)
        elif mode in ("RGBA", "LA") or "transparency" in img.info:
            rgba = np.asarray(img.convert("RGBA"), dtype=np.float64)
            a = rgba[:, :, 3:4]
            out = (rgba[:, :, :3] * a + np.asarray(background, dtype=np.float64) * (255 - a)) / 255
            pixels = np.floor(out + 0.5).astype(np.uint8)
        else:
            pixels = np.asarray(img.convert("RGB"))
    if size is not None:
        fitted = ImageOps.fit(
            Image.fromarray(pixels), (size[1], size[0]), method=Image.Resampling.BILINEAR
        )
        pixels = np.asarray(fitted)
    if grayscale:
        pixels = np.asarray(Image.fromarray(pixels).convert("L"))[:, :, None]
    return pixels


@pytest.fixture
def edge_folder(tmp_path: Path) -> FakeFolder:
    return build_edge_folder(tmp_path / "src")


@pytest.fixture
def bad_folder(tmp_path: Path) -> FakeFolder:
    return build_edge_folder(tmp_path / "src", with_bad=True)


def build_uniform_folder(
    root: Path, count: int = 60, classes: int = 3, size: int = 16, seed: int = 1
) -> Path:
    """``count`` same-sized RGB PNGs spread over ``classes`` folders (for the reader tests)."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:04d}.png")
    return root


def manifest_file(output: Path) -> Path:
    """The file that holds ``output``'s manifest: ``imgpack.json``, or in a part written by
    shard tasks apart from the others (the default for sharded formats), its part's manifest
    (``.imgpack-part-I-of-K.json``)."""
    from imgpack.manifest import MANIFEST_NAME, PART_MANIFEST_GLOB

    if (output / MANIFEST_NAME).exists():
        return output / MANIFEST_NAME
    (found,) = sorted(output.glob(PART_MANIFEST_GLOB))
    return found


def output_manifest(output: Path) -> Any:
    """``output``'s manifest (:func:`manifest_file`), an output's or a part's."""
    from imgpack.manifest import read_manifest_file

    return read_manifest_file(manifest_file(output))


def rewrite_manifest(output: Path, manifest: Any) -> None:
    """Replace ``output``'s manifest (:func:`manifest_file`) with ``manifest``."""
    from imgpack.manifest import manifest_bytes

    manifest_file(output).write_bytes(manifest_bytes(manifest))


def refresh_manifest(output: Path) -> None:
    """Record the current size and sha256 of every file in ``output``'s manifest, as if the
    damage a test made through a format's own library (LMDB, h5py, torch) had been there when
    the output was written: the readers' per-record checks must find it."""
    from imgpack.manifest import sha256_file

    manifest = output_manifest(output)
    for entry in [*manifest.files, *(c for e in manifest.files for c in e.companions)]:
        entry.bytes = (output / entry.path).stat().st_size
        entry.sha256 = sha256_file(output / entry.path)
    rewrite_manifest(output, manifest)


@pytest.fixture
def uniform_folder(tmp_path: Path) -> Path:
    return build_uniform_folder(tmp_path / "uniform")


def slow_cli(seconds: float = 0.02, gate: Path | None = None, commit: int | None = None) -> str:
    """Python source of an `imgpack` CLI whose every image takes at least ``seconds`` to
    process (forked pool workers inherit the slowdown), so that a test can act on a running
    conversion: ``[sys.executable, "-c", slow_cli(), "convert", ...]``. With ``gate``, every
    image also waits while that file exists: the run cannot finish before the test removes it
    (an event, not a race against the clock). With ``commit``, the one writer of ``lmdb`` and
    ``hdf5`` makes its records durable (and saves a checkpoint) every ``commit`` records instead
    of every 1,000, so that a small source's run has checkpoints to resume from."""
    commits = (
        "import imgpack.formats.lmdb.writer as lmdb_writer, imgpack.formats.hdf5.writer as h5\n"
        f"lmdb_writer.COMMIT_RECORDS = h5.BLOCK_RECORDS = {commit}\n"
        if commit
        else ""
    )
    return f"""
import os, sys, time
import imgpack.sources.folder.source as folder_source
real = folder_source.process_file
def slow(*args):
    time.sleep({seconds})
    while {str(gate)!r} != "None" and os.path.exists({str(gate)!r}):
        time.sleep(0.01)
    return real(*args)
folder_source.process_file = slow
{commits}from imgpack.cli import main
sys.argv[0] = "imgpack"
main()
"""


def append_sources(base: Path, count: int) -> tuple[Path, Path]:
    """Two folders for appending one to an output of the other: ``a`` (classes class0 and
    class1) and ``b`` (class1, as in ``a``, then class2 and class3, new), ``count`` PNGs each."""
    first = build_uniform_folder(base / "a", count=count, classes=2)
    second = build_uniform_folder(base / "b", count=count, classes=3, seed=7)
    (second / "class0").rename(second / "class3")
    return first, second


@pytest.fixture(scope="module")
def append_src(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """:func:`append_sources` of the module's ``APPEND_COUNT`` images each (default 12)."""
    count = getattr(request.module, "APPEND_COUNT", 12)
    return append_sources(tmp_path_factory.mktemp("src"), count)


@pytest.fixture(scope="module")
def first(append_src: tuple[Path, Path]) -> Path:
    """The folder appended to (an output of it): classes class0 and class1."""
    return append_src[0]


@pytest.fixture(scope="module")
def second(append_src: tuple[Path, Path]) -> Path:
    """The folder appended: classes class1 (also in ``first``), then class2 and class3 (new)."""
    return append_src[1]


def tree_hashes(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root`` by relative path (LMDB's ``lock.mdb`` aside:
    a reader's, not the output's)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    }


def read_all(ds: Any) -> Any:
    """Every sample of the reader ``ds``, in order, as one ``(images, labels)`` batch."""
    from imgpack.readers import collate

    return collate(ds.__getitems__(list(range(len(ds)))))


def check_appended(ds: Any, old: Any, alone: Any, old_id: str) -> Any:
    """The output ``ds`` after appending :func:`append_sources`' ``b`` to ``a``'s output:
    ``old`` (its pixels and labels before) first, then the samples of ``alone`` (``b``
    converted by itself) with their class names; the classes of both in order, statistics of
    every sample, the append recorded with the id before it. Returns its pixels and labels."""
    import torch

    manifest, count = ds.manifest, len(old[0])
    assert manifest.classes == ["class0", "class1", "class2", "class3"]
    pixels, labels = read_all(ds)
    assert torch.equal(pixels[:count], old[0]) and torch.equal(labels[:count], old[1])
    alone_pixels, alone_labels = read_all(alone)
    assert torch.equal(pixels[count:], alone_pixels)
    assert [manifest.classes[i] for i in labels[count:]] == [alone.classes[i] for i in alone_labels]
    assert manifest.stats is not None and manifest.stats["per_class"] == [
        int((labels == k).sum()) for k in range(4)
    ]
    record = manifest.source["appended"][0]
    assert record["samples"] == len(alone) and record["new_classes"] == ["class2", "class3"]
    assert record["output_id_before"] == old_id and manifest.output_id != old_id
    return pixels, labels


def append_reference(first: Path, second: Path, tmp_path: Path, args: list[str]) -> Path:
    """``tmp_path/reference``: ``second`` appended to ``first``'s output, uninterrupted; and
    ``tmp_path/out``, ``first``'s output to append to (returned), both with ``args``."""
    reference, out = tmp_path / "reference", tmp_path / "out"
    cli_convert([str(first), str(reference), *args])
    cli_convert([str(second), str(reference), "--append", *args])
    cli_convert([str(first), str(out), *args])
    return out


def cli_convert(args: list[str]) -> None:
    """``imgpack convert ARGS -q`` through click's runner; it must succeed."""
    from click.testing import CliRunner

    from imgpack.cli import main

    done = CliRunner().invoke(main, ["convert", *args, "-q"])
    assert done.exit_code == 0, done.output


class CountingExecutor:
    """The local pool with 2 workers, recording what its tasks were given (a listing's folders,
    a label list's objects); ``runs_tasks=False``: an executor that runs no tasks (converts
    samples only)."""

    def __init__(self, runs_tasks: bool = True) -> None:
        from imgpack.executors import LocalExecutor

        self.inner, self.workers, self.given = LocalExecutor(2), 2, []
        if runs_tasks:
            self.tasks = self._tasks

    def outcomes(self, job: Any, samples: Any) -> Any:
        return self.inner.outcomes(job, samples)

    def _tasks(self, function: Any, items: Any) -> Any:
        for item, result in self.inner.tasks(function, items):
            self.given.append(item)
            yield item, result

    def alone(self, job: Any, samples: Any) -> Any:
        return self.inner.alone(job, samples)


def kill_when(command: list[str], reached: Callable[[], bool], seconds: float = 120) -> None:
    """Run ``command`` in a session of its own and SIGKILL it, with its pool workers, once
    ``reached()`` (polled); it must not finish before."""
    process = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not reached():
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def count_shard_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The numbers of the shards shard tasks write from now on in this process (workers=1:
    its tasks run here), in the order written."""
    import imgpack.direct as direct

    written: list[int] = []
    real = direct.write_shard

    def counting(task: direct.ShardTask) -> dict[str, Any]:
        written.append(task.number)
        return real(task)

    monkeypatch.setattr(direct, "write_shard", counting)
    return written


def pip_install(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package at ``package`` (tests/plugins/...), pip-installed into a folder of
    its own (put it on PYTHONPATH to use it); built from a copy, since builds leave files
    beside the sources."""
    site = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / package.name
    shutil.copytree(package, source)
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--no-build-isolation", "--disable-pip-version-check", "--target", str(site)),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    return site


def start_moto(port: int) -> subprocess.Popen[bytes]:
    """moto's S3 server on 127.0.0.1:``port``, once it answers (the caller stops it)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.terminate()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.2)


#: Network, PID and mount namespaces of their own for tests that start servers: only loopback
#: (no byte leaves 127.0.0.1), and every process started inside dies with the namespace (no
#: `ray stop`, which would stop any Ray it can see). Needs root, which CI has.
NAMESPACES = ["unshare", "-n", "-p", "-f", "-m", "--mount-proc"]


def can_isolate() -> bool:
    """Whether :data:`NAMESPACES` can be made here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run([*NAMESPACES, "true"], capture_output=True).returncode == 0


def isolated(script: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``script`` run by bash in :data:`NAMESPACES`, loopback up (``kwargs`` to subprocess.run).

    The script runs in a subshell, so that bash stays the namespace's PID 1 and reaps the
    processes orphaned there (a Python PID 1 would not: Ray's client server then finds its
    own children as zombies and fails to start)."""
    command = [*NAMESPACES, "bash", "-c", f"ip link set lo up\n(\n{script}\n)"]
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


# -- a real S3 API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 and the AWS variables pointing at it (credentials are
    dummies); yields a bucket URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_moto(port)
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("imgpack-test")
        yield "s3://imgpack-test"
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fsspec.filesystem("s3").clear_instance_cache()
