"""What is particular to the webdataset format (the shared round-trip, determinism and reader
tests cover it too, parametrized over every format)."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FakeFolder, build_uniform_folder, traced
from hypothesis import given, settings
from hypothesis import strategies as st

from imgpack import convert, open_dataset
from imgpack.errors import DataError

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats" / "webdataset.md"


def _doc_snippet() -> str:
    """The no-imgpack reading example of docs/formats/webdataset.md, as it stands."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Reading with the `webdataset` package", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None
    return match.group(1)


def _run_doc_snippet(folder: Path) -> list[tuple[Any, ...]]:
    """Run the docs' snippet in ``folder`` (it reads ``out/``), collecting what it prints."""
    printed: list[tuple[Any, ...]] = []
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(_doc_snippet(), {"print": lambda *args: printed.append(args)})
    finally:
        os.chdir(cwd)
    return printed


# The webdataset package leaves its tar files to the garbage collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "options",
    [{"encoding": "original"}, {"encoding": "raw", "size": 12}, {"encoding": "png", "size": 9}],
    ids=str,
)
def test_the_webdataset_package_reads_what_imgpack_reads(
    options: dict[str, Any], edge_folder: FakeFolder, tmp_path: Path
) -> None:
    convert(
        edge_folder.root, tmp_path / "out", "webdataset", shard_size=2000, progress=False, **options
    )
    ds = open_dataset(tmp_path / "out")
    assert len(ds.manifest.files) > 1  # several shards, read in order
    printed = _run_doc_snippet(tmp_path)
    assert len(printed) == len(ds) == len(edge_folder.images)
    for i, (path, class_name, label, shape) in enumerate(printed):
        rel, target = edge_folder.images[i]
        assert (path, class_name, label) == (rel, ds.classes[target], target)
        assert shape == tuple(ds[i][0].permute(1, 2, 0).shape)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("encoding", ["original", "raw"])
def test_webdataset_decoders_give_the_same_pixels(
    encoding: str, edge_folder: FakeFolder, tmp_path: Path
) -> None:
    import webdataset as wds

    size = 10 if encoding == "raw" else None
    convert(
        edge_folder.root,
        tmp_path / "out",
        "webdataset",
        encoding=encoding,
        size=size,
        progress=False,
    )
    ds = open_dataset(tmp_path / "out")
    shards = [str(tmp_path / "out" / f.path) for f in ds.manifest.files]
    stream = wds.WebDataset(shards, shardshuffle=False).decode("rgb8")
    samples = list(stream.to_tuple("__key__", "jpg;jpeg;png;npy", "cls"))
    assert [key for key, _, _ in samples] == [f"{i:010d}" for i in range(len(ds))]
    for i, (_, pixels, label) in enumerate(samples):
        image, target = ds[i]
        assert label == target
        assert np.array_equal(pixels, image.permute(1, 2, 0).numpy())


@pytest.mark.parametrize("encoding", ["png", "original"])
def test_hugging_face_reads_one_type_outputs_as_imgpack_does(encoding: str, tmp_path: Path) -> None:
    """``load_dataset("webdataset")`` on a png output of a mixed folder, and on an original
    output of an all-JPEG one (docs/formats/webdataset.md): every sample's pixels, label and
    path, in order, over several shards."""
    datasets = pytest.importorskip("datasets", reason="pip install 'imgpack[hf]'")
    from PIL import Image

    from imgpack.sample import make_sample_folder

    src = tmp_path / "images"
    make_sample_folder(src, 60, 5, 0)
    if encoding == "original":  # one stored type: keep only the sample's JPEGs
        for png in src.rglob("*.png"):
            png.unlink()
    out = tmp_path / "out"
    convert(src, out, "webdataset", encoding=encoding, shard_size=20_000, progress=False)
    ds = open_dataset(out)
    shards = [str(out / f.path) for f in ds.manifest.files]
    assert len(shards) > 1
    hf = datasets.load_dataset(
        "webdataset", data_files={"train": shards}, split="train", cache_dir=str(tmp_path / "hf")
    )
    column = "png" if encoding == "png" else "jpg"
    assert len(hf) == len(ds)
    for i, row in enumerate(hf):
        image, label = ds[i]
        rel = Path(ds.samples[i][0]).relative_to(src).as_posix()
        assert (row["cls"], row["json"]["path"]) == (label, rel)
        pixels = np.asarray(
            row[column].convert("RGB") if row[column].mode != "RGB" else row[column]
        )
        assert isinstance(row[column], Image.Image)
        assert np.array_equal(pixels, image.permute(1, 2, 0).numpy())


