"""The image folder as a source: its scan (:mod:`imgpack.sources.folder.scan`) and a fetcher that
reads each file under the root."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpack.errors import OptionError, ScanError
from imgpack.images import Encoded, Encoding, ImagePolicy, process_file
from imgpack.scan import Sample, Scan
from imgpack.sources.base import Fetcher, ScanRequest, Source, file_stamp
from imgpack.sources.folder.scan import find_classes, find_splits, printable, scan_folder


@dataclass(frozen=True)
class FileFetcher(Fetcher):
    """Reads ``root/<sample.path>``: the samples are files under one folder."""

    root: str

    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        return process_file(self.root, sample.path, sample.label, policy, encoding)


class FolderSource(Source):
    @classmethod
    def detect(cls, src: Path) -> bool:
        return src.is_dir()

    def check(self) -> None:
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such folder")
        if not self.src.is_dir():
            raise OptionError(
                f"{self.src}: not a folder (SRC must be an image folder SRC/<class>/<image>)"
            )

    def scan(self, request: ScanRequest) -> Scan:
        if not request.allow_split_names:
            refuse_split_folders(self.src)
        scan = scan_folder(self.src, request.classes)
        refuse_unreadable(self.src, scan, request)
        return scan

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        return FileFetcher(str(self.src))

    def stamp(self, sample: Sample) -> str:
        return file_stamp(f"{self.src}/{sample.path}")


def refuse_unreadable(src: Path, scan: Scan, request: ScanRequest) -> None:
    """With ``--on-error fail``, the first thing the scan could not take stops the run."""
    if scan.unreadable and request.on_error == "fail":
        first = scan.unreadable[0]
        more = f" (and {len(scan.unreadable) - 1} more)" if len(scan.unreadable) > 1 else ""
        raise ScanError(
            f"{printable(str(src))}/{first['path']}: {first['reason']}{more}; it would be "
            "left out (use --on-error skip to convert without it, recorded as skipped)"
        )


def refuse_split_folders(src: Path) -> None:
    """Refuse a SRC whose class folders would all be split names: converting ``train/`` and
    ``test/`` as two classes is never what was meant."""
    try:
        folders = find_classes(src)
    except (OSError, ScanError):
        return  # the scan reports it
    splits = find_splits(src)
    if splits and len(splits) == len(folders):
        raise ScanError(
            f"{src}: its folders ({', '.join(splits)}) are dataset splits, not classes: use "
            "--splits to convert each into DST/<split> with one shared label map, or --no-splits "
            "to convert them as classes"
        )
