"""Outputs as sources: `imgpack convert OUT_A OUT_B --format F` keeps labels, order, pixels and
source paths, carries stored bytes over unchanged when the encoding stays (an `original` output
keeps the original files' bytes through any number of hops), re-encodes through the image policy
when options change, records the chain, and takes TFRecord files other tools wrote."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner
from conftest import build_edge_folder, refresh_manifest

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.converters import FORMATS
from imgpack.errors import ImageError
from imgpack.readers import TFRecordDataset

DATA = Path(__file__).resolve().parent / "data"


def _rows(path: Path) -> tuple[list[tuple[str, int]], list[str] | None, list[str]]:
    ds = open_dataset(path)
    rows = [
        (hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest(), ds[i][1])
        for i in range(len(ds))
    ]
    return rows, ds._load_paths(), ds.classes


def _stored(path: Path) -> list[bytes]:
    ds = open_dataset(path)
    return [sample.payload for sample in ds.encoded(0, len(ds))]


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hops")
    src = build_edge_folder(base / "src").root
    return {fmt: _convert(src, base / fmt, fmt) for fmt in FORMATS}


def _convert(src: Path, dst: Path, fmt: str, **options: object) -> Path:
    convert(src, dst, fmt, progress=False, **options)  # type: ignore[arg-type]
    return dst


@pytest.mark.parametrize("target", FORMATS)
@pytest.mark.parametrize("source", FORMATS)
def test_every_format_to_every_format(
    source: str, target: str, originals: dict[str, Path], tmp_path: Path
) -> None:
    out = _convert(originals[source], tmp_path / "out", target)
    assert _rows(out) == _rows(originals[source])  # pixels, labels, order, paths, classes
    assert _stored(out) == _stored(originals[source])  # the very bytes, not decoded again
    manifest = open_dataset(out).manifest
    assert manifest.source["converted_from"]["format"] == source
    assert manifest.source["converted_from"]["from"]["path"].endswith("src")


def test_original_bytes_survive_any_number_of_hops(
    originals: dict[str, Path], tmp_path: Path
) -> None:
    hop = originals["lmdb"]
    for number, fmt in enumerate(("pt", "tfrecord", "webdataset", "hdf5", "lmdb")):
        hop = _convert(hop, tmp_path / f"hop{number}", fmt)
    assert _stored(hop) == _stored(originals["pt"])
    chain = open_dataset(hop).manifest.source["converted_from"]
    depth = 0
    while "converted_from" in chain.get("from", {}):
        chain, depth = chain["from"]["converted_from"], depth + 1
    assert depth == 4  # five hops, each recorded


def test_changed_options_reencode_like_the_folder_would(
    originals: dict[str, Path], tmp_path: Path
) -> None:
    src = Path(open_dataset(originals["pt"]).manifest.source["path"])
    direct = _convert(src, tmp_path / "direct", "hdf5", encoding="raw", size=12)
    via = _convert(originals["webdataset"], tmp_path / "via", "hdf5", encoding="raw", size=12)
    assert _rows(via)[0] == _rows(direct)[0]
    back = _convert(via, tmp_path / "back", "pt", encoding="png")  # raw records to PNG
    assert _rows(back)[0] == _rows(direct)[0]


def test_foreign_tfrecords_are_a_source(tmp_path: Path) -> None:
    files = tmp_path / "tf"
    files.mkdir()
    for name in ("tensorflow-written-synthetic.tfrecord", "tensorflow-written-real.tfrecord"):
        shutil.copy(DATA / name, files / name)
    result = CliRunner().invoke(
        main, ["convert", str(files), str(tmp_path / "out"), "--format", "lmdb", "-q"]
    )
    assert result.exit_code == 0, result.output
    foreign = TFRecordDataset(str(files))
    ds = open_dataset(tmp_path / "out")
    assert ds.classes == foreign.classes and ds.targets == foreign.targets
    for i in range(len(ds)):  # the images went through the policy, as TFRecordDataset does
        assert (ds[i][0] == foreign[i][0]).all()
    assert ds.manifest.source["converted_from"] == {"format": "tfrecord", "foreign": True}


@pytest.mark.parametrize("workers", [1, 2])
def test_compressed_tfrecords_are_a_source_and_a_changed_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """A GZIP-compressed TFRecord file converts (read as a stream from its start), with the
    labels and pixels ``TFRecordStream`` reads; a file rewritten after the scan stops the run
    naming the source, nothing published."""
    import os

    import imgpack.sources.tfrecord.source as tf_source
    from imgpack.errors import DataError
    from imgpack.readers import TFRecordStream

    files = tmp_path / "tf"
    files.mkdir()
    for name in ("tensorflow-written-synthetic.gz.tfrecord", "tensorflow-written-real.tfrecord"):
        shutil.copy(DATA / name, files / name)
    out = convert(files, tmp_path / "out", "pt", shard_size="8KB", workers=workers,
                  progress=False)  # fmt: skip
    stream = list(TFRecordStream(str(files)))
    ds = open_dataset(tmp_path / "out")
    assert out.num_samples == len(stream) and ds.targets == [int(t) for _, t in stream]
    assert all((ds[i][0] == image).all() for i, (image, _) in enumerate(stream))
    real = tf_source.scan_record_files

    def scanned_then_rewritten(*args: object, **kwargs: object) -> object:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        path = files / "tensorflow-written-real.tfrecord"
        path.write_bytes(path.read_bytes())
        os.utime(path, ns=(1, 1))
        return found

    monkeypatch.setattr(tf_source, "scan_record_files", scanned_then_rewritten)
    with pytest.raises(DataError, match="the source changed after this conversion planned it"):
        convert(files, tmp_path / "changed", "pt", workers=workers, progress=False)
    assert not (tmp_path / "changed").exists()


def test_a_compressed_tfrecord_is_read_through_once_into_one_file_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into ``lmdb`` (the one writer, a chunk at a time, here one sample a chunk) a compressed
    file's stream is read on from chunk to chunk, opened once, not once a chunk from its start
    (which would read a file of N records N times over)."""
    import imgpack.sources.tfrecord.source as tf_source
    from imgpack.readers import TFRecordStream

    opened: list[str] = []

    class Counted(tf_source._Stream):
        def __init__(self, raw: object, kind: str, where: str) -> None:
            opened.append(where)
            super().__init__(raw, kind, where)

    monkeypatch.setattr(tf_source, "_Stream", Counted)
    src = tmp_path / "tensorflow-written-synthetic.gz.tfrecord"
    shutil.copy(DATA / src.name, src)
    out = convert(src, tmp_path / "out", "lmdb", workers=1, progress=False)
    stream = list(TFRecordStream(str(src)))
    assert out.num_samples == len(stream) == 6 and opened == [str(src)]
    ds = open_dataset(tmp_path / "out")
    assert all((ds[i][0] == image).all() for i, (image, _) in enumerate(stream))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_compressed_tfrecord_cut_into_shard_tasks_is_read_through_once_a_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """A compressed file cut into six shard tasks (a record each): each process reads on from
    the stream it holds from task to task, so the file is opened at most once per worker
    (before: once per task, each from the file's start: a file of S shards read S/2 times
    over); the output is the one-shard conversion's records, in order."""
    import imgpack.sources.tfrecord.source as tf_source
    from imgpack.readers import TFRecordStream

    log = tmp_path / "opens.log"

    class Counted(tf_source._Stream):
        def __init__(self, raw: object, kind: str, where: str) -> None:
            with open(log, "a") as out:  # from every process the pool forked
                out.write(f"{os.getpid()}\n")
            super().__init__(raw, kind, where)

    monkeypatch.setattr(tf_source, "_Stream", Counted)
    src = tmp_path / "tensorflow-written-synthetic.gz.tfrecord"
    shutil.copy(DATA / src.name, src)
    out = convert(src, tmp_path / "out", "pt", shard_size="1B", workers=workers, progress=False)
    assert len(out.files) == out.num_samples == 6  # a shard task a record
    opens = log.read_text().split()
    assert len(opens) == len(set(opens)) <= workers, opens  # once in each process
    stream = list(TFRecordStream(str(src)))
    ds = open_dataset(tmp_path / "out")
    assert ds.targets == [int(t) for _, t in stream]
    assert all((ds[i][0] == image).all() for i, (image, _) in enumerate(stream))


