"""Conversion on Ray: a real local Ray and a real 2-node cluster (ray.cluster_utils), started in a
network namespace of their own that has only loopback, so no byte leaves 127.0.0.1 (Ray
advertises the machine's interface address otherwise). The checks themselves are in
tests/ray_support/checks.py; the whole run takes about a minute."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import can_isolate, isolated

from imgpack.executors import WORKER_DIED

SUPPORT = Path(__file__).resolve().parent / "ray_support"


pytestmark = pytest.mark.skipif(
    not can_isolate(), reason="needs root for a loopback-only network namespace (CI runs as root)"
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
    command = f'exec "{sys.executable}" "{SUPPORT / "checks.py"}" "{work}"'
    try:
        done = isolated(command, env=env, timeout=600)
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


def test_a_bucket_source_is_read_by_the_tasks_on_every_node(results: dict[str, object]) -> None:
    """A 2-node cluster converts an image folder in a bucket to the bytes the local pool writes
    from it: every task reads its objects from the bucket (nothing was downloaded to the
    driver, so a task handed a driver's path could not read it)."""
    assert results["bucket_src"] == {"pt": True, "webdataset": True}


def test_bucket_to_bucket_shard_tasks_on_two_nodes(results: dict[str, object]) -> None:
    """Shard tasks on a 2-node cluster read a bucket SRC and write whole shards to a bucket DST:
    the bytes of the local pool's run, every image converted."""
    assert results["bucket_to_bucket"] == {"pt": True, "tfrecord": True, "webdataset": True}


def test_an_output_in_a_bucket_is_read_by_the_tasks_on_two_nodes(
    results: dict[str, object],
) -> None:
    """An imgpack output in a bucket as SRC on a 2-node cluster: scan tasks (a data file each)
    and shard tasks read it by its URL on the nodes; the bytes of the local pool's run."""
    assert results["output_src"] is True


def test_a_shard_task_that_kills_its_worker_every_try_is_named_or_skipped(
    results: dict[str, object],
) -> None:
    """Ray retries the shard task, then each of its images alone finds the poison: named, or
    skipped with every other image written; a Python error shows its cause."""
    assert "class1/poison.png: the conversion worker reading it died" in str(
        results["shard_poison_fail"]
    )
    assert results["shard_poison_skipped"] == [{"path": "class1/poison.png", "reason": WORKER_DIED}]
    assert results["shard_poison_rest"] is True
    assert results["shard_bug"] == (
        "a conversion task failed on the Ray cluster: RuntimeError: a bug in a decoder"
    )


def test_a_killed_ray_worker_is_retried(results: dict[str, object]) -> None:
    assert results["killed_worker"] is True
    assert results["killed_same"] is True


def test_a_bad_file_is_named_as_locally(results: dict[str, object]) -> None:
    assert results["bad_ray"] == results["bad_local"]
    assert "class1/zz-broken.png" in str(results["bad_ray"])
    assert results["skip_same"] is True  # --on-error skip: the same skipped list and bytes


def test_a_file_that_kills_its_worker_every_try_is_named_or_skipped(
    results: dict[str, object],
) -> None:
    """Ray retries the chunk, then converts it one file per task to find the poison."""
    assert "class1/poison.png: the conversion worker reading it died" in str(results["poison_fail"])
    assert results["poison_left"] is False
    assert results["poison_skipped"] == [{"path": "class1/poison.png", "reason": WORKER_DIED}]
    assert results["poison_rest"] is True


def test_a_python_error_in_a_task_shows_its_cause(results: dict[str, object]) -> None:
    assert results["bug"] == (
        "a conversion task failed on the Ray cluster: RuntimeError: a bug in a decoder"
    )


def test_cluster_connection_problems_are_one_line(tmp_path: Path) -> None:
    """A `ray start --head` cluster with token authentication (docs/scale.md): a driver without
    RAY_AUTH_MODE=token, one with it but without the token, and an address where nothing
    listens each get one imgpack line (exit 1), no traceback; with both, the conversion runs."""
    pytest.importorskip("ray", reason="pip install 'imgpack[ray]' (scripts/test.sh installs it)")
    short = Path(tempfile.mkdtemp(prefix="ipt", dir="/tmp"))
    for home in ("head", "bare"):
        (short / home).mkdir()
    bin_dir = Path(sys.executable).parent
    script = f"""
export PATH="{bin_dir}:$PATH" RAY_TMPDIR="{short}" RAY_USAGE_STATS_ENABLED=0 HOME="{short}/head"
imgpack sample images --images 12 --classes 2 2>/dev/null
RAY_AUTH_MODE=token ray get-auth-token --generate >/dev/null 2>&1
RAY_AUTH_MODE=token ray start --head --port 6390 --num-cpus 1 >/dev/null 2>&1
run() {{ imgpack convert images "$1" --format pt --executor ray --ray-address "$2" -q; echo "rc=$?"; }}
echo "== no-mode";  run out1 127.0.0.1:6390
echo "== no-token"; RAY_AUTH_MODE=token HOME="{short}/bare" run out2 127.0.0.1:6390
echo "== nothing";  run out3 127.0.0.1:6399
echo "== both";     RAY_AUTH_MODE=token run out4 127.0.0.1:6390
"""
    try:
        done = isolated(script, cwd=tmp_path, timeout=300)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    parts = dict(part.split("\n", 1) for part in done.stdout.split("== ")[1:])  # case -> rc
    assert parts["no-mode"].strip() == "rc=1", done.stderr
    assert parts["no-token"].strip() == "rc=1", done.stderr
    assert parts["nothing"].strip() == "rc=1", done.stderr
    assert parts["both"].strip() == "rc=0", done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 3, done.stderr
    assert lines[0].startswith("Error: could not connect to the Ray cluster at 127.0.0.1:6390")
    assert "set RAY_AUTH_MODE=token" in lines[0]
    assert "uses token authentication and this machine has no token" in lines[1]
    assert lines[2].startswith("Error: cannot reach the Ray cluster at 127.0.0.1:6399")
