"""The newest surfaces tried as a hostile user would: every bad argument of the sampler, Mix,
the read options and a saved state is one OptionError naming it, at construction."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.errors import OptionError
from imgpack.loading import Loader, Mix, ShardSampler


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    base = tmp_path_factory.mktemp("sizes")
    src = build_uniform_folder(base / "src", count=12, classes=2, size=16)
    for name, size in (("small", 8), ("large", 12)):
        convert(src, base / name, format="pt", encoding="raw", size=size, progress=False)
    return open_dataset(base / "small"), open_dataset(base / "large")


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"window": math.nan}, "window"),
        ({"window": 0}, "window"),
        ({"block_size": math.nan}, "block_size"),
        ({"rank": "0", "num_replicas": 2}, "rank"),
        ({"num_replicas": 2.5, "rank": 0}, "num_replicas"),
        ({"num_replicas": 2, "rank": 2}, "rank"),
    ],
)
def test_a_bad_sampler_argument_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    with pytest.raises(OptionError, match=named):
        ShardSampler(two_sizes[0], **keywords)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"weights": [math.nan, 1]}, "weights"),
        ({"weights": [math.inf, 1]}, "weights"),
        ({"weights": [math.inf, math.inf]}, "weights"),
        ({"weights": [-1, 2]}, "weights"),
        ({"weights": [0, 0]}, "weights"),
        ({"samples": 0}, "samples"),
        ({"samples": -5}, "samples"),
        ({"counts": [0, 0]}, "counts"),
        ({"counts": [math.nan, 1]}, "count"),
        ({"counts": [1]}, "counts"),
    ],
)
def test_a_bad_mix_argument_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    small = two_sizes[0]
    with pytest.raises(OptionError, match=named):
        Mix([small, small], **keywords)


def test_a_mix_of_image_sizes_is_refused_with_the_way_out(two_sizes: tuple[Any, Any]) -> None:
    small, large = two_sizes
    with pytest.raises(OptionError, match=r"3x8x8.*3x12x12.*size="):
        Mix([small, large])
    resized = open_dataset(large.root, size=8)
    mix = Mix([small, resized])  # one size: batches stack
    loader = Loader(mix, batch_size=24, sampler=ShardSampler(mix, seed=0))
    images, _ = next(iter(loader))
    assert tuple(images.shape) == (24, 3, 8, 8)


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"prefetch": "x"}, "prefetch"),
        ({"prefetch": -1}, "prefetch"),
        ({"decode_threads": 0}, "decode_threads"),
        ({"resize": "squash"}, "resize"),
    ],
)
def test_a_bad_read_option_is_refused_by_name(
    two_sizes: tuple[Any, Any], keywords: dict[str, Any], named: str
) -> None:
    with pytest.raises(OptionError, match=named):
        open_dataset(two_sizes[0].root, **keywords)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"epoch": -1}, "epoch"),
        ({"epoch": "0"}, "epoch"),
        ({"consumed": 10**9}, "consumed"),
        ({"consumed": -1}, "consumed"),
        ({"imgpack_sampler": 99}, "version"),
    ],
)
def test_a_damaged_state_is_refused_when_loaded(
    two_sizes: tuple[Any, Any], change: dict[str, Any], match: str
) -> None:
    sampler = ShardSampler(two_sizes[0], seed=1)
    state = {**sampler.state_dict(), **change}
    with pytest.raises(OptionError, match=match):
        ShardSampler(two_sizes[0], seed=1).load_state_dict(state)
    with pytest.raises(OptionError, match="not an imgpack sampler state"):
        sampler.load_state_dict({"something": "else"})


def test_a_loader_state_resumes_a_sampler_and_the_other_way(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=20, classes=2, size=8)
    convert(src, tmp_path / "out", format="pt", progress=False)
    ds = open_dataset(tmp_path / "out")
    loader = Loader(ds, batch_size=4, sampler=ShardSampler(ds, seed=2))
    batches = iter(loader)
    next(batches)
    sampler = ShardSampler(ds, seed=2)
    sampler.load_state_dict(loader.state_dict())  # a Loader's state, into a bare sampler
    assert len(list(sampler)) == 16 and len(sampler) == 20  # len: the whole epoch


@pytest.mark.parametrize("name", ["o[1]", "o**x", "o?"])
def test_a_destination_name_is_never_a_pattern(tmp_path: Path, name: str) -> None:
    """A DST whose name has glob characters is converted as named, and never takes over the
    parked or temporary folders of another output whose name the pattern would match."""
    from click.testing import CliRunner

    from imgpack.cli import main
    from imgpack.publishing import PARKED_SUFFIX, TEMP_SUFFIX

    src = build_uniform_folder(tmp_path / "src", count=6, classes=2, size=8)
    convert(src, tmp_path / "o1", format="pt", progress=False)
    parked = tmp_path / f".o1.1234{PARKED_SUFFIX}"
    temp = tmp_path / f".o1.5678{TEMP_SUFFIX}"
    for folder in (parked, temp):
        folder.mkdir()
        (folder / "keep").write_text("another output's")
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / name), "-q", "--format", "pt"]
    )
    assert result.exit_code == 0, result.output
    assert len(open_dataset(tmp_path / name)) == 6
    assert (parked / "keep").read_text() == (temp / "keep").read_text() == "another output's"


class Hung(Exception):  # not an OSError: nothing that handles a failed read catches it
    pass


@contextlib.contextmanager
def _within(seconds: int) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM interrupts a blocking open or read."""

    def expired(signum: int, frame: Any) -> None:
        raise Hung(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("fmt", ["pt", "lmdb"])
@pytest.mark.parametrize("where", ["imgpack.json", "marker"])
def test_a_fifo_in_a_cache_entry_never_hangs_a_reader(tmp_path: Path, fmt: str, where: str) -> None:
    import fsspec  # type: ignore[import-untyped]

    src = build_uniform_folder(tmp_path / "src", count=8, classes=2, size=8)
    convert(src, tmp_path / "local", format=fmt, progress=False)
    url = f"memory://fifo-{tmp_path.name}-{fmt}-{where}/out"
    fs = fsspec.filesystem("memory")
    for path in (tmp_path / "local").iterdir():
        fs.pipe(f"{url}/{path.name}", path.read_bytes())
    cache = tmp_path / "cache"
    expected = [int(label) for _, label in open_dataset(url, cache_dir=cache)]
    (entry,) = [p for p in (cache / "outputs").iterdir() if p.is_dir()]
    markers = [
        p for p in entry.iterdir() if p.name.endswith((".checked", ".kept", ".imgpack-cache.json"))
    ]
    targets = [entry / "imgpack.json"] if where == "imgpack.json" else markers
    assert targets
    for target in targets:
        target.unlink()
        os.mkfifo(target)
    with _within(20):
        got = [int(label) for _, label in open_dataset(url, cache_dir=cache)]
    assert got == expected


def _convert_cli(*args: str) -> Any:
    from click.testing import CliRunner

    from imgpack.cli import main

    return CliRunner().invoke(main, ["convert", *args, "--format", "pt", "-q"])


def _png(path: Path, value: int) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8), (value, value, value)).save(path)


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ("big.png,1099511627776", "label 1099511627776 is beyond the 1,048,576 classes"),
        ("big.png," + "9" * 5000, "is beyond the 1,048,576 classes"),
        ("file:///dev/zero,1", "not a regular file (a character device)"),
    ],
)
def test_an_unbounded_label_list_row_is_refused_by_line(
    tmp_path: Path, row: str, said: str
) -> None:
    for name, value in (("a.png", 10), ("b.png", 200), ("big.png", 90)):
        _png(tmp_path / name, value)
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\na.png,0\nb.png,1\n{row}\n")
    failed = _convert_cli(str(listing), str(tmp_path / "out"))
    assert failed.exit_code == 1 and said in failed.output and "line 4" in failed.output
    assert "Traceback" not in failed.output and not (tmp_path / "out").exists()
    skipped = _convert_cli(str(listing), str(tmp_path / "out"), "--on-error", "skip")
    assert skipped.exit_code == 0, skipped.output
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 2 and ds.classes == ["0", "1"] and said in ds.manifest.skipped[0]["reason"]


