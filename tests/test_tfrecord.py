"""What is particular to the tfrecord format: framing, the Example codec, indexes, files written
by TensorFlow itself, corruption, and the stream reader's split across workers and ranks."""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import shutil
import zlib
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import simplejpeg
import torch
from click.testing import CliRunner
from conftest import traced
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.errors import DataError, ManifestError
from imgpack.formats.tfrecord import example as tfexample
from imgpack.formats.tfrecord import framing as tfrecord
from imgpack.images import ImagePolicy, apply_policy
from imgpack.readers import TFRecordDataset, TFRecordStream, collate
from imgpack.sources.folder.scan import scan_folder

DATA = Path(__file__).parent / "data"
EXPECTED = json.loads((DATA / "tensorflow-written.expected.json").read_text())


# -- framing and CRC ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "crc"),
    [
        # CRC-32C test vectors (RFC 3720 B.4), also in TensorFlow's crc32c_test.cc
        (bytes(32), 0x8A9136AA),
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
        (bytes(range(31, -1, -1)), 0x113FDB5C),
        (b"123456789", 0xE3069283),
    ],
)
def test_crc32c_vectors(data: bytes, crc: int) -> None:
    assert tfrecord.crc32c(data) == crc


def test_masking_as_tensorflow_defines_it() -> None:
    crc = tfrecord.crc32c(b"foo")
    masked = tfrecord.masked_crc32c(b"foo")
    assert masked != crc
    rot = (masked - tfrecord.MASK_DELTA) & 0xFFFFFFFF
    assert ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF == crc  # TensorFlow's Unmask


def test_frame_round_trip_and_layout() -> None:
    framed = tfrecord.frame(b"hello")
    assert framed[:8] == (5).to_bytes(8, "little")
    assert framed[8:12] == tfrecord.masked_crc32c(framed[:8]).to_bytes(4, "little")
    assert framed[12:17] == b"hello"
    assert framed[17:] == tfrecord.masked_crc32c(b"hello").to_bytes(4, "little")
    assert bytes(tfrecord.unframe(framed, "x")) == b"hello"


# -- the Example codec ------------------------------------------------------------------------
def test_example_round_trip() -> None:
    features = {
        "b": [b"", b"\x00\x01bytes with NUL"],
        "i": [0, 1, -1, 2**40, -(2**63)],
        "f": [0.5, -2.25],
        "empty": [],
    }
    decoded = tfexample.decode_example(tfexample.encode_example(features))
    assert decoded == {**features, "empty": []}


def test_example_decoder_accepts_unpacked_lists() -> None:
    # Int64List with two unpacked values (tag 0x08 each), as older writers produce.
    int64_list = b"\x08\x05\x08\x07"
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    entry = b"\x0a\x01k" + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    example = b"\x0a" + bytes([len(features)]) + features
    assert tfexample.decode_example(example) == {"k": [5, 7]}


@pytest.mark.parametrize(
    "data",
    [b"\x0a\x05\x0a", b"\x0a\x02\x0a\xff", b"\x0a\x03\x0a\x01", b"\x0b", b"\x0a\x80"],
)
def test_example_decoder_refuses_damaged_bytes(data: bytes) -> None:
    with pytest.raises(DataError, match="Example"):
        tfexample.decode_example(data)


