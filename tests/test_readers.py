from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from conftest import build_uniform_folder, refresh_manifest
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from imgpack import convert, formats, open_dataset
from imgpack.converters import FORMATS
from imgpack.errors import DataError, OptionError
from imgpack.readers import Batch, ImageDataset, collate


@pytest.fixture(params=FORMATS)
def outputs(
    request: pytest.FixtureRequest, uniform_folder: Path, tmp_path: Path
) -> dict[str, Path]:
    fmt = request.param
    raw, enc = tmp_path / f"{fmt}-raw", tmp_path / f"{fmt}-png"
    # several shards where the format has them, so batches cross shard boundaries
    shards = {"shard_size": 16 * 16 * 3 * 25} if formats.get(fmt).sharded else {}
    convert(uniform_folder, raw, fmt, encoding="raw", size=16, progress=False, **shards)
    convert(uniform_folder, enc, fmt, encoding="png", progress=False)
    return {"raw": raw, "png": enc}


def all_samples(ds: ImageDataset) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.tensor(
        [ds[i][1] for i in range(len(ds))]
    )


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_under_each_start_method(outputs: dict[str, Path], method: str) -> None:
    for path in outputs.values():
        ds = open_dataset(path)
        images, labels = all_samples(ds)
        loader = DataLoader(
            ds, batch_size=7, num_workers=2, multiprocessing_context=method, collate_fn=collate
        )
        got = list(loader)
        assert torch.equal(torch.cat([b[0] for b in got]), images)
        assert torch.equal(torch.cat([b[1] for b in got]), labels)


def test_default_collate_accepts_a_batch(outputs: dict[str, Path]) -> None:
    for path in outputs.values():
        ds = open_dataset(path)
        loader = DataLoader(
            ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        images, labels = next(iter(loader))
        assert images.shape == (8, 3, 16, 16) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64
        batch = ds.__getitems__([3, 1, 2])
        assert isinstance(batch, Batch)
        ref_images, ref_labels = default_collate(batch)
        fast_images, fast_labels = collate(batch)
        assert torch.equal(ref_images, fast_images) and torch.equal(ref_labels, fast_labels)


def test_shuffled_loader_sees_every_sample_once(outputs: dict[str, Path]) -> None:
    ds = open_dataset(outputs["raw"])
    images, _ = all_samples(ds)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, collate_fn=collate)
    seen = torch.cat([b[0] for b in loader])
    key = lambda t: sorted(x.flatten().tolist()[:12] for x in t)  # noqa: E731
    assert key(seen) == key(images)


def test_pickle_round_trip_after_use(outputs: dict[str, Path]) -> None:
    for path in outputs.values():
        ds = open_dataset(path)
        first = ds[0]
        clone = pickle.loads(pickle.dumps(ds))
        assert clone._proc is None  # nothing of this process travels
        assert torch.equal(clone[0][0], first[0]) and clone[0][1] == first[1]


def test_transforms_apply_per_sample(outputs: dict[str, Path]) -> None:
    ds = open_dataset(
        outputs["raw"], transform=lambda x: x.float() / 255, target_transform=lambda y: y + 100
    )
    image, label = ds[2]
    assert image.dtype == torch.float32 and label >= 100
    images, labels = collate(ds.__getitems__([0, 1]))
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32
    assert labels.tolist() == [ds[0][1], ds[1][1]]


def test_index_errors(outputs: dict[str, Path]) -> None:
    ds = open_dataset(outputs["raw"])
    with pytest.raises(IndexError, match="index 60 is out of range"):
        ds[60]
    with pytest.raises(IndexError):
        ds.__getitems__([0, -61])
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])