def test_a_csv_field_over_the_csv_limit_is_one_line(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 10)
    listing = tmp_path / "list.csv"
    listing.write_text(f'path,label\na.png,0\n"{"x" * 200_000}",1\n')
    result = _convert_cli(str(listing), str(tmp_path / "out"))
    assert result.exit_code == 1 and "line 3: not a CSV row" in result.output, result.output
    assert "Traceback" not in result.output


def _tar(path: Path, members: list[tuple[str, bytes]], declare_last: int | None = None) -> None:
    """A tar of ``members``; ``declare_last``: the last member's header says that many bytes
    (its data stays as it is: the tar ends inside what it declares)."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = bytearray(buffer.getvalue())
    if declare_last is not None:
        at = raw.rfind(members[-1][0].encode())
        raw[at + 124 : at + 136] = b"%012o" % declare_last
        raw[at + 148 : at + 156] = b" " * 8
        raw[at + 148 : at + 156] = b"%06o\x00 " % sum(raw[at : at + 512])
    path.write_bytes(bytes(raw))


def _png_bytes(value: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("bad", ["label", "size"])
def test_a_foreign_tar_member_that_cannot_be_is_named_not_lost(tmp_path: Path, bad: str) -> None:
    """A ``.cls`` of 2**40, or a last member whose header declares 40 GiB: the sample is named
    (the run stops on it, or skips and records it), never silently left out."""
    tars = tmp_path / "tars"
    tars.mkdir()
    members = [("000.cls", b"0"), ("000.png", _png_bytes(10)), ("001.cls", b"1")]
    members += [("001.png", _png_bytes(90))]
    if bad == "label":
        members += [("002.png", _png_bytes(200)), ("002.cls", str(2**40).encode())]
        said, declared = "beyond the 1,048,576 classes", None
    else:
        members += [("002.cls", b"1"), ("002.png", _png_bytes(200))]
        said, declared = "declares 42,949,672,960 bytes, past the end of the tar", 40 << 30
    _tar(tars / "a.tar", members, declared)
    failed = _convert_cli(str(tars), str(tmp_path / "out"))
    assert failed.exit_code == 1 and said in failed.output and "'002'" in failed.output
    assert "Traceback" not in failed.output
    skipped = _convert_cli(str(tars), str(tmp_path / "out"), "--on-error", "skip")
    assert skipped.exit_code == 0, skipped.output
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 2 and [s["path"] for s in ds.manifest.skipped] == ["a.tar/002.png"]
