"""Feeding the training loop: :mod:`~imgpack.loading.gpu` (``DeviceLoader``, a dataset preloaded
onto the GPU), :mod:`~imgpack.loading.tuning` (DataLoader settings), :mod:`~imgpack.loading.profiling`
(where the time goes) and :mod:`~imgpack.loading.bench` (read throughput side by side)."""
