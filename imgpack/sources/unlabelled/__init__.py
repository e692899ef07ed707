"""A folder of images without class folders (``--no-labels``): label -1, no classes."""

from imgpack.sources import SourceSpec

SPEC = SourceSpec(
    name="unlabelled",
    source="imgpack.sources.unlabelled.source:UnlabelledSource",
    summary="every image under SRC, without labels (label -1, classes []); only when asked "
    "for with --no-labels",
    detected=False,
)