def test_tar_lists_the_members(edge_folder: FakeFolder, tmp_path: Path) -> None:
    convert(edge_folder.root, tmp_path / "out", "webdataset", progress=False)
    listing = subprocess.run(
        ["tar", "tf", str(tmp_path / "out" / "data-000000.tar")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(listing) == 3 * len(edge_folder.images)
    by_source = {rel: listing[3 * i] for i, (rel, _) in enumerate(edge_folder.images)}
    assert listing[1:3] == ["0000000000.cls", "0000000000.json"]
    # The kept original's extension when it names the content, else the content's.
    assert by_source["ant/plain.jpg"].endswith(".jpg")
    assert by_source["ant/png_named.jpg"].endswith(".png")
    assert by_source["bee/UPPER.PNG"].endswith(".png")
    assert by_source["bee/rgba.png"].endswith(".png")  # re-encoded: alpha composited
    with tarfile.open(tmp_path / "out" / "data-000000.tar") as tar:
        member = tar.getmember("0000000003.json")
        assert (member.mode, member.mtime, member.uid, member.gid) == (0o444, 0, 0, 0)
        meta = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    rel, label = edge_folder.images[3]
    output_id = json.loads((tmp_path / "out" / "imgpack.json").read_text())["output_id"]
    assert meta == {"class": edge_folder.classes[label], "path": rel, "output_id": output_id}


def test_raw_members_are_plain_npy(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "webdataset", encoding="raw", size=16, progress=False)
    with tarfile.open(tmp_path / "out" / "data-000000.tar") as tar:
        data = tar.extractfile("0000000007.npy").read()  # type: ignore[union-attr]
    array = np.load(io.BytesIO(data), allow_pickle=False)
    assert array.dtype == np.uint8 and array.shape == (16, 16, 3)
    assert torch.equal(
        torch.from_numpy(array).permute(2, 0, 1), open_dataset(tmp_path / "out")[7][0]
    )


def test_index_lines_point_at_the_image_members(uniform_folder: Path, tmp_path: Path) -> None:
    convert(uniform_folder, tmp_path / "out", "webdataset", shard_size="10KB", progress=False)
    out = tmp_path / "out"
    ds = open_dataset(out)
    count = 0
    for entry in ds.manifest.files:
        lines = (out / entry.path).with_suffix(".idx").read_text().splitlines()
        assert len(lines) == entry.num_samples
        blob = (out / entry.path).read_bytes()
        with tarfile.open(out / entry.path) as tar:
            images = [m for m in tar.getmembers() if m.name.endswith(".png")]
        for line, member in zip(lines, images, strict=True):
            offset, size, label, _ = map(int, line.split())
            assert (offset, size) == (member.offset_data, member.size)
            assert blob[offset : offset + size][:8] == b"\x89PNG\r\n\x1a\n"
            assert label == ds.targets[count]
            count += 1
    assert count == len(ds) == 60


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (
            lambda text: text.replace("\n", "\n1 2 3 4\n", 1),
            "lists 61 samples, the manifest says 60",
        ),
        (
            lambda text: "99999999 10 0 0\n" + text.split("\n", 1)[1],
            "points outside data-000000.tar",
        ),
        (lambda text: text.replace(" 1 ", " 7 ", 1), r"labels outside 0\.\.2"),
        (lambda text: "x" + text, "cannot read the sample index"),
    ],
)
def test_damaged_index_is_refused(
    damage: Any, match: str, uniform_folder: Path, tmp_path: Path
) -> None:
    convert(uniform_folder, tmp_path / "out", "webdataset", progress=False)
    index = tmp_path / "out" / "data-000000.idx"
    index.write_text(damage(index.read_text()))
    with pytest.raises(DataError, match=match):
        open_dataset(tmp_path / "out")


