"""``imgpack convert SRC DST --append``: SRC's images added to an existing output as new shards
after its last one; its files untouched, new classes after its own, the manifest replaced last
(a reader opened before keeps the old version), a killed append resumable; on a path and in a
bucket (moto's server on 127.0.0.1, the ``s3`` fixture), byte for byte the same."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    append_reference,
    build_uniform_folder,
    check_appended,
    cli_convert,
    kill_when,
    read_all,
    tree_hashes,
)
from torch.utils.data import DataLoader

import imgpack.direct as direct
from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.readers import collate

SHARDED = ("pt", "tfrecord", "webdataset")


@pytest.mark.parametrize("fmt", SHARDED)
def test_an_append_adds_shards_after_the_old_ones_and_keeps_their_bytes(
    first: Path, second: Path, tmp_path: Path, fmt: str
) -> None:
    """The old files keep their bytes; old samples, then SRC's in its own order; an old class
    keeps its label, new ones come after; a reader opened before reads the old version whole;
    the whole output verifies and reads through a DataLoader with 2 workers."""
    args = ["--format", fmt, "--shard-size", "2KB", "--workers", "2"]
    out = tmp_path / "out"
    cli_convert([str(first), str(out), *args])
    old_files = tree_hashes(out)
    old_manifest = json.loads((out / "imgpack.json").read_text())
    before = open_dataset(out)
    old_pixels, old_labels = read_all(before)
    cli_convert([str(second), str(out), "--append", *args])
    after = tree_hashes(out)
    assert {k: after[k] for k in old_files if k != "imgpack.json"} == {
        k: v for k, v in old_files.items() if k != "imgpack.json"
    }
    ds = open_dataset(out)
    manifest = ds.manifest
    assert manifest.classes == ["class0", "class1", "class2", "class3"]
    assert manifest.num_samples == 24 and manifest.output_id != old_manifest["output_id"]
    assert [f.output_id for f in manifest.files[: len(old_manifest["files"])]] == [
        old_manifest["output_id"]
    ] * len(old_manifest["files"])
    assert all(not f.output_id for f in manifest.files[len(old_manifest["files"]) :])
    convert(second, tmp_path / "alone", fmt, progress=False)
    alone = open_dataset(tmp_path / "alone")
    old = (old_pixels, old_labels)
    pixels, labels = check_appended(ds, old, alone, old_manifest["output_id"])
    shown = CliRunner().invoke(main, ["info", str(out)])
    assert f"appended:  1 time(s); last 12 samples from {second.resolve()}" in shown.output
    again_pixels, again_labels = read_all(before)  # opened before the append: the old version
    assert len(before) == 12 and torch.equal(again_pixels, old_pixels)
    assert torch.equal(again_labels, old_labels)
    assert verify(out).ok
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=collate)
    got = [batch for batch in loader]
    assert torch.equal(torch.cat([b[0] for b in got]), pixels)
    assert torch.equal(torch.cat([b[1] for b in got]), labels)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--format", "tfrecord"], "the output's format is 'pt'"),
        (["--encoding", "png"], "the output's encoding is 'original'"),
        (["--size", "8"], "the output's image"),
        (["--format", "lmdb"], "the output's format is 'pt', this conversion's 'lmdb'"),
        (["--overwrite"], "--append does not go with --overwrite"),
    ],
)
def test_an_append_that_would_change_the_output_is_refused_in_one_line(
    first: Path, second: Path, tmp_path: Path, extra: list[str], said: str
) -> None:
    out = tmp_path / "out"
    cli_convert([str(first), str(out), "--format", "pt"])
    kept = tree_hashes(out)
    args = ["convert", str(second), str(out), "--append", "-q", "--format", "pt", *extra]
    done = CliRunner().invoke(main, args)
    assert done.exit_code != 0 and said in done.output, done.output
    said_lines = [line for line in done.output.splitlines() if line.startswith("Error")]
    assert "Traceback" not in done.output and len(said_lines) == 1, done.output
    assert tree_hashes(out) == kept


def test_the_dry_run_of_an_append_names_its_shards(
    first: Path, second: Path, tmp_path: Path
) -> None:
    """--dry-run plans an append as the append does (the new shards' names, after the old
    ones'; the classes after the append) and writes nothing."""
    out = tmp_path / "out"
    cli_convert([str(first), str(out), "--format", "tfrecord", "--shard-size", "2KB"])
    kept = tree_hashes(out)
    args = [str(second), str(out), "--format", "tfrecord", "--shard-size", "2KB", "--append"]
    planned = CliRunner().invoke(main, ["convert", *args, "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert tree_hashes(out) == kept
    old = len(json.loads((out / "imgpack.json").read_text())["files"])
    assert f"append:    after the 12 samples in {old} file(s)" in planned.output
    assert "classes:   4 (class0, class1, class2, class3)" in planned.output
    cli_convert(args)
    new = [f["path"] for f in json.loads((out / "imgpack.json").read_text())["files"]][old:]
    assert f"files:     {len(new)} (as planned: {new[0]}, {new[1]}" in planned.output


def test_an_append_to_nothing_or_of_the_same_images_again_is_refused(
    first: Path, second: Path, tmp_path: Path
) -> None:
    missing = CliRunner().invoke(
        main, ["convert", str(second), str(tmp_path / "none"), "--append", "--format", "pt"]
    )
    assert missing.exit_code != 0 and "there is none" in missing.output, missing.output
    out = tmp_path / "out"
    cli_convert([str(first), str(out), "--format", "webdataset"])
    cli_convert([str(second), str(out), "--format", "webdataset", "--append"])
    kept = tree_hashes(out)
    again = CliRunner().invoke(
        main, ["convert", str(second), str(out), "--format", "webdataset", "--append"]
    )
    assert again.exit_code != 0 and "its last append already" in again.output, again.output
    resumed = CliRunner().invoke(
        main, ["convert", str(second), str(out), "-q", "--format", "webdataset", "--append",
               "--resume"],
    )  # fmt: skip
    assert resumed.exit_code == 0, resumed.output  # committed already: the output as it is
    assert tree_hashes(out) == kept
    unlabelled = CliRunner().invoke(
        main, ["convert", str(second), str(out), "--format", "webdataset", "--append",
               "--no-labels"],
    )  # fmt: skip
    assert unlabelled.exit_code != 0 and "gives no labels" in unlabelled.output, unlabelled.output


def test_an_append_to_one_part_of_a_partitioned_conversion_is_refused(
    first: Path, second: Path, tmp_path: Path
) -> None:
    part = tmp_path / "part0"
    convert(first, part, "pt", num_parts=2, part=0, progress=False)
    kept = tree_hashes(part)
    done = CliRunner().invoke(
        main, ["convert", str(second), str(part), "--format", "pt", "--append"]
    )
    assert done.exit_code != 0 and "merge the parts first" in done.output, done.output
    assert tree_hashes(part) == kept


def test_an_append_to_an_output_without_an_id_is_refused(
    first: Path, second: Path, tmp_path: Path
) -> None:
    """An output of imgpack 0.1 or 0.2 has no output id, so an appended version could not tell
    its files from the new ones: refused, saying what to do."""
    out = tmp_path / "old"
    convert(first, out, "webdataset", progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    manifest["output_id"] = ""
    (out / "imgpack.json").write_text(json.dumps(manifest))
    kept = tree_hashes(out)
    done = CliRunner().invoke(
        main, ["convert", str(second), str(out), "--format", "webdataset", "--append"]
    )
    assert done.exit_code != 0 and "convert it again with this imgpack" in done.output
    assert tree_hashes(out) == kept


def test_an_append_of_split_folders_is_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "train").mkdir(parents=True)
    build_uniform_folder(root / "train", count=4, classes=2)
    args = ["convert", str(root), str(tmp_path / "out"), "--format", "pt", "--splits", "auto",
            "--append"]  # fmt: skip
    done = CliRunner().invoke(main, args)
    assert done.exit_code != 0 and "append each split's folder to its output" in done.output
    assert "Traceback" not in done.output


def _receipts(dst: Path) -> int:
    """The receipts an append into ``dst`` (a path) has written so far."""
    return len(list((dst / direct.WORK).glob("*/shard-*.json")))


def test_a_killed_append_leaves_the_old_output_and_resumes_to_the_same_bytes(
    first: Path, second: Path, tmp_path: Path
) -> None:
    """SIGKILLed once some appended shards have receipts: DST is the old output (the same
    manifest, every sample read as before); --append --resume writes the rest, to the bytes of
    an append that was not interrupted."""
    args = ["--format", "tfrecord", "--shard-size", "1KB", "--workers", "2"]
    out = append_reference(first, second, tmp_path, args)
    reference = tmp_path / "reference"
    old = tree_hashes(out)
    old_pixels, _ = read_all(open_dataset(out))
    slow = (
        "import time, imgpack.direct as d; w = d.write_shard\n"
        "def slow(t):\n    time.sleep(0.3); return w(t)\n"
        "d.write_shard = slow\n"
    )
    script = f"{slow}from imgpack.cli import main\nmain()"
    command = [sys.executable, "-c", script, "convert", str(second), str(out), "-q", "--append",
               *args]  # fmt: skip
    kill_when(command, lambda: _receipts(out) >= 2)
    assert tree_hashes(out)["imgpack.json"] == old["imgpack.json"]
    ds = open_dataset(out)
    assert len(ds) == 12 and torch.equal(read_all(ds)[0], old_pixels)
    cli_convert([str(second), str(out), "--append", "--resume", *args])
    assert tree_hashes(out) == tree_hashes(reference)


def test_an_append_in_a_bucket_is_the_local_appends_bytes(
    s3: str, first: Path, second: Path, tmp_path: Path
) -> None:
    args = {"shard_size": "2KB", "workers": 2, "progress": False}
    local = tmp_path / "local"
    convert(first, local, "webdataset", **args)
    convert(second, local, "webdataset", append=True, **args)
    url = f"{s3}/appended"
    convert(first, url, "webdataset", **args)
    manifest = convert(second, url, "webdataset", append=True, **args)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    remote = {p[len(root) + 1 :]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(root)}
    here = tree_hashes(local)
    manifest_path = "imgpack.json"
    assert {k: v for k, v in remote.items() if k != manifest_path} == {
        k: v for k, v in here.items() if k != manifest_path
    }
    assert manifest.output_id == json.loads((local / manifest_path).read_text())["output_id"]
    a, la = read_all(open_dataset(url, cache_dir=tmp_path / "cache"))
    b, lb = read_all(open_dataset(local))
    assert torch.equal(a, b) and torch.equal(la, lb)


def test_an_append_from_a_bucket_source_reads_its_objects_in_place(
    s3: str, first: Path, second: Path, tmp_path: Path
) -> None:
    """SRC an image folder in a bucket (listed, its objects read by the shard tasks): the
    appended output holds the samples a local append of the same images gives, and DST keeps
    no work folder."""
    args = {"shard_size": "2KB", "workers": 2, "progress": False}
    fsspec.filesystem("s3").put(str(second), "imgpack-test/append-src", recursive=True)
    local, remote = tmp_path / "local", tmp_path / "remote"
    for out, src in ((local, str(second)), (remote, f"{s3}/append-src")):
        convert(first, out, "tfrecord", **args)
        convert(src, out, "tfrecord", append=True, **args)
    a, la = read_all(open_dataset(remote))
    b, lb = read_all(open_dataset(local))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert open_dataset(remote).manifest.source["appended"][0]["path"] == f"{s3}/append-src"
    assert not (remote / direct.WORK).exists()


def test_an_appended_bucket_output_reuses_the_old_files_in_the_cache(
    s3: str, first: Path, second: Path, tmp_path: Path
) -> None:
    """A bucket output read through the cache, then appended to, then opened again: only the
    new shards are downloaded; the old ones are linked from the old version's cache entry once
    their sha256 matches, and the samples are those of the same append made locally."""
    from imgpack.storage.cache import stats as cache_stats

    args = {"shard_size": "2KB", "workers": 2, "progress": False}
    url, cache = f"{s3}/appended-cache", tmp_path / "cache"
    convert(first, url, "pt", **args)
    old_pixels, _ = read_all(open_dataset(url, cache_dir=cache))
    manifest = convert(second, url, "pt", append=True, **args)
    old = [f for f in manifest.files if f.output_id]
    downloads, reused = cache_stats.downloads, cache_stats.reused
    pixels, labels = read_all(open_dataset(url, cache_dir=cache))
    assert cache_stats.reused - reused == len(old)
    assert cache_stats.downloads - downloads == len(manifest.files) - len(old)
    local = tmp_path / "local"
    convert(first, local, "pt", **args)
    convert(second, local, "pt", append=True, **args)
    here, here_labels = read_all(open_dataset(local))
    assert torch.equal(pixels, here) and torch.equal(labels, here_labels)
    assert torch.equal(pixels[: len(old_pixels)], old_pixels)


@pytest.mark.parametrize("where", ["path", "bucket"])
def test_the_parts_of_an_append_write_the_single_appends_bytes(
    s3: str, first: Path, second: Path, tmp_path: Path, where: str
) -> None:
    """K = 2 and 3 parts of one append, into a shared path or a bucket: until the last part
    finishes, DST is the old output; then the single append's files, byte for byte, and a
    part run again returns the output as it is."""
    args = {"shard_size": "1KB", "workers": 1, "progress": False}
    reference = tmp_path / "reference"
    convert(first, reference, "tfrecord", **args)
    convert(second, reference, "tfrecord", append=True, **args)
    for count in (2, 3):
        if where == "path":
            dst: str | Path = tmp_path / f"k{count}"
        else:
            dst = f"{s3}/append-parts-{count}"
        convert(first, dst, "tfrecord", **args)
        for part in range(count):
            done = convert(second, dst, "tfrecord", append=True, num_parts=count, part=part,
                           **args)  # fmt: skip
            if part < count - 1:
                assert done.part is not None and len(open_dataset(
                    dst, cache_dir=tmp_path / "c"
                )) == 12  # fmt: skip
        assert done.part is None and done.num_samples == 24
        if where == "path":
            assert tree_hashes(Path(dst)) == tree_hashes(reference)
        else:
            fs = fsspec.filesystem("s3")
            fs.invalidate_cache()
            root = str(dst).removeprefix("s3://")
            remote = {
                p[len(root) + 1 :]: hashlib.sha256(fs.cat_file(p)).hexdigest()
                for p in fs.find(root)
            }
            assert remote == tree_hashes(reference)
        again = convert(second, dst, "tfrecord", append=True, num_parts=count, part=0, **args)
        assert again.output_id == done.output_id and again.num_samples == 24