def _scan_killing(item: tuple[str, str, str, int]) -> object:
    """A TFRecord scan task that kills its worker on the file ``*real.tfrecord`` (as a
    decoder's crash or the OOM killer would), and scans the others."""
    import os
    import signal

    from imgpack.sources.tfrecord.source import FileScan

    if item[2].endswith("real.tfrecord"):
        os.kill(os.getpid(), signal.SIGKILL)
    return FileScan("", [])


def test_a_scan_task_whose_worker_dies_names_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose scan kills its worker on every try stops the run in one line naming it and
    what the worker did, nothing published."""
    import imgpack.sources.tfrecord.source as tf_source

    files = tmp_path / "tf"
    files.mkdir()
    for name in ("tensorflow-written-synthetic.tfrecord", "tensorflow-written-real.tfrecord"):
        shutil.copy(DATA / name, files / name)
    monkeypatch.setattr(tf_source, "scan_record_file", _scan_killing)
    result = CliRunner().invoke(main, ["convert", str(files), str(tmp_path / "out"), "-q",
                                       "--format", "pt", "--workers", "2"])  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (
        f"{files / 'tensorflow-written-real.tfrecord'}: the worker reading it died on every try "
        "(out of memory? try fewer --workers)"
    ) in result.output
    assert not (tmp_path / "out").exists()


def test_a_damaged_source_record_is_named_or_skipped(
    originals: dict[str, Path], tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(originals["hdf5"], damaged)
    with h5py.File(damaged / "data.h5", "r+") as f:
        f["data"][5] ^= 0xFF
    refresh_manifest(damaged)
    with pytest.raises(ImageError, match="damaged record in the source output"):
        _convert(damaged, tmp_path / "out", "pt")
    manifest = convert(damaged, tmp_path / "out", "pt", on_error="skip", progress=False)
    assert len(manifest.skipped) == 1 and "checksum mismatch" in manifest.skipped[0]["reason"]


@pytest.fixture(scope="module")
def raw_outputs(
    originals: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("raw")
    src = Path(open_dataset(originals["pt"]).manifest.source["path"])
    return {fmt: _convert(src, base / fmt, fmt, encoding="raw", size=12) for fmt in FORMATS}


@pytest.mark.parametrize("source", FORMATS)
def test_raw_outputs_as_sources(source: str, raw_outputs: dict[str, Path], tmp_path: Path) -> None:
    """Raw records are pixels whatever wraps them (a WebDataset .npy member): carried over to
    another format's raw records, or encoded to PNG, they are the same pixels."""
    carried = _convert(raw_outputs[source], tmp_path / "carried", "lmdb", encoding="raw", size=12)
    assert _rows(carried) == _rows(raw_outputs[source])
    assert _stored(carried) == _stored(raw_outputs["pt"])  # bare HWC bytes, no wrapping
    png = _convert(raw_outputs[source], tmp_path / "png", "webdataset", encoding="png")
    assert _rows(png)[0] == _rows(raw_outputs[source])[0]


