"""The ``pt`` format: shards of tensors saved with ``torch.save`` (``docs/formats/pt.md``)."""

from imgpack.formats import FormatSpec

SPEC = FormatSpec(
    name="pt",
    writer="imgpack.formats.pt.writer:PTWriter",
    reader="imgpack.formats.pt.reader:PTDataset",
    summary="memory-mappable torch.save shards (shard-00000.pt ...)",
    sharded=True,
    # Each shard task assembles its shard in memory (a worker holds one at a time): 256 MiB
    # keeps a conversion's memory at about that per worker, as tfrecord and webdataset.
    default_shard_size=256 << 20,
    stores_fields=True,
)
