"""Loaded at start-up by every Python process of the Ray tests (the driver and Ray's workers,
through PYTHONPATH): while the file named by IMGPACK_TEST_SLOW exists, each image takes 50 ms
more to process, so that a test can kill a Ray worker mid-task."""

import os
import time

_FLAG = os.environ.get("IMGPACK_TEST_SLOW")

if _FLAG:
    import imgpack.executors as _executors

    _real = _executors.process_chunk

    def process_chunk(job, items):  # type: ignore[no-untyped-def]
        if os.path.exists(_FLAG):
            time.sleep(0.05 * len(items))
        return _real(job, items)

    _executors.process_chunk = process_chunk
