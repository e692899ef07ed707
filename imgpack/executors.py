"""Where a conversion's read + validate + encode work runs.

An executor takes a :class:`Job` (the source's fetcher, the image policy and the encoding) and the
samples in scan order, and yields one :data:`Outcome` per sample, **in scan order**, whatever order
the work finishes in: the writer downstream sees the same sequence from every executor, so the
output bytes do not depend on where the work ran.

- :class:`LocalExecutor`: a process pool on this machine with a bounded window of chunks in
  flight (memory stays bounded whatever the dataset size).
- :class:`RayExecutor`: the same chunks as Ray tasks on a Ray cluster (or a local Ray started for
  the run), the same bounded window, Ray's retries for a lost worker.

Both run the same :func:`process_chunk`, and the writer downstream is the same, so the output is
byte-identical whichever runs the work.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from imgpack.errors import DataError, ImageError, ImgpackError, OptionError, first_line
from imgpack.fields import Field, sample_values
from imgpack.images import Encoded, Encoding, ImagePolicy
from imgpack.scan import Sample
from imgpack.stored import measure
from imgpack.system import TaskDied, usable_cpus

log = logging.getLogger(__name__)

#: Chunks in flight per worker: enough to keep every worker busy, few enough to bound memory.
WINDOW_PER_WORKER = 4
MAX_CHUNK = 32


@dataclass(frozen=True)
class Failure:
    """A source file that could not be converted, and why."""

    path: str
    reason: str


Outcome = Encoded | Failure


@dataclass(frozen=True)
class Job:
    """How every sample of one conversion is processed (small: sent with every chunk)."""

    #: Reads one sample of the run's source (:class:`~imgpack.sources.base.Fetcher`): the
    #: source kind's own picklable object, carrying what identifies the source as planned.
    fetch: Callable[[Sample, ImagePolicy, Encoding], Encoded]
    policy: ImagePolicy
    encoding: Encoding
    #: Measure each sample's stored pixels for the dataset statistics (:mod:`imgpack.stats`).
    stats: bool = False
    #: The fields the output keeps (:mod:`imgpack.fields`): each sample's values, from the
    #: fetcher or else from the scan (:attr:`Sample.fields`), checked against them.
    fields: tuple[Field, ...] = ()

    def convert(self, sample: Sample) -> Encoded:
        """Read, validate and encode one sample, measured when the job says so; raises
        :class:`~imgpack.errors.ImageError` for a bad file or a bad field value."""
        encoded = self.fetch(sample, self.policy, self.encoding)
        if self.fields:
            values = encoded.fields if encoded.fields is not None else (sample.fields or {})
            try:
                encoded.fields = sample_values(self.fields, values, encoded.path)
            except DataError as exc:
                reason = first_line(exc).removeprefix(f"{encoded.path}: ")
                raise ImageError(encoded.path, reason) from None
        else:
            encoded.fields = None
        if self.stats:
            try:
                measure(encoded, self.policy.channels)
            except DataError as exc:  # what would be stored does not decode: a bad file
                raise ImageError(encoded.path, first_line(exc)) from None
        return encoded


class Executor(Protocol):
    def outcomes(self, job: Job, samples: Sequence[Sample]) -> Generator[Outcome, None, None]:
        """One outcome per sample of ``samples``, in that order."""
        ...


class TaskExecutor(Executor, Protocol):
    """An executor that also runs whole tasks (a shard written by a worker: :mod:`imgpack.direct`)
    and converts samples one per process to find the one that kills its worker."""

    def tasks(
        self, function: Callable[[Any], Any], items: Iterable[Any]
    ) -> Iterator[tuple[Any, Any]]:
        """``(item, function(item))`` for every item, in the items' order, a bounded window of
        them in flight; :class:`TaskDied` in place of the result when the task's worker died on
        every try. ``items`` is iterated as tasks are sent (a generator keeps memory bounded).
        A Python error in a task is raised (with its type and message)."""
        ...

    def alone(self, job: Job, samples: Sequence[Sample]) -> list[Outcome]:
        """The outcomes of ``samples``, each converted in a process of its own: a sample whose
        worker dies is a :class:`Failure` (:data:`WORKER_DIED`)."""
        ...


def process_chunk(job: Job, items: Sequence[Sample]) -> list[Outcome]:
    """Read, validate and encode ``items`` (in a worker); a bad file becomes a :class:`Failure`."""
    out: list[Outcome] = []
    prefetch = getattr(job.fetch, "prefetch", None)
    if prefetch is not None:
        prefetch(items)
    for sample in items:
        try:
            out.append(job.convert(sample))
        except ImageError as exc:
            out.append(Failure(exc.path, exc.reason))
    return out


def _worker_init(parent: int) -> None:
    """Set up a pool worker: it dies with its parent, and leaves signals to the parent.

    Ctrl-C and SIGTERM (which Slurm sends to every process of a job step) are ignored here: the
    parent handles them and shuts the pool down, so workers neither print tracebacks nor break
    the pool under the parent. A parent that is SIGKILLed cannot shut anything down, so the
    worker asks the kernel to kill it when its parent dies (Linux), and else watches for it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not die_with_parent():
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before we could ask
        os._exit(1)


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``); whether
    that could be arranged."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


