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
from collections.abc import Mapping, Sequence

from imgpack.errors import DataError

FeatureValue = list[bytes] | list[float] | list[int]
_FLOAT = struct.Struct("<f")

# -- encoding ----------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
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


def _feature(values: Sequence[bytes] | Sequence[float] | Sequence[int]) -> bytes:
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


def encode_example(
    features: Mapping[str, Sequence[bytes] | Sequence[float] | Sequence[int]],
) -> bytes:
    """Serialize a ``tf.train.Example`` from ``{key: [values]}`` (bytes, int or float lists)."""
    entries = b"".join(
        _field(1, _field(1, key.encode("utf-8")) + _field(2, _feature(values)))
        for key, values in sorted(features.items())
    )
    return _field(1, entries)


# -- decoding ----------------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DataError("truncated varint in Example")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DataError("varint longer than 10 bytes in Example")


def _fields(buf: memoryview) -> list[tuple[int, int, memoryview | int]]:
    """``(field number, wire type, value)`` of every field of one message."""
    out: list[tuple[int, int, memoryview | int]] = []
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            out.append((number, wire, value))
        elif wire == 1:
            out.append((number, wire, buf[pos : pos + 8]))
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise DataError("length-delimited field runs past the end of the Example")
            out.append((number, wire, buf[pos : pos + length]))
            pos += length
        elif wire == 5:
            out.append((number, wire, buf[pos : pos + 4]))
            pos += 4
        else:
            raise DataError(f"unsupported protobuf wire type {wire} in Example")
    if pos != len(buf):
        raise DataError("truncated field in Example")
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_feature(buf: memoryview) -> FeatureValue:
    for number, wire, value in _fields(buf):
        if wire != 2 or not isinstance(value, memoryview):
            continue
        if number == 1:
            return [bytes(v) for n, w, v in _fields(value) if n == 1 and isinstance(v, memoryview)]
        if number == 2:
            floats: list[float] = []
            for n, w, v in _fields(value):
                if n != 1 or not isinstance(v, memoryview):
                    continue
                if w == 2:  # packed
                    floats.extend(x for (x,) in _FLOAT.iter_unpack(v))
                elif w == 5:
                    floats.append(_FLOAT.unpack(v)[0])
            return floats
        if number == 3:
            ints: list[int] = []
            for n, w, v in _fields(value):
                if n != 1:
                    continue
                if w == 2 and isinstance(v, memoryview):  # packed
                    pos = 0
                    while pos < len(v):
                        raw, pos = _read_varint(v, pos)
                        ints.append(_signed(raw))
                elif w == 0 and isinstance(v, int):
                    ints.append(_signed(v))
            return ints
    return []


def decode_example(data: bytes | memoryview) -> dict[str, FeatureValue]:
    """Parse a serialized ``tf.train.Example`` into ``{key: [values]}``."""
    features: dict[str, FeatureValue] = {}
    for number, wire, value in _fields(memoryview(data)):
        if number != 1 or wire != 2 or not isinstance(value, memoryview):
            continue
        for n, w, entry in _fields(value):
            if n != 1 or w != 2 or not isinstance(entry, memoryview):
                continue
            key, feature = "", memoryview(b"")
            for en, _, ev in _fields(entry):
                if en == 1 and isinstance(ev, memoryview):
                    key = bytes(ev).decode("utf-8")
                elif en == 2 and isinstance(ev, memoryview):
                    feature = ev
            features[key] = _decode_feature(feature)
    return features
