"""A memory-mapped shard cut (truncated in place) or replaced after a reader first used it: the
next batch that touches it is an imgpack error or the right data, never another shard's pixels
and never a SIGBUS. Each case runs in a subprocess, so a signal shows as one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_uniform_folder

from imgpack import convert
from imgpack.converters import FORMATS

CHILD = r"""
import os, sys, warnings
warnings.simplefilter("ignore")
import torch
from imgpack import open_dataset
from imgpack.errors import DataError
from imgpack.readers import collate
root, how = sys.argv[1], sys.argv[2]
ds = open_dataset(root)
want = collate(open_dataset(root).__getitems__(list(range(len(ds)))))
first = collate(ds.__getitems__(list(range(0, len(ds), 3))))  # maps every shard it touches
victim = os.path.join(root, ds.manifest.files[0].path)
if how == "cut":
    os.truncate(victim, os.path.getsize(victim) // 3)
else:  # replaced by another file of the same name: the reader keeps the one it mapped
    data = open(victim, "rb").read()
    with open(victim + ".new", "wb") as out:
        out.write(data[: len(data) // 3])
    os.replace(victim + ".new", victim)
try:
    got = collate(ds.__getitems__(list(range(len(ds)))))
    single = ds[0]
except DataError as exc:
    print("refused:", exc, flush=True)
    sys.exit(0)
same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
print("read", "the same" if same else "OTHER DATA", flush=True)
sys.exit(0 if same else 3)
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("cut")
    build_uniform_folder(base / "src", count=60, classes=3, size=16)
    return base


@pytest.mark.parametrize("how", ["cut", "replaced"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shard_cut_or_replaced_under_a_reader_is_refused_or_read_right(
    outputs: Path, fmt: str, how: str
) -> None:
    out = outputs / f"{fmt}-{how}"
    sharded = {"shard_size": 6000} if fmt in ("pt", "tfrecord", "webdataset") else {}
    convert(outputs / "src", out, format=fmt, encoding="raw", size=16, progress=False, **sharded)
    ran = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), how], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, f"exit {ran.returncode}: {ran.stdout}{ran.stderr[-2000:]}"
    if how == "cut":
        assert "refused:" in ran.stdout and "cut while it was read" in ran.stdout, ran.stdout


AFTER_OPEN = r"""
import os, sys, warnings
warnings.simplefilter("ignore")
from imgpack import open_dataset
from imgpack.errors import DataError
root = sys.argv[1]
ds = open_dataset(root)  # opened, nothing read yet
victim = os.path.join(root, ds.manifest.files[0].path)
os.truncate(victim, os.path.getsize(victim) // 3)
try:
    ds.__getitems__(list(range(len(ds))))
except DataError as exc:
    print("refused:", exc, flush=True)
"""

IN_WORKERS = r"""
import os, sys, warnings
warnings.simplefilter("ignore")
from torch.utils.data import DataLoader
from imgpack import open_dataset
from imgpack.errors import DataError
from imgpack.readers import collate
root, warm = sys.argv[1], sys.argv[2] == "warm"
ds = open_dataset(root)
if warm:  # the main process maps the shards (and builds what it builds) before the fork
    for _ in range(3):
        ds.__getitems__(list(range(len(ds))))
victim = os.path.join(root, ds.manifest.files[0].path)
loader = DataLoader(ds, batch_size=4, shuffle=False, num_workers=2, collate_fn=collate,
                    persistent_workers=True, prefetch_factor=1)
try:
    for epoch in range(3):
        if epoch == 2:  # the workers are idle between epochs (none is copying out of the map)
            os.truncate(victim, os.path.getsize(victim) // 3)
        for _ in loader:
            pass
except DataError as exc:
    print("refused:", exc, flush=True)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shard_cut_after_open_before_any_read_is_refused(outputs: Path, fmt: str) -> None:
    out = outputs / f"{fmt}-after-open"
    convert(outputs / "src", out, format=fmt, encoding="raw", size=16, progress=False)
    ran = subprocess.run(
        [sys.executable, "-c", AFTER_OPEN, str(out)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, f"exit {ran.returncode}: {ran.stdout}{ran.stderr[-2000:]}"
    assert "refused:" in ran.stdout and str(out) in ran.stdout, ran.stdout


@pytest.mark.parametrize("warm", ["warm", "cold"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shard_cut_between_epochs_is_a_data_error_in_dataloader_workers(
    outputs: Path, fmt: str, warm: str
) -> None:
    """Persistent workers that read the shard for two epochs (maps and tables built, warm: the
    main process's too, before the fork) meet it cut: the worker's next batch raises the
    DataError the main process gets, named by the file; a SIGBUS would kill the worker
    ("killed by signal: Bus error"). A cut while a worker is copying a batch out of the map
    is the race docs/integrity.md states."""
    out = outputs / f"{fmt}-workers-{warm}"
    convert(outputs / "src", out, format=fmt, encoding="raw", size=16, progress=False)
    ran = subprocess.run(
        [sys.executable, "-c", IN_WORKERS, str(out), warm],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ran.returncode == 0, f"exit {ran.returncode}: {ran.stdout}{ran.stderr[-2000:]}"
    assert "refused:" in ran.stdout and "cut while it was read" in ran.stdout, ran.stdout
