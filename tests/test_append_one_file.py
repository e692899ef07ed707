"""``imgpack convert SRC DST --append`` to a one-file output (``lmdb``, ``hdf5``): the new version
is built beside DST from a copy of it and swapped in with its manifest, under DST's lock. Old
samples then new, old classes keep their labels, a reader that has the old file open keeps the
old version, a run killed midway leaves the old output byte for byte and resumes to the bytes
of an append that was not interrupted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    append_reference,
    check_appended,
    cli_convert,
    kill_when,
    read_all,
    slow_cli,
    tree_hashes,
)
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.errors import DataError
from imgpack.pipeline import Checkpoint
from imgpack.publishing import leftovers
from imgpack.readers import collate

#: Images in each of the two folders: enough for checkpoints every 4 records to kill between.
APPEND_COUNT = 40
#: (format, the conversion's options): an encoded LMDB, a raw HDF5.
CASES = {
    "lmdb": ["--format", "lmdb"],
    "hdf5": ["--format", "hdf5", "--encoding", "raw", "--size", "8"],
}


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
    cli_convert([str(first), str(out), *args])
    old_manifest = open_dataset(out).manifest
    before = open_dataset(out)
    old_pixels, old_labels = read_all(before)  # its file is open from here on
    (out / "notes.txt").write_text("the user's own\n")  # kept: an append loses nothing
    (out / "previews").mkdir()
    (out / "previews" / "a.png").write_bytes(b"png")
    kept = tree_hashes(out)
    planned = CliRunner().invoke(main, ["convert", str(second), str(out), "--append", "--dry-run",
                                        *args])  # fmt: skip
    assert planned.exit_code == 0, planned.output
    assert "append:    after the 40 samples in 1 file(s)" in planned.output
    assert "classes:   4 (class0, class1, class2, class3)" in planned.output
    assert tree_hashes(out) == kept
    cli_convert([str(second), str(out), "--append", *args])
    ds = open_dataset(out)
    manifest = ds.manifest
    assert manifest.num_samples == 80
    assert len(manifest.files) == 1 and manifest.files[0].num_samples == 80
    convert(second, tmp_path / "alone", options=None, progress=False, **_keywords(fmt))
    alone = open_dataset(tmp_path / "alone")
    old = (old_pixels, old_labels)
    pixels, labels = check_appended(ds, old, alone, old_manifest.output_id)
    again_pixels, again_labels = read_all(before)  # the old version, from the file it has open
    assert len(before) == 40 and torch.equal(again_pixels, old_pixels)
    assert torch.equal(again_labels, old_labels)
    assert verify(out).ok
    loader = DataLoader(ds, batch_size=7, num_workers=2, collate_fn=collate)
    got = list(loader)
    assert torch.equal(torch.cat([b[0] for b in got]), pixels)
    assert torch.equal(torch.cat([b[1] for b in got]), labels)
    twice = tmp_path / "twice"
    cli_convert([str(first), str(twice), *args])
    cli_convert([str(second), str(twice), "--append", "--workers", "1", *CASES[fmt]])
    theirs = {k: v for k, v in tree_hashes(out).items() if k in tree_hashes(twice)}
    assert theirs == tree_hashes(twice) and len(theirs) == 2  # the data file and the manifest
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
    cli_convert([str(first), str(out), *CASES[fmt]])
    before = open_dataset(out)
    cli_convert([str(second), str(out), "--append", *CASES[fmt]])
    with pytest.raises(DataError, match="was replaced after it was opened; open it again"):
        read_all(before)


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
    out = append_reference(first, second, tmp_path, args)
    reference = tmp_path / "reference"
    old = tree_hashes(out)
    script = slow_cli(0.05, commit=4)
    command = [sys.executable, "-c", script, "convert", str(second), str(out), "-q", "--append",
               *args]  # fmt: skip
    kill_when(command, lambda: _checkpointed(out) >= 8)
    assert tree_hashes(out) == old
    assert len(open_dataset(out)) == 40 and verify(out).ok
    resumed = CliRunner().invoke(
        main, ["convert", str(second), str(out), "--append", "--resume", *args]
    )
    assert resumed.exit_code == 0, resumed.output
    assert tree_hashes(out) == tree_hashes(reference)
    assert not leftovers(out)


def test_an_append_to_one_file_is_refused_for_what_it_cannot_do(
    first: Path, second: Path, tmp_path: Path
) -> None:
    """Parts (one file is written by one process), and an output whose file is not what its
    manifest records: refused in one line, DST untouched."""
    out = tmp_path / "out"
    cli_convert([str(first), str(out), "--format", "lmdb"])
    kept = tree_hashes(out)
    runner = CliRunner()
    base = ["convert", str(second), str(out), "--append", "--format", "lmdb"]
    parts = runner.invoke(main, [*base, "--num-parts", "2", "--part", "0"])
    assert parts.exit_code != 0 and "append without --num-parts" in parts.output, parts.output
    assert tree_hashes(out) == kept
    data = out / "data.mdb"
    damaged = bytearray(data.read_bytes())
    damaged[-100] ^= 0xFF
    data.write_bytes(bytes(damaged))
    refused = runner.invoke(main, base)
    assert refused.exit_code != 0, refused.output
    assert "its sha256 is not the one its manifest records" in refused.output, refused.output
    assert "nothing was appended" in refused.output and "Traceback" not in refused.output
    assert (out / "data.mdb").read_bytes() == bytes(damaged) and not leftovers(out)
