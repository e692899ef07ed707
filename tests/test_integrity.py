"""Damage to an output is detected: record checksums, checked opens, imgpack verify; and a source
folder that cannot be listed is never silently left out."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder

from imgpack import convert, open_dataset, verify
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import DataError, ManifestError, ScanError
from imgpack.formats.tfrecord import framing


def _flip_inside_a_record(out: Path, source: bytes) -> Path:
    """Flip one byte of ``source``'s stored copy (an ``original`` output keeps its bytes)."""
    probe = source[len(source) // 2 : len(source) // 2 + 32]
    for path in sorted(out.iterdir()):
        blob = bytearray(path.read_bytes())
        at = blob.find(probe)
        if at >= 0:
            blob[at + 5] ^= 0x01
            path.write_bytes(bytes(blob))
            return path
    raise AssertionError("the stored bytes were not found")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_flipped_byte_is_caught_and_named(fmt: str, uniform_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(uniform_folder, out, fmt, encoding="original", progress=False)
    ds = open_dataset(out)
    source_path, _ = ds.samples[7]
    damaged = _flip_inside_a_record(out, Path(source_path).read_bytes())
    ds = open_dataset(out, verify=True)
    assert ds[6][0].shape == (3, 16, 16)
    named = "out: record 0000000007" if fmt == "lmdb" else damaged.name  # LMDB: env and key
    with pytest.raises(DataError, match=rf"{named}.*(checksum|CRC) mismatch"):
        ds.__getitems__([6, 7])
    report = verify(out)
    assert not report.ok
    lines = [p.line() for p in report.problems]
    assert any(damaged.name in line and "sha256 differs" in line for line in lines)
    if fmt != "tfrecord":  # TFRecord errors name the byte offset of the record instead
        assert any("sample 7" in line and Path(source_path).name in line for line in lines)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("verify_reads", [None, True])
def test_a_damaged_raw_record_is_caught_at_its_first_read(
    fmt: str, verify_reads: bool | None, uniform_folder: Path, tmp_path: Path
) -> None:
    """A raw batch is checked where it is gathered (pt, hdf5: the batch's own bytes, all at once)
    or from its records (the others): a byte flipped in one record's pixels fails the first
    batch that holds it, named, whatever else the batch holds; the other records read."""
    out = tmp_path / "out"
    convert(uniform_folder, out, fmt, encoding="raw", size=16, progress=False)
    pixels = open_dataset(out)[7][0].permute(1, 2, 0).contiguous().numpy().tobytes()
    _flip_inside_a_record(out, pixels)
    ds = open_dataset(out, verify=verify_reads)
    good = ds.__getitems__([6, 8, 9])  # checked: fine
    assert len(good) == 3
    named = r"sample 7 .*(checksum|CRC) mismatch|CRC mismatch.*\(sample 7\)"
    with pytest.raises(DataError, match=named):  # the damaged record, named
        ds.__getitems__([6, 7, 8])
    with pytest.raises(DataError, match=r"(checksum|CRC) mismatch"):
        ds[7]
    assert len(ds.__getitems__([9, 6])) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_record_never_read_is_checked_however_often_the_others_were(
    fmt: str, uniform_folder: Path, tmp_path: Path
) -> None:
    """Raw records are checked the first time each is read; a reader that has read every other
    record several times over (more reads than records: its marks are then scanned whole, in
    the training process and in each DataLoader worker) still checks the one it never read."""
    from torch.utils.data import DataLoader

    from imgpack.readers import collate

    out = tmp_path / "out"
    convert(uniform_folder, out, fmt, encoding="raw", size=16, progress=False)
    pixels = open_dataset(out)[7][0].permute(1, 2, 0).contiguous().numpy().tobytes()
    _flip_inside_a_record(out, pixels)
    ds = open_dataset(out)
    others = [i for i in range(len(ds)) if i != 7]
    for _ in range(3):
        for start in range(0, len(others), 4):
            ds.__getitems__(others[start : start + 4])
    named = r"sample 7 .*(checksum|CRC) mismatch|CRC mismatch.*\(sample 7\)"
    with pytest.raises(DataError, match=named):
        ds.__getitems__([0, 7])
    fresh = open_dataset(out)
    loader = DataLoader(fresh, batch_size=4, sampler=others * 3 + [7], num_workers=2,
                        collate_fn=collate)  # fmt: skip
    with pytest.raises(DataError, match=r"(checksum|CRC) mismatch"):
        for _ in loader:
            pass


def test_records_intact_agrees_with_each_records_checksum() -> None:
    """The batch check (one CRC of the records' payloads against their checksums combined)
    says intact exactly when every record's own checksum matches: groups of any size, several
    groups, a flipped bit anywhere, a changed label or checksum; and the same for plain CRCs
    of rows (crcs_intact: TFRecord's data CRCs)."""
    from imgpack.checksum import GROUP, crc32c, crcs_intact, record_crcs, records_intact

    rng = np.random.default_rng(3)
    for count, width in [(1, 0), (1, 1), (3, 7), (GROUP, 48), (2 * GROUP + 5, 16)]:
        rows = rng.integers(0, 256, (count, width), dtype=np.uint8)
        labels = rng.integers(-(2**62), 2**62, count)
        crcs = np.array(record_crcs(rows, labels.tolist()), np.int64)
        assert records_intact(rows, labels, crcs)
        for _ in range(20):
            k = int(rng.integers(count))
            bad_rows, bad_labels, bad_crcs = rows.copy(), labels.copy(), crcs.copy()
            what = int(rng.integers(3 if width else 2))
            if what == 0:
                bad_labels[k] ^= 1 << int(rng.integers(63))
            elif what == 1:
                bad_crcs[k] ^= 1 << int(rng.integers(32))
            else:
                bad_rows[k, int(rng.integers(width))] ^= 1 << int(rng.integers(8))
            assert not records_intact(bad_rows, bad_labels, bad_crcs)
        assert not records_intact(rows, labels, crcs + (1 << 32))  # not a CRC-32C at all
        plain = np.array([crc32c(row.tobytes()) for row in rows], np.int64)  # no label
        assert crcs_intact(rows, plain)
        if width:
            bad_rows = rows.copy()
            bad_rows[count // 3, width - 1] ^= 0x80
            assert not crcs_intact(bad_rows, plain)


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_command(fmt: str, uniform_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(uniform_folder, out, fmt, encoding="raw", size=16, progress=False)
    runner = CliRunner()
    result = runner.invoke(
        main, ["verify", str(out), "--deep", "-q", "--json", str(tmp_path / "r.json")]
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"{out}: intact: ")
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    first = out / open_dataset(out).manifest.files[0].path
    blob = bytearray(first.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    first.write_bytes(bytes(blob))
    result = runner.invoke(main, ["verify", str(out), "-q"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith(f"{out}: DAMAGED")
    assert any(first.name in line for line in lines[:-1])


def test_verify_names_missing_and_short_files(uniform_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(uniform_folder, out, "pt", encoding="raw", size=16, shard_size=3000, progress=False)
    shards = sorted(out.glob("shard-*.pt"))
    shards[0].unlink()
    shards[1].write_bytes(shards[1].read_bytes()[:100])
    lines = [p.line() for p in verify(out).problems]
    assert any(shards[0].name in line and "missing" in line for line in lines)
    assert any(shards[1].name in line and "100 bytes, the manifest says" in line for line in lines)
    with pytest.raises(DataError, match="missing"):
        open_dataset(out)


def _edit_manifest(out: Path, **changes: object) -> None:
    path = out / "imgpack.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("file0_"):
            data["files"][0][key[6:]] = value
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        # the statistics' own count disagrees first; without stats the files' count does
        ({"num_samples": 59}, "stats count 60 samples, the output has 59"),
        ({"num_samples": 59, "stats": None}, "the files hold 60 samples, the manifest says 59"),
        ({"num_samples": 60.5}, "num_samples is 60.5, expected an integer"),
        ({"num_samples": True}, "num_samples is True"),
        ({"file0_num_samples": -1}, "files.num_samples is -1"),
        ({"file0_bytes": 10}, "10 bytes|the manifest says 10"),
        ({"file0_path": "../elsewhere.pt"}, "not a plain name inside the output"),
        ({"classes": ["a", "a", "b"]}, "classes lists a name twice"),
    ],
)
def test_edited_manifests_are_refused(
    changes: dict[str, object], match: str, uniform_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(uniform_folder, out, "pt", encoding="raw", size=16, progress=False)
    _edit_manifest(out, **changes)
    with pytest.raises((ManifestError, DataError), match=match):
        open_dataset(out)
    assert not verify(out).ok


def test_damaged_tfrecord_index_is_refused(uniform_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(uniform_folder, out, "tfrecord", encoding="png", progress=False)
    index = next(out.glob("*.idx"))
    original = index.read_text()
    index.write_bytes(b"\xff\xfe" + original.encode())
    with pytest.raises(DataError, match=r"\.idx: unreadable index"):
        open_dataset(out)
    lines = original.splitlines()
    lines[3], lines[4] = lines[4], lines[3]  # a stale order
    index.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 4: record at \d+ .* does not match the framing"):
        open_dataset(out)
    index.write_text("\n".join(original.splitlines()[:-1]) + "\n")  # one record short
    with pytest.raises(DataError, match="its records end at byte"):
        open_dataset(out)


def test_hostile_tfrecord_lengths_do_not_allocate(tmp_path: Path) -> None:
    """A length field of 2**40 with a valid CRC: refused without reading (plain file) or after
    reading only what the stream holds (GZIP), in a child process with 1 GiB of address space."""
    length = struct.pack("<Q", 1 << 40)
    record = length + struct.pack("<I", framing.masked_crc32c(length)) + b"x" * 1000
    (tmp_path / "plain.tfrecord").write_bytes(record)
    (tmp_path / "packed.tfrecord").write_bytes(gzip.compress(record))
    code = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from imgpack.formats.tfrecord import framing
from imgpack.errors import DataError
for name in sys.argv[1:]:
    try:
        with framing.open_records(name) as fh:
            list(framing.iter_frames(fh, name))
    except DataError as exc:
        print("refused:", exc)
"""
    paths = [str(tmp_path / "plain.tfrecord"), str(tmp_path / "packed.tfrecord")]
    done = subprocess.run(
        [sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused:") == 2 and "truncated record" in done.stdout


def test_truncated_lmdb_is_refused_not_a_crash(uniform_folder: Path, tmp_path: Path) -> None:
    """A data.mdb cut short would SIGBUS a reader that maps it; it is refused at open instead."""
    out = tmp_path / "out"
    convert(uniform_folder, out, "lmdb", encoding="raw", size=16, progress=False)
    data = out / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code = (
        "import sys; from imgpack import open_dataset; from imgpack.errors import ImgpackError\n"
        "try:\n    ds = open_dataset(sys.argv[1]); [ds[i] for i in range(len(ds))]\n"
        "except ImgpackError as exc:\n    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "the manifest says" in done.stdout


def _unreadable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make ``folder`` unlistable (tests run as root, whom permissions do not stop)."""
    real = os.scandir

    def scandir(path: object = ".") -> object:
        if isinstance(path, int):  # a descriptor (shutil.rmtree lists folders by them)
            return real(path)
        if Path(os.fsdecode(path)) == folder:  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", os.fsdecode(path))  # type: ignore[arg-type]
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)


def test_an_unreadable_folder_is_never_left_out_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = build_uniform_folder(tmp_path / "src", count=12)
    hidden = src / "class1" / "sub"
    build_uniform_folder(hidden, count=2, classes=1)
    _unreadable(monkeypatch, hidden)
    with pytest.raises(ScanError, match=r"class1/sub/: cannot list folder: Permission denied"):
        convert(src, tmp_path / "out", "pt", workers=1, progress=False)
    assert not (tmp_path / "out").exists()
    manifest = convert(src, tmp_path / "out", "pt", workers=1, on_error="skip", progress=False)
    assert manifest.skipped[0] == {
        "path": "class1/sub/",
        "reason": "cannot list folder: Permission denied",
    }
    assert manifest.num_samples == 12


def test_verify_of_something_that_is_not_an_output(tmp_path: Path) -> None:
    """The wrong folder given is not a damaged output: raised (one line from the CLI), not
    reported as DAMAGED."""
    from imgpack.errors import NotAnOutput

    with pytest.raises(NotAnOutput, match="not an imgpack output"):
        verify(tmp_path)
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "nowhere")])
    assert result.exit_code == 1 and "no such imgpack output" in result.output
    assert "DAMAGED" not in result.output


@pytest.mark.parametrize("fmt", ["tfrecord", "webdataset"])
def test_index_files_are_listed_and_verified(
    fmt: str, uniform_folder: Path, tmp_path: Path
) -> None:
    """The manifest lists each shard's .idx with its size and sha256; verify names a deleted or
    edited one (DALI needs a TFRecord shard's .idx, imgpack's reader a WebDataset shard's)."""
    import hashlib

    out = tmp_path / "out"
    convert(uniform_folder, out, fmt, shard_size=3000, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    assert len(manifest["files"]) > 1
    for entry in manifest["files"]:
        (companion,) = entry["companions"]
        index = out / companion["path"]
        assert index.suffix == ".idx" and Path(entry["path"]).stem == index.stem
        assert companion["bytes"] == index.stat().st_size
        assert companion["sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()
    assert verify(out).ok
    first, second = (out / e["companions"][0]["path"] for e in manifest["files"][:2])
    first.unlink()
    second.write_bytes(second.read_bytes().replace(b" ", b"  ", 1))
    report = verify(out)
    problems = {Path(p.file).name: p.message for p in report.problems}
    assert problems[first.name].startswith("missing")
    assert problems[second.name].endswith(
        "bytes, the manifest says " + str(manifest["files"][1]["companions"][0]["bytes"])
    )


def test_outputs_without_listed_index_files_still_verify(
    uniform_folder: Path, tmp_path: Path
) -> None:
    """imgpack 0.4.0 listed no companions: such an output reads and verifies as before."""
    out = tmp_path / "out"
    convert(uniform_folder, out, "webdataset", shard_size=3000, progress=False)
    manifest = json.loads((out / "imgpack.json").read_text())
    for entry in manifest["files"]:
        del entry["companions"]
    (out / "imgpack.json").write_text(json.dumps(manifest))
    assert verify(out, deep=True).ok
    assert len(open_dataset(out)) == manifest["num_samples"]


def test_only_formats_with_index_files_list_companions(
    uniform_folder: Path, tmp_path: Path
) -> None:
    for fmt in ("pt", "lmdb", "hdf5"):
        convert(uniform_folder, tmp_path / fmt, fmt, progress=False)
        manifest = json.loads((tmp_path / fmt / "imgpack.json").read_text())
        assert all("companions" not in entry for entry in manifest["files"])


def test_record_crcs_match_the_documented_checksum() -> None:
    """The batch checksum (rows checksummed where they are) is the documented one: CRC-32C of
    the payload then the label as int64 LE, what any CRC-32C library computes."""
    import google_crc32c
    import numpy as np

    from imgpack.checksum import record_crcs

    rows = np.random.default_rng(0).integers(0, 256, (9, 40), dtype=np.uint8)
    labels = [0, 1, -1, 7, 2**40, 3, 3, 5, 1]
    expected = [
        google_crc32c.value(row.tobytes() + struct.pack("<q", label))
        for row, label in zip(rows, labels, strict=True)
    ]
    assert record_crcs(rows, labels) == expected  # contiguous rows: no copy each
    assert record_crcs(list(rows), labels) == expected
    assert record_crcs([row.tobytes() for row in rows], labels) == expected
    strided = np.ascontiguousarray(np.concatenate([rows, rows], axis=1))[:, ::2]
    assert record_crcs(strided, labels) == [
        google_crc32c.value(row.tobytes() + struct.pack("<q", label))
        for row, label in zip(strided, labels, strict=True)
    ]


def test_a_shard_is_hashed_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sha256 a writer records is taken from the bytes it writes (large writes hashed in a
    thread beside the write): exactly the finished file's; a pt shard whose data is one large
    write records its file's hash, and verify agrees."""
    import hashlib

    from imgpack.formats import writer_base
    from imgpack.formats.writer_base import PARALLEL_HASH, HashedFile

    rng = np.random.default_rng(0)
    pieces = [b"x", rng.bytes(PARALLEL_HASH + 7), memoryview(rng.bytes(3 * PARALLEL_HASH)), b""]
    shard = HashedFile(tmp_path / "shard")
    for piece in pieces:
        shard.write(piece)
    assert shard.close() == hashlib.sha256((tmp_path / "shard").read_bytes()).hexdigest()

    monkeypatch.setattr(writer_base, "PARALLEL_HASH", 1024)  # every image's data is large here
    folder = build_uniform_folder(tmp_path / "src", 30, 3, size=24)
    manifest = convert(
        folder, tmp_path / "pt", format="pt", workers=1, progress=False, shard_size="8KB"
    )
    assert len(manifest.files) > 1
    for entry in manifest.files:
        assert (
            entry.sha256 == hashlib.sha256((tmp_path / "pt" / entry.path).read_bytes()).hexdigest()
        )
    verify(tmp_path / "pt")


def test_a_shard_reaches_its_file_in_aligned_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard written a few KB at a time (tar members, TFRecord records) reaches the file in
    runs that end on 2 MB boundaries (the kernel then caches it in large folios that a reader's
    memory map takes whole), the rest at a flush or the close; the bytes and the digest are
    the ones written, whatever the sizes of the writes and a flush midway."""
    import hashlib

    from imgpack.formats.writer_base import FOLIO, WRITE_BUFFER, HashedFile

    calls: list[tuple[int, int]] = []  # (offset, bytes) of each system call that wrote
    real = os.writev

    def writev(fd: int, parts: list[memoryview]) -> int:
        written = real(fd, parts)
        calls.append((os.lseek(fd, 0, os.SEEK_CUR) - written, written))
        return written

    monkeypatch.setattr(os, "writev", writev)
    rng = np.random.default_rng(1)
    sizes = [512, 3584, 1024] * 2000 + [3 * WRITE_BUFFER + 5] + [6144] * 1500 + [7]
    pieces = [rng.bytes(int(size)) for size in sizes]
    shard = HashedFile(tmp_path / "shard")
    for k, piece in enumerate(pieces):
        shard.write(piece if k % 2 else memoryview(piece))
        if k == len(pieces) // 3:
            shard.flush()  # a flush writes what is held: the runs after it end aligned again
    digest = shard.close()
    data = (tmp_path / "shard").read_bytes()
    assert data == b"".join(pieces)
    assert digest == hashlib.sha256(data).hexdigest()
    flushed = [k for k, (at, count) in enumerate(calls) if (at + count) % FOLIO]
    assert len(flushed) == 2  # the flush midway and the close
    assert all(count >= FOLIO for at, count in calls[: flushed[0]])
    assert all(count >= FOLIO for at, count in calls[flushed[0] + 1 : flushed[1]])
