"""Choosing where the per-image work runs: the options are checked, and a missing Ray says what to
install (the Ray runs themselves are in test_ray.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder

from imgpack import convert
from imgpack.cli import main
from imgpack.errors import OptionError
from imgpack.executors import LocalExecutor, create


def test_executor_options(tmp_path: Path) -> None:
    assert isinstance(create("local", 2), LocalExecutor)
    assert isinstance(create(None, 2), LocalExecutor)
    mine = LocalExecutor(1)
    assert create(mine) is mine
    with pytest.raises(OptionError, match="executor 'spark' is not one of local, ray"):
        create("spark", None)
    result = CliRunner().invoke(
        main, ["convert", "a", "b", "--format", "pt", "--ray-address", "x:1"]
    )
    assert result.exit_code == 2 and "--ray-address is for --executor ray" in result.output


def test_ray_specs_name_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """'ray', 'ray:ADDRESS' and 'ray://HOST:PORT' (one spec instead of ray_address=)."""
    from imgpack import executors

    made: list[object] = []
    monkeypatch.setattr(executors, "import_ray", lambda: None)
    monkeypatch.setattr(executors, "RayExecutor", lambda address, workers: made.append(address))
    for spec in ("ray", "ray:auto", "ray:10.0.0.1:6379", "ray://head:10001"):
        create(spec, 2)
    assert made == [None, "auto", "10.0.0.1:6379", "ray://head:10001"]


def test_without_ray_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if not installed
    src = build_uniform_folder(tmp_path / "src", count=3)
    with pytest.raises(OptionError, match=r"pip install 'imgpack\[ray\]'"):
        convert(src, tmp_path / "out", "pt", executor="ray", progress=False)
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "out"), "--format", "pt", "--executor", "ray"]
    )
    assert result.exit_code == 2 and "pip install 'imgpack[ray]'" in result.output
    assert not (tmp_path / "out").exists()


def test_a_ray_client_address_without_the_client_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a)
    )
    build_uniform_folder(tmp_path / "src", count=4, classes=1)
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--format",
            "pt",
            "--executor",
            "ray",
        ],
        env={"RAY_ADDRESS": "ray://127.0.0.1:10001"},
    )
    assert result.exit_code == 2
    assert "needs Ray's client, which is not installed: pip install 'imgpack[ray]'" in result.output
    assert not (tmp_path / "out").exists()


def test_a_local_ray_is_not_started_for_the_listing_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket folder's listing goes to the executor's tasks, except where each call would
    start a local Ray and stop it after (no address, none in RAY_ADDRESS, Ray not running in
    this process): then it is listed here, and Ray starts once, for the conversion."""
    from imgpack.executors import RayExecutor
    from imgpack.sources.listing import _task_lister

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    url = "s3://bucket/src"
    assert _task_lister(LocalExecutor(2), url, None, 8) is not None
    assert _task_lister(LocalExecutor(2), url, None, 1) is None  # one folder: nothing to spread
    if importlib.util.find_spec("ray") is not None:
        assert RayExecutor().starts_ray and _task_lister(RayExecutor(), url, None, 8) is None
    assert not RayExecutor("ray://head:10001").starts_ray
    assert _task_lister(RayExecutor("ray://head:10001"), url, None, 8) is not None
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert not RayExecutor().starts_ray
