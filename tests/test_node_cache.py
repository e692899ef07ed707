"""Reading a bucket output on several nodes, each with its own cache (moto on 127.0.0.1, inside
``unshare -n`` in CI): each node fetches its own shards once an epoch, counted by the store side
(a counting proxy per node in front of moto), its cache never past its limit; a limit below
what a node holds while reading is refused in one line; a state saved on 2 nodes resumes
exactly on 1 and on 3."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import build_uniform_folder

from imgpack import convert, open_dataset
from imgpack.errors import OptionError
from imgpack.loading import Loader, ShardSampler
from imgpack.readers import collate
from imgpack.storage.lazy import cached_files

COUNT = 1280
NODES, PER_NODE, WORKERS = 2, 2, 2
WINDOW, PREFETCH = 2, 2

#: An HTTP proxy on 127.0.0.1 in front of the S3 server, in a process of its own (forked
#: DataLoader workers must not inherit its sockets): it prints its port, then logs each
#: successful GET of an object ("<key> <bytes>") to the file it is given, as a store's access
#: log would.
PROXY = r"""
import http.client, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit
target, log = urlsplit(sys.argv[1]), open(sys.argv[2], "a", buffering=1)
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
        upstream.request(self.command, self.path, body=body, headers=headers)
        reply = upstream.getresponse()
        data = reply.read()
        upstream.close()
        if self.command == "GET" and "?" not in self.path and reply.status < 300:
            log.write(f"{self.path} {len(data)}\n")
        self.send_response(reply.status)
        for key, value in reply.getheaders():
            if key.lower() not in HOP and not (key.lower() == "content-length" and data):
                self.send_header(key, value)
        if data or self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class CountingProxy:
    """:data:`PROXY`, started for one node: what that node's readers GET from the store."""

    def __init__(self, upstream: str, log: Path) -> None:
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-c", PROXY, upstream, str(log)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def data_gets(self, names: set[str]) -> tuple[Counter[str], int]:
        """GETs per data file (by file name) and their bytes."""
        gets: Counter[str] = Counter()
        total = 0
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        for line in lines:
            path, size = line.rsplit(" ", 1)
            name = path.rsplit("/", 1)[-1]
            if name in names:
                gets[name] += 1
                total += int(size)
        return gets, total


@pytest.fixture
def proxies(s3: str, tmp_path: Path) -> Iterator[list[CountingProxy]]:
    upstream = os.environ["AWS_ENDPOINT_URL"]
    made = [CountingProxy(upstream, tmp_path / f"gets-{n}.log") for n in range(3)]
    try:
        yield made
    finally:
        for proxy in made:
            proxy.close()


@pytest.fixture
def bucket_output(s3: str, tmp_path: Path) -> tuple[str, Path]:
    """A pt output of ~64 shards, local and uploaded as it is."""
    src = build_uniform_folder(tmp_path / "src", count=COUNT, classes=8, size=8, seed=4)
    local = tmp_path / "local"
    convert(src, local, "pt", encoding="raw", size=8, progress=False, shard_size=4200)
    assert len(open_dataset(local).manifest.files) >= 60
    url = f"{s3}/nodes-{tmp_path.name}"
    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    return url, local


def _digest(image: Any) -> str:
    return hashlib.sha256(image.contiguous().numpy().tobytes()).hexdigest()


def _node_readers(
    url: str, cache: Path, proxy: CountingProxy, limit: int | None, ranks: range, world: int,
    per_node: int, workers: int,
) -> list[Loader]:  # fmt: skip
    loaders = []
    for rank in ranks:
        ds = open_dataset(
            url,
            cache_dir=cache,
            cache_limit=limit,
            prefetch=PREFETCH,
            storage_options={"endpoint_url": proxy.url},
        )
        sampler = ShardSampler(
            ds, seed=9, window=WINDOW, num_replicas=world, rank=rank, ranks_per_node=per_node
        )
        loaders.append(
            Loader(ds, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate)
        )
    return loaders


