"""Per-sample fields in the data model (#43, its first step): the types and their values, the
stored bytes each value has, the names a field may take, the manifest's list, and the record
checksum over a sample's fields."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from conftest import build_uniform_folder
from hypothesis import given, settings
from hypothesis import strategies as st

from imgpack import convert, open_dataset
from imgpack.checksum import record_crc
from imgpack.errors import DataError, ManifestError, OptionError
from imgpack.fields import (
    RESERVED,
    TYPES,
    Field,
    check_name,
    fields_crc,
    fields_from_json,
    parse_fields,
    sample_values,
)
from imgpack.manifest import Manifest, read_manifest

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
VALUES = {
    "str": st.text(),
    "bytes": st.binary(),
    "int": st.integers(-(2**63), 2**63 - 1),
    "float": FLOAT32,
    "json": JSON.filter(lambda v: v is not None),  # a top-level null is the field's absence
    "int[]": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8),
    "float[]": st.lists(FLOAT32, max_size=8),
}


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


@pytest.mark.parametrize("kind", TYPES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_value_reads_back_from_its_stored_bytes(kind: str, data: st.DataObject) -> None:
    field = Field("x", kind)
    value = field.value(data.draw(VALUES[kind]), "sample 0")
    stored = field.encode(value)
    assert isinstance(stored, bytes)
    assert _same(field.decode(stored), value)
    assert field.encode(field.decode(stored)) == stored  # one stored form per value


def test_the_stored_bytes_are_what_the_docs_say() -> None:
    assert Field("a", "str").encode("é") == "é".encode()
    assert Field("a", "int").encode(-2) == struct.pack("<q", -2)
    assert Field("a", "float").encode(0.5) == struct.pack("<f", 0.5)
    assert Field("a", "json").encode({"w": [1, 2.5], "t": "é"}) == '{"w":[1,2.5],"t":"é"}'.encode()
    assert Field("a", "int[]").encode(Field("a", "int[]").value([1, -1], "")) == struct.pack(
        "<qq", 1, -1
    )
    assert Field("a", "float[]").encode(Field("a", "float[]").value([], "")) == b""


def test_values_are_taken_as_sources_give_them() -> None:
    """Numbers from text (a CSV cell) and from JSON (3.0 for 3), floats kept as float32."""
    assert Field("n", "int").value("42", "") == 42 and Field("n", "int").value(3.0, "") == 3
    assert Field("s", "float").value("0.1", "") == float(np.float32(0.1))
    assert Field("s", "float").value(np.float64(2.5), "") == 2.5
    ints = Field("m", "int[]").value((1, 2, np.int64(3)), "")
    assert ints.dtype == np.dtype("<i8") and ints.tolist() == [1, 2, 3]
    assert Field("m", "float[]").value(np.arange(3), "").dtype == np.dtype("<f4")


@pytest.mark.parametrize(
    ("kind", "value", "says"),
    [
        ("int", True, "expected an integer"),
        ("int", 2.5, "expected an integer"),
        ("int", "x", "expected an integer"),
        ("int", 2**63, "out of int64's range"),
        ("float", math.nan, "not a finite float32"),
        ("float", 1e39, "not a finite float32"),
        ("float", "abc", "could not convert"),
        ("float", False, "expected a number"),
        ("str", b"x", "expected text"),
        ("str", "\udcff", "surrogates not allowed"),
        ("bytes", "x", "expected bytes"),
        ("json", {1: object()}, "not a JSON value"),
        ("json", math.inf, "not a JSON value"),
        ("int[]", [[1, 2], [3, 4]], "flat list"),
        ("int[]", [1.5], "not of fractions"),
        ("int[]", "12", "expected a list"),
        ("float[]", ["a"], "expected a list of numbers"),
        ("float[]", [math.inf], "not a finite float32"),
    ],
)
def test_a_bad_value_is_refused_naming_the_sample_and_the_field(
    kind: str, value: object, says: str
) -> None:
    where = re.escape(f"labels.csv, line 7: field 'x' ({kind}): ")
    with pytest.raises(DataError, match=rf"^{where}.*{re.escape(says)}"):
        Field("x", kind).value(value, "labels.csv, line 7")


def test_a_missing_value_is_refused_unless_the_field_is_optional() -> None:
    required, optional = Field.parse("caption:str"), Field.parse("score:float?")
    assert optional.optional and optional.spec == "score:float?" and not required.optional
    with pytest.raises(DataError, match=r"a/b.jpg: no value for the field 'caption' \(str"):
        sample_values([required, optional], {}, "a/b.jpg")
    assert sample_values([optional], {}, "a/b.jpg") == {"score": None}
    with pytest.raises(DataError, match="no value for the field 'meta'"):  # JSON's null: absent
        Field("meta", "json").value(None, "a/b.jpg")


@pytest.mark.parametrize("name", ["", "1x", "a-b", "a/b", "a.b", "x" * 65, "é"])
def test_a_name_no_format_can_store_is_refused(name: str) -> None:
    with pytest.raises(OptionError, match="invalid field name"):
        check_name(name)


@pytest.mark.parametrize("name", [*sorted(RESERVED), "Label", "IMAGES"])
def test_imgpack_own_keys_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(OptionError, match=f"the field name {name!r} is one of imgpack's own keys"):
        check_name(name)


def test_field_specs_are_parsed_and_checked() -> None:
    assert parse_fields(["txt:str", "json:json", "boxes:float[]?"]) == [
        Field("txt", "str"),
        Field("json", "json"),  # LAION's metadata member: a field like any other
        Field("boxes", "float[]", optional=True),
    ]
    with pytest.raises(OptionError, match="expected NAME:TYPE"):
        parse_fields(["caption"])
    with pytest.raises(OptionError, match="unknown type 'text'"):
        parse_fields(["caption:text"])
    with pytest.raises(OptionError, match="more than once: txt"):
        parse_fields(["txt:str", "txt:bytes"])


def test_the_checksum_covers_each_field_as_documented() -> None:
    """A record without fields keeps its checksum; with fields, the checksum is the payload's
    and label's extended over each field: a presence byte, the length, the bytes."""
    payload, label = b"\xff\xd8 pixels", 3
    crc = record_crc(payload, label)
    assert fields_crc(crc, [], {}) == crc
    fields = [Field("txt", "str"), Field("score", "float", optional=True)]
    values = sample_values(fields, {"txt": "a cat"}, "")
    expected = google_crc32c.value(
        payload + struct.pack("<q", label) + b"\x01" + struct.pack("<Q", 5) + b"a cat" + b"\x00"
    )
    assert fields_crc(crc, fields, values) == expected
    edited = sample_values(fields, {"txt": "a cau"}, "")
    moved = sample_values(fields, {"txt": "a ca", "score": None}, "")
    assert len({expected, fields_crc(crc, fields, edited), fields_crc(crc, fields, moved)}) == 3


