"""`imgpack export`: an output back to an image folder. An `original` output of plain JPEG and
PNG sources gives back the source tree byte for byte (nested folders, unicode names, empty
classes; hidden files were never part of it); sources the conversion re-encoded come back as the
PNG it stored, and the summary says so; other outputs give lossless PNGs of the stored pixels,
and converting an export again gives the same samples."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from imgpack import convert, export, open_dataset
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import DataError


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    rng = np.random.default_rng(4)
    root = tmp_path / "src"
    files = {
        "cat/a.jpg": _jpeg(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)),
        "cat/deep/er/b.png": _png(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8)),
        "dög/ünïcode 名前.jpg": _jpeg(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)),
        "dög/gray.png": _png(rng.integers(0, 256, (6, 6), dtype=np.uint8)),
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "empty_class").mkdir()
    (root / "cat" / ".hidden.jpg").write_bytes(files["cat/a.jpg"])  # ignored by the scan
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_original_output_exports_the_source_tree(fmt: str, src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "out", fmt, progress=False)
    done = export(tmp_path / "out", tmp_path / "back", progress=False)
    assert done.files == 4 and done.kept == 4 and not done.skipped
    assert _tree(tmp_path / "back") == _tree(src)  # byte for byte, names included
    assert (tmp_path / "back" / "empty_class").is_dir()  # the label map survives
    assert not (tmp_path / "back" / "cat" / ".hidden.jpg").exists()
    again = open_dataset(tmp_path / "out").classes
    convert(tmp_path / "back", tmp_path / "again", fmt, progress=False)
    assert open_dataset(tmp_path / "again").classes == again


def test_a_raw_output_exports_lossless_pngs(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "out", "lmdb", encoding="raw", size=8, progress=False)
    done = export(tmp_path / "out", tmp_path / "back", progress=False)
    assert done.encoded == 4 and done.kept == 0
    assert sorted(_tree(tmp_path / "back")) == [
        "cat/a.jpg.png", "cat/deep/er/b.png", "dög/gray.png", "dög/ünïcode 名前.jpg.png",
    ]  # fmt: skip
    convert(tmp_path / "back", tmp_path / "again", "lmdb", encoding="raw", size=8, progress=False)
    first, second = open_dataset(tmp_path / "out"), open_dataset(tmp_path / "again")
    digest = [hashlib.sha256(first[i][0].numpy().tobytes()).hexdigest() for i in range(4)]
    assert digest == [hashlib.sha256(second[i][0].numpy().tobytes()).hexdigest() for i in range(4)]
    assert first.targets == second.targets


def test_export_is_atomic_and_overwrites_only_exports(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "out", "pt", progress=False)
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / "back"), "-q"])
    assert result.exit_code == 0, result.output
    assert (
        "4 files (4 stored JPEG/PNG bytes as they are, 0 of them PNGs the conversion stored for "
        "another type of source; 0 raw records as PNG), 0 skipped"
    ) in result.output
    marker = json.loads((tmp_path / "back" / ".imgpack-export.json").read_text())
    assert marker["files"] == 4
    again = runner.invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / "back")])
    assert again.exit_code == 1 and "already exists" in again.output
    over = runner.invoke(
        main, ["export", str(tmp_path / "out"), str(tmp_path / "back"), "--overwrite", "-q"]
    )
    assert over.exit_code == 0, over.output
    refused = runner.invoke(main, ["export", str(tmp_path / "out"), str(src), "--overwrite"])
    assert refused.exit_code == 1 and "is not an imgpack export" in refused.output


def test_a_damaged_record_fails_or_is_skipped(src: Path, tmp_path: Path) -> None:
    from conftest import refresh_manifest

    convert(src, tmp_path / "out", "hdf5", progress=False)
    import h5py

    with h5py.File(tmp_path / "out" / "data.h5", "r+") as f:
        f["data"][5] ^= 0xFF  # inside the first image
    refresh_manifest(tmp_path / "out")
    with pytest.raises(DataError, match="checksum mismatch"):
        export(tmp_path / "out", tmp_path / "back", progress=False)
    assert not (tmp_path / "back").exists()
    done = export(tmp_path / "out", tmp_path / "back", on_error="skip", progress=False)
    assert done.files == 3 and done.skipped[0]["sample"] == "0"


def test_export_reads_the_stored_paths_once(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sample needs its source path: read once per export, not once per sample (an LMDB
    output's paths are in every record's header: reading them all per sample is quadratic)."""
    from imgpack.readers import LMDBDataset

    convert(src, tmp_path / "out", "lmdb", progress=False)
    calls = []
    real = LMDBDataset._load_paths

    def counted(self: LMDBDataset) -> list[str] | None:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(LMDBDataset, "_load_paths", counted)
    export(tmp_path / "out", tmp_path / "back", progress=False)
    assert len(calls) == 1


def test_the_summary_and_files_say_what_the_conversion_kept(tmp_path: Path) -> None:
    """A realistic folder: plain JPEG and PNG are the source bytes; an EXIF-rotated JPEG comes
    back upright as ``x.jpg.png`` and an RGBA PNG flattened under its name, both counted."""
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "plain.jpg").write_bytes(_jpeg(pixels))
    (src / "plain.png").write_bytes(_png(pixels))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to display
    rotated = io.BytesIO()
    Image.fromarray(pixels).save(rotated, format="JPEG", quality=90, exif=exif)
    (src / "rotated.jpg").write_bytes(rotated.getvalue())
    rgba = io.BytesIO()
    Image.fromarray(np.dstack([pixels, pixels[:, :, 0]]), "RGBA").save(rgba, format="PNG")
    (src / "alpha.png").write_bytes(rgba.getvalue())
    convert(tmp_path / "src", tmp_path / "out", "pt", progress=False)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    assert (
        "4 files (4 stored JPEG/PNG bytes as they are, 1 of them PNGs the conversion stored for "
        "another type of source; 0 raw records as PNG)"
    ) in result.output
    back = tmp_path / "back" / "cat"
    assert sorted(p.name for p in back.iterdir()) == [
        "alpha.png", "plain.jpg", "plain.png", "rotated.jpg.png",
    ]  # fmt: skip
    for name in ("plain.jpg", "plain.png"):
        assert (back / name).read_bytes() == (src / name).read_bytes()
    assert (back / "alpha.png").read_bytes() != (src / "alpha.png").read_bytes()
    with Image.open(back / "rotated.jpg.png") as upright:
        assert upright.size == (12, 20)  # EXIF orientation applied