@pytest.mark.parametrize(
    ("fmt", "encoding"),
    [("pt", "png"), ("pt", "raw"), ("tfrecord", "original"), ("tfrecord", "raw"),
     ("webdataset", "png"), ("webdataset", "raw"), ("lmdb", "png"), ("hdf5", "raw")],
)  # fmt: skip
def test_an_outputs_files_scanned_apart_join_into_its_scan(
    fmt: str, encoding: str, tmp_path: Path
) -> None:
    """What a bucket output's scan tasks read of each data file alone (``shard_scan``), joined
    (``ScannedOutput``), is what the whole output's reader gives: labels, stored paths, stored
    sizes (the plan is cut from them) and every field's column, the optional one's gaps too."""
    import torch
    from test_fields_convert import coco_like, write_jsonl

    from imgpack.sources.output.source import ScannedOutput

    src = write_jsonl(tmp_path / "list.jsonl", coco_like(tmp_path, count=13))
    sized = {"size": 8} if encoding == "raw" else {}
    sharded = {"shard_size": "600B"} if fmt in ("pt", "tfrecord", "webdataset") else {}
    convert(src, tmp_path / "out", fmt, encoding=encoding, progress=False, **sized, **sharded)
    ds = open_dataset(tmp_path / "out")
    names = [f.name for f in ds.manifest.fields]
    assert ds.shard_count == (len(ds.manifest.files) if sharded else 1)
    assert not sharded or ds.shard_count > 3
    joined = ScannedOutput(ds.manifest, [ds.shard_scan(k, names) for k in range(ds.shard_count)])
    assert joined.targets == ds.targets
    assert joined.stored_paths() == ds.stored_paths()
    assert joined.stored_sizes().tolist() == ds.stored_sizes().tolist()
    assert joined.stored_sizes().dtype == ds.stored_sizes().dtype
    for name in names:
        mine, theirs = joined.field(name), ds.field(name)
        if isinstance(theirs, torch.Tensor):
            assert isinstance(mine, torch.Tensor) and torch.equal(mine, theirs)
        else:
            plain = [v.tolist() if isinstance(v, torch.Tensor) else v for v in theirs]
            assert [v.tolist() if isinstance(v, torch.Tensor) else v for v in mine] == plain
