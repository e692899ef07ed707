"""Conversion to a bucket by shard tasks (imgpack.direct): the workers read SRC from the bucket and
write whole shards straight to DST, the driver keeps receipts and writes the manifest last.
A real S3 API: moto's server on 127.0.0.1 (the ``s3`` fixture)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    CountingExecutor,
    build_uniform_folder,
    count_shard_writes,
    jpeg_bytes,
    png_bytes,
    smooth_rgb,
    traced,
    tree_hashes,
)
from PIL import Image

import imgpack.direct as direct
from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.direct import receipt_check
from imgpack.errors import ImageError
from imgpack.executors import WORKER_DIED
from imgpack.readers import collate
from imgpack.sources import listing
from imgpack.sources.folder.source import ObjectFetcher
from imgpack.storage import destination
from imgpack.storage.cache import stats as cache_stats

SHARDED = ("pt", "tfrecord", "webdataset")
BUCKET = "imgpack-test"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("src") / "src", count=48, classes=4)


@pytest.fixture(scope="module")
def src_url(s3: str, images: Path) -> str:
    fsspec.filesystem("s3").put(str(images), f"{BUCKET}/shard-src", recursive=True)
    return f"{s3}/shard-src"


def _bucket(url: str) -> dict[str, bytes]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in sorted(fs.find(root))}


def _read(ds: object) -> tuple[torch.Tensor, torch.Tensor]:
    return collate(ds.__getitems__(list(range(len(ds)))))  # type: ignore[attr-defined]


def _same_samples(url: str, local: Path, cache: Path) -> None:
    remote, here = open_dataset(url, cache_dir=cache), open_dataset(local)
    (a, la), (b, lb) = _read(remote), _read(here)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert remote.classes == here.classes and remote.stored_paths() == here.stored_paths()


@pytest.mark.parametrize("fmt", SHARDED)
def test_bucket_to_bucket_equals_a_local_conversion(
    s3: str, src_url: str, images: Path, tmp_path: Path, fmt: str
) -> None:
    """Pixels, labels, order and paths of a local conversion of the same images; the driver
    downloads no image and builds nothing: the workers wrote the shards, and the bucket holds
    the output's files only (the work folder is gone)."""
    url = f"{s3}/b2b-{fmt}"
    before = cache_stats.downloads
    manifest = convert(src_url, url, fmt, shard_size="4KB", workers=2, progress=False,
                       cache_dir=tmp_path / "cache")  # fmt: skip
    assert cache_stats.downloads == before
    assert not (tmp_path / "cache" / destination.BUILDS).exists()
    assert manifest.num_samples == 48 and len(manifest.files) > 4
    assert manifest.source["path"] == src_url
    local = convert(images, tmp_path / "local", fmt, progress=False)
    _same_samples(url, tmp_path / "local", tmp_path / "cache")
    # The shard tasks' statistics (in their receipts) add up to the one writer's.
    assert manifest.stats == local.stats and manifest.stats["samples"] == 48
    listed = {"imgpack.json", *(f.path for f in manifest.files)}
    listed |= {c.path for f in manifest.files for c in f.companions}
    assert set(_bucket(url)) == listed
    assert verify(url).ok


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord"])
def test_runs_and_any_number_of_parts_write_the_same_bytes(
    s3: str, src_url: str, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs (2 workers, 1 worker) and K = 1, 2, 3 parts written into one DST: byte for
    byte the same output. Each part GETs only its own objects; the parts after the first plan
    from the listing it saved in DST (no LIST of SRC); the last part to finish commits the
    manifest, and a part run again after that returns it."""
    import s3fs

    args = {"shard_size": "3KB", "progress": False}
    whole = convert(src_url, f"{s3}/same-{fmt}-a", fmt, workers=2, **args)
    convert(src_url, f"{s3}/same-{fmt}-b", fmt, workers=1, **args)
    reference = _bucket(f"{s3}/same-{fmt}-a")
    assert _bucket(f"{s3}/same-{fmt}-b") == reference
    read: list[str] = []
    heads: list[str] = []
    lists: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        key = str(k.get("Key", ""))
        if key.startswith("shard-src/"):  # what a worker asks of a source object
            (read if method == "get_object" else heads).append(key.split("/", 1)[1])
        if method == "list_objects_v2" and str(k.get("Prefix", "")).startswith("shard-src"):
            lists.append(str(k["Prefix"]))
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    for count in (1, 2, 3):
        url = f"{s3}/same-{fmt}-k{count}"
        seen: set[str] = set()
        for i in range(count):
            read.clear()
            lists.clear()
            done = convert(src_url, url, fmt, workers=1, num_parts=count, part=i, **args)
            assert bool(lists) == (i == 0), lists  # part 0 listed SRC; the others read that
            if i < count - 1:
                assert done.part is not None and "imgpack.json" not in _bucket(url)
                assert sorted(read) == sorted({s for s in read})  # each object once
            assert not seen & set(read)  # no object of another part
            seen |= set(read)
        assert len(seen) == 48 and not [h for h in heads if "/" in h]  # one GET an image
        assert done.output_id == whole.output_id and done.part is None
        assert _bucket(url) == reference
        if count > 1:
            again = convert(src_url, url, fmt, workers=1, num_parts=count, part=0, **args)
            assert again == done  # committed already: nothing is written again


def test_a_shard_whose_images_are_all_skipped_is_empty_and_reads(
    s3: str, images: Path, tmp_path: Path
) -> None:
    """A shard's name is fixed by the plan before it is written: one whose every image is bad
    is written with no sample, and every format reads the output."""
    src = tmp_path / "src"
    build_uniform_folder(src, count=12, classes=2)
    bad = sorted((src / "class1").iterdir())[2]
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(30))
    for fmt in SHARDED:
        url = f"{s3}/empty-{fmt}"
        size = (src / "class0" / "img0000.png").stat().st_size
        done = convert(src, url, fmt, shard_size=size, on_error="skip", progress=False)
        assert [s["path"] for s in done.skipped] == [f"class1/{bad.name}"]
        assert 0 in [f.num_samples for f in done.files] and done.num_samples == 11
        ds = open_dataset(url, cache_dir=tmp_path / f"cache-{fmt}")
        assert len(ds) == 11 and len(_read(ds)[1]) == 11
        assert verify(url).ok


def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file named poison.png kills the process reading it (a decoder that crashes)."""
    real = ObjectFetcher.__call__

    def reading(self: ObjectFetcher, sample, policy, encoding):  # type: ignore[no-untyped-def]
        if sample.path.endswith("poison.png"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, sample, policy, encoding)

    monkeypatch.setattr(ObjectFetcher, "__call__", reading)


def test_a_file_that_kills_its_worker_is_named_or_skipped(
    s3: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard task that dies on every try: each of its images converted alone finds the file;
    it stops the run by name (the shards written are kept) or, with --on-error skip, is
    recorded as skipped and everything else is written."""
    fs = fsspec.filesystem("s3")
    fs.put(str(images), f"{BUCKET}/poison", recursive=True)
    fs.pipe(f"{BUCKET}/poison/class2/poison.png", (images / "class2" / "img0002.png").read_bytes())
    _poisoned(monkeypatch)
    url = f"{s3}/poison-out"
    with pytest.raises(ImageError, match=r"class2/poison\.png: the conversion worker reading it"):
        convert(f"{s3}/poison", url, "webdataset", shard_size="4KB", workers=2, progress=False)
    left = _bucket(url)
    assert "imgpack.json" not in left and any(n.endswith(".tar") for n in left)
    with pytest.raises(FileExistsError, match="unfinished work of another conversion"):
        convert(f"{s3}/poison", url, "webdataset", shard_size="4KB", on_error="skip",
                progress=False)  # fmt: skip
    done = convert(f"{s3}/poison", url, "webdataset", shard_size="4KB", workers=2,
                   on_error="skip", progress=False, overwrite=True)  # fmt: skip
    assert done.skipped == [{"path": "class2/poison.png", "reason": WORKER_DIED}]
    assert done.num_samples == 48
    assert not any(name.startswith(".imgpack-work") for name in _bucket(url))


def test_a_bad_image_is_named_by_its_url_and_nothing_is_committed(
    s3: str, images: Path, tmp_path: Path
) -> None:
    fs = fsspec.filesystem("s3")
    fs.put(str(images), f"{BUCKET}/badsrc", recursive=True)
    fs.pipe(f"{BUCKET}/badsrc/class1/zz-broken.png", b"\x89PNG\r\n\x1a\n" + bytes(30))
    with pytest.raises(ImageError, match=rf"{s3}/badsrc/class1/zz-broken\.png: "):
        convert(f"{s3}/badsrc", f"{s3}/bad-out", "pt", shard_size="4KB", progress=False)
    assert "imgpack.json" not in _bucket(f"{s3}/bad-out")


@pytest.mark.parametrize("resumed", ["in-process", "new-process"])
def test_a_killed_driver_resumes_to_the_same_bytes(
    s3: str, src_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resumed: str
) -> None:
    """The driver is SIGKILLed once some shards have receipts: the bucket holds no manifest,
    and --resume writes only the shards without a receipt, to the bytes of a run that was not
    interrupted; the first --resume commits, also in a new process (whose listing cache once
    hid the receipts it wrote itself)."""
    args = ["--format", "pt", "--shard-size", "2KB", "--workers", "2"]
    reference = f"{s3}/killed-ref"
    if "imgpack.json" not in _bucket(reference):
        run = CliRunner().invoke(main, ["convert", src_url, reference, "-q", *args])
        assert run.exit_code == 0, run.output
    url = f"{s3}/killed-{resumed}"
    env = {**os.environ, "IMGPACK_TEST_SLOW_SHARDS": "1"}
    slow = "import time, imgpack.direct as d; w = d.write_shard\n" \
        "def slow(t):\n    time.sleep(0.3); return w(t)\nd.write_shard = slow\n"  # fmt: skip
    script = f"{slow}from imgpack.cli import main\nmain()"
    command = [sys.executable, "-c", script, "convert", src_url, url, "-q", *args]
    process = subprocess.Popen(command, start_new_session=True, env=env, stderr=subprocess.PIPE)
    fs = fsspec.filesystem("s3")
    root = url.removeprefix("s3://")
    deadline = time.monotonic() + 120
    receipts: list[str] = []
    while time.monotonic() < deadline and len(receipts) < 3:
        fs.invalidate_cache()
        receipts = [p for p in fs.find(root) if "/.imgpack-work/" in p and "/shard-" in p]
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    left = _bucket(url)
    assert "imgpack.json" not in left
    total = len(open_dataset(reference, cache_dir=tmp_path / "c").manifest.files)
    written = count_shard_writes(monkeypatch)
    refused = CliRunner().invoke(main, ["convert", src_url, url, "-q", "--format", "lmdb"])
    assert refused.exit_code != 0 and "holds no imgpack.json" in refused.output
    workers = "1" if resumed == "in-process" else "2"  # receipts written by other processes
    again = ["convert", src_url, url, "-q", "--resume", *args[:-2], "--workers", workers]
    if resumed == "in-process":
        lists = _source_lists(monkeypatch)
        done = CliRunner().invoke(main, again)
        assert done.exit_code == 0, done.output
        assert 0 < len(written) <= total - 3
        assert lists == []  # planned from the listing the killed run saved in DST
    else:
        command = [sys.executable, "-c", "from imgpack.cli import main; main()", *again]
        ran = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0 and "still to be written" not in ran.stderr, ran.stderr
    assert _bucket(url) == _bucket(reference)


def _source_lists(monkeypatch: pytest.MonkeyPatch, prefix: str = "shard-src") -> list[str]:
    """The prefixes of the LISTs of SRC (objects under ``prefix``) this process asks from now."""
    import s3fs

    lists: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        if method == "list_objects_v2" and str(k.get("Prefix", "")).startswith(prefix):
            lists.append(str(k["Prefix"]))
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    return lists


@pytest.mark.parametrize("damage", ["lines", "head", "another-source"])
def test_a_saved_listing_that_is_not_this_sources_is_not_taken(
    s3: str, src_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:  # fmt: skip
    """Part 1 of 2 finds the listing part 0 saved damaged (its lines, its head) or another
    SRC's: it says so where it is damaged, lists SRC itself, and the parts still make the
    output of one conversion; the saved listing goes with the work folder at the commit."""
    fs = fsspec.filesystem("s3")
    args = {"shard_size": "3KB", "progress": False, "workers": 1}
    reference = f"{s3}/saved-ref"
    if "imgpack.json" not in _bucket(reference):
        convert(src_url, reference, "webdataset", **args)
    url = f"{s3}/saved-{damage}"
    convert(src_url, url, "webdataset", num_parts=2, part=0, **args)
    saved = f"{url.removeprefix('s3://')}/{direct.SAVED}"
    assert set(fs.ls(saved)) == {f"{saved}/listing.json", f"{saved}/listing.jsonl.gz"}
    if damage == "lines":
        fs.pipe(f"{saved}/listing.jsonl.gz", b"\x1f\x8b not gzip")
    elif damage == "head":
        fs.pipe(f"{saved}/listing.json", b"{not json")
    else:
        head = json.loads(fs.cat(f"{saved}/listing.json"))
        fs.pipe(f"{saved}/listing.json", json.dumps({**head, "source": f"{s3}/x"}).encode())
    lists = _source_lists(monkeypatch)
    with caplog.at_level("WARNING"):
        done = convert(src_url, url, "webdataset", num_parts=2, part=1, **args)
    assert lists and done.part is None
    said = [r.getMessage() for r in caplog.records if "listed again" in r.getMessage()]
    assert len(said) == (damage != "another-source"), said
    assert _bucket(url) == _bucket(reference)


def test_parts_on_a_shared_path_list_a_bucket_source_once(
    s3: str, src_url: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SRC in a bucket, DST on a shared path written in place by 2 parts: part 0 lists SRC and
    saves the listing in DST's work folder, part 1 plans from it (no LIST of SRC); the output
    is the single conversion's, and the work folder is gone."""
    args = {"shard_size": "3KB", "workers": 1, "progress": False}
    whole = convert(src_url, tmp_path / "whole", "tfrecord", **args)
    dst = tmp_path / "parts"
    convert(src_url, dst, "tfrecord", num_parts=2, part=0, **args)
    assert (dst / direct.SAVED / "listing.json").is_file()
    lists = _source_lists(monkeypatch)
    done = convert(src_url, dst, "tfrecord", num_parts=2, part=1, **args)
    assert lists == [] and done.output_id == whole.output_id
    files = sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file())
    assert files == sorted(
        p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*") if p.is_file()
    )
    assert not (dst / direct.WORK).exists()
    for name in files:
        assert (dst / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    # A part run again after the commit returns the output, and leaves nothing beside it (the
    # claim on the listing it took while it planned goes with the folders it made).
    again = convert(src_url, dst, "tfrecord", num_parts=2, part=0, **args)
    assert again.output_id == whole.output_id and not (dst / direct.WORK).exists()


# A part's CLI that counts its LISTs of SRC, each taking a second more: a listing that takes
# a while, so that parts started together find it under way (not done), as in a bucket of
# millions of objects.
_PART = """
import asyncio, atexit, json, sys
import s3fs
lists, real = [], s3fs.S3FileSystem._call_s3
async def counted(self, method, *a, **k):
    if method == "list_objects_v2" and str(k.get("Prefix", "")).startswith("shard-src"):
        lists.append(k["Prefix"])
        await asyncio.sleep(1)
    return await real(self, method, *a, **k)
s3fs.S3FileSystem._call_s3 = counted
log = sys.argv.pop(1)
atexit.register(lambda: open(log, "w").write(json.dumps(lists)))
from imgpack.cli import main
main()
"""


@pytest.mark.parametrize("where", ["bucket", "path"])
def test_parts_started_together_list_a_bucket_source_once(
    s3: str, src_url: str, tmp_path: Path, where: str
) -> None:
    """Two parts started at the same moment (two processes, as a job array starts them): both
    claim the listing of SRC in DST's work folder, one claim stands, and that part lists SRC;
    the other waits for the listing it saves and plans from it (no LIST of SRC). The output is
    the single conversion's, and no claim is left."""
    args = ["--format", "webdataset", "--shard-size", "3KB", "--workers", "1", "-q"]
    whole = convert(src_url, tmp_path / "whole", "webdataset", shard_size="3KB", workers=1,
                    progress=False)  # fmt: skip
    dst = f"{s3}/together" if where == "bucket" else str(tmp_path / "together")
    runs = []
    for part in (0, 1):
        lists = tmp_path / f"lists-{part}.json"
        command = [sys.executable, "-c", _PART, str(lists), "convert", src_url, dst, *args,
                   "--num-parts", "2", "--part", str(part)]  # fmt: skip
        runs.append((subprocess.Popen(command, stderr=subprocess.PIPE, text=True), lists))
    said = []
    try:
        for process, _ in runs:
            _, err = process.communicate(timeout=300)
            assert process.returncode == 0, err
            said.append(err)
    finally:  # a failed part does not leave the other running into the next test
        for process, _ in runs:
            if process.poll() is None:
                process.kill()
                process.communicate()
    listed = [json.loads(lists.read_text()) for _, lists in runs]
    assert sorted(map(bool, listed)) == [False, True], listed  # one part listed SRC
    waited = said[listed.index([])]  # the other says whom it waits for, in one line
    assert f"{src_url}: part {1 - listed.index([])} of 2 is on it" in waited, said
    assert open_dataset(dst, cache_dir=tmp_path / "c").manifest.output_id == whole.output_id
    files = _bucket(dst) if where == "bucket" else _tree(Path(dst))
    assert files == _tree(tmp_path / "whole")  # no claim, no work folder: the output alone


@pytest.mark.parametrize("held", ["notes.txt", "class0/notes.txt"])
def test_a_part_that_cannot_plan_its_source_leaves_no_claim(
    s3: str, tmp_path: Path, held: str
) -> None:
    """The part that claimed the listing fails (SRC holds no image: one file, or a class folder
    of text): it says so naming SRC, and takes its claim back, so the parts waiting for its
    listing go on at once (to the same message)."""
    src = f"{s3}/no-images-{held.count('/')}"
    fsspec.filesystem("s3").pipe(f"{src.removeprefix('s3://')}/{held}", b"not an image")
    dst = f"{s3}/no-claim-{held.count('/')}"
    command = ["convert", src, dst, "-q", "--format", "webdataset"]
    ran = CliRunner().invoke(main, [*command, "--num-parts", "2", "--part", "0"])
    assert ran.exit_code != 0 and "Traceback" not in ran.output
    assert f"Error: {src}: " in ran.output and "imgpack-src-" not in ran.output, ran.output
    assert not [k for k in _bucket(dst) if k.endswith(listing.SAVED_CLAIM)], _bucket(dst)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_what_a_bucket_destination_holds_is_checked(s3: str, src_url: str, images: Path) -> None:
    url = f"{s3}/held"
    fs = fsspec.filesystem("s3")
    fs.pipe(f"{BUCKET}/held/notes.txt", b"mine")
    with pytest.raises(FileExistsError, match=r"holds no imgpack\.json"):
        convert(src_url, url, "webdataset", progress=False)
    fs.rm_file(f"{BUCKET}/held/notes.txt")
    first = convert(src_url, url, "webdataset", shard_size="3KB", progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        convert(src_url, url, "webdataset", progress=False)
    second = convert(images, url, "webdataset", progress=False, overwrite=True)  # one shard
    assert len(second.files) == 1 < len(first.files)
    assert set(_bucket(url)) == {"imgpack.json", "data-000000.tar", "data-000000.idx"}
    work = f"{BUCKET}/other/.imgpack-work/0123456789abcdef/plan.json"
    fs.pipe(work, json.dumps({"output_id": "0123456789abcdef"}).encode())
    with pytest.raises(FileExistsError, match=r"unfinished work of another conversion"):
        convert(src_url, f"{s3}/other", "pt", progress=False)


def test_the_scan_of_a_bucket_is_listed_folder_by_folder_and_packed(
    s3: str, src_url: str, images: Path
) -> None:
    """The listing goes to a file on disk, one class folder at a time; the scan keeps the
    samples packed (no Python object per image) with the sizes the store lists, and equals the
    scan of the same folder on disk."""
    from imgpack.scan import SampleTable
    from imgpack.sources.base import ScanRequest
    from imgpack.sources.folder.scan import scan_folder
    from imgpack.sources.folder.source import FolderSource

    with listing.source_location(src_url, listing_only=lambda top: True) as folder:
        assert sorted(listing.store_folders(folder) or {}) == [f"class{i}" for i in range(4)]
        scan = FolderSource(folder).scan(ScanRequest())
    local = scan_folder(images)
    assert isinstance(scan.samples, SampleTable) and scan.samples == local.samples
    sizes = [scan.samples.size(i) for i in range(len(scan.samples))]
    assert sizes == [(images / s.path).stat().st_size for s in local.samples]


def test_a_packed_scan_takes_under_100_bytes_per_image() -> None:
    from itertools import repeat

    from imgpack.scan import SampleTable

    count = 100_000

    def scanned() -> SampleTable:
        table = SampleTable()
        for label in range(10):
            paths = (f"n{label:08d}/n{label:08d}_{i:06d}.JPEG" for i in range(count // 10))
            table.extend(paths, label, repeat(110_000))
        return table

    table, held, _ = traced(scanned)
    assert len(table) == count and table[12_345].path == "n00000001/n00000001_002345.JPEG"
    assert held / count < 100, f"{held / count:.0f} bytes per image"


def test_a_table_holds_what_every_source_kind_gives_a_sample() -> None:
    """A tar's samples (where in the tar, its ETag's id, the span read), a label list's (each
    row's own fields) and an output's (fields as columns) are packed as an image folder's are:
    each sample reads back whole, relabelled or placed; 100,000 tar members within 110 bytes a
    sample."""
    from imgpack.scan import Sample, SampleTable

    def whole(sample: Sample) -> tuple[Any, ...]:  # every attribute, compared or not
        return (sample.path, sample.label, sample.index, sample.listed, sample.fields,
                sample.size, sample.span)  # fmt: skip

    rows = [Sample(f"shard-{i // 100:05d}.tar/{i:08d}.jpg", i % 7, i * 10_240, 99, None,
                   100_000 + i, 101_024 + i) for i in range(100_000)]  # fmt: skip

    def packed() -> SampleTable:
        table = SampleTable()
        for r in rows:
            table.add(r.path, r.label, r.index, r.listed, size=r.size, span=r.span)
        return table

    tars, held, _ = traced(packed)
    assert held / len(rows) < 110, f"{held / len(rows):.0f} bytes per sample"
    assert [whole(s) for s in tars[:50]] == [whole(r) for r in rows[:50]]
    assert whole(tars[-1]) == whole(rows[-1]) and tars == rows
    listed = SampleTable()
    listed.add("a.jpg", 0, 1, fields={"box": [1, 2]})
    listed.add("b.jpg", 1, 2)
    assert [s.fields for s in listed] == [{"box": [1, 2]}, None]
    with pytest.raises(ValueError):
        listed.set_columns({"box": [1, 2]})  # one way per table
    columns = SampleTable()
    columns.extend(["a.jpg", "b.jpg"], 3)
    columns.set_columns({"caption": ["one", "two"], "score": [0.5, 1.5]})
    assert [s.fields for s in columns] == [
        {"caption": "one", "score": 0.5},
        {"caption": "two", "score": 1.5},
    ]
    moved = columns.relabelled([0, 0, 0, 9]).placed([(7, 70, 5), (8, 80, 6)])
    assert [whole(s) for s in moved] == [
        ("a.jpg", 9, 7, 5, {"caption": "one", "score": 0.5}, -1, 70),
        ("b.jpg", 9, 8, 6, {"caption": "two", "score": 1.5}, -1, 80),
    ]
    assert [s.label for s in columns] == [3, 3]  # the table relabelled is unchanged


def test_the_shard_plan_keeps_every_sample() -> None:
    """Shards stay within the limit, hold at least one sample each, and cover every sample:
    a lone empty file (listed size 0) gets its shard too, not dropped from the plan."""
    assert direct.cut(iter([]), 10) == [0]
    assert direct.cut(iter([0]), 10) == [0, 1]
    assert direct.cut(iter([6, 6, 6]), 10) == [0, 1, 2, 3]
    assert direct.cut(iter([3, 3, 3, 30, 1]), 10) == [0, 3, 4, 5]


def test_the_shard_plan_cuts_shards_of_near_equal_bytes() -> None:
    """As few shards as the limit allows, of near-equal bytes, none past the limit unless it
    holds one sample: where filling shards in order left a short last one (a worker idle at
    the end of a conversion of a few shards). Whatever the sizes, every sample once, in
    order."""
    assert direct.rollover(iter([10] * 10), 60) == [0, 6, 10]
    assert direct.cut(iter([10] * 10), 60) == [0, 5, 10]
    rng = np.random.default_rng(3)
    for _ in range(200):
        count = int(rng.integers(1, 400))
        sizes = rng.integers(0, int(rng.choice([50, 5000])), count).tolist()
        limit = int(rng.integers(1, 40_000))
        bounds = direct.cut(iter(sizes), limit)
        assert bounds[0] == 0 and bounds[-1] == count
        pairs = list(itertools.pairwise(bounds))
        assert all(a < b for a, b in pairs)
        shards = [sum(sizes[a:b]) for a, b in pairs]
        assert all(t <= limit or b - a == 1 for t, (a, b) in zip(shards, pairs, strict=True))
        assert len(shards) <= len(direct.rollover(iter(sizes), limit)) - 1
        if max(sizes) <= limit // 50:  # fine-grained samples: the shards are near-equal
            assert max(shards) - min(shards) <= 2 * max(sizes), (shards, limit)


def _unlabelled_tree(root: Path) -> Path:
    """Images at the top, in folders and subfolders (``a-b`` sorts between ``a``'s own files
    and ``a/c``'s), beside hidden names and a text file: what ``--no-labels`` takes."""
    rng = np.random.default_rng(8)
    names = ["top1.png", "top0.jpg", "a/x.png", "a/c/y.png", "a-b/z.png", "a-b/d/w.jpg",
             "b/v.PNG", ".hidden.png", ".cache/u.png", "a/notes.txt"]  # fmt: skip
    for k, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(smooth_rgb(rng, 20 + k, 24 + 2 * k))
        data = jpeg_bytes(img) if name.endswith(".jpg") else png_bytes(img)
        path.write_bytes(b"a note" if name.endswith(".txt") else data)
    return root


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_an_unlabelled_bucket_tree_is_read_in_place(
    s3: str, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--no-labels`` of a bucket tree is listed, not downloaded: the driver GETs no object
    and the workers GET each image once (none of the other objects); the samples, their order
    (folders by path: ``a-b`` between ``a``'s files and ``a/c``), pixels and paths are a local
    conversion's of the same tree, to a bucket DST and to a local one. Tars in a bucket are
    still WebDataset samples (read in place as tars)."""
    tree = _unlabelled_tree(tmp_path / "tree")
    name = f"unlabelled-{fmt}"
    fs = fsspec.filesystem("s3")
    fs.put(str(tree), f"{BUCKET}/{name}", recursive=True)
    gets = _source_gets(monkeypatch, name)
    here = tmp_path / "here"
    result = CliRunner().invoke(main, ["convert", f"{s3}/{name}", str(here), "-q", "--format",
                                       fmt, "--no-labels", "--workers", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    images = ["a-b/d/w.jpg", "a-b/z.png", "a/c/y.png", "a/x.png", "b/v.PNG", "top0.jpg",
              "top1.png"]  # fmt: skip
    assert sorted(gets) == images  # each image once, by the task run here; nothing else
    local = convert(tree, tmp_path / "local", fmt, no_labels=True, progress=False)
    url = f"{s3}/{name}-out"
    bucket = convert(f"{s3}/{name}", url, fmt, no_labels=True, workers=2, progress=False)
    assert bucket.num_samples == local.num_samples == 7
    expected = ["top0.jpg", "top1.png", "a/x.png", "a-b/z.png", "a-b/d/w.jpg", "a/c/y.png",
                "b/v.PNG"]  # fmt: skip
    assert open_dataset(tmp_path / "local").stored_paths() == sorted(expected, key=_walk_key)
    for out in (here, url):
        ds = open_dataset(out, cache_dir=tmp_path / "cache")
        assert ds.stored_paths() == open_dataset(tmp_path / "local").stored_paths()
        (a, la), (b, lb) = _read(ds), _read(open_dataset(tmp_path / "local"))
        assert _same_images(a, b) and la.tolist() == lb.tolist() == [-1] * 7
    # Two parts into one DST plan from the listing the first saved: the one-run bytes.
    parts = tmp_path / "parts"
    for part in ("0", "1"):
        args = ["--format", fmt, "--no-labels", "--shard-size", "2KB", "--num-parts", "2"]
        done = CliRunner().invoke(main, ["convert", f"{s3}/{name}", str(parts), "-q", *args,
                                         "--part", part])  # fmt: skip
        assert done.exit_code == 0, done.output
    whole = tmp_path / "whole"
    convert(f"{s3}/{name}", whole, fmt, no_labels=True, shard_size="2KB", progress=False)
    assert len(open_dataset(whole).manifest.files) > 2
    assert tree_hashes(parts) == tree_hashes(whole)
    # A bucket of tars with --no-labels: WebDataset samples, as a local folder of them gives.
    tars = tmp_path / "tars"
    convert(tree, tmp_path / "as-tars", "webdataset", no_labels=True, progress=False)
    tars.mkdir()
    for tar in (tmp_path / "as-tars").glob("*.tar"):
        (tars / tar.name).write_bytes(tar.read_bytes())
    monkeypatch.undo()
    fs.put(str(tars), f"{BUCKET}/{name}-tars", recursive=True)
    from_bucket = convert(f"{s3}/{name}-tars", tmp_path / "t1", "pt", no_labels=True, fields=(),
                          progress=False)  # fmt: skip
    from_here = convert(tars, tmp_path / "t2", "pt", no_labels=True, fields=(), progress=False)
    assert from_bucket.num_samples == from_here.num_samples == 7
    assert _same_images(
        _read(open_dataset(tmp_path / "t1"))[0], _read(open_dataset(tmp_path / "t2"))[0]
    )


@pytest.mark.parametrize("fmt", ["pt", "tfrecord"])
def test_a_label_list_over_a_bucket_folder_is_read_in_place(
    s3: str, images: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--labels FILE`` with SRC a bucket folder: SRC is listed, not downloaded; each row's
    object (``./`` and ``a/../`` resolved) is sized by the listing and GET once by the task
    that converts it; the samples, order, labels, paths as written and pixels are those of
    the same list over a local copy, in every part. A row whose object the bucket lacks, or
    that climbs above SRC, is named by its line."""
    name = f"listed-src-{fmt}"
    fs = fsspec.filesystem("s3")
    fs.put(str(images), f"{BUCKET}/{name}", recursive=True)
    files = sorted(p.relative_to(images).as_posix() for p in images.rglob("*.png"))
    rows = [f"./{files[0]},a", f"{files[1].split('/')[0]}/../{files[1]},b"]
    rows += [f"{path},{'a' if k % 2 else 'b'}" for k, path in enumerate(files[2:30])]
    listed = tmp_path / "list.csv"
    listed.write_text("path,label\n" + "\n".join(rows) + "\n")
    gets = _source_gets(monkeypatch, name)
    here = tmp_path / "here"
    args = ["--format", fmt, "--labels", str(listed), "--shard-size", "3KB"]
    result = CliRunner().invoke(main, ["convert", f"{s3}/{name}", str(here), "-q", *args,
                                       "--workers", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(gets) == sorted(files[:30])  # each listed object once, nothing else
    local = convert(images, tmp_path / "local", fmt, labels=str(listed), shard_size="3KB",
                    progress=False)  # fmt: skip
    ours, theirs = open_dataset(here), open_dataset(tmp_path / "local")
    assert ours.stored_paths() == theirs.stored_paths() == [r.split(",")[0] for r in rows]
    assert ours.classes == theirs.classes and ours.targets == theirs.targets
    assert torch.equal(_read(ours)[0], _read(theirs)[0])
    assert open_dataset(here).manifest.num_samples == local.num_samples == 30
    parts = tmp_path / "parts"
    for part in ("0", "1"):
        done = CliRunner().invoke(main, ["convert", f"{s3}/{name}", str(parts), "-q", *args,
                                         "--num-parts", "2", "--part", part])  # fmt: skip
        assert done.exit_code == 0, done.output
    assert tree_hashes(parts) == tree_hashes(here)
    for bad, says in (
        (f"{files[0]}x,a", "no such object"),
        ("../elsewhere.png,a", "not under SRC"),
    ):
        listed.write_text("path,label\n" + "\n".join([*rows[:3], bad]) + "\n")
        failed = CliRunner().invoke(main, ["convert", f"{s3}/{name}", str(tmp_path / "bad"),
                                           "-q", *args])  # fmt: skip
        assert failed.exit_code != 0 and "line 5" in failed.output and says in failed.output
        assert "Traceback" not in failed.output and not (tmp_path / "bad").exists()


def _source_gets(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """The keys under ``BUCKET/name`` this process GETs from now on (a task run here counts),
    in order; the driver downloading a source object into its scratch folder fails the test."""
    import s3fs

    gets: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        if method == "get_object" and str(k.get("Key", "")).startswith(f"{name}/"):
            gets.append(str(k["Key"]).split("/", 1)[1])
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    def no_download(*args: object) -> None:
        raise AssertionError("the driver downloaded a source object")

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    monkeypatch.setattr(listing, "_download", no_download)
    return gets


def _same_images(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _walk_key(path: str) -> tuple[str, str]:
    folder, _, file = path.rpartition("/")
    return folder, file


@pytest.mark.parametrize("key", ["cat//b.png", "dots/../../escape.png", "cat/./c.png"])
@pytest.mark.parametrize("how", ["shard tasks", "downloaded"])
def test_a_key_that_is_no_plain_path_is_refused_by_name(
    s3: str, images: Path, tmp_path: Path, key: str, how: str
) -> None:
    """Keys with an empty, '.' or '..' segment are neither dropped nor followed out of the
    scratch folder: the conversion stops naming the key, and writes nothing anywhere."""
    fs = fsspec.filesystem("s3")
    name = f"oddkeys-{abs(hash((key, how)))}"
    fs.put(str(images / "class0"), f"{BUCKET}/{name}/class0", recursive=True)
    fs.put(str(images / "class1"), f"{BUCKET}/{name}/class1", recursive=True)
    fs.pipe(f"{BUCKET}/{name}/{key}", (images / "class0" / "img0000.png").read_bytes())
    work = tmp_path / "here" / "deeper"
    work.mkdir(parents=True)
    if how == "shard tasks":
        dst, extra = f"{s3}/{name}-out", ["--format", "pt"]
    else:  # a WebDataset source is downloaded into a scratch folder first
        dst, extra = str(work / "out"), ["--format", "pt", "--source", "webdataset"]
    result = CliRunner().invoke(main, ["convert", f"{s3}/{name}", dst, "-q", *extra])
    assert result.exit_code == 1, result.output
    assert key in result.output and "path segment" in result.output
    assert "Traceback" not in result.output
    assert (
        not (tmp_path / "escape.png").exists() and not (tmp_path / "here" / "escape.png").exists()
    )
    assert not (work / "out").exists()
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/{name}-out/imgpack.json")


def test_an_object_replaced_after_the_listing_is_refused(
    s3: str, images: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan lists SRC; one object is replaced before the workers GET it: the worker sees
    another ETag than the listed one and the run stops naming the object, committing nothing
    (one output id never names two contents)."""
    import imgpack.sources.folder.source as folder_source

    fs = fsspec.filesystem("s3")
    fs.put(str(images), f"{BUCKET}/replaced", recursive=True)
    real = folder_source.scan_listing
    victim = "class1/img0001.png"

    def listed_then_replaced(*args: object, **kwargs: object) -> object:
        scan = real(*args, **kwargs)  # type: ignore[arg-type]
        other = (images / "class0" / "img0000.png").read_bytes()
        fs.pipe(f"{BUCKET}/replaced/{victim}", other)  # after the listing, before any GET
        return scan

    monkeypatch.setattr(folder_source, "scan_listing", listed_then_replaced)
    url = f"{s3}/replaced-out"
    result = CliRunner().invoke(main, ["convert", f"{s3}/replaced", url, "-q", "--format", "pt",
                                       "--workers", "1"])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert f"{victim}: the object was replaced after this conversion listed it" in result.output
    assert "Traceback" not in result.output
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/replaced-out/imgpack.json")


def _tamper(fs: object, root: str, receipt: str, how: str) -> None:
    """Change part 0's first receipt, or its shard object, as ``how`` says."""
    data = json.loads(fs.cat_file(receipt))  # type: ignore[attr-defined]
    shard = f"{root}/{data['file']['path']}"
    if how == "count":
        data["count"] += 1
    elif how == "range":
        data["start"], data["stop"] = data["start"] + 1, data["stop"] + 1
    elif how == "number":
        data["shard"] += 1
    elif how == "path":
        data["file"]["path"] = "shard-00099.pt"
    elif how == "etags":
        del data["etags"]
    elif how == "sha256":  # zeroed (the receipt's check then disagrees)
        data["file"]["sha256"] = "0" * 64
    elif how == "stats-class":  # statistics of another shape, made to match its check
        data["stats"]["per_class"].append(0)
        data["check"] = receipt_check(data)
    elif how == "stats-channels":
        data["stats"]["channels"] = 1
        data["check"] = receipt_check(data)
    elif how == "edited":  # a consistent edit of the sums, its check not made again
        data["stats"]["sum"][0] += 1
    elif how == "other-run":  # another conversion's receipt: its output id is not this one's
        data["output_id"] = "f" * len(data["output_id"])
        data["check"] = receipt_check(data)
    if how in ("swapped", "same-size"):
        blob = bytearray(fs.cat_file(shard))  # type: ignore[attr-defined]
        if how == "swapped":
            blob = blob[: len(blob) // 2]
        else:
            blob[-100] ^= 0xFF  # same size, other content: only the ETag tells
        fs.pipe_file(shard, bytes(blob))  # type: ignore[attr-defined]
    elif how == "garbage":
        fs.pipe_file(receipt, b"{not json")  # type: ignore[attr-defined]
    else:
        fs.pipe_file(receipt, json.dumps(data).encode())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "how",
    [
        "count", "range", "number", "path", "etags", "swapped", "same-size", "garbage",
        "sha256", "stats-class", "stats-channels", "edited", "other-run",
    ],
)  # fmt: skip
def test_a_tampered_receipt_or_shard_is_refused_at_the_commit(
    s3: str, src_url: str, how: str
) -> None:
    """Part 0 of 2 leaves its shards and receipts; one is changed; the part that would commit
    refuses in one line naming the receipt, and writes no manifest; --resume of part 0 writes
    that shard again and the output then commits whole and reads."""
    url = f"{s3}/tampered-{how}"
    args = ["--format", "pt", "--shard-size", "3KB", "--workers", "1", "--num-parts", "2"]
    first = CliRunner().invoke(main, ["convert", src_url, url, "-q", *args, "--part", "0"])
    assert first.exit_code == 0, first.output
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    receipts = sorted(p for p in fs.find(root) if "/.imgpack-work/" in p and "/shard-" in p)
    _tamper(fs, root, receipts[0], how)
    fs.invalidate_cache()
    second = CliRunner().invoke(main, ["convert", src_url, url, "-q", *args, "--part", "1"])
    assert second.exit_code == 1, second.output
    assert receipts[0].rsplit("/", 1)[1] in second.output and "nothing committed" in second.output
    assert "Traceback" not in second.output
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/imgpack.json")
    again = ["convert", src_url, url, "-q", *args, "--resume"]
    mended = CliRunner().invoke(main, [*again, "--part", "0"])
    assert mended.exit_code == 0, mended.output
    if "imgpack.json" not in _bucket(url):  # part 1 found part 0 unfinished: it commits now
        assert CliRunner().invoke(main, [*again, "--part", "1"]).exit_code == 0
    assert verify(url).ok
    assert len(open_dataset(url, verify=True)) == 48


@pytest.mark.parametrize("runs_tasks", [True, False])
def test_the_workers_list_the_sources_folders(
    s3: str, src_url: str, monkeypatch: pytest.MonkeyPatch, runs_tasks: bool
) -> None:
    """A bucket image folder's class folders are listed by the conversion's workers, a task
    each (the store's pages parsed on their CPUs, not the driver's): this process makes no LIST
    of a class folder, only the one of SRC's top level. An executor that runs no tasks has
    them listed here. Either way the same listing, so the same output, byte for byte."""
    args = {"shard_size": "3KB", "progress": False}
    reference = f"{s3}/listed-ref"
    if "imgpack.json" not in _bucket(reference):
        convert(src_url, reference, "webdataset", workers=1, **args)
    lists = _source_lists(monkeypatch)
    runner = CountingExecutor(runs_tasks)
    url = f"{s3}/listed-{runs_tasks}"
    convert(src_url, url, "webdataset", executor=runner, **args)
    folders = sorted({p for p in lists if p.startswith("shard-src/class")})
    listed = [item[2] for item in runner.given if isinstance(item, tuple)]
    if runs_tasks:
        assert folders == [] and listed == [f"class{k}" for k in range(len(listed))]
        assert len(listed) > 1
    else:
        assert len(folders) > 1 and listed == []
    assert _bucket(url) == _bucket(reference)


def _foreign_tars(root: Path) -> Path:
    """Three WebDataset tars another tool wrote: ``key.png``, ``key.cls`` and a ``key.txt``
    caption per sample (members in varied order), one key long enough to need a pax header."""
    import io
    import tarfile

    root.mkdir(parents=True)
    rng = np.random.default_rng(11)
    for shard in range(3):
        with tarfile.open(root / f"part-{shard}.tar", "w", format=tarfile.PAX_FORMAT) as tar:
            for k in range(7):
                key = f"{shard}{k:03d}" + ("-" + "long" * 30 if (shard, k) == (1, 3) else "")
                pixels = rng.integers(0, 256, size=(10 + k, 12, 3), dtype=np.uint8)
                image = png_bytes(Image.fromarray(pixels))
                members = [(f"{key}.png", image), (f"{key}.cls", str(k % 3).encode()),
                           (f"{key}.txt", f"caption {key}".encode())]  # fmt: skip
                for name, data in members[k % 3 :] + members[: k % 3]:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def test_webdataset_tars_in_a_bucket_are_read_in_place(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket folder of WebDataset tars is listed, not downloaded: each tar is read through
    once by the scan and its samples' members by ranged GETs of the tasks converting them.
    The output is the one the download route writes, byte for byte (one plan, one output),
    its samples, labels, captions and pixels those of the same tars converted here; two parts
    write the one-run bytes."""

    tars = _foreign_tars(tmp_path / "tars")
    url, args = _converted_in_place(tars, "wds-src", ".tar", s3, tmp_path, monkeypatch)
    local = tmp_path / "local"
    convert(tars, local, "pt", shard_size="2KB", progress=False)
    ours, theirs = open_dataset(tmp_path / "here"), open_dataset(local)
    assert ours.stored_paths() == theirs.stored_paths() and len(ours) == 21
    assert ours.classes == theirs.classes and ours.targets == theirs.targets
    assert ours.field("txt") == theirs.field("txt")
    assert _same_images(*(_read(ds)[0] for ds in (ours, theirs)))
    # The download route (what converted bucket tars before) writes the very same files, as
    # do two parts, and reads ahead of 5,000, 20,000 (ending inside a member: the next chunk
    # that needs it reads it again) and 1 MiB bytes.
    import imgpack.sources.webdataset.source as wds_source

    aheads = (5_000, 20_000, 1 << 20)
    _same_output_every_way(url, tmp_path, args, monkeypatch, wds_source, aheads, "scan_tars")
    # --no-labels over the same bucket: in place too, the captions kept, label -1.
    unlabelled = convert(url, tmp_path / "unlabelled", "pt", no_labels=True, fields=("txt",),
                         progress=False)  # fmt: skip
    assert unlabelled.num_samples == 21
    assert open_dataset(tmp_path / "unlabelled").field("txt") == theirs.field("txt")


def _converted_in_place(
    folder: Path,
    prefix: str,
    suffix: str,
    s3: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[str, list[str]]:
    """``folder`` put in the bucket under ``prefix`` and converted from there to ``pt`` at 2 KB
    a shard into ``tmp_path / "here"``: only its ``suffix`` files are GET, each by its scan and
    then once or twice a shard (a ranged GET a stretch), and the driver downloads nothing. The
    folder's URL and the arguments."""
    fsspec.filesystem("s3").put(str(folder), f"{BUCKET}/{prefix}", recursive=True)
    url = f"{s3}/{prefix}"
    args = ["--format", "pt", "--shard-size", "2KB", "--workers", "1", "-q"]
    gets = _source_gets(monkeypatch, prefix)
    result = CliRunner().invoke(main, ["convert", url, str(tmp_path / "here"), *args])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in folder.glob(f"*{suffix}"))
    assert sorted(set(gets)) == names  # those files only, nothing downloaded by the driver
    shards = len(open_dataset(tmp_path / "here").manifest.files)
    assert shards > 3 and len(gets) <= len(names) + 2 * shards  # a scan each, a GET a stretch
    monkeypatch.undo()
    return url, args


def _same_output_every_way(
    url: str,
    tmp_path: Path,
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    source: object,
    aheads: tuple[int, ...],
    scanner: str,
) -> None:
    """What ``args`` converted from the bucket folder ``url`` into ``tmp_path / "here"`` (21
    samples) is written byte for byte by the download route, by two parts (the second reads
    the listing and the scan the first saved: its ``scanner``, the ``source`` module's function
    that reads the objects through, is not called), and with a shard task's reads ahead of each
    of ``aheads`` bytes (the module's ``READ_AHEAD``, four samples a chunk) into 64 KB shards,
    the next chunks taking theirs from memory: a large read ahead makes fewer GETs than
    chunks, a small one more."""
    import imgpack.pipeline as pipeline

    here = tree_hashes(tmp_path / "here")
    monkeypatch.setattr(pipeline, "_in_place", lambda options: None)
    done = CliRunner().invoke(main, ["convert", url, str(tmp_path / "downloaded"), *args])
    assert done.exit_code == 0, done.output
    monkeypatch.undo()
    assert tree_hashes(tmp_path / "downloaded") == here
    parts = tmp_path / "parts"

    def scanned_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("a part read the objects through again")

    for part in ("0", "1"):
        if part == "1":
            monkeypatch.setattr(source, scanner, scanned_again)
        done = CliRunner().invoke(main, ["convert", url, str(parts), *args, "--num-parts", "2",
                                         "--part", part])  # fmt: skip
        assert done.exit_code == 0, done.output
    monkeypatch.undo()
    assert tree_hashes(parts) == here
    wide = [*args[:2], "--shard-size", "64KB", *args[4:]]
    done = CliRunner().invoke(main, ["convert", url, str(tmp_path / "wide"), *wide])
    assert done.exit_code == 0, done.output
    prefix = url.rsplit("/", 1)[1]
    scans = sum(key.endswith((".tar", ".tfrecord")) for key in _bucket(url))
    for ahead in aheads:
        monkeypatch.setattr(direct, "FETCH_GROUP", 4)
        monkeypatch.setattr(source, "READ_AHEAD", ahead)
        gets = _source_gets(monkeypatch, prefix)
        cut = CliRunner().invoke(main, ["convert", url, str(tmp_path / f"cut{ahead}"), *wide])
        assert cut.exit_code == 0, cut.output
        monkeypatch.undo()
        assert tree_hashes(tmp_path / f"cut{ahead}") == tree_hashes(tmp_path / "wide")
        reads = len(gets) - scans  # beside the scans'
        assert (reads < 21 / 4) if ahead > 1e5 else (reads > 21 / 4), (ahead, reads)


def test_a_damaged_saved_scan_is_not_taken(s3: str, tmp_path: Path) -> None:
    """Part 1 of 2 finds the scan of the tars part 0 saved beside the listing damaged: it reads
    the tars through again, and the parts still write the one-run bytes."""
    import imgpack.sources.webdataset.source as wds_source

    tars = _foreign_tars(tmp_path / "tars")
    fs = fsspec.filesystem("s3")
    fs.put(str(tars), f"{BUCKET}/wds-scan", recursive=True)
    url, args = f"{s3}/wds-scan", {"shard_size": "2KB", "progress": False, "workers": 1}
    convert(url, tmp_path / "one", "pt", **args)  # type: ignore[arg-type]
    parts = tmp_path / "parts"
    convert(url, parts, "pt", num_parts=2, part=0, **args)  # type: ignore[arg-type]
    saved = parts / direct.SAVED / listing.SAVED_SCAN
    assert json.loads((parts / direct.SAVED / listing.SAVED_HEAD).read_text())["scan"]
    saved.write_bytes(saved.read_bytes()[:-9] + b"damaged!!")
    scans = []
    real = wds_source.scan_tars
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wds_source, "scan_tars", lambda *a, **k: scans.append(1) or real(*a, **k))
        done = convert(url, parts, "pt", num_parts=2, part=1, **args)  # type: ignore[arg-type]
    assert scans == [1] and done.part is None
    assert tree_hashes(parts) == tree_hashes(tmp_path / "one")


def test_a_bucket_tar_replaced_or_truncated_is_named(s3: str, tmp_path: Path) -> None:
    """A tar replaced after the listing stops the run naming it, committing nothing; a tar cut
    short names the sample it cuts, by the tar's URL (``--on-error skip`` records it)."""
    import imgpack.sources.webdataset.source as wds_source

    tars = _foreign_tars(tmp_path / "tars")
    fs = fsspec.filesystem("s3")
    fs.put(str(tars), f"{BUCKET}/wds-bad", recursive=True)
    real = wds_source.scan_tars

    def scanned_then_replaced(*args: object, **kwargs: object) -> object:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        fs.pipe(f"{BUCKET}/wds-bad/part-1.tar", (tars / "part-0.tar").read_bytes())
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wds_source, "scan_tars", scanned_then_replaced)
        out = f"{s3}/wds-bad-out"
        result = CliRunner().invoke(main, ["convert", f"{s3}/wds-bad", out, "--format", "pt",
                                           "--workers", "1", "-q"])  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "part-1.tar: the object was replaced after this conversion listed it" in result.output
    assert "Traceback" not in result.output
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/wds-bad-out/imgpack.json")
    whole = (tars / "part-2.tar").read_bytes()
    fs.pipe(f"{BUCKET}/wds-bad/part-1.tar", (tars / "part-1.tar").read_bytes())
    fs.pipe(f"{BUCKET}/wds-bad/part-2.tar", whole[: len(whole) // 2])
    failed = CliRunner().invoke(main, ["convert", f"{s3}/wds-bad", str(tmp_path / "cut"), "-q",
                                       "--format", "pt"])  # fmt: skip
    assert failed.exit_code != 0 and f"{s3}/wds-bad/part-2.tar: sample" in failed.output
    assert "a truncated file" in failed.output and "Traceback" not in failed.output
    skipped = convert(f"{s3}/wds-bad", tmp_path / "skipped", "pt", on_error="skip",
                      progress=False)  # fmt: skip
    assert 14 < skipped.num_samples < 21 and skipped.skipped
    assert all(s["path"].startswith("part-2.tar/") for s in skipped.skipped)


def test_a_flat_bucket_is_listed_page_by_page(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket of images at its top level only (no folders, ``--no-labels``) is listed in the
    store's pages, each written to disk as it comes: the driver never lists the top level into
    memory whole (for millions of objects, gigabytes). The samples are every image, in the
    order a local copy gives, each read once by the task converting it."""
    import s3fs

    fs = fsspec.filesystem("s3")
    count = 1_500  # two of moto's 1,000-key pages
    image = png_bytes(Image.fromarray(np.full((4, 4, 3), 7, np.uint8)))
    names = [f"{k:05d}.png" for k in range(count)]
    fs.pipe({f"{BUCKET}/flat/{name}": image for name in names})
    fs.pipe(f"{BUCKET}/flat/.hidden.png", image)
    pages: list[dict[str, object]] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        if method == "list_objects_v2" and k.get("Prefix") == "flat/":
            pages.append(k)
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    real_lsdir = s3fs.S3FileSystem._lsdir

    async def lsdir(self: object, path: str, *a: object, **k: object) -> object:
        if path.strip("/") == f"{BUCKET}/flat":
            raise AssertionError("the top level was listed whole into memory")
        return await real_lsdir(self, path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    monkeypatch.setattr(s3fs.S3FileSystem, "_lsdir", lsdir)
    manifest = convert(f"{s3}/flat", tmp_path / "out", "pt", no_labels=True, workers=1,
                       progress=False)  # fmt: skip
    assert manifest.num_samples == count
    # The first page by the driver, the rest by key-range tasks (run here with one worker).
    assert len(pages) >= 2 and all(page.get("Delimiter") == "/" for page in pages)
    assert pages[0].get("StartAfter") is None and pages[1].get("StartAfter") == "flat/00998.png"
    assert open_dataset(tmp_path / "out").stored_paths() == names
    monkeypatch.undo()
    with pytest.raises(Exception, match="nothing there"):
        convert(f"{s3}/no-such-prefix", tmp_path / "none", "pt", no_labels=True, progress=False)


def test_a_flat_top_level_is_listed_by_range_tasks(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A top level of more than a page, with workers to lend: the driver lists its first page,
    then tasks list key ranges a few pages each, and what is left of a range is cut again for
    the next round. The listing (every line, in key order, and the folders' index) is the one
    the driver takes alone, whatever the keys: digits, letters, capitals, hidden and non-ASCII
    names, and folders among them."""
    from imgpack.executors import LocalExecutor

    fs = fsspec.filesystem("s3")
    names = [f"{k:05d}.png" for k in range(2_000)] + [f"img-{k}.png" for k in range(300)]
    names += [f"Z{k}.png" for k in range(100)] + [f"é{k}.png" for k in range(60)]
    names += [f"日本{k}.png" for k in range(60)] + [f".h{k}.png" for k in range(3)]
    names += [f"sub{k}/x.png" for k in range(4)]
    fs.pipe({f"{BUCKET}/flat-ranges/{name}": name.encode() for name in names})
    url = f"{s3}/flat-ranges"
    monkeypatch.setattr(listing, "RANGE_PAGES", 1)
    found = {}
    for label, runner in (("alone", None), ("tasks", LocalExecutor(2)), ("here", LocalExecutor(1))):
        tops: list[listing.TopLevel] = []
        with listing.source_folder(url, None, _noted(tops), runner) as got:
            assert not (got / listing.RANGE_PARTS).exists()  # the ranges' lines, joined
            found[label] = (
                (got / listing.STORE_LISTING).read_bytes(),
                (got / listing.STORE_FOLDERS).read_bytes(),
                tops,
            )
    lines, _, (top,) = found["alone"]
    keys = [json.loads(line)[0] for line in lines.splitlines()]
    flat = sorted((n for n in names if "/" not in n), key=lambda n: n.encode())
    assert keys == flat + [f"sub{k}/x.png" for k in range(4)]
    assert top.folders == tuple(f"sub{k}" for k in range(4)) and top.visible == len(flat) - 3
    assert found["tasks"] == found["alone"] and found["here"] == found["alone"]
    # Eight workers: the rest of the range where the 2,000 numbered keys crowd is cut in eight
    # for the next round, not in two, and the listing is the same.
    rounds: list[int] = []

    class Eight:
        workers = 8

        def tasks(self, function, items):  # type: ignore[no-untyped-def]
            given = list(items)
            rounds.append(len(given))
            return ((item, function(item)) for item in given)

    with listing.source_folder(url, None, _noted([]), Eight()) as got:
        assert (got / listing.STORE_LISTING).read_bytes() == found["alone"][0]
    assert rounds[0] == 9 and rounds[1] >= 8, rounds  # (eight ranges, and the one past ASCII)


def _noted(tops: list[listing.TopLevel]) -> Callable[[listing.TopLevel], bool]:
    """A ``listing_only`` that notes each top level it is given and lists in place."""

    def note(top: listing.TopLevel) -> bool:
        tops.append(top)
        return True

    return note


def _foreign_records(root: Path) -> Path:
    """Three TFRecord files another tool wrote: PNGs of varied sizes with their labels, class
    texts and file names, and features beyond the image's (boxes, a source id, a count some
    records lack) that become fields; the first with the ``.idx`` file DALI reads beside it."""
    from imgpack.formats.tfrecord import example, framing

    root.mkdir(parents=True)
    rng = np.random.default_rng(12)
    for number in range(3):
        records = []
        for k in range(7):
            pixels = rng.integers(0, 256, size=(9 + k, 11 + number, 3), dtype=np.uint8)
            label = (number + k) % 3
            features: dict[str, object] = {
                "image/encoded": [png_bytes(Image.fromarray(pixels))],
                "image/format": [b"PNG"],
                "image/class/label": [label],
                "image/class/text": [f"class-{label}".encode()],
                "image/filename": [f"shot-{number}-{k}.png".encode()],
                "image/object/bbox/xmin": [float(np.float32(0.125 * j)) for j in range(k % 3)],
                "image/source_id": [f"id-{number}-{k}".encode()],
            }
            if k % 2:
                features["image/object/count"] = [k]
            records.append(framing.frame(example.encode_example(features)))  # type: ignore[arg-type]
        (root / f"part-{number}.tfrecord").write_bytes(b"".join(records))
    path = root / "part-0.tfrecord"
    framing.write_index(path, framing.build_index(path))
    return root


def _same_dataset(ours: object, theirs: object) -> None:
    """Two outputs (or readers) hold the same samples: paths, classes, labels, fields, pixels."""
    a, b = ours, theirs
    assert a.stored_paths() == b.stored_paths() and a.classes == b.classes  # type: ignore[attr-defined]
    assert a.targets == b.targets and len(a) == len(b)  # type: ignore[attr-defined,arg-type]
    for found in a.manifest.fields:  # type: ignore[attr-defined]
        x, y = a.field(found.name), b.field(found.name)  # type: ignore[attr-defined]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert [v.tolist() if isinstance(v, torch.Tensor) else v for v in x] == [
                v.tolist() if isinstance(v, torch.Tensor) else v for v in y
            ]
    assert _same_images(*(_read(ds)[0] for ds in (a, b)))


def test_tfrecord_files_in_a_bucket_are_read_in_place(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket folder of TFRecord files is listed, not downloaded: each file is read through
    once by its scan and its records by ranged GETs of the tasks converting them. The output
    is the one the download route writes, byte for byte, its samples, labels, fields and
    pixels those of the same files converted here; worker counts and parts write one output."""
    import imgpack.sources.tfrecord.source as tf_source
    from imgpack.readers import TFRecordDataset

    files = _foreign_records(tmp_path / "files")
    url, args = _converted_in_place(files, "tf-src", ".tfrecord", s3, tmp_path, monkeypatch)
    ours = open_dataset(tmp_path / "here")
    assert len(ours) == 21 and [f.spec for f in ours.manifest.fields] == [
        "image_object_bbox_xmin:float[]", "image_object_count:int?", "image_source_id:str",
    ]  # fmt: skip
    convert(files, tmp_path / "local", "pt", shard_size="2KB", progress=False)
    _same_dataset(ours, open_dataset(tmp_path / "local"))
    _same_dataset(ours, TFRecordDataset(str(files)))
    # Scanned by the pool's tasks (2 workers): the one-run bytes.
    two = [*args[:4], "--workers", "2", "-q"]
    done = CliRunner().invoke(main, ["convert", url, str(tmp_path / "two"), *two])
    assert done.exit_code == 0, done.output
    assert tree_hashes(tmp_path / "two") == tree_hashes(tmp_path / "here")
    # The download route (what converted bucket TFRecords before) writes the very same files,
    # as do two parts, and reads ahead that end inside a record.
    aheads = (1_000, 3_000, 1 << 20)
    _same_output_every_way(url, tmp_path, args, monkeypatch, tf_source, aheads, "scan_record_files")


def test_compressed_and_tensorflow_written_tfrecords_in_a_bucket(s3: str, tmp_path: Path) -> None:
    """Files TensorFlow wrote, one of them GZIP-compressed (no random access: read as a stream
    from its start by the task that needs its records), are read in place: each file's objects
    GET by its scan and its tasks only, the samples in file order with the labels and pixels
    that ``TFRecordStream`` reads from the same files here, and those of a local conversion of
    them. A file replaced after the scan, or cut short, is named by its URL with nothing
    committed."""
    import shutil

    import imgpack.sources.tfrecord.source as tf_source
    from imgpack.readers import TFRecordStream

    data = Path(__file__).parent / "data"
    files = tmp_path / "tf"
    files.mkdir()
    for name in ("tensorflow-written-synthetic.tfrecord", "tensorflow-written-real.tfrecord",
                 "tensorflow-written-synthetic.gz.tfrecord"):  # fmt: skip
        shutil.copy(data / name, files / name)
    fs = fsspec.filesystem("s3")
    fs.put(str(files), f"{BUCKET}/tf-gz", recursive=True)
    url = f"{s3}/tf-gz"
    args = ["--format", "tfrecord", "--shard-size", "4KB", "--workers", "1", "-q"]
    with pytest.MonkeyPatch.context() as patch:
        gets = _source_gets(patch, "tf-gz")
        patch.setattr(direct, "FETCH_GROUP", 2)
        done = CliRunner().invoke(main, ["convert", url, str(tmp_path / "here"), *args])
        assert done.exit_code == 0, done.output
    assert sorted(set(gets)) == sorted(p.name for p in files.iterdir())
    ours = open_dataset(tmp_path / "here")
    assert len(ours.manifest.files) > 2
    stream = list(TFRecordStream(str(files)))
    assert ours.targets == [int(label) for _, label in stream]
    assert _same_images([ours[i][0] for i in range(len(ours))], [image for image, _ in stream])
    again = convert(url, tmp_path / "again", "tfrecord", shard_size="4KB", workers=2,
                    progress=False)  # fmt: skip
    assert again.output_id == ours.manifest.output_id
    assert tree_hashes(tmp_path / "again") == tree_hashes(tmp_path / "here")
    # The same files converted here (the compressed one too, by the same reads): one dataset.
    convert(files, tmp_path / "local", "tfrecord", shard_size="4KB", progress=False)
    _same_dataset(open_dataset(tmp_path / "local"), ours)
    # Replaced after the scan: named, nothing committed (a compressed file and a plain one).
    real = tf_source.scan_record_files
    for name in ("tensorflow-written-synthetic.gz.tfrecord", "tensorflow-written-real.tfrecord"):

        def scanned_then_replaced(*a: object, name: str = name, **k: object) -> object:
            found = real(*a, **k)  # type: ignore[arg-type]
            fs.pipe(f"{BUCKET}/tf-gz/{name}", (files / name).read_bytes() + b"\0")
            return found

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tf_source, "scan_record_files", scanned_then_replaced)
            out = f"{s3}/tf-gz-out"
            failed = CliRunner().invoke(main, ["convert", url, out, *args])
        assert failed.exit_code == 1, failed.output
        assert f"{name}: the object was replaced after this conversion listed it" in failed.output
        assert "Traceback" not in failed.output
        fs.invalidate_cache()
        assert not fs.exists(f"{BUCKET}/tf-gz-out/imgpack.json")
        fs.pipe(f"{BUCKET}/tf-gz/{name}", (files / name).read_bytes())
    whole = (files / "tensorflow-written-real.tfrecord").read_bytes()
    fs.pipe(f"{BUCKET}/tf-gz/tensorflow-written-real.tfrecord", whole[: len(whole) // 2])
    cut = CliRunner().invoke(main, ["convert", url, str(tmp_path / "cut"), *args])
    assert cut.exit_code != 0 and f"{url}/tensorflow-written-real.tfrecord" in cut.output
    assert "truncated record" in cut.output and "Traceback" not in cut.output
    assert not (tmp_path / "cut").exists()


def _fetches(monkeypatch: pytest.MonkeyPatch, log: Path) -> Callable[[], list[tuple[int, str]]]:
    """``(pid, file)`` of every file of an output that any process of this test fetches into
    its cache from now on (the conversion's forked workers too), as a function."""
    from imgpack.storage import cache, lazy

    real = cache.fetch_file

    def logged(fs: object, remote: str, *args: object) -> object:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()} {remote.rsplit('/', 1)[1]}\n")
        return real(fs, remote, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cache, "fetch_file", logged)
    monkeypatch.setattr(lazy, "fetch_file", logged)

    def found() -> list[tuple[int, str]]:
        lines = log.read_text(encoding="utf-8").split() if log.exists() else []
        return [(int(pid), name) for pid, name in zip(lines[::2], lines[1::2], strict=True)]

    return found


@pytest.mark.parametrize("fmt", ["pt", "tfrecord", "webdataset", "lmdb"])
def test_an_output_in_a_bucket_is_read_in_place(
    fmt: str, s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An imgpack output in a bucket as SRC is not downloaded by the driver: it reads the
    manifest (and the small index files); the workers' scan tasks, a data file each, and then
    their shard tasks read it through their own readers of the URL (each file fetched into the
    machine's cache once). The new output is a local copy's conversion byte for byte, fields
    and all, with 1 and 2 workers; an output replaced in the bucket after the scan is named and
    nothing is committed."""
    from test_fields_convert import coco_like, write_jsonl

    src = write_jsonl(tmp_path / "list.jsonl", coco_like(tmp_path, count=20))
    sharded = fmt != "lmdb"
    shard = {"shard_size": "1KB"} if sharded else {}
    local = tmp_path / "local"
    first = convert(src, local, fmt, progress=False, **shard)  # type: ignore[arg-type]
    fs = fsspec.filesystem("s3")
    fs.put(str(local), f"{BUCKET}/as-src-{fmt}", recursive=True)
    url = f"{s3}/as-src-{fmt}"
    args = {"shard_size": "2KB", "progress": False}
    expected = convert(local, tmp_path / "expected", "webdataset", **args)  # type: ignore[arg-type]
    data = sorted(e.path for e in first.files)
    for workers in (1, 2):
        fetched = _fetches(monkeypatch, tmp_path / f"fetched{workers}")
        out = tmp_path / f"w{workers}"
        done = convert(url, out, "webdataset", workers=workers, cache_dir=tmp_path / f"c{workers}",
                       **args)  # type: ignore[arg-type]  # fmt: skip
        monkeypatch.undo()
        assert done.output_id == expected.output_id and done.fields == expected.fields
        assert done.source["path"] == url
        assert done.source["converted_from"]["output_id"] == first.output_id
        assert tree_hashes(out) == {
            k: v for k, v in tree_hashes(tmp_path / "expected").items() if k != "imgpack.json"
        } | {"imgpack.json": tree_hashes(out)["imgpack.json"]}
        got = [name for _, name in fetched() if name in data]
        assert sorted(got) == data  # each data file fetched once, into the one cache
        if workers == 2:  # by the pool's workers, never by the driver
            assert {pid for pid, name in fetched() if name in data} - {os.getpid()}
            assert all(pid != os.getpid() for pid, name in fetched() if name in data)
    # Bucket to bucket: the same shards; the manifest names SRC by its URL.
    to_bucket = convert(url, f"{s3}/as-src-{fmt}-out", "webdataset", workers=2,
                        cache_dir=tmp_path / "c2", **args)  # type: ignore[arg-type]  # fmt: skip
    assert to_bucket.source["path"] == url and to_bucket.output_id == expected.output_id
    shards = {k: v for k, v in _bucket(f"{s3}/as-src-{fmt}-out").items() if k.startswith("data-")}
    assert shards == {p.name: p.read_bytes() for p in (tmp_path / "expected").glob("data-*")}
    # Two parts: the second takes the manifest and the scan the first saved (reads no file).
    import imgpack.sources.output.source as output_source

    def scanned_again(*a: object, **k: object) -> None:
        raise AssertionError("a part read the output's files through again")

    parts = tmp_path / "parts"
    for part in (0, 1):
        if part == 1:
            monkeypatch.setattr(output_source, "scan_output_files", scanned_again)
        convert(url, parts, "webdataset", workers=2, num_parts=2, part=part,
                cache_dir=tmp_path / "c2", **args)  # type: ignore[arg-type]  # fmt: skip
        monkeypatch.undo()
    made = tree_hashes(parts)
    assert {k: v for k, v in made.items() if k.startswith("data-")} == {
        k: v for k, v in tree_hashes(tmp_path / "expected").items() if k.startswith("data-")
    }
    assert open_dataset(parts).manifest.output_id == expected.output_id
    # Part 0 of another run saves the scan; after the output is replaced (below) it is not taken.
    convert(url, tmp_path / "stale", "webdataset", workers=2, num_parts=2, part=0,
            cache_dir=tmp_path / "c2", **args)  # type: ignore[arg-type]  # fmt: skip
    saved = f"{tmp_path / 'stale'}/{direct.SAVED}"
    with listing.source_location(url, listing_only=lambda top: True, saved=saved) as folder:
        assert listing.remote_manifest(folder).output_id == first.output_id
        assert (folder / listing.STORE_SCAN).is_file()  # taken: nothing of SRC read but one GET
    # Replaced in the bucket after the scan: the shard tasks' readers name it; nothing committed.
    real = output_source.scan_output_files

    def scanned_then_replaced(*a: object, **k: object) -> object:
        found = real(*a, **k)  # type: ignore[arg-type]
        converted = convert(src, tmp_path / "changed", fmt, progress=False, fields="score",
                            **shard)  # type: ignore[arg-type]  # fmt: skip
        fs.rm(f"{BUCKET}/as-src-{fmt}", recursive=True)
        fs.put(str(tmp_path / "changed"), f"{BUCKET}/as-src-{fmt}", recursive=True)
        assert converted.output_id != first.output_id
        return found

    monkeypatch.setattr(output_source, "scan_output_files", scanned_then_replaced)
    failed = CliRunner().invoke(main, ["convert", url, str(tmp_path / "late"), "--format",
                                       "webdataset", "--workers", "2", "-q"])  # fmt: skip
    assert failed.exit_code == 1, failed.output
    assert f"{url}: the source changed after this conversion planned it" in failed.output
    assert "Traceback" not in failed.output and not (tmp_path / "late").exists()
    # The saved scan is of the output before: a part or a resume now scans the new one.
    with listing.source_location(url, listing_only=lambda top: True, saved=saved) as folder:
        assert listing.remote_manifest(folder).output_id != first.output_id
        assert not (folder / listing.STORE_SCAN).exists()
