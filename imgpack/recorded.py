"""What the manifest of a conversion records, from its plan and the files it wrote: one place for
both engines (:mod:`imgpack.pipeline`'s one writer, :mod:`imgpack.direct`'s shard tasks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from imgpack.manifest import FileEntry, Manifest
from imgpack.scan import Scan
from imgpack.stats import DatasetStats
from imgpack.version import __version__

if TYPE_CHECKING:
    from imgpack.pipeline import Plan


def manifest_for(
    plan: Plan,
    files: list[FileEntry],
    count: int,
    skipped: list[dict[str, str]],
    stats: DatasetStats | None = None,
) -> Manifest:
    """The manifest of ``plan``'s output made of ``files``, holding ``count`` samples, with
    their ``stats`` (``None``: not known)."""
    opts, scan = plan.options, plan.scan
    return Manifest(
        format=opts.format,
        num_samples=count,
        classes=scan.classes,
        encoding=opts.encoding,
        image=opts.policy.describe(),
        files=files,
        options=opts.recorded(),
        source={
            "path": str(plan.src.resolve()),
            "image_files": len(scan.samples),
            "ignored_files": scan.ignored_files,
            "empty_classes": scan.empty_classes,
            "classes_from": opts.classes_from,
            **_chain(scan),
        },
        skipped=skipped,
        created_by=f"imgpack {__version__}",
        output_id=plan.output_id,
        part=plan.part,
        stats=stats.to_json() if stats is not None else None,
    )


def _chain(scan: Scan) -> dict[str, Any]:
    """What the manifest records of a source that is not an image folder: its format, its
    output id and its own ``source`` (so a manifest holds the whole chain of conversions)."""
    origin = scan.origin
    if origin is None:
        return {}
    keys = (
        "format",
        "encoding",
        "output_id",
        "foreign",
        "from",
        "image_column",
        "label_column",
        "file",
    )
    return {"converted_from": {k: origin[k] for k in keys if k in origin}}
