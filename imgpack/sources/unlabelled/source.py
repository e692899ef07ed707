"""A folder of images without labels, for pretraining, embedding or deduplication runs.

Every image file under SRC (recursively, hidden files and folders ignored, in the image folder's
order: folders sorted by path, the files of each sorted by name) becomes a sample with label
:data:`~imgpack.scan.UNLABELLED` (-1); the output's label map is empty. Only when asked for
(``--no-labels``, ``no_labels=True``): a folder without class folders is refused otherwise, as a
mistake is likelier than an unlabelled dataset.
"""

from __future__ import annotations

from pathlib import Path

from imgpack.errors import OptionError, ScanError
from imgpack.images import Encoding, ImagePolicy
from imgpack.scan import UNLABELLED, Sample, Scan
from imgpack.sources.base import Fetcher, ScanRequest, Source, file_stamp
from imgpack.sources.folder.scan import IMAGE_EXTENSIONS, walk_images
from imgpack.sources.folder.source import FileFetcher, refuse_unreadable


class UnlabelledSource(Source):
    def check(self) -> None:
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such folder")
        if not self.src.is_dir():
            raise OptionError(
                f"{self.src}: not a folder; --no-labels converts every image under a folder "
                "SRC (any layout, no classes). A label list is converted with --labels FILE, "
                "its rows' labels kept"
            )

    def scan(self, request: ScanRequest) -> Scan:
        if request.classes is not None:
            raise OptionError(
                "an unlabelled source has no classes: --classes-from does not apply to --no-labels"
            )
        unreadable: list[dict[str, str]] = []
        ignored: list[dict[str, str]] = []
        paths = walk_images(self.src, "", unreadable, ignored)
        if not paths and not unreadable:
            raise ScanError(
                f"{self.src}: found no image files. Images are recognised by the extensions "
                f"{', '.join(IMAGE_EXTENSIONS)} (any case)"
            )
        scan = Scan(
            classes=[],
            samples=[Sample(path, UNLABELLED) for path in paths],
            ignored_files=len(ignored),
            ignored=ignored,
            unreadable=unreadable,
        )
        refuse_unreadable(self.src, scan, request)
        return scan

    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        return FileFetcher(str(self.src))

    def stamp(self, sample: Sample) -> str:
        return file_stamp(Path(self.src, sample.path))
