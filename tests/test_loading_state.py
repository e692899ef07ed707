"""Training state: ShardSampler + Loader (and torchdata's StatefulDataLoader) resume exactly,
mid-epoch, in a new process, with another number of workers and of ranks; Mix draws by weight
and resumes the same way."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.converters import FORMATS
from imgpack.errors import OptionError
from imgpack.loading import Loader, Mix, ShardSampler
from imgpack.loading.sampler import ShardBatches
from imgpack.readers import collate
from imgpack.recipe import EpochIndices

N = 24  # samples: 2 ranks x batches of 2 x 3 batches = 12 consumed, 12 left for 3 or 4 ranks


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("state")
    src = build_uniform_folder(base / "src", count=N, classes=3, size=8)
    made = {}
    for fmt in FORMATS:
        out = base / fmt
        sharded = {"shard_size": 1000} if fmt in ("pt", "tfrecord", "webdataset") else {}
        convert(src, out, format=fmt, progress=False, **sharded)
        made[fmt] = out
    return made


#: A training process: R ranks (in lockstep, one Loader each) read TAKE batches each (all of
#: the epoch if TAKE is -1) after loading STATE (a file, or "-"), write what they saw and rank
#: 0's state to OUT, say "saved", and wait to be killed.
CHILD = r"""
import hashlib, json, sys, time, warnings
warnings.simplefilter("ignore")
from imgpack import open_dataset
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate
root, ranks, workers, take, state_file, out, kind = sys.argv[1:8]
ranks, workers, take = int(ranks), int(workers), int(take)
size = int(sys.argv[8]) if len(sys.argv) > 8 else 2
ds = open_dataset(root)
samplers = [ShardSampler(ds, seed=7, window=2, block_size=5, num_replicas=ranks, rank=rank)
            for rank in range(ranks)]
def make(sampler):
    batched = {"batch_sampler": sampler.batches(size)} if kind.endswith("batches") else {
        "batch_size": size, "sampler": sampler}
    if kind.startswith("torchdata"):
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(ds, num_workers=workers, collate_fn=collate, **batched)
    return Loader(ds, num_workers=workers, collate_fn=collate, **batched)
loaders = [make(s) for s in samplers]
if state_file != "-":
    saved = json.load(open(state_file))
    state = saved.get("state", saved)
    for loader, sampler in zip(loaders, samplers):
        if kind.startswith("torchdata") and saved.get("workers") != workers:
            sampler.load_state_dict(state)  # torchdata's own load needs the same workers
        else:
            loader.load_state_dict(state)
    for sampler in samplers:
        sampler.set_epoch(0)  # what a training loop does: the saved epoch keeps its count
seen, iters, batches = [], [iter(l) for l in loaders], 0
while take < 0 or batches < take:
    try:
        got = [next(it) for it in iters]
    except StopIteration:
        break
    for images, labels in got:
        for image in images:
            seen.append(hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest())
    batches += 1
