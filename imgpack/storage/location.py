"""Where a location is: a local path or an fsspec URL, its filesystem, and the store's words.

Wherever imgpack takes a path it also takes an fsspec URL (``s3://bucket/prefix``, ``gs://``,
``az://``, ``memory://``; ``file://`` is a local path). Credentials and endpoints come from each
filesystem's usual settings (for S3 the standard AWS variables and config files, including
``AWS_ENDPOINT_URL`` for MinIO and other S3-compatible stores); ``storage_options`` passes
anything else to the filesystem. Errors the store raises are said here in one line that names
the URL (:func:`remote_error`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from imgpack.errors import (
    ImgpackError,
    ManifestError,
    NotAnOutput,
    OptionError,
    StorageError,
    first_line,
)
from imgpack.manifest import MANIFEST_NAME, Manifest
from imgpack.system import each_task, lends_tasks

log = logging.getLogger(__name__)

Location = str | os.PathLike[str]
#: Files transferred at once.
TRANSFERS = 8


def is_url(location: Any) -> bool:
    """Whether ``location`` names something an fsspec filesystem other than the local one holds
    (``file://`` URLs are local paths)."""
    if not isinstance(location, str) or "://" not in location:
        return False
    return not location.startswith("file://")


def local_path(location: Location) -> Path:
    """``location`` as a local path (a ``file://`` URL stripped of its scheme)."""
    text = os.fspath(location)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


#: Filesystems a forked process inherited from its parent, kept alive and never used. When
#: one is collected, its finalizer closes its connections, and a closing socket is taken out of
#: its event loop's epoll set, which parent and child share after a fork: a request the parent
#: has in flight on that socket then waits until the client gives up and sends it again (a
#: DataLoader worker forked while the main process fetched ahead stalled a fetch ~15 s). fsspec
#: drops its cached instances in a child at its next use, so they are kept at the fork.
_inherited: list[Any] = []


def keep_inherited(fs: Any) -> None:
    """Keep ``fs``, a filesystem of the process this one was forked from (see
    :data:`_inherited`)."""
    _inherited.append(fs)


def _keep_cached_filesystems() -> None:
    fsspec = sys.modules.get("fsspec")
    if fsspec is None:
        return
    classes, seen = [fsspec.AbstractFileSystem], set()
    while classes:
        cls = classes.pop()
        if cls in seen:
            continue
        seen.add(cls)
        classes.extend(cls.__subclasses__())
        _inherited.extend(getattr(cls, "_cache", {}).values())


#: Forks this process made: a connection a filesystem opened before a fork may be broken by
#: the child (see :data:`_inherited`: its copy of the parent's objects is collected there), so
#: a reader takes a new filesystem after each (:func:`forks`).
_forks = [0]


def forks() -> int:
    """How many processes this one has forked so far."""
    return _forks[0]


def _forked_here() -> None:
    _forks[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_cached_filesystems, after_in_parent=_forked_here)


def filesystem(
    url: str, storage_options: dict[str, Any] | None = None, fresh: bool = False
) -> tuple[Any, str]:
    """``(fsspec filesystem, path in it)`` for ``url``; a clear error when the scheme's package
    is missing (``pip install 'imgpack[s3]'``, ``'imgpack[gcs]'``). ``fresh``: a new instance,
    not fsspec's cached one (in a forked process, whose inherited instance is not usable)."""
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - fsspec comes with torch
        raise OptionError(f"{url}: URLs need fsspec (pip install fsspec)") from None
    try:
        options = {**(storage_options or {}), **({"skip_instance_cache": True} if fresh else {})}
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme)
        hint = f"pip install 'imgpack[{extra}]'" if extra else str(exc)
        raise OptionError(f"{url}: reading {scheme}:// needs another package: {hint}") from None
    except ValueError as exc:
        raise OptionError(f"{url}: {exc}") from None
    return fs, str(path).rstrip("/")


