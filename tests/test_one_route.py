"""The read seam (#56), step 1: one route opens an output (:func:`imgpack.opening.open_output`),
and every reader is built from what it opened: the manifest is read once per open, local or
from a bucket (moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.manifest import Manifest
from imgpack.opening import Opened, open_output
from imgpack.readers import ReadOptions, reader_class
from imgpack.storage.files import CachedFiles, LazyFiles, LocalFiles


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("route") / "src", count=12, size=8)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every manifest parsed from now on, by where it was read."""
    read: list[str] = []
    real = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: Any, where: str = "") -> Manifest:
        read.append(where)
        return real(cls, data, where)

    monkeypatch.setattr(Manifest, "from_json", classmethod(counted))
    return read


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_local_open_reads_the_manifest_once(
    src: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    convert(src, out, fmt, progress=False)
    read = _counting(monkeypatch)
    ds = open_dataset(out)
    assert len(read) == 1, read
    assert isinstance(ds.opened, Opened) and isinstance(ds.opened.files, LocalFiles)
    assert ds.opened.manifest is ds.manifest and ds.root == out
    # a reader built from what the route opened reads nothing again
    opened = open_output(out)
    del read[:]
    again = reader_class(fmt)(opened, options=ReadOptions(size=4))
    assert read == [] and again[0][0].shape[1:] == (4, 4)
    # the path-taking convenience goes through the route too
    del read[:]
    assert len(reader_class(fmt)(out)) == len(ds) and len(read) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bucket_open_reads_the_manifest_once(
    s3: str, src: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3}/route-{fmt}"
    convert(src, url, fmt, progress=False)
    read = _counting(monkeypatch)
    ds = open_dataset(url, cache_dir=tmp_path / "cache")
    assert len(read) == 1, read
    lazy = reader_class(fmt).lazy_files
    assert isinstance(ds.opened.files, LazyFiles if lazy else CachedFiles)
    assert ds.opened.location == url and len(ds) == 12
    assert ds[11][1] == open_dataset(url, cache_dir=tmp_path / "cache")[11][1]


def test_a_cached_outputs_entry_is_pinned_by_its_reader_and_let_go_with_it(
    s3: str, src: Path, tmp_path: Path
) -> None:
    """The pin on a cache entry is the opened output's (no process-global pins): eviction
    skips the entry while its reader lives, and may take it once the reader is gone."""
    import gc

    from imgpack.storage.cache import OutputCache

    url = f"{s3}/pinned-lmdb"
    convert(src, url, "lmdb", progress=False)
    cache = tmp_path / "cache"
    ds = open_dataset(url, cache_dir=cache)
    entry = ds.root
    small = OutputCache(cache, max_bytes=1)
    small.evict()
    assert entry.exists() and len(ds) == 12  # read now: not evicted
    del ds
    gc.collect()
    small.evict()
    assert not entry.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dropped_reader_is_freed_at_once(src: Path, tmp_path: Path, fmt: str) -> None:
    """No reference cycle keeps a reader (its handles, its LMDB environment, its maps) alive
    after its last reference goes: its files' holder keeps the reader's hook weakly."""
    import gc
    import weakref

    out = tmp_path / "out"
    convert(src, out, fmt, progress=False)
    gc.disable()
    try:
        ds = open_dataset(out)
        ds.__getitems__([0, 1])
        gone = weakref.ref(ds)
        del ds
        assert gone() is None
    finally:
        gc.enable()


def test_the_keywords_are_read_options_fields() -> None:
    """The one list of common reader keywords (typed, for the path-taking convenience) is
    ReadOptions' fields, neither more nor fewer."""
    from dataclasses import fields

    from imgpack.opening import ReadKeywords

    assert set(ReadKeywords.__annotations__) == {f.name for f in fields(ReadOptions)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_takes_options_or_keywords_not_a_stray_positional(
    src: Path, tmp_path: Path, fmt: str
) -> None:
    """``(opened, options)`` positionally, keywords by name; a transform given where options go
    (the old second positional) is refused in one line, as is options with keywords."""
    from imgpack.errors import OptionError

    out = tmp_path / "out"
    convert(src, out, fmt, progress=False)
    opened = open_output(out)
    reader = reader_class(fmt)
    by_options = reader(opened, ReadOptions(size=4))
    by_keywords = reader(out, size=4)
    assert by_options[3][0].equal(by_keywords[3][0]) and by_options[3][0].shape[1:] == (4, 4)
    with pytest.raises(OptionError, match="takes a ReadOptions"):
        reader(out, lambda image: image)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="not both"):
        reader(opened, ReadOptions(), size=4)
    with pytest.raises(TypeError):
        reader(out, sizes=4)  # type: ignore[call-arg]
