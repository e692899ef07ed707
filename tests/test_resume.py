"""A conversion killed with SIGKILL leaves DST as it was, and --resume finishes it with exactly the
bytes of an uninterrupted run (real `imgpack convert` processes, every format)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import slow_cli
from PIL import Image

from imgpack import convert, direct, open_dataset, verify
from imgpack.converters import FORMATS
from imgpack.errors import OptionError
from imgpack.pipeline import CHECKPOINT, leftovers

COUNT = 2400  # more than two LMDB commits / HDF5 blocks of 1000
SHARD = {"pt": "40KB", "tfrecord": "40KB", "webdataset": "80KB"}


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many") / "src"
    rng = np.random.default_rng(5)
    for i in range(COUNT):
        folder = root / f"c{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def _args(fmt: str) -> list[str]:
    shard = SHARD.get(fmt)
    return ["--format", fmt, "--encoding", "png", *(["--shard-size", shard] if shard else [])]


def _convert(src: Path, dst: Path | str, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "imgpack.cli", "convert", str(src), str(dst), "-q", *args]
    # A session of its own, so the test can kill the conversion with its pool workers.
    return subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)


def _checkpoint_position(dst: Path) -> int:
    """The position a one-writer run's checkpoint has reached (-1: none yet)."""
    for left in leftovers(dst):
        try:
            return int(json.loads((left / CHECKPOINT).read_text())["position"])
        except (OSError, ValueError, KeyError):
            continue
    return -1


def _receipts(dst: Path) -> int:
    """How many shards a run by shard tasks has receipts for."""
    return sum(direct.receipts_in(t) for t in leftovers(dst))


