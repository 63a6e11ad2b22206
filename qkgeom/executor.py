"""Run jobs in parallel and yield results as they finish: in-process, a local spawn pool, or Ray.

One executor serves sweeps (a job trains one run) and checkpoint families (a job analyses one
revision). A job's function must be importable at module level, report expected failures as a
return value rather than raising, and be resumable: re-running a finished or half-finished job is
cheap and exact (done.json / checkpoints), which is what makes the retry below safe.

- `local`, workers = 1: in this process, one job after another.
- `local`, workers > 1: a spawn pool (a clean interpreter per worker: fork after torch has started
  threads can deadlock). Given `devices` (GPU ids), worker i sees only devices[i % len(devices)]
  (CUDA_VISIBLE_DEVICES, set before its torch starts CUDA): its `cuda` is that GPU, so 8 workers on
  an 8-GPU machine train one run per GPU, and 8 workers over one GPU share it. Workers ignore
  Ctrl-C (the parent handles it) and die with their parent (Linux PDEATHSIG), so a killed sweep
  leaves no orphans; Ctrl-C or SIGTERM stops them at once. A worker that dies (OOM killer, kill -9)
  breaks the pool: the jobs that had started are retried once in a fresh pool, queued ones are
  resubmitted without charge; a started job lost twice comes back as `JobLost`.
- `ray` (optional extra, pip install 'qkgeom[ray]'): each job a Ray task with `threads` CPUs and
  `gpus` GPUs, on a running cluster (`address`) or a local instance.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from qkgeom.device import PORTABLE_ENV

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Job:
    key: str
    args: tuple


class JobLost(RuntimeError):
    """A job whose worker process died twice (killed, or out of memory)."""


def run_jobs(
    fn: Callable[..., Any],
    jobs: list[Job],
    executor: str = "local",
    workers: int = 1,
    threads: int = 1,
    address: str | None = None,
    gpus: float = 0.0,
    devices: list[str] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yield (job key, fn(*job.args) or a JobLost) as jobs finish. `devices`: the GPU ids the local
    pool's workers are spread over (None: each worker sees what this process sees)."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r} ({', '.join(EXECUTORS)})")
    if not jobs:
        return
    if executor == "ray":
        yield from _run_ray(fn, jobs, threads, address, gpus)
    elif workers == 1:
        for job in jobs:
            yield job.key, fn(*job.args)
    else:
        yield from _run_pool(fn, jobs, workers, devices)


def _worker_init(slots: Any = None) -> None:
    if slots is not None:  # before anything in this worker starts CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = slots.get()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a worker interrupted in start-up would be poisoned
    # tqdm makes a multiprocessing lock (a named semaphore) on first use, even disabled; a worker
    # ended by terminate() cannot unlink it, and the resource tracker then warns of a leak at exit
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's SIGTERM handler still ends workers
        pass


def pool_internals(pool: ProcessPoolExecutor) -> tuple[list, threading.Thread | None]:
    """The pool's worker processes and its manager thread. PRIVATE CPython attributes (3.9-3.13):
    concurrent.futures has no public way to terminate running workers, and shutdown() forgets
    them. tests/ground/test_executor_private.py fails loudly if a Python release renames them."""
    return list((pool._processes or {}).values()), pool._executor_manager_thread


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel queued jobs and end running ones now (resumable jobs lose nothing finished)."""
    procs, manager = pool_internals(pool)  # shutdown() forgets them: take them first
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=10)
    if manager is not None:  # it sees the workers gone and closes the queues (and their semaphores)
        manager.join(timeout=10)


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # handled like Ctrl-C: workers stopped, one line, resumable


def _started(fn: Callable[..., Any], marker: str, *args: Any) -> Any:
    """Run a job in a worker, first leaving a marker that it started (see _run_pool)."""
    Path(marker).touch()
    return fn(*args)


def _new_pool(workers: int, devices: list[str] | None) -> ProcessPoolExecutor:
    """A spawn pool; with `devices`, one GPU id per worker, handed out as each worker starts."""
    ctx = get_context("spawn")
    slots = None
    if devices:
        slots = ctx.Queue()
        for i in range(workers):
            slots.put(devices[i % len(devices)])
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(slots,))


def _run_pool(
    fn: Callable[..., Any], jobs: list[Job], workers: int, devices: list[str] | None = None
) -> Iterator[tuple[str, Any]]:
    # When one worker dies the whole pool breaks and every pending job fails with it, most of them
    # still queued. Only a job that had started (its marker exists) is charged an attempt; a queued
    # one is resubmitted for free, so two unrelated deaths never fail jobs that never ran.
    attempts = {job.key: 0 for job in jobs}
    markers_dir = tempfile.mkdtemp(prefix="qkgeom-jobs-")
    marker = {job.key: os.path.join(markers_dir, str(i)) for i, job in enumerate(jobs)}
    order = {job.key: i for i, job in enumerate(jobs)}
    queue = list(jobs)
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers only there
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    # the CLI restores SIGPIPE's default (quiet `| head`); stopping workers writes to their closed
    # pipes, which must raise (and be handled by the pool) rather than kill this process
    previous_pipe = signal.signal(signal.SIGPIPE, signal.SIG_IGN) if main_thread else None
    try:
        while queue:
            lost: list[Job] = []
            pool = _new_pool(workers, devices)
            try:
                futures = {pool.submit(_started, fn, marker[job.key], *job.args): job for job in queue}
                for f in as_completed(futures):
                    try:
                        result = f.result()
                    except BrokenProcessPool:
                        lost.append(futures[f])
                        continue
                    yield futures[f].key, result
            except BaseException:  # Ctrl-C, SIGTERM, or the consumer stopped: no orphans
                _stop(pool)
                raise
            pool.shutdown(wait=True)
            queue = []
            # as_completed hands the broken futures back in no set order: resubmit in the order given (longest
            # first in a sweep), or a job may run beside the next killer again and be charged twice
            for job in sorted(lost, key=lambda job: order[job.key]):
                if os.path.exists(marker[job.key]):
                    attempts[job.key] += 1
                    os.remove(marker[job.key])
                if attempts[job.key] < 2:
                    queue.append(job)
                else:
                    yield job.key, JobLost("its worker process died twice (killed, or out of memory?)")
    finally:
        shutil.rmtree(markers_dir, ignore_errors=True)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGPIPE, previous_pipe)


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray executor needs Ray: pip install 'qkgeom[ray]'") from None
    return ray


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` ("auto" inside `ray start` / Slurm), or start a local instance."""
    ray = _ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def _run_ray(
    fn: Callable[..., Any], jobs: list[Job], threads: int, address: str | None, gpus: float
) -> Iterator[tuple[str, Any]]:
    ray = _ray()
    connect(address)
    # a worker's float kernels are fixed when its torch starts: train.portable's settings go with each
    # task (Ray starts its workers under them), not only to the workers this machine's process spawns
    env = {k: os.environ[k] for k in PORTABLE_ENV if k in os.environ}
    options = {"runtime_env": {"env_vars": env}} if env else {}
    task = ray.remote(num_cpus=threads, num_gpus=gpus, max_retries=0, **options)(fn)
    pending = {task.remote(*job.args): job.key for job in jobs}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        yield pending.pop(done[0]), ray.get(done[0])
