"""Outputs and sources in object storage: a real S3 API (moto's server, started here on
127.0.0.1) and fsspec's in-memory filesystem for the quick cases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from click.testing import CliRunner
from conftest import build_uniform_folder
from torch.utils.data import DataLoader

from imgpack import convert, export, merge, open_dataset, verify
from imgpack.cli import main
from imgpack.errors import ImageError, ImgpackError, ManifestError, OptionError
from imgpack.readers import TFRecordStream, collate
from imgpack.sources import listing
from imgpack.storage import location
from imgpack.storage.cache import OutputCache, _folder_bytes, default_cache_dir
from imgpack.storage.cache import stats as cache_stats

FORMATS = ("pt", "lmdb", "hdf5", "tfrecord", "webdataset")


def _read_all(ds: object) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = collate(ds.__getitems__(list(range(len(ds)))))  # type: ignore[attr-defined]
    return images, labels


def _same_output(a: object, b: object) -> None:
    got, expected = _read_all(a), _read_all(b)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert a.classes == b.classes  # type: ignore[attr-defined]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return build_uniform_folder(tmp_path / "src", count=40, classes=4, size=12)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def mem() -> Iterator[str]:
    """A fresh prefix in fsspec's in-memory filesystem."""
    url = f"memory://imgpack-test-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_to_s3_and_read_back_as_a_local_conversion(
    s3: str, src: Path, tmp_path: Path, cache: Path, fmt: str
) -> None:
    url = f"{s3}/{fmt}"
    shards = {"shard_size": 4000} if fmt in ("pt", "tfrecord", "webdataset") else {}
    manifest = convert(src, url, fmt, progress=False, **shards)
    local = tmp_path / "local"
    convert(src, local, fmt, progress=False, **shards)
    fs = fsspec.filesystem("s3")
    names = {p.rsplit("/", 1)[1] for p in fs.find(url.removeprefix("s3://"))}
    listed = {"imgpack.json", *(f.path for f in manifest.files)}
    assert listed <= names and {Path(n).suffix for n in names - listed} <= {".idx"}
    remote = open_dataset(url, cache_dir=cache)
    _same_output(remote, open_dataset(local))
    assert remote.root.is_relative_to(cache)  # memory-mapped from the local copy
    loader = DataLoader(remote, batch_size=8, num_workers=2, collate_fn=collate)
    assert sum(len(labels) for _, labels in loader) == 40


def test_the_cache_downloads_once_and_fetches_a_damaged_shard_again(
    s3: str, src: Path, cache: Path
) -> None:
    url = f"{s3}/cached"
    convert(src, url, "tfrecord", progress=False, shard_size=3000)
    before = cache_stats.downloads
    first = open_dataset(url, cache_dir=cache)
    shards = len(first.manifest.files)
    assert cache_stats.downloads - before == shards  # the .idx files; shards when read
    expected = _read_all(first)
    assert cache_stats.downloads - before == 2 * shards
    second = open_dataset(url, cache_dir=cache)  # another process would find the same
    _same_output(second, first)
    assert cache_stats.downloads - before == 2 * shards  # nothing new downloaded
    first.release_files()
    second.release_files()
    shard = first.root / first.manifest.files[1].path
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    refetched = cache_stats.refetched
    third = open_dataset(url, cache_dir=cache)
    got = _read_all(third)
    assert cache_stats.refetched == refetched + 1
    assert cache_stats.downloads - before == 2 * shards + 1  # that shard only
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bucket_source_converts_as_the_local_folder(s3: str, src: Path, tmp_path: Path) -> None:
    fs = fsspec.filesystem("s3")
    fs.put(str(src), "imgpack-test/images", recursive=True)
    from_bucket = convert(f"{s3}/images", tmp_path / "a", "pt", progress=False)
    from_disk = convert(src, tmp_path / "b", "pt", progress=False)
    assert from_bucket.source["path"] == f"{s3}/images"
    assert from_bucket.num_samples == from_disk.num_samples == 40
    assert from_bucket.classes == from_disk.classes
    a, b = open_dataset(tmp_path / "a"), open_dataset(tmp_path / "b")
    assert a.stored_paths() == b.stored_paths()
    _same_output(a, b)