@functools.cache
def _protobuf_example() -> type:
    """``tf.train.Example`` as a protobuf message class, built from its schema (the one in
    imgpack's codec) by the protobuf library: an Example coder independent of imgpack's."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="example.proto", package="t", syntax="proto3")
    repeated = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    optional = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    kinds = descriptor_pb2.FieldDescriptorProto

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        msg = proto.message_type.add(name=name)
        for field, number, label, kind, type_name in fields:
            added = msg.field.add(name=field, number=number, label=label, type=kind)
            if type_name:
                added.type_name = type_name

    message("BytesList", ("value", 1, repeated, kinds.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, repeated, kinds.TYPE_FLOAT, ""))
    message("Int64List", ("value", 1, repeated, kinds.TYPE_INT64, ""))
    message(
        "Feature",
        ("bytes_list", 1, optional, kinds.TYPE_MESSAGE, ".t.BytesList"),
        ("float_list", 2, optional, kinds.TYPE_MESSAGE, ".t.FloatList"),
        ("int64_list", 3, optional, kinds.TYPE_MESSAGE, ".t.Int64List"),
    )
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=optional, type=kinds.TYPE_STRING)
    entry.field.add(
        name="value", number=2, label=optional, type=kinds.TYPE_MESSAGE, type_name=".t.Feature"
    )
    features.field.add(
        name="feature",
        number=1,
        label=repeated,
        type=kinds.TYPE_MESSAGE,
        type_name=".t.Features.FeatureEntry",
    )
    message("Example", ("features", 1, optional, kinds.TYPE_MESSAGE, ".t.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Example"))


_values = st.one_of(
    st.lists(st.binary(max_size=300), max_size=3).map(lambda v: ("bytes_list", v)),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(lambda v: ("int64_list", v)),
    st.lists(st.floats(width=32, allow_nan=False), max_size=4).map(lambda v: ("float_list", v)),
)


@settings(max_examples=300, deadline=None)
@given(features=st.dictionaries(st.text(max_size=140), _values, max_size=6), cut=st.data())
def test_example_decoder_reads_what_protobuf_writes(features: dict, cut: st.DataObject) -> None:
    # The decoder (one-byte tags and lengths read inline) against Examples serialized by the
    # protobuf library: the same features, lengths of one byte and more (keys and values
    # around 128 bytes); every truncation of one is refused as a damaged Example.
    example_class = _protobuf_example()
    message = example_class()
    for key, (kind, values) in features.items():
        getattr(message.features.feature[key], kind).value.extend(values)
    data = message.SerializeToString()
    assert tfexample.decode_example(data) == {k: v for k, (_, v) in features.items()}
    if data:
        end = cut.draw(st.integers(0, len(data) - 1))
        try:
            example_class.FromString(data[:end])
        except Exception:  # protobuf refuses it too: so must imgpack
            with pytest.raises(DataError, match="Example"):
                tfexample.decode_example(data[:end])


# -- files written by TensorFlow ------------------------------------------------------------
def _tf_records(name: str) -> list[dict[str, tfexample.FeatureValue]]:
    with tfrecord.open_records(DATA / name) as fh:
        return [tfexample.decode_example(data) for _, data in tfrecord.iter_frames(fh, name)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_tensorflow_written_files_match_what_tensorflow_reads(name: str) -> None:
    expected = EXPECTED[name]
    records = _tf_records(name)
    assert len(records) == expected["num_records"]
    for got, want in zip(records, expected["records"], strict=True):
        encoded = got["image/encoded"][0]
        assert isinstance(encoded, bytes)
        assert len(encoded) == want["image/encoded.bytes"]
        assert hashlib.sha256(encoded).hexdigest() == want["image/encoded.sha256"]
        for key in ("image/class/label", "image/height", "image/width"):
            assert got[key] == want[key], key
        for key in ("image/format", "image/filename"):
            assert [v.decode() for v in got[key]] == want[key], key  # type: ignore[union-attr]
        # TensorFlow's decode: no EXIF rotation, channels as stored; for JPEG, libjpeg-turbo
        # with the fast integer DCT (TensorFlow's default) and fancy upsampling, which
        # simplejpeg exposes and Pillow does not.
        if want["image/format"] == ["JPEG"]:
            pixels = simplejpeg.decode_jpeg(
                encoded, colorspace="RGB", fastdct=True, fastupsample=False
            )
        else:
            pixels = np.asarray(Image.open(io.BytesIO(encoded)))
        pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
        assert list(pixels.shape) == want["decoded.shape_hwc"]
        assert hashlib.sha256(pixels.tobytes()).hexdigest() == want["decoded.sha256"]


def test_map_reader_on_tensorflow_files(tmp_path: Path) -> None:
    name = "tensorflow-written-real.tfrecord"
    ds = TFRecordDataset(DATA / name)  # no .idx: the index is built in memory
    want = EXPECTED[name]["records"]
    assert len(ds) == 6
    assert ds.targets == [r["image/class/label"][0] for r in want]
    assert ds.classes == ["0", "1", "2"]  # no image/class/text: named by label
    for i, record in enumerate(_tf_records(name)):
        image, label = ds[i]
        encoded = record["image/encoded"][0]
        assert isinstance(encoded, bytes)
        expected = apply_policy(encoded, "x", ImagePolicy())[0]  # RGB under imgpack's policy
        assert torch.equal(image, torch.from_numpy(expected.copy()).permute(2, 0, 1))
        assert label == want[i]["image/class/label"][0]


def test_stream_reads_gzip_files() -> None:
    plain = list(TFRecordStream(DATA / "tensorflow-written-synthetic.tfrecord"))
    packed = list(TFRecordStream(DATA / "tensorflow-written-synthetic.gz.tfrecord"))
    assert len(plain) == len(packed) == 6
    for (a, la), (b, lb) in zip(plain, packed, strict=True):
        assert torch.equal(a, b) and la == lb
    with pytest.raises(DataError, match="no random access"):
        TFRecordDataset(DATA / "tensorflow-written-synthetic.gz.tfrecord")


def test_zlib_files_are_recognised_and_streamed(tmp_path: Path) -> None:
    """TensorFlow's other compression_type: a zlib stream (with its 2-byte header) of the
    records. Streamed like GZIP; named in the error of the random-access readers."""
    plain = (DATA / "tensorflow-written-synthetic.tfrecord").read_bytes()
    packed = tmp_path / "synthetic.zlib.tfrecord"
    packed.write_bytes(zlib.compress(plain, 6))
    assert tfrecord.compression(packed) == "ZLIB"
    assert tfrecord.compression(DATA / "tensorflow-written-synthetic.tfrecord") is None
    assert tfrecord.compression(DATA / "tensorflow-written-synthetic.gz.tfrecord") == "GZIP"
    expected = list(TFRecordStream(DATA / "tensorflow-written-synthetic.tfrecord"))
    got = list(TFRecordStream(packed))
    assert len(got) == 6
    for (a, la), (b, lb) in zip(expected, got, strict=True):
        assert torch.equal(a, b) and la == lb
    with pytest.raises(DataError, match="ZLIB-compressed TFRecord files have no random access"):
        TFRecordDataset(packed)
    result = CliRunner().invoke(main, ["index", str(packed)])
    assert result.exit_code == 1 and "ZLIB-compressed TFRecord file has no random access" in (
        result.output
    )
    damaged = tmp_path / "damaged.tfrecord"
    damaged.write_bytes(packed.read_bytes()[:40] + bytes(40) + packed.read_bytes()[80:])
    with pytest.raises(DataError):
        list(TFRecordStream(damaged))


def test_open_dataset_on_a_folder_of_tfrecords_names_the_reader(tmp_path: Path) -> None:
    shutil.copy(DATA / "tensorflow-written-synthetic.tfrecord", tmp_path / "a.tfrecord")
    with pytest.raises(
        ManifestError,
        match=r"holds TFRecord files but no imgpack\.json.*"
        r"TFRecordDataset",
    ):
        open_dataset(tmp_path)
    result = CliRunner().invoke(main, ["tune", str(tmp_path)])
    assert result.exit_code == 1 and "TFRecordDataset" in result.output


def test_foreign_folder_glob_and_index_command(tmp_path: Path) -> None:
    for name in ("tensorflow-written-synthetic.tfrecord", "tensorflow-written-real.tfrecord"):
        shutil.copy(DATA / name, tmp_path / name)
    result = CliRunner().invoke(main, ["index", *map(str, sorted(tmp_path.glob("*.tfrecord")))])
    assert result.exit_code == 0, result.output
    idx = tmp_path / "tensorflow-written-real.idx"
    lines = idx.read_text().splitlines()
    assert len(lines) == 6
    assert tfrecord.read_index(
        tmp_path / "tensorflow-written-real.tfrecord"
    ) == tfrecord.build_index(tmp_path / "tensorflow-written-real.tfrecord")
    by_folder, by_glob = TFRecordDataset(tmp_path), TFRecordDataset(str(tmp_path / "*.tfrecord"))
    assert len(by_folder) == len(by_glob) == 12
    assert torch.equal(by_folder[7][0], by_glob[7][0])


# -- imgpack's own output -----------------------------------------------------------------------
def test_every_record_carries_every_key_and_the_index_matches(
    uniform_folder: Path, tmp_path: Path
) -> None:
    manifest = convert(
        uniform_folder,
        tmp_path / "out",
        "tfrecord",
        encoding="png",
        shard_size=20_000,
        label_offset=1,
        progress=False,
    )
    assert manifest.options["label_offset"] == 1
    names = [f.path for f in manifest.files]
    total = len(names)
    assert names == [f"data-{i:05d}-of-{total:05d}.tfrecord" for i in range(total)] and total > 1
    keys = {
        "image/encoded", "image/format", "image/class/label", "image/class/text", "image/height",
        "image/width", "image/channels", "image/colorspace", "image/filename", "imgpack/output_id",
    }  # fmt: skip
    for entry in manifest.files:
        path = tmp_path / "out" / entry.path
        # The .idx matches the file byte for byte: offsets and sizes cover it exactly.
        index = tfrecord.read_index(path)
        assert index == tfrecord.build_index(path)
        assert index is not None and sum(size for _, size in index) == path.stat().st_size
        records = _records_of(path)
        assert len(records) == entry.num_samples
        for record in records:
            assert set(record) == keys
            assert record["image/class/label"][0] >= 1  # label_offset
            assert record["imgpack/output_id"] == [manifest.output_id.encode()]
            assert record["image/colorspace"] == [b"RGB"] and record["image/channels"] == [3]
    ds = open_dataset(tmp_path / "out")
    # The readers subtract the offset again: labels are the scan's.
    assert ds.targets == [sample.label for sample in scan_folder(uniform_folder).samples]


def _records_of(path: Path) -> list[dict[str, tfexample.FeatureValue]]:
    with tfrecord.open_records(path) as fh:
        return [tfexample.decode_example(d) for _, d in tfrecord.iter_frames(fh, str(path))]


@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("data", "data CRC mismatch"),
        ("length", "length CRC mismatch"),
        ("truncate", "truncated|does not match|records end at byte"),
    ],
)
def test_corruption_is_detected_with_file_and_offset(
    where: str, match: str, uniform_folder: Path, tmp_path: Path
) -> None:
    convert(uniform_folder, tmp_path / "out", "tfrecord", encoding="png", progress=False)
    ds = open_dataset(tmp_path / "out")
    shard = ds.records.shards[0]  # type: ignore[attr-defined]
    offset, size = int(shard.offsets[3]), int(shard.sizes[3])
    blob = bytearray(shard.path.read_bytes())
    if where == "data":
        blob[offset + 40] ^= 0xFF
    elif where == "length":
        blob[offset + 1] ^= 0x01
    else:
        blob = blob[: offset + size - 10]
    shard.path.write_bytes(bytes(blob))
    if where == "truncate":
        # The output is refused at open: the file is shorter than its manifest says...
        with pytest.raises(DataError, match=r"\.tfrecord: \d+ bytes, the manifest says"):
            open_dataset(tmp_path / "out")
        # ...and read as a plain TFRecord file, its stale .idx is refused too.
        with pytest.raises(DataError, match=match):
            TFRecordDataset(shard.path)
        shard.path.with_suffix(".idx").unlink()
        with pytest.raises(DataError, match=match):
            TFRecordDataset(shard.path)
        return
    ds = open_dataset(tmp_path / "out")
    assert ds[2][0].shape == (3, 16, 16)
    with pytest.raises(
        DataError, match=rf"data-00000-of-00001\.tfrecord at offset {offset}: .*({match})"
    ):
        ds[3]
    with pytest.raises(DataError, match=match):
        list(TFRecordStream(tmp_path / "out"))
    if where == "data":
        # Without CRC checks the flipped byte is not caught as such: the record decodes (into
        # different pixels) or fails to decode, but no CRC error is raised.
        unchecked = TFRecordDataset(tmp_path / "out", check_crc=False)
        try:
            unchecked[3]
        except DataError as exc:
            assert "CRC" not in str(exc)


# -- the stream reader's split ------------------------------------------------------------------
@pytest.fixture
def sharded(uniform_folder: Path, tmp_path: Path) -> Path:
    convert(
        uniform_folder,
        tmp_path / "out",
        "tfrecord",
        encoding="raw",
        size=16,
        shard_size=16 * 16 * 3 * 9 + 900,
        progress=False,
    )
    return tmp_path / "out"


def _ids(images: torch.Tensor) -> list[bytes]:
    return [img.numpy().tobytes() for img in images]


@pytest.mark.parametrize("shuffle_buffer", [0, 16])
def test_stream_workers_read_every_sample_once(sharded: Path, shuffle_buffer: int) -> None:
    ref = open_dataset(sharded)
    everything = sorted(_ids(collate(ref.__getitems__(range(len(ref))))[0]))
    stream = TFRecordStream(sharded, shuffle_buffer=shuffle_buffer, seed=3)
    loader = DataLoader(stream, batch_size=5, num_workers=2, collate_fn=collate)
    seen = sorted(x for images, _ in loader for x in _ids(images))
    assert seen == everything  # no duplicates, no losses


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_stream_ranks_get_equal_disjoint_parts(sharded: Path, drop_remainder: bool) -> None:
    n, world = 60, 7
    parts = []
    for rank in range(world):
        stream = TFRecordStream(sharded, rank=rank, world_size=world, drop_remainder=drop_remainder)
        loader = DataLoader(stream, batch_size=4, num_workers=2, collate_fn=collate)
        parts.append([x for images, _ in loader for x in _ids(images)])
    counts = {len(p) for p in parts}
    assert counts == {n // world if drop_remainder else -(-n // world)}
    flat = [x for p in parts for x in p]
    if drop_remainder:
        assert len(set(flat)) == len(flat) == (n // world) * world
    else:
        assert len(set(flat)) == n  # all read; the wrap-around repeats n mod world... records
        assert len(flat) - n == world * -(-n // world) - n


def test_stream_shuffles_per_epoch(sharded: Path) -> None:
    stream = TFRecordStream(sharded, shuffle_buffer=20, seed=1)
    first = [x for img, _ in stream for x in _ids(img[None])]
    stream.set_epoch(1)
    second = [x for img, _ in stream for x in _ids(img[None])]
    assert sorted(first) == sorted(second) and first != second
    assert first == [
        x for img, _ in TFRecordStream(sharded, shuffle_buffer=20, seed=1) for x in _ids(img[None])
    ]


def test_label_offset_round_trip(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "tfrecord", label_offset=1, progress=False)
    ds = open_dataset(tmp_path / "out")
    plain = convert(uniform_folder, tmp_path / "ref", "pt", progress=False)
    assert ds.targets == open_dataset(tmp_path / "ref").targets and plain.num_samples == len(ds)
    foreign = TFRecordDataset(str(tmp_path / "out" / "*.tfrecord"), label_offset=1)
    assert foreign.targets == ds.targets and foreign.classes == ds.classes


def test_gzip_written_by_us_is_streamable(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "tfrecord", progress=False)
    src = next((tmp_path / "out").glob("*.tfrecord"))
    packed = tmp_path / "packed.tfrecord"
    packed.write_bytes(gzip.compress(src.read_bytes()))
    assert len(list(TFRecordStream(packed))) == 60


def test_stream_can_yield_whole_batches(sharded: Path) -> None:
    ref = open_dataset(sharded)
    everything = sorted(_ids(collate(ref.__getitems__(range(len(ref))))[0]))
    stream = TFRecordStream(sharded, batch_size=8, shuffle_buffer=10, seed=2)
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    batches = list(loader)
    assert all(
        images.shape[1:] == (3, 16, 16) and len(images) == len(labels) <= 8
        for images, labels in batches
    )
    assert not batches[0][0].is_shared()  # a view of a worker's pooled buffer, no new segment
    assert sorted(x for images, _ in batches for x in _ids(images)) == everything
    with_transform = TFRecordStream(sharded, batch_size=8, transform=lambda x: x.float())
    images, labels = next(iter(with_transform))
    assert images.dtype == torch.float32 and images.shape == (8, 3, 16, 16) and labels.shape == (8,)


@pytest.fixture
def raw_records(tmp_path: Path) -> Path:
    from conftest import build_uniform_folder

    src = build_uniform_folder(tmp_path / "src", count=90, classes=5, size=6)
    out = tmp_path / "raw"
    convert(src, out, "tfrecord", encoding="raw", size=6, shard_size=6 * 6 * 3 * 25, progress=False,
            format_options={"label_offset": 1})  # fmt: skip
    return out


def _generic(ds: TFRecordDataset, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    layout, ds._layout = ds._layout, None
    try:
        images, labels = ds._gather(indices)
    finally:
        ds._layout = layout
    assert isinstance(images, torch.Tensor)
    return images, labels


def test_raw_records_are_read_by_layout_as_the_example_parser_reads_them(
    raw_records: Path,
) -> None:
    ds = open_dataset(raw_records)
    assert isinstance(ds, TFRecordDataset) and ds._layout is not None
    assert len(ds.manifest.files) > 2 and ds.records.label_offset == 1
    indices = np.random.default_rng(0).permutation(len(ds))
    images, labels = ds._gather(indices)
    expected = _generic(ds, indices)
    assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    assert sorted(labels.tolist()) == sorted(ds.targets)


def test_raw_records_laid_out_otherwise_go_through_the_parser(raw_records: Path) -> None:
    """A shard rewritten by another tool (an extra feature, so another layout; valid CRCs and
    index) reads the same through the generic path; a damaged record is named."""
    from conftest import refresh_manifest

    before = open_dataset(raw_records)
    indices = np.arange(len(before))
    expected = collate(before.__getitems__(indices.tolist()))
    shard = raw_records / before.manifest.files[1].path
    frames, index, offset = [], [], 0
    for features in _records_of(shard):
        features["aaa/extra"] = [b"written elsewhere"]
        framed = tfrecord.frame(tfexample.encode_example(features))
        frames.append(framed)
        index.append((offset, len(framed)))
        offset += len(framed)
    shard.write_bytes(b"".join(frames))
    tfrecord.write_index(shard, index)
    refresh_manifest(raw_records)
    after = open_dataset(raw_records)
    got = collate(after.__getitems__(indices.tolist()))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    data = bytearray(shard.read_bytes())
    data[index[3][0] + 40] ^= 0xFF  # inside the fourth record's data: its CRC no longer matches
    shard.write_bytes(bytes(data))
    refresh_manifest(raw_records)
    damaged = open_dataset(raw_records)
    first = int(damaged._starts[1])
    with pytest.raises(DataError, match=rf"{shard.name} at offset {index[3][0]}: data CRC"):
        damaged.__getitems__([0, first + 3])


def test_a_damaged_raw_record_is_named_on_the_layout_path_too(raw_records: Path) -> None:
    from conftest import refresh_manifest

    ds = open_dataset(raw_records)
    shard = ds.records.shards[0]
    offset = int(shard.offsets[2])
    data = bytearray(shard.path.read_bytes())
    assert ds._layout is not None
    found = ds._layout.match(np.frombuffer(bytes(data), np.uint8), shard.offsets, shard.sizes)
    assert found[0].all()
    data[int(found[2][2]) + 5] ^= 0x01  # a pixel of the third record
    shard.path.write_bytes(bytes(data))
    refresh_manifest(raw_records)
    with pytest.raises(DataError, match=rf"{shard.path.name} at offset {offset}: data CRC"):
        open_dataset(raw_records).__getitems__([5, 2])
    unchecked = open_dataset(raw_records, check_crc=False)  # as asked: read, not checked
    assert unchecked.__getitems__([2]).images.shape == (1, 3, 6, 6)


def test_a_record_framed_around_its_image_is_the_whole_record() -> None:
    """The writer frames a record without copying the image bytes into it: the parts around
    them are exactly the record ``frame(encode_example(...))`` gives."""
    image = bytes(range(256)) * 600
    features = {
        "image/encoded": [image],
        "image/height": [375],
        "image/class/label": [-3],
        "a": [b"first"],
        "z": [1.5, 2.0],
    }
    head, tail = tfexample.encode_example_around(features, "image/encoded")
    before, after = tfrecord.frame_around(head, image, tail)
    data = tfexample.encode_example(features)
    assert head + image + tail == data

    def masked(chunk: bytes) -> bytes:  # TensorFlow's masked CRC-32C, written out here
        crc = google_crc32c.value(chunk)
        return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).to_bytes(4, "little")

    length = len(data).to_bytes(8, "little")
    assert before + image + after == length + masked(length) + data + masked(data)
    assert tfrecord.frame(data) == before + image + after


def test_raw_records_read_again_where_the_first_read_found_them(tmp_path: Path) -> None:
    """A raw record is matched against the layout and checked once; after that a batch is a
    gather from where its pixels were found (one shard or many), the same batch every time.
    ``verify=True`` matches and checks every read, remembering nothing."""
    from conftest import build_uniform_folder

    src = build_uniform_folder(tmp_path / "src", count=90, classes=3, size=8)
    out = tmp_path / "out"
    convert(src, out, "tfrecord", encoding="raw", size=8, shard_size="3KB", progress=False)
    ds = open_dataset(out)
    assert len(ds.manifest.files) > 3
    order = np.random.default_rng(3).permutation(len(ds))
    first = collate(ds.__getitems__(order.tolist()))
    known = ds._learned.starts
    assert known is not None and (known >= 0).all()
    for batch in (order[:40], order[40:], np.arange(10), order):
        images, labels = collate(ds.__getitems__(batch.tolist()))
        at = [int(np.flatnonzero(order == i)[0]) for i in batch]
        assert torch.equal(images, first[0][at]) and torch.equal(labels, first[1][at])
    for i in (0, 17, 89):
        features, _ = ds.record(i)
        pixels = np.frombuffer(features["image/encoded"][0], np.uint8).reshape(8, 8, 3)
        assert np.array_equal(ds[i][0].permute(1, 2, 0).numpy(), pixels)
    checked = open_dataset(out, verify=True)
    again = collate(checked.__getitems__(order.tolist()))
    assert torch.equal(again[0], first[0]) and checked._learned.starts is None


def test_a_record_read_again_is_not_parsed_again_unless_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoded record is parsed the first time a reader reads it; later reads (ds[i] and
    batches) take its image where it was found and its label as checked then. A record whose
    bytes changed since (its stored data CRC another) is parsed again: a record rewritten in
    place with another label and class is read with them, never with the remembered ones."""
    from conftest import build_uniform_folder

    folder = build_uniform_folder(tmp_path / "src", 12, 3)
    convert(folder, tmp_path / "png", format="pt", encoding="png", workers=1, progress=False)
    convert(folder, tmp_path / "out", format="tfrecord", encoding="png", workers=1, progress=False)
    reference = open_dataset(tmp_path / "png")
    ds = open_dataset(tmp_path / "out")
    parsed = []
    real_parse = tfexample.decode_example
    monkeypatch.setattr(tfexample, "decode_example", lambda d: parsed.append(1) or real_parse(d))
    counts = []
    for _ in range(2):
        for i in range(len(ds)):
            image, label = ds[i]
            expected_image, expected_label = reference[i]
            assert label == expected_label and torch.equal(image, expected_image)
        images, labels = collate(ds.__getitems__([5, 0, 11]))
        assert labels.tolist() == [reference[i][1] for i in (5, 0, 11)]
        assert all(torch.equal(a, reference[i][0]) for a, i in zip(images, (5, 0, 11), strict=True))
        counts.append(len(parsed))
    # Each record once, in the first pass (and the shard's first when it was opened).
    assert counts == [len(ds) + 1, len(ds) + 1]
    # Record 4 (class1, label 1) rewritten in place as class2, label 2, its CRCs valid.
    shard = next((tmp_path / "out").glob("*.tfrecord"))
    offset, size = (int(v) for v in shard.with_suffix(".idx").read_text().split("\n")[4].split())
    blob = bytearray(shard.read_bytes())
    data = bytes(blob[offset + tfrecord.HEADER_SIZE : offset + size - tfrecord.FOOTER_SIZE])
    features = real_parse(data)
    assert features["image/class/label"] == [1] and features["image/class/text"] == [b"class1"]
    features["image/class/label"], features["image/class/text"] = [2], [b"class2"]
    changed = tfexample.encode_example(features)
    assert len(changed) == len(data) and changed != data
    blob[offset : offset + size] = tfrecord.frame(changed)
    with open(shard, "r+b") as fh:  # in place: the reader's open file sees it
        fh.write(blob)
    assert ds[4][1] == 2 and len(parsed) == len(ds) + 2
    assert ds[3][1] == reference[3][1] and len(parsed) == len(ds) + 2  # the others: as kept


