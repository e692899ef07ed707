"""A claim on work that parts started together would each repeat (imgpack.storage.claim): one
does it, the others wait for what it saves, and go on by themselves when it stops answering."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from imgpack.storage import claim


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claim, "BEAT", 0.05)
    monkeypatch.setattr(claim, "POLL", 0.02)
    monkeypatch.setattr(claim, "STALE", 0.5)
    monkeypatch.setattr(claim, "SETTLE", 0.1)


def _claim(folder: Path) -> dict[str, object]:
    return json.loads((folder / "work.claim").read_text())  # type: ignore[no-any-return]


def test_a_claim_is_kept_fresh_then_taken_back(tmp_path: Path) -> None:
    folder = tmp_path / "dst" / "work"
    held = claim.Claim(str(folder), "work.claim", "s3://b/src", "part 0 of 2").take()
    assert held.stands()
    first = _claim(folder)
    assert first["what"] == "s3://b/src" and first["who"] == "part 0 of 2"
    deadline = time.monotonic() + 10
    while _claim(folder)["beat"] == first["beat"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held.release()
    assert sorted(tmp_path.iterdir()) == []  # the claim and the folders it made


def test_a_settled_claim_is_taken_back_by_itself(tmp_path: Path) -> None:
    """Once what the waiters wait for is saved, the claim goes (before its process ends)."""
    saved = threading.Event()
    held = claim.Claim(str(tmp_path), "work.claim", "src", "part 0", settled=saved.is_set).take()
    assert held.stands()
    assert (tmp_path / "work.claim").is_file()
    saved.set()
    deadline = time.monotonic() + 10
    while (tmp_path / "work.claim").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held.release()


def test_a_waiter_takes_what_the_claimer_saves(tmp_path: Path) -> None:
    held = claim.Claim(str(tmp_path), "work.claim", "src", "part 0 of 2").take()
    assert held.stands()
    saved: list[str] = []

    def work() -> None:
        time.sleep(0.3)
        saved.append("the listing")
        held.release()

    worker = threading.Thread(target=work)
    began = time.monotonic()
    worker.start()
    found = claim.wait_for(str(tmp_path), "work.claim", "src", lambda: saved[0] if saved else None)
    worker.join()
    assert found == "the listing" and time.monotonic() - began >= 0.3


def test_a_claim_taken_back_unsaved_lets_the_waiter_go_on(tmp_path: Path) -> None:
    """The claimer failed: its claim goes, and the waiter does the work itself at once."""
    held = claim.Claim(str(tmp_path), "work.claim", "src", "part 0 of 2").take()
    assert held.stands()
    threading.Timer(0.2, held.release).start()
    began = time.monotonic()
    assert claim.wait_for(str(tmp_path), "work.claim", "src", lambda: None) is None
    assert 0.2 <= time.monotonic() - began < claim.STALE


def test_a_claim_that_stops_changing_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim left by a process killed while it listed: the waiter goes on by itself after
    STALE seconds of its own clock without a change."""
    body = {"what": "src", "who": "part 0 of 2", "token": "gone", "beat": 7}
    (tmp_path / "work.claim").write_text(json.dumps(body))
    began = time.monotonic()
    with caplog.at_level("WARNING"):
        assert claim.wait_for(str(tmp_path), "work.claim", "src", lambda: None) is None
    assert time.monotonic() - began >= claim.STALE
    assert any("part 0 of 2 claimed it but said nothing" in r.getMessage() for r in caplog.records)


def test_another_sources_claim_or_none_is_not_waited_for(tmp_path: Path) -> None:
    assert claim.wait_for(str(tmp_path), "work.claim", "src", lambda: None) is None
    held = claim.Claim(str(tmp_path), "work.claim", "other", "part 0 of 2").take()
    assert held.stands()
    began = time.monotonic()
    assert claim.wait_for(str(tmp_path), "work.claim", "src", lambda: "saved") is None
    assert time.monotonic() - began < claim.STALE
    held.release()


def test_a_claim_is_created_only_where_there_is_none(tmp_path: Path) -> None:
    early = claim.Claim(str(tmp_path), "work.claim", "src", "part 0 of 2").take()
    late = claim.Claim(str(tmp_path), "work.claim", "src", "part 1 of 2").take()
    assert [late.stands(), early.stands()] == [False, True]
    late.release()
    time.sleep(4 * claim.BEAT)  # the loser never writes; the one kept is renewed
    assert _claim(tmp_path)["who"] == "part 0 of 2" and _claim(tmp_path)["beat"]
    early.release()
    assert sorted(tmp_path.iterdir()) == []  # nor any file the writes went through


def test_without_conditional_writes_of_claims_written_at_one_moment_the_last_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without hard links (and a store without ``If-None-Match``) keeps the last
    write: each claimer reads its claim back after a pause."""
    import os

    def no_links(*args: object) -> None:
        raise OSError("hard links are not supported here")

    monkeypatch.setattr(os, "link", no_links)
    early = claim.Claim(str(tmp_path), "work.claim", "src", "part 0 of 2").take()
    late = claim.Claim(str(tmp_path), "work.claim", "src", "part 1 of 2").take()
    began = time.monotonic()
    assert [early.stands(), late.stands()] == [False, True]
    assert time.monotonic() - began >= 2 * claim.SETTLE
    early.release()
    time.sleep(4 * claim.BEAT)
    assert _claim(tmp_path)["who"] == "part 1 of 2" and _claim(tmp_path)["beat"]
    late.release()
    assert sorted(tmp_path.iterdir()) == []


def test_a_stale_claim_is_replaced_by_the_part_that_gave_up_on_it(tmp_path: Path) -> None:
    body = {"what": "src", "who": "part 0 of 2", "token": "gone", "beat": 7}
    (tmp_path / "work.claim").write_text(json.dumps(body))
    found, held = claim.first(str(tmp_path), "work.claim", "src", "part 1 of 2", lambda: None)
    assert found is None and held is not None and _claim(tmp_path)["who"] == "part 1 of 2"
    held.release()


def _four_parts_at_once(folder: Path) -> tuple[list[str], list[str]]:
    """Four threads ask for the same work at one barrier; the one whose claim stands does it
    (0.3 s) and saves it. What was saved, and what each part got."""
    saved: list[str] = []
    done: list[str] = []
    start = threading.Barrier(4)

    def part(k: int) -> None:
        start.wait()
        found, held = claim.first(
            str(folder), "work.claim", "src", f"part {k}", lambda: saved[0] if saved else None
        )
        if held is not None:
            time.sleep(0.3)  # the listing
            saved.append(f"listed by part {k}")
            held.release()
            found = saved[0]
        done.append(str(found))

    threads = [threading.Thread(target=part, args=(k,)) for k in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return saved, done


def test_parts_started_at_one_moment_do_the_work_once(tmp_path: Path) -> None:
    """Four threads ask for the same work at the same moment: one does it, the others take
    what it saved."""
    saved, done = _four_parts_at_once(tmp_path)
    assert len(saved) == 1 and done == saved * 4


def test_parts_that_give_up_on_one_stale_claim_together_do_the_work_once(tmp_path: Path) -> None:
    """The claimer was killed: four parts waiting for it find its claim stale at about the same
    moment, and each would take it over. One does the work; the others wait for it and take
    what it saved."""
    body = {"what": "src", "who": "part 0 of 5", "token": "gone", "beat": 7}
    (tmp_path / "work.claim").write_text(json.dumps(body))
    saved, done = _four_parts_at_once(tmp_path)
    assert len(saved) == 1 and done == saved * 4, saved
    assert sorted(tmp_path.iterdir()) == []
