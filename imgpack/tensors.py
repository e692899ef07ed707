"""Using torch from anywhere in the package: whether its threaded kernels may run in this
process, and a tensor over a read-only array. torch is imported on first use, so a module that
needs these (the recipe, the gathers) costs a conversion nothing.

Torch runs its intra-op work (a large ``index_select``, an image resize) on GNU OpenMP's
thread pool, and that pool does not survive ``fork()``: a forked child that enters it after
its parent did waits forever. So torch's threaded kernels run in a process that was not forked
(its pool is its own) or that runs torch on one thread (DataLoader workers: no OpenMP region
is entered); elsewhere (a process forked with several threads) the caller takes a path of its
own (numpy, Pillow).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

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


def readonly_tensor(data: np.ndarray) -> torch.Tensor:
    """A tensor over the bytes of ``data``, an array that may be read only (a memory map opened
    for reading, Pillow's pixels), to be read only: torch has no read-only tensors and warns."""
    import torch

    if data.flags.writeable:
        return torch.from_numpy(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)
