"""Fields through a conversion and back (#43, the label list's columns into ``pt``): every value
read back exactly, in order, through ``ds[i]``, a multi-worker DataLoader and ``ds.field``; the
bad rows named by line; the fields covered by the record checksum; formats that store no fields
yet refuse them in one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.errors import DataError, OptionError, ScanError
from imgpack.manifest import read_manifest
from imgpack.readers import collate

COUNT = 12


def coco_like(root: Path, count: int = COUNT, seed: int = 3) -> list[dict[str, Any]]:
    """``count`` PNGs under ``root/img`` and their rows: a path, a class name, boxes (JSON), a
    score (float), multi-labels (an int list) and, on odd rows only, a caption."""
    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        pixels = rng.integers(0, 256, size=(8 + i % 3, 10, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "img" / f"{i:03d}.png")
        boxes = [[int(v) for v in rng.integers(0, 50, 4)] for _ in range(i % 3)]
        row: dict[str, Any] = {
            "path": f"img/{i:03d}.png",
            "label": ["cat", "dog", "emu"][i % 3],
            "boxes": {"boxes": boxes, "crowd": bool(i % 2)},
            "score": float(np.float32(rng.random())),
            "tags": [int(v) for v in rng.integers(0, 80, 1 + i % 4)],
        }
        if i % 2:
            row["caption"] = f"sample {i}: ünïcode ✓"
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def expected(rows: list[dict[str, Any]], name: str) -> list[Any]:
    return [row.get(name) for row in rows]


def plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("fmt", ["pt", "webdataset", "hdf5", "lmdb", "tfrecord"])
@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_a_label_lists_columns_round_trip(fmt: str, encoding: str, tmp_path: Path) -> None:
    """Every column beside path and label is kept by default with its inferred type, and read
    back exactly and in order: ``ds[i]``, batches through two DataLoader workers, ``ds.field``."""
    rows = coco_like(tmp_path)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    options: dict[str, Any] = {"encoding": encoding, "progress": False}
    if encoding == "raw":
        options["size"] = 8
    manifest = convert(src, tmp_path / "out", fmt, **options)
    assert [f.spec for f in manifest.fields] == [
        "boxes:json", "score:float", "tags:int[]", "caption:str?",
    ]  # fmt: skip
    names = ("caption", "boxes", "score", "tags")
    ds = open_dataset(tmp_path / "out", fields=names)
    for i in (0, 1, COUNT - 1):
        _image, label, caption, boxes, score, tags = ds[i]
        assert label == ds.class_to_idx[rows[i]["label"]]
        assert caption == rows[i].get("caption")
        assert boxes == rows[i]["boxes"] and score == rows[i]["score"]
        assert tags.dtype == torch.int64 and tags.tolist() == rows[i]["tags"]
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=collate)
    seen: dict[str, list[Any]] = {n: [] for n in names}
    labels: list[int] = []
    for _images, batch_labels, *columns in loader:
        labels += batch_labels.tolist()
        for name, column in zip(names, columns, strict=True):
            if name == "score":
                assert isinstance(column, torch.Tensor) and column.dtype == torch.float32
            seen[name] += [plain(v) for v in column]
    assert labels == [ds.class_to_idx[r["label"]] for r in rows]
    for name in names:
        assert seen[name] == expected(rows, name), name
    assert ds.field("score").tolist() == expected(rows, "score")
    assert ds.field("caption") == expected(rows, "caption")
    assert [t.tolist() for t in ds.field("tags")] == expected(rows, "tags")


def test_a_csv_lists_columns_are_typed_and_given_types_win(tmp_path: Path) -> None:
    """A CSV's cells are text: a column of integers is ``int``, of numbers ``float``, else
    ``str``; ``--field NAME:TYPE`` takes a column of JSON text as JSON. Through the CLI, the
    summary and ``info`` say which fields the output keeps."""
    rows = coco_like(tmp_path)
    with (tmp_path / "list.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "boxes", "score", "count", "caption"])
        for i, row in enumerate(rows):
            writer.writerow(
                [row["path"], row["label"], json.dumps(row["boxes"]), row["score"], i * 7,
                 row.get("caption", "")]
            )  # fmt: skip
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(
        main,
        [
            "convert",
            str(tmp_path / "list.csv"),
            str(out),
            "--format",
            "pt",
            "--field",
            "boxes:json",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "fields kept: boxes:json, score:float, count:int, caption:str?" in result.output
    dry = runner.invoke(
        main,
        ["convert", str(tmp_path / "list.csv"), str(tmp_path / "dry"), "--format", "pt",
         "--field", "boxes:json", "--dry-run"],
    )  # fmt: skip
    assert "fields:    boxes:json, score:float, count:int, caption:str?" in dry.output
    info = runner.invoke(main, ["info", str(out)])
    assert "fields:    boxes:json, score:float, count:int, caption:str?" in info.output
    ds = open_dataset(out, fields=("boxes", "count", "caption", "score"))
    batch = collate(ds.__getitems__(list(range(COUNT))))
    assert batch[2] == expected(rows, "boxes")
    assert batch[3].dtype == torch.int64 and batch[3].tolist() == [i * 7 for i in range(COUNT)]
    assert batch[4] == expected(rows, "caption")
    assert batch[5].tolist() == expected(rows, "score")


def test_fields_keeps_the_named_ones_in_order_or_none(tmp_path: Path) -> None:
    """``--fields b,a`` keeps those, in that order; ``--fields ''`` none (the manifest then has
    no fields, as an output of a list without other columns); a name the list lacks, or a
    ``--field`` for one, is refused in one line naming the fields it has."""
    src = write_jsonl(tmp_path / "list.jsonl", coco_like(tmp_path))
    some = convert(src, tmp_path / "some", "pt", fields=("tags", "boxes"), progress=False)
    assert [f.name for f in some.fields] == ["tags", "boxes"]
    assert open_dataset(tmp_path / "some", fields="tags")[3][2].tolist() == read_tags(src, 3)
    none = convert(src, tmp_path / "none", "pt", fields="", progress=False)
    assert none.fields == []
    assert "fields" not in json.loads((tmp_path / "none" / "imgpack.json").read_text())
    with pytest.raises(OptionError, match=r"has no field 'nope' \(its fields: boxes, score"):
        convert(src, tmp_path / "bad", "pt", fields=("nope",), progress=False)
    with pytest.raises(OptionError, match=r"--field: .* has no field 'size'"):
        convert(src, tmp_path / "bad", "pt", field_types=("size:int",), progress=False)
    assert not (tmp_path / "bad").exists()


def read_tags(src: Path, line: int) -> list[int]:
    return list(json.loads(src.read_text().splitlines()[line])["tags"])


def test_a_format_that_stores_no_fields_refuses_them(tmp_path: Path) -> None:
    """Never a column silently dropped: a format that stores no fields (a plugin's) refuses a
    source that has some, in one line saying how to go on; ``--fields ''`` converts without."""
    from imgpack import formats
    from imgpack.formats import FormatSpec

    spec = formats.register(
        FormatSpec(
            name="plain",
            writer="imgpack.formats.pt.writer:PTWriter",
            reader="imgpack.formats.pt.reader:PTDataset",
            summary="a format without fields",
            sharded=True,
            default_shard_size=1 << 20,
        )
    )
    try:
        src = write_jsonl(tmp_path / "list.jsonl", coco_like(tmp_path, count=4))
        with pytest.raises(OptionError, match=r"format 'plain' cannot store fields.*--fields ''"):
            convert(src, tmp_path / "out", "plain", progress=False)
        assert not (tmp_path / "out").exists()
        result = CliRunner().invoke(  # a user mistake through the CLI: one line, no traceback
            main, ["convert", str(src), str(tmp_path / "out"), "--format", "pt", "--fields", "x"]
        )
        assert result.exit_code != 0 and "has no field 'x'" in result.output
        assert "Traceback" not in result.output and not (tmp_path / "out").exists()
        manifest = convert(src, tmp_path / "out", "plain", fields="", progress=False)
        assert manifest.num_samples == 4 and manifest.fields == []
    finally:
        formats.unregister(spec.name)


def test_bad_field_values_are_refused_by_line_or_skipped(tmp_path: Path) -> None:
    """A cell that is not JSON in a JSON column, or text in an int column, stops the run naming
    its line; with ``--on-error skip`` the row is recorded as skipped and the rest converted."""
    rows = coco_like(tmp_path, count=5)
    with (tmp_path / "list.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "boxes", "count"])
        for i, row in enumerate(rows):
            boxes = "{not json" if i == 1 else json.dumps(row["boxes"])
            writer.writerow([row["path"], row["label"], boxes, "seven" if i == 3 else i])
    src = tmp_path / "list.csv"
    types = ("boxes:json", "count:int")
    with pytest.raises(ScanError, match=r"list.csv: line 3: column 'boxes' \(json\): not JSON"):
        convert(src, tmp_path / "out", "pt", field_types=types, progress=False)
    manifest = convert(
        src, tmp_path / "out", "pt", field_types=types, on_error="skip", progress=False
    )
    assert manifest.num_samples == 3
    reasons = sorted(s["reason"] for s in manifest.skipped)
    assert reasons[0].startswith("line 3: column 'boxes' (json): not JSON")
    assert reasons[1].startswith("line 5: field 'count' (int): expected an integer, not 'seven'")
    ds = open_dataset(tmp_path / "out", fields=("count",))
    assert ds.field("count").tolist() == [0, 2, 4]


def test_a_required_value_missing_or_a_bad_name_is_refused(tmp_path: Path) -> None:
    """A column given as required that a row lacks names the row; a column whose name cannot
    be a field (imgpack's own key) is refused in one line that says how to leave it out."""
    rows = coco_like(tmp_path, count=4)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    with pytest.raises(ScanError, match=r"line 1: no value for the field 'caption'"):
        convert(src, tmp_path / "out", "pt", field_types=("caption:str",), progress=False)
    for row in rows:
        row["data"] = 1
    write_jsonl(src, rows)
    with pytest.raises(ScanError, match=r"column 'data' cannot be kept as a field.*--fields"):
        convert(src, tmp_path / "out", "pt", progress=False)
    manifest = convert(src, tmp_path / "out", "pt", fields=("score",), progress=False)
    assert [f.name for f in manifest.fields] == ["score"]


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("pt", "shard-00000.pt"),
        ("hdf5", "data.h5"),
        ("lmdb", "data.mdb"),
        ("tfrecord", "data-00000-of-00001.tfrecord"),
    ],
)
def test_an_edited_field_is_caught_by_the_reader_and_by_verify(
    fmt: str, name: str, tmp_path: Path
) -> None:
    """The record checksum covers the fields: a caption edited in a stored file (same length,
    the file's size unchanged) is refused when its record is read, and ``verify`` names it."""
    rows = coco_like(tmp_path, count=6)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    convert(src, tmp_path / "out", fmt, progress=False)
    shard = tmp_path / "out" / name
    data = shard.read_bytes()
    assert data.count(b"sample 3:") == 1
    shard.write_bytes(data.replace(b"sample 3:", b"sample 8:"))
    ds = open_dataset(tmp_path / "out", fields=("caption",))
    assert ds[1][2] == rows[1]["caption"]
    # TFRecord's own frame CRC covers the whole record; the other formats' record checksum
    damaged = r"data CRC mismatch .*\(sample 3" if fmt == "tfrecord" else r"sample 3 .*checksum"
    with pytest.raises(DataError, match=damaged):
        ds[3]
    with pytest.raises(DataError, match=damaged):
        ds.__getitems__([2, 3])
    if fmt != "tfrecord":  # its frames are checked unless check_crc=False
        raw = open_dataset(tmp_path / "out", verify=False, fields=("caption",))
        assert raw[3][2] == "sample 8: ünïcode ✓"  # unchecked reads take what is stored
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "out")])
    assert result.exit_code != 0 and name in result.output


