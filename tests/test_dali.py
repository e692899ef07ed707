"""NVIDIA DALI reads imgpack's TFRecord shards with the CPU pipeline docs/formats/tfrecord.md
shows (the snippet is taken from the page itself, so the docs stay runnable): the same labels,
and for PNG records the same pixels as imgpack's reader. DALI runs in a child process: loaded
into the test process, its libraries break the forked workers of later conversions."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats" / "tfrecord.md"

CHILD = """
import glob, hashlib, json, sys
from nvidia.dali import fn, pipeline_def, types
import nvidia.dali.tfrecord as tfrec
files = sorted(glob.glob(sys.argv[1] + "/data-*.tfrecord"))
indexes = [f[: -len(".tfrecord")] + ".idx" for f in files]
exec(sys.stdin.read())
print(json.dumps({
    "labels": [int(labels.at(i)[0]) for i in range(len(labels))],
    "pixels": [hashlib.sha256(images.at(i).tobytes()).hexdigest() for i in range(len(images))],
}))
"""


def _cpu_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    [snippet] = [b for b in blocks if "def cpu_pipeline" in b]
    return snippet


def test_the_documented_dali_cpu_pipeline_reads_an_output(tmp_path: Path) -> None:
    if (
        importlib.util.find_spec("nvidia") is None
        or importlib.util.find_spec("nvidia.dali") is None
    ):
        pytest.skip("pip install 'imgpack[dali]' (scripts/test.sh does)")
    out = tmp_path / "out"
    convert(build_uniform_folder(tmp_path / "src", count=40), out, "tfrecord", progress=False)
    snippet = _cpu_snippet().replace("batch_size=256", "batch_size=40")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)],
        input=snippet,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ds = open_dataset(out)
    assert got["labels"] == ds.targets
    expected = [
        hashlib.sha256(ds[i][0].permute(1, 2, 0).contiguous().numpy().tobytes()).hexdigest()
        for i in range(len(ds))
    ]
    assert got["pixels"] == expected