json.dump({"seen": seen, "state": loaders[0].state_dict(), "workers": workers}, open(out, "w"))
print("saved", flush=True)
time.sleep(600)
"""


def _run(root: Path, ranks: int, workers: int, take: int, state: Path | None, out: Path,
         kind: str = "loader", size: int = 2) -> dict[str, Any]:  # fmt: skip
    """Run CHILD, SIGKILL it once it saved, return what it wrote."""
    args = [sys.executable, "-c", CHILD, str(root), str(ranks), str(workers), str(take)]
    args += [str(state) if state else "-", str(out), kind, str(size)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    process.send_signal(signal.SIGKILL)
    _, err = process.communicate(timeout=60)
    assert line.strip() == "saved", err[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _digests(root: Path) -> list[str]:
    ds = open_dataset(root)
    return [hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest() for i in range(N)]


@pytest.mark.parametrize(
    ("fmt", "kind"), [(fmt, "loader") for fmt in FORMATS] + [("webdataset", "loader-batches")]
)
def test_a_killed_run_resumes_on_other_workers_and_ranks(
    fmt: str, kind: str, outputs: dict[str, Path], tmp_path: Path
) -> None:
    root = outputs[fmt]
    before = _run(root, 2, 2, 3, None, tmp_path / "a.json", kind=kind)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(before))
    assert before["state"]["sampler"]["consumed"] == 12  # what was handed out, not prefetched
    after = _run(root, 3, 1, -1, state, tmp_path / "b.json", kind=kind)
    seen = before["seen"] + after["seen"]
    assert len(seen) == N and sorted(seen) == sorted(_digests(root))


#: Samples of the resume matrix: 3 batches of 2 on each of 1-3 ranks leave 54, 48 or 42, which
#: 1, 2 and 3 ranks share without padding (a padded sample is read twice by design).
MATRIX_N = 60
#: (ranks, workers) when saving and when resuming: every pair of worker counts (0, 1, 2), and
#: each of 1, 2 and 3 ranks on both sides.
MATRIX = [
    ((1, 0), (3, 2)), ((2, 0), (1, 1)), ((3, 0), (2, 0)),
    ((1, 1), (2, 1)), ((2, 1), (3, 0)), ((3, 1), (1, 2)),
    ((1, 2), (1, 0)), ((2, 2), (2, 2)), ((3, 2), (3, 1)),
]  # fmt: skip


@pytest.fixture(scope="module")
def matrix_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("matrix")
    src = build_uniform_folder(base / "src", count=MATRIX_N, classes=3, size=8)
    made = {}
    for fmt in ("pt", "webdataset"):
        convert(src, base / fmt, format=fmt, progress=False, shard_size=600)  # several shards
        made[fmt] = base / fmt
    return made


@pytest.mark.parametrize(
    ("kind", "fmt", "save", "resume"),
    [("loader", "pt", *pair) for pair in MATRIX]
    + [("loader-batches", "webdataset", *pair) for pair in MATRIX[1::3]]
    + [("loader", "webdataset", *pair) for pair in MATRIX[2::3]]
    + [("torchdata", "pt", *pair) for pair in MATRIX[::2]]
    + [("torchdata-batches", "webdataset", *pair) for pair in MATRIX[1::4]],
)
def test_a_resume_is_exact_for_any_workers_and_ranks_on_either_side(
    kind: str,
    fmt: str,
    save: tuple[int, int],
    resume: tuple[int, int],
    matrix_outputs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Killed after 3 batches a rank on ``save`` (ranks, workers), resumed on ``resume``: what
    was read before and after is the epoch, each sample once (with workers on resume too: the
    DataLoader makes two sampler iterations and draws from the second)."""
    if kind.startswith("torchdata"):
        pytest.importorskip("torchdata.stateful_dataloader", reason="the [torchdata] extra")
    root = matrix_outputs[fmt]
    before = _run(root, *save, 3, None, tmp_path / "a.json", kind=kind)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(before))
    after = _run(root, *resume, -1, state, tmp_path / "b.json", kind=kind)
    seen = before["seen"] + after["seen"]
    ds = open_dataset(root)
    every = [
        hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest() for i in range(len(ds))
    ]
    assert len(before["seen"]) == 6 * save[0]
    assert Counter(seen) == Counter(every)


#: The Lightning recipe of docs/loading.md, run as written (batches of 8 instead of 256): a
#: training step records its images, saves a checkpoint at step STOP and is SIGKILLed; the
#: next run resumes from that checkpoint to the end of the epoch.
LIGHTNING_CHILD = r"""
import hashlib, json, os, re, signal, sys, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
docs, ckpt, out, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
text = open(docs, encoding="utf-8").read()
block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "LightningDataModule" in b)
assert "batch_size=256" in block
exec(block.replace("batch_size=256", "batch_size=8"))
seen = []

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def training_step(self, batch, index):
        for image in batch[0]:
            seen.append(hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest())
        if self.global_step + 1 == stop:
            self.trainer.save_checkpoint(ckpt)
            json.dump(seen, open(out, "w"))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.w(torch.ones(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=False)
trainer.fit(Model(), datamodule=Data(), ckpt_path=ckpt if stop < 0 else None)
json.dump(seen, open(out, "w"))
"""


