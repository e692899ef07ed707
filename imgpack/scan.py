"""What a source scan produces: the ordered samples and the label map (below every source kind,
the engine and the executors, which all pass them around)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The label of a sample that has none (an unlabelled source: ``classes == []``).
UNLABELLED = -1


@dataclass(frozen=True)
class Sample:
    """One image of the source: its path relative to the source root (POSIX; for some sources
    a name the source gives it) and its label."""

    path: str
    label: int
    #: Where the source finds the sample again when it is not a file under the root: an index
    #: into an imgpack output or TFRecord files, a row of a dataset, a line of a label list.
    index: int = -1


@dataclass
class Scan:
    """What a source's scan found, in the order the output keeps."""

    classes: list[str]
    samples: list[Sample]
    empty_classes: list[str] = field(default_factory=list)
    ignored_files: int = 0
    #: What the scan could not take (folders it could not list, bad rows of a label list):
    #: ``{"path": ..., "reason": ...}``, recorded as skipped.
    unreadable: list[dict[str, str]] = field(default_factory=list)
    #: When SRC is not an image folder: what the manifest records of it (its format, output id,
    #: its own source), which also goes into the output id.
    origin: dict[str, Any] | None = None

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.classes)}


def valid_label(label: int, num_classes: int) -> bool:
    """Whether ``label`` is a label of an output with ``num_classes`` classes: ``0..n-1``, or
    :data:`UNLABELLED` when the output has no classes."""
    return 0 <= label < num_classes if num_classes else label == UNLABELLED