def test_h5dump_shows_the_field_datasets(tmp_path: Path) -> None:
    """An HDF5 output's fields are plain datasets HDF5's own tools show: a caption as a
    variable-length UTF-8 string, a score as a float, tags as variable-length integers."""
    import shutil
    import subprocess

    h5dump = shutil.which("h5dump")
    assert h5dump is not None, "h5dump (hdf5-tools) is part of the test machine"
    rows = coco_like(tmp_path, count=4)
    convert(write_jsonl(tmp_path / "list.jsonl", rows), tmp_path / "out", "hdf5", progress=False)
    shown = subprocess.run(
        [h5dump, "-g", "/fields", str(tmp_path / "out" / "data.h5")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert 'GROUP "caption"' in shown and 'DATASET "present"' in shown
    assert "H5T_STR_NULLTERM" in shown or "H5T_VARIABLE" in shown
    assert '(1): "sample 1: ' in shown and "CSET H5T_CSET_UTF8" in shown  # h5dump escapes ü
    assert "H5T_VLEN" in shown  # the tags
    assert "H5T_IEEE_F32LE" in shown  # the score


def test_the_same_plan_writes_the_same_bytes_with_fields(tmp_path: Path) -> None:
    """Two conversions of one list give byte-identical shards and one output id; the kept
    fields are part of the id (``--fields`` another selection: another id)."""
    src = write_jsonl(tmp_path / "list.jsonl", coco_like(tmp_path, count=6))
    first = convert(src, tmp_path / "a", "pt", progress=False)
    second = convert(src, tmp_path / "b", "pt", progress=False)
    assert first.output_id == second.output_id
    assert [f.sha256 for f in first.files] == [f.sha256 for f in second.files]
    other = convert(src, tmp_path / "c", "pt", fields=("score",), progress=False)
    assert other.output_id != first.output_id
    loaded = torch.load(tmp_path / "a" / "shard-00000.pt", weights_only=True)
    assert loaded["fields"]["score"]["values"].dtype == torch.float32  # plain torch.load reads it
    assert bytes(loaded["fields"]["caption"]["values"][:5].tolist()) == b"sampl"
    assert read_manifest(tmp_path / "a").fields == first.fields


def test_an_output_with_fields_converts_and_merges_with_them(tmp_path: Path) -> None:
    """An imgpack output as SRC carries its fields into the new output (``--fields`` keeps
    some), and the parts of a partitioned conversion merge with them: never dropped."""
    from imgpack import merge

    rows = coco_like(tmp_path, count=8)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    convert(src, tmp_path / "first", "pt", progress=False)
    again = convert(tmp_path / "first", tmp_path / "again", "pt", encoding="raw", size=8,
                    progress=False)  # fmt: skip
    assert [f.spec for f in again.fields] == [
        "boxes:json", "score:float", "tags:int[]", "caption:str?",
    ]  # fmt: skip
    ds = open_dataset(tmp_path / "again", fields=("caption", "boxes"))
    assert ds.field("caption") == expected(rows, "caption")
    assert collate(ds.__getitems__([2, 5]))[3] == [rows[2]["boxes"], rows[5]["boxes"]]
    some = convert(tmp_path / "first", tmp_path / "some", "pt", fields="score", progress=False)
    assert [f.name for f in some.fields] == ["score"]
    parts = []
    for part in range(2):
        out = tmp_path / f"part{part}"
        convert(src, out, "pt", num_parts=2, part=part, progress=False)
        parts.append(out)
    merged = merge(parts, tmp_path / "merged", progress=False)
    assert merged.fields == again.fields
    whole = open_dataset(tmp_path / "merged", fields=("tags",), verify=True)
    assert [t.tolist() for t in whole.field("tags")] == expected(rows, "tags")
    assert [whole[i][2].tolist() for i in range(8)] == expected(rows, "tags")


def test_export_writes_fields_as_sidecars_and_a_folder_reads_them_back(tmp_path: Path) -> None:
    """``export`` writes each field value beside its image as ``<name>.<field>``; converting
    the folder takes the sidecars back as fields (``txt`` and ``json`` by their names, the
    others typed with ``--field``): every value as it was, through the CLI."""
    rows = coco_like(tmp_path, count=6)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    convert(src, tmp_path / "out", "pt", progress=False)
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / "folder"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "folder" / "dog" / "img" / "001.caption").read_text() == rows[1]["caption"]
    assert not (tmp_path / "folder" / "cat" / "img" / "000.caption").exists()  # absent: none
    assert (
        json.loads((tmp_path / "folder" / "cat" / "img" / "000.tags").read_text())
        == rows[0]["tags"]
    )
    types = ["--field", "caption:str?", "--field", "boxes:json", "--field", "score:float",
             "--field", "tags:int[]"]  # fmt: skip
    again = tmp_path / "again"
    result = runner.invoke(
        main, ["convert", str(tmp_path / "folder"), str(again), "--format", "lmdb", "-q", *types]
    )
    assert result.exit_code == 0, result.output
    ds = open_dataset(again, fields=("caption", "boxes", "score", "tags"))
    by_path = {p.split("/", 1)[1]: i for i, p in enumerate(ds.stored_paths() or [])}
    for row in rows:
        caption, boxes, score, tags = ds[by_path[row["path"]]][2:]
        assert caption == row.get("caption") and boxes == row["boxes"]
        assert score == row["score"] and tags.tolist() == row["tags"]


def test_an_img2dataset_folder_converts_with_its_sidecars(tmp_path: Path) -> None:
    """A folder as img2dataset writes it (``00000/000001.jpg`` + ``.txt`` + ``.json``) with
    ``--no-labels``: the captions and JSON are fields (a missing ``.json``: optional), the
    sidecars listed as such among the files passed over, a bad ``.json`` named by its image."""
    rng = np.random.default_rng(4)
    want = []
    for shard in range(2):
        folder = tmp_path / "i2d" / f"{shard:05d}"
        folder.mkdir(parents=True)
        for k in range(3):
            key = f"{shard}{k:05d}"
            Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8)).save(
                folder / f"{key}.jpg"
            )
            (folder / f"{key}.txt").write_text(f"caption {key}", encoding="utf-8")
            meta = {"url": f"https://example.com/{key}", "key": key} if k != 1 else None
            if meta is not None:
                (folder / f"{key}.json").write_text(json.dumps(meta))
            want.append((f"caption {key}", meta))
    manifest = convert(tmp_path / "i2d", tmp_path / "out", "webdataset", no_labels=True,
                       progress=False)  # fmt: skip
    assert [f.spec for f in manifest.fields] == ["json:json?", "txt:str"]  # in name order
    assert manifest.source["ignored"] == {"a sidecar of an image, kept as its field": 10}
    ds = open_dataset(tmp_path / "out", fields=("txt", "json"))
    assert [tuple(ds[i][2:]) for i in range(len(ds))] == want
    (tmp_path / "i2d" / "00001" / "100002.json").write_text("{broken")
    with pytest.raises(Exception, match=r"100002.jpg.*sidecar 00001/100002.json"):
        convert(tmp_path / "i2d", tmp_path / "bad", "pt", no_labels=True, progress=False)


