"""``imgpack convert SRC DST --append`` to a one-file output (``lmdb``, ``hdf5``): the new version
is built beside DST from a copy of it and swapped in with its manifest, under DST's lock. Old
samples then new, old classes keep their labels, a reader that has the old file open keeps the
old version, a run killed midway leaves the old output byte for byte and resumes to the bytes
of an append that was not interrupted."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import build_uniform_folder, slow_cli
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.errors import DataError
from imgpack.pipeline import Checkpoint
from imgpack.publishing import leftovers
from imgpack.readers import collate

#: (format, the conversion's options): an encoded LMDB, a raw HDF5.
CASES = {
    "lmdb": ["--format", "lmdb"],
    "hdf5": ["--format", "hdf5", "--encoding", "raw", "--size", "8"],
}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("a") / "a", count=40, classes=2)


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Classes class1 (also in ``first``), then class2 and class3 (new)."""
    root = tmp_path_factory.mktemp("b") / "b"
    build_uniform_folder(root, count=40, classes=3, seed=7)
    (root / "class0").rename(root / "class3")
    return root


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    }


def _read(ds: object) -> tuple[torch.Tensor, torch.Tensor]:
    return collate(ds.__getitems__(list(range(len(ds)))))  # type: ignore[attr-defined]


def _convert(args: list[str]) -> None:
    done = CliRunner().invoke(main, ["convert", *args, "-q"])
    assert done.exit_code == 0, done.output


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_an_append_to_one_file_adds_the_new_samples_after_the_old(
    first: Path, second: Path, tmp_path: Path, fmt: str
) -> None:
    """Old samples (their pixels and labels as before), then SRC's in its own order (those of a
    conversion of SRC alone, relabelled); the statistics of both; a reader that has the old file
    open reads the old version whole; the output verifies and reads through 2 workers; the same
    append made twice gives the same bytes."""
    args = [*CASES[fmt], "--workers", "2"]
    out = tmp_path / "out"
    _convert([str(first), str(out), *args])
    old_manifest = open_dataset(out).manifest
    before = open_dataset(out)
    old_pixels, old_labels = _read(before)  # its file is open from here on
    (out / "notes.txt").write_text("the user's own\n")  # kept: an append loses nothing
    (out / "previews").mkdir()
    (out / "previews" / "a.png").write_bytes(b"png")
    kept = _hashes(out)
    planned = CliRunner().invoke(main, ["convert", str(second), str(out), "--append", "--dry-run",
                                        *args])  # fmt: skip
    assert planned.exit_code == 0, planned.output
    assert "append:    after the 40 samples in 1 file(s)" in planned.output
    assert "classes:   4 (class0, class1, class2, class3)" in planned.output
    assert _hashes(out) == kept
    _convert([str(second), str(out), "--append", *args])
    ds = open_dataset(out)
    manifest = ds.manifest
    assert manifest.classes == ["class0", "class1", "class2", "class3"]
    assert manifest.num_samples == 80 and manifest.output_id != old_manifest.output_id
    assert len(manifest.files) == 1 and manifest.files[0].num_samples == 80
    pixels, labels = _read(ds)
    assert torch.equal(pixels[:40], old_pixels) and torch.equal(labels[:40], old_labels)
    alone = tmp_path / "alone"
    convert(second, alone, options=None, progress=False, **_keywords(fmt))
    alone_ds = open_dataset(alone)
    alone_pixels, alone_labels = _read(alone_ds)
    assert torch.equal(pixels[40:], alone_pixels)
    assert [manifest.classes[i] for i in labels[40:]] == [alone_ds.classes[i] for i in alone_labels]
    assert manifest.stats is not None and manifest.stats["per_class"] == [
        int((labels == k).sum()) for k in range(4)
    ]
    record = manifest.source["appended"][0]
    assert record["samples"] == 40 and record["new_classes"] == ["class2", "class3"]
    assert record["output_id_before"] == old_manifest.output_id
    again_pixels, again_labels = _read(before)  # the old version, from the file it has open
    assert len(before) == 40 and torch.equal(again_pixels, old_pixels)
    assert torch.equal(again_labels, old_labels)
    assert verify(out).ok
    loader = DataLoader(ds, batch_size=7, num_workers=2, collate_fn=collate)
    got = list(loader)
    assert torch.equal(torch.cat([b[0] for b in got]), pixels)
    assert torch.equal(torch.cat([b[1] for b in got]), labels)
    twice = tmp_path / "twice"
    _convert([str(first), str(twice), *args])
    _convert([str(second), str(twice), "--append", "--workers", "1", *CASES[fmt]])
    theirs = {k: v for k, v in _hashes(out).items() if k in _hashes(twice)}
    assert theirs == _hashes(twice) and len(theirs) == 2  # the data file and the manifest
    assert (out / "notes.txt").read_text() == "the user's own\n"
    assert (out / "previews" / "a.png").read_bytes() == b"png"
    assert not list(tmp_path.glob(".*"))  # no temp folder or parked output left beside them


