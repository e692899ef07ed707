"""The ``hdf5`` format: one ``data.h5`` (``docs/formats/hdf5.md``)."""

from functools import partial

from imgpack.formats import FormatOption, FormatSpec
from imgpack.units import parse_byte_size

SPEC = FormatSpec(
    name="hdf5",
    writer="imgpack.formats.hdf5.writer:HDF5Writer",
    reader="imgpack.formats.hdf5.reader:HDF5Dataset",
    stores_fields=True,
    summary="one HDF5 file (data.h5), memory-mappable unless compressed",
    options=(
        FormatOption(
            "compression",
            "none",
            "compress the image datasets (makes them chunked): none, gzip or lzf",
            choices=("none", "gzip", "lzf"),
        ),
        FormatOption(
            "chunk_size",
            "1MiB",
            "target bytes per chunk when compressed",
            partial(parse_byte_size, name="chunk_size"),
        ),
        FormatOption(
            "libver",
            "earliest",
            "earliest (readable by HDF5 1.10 tools such as Debian's h5dump) or latest",
            choices=("earliest", "latest"),
        ),
    ),
)
