"""Trust on the newer surfaces (merge, resume, export, the cache, raw outputs, non-folder
sources): each case gives the right data or one clear imgpack error, never wrong data, lost data,
a path outside the intended folders, or a traceback."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    build_uniform_folder,
    output_manifest,
    refresh_manifest,
    rewrite_manifest,
    slow_cli,
)
from PIL import Image
from torch.utils.data import DataLoader

import imgpack
from imgpack import convert, merge, open_dataset, verify
from imgpack.cli import main
from imgpack.direct import receipts_in
from imgpack.errors import DataError, ImgpackError, ManifestError, OptionError
from imgpack.exporting import export
from imgpack.formats.tfrecord import example, framing
from imgpack.manifest import read_manifest, write_manifest
from imgpack.pipeline import CHECKPOINT, leftovers
from imgpack.readers import collate


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("trust") / "src", count=24, classes=3)


def _pixels(ds: object) -> list[bytes]:
    return [ds[i][0].numpy().tobytes() for i in range(len(ds))]  # type: ignore[index, arg-type]


# -- stale source readers --------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
def test_a_replaced_source_output_is_read_as_it_is_now(tmp_path: Path, workers: int) -> None:
    a = build_uniform_folder(tmp_path / "a", count=12, seed=1)
    b = build_uniform_folder(tmp_path / "b", count=12, seed=2)
    mid = tmp_path / "mid"
    convert(a, mid, format="pt", progress=False, workers=workers)
    convert(mid, tmp_path / "one", format="lmdb", progress=False, workers=workers)
    convert(b, mid, format="pt", progress=False, workers=workers, overwrite=True)
    convert(mid, tmp_path / "two", format="lmdb", progress=False, workers=workers)
    assert _pixels(open_dataset(tmp_path / "two")) == _pixels(open_dataset(mid))
    assert _pixels(open_dataset(tmp_path / "one")) != _pixels(open_dataset(tmp_path / "two"))


def test_a_worker_refuses_a_source_replaced_after_the_plan(tmp_path: Path) -> None:
    from imgpack.options import ConvertOptions
    from imgpack.pipeline import plan, process
    from imgpack.sources.base import forget

    a = build_uniform_folder(tmp_path / "a", count=6, seed=1)
    b = build_uniform_folder(tmp_path / "b", count=6, seed=2)
    mid = tmp_path / "mid"
    convert(a, mid, format="pt", progress=False)
    the_plan = plan(mid, tmp_path / "out", ConvertOptions.create("lmdb", progress=False))
    convert(b, mid, format="pt", progress=False, overwrite=True)
    forget()  # nothing this process opened serves the run
    with pytest.raises(DataError, match="changed after this conversion planned it"):
        list(process(the_plan, imgpack.executors.LocalExecutor(1)))


# -- merge -----------------------------------------------------------------------------------
def _parts(src: Path, root: Path, fmt: str, count: int = 2) -> list[Path]:
    parts = [root / f"p{i}" for i in range(count)]
    for i, part in enumerate(parts):
        sharded = {"shard_size": 4000} if fmt in ("pt", "webdataset", "tfrecord") else {}
        convert(src, part, format=fmt, progress=False, num_parts=count, part=i, **sharded)
    return parts


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_merge_refuses_a_part_file_that_is_a_link(src: Path, tmp_path: Path, fmt: str) -> None:
    parts = _parts(src, tmp_path, fmt)
    victim = tmp_path / "secret.bin"
    shard = parts[1] / output_manifest(parts[1]).files[0].path
    victim.write_bytes(shard.read_bytes())
    shard.unlink()
    os.symlink(victim, shard)
    with pytest.raises(DataError, match=r"symbolic link|not a regular file"):
        merge(parts, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_part_whose_bytes_changed_after_its_check(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = _parts(src, tmp_path, "pt")
    other = _parts(build_uniform_folder(tmp_path / "other", count=24, seed=9), tmp_path / "o", "pt")
    import imgpack.merging as merging

    real = merging.check_parts

    def check_then_replace(roots, manifests):  # type: ignore[no-untyped-def]
        ordered = real(roots, manifests)
        for entry in manifests[1].files:  # an array task retried: the part's files replaced
            shutil.copyfile(other[1] / entry.path, roots[1] / entry.path)
        return ordered

    monkeypatch.setattr(merging, "check_parts", check_then_replace)
    with pytest.raises(ImgpackError, match=r"sha256|replaced|size"):
        merge(parts, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_merge_streaming_reads_the_pinned_part(src: Path, tmp_path: Path) -> None:
    """lmdb parts are opened before the check: a part swapped afterwards is refused."""
    import imgpack.merging as merging

    parts = _parts(src, tmp_path, "lmdb")
    real = merging.check_parts

    def check_then_swap(roots, manifests):  # type: ignore[no-untyped-def]
        ordered = real(roots, manifests)
        manifest = read_manifest(roots[1])
        manifest.skipped = [{"path": "x", "reason": "edited"}]
        write_manifest(roots[1], manifest)
        return ordered

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(merging, "check_parts", check_then_swap)
        with pytest.raises(DataError, match="replaced while it was being merged"):
            merge(parts, tmp_path / "out", progress=False)


def test_merge_refuses_a_manifest_that_drops_a_part(src: Path, tmp_path: Path) -> None:
    parts = _parts(src, tmp_path, "pt", count=3)
    m0, m2 = output_manifest(parts[0]), output_manifest(parts[2])
    assert m0.num_samples and m2.part["start"] > m0.part["stop"]  # part 1 between them
    m0.part = {**m0.part, "count": 2, "stop": m2.part["start"]}  # type: ignore[dict-item]
    m2.part = {**m2.part, "count": 2, "index": 1}  # type: ignore[dict-item]
    rewrite_manifest(parts[0], m0)
    rewrite_manifest(parts[2], m2)
    with pytest.raises(OptionError, match="damaged"):
        merge([parts[0], parts[2]], tmp_path / "out", progress=False)


def test_merge_and_export_refuse_inputs_inside_the_destination(src: Path, tmp_path: Path) -> None:
    box = tmp_path / "M"
    parts = _parts(src, box, "pt")
    runner = CliRunner()
    result = runner.invoke(main, ["merge", *map(str, parts), str(box), "--overwrite"])
    assert result.exit_code == 2 and "must not be, hold or lie inside a part" in result.output
    assert all(p.is_dir() for p in parts)
    out = tmp_path / "F" / "out"
    convert(src, out, format="pt", progress=False)
    result = runner.invoke(main, ["export", str(out), str(tmp_path / "F"), "--overwrite"])
    assert result.exit_code == 2 and "holds the output" in result.output
    assert len(open_dataset(out)) == 24  # untouched


# -- webdataset index ------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["original", "raw"])
@pytest.mark.parametrize("edit", ["duplicate", "swap"])
def test_a_webdataset_index_is_checked_against_the_tar(
    src: Path, tmp_path: Path, encoding: str, edit: str
) -> None:
    out = tmp_path / "out"
    size = 16 if encoding == "raw" else None
    convert(src, out, format="webdataset", encoding=encoding, size=size, progress=False)
    idx = out / "data-000000.idx"
    lines = idx.read_text().splitlines()
    if edit == "duplicate":
        lines[2] = lines[1]
    else:
        lines[1], lines[2] = lines[2], lines[1]
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="does not match"):
        open_dataset(out)[1]
    report = verify(out, deep=True)  # the manifest lists the .idx: its size or sha256 differs
    assert not report.ok and any(p.file == str(idx) for p in report.problems)
    refresh_manifest(out)  # an index edited with its manifest: the tar framing still tells
    report = verify(out, deep=True)
    assert not report.ok and any("does not match" in p.message for p in report.problems)


# -- raw checksums by default ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["pt", "hdf5", "lmdb", "webdataset", "tfrecord"])
def test_a_flipped_raw_byte_is_caught_by_default(src: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    convert(src, out, format=fmt, encoding="raw", size=16, progress=False)
    ds = open_dataset(out)
    target = ds[7][0].permute(1, 2, 0).contiguous().numpy().tobytes()
    path = out / ds.manifest.files[0].path
    data = bytearray(path.read_bytes())
    at = data.find(target)
    assert at >= 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    refresh_manifest(out)
    loader = DataLoader(open_dataset(out), batch_size=8, num_workers=2, collate_fn=collate)
    with pytest.raises(
        Exception, match=r"sample 7 .*checksum mismatch|data CRC mismatch .*\(sample 7\)"
    ):
        for _ in loader:
            pass
    del loader, ds
    import gc

    gc.collect()  # LMDB opens an environment once per process
    with pytest.raises(ImgpackError, match=r"(checksum|data CRC) mismatch"):
        convert(out, tmp_path / "again", format="pt", progress=False)  # carried over: checked
    assert not (tmp_path / "again").exists()


def test_raw_records_are_checked_once_per_reader(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(src, out, format="pt", encoding="raw", size=16, progress=False)
    ds = open_dataset(out)
    calls: list[int] = []
    real = ds.checks.gathered  # a pt batch is checked as gathered: the bytes it returns

    def counting(reader, indices, *args):  # type: ignore[no-untyped-def]
        calls.extend(indices.tolist())
        return real(reader, indices, *args)

    ds.checks.gathered = counting  # type: ignore[method-assign]
    for _ in range(2):
        for _ in DataLoader(ds, batch_size=5, shuffle=True, collate_fn=collate):
            pass
    assert sorted(calls) == list(range(len(ds)))


@pytest.mark.parametrize("verify", [None, True])
def test_tfrecord_raw_crcs_are_checked_once_per_reader_by_default(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool | None
) -> None:
    import imgpack.formats.tfrecord.reader as tfrecord_reader

    out = tmp_path / "out"
    convert(src, out, format="tfrecord", encoding="raw", size=16, progress=False)
    checked: list[int] = []
    real = tfrecord_reader.data_crcs_match

    def counting(mapped, data, offsets, sizes):  # type: ignore[no-untyped-def]
        checked.append(len(offsets))
        return real(mapped, data, offsets, sizes)

    monkeypatch.setattr(tfrecord_reader, "data_crcs_match", counting)
    ds = open_dataset(out, verify=verify)
    for _ in range(2):
        for _ in DataLoader(ds, batch_size=5, shuffle=True, collate_fn=collate):
            pass
    assert sum(checked) == len(ds) * (2 if verify else 1)


# -- checkpoints -----------------------------------------------------------------------------
SLOW_CLI = slow_cli(0.01, commit=4)


def _killed_run(src: Path, dst: Path, fmt: str, sig: int = signal.SIGKILL) -> subprocess.Popen[str]:
    """``imgpack convert`` of slowed images, sent ``sig`` once it has kept work to resume: a
    checkpoint of 6 samples or more (the one writer of ``lmdb`` and ``hdf5``), or 2 shards'
    receipts (the shard tasks of ``pt``, ``tfrecord`` and ``webdataset``)."""
    command = [sys.executable, "-c", SLOW_CLI, "convert", str(src), str(dst), "-q", "--format"]
    command += [fmt, "--workers", "1"]
    if fmt in ("pt", "webdataset", "tfrecord"):
        command += ["--shard-size", "3000"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = leftovers(dst)
        if found and (found[0] / CHECKPOINT).exists():
            state = json.loads((found[0] / CHECKPOINT).read_text())
            if state["count"] >= 6:
                break
        if found and receipts_in(found[0]) >= 2:
            break
        if process.poll() is not None:
            raise AssertionError(f"finished too early: {process.communicate()}")
        time.sleep(0.02)
    process.send_signal(sig)
    return process


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("big") / "src", count=120, classes=3)


def _rechecked(case: dict[str, object]) -> dict[str, object]:
    from imgpack.checksum import content_digest

    body = {key: value for key, value in case.items() if key != "check"}
    return {**body, "check": content_digest(body)}


def _writer_edits(fmt: str, writer: dict[str, Any]) -> list[dict[str, Any]]:
    """Edits of the one writer's own part of a checkpoint: more records than its files hold,
    a count of another type, offsets past the staged files' ends."""
    if fmt == "lmdb":
        return [{**writer, "records": writer["records"] + 1000}, {**writer, "records": "7"}]
    return [
        {**writer, "records": writer["records"] + 1000},
        {**writer, "staging_bytes": writer["staging_bytes"] + 10**9},
        {**writer, "journal_bytes": -1},
        {**writer, "records": "7"},
    ]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_a_tampered_checkpoint_is_refused(big: Path, tmp_path: Path, fmt: str) -> None:
    """Each edit of a killed run's checkpoint is refused in one line (or, unparseable, not
    resumed at all); no file outside the output is touched; the output is never short or
    repeated. (Sharded formats resume by their shard tasks' receipts:
    tests/test_local_shards.py.)"""
    dst = tmp_path / "out"
    process = _killed_run(big, dst, fmt)
    process.communicate(timeout=60)
    (tmp_dir,) = leftovers(dst)
    backup = tmp_path / "backup"
    shutil.copytree(tmp_dir, backup)
    victim = tmp_path / "victim" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    state = json.loads((tmp_dir / CHECKPOINT).read_text())
    cases = [
        *({**state, "writer": writer} for writer in _writer_edits(fmt, state["writer"])),
        {**state, "position": state["position"] - 1},
        {**state, "count": state["count"] - 1, "position": state["position"] - 1},
        {**state, "position": "7"},
        {**state, "stats": {**state["stats"], "samples": state["count"] + 1}},  # not its count
        # statistics of another shape (an extra class, one channel on an RGB output), sums no
        # pixels of 0-255 can give, each with the checksum made again: the shape is checked
        _rechecked({**state, "stats": {**state["stats"],
                                       "per_class": [*state["stats"]["per_class"], 0]}}),
        _rechecked({**state, "stats": {**state["stats"], "channels": 1}}),
        _rechecked({**state, "stats": {**state["stats"], "sum": [10**400] * 3}}),
        # a consistent edit of the sums, the checksum not made again
        {**state, "stats": {**state["stats"], "sum": [v + 1 for v in state["stats"]["sum"]]}},
    ]  # fmt: skip
    args = ["convert", str(big), str(dst), "-q", "--format", fmt]
    for case in cases:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.copytree(backup, tmp_dir)
        (tmp_dir / CHECKPOINT).write_text(json.dumps(case))
        result = CliRunner().invoke(main, [*args, "--resume"])
        assert "Traceback" not in result.output
        if case["position"] == "7":  # no usable checkpoint: nothing resumed, a whole run
            assert result.exit_code == 0 and len(open_dataset(dst)) == 120
            shutil.rmtree(dst)
        else:
            assert result.exit_code == 1, (case, result.output)
            assert "checkpoint" in result.output and not dst.exists(), (case, result.output)
        assert victim.read_text() == "keep me"


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_sigterm_keeps_the_checkpoint_and_resume_gives_the_same_bytes(
    big: Path, tmp_path: Path, fmt: str
) -> None:
    dst = tmp_path / "out"
    process = _killed_run(big, dst, fmt, signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "kept" in lines[0] and "--resume" in lines[0], err
    assert leftovers(dst)
    result = CliRunner().invoke(main, ["convert", str(big), str(dst), "-q", "--format", fmt,
                                       "--shard-size", "3000", "--resume", "--workers", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    convert(big, tmp_path / "whole", format=fmt, shard_size=3000, progress=False, workers=1)
    assert read_manifest(dst).files == read_manifest(tmp_path / "whole").files


# -- export ----------------------------------------------------------------------------------
def _output_with_paths(tmp_path: Path, paths: list[str], classes: list[str]) -> Path:
    """A pt output whose stored source paths and classes are ``paths`` and ``classes``."""
    out = tmp_path / "made"
    folder = build_uniform_folder(tmp_path / "plain", count=len(paths), classes=1)
    convert(folder, out, format="pt", progress=False)
    shard = torch.load(out / "shard-00000.pt", weights_only=True)
    shard["paths"] = paths
    torch.save(shard, out / "shard-00000.pt")
    manifest = read_manifest(out)
    manifest.classes = classes
    write_manifest(out, manifest)
    refresh_manifest(out)
    return out


@pytest.mark.parametrize(
    ("paths", "classes", "message"),
    [
        (["class0/.x.png", "class0/y.png"], ["class0"], "hidden"),
        (["class0/a.png", "class0/b.png"], [".hid"], "hidden"),
        (["class0/a.png", "class0/b.png"], [".imgpack-export.json"], "hidden"),
        (["class0/" + "x" * 300 + ".png", "class0/b.png"], ["class0"], "too long"),
        (["class0/a.png", "class0/a.png/b.png"], ["class0"], "clashes"),
    ],
)
def test_export_refuses_names_that_would_not_come_back(
    tmp_path: Path, paths: list[str], classes: list[str], message: str
) -> None:
    out = _output_with_paths(tmp_path, paths, classes)
    result = CliRunner().invoke(main, ["export", str(out), str(tmp_path / "folder")])
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "folder").exists()


def test_export_never_overwrites_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a case-insensitive filesystem X.png and x.png are one file: the second is refused
    by O_EXCL, whatever the names compare as (simulated: the second open finds the first)."""
    out = _output_with_paths(tmp_path, ["class0/X.png", "class0/x.png"], ["class0"])
    import imgpack.exporting as exporting

    real = exporting._create

    def insensitive(tmp: Path, name: str, data: bytes, index: int) -> None:
        real(tmp, name.lower(), data, index)

    monkeypatch.setattr(exporting, "_create", insensitive)
    with pytest.raises(DataError, match="exists already"):
        export(out, tmp_path / "folder", progress=False)


# -- the cache -------------------------------------------------------------------------------
@pytest.fixture
def memory_output(src: Path, tmp_path: Path) -> str:
    import fsspec  # type: ignore[import-untyped]

    url = f"memory://trust-{tmp_path.name}/out"
    local = tmp_path / "local"
    convert(src, local, format="pt", progress=False)
    fs = fsspec.filesystem("memory")
    for path in local.iterdir():
        fs.pipe(f"{url}/{path.name}", path.read_bytes())
    return url


def test_a_planted_link_in_the_cache_is_refused(memory_output: str, tmp_path: Path) -> None:
    from imgpack.storage.cache import OutputCache
    from imgpack.storage.location import read_remote_manifest

    cache = tmp_path / "cache"
    manifest, data = read_remote_manifest(memory_output)
    entry = OutputCache(cache).entry(memory_output, manifest, data)
    entry.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, entry)
    with pytest.raises(ImgpackError, match="not a folder"):
        open_dataset(memory_output, cache_dir=cache)
    assert list(elsewhere.iterdir()) == []


def test_the_cache_refetches_a_file_replaced_under_the_same_id(
    memory_output: str, tmp_path: Path
) -> None:
    """The bucket's shard and manifest replaced, the output id kept: the cache serves the new
    bytes, not the copy it had checked before."""
    import fsspec

    cache = tmp_path / "cache"
    first = open_dataset(memory_output, cache_dir=cache).stored_paths()
    fs = fsspec.filesystem("memory")
    root = memory_output[len("memory://") :]
    raw = fs.cat_file(f"{root}/shard-00000.pt")
    shard = torch.load(io.BytesIO(raw), weights_only=True)
    shard["paths"] = [p.replace("img", "IMG") for p in shard["paths"]]
    out = io.BytesIO()
    torch.save(shard, out)
    new = out.getvalue()
    import hashlib

    manifest = json.loads(fs.cat_file(f"{root}/imgpack.json"))
    manifest["files"][0]["sha256"] = hashlib.sha256(new).hexdigest()
    manifest["files"][0]["bytes"] = len(new)
    fs.pipe(f"{root}/shard-00000.pt", new)
    fs.pipe(f"{root}/imgpack.json", json.dumps(manifest).encode())
    again = open_dataset(memory_output, cache_dir=cache).stored_paths()
    assert again == [p.replace("img", "IMG") for p in first] != first


def test_a_read_only_cache_with_a_complete_entry_reads(
    memory_output: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared cache folder the user cannot write (simulated: every lock file creation is
    refused, as on a read-only folder): a complete entry is read; an incomplete one is one
    clear error."""
    import errno

    cache = tmp_path / "cache"
    expected = _pixels(open_dataset(memory_output, cache_dir=cache))

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("imgpack.storage.cache.locked", refused)
    assert _pixels(open_dataset(memory_output, cache_dir=cache)) == expected
    with pytest.raises(ImgpackError, match="cannot be written"):
        open_dataset(memory_output, cache_dir=tmp_path / "empty")


def test_a_killed_fetch_leaves_no_part_file(memory_output: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_dataset(memory_output, cache_dir=cache)
    (entry,) = [p for p in (cache / "outputs").iterdir() if p.is_dir()]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # a process that has ended
    gone.wait()
    (entry / f".shard-00000.pt.{gone.pid}.1.part").write_bytes(b"half")
    open_dataset(memory_output, cache_dir=cache)
    assert not list(entry.glob("*.part"))


# -- foreign TFRecords, manifests, messages --------------------------------------------------
def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def _tfrecord(path: Path, label: int, name: bytes = b"x.png") -> Path:
    features = {"image/encoded": [_png()], "image/class/label": [label], "image/filename": [name]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(framing.frame(example.encode_example(features)))
    return path


def test_a_huge_foreign_label_is_refused_at_once(tmp_path: Path) -> None:
    record = _tfrecord(tmp_path / "t" / "a.tfrecord", 2**40)
    result = CliRunner().invoke(
        main, ["convert", str(record), str(tmp_path / "o"), "-q", "--format", "pt"]
    )
    assert result.exit_code == 1 and "beyond the 1,048,576 classes" in result.output


def test_a_nul_in_a_foreign_file_name_converts_to_hdf5(tmp_path: Path) -> None:
    record = _tfrecord(tmp_path / "t" / "a.tfrecord", 0, b"a\x00b.png")
    convert(record, tmp_path / "o", format="hdf5", progress=False)
    assert open_dataset(tmp_path / "o").stored_paths() == ["a\\x00b.png"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("encoding", "bogus"), ("image", []), ("image", {"height": None}), ("files", "reversed")],
)
def test_edited_manifests_are_refused_in_one_line(
    src: Path, tmp_path: Path, field: str, value: object
) -> None:
    out = tmp_path / "out"
    convert(src, out, format="pt", encoding="raw", size=16, shard_size=4000, progress=False)
    data = json.loads((out / "imgpack.json").read_text())
    data[field] = data["files"][::-1] if value == "reversed" else value
    (out / "imgpack.json").write_text(json.dumps(data))
    with pytest.raises((ManifestError, DataError)):
        open_dataset(out)
    result = CliRunner().invoke(main, ["export", str(out), str(tmp_path / "e")])
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_an_edited_tfrecord_label_offset_is_caught(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(src, out, format="tfrecord", progress=False)
    manifest = read_manifest(out)
    manifest.options["label_offset"] = 1
    write_manifest(out, manifest)
    ds = open_dataset(out)
    with pytest.raises(DataError, match="label"):
        for i in range(len(ds)):
            ds[i]


def test_skip_reasons_quote_no_file_content(tmp_path: Path) -> None:
    folder = build_uniform_folder(tmp_path / "src", count=3, classes=1)
    (folder / "class0" / "secret.jpg").write_bytes(b"password=hunter2\n")
    manifest = convert(folder, tmp_path / "o", format="pt", on_error="skip", progress=False)
    (skip,) = manifest.skipped
    assert "hunter" not in skip["reason"] and "text" in skip["reason"]


def test_a_newline_in_a_file_name_cannot_forge_a_line(tmp_path: Path) -> None:
    folder = build_uniform_folder(tmp_path / "src", count=3, classes=1)
    (folder / "class0" / "x\nError: forged.jpg").write_bytes(b"not an image")
    args = ["convert", str(folder), str(tmp_path / "o"), "-q", "--format", "pt"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and "\\n" in result.output, result.output


def test_a_killed_merges_temp_folder_is_removed(src: Path, tmp_path: Path) -> None:
    parts = _parts(src, tmp_path, "pt")
    left = tmp_path / ".out.abc123.imgpack-tmp"
    left.mkdir()
    (left / "shard-00000.pt").write_bytes(b"half")
    merge(parts, tmp_path / "out", progress=False)
    assert not left.exists()


def test_an_hdf5_reader_opened_before_a_smaller_overwrite_says_replaced(tmp_path: Path) -> None:
    big_src = build_uniform_folder(tmp_path / "big", count=20, seed=1)
    small_src = build_uniform_folder(tmp_path / "small", count=4, seed=2)
    out = tmp_path / "out"
    convert(big_src, out, format="hdf5", encoding="raw", size=16, progress=False)
    ds = open_dataset(out)
    convert(small_src, out, format="hdf5", encoding="raw", size=16, progress=False, overwrite=True)
    with pytest.raises(DataError, match="was replaced after it was opened"):
        ds[0]


@pytest.mark.parametrize("fmt", ["pt", "webdataset"])
def test_merge_checks_the_records_it_links(src: Path, tmp_path: Path, fmt: str) -> None:
    """A part damaged with its manifest refreshed (the sha256 then agree): the record checksums
    still catch it, as a streamed merge would."""
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, part in enumerate(parts):
        convert(src, part, format=fmt, encoding="raw", size=16, num_parts=2, part=i,
                progress=False)  # fmt: skip
    ds = open_dataset(parts[1])
    target = ds[2][0].permute(1, 2, 0).contiguous().numpy().tobytes()
    path = parts[1] / ds.manifest.files[0].path
    data = bytearray(path.read_bytes())
    at = data.find(target)
    assert at >= 0
    data[at + 3] ^= 0x01
    path.write_bytes(bytes(data))
    refresh_manifest(parts[1])
    with pytest.raises(DataError, match="checksum mismatch"):
        merge(parts, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
