"""A process forked after reads (raw batches over several shards, ``ds[i]``, encoded batches)
reads on without hanging: through ``os.fork``, a fork ``multiprocessing.Pool`` and DataLoader
workers under fork, spawn and forkserver. The parent has run torch's OpenMP thread pool first
(a large ``index_select``), as any training process has: GNU OpenMP is not fork-safe, so a
reader that gathered through a parallel torch op in the child would wait forever."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_uniform_folder
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.readers import collate

COUNT = 600
CASES = [(fmt, "raw") for fmt in FORMATS] + [("pt", "png"), ("webdataset", "png")]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("fork")
    src = build_uniform_folder(base / "src", count=COUNT, classes=3, size=32)
    made = {}
    for fmt, encoding in CASES:
        sharded = {"shard_size": 200_000} if fmt in ("pt", "tfrecord", "webdataset") else {}
        out = base / f"{fmt}-{encoding}"
        convert(src, out, format=fmt, encoding=encoding, size=32, progress=False, **sharded)
        made[fmt, encoding] = out
    return made


def _warm_openmp() -> None:
    """What a training process has done before it forks: a parallel torch op."""
    data = torch.zeros(8_000_000, dtype=torch.uint8).view(-1, 4000)
    torch.index_select(data, 0, torch.arange(2000))


def _read(ds: Any) -> int:
    images, labels = collate(ds.__getitems__(list(range(0, COUNT, 2))))
    image, label = ds[COUNT - 1]
    return int(labels.sum()) + int(label) + int(images.shape[0]) + int(image.shape[0])


def _read_one(ds: Any, index: int) -> int:
    return int(ds[index][1])


_POOLED: Any = None


def _pooled(index: int) -> int:
    return _read_one(_POOLED, index)


@pytest.mark.parametrize(("fmt", "encoding"), CASES)
def test_a_forked_process_reads_after_the_parent_did(
    outputs: dict[tuple[str, str], Path], fmt: str, encoding: str
) -> None:
    global _POOLED
    ds = open_dataset(outputs[fmt, encoding])
    expected = _read(ds)  # the parent reads: several shards, ds[i]
    _warm_openmp()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 with the same sums, killed by its alarm if it hangs
        signal.alarm(30)
        os._exit(0 if _read(ds) == expected else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    _POOLED = ds
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_pooled, range(0, COUNT, 37)).get(timeout=60)
    assert got == [_read_one(ds, i) for i in range(0, COUNT, 37)]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_read_after_the_parent_did(
    outputs: dict[tuple[str, str], Path], method: str
) -> None:
    ds = open_dataset(outputs["pt", "raw"])
    _read(ds)
    _warm_openmp()
    loader = DataLoader(
        ds, batch_size=64, num_workers=2, collate_fn=collate, multiprocessing_context=method,
        timeout=120,
    )  # fmt: skip
    labels = torch.cat([batch[1] for batch in loader])
    assert labels.tolist() == ds.targets


def test_the_read_side_has_no_address_tricks_and_gathers_in_one_place() -> None:
    """No ctypes memory mapping (a range reserved and files mapped into it); torch's
    ``index_select`` (OpenMP threads, which hang a forked process) only in the two gathers,
    each behind ``_torch_gathers``, which asks ``torch_may_gather``."""
    package = Path(__file__).resolve().parents[1] / "imgpack"
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert "MAP_FIXED" not in text and "libc.mmap" not in text, path
        if "formats" in path.parts and path.name != "gather.py":
            assert "index_select(" not in text, path
    base = (package / "formats" / "gather.py").read_text(encoding="utf-8")
    assert base.count("index_select(") == base.count("    if _torch_gathers(") == 2
    assert "and torch_may_gather()" in base
    assert not (package / "formats" / "span.py").exists()


def test_a_forked_child_with_threads_gathers_without_torch(
    outputs: dict[tuple[str, str], Path],
) -> None:
    """The rule itself: torch gathers in the process that opened the reader and in a child on
    one thread; numpy in a forked child with several threads."""
    from imgpack.formats import gather

    assert gather.torch_may_gather()
    pid = os.fork()
    if pid == 0:
        threads = torch.get_num_threads()
        ok = gather.torch_may_gather() == (threads == 1)
        torch.set_num_threads(1)
        os._exit(0 if ok and gather.torch_may_gather() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_forked_child_with_threads_resizes_crops_without_torch() -> None:
    """The recipe's JPEG crops are resized by torch's kernel where torch's threads may run, and
    by Pillow in a forked child with several threads (torch's pool would hang it there): the
    parent resizes through torch first, then the child's crop is Pillow's, pixel for pixel."""
    from imgpack import recipe

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)
    box = (5.0, 7.0, 80.0, 100.0)
    pillow = recipe.crop_resize(pixels, box, (32, 32), False)
    fast = recipe.crop_resize(pixels, box, (32, 32), False, exact=False)
    assert np.abs(fast.astype(np.int64) - pillow).max() <= 2
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(2)
        found = recipe.crop_resize(pixels, box, (32, 32), False, exact=False)
        os._exit(0 if np.array_equal(found, pillow) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
