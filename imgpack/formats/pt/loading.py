"""Loading a ``pt`` shard: ``torch.load`` with Python's own unpickler, restricted to the globals
a shard's pickle names.

A shard is what ``torch.save`` writes: a zip holding a pickle of the shard's dict (tensors,
whose bytes ``mmap=True`` maps, and the list of source paths) beside the tensors' storages.
``torch.load(weights_only=True)`` unpickles it safely, but in Python, about 2.4 µs per source
path: 121 ms for a shard of 50,000 samples, paid by every process that opens it, against 12 ms
for Python's C unpickler. So a shard is loaded by the C unpickler with its globals restricted
to the two a shard's pickle holds (``collections.OrderedDict`` and torch's tensor rebuild; the
storage types torch resolves itself), as Python's pickle documentation shows under "Restricting
Globals": anything else is refused, and the shard is then loaded by ``weights_only=True``,
which names what is wrong or loads what a later torch writes differently.
"""

from __future__ import annotations

import os
import pickle
import types
from typing import Any

import torch

#: The globals a shard's pickle may name: ``(module, name)``.
SHARD_GLOBALS = frozenset({("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")})


class _ShardUnpickler(pickle.Unpickler):
    """Python's C unpickler, refusing every global but :data:`SHARD_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SHARD_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a shard")


#: What ``torch.load(pickle_module=...)`` takes: a module with an ``Unpickler``.
_shard_pickle = types.SimpleNamespace(
    __name__="imgpack_shard_pickle", Unpickler=_ShardUnpickler, load=pickle.load
)


def load_shard(path: str | os.PathLike[str]) -> Any:
    """The shard at ``path``, its tensors memory-mapped (read only through them)."""
    try:
        return torch.load(
            path, mmap=True, weights_only=False, pickle_module=_shard_pickle, map_location="cpu"
        )
    except pickle.UnpicklingError:  # not a shard's globals: torch's safe unpickler says why
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
