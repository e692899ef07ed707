"""Readers and the outputs under them: a reader opened before `convert --overwrite` never mixes
two outputs, LMDB environments live as long as their readers, and the stream and the timing
wrapper behave with persistent DataLoader workers."""

from __future__ import annotations

import gc
import hashlib
import math
import traceback
from pathlib import Path

import lmdb
import pytest
import torch
from conftest import build_uniform_folder
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.errors import DataError
from imgpack.loading.profiling import TimedDataset
from imgpack.readers import TFRecordStream, collate

REPLACED = "was replaced after it was opened"


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()


def _samples(ds: object, workers: int) -> list[tuple[str, int]]:
    loader = DataLoader(ds, batch_size=7, num_workers=workers, collate_fn=collate)  # type: ignore[arg-type]
    out = []
    try:
        for images, labels in loader:
            out.extend(zip(map(_digest, images), labels.tolist(), strict=True))
    except DataError as exc:
        # torch re-raises a worker's error from a frame that references it: a cycle that keeps
        # the loader's iterator alive until a garbage collection, which then waits 5 s per
        # worker. Clearing the frames lets its workers stop now.
        traceback.clear_frames(exc.__traceback__)
        raise
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("two")
    # Same count and size, other pixels and other labels: mixing them would go unnoticed.
    old = build_uniform_folder(base / "old", count=48, classes=2, seed=1)
    new = build_uniform_folder(base / "new", count=48, classes=4, seed=2)
    return old, new


def _shards(fmt: str) -> dict[str, str]:
    # Several shards, so that some open before the overwrite and some after.
    return {"shard_size": "2KB"} if fmt in ("pt", "tfrecord", "webdataset") else {}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_opened_before_an_overwrite_never_mixes_outputs(
    fmt: str, workers: int, sources: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = sources
    out = tmp_path / "out"
    convert(old, out, fmt, progress=False, **_shards(fmt))
    expected = _samples(open_dataset(out), 0)
    ds = open_dataset(out)
    first = ds[0]  # some handles open now, in this process
    assert (_digest(first[0]), first[1]) == expected[0]
    convert(new, out, fmt, overwrite=True, progress=False, **_shards(fmt))
    try:
        got = _samples(ds, workers)
    except DataError as exc:  # refused, with a clear message
        assert REPLACED in str(exc)
        return
    assert got == expected  # or served the output it opened, whole


def test_each_format_refuses_the_files_of_another_output(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    """In workers every handle opens after the overwrite: every format must refuse."""
    old, new = sources
    for fmt in FORMATS:
        out = tmp_path / fmt
        convert(old, out, fmt, progress=False)
        ds = open_dataset(out)
        convert(new, out, fmt, overwrite=True, progress=False)
        with pytest.raises(DataError, match=REPLACED):
            _samples(ds, 2)


def test_the_output_id_is_in_the_manifest_and_deterministic(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = sources
    ids = set()
    for name, src in (("a", old), ("b", old), ("c", new)):
        convert(src, tmp_path / name, "pt", progress=False)
        ids.add(open_dataset(tmp_path / name).manifest.output_id)
        assert len(open_dataset(tmp_path / name).manifest.output_id) == 16
    assert len(ids) == 2  # the same input gives the same id (and bytes), another input another
    assert (tmp_path / "a" / "shard-00000.pt").read_bytes() == (
        tmp_path / "b" / "shard-00000.pt"
    ).read_bytes()


def _maps_of(path: Path) -> int:
    text = Path("/proc/self/maps").read_text()
    return sum(str(path) in line for line in text.splitlines())


def test_lmdb_environments_live_as_long_as_their_readers(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    old, _ = sources
    out = tmp_path / "out"
    convert(old, out, "lmdb", progress=False)
    one, two = open_dataset(out), open_dataset(out)
    one[0], two[0]
    del one
    gc.collect()
    assert two[1][1] in (0, 1)  # the shared environment is still open for the other reader
    del two
    gc.collect()
    assert _maps_of(out / "data.mdb") == 0
    env = lmdb.open(str(out), readonly=True, lock=False)  # nothing of imgpack's is in the way
    env.close()
    for _ in range(3):  # --overwrite leaks no map
        ds = open_dataset(out)
        ds[0]
        convert(old, out, "lmdb", overwrite=True, progress=False)
        del ds
        gc.collect()
    assert _maps_of(out / "data.mdb") == 0


@pytest.fixture(scope="module")
def tfrecord_out(sources: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tf") / "out"
    convert(sources[0], out, "tfrecord", shard_size="3KB", progress=False)
    return out


def test_set_epoch_reaches_persistent_workers(tfrecord_out: Path) -> None:
    def orders(persistent: bool) -> list[list[str]]:
        stream = TFRecordStream(tfrecord_out, shuffle_buffer=16, seed=3)
        loader = DataLoader(
            stream,
            batch_size=8,
            num_workers=2,
            persistent_workers=persistent,
            collate_fn=collate,
        )
        out = []
        for epoch in range(3):
            stream.set_epoch(epoch)
            out.append([_digest(image) for images, _ in loader for image in images])
        return out

    persistent, fresh = orders(True), orders(False)
    assert persistent == fresh  # the same epochs, the same orders
    assert persistent[0] != persistent[1] != persistent[2]
    assert sorted(persistent[0]) == sorted(persistent[1])


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 CPUs
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_stream_len_counts_batches(tfrecord_out: Path, workers: int) -> None:
    stream = TFRecordStream(tfrecord_out, batch_size=5)
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    batches = list(loader)
    assert len(loader) == len(stream) == len(batches) == math.ceil(48 / 5)
    assert sum(len(labels) for _, labels in batches) == 48
    assert len(TFRecordStream(tfrecord_out)) == 48  # samples without batch_size


def test_timed_dataset_reset_keeps_later_timings(
    sources: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(sources[0], out, "pt", progress=False)
    timed = TimedDataset(open_dataset(out))
    loader = DataLoader(
        timed, batch_size=8, num_workers=2, persistent_workers=True, collate_fn=collate
    )
    list(loader)
    assert timed.stats()["count"] == 48
    timed.reset()
    assert timed.stats()["count"] == 0
    list(loader)  # the same persistent workers
    assert timed.stats()["count"] == 48
    timed.close()
