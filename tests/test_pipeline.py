from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import FakeFolder, build_uniform_folder

from imgpack import convert, formats, open_dataset
from imgpack.converters import FORMATS
from imgpack.errors import ImageError, ImgpackError, ManifestError, OptionError
from imgpack.manifest import read_manifest, sha256_file
from imgpack.publishing import _umask

SHARDED = [fmt for fmt in FORMATS if formats.get(fmt).sharded]


def tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "imgpack-" in p.name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("encoding", ["original", "raw"])
def test_output_bytes_do_not_depend_on_workers(
    fmt: str, encoding: str, edge_folder: FakeFolder, tmp_path: Path
) -> None:
    size = 10 if encoding == "raw" else None
    one = convert(
        edge_folder.root,
        tmp_path / "w1",
        fmt,
        encoding=encoding,
        size=size,
        workers=1,
        progress=False,
    )
    two = convert(
        edge_folder.root,
        tmp_path / "w2",
        fmt,
        encoding=encoding,
        size=size,
        workers=2,
        progress=False,
    )
    assert [f.sha256 for f in one.files] == [f.sha256 for f in two.files]
    assert tree_digest(tmp_path / "w1") == tree_digest(tmp_path / "w2")


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_records_files_and_checksums(
    fmt: str, edge_folder: FakeFolder, tmp_path: Path
) -> None:
    dst = tmp_path / "out"
    convert(edge_folder.root, dst, fmt, encoding="raw", size=8, progress=False)
    data = json.loads((dst / "imgpack.json").read_text())
    assert data["imgpack"] == 1 and data["format"] == fmt
    assert data["num_samples"] == len(edge_folder.images)
    assert data["classes"] == edge_folder.classes
    assert data["image"]["height"] == 8 and data["image"]["channels"] == 3
    assert data["source"]["empty_classes"] == ["dog_empty"]
    assert data["created_by"].startswith("imgpack ")
    assert dst.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's private 0700
    assert sum(f["num_samples"] for f in data["files"]) == data["num_samples"]
    for entry in data["files"]:
        assert entry["sha256"] == sha256_file(dst / entry["path"])
        assert entry["bytes"] == (dst / entry["path"]).stat().st_size


