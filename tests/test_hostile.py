"""Hostile outputs and sources: a file from the internet or another team can start no program,
reach no byte outside its folder, hang no reader and cost no unbounded memory."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import build_uniform_folder, refresh_manifest

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.errors import DataError, ImgpackError, ManifestError
from imgpack.formats.tfrecord import example, framing
from imgpack.readers import TFRecordStream

#: A complete Encapsulated PostScript file: Pillow hands EPS to Ghostscript (`gs`) to decode.
EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"
    b"0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"
)

HOSTILE_READS = r"""
import io, json, sys
from pathlib import Path
from PIL import Image
from imgpack import convert, open_dataset
from imgpack.errors import ImgpackError
from imgpack.readers import TFRecordDataset
pt_out, tf_file, src, marker = sys.argv[1:5]
results = {}
def attempt(name, action):
    try:
        action()
        results[name] = "read"
    except ImgpackError as exc:
        results[name] = f"refused: {exc}"
    results[name + " started gs"] = Path(marker).exists()
attempt("stored record", lambda: open_dataset(pt_out, verify=False)[0])
attempt("foreign tfrecord", lambda: TFRecordDataset(tf_file)[0])
attempt("source file", lambda: convert(src, src + "-out", "pt", workers=1, progress=False))
# The trap works: a plain Pillow decode of the same bytes does run `gs`.
try:
    Image.open(io.BytesIO(Path(src, "c", "eps.jpg").read_bytes())).load()
except Exception:
    pass
results["plain Pillow started gs"] = Path(marker).exists()
print(json.dumps(results))
"""


def test_an_eps_payload_starts_no_process(tmp_path: Path) -> None:
    # A pt output whose first record holds EPS bytes (checksums off: the decoder is the target).
    out = tmp_path / "pt"
    convert(build_uniform_folder(tmp_path / "u", count=4), out, "pt", progress=False)
    shard = torch.load(out / "shard-00000.pt", weights_only=True)
    data = shard["data"].numpy().tobytes()
    offsets = shard["offsets"].tolist()
    shard["data"] = torch.frombuffer(bytearray(EPS + data[offsets[1] :]), dtype=torch.uint8)
    shard["offsets"] = torch.tensor([0, *(o - offsets[1] + len(EPS) for o in offsets[1:])])
    torch.save(shard, out / "shard-00000.pt")
    refresh_manifest(out)
    # A foreign TFRecord file whose image is EPS, and a source folder with an EPS named .jpg.
    tf_file = tmp_path / "foreign.tfrecord"
    features = {"image/encoded": [EPS], "image/class/label": [0]}
    tf_file.write_bytes(framing.frame(example.encode_example(features)))
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    (src / "c" / "eps.jpg").write_bytes(EPS)
    # A `gs` first on PATH that leaves a mark when anything runs it.
    bin_dir, marker = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_READS, str(out), str(tf_file), str(src), str(marker)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for name in ("stored record", "foreign tfrecord", "source file"):
        assert results[name].startswith("refused:"), results
        assert results[f"{name} started gs"] is False
    assert "cannot decode stored image" in results["stored record"]
    assert "not an image" in results["foreign tfrecord"]
    assert "eps.jpg: not an image" in results["source file"]
    assert results["plain Pillow started gs"] is True  # what imgpack's reads did not do


class _Payload:
    """Runs a command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_in_a_shard_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "pt"
    convert(build_uniform_folder(tmp_path / "u", count=4), out, "pt", progress=False)
    marker = tmp_path / "ran"
    shard = torch.load(out / "shard-00000.pt", weights_only=True)
    shard["paths"] = _Payload(marker)
    torch.save(shard, out / "shard-00000.pt")
    refresh_manifest(out)
    with pytest.raises(DataError, match="cannot load shard"):
        open_dataset(out)[0]
    assert not marker.exists()


