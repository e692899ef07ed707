"""A small ``tf.train.Example`` encoder/decoder written against the protobuf wire format.

Shared by the ``tfrecord`` writer and readers, so neither needs TensorFlow or protobuf::

    message Example  { Features features = 1; }
    message Features { map<string, Feature> feature = 1; }   // entries: key = 1, value = 2
    message Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                    Int64List int64_list = 3; } }
    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }

The encoder writes features in sorted key order and packed numeric lists, as TensorFlow does;
the decoder also accepts unpacked lists and skips unknown fields.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from imgpack.errors import DataError
from imgpack.fields import Field
from imgpack.images import Encoded

#: The feature holding the output id in every record imgpack writes.
OUTPUT_ID_KEY = "imgpack/output_id"

FeatureValue = list[bytes] | list[float] | list[int]
_FLOAT = struct.Struct("<f")

# -- encoding ----------------------------------------------------------------------------------


_SMALL = [bytes([n]) for n in range(0x80)]


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _SMALL[value]
    value &= 0xFFFFFFFFFFFFFFFF  # negative int64 as two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class FloatValues(list):
    """A feature's values that are floats, an empty list too (a ``float_list``; an empty plain
    list encodes as an ``int64_list``, which a reader asking for floats refuses)."""


def _feature(values: Sequence[bytes] | Sequence[float] | Sequence[int]) -> bytes:
    if isinstance(values, FloatValues):
        packed = b"".join(_FLOAT.pack(float(v)) for v in values)
        return _field(2, _field(1, packed) if values else b"")
    if all(isinstance(v, (bytes, bytearray, memoryview)) for v in values) and values:
        inner = b"".join(_field(1, bytes(v)) for v in values)  # type: ignore[arg-type]
        return _field(1, inner)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        packed = b"".join(_varint(int(v)) for v in values)
        return _field(3, _field(1, packed) if values else b"")
    if all(isinstance(v, (int, float)) for v in values):
        packed = b"".join(_FLOAT.pack(float(v)) for v in values)
        return _field(2, _field(1, packed))
    raise TypeError(f"a feature holds bytes, ints or floats, not {values!r}")


def encode_entry(key: str, values: Sequence[bytes] | Sequence[float] | Sequence[int]) -> bytes:
    """One ``Features.feature`` map entry: ``key`` and its value list."""
    return _field(1, _field(1, key.encode("utf-8")) + _field(2, _feature(values)))


def bytes_entry_head(key: str, size: int) -> bytes:
    """The bytes of ``encode_entry(key, [value])`` before ``value``, for a value of ``size``
    bytes (without building the value)."""
    key_field = _field(1, key.encode("utf-8"))
    value_field = _varint(1 << 3 | 2) + _varint(size)  # BytesList.value
    list_size = len(value_field) + size
    feature = _varint(1 << 3 | 2) + _varint(list_size)  # Feature.bytes_list
    feature_size = len(feature) + list_size
    inner = key_field + _varint(2 << 3 | 2) + _varint(feature_size)
    return _varint(1 << 3 | 2) + _varint(len(inner) + feature_size) + inner + feature + value_field


def encode_example(
    features: Mapping[str, Sequence[bytes] | Sequence[float] | Sequence[int]],
) -> bytes:
    """Serialize a ``tf.train.Example`` from ``{key: [values]}`` (bytes, int or float lists),
    its entries in key order."""
    return _field(1, b"".join(encode_entry(k, v) for k, v in sorted(features.items())))


def encode_example_around(
    features: Mapping[str, Sequence[bytes] | Sequence[float] | Sequence[int]],
    key: str,
    entries: Callable[[str, Any], bytes] = encode_entry,
) -> tuple[bytes, bytes]:
    """:func:`encode_example` split around the one bytes value of feature ``key``: ``(head,
    tail)`` with ``head + value + tail == encode_example(features)``, without copying the value
    (an image's bytes). ``entries`` encodes the other features (a caching wrapper of
    :func:`encode_entry`)."""
    before: list[bytes] = []
    after: list[bytes] = []
    size, found = 0, False
    for name in sorted(features):
        if name == key:
            (value,) = features[name]
            size = len(cast(bytes, value))
            before.append(bytes_entry_head(key, size))
            found = True
        else:
            (after if found else before).append(entries(name, features[name]))
    if not found:
        raise KeyError(key)
    head, tail = b"".join(before), b"".join(after)
    return _varint(1 << 3 | 2) + _varint(len(head) + size + len(tail)) + head, tail


def encode_varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a negative one as ten bytes of two's complement)."""
    return _varint(value)


