"""Fuzzing the newer surfaces with hypothesis: part manifests (merge), checkpoints and the files
of a killed conversion (resume), WebDataset indexes and cache entries. A changed byte anywhere
gives the right data or an imgpack error (one line from the CLI): never another exception, a
traceback, a hang, or a silent difference."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder, manifest_file, slow_cli
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from imgpack import convert, direct, open_dataset, verify
from imgpack.cli import main
from imgpack.errors import ImgpackError
from imgpack.pipeline import CHECKPOINT, leftovers

FUZZ = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
flips = st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3
)


def _flip(path: Path, damage: list[tuple[float, int]]) -> bool:
    """Flip bytes of ``path``; whether its content changed."""
    blob = bytearray(path.read_bytes())
    if not blob:
        return False
    before = bytes(blob)
    for where, value in damage:
        blob[int(where * len(blob))] ^= value
    path.write_bytes(bytes(blob))
    return bytes(blob) != before


def _digests(root: Path | str, **kwargs: Any) -> list[list[Any]]:
    ds = open_dataset(root, verify=True, **kwargs)
    return [
        [hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest(), ds[i][1]]
        for i in range(len(ds))
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-surfaces")
    build_uniform_folder(root / "src", count=40, size=8, classes=3)
    return root


# -- part manifests --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parts(base: Path) -> dict[str, tuple[list[Path], list[list[Any]]]]:
    made = {}
    for fmt in ("pt", "lmdb", "webdataset"):
        sharded = {"shard_size": 2000} if fmt != "lmdb" else {}
        roots = [base / f"{fmt}-p{i}" for i in range(2)]
        for i, root in enumerate(roots):
            convert(base / "src", root, format=fmt, num_parts=2, part=i, progress=False, **sharded)
        whole = base / f"{fmt}-whole"
        convert(base / "src", whole, format=fmt, progress=False, **sharded)
        made[fmt] = (roots, _digests(whole))
    return made


@pytest.mark.parametrize("fmt", ["pt", "lmdb", "webdataset"])
@FUZZ
@given(which=st.integers(0, 1), damage=flips, in_data=st.booleans())
def test_a_damaged_part_merges_right_or_not_at_all(
    fmt: str,
    which: int,
    damage: list[tuple[float, int]],
    in_data: bool,
    parts: dict[str, tuple[list[Path], list[list[Any]]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    roots, expected = parts[fmt]
    work = tmp_path_factory.mktemp("merge")
    copies = [work / root.name for root in roots]
    for root, copy in zip(roots, copies, strict=True):
        shutil.copytree(root, copy)
    files = sorted(p for p in copies[which].iterdir() if p.is_file() and p.name != "lock.mdb")
    manifest = manifest_file(copies[which])  # imgpack.json, or a part's manifest
    data = [p for p in files if p != manifest]
    target = data[int(damage[0][0] * len(data))] if in_data else manifest
    _flip(target, damage)
    out = work / "out"
    result = CliRunner().invoke(main, ["merge", *map(str, copies), str(out), "-q"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert _digests(out) == expected
    else:
        assert result.exit_code in (1, 2) and not out.exists()


# -- checkpoints and the files of a killed run -----------------------------------------------
SLOW_CLI = slow_cli(0.02, commit=4)


#: Each format with how it resumes: pt, tfrecord and webdataset by their shard tasks'
#: receipts, lmdb and hdf5 by their one writer's checkpoint.
RESUMED = [("pt", "tasks"), ("tfrecord", "tasks"), ("webdataset", "tasks"), ("lmdb", "writer"),
           ("hdf5", "writer")]  # fmt: skip


def _sharding(fmt: str) -> list[str]:
    return ["--shard-size", "1000"] if fmt in ("pt", "tfrecord", "webdataset") else []


def _killed(base: Path, fmt: str, engine: str) -> tuple[Path, list[list[Any]]]:
    """The temp dir of a conversion to ``fmt`` SIGKILLed midway (by shard tasks: once 2 shards
    have receipts; by one writer: kept once its checkpoint counts a sample), and the pixels of
    an uninterrupted run."""
    dst = base / f"killed-{fmt}"
    command = [sys.executable, "-c", SLOW_CLI, "convert", str(base / "src"), str(dst)]
    command += ["-q", "--format", fmt, "--workers", "1", *_sharding(fmt)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = leftovers(dst)
        if engine == "tasks" and found and direct.receipts_in(found[0]) >= 2:
            break
        checkpoint = found[0] / CHECKPOINT if found else None
        if (
            engine == "writer"
            and checkpoint
            and checkpoint.exists()
            and json.loads(checkpoint.read_text())["count"]
        ):
            break
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    (tmp,) = leftovers(dst)
    keep = base / f"keep-{fmt}"
    shutil.move(tmp, keep)
    whole = base / f"whole-{fmt}"
    shard = {"shard_size": 1000} if engine == "tasks" else {}
    convert(base / "src", whole, format=fmt, progress=False, workers=1, **shard)
    return keep, _digests(whole)


@pytest.fixture(scope="module")
def killed(base: Path) -> dict[str, tuple[Path, list[list[Any]]]]:
    """Per format: the temp dir of a conversion SIGKILLed midway, and the pixels of an
    uninterrupted run."""
    return {fmt: _killed(base, fmt, engine) for fmt, engine in RESUMED}


@pytest.mark.parametrize("fmt", [fmt for fmt, _ in RESUMED])
@FUZZ
@given(damage=flips, in_checkpoint=st.booleans(), pick=st.floats(0, 1, exclude_max=True))
def test_a_damaged_checkpoint_resumes_right_or_not_at_all(
    fmt: str,
    damage: list[tuple[float, int]],
    in_checkpoint: bool,
    pick: float,
    killed: dict[str, tuple[Path, list[list[Any]]]],
    base: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A killed run's temp folder with bytes flipped in its checkpoint or in one of its files
    (shards and their receipts, by shard tasks; the one file, by one writer): ``--resume``
    gives the uninterrupted run's pixels, or fails in one line and publishes nothing."""
    keep, expected = killed[fmt]
    work = tmp_path_factory.mktemp("resume")
    dst = work / "out"
    tmp = work / f".out.fuzz{fmt}.imgpack-tmp"
    shutil.copytree(keep, tmp)
    files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != CHECKPOINT)
    target = tmp / CHECKPOINT if in_checkpoint or not files else files[int(pick * len(files))]
    _flip(target, damage)
    args = ["convert", str(base / "src"), str(dst), "-q", "--format", fmt, "--resume"]
    args += ["--workers", "1", *_sharding(fmt)]
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert _digests(dst) == expected
        assert verify(dst, deep=True).ok
    else:
        assert result.exit_code == 1 and not dst.exists(), result.output