def test_a_shard_loads_as_torch_loads_it_safely(tmp_path: Path) -> None:
    """The restricted unpickler gives what ``torch.load(weights_only=True)`` gives, for raw and
    encoded shards and shards with fields; a global outside a shard's two goes to torch's safe
    unpickler (a later torch writing its tensors otherwise still loads)."""
    from imgpack.formats.pt.loading import load_shard

    src = build_uniform_folder(tmp_path / "u", count=6)
    for name, options in (("raw", {"encoding": "raw", "size": 8}), ("png", {"encoding": "png"})):
        out = tmp_path / name
        convert(src, out, "pt", progress=False, **options)
        path = out / "shard-00000.pt"
        fast, safe = load_shard(path), torch.load(path, mmap=True, weights_only=True)
        assert fast.keys() == safe.keys()
        for key, value in safe.items():
            if isinstance(value, torch.Tensor):
                assert bool((fast[key] == value).all()), key
            else:
                assert fast[key] == value, key
    shard = torch.load(tmp_path / "raw" / "shard-00000.pt", weights_only=True)
    shard["device"] = torch.device("cpu")  # a global torch's safe unpickler takes
    torch.save(shard, tmp_path / "other.pt")
    assert load_shard(tmp_path / "other.pt")["device"] == torch.device("cpu")


@pytest.fixture
def hdf5_out(tmp_path: Path) -> Path:
    out = tmp_path / "h5"
    src = build_uniform_folder(tmp_path / "u", count=6)
    convert(src, out, "hdf5", encoding="raw", size=16, progress=False)
    return out


def test_hdf5_external_storage_is_refused(hdf5_out: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"private " * 1000)
    with h5py.File(hdf5_out / "data.h5", "a") as f:
        shape = f["images"].shape
        del f["images"]
        f.create_dataset(
            "images", shape, np.uint8, external=[(str(secret), 0, int(np.prod(shape)))]
        )
    refresh_manifest(hdf5_out)
    with pytest.raises(DataError, match="'images' uses external storage"):
        open_dataset(hdf5_out)


def test_hdf5_virtual_datasets_are_refused(hdf5_out: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    with h5py.File(hdf5_out / "data.h5", "a") as f:
        shape = f["images"].shape
        with h5py.File(other, "w") as g:
            g["x"] = np.full(shape, 7, np.uint8)
        layout = h5py.VirtualLayout(shape, np.uint8)
        layout[...] = h5py.VirtualSource(str(other), "x", shape)
        del f["images"]
        f.create_virtual_dataset("images", layout)
    refresh_manifest(hdf5_out)
    with pytest.raises(DataError, match="'images' is a virtual dataset"):
        open_dataset(hdf5_out)


def test_hdf5_size_fields_are_checked(hdf5_out: Path, tmp_path: Path) -> None:
    out = tmp_path / "encoded"
    convert(build_uniform_folder(tmp_path / "v", count=6), out, "hdf5", progress=False)
    with h5py.File(out / "data.h5", "a") as f:
        offsets = f["offsets"][...]
        offsets[-1] = 1 << 62  # a hostile size
        f["offsets"][...] = offsets
    refresh_manifest(out)
    with pytest.raises(DataError, match="offsets do not match the data"):
        open_dataset(out)


def _edit_first_file(out: Path, path: str) -> None:
    manifest = json.loads((out / "imgpack.json").read_text())
    manifest["files"][0]["path"] = path
    (out / "imgpack.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../outside.pt", "/tmp/outside.pt", "sub/shard.pt", ".."])
def test_manifest_names_stay_inside_the_output(name: str, tmp_path: Path) -> None:
    out = tmp_path / "pt"
    convert(build_uniform_folder(tmp_path / "u", count=4), out, "pt", progress=False)
    _edit_first_file(out, name)
    with pytest.raises(ManifestError, match="not a plain name inside the output"):
        open_dataset(out)


def test_a_symlink_leading_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "pt"
    convert(build_uniform_folder(tmp_path / "u", count=4), out, "pt", progress=False)
    outside = tmp_path / "outside.pt"
    shutil.move(out / "shard-00000.pt", outside)  # same bytes, same size: only the link differs
    os.symlink(outside, out / "shard-00000.pt")
    with pytest.raises(DataError, match=r"shard-00000\.pt: not a regular file"):
        open_dataset(out)


