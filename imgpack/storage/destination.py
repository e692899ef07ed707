"""Writing an output (or an export) to object storage.

A command builds the output in a local folder with the usual engine (a conversion: its build
folder in the cache, :func:`build_folder`, kept for ``--resume`` when the run stops), then
uploads its files concurrently, the manifest last: an object store has no rename, so
``imgpack.json`` is the commit point. A reader opens only an output whose manifest exists, and
the manifest names exactly the files that belong; a conversion killed midway leaves none.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from imgpack.manifest import MANIFEST_NAME
from imgpack.publishing import leftovers
from imgpack.storage.cache import OutputCache
from imgpack.storage.location import (
    TRANSFERS,
    Location,
    filesystem,
    is_url,
    local_path,
    remote_error,
)

log = logging.getLogger(__name__)


#: Where conversions to a bucket are built, under the cache folder: one folder per DST URL.
BUILDS = "builds"


def build_folder(url: str, cache_dir: Location | None = None) -> Path:
    """Where a conversion to the bucket ``url`` builds its output before the upload:
    ``<cache>/builds/<hash of the URL>/``. A run that stops keeps it (``--resume`` continues
    there); it is removed once the output is uploaded."""
    key = hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return OutputCache(cache_dir).directory / BUILDS / key


@contextlib.contextmanager
def output_folder(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    marker: str = MANIFEST_NAME,
    build: Path | None = None,
    resume: bool = False,
    skip: Collection[str] = (),
) -> Iterator[Path]:
    """Where a command writes ``location``: itself when local; for a URL a scratch path, whose
    files are uploaded when the block ends without an error (the manifest last, so the output
    appears whole or not at all). ``overwrite``: an output already at the URL is withdrawn (its
    manifest removed first: readers see no output rather than a mixed one) and replaced.
    ``marker``: the file that says what the destination holds and is written last
    (``imgpack.json``, or an export's marker).

    ``build``: the scratch folder to use (:func:`build_folder`), kept when the block fails so
    that a ``resume`` can continue in it; a ``resume`` whose build is complete (a run stopped
    while uploading) may replace the files that upload left at the URL. ``skip``: names of
    files not to upload (those a format's reader makes beside its files, as LMDB's lock)."""
    if not is_url(location):
        yield local_path(location)
        return
    url = str(location).rstrip("/")
    fs, root = filesystem(url, storage_options)
    built = build is not None and (build / "out" / marker).is_file()  # an upload was stopped
    _check_remote_destination(fs, root, url, overwrite, marker, partial_ok=built and resume)
    if build is None:
        scratch = Path(tempfile.mkdtemp(prefix="imgpack-dst-"))
    else:
        build.mkdir(parents=True, exist_ok=True)
        scratch = build
        if built and not resume:
            log.warning("%s: a complete build of %s whose upload was stopped; building "
                        "again (--resume would upload it)", build / "out", url)  # fmt: skip
            shutil.rmtree(build / "out")
    try:
        yield scratch / "out"
        upload(scratch / "out", url, storage_options, marker, skip)
    except BaseException:
        if build is None or not _resumable_build(scratch / "out", marker):
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(scratch, ignore_errors=True)


def _resumable_build(out: Path, marker: str) -> bool:
    """Whether a build folder holds something ``--resume`` continues from: a complete output
    (stopped while uploading) or the temp dir of an interrupted conversion."""
    return (out / marker).is_file() or bool(leftovers(out))


def _check_remote_destination(
    fs: Any, root: str, url: str, overwrite: bool, marker: str, partial_ok: bool = False
) -> None:
    try:
        present = [f for f in fs.find(root) if not f.endswith("/")]
    except FileNotFoundError:
        present = []
    except OSError as exc:
        raise remote_error(url, exc) from None
    if not present:
        return
    names = {p[len(root) :].lstrip("/") for p in present}
    if marker not in names:
        if partial_ok:  # the files of an upload that was stopped
            return
        raise FileExistsError(
            f"{url}: already exists and holds no {marker}; refusing to replace it, with or "
            "without --overwrite (remove it yourself, or choose another destination; a run "
            "killed midway leaves such files)"
        )
    if not overwrite:
        raise FileExistsError(f"{url}: already exists (use --overwrite to replace it)")


def upload(
    local: Path,
    url: str,
    storage_options: dict[str, Any] | None = None,
    marker: str = MANIFEST_NAME,
    skip: Collection[str] = (),
) -> None:
    """Upload the files of the local folder ``local`` under ``url``, several at once: a
    ``marker`` (``imgpack.json``) already there is removed first, the new one is written after
    every other file (the commit), and files of the replaced output that the new one does not
    have are removed after. Files named in ``skip`` (a reader's runtime files) stay here."""
    fs, root = filesystem(url, storage_options)
    skipped = set(skip)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name not in skipped)
    names = {p.relative_to(local).as_posix() for p in files}
    try:
        before = {f[len(root) :].lstrip("/") for f in fs.find(root) if not f.endswith("/")}
    except FileNotFoundError:
        before = set()
    try:
        if marker in before:
            fs.rm_file(f"{root}/{marker}")  # withdrawn: no reader opens it from now on
        data = [p for p in files if p.relative_to(local).as_posix() != marker]
        with ThreadPoolExecutor(TRANSFERS) as pool:
            list(
                pool.map(
                    lambda p: fs.put_file(str(p), f"{root}/{p.relative_to(local).as_posix()}"),
                    data,
                )
            )
        if (local / marker).exists():
            fs.put_file(str(local / marker), f"{root}/{marker}")  # the commit
        for stale in sorted(before - names):
            fs.rm_file(f"{root}/{stale}")
    except OSError as exc:
        raise remote_error(url, exc) from None