def laion_like(root: Path, shards: int = 2, per_shard: int = 4) -> list[tuple[str, dict[str, Any]]]:
    """WebDataset tars as img2dataset writes them: ``key.jpg``, a ``key.txt`` caption and a
    ``key.json`` of url, width and similarity; no ``.cls``. Returns each sample's caption and
    JSON, in order."""
    import io
    import tarfile

    root.mkdir(parents=True)
    rng = np.random.default_rng(7)
    samples = []
    for shard in range(shards):
        with tarfile.open(root / f"{shard:05d}.tar", "w") as tar:
            for k in range(per_shard):
                key = f"{shard}{k:04d}"
                buffer = io.BytesIO()
                pixels = rng.integers(0, 256, size=(12, 9 + k, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(buffer, "JPEG")
                meta = {"url": f"https://example.com/{key}.jpg", "width": 9 + k,
                        "similarity": round(float(rng.random()), 6)}  # fmt: skip
                caption = f"caption {key}: ünïcode ✓"
                samples.append((caption, meta))
                for name, data in (
                    (f"{key}.jpg", buffer.getvalue()),
                    (f"{key}.txt", caption.encode("utf-8")),
                    (f"{key}.json", json.dumps(meta).encode("utf-8")),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return samples


@pytest.mark.parametrize("fmt", ["pt", "webdataset", "hdf5", "lmdb", "tfrecord"])
def test_a_laion_like_set_converts_without_labels_with_its_fields(fmt: str, tmp_path: Path) -> None:
    """LAION-like tars (no ``.cls``) with ``--no-labels``: every caption and JSON value read
    back exactly, in order, label -1; the images are the source JPEGs' pixels."""
    samples = laion_like(tmp_path / "laion")
    result = CliRunner().invoke(
        main,
        ["convert", str(tmp_path / "laion"), str(tmp_path / "out"), "--format", fmt,
         "--no-labels", "-q"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fields kept: txt:str, json:json" in result.output
    ds = open_dataset(tmp_path / "out", fields=("txt", "json"))
    assert ds.classes == [] and ds.manifest.fields[0].spec == "txt:str"
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=collate)
    got: list[tuple[str, dict[str, Any]]] = []
    for _images, labels, captions, metas in loader:
        assert labels.tolist() == [-1] * len(labels)
        got += list(zip(captions, metas, strict=True))
    assert got == samples
    assert ds.field("txt") == [caption for caption, _ in samples]


# The webdataset package leaves its last shard's file to the garbage collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_fields_read_by_the_webdataset_package(tmp_path: Path) -> None:
    """An output with fields back to WebDataset: the ``webdataset`` package reads each sample's
    ``.txt`` and ``.json`` as the source held them, and imgpack's own metadata as
    ``.imgpack.json``; numbers are decimal text, int lists JSON."""
    wds = pytest.importorskip("webdataset")
    samples = laion_like(tmp_path / "laion")
    convert(tmp_path / "laion", tmp_path / "pt", "pt", no_labels=True, progress=False)
    convert(tmp_path / "pt", tmp_path / "out", "webdataset", shard_size="4KB", progress=False)
    shards = sorted(str(p) for p in (tmp_path / "out").glob("*.tar"))
    assert len(shards) > 1
    read = list(wds.WebDataset(shards, shardshuffle=False).decode())
    assert [(s["txt"], s["json"]) for s in read] == samples
    assert all(s["imgpack.json"]["output_id"] for s in read)
    rows = coco_like(tmp_path / "coco", count=4)
    src = write_jsonl(tmp_path / "coco" / "list.jsonl", rows)
    convert(src, tmp_path / "coco-wds", "webdataset", progress=False)
    tar = str(tmp_path / "coco-wds" / "data-000000.tar")
    first, *_ = list(wds.WebDataset(tar, shardshuffle=False))
    assert float(first["score"]) == rows[0]["score"]
    assert json.loads(first["tags"]) == rows[0]["tags"]
    assert "caption" not in first  # absent in row 0: no member
    ds = open_dataset(tmp_path / "coco-wds", fields=("caption", "boxes", "score", "tags"))
    batch = collate(ds.__getitems__([0, 1, 2, 3]))
    assert batch[2] == expected(rows, "caption") and batch[3] == expected(rows, "boxes")
    assert batch[4].tolist() == expected(rows, "score")
    assert [t.tolist() for t in batch[5]] == expected(rows, "tags")


@pytest.mark.parametrize("encoding", ["original", "raw"])
def test_an_edited_webdataset_field_member_is_caught(encoding: str, tmp_path: Path) -> None:
    """A caption member edited in the tar (same length) is refused when its record is read
    (raw: the first time), and by ``verify``."""
    laion_like(tmp_path / "laion", shards=1)
    options: dict[str, Any] = {"encoding": encoding, "progress": False, "no_labels": True}
    if encoding == "raw":
        options["size"] = 8
    convert(tmp_path / "laion", tmp_path / "out", "webdataset", **options)
    shard = tmp_path / "out" / "data-000000.tar"
    data = shard.read_bytes()
    assert data.count(b"caption 00002:") == 1
    shard.write_bytes(data.replace(b"caption 00002:", b"caption 00009:"))
    ds = open_dataset(tmp_path / "out", fields=("txt",))
    assert ds[1][2].startswith("caption 00001:")
    with pytest.raises(DataError, match=r"sample 2 .*checksum mismatch"):
        ds.__getitems__([0, 2])
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "out")])
    assert result.exit_code != 0 and "data-000000.tar" in result.output


def test_a_tar_member_that_is_not_its_type_is_refused_by_sample(tmp_path: Path) -> None:
    """A ``.json`` member that is not JSON names the sample and the member; ``--on-error skip``
    records it and converts the rest."""
    laion_like(tmp_path / "laion", shards=1)
    import tarfile

    broken = tmp_path / "broken.tar"
    with tarfile.open(tmp_path / "laion" / "00000.tar") as tar, tarfile.open(broken, "w") as out:
        for member in tar:
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == "00001.json":
                data = b"{not json" + b" " * (len(data) - 9)
            member.size = len(data)
            import io

            out.addfile(member, io.BytesIO(data))
    with pytest.raises(Exception, match=r"00001.jpg: member 00001.json: .*not JSON|Expecting"):
        convert(broken, tmp_path / "out", "pt", no_labels=True, progress=False)
    manifest = convert(broken, tmp_path / "out", "pt", no_labels=True, on_error="skip",
                       progress=False)  # fmt: skip
    assert manifest.num_samples == 3
    assert [s["path"] for s in manifest.skipped] == ["broken.tar/00001.jpg"]


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "pt", "tfrecord", "webdataset"])
def test_a_killed_conversion_with_fields_resumes_to_the_same_bytes(
    fmt: str, tmp_path: Path
) -> None:
    """Fields are in the checkpoints (HDF5's journal, LMDB's commits) and in the shards and
    their receipts: a conversion of a label list with fields killed with SIGKILL resumes to
    exactly the bytes of an uninterrupted one, every value read back."""
    import random
    import subprocess
    import sys

    from test_resume import COUNT, SHARD, SLOWED_TASKS, _convert, _files, _kill_at, _receipts

    from imgpack import verify
    from imgpack.pipeline import leftovers

    rng = np.random.default_rng(9)
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(COUNT):
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(
            tmp_path / "img" / f"{i}.png"
        )
        row = {"path": f"img/{i}.png", "label": i % 4, "caption": f"image {i}", "n": [i, -i]}
        rows.append(row | ({"score": i / 7} if i % 3 else {}))
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    args = ["--format", fmt, "--encoding", "png"]
    if fmt in SHARD:
        args += ["--shard-size", SHARD[fmt]]
    command = [sys.executable, "-m", "imgpack.cli", "convert", str(src)]
    done = subprocess.run([*command, str(tmp_path / "reference"), "-q", *args], capture_output=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    if fmt in SHARD:  # shard tasks (a list of files plans its shards): killed by receipts
        total = len(open_dataset(tmp_path / "reference").manifest.files)
        target = random.Random(fmt).randint(total // 4, 3 * total // 4)
        slowed = [sys.executable, "-c", SLOWED_TASKS, "convert", str(src), str(out), "-q", *args]
        process = subprocess.Popen(slowed, start_new_session=True, stderr=subprocess.PIPE)
        assert 0 < _kill_at(process, out, target, _receipts) < total
    else:
        # Before the second LMDB commit / HDF5 block (1,000 samples each): past it, 400
        # samples are left, and a loaded machine finished them before the poll saw the
        # checkpoint.
        target = random.Random(fmt).randint(COUNT // 4, COUNT // 3)
        assert 0 < _kill_at(_convert(src, out, *args), out, target) < COUNT
    resumed = subprocess.run([*command, str(out), "-q", "--resume", *args], capture_output=True)
    assert resumed.returncode == 0, resumed.stderr
    assert leftovers(out) == [] and _files(out) == _files(tmp_path / "reference")
    assert verify(out).ok
    ds = open_dataset(out, fields=("caption", "score"))
    assert ds.field("caption") == expected(rows, "caption")
    assert [None if v is None else round(v, 4) for v in ds.field("score")] == [
        None if r.get("score") is None else round(float(np.float32(r["score"])), 4) for r in rows
    ]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_parts_of_a_single_file_format_merge_with_their_fields(fmt: str, tmp_path: Path) -> None:
    """``lmdb`` and ``hdf5`` parts are merged by streaming their records into one file: the
    fields come along, the merged output the bytes of one conversion of the whole."""
    from imgpack import merge

    rows = coco_like(tmp_path, count=7)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    whole = convert(src, tmp_path / "whole", fmt, progress=False)
    parts = []
    for part in range(3):
        out = tmp_path / f"part{part}"
        convert(src, out, fmt, num_parts=3, part=part, progress=False)
        parts.append(out)
    merged = merge(parts, tmp_path / "merged", progress=False)
    assert merged.fields == whole.fields and merged.output_id == whole.output_id
    ds = open_dataset(tmp_path / "merged", fields=("caption", "tags"), verify=True)
    assert ds.field("caption") == expected(rows, "caption")
    assert [ds[i][3].tolist() for i in range(7)] == expected(rows, "tags")


def hf_with_columns(root: Path, count: int = 6) -> tuple[Path, dict[str, list[Any]]]:
    """A saved Hugging Face dataset with an image, a ClassLabel and other columns: a nullable
    caption, a float score, an int list, a dict and a bool."""
    import io

    import datasets

    rng = np.random.default_rng(11)
    images = []
    for i in range(count):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, size=(8, 8 + i, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, "PNG")
        images.append({"bytes": buffer.getvalue(), "path": f"{i}.png"})
    columns: dict[str, list[Any]] = {
        "caption": [None if i == 2 else f"caption {i}" for i in range(count)],
        "score": [float(np.float32(i / 3)) for i in range(count)],
        "ids": [[i, i * 2, -i] for i in range(count)],
        "meta": [{"w": 8 + i, "src": f"s{i}"} for i in range(count)],
        "flag": [bool(i % 2) for i in range(count)],
    }
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["a", "b", "c"]),
            "caption": datasets.Value("string"),
            "score": datasets.Value("float32"),
            "ids": datasets.List(datasets.Value("int64")),
            "meta": {"w": datasets.Value("int32"), "src": datasets.Value("string")},
            "flag": datasets.Value("bool"),
        }
    )
    rows = {"image": images, "label": [i % 3 for i in range(count)], **columns}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(root))
    return root, columns


