"""An imgpack output as a source (``imgpack convert OUT_A OUT_B``)."""

from imgpack.sources import SourceSpec

SPEC = SourceSpec(
    name="output",
    source="imgpack.sources.output.source:OutputSource",
    summary="an imgpack output (its order, labels and paths; records carried over as stored "
    "when nothing that decides the bytes changes)",
)