@pytest.mark.parametrize("fmt", FORMATS)
def test_failure_leaves_nothing_behind(fmt: str, bad_folder: FakeFolder, tmp_path: Path) -> None:
    (bad_folder.root / "cat" / "zero.jpg").unlink()  # the scan refuses it before any work
    before = tree_digest(bad_folder.root)
    dst = tmp_path / "out"
    with pytest.raises(ImageError, match=r"cat/text_named.jpg: not an image.*--on-error skip"):
        convert(bad_folder.root, dst, fmt, workers=2, progress=False)
    assert not dst.exists()
    assert leftovers(tmp_path) == []
    assert tree_digest(bad_folder.root) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_skip_records_every_bad_file(fmt: str, bad_folder: FakeFolder, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    manifest = convert(bad_folder.root, dst, fmt, on_error="skip", workers=2, progress=False)
    assert {s["path"] for s in manifest.skipped} == set(bad_folder.bad)
    for item in manifest.skipped:
        assert bad_folder.bad[item["path"]].lower() in item["reason"].lower()
    assert read_manifest(dst).skipped == manifest.skipped
    ds = open_dataset(dst)
    assert len(ds) == len(bad_folder.images)
    assert ds.targets == [label for _, label in bad_folder.images]


def test_source_is_never_modified(edge_folder: FakeFolder, tmp_path: Path) -> None:
    before = tree_digest(edge_folder.root)
    convert(edge_folder.root, tmp_path / "out", "pt", encoding="raw", size=8, progress=False)
    assert tree_digest(edge_folder.root) == before


def test_existing_destination(uniform_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert(uniform_folder, dst, "pt", progress=False)
    with pytest.raises(FileExistsError, match=r"already exists .*--overwrite"):
        convert(uniform_folder, dst, "pt", progress=False)
    first = read_manifest(dst)
    convert(uniform_folder, dst, "pt", encoding="raw", size=4, overwrite=True, progress=False)
    assert read_manifest(dst).encoding == "raw" != first.encoding
    assert leftovers(tmp_path) == []


def test_overwrite_refuses_a_folder_that_is_not_an_output(
    uniform_folder: Path, tmp_path: Path
) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not an imgpack output; refusing"):
        convert(uniform_folder, precious, "pt", overwrite=True, progress=False)
    assert (precious / "thesis.tex").read_text() == "do not delete"


def test_failed_overwrite_keeps_the_old_output(
    uniform_folder: Path, bad_folder: FakeFolder, tmp_path: Path
) -> None:
    dst = tmp_path / "out"
    convert(uniform_folder, dst, "pt", progress=False)
    before = tree_digest(dst)
    (bad_folder.root / "cat" / "zero.jpg").unlink()  # the scan would refuse it before any work
    with pytest.raises(ImageError):
        convert(bad_folder.root, dst, "pt", overwrite=True, progress=False)
    assert tree_digest(dst) == before


def test_output_inside_source_is_refused(uniform_folder: Path) -> None:
    with pytest.raises(OptionError, match="must not be inside the source"):
        convert(uniform_folder, uniform_folder / "out", "pt", progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"encoding": "raw"}, "raw' needs a fixed image size"),
        ({"encoding": "webp"}, "invalid encoding"),
        ({"on_error": "ignore"}, "invalid on_error"),
        ({"shard_size": "lots"}, "invalid shard size"),
        ({"workers": 0}, "invalid workers"),
        ({"size": "0x4"}, "invalid image size"),
        ({"colour": "red"}, "has no option colour"),
    ],
)
def test_bad_options_fail_before_touching_anything(
    uniform_folder: Path, tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(OptionError, match=match):
        convert(uniform_folder, tmp_path / "out", "pt", progress=False, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unknown_format(uniform_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="unknown format 'zip': expected one of"):
        convert(uniform_folder, tmp_path / "out", "zip")


def test_every_file_skipped_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.png").write_text("text")
    with pytest.raises(ImgpackError, match="every one of the 1 image files was skipped"):
        convert(tmp_path / "src", tmp_path / "out", "pt", on_error="skip", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", SHARDED)
def test_shards_roll_over_and_read_across(fmt: str, tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=50, size=8)
    manifest = convert(
        src, tmp_path / "out", fmt, encoding="raw", size=8, shard_size=8 * 8 * 3 * 7, progress=False
    )
    # Shards roll over at about 7 raw samples' worth of bytes (formats add their own framing).
    counts = [f.num_samples for f in manifest.files]
    assert len(counts) >= 8 and sum(counts) == 50
    assert len(set(counts[:-1])) == 1 and counts[0] <= 7 and counts[-1] <= counts[0]
    single = convert(src, tmp_path / "one", fmt, encoding="raw", size=8, progress=False)
    assert len(single.files) == 1
    many, one = open_dataset(tmp_path / "out"), open_dataset(tmp_path / "one")
    order = [49, 0, 13, 14, 6, 7, 48, 20]
    a, b = many.__getitems__(order), one.__getitems__(order)
    assert a.images.equal(b.images) and a.labels.equal(b.labels)  # type: ignore[union-attr]
    assert many.targets == one.targets


def test_classes_from_another_output(tmp_path: Path) -> None:
    train = build_uniform_folder(tmp_path / "train", count=9, classes=3)
    val = build_uniform_folder(tmp_path / "val", count=4, classes=2)  # class2 missing in val
    convert(train, tmp_path / "train.out", "pt", progress=False)
    manifest = convert(
        val, tmp_path / "val.out", "pt", classes_from=tmp_path / "train.out", progress=False
    )
    assert manifest.classes == ["class0", "class1", "class2"]
    assert manifest.source["empty_classes"] == ["class2"]


def test_reader_refuses_unknown_versions_and_formats(uniform_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert(uniform_folder, dst, "pt", progress=False)
    path = dst / "imgpack.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "imgpack": 2}))
    with pytest.raises(ManifestError, match="schema version 2 is not supported"):
        open_dataset(dst)
    path.write_text(json.dumps({**data, "format": "zarr"}))
    with pytest.raises(ManifestError, match="format 'zarr' is not known to this imgpack"):
        open_dataset(dst)
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="unreadable manifest"):
        open_dataset(dst)
    path.unlink()
    with pytest.raises(ManifestError, match="not an imgpack output"):
        open_dataset(dst)


def test_interrupt_leaves_nothing_behind(
    uniform_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from imgpack.converters import PTWriter

    calls = {"n": 0}
    original = PTWriter.add

    def add_then_interrupt(self: PTWriter, sample: object) -> None:
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt  # as Ctrl-C would, in the middle of writing
        original(self, sample)  # type: ignore[arg-type]

    monkeypatch.setattr(PTWriter, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(uniform_folder, tmp_path / "out", "pt", workers=2, progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_work_in_flight_is_bounded(uniform_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many files there are, at most workers x WINDOW_PER_WORKER chunks are submitted
    ahead of the writer, so memory does not grow with the dataset."""
    from concurrent.futures import ProcessPoolExecutor

    from imgpack import executors
    from imgpack.images import Encoding, ImagePolicy
    from imgpack.sources.folder.scan import scan_folder
    from imgpack.sources.folder.source import FileFetcher

    submitted = {"n": 0}
    original = ProcessPoolExecutor.submit

    def counting_submit(self: ProcessPoolExecutor, *args: object, **kwargs: object) -> object:
        submitted["n"] += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ProcessPoolExecutor, "submit", counting_submit)
    monkeypatch.setattr(executors, "MAX_CHUNK", 1)  # one file per chunk: the window in files
    samples = scan_folder(uniform_folder).samples
    ahead = []
    consumed = 0
    job = executors.Job(FileFetcher(str(uniform_folder)), ImagePolicy(), Encoding())
    for _ in executors.LocalExecutor(2).outcomes(job, samples):
        consumed += 1
        ahead.append(submitted["n"] - 1 - consumed)  # minus the start-up task
    assert consumed == 60
    assert max(ahead) <= 2 * executors.WINDOW_PER_WORKER


@pytest.mark.parametrize(
    ("fmt", "options", "match"),
    [
        ("lmdb", {"map_size": "big"}, "invalid map_size"),
        ("hdf5", {"compression": "zstd"}, "invalid compression"),
        ("tfrecord", {"prefix": "../x"}, "invalid prefix"),
        ("pt", {"colour": "red"}, "has no option colour"),
    ],
)
def test_format_options_are_checked_before_the_scan(
    fmt: str,
    options: dict[str, str],
    match: str,
    uniform_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("scanned before checking the options")

    monkeypatch.setattr("imgpack.sources.folder.source.scan_folder", no_scan)
    with pytest.raises(OptionError, match=match):
        convert(uniform_folder, tmp_path / "out", fmt, progress=False, **options)
