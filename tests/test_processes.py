"""Processes and signals: real `imgpack convert` processes killed, terminated and run side by
side. Pool workers die with their parent, SIGTERM cleans up like Ctrl-C, two runs never write one
DST, and a replacement killed midway never leaves the user without an output."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import build_uniform_folder, slow_cli

from imgpack import convert, executors, open_dataset, publishing
from imgpack.cli import main
from imgpack.errors import ConcurrentRunError
from imgpack.pipeline import leftovers
from imgpack.scan import Sample

SLOW_CLI = slow_cli(0.02)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_uniform_folder(tmp_path_factory.mktemp("procs") / "src", count=400, classes=4)


def _start(
    src: Path, dst: Path, *args: str, slow: bool = True, gate: Path | None = None
) -> subprocess.Popen[str]:
    code = slow_cli(0.02, gate) if gate else SLOW_CLI
    head = [sys.executable, "-c", code] if slow else [sys.executable, "-m", "imgpack.cli"]
    command = [*head, "convert", str(src), str(dst), "-q", "--format", "pt", *args]
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_workers(process: subprocess.Popen[str], dst: Path, count: int = 2) -> list[int]:
    """The pool workers of a running conversion, once it has started writing."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = _children(process.pid)
        if len(workers) >= count and leftovers(dst):
            return workers
        if process.poll() is not None:
            raise AssertionError(f"finished too early: {process.communicate()}")
        time.sleep(0.01)
    process.kill()
    raise AssertionError("the conversion did not start its workers")