def _keywords(fmt: str) -> dict[str, object]:
    return {"format": fmt, **({"encoding": "raw", "size": 8} if fmt == "hdf5" else {})}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_a_reader_opening_the_file_after_the_append_is_told_to_open_it_again(
    first: Path, second: Path, tmp_path: Path, fmt: str
) -> None:
    """A reader made before the append that opens its file only after it (a DataLoader worker
    started later) finds the new version's file, and says so instead of mixing the two."""
    out = tmp_path / "out"
    _convert([str(first), str(out), *CASES[fmt]])
    before = open_dataset(out)
    _convert([str(second), str(out), "--append", *CASES[fmt]])
    with pytest.raises(DataError, match="was replaced after it was opened; open it again"):
        _read(before)


def _checkpointed(out: Path) -> int:
    """Samples the append into ``out`` has made durable so far (its temp folder's checkpoint)."""
    for folder in leftovers(out):
        found = Checkpoint.load(folder)
        if found is not None and found.writer:
            return found.count
    return 0


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_a_killed_append_to_one_file_leaves_the_old_output_and_resumes(
    first: Path, second: Path, tmp_path: Path, fmt: str
) -> None:
    """SIGKILLed once the append has made some samples durable: DST is the old output, byte for
    byte; --append --resume goes on from the checkpoint to the bytes of an append that was not
    interrupted."""
    args = [*CASES[fmt], "--workers", "2"]
    reference = tmp_path / "reference"
    _convert([str(first), str(reference), *args])
    _convert([str(second), str(reference), "--append", *args])
    out = tmp_path / "out"
    _convert([str(first), str(out), *args])
    old = _hashes(out)
    script = slow_cli(0.05, commit=4)
    command = [sys.executable, "-c", script, "convert", str(second), str(out), "-q", "--append",
               *args]  # fmt: skip
    process = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _checkpointed(out) < 8:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    assert _hashes(out) == old
    assert len(open_dataset(out)) == 40 and verify(out).ok
    resumed = CliRunner().invoke(
        main, ["convert", str(second), str(out), "--append", "--resume", *args]
    )
    assert resumed.exit_code == 0, resumed.output
    assert _hashes(out) == _hashes(reference)
    assert not leftovers(out)


def test_an_append_to_one_file_is_refused_for_what_it_cannot_do(
    first: Path, second: Path, tmp_path: Path
) -> None:
    """Parts (one file is written by one process), and an output whose file is not what its
    manifest records: refused in one line, DST untouched."""
    out = tmp_path / "out"
    _convert([str(first), str(out), "--format", "lmdb"])
    kept = _hashes(out)
    runner = CliRunner()
    base = ["convert", str(second), str(out), "--append", "--format", "lmdb"]
    parts = runner.invoke(main, [*base, "--num-parts", "2", "--part", "0"])
    assert parts.exit_code != 0 and "append without --num-parts" in parts.output, parts.output
    assert _hashes(out) == kept
    data = out / "data.mdb"
    damaged = bytearray(data.read_bytes())
    damaged[-100] ^= 0xFF
    data.write_bytes(bytes(damaged))
    refused = runner.invoke(main, base)
    assert refused.exit_code != 0, refused.output
    assert "its sha256 is not the one its manifest records" in refused.output, refused.output
    assert "nothing was appended" in refused.output and "Traceback" not in refused.output
    assert (out / "data.mdb").read_bytes() == bytes(damaged) and not leftovers(out)
