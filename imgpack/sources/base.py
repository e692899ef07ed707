"""What every source kind implements, and the per-run reader cache of conversion workers.

A source kind is a :class:`Source` subclass (its scan and its fetcher) named by a
:class:`~imgpack.sources.SourceSpec` in the registry. A conversion makes one ``Source`` for SRC
and its options, asks it for the :class:`~imgpack.scan.Scan` (ordered samples, label map) and for
a :class:`Fetcher`: a small picklable object that the executor sends with every chunk of work,
and that reads one sample and runs it through the image policy in a worker (a pool process or a
Ray task), wherever that worker is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpack.errors import DataError, OptionError, ScanError
from imgpack.fields import Field, check_name
from imgpack.images import Encoded, Encoding, ImagePolicy
from imgpack.scan import MAX_CLASSES, Sample, Scan


@dataclass(frozen=True)
class ScanRequest:
    """What a conversion asks of a scan."""

    #: A label map to use instead of the source's (``--classes-from``, a split's union): every
    #: class the source has must be in it, and labels are positions in it.
    classes: list[str] | None = None
    #: ``"fail"``: a bad entry found by the scan (a label list's bad row) stops the run, named;
    #: ``"skip"``: it goes into :attr:`Scan.unreadable` and the run goes on.
    on_error: str = "fail"
    #: Convert top-level folders named like splits (``train``, ``test``) as classes.
    allow_split_names: bool = False
    #: The types of fields the user gave (``--field NAME:TYPE``), by name: a source takes its
    #: column ``NAME`` as that type instead of the one it would infer.
    field_types: tuple[Field, ...] = ()
    #: The fields to keep (``--fields``), by name; ``None``: every one the source has. A
    #: source need not offer the others (nor check their names or values).
    fields: tuple[str, ...] | None = None
    #: The conversion's executor: a scan may hand its store requests to its workers as tasks
    #: (:func:`~imgpack.system.lends_tasks`); ``None``: made here.
    runner: Any = None


class Fetcher(ABC):
    """Reads one sample of one run's source and runs it through the image policy, in a worker.

    Pickled with every chunk of work (a frozen dataclass of a few strings, so it is small),
    by value: a worker needs nothing else of the driver, and imports the fetcher's module. Raise
    :class:`~imgpack.errors.ImageError` naming the sample for a sample that cannot be converted
    (the executor records it as a failure; ``--on-error`` decides).
    """

    @abstractmethod
    def __call__(self, sample: Sample, policy: ImagePolicy, encoding: Encoding) -> Encoded:
        """The sample, read, validated and encoded."""

    def prefetch(self, samples: Sequence[Sample]) -> None:
        """Called with each chunk of samples before they are read one by one: a fetcher whose
        reads wait on a round trip (object storage) starts them all here. Default: nothing."""
        return None

    def expect(self, samples: Sequence[Sample]) -> None:
        """Called with every sample of a shard task before its chunks (:meth:`prefetch`): a
        fetcher that reads ahead of a chunk reads no further than the task's samples. Default:
        nothing."""
        return None


class Source(ABC):
    """One source kind: how SRC is recognised, scanned and read.

    ``src`` is SRC as given (a local path: URLs are fetched to a local copy first) and
    ``settings`` the kind's options (``-s KEY=VALUE``), parsed by its spec.
    """

    def __init__(self, src: Path, settings: Mapping[str, Any] | None = None) -> None:
        self.src = src
        self.settings = dict(settings or {})

    @classmethod
    def detect(cls, src: Path) -> bool:
        """Whether ``src`` is of this kind (asked in the registry's order; a kind that is only
        ever asked for by name keeps the default, ``False``)."""
        return False

    def check(self) -> None:
        """Refuse a SRC that cannot be this kind at all, before anything else is done (the
        scan names what is wrong inside it)."""
        if not self.src.exists():
            raise FileNotFoundError(f"{self.src}: no such file or folder")

    @abstractmethod
    def scan(self, request: ScanRequest) -> Scan:
        """The samples of SRC in the order the output keeps, and its label map."""

    @abstractmethod
    def fetcher(self, scan: Scan, policy: ImagePolicy, encoding: Encoding, run: str) -> Fetcher:
        """The fetcher of one run (``run``: a token unique to the run, which keys the readers
        workers open, see :func:`opened`)."""

    def stored_size(self, sample: Sample) -> int:
        """The bytes of ``sample``'s image as SRC holds it: a sharded output's shards are cut
        by them before any image is read (:func:`imgpack.direct.sample_sizes`), so that every
        shard is written by a task of its own. ``-1`` when it cannot be found (the image counts
        as empty in the plan, and its task names it if it cannot be read). Default: the file
        SRC/``sample.path``, as an image folder holds it (a scan that knows the sizes keeps them
        in :attr:`Sample.size <imgpack.scan.Sample.size>`, and this is not asked). A kind whose
        images are elsewhere says where, or its shards are cut as if its images were empty."""
        return file_size(self.src / sample.path)

    def identity(self, scan: Scan) -> str:
        """What identifies SRC as it was scanned, beyond :meth:`stamp` (an output's id, a list
        file's hash), recorded in the fetcher: a worker refuses a source that changed since."""
        return ""

    def stamp(self, sample: Sample) -> str:
        """What identifies one sample's bytes for the output id (a file's size and modification
        time); ``"-"`` when :meth:`identity` covers it already."""
        return "-"


def file_size(path: str | os.PathLike[str]) -> int:
    """The size of the file at ``path`` as the file system says, ``-1`` when it cannot say."""
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return -1


def kept_fields(
    names: Sequence[str],
    request: ScanRequest,
    infer: Callable[[str], Field],
    what: Callable[[str], str],
) -> list[Field]:
    """The fields a source keeps of the ones it has (``names``, in its order): those
    ``--fields`` names (every one when not given), each of the type ``--field`` gives, else
    ``infer(name)``'s. A name that cannot be a field's (:func:`~imgpack.fields.check_name`)
    raises :class:`~imgpack.errors.ScanError` in one line naming it as ``what(name)`` (``column
    'x'``) and how ``--fields`` leaves it out."""
    given = {f.name: f for f in request.field_types}
    kept: list[Field] = []
    for name in names:
        if request.fields is not None and name not in request.fields:
            continue
        if name in given:
            kept.append(given[name])
            continue
        try:
            check_name(name)
        except OptionError as exc:
            raise ScanError(
                f"{what(name)} cannot be kept as a field: {exc}; --fields NAME,... keeps only "
                "the ones it names"
            ) from None
        kept.append(infer(name))
    return kept


def file_stamp(path: str | os.PathLike[str]) -> str:
    """A local file's size and modification time, ``"-"`` when it cannot be stat'ed (it fails
    when it is read)."""
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def files_identity(paths: Sequence[Path]) -> str:
    """Files' paths, sizes and modification times as a digest (a file that cannot be stat'ed
    is recorded as such: it fails when it is read)."""
    out: list[list[Any]] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append([str(path), None])
            continue
        out.append([str(path), st.st_size, st.st_mtime_ns])
    return digest(out)


def has_subfolders(src: Path) -> bool:
    """Whether ``src`` is a folder with non-hidden folders in it (class folders: an image
    folder, whatever else lies beside them). Files of another kind beside them do not make
    it that kind."""
    return src.is_dir() and any(p.is_dir() for p in src.iterdir() if not p.name.startswith("."))


def digest(value: Any) -> str:
    """A short digest of a JSON-able value (a source identity)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


def changed_source(root: str) -> DataError:
    return DataError(
        f"{root}: the source changed after this conversion planned it (replaced or rewritten "
        "while it ran); nothing was published: run the conversion again"
    )


#: The readers a worker opened for the run it serves now (keyed by source kind, path and
#: identity), so that a sample is read without reopening its source. They belong to that run:
#: a worker reused by another run (a pool worker, a Ray actor) drops them when it sees the new
#: run's token, so it never serves a source that was replaced since. A forked worker inherits
#: the parent's entries; readers reopen their handles after a fork.
_run = ""
_opened: OrderedDict[tuple[str, ...], Any] = OrderedDict()
#: Readers kept per run (a run reads one source; a few in case a kind opens several).
KEEP_OPENED = 4


def opened(run: str, key: tuple[str, ...], open_it: Callable[[], Any]) -> Any:
    """The reader opened for ``key`` in this process during run ``run``, opened by ``open_it``
    the first time."""
    global _run
    if run != _run:
        forget()
        _run = run
    if key in _opened:
        _opened.move_to_end(key)
        return _opened[key]
    found = _opened[key] = open_it()
    while len(_opened) > KEEP_OPENED:
        _close(_opened.popitem(last=False)[1])
    return found


def forget() -> None:
    """Drop (and close, where they can be) every reader this process opened."""
    global _run
    while _opened:
        _close(_opened.popitem()[1])
    _run = ""


def _close(reader: Any) -> None:
    close = getattr(reader, "close", None)
    if callable(close):
        with contextlib.suppress(
            Exception
        ):  # one that cannot close cleanly is dropped all the same
            close()


def relabel(
    src: Path | str, source_classes: list[str], labels: list[int], classes: list[str] | None
) -> tuple[list[str], list[int]]:
    """The label map and labels of a source whose own label map is ``source_classes``: as
    they are, or remapped by name onto ``classes`` (every class the samples have must be in
    it)."""
    if classes is None:
        return list(source_classes), labels
    unknown = sorted({source_classes[t] for t in set(labels)} - set(classes))
    if unknown:
        raise ScanError(
            f"{src}: class(es) {', '.join(map(repr, unknown))} are not in the given label map"
        )
    position = {name: index for index, name in enumerate(classes)}
    remap = [position.get(name, -1) for name in source_classes]
    return list(classes), [remap[t] for t in labels]


def empty_classes(classes: list[str], labels: list[int]) -> list[str]:
    present = set(labels)
    return [c for i, c in enumerate(classes) if i not in present]


def label_map(
    values: list[int | str], classes: list[str] | None
) -> tuple[list[str], Callable[[int | str], int | str]]:
    """The label map of a source whose samples name their labels (a label list, WebDataset
    ``.cls``/``.json``), and a function from a value to its label (or to a ``str``: why it is
    none). Every value an integer ``>= 0`` (``3`` or ``"3"``): those are the labels, and the
    classes ``"0"`` up to the largest (or ``classes``, by position). Otherwise the values are
    class names: their sorted set, or positions in ``classes``."""
    integers = bool(values) and all(
        isinstance(v, int) or (isinstance(v, str) and v.isascii() and v.isdigit()) for v in values
    )
    if integers:

        def number(value: int | str) -> int:  # MAX_CLASSES for any label too large to be one
            if isinstance(value, str) and len(value.lstrip("0")) > 18:
                return MAX_CLASSES
            return min(int(value), MAX_CLASSES)

        if classes is None:
            below = [n for n in map(number, values) if n < MAX_CLASSES]
            classes = [str(i) for i in range(max(below) + 1)] if below else []
        count = len(classes)

        def by_number(value: int | str) -> int | str:
            label = number(value)
            if label >= MAX_CLASSES:
                shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:20]}..."
                return (
                    f"label {shown} is beyond the {MAX_CLASSES:,} classes imgpack takes "
                    "(integer labels are 0..N-1)"
                )
            if label < count:
                return label
            return f"label {label} is not a class of the label map ({count} classes)"

        return classes, by_number
    if classes is None:
        classes = sorted({str(v) for v in values})
    position = {name: index for index, name in enumerate(classes)}

    def by_name(value: int | str) -> int | str:
        found = position.get(str(value))
        if found is not None:
            return found
        return f"class {str(value)!r} is not in the given label map"

    return classes, by_name