def test_the_lightning_recipe_resumes_mid_epoch_exactly(
    matrix_outputs: dict[str, Path], tmp_path: Path
) -> None:
    """docs/loading.md's LightningDataModule with 2 workers, killed after a checkpoint at step 3
    and resumed from it: every sample of the epoch once."""
    pytest.importorskip("lightning")
    docs = Path(__file__).resolve().parents[1] / "docs" / "loading.md"
    (tmp_path / "out").symlink_to(matrix_outputs["pt"])
    ckpt, seen = tmp_path / "step3.ckpt", []
    for stop, name in ((3, "a.json"), (-1, "b.json")):
        args = [sys.executable, "-c", LIGHTNING_CHILD, str(docs), str(ckpt), name, str(stop)]
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == (-signal.SIGKILL if stop > 0 else 0), done.stderr[-3000:]
        seen += json.loads((tmp_path / name).read_text())
    ds = open_dataset(matrix_outputs["pt"])
    every = [
        hashlib.sha256(ds[i][0].contiguous().numpy().tobytes()).hexdigest() for i in range(len(ds))
    ]
    assert len(seen) == MATRIX_N and Counter(seen) == Counter(every)


@pytest.mark.parametrize(
    ("fmt", "kind"), [("pt", "torchdata"), ("lmdb", "torchdata"), ("lmdb", "torchdata-batches")]
)
def test_statefuldataloader_resumes_with_the_same_workers_and_other_ranks(
    fmt: str, kind: str, outputs: dict[str, Path], tmp_path: Path
) -> None:
    pytest.importorskip("torchdata.stateful_dataloader", reason="the [torchdata] extra")
    root = outputs[fmt]
    before = _run(root, 2, 2, 3, None, tmp_path / "a.json", kind=kind)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(before["state"]))
    after = _run(root, 4, 2, -1, state, tmp_path / "b.json", kind=kind)
    seen = before["seen"] + after["seen"]
    assert len(seen) == N and sorted(seen) == sorted(_digests(root))


def _order(loader: Loader) -> list[int]:
    """The labels of an iteration, flattened (the datasets here label samples uniquely)."""
    return [int(t) for _, labels in loader for t in labels]


@pytest.fixture
def indexed(tmp_path: Path) -> Any:
    """A dataset whose label is its index: orders compare exactly."""

    class Indexed:
        classes: ClassVar[list[str]] = [str(i) for i in range(N)]

        def __len__(self) -> int:
            return N

        def __getitem__(self, index: int) -> tuple[Any, int]:
            return np.zeros(1), index

    return Indexed()


def test_epoch_boundaries_and_set_epoch(indexed: Any) -> None:
    def loader() -> Loader:
        return Loader(indexed, batch_size=4, sampler=ShardSampler(indexed, seed=3, block_size=5))

    first = loader()
    epoch0 = _order(first)
    assert sorted(epoch0) == list(range(N))
    end = first.state_dict()  # after the whole epoch: nothing left of it
    assert end["sampler"]["consumed"] == N and end["sampler"]["epoch"] == 0
    resumed = loader()
    resumed.load_state_dict(end)
    assert _order(resumed) == []
    resumed.sampler.set_epoch(1)  # type: ignore[attr-defined]
    fresh = loader()
    fresh.sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert _order(resumed) == _order(fresh) != epoch0
    # mid-epoch 1, then the training loop's set_epoch(1) on resume keeps the position
    mid = loader()
    mid.sampler.set_epoch(1)  # type: ignore[attr-defined]
    it = iter(mid)
    head = [int(t) for _ in range(2) for t in next(it)[1]]
    saved = mid.state_dict()
    again = loader()
    again.load_state_dict(saved)
    again.sampler.set_epoch(1)  # type: ignore[attr-defined]
    assert head + _order(again) == _order(fresh)