def read_varint(data: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` of ``data`` (before ``end``) and the position after it."""
    return _read_varint(data, pos, end)


# -- decoding ----------------------------------------------------------------------------------
# One pass over the bytes with the tags of the messages above inlined, one-byte tags and
# lengths (most of an Example's) read without a call: a record imgpack writes is parsed in
# ~50 µs. Unknown fields are skipped; truncation raises DataError.

_EXAMPLE_FEATURES = 0x0A  # Example.features, length-delimited
_ENTRY = 0x0A  # Features.feature map entry
_KEY, _VALUE = 0x0A, 0x12  # map entry key / value
_BYTES_LIST, _FLOAT_LIST, _INT64_LIST = 0x0A, 0x12, 0x1A  # Feature oneof
_LIST_PACKED, _FLOAT_ONE, _INT_ONE = 0x0A, 0x0D, 0x08  # value = 1 as packed / fixed32 / varint


def _read_varint(data: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    if pos < end and data[pos] < 0x80:  # most are one byte: tags, keys' and small lengths
        return data[pos], pos + 1
    result = shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DataError("varint longer than 10 bytes in Example")
    raise DataError("truncated varint in Example")


def _length(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The end of the length-delimited field whose length starts at ``pos``, and its start."""
    if pos < end and data[pos] < 0x80:  # most lengths in an Example are one byte
        length, pos = data[pos], pos + 1
    else:
        length, pos = _read_varint(data, pos, end)
    if pos + length > end:
        raise DataError("length-delimited field runs past the end of the Example")
    return pos + length, pos


def _skip(data: bytes, pos: int, end: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(data, pos, end)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        return _length(data, pos, end)[0]
    if wire == 5:
        return pos + 4
    raise DataError(f"unsupported protobuf wire type {wire} in Example")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_list(data: bytes, kind: int, pos: int, end: int) -> FeatureValue:
    out: list[Any] = []
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos, end)
        if tag == _LIST_PACKED and kind != _FLOAT_LIST:
            stop, pos = _length(data, pos, end)
            if kind == _BYTES_LIST:
                out.append(data[pos:stop])
                pos = stop
                continue
            while pos < stop:  # packed int64 values
                value = data[pos]
                if value < 0x80:
                    pos += 1
                else:
                    value, pos = _read_varint(data, pos, stop)
                out.append(_signed(value))
        elif kind == _INT64_LIST and tag == _INT_ONE:
            value, pos = _read_varint(data, pos, end)
            out.append(_signed(value))
        elif kind == _FLOAT_LIST and tag == _LIST_PACKED:
            stop, pos = _length(data, pos, end)
            out.extend(x for (x,) in _FLOAT.iter_unpack(data[pos:stop]))
            pos = stop
        elif kind == _FLOAT_LIST and tag == _FLOAT_ONE:
            out.append(_FLOAT.unpack_from(data, pos)[0])
            pos += 4
        else:
            pos = _skip(data, pos, end, tag & 7)
    if pos != end:
        raise DataError("truncated field in Example")
    return out


def _decode_feature(data: bytes, pos: int, end: int) -> FeatureValue:
    value: FeatureValue = []
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos, end)
        if tag in (_BYTES_LIST, _FLOAT_LIST, _INT64_LIST):
            stop, pos = _length(data, pos, end)
            value = _decode_list(data, tag, pos, stop)
            pos = stop
        else:
            pos = _skip(data, pos, end, tag & 7)
    return value


def _decode_entry(data: bytes, pos: int, end: int) -> tuple[str, FeatureValue]:
    """A ``Features.feature`` map entry: its key and value."""
    key, value = "", cast(FeatureValue, [])
    while pos < end:
        tag = data[pos]
        if tag != _KEY and tag != _VALUE:
            tag, pos = _read_varint(data, pos, end)
            if tag != _KEY and tag != _VALUE:
                pos = _skip(data, pos, end, tag & 7)
                continue
        else:
            pos += 1
        field_end, pos = _length(data, pos, end)
        if tag == _KEY:
            try:
                key = data[pos:field_end].decode("utf-8")
            except UnicodeDecodeError:
                raise DataError("a feature key in Example is not UTF-8") from None
        else:
            value = _decode_feature(data, pos, field_end)
        pos = field_end
    return key, value


def decode_example(data: bytes | memoryview) -> dict[str, FeatureValue]:
    """Parse a serialized ``tf.train.Example`` into ``{key: [values]}``."""
    data = bytes(data)
    features: dict[str, FeatureValue] = {}
    pos, end = 0, len(data)
    while pos < end:
        tag, pos = _read_varint(data, pos, end)
        if tag != _EXAMPLE_FEATURES:
            pos = _skip(data, pos, end, tag & 7)
            continue
        stop, pos = _length(data, pos, end)
        while pos < stop:
            if data[pos] == _ENTRY:
                pos += 1
            else:
                tag, pos = _read_varint(data, pos, stop)
                if tag != _ENTRY:
                    pos = _skip(data, pos, stop, tag & 7)
                    continue
            entry_end, pos = _length(data, pos, stop)
            key, value = _decode_entry(data, pos, entry_end)
            features[key] = value
            pos = entry_end
        pos = stop
    if pos != end:
        raise DataError("truncated field in Example")
    return features


def example_features(
    sample: Encoded, class_name: str, label_offset: int, output_id: str = ""
) -> dict[str, Any]:
    """The features of one sample's record."""
    features: dict[str, Any] = {
        "image/encoded": [sample.payload],
        "image/format": [sample.kind.value.encode()],
        "image/class/label": [sample.label + label_offset],
        "image/class/text": [class_name.encode("utf-8")],
        "image/height": [sample.height],
        "image/width": [sample.width],
        "image/channels": [sample.channels],
        "image/colorspace": [b"RGB" if sample.channels == 3 else b"Grayscale"],
        "image/filename": [sample.path.encode("utf-8", "surrogateescape")],
    }
    if output_id:
        features[OUTPUT_ID_KEY] = [output_id.encode("ascii")]
    return features


def field_features(fields: Sequence[Field], values: Mapping[str, Any]) -> dict[str, Any]:
    """A sample's field ``values`` as features under the fields' names: ``str``, ``bytes`` and
    ``json`` (its compact text) a ``bytes_list`` of one value, ``int`` and ``int[]`` an
    ``int64_list``, ``float`` and ``float[]`` a ``float_list``; an absent value has none."""
    out: dict[str, Any] = {}
    for f in fields:
        value = values.get(f.name)
        if value is None:
            continue
        if f.type in ("str", "bytes", "json"):
            out[f.name] = [f.encode(value)]
        elif f.type == "int":
            out[f.name] = [value]
        elif f.type == "float":
            out[f.name] = FloatValues([value])
        elif f.type == "int[]":
            out[f.name] = [int(v) for v in value]
        else:
            out[f.name] = FloatValues(float(v) for v in value)
    return out


def field_stored(found: Field, feature: FeatureValue | None, where: str) -> bytes | None:
    """The stored bytes of field ``found`` from its feature in a record (``None``: absent);
    :class:`DataError` for a feature of another kind or length."""
    if feature is None:
        if not found.optional:
            raise DataError(f"{where}: no feature {found.name!r} ({found.type}, required)")
        return None
    try:
        if found.type in ("str", "bytes", "json"):
            (value,) = feature
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError("not a bytes_list")
            data = bytes(value)
            found.decode(data)  # the text is UTF-8, the JSON JSON
            return data
        if found.type in ("int", "float"):
            (number,) = feature
            return found.encode(found.value(number, where))
        return found.encode(found.value(list(feature), where))
    except (ValueError, TypeError, DataError) as exc:
        raise DataError(
            f"{where}: feature {found.name!r} is not a {found.type} value ({exc})"
        ) from None
