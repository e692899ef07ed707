"""What is particular to the lmdb format (the shared round-trip, determinism and reader tests
cover it too, parametrized over every format)."""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from conftest import build_uniform_folder, refresh_manifest

from imgpack import convert, open_dataset
from imgpack.errors import DataError, ManifestError
from imgpack.manifest import read_manifest, write_manifest
from imgpack.readers import LMDBDataset


def test_map_grows_past_the_starting_size(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=120, size=32)
    record_bytes = 120 * (24 + 32 * 32 * 3)  # ~370 KB of records
    manifest = convert(
        src, tmp_path / "out", "lmdb", encoding="raw", size=32, map_size="64KiB", progress=False
    )
    assert manifest.options["map_size"] == 64 * 1024 < record_bytes
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 120
    one = convert(src, tmp_path / "ref", "pt", encoding="raw", size=32, progress=False)
    ref = open_dataset(tmp_path / "ref")
    batch, expected = ds.__getitems__(range(120)), ref.__getitems__(range(120))
    assert batch.images.equal(expected.images) and batch.labels.equal(expected.labels)  # type: ignore[union-attr]
    # data.mdb holds no map-sized or otherwise large unused tail.
    data_mdb = (tmp_path / "out" / "data.mdb").stat().st_size
    assert data_mdb < 1.5 * record_bytes and one.num_samples == 120


