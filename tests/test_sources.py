"""Every source kind in the registry, converted to every format, reads back the pixels an
independent decode of the images gives, with the right labels, in the source's order, with its
source paths; a label list's bad rows are named by line or skipped; unlabelled folders and
foreign WebDataset shards convert; a source plugin pip-installed into a folder adds a kind."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder, pip_install, reference_pixels, traced

from imgpack import convert, open_dataset, sources
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import OptionError, ScanError

PLUGIN = Path(__file__).resolve().parent / "plugins" / "imgpack-toy-source"


@dataclass
class Built:
    """A source of one kind, how to convert it, and what its output must hold."""

    src: Path
    #: (source path, class name or None, the image file it came from), in output order.
    rows: list[tuple[str, str | None, Path]]
    classes: list[str]
    options: dict[str, Any] = field(default_factory=dict)


def _folder_rows(images: Path) -> list[tuple[str, str | None, Path]]:
    """An image folder's samples in torchvision's order, listed independently of imgpack."""
    rows = []
    for cls in sorted(p.name for p in images.iterdir()):
        for file in sorted((images / cls).iterdir()):
            rows.append((f"{cls}/{file.name}", cls, file))
    return rows


def _folder(base: Path, images: Path) -> Built:
    return Built(images, _folder_rows(images), sorted(p.name for p in images.iterdir()))


def _output(base: Path, images: Path) -> Built:
    convert(images, base / "lmdb-out", "lmdb", progress=False)
    return Built(base / "lmdb-out", _folder_rows(images), sorted(p.name for p in images.iterdir()))


def _tfrecord(base: Path, images: Path) -> Built:
    """TFRecord files without a manifest (an imgpack output whose manifest is gone)."""
    convert(images, base / "tf-out", "tfrecord", shard_size="2KB", progress=False)
    files = base / "tf"
    files.mkdir()
    for path in sorted((base / "tf-out").glob("*.tfrecord")):
        shutil.copy(path, files / path.name)
    return Built(files, _folder_rows(images), sorted(p.name for p in images.iterdir()))


def _hf(base: Path, images: Path) -> Built:
    datasets = pytest.importorskip("datasets", reason="pip install 'imgpack[hf]' (test.sh does)")
    rows = _folder_rows(images)[::-1]  # an order of its own: the rows' order is kept
    classes = sorted(p.name for p in images.iterdir())
    features = datasets.Features(
        {"picture": datasets.Image(), "kind": datasets.ClassLabel(names=classes)}
    )
    table = {
        "picture": [{"bytes": file.read_bytes(), "path": file.name} for _, _, file in rows],
        "kind": [classes.index(cls) for _, cls, _ in rows if cls is not None],
    }
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(base / "hf"))
    return Built(base / "hf", rows, classes)


def _labels(base: Path, images: Path) -> Built:
    """A CSV beside the images, rows in an order of their own, class names as labels."""
    rows = _folder_rows(images)
    order = rows[1::2] + rows[0::2]
    lines = ["path,label"] + [f"images/{path},{cls}" for path, cls, _ in order]
    (base / "list.csv").write_text("\n".join(lines) + "\n")
    listed = [(f"images/{path}", cls, file) for path, cls, file in order]
    return Built(base / "list.csv", listed, sorted({cls for _, cls, _ in rows if cls}))


def _unlabelled(base: Path, images: Path) -> Built:
    rows = [(path, None, file) for path, _, file in _folder_rows(images)]
    return Built(images, rows, [], {"no_labels": True})


def _webdataset(base: Path, images: Path) -> Built:
    """Two tars as the webdataset package writes them: key.png + key.cls per sample."""
    folder = base / "wds"
    folder.mkdir()
    rows = _folder_rows(images)
    classes = sorted({cls for _, cls, _ in rows if cls})
    listed = []
    for shard, chunk in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2 :])):
        name = f"shard-{shard:04d}.tar"
        with tarfile.open(folder / name, "w") as tar:
            for k, (_, cls, file) in enumerate(chunk):
                key = f"s{shard}{k:04d}"
                assert cls is not None
                for ext, data in (("png", file.read_bytes()), ("cls", str(classes.index(cls)))):
                    payload = data if isinstance(data, bytes) else data.encode()
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                listed.append((f"{name}/{key}.png", str(classes.index(cls)), file))
    return Built(folder, listed, [str(i) for i in range(len(classes))])


#: One builder per built-in source kind: a kind without one fails the test below.
BUILDERS: dict[str, Callable[[Path, Path], Built]] = {
    "folder": _folder,
    "output": _output,
    "tfrecord": _tfrecord,
    "hf": _hf,
    "labels": _labels,
    "unlabelled": _unlabelled,
    "webdataset": _webdataset,
}


#: What the manifest's source.converted_from.format records of each kind.
CHAIN = {
    "folder": None,
    "unlabelled": None,
    "output": "lmdb",
    "tfrecord": "tfrecord",
    "hf": "huggingface",
    "labels": "labels",
    "webdataset": "webdataset",
}


def test_every_source_kind_has_a_round_trip() -> None:
    assert set(sources.BUILTIN) == set(BUILDERS)
    assert set(sources.names()) >= set(BUILDERS)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("sources") / "images", 12, 3, 12, seed=5)


@pytest.fixture(scope="module")
def built(images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    found = {}
    for kind, build in BUILDERS.items():
        base = tmp_path_factory.mktemp(kind)
        shutil.copytree(images, base / "images")
        found[kind] = build(base, base / "images")
    return found


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_every_source_kind_to_every_format(
    kind: str, fmt: str, built: dict[str, Built], tmp_path: Path
) -> None:
    source = built[kind]
    out = tmp_path / "out"
    convert(source.src, out, fmt, progress=False, workers=2, **source.options)
    ds = open_dataset(out)
    assert ds.classes == source.classes
    assert ds.stored_paths() == [path for path, _, _ in source.rows]
    assert ds.manifest.num_samples == len(source.rows) and not ds.manifest.skipped
    for i, (_, cls, file) in enumerate(source.rows):
        image, label = ds[i]
        assert label == (-1 if cls is None else ds.classes.index(cls)), i
        assert np.array_equal(image.permute(1, 2, 0).numpy(), reference_pixels(file)), i
    recorded = ds.manifest.source.get("converted_from", {}).get("format")
    assert recorded == CHAIN[kind]


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_every_source_kind_scans_into_a_packed_table(
    kind: str, built: dict[str, Built], tmp_path: Path
) -> None:
    """A driver holds the scan of every sample through the whole conversion: every source
    kind's scan is a :class:`SampleTable` (about 75 bytes a sample, where ``Sample`` objects
    take 280), whose samples are those the output keeps, in order."""
    from imgpack.options import ConvertOptions
    from imgpack.pipeline import plan
    from imgpack.scan import SampleTable

    source = built[kind]
    scan = plan(source.src, tmp_path / "out", ConvertOptions.create("pt", **source.options)).scan
    assert isinstance(scan.samples, SampleTable), type(scan.samples)
    assert [s.path for s in scan.samples] == [path for path, _, _ in source.rows]
    labels = [-1 if cls is None else scan.classes.index(cls) for _, cls, _ in source.rows]
    assert scan.samples.labels() == [s.label for s in scan.samples] == labels


def test_the_kind_is_detected(built: dict[str, Built]) -> None:
    for kind, source in built.items():
        expected = "folder" if kind == "unlabelled" else kind  # asked for by name only
        assert sources.detect(source.src).name == expected


def test_a_label_list_beside_the_images_with_integer_labels(images: Path, tmp_path: Path) -> None:
    """--labels FILE: paths relative to SRC; integer labels are the labels, classes "0".."n"."""
    rows = _folder_rows(images)
    classes = sorted({cls for _, cls, _ in rows if cls})
    listing = tmp_path / "labels.jsonl"
    listing.write_text(
        "".join(
            json.dumps({"file": path, "y": classes.index(cls) if cls else 0}) + "\n"
            for path, cls, _ in rows
        )
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        [
            *("convert", str(images), str(out), "--format", "pt", "-q"),
            *("--labels", str(listing), "-s", "path_column=file", "--label-column", "y"),
        ],
    )
    assert result.exit_code == 0, result.output
    ds = open_dataset(out)
    assert ds.classes == ["0", "1", "2"]
    assert ds.targets == [classes.index(cls) for _, cls, _ in rows if cls]
    assert ds.manifest.source["converted_from"]["format"] == "labels"


def _bad_list(images: Path, folder: Path) -> Path:
    rows = _folder_rows(images)
    body = [
        b"path,label",
        f"{rows[0][0]},{rows[0][1]}".encode(),  # line 2: good
        b"class0/missing.png,class0",  # line 3: no such file
        f"{rows[1][0]},zebra".encode(),  # line 4: not in the label map
        f"{rows[0][0]},{rows[0][1]}".encode(),  # line 5: listed twice
        b"class0/\xff.png,class0",  # line 6: not UTF-8
        f"{rows[2][0]}".encode(),  # line 7: no label
        f"{rows[3][0]},{rows[3][1]}".encode(),  # line 8: good
    ]
    listing = folder / "bad.csv"
    listing.write_bytes(b"\n".join(body) + b"\n")
    (folder / "classes.txt").write_text("class0\nclass1\nclass2\n")
    return listing


def test_a_label_lists_bad_rows_are_refused_by_line(images: Path, tmp_path: Path) -> None:
    listing = _bad_list(images, tmp_path)
    command = ["convert", str(images), str(tmp_path / "out"), "--format", "lmdb", "-q"]
    command += ["--labels", str(listing), "--classes-from", str(tmp_path / "classes.txt")]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 1
    assert f"{listing}: line 3: class0/missing.png: no such file" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_label_lists_bad_rows_are_skipped_and_recorded(images: Path, tmp_path: Path) -> None:
    listing = _bad_list(images, tmp_path)
    command = ["convert", str(images), str(tmp_path / "out"), "--format", "lmdb", "-q"]
    command += ["--labels", str(listing), "--classes-from", str(tmp_path / "classes.txt")]
    result = CliRunner().invoke(main, [*command, "--on-error", "skip"])
    assert result.exit_code == 0, result.output
    ds = open_dataset(tmp_path / "out")
    rows = _folder_rows(images)
    assert ds.stored_paths() == [rows[0][0], rows[3][0]]
    reasons = {s["reason"].split(":")[0]: s for s in ds.manifest.skipped}
    assert sorted(reasons) == [f"line {n}" for n in (3, 4, 5, 6, 7)]
    assert "not in the given label map" in reasons["line 4"]["reason"]
    assert "listed already, on line 2" in reasons["line 5"]["reason"]
    assert "not valid UTF-8" in reasons["line 6"]["reason"]
    assert reasons["line 6"]["path"] == "bad.csv:6"


def _scanned(listing: Path, on_error: str = "skip") -> tuple[list[Any], list[Any], list[str]]:
    """A label list's scan: its samples (every attribute), its bad rows, its classes."""
    from imgpack.sources.base import ScanRequest

    scan = sources.resolve(listing).scan(ScanRequest(on_error=on_error))
    samples = [(s.path, s.label, s.index, s.size, s.fields) for s in scan.samples]
    return samples, scan.unreadable, scan.classes


