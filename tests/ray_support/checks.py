"""The Ray checks, run by tests/test_ray.py in a network namespace of their own (loopback only):
a local Ray and a 2-node ray.cluster_utils.Cluster convert every format to the same bytes as the
local engine, a Ray worker killed mid-task is retried to the same bytes, and a bad file is named
as locally, and a file that kills its worker on every try is named, or skipped with the rest
written. Prints one JSON object of results."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import fsspec
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import build_uniform_folder, start_moto

from imgpack import convert
from imgpack.converters import FORMATS
from imgpack.errors import ImgpackError

SHARDS = {"pt": "8KB", "tfrecord": "8KB", "webdataset": "8KB"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "lock.mdb"}


def bucket_files(fs, root: str) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    fs.invalidate_cache()
    return {p[len(root) :]: fs.cat_file(p) for p in sorted(fs.find(root))}


def same_as_local(src: Path, work: Path, tag: str, formats: tuple[str, ...]) -> dict[str, bool]:
    same = {}
    for fmt in formats:
        shard = {"shard_size": SHARDS[fmt]} if fmt in SHARDS else {}
        local = convert(src, work / f"{tag}-{fmt}-local", fmt, workers=2, progress=False, **shard)
        remote = convert(
            src, work / f"{tag}-{fmt}-ray", fmt, executor="ray", progress=False, **shard
        )
        same[fmt] = (
            files(work / f"{tag}-{fmt}-local") == files(work / f"{tag}-{fmt}-ray")
            and local == remote
        )
    return same


def error_of(action) -> str:  # type: ignore[no-untyped-def]
    try:
        action()
    except ImgpackError as exc:
        return str(exc)
    return "no error"


def kill_a_worker(deadline: float, killed: list[int]) -> None:
    """SIGKILL the first Ray worker seen running a conversion task."""
    while time.monotonic() < deadline and not killed:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ray::process_chunk" in cmdline:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
                return
        time.sleep(0.02)


def main(work: Path) -> None:
    results: dict[str, object] = {}
    src = build_uniform_folder(work / "src", count=120, classes=3)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results["local_ray"] = same_as_local(src, work, "one", FORMATS)

    bad = work / "bad"
    shutil.copytree(src, bad)
    (bad / "class1" / "zz-broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(30))
    results["bad_local"] = error_of(lambda: convert(bad, work / "bad-local", "pt", progress=False))
    results["bad_ray"] = error_of(
        lambda: convert(bad, work / "bad-ray", "pt", executor="ray", progress=False)
    )
    skip_local = convert(bad, work / "skip-local", "webdataset", on_error="skip", progress=False)
    skip_ray = convert(
        bad, work / "skip-ray", "webdataset", on_error="skip", executor="ray", progress=False
    )
    results["skip_same"] = skip_local == skip_ray and files(work / "skip-local") == files(
        work / "skip-ray"
    )

    poison = work / "poison"
    shutil.copytree(src, poison)
    shutil.copy(poison / "class1" / "img0001.png", poison / "class1" / "poison.png")
    results["poison_fail"] = error_of(
        lambda: convert(poison, work / "poison-fail", "pt", executor="ray", progress=False)
    )
    results["poison_left"] = (work / "poison-fail").exists()
    buggy = work / "bug"
    shutil.copytree(src, buggy)
    shutil.copy(buggy / "class1" / "img0001.png", buggy / "class1" / "bug.png")
    results["bug"] = error_of(
        lambda: convert(buggy, work / "bug-out", "pt", executor="ray", progress=False)
    )
    skipped = convert(
        poison, work / "poison-skip", "webdataset", executor="ray", on_error="skip", progress=False
    )
    results["poison_skipped"] = skipped.skipped
    results["poison_rest"] = skipped.num_samples == 120 and files(work / "skip-local").keys() == (
        files(work / "poison-skip").keys()
    )

    flag = Path(os.environ["IMGPACK_TEST_SLOW"])
    reference = convert(src, work / "kill-local", "lmdb", workers=2, progress=False)
    flag.touch()
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker, args=(time.monotonic() + 60, killed))
    killer.start()
    survived = convert(src, work / "kill-ray", "lmdb", executor="ray", progress=False)
    killer.join()
    flag.unlink()
    results["killed_worker"] = bool(killed)
    results["killed_same"] = (
        files(work / "kill-local") == files(work / "kill-ray") and survived == reference
    )
    ray.shutdown()

    # A bucket SRC (moto on 127.0.0.1, started before the cluster: its nodes inherit the AWS
    # variables): the tasks read each object from the bucket, no path of the driver's.
    port = free_port()
    server = start_moto(port)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    fs = fsspec.filesystem("s3")
    fs.mkdir("bucket")
    fs.put(str(src), "bucket/images", recursive=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    results["nodes"] = len([n for n in ray.nodes() if n["Alive"]])
    results["cluster"] = same_as_local(src, work, "two", FORMATS)
    bucket_src = {}
    for fmt in ("pt", "webdataset"):
        shard = {"shard_size": SHARDS[fmt]}
        local = convert("s3://bucket/images", work / f"b-{fmt}-local", fmt, workers=2,
                        progress=False, **shard)  # fmt: skip
        remote = convert("s3://bucket/images", work / f"b-{fmt}-ray", fmt, executor="ray",
                         progress=False, **shard)  # fmt: skip
        bucket_src[fmt] = (
            files(work / f"b-{fmt}-local") == files(work / f"b-{fmt}-ray")
            and remote.num_samples == local.num_samples == 120
        )
    results["bucket_src"] = bucket_src

    # Bucket to bucket by shard tasks: the tasks on both nodes read SRC's objects and write
    # whole shards to DST; the driver gets receipts. The same bytes as the local pool's.
    to_bucket = {}
    for fmt in ("pt", "tfrecord", "webdataset"):
        pool = convert("s3://bucket/images", f"s3://bucket/pool-{fmt}", fmt, workers=2,
                       shard_size="8KB", progress=False)  # fmt: skip
        on_ray = convert("s3://bucket/images", f"s3://bucket/ray-{fmt}", fmt, executor="ray",
                         shard_size="8KB", progress=False)  # fmt: skip
        to_bucket[fmt] = (
            bucket_files(fs, f"bucket/pool-{fmt}") == bucket_files(fs, f"bucket/ray-{fmt}")
            and pool == on_ray
            and on_ray.num_samples == 120
            and len(on_ray.files) > 2
        )
    results["bucket_to_bucket"] = to_bucket
    # An imgpack output in the bucket as SRC: scan tasks and shard tasks on the nodes read it
    # by its URL (the driver fetches none of it): the bytes of the local pool's run.
    pool = convert("s3://bucket/pool-pt", "s3://bucket/out-pool", "webdataset", workers=2,
                   shard_size="8KB", progress=False)  # fmt: skip
    on_ray = convert("s3://bucket/pool-pt", "s3://bucket/out-ray", "webdataset", executor="ray",
                     shard_size="8KB", progress=False)  # fmt: skip
    results["output_src"] = (
        bucket_files(fs, "bucket/out-pool") == bucket_files(fs, "bucket/out-ray")
        and pool == on_ray
        and pool.source["path"] == "s3://bucket/pool-pt"
        and on_ray.num_samples == 120
        and len(on_ray.files) > 2
    )
    fs.put(str(src), "bucket/poison", recursive=True)
    fs.pipe("bucket/poison/class1/poison.png", (src / "class1" / "img0001.png").read_bytes())
    results["shard_poison_fail"] = error_of(
        lambda: convert(
            "s3://bucket/poison",
            "s3://bucket/poison-fail",
            "webdataset",
            executor="ray",
            shard_size="8KB",
            progress=False,
        )
    )
    skipped = convert("s3://bucket/poison", "s3://bucket/poison-skip", "webdataset",
                      executor="ray", shard_size="8KB", on_error="skip", progress=False)  # fmt: skip
    results["shard_poison_skipped"] = skipped.skipped
    results["shard_poison_rest"] = skipped.num_samples == 120
    fs.put(str(src), "bucket/bug", recursive=True)
    fs.pipe("bucket/bug/class1/bug.png", (src / "class1" / "img0001.png").read_bytes())
    results["shard_bug"] = error_of(
        lambda: convert(
            "s3://bucket/bug", "s3://bucket/bug-out", "pt", executor="ray", progress=False
        )
    )
    ray.shutdown()
    cluster.shutdown()
    server.terminate()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