def test_hugging_face_columns_are_fields_and_back(tmp_path: Path) -> None:
    """A Hugging Face dataset's other columns are fields typed from their features (a null
    makes one optional); ``to_hf`` makes them columns again (JSON as its text)."""
    from imgpack import to_hf

    src, columns = hf_with_columns(tmp_path / "hf")
    manifest = convert(src, tmp_path / "out", "pt", progress=False)
    assert [f.spec for f in manifest.fields] == [
        "caption:str?", "score:float", "ids:int[]", "meta:json", "flag:json",
    ]  # fmt: skip
    names = tuple(columns)
    ds = open_dataset(tmp_path / "out", fields=names)
    for i in range(len(ds)):
        values = [plain(v) for v in ds[i][2:]]
        assert values == [columns[name][i] for name in names]
    back = to_hf(tmp_path / "out", cache_dir=str(tmp_path / "cache"))
    assert back["caption"] == columns["caption"] and back["ids"] == columns["ids"]
    assert [json.loads(m) for m in back["meta"]] == columns["meta"]
    assert back.features["score"].dtype == "float32"


def test_a_hugging_face_column_no_field_holds_is_refused(tmp_path: Path) -> None:
    """A second image column is no field type: refused in one line that says ``--fields``
    leaves it out; with it, the conversion goes on."""
    import datasets

    src, _ = hf_with_columns(tmp_path / "hf", count=3)
    loaded = datasets.load_from_disk(str(src))
    mask = loaded.cast_column("image", datasets.Image(decode=False))["image"]
    loaded.add_column("mask", mask, feature=datasets.Image()).save_to_disk(str(tmp_path / "hf2"))
    with pytest.raises(ScanError, match=r"column 'mask' cannot be kept as a field.*--fields"):
        convert(tmp_path / "hf2", tmp_path / "out", "pt", image_column="image", progress=False)
    manifest = convert(tmp_path / "hf2", tmp_path / "out", "pt", image_column="image",
                       fields=("caption",), progress=False)  # fmt: skip
    assert [f.name for f in manifest.fields] == ["caption"]


