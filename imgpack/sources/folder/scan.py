"""Scanning an image folder laid out like torchvision's ImageFolder.

``SRC/<class>/**/<image>``: classes are the top-level folders of ``SRC``, sorted; images are the
files under each class folder (recursively, following symbolic links like ``os.walk(...,
followlinks=True)`` does, but never around a loop) whose extension is one of
:data:`IMAGE_EXTENSIONS`. Hidden files and folders (a name starting with ``.``) are ignored. The
order of samples is torchvision's: classes in sorted order, then within a class the walk's
directories sorted by path and the files of each directory sorted by name, so indices and labels
match ``torchvision.datasets.ImageFolder`` on the same folder.

The scan only lists files; what a file holds is decided from its bytes when it is decoded
(:mod:`imgpack.images`), so a PNG named ``.jpg`` is a PNG and a text file named ``.jpg`` is an
error (or a skip).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from imgpack.errors import ScanError
from imgpack.scan import IMAGE_EXTENSIONS, SampleTable, Scan, listed_id
from imgpack.system import file_kind

log = logging.getLogger(__name__)


def _hidden(name: str) -> bool:
    return name.startswith(".")


def find_classes(root: Path) -> list[str]:
    """The sorted names of the non-hidden top-level folders of ``root``."""
    with os.scandir(root) as entries:
        classes = sorted(e.name for e in entries if not _hidden(e.name) and e.is_dir())
    bad = [printable(name) for name in classes if not is_utf8(name)]
    if bad:
        raise ScanError(
            f"{printable(str(root))}: class folder name(s) {', '.join(bad)} are not "
            "valid UTF-8; class names are stored as UTF-8 text, so rename the folder(s)"
        )
    if not classes:
        with os.scandir(root) as entries:
            files = [e.name for e in entries if not _hidden(e.name)]
        detail = (
            f"it holds {len(files)} file(s) but no folder"
            if files
            else "it is empty (hidden files and folders are ignored)"
        )
        images = [name for name in files if name.lower().endswith(IMAGE_EXTENSIONS)]
        hint = (
            f"; to convert its {len(images)} image(s) without labels, add --no-labels"
            if images
            else ""
        )
        raise ScanError(
            f"{root}: no class folders found — {detail}. imgpack expects one folder per class: "
            f"{root}/<class>/<image>{hint}"
        )
    return classes


#: Folder names (lower case) that name a split of a dataset rather than a class.
SPLIT_NAMES = ("train", "training", "val", "valid", "validation", "dev", "test", "testing")


def find_splits(root: Path) -> list[str]:
    """The top-level folders of ``root`` named like splits (``train``, ``val``, ``test``, ...),
    in the order train, validation, test."""
    order = {name: rank for rank, name in enumerate(SPLIT_NAMES)}
    with os.scandir(root) as entries:
        names = [e.name for e in entries if not _hidden(e.name) and e.is_dir()]
    return sorted((n for n in names if n.lower() in order), key=lambda n: order[n.lower()])


def read_class_list(source: str | os.PathLike[str]) -> list[str]:
    """Read a label map from a text file, one class per line (an imgpack output's label map is
    its manifest's, read by the route: :func:`imgpack.pipeline` takes a folder there)."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file or imgpack output (for --classes-from give an imgpack output "
            "directory or a text file with one class per line)"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ScanError(f"{path}: cannot read the class list: {exc}") from None
    classes = [line.strip() for line in lines if line.strip()]
    if not classes:
        raise ScanError(f"{path}: the class list is empty (expected one class name per line)")
    duplicates = sorted({c for c in classes if classes.count(c) > 1})
    if duplicates:
        raise ScanError(f"{path}: class names listed more than once: {', '.join(duplicates)}")
    return classes


def printable(name: str) -> str:
    """``name`` for messages and manifests: bytes that are not UTF-8 (kept by Python as lone
    surrogates) shown as ``\\xNN`` escapes."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


#: Why the scan passes a file over (:attr:`imgpack.scan.Scan.ignored`).
IGNORED_HIDDEN = "hidden (a name starting with '.')"
IGNORED_NOT_IMAGE = "not an image file (by its extension)"
IGNORED_LOOP = "a symbolic link back to a folder already scanned (a loop)"
IGNORED_OUTSIDE = "not in a class folder, and not an image"
#: An image file at SRC's top, beside the class folders: in no class, so never converted.
STRAY_IMAGE = (
    "an image beside the class folders, in no class: move it into SRC/<class>/, or convert "
    "with --no-labels to take every image without labels"
)


def _unfit_image(path: str, entry: os.DirEntry[str]) -> str | None:
    """Why the run would refuse image file ``entry`` without reading a byte of it (a broken
    link, not a regular file, empty, not readable), else ``None``."""
    try:
        if not entry.is_file():  # follows links, as the read does
            if entry.is_symlink() and not os.path.exists(path):
                return "a broken symbolic link (its target does not exist)"
            return f"not a regular file ({file_kind(os.stat(path).st_mode)})"
        if entry.stat().st_size == 0:
            return "empty file (0 bytes)"
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if not os.access(path, os.R_OK):
        return "cannot be read: permission denied"
    return None


def walk_images(
    root: Path,
    class_name: str,
    unreadable: list[dict[str, str]],
    ignored: list[dict[str, str]],
    sizes: list[int] | None = None,
) -> list[str]:
    """Relative POSIX paths of the image files under ``root/class_name`` (``""``: all of
    ``root``), in torchvision's order; every other file passed over is added to ``ignored`` by
    path, with why (hidden, not an image, a link back into the walk). ``sizes``: a list that
    gets each image's size in bytes, in the same order (the walk stats every image already;
    the shard plan is cut from them).

    The walk keeps its own stack (no recursion: a tree thousands of levels deep is fine), follows
    symbolic links to folders but never around a loop, and adds to ``unreadable`` the folders
    that cannot be listed, the image files whose names are not UTF-8 (every format stores
    source paths as UTF-8; such a name is refused here, before any work, not after) and those
    the run would refuse without reading them (a broken link, a FIFO or device, an empty or
    unreadable file): the dry run refuses what the run refuses.
    """
    found: list[tuple[str, str, int]] = []
    passed = ignored
    visited: set[tuple[int, int]] = set()
    stack = [class_name]
    while stack:
        rel_dir = stack.pop()
        folder = root / rel_dir
        try:
            st = os.stat(folder)
            key = (st.st_dev, st.st_ino)
            if key in visited:
                log.warning(
                    "%s: skipped, it leads back to a folder already scanned (symlink loop)",
                    printable(str(folder)),
                )
                passed.append({"path": printable(rel_dir) + "/", "reason": IGNORED_LOOP})
                continue
            visited.add(key)
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError as exc:
            unreadable.append(
                {
                    "path": printable(rel_dir or ".") + "/",
                    "reason": f"cannot list folder: {exc.strerror}",
                }
            )
            continue
        subfolders = []
        for entry in entries:
            name = entry.name
            rel = _join(rel_dir, name)
            if _hidden(name):
                folder_mark = "/" if _is_dir(entry) else ""
                passed.append({"path": printable(rel) + folder_mark, "reason": IGNORED_HIDDEN})
            elif _is_dir(entry):
                subfolders.append(name)
            elif not name.lower().endswith(IMAGE_EXTENSIONS):
                passed.append({"path": printable(rel), "reason": IGNORED_NOT_IMAGE})
            elif not is_utf8(rel):
                unreadable.append(
                    {
                        "path": printable(rel),
                        "reason": "file name is not valid UTF-8; rename it to convert it",
                    }
                )
            elif (why := _unfit_image(entry.path, entry)) is not None:
                unreadable.append({"path": printable(rel), "reason": why})
            else:
                found.append((rel_dir, name, _size(entry)))
        # Depth first, subfolders in sorted order (os.walk's order); order is restored below.
        stack.extend(_join(rel_dir, d) for d in sorted(subfolders, reverse=True))
    found.sort()
    if sizes is not None:
        sizes.extend(size for _, _, size in found)
    return [_join(d, n) for d, n, _ in found]


def _size(entry: os.DirEntry[str]) -> int:
    """The size of an image file the walk took (its stat is cached by the walk's check);
    ``-1`` when it cannot be had now (its task names the file)."""
    try:
        return entry.stat().st_size
    except OSError:
        return -1


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def top_files(root: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The files at the top of image folder ``root``, beside its class folders: the image
    files among them (in no class: never converted, so the scan must not pass them over in
    silence) and the others, passed over with why."""
    strays: list[str] = []
    others: list[dict[str, str]] = []
    with os.scandir(root) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            name = printable(entry.name)
            if _is_dir(entry):
                if _hidden(entry.name):
                    others.append({"path": name + "/", "reason": IGNORED_HIDDEN})
                continue
            if _hidden(entry.name):
                others.append({"path": name, "reason": IGNORED_HIDDEN})
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                strays.append(name)
            else:
                others.append({"path": name, "reason": IGNORED_OUTSIDE})
    return strays, others


def scan_folder(root: str | os.PathLike[str], classes: list[str] | None = None) -> Scan:
    """Scan ``root`` and return its classes and samples.

    Args:
        root: the source folder, ``root/<class>/**/<image>``.
        classes: a label map to use instead of the sorted class folders (``--classes-from``); every
            class folder of ``root`` must be in it, and labels are positions in it.

    Every file under ``root`` is accounted for: a sample, in :attr:`Scan.unreadable` (what the
    run refuses or, with ``--on-error skip``, records as skipped: images beside the class
    folders among them), or in :attr:`Scan.ignored` with why.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ScanError: ``root`` is not a folder, has no class folders, a class folder is missing from
            ``classes``, or no image was found at all.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such folder")
    if not root.is_dir():
        raise ScanError(f"{root}: not a folder (expected an image folder {root}/<class>/<image>)")
    folders = find_classes(root)
    strays, ignored = top_files(root)
    unreadable = [{"path": path, "reason": STRAY_IMAGE} for path in strays]

    def walk(name: str) -> tuple[list[str], list[dict[str, str]], list[int], None]:
        passed: list[dict[str, str]] = []
        sizes: list[int] = []
        return walk_images(root, name, unreadable, passed, sizes), passed, sizes, None

    return _scan(str(root), folders, classes, walk, unreadable, ignored)


def visible(path: str) -> bool:
    """Whether a listed object (a relative POSIX path) is a file of a class folder as
    :func:`scan_folder` sees it: under a top-level folder, no hidden name at any depth."""
    parts = path.split("/")
    return len(parts) >= 2 and all(part and not _hidden(part) for part in parts)


def scan_listing(
    where: str,
    folders: list[str],
    objects: Callable[[str], Iterable[tuple[str, int, str]]],
    classes: list[str] | None = None,
    top: Iterable[tuple[str, int, str]] = (),
) -> Scan:
    """The scan of an image folder known by its listing (a bucket's objects): the classes,
    samples and order :func:`scan_folder` gives for the same tree, each sample with the size the
    store lists. ``folders``: the class folders (top-level folders holding a visible object);
    ``objects(folder)``: that folder's objects, ``(relative path, size)``, in any order (read
    one folder at a time: the driver never holds the whole listing); ``top``: the objects at
    SRC's top (images there are in no class: refused, or skipped). ``where`` names it in
    messages."""
    if not folders:
        raise ScanError(
            f"{where}: no class folders found. imgpack expects one folder per class: "
            f"{where}/<class>/<image>"
        )
    unreadable: list[dict[str, str]] = []
    ignored: list[dict[str, str]] = []
    for path, _, _ in sorted(top):
        if "/" in path:
            continue
        if _hidden(path):
            ignored.append({"path": path, "reason": IGNORED_HIDDEN})
        elif path.lower().endswith(IMAGE_EXTENSIONS):
            unreadable.append({"path": path, "reason": STRAY_IMAGE})
        else:
            ignored.append({"path": path, "reason": IGNORED_OUTSIDE})

    def walk(name: str) -> tuple[list[str], list[dict[str, str]], list[int], list[int]]:
        return _listed_images(objects(name), visible)

    return _scan(where, sorted(folders), classes, walk, unreadable, ignored)


def _listed_images(
    objects: Iterable[tuple[str, int, str]], shown: Callable[[str], bool]
) -> tuple[list[str], list[dict[str, str]], list[int], list[int]]:
    """The images among listed objects ``(relative path, size, etag)`` in :func:`walk_images`'s
    order (folders by path, files by name), with their sizes and ETags
    (:func:`imgpack.scan.listed_id`), and the objects passed over, with why: those not
    ``shown`` (hidden), and those that are no image."""
    found: list[tuple[str, str, int, int]] = []
    passed: list[dict[str, str]] = []
    for path, size, etag in objects:
        if not shown(path):
            passed.append({"path": path, "reason": IGNORED_HIDDEN})
            continue
        folder, _, file = path.rpartition("/")
        if file.lower().endswith(IMAGE_EXTENSIONS):
            found.append((folder, file, size, listed_id(etag)))
        else:
            passed.append({"path": path, "reason": IGNORED_NOT_IMAGE})
    found.sort()
    paths = [_join(d, n) for d, n, _, _ in found]
    return paths, passed, [f[2] for f in found], [f[3] for f in found]


def scan_unlabelled_listing(
    where: str, objects: Iterable[tuple[str, int, str]]
) -> tuple[list[str], list[int], list[int], list[dict[str, str]]]:
    """Every image of a tree known by its listing (a bucket's objects, ``(relative path, size,
    etag)`` in any order), as :func:`walk_images` walks the same tree from its top: the image
    paths in its order (folders by path, files by name, the top's own files first), their
    listed sizes and ETags (:func:`imgpack.scan.listed_id`), and the objects passed over, with
    why (a hidden name at any depth, not an image). The images are held and sorted at once:
    the order interleaves top-level folders (``a-b/...`` sorts between ``a/x.jpg`` and
    ``a/c/...``), about 150 bytes an image while the scan runs. ``where`` names SRC."""
    paths, passed, sizes, listed = _listed_images(objects, _shown_anywhere)
    if not paths:
        raise ScanError(
            f"{where}: found no image files. Images are recognised by the extensions "
            f"{', '.join(IMAGE_EXTENSIONS)} (any case)"
        )
    return paths, sizes, listed, passed


def _shown_anywhere(path: str) -> bool:
    """Whether a listed object is no hidden name at any depth (images at the top count)."""
    return all(part and not _hidden(part) for part in path.split("/"))


Walk = Callable[[str], tuple[list[str], list[dict[str, str]], list[int] | None, list[int] | None]]


def _scan(
    root: str,
    folders: list[str],
    classes: list[str] | None,
    walk: Walk,
    unreadable: list[dict[str, str]],
    ignored: list[dict[str, str]],
) -> Scan:
    """A scan from the class folders and a walk of each (its image paths, in order, the other
    files passed over with why, and the images' sizes when the walk knows them); the folders
    that could not be taken go into ``unreadable``."""
    if classes is None:
        classes = folders
    else:
        unknown = [name for name in folders if name not in classes]
        if unknown:
            raise ScanError(
                f"{root}: class folder(s) {', '.join(map(repr, unknown))} are not in the given "
                f"label map ({len(classes)} classes: {', '.join(classes[:10])}"
                f"{', ...' if len(classes) > 10 else ''})"
            )
    samples = SampleTable()
    empty: list[str] = []
    present = set(folders)
    for label, name in enumerate(classes):
        if name not in present:
            empty.append(name)
            continue
        paths, passed, sizes, listed = walk(name)
        ignored.extend(passed)
        if not paths:
            empty.append(name)
        samples.extend(paths, label, sizes, listed)
    if not samples and not unreadable:
        raise ScanError(
            f"{root}: found no image files in {len(folders)} class folder(s). Images are recognised "
            f"by the extensions {', '.join(IMAGE_EXTENSIONS)} (any case)"
        )
    for name in empty:
        log.warning(
            "class %r has no images in %s; it keeps its label %d", name, root, classes.index(name)
        )
    return Scan(
        classes=list(classes),
        samples=samples,
        empty_classes=empty,
        ignored_files=len(ignored),
        unreadable=unreadable,
        ignored=ignored,
    )
