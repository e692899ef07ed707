"""WebDataset shards other tools wrote (the ``webdataset`` package, img2dataset): ``.tar`` files
of ``key.jpg`` + ``key.cls`` (or ``key.json``) members."""

from imgpack.sources import SourceSpec

SPEC = SourceSpec(
    name="webdataset",
    source="imgpack.sources.webdataset.source:WebDatasetSource",
    summary="WebDataset .tar shards without a manifest (a .tar file, a folder of them, a glob): "
    "key.jpg/png/webp with key.cls or key.json's label",
)
