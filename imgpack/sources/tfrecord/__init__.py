"""TFRecord files other tools wrote (no imgpack manifest): a file, a folder, a glob."""

from imgpack.sources import SourceSpec

SPEC = SourceSpec(
    name="tfrecord",
    source="imgpack.sources.tfrecord.source:TFRecordSource",
    summary="TFRecord files without a manifest (a .tfrecord file, a folder of them, a glob): "
    "image/encoded, image/class/label, image/class/text",
)