def test_device_loader_carries_numeric_fields(tmp_path: Path) -> None:
    """``DeviceLoader(fields=...)`` loads numeric fields beside the labels: every batch is
    ``(images, labels, *fields)``, each value the one of its image (checked against the
    reader); a field that is not a number every sample has is refused in one line."""
    from imgpack.loading import DeviceLoader

    rows = coco_like(tmp_path, count=10)
    for i, row in enumerate(rows):
        row["n"] = i * 11
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    convert(src, tmp_path / "out", "pt", encoding="raw", size=8, progress=False)
    loader = DeviceLoader(tmp_path / "out", device="cpu", batch_size=4, fields=("score", "n"),
                          progress=False)  # fmt: skip
    reader = open_dataset(tmp_path / "out")
    seen = 0
    for images, labels, scores, ns in loader:
        assert scores.dtype == torch.float32 and ns.dtype == torch.int64
        for image, label, score, n in zip(images, labels, scores, ns, strict=True):
            index = int(n) // 11
            assert torch.equal(image, reader[index][0]) and int(label) == reader[index][1]
            assert float(score) == rows[index]["score"]
            seen += 1
    assert seen == 10
    with pytest.raises(OptionError, match=r"field 'caption' is caption:str\?.*numeric"):
        DeviceLoader(tmp_path / "out", device="cpu", fields=("caption",), progress=False)


