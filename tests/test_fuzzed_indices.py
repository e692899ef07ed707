"""Whatever index a user passes, a reader answers like a Python sequence: the sample, or an
``IndexError`` (out of range) or a ``TypeError`` (not an integer) — never another sample, a
rounded float, a parsed string, a crash or a signal. For ``ds[i]``, ``ds.__getitems__`` (what
DataLoader calls) and ``Mix``, in every format, raw and encoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from imgpack import convert, open_dataset
from imgpack.loading import Mix
from imgpack.sample import make_sample_folder

COUNT = 12
CASES = [
    ("pt", "raw"),
    ("pt", "original"),
    ("lmdb", "raw"),
    ("lmdb", "original"),
    ("hdf5", "raw"),
    ("tfrecord", "raw"),
    ("tfrecord", "original"),
    ("webdataset", "raw"),
    ("webdataset", "original"),
]


@pytest.fixture(scope="module")
def readers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("fuzz-indices")
    make_sample_folder(root / "src", COUNT, 3, seed=2)
    found = {}
    for fmt, encoding in CASES:
        out = root / f"{fmt}-{encoding}"
        convert(root / "src", out, fmt, progress=False, size=8, encoding=encoding)
        found[f"{fmt}-{encoding}"] = open_dataset(out)
    return found


#: Integers of other types, and things that look like one but are not.
ODD_INDICES = [np.int64(3), np.int32(-2), np.uint64(2**63), torch.tensor(5), np.float64(2.0),
               slice(0, 2), [1], (1,)]  # fmt: skip


#: Each property runs this many examples per reader (hypothesis, no deadline: reads vary).
FUZZ = settings(max_examples=60, deadline=None)


@pytest.fixture(params=[f"{f}-{e}" for f, e in CASES])
def case(readers: dict[str, object], request: pytest.FixtureRequest) -> tuple[object, list]:
    """A reader and every one of its samples, read in order."""
    ds = readers[request.param]
    return ds, [ds[i] for i in range(COUNT)]  # type: ignore[index]


def test_single_indices_answer_like_a_sequence(case: tuple[object, list]) -> None:
    ds, expected = case

    @FUZZ
    @given(
        st.one_of(
            st.integers(min_value=-(2**70), max_value=2**70),
            st.floats(allow_nan=True),
            st.text(max_size=3),
            st.none(),
            st.sampled_from(ODD_INDICES),
        )
    )
    def check(index: object) -> None:
        try:
            as_int = int(index.__index__())  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            with pytest.raises(TypeError):
                ds[index]  # type: ignore[index]
            return
        if -COUNT <= as_int < COUNT:
            image, label = ds[index]  # type: ignore[index]
            want_image, want_label = expected[as_int]
            assert torch.equal(image, want_image) and label == want_label
        else:
            with pytest.raises(IndexError):
                ds[index]  # type: ignore[index]

    check()


def test_batches_answer_like_a_sequence(case: tuple[object, list]) -> None:
    ds, expected = case

    @FUZZ
    @given(
        st.one_of(
            st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=20),
            st.lists(st.integers(min_value=-COUNT, max_value=COUNT - 1), max_size=20),
            st.lists(st.floats(), min_size=1, max_size=3),
            st.lists(st.text(max_size=2), min_size=1, max_size=3),
        ),
        st.sampled_from(["list", "array", "tensor"]),
    )
    def check(indices: list, kind: str) -> None:
        if kind == "array":
            batch = np.asarray(indices) if indices else np.empty(0, np.int64)
        elif kind == "tensor" and all(isinstance(i, int) for i in indices):
            batch = torch.tensor(indices, dtype=torch.int64)
        else:
            batch = indices
        if not all(isinstance(i, int) for i in indices):
            with pytest.raises(TypeError):
                ds.__getitems__(batch)  # type: ignore[attr-defined]
            return
        if any(not -COUNT <= i < COUNT for i in indices):
            with pytest.raises(IndexError):
                ds.__getitems__(batch)  # type: ignore[attr-defined]
            return
        got = ds.__getitems__(batch)  # type: ignore[attr-defined]
        assert len(got) == len(indices)
        for (image, label), i in zip(got, indices, strict=True):
            assert torch.equal(image, expected[i][0]) and int(label) == expected[i][1]

    check()


def test_a_mix_refuses_what_its_readers_refuse(readers: dict[str, object]) -> None:
    mix = Mix([readers["pt-raw"], readers["lmdb-raw"]])
    total = len(mix)
    for bad in (-1, total, 2**40):
        with pytest.raises(IndexError):
            mix.__getitems__([bad])
        with pytest.raises(IndexError):
            mix[bad]
    for bad in (1.5, "1", None):
        with pytest.raises(TypeError):
            mix[bad]  # type: ignore[index]
        with pytest.raises(TypeError):
            mix.__getitems__([bad])
    assert len(mix.__getitems__([0, total - 1])) == 2