def _kill_at(
    process: subprocess.Popen[bytes],
    dst: Path,
    target: int,
    progress: Callable[[Path], int] = _checkpoint_position,
) -> int:
    """SIGKILL ``process`` once its ``progress`` (default: its checkpoint's position; or
    :func:`_receipts`) has reached ``target``; what it had reached."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        reached = progress(dst)
        if reached >= target:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return reached
        if process.poll() is not None:
            _, err = process.communicate()
            raise AssertionError(f"finished before reaching {target}: {err!r}")
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    raise AssertionError(f"{target} not reached in time")


#: ``imgpack convert`` whose shard tasks each take 0.05 s more: a killed run leaves some.
SLOWED_TASKS = (
    "import time, imgpack.direct as d; w = d.write_shard\n"
    "def slow(t):\n    time.sleep(0.05); return w(t)\n"
    "d.write_shard = slow\n"
    "from imgpack.cli import main\nmain()"
)


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "lock.mdb"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_killed_conversion_resumes_to_the_same_bytes(fmt: str, many: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "imgpack.cli",
            "convert",
            str(many),
            str(reference),
            "-q",
            *_args(fmt),
        ],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    if fmt in SHARD:  # shard tasks (the default): killed once some shards have receipts
        total = len(open_dataset(reference).manifest.files)
        target = random.Random(fmt).randint(total // 4, 3 * total // 4)
        command = [sys.executable, "-c", SLOWED_TASKS, "convert", str(many), str(out), "-q"]
        slowed = subprocess.Popen(
            [*command, *_args(fmt)], start_new_session=True, stderr=subprocess.PIPE
        )
        reached = _kill_at(slowed, out, target, _receipts)
        assert 0 < reached < total
    else:  # the one writer: killed once its checkpoint passed a sample
        target = random.Random(fmt).randint(COUNT // 4, 3 * COUNT // 4)
        # Each image 3 ms slower: the last 1,000-sample checkpoint comes well before the end
        # (a run of 0.4 s finished between two looks on a loaded machine).
        command = [sys.executable, "-c", slow_cli(0.003), "convert", str(many), str(out), "-q"]
        slowed = subprocess.Popen(
            [*command, *_args(fmt)], start_new_session=True, stderr=subprocess.PIPE
        )
        reached = _kill_at(slowed, out, target)
        assert 0 < reached < COUNT
    assert not out.exists()  # nothing half-written looks like an output
    [left] = leftovers(out)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "imgpack.cli",
            "convert",
            str(many),
            str(out),
            "-q",
            "--resume",
            *_args(fmt),
        ],
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert not left.exists() and leftovers(out) == []
    assert _files(out) == _files(reference)  # every data file and the manifest, byte for byte
    assert verify(out).ok


def test_killed_overwrite_keeps_the_old_output(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(many, out, "lmdb", encoding="raw", size=8, progress=False)
    before = _files(out)
    # Killed once a checkpoint has passed a third of the samples: each image takes 3 ms and
    # LMDB commits every 100 records, so the run cannot finish before the poll sees one (at
    # full speed it did, on a loaded machine).
    command = [sys.executable, "-c", slow_cli(0.003, commit=100), "convert", str(many), str(out),
               "-q", "--overwrite", *_args("lmdb")]  # fmt: skip
    _kill_at(subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE), out,
             COUNT // 3)  # fmt: skip
    assert _files(out) == before
    assert verify(out, deep=True).ok and len(open_dataset(out)) == COUNT


def test_resume_refuses_other_options_and_warns_without_it(
    many: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    _kill_at(_convert(many, out, *_args("hdf5")), out, COUNT // 3)
    with pytest.raises(
        OptionError, match=r"left by a conversion .* with another source or other options"
    ):
        convert(many, out, "hdf5", encoding="jpeg", resume=True, progress=False)
    with caplog.at_level(logging.WARNING):
        convert(many, out, "hdf5", encoding="png", progress=False)
    assert "left by an interrupted conversion" in caplog.text and "--resume" in caplog.text
    assert len(leftovers(out)) == 1  # the fresh run leaves the old leftover for the user to decide


def test_resume_with_nothing_to_resume_converts(many: Path, tmp_path: Path) -> None:
    src = many.parent / "few"
    for i in range(3):
        (src / "a").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (i, 0, 0)).save(src / "a" / f"{i}.png")
    manifest = convert(src, tmp_path / "out", "pt", resume=True, progress=False)
    assert manifest.num_samples == 3


@pytest.mark.parametrize("fmt", ["pt", "lmdb"])
def test_resume_after_a_kill_before_the_writer_started(
    many: Path, tmp_path: Path, fmt: str
) -> None:
    """Killed between creating its temp folder and starting its writer (importing torch, say):
    the leftover holds only the fingerprint, and --resume starts over in its place; by shard
    tasks (``pt``) and by the one writer (``lmdb``)."""
    src = many.parent / "few2"
    for i in range(3):
        (src / "a").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (i, 0, 0)).save(src / "a" / f"{i}.png")
    out = tmp_path / "out"
    reference = convert(src, tmp_path / "ref", fmt, progress=False)
    from dataclasses import replace

    from imgpack import direct
    from imgpack.options import ConvertOptions
    from imgpack.pipeline import Checkpoint, plan

    early = tmp_path / ".out.abc.imgpack-tmp"
    early.mkdir()
    options = ConvertOptions(format=fmt)
    the_plan = plan(src, out, options)
    if direct.applies_locally(options):  # the plan such a run follows
        the_plan = replace(the_plan, layout=direct.LAYOUT)
    Checkpoint(the_plan.fingerprint).save(early)
    (tmp_path / ".out.nockpt.imgpack-tmp").mkdir()  # no checkpoint at all: named, not trusted
    manifest = convert(src, out, fmt, resume=True, progress=False)
    assert manifest.num_samples == reference.num_samples
    assert not early.exists()
    data = {name: body for name, body in _files(out).items() if name != "imgpack.json"}
    assert data == {n: b for n, b in _files(tmp_path / "ref").items() if n != "imgpack.json"}


def _bucket_files(url: str) -> dict[str, bytes]:
    import fsspec

    fs = fsspec.filesystem("s3")
    root = url.removeprefix("s3://")
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in sorted(fs.find(root))}


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb"])
def test_a_killed_conversion_to_a_bucket_resumes_to_the_same_bytes(
    fmt: str, many: Path, tmp_path: Path, s3: str
) -> None:
    """The driver of a one-file conversion to a bucket (built in the cache, then uploaded;
    the sharded formats write shards straight to the bucket: tests/test_bucket_shards.py) is
    SIGKILLed mid-run: the bucket holds nothing that looks like an output, the build folder in the cache keeps the checkpoint, and
    ``--resume`` finishes it with the bytes of an uninterrupted run."""
    from imgpack.storage import destination

    reference = f"{s3}/resume-{fmt}-reference"
    done = convert(many, reference, fmt, progress=False, encoding="png", shard_size=SHARD.get(fmt))
    url = f"{s3}/resume-{fmt}"
    cache = tmp_path / "cache"
    build = destination.build_folder(url, cache) / "out"
    args = [*_args(fmt), "--cache-dir", str(cache)]
    target = random.Random(fmt).randint(COUNT // 4, 3 * COUNT // 4)
    reached = _kill_at(_convert(many, url, *args), build, target)
    assert 0 < reached < COUNT
    assert _bucket_files(url) == {}  # nothing uploaded: no half output in the bucket
    resumed = subprocess.run(
        [sys.executable, "-m", "imgpack.cli", "convert", str(many), url, "-q", "--resume", *args],
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert _bucket_files(url) == _bucket_files(reference)
    assert open_dataset(url, cache_dir=cache).manifest.output_id == done.output_id
    assert not build.parent.exists()  # uploaded: the build folder is gone


def test_a_conversion_stopped_while_uploading_resumes_by_uploading(
    many: Path, tmp_path: Path, s3: str
) -> None:
    """A run to a bucket stopped after its output was built, part of it uploaded (no manifest
    there yet): ``--resume`` checks the build is this conversion's and uploads it."""
    import fsspec

    from imgpack.storage import destination

    url, cache = f"{s3}/uploading", tmp_path / "cache"
    local = tmp_path / "local"
    done = convert(many, local, "hdf5", progress=False)
    build = destination.build_folder(url, cache) / "out"
    build.parent.mkdir(parents=True)
    build.mkdir()
    for path in local.iterdir():
        (build / path.name).write_bytes(path.read_bytes())
    shard = sorted(p.name for p in local.iterdir() if p.suffix == ".h5")[0]
    fsspec.filesystem("s3").pipe(f"{url.removeprefix('s3://')}/{shard}", b"half")
    args = ["--format", "hdf5", "--cache-dir", str(cache), "-q"]
    again = [sys.executable, "-m", "imgpack.cli", "convert", str(many), url, *args]
    refused = subprocess.run(again, capture_output=True, text=True)
    assert refused.returncode == 1 and "holds no imgpack.json" in refused.stderr
    other = subprocess.run([*again, "--resume", "--size", "8"], capture_output=True, text=True)
    assert other.returncode == 2 and "another conversion" in other.stderr
    resumed = subprocess.run([*again, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert _bucket_files(url) == {p.name: p.read_bytes() for p in sorted(local.iterdir())}
    assert open_dataset(url, cache_dir=cache).manifest.output_id == done.output_id
