"""Honest errors: one line naming the file and what is wrong, decided as early as possible, the
same in every run; and records that say what their stored bytes are."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder, jpeg_bytes
from PIL import Image

from imgpack import convert, formats, open_dataset
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import ScanError, StorageError
from imgpack.formats.tfrecord import example, framing
from imgpack.formats.writer_base import Writer
from imgpack.sources.folder.scan import scan_folder

# -- disk full --------------------------------------------------------------------------

FULL_DISK = """
mount -t tmpfs -o size=256k tmpfs "$1" || exit 99
"$2" -m imgpack.cli convert "$3" "$1/out" --format "$4" --encoding raw --size 64 -q
status=$?
ls -A "$1"
exit $status
"""


def _mount_works(where: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(where)],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def raw_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 60 images of 64x64 RGB stored raw: 720 KiB, more than the 256 KiB disk.
    return build_uniform_folder(tmp_path_factory.mktemp("full") / "src", count=60, size=64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_is_one_line_and_leaves_nothing(
    fmt: str, raw_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if _mount_works(disk):  # a real full filesystem: a 256 KiB tmpfs in a mount namespace
        done = subprocess.run(
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                FULL_DISK,
                "sh",
                str(disk),
                sys.executable,
                str(raw_src),
                fmt,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 1, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"Error: {disk}/out: cannot write the output: ")
        assert line.endswith(
            f"No space left on device; nothing was published and {disk}/out is as it was"
        )
        assert done.stdout.strip() == ""  # the disk holds nothing: no temp dir, no lock
        return

    # Where no filesystem can be mounted: the same error injected into the writer.
    def full(self: Writer, sample: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / "x"))

    writer = formats.get(fmt).writer_class()
    monkeypatch.setattr(writer, "add", full)
    with pytest.raises(StorageError, match="No space left on device; nothing was published"):
        convert(raw_src, disk / "out", fmt, encoding="raw", size=64, progress=False)
    assert list(disk.iterdir()) == []


# -- names that are not UTF-8 -------------------------------------------------------------


def _bad_name_folder(root: Path) -> Path:
    src = build_uniform_folder(root, count=6)
    png = (src / "class0" / "img0000.png").read_bytes()
    with open(os.fsencode(src / "class1") + b"/bad\xff.png", "wb") as fh:
        fh.write(png)
    return src


def test_a_non_utf8_file_name_is_refused_before_any_work(tmp_path: Path) -> None:
    src = _bad_name_folder(tmp_path / "src")
    with pytest.raises(ScanError, match=r"class1/bad\\xff\.png: file name is not valid UTF-8"):
        convert(src, tmp_path / "out", "lmdb", progress=False)
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "out"), "--format", "pt"]
    )
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "bad\\xff.png: file name is not valid UTF-8" in result.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_non_utf8_file_name_is_skipped_and_recorded(fmt: str, tmp_path: Path) -> None:
    src = _bad_name_folder(tmp_path / "src")
    manifest = convert(src, tmp_path / "out", fmt, on_error="skip", progress=False)
    assert manifest.num_samples == 6
    assert manifest.skipped == [
        {
            "path": "class1/bad\\xff.png",
            "reason": "file name is not valid UTF-8; rename it to convert it",
        }
    ]
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 6 and all(path.isprintable() for path, _ in ds.samples)


def test_a_non_utf8_class_name_is_refused(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=4)
    os.rename(src / "class1", os.fsencode(src) + b"/cl\xe9ss")
    with pytest.raises(ScanError, match=r"name\(s\) cl\\xe9ss are not valid UTF-8"):
        scan_folder(src)


# -- deep trees -------------------------------------------------------------------------------

DEPTH = 1100


def test_a_tree_deeper_than_the_recursion_limit_scans(tmp_path: Path) -> None:
    src = tmp_path / "src"
    folder = src / "c"
    folder.mkdir(parents=True)
    for _ in range(DEPTH):  # no os.makedirs: it recurses too
        folder = folder / "d"
        folder.mkdir()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(folder / "deep.png")
    Image.new("RGB", (4, 4), (4, 5, 6)).save(src / "c" / "top.png")
    try:
        scan = scan_folder(src)
        assert [s.path.rsplit("/", 1)[-1] for s in scan.samples] == ["top.png", "deep.png"]
        assert scan.samples[1].path.count("/") == DEPTH + 1
        manifest = convert(src, tmp_path / "out", "pt", workers=1, progress=False)
        assert manifest.num_samples == 2
    finally:
        while folder != src:  # no shutil.rmtree either
            for child in folder.iterdir():
                child.unlink()
            folder.rmdir()
            folder = folder.parent


# -- DataLoader worker errors in bench, tune and profile -----------------------------------


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    convert(build_uniform_folder(tmp_path / "src", count=40), out, "pt", progress=False)
    shard = out / "shard-00000.pt"
    data = bytearray(shard.read_bytes())
    at = data.find(b"IDAT")
    while at >= 0:  # a byte of every image's pixels: whatever a command samples is damaged
        data[at + 8] ^= 0xFF
        at = data.find(b"IDAT", at + 1)
    shard.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--workers", "2", "--samples", "40", "--batch-size", "8"],
        ["tune", "--workers", "2", "--batches", "2", "--batch-size", "8"],
        ["profile", "--workers", "2", "--batches", "3", "--batch-size", "8"],
    ],
)
def test_worker_errors_are_one_line(args: list[str], damaged: Path) -> None:
    from conftest import refresh_manifest

    refresh_manifest(damaged)  # the files match the manifest: only the record is damaged
    result = CliRunner().invoke(main, [args[0], str(damaged), *args[1:]])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "checksum mismatch (damaged record)" in last
    assert "Traceback" not in result.output and "DataLoader worker" not in result.output


# -- deterministic manifests ------------------------------------------------------------------


def test_skip_reasons_and_manifests_are_the_same_in_every_run(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=6)
    (src / "class0" / "broken.gif").write_bytes(b"GIF89a" + bytes(range(200)))  # Pillow names
    # its BytesIO with a memory address in the message it raises for this one
    for name in ("a", "b"):
        convert(src, tmp_path / name, "pt", on_error="skip", progress=False)
    first = (tmp_path / "a" / "imgpack.json").read_bytes()
    assert first == (tmp_path / "b" / "imgpack.json").read_bytes()
    [skip] = json.loads(first)["skipped"]
    assert skip["path"] == "class0/broken.gif" and "0x" not in skip["reason"]


# -- what the stored bytes are ----------------------------------------------------------------


@pytest.fixture
def gray_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    rng = np.random.default_rng(3)
    gray = Image.fromarray(rng.integers(0, 256, (12, 10), dtype=np.uint8), "L")
    (src / "a" / "gray.jpg").write_bytes(jpeg_bytes(gray))
    rgb = Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))
    (src / "a" / "rgb.jpg").write_bytes(jpeg_bytes(rgb))
    return src


def test_a_kept_grayscale_jpeg_is_recorded_as_one_channel(gray_src: Path, tmp_path: Path) -> None:
    convert(gray_src, tmp_path / "lmdb", "lmdb", progress=False)
    env = lmdb.open(str(tmp_path / "lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        channels = [txn.get(b"%010d" % i)[6] for i in range(2)]
    env.close()
    assert channels == [1, 3]  # gray.jpg, rgb.jpg
    convert(gray_src, tmp_path / "tf", "tfrecord", progress=False)
    [shard] = (tmp_path / "tf").glob("*.tfrecord")
    with framing.open_records(shard) as fh:
        records = [example.decode_example(d) for _, d in framing.iter_frames(fh, str(shard))]
    assert [r["image/channels"] for r in records] == [[1], [3]]
    assert [r["image/colorspace"] for r in records] == [[b"Grayscale"], [b"RGB"]]
    gray = np.asarray(Image.open(io.BytesIO((gray_src / "a" / "gray.jpg").read_bytes())))
    for out in ("lmdb", "tf"):
        image, _ = open_dataset(tmp_path / out)[0]  # the output is RGB: gray widened to 3
        assert image.shape == (3, 12, 10)
        assert all(np.array_equal(image[c].numpy(), gray) for c in range(3))