def test_a_conversion_killed_midway_leaves_no_manifest(s3: str, src: Path, tmp_path: Path) -> None:
    """The manifest is the commit point: a conversion SIGKILLed while uploading leaves data
    files but no imgpack.json, so no reader opens a half-written output."""
    script = textwrap.dedent(
        f"""
        import os, signal, s3fs
        from imgpack import convert
        put = s3fs.S3FileSystem.put_file
        done = []
        def dying(self, *args, **kwargs):
            put(self, *args, **kwargs)
            done.append(args)
            if len(done) >= 2:  # two files are in the bucket: killed mid-upload
                os.kill(os.getpid(), signal.SIGKILL)
        s3fs.S3FileSystem.put_file = dying
        convert({str(src)!r}, "{s3}/killed", "webdataset", progress=False, shard_size=2000,
                workers=1)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    left = [p.rsplit("/", 1)[1] for p in fs.find("imgpack-test/killed")]
    assert left and "imgpack.json" not in left
    with pytest.raises(ManifestError, match=r"no imgpack\.json"):
        open_dataset(f"{s3}/killed", cache_dir=tmp_path / "cache")
    # The shards and receipts of a conversion by shard tasks (imgpack.direct): another
    # conversion is refused there unless it is told to replace them.
    with pytest.raises(FileExistsError, match=r"unfinished work of another conversion"):
        convert(src, f"{s3}/killed", "pt", progress=False)


def test_cli_with_a_bucket(s3: str, src: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    url = f"{s3}/cli"
    result = runner.invoke(main, ["convert", str(src), url, "--format", "lmdb", "-q"])
    assert result.exit_code == 0, result.output
    planned = runner.invoke(main, ["convert", str(src), f"{url}-2", "--format", "hdf5",
                                   "--dry-run"])  # fmt: skip
    assert "note:      hdf5 is one file, written by one process: it is built whole" in (
        planned.output
    )
    result = runner.invoke(main, ["info", url])
    assert result.exit_code == 0 and "samples:   40" in result.output
    result = runner.invoke(main, ["verify", url, "-q"])
    assert result.exit_code == 0 and f"{url}: intact" in result.output, result.output
    result = runner.invoke(main, ["convert", str(src), url, "--format", "lmdb", "-q"])
    assert result.exit_code != 0 and "already exists" in result.output
    assert "Traceback" not in result.output
    bad = runner.invoke(main, ["info", url, "--storage-option", "nonsense"])
    assert bad.exit_code != 0 and "KEY=VALUE" in bad.output


# -- fsspec's memory filesystem: quick cases -----------------------------------------------------
def test_only_a_one_file_format_to_a_bucket_is_built_on_this_disk(
    mem: str, src: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An hdf5 or lmdb output to a bucket is built whole on the driver's disk, and the run says
    so; a sharded format's is not said to be."""
    convert(src, f"{mem}/one", "hdf5", progress=False, cache_dir=cache)
    assert f"{mem}/one: hdf5 is one file, written by one process: it is built whole" in (
        caplog.text
    )
    caplog.clear()
    convert(src, f"{mem}/many", "tfrecord", progress=False, cache_dir=cache)
    assert "built whole" not in caplog.text


def test_overwrite_withdraws_then_replaces(mem: str, src: Path, cache: Path) -> None:
    url = f"{mem}/out"
    convert(src, url, "tfrecord", progress=False, shard_size=3000)
    fs = fsspec.filesystem("memory")
    first = sorted(fs.find(url))
    with pytest.raises(FileExistsError, match="already exists"):
        convert(src, url, "tfrecord", progress=False)
    convert(src, url, "tfrecord", progress=False, overwrite=True)  # one shard now
    second = sorted(fs.find(url))
    assert len(second) < len(first)  # the replaced output's extra shards are gone
    ds = open_dataset(url, cache_dir=cache)
    assert len(ds.manifest.files) == 1 and len(ds) == 40


def test_a_failed_upload_publishes_nothing(
    mem: str, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = fsspec.filesystem("memory")
    real = type(fs).put_file
    calls: list[object] = []

    def failing(self: object, lpath: str, rpath: str, **kwargs: object) -> None:
        if calls:
            raise OSError("connection reset")
        calls.append(rpath)
        real(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(type(fs), "put_file", failing)
    with pytest.raises(Exception, match="connection reset"):
        convert(src, f"{mem}/out", "tfrecord", progress=False, shard_size=3000)
    assert not fs.exists(f"{mem}/out/imgpack.json")


def test_ranks_on_one_machine_download_each_shard_once(s3: str, src: Path, cache: Path) -> None:
    """Two processes (DDP ranks) opening the same bucket output at once share the cache: the
    shards are downloaded once between them."""
    url = f"{s3}/ranks"
    manifest = convert(src, url, "tfrecord", progress=False, shard_size=2000)
    script = textwrap.dedent(
        f"""
        from imgpack.storage.cache import OutputCache, _folder_bytes, default_cache_dir, stats as cache_stats
        from imgpack.storage import location
        from imgpack import open_dataset
        ds = open_dataset({url!r}, cache_dir={str(cache)!r})
        assert len(ds) == 40 and len([ds[i] for i in range(40)]) == 40  # every shard read
        print(cache_stats.downloads)
        """
    )
    ranks = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    counts = [int(rank.communicate(timeout=120)[0].split()[-1]) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks)
    assert sum(counts) == 2 * len(manifest.files)  # each shard and its .idx, once


def test_least_recently_used_outputs_are_evicted(mem: str, src: Path, cache: Path) -> None:
    urls = [f"{mem}/o{k}" for k in range(3)]
    for url in urls:
        convert(src, url, "pt", progress=False)
    small = OutputCache(cache)
    (old, old_pin), (recent, recent_pin) = small.fetch(urls[0]), small.fetch(urls[1])
    size = _folder_bytes(old)
    os.utime(old / ".imgpack-used", (1, 1))  # used long ago
    small.max_bytes = int(size * 2.5)
    small.evict()
    assert old.exists() and recent.exists()  # both are being read: their pins are held
    assert old_pin is not None and recent_pin is not None
    old_pin.close()  # as when what reads it lets it go (a reader, or its process, gone)
    recent_pin.close()
    newest, _ = small.fetch(urls[2])
    assert not old.exists() and recent.exists() and newest.exists()
    assert _folder_bytes(cache / "outputs") <= small.max_bytes
    assert len(open_dataset(urls[0], cache_dir=cache)) == 40  # fetched again when needed


def test_stream_from_a_bucket_without_caching(mem: str, src: Path, cache: Path) -> None:
    url = f"{mem}/stream"
    convert(src, url, "tfrecord", progress=False, shard_size=3000)
    before = cache_stats.downloads
    stream = TFRecordStream(url, batch_size=8)
    seen = torch.cat([labels for _, labels in stream])
    assert cache_stats.downloads == before  # streamed, not cached
    local = open_dataset(url, cache_dir=cache)
    assert sorted(seen.tolist()) == sorted(local.targets)
    images = torch.cat([imgs for imgs, _ in TFRecordStream(url, batch_size=8)])
    expected = _read_all(local)[0]
    assert torch.equal(images, expected)  # no shuffle: file order


def test_merge_export_verify_with_urls(mem: str, src: Path, tmp_path: Path, cache: Path) -> None:
    for part in range(2):
        convert(src, f"{mem}/p{part}", "webdataset", progress=False, num_parts=2, part=part)
    merged = merge([f"{mem}/p0", f"{mem}/p1"], f"{mem}/merged", storage_options=None,
                   cache_dir=cache, progress=False)  # fmt: skip
    assert merged.num_samples == 40
    report = verify(f"{mem}/merged")
    assert report.ok and report.path == f"{mem}/merged"
    done = export(f"{mem}/merged", f"{mem}/images", cache_dir=cache, progress=False)
    assert done.files == 40
    fs = fsspec.filesystem("memory")
    pngs = [p for p in fs.find(f"{mem}/images") if p.endswith(".png")]
    assert len(pngs) == 40
    again = convert(f"{mem}/images", tmp_path / "again", "pt", progress=False)
    assert again.num_samples == 40
    fs.pipe(f"{mem}/merged/{merged.files[0].path}", b"broken")
    damaged = verify(f"{mem}/merged")
    assert not damaged.ok and f"{mem}/merged/{merged.files[0].path}" in damaged.problems[0].line()


def test_urls_are_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OptionError, match=r"nosuchscheme://bucket/out: Protocol not known"):
        open_dataset("nosuchscheme://bucket/out", cache_dir=tmp_path)
    assert location.is_url("s3://b/x") and not location.is_url("file:///tmp/x")
    assert location.local_path("file:///tmp/x") == Path("/tmp/x")
    assert location.parse_storage_options(["anon=true", "endpoint_url=http://h:1"]) == {
        "anon": True,
        "endpoint_url": "http://h:1",
    }
    monkeypatch.delenv("IMGPACK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "imgpack"
    monkeypatch.setenv("IMGPACK_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_stream_from_s3_in_dataloader_workers(s3: str, src: Path, cache: Path) -> None:
    """Workers forked from a process that already talked to the bucket stream their parts."""
    url = f"{s3}/stream"
    convert(src, url, "tfrecord", progress=False, shard_size=3000)
    stream = TFRecordStream(url, batch_size=8)
    assert len(list(stream)) == 5  # the training process reads it once itself
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    seen = torch.cat([labels for _, labels in loader])
    assert sorted(seen.tolist()) == sorted(open_dataset(url, cache_dir=cache).targets)


def test_bench_tune_profile_read_urls(mem: str, src: Path) -> None:
    url = f"{mem}/out"
    convert(src, url, "pt", encoding="raw", size=12, progress=False)
    runner = CliRunner()
    args = ["--workers", "0", "--batch-size", "8"]
    for command in (["bench", url, "--samples", "16"], ["tune", url, "--batches", "2"],
                    ["profile", url, "--batches", "2"]):  # fmt: skip
        result = runner.invoke(main, [*command, *args])
        assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["bench", str(src / "missing"), *args])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_a_bucket_index_file_is_checked_like_the_data(mem: str, src: Path, cache: Path) -> None:
    """The manifest lists each .idx with its sha256: the cache checks a fetched index as it
    checks a shard, instead of taking whatever lies beside the shards."""
    url = f"{mem}/wds"
    manifest = convert(src, url, "webdataset", shard_size=4000, progress=False)
    (index,) = manifest.files[1].companions
    fs = fsspec.filesystem("memory")
    path = f"{url.removeprefix('memory://')}/{index.path}"
    data = bytearray(fs.cat_file(path))
    data[-2] = ord("0") if data[-2] != ord("0") else ord("1")  # same size, another digit
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ImgpackError, match=rf"{index.path}.*another sha256"):
        open_dataset(url, cache_dir=cache)


def test_a_bucket_source_has_one_output_id_and_its_parts_merge(
    s3: str, src: Path, tmp_path: Path
) -> None:
    """The output id comes from what the store says of each object (size, ETag), not from the
    download's modification times: two conversions of one bucket write the same bytes, and the
    parts of one merge (they used to differ: 'output_id differ')."""
    from imgpack import merge

    fs = fsspec.filesystem("s3")
    fs.put(str(src), "imgpack-test/same", recursive=True)
    first = convert(f"{s3}/same", tmp_path / "a", "webdataset", progress=False)
    time.sleep(0.01)  # later downloads, other modification times
    second = convert(f"{s3}/same", tmp_path / "b", "webdataset", progress=False)
    assert first.output_id == second.output_id
    for entry in first.files:
        assert (tmp_path / "a" / entry.path).read_bytes() == (
            tmp_path / "b" / entry.path
        ).read_bytes()
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, part in enumerate(parts):
        convert(f"{s3}/same", part, "webdataset", num_parts=2, part=i, progress=False)
    merged = merge(parts, tmp_path / "merged", progress=False)
    assert merged.output_id == first.output_id
    _same_output(open_dataset(tmp_path / "merged"), open_dataset(tmp_path / "a"))
    other = (src / "class1" / "img0001.png").read_bytes()
    fs.pipe("imgpack-test/same/class0/img0000.png", other)
    changed = convert(f"{s3}/same", tmp_path / "c", "webdataset", progress=False)
    assert changed.output_id != first.output_id  # the store says the object changed


@pytest.mark.parametrize("fmt", ["pt", "tfrecord", "webdataset", "lmdb"])
def test_a_bucket_folder_is_read_in_place_by_the_workers(
    s3: str, src: Path, tmp_path: Path, fmt: str
) -> None:
    """An image folder in a bucket is listed, not downloaded: the pool workers read each object
    from the bucket, and the output equals a local conversion of the same images (pixels,
    labels, order, paths) in every format."""
    fs = fsspec.filesystem("s3")
    fs.put(str(src), f"imgpack-test/inplace-{fmt}", recursive=True)
    before = cache_stats.downloads
    got = convert(f"{s3}/inplace-{fmt}", tmp_path / "a", fmt, workers=2, progress=False)
    assert cache_stats.downloads == before  # the driver fetched no image
    want = convert(src, tmp_path / "b", fmt, progress=False)
    assert got.num_samples == want.num_samples == 40 and got.classes == want.classes
    a, b = open_dataset(tmp_path / "a"), open_dataset(tmp_path / "b")
    assert a.stored_paths() == b.stored_paths()
    _same_output(a, b)


def test_each_part_of_a_bucket_folder_reads_only_its_objects(
    s3: str, src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K parts of one bucket conversion GET their own objects only, and merge into the output
    of one conversion whatever K."""
    import s3fs

    fs = fsspec.filesystem("s3")
    fs.put(str(src), "imgpack-test/parted", recursive=True)
    whole = convert(f"{s3}/parted", tmp_path / "whole", "webdataset", progress=False)
    read: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: object, method: str, *args: object, **kwargs: object) -> object:
        key = str(kwargs.get("Key", ""))
        if method == "get_object" and key.startswith("parted/"):
            read.append(key.split("/", 1)[1])
        return await real(self, method, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    s3fs.S3FileSystem.clear_instance_cache()  # instances made before mirror the unpatched one
    for count in (2, 3):
        parts = []
        for i in range(count):
            read.clear()
            part = tmp_path / f"k{count}-{i}"
            done = convert(f"{s3}/parted", part, "webdataset", num_parts=count, part=i,
                           workers=1, progress=False)  # fmt: skip
            assert done.num_samples == len(read)
            assert sorted(read) == sorted(open_dataset(part).stored_paths() or [])  # its own
            parts.append(part)
        merged = merge(parts, tmp_path / f"merged-{count}", progress=False)
        assert merged.output_id == whole.output_id
        _same_output(open_dataset(tmp_path / f"merged-{count}"), open_dataset(tmp_path / "whole"))


def test_a_bad_object_is_named_by_its_url(s3: str, src: Path, tmp_path: Path) -> None:
    fs = fsspec.filesystem("s3")
    fs.put(str(src), "imgpack-test/badobj", recursive=True)
    fs.pipe("imgpack-test/badobj/class1/zz-broken.png", b"\x89PNG\r\n\x1a\n" + bytes(30))
    with pytest.raises(ImageError, match=rf"{s3}/badobj/class1/zz-broken.png: "):
        convert(f"{s3}/badobj", tmp_path / "a", "pt", workers=2, progress=False)
    done = convert(f"{s3}/badobj", tmp_path / "b", "pt", on_error="skip", progress=False)
    assert [s["path"] for s in done.skipped] == ["class1/zz-broken.png"]
    assert done.num_samples == 40


def test_only_s3fs_is_listed_through_its_private_pages(tmp_path: Path) -> None:
    """s3fs's page iterator is a private s3fs method: it is used for s3fs alone; another
    filesystem, even one that says it is "s3" and has such a method, is listed with fsspec's
    public ``find``."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from imgpack.storage import location

    class LookAlike(MemoryFileSystem):
        protocol = ("s3", "lookalike")
        async_impl = True

        def _iterdir(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("a private method of another filesystem was called")

    assert location.is_s3fs(fsspec.filesystem("s3", anon=True))
    fs = LookAlike(skip_instance_cache=True)
    assert not location.is_s3fs(fs)
    root = f"/imgpack-lookalike-{tmp_path.name}/src"  # memory filesystems share one store
    fs.pipe_file(f"{root}/cat/a.png", b"x" * 5)
    fs.pipe_file(f"{root}/cat/b.png", b"y" * 7)
    part = tmp_path / "part.jsonl"
    try:
        with open(part, "wb") as out:
            assert listing._list_folder(fs, root, "cat", out) == 2
    finally:
        fs.rm(root.rsplit("/", 1)[0], recursive=True)
    assert [line.split(",")[1].strip() for line in part.read_text().splitlines()] == ["5", "7"]


def test_a_bucket_folder_with_sidecars_is_refused_not_dropped(s3: str, tmp_path: Path) -> None:
    """Sidecar files (``x.txt`` beside ``x.png``) of a folder in a bucket are not read as fields
    yet: the conversion is refused in one line, never converted without them by default;
    ``fields=""`` converts the images alone."""
    src = build_uniform_folder(tmp_path / "src", count=6, classes=2, size=8)
    for image in sorted(src.glob("*/*.png")):
        image.with_suffix(".txt").write_text(f"caption of {image.name}")
    fsspec.filesystem("s3").put(str(src), "imgpack-test/sidecars", recursive=True)
    with pytest.raises(OptionError, match=r"holds sidecar files of its images \(txt\).*--fields"):
        convert(f"{s3}/sidecars", tmp_path / "out", "pt", progress=False)
    manifest = convert(f"{s3}/sidecars", tmp_path / "out", "pt", fields="", progress=False)
    assert manifest.num_samples == 6 and manifest.fields == []


def test_shard_tasks_write_a_folders_sidecar_fields_to_a_bucket(s3: str, tmp_path: Path) -> None:
    """A local folder with sidecars converted to a bucket (shard tasks write the shards): the
    fields are in the shards and the manifest, and read back from the bucket."""
    src = build_uniform_folder(tmp_path / "src", count=8, classes=2, size=8)
    captions = {}
    for image in sorted(src.glob("*/*.png")):
        image.with_suffix(".txt").write_text(f"caption of {image.name}")
        captions[f"{image.parent.name}/{image.name}"] = f"caption of {image.name}"
    manifest = convert(src, f"{s3}/with-sidecars", "pt", shard_size="1KB", progress=False)
    assert [f.spec for f in manifest.fields] == ["txt:str"] and len(manifest.files) > 1
    ds = open_dataset(f"{s3}/with-sidecars", fields="txt", cache_dir=tmp_path / "cache")
    paths = ds.stored_paths() or []
    assert [ds[i][2] for i in range(len(ds))] == [captions[p] for p in paths]


def test_object_sizes_list_a_folder_named_often_and_ask_the_rest() -> None:
    """Sizes of listed objects: a folder named 16 or more times by one listing, other objects
    (and one the listing lacks) asked one by one, a missing object ``-1``, in the order
    asked."""
    from imgpack.storage import location

    fs = fsspec.filesystem("memory")
    base = "memory://object-sizes"
    for k in range(20):
        fs.pipe(f"{base}/many/{k}.png", b"x" * k)
    fs.pipe(f"{base}/few/a.png", b"abc")
    urls = [f"{base}/many/{k}.png" for k in range(20)]
    urls += [f"{base}/few/a.png", f"{base}/few/missing.png", f"{base}/many/missing.png"]
    listings: list[str] = []
    real = type(fs).ls

    def counted(self: object, path: str, *a: object, **k: object) -> object:
        listings.append(str(path))
        return real(self, path, *a, **k)  # type: ignore[arg-type]

    import unittest.mock

    with unittest.mock.patch.object(type(fs), "ls", counted):
        sizes = location.object_sizes(urls)
    assert sizes == [*range(20), 3, -1, -1]
    assert [p.rstrip("/").rsplit("/", 1)[-1] for p in listings] == ["many"]