def test_batches_are_the_samplers_order_in_arrays_with_its_state(indexed: Any) -> None:
    for ranks in (1, 3):
        for drop_last in (False, True):
            samplers = [
                ShardSampler(indexed, seed=2, num_replicas=ranks, rank=r, block_size=5)
                for r in range(ranks)
            ]
            for sampler in samplers:
                positions = list(
                    ShardSampler(
                        indexed, seed=2, num_replicas=ranks, rank=sampler.rank, block_size=5
                    )
                )
                batches = sampler.batches(5, drop_last=drop_last)
                got = list(batches)
                assert all(b.dtype == np.int64 and 0 < len(b) <= 5 for b in got)
                assert len(got) == len(batches)
                flat = [int(i) for b in got for i in b]
                kept = len(positions) - len(positions) % 5 if drop_last else len(positions)
                assert flat == positions[:kept]
    # mid-epoch state, in samples, as the sampler's own; a new one resumes after it
    sampler = ShardSampler(indexed, seed=4, block_size=5)
    it = iter(sampler.batches(4))
    head = [int(i) for _ in range(2) for i in next(it)]
    state = it.state_dict()  # type: ignore[attr-defined]
    assert state["consumed"] == 8 and state == sampler.state_dict()
    again = ShardSampler(indexed, seed=4, block_size=5)
    again.load_state_dict(state)
    rest = [int(i) for b in again.batches(4) for i in b]
    assert head + rest == list(ShardSampler(indexed, seed=4, block_size=5))
    loader = Loader(indexed, batch_sampler=ShardSampler(indexed, seed=4, block_size=5).batches(4))
    assert _order(loader) == list(ShardSampler(indexed, seed=4, block_size=5))
    assert loader.state_dict()["sampler"]["consumed"] == N
    with pytest.raises(OptionError, match="batch_size must be 1 or more"):
        sampler.batches(0)


