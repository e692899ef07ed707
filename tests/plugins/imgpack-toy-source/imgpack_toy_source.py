"""A toy imgpack source: a ``.toy`` file whose lines are ``<class> <path>`` (paths relative to
the file's folder). Small on purpose: it shows what a source plugin implements — detection, a
scan into samples and a label map, and a picklable fetcher that reads one sample in a worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpack.images import Encoded, Encoding, ImagePolicy, process_file
from imgpack.scan import Sample, Scan
from imgpack.sources import SourceOption, SourceSpec
from imgpack.sources.base import Fetcher, ScanRequest, Source, file_size, file_stamp

SPEC = SourceSpec(
    name="toy",
    source="imgpack_toy_source:ToySource",
    summary="a toy source from a plugin",
    options=(SourceOption("prefix", "", "a prefix added to every class name"),),
)


@dataclass(frozen=True)
class ToyFetcher(Fetcher):
    root: str

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        return process_file(self.root, sample.path, sample.label, policy, encoding)


class ToySource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_file() and src.suffix == ".toy"

    def scan(self, request: ScanRequest) -> Scan:
        rows = [line.split(" ", 1) for line in self.src.read_text().splitlines() if line]
        names = [self.settings["prefix"] + name for name, _ in rows]
        classes = request.classes or sorted(set(names))
        samples = [
            Sample(path, classes.index(name)) for name, (_, path) in zip(names, rows, strict=True)
        ]
        return Scan(classes=list(classes), samples=samples)

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        return ToyFetcher(str(self.src.parent))

    def stamp(self, sample: Sample) -> str:
        return file_stamp(self.src.parent / sample.path)

    def stored_size(self, sample: Sample) -> int:
        return file_size(self.src.parent / sample.path)  # what the shards are cut by
