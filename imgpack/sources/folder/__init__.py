"""An image folder laid out like torchvision's ImageFolder: ``SRC/<class>/**/<image>``."""

from imgpack.sources import SourceSpec

SPEC = SourceSpec(
    name="folder",
    source="imgpack.sources.folder.source:FolderSource",
    summary="an image folder SRC/<class>/**/<image> (classes: the sorted folder names)",
)