def test_damaged_pt_shard_is_reported(uniform_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert(uniform_folder, dst, "pt", encoding="raw", size=16, progress=False)
    shard = dst / "shard-00000.pt"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(DataError, match=r"shard-00000\.pt: \d+ bytes, the manifest says \d+"):
        open_dataset(dst)
    # A shard of the right size that is not a torch file is refused when loaded.
    shard.write_bytes(bytes(len(data)))
    ds = open_dataset(dst)
    with pytest.raises(DataError, match=r"shard-00000\.pt: cannot load shard"):
        ds[0]


def test_corrupt_encoded_record_names_file_and_sample(uniform_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    convert(uniform_folder, dst, "pt", encoding="png", progress=False)
    shard = torch.load(dst / "shard-00000.pt", weights_only=True)
    start = int(shard["offsets"][4])
    shard["data"][start + 20 : start + 60] = 7
    torch.save(shard, dst / "shard-00000.pt")
    refresh_manifest(dst)
    ds = open_dataset(dst)
    with pytest.raises(
        DataError,
        match=r"shard-00000.pt: sample 4 \(source class0/img0012.png\): checksum mismatch",
    ):
        ds[4]
    assert ds[3][0].shape == (3, 16, 16)
    # Without the check, the damage is found by the decoder, which names the sample too.
    unchecked = open_dataset(dst, verify=False)
    with pytest.raises(DataError, match=r"shard-00000.pt: sample 4: cannot decode"):
        unchecked[4]


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_options_are_one_object_for_every_format(fmt: str, tmp_path: Path) -> None:
    """ReadOptions gives the common reader options the same way to every format; keywords and
    options= together are refused."""
    from imgpack.readers import ReadOptions

    src = build_uniform_folder(tmp_path / "src", count=6, classes=2, size=12)
    convert(src, tmp_path / "out", fmt, progress=False)
    options = ReadOptions(size=8, target_transform=lambda t: t + 10, verify=True)
    ds = open_dataset(tmp_path / "out", options=options)
    image, label = ds[0]
    assert tuple(image.shape) == (3, 8, 8) and label == 10 and ds.verify
    assert ds.options is options
    assert ds.with_options(size=4).options.size == 4 and ds.options.size == 8
    with pytest.raises(OptionError, match="give either options= or the keyword"):
        open_dataset(tmp_path / "out", options=options, size=4)


#: Shard sizes that give a raw 8x8 output a few samples per shard, or dozens.
SHARD_SIZES = {("pt", "few"): "2KB", ("pt", "many"): "16KB"}
SHARD_SIZES |= {("webdataset", "few"): "12KB", ("webdataset", "many"): "160KB"}
SHARD_SIZES |= {("tfrecord", "few"): "3KB", ("tfrecord", "many"): "20KB"}


@pytest.mark.parametrize("fmt", ["pt", "webdataset", "tfrecord"])
@pytest.mark.parametrize("per_shard", ["few", "many"])
@pytest.mark.parametrize("verify", [None, False])
def test_raw_batches_across_many_shards_equal_a_one_shard_output(
    fmt: str, per_shard: str, verify: bool | None, tmp_path: Path
) -> None:
    """A raw batch that touches several shards (a few rows of each, or dozens) holds the same
    pixels and labels, in batch order, as the same batch read from a one-shard output of the
    same images."""
    import numpy as np

    shard_size = SHARD_SIZES[(fmt, per_shard)]

    src = build_uniform_folder(tmp_path / "src", count=120, classes=3, size=8)
    options = {"encoding": "raw", "size": 8, "progress": False}
    convert(src, tmp_path / "many", fmt, shard_size=shard_size, **options)  # type: ignore[arg-type]
    convert(src, tmp_path / "one", fmt, **options)  # type: ignore[arg-type]
    many = open_dataset(tmp_path / "many", verify=verify)
    one = open_dataset(tmp_path / "one", verify=verify)
    counts = [f.num_samples for f in many.manifest.files]
    assert len(counts) > 1 and len(one.manifest.files) == 1
    assert max(counts) >= 32 if per_shard == "many" else max(counts) < 32, counts
    rng = np.random.default_rng(1)
    order = rng.permutation(120).tolist()
    # mostly one shard, a few rows of others (gathered whole from that shard, then put over)
    first = rng.permutation([*range(counts[0]), 119, 118, counts[0]]).tolist()
    for batch in (order[:64], order[64:], list(range(50, 110)), [7, 7, 119, 0, 7], [3], first):
        for _ in range(2):  # a first read (checked as gathered) and a later one
            got = collate(many.__getitems__(batch))
            want = collate(one.__getitems__(batch))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), batch


@pytest.mark.parametrize("fmt", ["pt", "webdataset", "tfrecord"])
def test_raw_batches_across_shards_read_alike_in_dataloader_workers(
    fmt: str, tmp_path: Path
) -> None:
    """Each forked worker gathers from the shards it maps itself: the batches two workers hand
    back are the ones a one-shard output of the same images gives, in order."""
    import numpy as np
    from torch.utils.data import DataLoader

    src = build_uniform_folder(tmp_path / "src", count=120, classes=3, size=8)
    options = {"encoding": "raw", "size": 8, "progress": False}
    small = SHARD_SIZES[(fmt, "few")]
    convert(src, tmp_path / "many", fmt, shard_size=small, **options)  # type: ignore[arg-type]
    convert(src, tmp_path / "one", fmt, **options)  # type: ignore[arg-type]
    many, one = open_dataset(tmp_path / "many"), open_dataset(tmp_path / "one")
    assert len(many.manifest.files) > 2
    order = np.random.default_rng(2).permutation(120)
    batches = [order[k : k + 24].tolist() for k in range(0, 120, 24)]
    loader = DataLoader(many, batch_sampler=batches, num_workers=2, collate_fn=collate)
    for (images, labels), batch in zip(loader, batches, strict=True):
        want_images, want_labels = collate(one.__getitems__(batch))
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