def test_foreign_tfrecord_features_are_fields(tmp_path: Path) -> None:
    """TFRecord files another tool wrote, with features beyond the image's (object-detection
    boxes and class texts, a source id, a count): each is a field, named from its key, typed
    from its values, read by ``TFRecordDataset`` and carried by a conversion."""
    import io

    from imgpack.formats.tfrecord import example, framing
    from imgpack.readers import TFRecordDataset

    records, boxes = [], []
    for i in range(6):
        buffer = io.BytesIO()
        Image.fromarray(np.full((8, 9, 3), i * 30, np.uint8)).save(buffer, "JPEG")
        xmin = [float(np.float32(0.1 * k)) for k in range(i % 4)]
        boxes.append(xmin)
        features: dict[str, Any] = {
            "image/encoded": [buffer.getvalue()],
            "image/format": [b"JPEG"],
            "image/class/label": [i % 2],
            "image/object/bbox/xmin": xmin,
            "image/object/class/text": [b"cat"] * (i % 3),
            "image/source_id": [f"id-{i}".encode()],
        }
        if i % 2:
            features["image/object/count"] = [i]
        records.append(example.encode_example(features))
    path = tmp_path / "detection.tfrecord"
    path.write_bytes(b"".join(framing.frame(r) for r in records))
    ds = TFRecordDataset(str(path))
    assert [f.spec for f in ds.manifest.fields] == [
        "image_object_bbox_xmin:float[]", "image_object_class_text:json",
        "image_object_count:int?", "image_source_id:str",
    ]  # fmt: skip
    assert [t.tolist() for t in ds.field("image_object_bbox_xmin")] == boxes
    assert ds.field("image_object_class_text") == [["cat"] * (i % 3) for i in range(6)]
    manifest = convert(path, tmp_path / "out", "hdf5", progress=False)
    assert manifest.fields == ds.manifest.fields
    out = open_dataset(tmp_path / "out", fields=("image_source_id", "image_object_count"))
    assert [tuple(out[i][2:]) for i in range(6)] == [
        (f"id-{i}", i if i % 2 else None) for i in range(6)
    ]