def test_damaged_image_names_shard_and_sample(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=6)
    convert(src, tmp_path / "out", "webdataset", encoding="raw", size=16, progress=False)
    shard = tmp_path / "out" / "data-000000.tar"
    offset = int((tmp_path / "out" / "data-000000.idx").read_text().splitlines()[4].split()[0])
    blob = bytearray(shard.read_bytes())
    blob[offset : offset + 6] = b"NOTNPY"
    shard.write_bytes(bytes(blob))
    ds = open_dataset(tmp_path / "out")  # checks each record the first time it reads it
    assert ds[3][0].shape == (3, 16, 16)
    with pytest.raises(
        DataError, match=r"data-000000.tar: sample 4 \(source .*\): checksum mismatch"
    ):
        ds.__getitems__([3, 4])
    unchecked = open_dataset(tmp_path / "out", verify=False)
    with pytest.raises(DataError, match=r"data-000000.tar: sample 4 \(0000000004\): not a uint8"):
        unchecked.__getitems__([3, 4])


def _raw_outputs(tmp_path: Path, shard_size: str) -> tuple[Path, Path]:
    """40 uniform 16x16 images as a raw webdataset output in shards of ``shard_size``, and as
    the raw pt output whose pixels it must give."""
    src = build_uniform_folder(tmp_path / "src", count=40, size=16)
    args: dict[str, Any] = {"encoding": "raw", "size": 16, "progress": False}
    convert(src, tmp_path / "wds", "webdataset", shard_size=shard_size, **args)
    convert(src, tmp_path / "pt", "pt", **args)
    return tmp_path / "wds", tmp_path / "pt"


def test_raw_batches_across_shards_are_gathered_exactly(tmp_path: Path) -> None:
    """Raw batches are gathered from the memory-mapped shards (headers compared, pixels copied
    into the batch): the same pixels and labels as the pt output of the same images, in batch
    order, whichever shards a batch spans; damaged pixels are named the first time they are
    read."""
    from imgpack.readers import collate

    wds, pt = _raw_outputs(tmp_path, "16KB")  # 4 samples a shard
    ds, reference = open_dataset(wds), open_dataset(pt)
    assert len(ds.manifest.files) > 3 and ds.manifest.files[0].num_samples >= 4
    order = np.random.default_rng(0).permutation(40).tolist()
    starts = np.cumsum([0] + [f.num_samples for f in ds.manifest.files]).tolist()
    first, second, third = (list(range(starts[k], starts[k + 1])) for k in range(3))
    shapes = [
        order[:17],  # every shard, none with half the batch
        order[17:],
        [5],
        [0, 0, 39],
        first[:3] + second[:1],  # most in one shard, the rest in one other
        second[:1] + first[:3],  # the first row in the shard with fewer
        first[:4] + second[:1] + third[:1],  # most in one shard, the rest in two others
        second[:2] + first[:1] + third[:1],  # no shard with more than half
        first[:2] + second[:2],  # exactly half
        (first[:2] + second[:1]) * 3,  # the same samples again
    ]
    for _ in range(2):  # the first reads (checked as gathered), then the later ones
        for batch in shapes:
            images, labels = collate(ds.__getitems__(batch))
            expected = collate(reference.__getitems__(batch))
            assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    index = (tmp_path / "wds" / ds.manifest.files[1].path).with_suffix(".idx")
    offset = int(index.read_text().splitlines()[2].split()[0])
    shard = tmp_path / "wds" / ds.manifest.files[1].path
    blob = bytearray(shard.read_bytes())
    blob[offset + 200] ^= 0xFF  # a pixel byte, past the .npy header
    shard.write_bytes(bytes(blob))
    damaged = ds.manifest.files[0].num_samples + 2
    fresh = open_dataset(tmp_path / "wds")
    with pytest.raises(DataError, match=rf"sample {damaged} \(source .*\): checksum mismatch"):
        fresh.__getitems__([0, damaged, 39])