def test_the_loader_is_a_dataloader_through_its_public_api_only(
    indexed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loader batches come through DataLoader's own iterator (its profiler ranges included,
    batch by batch, as a plain DataLoader's), and imgpack uses none of DataLoader's private
    names (which torch changes often; setup.cfg allows torch>=2.1)."""
    import re

    import torch
    from torch.utils.data import DataLoader

    opened: list[str] = []
    real = torch.autograd.profiler.record_function

    class Counted(real):  # type: ignore[misc, valid-type]
        def __enter__(self) -> Any:
            opened.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Counted)
    order = list(ShardSampler(indexed, seed=5))
    for workers in (0, 2):
        plain = DataLoader(
            indexed, batch_sampler=ShardSampler(indexed, seed=5).batches(4), num_workers=workers
        )
        assert _order(plain) == order
        ranges, opened[:] = len(opened), []
        loader = Loader(
            indexed, batch_sampler=ShardSampler(indexed, seed=5).batches(4), num_workers=workers
        )
        assert _order(loader) == order and len(opened) == ranges > N // 4
        assert loader.state_dict()["sampler"]["consumed"] == N
        opened.clear()
    private = re.compile(
        r"\._(next_data|sampler_iter|num_yielded|index_sampler|profiler_enabled|"
        r"get_iterator|DatasetKind|auto_collation)\b"
    )
    package = Path(__file__).resolve().parents[1] / "imgpack"
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


def test_a_loaders_batches_reach_an_imgpack_reader_as_index_arrays(
    outputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from torch.utils.data import DataLoader

    ds = open_dataset(outputs["pt"])
    got: list[type] = []
    real = type(ds).__getitems__

    def spy(self: Any, indices: Any) -> Any:
        got.append(type(indices))
        return real(self, indices)

    monkeypatch.setattr(type(ds), "__getitems__", spy)
    for drop_last in (False, True):
        made = {"batch_size": 5, "drop_last": drop_last, "collate_fn": collate}
        plain = list(DataLoader(ds, sampler=ShardSampler(ds, seed=3, block_size=4), **made))
        assert set(got) == {list}
        got.clear()
        sampler = ShardSampler(ds, seed=3, block_size=4)
        loader = Loader(ds, sampler=sampler, **made)
        # DataLoader's public batch_sampler=: the sampler's batches as arrays
        assert type(loader.batch_sampler) is ShardBatches and loader.batch_sampler.batch_size == 5
        assert loader.batch_sampler.sampler is sampler
        assert loader.batch_sampler.drop_last is drop_last
        assert len(loader) == len(plain) == (N // 5 if drop_last else -(-N // 5))
        mine = list(loader)
        # one index array a batch (carrying its epoch), not 5 Python ints
        assert set(got) == {EpochIndices} and issubclass(EpochIndices, np.ndarray)
        got.clear()
        assert len(mine) == len(plain)
        for (a, x), (b, y) in zip(mine, plain, strict=True):
            assert torch.equal(a, b) and torch.equal(x, y)
        assert loader.state_dict()["sampler"]["consumed"] == sum(len(y) for _, y in plain)


def test_a_loader_needs_a_shard_sampler(indexed: Any) -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    with pytest.raises(OptionError, match="keeps state through its sampler"):
        Loader(indexed, batch_sampler=BatchSampler(SequentialSampler(indexed), 4, False))


def test_a_state_of_another_dataset_or_seed_is_refused(outputs: dict[str, Path]) -> None:
    a, b = open_dataset(outputs["pt"]), open_dataset(outputs["hdf5"])
    state = ShardSampler(a, seed=1).state_dict()
    with pytest.raises(OptionError, match="another dataset"):
        ShardSampler(b, seed=1).load_state_dict(state)
    with pytest.raises(OptionError, match="another seed"):
        ShardSampler(a, seed=2).load_state_dict(state)
    with pytest.raises(OptionError, match="not an imgpack sampler state"):
        ShardSampler(a, seed=1).load_state_dict({"epoch": 3})


def test_every_sample_once_across_ranks_with_equal_counts(indexed: Any) -> None:
    for ranks in (1, 2, 3, 5):
        parts = [
            list(ShardSampler(indexed, seed=0, num_replicas=ranks, rank=r, block_size=4))
            for r in range(ranks)
        ]
        assert len({len(p) for p in parts}) == 1
        counts = Counter(i for p in parts for i in p)
        assert set(counts) == set(range(N))
        assert sum(counts.values()) - N == (-N) % ranks  # only the pad is read twice


def test_the_order_stays_within_a_window_of_shards(outputs: dict[str, Path]) -> None:
    ds = open_dataset(outputs["pt"])
    sampler = ShardSampler(ds, seed=0, window=2)
    starts = np.cumsum([0, *[f.num_samples for f in ds.manifest.files]])
    shard_of = np.searchsorted(starts, sampler.global_order(), side="right") - 1
    per_window = sum(int(starts[1] - starts[0]) for _ in range(2))
    for first in range(0, N, per_window):
        assert len(set(shard_of[first : first + per_window].tolist())) <= 2 + 1


def test_mix_draws_by_weight_and_resumes_exactly(outputs: dict[str, Path]) -> None:
    a, b = open_dataset(outputs["pt"]), open_dataset(outputs["lmdb"])
    mix = Mix([a, b], weights=[0.75, 0.25], samples=40)
    assert mix.counts == [30, 10]
    sampler = ShardSampler(mix, seed=5, block_size=4)
    order = sampler.global_order()
    source = (order >= len(a)).astype(int)
    assert Counter(source.tolist()) == {0: 30, 1: 10}
    for prefix in range(1, 41):  # every prefix within one sample of the weights
        assert abs(int(source[:prefix].sum()) - 0.25 * prefix) <= 1.0
    labels = [mix[int(i)][1] for i in order[:8]]
    assert all(0 <= t < len(mix.classes) == 6 for t in labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = Loader(mix, batch_size=4, sampler=ShardSampler(mix, seed=5), collate_fn=collate)
        full = _order(whole)
        part = Loader(mix, batch_size=4, sampler=ShardSampler(mix, seed=5), collate_fn=collate)
        it = iter(part)
        head = [int(t) for _ in range(3) for t in next(it)[1]]
        resumed = Loader(mix, batch_size=4, sampler=ShardSampler(mix, seed=5), collate_fn=collate)
        resumed.load_state_dict(part.state_dict())
        assert head + _order(resumed) == full
        batched = ShardSampler(mix, seed=5).batches(4)  # index arrays: the same samples
        assert _order(Loader(mix, batch_sampler=batched, collate_fn=collate)) == full
    by_name = Mix([a, b], counts=[2, 2], labels="by_name")
    assert by_name.classes == sorted(set(a.classes) | set(b.classes))


def test_device_loader_resumes_with_the_same_augmentation(outputs: dict[str, Path]) -> None:
    from imgpack.loading import DeviceLoader

    def make() -> DeviceLoader:
        return DeviceLoader(outputs["pt"], device="cpu", batch_size=5, seed=4, crop_padding=2,
                            hflip=0.5, size=8, progress=False)  # fmt: skip

    whole = make()
    whole.set_epoch(2)
    full = [(x.clone(), y.clone()) for x, y in whole]
    part = make()
    part.set_epoch(2)
    it = iter(part)
    head = [next(it) for _ in range(2)]
    resumed = make()
    resumed.load_state_dict(part.state_dict())
    rest = list(resumed)
    assert len(head) + len(rest) == len(full)
    for (x, y), (fx, fy) in zip(head + rest, full, strict=True):
        assert bool((x == fx).all()) and bool((y == fy).all())
    with pytest.raises(OptionError, match="another seed"):
        other = DeviceLoader(
            outputs["pt"], device="cpu", batch_size=5, seed=5, size=8, progress=False
        )
        other.load_state_dict(part.state_dict())


@pytest.mark.parametrize(("save", "resume"), [((2, 2), (1, 2)), ((1, 2), (3, 1)), ((2, 1), (2, 0))])
def test_a_mix_resumes_exactly_with_workers_and_ranks_on_either_side(
    outputs: dict[str, Path], save: tuple[int, int], resume: tuple[int, int]
) -> None:
    """A Loader over a Mix (index arrays through the public batch_sampler=, the Mix's own
    range check) saved after 2 batches a rank on ``save`` (ranks, workers) and resumed on
    ``resume``: before and after hold the epoch's draws, each once."""
    a, b = open_dataset(outputs["pt"]), open_dataset(outputs["lmdb"])
    mix = Mix([a, b], weights=[0.5, 0.5], samples=36)

    def loaders(ranks: int, workers: int) -> list[Loader]:
        return [
            Loader(mix, batch_size=3, num_workers=workers, collate_fn=collate,
                   sampler=ShardSampler(mix, seed=9, block_size=4, num_replicas=ranks, rank=r))
            for r in range(ranks)
        ]  # fmt: skip

    def key(image: Any) -> str:
        return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()

    seen: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = loaders(*save)
        for loader in first:
            batches = iter(loader)
            for _ in range(2):
                seen += [key(image) for image in next(batches)[0]]
        state = first[0].state_dict()
        for loader in loaders(*resume):
            loader.load_state_dict(state)
            seen += [key(image) for images, _ in loader for image in images]
    epoch = ShardSampler(mix, seed=9, block_size=4).global_order()  # the Mix's 36 draws
    assert len(seen) == len(epoch) == 36
    assert Counter(seen) == Counter(key(mix[int(i)][0]) for i in epoch)