def test_compaction_when_pages_are_wasted(
    uniform_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import imgpack.formats.lmdb.writer as writer

    convert(uniform_folder, tmp_path / "plain", "lmdb", encoding="raw", size=16, progress=False)
    monkeypatch.setattr(writer, "COMPACT_ABOVE", -1.0)  # always compact
    convert(uniform_folder, tmp_path / "compact", "lmdb", encoding="raw", size=16, progress=False)
    assert not (tmp_path / "compact" / ".compact").exists()
    a, b = open_dataset(tmp_path / "plain"), open_dataset(tmp_path / "compact")
    batch_a, batch_b = a.__getitems__(range(60)), b.__getitems__(range(60))
    assert batch_a.images.equal(batch_b.images)  # type: ignore[union-attr]


def test_plain_py_lmdb_read_as_in_the_docs(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "lmdb", encoding="raw", size=16, progress=False)
    ds = open_dataset(tmp_path / "out")
    # -- as docs/formats/lmdb.md shows --
    env = lmdb.open(str(tmp_path / "out"), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(b"%010d" % 7)
    magic, version, kind, channels, _, label, height, width, path_length = struct.unpack_from(
        "<4sBBBBqIII", value
    )
    path = value[32 : 32 + path_length].decode("utf-8")
    pixels = np.frombuffer(value, np.uint8, offset=32 + path_length).reshape(
        height, width, channels
    )
    env.close()
    # --
    assert (magic, version, kind) == (b"IMGP", 2, 0)
    image, target = ds[7]
    assert label == target
    assert ds.samples[7] == (str(uniform_folder.resolve() / path), target)
    assert np.array_equal(pixels, image.permute(1, 2, 0).numpy())


def _rewrite(root: Path, key: bytes, offset: int = 0, change: bytes | None = None) -> None:
    env = lmdb.open(str(root), map_size=1 << 24)
    with env.begin(write=True) as txn:
        if change is None:
            txn.delete(key)
        else:
            value = bytearray(txn.get(key))
            value[offset : offset + len(change)] = change
            txn.put(key, bytes(value))
    env.close()
    refresh_manifest(root)


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_unknown_record_version_is_refused(
    encoding: str, uniform_folder: Path, tmp_path: Path
) -> None:
    convert(uniform_folder, tmp_path / "out", "lmdb", encoding=encoding, size=16, progress=False)
    _rewrite(tmp_path / "out", b"0000000003", 4, b"\x04")
    _rewrite(tmp_path / "out", b"0000000005", 4, b"\x03")  # a record with fields, here
    ds = open_dataset(tmp_path / "out")
    assert ds[2][0].shape == (3, 16, 16)
    with pytest.raises(
        DataError, match=r"out: record 0000000003: record version 4 is not supported"
    ):
        ds.__getitems__([2, 3])
    with pytest.raises(DataError, match=r"out: record 0000000005: .*fields"):
        ds.__getitems__([5])


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_version_1_records_still_read(encoding: str, uniform_folder: Path, tmp_path: Path) -> None:
    """Outputs of imgpack 0.1 (24-byte headers, no source path) read as before."""
    for name in ("out", "new"):
        convert(uniform_folder, tmp_path / name, "lmdb", encoding=encoding, size=16, progress=False)
    expected = [open_dataset(tmp_path / "new")[i] for i in range(60)]
    env = lmdb.open(str(tmp_path / "out"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.delete(b"__imgpack__")  # 0.1 wrote no output id
        for key, value in list(txn.cursor()):
            (path_length,) = struct.unpack_from("<I", value, 24)
            old = bytearray(value[:24]) + value[32 + path_length :]
            old[4] = 1
            txn.put(key, bytes(old))
    env.close()
    manifest = read_manifest(tmp_path / "out")
    manifest.output_id = ""
    write_manifest(tmp_path / "out", manifest)
    refresh_manifest(tmp_path / "out")
    ds = open_dataset(tmp_path / "out")
    batch = ds.__getitems__(list(range(60)))
    for i, (image, label) in enumerate(expected):
        assert torch.equal(batch[i][0], image) and batch[i][1] == label
    assert ds.targets == [label for _, label in expected]
    with pytest.raises(ManifestError, match="stores no source paths"):
        _ = ds.samples


@pytest.mark.parametrize(
    ("offset", "change", "match"),
    [
        (0, b"XXXX", "not an imgpack record"),
        (8, b"\x63", "label 99 out of range"),
        (16, b"\x07", "raw payload is 768 bytes, expected 7x16x3"),
    ],
)
def test_damaged_raw_record_is_named(
    offset: int, change: bytes, match: str, uniform_folder: Path, tmp_path: Path
) -> None:
    convert(uniform_folder, tmp_path / "out", "lmdb", encoding="raw", size=16, progress=False)
    _rewrite(tmp_path / "out", b"0000000009", offset, change)
    ds = open_dataset(tmp_path / "out")
    with pytest.raises(DataError, match=f"out: record 0000000009: {match}"):
        ds.__getitems__([0, 9, 1])


def test_missing_record_names_environment_and_key(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "lmdb", encoding="raw", size=16, progress=False)
    _rewrite(tmp_path / "out", b"0000000005")
    ds = open_dataset(tmp_path / "out")
    with pytest.raises(DataError, match=r"out: holds 59 records, the manifest says 60"):
        ds.__getitems__([1, 5, 2])


def test_not_an_lmdb_output(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "pt", progress=False)
    with pytest.raises(ManifestError, match="holds format 'pt', not 'lmdb'"):
        LMDBDataset(tmp_path / "out")


def test_two_readers_of_one_output_in_one_process(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "lmdb", encoding="raw", size=16, progress=False)
    a, b = open_dataset(tmp_path / "out"), open_dataset(tmp_path / "out")
    assert a[0][0].equal(b[0][0])


def test_shard_size_does_not_apply(uniform_folder: Path, tmp_path: Path) -> None:
    from imgpack.errors import OptionError

    with pytest.raises(OptionError, match="--shard-size does not apply"):
        convert(uniform_folder, tmp_path / "out", "lmdb", shard_size="1MB", progress=False)


def test_a_reader_going_away_leaves_the_others_working(
    uniform_folder: Path, tmp_path: Path
) -> None:
    import gc

    convert(uniform_folder, tmp_path / "out", "lmdb", encoding="raw", size=16, progress=False)
    keep = open_dataset(tmp_path / "out")
    first = keep[0][0]
    gone = open_dataset(tmp_path / "out")
    gone[1]
    del gone
    gc.collect()
    assert keep[0][0].equal(first)


def test_bad_map_size_names_the_option(uniform_folder: Path, tmp_path: Path) -> None:
    from imgpack.errors import OptionError

    with pytest.raises(OptionError, match="invalid map_size 'abc'"):
        convert(uniform_folder, tmp_path / "out", "lmdb", map_size="abc", progress=False)
    assert not (tmp_path / "out").exists()


def test_raw_reads_from_the_map_table_equal_reads_by_get(tmp_path: Path) -> None:
    """After 1/12 of the records read by ``get``, raw batches come from the table of where
    records lie in the map: the same pixels and labels in any order, small (inline) and large
    (over a page) records alike; a header is checked the first time (a header that does not
    check out sends the batch back to ``get``), then its label is remembered."""
    for size in (6, 40):  # 108-byte values in leaf pages; 4.8 KB values on overflow pages
        src = build_uniform_folder(tmp_path / f"src{size}", count=90, classes=4, size=size)
        out = tmp_path / f"raw{size}"
        convert(src, out, "lmdb", encoding="raw", size=size, progress=False)
        expected = open_dataset(out).__getitems__(list(range(90)))  # by get
        ds = open_dataset(out)
        assert isinstance(ds, LMDBDataset)
        order = np.random.default_rng(size).permutation(90)
        for _ in range(2):
            for start in range(0, 90, 16):
                indices = order[start : start + 16].tolist()
                batch = ds.__getitems__(indices)
                assert torch.equal(batch.images, expected.images[indices])  # type: ignore[call-overload]
                assert torch.equal(batch.labels, expected.labels[indices])
        spans = ds._learned.spans
        assert spans is not None and spans.env is ds.handles
        assert spans.checked.all()  # every header checked once: later batches gather pixels
        damaged = spans.tensor.clone()
        damaged[int(spans.starts[5]) + 8] = 99  # record 5's label byte: out of range
        spans.tensor = damaged
        spans.checked[:] = False  # as a record not read yet
        assert ds._from_map(spans, np.array([4, 5])) is None
        assert ds._from_map(spans, np.array([4, 6])) is not None
        assert torch.equal(ds.__getitems__([5]).images, expected.images[[5]])  # type: ignore[call-overload]


def test_raw_checksums_are_checked_from_the_map_on_first_reads(tmp_path: Path) -> None:
    """Once the map of record positions exists, a raw record read for the first time is checked
    from it (its pixels, label and stored CRC gathered with the batch's): a damaged one is a
    DataError naming it, the others read as by ``get``."""
    src = build_uniform_folder(tmp_path / "src", count=90, classes=4, size=6)
    out = tmp_path / "raw"
    convert(src, out, "lmdb", encoding="raw", size=6, progress=False)
    expected = open_dataset(out).__getitems__(list(range(90)))  # by get
    ds = open_dataset(out)
    assert isinstance(ds, LMDBDataset)
    ds.__getitems__(list(range(8)))  # 8 >= 90 // SLOW_SHARE records read by get
    first = ds.__getitems__([8, 9])  # the map is built here
    assert ds._learned.spans is not None and torch.equal(first.images, expected.images[[8, 9]])  # type: ignore[call-overload]
    rows = ds._raw_rows(np.arange(10, 90))
    assert rows is not None and len(rows[0]) == 80
    spans = ds._learned.spans
    damaged = spans.tensor.clone()
    damaged[int(spans.starts[50] + spans.lengths[50]) - 1] ^= 1  # record 50's last pixel byte
    spans.tensor = damaged
    with pytest.raises(DataError, match="sample 50: checksum mismatch"):
        ds.__getitems__([49, 50])
    batch = ds.__getitems__(list(range(60, 90)))
    assert torch.equal(batch.images, expected.images[60:90])


def test_the_record_table_is_the_files_own_mapping_and_checked_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of record offsets maps data.mdb itself (no view of LMDB's memory), and is used
    only when every record's bytes at its offset are LMDB's value: offsets that do not check
    out (here: no place tried for the first value) leave the reader on ``get``, reading the
    same."""
    import imgpack.formats.lmdb.reader as lmdb_reader

    src = build_uniform_folder(tmp_path / "src", count=90, classes=4, size=6)
    out = tmp_path / "raw"
    convert(src, out, "lmdb", encoding="raw", size=6, progress=False, workers=1)
    expected = open_dataset(out).__getitems__(list(range(90)))
    ds = open_dataset(out)
    assert isinstance(ds, LMDBDataset)
    ds.__getitems__(list(range(8)))
    ds.__getitems__([8, 9])
    spans = ds._learned.spans
    assert spans is not None
    data = (out / "data.mdb").read_bytes()
    for index in (0, 41, 89):  # each record's bytes sit at its offset in the file itself
        start, length = int(spans.starts[index]), int(spans.lengths[index])
        with ds.handles.begin() as txn:
            assert data[start : start + length] == txn.get(b"%010d" % index)
    spans.starts[41] += 1
    assert not spans._agrees(ds.handles, 90)
    monkeypatch.setattr(lmdb_reader, "ANCHOR_TRIES", 0)
    fresh = open_dataset(out)
    assert isinstance(fresh, LMDBDataset)
    for start in range(0, 90, 10):
        got = fresh.__getitems__(list(range(start, start + 10)))
        assert torch.equal(got.images, expected.images[start : start + 10])  # type: ignore[call-overload]
    assert fresh._learned.spans is None


def _point_past_the_end(data: Path, field: int) -> None:
    """Set a field of both meta pages (64-bit layout: 128 the main tree's root, 136 the last
    page used) to a page past the file's end; its size and everything else unchanged."""
    blob = bytearray(data.read_bytes())
    pages = len(blob) // 4096
    for meta in (0, 4096):
        blob[meta + field : meta + field + 8] = (pages + 100).to_bytes(8, "little")
    data.write_bytes(bytes(blob))


@pytest.mark.parametrize("field", [128, 136])
def test_a_meta_page_pointing_past_the_end_is_refused_not_a_crash(
    tmp_path: Path, field: int
) -> None:
    """LMDB follows the file's own page numbers: a damaged meta page that points past the end
    of ``data.mdb`` (the size the manifest records unchanged) was a SIGBUS that killed the
    reader, ``imgpack verify`` and ``imgpack merge``. It is refused in one line naming the
    file; verify reports it."""
    import subprocess
    import sys

    src = build_uniform_folder(tmp_path / "src", count=12)
    out = tmp_path / "out"
    convert(src, out, "lmdb", progress=False)
    _point_past_the_end(out / "data.mdb", field)
    with pytest.raises(DataError, match=r"data\.mdb: its meta page points past the file's end"):
        open_dataset(out)[0]
    done = subprocess.run(
        [sys.executable, "-m", "imgpack", "verify", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stderr  # a report, not a signal
    assert "data.mdb" in done.stdout and "Traceback" not in done.stdout + done.stderr
