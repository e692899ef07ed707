"""A Hugging Face dataset saved with ``save_to_disk`` (the ``[hf]`` extra)."""

from imgpack.sources import SourceOption, SourceSpec, optional_text

SPEC = SourceSpec(
    name="hf",
    source="imgpack.sources.hf.source:HFSource",
    summary="a Hugging Face dataset folder written by save_to_disk (its Image and ClassLabel "
    "columns, in row order)",
    options=(
        SourceOption(
            "image_column", None, "the image column (default: the one of type Image)", optional_text
        ),
        SourceOption(
            "label_column",
            None,
            "the label column (default: the one of type ClassLabel)",
            optional_text,
        ),
    ),
    requires=("datasets",),
    extra="hf",
)
