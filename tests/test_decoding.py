"""The reader side of the image policy, fast: simplejpeg straight into the batch, decode threads,
decoding to a size, the pooled hand-over from DataLoader workers, and the default-collate path."""

from __future__ import annotations

import gc
import io
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_uniform_folder, jpeg_bytes, png_bytes, smooth_rgb
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset

import imgpack.decoding as decoding
from imgpack import convert, open_dataset
from imgpack.decoding import Decoder, decode_stored, default_threads, draft_scale
from imgpack.errors import DataError, OptionError, PerformanceWarning
from imgpack.images import ImagePolicy, resize_pixels
from imgpack.readers import collate

FORMATS = ("pt", "lmdb", "hdf5", "tfrecord", "webdataset")


def _photo(seed: int, height: int, width: int, gray: bool = False, png: bool = False) -> bytes:
    pixels = smooth_rgb(np.random.default_rng(seed), height, width)
    noise = np.random.default_rng(seed + 1).integers(0, 24, pixels.shape, dtype=np.uint8)
    img = Image.fromarray(pixels + noise)
    if gray:
        img = img.convert("L")
    return png_bytes(img) if png else jpeg_bytes(img)


def _pillow(data: bytes, draft: tuple[int, int] | None = None) -> np.ndarray:
    """An independent decode: Pillow, with ``Image.draft`` for a size (W, H)."""
    with Image.open(io.BytesIO(data)) as img:
        if draft is not None and img.format == "JPEG":
            img.draft(img.mode, draft)
        img.load()
        pixels = np.asarray(img)
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def test_decoding_into_the_batch_gives_the_same_pixels() -> None:
    for data, channels in [
        (_photo(1, 40, 60), 3),
        (_photo(2, 40, 60, gray=True), 3),  # a gray record widened into an RGB batch
        (_photo(3, 40, 60, gray=True), 1),
        (_photo(4, 40, 60, png=True), 3),
    ]:
        expected = _pillow(data)
        if channels == 3 and expected.shape[2] == 1:
            expected = np.repeat(expected, 3, axis=2)
        out = np.zeros((40, 60, channels), np.uint8)
        assert decode_stored(data, channels, out=out) is out
        assert np.array_equal(out, expected)
        assert np.array_equal(decode_stored(data, channels), expected)