def _lockstep(loaders: list[Loader], take: int | None) -> tuple[list[str], dict[str, Any]]:
    seen: list[str] = []
    iters, steps = [iter(loader) for loader in loaders], 0
    while take is None or steps < take:
        try:
            batches = [next(it) for it in iters]
        except StopIteration:
            break
        seen += [_digest(image) for images, _ in batches for image in images]
        steps += 1
    return seen, loaders[0].state_dict()


def _data_bytes(cache: Path) -> int:
    return sum(size for _, _, size in cached_files(cache))


def test_each_node_fetches_its_own_shards_once_within_its_limit(
    bucket_output: tuple[str, Path], proxies: list[CountingProxy], tmp_path: Path
) -> None:
    url, local = bucket_output
    files = open_dataset(local).manifest.files
    names = {f.path for f in files}
    total = sum(f.bytes for f in files)
    # An eighth of the output, or what a node holds at once where that is more (each node's
    # first rank, through a Loader as below: its lag and batches).
    sizing = [_node_readers(url, tmp_path / f"sizing{node}", proxies[2], 2**30,
                            range(node * PER_NODE, node * PER_NODE + 1), NODES * PER_NODE,
                            PER_NODE, WORKERS)[0] for node in range(NODES)]  # fmt: skip
    need = max(loader.batch_sampler.sampler.working_set() or 0 for loader in sizing)  # type: ignore[union-attr]
    assert 0 < need < total // 2
    limit = max(total // 8, need)
    caches = [tmp_path / f"cache-node{n}" for n in range(NODES)]
    loaders = []
    for node in range(NODES):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        loaders += _node_readers(url, caches[node], proxies[node], limit, ranks,
                                 NODES * PER_NODE, PER_NODE, WORKERS)  # fmt: skip
    peaks = [0] * NODES
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for node, cache in enumerate(caches):
                peaks[node] = max(peaks[node], _data_bytes(cache))
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        seen, _ = _lockstep(loaders, None)
    finally:
        done.set()
        watcher.join()
    reference = open_dataset(local)
    every = Counter(_digest(reference[i][0]) for i in range(len(reference)))
    assert Counter(seen) == every  # every sample once (COUNT is a multiple of the ranks)
    for node in range(NODES):
        gets, fetched = proxies[node].data_gets(names)
        # Each shard once. (A fetch the main process sent on a connection made before a
        # worker was forked used to stall ~15 s and be sent again: the reader now takes a new
        # filesystem after each fork.)
        assert gets and max(gets.values()) == 1, gets.most_common(3)
        assert fetched <= 1.05 * total / NODES, (node, fetched / (total / NODES))
        assert 0 < peaks[node] <= limit, (node, peaks[node], limit)


def test_a_limit_below_what_a_node_holds_is_refused(
    bucket_output: tuple[str, Path], proxies: list[CountingProxy], tmp_path: Path
) -> None:
    """The least limit is what the sampler's order has one node hold at once; a limit below
    it is refused in one line naming it, by the sampler, and by a Loader whose workers hold
    batches ahead (so that shards are held longer)."""
    url, _ = bucket_output
    made = {"cache_dir": tmp_path / "cache", "prefetch": PREFETCH,
            "storage_options": {"endpoint_url": proxies[0].url}}  # fmt: skip
    options = {"window": WINDOW, "num_replicas": 4, "rank": 1, "ranks_per_node": 2}
    need = ShardSampler(open_dataset(url, cache_limit="1GB", **made), **options).working_set()
    assert need is not None
    small = open_dataset(url, cache_limit=need - 1, **made)
    with pytest.raises(OptionError, match=f"give cache_limit >= {need}, or a smaller window"):
        ShardSampler(small, **options)
    enough = ShardSampler(open_dataset(url, cache_limit=need, **made), **options)
    with pytest.raises(OptionError, match="samples handed out ahead of the reads"):
        Loader(enough.dataset, batch_size=16, sampler=enough, num_workers=2, collate_fn=collate)


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_state_saved_on_two_nodes_resumes_on_others(
    bucket_output: tuple[str, Path], proxies: list[CountingProxy], tmp_path: Path, nodes: int
) -> None:
    """Saved with 2 workers a rank on 2 nodes; resumed on 1 node with 2 workers and on 3
    nodes without: each remaining sample once."""
    url, local = bucket_output
    total = sum(f.bytes for f in open_dataset(local).manifest.files)
    limit = total // 4
    before_loaders = []
    for node in range(NODES):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        before_loaders += _node_readers(url, tmp_path / f"a{node}", proxies[node], limit, ranks,
                                        NODES * PER_NODE, PER_NODE, WORKERS)  # fmt: skip
    before, state = _lockstep(before_loaders, 7)
    after_loaders = []
    for node in range(nodes):
        after_loaders += _node_readers(url, tmp_path / f"b{node}", proxies[node], limit,
                                       range(node, node + 1), nodes, 1, 2 if nodes == 1 else 0)  # fmt: skip
    for loader in after_loaders:
        loader.load_state_dict(state)
    after, _ = _lockstep(after_loaders, None)
    reference = open_dataset(local)
    every = Counter(_digest(reference[i][0]) for i in range(len(reference)))
    seen = Counter(before + after)
    assert set(seen) == set(every)
    assert sum(seen.values()) - COUNT <= nodes - 1  # the resumed side's pad only


def test_a_one_shard_output_needs_its_shard_in_the_cache(s3: str, tmp_path: Path) -> None:
    """An output of one data file is read by blocks but fetched whole: a limit below that file
    is refused by the sampler, naming its size."""
    local = tmp_path / "local"
    convert(build_uniform_folder(tmp_path / "src", count=24, size=8), local, "pt", progress=False)
    (entry,) = open_dataset(local).manifest.files
    url = f"{s3}/one-shard-{tmp_path.name}"
    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    ds = open_dataset(url, cache_dir=tmp_path / "cache", cache_limit=entry.bytes - 1)
    with pytest.raises(OptionError, match=f"give cache_limit >= {entry.bytes},"):
        ShardSampler(ds)
    whole = open_dataset(url, cache_dir=tmp_path / "cache", cache_limit=entry.bytes)
    assert ShardSampler(whole).working_set() == entry.bytes


def test_each_batch_tells_its_worker_the_shards_done_with(
    bucket_output: tuple[str, Path], tmp_path: Path
) -> None:
    """The sampler's batches carry the shards it is done with (``EpochIndices.done``): none is
    read by that batch or a later one, and they grow through the epoch, so a worker reading
    any batch may let its pins on them go."""
    import numpy as np

    url, _ = bucket_output
    ds = open_dataset(url, cache_dir=tmp_path / "cache", prefetch=PREFETCH)
    sampler = ShardSampler(ds, seed=2, window=WINDOW)
    loader = Loader(ds, batch_size=8, sampler=sampler, collate_fn=collate)
    batches = list(loader.batch_sampler)  # type: ignore[arg-type]
    starts = np.cumsum([0, *[f.num_samples for f in ds.manifest.files]])
    shards = [set((np.searchsorted(starts, b, side="right") - 1).tolist()) for b in batches]
    count = len(ds.manifest.files)
    seen: set[int] = set()
    for k, batch in enumerate(batches):
        assert batch.done is not None
        done = set(np.flatnonzero(np.unpackbits(np.frombuffer(batch.done, np.uint8))[:count]))
        assert seen <= done  # it only grows
        seen = done
        later = set().union(*shards[k:])
        assert not done & later, (k, sorted(done & later))
    assert len(seen) >= count - 2 * WINDOW  # all but the last shards read, within the lag