def _gone(pids: list[int], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_parent(src: Path, tmp_path: Path) -> None:
    process = _start(src, tmp_path / "out", "--workers", "2")
    workers = _wait_for_workers(process, tmp_path / "out")
    process.send_signal(signal.SIGKILL)  # the parent only: nothing can clean up
    process.wait(timeout=30)  # not communicate(): orphans would hold its pipes open
    for pipe in (process.stdout, process.stderr):
        assert pipe is not None
        pipe.close()
    try:
        assert _gone(workers), "pool workers outlived their SIGKILLed parent"
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_cleans_up_like_ctrl_c(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    process = _start(src, out, "--workers", "2")
    workers = _wait_for_workers(process, out)
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # never left running for the tests after this one
        for pid in [process.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines() == [
        "Error: stopped by SIGTERM; cleaned up, nothing half-written"
    ]
    assert _gone(workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp dir, no lock file


def test_sigterm_reaches_every_command_as_one_line(tmp_path: Path) -> None:
    """The handler is the CLI's, not convert's: any long command (here `imgpack sample`)
    stopped by SIGTERM says so in one line and exits 143."""
    code = (
        "import os, signal, sys\n"
        "import imgpack.sample as sample\n"
        "def stop(*args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    raise AssertionError('SIGTERM was not handled')\n"
        "sample.make_sample_folder = stop\n"
        "from imgpack.cli import main\n"
        "sys.argv[0] = 'imgpack'\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "sample", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: stopped by SIGTERM; cleaned up, nothing half-written"
    ]


def test_a_second_run_to_the_same_dst_is_refused(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    gate.touch()  # the first run cannot finish until the second one has been refused
    first = _start(src, out, "--workers", "2", gate=gate)
    _wait_for_workers(first, out)
    second = _start(src, out, slow=False)
    _, err = second.communicate(timeout=120)
    gate.unlink()
    assert second.returncode == 1
    assert f"{out}: another imgpack run (pid {first.pid}) is writing it" in err
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert len(open_dataset(out)) == 400
    assert not publishing.lock_path(out).exists()


def test_a_dst_that_appears_meanwhile_is_not_replaced(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    process = _start(src, out, "--workers", "2")
    _wait_for_workers(process, out)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "appeared while this conversion ran" in err and "nothing was replaced" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert leftovers(out) == []


def test_the_lock_in_the_library(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with publishing.locked(out), pytest.raises(ConcurrentRunError, match="another imgpack run"):
        convert(src, out, "pt", progress=False)
    assert not out.exists()


def _overwrite(src: Path, out: Path) -> None:
    convert(src, out, "pt", overwrite=True, workers=1, progress=False)


@pytest.mark.skipif(publishing._RENAMEAT2 is None, reason="no renameat2 on this platform")
def test_overwrite_swaps_in_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old_src = build_uniform_folder(tmp_path / "old", count=6)
    new_src = build_uniform_folder(tmp_path / "new", count=9)
    out = tmp_path / "out"
    convert(old_src, out, "pt", workers=1, progress=False)
    calls: list[int] = []
    real = publishing.rename2

    def rename2(a: Path, b: Path, flags: int) -> bool:
        calls.append(flags)
        return real(a, b, flags)

    monkeypatch.setattr(publishing, "rename2", rename2)
    _overwrite(new_src, out)
    assert calls == [publishing.RENAME_EXCHANGE]
    assert len(open_dataset(out)) == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old", "out"]


KILL_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from imgpack import convert, publishing
publishing.rename2 = lambda *args: False  # a filesystem that cannot exchange
dst = Path(sys.argv[2])
real = os.rename
def rename(a, b):
    real(a, b)
    if Path(a) == dst:  # the old output is parked, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
convert(sys.argv[1], dst, "pt", overwrite=True, workers=1, progress=False)
"""


def test_a_kill_between_the_two_renames_is_recovered(tmp_path: Path) -> None:
    old_src = build_uniform_folder(tmp_path / "old", count=6)
    new_src = build_uniform_folder(tmp_path / "new", count=9)
    out = tmp_path / "out"
    convert(old_src, out, "pt", workers=1, progress=False)
    done = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(new_src), str(out)])
    assert done.returncode == -signal.SIGKILL
    assert not out.exists() and len(publishing.parked_outputs(out)) == 1
    # The next imgpack command that meets DST puts the old output back.
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0, result.output
    assert "samples:   6" in result.output
    assert publishing.parked_outputs(out) == []


def test_readers_and_convert_recover_a_parked_output(tmp_path: Path) -> None:
    old_src = build_uniform_folder(tmp_path / "old", count=6)
    out = tmp_path / "out"
    convert(old_src, out, "pt", workers=1, progress=False)
    parked = tmp_path / ".out.abc.imgpack-old"
    parked.mkdir()
    os.rename(out, parked / "out")
    assert len(open_dataset(out)) == 6 and not parked.exists()
    parked.mkdir()
    os.rename(out, parked / "out")
    _overwrite(build_uniform_folder(tmp_path / "new", count=9), out)  # recovers, then replaces
    assert len(open_dataset(out)) == 9 and publishing.parked_outputs(out) == []


_process_chunk = executors.process_chunk


def _poisoned(job: executors.Job, items: list[Sample]) -> list[executors.Outcome]:
    """process_chunk, except that a chunk holding ``poison.png`` kills its worker (as a decoder
    that crashes on one file would), on every try."""
    if any(sample.path.endswith("poison.png") for sample in items):
        os.kill(os.getpid(), signal.SIGKILL)
    return _process_chunk(job, items)


def test_a_file_that_kills_its_worker_is_named_or_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = build_uniform_folder(tmp_path / "src", count=60, classes=3)
    clean = convert(src, tmp_path / "clean", "pt", workers=2, progress=False)
    (src / "class1" / "poison.png").write_bytes((src / "class1" / "img0001.png").read_bytes())
    monkeypatch.setattr(executors, "process_chunk", _poisoned)
    runner = CliRunner()
    failed = runner.invoke(
        main,
        ["convert", str(src), str(tmp_path / "fail"), "--format", "pt", "--workers", "2", "-q"],
    )
    assert failed.exit_code == 1
    assert "class1/poison.png: the conversion worker reading it died" in failed.output
    assert not (tmp_path / "fail").exists()
    done = convert(src, tmp_path / "skip", "pt", workers=2, on_error="skip", progress=False)
    assert done.skipped == [{"path": "class1/poison.png", "reason": executors.WORKER_DIED}]
    got, want = open_dataset(tmp_path / "skip"), open_dataset(tmp_path / "clean")
    assert len(got) == len(want) == clean.num_samples == 60  # every other file, in order
    for i in range(len(want)):
        assert got[i][1] == want[i][1] and bool((got[i][0] == want[i][0]).all()), i