@pytest.mark.parametrize("shape", [(375, 500), (101, 77), (64, 64), (33, 500)])
def test_draft_scale_is_pillows(shape: tuple[int, int]) -> None:
    data = _photo(5, *shape)
    for size in [(224, 224), (32, 32), (50, 20), (1, 1), (400, 600)]:
        with Image.open(io.BytesIO(data)) as img:
            img.draft(img.mode, (size[1], size[0]))
            drafted = img.size[::-1]
        scale = draft_scale(*shape, size)
        assert (-(-shape[0] // scale), -(-shape[1] // scale)) == drafted


@pytest.mark.parametrize("resize", ["crop", "stretch"])
@pytest.mark.parametrize("gray", [False, True])
def test_a_size_decodes_jpegs_at_a_reduced_dct_scale_like_pillows_draft(
    resize: str, gray: bool
) -> None:
    """decode_stored(size) = Pillow's draft at the size, then the policy's resize: the pixels a
    user can reproduce with Pillow alone."""
    for shape in [(375, 500), (250, 133), (64, 48)]:
        data = _photo(6, *shape, gray=gray)
        for size in [(32, 32), (60, 40), (100, 150)]:
            policy = ImagePolicy(size=size, resize=resize)
            expected = resize_pixels(_pillow(data, draft=(size[1], size[0])), policy)
            got = decode_stored(data, 1 if gray else 3, policy)
            assert got.shape == (*size, 1 if gray else 3)
            assert np.array_equal(got, expected), (shape, size)
    png = _photo(7, 90, 70, png=True)
    policy = ImagePolicy(size=(30, 30))
    assert np.array_equal(decode_stored(png, 3, policy), resize_pixels(_pillow(png), policy))


def test_threads_decode_the_same_batch_and_name_a_damaged_record() -> None:
    payloads = [_photo(k, 48, 64, gray=k % 5 == 0, png=k % 7 == 0) for k in range(40)]
    one = Decoder(3, threads=1).batch(payloads, lambda k: f"record {k}")
    four = Decoder(3, threads=4).batch(payloads, lambda k: f"record {k}")
    assert isinstance(one, torch.Tensor) and torch.equal(one, four)
    for k in (0, 17, 39):
        expected = _pillow(payloads[k])
        assert np.array_equal(
            one[k].permute(1, 2, 0).numpy(), np.broadcast_to(expected, (48, 64, 3))
        )
    damaged = list(payloads)
    damaged[23] = payloads[23][: len(payloads[23]) // 2]
    for threads in (1, 4):
        with pytest.raises(DataError, match=r"^record 23: cannot decode stored image"):
            Decoder(3, threads=threads).batch(damaged, lambda k: f"record {k}")
    mixed = Decoder(3, threads=3).batch(
        [_photo(1, 20, 30), _photo(2, 30, 20)], lambda k: f"record {k}"
    )
    assert [tuple(t.shape) for t in mixed] == [(3, 20, 30), (3, 30, 20)]


def test_decode_threads_leave_pillows_limits_as_they_were() -> None:
    """Pillow's decompression-bomb limit and LOAD_TRUNCATED_IMAGES are globals that imgpack
    sets for its decodes: threads entering and leaving together must put them back."""
    saved = Image.MAX_IMAGE_PIXELS
    payloads = [_photo(k, 40, 40, png=True) for k in range(64)]

    def work() -> None:
        for _ in range(5):
            Decoder(3, threads=4).batch(payloads, str)

    runners = [threading.Thread(target=work) for _ in range(3)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    assert Image.MAX_IMAGE_PIXELS == saved is not None


def test_decode_threads_must_be_positive(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=6)
    convert(src, tmp_path / "out", "pt", progress=False)
    for bad in (0, -1, 1.5):
        with pytest.raises(OptionError, match="decode_threads"):
            open_dataset(tmp_path / "out", decode_threads=bad)


class _Threads(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return default_threads()


def test_images_under_64x64_decode_in_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default only: an explicit ``decode_threads`` is kept whatever the size."""
    monkeypatch.setattr(decoding, "default_threads", lambda: 4)
    rng = np.random.default_rng(0)
    small = png_bytes(Image.fromarray(smooth_rgb(rng, 32, 48)))
    large = jpeg_bytes(Image.fromarray(smooth_rgb(rng, 80, 80)))
    seen: list[int] = []
    real = decoding.run_threaded
    monkeypatch.setattr(
        decoding,
        "run_threaded",
        lambda n, work, threads: (seen.append(threads), real(n, work, threads)),
    )
    for items, threads in (([small] * 3, None), ([large] * 3, None), ([small] * 3, 2)):
        Decoder(3, threads=threads).batch(items, lambda k: "x")
    assert seen == [1, 4, 2]
    raw = np.zeros((3, 8, 8, 3), np.uint8)
    assert Decoder(3)._default_threads(list(raw)) == 1


def test_workers_take_their_share_of_the_cpus() -> None:
    cpus = decoding.usable_cpus()
    assert default_threads() == cpus
    seen = {int(n) for batch in DataLoader(_Threads(), num_workers=2) for n in batch}
    assert seen == {max(1, cpus // 2)}


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    for k in range(24):
        folder = root / f"class{k % 3}"
        folder.mkdir(exist_ok=True)
        shape = (90, 120) if k % 4 else (77, 101)
        (folder / f"p{k:02d}.jpg").write_bytes(_photo(k, *shape, gray=k % 6 == 0))
    return root


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_resize_on_read(photos: Path, tmp_path: Path, fmt: str) -> None:
    """``size=`` on every reader: encoded records decoded at a reduced scale then resized as
    Pillow's draft + the policy's resize give; raw records resized from their pixels."""
    convert(photos, tmp_path / "jpeg", fmt, progress=False)
    convert(photos, tmp_path / "raw", fmt, encoding="raw", size=(60, 80), progress=False)
    size = (40, 30)
    policy = ImagePolicy(size=size)
    sized = open_dataset(tmp_path / "jpeg", size=size)
    plain = open_dataset(tmp_path / "jpeg")
    images, labels = collate(sized.__getitems__(list(range(len(sized)))))
    assert tuple(images.shape) == (len(sized), 3, *size)
    assert labels.tolist() == plain.targets
    for k, (path, _) in enumerate(plain.samples):
        data = Path(path).read_bytes()
        expected = resize_pixels(_pillow(data, draft=(size[1], size[0])), policy)
        expected = np.broadcast_to(expected, (*size, 3))
        assert np.array_equal(images[k].permute(1, 2, 0).numpy(), expected), path
    raw = open_dataset(tmp_path / "raw")
    raw_sized = raw.with_options(size=size)
    assert raw.decoder.size is None  # with_options copies
    got, _ = collate(raw_sized.__getitems__([0, 5, 9]))
    for row, index in zip(got, [0, 5, 9], strict=True):
        expected = resize_pixels(raw[index][0].permute(1, 2, 0).numpy(), policy)
        assert np.array_equal(row.permute(1, 2, 0).numpy(), expected)
    loader = DataLoader(sized, batch_size=5, num_workers=2, collate_fn=collate)
    assert sum(len(batch) for batch, _ in loader) == len(sized)


@pytest.fixture(scope="module")
def raw_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("raw")
    src = build_uniform_folder(base / "src", count=200, classes=4, size=8)
    out = {}
    for fmt in FORMATS:
        out[fmt] = base / fmt
        convert(src, out[fmt], fmt, encoding="raw", size=8, progress=False)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_torchs_default_collate_reads_the_same_batches(
    raw_outputs: dict[str, Path], fmt: str
) -> None:
    ds = open_dataset(raw_outputs[fmt])
    for workers in (0, 2):
        fast = DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=collate)
        plain = DataLoader(ds, batch_size=32, num_workers=workers)  # torch's default collate
        for (a, la), (b, lb) in zip(fast, plain, strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb)
            assert lb.dtype == torch.int64


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_from_workers_stay_whole_while_later_ones_arrive(
    raw_outputs: dict[str, Path], fmt: str
) -> None:
    """Workers lend pooled shared buffers and reuse them: every batch kept for three epochs
    still holds exactly what a direct read gives."""
    ds = open_dataset(raw_outputs[fmt])
    expected = collate(ds.__getitems__(list(range(len(ds)))))
    loader = DataLoader(
        ds, batch_size=16, num_workers=2, collate_fn=collate, persistent_workers=True
    )
    kept = [batch for _ in range(3) for batch in loader]
    assert len(kept) == 3 * 13
    for step, (images, labels) in enumerate(kept):
        first = (step % 13) * 16
        assert torch.equal(images, expected[0][first : first + 16])
        assert torch.equal(labels, expected[1][first : first + 16])


def test_new_workers_each_epoch_hand_over_correctly(raw_outputs: dict[str, Path]) -> None:
    """Workers that are not persistent start new pools every epoch: the training process
    holds the buffers of live workers only, and every batch is right."""
    import imgpack.handover as handover

    ds = open_dataset(raw_outputs["pt"])
    expected = collate(ds.__getitems__(list(range(len(ds)))))
    loader = DataLoader(ds, batch_size=16, num_workers=2, collate_fn=collate)
    for _ in range(3):
        images, labels = (torch.cat(parts) for parts in zip(*loader, strict=True))
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    assert len(handover._held_pids) <= 4  # this epoch's two pools, perhaps the last one's


def test_a_pooled_buffer_is_lent_again_only_when_every_view_is_gone() -> None:
    """The training process gets views of a worker's buffer; the buffer is lent again only
    once every view is gone, and the pickled bytes of a batch unpickle once."""
    from multiprocessing.reduction import ForkingPickler

    import imgpack.handover as handover

    images = torch.full((4, 3, 8, 8), 7, dtype=torch.uint8)
    batch = handover.Handover(images, torch.arange(4))
    first = ForkingPickler.loads(ForkingPickler.dumps(batch))  # the buffer travels, is held
    assert torch.equal(first[0], images) and first[1].tolist() == [0, 1, 2, 3]
    pointer = first[0].data_ptr()
    view = first[0][1:3]
    del first
    gc.collect()
    images.fill_(9)
    second = ForkingPickler.loads(ForkingPickler.dumps(batch))
    assert second[0].data_ptr() != pointer  # ``view`` still holds the first buffer
    assert (view == 7).all() and (second[0] == 9).all()
    del view
    gc.collect()
    kept = ForkingPickler.dumps(batch)  # the first buffer again, by name
    third = ForkingPickler.loads(kept)
    assert third[0].data_ptr() == pointer and (third[0] == 9).all()
    with pytest.raises(DataError, match="unpickled twice"):
        ForkingPickler.loads(kept)
    assert (second[0] == 9).all() and (third[0] == 9).all()


class _Keeper(Dataset[Any]):
    """Keeps every batch it returns, in the worker, and checks them all at every batch."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds
        self.kept: list[tuple[list[int], torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.ds)

    def __getitems__(self, indices: list[int]) -> Any:
        batch = self.ds.__getitems__(indices)
        self.kept.append((indices, batch.images))
        for old, images in self.kept:
            if not torch.equal(images, self.ds.__getitems__(old).images):
                raise AssertionError(f"a kept batch changed: {old[:3]}...")
        return batch


@pytest.mark.parametrize("fmt", ["pt", "tfrecord"])
def test_batches_kept_or_forwarded_stay_whole(raw_outputs: dict[str, Path], fmt: str) -> None:
    """Batches built in pooled buffers stay right when a worker keeps them (a cache in the
    dataset) and when the training process forwards them to another process (torch copies
    them out of the buffer first), over epochs that reuse the buffers."""
    from multiprocessing.reduction import ForkingPickler

    ds = open_dataset(raw_outputs[fmt])
    expected = collate(ds.__getitems__(list(range(len(ds)))))
    loader = DataLoader(
        _Keeper(ds), batch_size=16, num_workers=2, collate_fn=collate, persistent_workers=True
    )
    forwarded = [ForkingPickler.dumps(images) for _ in range(3) for images, _ in loader]
    for step, data in enumerate(forwarded):
        first = (step % 13) * 16
        assert torch.equal(ForkingPickler.loads(data), expected[0][first : first + 16])


def test_raw_memory_mapped_readers_point_workers_to_tune(raw_outputs: dict[str, Path]) -> None:
    """The loader gives the note (never a read: a plain DataLoader's reads say nothing), and it
    names no worker count of its own (#55): imgpack tune measures it."""
    from imgpack.loading import Loader

    for fmt in ("pt", "lmdb", "hdf5"):
        ds = open_dataset(raw_outputs[fmt])
        assert len(list(Loader(ds, batch_size=16, collate_fn=collate))) == 13  # no note
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            assert len(list(DataLoader(ds, batch_size=16, num_workers=1, collate_fn=collate))) == 13
            loader = Loader(ds, batch_size=16, num_workers=1, collate_fn=collate)
            with pytest.raises(PerformanceWarning, match=r"may cost more .*imgpack tune") as said:
                list(loader)
            assert "num_workers=0" not in str(said.value)
    for fmt in ("tfrecord", "webdataset"):  # read with pread: no note
        loader = Loader(open_dataset(raw_outputs[fmt]), batch_size=16, num_workers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            assert sum(len(b) for b, _ in loader) == 200


@pytest.fixture(scope="module")
def mixed_sizes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Photos of many sizes (gray among them) in every format."""
    base = tmp_path_factory.mktemp("mixed")
    shapes = [(90, 120), (77, 101), (120, 90), (64, 64), (33, 150)]
    for k in range(40):
        folder = base / "src" / f"class{k % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        data = _photo(k, *shapes[k % len(shapes)], gray=k % 7 == 0, png=k % 9 == 0)
        (folder / f"p{k:02d}.{'png' if k % 9 == 0 else 'jpg'}").write_bytes(data)
    out = {}
    for fmt in FORMATS:
        out[fmt] = base / fmt
        convert(base / "src", out[fmt], fmt, progress=False)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_batch_of_different_sizes_is_decoded_into_one_buffer(
    mixed_sizes: dict[str, Path], fmt: str
) -> None:
    """A batch of images of different sizes: each image is decoded into its place in one
    buffer (its own view), with the pixels an independent decode gives, and from DataLoader
    workers the whole batch travels as that one buffer, kept batches staying whole."""
    import imgpack.handover as handover

    ds = open_dataset(mixed_sizes[fmt])
    images, labels = collate(ds.__getitems__(list(range(len(ds)))))
    assert isinstance(images, list) and len({tuple(i.shape) for i in images}) > 1
    assert len({i.untyped_storage().data_ptr() for i in images}) == 1
    for image, (path, _) in zip(images, ds.samples, strict=True):
        expected = np.broadcast_to(_pillow(Path(path).read_bytes()), (*image.shape[1:], 3))
        assert np.array_equal(image.permute(1, 2, 0).numpy(), expected), path
    for workers in (0, 2):
        loader = DataLoader(
            ds,
            batch_size=6,
            num_workers=workers,
            collate_fn=collate,
            persistent_workers=workers > 0,
        )
        kept = []
        for epoch in range(3):
            for batch in loader:
                # While the pools have room (8 buffers a worker; later epochs' batches are all
                # kept, more than that), a batch arrives in a worker's pooled buffer, not in
                # segments of its own.
                if workers and epoch == 0:
                    held = {b.array.ctypes.data for b in handover._held_buffers.values()}
                    address = batch[0][0].untyped_storage().data_ptr() - handover._HEADER
                    assert address in held
                kept.append(batch)
        for step, (got, got_labels) in enumerate(kept):
            first = (step % 7) * 6
            assert len({i.untyped_storage().data_ptr() for i in got}) == 1
            assert got_labels.tolist() == labels[first : first + 6].tolist()
            for a, b in zip(got, images[first : first + 6], strict=True):
                assert torch.equal(a, b)


def test_views_of_a_pooled_buffer_free_it_when_the_last_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list of images of different sizes is handed over as one buffer (copied into it); the
    buffer is lent again only once every received view is gone, and the bytes unpickle once."""
    from multiprocessing.reduction import ForkingPickler

    import imgpack.handover as handover

    monkeypatch.setattr(handover, "_pools", {})  # a pool of its own, whatever ran before

    flat = decoding.new_batch_tensor((10 * 10 * 3 + 4 * 6 * 3,))
    assert flat.numel() == 372
    images = [
        flat[:300].view(10, 10, 3).permute(2, 0, 1),
        flat[300:].view(4, 6, 3).permute(2, 0, 1),
    ]
    flat.fill_(5)
    batch = handover.Handover(images, torch.arange(2))
    first = ForkingPickler.loads(ForkingPickler.dumps(batch))  # the buffer travels, is held
    assert all(torch.equal(a, b) for a, b in zip(first[0], images, strict=True))
    del first
    gc.collect()
    data = ForkingPickler.dumps(batch)  # the same buffer again, by name
    got, labels = ForkingPickler.loads(data)
    assert [tuple(i.shape) for i in got] == [(3, 10, 10), (3, 4, 6)] and labels.tolist() == [0, 1]
    assert len({i.untyped_storage().data_ptr() for i in got}) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, images, strict=True))
    with pytest.raises(DataError, match="unpickled twice"):
        ForkingPickler.loads(data)
    second = got[1]
    del got
    gc.collect()
    assert handover._pool_of(shared=True).buffers[0].header[1] != 0  # ``second`` holds it
    del second
    gc.collect()
    assert handover._pool_of(shared=True).buffers[0].header[1] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_images_read_one_by_one_in_workers_travel_in_their_arenas(
    mixed_sizes: dict[str, Path], fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ds[i]`` in a DataLoader worker decodes into the worker's arena; a batch of such images
    reaches the training process as views of the arenas it spans (images too large for one
    copied into a free buffer), each image the one ``ds[i]`` gives here, batches kept over
    epochs that reuse the buffers staying whole."""
    import imgpack.handover as handover

    # Small arenas (the forked workers inherit this): a batch spans several, and images over a
    # quarter of one are decoded elsewhere and copied.
    monkeypatch.setattr(handover, "ARENA_BYTES", 64 << 10)
    ds = open_dataset(mixed_sizes[fmt])
    expected = [ds[i] for i in range(len(ds))]
    assert any(img.numel() > (16 << 10) for img, _ in expected)
    assert any(img.numel() <= (16 << 10) for img, _ in expected)
    one_by_one = ConcatDataset([ds])  # no __getitems__: DataLoader reads ds[i] one at a time
    loader = DataLoader(
        one_by_one, batch_size=6, num_workers=2, collate_fn=collate, persistent_workers=True
    )
    kept = []
    for _ in range(3):
        for batch in loader:
            if not kept:  # the pools have room: every image in a worker's buffer
                held = {b.array.ctypes.data for b in handover._held_buffers.values()}
                starts = {img.untyped_storage().data_ptr() - handover._HEADER for img in batch[0]}
                assert starts <= held and len(starts) > 1
            kept.append(batch)
    assert len(kept) == 21
    for step, (got, labels) in enumerate(kept):
        first = (step % 7) * 6
        wanted = expected[first : first + 6]
        assert labels.tolist() == [label for _, label in wanted]
        for image, (image_here, _) in zip(got, wanted, strict=True):
            assert torch.equal(image, image_here)
