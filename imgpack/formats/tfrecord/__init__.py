"""The ``tfrecord`` format: ``tf.train.Example`` records in TFRecord shards with DALI indexes
(``docs/formats/tfrecord.md``)."""

from imgpack.errors import OptionError
from imgpack.formats import FormatOption, FormatSpec


def _prefix(value: object) -> str:
    prefix = str(value)
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise OptionError(f"invalid prefix {prefix!r}: expected a plain file name prefix")
    return prefix


def _integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("expected an integer")
    return int(value)


SPEC = FormatSpec(
    name="tfrecord",
    writer="imgpack.formats.tfrecord.writer:TFRecordWriter",
    stores_fields=True,
    reader="imgpack.formats.tfrecord.reader:TFRecordDataset",
    summary="tf.train.Example records in TFRecord shards, with DALI .idx files",
    options=(
        FormatOption(
            "prefix", "data", "shard file name prefix: PREFIX-00000-of-00008.tfrecord", _prefix
        ),
        FormatOption(
            "label_offset",
            0,
            "added to every stored image/class/label (1 = TensorFlow's ImageNet convention)",
            _integer,
        ),
    ),
    sharded=True,
    default_shard_size=256 << 20,
)