def test_a_files_scan_is_packed_and_gives_back_what_was_found() -> None:
    """What the scan of a TFRecord file found (:class:`RecordTable`): every record as it was
    found (the usual one: an integer label, a class name and a file name or not; and any
    other: a label list, a float label, no label, fields, bytes that are not text), through a
    pickle too (a scan task's result); 100,000 usual records within 100 bytes each, where a
    :class:`Record` and its features took 650."""
    import pickle

    from imgpack.sources.tfrecord.found import Record, RecordTable

    label, text, name = "image/class/label", "image/class/text", "image/filename"
    odd = [
        Record(0, 60, 30, {label: [3], text: [b"cat"], name: [b"a.jpg"]}),
        Record(60, 50, 20, {label: [3]}),
        Record(110, 50, 20, {label: [1], name: [b"\xff\xfe.png"]}),
        Record(160, 50, 20, {label: [1, 2], text: [b"dog"]}),
        Record(210, 50, -1, {label: [0.5]}),
        Record(260, 50, 20, {}),
        Record(310, 80, 20, {label: [4], text: [b"cat"], "box": [0.25, 0.5], "id": [b"7"]}),
        Record(390, 50, 20, {label: [5], text: [b"cat", b"dog"], name: [b""]}),
        Record(440, 50, 20, {label: [6], text: [b"cat"], name: [b""]}),
    ]
    table = RecordTable(odd)
    assert list(table) == odd and table[-1] == odd[-1] and table[2:4] == odd[2:4]
    assert [r.end for r in table] == [r.offset + r.framed for r in odd]
    assert list(pickle.loads(pickle.dumps(table))) == odd
    many = [Record(i * 9_000, 9_000, 8_950, {label: [i % 1000], text: [b"n%08d" % (i % 1000)],
                   name: [b"train/img_%08d.jpg" % i]}) for i in range(100_000)]  # fmt: skip
    packed, held, _ = traced(lambda: RecordTable(many))
    assert held / len(many) < 100, f"{held / len(many):.0f} bytes per record"
    assert packed[54_321] == many[54_321] and len(packed) == len(many)


