"""Conversion to a local path by shard tasks (imgpack.direct.write_local): the workers write
whole shards into the output's temp folder and only receipts come back, as for a bucket. One
plan gives one output wherever it is written: the same files, byte for byte, locally and in a
bucket (moto's server on 127.0.0.1, the ``s3`` fixture), with any number of workers, and after
a run killed midway is resumed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from click.testing import CliRunner
from conftest import CountingExecutor, build_uniform_folder, count_shard_writes

import imgpack.direct as direct
from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.manifest import MANIFEST_NAME
from imgpack.publishing import leftovers

SHARDED = ("pt", "tfrecord", "webdataset")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("src") / "src", count=40, classes=4)


def _files(root: Path) -> dict[str, str]:
    """Each file of a local output but its manifest, by name: its sha256."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.name != MANIFEST_NAME and p.is_file()
    }


def _bucket_files(url: str) -> dict[str, str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {
        path[len(root) + 1 :]: hashlib.sha256(fs.cat_file(path)).hexdigest()
        for path in sorted(fs.find(root))
        if not path.endswith(f"/{MANIFEST_NAME}")
    }


@pytest.mark.parametrize("fmt", SHARDED)
def test_a_local_output_is_the_bucket_output_byte_for_byte(
    s3: str, images: Path, tmp_path: Path, fmt: str
) -> None:
    """The same images and options converted to a local path and to a bucket: the same shard
    files (and index files), the same manifest entries and output id; the temp folder and its
    receipts are gone, and the output reads and verifies."""
    args = {"shard_size": "4KB", "workers": 2, "progress": False}
    local = convert(images, tmp_path / "out", fmt, **args)
    bucket = convert(images, f"{s3}/local-{fmt}-{tmp_path.name}", fmt, **args)
    assert len(local.files) > 4
    assert local.output_id == bucket.output_id
    assert local.files == bucket.files
    assert _files(tmp_path / "out") == _bucket_files(f"{s3}/local-{fmt}-{tmp_path.name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder, no receipts
    assert not (tmp_path / "out" / direct.WORK).exists()
    assert verify(tmp_path / "out").ok
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 40 and ds.targets == sorted(ds.targets)


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_any_number_of_workers_writes_the_same_bytes(
    images: Path, tmp_path: Path, fmt: str
) -> None:
    outputs = []
    for workers in (1, 2, 4):
        out = tmp_path / f"w{workers}"
        convert(images, out, fmt, shard_size="3KB", workers=workers, progress=False,)  # fmt: skip
        outputs.append(_files(out))
    assert outputs[0] == outputs[1] == outputs[2]


def _slowed_convert(src: Path, dst: Path, args: list[str]) -> subprocess.Popen[bytes]:
    """``imgpack convert`` in a process of its own whose shard tasks each take 0.3 s more."""
    slow = (
        "import time, imgpack.direct as d; w = d.write_shard\n"
        "def slow(t):\n    time.sleep(0.3); return w(t)\n"
        "d.write_shard = slow\n"
    )
    script = f"{slow}from imgpack.cli import main\nmain()"
    command = [sys.executable, "-c", script, "convert", str(src), str(dst), "-q", *args]
    return subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE)


def _receipts_when(process: subprocess.Popen[bytes], dst: Path, count: int) -> int:
    """How many receipts the temp folder of the conversion ``process`` to ``dst`` holds once
    it holds ``count`` (the process still running; two minutes at most)."""
    deadline = time.monotonic() + 120
    receipts = 0
    while time.monotonic() < deadline and receipts < count:
        receipts = sum(direct.receipts_in(t) for t in leftovers(dst))
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.05)
    return receipts