DATA = Path(__file__).parent / "data"


def test_tensorflow_written_features_are_read_as_tensorflow_reads_them(tmp_path: Path) -> None:
    """Records TensorFlow wrote with features beyond the image's (``tests/data``: boxes, class
    texts, a source id, a count on some records): each field holds what
    ``tf.io.parse_single_example`` read, and a conversion carries them."""
    from imgpack.readers import TFRecordDataset

    expected = json.loads((DATA / "tensorflow-written-fields.tf.json").read_text())
    ds = TFRecordDataset(str(DATA / "tensorflow-written-fields.tfrecord"))
    names = {
        "image/source_id": "image_source_id",
        "image/object/bbox/xmin": "image_object_bbox_xmin",
        "image/object/class/text": "image_object_class_text",
        "image/object/count": "image_object_count",
    }
    for key, name in names.items():
        assert [plain(v) for v in ds.field(name)] == [row[key] for row in expected], key
    convert(DATA / "tensorflow-written-fields.tfrecord", tmp_path / "out", "pt", progress=False)
    out = open_dataset(tmp_path / "out", fields=tuple(names.values()))
    for i, row in enumerate(expected):
        assert [plain(v) for v in out[i][2:]] == [row[key] for key in names]


def test_tensorflow_reads_imgpacks_field_features(tmp_path: Path) -> None:
    """``tests/data/imgpack-written-fields.tfrecord`` (an imgpack output's shard with a field
    of every type) is what ``tf.io.parse_single_example`` read into
    ``imgpack-written-fields.tf.json``; imgpack today writes the same features for the same
    values (the output id aside), and reads them back as TensorFlow did."""
    from imgpack.formats.tfrecord import framing
    from imgpack.formats.tfrecord.example import OUTPUT_ID_KEY, decode_example

    read_by_tf = json.loads((DATA / "imgpack-written-fields.tf.json").read_text())
    manifest = json.loads((DATA / "imgpack-written-fields.json").read_text())
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(4):  # the same images and rows as the reference was made from
        Image.fromarray(np.full((4, 4, 3), i * 50, np.uint8)).save(tmp_path / "img" / f"{i}.png")
        row = {"path": f"img/{i}.png", "label": i % 2, "caption": f"caption {i} ✓",
               "score": i / 4, "count": i * 1000, "tags": list(range(i)),
               "boxes": [0.5 * k for k in range(i)], "meta": {"k": i, "v": [i, "x"]},
               "blob": f"bytes {i}"}  # fmt: skip
        if i % 2:
            row["note"] = f"note {i}"
        rows.append(row)
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    types = ("blob:bytes", "boxes:float[]", "tags:int[]")
    made = convert(src, tmp_path / "out", "tfrecord", field_types=types, progress=False)
    assert made.to_json()["fields"] == manifest["fields"]

    def records(path: Path) -> list[dict[str, Any]]:
        with framing.open_records(path) as fh:
            found = [decode_example(data) for _, data in framing.iter_frames(fh, str(path), True)]
        return [{k: v for k, v in f.items() if k != OUTPUT_ID_KEY} for f in found]

    assert records(tmp_path / "out" / "data-00000-of-00001.tfrecord") == records(
        DATA / "imgpack-written-fields.tfrecord"
    )
    ds = open_dataset(tmp_path / "out", fields=tuple(read_by_tf[0]))
    for i, row in enumerate(read_by_tf):
        values = dict(zip(row, (plain(v) for v in ds[i][2:]), strict=True))
        values["blob"] = values["blob"].decode("utf-8")
        assert values == row


