"""A label list: a CSV or JSON Lines file of ``path,label`` rows (``--labels FILE``, or the file
as SRC)."""

from imgpack.sources import SourceOption, SourceSpec, optional_text

SPEC = SourceSpec(
    name="labels",
    source="imgpack.sources.labels.source:LabelListSource",
    summary="a CSV or JSON Lines list of path,label rows (--labels FILE with SRC the folder the "
    "paths are relative to, or the list as SRC)",
    options=(
        SourceOption("file", None, "the list (default: SRC itself)", optional_text),
        SourceOption("path_column", "path", "the column (JSON key) of image paths", str),
        SourceOption("label_column", "label", "the column (JSON key) of labels", str),
    ),
)
