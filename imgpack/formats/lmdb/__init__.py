"""The ``lmdb`` format: the output directory is an LMDB environment (``docs/formats/lmdb.md``)."""

from functools import partial

from imgpack.formats import FormatOption, FormatSpec
from imgpack.units import parse_byte_size

SPEC = FormatSpec(
    name="lmdb",
    writer="imgpack.formats.lmdb.writer:LMDBWriter",
    reader="imgpack.formats.lmdb.reader:LMDBDataset",
    stores_fields=True,
    summary="one LMDB environment (data.mdb), a binary record per sample",
    runtime_files=("lock.mdb",),
    options=(
        FormatOption(
            "map_size",
            "64MiB",
            "the LMDB map the conversion starts with; it doubles whenever it is full",
            partial(parse_byte_size, name="map_size"),
        ),
    ),
)
