"""The ``pt`` format: shards of tensors saved with ``torch.save`` (``docs/formats/pt.md``)."""

from imgpack.formats import FormatSpec

SPEC = FormatSpec(
    name="pt",
    writer="imgpack.formats.pt.writer:PTWriter",
    reader="imgpack.formats.pt.reader:PTDataset",
    summary="memory-mappable torch.save shards (shard-00000.pt ...)",
    sharded=True,
    default_shard_size=1 << 30,
    stores_fields=True,
)
