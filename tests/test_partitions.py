"""Partitioned conversion and `imgpack merge`: K parts converted separately (as a Slurm array
would) and merged equal one conversion — samples, labels, pixels, source paths, order, skipped
files — for every format; wrong sets of parts are refused by name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder, manifest_file

from imgpack import convert, merge, open_dataset, verify
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import ImgpackError, OptionError

PARTS = 3


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build_uniform_folder(tmp_path_factory.mktemp("parts") / "src", count=50)
    (root / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    return root


def _options(fmt: str) -> dict[str, object]:
    # Small shards, so that every part has several and the merge renumbers them.
    sharded = fmt in ("pt", "tfrecord", "webdataset")
    return {"on_error": "skip", "progress": False, **({"shard_size": "2KB"} if sharded else {})}


def _contents(path: Path) -> tuple[list[tuple[str, int]], list[str]]:
    ds = open_dataset(path, verify=True)
    rows = []
    for i in range(len(ds)):
        image, label = ds[i]
        rows.append((hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest(), label))
    return rows, [path for path, _ in ds.samples]


def _parts(src: Path, base: Path, fmt: str, count: int = PARTS) -> list[Path]:
    out = []
    for part in range(count):
        target = base / f"part{part}"
        convert(src, target, fmt, num_parts=count, part=part, **_options(fmt))  # type: ignore[arg-type]
        out.append(target)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_parts_merged_equal_one_conversion(fmt: str, src: Path, tmp_path: Path) -> None:
    single = convert(src, tmp_path / "single", fmt, **_options(fmt))  # type: ignore[arg-type]
    parts = _parts(src, tmp_path, fmt)
    manifests = [json.loads(manifest_file(p).read_text()) for p in parts]
    assert [m["part"]["index"] for m in manifests] == [0, 1, 2]
    assert sum(m["num_samples"] for m in manifests) == single.num_samples == 50
    assert {m["output_id"] for m in manifests} == {single.output_id}  # one conversion, one id
    merged = merge(list(reversed(parts)), tmp_path / "merged", progress=False)  # any order
    assert _contents(tmp_path / "merged") == _contents(tmp_path / "single")
    assert merged.num_samples == single.num_samples
    assert merged.skipped == single.skipped and len(merged.skipped) == 1
    assert merged.source == single.source and merged.options == single.options
    assert merged.output_id == single.output_id and merged.part is None
    assert verify(tmp_path / "merged").ok
    if fmt in ("pt", "tfrecord", "webdataset"):  # shards were linked, not copied
        first = parts[0] / manifests[0]["files"][0]["path"]
        assert first.stat().st_nlink == 2
        assert verify(parts[0]).ok  # and the parts are as they were
    # The index files are listed under the merged names, as one conversion lists them.
    indexed = fmt in ("tfrecord", "webdataset")
    for entry in merged.files:
        wanted = [Path(entry.path).with_suffix(".idx").name] if indexed else []
        assert [c.path for c in entry.companions] == wanted


@pytest.mark.parametrize("fmt", ["tfrecord", "webdataset"])
def test_a_part_index_changed_after_its_conversion_is_not_merged(
    fmt: str, src: Path, tmp_path: Path
) -> None:
    parts = _parts(src, tmp_path, fmt)
    manifest = json.loads(manifest_file(parts[1]).read_text())
    entry = next(f for f in manifest["files"] if f["num_samples"])  # a skipped file's is empty
    index = parts[1] / entry["companions"][0]["path"]
    text = index.read_text()
    end = text.index("\n") - 1  # the first line's last digit, another digit: same size
    index.write_text(text[:end] + str((int(text[end]) + 1) % 10) + text[end + 1 :])
    with pytest.raises(ImgpackError, match=r"sha256|does not match|damaged|records end") as caught:
        merge(parts, tmp_path / "merged", progress=False)
    assert str(index) in str(caught.value) or index.name in str(caught.value)
    assert not (tmp_path / "merged").exists()


def test_the_cli_runs_a_slurm_style_array_then_merges(src: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for task in range(PARTS):  # what each task of `sbatch --array=0-2` runs
        result = runner.invoke(
            main,
            [
                "convert", str(src), str(tmp_path / f"part{task}"), "--format", "webdataset",
                "--num-parts", str(PARTS), "--part", str(task), "--on-error", "skip", "-q",
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    result = runner.invoke(
        main, ["merge", *(str(tmp_path / f"part{t}") for t in range(PARTS)), str(tmp_path / "all")]
    )
    assert result.exit_code == 0, result.output
    assert "50 samples from 3 parts" in result.output
    assert len(open_dataset(tmp_path / "all")) == 50


def test_more_parts_than_samples(tmp_path: Path) -> None:
    small = build_uniform_folder(tmp_path / "small", count=2, classes=1)
    parts = _parts(small, tmp_path, "pt", count=4)  # two of them empty
    merge(parts, tmp_path / "merged", progress=False)
    assert len(open_dataset(tmp_path / "merged")) == 2


@pytest.fixture(scope="module")
def lmdb_parts(src: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return _parts(src, tmp_path_factory.mktemp("lmdbparts"), "lmdb")


def _refused(parts: list[Path], dst: Path, match: str) -> None:
    with pytest.raises(OptionError, match=match):
        merge(parts, dst, progress=False)
    assert not dst.exists()
    result = CliRunner().invoke(main, ["merge", *map(str, parts), str(dst)])
    assert result.exit_code == 2  # a usage error: the usage, then the one-line reason
    assert result.output.strip().splitlines()[-1].startswith("Error: ")


def test_a_damaged_one_file_part_is_refused_before_its_library_opens_it(
    lmdb_parts: list[Path], tmp_path: Path
) -> None:
    """Bytes of an LMDB part's meta pages flipped (its size unchanged): LMDB follows the file's
    own page numbers, past its end (a SIGBUS that kills the merge), so the part is hashed
    against its manifest first and refused in one line."""
    parts = [tmp_path / p.name for p in lmdb_parts]
    for source, copy in zip(lmdb_parts, parts, strict=True):
        shutil.copytree(source, copy)
    data = parts[1] / "data.mdb"
    blob = bytearray(data.read_bytes())
    pages = len(blob) // 4096
    for meta in (0, 4096):  # both meta pages (64-bit layout): the main tree's root page, then
        # the last page used, past the file's end; the magic and everything else as they were
        blob[meta + 128 : meta + 136] = (pages + 100).to_bytes(8, "little")
        blob[meta + 136 : meta + 144] = (pages + 200).to_bytes(8, "little")
    data.write_bytes(bytes(blob))
    with pytest.raises(ImgpackError, match=r"data\.mdb: its sha256 is not"):
        merge(parts, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, ["merge", *map(str, parts), str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output


def test_a_missing_part_is_refused(lmdb_parts: list[Path], tmp_path: Path) -> None:
    _refused(lmdb_parts[:2], tmp_path / "out", r"part\(s\) 2 of 3 missing")


def test_a_repeated_part_is_refused(lmdb_parts: list[Path], tmp_path: Path) -> None:
    _refused([*lmdb_parts, lmdb_parts[1]], tmp_path / "out", "part 1 of 3 is given twice")


def test_parts_of_different_conversions_are_refused(
    src: Path, lmdb_parts: list[Path], tmp_path: Path
) -> None:
    other = tmp_path / "other"
    convert(src, other, "lmdb", num_parts=PARTS, part=2, encoding="png", **_options("lmdb"))  # type: ignore[arg-type]
    _refused([*lmdb_parts[:2], other], tmp_path / "out", "parts of different conversions")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    os.remove(next((changed / "class2").iterdir()))
    third = tmp_path / "third"
    convert(changed, third, "lmdb", num_parts=PARTS, part=2, **_options("lmdb"))  # type: ignore[arg-type]
    _refused([*lmdb_parts[:2], third], tmp_path / "out", "parts of different conversions")
    split4 = tmp_path / "split4"
    convert(src, split4, "lmdb", num_parts=4, part=2, **_options("lmdb"))  # type: ignore[arg-type]
    _refused([*lmdb_parts[:2], split4], tmp_path / "out", "parts of different conversions")


def test_an_output_that_is_not_a_part_is_refused(src: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    convert(src, whole, "pt", **_options("pt"))  # type: ignore[arg-type]
    _refused([whole], tmp_path / "out", "not a part of a partitioned conversion")


def test_part_options_are_checked(src: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="invalid part 3: expected 0 to 2"):
        convert(src, tmp_path / "x", "pt", num_parts=3, part=3)
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "x"), "--format", "pt", "--num-parts", "0"]
    )
    assert result.exit_code == 2
