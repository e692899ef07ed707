"""Small facts about the machine, shared by the conversion and the loading side."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on (affinity-aware, unlike ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