_PR_SET_PDEATHSIG = 1


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it, else spawn.

    The workers run only imgpack's own read/decode/encode code (Pillow, numpy), never torch,
    OpenMP or logging, so forking a parent that holds other threads is safe here, as it is for
    torch's DataLoader workers. forkserver and spawn would re-run the caller's ``__main__``
    module in every worker (on Python 3.11 the forkserver does not preload it): for a training
    script that imports torch, seconds of start-up per worker.
    """
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def chunks(items: Sequence[Any], largest: int) -> Iterator[Sequence[Any]]:
    """Slices of ``items`` of 1, 2, 4, ... up to ``largest`` items: the first results arrive at
    once, later chunks amortise the per-task overhead."""
    start, size = 0, 1
    while start < len(items):
        yield items[start : start + size]
        start += size
        size = min(size * 2, largest)


#: Why a sample is skipped (or the run stops) when the worker converting it dies every time.
WORKER_DIED = (
    "the conversion worker reading it died (killed by a signal: a crash in a decoder, or out "
    "of memory)"
)


class LocalExecutor:
    """A process pool of ``workers`` processes (``1``: in this process, no pool).

    A worker that dies (a decoder that crashes on one file, the kernel's OOM killer) breaks the
    pool: the chunks that were in flight are converted again one file at a time, each in a
    process of its own, so the file that kills its worker is found and becomes a
    :class:`Failure` (named, or skipped with ``--on-error skip``); the rest of the run goes on
    in a new pool, and the outcomes stay in scan order.
    """

    #: Its workers run on this machine: they write the shards of a conversion to a local path
    #: themselves (:mod:`imgpack.direct`). An executor without it (Ray, whose tasks may run
    #: on other nodes) converts the samples and the driver writes such shards.
    local_machine = True

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be 1 or more, not {workers}")
        self.workers = workers

    def outcomes(self, job: Job, samples: Sequence[Sample]) -> Generator[Outcome, None, None]:
        workers = self.workers
        if workers == 1:
            for sample in samples:
                yield from process_chunk(job, [sample])
            return
        largest = max(1, min(MAX_CHUNK, len(samples) // (workers * 8)))
        window: deque[tuple[Sequence[Sample], Future[list[Outcome]]]] = deque()
        parts = chunks(samples, largest)
        pool = _new_pool(workers)
        try:
            pool.submit(process_chunk, job, []).result()  # starts the workers
            while True:
                while len(window) < workers * WINDOW_PER_WORKER:
                    part = next(parts, None)
                    if part is None:
                        break
                    window.append((part, _submit(pool, job, part)))
                if not window:
                    return
                part, future = window.popleft()
                try:
                    done = future.result()
                except BrokenProcessPool:  # every chunk in flight is lost with the pool
                    pool.shutdown(wait=True, cancel_futures=True)
                    lost = [part, *(p for p, _ in window)]
                    window.clear()
                    for part in lost:
                        yield from _one_by_one(job, part)
                    pool = _new_pool(workers)
                    continue
                yield from done
        except BrokenProcessPool:
            raise ImgpackError(
                "a conversion worker died unexpectedly (out of memory?); try fewer --workers"
            ) from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def tasks(
        self, function: Callable[[Any], Any], items: Iterable[Any]
    ) -> Iterator[tuple[Any, Any]]:
        """See :meth:`TaskExecutor.tasks`. A worker that dies breaks the pool: each task that was
        in flight is run again alone, in a process of its own, so only the one that kills its
        worker is :class:`TaskDied`; the rest go on in a new pool."""
        if self.workers == 1:
            for item in items:
                yield item, function(item)
            return
        window: deque[tuple[Any, Future[Any]]] = deque()
        pending = iter(items)
        pool = _new_pool(self.workers)
        try:
            while True:
                while len(window) < self.workers * TASKS_PER_WORKER:
                    item = next(pending, _END)
                    if item is _END:
                        break
                    window.append((item, _submit_task(pool, function, item)))
                if not window:
                    return
                item, future = window.popleft()
                try:
                    yield item, future.result()
                except BrokenProcessPool:
                    pool.shutdown(wait=True, cancel_futures=True)
                    lost = [item, *(i for i, _ in window)]
                    window.clear()
                    for again in lost:
                        yield again, _alone(function, again)
                    pool = _new_pool(self.workers)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def alone(self, job: Job, samples: Sequence[Sample]) -> list[Outcome]:
        return list(_one_by_one(job, samples))


#: Whole tasks (shards) in flight per worker: one running, one waiting.
TASKS_PER_WORKER = 2
_END = object()


def _submit_task(
    pool: ProcessPoolExecutor, function: Callable[[Any], Any], item: Any
) -> Future[Any]:
    try:
        return pool.submit(function, item)
    except BrokenProcessPool as exc:
        lost: Future[Any] = Future()
        lost.set_exception(exc)
        return lost


def _alone(function: Callable[[Any], Any], item: Any) -> Any:
    """``function(item)`` in a one-process pool of its own; :class:`TaskDied` when it dies."""
    pool = _new_pool(1)
    try:
        return pool.submit(function, item).result()
    except BrokenProcessPool:
        return TaskDied()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _submit(pool: ProcessPoolExecutor, job: Job, part: Sequence[Sample]) -> Future[list[Outcome]]:
    """``part`` sent to ``pool``; a pool broken already gives a future that says so."""
    try:
        return pool.submit(process_chunk, job, part)
    except BrokenProcessPool as exc:
        lost: Future[list[Outcome]] = Future()
        lost.set_exception(exc)
        return lost


def _new_pool(workers: int) -> ProcessPoolExecutor:
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in a multi-threaded process; see _pool_context.
        warnings.filterwarnings(
            "ignore",
            message=r".*use of fork\(\) may lead to deadlocks",
            category=DeprecationWarning,
        )
        return ProcessPoolExecutor(
            workers, mp_context=_pool_context(), initializer=_worker_init, initargs=(os.getpid(),)
        )


def _one_by_one(job: Job, part: Sequence[Sample]) -> Iterator[Outcome]:
    """The outcomes of ``part``, each sample converted alone in a one-process pool: a sample
    whose worker dies becomes a :class:`Failure` (a new process takes the next)."""
    pool: ProcessPoolExecutor | None = None
    try:
        for sample in part:
            if pool is None:
                pool = _new_pool(1)
            try:
                outcome = pool.submit(process_chunk, job, [sample]).result()
            except BrokenProcessPool:
                pool.shutdown(wait=True, cancel_futures=True)
                pool = None
                log.warning("%s: %s", sample.path, WORKER_DIED)
                outcome = [Failure(sample.path, WORKER_DIED)]
            yield from outcome
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


#: Where a Ray task is retried after its worker died (a lost node, an OOM kill).
RAY_TASK_RETRIES = 3


class RayExecutor:
    """Chunks of the scan as Ray tasks, results taken in scan order, at most
    ``WINDOW_PER_WORKER`` chunks per cluster CPU in flight.

    ``address``: a running cluster (``ray://...`` or ``host:port``); default ``RAY_ADDRESS``, else
    a local Ray started for the run and stopped after it (``workers`` CPUs, default all). When
    Ray is already initialised in this process, that cluster is used and left running. Every node
    must see SRC at the same path (shared storage), or read it from its bucket (an image folder
    at a URL is read in place), and have imgpack installed.
    """

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        self.address = address
        self.workers = workers

    @property
    def starts_ray(self) -> bool:
        """Whether each call would start a local Ray of its own and stop it after (no cluster
        address, none in ``RAY_ADDRESS``, Ray not initialised in this process): worth it for a
        conversion's work, not for a few seconds of listing."""
        if self._address() is not None:
            return False
        try:
            import ray
        except ImportError:
            return True
        return not ray.is_initialized()

    def _address(self) -> str | None:
        """The cluster to connect to: the one given, else ``RAY_ADDRESS``; ``None``: a local Ray."""
        return self.address or os.environ.get("RAY_ADDRESS") or None

    def outcomes(self, job: Job, samples: Sequence[Sample]) -> Generator[Outcome, None, None]:
        with self._session() as (ray, started):
            window: deque[tuple[list[Sample], Any]] = deque()
            try:
                cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
                task = ray.remote(num_cpus=1, max_retries=RAY_TASK_RETRIES)(process_chunk)
                job_ref = ray.put(job)
                largest = max(1, min(MAX_CHUNK, len(samples) // (cpus * 8)))
                for part in chunks(samples, largest):
                    window.append((list(part), task.remote(job_ref, list(part))))
                    if len(window) >= cpus * WINDOW_PER_WORKER:
                        yield from _ray_outcomes(ray, job_ref, *window.popleft())
                while window:
                    yield from _ray_outcomes(ray, job_ref, *window.popleft())
            finally:
                _end_in_flight(ray, [ref for _, ref in window], started)

    def tasks(
        self, function: Callable[[Any], Any], items: Iterable[Any]
    ) -> Iterator[tuple[Any, Any]]:
        """See :meth:`TaskExecutor.tasks`: each item a Ray task (retried when its worker dies),
        at most ``TASKS_PER_WORKER`` per cluster CPU in flight."""
        with self._session() as (ray, started):
            task = ray.remote(num_cpus=1, max_retries=RAY_TASK_RETRIES)(function)
            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            window: deque[tuple[Any, Any]] = deque()
            try:
                for item in items:
                    window.append((item, task.remote(item)))
                    if len(window) >= cpus * TASKS_PER_WORKER:
                        item, ref = window.popleft()
                        yield item, _ray_result(ray, ref)
                while window:
                    item, ref = window.popleft()
                    yield item, _ray_result(ray, ref)
            finally:
                _end_in_flight(ray, [ref for _, ref in window], started)

    def alone(self, job: Job, samples: Sequence[Sample]) -> list[Outcome]:
        with self._session() as (ray, _):
            return _ray_alone(ray, ray.put(job), samples)

    @contextmanager
    def _session(self) -> Iterator[tuple[Any, bool]]:
        """Ray, connected for as long as the block runs (a local Ray started for it, or the
        cluster already initialised in this process, left running), and whether it was started."""
        ray = import_ray()
        started = not ray.is_initialized()
        if started:
            connect_ray(ray, self._address(), self.workers)
        try:
            yield ray, started
        except ray.exceptions.RayError as exc:
            raise ImgpackError(
                f"the Ray cluster failed the conversion: {first_line(exc)}"
            ) from None
        finally:
            if started:
                ray.shutdown()


def _ray_result(ray: Any, ref: Any) -> Any:
    """``ray.get(ref)``: a Python error in the task raised as itself (an imgpack error) or with
    its type and message, not Ray's wrapper; :class:`TaskDied` when its worker died on every
    retry."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ImgpackError):
            raise cause from None
        what = f"{type(cause).__name__}: {first_line(cause)}" if cause else first_line(exc)
        raise ImgpackError(f"a conversion task failed on the Ray cluster: {what}") from None
    except _worker_lost(ray):
        return TaskDied()


def _end_in_flight(ray: Any, refs: list[Any], started: bool) -> None:
    """The tasks still in flight when a run stops early (a bad file, an error, Ctrl-C): a Ray
    started for the run is shut down with them; on a running cluster they are waited for, as
    the local pool waits for its running workers, so none writes after the run has cleaned up.
    Never ``ray.cancel``: Ray 2.60's driver aborts when a cancel races with the task's own
    completion (task_manager.cc, "Tried to complete task that was not pending")."""
    if refs and not started:
        ray.wait(refs, num_returns=len(refs), fetch_local=False)


def _ray_outcomes(ray: Any, job_ref: Any, part: list[Sample], ref: Any) -> list[Outcome]:
    """The outcomes of the Ray task ``ref`` (chunk ``part``). A Python error in the task is
    raised as itself (an imgpack error) or with its type and message, not Ray's wrapper; a chunk
    whose worker died on every retry is converted again one sample per task, to find the file
    that kills it (a :class:`Failure`)."""
    found = _ray_result(ray, ref)
    if not isinstance(found, TaskDied):
        return list(found)
    return _ray_alone(ray, job_ref, part)


def _ray_alone(ray: Any, job_ref: Any, part: Sequence[Sample]) -> list[Outcome]:
    """The outcomes of ``part``, one sample per Ray task: a sample whose worker dies on every
    try is a :class:`Failure` (:data:`WORKER_DIED`)."""
    single = ray.remote(num_cpus=1, max_retries=1)(process_chunk)
    refs = [single.remote(job_ref, [sample]) for sample in part]
    found: list[Outcome] = []
    for sample, one in zip(part, refs, strict=True):
        try:
            found.extend(ray.get(one))
        except _worker_lost(ray):
            log.warning("%s: %s", sample.path, WORKER_DIED)
            found.append(Failure(sample.path, WORKER_DIED))
    return found


def _worker_lost(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for a task whose worker process died (every retry)."""
    names = ("WorkerCrashedError", "OutOfMemoryError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


#: Seconds to wait for a Ray cluster's port to answer before saying it cannot be reached.
RAY_PROBE_TIMEOUT_S = 5.0

RAY_TOKEN_HINT = (
    "if the cluster uses token authentication, set RAY_AUTH_MODE=token here and give this "
    "machine the cluster's token (~/.ray/auth_token or RAY_AUTH_TOKEN): see docs/scale.md"
)


def connect_ray(ray: Any, address: str | None, workers: int | None) -> None:
    """``ray.init`` for a conversion: a local Ray when ``address`` is None, else the cluster at
    ``address``. What goes wrong becomes one line: no client extra for ``ray://``, a port that
    does not answer (said at once, not after Ray's retries), a token missing or refused."""
    if address is not None and address != "auto":
        # Ray's client runs on gRPC, which only ray[client] installs.
        if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
            raise OptionError(
                f"the Ray address {address} needs Ray's client, which is not installed: "
                "pip install 'imgpack[ray]' (it includes ray[client])"
            )
        _probe_ray(address)
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            **({"num_cpus": workers} if address is None else {}),
        )
    except getattr(ray.exceptions, "AuthenticationError", ()):  # Ray 2.5x and later
        raise ImgpackError(
            f"the Ray cluster at {address} uses token authentication and this machine has no "
            "token: copy the cluster's ~/.ray/auth_token here (or set RAY_AUTH_TOKEN): see "
            "docs/scale.md"
        ) from None
    except (ConnectionError, RuntimeError) as exc:
        if address is None:
            raise ImgpackError(f"could not start a local Ray: {first_line(exc)}") from None
        hint = (
            "" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else f"; {RAY_TOKEN_HINT}"
        )
        raise ImgpackError(
            f"could not connect to the Ray cluster at {address}: {first_line(exc)}{hint}"
        ) from None


def _probe_ray(address: str) -> None:
    """Raise at once, with the reason, when nothing answers at ``address``'s host and port."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise OptionError(
            f"Ray address {address!r} is not host:port or ray://host:port (e.g. head:6379)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        reason = (
            f"no answer in {RAY_PROBE_TIMEOUT_S:g} s"
            if isinstance(exc, TimeoutError)
            else exc.strerror or type(exc).__name__
        )
        raise ImgpackError(
            f"cannot reach the Ray cluster at {address}: {reason}; is `ray start --head` "
            "running there, and is the port open from this machine?"
        ) from None


def import_ray() -> Any:
    """The ``ray`` module, or an :class:`OptionError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise OptionError(
            "--executor ray needs Ray, which is not installed: pip install 'imgpack[ray]'"
        ) from None
    return ray


EXECUTORS = ("local", "ray")


def create(spec: Executor | str | None, workers: int | None = None) -> Executor:
    """The executor ``spec`` names: ``None`` or ``"local"`` a process pool of ``workers``
    (default: the usable CPUs); ``"ray"`` Ray at ``RAY_ADDRESS``, else a local Ray started for
    the run; ``"ray://HOST:PORT"`` (Ray client) or ``"ray:ADDRESS"`` (``ray:auto``,
    ``ray:10.0.0.1:6379``) the cluster at that address; an :class:`Executor` as it is."""
    if spec is None or spec == "local":
        return LocalExecutor(workers or usable_cpus())
    if not isinstance(spec, str):
        return spec
    if spec == "ray" or spec.startswith("ray:"):
        import_ray()
        address = spec if spec.startswith("ray://") else spec[len("ray:") :] or None
        return RayExecutor(address, workers)
    raise OptionError(f"executor {spec!r} is not one of local, ray, ray://HOST:PORT, ray:ADDRESS")