@pytest.mark.parametrize(("fmt", "listed"), [("pt", False), ("tfrecord", False), ("pt", True)])
def test_a_killed_conversion_resumes_to_the_same_bytes(
    images: Path, tmp_path: Path, fmt: str, listed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILLed once some shards have receipts: DST does not exist, the temp folder is kept,
    and --resume writes only the shards without a receipt, to the bytes of a run that was not
    interrupted; from an image folder, and from a label list of its files."""
    args = ["--format", fmt, "--shard-size", "2KB", "--workers", "2"]
    if listed:
        args = ["--labels", str(_label_list(images, tmp_path / "list.csv")), *args]
    reference = tmp_path / "reference"
    done = CliRunner().invoke(main, ["convert", str(images), str(reference), "-q", *args])
    assert done.exit_code == 0, done.output
    total = len(open_dataset(reference).manifest.files)
    dst = tmp_path / "out"
    process = _slowed_convert(images, dst, args)
    receipts = _receipts_when(process, dst, 3)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    assert not dst.exists() and len(leftovers(dst)) == 1
    written = count_shard_writes(monkeypatch)
    again = ["convert", str(images), str(dst), "-q", "--resume", *args[:-2]]
    resumed = CliRunner().invoke(main, [*again, "--workers", "1"])
    assert resumed.exit_code == 0, resumed.output
    assert 0 < len(written) <= total - receipts
    assert _files(dst) == _files(reference)
    assert leftovers(dst) == []


def test_an_interrupted_run_says_what_it_kept(images: Path, tmp_path: Path) -> None:
    """SIGTERM once some shards are written: the temp folder is kept for --resume and the
    message says how many shards it holds."""
    dst = tmp_path / "out"
    process = _slowed_convert(images, dst, ["--format", "pt", "--shard-size", "2KB"])
    _receipts_when(process, dst, 2)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert b"shard(s) written: run the same command with --resume" in err, err
    assert len(leftovers(dst)) == 1 and not dst.exists()


@pytest.mark.parametrize("name", ["o[1]", "o**x"])
def test_a_destination_name_is_never_a_pattern(images: Path, tmp_path: Path, name: str) -> None:
    """The temp folder beside DST is named after it: a name with glob characters is a name."""
    convert(images, tmp_path / name, "pt", shard_size="4KB", progress=False)
    assert len(open_dataset(tmp_path / name)) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_the_dry_run_names_the_shards_the_tasks_write(images: Path, tmp_path: Path) -> None:
    from imgpack.pipeline import dry_run

    planned = dry_run(images, tmp_path / "out", "tfrecord", shard_size="4KB")
    manifest = convert(images, tmp_path / "out", "tfrecord", shard_size="4KB", progress=False)
    assert planned.shards_exact
    assert planned.shards == [f.path for f in manifest.files]


@pytest.mark.parametrize("fmt", ["tfrecord", "webdataset"])
def test_any_number_of_parts_write_one_local_output(images: Path, tmp_path: Path, fmt: str) -> None:
    """K = 1, 2, 3 parts written into one DST on a shared path (the parts of a cluster job):
    the same files byte for byte; until the last part finishes DST holds no manifest, and the
    last one writes it."""
    args = {"shard_size": "3KB", "workers": 2, "progress": False}
    convert(images, tmp_path / "whole", fmt, **args)
    reference = _files(tmp_path / "whole")
    for count in (2, 3):
        dst = tmp_path / f"k{count}"
        for part in range(count):
            done = convert(images, dst, fmt, num_parts=count, part=part, **args)
            if part < count - 1:
                assert done.part is not None and not (dst / MANIFEST_NAME).exists()
        assert done.part is None and (dst / MANIFEST_NAME).is_file()
        assert _files(dst) == reference
        assert verify(dst).ok
        again = convert(images, dst, fmt, num_parts=count, part=0, **args)
        assert again == done  # committed already: nothing is written again


def test_a_part_beside_another_parts_running_task_goes_on(images: Path, tmp_path: Path) -> None:
    """Parts on a shared path run at once: a part that looks at DST while another part's task
    writes its shard (a scratch folder in DST's work folder) goes on, and the commit removes
    the scratch a killed task left; the output is the single conversion's."""
    args = {"shard_size": "3KB", "workers": 1, "progress": False}
    convert(images, tmp_path / "whole", "webdataset", **args)
    dst = tmp_path / "parts"
    convert(images, dst, "webdataset", num_parts=2, part=0, **args)
    scratch = dst / direct.WORK / f"{direct.SCRATCH}x1y2z3"  # part 0's task, writing (or killed)
    scratch.mkdir()
    (scratch / "shard-000000.tar").write_bytes(b"half a shard")
    done = convert(images, dst, "webdataset", num_parts=2, part=1, **args)
    assert done.part is None and _files(dst) == _files(tmp_path / "whole")
    assert not (dst / direct.WORK).exists()


@pytest.mark.parametrize("fmt", SHARDED)
def test_fewer_shards_than_workers_are_converted_by_every_worker(
    images: Path, tmp_path: Path, fmt: str
) -> None:
    """An output of fewer shards than workers: the pool converts each shard's images and the
    driver writes the shard, so no worker waits; the bytes are those one task writes alone."""
    args = {"progress": False}
    one = convert(images, tmp_path / "w1", fmt, workers=1, **args)
    many = convert(images, tmp_path / "w4", fmt, workers=4, **args)
    assert len(one.files) == 1 and one.files == many.files
    assert _files(tmp_path / "w1") == _files(tmp_path / "w4")


def test_a_bad_image_in_a_shard_the_driver_writes_is_named_or_skipped(
    images: Path, tmp_path: Path
) -> None:
    import shutil

    from imgpack.errors import ImageError

    src = tmp_path / "src"
    shutil.copytree(images, src)
    (src / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    args = {"progress": False}
    with pytest.raises(ImageError, match=r"broken\.png: .*nothing was written"):
        convert(src, tmp_path / "failed", "webdataset", workers=4, **args)
    assert not (tmp_path / "failed").exists() and not leftovers(tmp_path / "failed")
    one = convert(src, tmp_path / "w1", "webdataset", workers=1, on_error="skip", **args)
    many = convert(src, tmp_path / "w4", "webdataset", workers=4, on_error="skip", **args)
    assert [s["path"] for s in many.skipped] == ["class1/broken.png"]
    assert one.skipped == many.skipped and many.num_samples == 40
    assert _files(tmp_path / "w1") == _files(tmp_path / "w4")


@pytest.mark.parametrize("fmt", SHARDED)
def test_the_shard_plan_counts_the_bytes_written(images: Path, tmp_path: Path, fmt: str) -> None:
    """``--shard-size`` counts what a shard holds, its format's framing included: a raw
    webdataset sample is three tar members, 3 KB for 192 bytes of pixels, and its shards stay
    within the size (plus the tar's closing blocks) instead of holding 16x as many samples."""
    limit = 8_000
    manifest = convert(images, tmp_path / "out", fmt, encoding="raw", size=8, progress=False,
                       shard_size=limit)  # fmt: skip
    sizes = [f.bytes for f in manifest.files]
    assert len(sizes) > 1
    assert max(sizes) <= limit + 10_240, sizes  # a tar ends in whole 10,240-byte records
    assert sum(sizes) / len(sizes) >= limit / 3, sizes


def open_dataset_part(folder: Path) -> Any:
    """The manifest a part written apart keeps beside its shards."""
    from imgpack.opening import read_part_manifest

    return read_part_manifest(folder)


@pytest.mark.parametrize("fmt", SHARDED)
def test_parts_written_apart_merge_into_the_single_conversions_files(
    images: Path, tmp_path: Path, fmt: str
) -> None:
    """K = 2 and 3 parts by shard tasks, each into a folder of its own (the parts of a job
    whose nodes share no disk): each folder is a part (its manifest beside its shards, under
    the whole output's names), readable as the others' parts are, and ``imgpack merge`` joins
    them into the single conversion's files, byte for byte, through the CLI."""
    from click.testing import CliRunner

    from imgpack.cli import main

    args = {"shard_size": "3KB", "workers": 2, "progress": False}
    whole = convert(images, tmp_path / "whole", fmt, **args)
    reference = _files(tmp_path / "whole")
    for count in (2, 3):
        parts = [tmp_path / f"k{count}-p{part}" for part in range(count)]
        seen = 0
        for part, folder in enumerate(parts):
            done = convert(images, folder, fmt, num_parts=count, part=part, **args)
            assert done.part is not None and not (folder / MANIFEST_NAME).exists()
            assert (folder / f".imgpack-part-{part}-of-{count}.json").is_file()
            seen += done.num_samples
        assert seen == whole.num_samples
        before = _files(parts[0])
        again = convert(images, parts[0], fmt, num_parts=count, part=0, resume=True, **args)
        kept = open_dataset_part(parts[0]).part  # a resumed part writes nothing new
        assert {k: v for k, v in again.part.items() if k != "pending"} == kept
        assert _files(parts[0]) == before
        merged = tmp_path / f"merged-{count}"
        result = CliRunner().invoke(main, ["merge", *map(str, parts), str(merged), "-q"])
        assert result.exit_code == 0, result.output
        assert _files(merged) == reference
        manifest = open_dataset(merged).manifest
        assert [f.path for f in manifest.files] == [f.path for f in whole.files]
        assert [f.sha256 for f in manifest.files] == [f.sha256 for f in whole.files]
        assert open_dataset(merged).targets == open_dataset(tmp_path / "whole").targets
        assert verify(merged).ok


def test_a_shared_destination_is_not_merged(images: Path, tmp_path: Path) -> None:
    """Parts that share a DST leave their manifests there until the last commits; one that did
    not finish (two part manifests, no ``imgpack.json``) is refused by merge in one line."""
    from click.testing import CliRunner

    from imgpack.cli import main

    args = {"shard_size": "3KB", "workers": 1, "progress": False}
    dst = tmp_path / "shared"
    for part in (0, 1):
        convert(images, dst, "pt", num_parts=3, part=part, **args)
    assert len(list(dst.glob(".imgpack-part-*"))) == 2
    result = CliRunner().invoke(main, ["merge", str(dst), str(tmp_path / "m"), "-q"])
    assert result.exit_code != 0 and "running its last part again" in result.output
    convert(images, dst, "pt", num_parts=3, part=2, **args)
    assert (dst / MANIFEST_NAME).is_file() and not list(dst.glob(".imgpack-part-*"))


def test_merged_parts_list_what_the_scan_could_not_take_once(images: Path, tmp_path: Path) -> None:
    """An image beside the class folders, skipped (``--on-error skip``): every part's scan
    finds it, part 0 alone lists it, and the merged output lists it once, as one conversion
    does."""
    import shutil

    from click.testing import CliRunner

    from imgpack.cli import main

    src = tmp_path / "src"
    shutil.copytree(images, src)
    stray = next(p for p in sorted(src.rglob("*")) if p.is_file())
    shutil.copy(stray, src / f"stray{stray.suffix}")
    args = {"shard_size": "3KB", "progress": False, "on_error": "skip"}
    whole = convert(src, tmp_path / "whole", "pt", **args)
    assert [s["path"] for s in whole.skipped] == [f"stray{stray.suffix}"]
    parts = [tmp_path / f"p{part}" for part in range(2)]
    kept = [
        convert(src, folder, "pt", num_parts=2, part=k, **args) for k, folder in enumerate(parts)
    ]
    assert [len(m.skipped) for m in kept] == [1, 0]
    result = CliRunner().invoke(main, ["merge", *map(str, parts), str(tmp_path / "m"), "-q"])
    assert result.exit_code == 0, result.output
    assert open_dataset(tmp_path / "m").manifest.skipped == whole.skipped
    assert _files(tmp_path / "m") == _files(tmp_path / "whole")


@pytest.mark.parametrize("shared", [False, True])
def test_more_parts_than_shards(images: Path, tmp_path: Path, shared: bool) -> None:
    """A plan of one shard in 3 parts: parts 0 and 1 hold no shard, part 2 every one. Written
    apart, none of them commits an output (part 2 holds the whole output's shard, but merge joins
    the three: the single conversion's files); into one shared DST, the last part to run commits
    it, whichever holds the shard. Each part written apart is read as a part."""
    args = {"progress": False}
    whole = convert(images, tmp_path / "whole", "pt", **args)
    assert len(whole.files) == 1
    if shared:
        dst = tmp_path / "shared"
        for part in (2, 0, 1):  # the part with the shard first
            done = convert(images, dst, "pt", num_parts=3, part=part, **args)
            assert (done.part is None) == (part == 1)
            assert (dst / MANIFEST_NAME).is_file() == (part == 1)
        assert _files(dst) == _files(tmp_path / "whole")
        assert open_dataset(dst).targets == open_dataset(tmp_path / "whole").targets
        return
    parts = [tmp_path / f"p{part}" for part in range(3)]
    kept = [convert(images, p, "pt", num_parts=3, part=k, **args) for k, p in enumerate(parts)]
    assert [m.num_samples for m in kept] == [0, 0, whole.num_samples]
    assert [(m.part["start"], m.part["stop"]) for m in kept] == [(0, 0), (0, 0), (0, 40)]
    assert not any((p / MANIFEST_NAME).exists() for p in parts)
    assert open_dataset(parts[2]).targets == open_dataset(tmp_path / "whole").targets
    assert len(open_dataset(parts[0])) == 0
    info = CliRunner().invoke(main, ["info", str(parts[2])])
    assert info.exit_code == 0, info.output
    assert "part:      --part 2 of --num-parts 3 (image files 0 to 40" in info.output
    result = CliRunner().invoke(main, ["merge", *map(str, parts), str(tmp_path / "m"), "-q"])
    assert result.exit_code == 0, result.output
    assert _files(tmp_path / "m") == _files(tmp_path / "whole")
    assert verify(tmp_path / "m").ok


class _Elsewhere:
    """A task executor whose workers may run on other machines, as Ray's (no
    ``local_machine``): here a one-process pool, so its tasks would run in this process."""

    def __init__(self) -> None:
        from imgpack.executors import LocalExecutor

        self.inner, self.workers = LocalExecutor(1), 1

    def outcomes(self, job: Any, samples: Any) -> Any:
        return self.inner.outcomes(job, samples)

    def tasks(self, function: Any, items: Any) -> Any:
        return self.inner.tasks(function, items)

    def alone(self, job: Any, samples: Any) -> Any:
        return self.inner.alone(job, samples)


def test_workers_elsewhere_leave_a_paths_shards_to_the_driver(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local DST is a folder of this machine: workers that may run on other nodes convert the
    samples, and the driver writes each shard of the same plan, so the files are the pool's,
    byte for byte (and Ray's output is a local conversion's)."""
    args = {"shard_size": "3KB", "progress": False}
    written = count_shard_writes(monkeypatch)
    convert(images, tmp_path / "elsewhere", "webdataset", executor=_Elsewhere(), **args)
    assert written == []  # no task wrote a shard
    convert(images, tmp_path / "pool", "webdataset", workers=1, **args)
    assert len(written) > 2  # a pool on this machine: its tasks write them
    assert _files(tmp_path / "elsewhere") == _files(tmp_path / "pool")


def test_an_unlabelled_folder_is_written_by_shard_tasks(
    s3: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unlabelled folder (``--no-labels``) plans its shards as an image folder does: the
    tasks write them, locally and to a bucket, the same files for any worker count."""
    args = {"shard_size": "3KB", "progress": False, "no_labels": True}
    written = count_shard_writes(monkeypatch)
    one = convert(images, tmp_path / "one", "webdataset", workers=1, **args)
    assert written and one.classes == [] and len(one.files) > 2
    monkeypatch.undo()  # the pool's workers run the real tasks
    two = convert(images, tmp_path / "two", "webdataset", workers=2, **args)
    url = f"{s3}/unlabelled-{tmp_path.name}"
    bucket = convert(images, url, "webdataset", workers=2, **args)
    assert one.files == two.files == bucket.files
    assert _files(tmp_path / "one") == _files(tmp_path / "two") == _bucket_files(url)
    assert open_dataset(tmp_path / "one").targets == [-1] * 40


def _tars(images: Path, folder: Path) -> Path:
    """``images`` as two foreign WebDataset tars (``key.png``, ``key.cls`` and ``key.txt`` per
    sample, as the ``webdataset`` package writes them), in ``folder``."""
    import io
    import tarfile

    folder.mkdir()
    files = sorted(images.rglob("*.png"))
    classes = sorted({p.parent.name for p in files})
    for number, chunk in enumerate((files[:25], files[25:])):
        with tarfile.open(folder / f"part-{number}.tar", "w") as tar:
            for k, file in enumerate(chunk):
                members = {
                    "png": file.read_bytes(),
                    "cls": str(classes.index(file.parent.name)).encode(),
                    "txt": f"caption {number} {k}".encode(),
                }
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{number}{k:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def test_a_label_list_of_urls_is_written_by_shard_tasks(
    s3: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A label list of bucket URLs: the objects' sizes are asked in bulk (a folder the list
    names 16 or more objects of by one listing, the others by one HEAD each), the tasks write
    the shards, each object is read once, and a local DST with 1 and 2 workers and a bucket
    DST get the same files."""
    import s3fs

    fs = fsspec.filesystem("s3")
    base = f"{s3}/urls-{tmp_path.name}".removeprefix("s3://")
    rows = []
    for k, file in enumerate(sorted(images.rglob("*.png"))):
        key = f"flat/{k:03d}.png" if k < 36 else f"own{k}/{k:03d}.png"
        fs.put(str(file), f"{base}/{key}")
        rows.append(f"s3://{base}/{key},{file.parent.name}")
    listed = tmp_path / "urls.csv"
    listed.write_text("path,label\n" + "\n".join(rows) + "\n")
    calls: list[tuple[str, str]] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        calls.append((method, str(k.get("Key") or k.get("Prefix") or "")))
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)  # the first conversion's
    args: dict[str, Any] = {"shard_size": "3KB", "progress": False}
    url = f"{s3}/urls-out-{tmp_path.name}"
    _written_three_ways(listed, tmp_path, url, "webdataset", args, monkeypatch)
    gets = sorted(key for method, key in calls if method == "get_object")
    assert gets == sorted(row.split(",")[0].split("/", 3)[3] for row in rows)  # each once
    lists = [key for method, key in calls if method.startswith("list_objects")]
    heads = [key for method, key in calls if method == "head_object"]
    assert lists == [f"{base.split('/', 1)[1]}/flat/"] and len(heads) == 4
    ds = open_dataset(tmp_path / "one")
    assert len(ds) == 40 and ds.stored_paths()[0] == rows[0].split(",")[0]


def test_the_workers_ask_the_sizes_of_a_label_lists_objects(
    s3: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A label list of bucket URLs in several folders: its objects' sizes are asked by the
    conversion's workers, whole folders to a task (the store's pages parsed on their CPUs),
    this process asking none; the same plan, so the same files, as when it asks them itself."""
    import s3fs

    from imgpack.storage import location

    fs = fsspec.filesystem("s3")
    base = f"{s3}/sized-{tmp_path.name}".removeprefix("s3://")
    rows = []
    for k, file in enumerate(sorted(images.rglob("*.png"))):
        key = f"folder{k % 5}/{k:03d}.png"
        fs.put(str(file), f"{base}/{key}")
        rows.append(f"s3://{base}/{key},{file.parent.name}")
    listed = tmp_path / "urls.csv"
    listed.write_text("path,label\n" + "\n".join(rows) + "\n")
    args: dict[str, Any] = {"labels": str(listed), "shard_size": "3KB", "progress": False}
    reference = convert(images, tmp_path / "reference", "webdataset", workers=1, **args)
    asked: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *a: object, **k: object) -> object:
        if method.startswith("list_objects") or method == "head_object":
            asked.append(str(k.get("Key") or k.get("Prefix") or ""))
        return await real(self, method, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    monkeypatch.setattr(location, "SIZES_PER_TASK", 16)  # 40 objects, 8 a folder: 3 tasks
    runner = CountingExecutor()
    done = convert(images, tmp_path / "out", "webdataset", executor=runner, **args)
    groups = [item for item in runner.given if isinstance(item, list)]
    assert asked == [] and [len(g) for g in groups] == [16, 16, 8]
    folders = [{url.rsplit("/", 1)[0] for url in group} for group in groups]
    assert sum(len(f) for f in folders) == 5  # no folder asked by two tasks
    assert done.output_id == reference.output_id and done.files == reference.files
    assert _files(tmp_path / "out") == _files(tmp_path / "reference")


@pytest.mark.parametrize("kind", ["webdataset png", "pt raw", "tensorflow", "hugging face"])
def test_outputs_and_tfrecords_are_written_by_shard_tasks(
    s3: str, images: Path, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An imgpack output (its records carried over as they are, or re-encoded), a TFRecord
    file TensorFlow wrote and a saved Hugging Face dataset plan their shards from their
    records' sizes: the tasks write them, and one plan gives the same files, byte for byte,
    with 1 and 2 workers and in a bucket; carried-over samples read back as the source holds
    them."""
    if kind == "webdataset png":
        src = tmp_path / "src"
        convert(images, src, "webdataset", encoding="png", progress=False)
        args: dict[str, Any] = {"encoding": "png"}
    elif kind == "pt raw":
        src = tmp_path / "src"
        convert(images, src, "pt", encoding="raw", size=8, progress=False)
        args = {"encoding": "jpeg", "size": 8}
    elif kind == "tensorflow":
        src = Path(__file__).parent / "data" / "tensorflow-written-synthetic.tfrecord"
        args = {}
    else:
        datasets = pytest.importorskip("datasets", reason="pip install 'imgpack[hf]'")
        files = sorted(images.rglob("*.png"))
        classes = sorted({p.parent.name for p in files})
        features = datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
        )
        table = {
            "image": [{"bytes": p.read_bytes(), "path": p.name} for p in files],
            "label": [classes.index(p.parent.name) for p in files],
        }
        src = tmp_path / "hf"
        datasets.Dataset.from_dict(table, features=features).save_to_disk(str(src))
        args = {}
    args |= {"shard_size": "2KB", "progress": False}
    url = f"{s3}/from-{kind.replace(' ', '-')}-{tmp_path.name}"
    _written_three_ways(src, tmp_path, url, "tfrecord", args, monkeypatch)
    out = open_dataset(tmp_path / "one")
    if kind == "webdataset png":  # carried over as they are
        source = open_dataset(src)
        assert len(out) == len(source) and out.targets == source.targets
        for k in (0, len(out) - 1):
            assert torch.equal(out[k][0], source[k][0])
    assert verify(tmp_path / "one").ok


@pytest.mark.parametrize("no_labels", [False, True])
def test_tars_are_written_by_shard_tasks(
    s3: str, images: Path, tmp_path: Path, no_labels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Foreign WebDataset tars (labelled or not) plan their shards from their members'
    headers: the tasks write them, and one plan gives the same files, byte for byte, with 1
    and 2 workers and in a bucket, each sample's image, label and text field as the tars hold
    them, in the tars' order."""
    tars = _tars(images, tmp_path / "tars")
    args: dict[str, Any] = {
        "shard_size": "3KB", "progress": False, "no_labels": no_labels, "fields": ("txt",)
    }  # fmt: skip
    _written_three_ways(tars, tmp_path, f"{s3}/tars-{tmp_path.name}", "pt", args, monkeypatch)
    ds = open_dataset(tmp_path / "one", fields="txt")
    files = sorted(images.rglob("*.png"))
    assert len(ds) == 40 and ds.stored_paths()[:2] == [
        "part-0.tar/00000.png",
        "part-0.tar/00001.png",
    ]
    assert ds[26][2] == "caption 1 1"
    if not no_labels:
        assert [ds.classes[t] for t in ds.targets] == [
            str(sorted({p.parent.name for p in files}).index(p.parent.name)) for p in files
        ]
    assert verify(tmp_path / "one").ok


def _written_three_ways(
    src: Path, tmp_path: Path, url: str, fmt: str, args: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Any:  # fmt: skip
    """``src`` converted to ``fmt`` with ``args`` by one worker (its tasks, run here, write
    every shard), by two, and to the bucket ``url``: one output id, one manifest's files and
    the same bytes every way. The local output is ``tmp_path / "one"``; its manifest is
    returned."""
    written = count_shard_writes(monkeypatch)
    one = convert(src, tmp_path / "one", fmt, workers=1, **args)
    assert sorted(written) == list(range(len(one.files))) and len(one.files) > 2
    monkeypatch.undo()  # the pool's workers run the real tasks
    two = convert(src, tmp_path / "two", fmt, workers=2, **args)
    bucket = convert(src, url, fmt, workers=2, **args)
    assert one.output_id == two.output_id == bucket.output_id
    assert one.files == two.files == bucket.files
    assert _files(tmp_path / "one") == _files(tmp_path / "two") == _bucket_files(url)
    return one


def _label_list(images: Path, where: Path, extra: list[str] | None = None) -> Path:
    """A CSV label list of ``images`` (paths relative to it, in reverse order, each with a
    ``weight`` column: a field), and ``extra`` rows after them."""
    rows = [
        f"{p.relative_to(images)},{p.parent.name},{k / 8}"
        for k, p in enumerate(sorted(images.rglob("*.png"), reverse=True))
    ]
    where.write_text("path,label,weight\n" + "\n".join([*rows, *(extra or [])]) + "\n")
    return where


@pytest.mark.parametrize("fmt", SHARDED)
def test_a_label_list_of_files_is_written_by_shard_tasks(
    s3: str, images: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A label list whose rows are files plans its shards from their sizes: the tasks write
    them, and one plan gives the same files, byte for byte, with 1 and 2 workers, in a bucket,
    and from 2 parts sharing DST; the samples keep the list's order, labels and fields."""
    listed = _label_list(images, tmp_path / "list.csv")
    args: dict[str, Any] = {"labels": str(listed), "shard_size": "3KB", "progress": False}
    url = f"{s3}/listed-{fmt}-{tmp_path.name}"
    one = _written_three_ways(images, tmp_path, url, fmt, args, monkeypatch)
    for part in (0, 1):
        convert(images, tmp_path / "parts", fmt, workers=2, num_parts=2, part=part, **args)
    parts = open_dataset(tmp_path / "parts").manifest
    assert one.output_id == parts.output_id and one.files == parts.files
    assert _files(tmp_path / "parts") == _files(tmp_path / "one")
    ds = open_dataset(tmp_path / "one", fields="weight")
    order = sorted(images.rglob("*.png"), reverse=True)
    assert ds.stored_paths() == [str(p.relative_to(images)) for p in order]
    assert [ds.classes[t] for t in ds.targets] == [p.parent.name for p in order]
    assert [float(ds[k][2]) for k in (0, 5)] == [0.0, 5 / 8]
    assert verify(tmp_path / "one").ok


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_a_last_round_short_of_the_workers_is_written_by_this_process(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Three shards on two workers: the first two by shard tasks in the workers, the third (a
    round short of the workers) converted by both and written by this process, so that no
    worker idles while another writes it alone; the bytes of a one-worker run."""
    from imgpack.pipeline import dry_run

    size = next(
        s for s in range(1000, 100000, 100) if len(dry_run(images, tmp_path / "p", fmt,
                                                          shard_size=s).shards) == 3
    )  # fmt: skip
    here: list[int] = []
    real = direct.shard_from

    def spying(task: direct.ShardTask, outcomes: Any) -> dict[str, Any]:
        here.append(task.number)  # in the workers too, where this list is a copy
        return real(task, outcomes)

    monkeypatch.setattr(direct, "shard_from", spying)
    convert(images, tmp_path / "two", fmt, shard_size=size, workers=2, progress=False)
    assert here == [2]
    monkeypatch.setattr(direct, "shard_from", real)
    convert(images, tmp_path / "one", fmt, shard_size=size, workers=1, progress=False)
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
