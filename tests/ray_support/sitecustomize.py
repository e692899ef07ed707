"""Loaded at start-up by every Python process of the Ray tests (the driver and Ray's workers,
through PYTHONPATH):

- while the file named by IMGPACK_TEST_SLOW exists, each image takes 50 ms more to process, so
  that a test can kill a Ray worker mid-task;
- a chunk holding a file named ``poison.png`` kills the worker converting it (SIGKILL), on
  every try, as a decoder that crashes on one file would; one holding ``bug.png`` raises a
  Python error (a bug, not a bad file); so does reading such a file in a shard task."""

import os
import signal
import time

_FLAG = os.environ.get("IMGPACK_TEST_SLOW")

if _FLAG:
    import imgpack.executors as _executors

    _real = _executors.process_chunk

    def process_chunk(job, items):  # type: ignore[no-untyped-def]
        if any(sample.path.endswith("poison.png") for sample in items):
            os.kill(os.getpid(), signal.SIGKILL)
        if any(sample.path.endswith("bug.png") for sample in items):
            raise RuntimeError("a bug in a decoder")
        if os.path.exists(_FLAG):
            time.sleep(0.05 * len(items))
        return _real(job, items)

    _executors.process_chunk = process_chunk

    # Shard tasks (imgpack.direct) read through the source's fetcher: the same two files there.
    from imgpack.sources.folder import source as _source

    def _poisoned(real):  # type: ignore[no-untyped-def]
        def reading(self, sample, policy, encoding):  # type: ignore[no-untyped-def]
            if sample.path.endswith("poison.png"):
                os.kill(os.getpid(), signal.SIGKILL)
            if sample.path.endswith("bug.png"):
                raise RuntimeError("a bug in a decoder")
            return real(self, sample, policy, encoding)

        return reading

    for _fetcher in (_source.ObjectFetcher, _source.FileFetcher):
        _fetcher.__call__ = _poisoned(_fetcher.__call__)
