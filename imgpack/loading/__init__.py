"""Feeding the training loop: :mod:`~imgpack.loading.sampler` (``ShardSampler``, shard-aware and
resumable; ``Mix``, several outputs drawn by weight), :mod:`~imgpack.loading.state` (``Loader``,
a ``DataLoader`` with exact mid-epoch state), :mod:`~imgpack.loading.gpu` (``DeviceLoader``, a
dataset preloaded onto the GPU), :mod:`~imgpack.loading.tuning` (DataLoader settings),
:mod:`~imgpack.loading.profiling` (where the time goes) and :mod:`~imgpack.loading.bench` (read
throughput side by side)."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "ShardSampler": "imgpack.loading.sampler",
    "ShardBatches": "imgpack.loading.sampler",
    "Mix": "imgpack.loading.sampler",
    "sampler_state": "imgpack.loading.sampler",
    "Loader": "imgpack.loading.state",
    "DeviceLoader": "imgpack.loading.gpu",
}


def __getattr__(name: str) -> Any:
    """``from imgpack.loading import ShardSampler, Loader, Mix, DeviceLoader`` (and
    ``ShardBatches``, ``sampler_state``), imported when first used: ``import imgpack.loading`` imports no torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'imgpack.loading' has no attribute {name!r}")


__all__ = ["DeviceLoader", "Loader", "Mix", "ShardBatches", "ShardSampler", "sampler_state"]
