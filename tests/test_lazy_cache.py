"""Reading an output larger than the cache from a bucket (moto's S3 server on 127.0.0.1):
opening fetches no data file, each shard is fetched when first read and checked, the cache
stays within its limit plus the shards in use, and a shard damaged in the bucket is named at
first use while one damaged in the cache is fetched again."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import fsspec
import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder
from torch.utils.data import DataLoader

import imgpack.storage.files as storage_files
import imgpack.storage.lazy as lazy_module
from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.errors import StorageError
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate
from imgpack.storage.cache import stats as cache_stats
from imgpack.storage.lazy import cached_files

#: 96 images in 16 shards: sharded formats only (lmdb and hdf5 are one file, fetched whole).
SHARDS = 16


def _output(s3: str, tmp_path: Path, fmt: str, raw: bool = False) -> tuple[str, Path]:
    src = build_uniform_folder(tmp_path / "src", count=96, classes=4, size=12, seed=3)
    local = tmp_path / "local"
    options = {"encoding": "raw", "size": 12} if fmt == "pt" or raw else {}
    convert(src, local, fmt, progress=False, **options)  # its shard size, to get 16 shards
    per_shard = sum(f.bytes for f in open_dataset(local).manifest.files) // SHARDS
    url = f"{s3}/lazy-{fmt}-{tmp_path.name}"
    # Uploaded as it is: a conversion to the bucket cuts its shards by the source's bytes.
    convert(src, local, fmt, progress=False, shard_size=per_shard, overwrite=True, **options)
    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    return url, local


def _rows(batches: object) -> Counter[tuple[int, str]]:
    found: Counter[tuple[int, str]] = Counter()
    for images, labels in batches:  # type: ignore[attr-defined]
        for image, label in zip(images, labels, strict=True):
            found[(int(label), hashlib.sha256(image.numpy().tobytes()).hexdigest())] += 1
    return found


def _data_bytes(cache: Path) -> int:
    return sum(size for _, _, size in cached_files(cache))


def test_the_readers_of_a_process_fetch_through_one_client(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every lazy reader of a process fetches through one filesystem, one client (making one
    loads the store's service model and TLS context again: about 0.15 s of CPU, as much as
    fetching 20 MB); a forked child makes its own, and so does the parent after the fork."""
    url, local = _output(s3, tmp_path, "pt")
    made: list[object] = []
    real = lazy_module.filesystem

    def counting(*args: object, **kwargs: object) -> tuple[object, str]:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("fresh"):
            made.append(found[0])
        return found

    monkeypatch.setattr(lazy_module, "filesystem", counting)
    expected = open_dataset(local)
    readers = [open_dataset(url, cache_dir=tmp_path / f"cache{i}") for i in range(3)]
    for i, ds in enumerate(readers):  # each reader fetches a shard into its own cache
        assert ds[i * 10][1] == expected[i * 10][1]
        assert ds[i * 10][0].equal(expected[i * 10][0])
    assert len(made) == 1
    reading, said = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit status says it
        try:
            same = readers[0][50][0].equal(expected[50][0])
            os.write(said, f"{int(same)} {len(made)}".encode())
        finally:
            os._exit(0)
    os.close(said)
    assert os.waitpid(child, 0)[1] == 0
    assert os.read(reading, 64).decode() == "1 2"  # read right, through a client of its own
    assert readers[1][60][0].equal(expected[60][0])
    assert len(made) == 2 and made[1] is not made[0]  # the parent's own, after the fork
    for ds in readers:
        ds.release_files()