# -- webdataset indexes ----------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["original", "raw"])
@FUZZ
@given(
    edit=st.sampled_from(["duplicate", "swap", "shift", "drop"]),
    line=st.floats(0, 1, exclude_max=True),
)
def test_an_edited_webdataset_index_reads_right_or_fails(
    encoding: str,
    edit: str,
    line: float,
    base: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    work = tmp_path_factory.mktemp("wds")
    out = work / "out"
    convert(base / "src", out, format="webdataset", encoding=encoding, size=8, progress=False)
    expected = _digests(out)
    idx = out / "data-000000.idx"
    rows = [r.split() for r in idx.read_text().splitlines()]
    k = int(line * (len(rows) - 1))
    if edit == "duplicate":
        rows[k + 1] = rows[k]
    elif edit == "swap":
        rows[k], rows[k + 1] = rows[k + 1], rows[k]
    elif edit == "shift":
        rows[k][0] = str(int(rows[k][0]) + 512)
    else:
        del rows[k]
    idx.write_text("".join(" ".join(r) + "\n" for r in rows))
    with contextlib.suppress(ImgpackError):
        assert _digests(out) == expected
    assert not verify(out, deep=True).ok


# -- cache entries ---------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["original", "raw"])
@FUZZ
@given(damage=flips, pick=st.floats(0, 1, exclude_max=True))
def test_a_damaged_cache_entry_is_fetched_again_or_refused(
    encoding: str,
    damage: list[tuple[float, int]],
    pick: float,
    base: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import fsspec  # type: ignore[import-untyped]

    work = tmp_path_factory.mktemp("cache")
    local = work / "local"
    convert(base / "src", local, format="tfrecord", encoding=encoding, size=8, progress=False)
    expected = _digests(local)
    url = f"memory://fuzz-{work.name}/out"
    fs = fsspec.filesystem("memory")
    for path in local.iterdir():
        fs.pipe(f"{url}/{path.name}", path.read_bytes())
    cache = work / "cache"
    open_dataset(url, cache_dir=cache)
    (entry,) = [p for p in (cache / "outputs").iterdir() if p.is_dir()]
    files = sorted(p for p in entry.iterdir() if p.is_file())
    _flip(files[int(pick * len(files))], damage)
    try:
        got = _digests(url, cache_dir=cache)
    except ImgpackError:
        return
    assert got == expected
