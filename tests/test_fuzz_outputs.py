"""Fuzzing outputs with hypothesis: byte flips, truncations, deleted files and manifest edits in
every format's files. Reading every sample (verify=True) gives the right pixels and label or an
ImgpackError: never another exception, a signal, a hang, or silently different data. verify
reports every case that changed a byte.

The reads run in a child process (one per example, over all its damaged copies), so a SIGBUS or
a hang fails the test instead of killing pytest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build_uniform_folder
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from imgpack import convert, open_dataset, verify
from imgpack.converters import FORMATS

COPIES = 10  # damaged copies per example, read by one child process

CHILD = r"""
import hashlib, json, sys
from imgpack import open_dataset
from imgpack.errors import ImgpackError
expected = json.load(open(sys.argv[1]))
results = []
for path in sys.argv[2:]:
    try:
        ds = open_dataset(path, verify=True)
        if len(ds) != len(expected):
            results.append(["mismatch", f"{len(ds)} samples, expected {len(expected)}"])
            continue
        verdict = ["ok", ""]
        for i in range(len(ds)):
            image, label = ds[i]
            digest = hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()
            if [digest, label] != expected[i]:
                verdict = ["mismatch", f"sample {i} differs"]
                break
        results.append(verdict)
    except ImgpackError as exc:
        results.append(["error", f"{type(exc).__name__}: {exc}"])
    except BaseException as exc:
        results.append(["crash", f"{type(exc).__name__}: {exc}"])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    base = tmp_path_factory.mktemp("fuzz")
    src = build_uniform_folder(base / "src", count=12, size=8)
    made = {}
    for fmt in FORMATS:
        for encoding in ("raw", "original"):
            out = base / f"{fmt}-{encoding}"
            convert(src, out, fmt, encoding=encoding, size=8, shard_size=None, progress=False)
            ds = open_dataset(out)
            expected = [
                [hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest(), ds[i][1]]
                for i in range(len(ds))
            ]
            (out.parent / f"{out.name}.expected.json").write_text(json.dumps(expected))
            made[fmt, encoding] = out
    return made


damage = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(0)),
    st.tuples(st.just("delete"), st.just(0.0), st.just(0)),
    st.tuples(
        st.just("manifest"),
        st.sampled_from(["num_samples", "bytes", "path", "classes", "encoding", "image"]),
        st.integers(-3, 3),
    ),
)


def _damage(out: Path, how: tuple[str, Any, int]) -> bool:
    """Apply one damage to ``out``'s files; whether a byte of the output changed."""
    kind, where, value = how
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "lock.mdb")
    data_files = [p for p in files if p.name != "imgpack.json"]
    if kind == "manifest":
        path = out / "imgpack.json"
        data = json.loads(path.read_text())
        if where == "num_samples":
            data["num_samples"] += value or 1
        elif where == "bytes":
            data["files"][0]["bytes"] += value or 1
        elif where == "path":
            data["files"][0]["path"] = [
                "../x",
                "/etc/passwd",
                "",
                ".",
                "nope.bin",
                "a/b",
                "imgpack.json",
            ][value + 3]
        elif where == "classes":
            data["classes"] = data["classes"][: max(0, len(data["classes"]) + min(value, -1))]
        elif where == "encoding":
            data["encoding"] = "raw" if data["encoding"] != "raw" else "png"
        else:
            data["image"]["height"] = (data["image"]["height"] or 8) + (value or 1)
        before = path.read_bytes()
        path.write_text(json.dumps(data))
        return path.read_bytes() != before
    target = data_files[int(abs(value)) % len(data_files)] if kind == "delete" else None
    if target is None:
        sizes = [p.stat().st_size for p in data_files]
        offset = int(where * sum(sizes))
        for path, size in zip(data_files, sizes, strict=True):
            if offset < size:
                target = path
                break
            offset -= size
    assert target is not None
    if kind == "delete":
        target.unlink()
        # A TFRecord .idx is derived from its shard: without it the reader indexes the shard
        # itself (imgpack index writes it again), so nothing of the data is lost.
        return not (
            target.suffix == ".idx" and (out / target.with_suffix(".tfrecord").name).exists()
        )
    blob = bytearray(target.read_bytes())
    if kind == "truncate":
        target.write_bytes(bytes(blob[:offset]))
        return True
    blob[offset] ^= value
    target.write_bytes(bytes(blob))
    return True


@pytest.mark.parametrize("encoding", ["raw", "original"])
@pytest.mark.parametrize("fmt", FORMATS)
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # a failure is reported as found, unshrunk
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damages=st.lists(damage, min_size=COPIES, max_size=COPIES))
def test_damage_is_an_error_or_harmless(
    fmt: str,
    encoding: str,
    damages: list[tuple[str, Any, int]],
    outputs: dict[tuple[str, str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    original = outputs[fmt, encoding]
    work = tmp_path_factory.mktemp("copies")
    copies, changed = [], []
    for k, how in enumerate(damages):
        copy = work / f"copy{k}"
        shutil.copytree(original, copy)
        changed.append(_damage(copy, how))
        copies.append(copy)
    expected = original.parent / f"{original.name}.expected.json"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(expected), *map(str, copies)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, f"the reader died ({child.returncode}): {child.stderr[-2000:]}"
    results = json.loads(child.stdout)
    for how, (verdict, detail), copy, did_change in zip(
        damages, results, copies, changed, strict=True
    ):
        assert verdict in ("ok", "error"), f"{how}: {verdict}: {detail}"
        report = verify(copy, deep=True)
        if did_change:
            assert not report.ok, f"{how}: verify --deep found nothing"