def test_a_reader_alive_at_exit_lets_its_pins_go_quietly(s3: str, tmp_path: Path) -> None:
    """A script that ends (here with a user's error) while a reader still pins cache files
    says only its error: the pins are let go as the interpreter clears its modules, without an
    "Exception ignored" traceback."""
    url, _ = _output(s3, tmp_path, "pt")
    script = (
        "from imgpack import open_dataset\n"
        f"ds = open_dataset({url!r}, cache_dir={str(tmp_path / 'cache')!r})\n"
        "ds[0]\n"
        "raise SystemExit('the script stops here')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "the script stops here"


@pytest.mark.parametrize(
    ("fmt", "batched"),
    [("pt", False), ("webdataset", False), ("tfrecord", False), ("webdataset", True)],
)
def test_an_epoch_through_a_cache_four_times_smaller(
    s3: str, tmp_path: Path, fmt: str, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, local = _output(s3, tmp_path, fmt)
    cache = tmp_path / "cache"
    files = open_dataset(local).manifest.files
    assert len(files) == SHARDS
    total = sum(f.bytes for f in files)

    def loader(ds: object) -> Loader:
        sampler = ShardSampler(ds, seed=1, window=1)  # type: ignore[arg-type]
        if batched:  # the sampler's batches fetch ahead as its positions do
            return Loader(ds, batch_sampler=sampler.batches(4), num_workers=2, collate_fn=collate)
        return Loader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate)

    # What a node holds at once (the sampler's order, the batches the workers hold ahead):
    # the least limit; a quarter of the output when that is more.
    sizing = open_dataset(url, cache_dir=tmp_path / "sizing", cache_limit="1GB", prefetch=1)
    need = loader(sizing).batch_sampler.sampler.working_set()  # type: ignore[attr-defined]
    assert need is not None and need < total
    limit = max(total // 4, need)
    before = cache_stats.downloads
    ds = open_dataset(url, cache_dir=cache, cache_limit=limit, prefetch=1)
    indexed = fmt != "pt"  # webdataset and tfrecord shards have an .idx each, fetched at open
    assert cache_stats.downloads - before == (SHARDS if indexed else 0)
    assert _data_bytes(cache) == 0  # opening fetched no data file
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _data_bytes(cache))
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = _rows(loader(ds))
    finally:
        done.set()
        watcher.join()
    reference = open_dataset(local)
    want = _rows(DataLoader(reference, batch_size=8, collate_fn=collate))
    assert got == want  # every sample once, with its label and pixels
    assert 0 < peak[0] <= limit, (peak[0], limit)  # everything counted, within the limit
    assert _data_bytes(cache) <= limit


def test_a_batch_fetches_and_opens_each_of_its_shards_once(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that touches more shards than a reader keeps pinned (ShardSampler's batches
    that span two windows do) holds them all until it is gathered: the raw checks and the
    gather do not fetch and open them twice; older ones are let go after the batch."""
    url, local = _output(s3, tmp_path, "pt")
    monkeypatch.setattr(storage_files, "PINNED_FILES", 2)
    ds = open_dataset(url, cache_dir=tmp_path / "cache", prefetch=0)
    loads: Counter[int] = Counter()
    real = type(ds)._load

    def counted(self: object, number: int) -> object:
        loads[number] += 1
        return real(self, number)

    monkeypatch.setattr(type(ds), "_load", counted)
    counts = [f.num_samples for f in ds.manifest.files]
    firsts = [sum(counts[:k]) for k in range(6)]  # one sample of each of 6 shards
    before = cache_stats.downloads
    images, labels = collate(ds.__getitems__(firsts))  # checks each record once, then gathers
    assert loads == Counter(range(6)) and cache_stats.downloads - before == 6
    assert len(ds._here().files.pins) == 2  # the batch is read: the older shards are let go
    reference = open_dataset(local)
    for row, index in enumerate(firsts):
        assert labels[row] == reference[index][1]
        assert bool((images[row] == reference[index][0]).all())


def test_two_ranks_read_every_sample_once(s3: str, tmp_path: Path) -> None:
    url, local = _output(s3, tmp_path, "webdataset")
    cache = tmp_path / "cache"
    counts, seen = [], Counter[tuple[int, str]]()
    for rank in range(2):
        ds = open_dataset(url, cache_dir=cache, cache_limit="200KB", prefetch=1)
        sampler = ShardSampler(ds, seed=5, window=2, num_replicas=2, rank=rank)
        rows = _rows(
            DataLoader(ds, batch_size=5, sampler=sampler, num_workers=2, collate_fn=collate)
        )
        counts.append(sum(rows.values()))
        seen.update(rows)
    assert counts == [48, 48]
    assert seen == _rows(DataLoader(open_dataset(local), batch_size=8, collate_fn=collate))


@pytest.mark.parametrize("fmt", ["pt", "tfrecord"])
def test_a_shard_damaged_in_the_bucket_is_named_at_first_use(
    s3: str, tmp_path: Path, fmt: str
) -> None:
    url, local = _output(s3, tmp_path, fmt)
    name = open_dataset(local).manifest.files[3].path
    fs = fsspec.filesystem("s3")
    key = f"{url.removeprefix('s3://')}/{name}"
    data = bytearray(fs.cat_file(key))
    data[-20] ^= 0xFF
    fs.pipe(key, bytes(data))
    ds = open_dataset(url, cache_dir=tmp_path / "cache")  # opens: the manifest is fine
    assert ds[0][1] in range(4)  # shard 0 reads
    bad = sum(f.num_samples for f in ds.manifest.files[:3])
    with pytest.raises(StorageError, match=rf"{name}: the stored file is not what"):
        ds[bad]


def test_a_shard_damaged_in_the_cache_is_fetched_again(s3: str, tmp_path: Path) -> None:
    url, local = _output(s3, tmp_path, "webdataset")
    cache = tmp_path / "cache"
    first = open_dataset(url, cache_dir=cache)
    want = first[10]
    first.release_files()
    counts = [f.num_samples for f in first.manifest.files]
    holder = next(k for k in range(len(counts)) if sum(counts[: k + 1]) > 10)  # sample 10's shard
    shard = first.root / first.manifest.files[holder].path
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF
    shard.write_bytes(bytes(data))
    refetched = cache_stats.refetched
    again = open_dataset(url, cache_dir=cache)
    got = [again[i] for i in range(len(again))]
    assert cache_stats.refetched == refetched + 1
    reference = open_dataset(local)
    for i, (image, label) in enumerate(got):
        assert label == reference[i][1] and bool((image == reference[i][0]).all()), i
    assert bool((got[10][0] == want[0]).all())


@pytest.mark.parametrize("fmt", ["pt", "webdataset", "tfrecord"])
def test_a_shard_fetched_here_is_not_checked_again_record_by_record(
    s3: str, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw record is checked against its checksum the first time a reader reads it, unless
    this process fetched its shard just now: the fetch checked the whole file against the
    manifest's sha256. A copy found in the cache (fetched earlier, maybe damaged on disk since)
    is checked record by record, as a local output is."""
    import imgpack.formats.checking as checking
    import imgpack.formats.tfrecord.reader as tfrecord_reader

    url, local = _output(s3, tmp_path, fmt, raw=True)
    checked: list[int] = []
    intact, crcs_match = checking.records_intact, tfrecord_reader.data_crcs_match

    def counting(rows: object, labels: object, crcs: object) -> bool:
        checked.append(len(labels))  # type: ignore[arg-type]
        return intact(rows, labels, crcs)  # type: ignore[arg-type]

    def counting_crcs(mapped: object, data: object, offsets: object, sizes: object) -> object:
        checked.append(len(offsets))  # type: ignore[arg-type]
        return crcs_match(mapped, data, offsets, sizes)  # type: ignore[arg-type]

    monkeypatch.setattr(checking, "records_intact", counting)
    monkeypatch.setattr(tfrecord_reader, "data_crcs_match", counting_crcs)
    reference = open_dataset(local)
    n = len(reference)
    images, labels = collate(reference.__getitems__(list(range(n))))
    assert sum(checked) == n  # a local output: every record checked on its first read
    for fresh_cache in (True, False):  # fetched by this reader, then found in the cache
        checked.clear()
        ds = open_dataset(url, cache_dir=tmp_path / "cache")
        order = list(range(n))[::-1]
        got_images, got_labels = collate(ds.__getitems__(order))
        assert sum(checked) == (0 if fresh_cache else n), fresh_cache
        assert bool((got_images == images[order]).all())
        assert got_labels.tolist() == labels[order].tolist()
        assert bool(ds.checks.marks().all())  # type: ignore[union-attr]
        ds.release_files()


@pytest.mark.parametrize("batched", [False, True])
def test_the_sampler_has_the_next_shards_fetched_ahead(
    s3: str, tmp_path: Path, batched: bool
) -> None:
    """While shard k is read, the next shards in the sampler's order are fetched in the
    background (ReadOptions.prefetch of them), before the reader asks."""
    import time

    url, _ = _output(s3, tmp_path, "webdataset")
    cache = tmp_path / "cache"
    ds = open_dataset(url, cache_dir=cache, prefetch=3)
    sampler = ShardSampler(ds, shuffle=False)
    # the sampler is at shard 0 (its first position, or its first batch): 1, 2, 3 are named
    first = int(next(iter(sampler.batches(2)))[0]) if batched else next(iter(sampler))
    assert first == 0
    deadline = time.monotonic() + 20
    names = {f.path for f in ds.manifest.files[1:4]}
    while time.monotonic() < deadline:
        fetched = {path.name for _, path, _ in cached_files(cache)}
        if names <= fetched:
            break
        time.sleep(0.05)
    assert fetched == names  # fetched ahead, nothing else (shard 0 is read when asked for)
    ds[first]
    assert ds.manifest.files[0].path in {path.name for _, path, _ in cached_files(cache)}
    ds.release_files()


def test_export_reads_through_a_bounded_cache(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``imgpack export URL FOLDER --cache-limit``: the shards are fetched as the export
    reaches them and the cache stays within the limit plus the shards the reader pins."""
    url, local = _output(s3, tmp_path, "pt")
    files = open_dataset(local).manifest.files
    total, biggest = sum(f.bytes for f in files), max(f.bytes for f in files)
    monkeypatch.setattr(storage_files, "PINNED_FILES", 2)
    cache = tmp_path / "cache"
    runner = CliRunner()
    bad = runner.invoke(main, ["export", url, str(tmp_path / "x"), "--cache-limit", "lots"])
    assert bad.exit_code == 2 and "invalid --cache-limit 'lots'" in bad.output
    args = ["export", url, str(tmp_path / "bucket-export"), "-q", "--cache-dir", str(cache)]
    done = runner.invoke(main, [*args, "--cache-limit", str(total // 4)])
    assert done.exit_code == 0, done.output
    assert 0 < _data_bytes(cache) <= total // 4 + 2 * biggest
    assert (
        runner.invoke(main, ["export", str(local), str(tmp_path / "local-export"), "-q"]).exit_code
        == 0
    )

    def tree(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}

    assert tree(tmp_path / "bucket-export") == tree(tmp_path / "local-export")
    assert len(tree(tmp_path / "local-export")) == 96


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_a_one_file_output_above_the_cache_limit_is_refused_before_fetching(
    s3: str, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lmdb and hdf5 are one file each, fetched whole: a cache limit below it is refused in one
    line naming both sizes, before anything is downloaded (the limit was passed silently);
    at or above it the output reads."""
    from imgpack.errors import OptionError
    from imgpack.readers import reader_class

    local = tmp_path / "local"
    convert(build_uniform_folder(tmp_path / "src", count=24, size=12), local, fmt, progress=False)
    url = f"{s3}/whole-{fmt}-{tmp_path.name}"
    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    cache = tmp_path / "cache"
    before = cache_stats.downloads
    with pytest.raises(OptionError, match=f"a {fmt} output is fetched whole .* cache limit"):
        open_dataset(url, cache_dir=cache, cache_limit="1KB")
    with pytest.raises(OptionError, match="more than the cache limit"):
        reader_class(fmt)(url, cache_dir=cache, cache_limit="1KB")
    monkeypatch.setenv("IMGPACK_CACHE_LIMIT", "1KB")
    with pytest.raises(OptionError, match="IMGPACK_CACHE_LIMIT"):
        open_dataset(url, cache_dir=cache)
    result = CliRunner().invoke(main, ["bench", url, "--workers", "0", "--samples", "8",
                                       "--cache-dir", str(cache)])  # fmt: skip
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert result.exit_code == 2 and len(errors) == 1 and "more than the cache limit" in errors[0]
    assert cache_stats.downloads == before and not list(cache.rglob("data.*"))
    monkeypatch.delenv("IMGPACK_CACHE_LIMIT")
    assert len(open_dataset(url, cache_dir=cache, cache_limit="1GB")) == len(open_dataset(local))


def test_records_marked_by_workers_and_a_resume_across_ranks_read_exactly(
    s3: str, tmp_path: Path
) -> None:
    """Two ranks, each with 2 DataLoader workers, read part of an epoch of a raw output from a
    fresh cache: the records the workers read are marked checked in the bitmap the parent
    shares with them (fetched there, or checked there). Their states, saved with workers, are
    resumed by new readers with 2 workers on the same cache: every sample once, as stored."""
    url, local = _output(s3, tmp_path, "webdataset", raw=True)
    reference = open_dataset(local)
    every = _rows(
        [collate(reference.__getitems__(list(range(len(reference)))))]  # type: ignore[list-item]
    )

    def loaders() -> list[tuple[object, Loader]]:
        made = []
        for rank in range(2):
            ds = open_dataset(url, cache_dir=tmp_path / "cache")
            sampler = ShardSampler(ds, seed=2, num_replicas=2, rank=rank, window=2)
            made.append(
                (ds, Loader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate))
            )
        return made

    first, states, seen = loaders(), [], Counter()  # type: ignore[var-annotated]
    for rank, (ds, loader) in enumerate(first):
        # The positions it reads first, as a sampler of the same arguments deals them.
        read = list(ShardSampler(ds, seed=2, num_replicas=2, rank=rank, window=2))[:20]  # type: ignore[arg-type]
        batches = iter(loader)
        taken = [next(batches) for _ in range(5)]
        seen += _rows(taken)
        states.append(loader.state_dict())
        marks = ds.checks.marks()  # type: ignore[attr-defined]
        assert marks is not None and bool(marks[read].all())  # set in the workers, seen here
        del batches
    for (_, loader), state in zip(loaders(), states, strict=True):
        loader.load_state_dict(state)
        seen += _rows(loader)
    assert seen == every
