"""The first hour, again: `python -m imgpack`, `convert --dry-run` (the plan equals what the run
writes, and nothing is written), `imgpack preview` (its tiles are the reader's pixels), the
messages a newcomer met (a missing bucket, --labels with --no-labels, --no-labels on a file) and
one loader advice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder
from PIL import Image

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.loading.advice import RAW_WORKERS_REASON
from imgpack.loading.profiling import verdict
from imgpack.loading.tuning import loader_bound_advice, recommend_loader_settings
from imgpack.pipeline import dry_run
from imgpack.preview import contact_sheet
from imgpack.sample import make_sample_folder

FORMATS = ("pt", "lmdb", "hdf5", "tfrecord", "webdataset")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("first-hour") / "images"
    make_sample_folder(root, 30, 3, seed=3)
    (root / "circle" / "notes.txt").write_text("not an image")  # ignored by the scan
    return root


def test_python_dash_m_imgpack_is_the_command_line(images: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "imgpack", "convert", str(images), str(tmp_path / "o"),
         "--format", "pt", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    info = subprocess.run(
        [sys.executable, "-m", "imgpack", "info", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert info.returncode == 0 and "samples:   30" in info.stdout
    usage = subprocess.run([sys.executable, "-m", "imgpack", "--help"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert usage.stdout.startswith("Usage: imgpack ")


@pytest.mark.parametrize("fmt", ["lmdb", "webdataset", "tfrecord"])
def test_the_dry_run_plan_is_what_the_run_writes_and_nothing_is_written(
    fmt: str, images: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(images), str(out), "--format", fmt,
                                       "--dry-run"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not out.exists() and os.listdir(tmp_path) == []  # no DST, no temp folder
    assert "images:    30" in result.output and "classes:   3" in result.output
    assert "1 other file(s) ignored" in result.output
    planned = dry_run(images, out, fmt)
    manifest = convert(images, out, fmt, progress=False)
    assert planned.images == manifest.num_samples == 30
    assert planned.classes == manifest.classes
    assert planned.ignored_files == manifest.source["ignored_files"] == 1
    if planned.shards:  # one shard at the default shard size: its name is the output's
        assert planned.shards == [f.path for f in manifest.files]
    assert planned.estimated_bytes == sum(p.stat().st_size for p in images.rglob("*.*")
                                          if p.suffix != ".txt")  # fmt: skip


def test_the_dry_run_of_a_raw_conversion_counts_exact_bytes(images: Path, tmp_path: Path) -> None:
    planned = dry_run(images, tmp_path / "o", "pt", encoding="raw", size=8, num_parts=3, part=1)
    assert planned.images == 0 and planned.shards == []  # one shard: part 2's
    sharded = dry_run(images, tmp_path / "o", "pt", encoding="raw", size=8, shard_size="1KB",
                      num_parts=3, part=1)  # fmt: skip
    assert len(sharded.shards) > 1 and sharded.estimated_bytes == sharded.images * 8 * 8 * 3
    apart = dry_run(images, tmp_path / "o", "lmdb", encoding="raw", size=8, num_parts=3, part=1)
    assert apart.images == 10 and apart.estimated_bytes == 10 * 8 * 8 * 3  # one file: its third


def test_the_dry_run_refuses_what_the_run_refuses(images: Path, tmp_path: Path) -> None:
    convert(images, tmp_path / "o", "pt", progress=False)
    result = CliRunner().invoke(main, ["convert", str(images), str(tmp_path / "o"),
                                       "--format", "pt", "--dry-run"])  # fmt: skip
    assert result.exit_code == 1 and "already exists (use --overwrite" in result.output


def test_the_dry_run_of_shard_tasks_to_a_bucket_names_their_shards(
    s3: str, images: Path, tmp_path: Path
) -> None:
    url = f"{s3}/dry-run"
    planned = dry_run(images, url, "tfrecord", shard_size="20KB")
    assert planned.shards_exact and len(planned.shards) > 2
    assert not [p for p in _bucket_names(s3) if "dry-run" in p]  # nothing written there
    manifest = convert(images, url, "tfrecord", shard_size="20KB", progress=False)
    assert planned.shards == [f.path for f in manifest.files]
    assert planned.images == manifest.num_samples
    # A part's plan is its shards of the whole plan: the parts' shards are the whole's.
    halves = [dry_run(images, url, "tfrecord", shard_size="20KB", num_parts=2, part=k,
                      overwrite=True) for k in (0, 1)]  # fmt: skip
    assert halves[0].shards + halves[1].shards == planned.shards
    assert halves[0].images + halves[1].images == planned.images


def _bucket_names(url: str) -> list[str]:
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs.find(url.removeprefix("s3://"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_preview_tiles_are_the_readers_pixels(fmt: str, images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(images, out, fmt, progress=False)
    sheet_path = tmp_path / "grid.png"
    result = CliRunner().invoke(main, ["preview", str(out), "-o", str(sheet_path),
                                       "--per-class", "4"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "12 samples in 3 row(s)" in result.output
    ds = open_dataset(out)
    sheet = contact_sheet(ds, per_class=4)
    with Image.open(sheet_path) as png:
        written = np.asarray(png.convert("RGB"))
    assert written.shape[:2] == (sheet.image.height, sheet.image.width)
    targets = ds.targets
    for index, name, x, y in sheet.tiles:
        image = ds[index][0].numpy().transpose(1, 2, 0)
        height, width, _ = image.shape
        assert np.array_equal(written[y : y + height, x : x + width], image)
        assert ds.classes[targets[index]] == name
    rows = {}
    for index, name, _, _ in sheet.tiles:
        rows.setdefault(name, []).append(index)
    for name, chosen in rows.items():  # the first samples of each class, in order
        label = ds.class_to_idx[name]
        assert chosen == [i for i, t in enumerate(targets) if t == label][:4]


def test_preview_with_size_and_classes_and_a_wrong_class(images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(images, out, "webdataset", progress=False)
    sheet = contact_sheet(open_dataset(out, size=16), per_class=2, classes=["square", "circle"])
    assert [name for _, name, _, _ in sheet.tiles] == ["square", "square", "circle", "circle"]
    small = open_dataset(out, size=16)
    written = np.asarray(sheet.image)
    for index, _, x, y in sheet.tiles:
        assert np.array_equal(written[y : y + 16, x : x + 16],
                              small[index][0].numpy().transpose(1, 2, 0))  # fmt: skip
    result = CliRunner().invoke(main, ["preview", str(out), "--classes", "cat",
                                       "-o", str(tmp_path / "p.png")])  # fmt: skip
    assert result.exit_code == 2 and "no class 'cat'" in result.output
    assert not (tmp_path / "p.png").exists()


def test_preview_of_an_output_in_a_bucket(s3: str, images: Path, tmp_path: Path) -> None:
    url = f"{s3}/preview"
    convert(images, url, "pt", encoding="raw", size=12, progress=False)
    result = CliRunner().invoke(main, ["preview", url, "-o", str(tmp_path / "p.png"),
                                       "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert result.exit_code == 0, result.output
    with Image.open(tmp_path / "p.png") as sheet:
        assert sheet.size[1] == 4 + 3 * (12 + 4)


def test_a_missing_bucket_is_named(s3: str, images: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for args in (
        ["convert", str(images), "s3://no-such-bucket/out", "--format", "webdataset", "-q"],
        ["convert", "s3://no-such-bucket/src", str(tmp_path / "o"), "--format", "pt", "-q"],
        ["info", "s3://no-such-bucket/out"],
        ["verify", "s3://no-such-bucket/out"],
    ):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith("Error: s3://no-such-bucket/")
        assert "the bucket s3://no-such-bucket does not exist" in result.output, result.output


def test_labels_and_no_labels_name_the_flags(images: Path, tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\ncircle/x.png,circle\n")
    result = CliRunner().invoke(main, ["convert", str(images), str(tmp_path / "o"), "--format",
                                       "pt", "--labels", str(listing), "--no-labels"])  # fmt: skip
    assert result.exit_code == 2
    assert "give --labels FILE (a label list's labels) or --no-labels" in result.output
    assert "no_labels" not in result.output


def test_no_labels_on_a_label_list_says_what_it_converts(tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\nx.png,cat\n")
    result = CliRunner().invoke(main, ["convert", str(listing), str(tmp_path / "o"),
                                       "--format", "pt", "--no-labels"])  # fmt: skip
    assert result.exit_code == 2
    assert "--no-labels converts every image under a folder SRC" in result.output
    assert "--labels FILE" in result.output and "SRC/<class>/<image>" not in result.output


def test_one_loader_advice_for_a_raw_output(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "images", count=12, size=8)
    out = tmp_path / "out"
    convert(src, out, "pt", encoding="raw", size=8, progress=False)
    ds = open_dataset(out)
    advised = recommend_loader_settings(ds)
    assert advised.num_workers == 0 and advised.reasons["num_workers"] == RAW_WORKERS_REASON
    summary = {"batches": 40, "wait_share": 0.9, "compute_s": 1.0, "wait_s": 9.0, "samples": 9}
    said = verdict(summary, advice=loader_bound_advice(ds))
    assert "imgpack tune" in said and "num_workers=" not in said  # tune's measure, no count
    assert "raw or memory-mapped format" not in said
    profiled = CliRunner().invoke(main, ["profile", str(out), "--workers", "0", "--batches", "12",
                                         "--batch-size", "4", "--step-ms", "0"])  # fmt: skip
    assert profiled.exit_code == 0, profiled.output
    assert "use a raw" not in profiled.output
    # The loader's note on workers names no worker count: it points to tune.
    code = (
        "import warnings; from imgpack.loading import Loader; from imgpack import "
        "open_dataset; from imgpack.readers import collate\n"
        f"ds = open_dataset({str(out)!r})\n"
        "for _ in Loader(ds, batch_size=2, num_workers=1, collate_fn=collate): pass\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = done.stderr.replace("\n", " ")
    assert "imgpack tune" in said and "num_workers=0" not in said


def test_an_unlabelled_output_previews_in_one_row_and_counts_its_samples(
    images: Path, tmp_path: Path
) -> None:
    out = tmp_path / "unlabelled"
    convert(images, out, "pt", no_labels=True, progress=False)
    result = CliRunner().invoke(main, ["preview", str(out), "-o", str(tmp_path / "p.png"),
                                       "--per-class", "5"])  # fmt: skip
    assert result.exit_code == 0 and "5 samples in 1 row(s)" in result.output, result.output
    info = CliRunner().invoke(main, ["info", str(out)])
    assert "unlabelled: 30 samples (label -1)" in info.output