@pytest.mark.parametrize("verify", [None, False, True])
def test_raw_batches_of_a_two_shard_output_are_gathered_exactly(
    tmp_path: Path, verify: bool | None
) -> None:
    """A raw output of one large shard and a short last one (the default layout's shape): a
    batch with most rows in the large shard is one gather there plus the short shard's rows,
    one with most in the short shard goes shard by shard; every way gives the pt output's
    pixels and labels in batch order, and a damaged ``.npy`` header in the short shard is
    named whichever way the batch is gathered."""
    from imgpack.readers import collate

    wds, pt = _raw_outputs(tmp_path, "100KB")
    ds, reference = open_dataset(wds, verify=verify), open_dataset(pt)
    counts = [f.num_samples for f in ds.manifest.files]
    assert len(counts) == 2 and counts[0] > counts[1] > 0
    large, short = list(range(counts[0])), list(range(counts[0], 40))
    order = np.random.default_rng(1).permutation(40).tolist()
    shapes = [
        order,  # both shards, most in the large one
        large[:5] + short[:2],  # most in the large shard
        short[:2] + large[:5],  # the first row in the short one
        short[:5] + large[:1],  # most in the short shard
        short[:3],  # the short shard alone
        large[:3] + short[:3],  # exactly half
        (large[:2] + short[:1]) * 3,  # the same samples again
        [39, 0, -1],
    ]
    for _ in range(2):  # the first reads (checked as gathered), then the later ones
        for batch in shapes:
            images, labels = collate(ds.__getitems__(batch))
            expected = collate(reference.__getitems__(batch))
            assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    shard = tmp_path / "wds" / ds.manifest.files[1].path
    offset = int(shard.with_suffix(".idx").read_text().splitlines()[1].split()[0])
    blob = bytearray(shard.read_bytes())
    blob[offset + 8] ^= 0xFF  # inside the second short-shard sample's .npy header
    shard.write_bytes(bytes(blob))
    damaged = counts[0] + 1
    for batch in ([*large[:5], damaged], [damaged, *short[:1]]):
        fresh = open_dataset(tmp_path / "wds", verify=verify)
        with pytest.raises(DataError, match=rf"sample {damaged} "):
            fresh.__getitems__(batch)


@pytest.mark.parametrize(
    ("name", "size"), [("0000000001.jpg", 12345), ("a" * 100, 0), ("7.cls", 1), ("x", 8**11 - 1)]
)
def test_member_headers_are_tarfiles(name: str, size: int) -> None:
    """The writer builds each member's header itself: byte for byte what tarfile writes."""
    from imgpack.formats.webdataset.layout import member_header

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0
    assert member_header(name, size) == info.tobuf(tarfile.USTAR_FORMAT)


@settings(max_examples=300, deadline=None)
@given(
    name=st.none() | st.text(),
    path=st.text(st.characters(codec="utf-8") | st.sampled_from(["\udcff", "\udc80"])),
    output_id=st.sampled_from(["", "0123abcd"]),
)
def test_sample_metadata_is_what_json_writes(name: str | None, path: str, output_id: str) -> None:
    """The writer formats each sample's .json member itself: byte for byte json.dumps of the
    same dict with sorted keys, quotes, control characters, non-ASCII and the surrogates of
    undecodable file names included."""
    from imgpack.formats.webdataset.writer import metadata

    meta: dict[str, Any] = {"class": name, "path": path}
    if output_id:
        meta["output_id"] = output_id
    assert metadata(name, path, output_id) == json.dumps(meta, sort_keys=True).encode("ascii")


