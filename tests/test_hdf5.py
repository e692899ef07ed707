"""What is particular to the hdf5 format (the shared round-trip, determinism and reader tests
cover it too, parametrized over every format)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from conftest import FakeFolder, refresh_manifest
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.errors import DataError, ManifestError, OptionError
from imgpack.readers import HDF5Dataset, collate

ORDER = [7, 3, 3, 59, 0, 8, 9, 10, 58, 7]  # unsorted, repeated, with consecutive runs


def test_default_layout_is_contiguous_and_reads_with_plain_h5py(
    uniform_folder: Path, tmp_path: Path
) -> None:
    convert(uniform_folder, tmp_path / "out", "hdf5", encoding="raw", size=16, progress=False)
    ds = open_dataset(tmp_path / "out")
    # -- as docs/formats/hdf5.md shows --
    with h5py.File(tmp_path / "out" / "data.h5", "r") as f:
        classes = list(f.attrs["classes"])
        image = f["images"][7]  # (H, W, C) uint8
        label = int(f["labels"][7])
        filename = f["filenames"][7].decode()
        assert f["images"].chunks is None and f["images"].compression is None
        assert f.attrs["imgpack"] == 1 and f.attrs["encoding"] == "raw"
    # --
    assert classes == ds.classes
    assert filename == "class0/img0021.png"  # class0 holds img0000, img0003, ... in order
    assert torch.equal(torch.from_numpy(image).permute(2, 0, 1), ds[7][0]) and label == ds[7][1]
    assert isinstance(ds, HDF5Dataset) and ds.mmap


def test_encoded_layout(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "hdf5", encoding="png", progress=False)
    with h5py.File(tmp_path / "out" / "data.h5", "r") as f:
        offsets = f["offsets"][...]
        png = f["data"][offsets[4] : offsets[5]].tobytes()
        filename = f["filenames"][4].decode()
    # An RGB PNG source needs no change, so its bytes are stored as they are.
    assert png == (uniform_folder / filename).read_bytes()


@pytest.mark.parametrize("encoding", ["raw", "png"])
def test_mmap_and_h5py_paths_agree(encoding: str, uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "hdf5", encoding=encoding, size=16, progress=False)
    fast, slow = HDF5Dataset(tmp_path / "out"), HDF5Dataset(tmp_path / "out", mmap=False)
    assert fast.mmap and not slow.mmap
    a, b = collate(fast.__getitems__(ORDER)), collate(slow.__getitems__(ORDER))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    singles = torch.stack([fast[i][0] for i in ORDER])
    assert torch.equal(a[0], singles)


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("encoding", ["raw", "png"])
def test_compression_round_trip(
    compression: str, encoding: str, uniform_folder: Path, tmp_path: Path
) -> None:
    plain = convert(
        uniform_folder, tmp_path / "plain", "hdf5", encoding=encoding, size=16, progress=False
    )
    packed = convert(
        uniform_folder,
        tmp_path / "packed",
        "hdf5",
        encoding=encoding,
        size=16,
        compression=compression,
        chunk_size="2KiB",
        progress=False,
    )
    assert packed.options["compression"] == compression
    with h5py.File(tmp_path / "packed" / "data.h5", "r") as f:
        dset = f["images" if encoding == "raw" else "data"]
        assert dset.compression == compression and dset.chunks is not None
    ref, ds = open_dataset(tmp_path / "plain"), open_dataset(tmp_path / "packed")
    assert not ds.mmap  # type: ignore[attr-defined]
    a, b = collate(ref.__getitems__(ORDER)), collate(ds.__getitems__(ORDER))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert plain.num_samples == packed.num_samples


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_chunked_reader_in_workers(method: str, uniform_folder: Path, tmp_path: Path) -> None:
    convert(
        uniform_folder,
        tmp_path / "out",
        "hdf5",
        encoding="raw",
        size=16,
        compression="gzip",
        progress=False,
    )
    ds = open_dataset(tmp_path / "out")
    ds[0]  # an h5py handle is open in the parent before the workers start
    loader = DataLoader(
        ds, batch_size=8, num_workers=2, multiprocessing_context=method, collate_fn=collate
    )
    images = torch.cat([b[0] for b in loader])
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(len(ds))]))


def convert_cli(src: Path, dst: Path, fmt: str, compression: str) -> Result:
    args = ["convert", str(src), str(dst), "--format", fmt, "--compression", compression, "-q"]
    return CliRunner().invoke(main, args)


def test_bad_compression(uniform_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="invalid compression 'zstd'"):
        convert(uniform_folder, tmp_path / "out", "hdf5", compression="zstd", progress=False)
    result = convert_cli(uniform_folder, tmp_path / "o", "pt", "gzip")
    assert result.exit_code == 2 and "format 'pt' has no option compression" in result.output


def test_cli_compression(uniform_folder: Path, tmp_path: Path) -> None:
    result = convert_cli(uniform_folder, tmp_path / "o", "hdf5", "lzf")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "o" / "data.h5", "r") as f:
        assert f["data"].compression == "lzf"


def test_skipped_files_leave_no_gap(bad_folder: FakeFolder, tmp_path: Path) -> None:
    manifest = convert(
        bad_folder.root,
        tmp_path / "out",
        "hdf5",
        encoding="raw",
        size=8,
        on_error="skip",
        progress=False,
    )
    with h5py.File(tmp_path / "out" / "data.h5", "r") as f:
        assert f["images"].shape[0] == manifest.num_samples == len(bad_folder.images)
        assert [n.decode() for n in f["filenames"][...]] == [p for p, _ in bad_folder.images]
    assert not list((tmp_path / "out").glob(".*"))  # no staging file left


def test_truncated_file_is_reported(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "hdf5", encoding="raw", size=16, progress=False)
    path = tmp_path / "out" / "data.h5"
    path.write_bytes(path.read_bytes()[:4000])
    with pytest.raises(DataError, match=r"data\.h5: 4000 bytes, the manifest says"):
        open_dataset(tmp_path / "out")
    refresh_manifest(tmp_path / "out")  # a short file its manifest agrees with: too short for
    # the manifest's 60 raw images, so refused before h5py sees it
    with pytest.raises(ManifestError, match=r"data\.h5: 4000 bytes cannot hold 60 samples"):
        open_dataset(tmp_path / "out")


def test_corrupt_encoded_sample_names_file_and_sample(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "hdf5", encoding="png", progress=False)
    with h5py.File(tmp_path / "out" / "data.h5", "r+") as f:
        start = int(f["offsets"][6])
        f["data"][start + 20 : start + 60] = np.full(40, 7, np.uint8)
    ds = open_dataset(tmp_path / "out")
    with pytest.raises(DataError, match=r"data\.h5: sample 6 \(source .*\): checksum mismatch"):
        ds.__getitems__([5, 6])
    with pytest.raises(DataError, match=r"data\.h5: sample 6: cannot decode"):
        open_dataset(tmp_path / "out", verify=False).__getitems__([5, 6])