@pytest.mark.parametrize(
    ("save", "resume"),
    [((2, 1), (0, 1)), ((0, 1), (2, 1)), ((2, 2), (2, 1)), ((1, 2), (2, 2)), ((2, 1), (0, 2))],
)
def test_a_loader_with_fields_resumes_exactly_on_other_workers_and_ranks(
    save: tuple[int, int], resume: tuple[int, int], tmp_path: Path
) -> None:
    """``Loader`` over an output with fields, ``fields=`` read with each batch: stopped after
    two batches a rank on ``save`` (workers, ranks) and resumed on ``resume``, every sample's
    caption is seen once in the epoch across the ranks, each with its own image's label."""
    from imgpack.loading import Loader, ShardSampler

    rows = coco_like(tmp_path, count=24)
    for i, row in enumerate(rows):
        row["caption"] = f"caption {i}"
    src = write_jsonl(tmp_path / "list.jsonl", rows)
    convert(src, tmp_path / "out", "pt", shard_size="2KB", progress=False)
    ds = open_dataset(tmp_path / "out", fields=("caption",))

    def loaders(workers: int, ranks: int) -> list[Loader]:
        return [
            Loader(
                ds,
                batch_size=2,
                sampler=ShardSampler(ds, seed=3, window=2, num_replicas=ranks, rank=rank),
                num_workers=workers,
                collate_fn=collate,
            )
            for rank in range(ranks)
        ]

    seen: list[tuple[str, int]] = []
    first = loaders(*save)
    for loader in first:  # each rank stops after two batches
        for step, (_, labels, captions) in enumerate(loader):
            seen += list(zip(captions, labels.tolist(), strict=True))
            if step == 1:
                break
    state = first[0].state_dict()
    for loader in loaders(*resume):
        loader.load_state_dict(state)
        for _, labels, captions in loader:
            seen += list(zip(captions, labels.tolist(), strict=True))
    label_of = {row["caption"]: ds.class_to_idx[row["label"]] for row in rows}
    assert sorted(seen) == sorted(label_of.items())
