"""The ``webdataset`` format: WebDataset tar shards with a member-offset index beside each
(``docs/formats/webdataset.md``)."""

from imgpack.formats import FormatSpec

SPEC = FormatSpec(
    name="webdataset",
    writer="imgpack.formats.webdataset.writer:WebDatasetWriter",
    stores_fields=True,
    reader="imgpack.formats.webdataset.reader:WebDatasetDataset",
    summary="WebDataset tar shards (data-000000.tar ...), <key>.<ext> + <key>.cls + <key>.json",
    sharded=True,
    default_shard_size=256 << 20,
)
