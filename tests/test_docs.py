"""Every fenced code block of README.md and docs/ runs as written, page by page, top to bottom
(tests/docs_support/page.py says how each kind of block is run and checked).

A page runs in a fresh folder with what it assumes the reader has (``fixtures``, made by
tests/docs_support/fixtures.py). Pages that start servers (moto's S3 on 127.0.0.1:9000, a Ray
cluster) run in a network namespace of their own that has only loopback, which needs root (CI
runs as root). ``replace`` lists, for each page, every piece of text the test machine changes
before running it, and why.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import pytest
from conftest import can_isolate
from conftest import isolated as run_isolated

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "docs_support" / "page.py"

#: One Ray "node" per process here, not 32 CPUs each: two CPUs would start 64 Ray workers.
CLUSTER = {"head:": "127.0.0.1:", "--num-cpus 32": "--num-cpus 1"}

PAGES: dict[str, dict[str, object]] = {
    "README.md": {"fixtures": ["s3"], "isolated": True, "seconds": 60},
    "docs/benchmarks.md": {},
    "docs/cli.md": {},
    "docs/images.md": {},
    "docs/integrity.md": {},
    "docs/loading.md": {},
    "docs/python-api.md": {},
    "docs/scale.md": {
        "isolated": True,
        "replace": CLUSTER,
        "seconds": 60,
        # Its ray:// client (whose server starts a process per client) failed now and then on
        # 2 CPUs, Ray's per-client server dying at start with empty logs ("Starting Ray client
        # server failed") or finding its own child a zombie in the page's PID namespace
        # ("Initialization failure from server: psutil.ZombieProcess"): it runs alone, after
        # the others, and once more if either happens.
        "alone": True,
        "again_on": ("Starting Ray client server failed", "Initialization failure from server"),
    },
    "docs/security.md": {},
    "docs/sources.md": {"fixtures": ["sources"], "seconds": 40},
    "docs/storage.md": {"fixtures": ["images", "s3"], "isolated": True, "seconds": 20},
    "docs/formats/hdf5.md": {},
    "docs/formats/lmdb.md": {},
    "docs/formats/pt.md": {},
    "docs/formats/tfrecord.md": {},
    "docs/formats/webdataset.md": {},
}


def test_every_page_is_listed() -> None:
    pages = {"README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))}
    assert pages == set(PAGES)


#: Pages run two at a time (each is mostly one process starting after another): the module
#: takes half as long on CI's 2 CPUs.
PARALLEL = 2


def _run(page: str, root: Path) -> subprocess.CompletedProcess[str] | str:
    """Run one page in a fresh folder under ``root``; a string says why it was not run."""
    config = PAGES[page]
    isolated = bool(config.get("isolated"))
    if isolated and not can_isolate():
        return "starts servers: needs root for a loopback-only network namespace (CI has it)"
    # Ray's socket paths must stay under 108 bytes, and its token file lives in $HOME/.ray.
    short = Path(tempfile.mkdtemp(prefix="ipd", dir="/tmp"))
    (short / "home").mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(short / "home"),
        "RAY_TMPDIR": str(short),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONWARNINGS": "ignore",
        "MPLBACKEND": "Agg",
    }
    work = root / page.replace("/", "-")
    work.mkdir()
    command = [sys.executable, str(RUNNER), str(ROOT / page), str(work), json.dumps(config)]
    try:
        if isolated:  # a Ray the page started dies with its namespace, not the other lane's
            return run_isolated(f"exec {shlex.join(command)}", env=env, timeout=900)
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, object]:
    """The selected pages' runs (``-k`` picks pages), the slowest started first so that the
    lanes end together."""
    root = tmp_path_factory.mktemp("docs")
    selected = {
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_the_page_runs_as_written"
    }
    order = sorted(selected, key=lambda page: -int(PAGES[page].get("seconds", 0)))  # type: ignore[call-overload]
    shared = [page for page in order if not PAGES[page].get("alone")]
    with ThreadPoolExecutor(PARALLEL) as pool:
        done = dict(zip(shared, pool.map(lambda page: _run(page, root), shared), strict=True))
    for page in (page for page in order if page not in done):
        done[page] = first = _run(page, root)
        patterns = cast("tuple[str, ...]", PAGES[page].get("again_on", ()))
        failed = isinstance(first, subprocess.CompletedProcess) and first.returncode != 0
        said = f"{first.stdout}\n{first.stderr}" if failed else ""  # type: ignore[union-attr]
        seen = [pattern for pattern in patterns if pattern in said]
        if seen:
            # Those failures only, once, and said in the page's output.
            shutil.rmtree(root / page.replace("/", "-"))
            retried = _run(page, root)
            if isinstance(retried, subprocess.CompletedProcess):
                retried.stdout = f"RETRIED after: {seen[0]}\n{retried.stdout}"
            done[page] = retried
    return done


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_runs_as_written(page: str, runs: dict[str, object]) -> None:
    done = runs[page]
    if isinstance(done, str):
        pytest.skip(done)
    assert isinstance(done, subprocess.CompletedProcess)
    print(done.stdout)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    assert "DONE " in done.stdout
