"""Whether torch's intra-op threads may run in this process.

Torch runs its intra-op work (a large ``index_select``, an image resize) on GNU OpenMP's
thread pool, and that pool does not survive ``fork()``: a forked child that enters it after
its parent did waits forever. So torch's threaded kernels run in a process that was not forked
(its pool is its own) or that runs torch on one thread (DataLoader workers: no OpenMP region
is entered); elsewhere (a process forked with several threads) the caller takes a path of its
own (numpy, Pillow).
"""

from __future__ import annotations

import os

#: Whether this process was forked from another.
_FORKED = False


def _forked() -> None:
    global _FORKED
    _FORKED = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def torch_may_run() -> bool:
    """Whether torch's threaded kernels may run here (see the module's note)."""
    import torch

    return not _FORKED or torch.get_num_threads() == 1
