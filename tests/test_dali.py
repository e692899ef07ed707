"""NVIDIA DALI reads imgpack's TFRecord shards with the CPU pipeline docs/formats/tfrecord.md
shows (the snippet is taken from the page itself, so the docs stay runnable): the same labels,
and for PNG records the same pixels as imgpack's reader."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats" / "tfrecord.md"


def _cpu_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    [snippet] = [b for b in blocks if "def cpu_pipeline" in b]
    return snippet


def test_the_documented_dali_cpu_pipeline_reads_an_output(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali", reason="pip install 'imgpack[dali]' (scripts/test.sh does)")
    out = tmp_path / "out"
    convert(build_uniform_folder(tmp_path / "src", count=40), out, "tfrecord", progress=False)
    files = sorted(glob.glob(str(out / "data-*.tfrecord")))
    indexes = [f[: -len(".tfrecord")] + ".idx" for f in files]
    import nvidia.dali.tfrecord as tfrec  # noqa: F401
    from nvidia.dali import fn, pipeline_def, types  # noqa: F401 - the snippet uses them

    scope = {"files": files, "indexes": indexes, **globals(), **locals()}
    snippet = _cpu_snippet().replace("batch_size=256", "batch_size=40")
    exec(snippet, scope)
    images, labels = scope["images"], scope["labels"]
    ds = open_dataset(out)
    assert [int(labels.at(i)[0]) for i in range(40)] == ds.targets
    for i in range(40):
        assert np.array_equal(images.at(i), ds[i][0].permute(1, 2, 0).numpy())