def test_the_manifest_lists_fields_only_when_an_output_has_some(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "src", count=4, classes=2, size=8)
    convert(src, tmp_path / "out", "pt", progress=False)
    text = (tmp_path / "out" / "imgpack.json").read_text()
    manifest = read_manifest(tmp_path / "out")
    assert manifest.fields == [] and '"fields"' not in text  # the bytes of before
    data = manifest.to_json()
    data["fields"] = [{"name": "txt", "type": "str"}, {"name": "boxes", "type": "json?"}]
    parsed = Manifest.from_json(json.loads(json.dumps(data)))
    assert parsed.fields == [Field("txt", "str"), Field("boxes", "json", optional=True)]
    assert parsed.to_json()["fields"] == data["fields"]
    for bad in ([{"name": "label", "type": "str"}], [{"name": "x"}], {"x": "str"}):
        with pytest.raises(ManifestError, match="malformed fields"):
            fields_from_json(bad)


def pt_listing_a_field_it_lacks(tmp_path: Path) -> Path:
    """A ``pt`` output without fields whose manifest was edited to list ``txt:str``."""
    src = build_uniform_folder(tmp_path / "src", count=4, classes=2, size=8)
    convert(src, tmp_path / "out", "pt", progress=False)
    path = tmp_path / "out" / "imgpack.json"
    data = json.loads(path.read_text())
    data["fields"] = [{"name": "txt", "type": "str"}]
    path.write_text(json.dumps(data))
    return tmp_path / "out"


def test_a_reader_refuses_an_output_whose_fields_it_does_not_read(tmp_path: Path) -> None:
    """A reader that reads no fields (a plugin's, written before fields) refuses an output
    whose manifest lists some in one line, never reads it with its fields dropped."""
    from imgpack.formats.pt.reader import PTDataset

    class NoFields(PTDataset):
        reads_fields = False

    out = pt_listing_a_field_it_lacks(tmp_path)
    with pytest.raises(ManifestError, match=r"its samples carry fields \(txt:str\)"):
        NoFields(out)


def test_a_pt_shard_without_the_fields_its_manifest_lists_is_refused(tmp_path: Path) -> None:
    """A manifest that lists fields its shards do not hold (edited, or a shard swapped) is a
    damaged output: the shard is refused by name when it is read."""
    ds = open_dataset(pt_listing_a_field_it_lacks(tmp_path))
    with pytest.raises(DataError, match=r"shard-00000.pt: damaged shard: no fields"):
        ds[0]