def test_a_label_list_read_a_few_bytes_at_a_time_scans_as_read_whole(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list is read a block at a time, never whole: a line, a CRLF, a quoted value with a
    line break, a byte order mark or a bad UTF-8 line cut across blocks scan as they do read at
    once, the same rows on the same lines."""
    from imgpack.sources.labels import source

    rows = _folder_rows(images)
    for file in rows[:4]:
        shutil.copy(file[2], tmp_path / file[2].name)
    a, b, c, d = (r[2].name for r in rows[:4])
    csv_text = (
        b"\xef\xbb\xbfpath,label,caption\r\n"
        + f'{a},cat,"two\r\nlines"\r\n{b},dog,plain\r'.encode()
        + b"bad\xff.png,cat,x\n\n"
        + f"{c},cat,\n{b},dog,again\r\n{d},7,last".encode()
    )
    jsonl_text = b"\xef\xbb\xbf" + b"".join(
        json.dumps({"path": n, "label": k % 2, "box": [k]}).encode() + end
        for k, (n, end) in enumerate(zip((a, b, c, d), (b"\r\n", b"\n", b"\r", b""), strict=True))
    )
    for name, text in (("list.csv", csv_text), ("list.jsonl", jsonl_text)):
        listing = tmp_path / name
        listing.write_bytes(text)
        whole = _scanned(listing)
        assert len(whole[0]) == 4, whole
        for block in (1, 2, 3, 5, 8):
            monkeypatch.setattr(source, "_BLOCK", block)
            assert _scanned(listing) == whole, (name, block)
        monkeypatch.undo()
    samples, bad, _ = _scanned(tmp_path / "list.csv")
    assert [s[2] for s in samples] == [2, 4, 7, 9]  # each row's first line
    assert samples[0][4] == {"caption": "two\r\nlines"}  # as the file holds it
    assert [entry["reason"].split(":")[0] for entry in bad] == ["line 5", "line 8"]
    assert "not valid UTF-8" in bad[0]["reason"] and "listed already, on line 4" in bad[1]["reason"]


def test_a_label_list_finds_two_rows_of_one_file_whatever_their_hashes(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows naming one file are found by their files' hashes once every row is read, then
    compared by file: with every hash equal, distinct files are all kept and only the rows
    that name an earlier row's file are refused, by line; with ``--on-error fail`` the first
    bad row by line stops the run, whether it names a file twice or a missing one."""
    from imgpack.sources.labels import source

    rows = _folder_rows(images)[:5]
    for path, _, file in rows:  # a copy: the images fixture is shared
        (tmp_path / path).parent.mkdir(exist_ok=True)
        shutil.copy(file, tmp_path / path)
    lines = ["path,label", *(f"{p},{cls}" for p, cls, _ in rows)]
    lines += [f"./{rows[1][0]}", f"{rows[3][0]},x"]
    lines[-2] += f",{rows[1][1]}"
    listing = tmp_path / "list.csv"
    listing.write_text("\n".join(lines) + "\n")
    expected = _scanned(listing)
    assert [s[0] for s in expected[0]] == [p for p, _, _ in rows]
    assert [e["reason"] for e in expected[1]] == [
        f"line 7: ./{rows[1][0]} is the file {rows[1][0]} names, listed on line 3",
        f"line 8: {rows[3][0]} is listed already, on line 5",
    ]
    monkeypatch.setattr(source, "hash", lambda value: 7, raising=False)
    assert _scanned(listing) == expected
    monkeypatch.undo()
    with pytest.raises(ScanError, match=r"line 7: \./"):
        _scanned(listing, "fail")
    listing.write_text("\n".join([*lines, "class0/missing.png,class0"]) + "\n")
    with pytest.raises(ScanError, match=r"line 7: \./"):
        _scanned(listing, "fail")
    lines.insert(3, "class0/missing.png,class0")
    listing.write_text("\n".join(lines) + "\n")
    with pytest.raises(ScanError, match=r"line 4: class0/missing\.png: no such file"):
        _scanned(listing, "fail")


def test_a_label_lists_scan_holds_a_few_dozen_bytes_a_row(tmp_path: Path) -> None:
    """A driver plans from a list of millions of rows: its scan reads the list a block at a
    time, holds the rows packed, and finds rows naming one file without a dict of every
    file: 50,000 rows within 100 bytes a row held and 200 at the peak (525 before: the list
    read whole, a tuple and a dict entry a row)."""
    from imgpack.sources.base import ScanRequest

    count = 50_000
    lines = ["path,label"]
    for i in range(count):
        folder = tmp_path / f"img/{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        (folder / f"photo_{i:07d}.jpg").touch()
        lines.append(f"img/{i // 1000:03d}/photo_{i:07d}.jpg,class{i % 10}")
    listing = tmp_path / "list.csv"
    listing.write_text("\n".join(lines) + "\n")
    source = sources.resolve(listing)
    source.scan(ScanRequest())  # what the first scan imports and caches is not counted
    scan, held, peak = traced(lambda: source.scan(ScanRequest()))
    assert len(scan.samples) == count and scan.samples[-1].path == lines[-1].split(",")[0]
    assert scan.samples[-1].label == 9 and scan.samples[-1].index == count + 1
    assert held / count < 100 and peak / count < 200, (held / count, peak / count)


def test_a_listed_file_that_fails_to_decode_names_its_line(images: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = _folder_rows(images)
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\n{rows[0][2]},a\nbroken.png,b\n")  # absolute, relative
    with pytest.raises(Exception, match=r"broken.png: .*\(list.csv line 3\)"):
        convert(listing, tmp_path / "out", "pt", progress=False)
    done = convert(listing, tmp_path / "out", "pt", progress=False, on_error="skip")
    assert done.num_samples == 1 and done.skipped[0]["path"] == "broken.png"
    assert open_dataset(tmp_path / "out").stored_paths() == [str(rows[0][2])]


def test_a_header_without_the_columns_says_how_to_name_them(tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text("id,category\na.png,x\n")
    with pytest.raises(ScanError, match=r"line 1: no 'path' column .* -s path_column=NAME"):
        convert(listing, tmp_path / "out", "pt", progress=False)


def test_unlabelled_images_need_asking_for(tmp_path: Path) -> None:
    folder = tmp_path / "flat"
    build_uniform_folder(tmp_path / "tmp", 4, 1, 8)
    shutil.copytree(tmp_path / "tmp" / "class0", folder)
    refused = CliRunner().invoke(
        main, ["convert", str(folder), str(tmp_path / "o"), "--format", "pt"]
    )
    assert refused.exit_code == 1 and "no class folders found" in refused.output
    done = CliRunner().invoke(
        main, ["convert", str(folder), str(tmp_path / "o"), "--format", "pt", "--no-labels", "-q"]
    )
    assert done.exit_code == 0, done.output
    ds = open_dataset(tmp_path / "o")
    assert ds.classes == [] and ds.targets == [-1] * 4
    assert ds.stored_paths() == sorted(p.name for p in folder.iterdir())
    with pytest.raises(OptionError, match="--classes-from does not apply"):
        convert(folder, tmp_path / "p", "pt", no_labels=True, classes=["a"], progress=False)


def test_unlabelled_outputs_verify_export_and_convert_again(images: Path, tmp_path: Path) -> None:
    from imgpack import verify
    from imgpack.exporting import export

    for fmt in FORMATS:
        out = tmp_path / fmt
        convert(images, out, fmt, no_labels=True, progress=False)
        assert verify(out, deep=True).ok, fmt
        export(out, tmp_path / f"{fmt}-files", progress=False)
        found = sorted(
            str(p.relative_to(tmp_path / f"{fmt}-files"))
            for p in (tmp_path / f"{fmt}-files").rglob("*.png")
        )
        assert found == [path for path, _, _ in _folder_rows(images)]
        again = convert(out, tmp_path / f"{fmt}-again", "pt", progress=False)
        assert again.classes == [] and again.num_samples == len(found)


def test_a_webdataset_sample_without_a_label_is_named(tmp_path: Path) -> None:
    tar_path = tmp_path / "one.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, data in (("a.png", b"x"), ("b.png", b"y"), ("b.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ScanError, match=r"one.tar: sample 'a': no label"):
        convert(tar_path, tmp_path / "out", "pt", progress=False)


def test_source_options_are_checked_for_the_kind(images: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="source 'folder' has no option image_column"):
        convert(images, tmp_path / "out", "pt", image_column="img", progress=False)
    with pytest.raises(OptionError, match="unknown source kind 'nope'"):
        convert(images, tmp_path / "out", "pt", source="nope", progress=False)


@pytest.fixture(scope="module")
def toy_source_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy source plugin (tests/plugins/imgpack-toy-source), pip-installed into a folder."""
    return pip_install(PLUGIN, tmp_path_factory)


def test_an_installed_plugin_adds_a_source_kind(
    toy_source_site: Path, images: Path, tmp_path: Path
) -> None:
    """A package with an imgpack.sources entry point adds a kind: detected, with its options,
    read by pool workers, nothing in imgpack changed."""
    shutil.copytree(images, tmp_path / "images")
    rows = _folder_rows(tmp_path / "images")
    listing = tmp_path / "set.toy"
    listing.write_text("".join(f"{cls} images/{path}\n" for path, cls, _ in rows))
    env = {**os.environ, "PYTHONPATH": str(toy_source_site)}
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "imgpack.cli", "convert", str(listing), str(out)),
            *("--format", "hdf5", "-q", "--workers", "2", "-s", "prefix=toy-"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    ds = open_dataset(out)
    assert ds.classes == ["toy-class0", "toy-class1", "toy-class2"]
    assert ds.stored_paths() == [f"images/{path}" for path, _, _ in rows]
    for i, (_, _, file) in enumerate(rows):
        assert np.array_equal(ds[i][0].permute(1, 2, 0).numpy(), reference_pixels(file))
    listed = subprocess.run(
        [sys.executable, "-m", "imgpack.cli", "convert", "--help"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "toy: a toy source from a plugin" in " ".join(listed.stdout.split())


def test_a_label_list_may_name_urls(images: Path, tmp_path: Path) -> None:
    """A URL in the list is read by the workers through fsspec (file:// here; s3:// alike)."""
    rows = _folder_rows(images)[:3]
    listing = tmp_path / "list.csv"
    listing.write_text(
        "path,label\n" + "".join(f"{file.as_uri()},{cls}\n" for _, cls, file in rows)
    )
    convert(listing, tmp_path / "out", "webdataset", progress=False, workers=2)
    ds = open_dataset(tmp_path / "out")
    assert ds.stored_paths() == [file.as_uri() for _, _, file in rows]
    for i, (_, _, file) in enumerate(rows):
        assert np.array_equal(ds[i][0].permute(1, 2, 0).numpy(), reference_pixels(file))


def test_an_unlabelled_output_to_hugging_face(images: Path, tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="pip install 'imgpack[hf]' (test.sh does)")
    from imgpack import to_hf

    convert(images, tmp_path / "out", "lmdb", no_labels=True, progress=False)
    back = to_hf(tmp_path / "out", cache_dir=str(tmp_path / "cache"))
    assert back["label"] == [-1] * 12


def test_a_label_list_under_a_bucket_folder_is_sized_from_its_listing_by_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With SRC a bucket folder, each row's object is found in SRC's listing (read one line at
    a time) by its key's hash, then by its key: each row gets its object's size and ETag, a
    row whose object is not listed is bad by its line, rows of other kinds (a URL) pass as
    they are; with every hash equal the same; 100,000 rows within 120 bytes a row beside
    their table (348 with a dict of every row's key and another of what was found)."""
    from pathlib import Path as P

    from imgpack.scan import SampleTable, listed_id
    from imgpack.sources.base import ScanRequest
    from imgpack.sources.labels import source

    def table(count: int) -> SampleTable:
        rows = SampleTable()
        for i in range(count):
            rows.add(f"./img/{i // 1000:03d}//p{i:07d}.jpg", i % 10, i + 2)
        rows.add("s3://other/x.jpg", 1, count + 2, size=5)
        return rows

    def objects(folder: P) -> Any:
        for i in range(count + 5_000):  # the bucket holds more than the list names
            if i % 40_000 != 7:  # and not all of it
                yield f"img/{i // 1000:03d}/p{i:07d}.jpg", 1_000 + i, f'"e{i}"'

    monkeypatch.setattr(source.listing, "store_every_object", objects)
    found = source.LabelListSource(P("list.csv"), {"path_column": "path", "label_column": "label"})
    found.__dict__["remote"] = ("s3://bucket/images", {})
    request = ScanRequest(on_error="skip")
    count = 100_000
    rows = table(count)
    unreadable: list[dict[str, str]] = []
    kept, _, peak = traced(lambda: found._with_listed_sizes(rows, request, unreadable))
    assert peak / count < 120, f"{peak / count:.0f} bytes a row"
    assert [e["reason"] for e in unreadable] == [
        f"line {i + 2}: ./img/{i // 1000:03d}//p{i:07d}.jpg: no such object "
        f"(s3://bucket/images/img/{i // 1000:03d}/p{i:07d}.jpg)"
        for i in (7, 40_007, 80_007)
    ]
    assert len(kept) == count + 1 - 3 and kept[-1] == rows[-1] and kept[-1].size == 5
    assert (kept[8].size, kept[8].listed, kept[8].index) == (1_009, listed_id('"e9"'), 11)
    count = 300
    rows = table(count)
    expected = found._with_listed_sizes(rows, request, [])
    monkeypatch.setattr(source, "hash", lambda value: 7, raising=False)
    again = found._with_listed_sizes(rows, request, [])
    assert [(s.path, s.size, s.listed) for s in again] == [
        (s.path, s.size, s.listed) for s in expected
    ]
    assert len(again) == count + 1 - 1 and again[0].size == 1_000