def parse_storage_options(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (``--storage-option``) as a dict; JSON values are decoded
    (``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``), others stay strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionError(f"invalid storage option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def no_bucket(url: str, exc: BaseException) -> ImgpackError | None:
    """The error naming ``url``'s bucket when ``exc`` says it does not exist (S3's
    ``NoSuchBucket``, which s3fs raises as a bare ``FileNotFoundError``), else ``None``."""
    if not isinstance(exc, FileNotFoundError) or "bucket" not in str(exc).lower():
        return None
    scheme, _, rest = url.partition("://")
    bucket = f"{scheme}://{rest.split('/', 1)[0]}"
    return StorageError(
        f"{url}: the bucket {bucket} does not exist (create it first, or check the name and "
        "the endpoint the filesystem uses: docs/storage.md)"
    )


def remote_error(url: str, exc: BaseException) -> ImgpackError:
    if isinstance(exc, ImgpackError):  # said already, with its URL
        return exc
    missing = no_bucket(url, exc)
    if missing is not None:
        return missing
    if isinstance(exc, FileNotFoundError):
        return ManifestError(
            f"{url}: not found (no such bucket or object; check the name, and the endpoint "
            "and credentials the filesystem uses)"
        )
    if isinstance(exc, PermissionError):
        return StorageError(f"{url}: access denied ({exc})")
    return StorageError(
        f"{url}: {type(exc).__name__}: {first_line(exc) if str(exc).strip() else ''}"
    )


def read_remote_manifest(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[Manifest, bytes]:
    """The manifest of the output at ``url`` (validated) and its bytes."""
    fs, root = filesystem(url, storage_options)
    try:
        data = fs.cat_file(f"{root}/{MANIFEST_NAME}")
    except FileNotFoundError as exc:
        missing = no_bucket(url, exc)
        if missing is not None:
            raise missing from None
        raise NotAnOutput(
            f"{url}: not an imgpack output (no {MANIFEST_NAME}: nothing there, or a conversion "
            "still uploading or killed midway, which leaves none)"
        ) from None
    except OSError as exc:
        raise remote_error(url, exc) from None
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{url}/{MANIFEST_NAME}: unreadable manifest: {exc}") from None
    return Manifest.from_json(parsed, where=f"{url}/{MANIFEST_NAME}"), data


def read_objects(
    fs: Any, paths: Sequence[str], ranges: Sequence[tuple[int, int]] | None = None
) -> list[tuple[bytes, list[str]] | BaseException]:
    """Each object's bytes (``ranges``: the bytes ``[start, end)`` of each) and what the store
    said of its content as it sent them (its ETag and version, where the protocol says: S3;
    ``[]`` elsewhere), or the exception that reading it raised; one GET each, all at once.
    s3fs's ``cat_file`` asks for each object's size first (a HEAD before every GET): on S3 the
    GET is made here, through s3fs's own client."""
    if not paths:
        return []
    if is_s3fs(fs) and hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
        from fsspec.asyn import sync  # type: ignore[import-untyped]

        async def one(path: str, span: tuple[int, int] | None) -> tuple[bytes, list[str]]:
            bucket, key, version = fs.split_path(path)
            given = {"VersionId": version} if version else {}
            if span is not None:
                given["Range"] = f"bytes={span[0]}-{span[1] - 1}"
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **given)
            try:
                body = await response["Body"].read()
            finally:
                response["Body"].close()
            said = [str(response[k]) for k in ("ETag", "VersionId") if response.get(k)]
            return body, said

        async def every() -> list[Any]:
            spans = ranges if ranges is not None else [None] * len(paths)
            jobs = (one(p, r) for p, r in zip(paths, spans, strict=True))
            return await asyncio.gather(*jobs, return_exceptions=True)

        return list(sync(fs.loop, every))
    starts = [r[0] for r in ranges] if ranges is not None else None
    ends = [r[1] for r in ranges] if ranges is not None else None
    found = fs.cat_ranges(list(paths), starts, ends, on_error="return")
    return [f if isinstance(f, BaseException) else (bytes(f), []) for f in found]


#: Objects of one folder a list names at least, for their sizes to be found by one listing of
#: the folder (a LIST answers for up to a thousand objects) rather than by one ``info`` each.
LIST_AT = 16
#: ``info`` requests in flight at once, where the filesystem is asynchronous.
INFOS_AT_ONCE = 256
#: Objects a task of :func:`object_sizes_in_tasks` sizes at least (whole folders of them).
SIZES_PER_TASK = 4096


def object_sizes_in_tasks(urls: Sequence[str], runner: Any = None) -> list[int]:
    """:func:`object_sizes`, asked by ``runner``'s tasks (a conversion's executor whose workers
    take store requests: :func:`~imgpack.system.lends_tasks`), so that the store's pages
    are parsed on their CPUs: the objects in groups of whole folders (a folder's listing is
    asked once, by one task), :data:`SIZES_PER_TASK` or more objects a group, each group a
    task; here when they make one group, or without such a runner. The same sizes either way."""
    groups = _folder_groups(urls)
    if len(groups) < 2 or not lends_tasks(runner):
        return object_sizes(urls)
    found = [-1] * len(urls)
    items = ([urls[k] for k in group] for group in groups)

    def died(asked: list[str]) -> tuple[str, str]:
        return f"{asked[0]} and {len(asked) - 1} other object(s)", "asking their sizes"

    tasks = each_task(runner, object_sizes, items, died, StorageError)
    for group, (_, sizes) in zip(groups, tasks, strict=True):
        for k, size in zip(group, sizes, strict=True):
            found[k] = size
    return found


def _folder_groups(urls: Sequence[str]) -> list[list[int]]:
    """The positions of ``urls`` by folder (folders in the order first named), gathered into
    groups of :data:`SIZES_PER_TASK` or more, no folder split between two."""
    folders: dict[str, list[int]] = {}
    for k, url in enumerate(urls):
        folders.setdefault(url.rpartition("/")[0], []).append(k)
    groups: list[list[int]] = [[]]
    for members in folders.values():
        if len(groups[-1]) >= SIZES_PER_TASK:
            groups.append([])
        groups[-1].extend(members)
    return [group for group in groups if group]


def object_sizes(urls: Sequence[str]) -> list[int]:
    """Each object's size in bytes as its store says (``-1``: not found, or not a file), asked
    in bulk: the objects of a folder the list names :data:`LIST_AT` or more of by one listing
    of that folder, the others (and any the listing did not give) by one ``info`` each, all
    at once where the filesystem is asynchronous (s3fs, gcsfs). Listings are asked afresh,
    never taken from fsspec's cache: every process that plans the same list finds the same
    sizes."""
    found = [-1] * len(urls)
    systems: dict[int, Any] = {}
    folders: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for k, url in enumerate(urls):
        fs, path = filesystem(url)
        systems[id(fs)] = fs
        folders.setdefault((id(fs), path.rpartition("/")[0]), []).append((k, path))
    asked: dict[int, list[tuple[int, str]]] = {}
    for (key, folder), members in folders.items():
        fs = systems[key]
        listed = _listed_sizes(fs, folder) if folder and len(members) >= LIST_AT else {}
        for k, path in members:
            if path in listed:
                found[k] = listed[path]
            else:  # not listed (a folder that cannot be, a store that lists no sizes): asked
                asked.setdefault(key, []).append((k, path))
    for key, members in asked.items():
        infos = _infos(systems[key], [path for _, path in members])
        for (k, _), info in zip(members, infos, strict=True):
            if isinstance(info, dict) and info.get("type") == "file":
                size = info.get("size")
                found[k] = size if isinstance(size, int) else -1
    return found


def _listed_sizes(fs: Any, folder: str) -> dict[str, int]:
    """The sizes of the files directly in ``folder`` by path, listed afresh (none where it
    cannot be listed)."""
    fs.invalidate_cache(folder)
    try:
        entries = fs.ls(folder, detail=True)
    except (OSError, ValueError):
        return {}
    return {
        str(e["name"]).rstrip("/"): int(e["size"])
        for e in entries
        if e.get("type") == "file" and isinstance(e.get("size"), int)
    }


def _infos(fs: Any, paths: Sequence[str]) -> list[dict[str, Any] | BaseException]:
    """``fs.info`` of each of ``paths`` (what it raised, for one it could not say)."""
    for path in {p.rpartition("/")[0] for p in paths}:
        fs.invalidate_cache(path)  # info answers from a cached listing where it has one
    if getattr(fs, "async_impl", False) and hasattr(fs, "_info"):
        from fsspec.asyn import sync

        async def chunk(part: Sequence[str]) -> list[Any]:
            return await asyncio.gather(*(fs._info(p) for p in part), return_exceptions=True)

        out: list[Any] = []
        for at in range(0, len(paths), INFOS_AT_ONCE):
            out.extend(sync(fs.loop, chunk, paths[at : at + INFOS_AT_ONCE]))
        return out
    answers: list[dict[str, Any] | BaseException] = []
    for path in paths:
        try:
            answers.append(fs.info(path))
        except Exception as exc:  # fsspec backends raise their own errors
            answers.append(exc)
    return answers


def forget_listings(fs: Any, root: str) -> None:
    """Forget every cached listing of ``root`` and of the folders below it (fsspec's
    ``dircache``), so that the next ``ls``/``find`` asks the store."""
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        prefix = root.rstrip("/") + "/"
        for path in [p for p in list(cache) if str(p).startswith(prefix)]:
            fs.invalidate_cache(path)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def content_tag(info: dict[str, Any]) -> str:
    """What the store says identifies an object's content (ETag, version, generation)."""
    for key in ("VersionId", "ETag", "etag", "generation", "version_id", "md5Hash"):
        if info.get(key):
            return str(info[key])
    return ""


def is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (whose private calls imgpack makes for S3 alone)."""
    return "s3" in _protocols(fs) and type(fs).__module__.split(".")[0] == "s3fs"