def test_tfrecord_files_scan_within_a_few_hundred_bytes_a_record(tmp_path: Path) -> None:
    """A driver plans from TFRecord files of millions of records: each file's scan is packed
    as it comes and let go once the plan holds it, so 50,000 records in 5 files take within
    300 bytes a record at the peak (937 when each record was an object with its features),
    the same samples in file order."""
    from imgpack.sources import resolve
    from imgpack.sources.base import ScanRequest

    png = io.BytesIO()
    Image.new("RGB", (2, 2), (1, 2, 3)).save(png, "PNG")
    files = tmp_path / "tf"
    files.mkdir()
    count = 50_000
    for f in range(5):
        with open(files / f"part-{f}.tfrecord", "wb") as out:
            for i in range(f * count // 5, (f + 1) * count // 5):
                features = {"image/encoded": [png.getvalue()], "image/class/label": [i % 10],
                            "image/filename": [b"img_%08d.png" % i]}  # fmt: skip
                out.write(tfrecord.frame(tfexample.encode_example(features)))
    resolve(files).scan(ScanRequest())  # what the first scan imports and caches is not counted
    source = resolve(files)
    scan, _, peak = traced(lambda: source.scan(ScanRequest()))
    assert len(scan.samples) == count and scan.samples[-1].path == f"img_{count - 1:08d}.png"
    assert scan.samples[-1].label == (count - 1) % 10
    assert peak / count < 300, f"{peak / count:.0f} bytes per record"