def test_a_shard_is_what_tarfile_writes(tmp_path: Path) -> None:
    """Members, padding and the end of the archive as tarfile writes the same members."""
    folder = build_uniform_folder(tmp_path / "src", 5, 2)
    convert(folder, tmp_path / "out", format="webdataset", workers=1, progress=False)
    shard = tmp_path / "out" / "data-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    again = io.BytesIO()
    with tarfile.open(fileobj=again, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
    assert shard.read_bytes() == again.getvalue()


def test_a_tars_scan_is_packed_and_gives_back_what_was_found() -> None:
    """What the scan of a tar found (:class:`FoundTable`): every sample as it was found (no
    image, a problem, a JSON value that is a list, values and member sets repeated), through
    a pickle too (a scan task's result); 100,000 samples within 130 bytes each."""
    import pickle

    from imgpack.sources.webdataset.found import Found, FoundTable

    odd = [
        Found("a", "a.jpg", "3", None, ["cls"], 10, 0, 1536),
        Found("b", None, None, "no image member (.txt)", ["txt"], -1, 1536, 2560),
        Found("c.d", "c.d.PNG", 3, None, ["cls", "json"], 7, 2560, 4608),
        Found("é", "é.webp", [1, 2], None, [], 0, 4608, 5632),
        Found("f", "f.jpg", "3", "its members are not together", ["cls"], 5, 5632, 7168),
    ]
    table = FoundTable(odd)
    assert list(table) == odd and table[-1] == odd[-1] and table[1:3] == odd[1:3]
    assert [type(f.value) for f in table] == [str, type(None), int, list, str]
    assert list(pickle.loads(pickle.dumps(table))) == odd
    many = [Found(f"{i:09d}", f"{i:09d}.jpg", str(i % 10), None, ["cls"], 40_000 + i,
                  i * 43_008, (i + 1) * 43_008) for i in range(100_000)]  # fmt: skip
    packed, held, _ = traced(lambda: FoundTable(many))
    assert held / len(many) < 130, f"{held / len(many):.0f} bytes per sample"
    assert packed[54_321] == many[54_321] and len(packed) == len(many)


def test_a_saved_tar_scan_is_read_one_tar_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part or a resume takes the tars' scan saved with the listing instead of reading the
    tars again: the scan is saved one JSON line per tar and read back one line at a time,
    every sample as found, so the driver never holds the text of every tar's (100,000
    samples in 10 tars: within 200 bytes a sample at the peak while it is read back). A scan
    saved for another kind or listing, or unreadable, is not taken."""
    from imgpack.sources import listing
    from imgpack.sources.webdataset.found import Found, FoundTable

    digest = ["listing-1"]
    monkeypatch.setattr(listing, "_saveable", lambda folder: True)
    monkeypatch.setattr(listing, "_lines_digest", lambda folder: digest[0])
    tars = [
        FoundTable(Found(f"{t}-{i:06d}", f"{t}-{i:06d}.jpg", str(i % 10), None, ["cls"],
                         40_000 + i, i * 43_008, (i + 1) * 43_008) for i in range(10_000))
        for t in range(10)
    ]  # fmt: skip
    tars[3] = FoundTable([*tars[3][:5], Found("x", None, [1, 2], "no image member", [], -1, 0, 9)])
    scanned: list[int] = []

    def scan() -> list[FoundTable]:
        scanned.append(1)
        return tars

    def again(kind: str = "webdataset labelled=True") -> list[FoundTable]:
        return listing.scanned_once(
            tmp_path,
            kind,
            scan,
            lambda tar: [list(f) for f in tar],
            lambda kept: FoundTable(Found(*f) for f in kept),
        )

    assert again() is tars and len(scanned) == 1  # scanned, then saved
    with gzip.open(tmp_path / listing.STORE_SCAN, "rt") as saved:
        assert sum(1 for _ in saved) == 1 + len(tars)  # a head, then a line a tar
    kept, _, peak = traced(again)
    count = sum(len(t) for t in tars)
    assert len(scanned) == 1 and [list(t) for t in kept] == [list(t) for t in tars]
    assert peak / count < 200, f"{peak / count:.0f} bytes per sample"
    again("webdataset labelled=False")
    digest[0] = "listing-2"
    again()
    assert len(scanned) == 3  # another kind, another listing: scanned again
    (tmp_path / listing.STORE_SCAN).write_bytes(b"not gzip")
    assert again() is tars and len(scanned) == 4
