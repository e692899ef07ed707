from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset

from imgpack import convert, open_dataset
from imgpack.cli import main
from imgpack.loading.profiling import LoaderProfiler, TimedDataset, verdict
from imgpack.loading.tuning import (
    NOISE,
    LoaderSettings,
    autotune_loader,
    recommend_loader_settings,
)
from imgpack.readers import collate


@pytest.fixture
def outputs(uniform_folder: Path, tmp_path: Path) -> dict[str, Path]:
    convert(uniform_folder, tmp_path / "raw", "pt", encoding="raw", size=16, progress=False)
    convert(uniform_folder, tmp_path / "png", "lmdb", encoding="png", progress=False)
    return {"raw": tmp_path / "raw", "png": tmp_path / "png"}


def test_recommendation_follows_the_format(
    outputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = recommend_loader_settings(open_dataset(outputs["raw"]), gpu=False)
    assert raw.num_workers == 0 and "memory gather" in raw.reasons["num_workers"]
    assert raw.pin_memory is False and "no GPU" in raw.reasons["pin_memory"]
    monkeypatch.setattr("imgpack.loading.tuning.usable_cpus", lambda: 8)
    enc = recommend_loader_settings(open_dataset(outputs["png"]), gpu=True)
    assert enc.num_workers == 7 and "sched_getaffinity" in enc.reasons["num_workers"]
    assert enc.pin_memory and enc.persistent_workers and enc.prefetch_factor == 4
    assert enc.decode_threads == 1 and "7 for 8 CPUs" in enc.reasons["decode_threads"]
    assert set(enc.reasons) == {*enc.kwargs(), "decode_threads"}
    assert enc.reader_kwargs() == {"decode_threads": 1} and raw.reader_kwargs() == {}


def test_candidates_share_the_cpus_between_workers_and_threads(
    outputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("imgpack.loading.tuning.usable_cpus", lambda: 4)
    from imgpack.loading.tuning import candidate_settings

    enc = candidate_settings(open_dataset(outputs["png"]), gpu=False)
    assert [(c.num_workers, c.decode_threads) for c in enc] == [
        (0, 4), (1, 4), (2, 2), (4, 1), (8, 1)
    ]  # fmt: skip
    raw = candidate_settings(open_dataset(outputs["raw"]), gpu=False)
    assert {c.decode_threads for c in raw} == {None}


def test_tune_gives_the_measured_reason(outputs: dict[str, Path]) -> None:
    ds = open_dataset(outputs["raw"])
    candidates = [LoaderSettings(0, False, False, None), LoaderSettings(1, False, True, 2)]
    result = autotune_loader(ds, batch_size=8, candidates=candidates, batches=3)
    reason = result.best.reasons["num_workers"]
    assert reason.startswith("measured: ") and "samples/s" in reason


def test_autotune_returns_a_candidate_it_measured(outputs: dict[str, Path]) -> None:
    ds = open_dataset(outputs["png"])
    candidates = [LoaderSettings(0, False, False, None), LoaderSettings(1, False, True, 2)]
    result = autotune_loader(ds, batch_size=8, candidates=candidates, batches=3)
    assert result.best in candidates
    assert [s for s, _ in result.table] == candidates
    # The rate it reports is the one it measured for its choice: the fastest, or the reasoned
    # choice when no candidate beats it by more than NOISE (the machine's noise).
    measured = next(rate for setting, rate in result.table if setting == result.best)
    fastest = max(rate for _, rate in result.table)
    assert result.samples_per_s == measured > 0
    assert measured == fastest or measured >= (1 - NOISE) * fastest


class Slow(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        return torch.zeros(3), i


def test_timed_dataset_counts_every_sample_in_workers(outputs: dict[str, Path]) -> None:
    timed = TimedDataset(open_dataset(outputs["raw"]))
    loader = DataLoader(timed, batch_size=8, num_workers=2, collate_fn=collate)
    seen = sum(len(labels) for _, labels in loader)
    stats = timed.stats()
    assert seen == stats["count"] == 60
    assert set(stats["per_worker"]) == {"worker0", "worker1"}
    assert sum(w["count"] for w in stats["per_worker"].values()) == 60
    assert 0 < stats["p50"] <= stats["p95"] <= stats["max"]
    assert timed.classes == ["class0", "class1", "class2"]  # attributes pass through
    timed[0]
    assert timed.stats()["per_worker"]["main"]["count"] == 1
    log_dir = timed.log_dir
    timed.close()
    assert not log_dir.exists()


def test_timed_dataset_per_sample_fetches_in_workers() -> None:
    timed = TimedDataset(Slow(12, 0.002))
    list(DataLoader(timed, batch_size=4, num_workers=2, multiprocessing_context="spawn"))
    stats = timed.stats()
    assert stats["count"] == 12 and stats["mean"] >= 0.002


def test_loader_profiler_tells_who_waits() -> None:
    slow_loader = LoaderProfiler(DataLoader(Slow(24, 0.01), batch_size=2), per_step=True)
    for _ in slow_loader:
        time.sleep(0.001)
    summary = slow_loader.summary()
    assert summary["batches"] == 12 and summary["samples"] == 24 and len(summary["steps"]) == 12
    assert summary["wait_share"] > 0.8 and verdict(summary).startswith("loader-bound")
    fast_loader = LoaderProfiler(DataLoader(Slow(24, 0.0), batch_size=2))
    for _ in fast_loader:
        time.sleep(0.01)
    assert fast_loader.summary()["wait_share"] < 0.2
    assert verdict(fast_loader.summary()).startswith("consumer-bound")


def test_the_verdict_needs_enough_batches_and_a_step() -> None:
    few = LoaderProfiler(DataLoader(Slow(6, 0.01), batch_size=2))
    for _ in few:
        time.sleep(0.001)
    assert verdict(few.summary()).startswith("too few batches for a verdict (2 after the first")
    idle = LoaderProfiler(DataLoader(Slow(24, 0.002), batch_size=2))
    for _ in idle:
        pass
    assert verdict(idle.summary()).startswith("no training step between batches")


def test_tune_and_profile_commands(outputs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "tune.json"
    result = CliRunner().invoke(
        main,
        [
            "tune",
            str(outputs["png"]),
            "--batch-size",
            "8",
            "--batches",
            "2",
            "--workers",
            "0,1",
            "--json",
            str(report),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "starting point" in result.output and "<- chosen" in result.output
    assert "DataLoader(ds, batch_size=8" in result.output
    assert "imgpack.open_dataset(" in result.output and "decode_threads" in result.output
    table = json.loads(report.read_text())["table"]
    assert {row["num_workers"] for row in table} == {0, 1}
    assert all(row["decode_threads"] >= 1 for row in table)
    result = CliRunner().invoke(
        main,
        [
            "profile",
            str(outputs["raw"]),
            "--workers",
            "2",
            "--batch-size",
            "8",
            "--batches",
            "12",
            "--step-ms",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    # 12 batches of 8 from a 40-sample output: three epochs' worth, all consumed.
    match = re.search(r"fetch per sample \((\d+) samples, 2 workers\)", result.output)
    assert match and int(match.group(1)) >= 96
    assert "training loop (12 batches" in result.output
    assert "-bound" in result.output


@pytest.mark.parametrize(
    ("rates", "chosen", "words"),
    [
        (
            {0: [100.0], 1: [105.0], 2: [104.0]},
            0,
            "within noise of the fastest (105 with 1 workers",
        ),
        ({0: [100.0], 1: [150.0], 2: [120.0]}, 1, "raw pixels, nothing to decode"),
        # 1 worker's median is 25% better, but its own runs spread 32%: no margin, a tie
        ({0: [100.0, 100.0, 100.0], 1: [90.0, 130.0, 125.0]}, 0, "spread 32%"),
        # the cheapest of the candidates within noise of the fastest, not the fastest
        ({0: [100.0], 1: [148.0], 2: [150.0]}, 1, "within noise of the fastest (150 with 2"),
    ],
)
def test_tune_chooses_the_cheapest_within_noise_of_the_best(
    outputs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    rates: dict[int, list[float]],
    chosen: int,
    words: str,
) -> None:
    """Each candidate is measured in turn, ``repeats`` times; the choice goes by the medians, and
    a margin inside the noise (10%, or the runs' own spread) is a tie that the cheaper wins."""
    runs = {n: iter(r * 3) for n, r in rates.items()}
    monkeypatch.setattr(
        "imgpack.loading.tuning._rate", lambda _ds, settings, *_a: next(runs[settings.num_workers])
    )
    ds = open_dataset(outputs["raw"])
    candidates = [LoaderSettings(n, False, n > 0, 4 if n else None) for n in rates]
    result = autotune_loader(ds, candidates=candidates, repeats=3)
    assert result.best.num_workers == chosen and words in result.best.reasons["num_workers"]
    assert [len(r) for r in result.runs] == [3] * len(rates)
    assert result.within_noise == ("within noise" in words or "spread" in words)


def test_tune_three_times_chooses_the_same_or_says_they_tie(
    outputs: dict[str, Path], tmp_path: Path
) -> None:
    """The advice test of #55: three ``imgpack tune`` runs on one output agree, or the output
    says the candidates tie; the readers' warning names no worker count of its own."""
    chosen, ties = set(), []
    for _ in range(3):
        result = CliRunner().invoke(
            main, ["tune", str(outputs["raw"]), "--batch-size", "8", "--batches", "4",
                   "--workers", "0,1", "--json", str(tmp_path / "t.json")],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "t.json").read_text())
        chosen.add(report["best"]["num_workers"])
        ties.append(report["within_noise"])
        assert "spread" in result.output and "median" in result.output
        assert all(len(row["runs"]) == 3 for row in report["table"])
    assert len(chosen) == 1 or any(ties)


def test_tune_measures_workers_without_the_advice_it_is_measuring(
    outputs: dict[str, Path],
) -> None:
    result = CliRunner().invoke(
        main, ["tune", str(outputs["raw"]), "--batch-size", "8", "--workers", "0,1,4"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "PerformanceWarning" not in result.output
        and "worker processes in total" not in result.output
    )