FIFO_CONVERT = [sys.executable, "-m", "imgpack.cli", "convert"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_the_source_is_refused_without_hanging(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=4)
    os.mkfifo(src / "class0" / "pipe.jpg")
    done = subprocess.run(
        [*FIFO_CONVERT, str(src), str(tmp_path / "out"), "--format", "pt", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "class0/pipe.jpg: not a regular file (a FIFO)" in done.stderr
    done = subprocess.run(
        [*FIFO_CONVERT, str(src), str(tmp_path / "out"), "--format", "pt", "-q", "--on-error=skip"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped class0/pipe.jpg: not a regular file (a FIFO)" in done.stderr
    assert len(open_dataset(tmp_path / "out")) == 4


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("fmt", ["pt", "tfrecord"])
def test_a_fifo_named_by_a_manifest_is_refused_without_hanging(fmt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(build_uniform_folder(tmp_path / "src", count=4), out, fmt, progress=False)
    name = json.loads((out / "imgpack.json").read_text())["files"][0]["path"]
    (out / name).unlink()
    os.mkfifo(out / name)
    code = (
        "import sys\nfrom imgpack import open_dataset\nfrom imgpack.errors import ImgpackError\n"
        "try:\n    open_dataset(sys.argv[1])[0]\nexcept ImgpackError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"{name}: not a regular file" in done.stdout


GZIP_BOMB = r"""
import resource, sys
from imgpack.errors import DataError
from imgpack.readers import TFRecordStream
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    list(TFRecordStream(sys.argv[1]))
    print("read")
except DataError as exc:
    print(exc)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown // 1024)
"""


def test_a_gzip_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A record whose length field claims 3 GiB, inside a GZIP stream of 300 MB of zeros that
    compresses to a few hundred KB: refused before it is inflated."""
    length = struct.pack("<Q", 3 << 30)
    header = length + struct.pack("<I", framing.masked_crc32c(length))
    bomb = tmp_path / "bomb.tfrecord"
    with gzip.open(bomb, "wb", compresslevel=1) as fh:
        fh.write(header)
        zeros = bytes(16 << 20)
        for _ in range(300 // 16):
            fh.write(zeros)
    assert bomb.stat().st_size < 2 << 20
    done = subprocess.run(
        [sys.executable, "-c", GZIP_BOMB, str(bomb)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    message, grown_mb = done.stdout.strip().splitlines()
    assert (
        "claims 3221225472 bytes, more than the 256 MiB imgpack reads from a compressed" in message
    )
    assert int(grown_mb) < 64


def test_gzip_records_under_the_limit_still_stream(tmp_path: Path) -> None:
    record = example.encode_example(
        {"image/encoded": [_png()], "image/class/label": [0], "image/class/text": [b"a"]}
    )
    path = tmp_path / "ok.tfrecord"
    with gzip.open(path, "wb") as fh:
        fh.write(framing.frame(record) * 3)
    assert [label for _, label in TFRecordStream(path)] == [0, 0, 0]


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


EXTREME = {
    "height": lambda m: m["image"].update(height=2**40),
    "width": lambda m: m["image"].update(width=2**31),
    "channels": lambda m: m["image"].update(channels=3 * 2**40),
    "num_samples": lambda m: (
        m.update(num_samples=2**61),
        m["files"][-1].update(num_samples=2**61 - sum(f["num_samples"] for f in m["files"][:-1])),
    ),
    "too many": lambda m: m.update(num_samples=2**70),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_hostile_manifest_sizes_are_refused_not_allocated(fmt: str, tmp_path: Path) -> None:
    """Counts and shapes no file could hold never size an allocation (MemoryError,
    OverflowError, torch's allocator error): they are refused as a damaged manifest."""
    out = tmp_path / "out"
    src = build_uniform_folder(tmp_path / "src", count=12)
    convert(src, out, fmt, encoding="raw", size=16, progress=False)
    original = json.loads((out / "imgpack.json").read_text())
    for name, edit in EXTREME.items():
        manifest = json.loads(json.dumps(original))
        edit(manifest)
        (out / "imgpack.json").write_text(json.dumps(manifest))
        with pytest.raises(ImgpackError):
            ds = open_dataset(out)
            ds.__getitems__([0, 1, 2])
            pytest.fail(f"{name}: read")
