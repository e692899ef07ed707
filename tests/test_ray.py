"""Conversion on Ray: a real local Ray and a real 2-node cluster (ray.cluster_utils), started in a
network namespace of their own that has only loopback, so no byte leaves 127.0.0.1 (Ray
advertises the machine's interface address otherwise). The checks themselves are in
tests/ray_support/checks.py; the whole run takes about a minute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "ray_support"


def _isolated() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _isolated(), reason="needs root for a loopback-only network namespace (CI runs as root)"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    pytest.importorskip("ray", reason="pip install 'imgpack[ray]' (scripts/test.sh installs it)")
    work = tmp_path_factory.mktemp("ray")
    # Ray's socket paths must stay under 108 bytes: its session folder goes in a short one.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ipr", dir="/tmp"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        "IMGPACK_TEST_SLOW": str(work / "slow"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": str(ray_tmp),
    }
    command = f'ip link set lo up && exec "{sys.executable}" "{SUPPORT / "checks.py"}" "{work}"'
    try:
        done = subprocess.run(
            ["unshare", "-n", "sh", "-c", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return dict(json.loads(lines[-1][len("RESULTS ") :]))


def test_local_ray_writes_the_bytes_of_the_local_engine(results: dict[str, object]) -> None:
    assert results["local_ray"] == dict.fromkeys(results["local_ray"], True)  # type: ignore[arg-type]
    assert len(results["local_ray"]) == 5  # type: ignore[arg-type]


def test_a_two_node_cluster_writes_the_same_bytes(results: dict[str, object]) -> None:
    assert results["nodes"] == 2
    assert results["cluster"] == dict.fromkeys(results["cluster"], True)  # type: ignore[arg-type]


def test_a_killed_ray_worker_is_retried(results: dict[str, object]) -> None:
    assert results["killed_worker"] is True
    assert results["killed_same"] is True


def test_a_bad_file_is_named_as_locally(results: dict[str, object]) -> None:
    assert results["bad_ray"] == results["bad_local"]
    assert "class1/zz-broken.png" in str(results["bad_ray"])
    assert results["skip_same"] is True  # --on-error skip: the same skipped list and bytes
