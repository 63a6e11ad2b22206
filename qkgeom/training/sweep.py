"""Sweeps run: the runs of an expanded grid (training.grid) trained by a local worker pool or Ray.

``sweep.json`` (the expanded grid) is written before anything runs. Finished runs (done.json)
are skipped; a partial run resumes from its checkpoint; a failing run writes error.json and the
others go on. The pool starts the longest runs first (or whole seeds first, order = "seed") and its
progress bar's ETA weighs finished runs by their cost.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.executor import Job, JobLost, run_jobs
from qkgeom.results import RunDir, folder_lock
from qkgeom.training.grid import RunSpec, SweepError, SweepSpec, expand, write_manifest


def _check_data(runs: list[RunSpec]) -> None:
    """Resolve and encode each distinct corpus once, up front: a missing corpus fails the sweep
    in one line instead of every run, and workers find the encoding cache warm."""
    from qkgeom.training.data import load_corpus

    for data_cfg in {r.config.data for r in runs}:
        load_corpus(data_cfg)


def run_cost(cfg: C.RunConfig) -> float:
    """Relative cost of a run (steps x layers x tokens per step): the pool starts the longest first
    and the progress bar's ETA weighs finished runs by it."""
    return float(cfg.train.steps * cfg.model.n_layers * cfg.train.batch_size * cfg.model.n_ctx)


def _run_order(order: str, r: RunSpec) -> tuple:
    """Sort key: longest first (a depth-8 run never starts last), after the seed if order = "seed"."""
    cost = -run_cost(r.config)
    return (r.config.train.seed, cost) if order == "seed" else (cost,)


def _chunks(order: str, todo: list[RunSpec], workers: int) -> list[list[RunSpec]]:
    """The sweep in one piece, or with order = "seed" in groups of `workers` seeds (in seed order): the
    baselines of a group, then its other runs, so that an interrupted study leaves whole seeds."""
    if order != "seed":
        return [todo]
    seeds = sorted({r.config.train.seed for r in todo})
    groups = [set(seeds[i : i + workers]) for i in range(0, len(seeds), workers)]
    return [[r for r in todo if r.config.train.seed in g] for g in groups]


def default_workers(todo: list[RunSpec]) -> int:
    """One worker per CPU core for runs on the CPU; one per visible GPU when a run trains on cuda (each
    worker a CUDA process of its own: one per core could fill a small GPU's memory; `--workers` packs
    more); never more than there are runs."""
    on_gpu = any(r.config.train.device.startswith("cuda") for r in todo)
    per = max(1, len(D.visible_gpus())) if on_gpu else os.cpu_count() or 1
    return max(1, min(len(todo), per))


def run_one(cfg_dict: dict[str, Any], run_dir: str, threads: int = 0) -> dict[str, Any]:
    """Train one run (resuming a partial one); never raises: failures come back as a status."""
    import torch

    from qkgeom.training.loop import train

    if threads:
        torch.set_num_threads(threads)
    rd = RunDir(run_dir)
    tic = time.perf_counter()
    try:
        rd.error.unlink(missing_ok=True)
        train(C.from_dict(cfg_dict), rd.path, resume=rd.config.exists(), progress=False)
        return {"run_id": rd.path.name, "status": "done", "seconds": time.perf_counter() - tic}
    except Exception as e:  # isolate the failure: record it, let the other runs go on
        msg = f"{type(e).__name__}: {e}"
        rd.write_error(msg, traceback.format_exc())
        return {"run_id": rd.path.name, "status": "failed", "error": msg, "seconds": time.perf_counter() - tic}


class CostBar:
    """A tqdm bar over a sweep's work (steps x layers x tokens per step, summed over runs) whose ETA
    comes from measured progress: finished runs count whole, and a background thread reads the last
    step of every running run's metrics.jsonl every few seconds, so the remaining time is estimated
    from the step times actually measured, and a grid of unequal runs (depth 4 to 8) is weighed
    honestly. ``update(1, run_id)`` marks a run finished. Without a terminal there is no bar: each
    finished run prints one line to stderr, with the time left from the same estimate."""

    def __init__(self, runs: list[RunSpec], skipped: list[str], name: str, progress: bool, out: Path) -> None:
        self.lines = progress and not sys.stderr.isatty()  # a log file gets lines, not carriage returns
        progress = progress and not self.lines  # --no-progress: neither
        self.name, self.started = name, time.monotonic()
        self.cost = {r.run_id: run_cost(r.config) for r in runs}
        self.steps = {r.run_id: r.config.train.steps for r in runs}
        self.total, self.n_runs, self.out = sum(self.cost.values()), len(runs), Path(out)
        self.finished = set(skipped)
        self.initial = sum(self.cost[r] for r in skipped)
        self.bar = tqdm(
            total=self.total / 1e6,
            initial=self.initial / 1e6,  # excluded from the rate
            disable=not progress,
            desc=name,
            unit="M tok-layers",
            bar_format="{desc}: {percentage:3.0f}%|{bar}|{postfix} [{elapsed}<{remaining}, from measured steps]",
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.refresh()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        if progress:
            self._thread.start()

    def _partial(self, run_id: str) -> float:
        """Fraction of a running run's steps done, from the tail of its metrics.jsonl (0 if none yet)."""
        path = RunDir(self.out / run_id).metrics
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 400))
                last = f.read().decode(errors="replace").strip().splitlines()[-1]
            return min(1.0, json.loads(last)["step"] / self.steps[run_id])
        except (OSError, ValueError, KeyError, IndexError):
            return 0.0

    def refresh(self) -> None:
        with self._lock:
            work = sum(self.cost[r] * (1.0 if r in self.finished else self._partial(r)) for r in self.cost)
            self.bar.n = work / 1e6
            self.bar.set_postfix_str(f"{len(self.finished)}/{self.n_runs} runs")  # also redraws

    def _poll(self) -> None:
        while not self._stop.wait(5.0):
            self.refresh()

    def update(self, _n: int = 1, run_id: str | None = None, failed: bool = False) -> None:
        self.finished.add(run_id)
        self.refresh()
        if self.lines:
            done, elapsed = self.bar.n * 1e6, time.monotonic() - self.started
            left = elapsed * (self.total - done) / (done - self.initial) if done > self.initial else float("nan")
            eta = f"~{left / 60:.1f} min left" if left == left else "time left unknown"
            what = f"{run_id}{' FAILED' if failed else ''}; {elapsed / 60:.1f} min so far, {eta}"
            print(
                f"{self.name}: {len(self.finished)}/{self.n_runs} runs finished ({what})", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        self._stop.set()
        self.refresh()
        self.bar.close()


@dataclass
class SweepResult:
    out: Path
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def check_pool(workers: int, gpus_per_run: float = 0.0) -> None:
    """A pool's size and GPU share as given on the command line, refused before anything is written."""
    if workers < 0:
        raise SweepError(f"--workers must be >= 0 (0: one per CPU core, or per visible GPU), got {workers}")
    if not 0 <= gpus_per_run < float("inf"):
        raise SweepError(f"--gpus-per-run must be a finite number >= 0, got {gpus_per_run}")


def run_sweep(
    spec: SweepSpec,
    out: str | Path,
    workers: int = 0,
    progress: bool = True,
    executor: str = "local",
    address: str | None = None,
    gpus_per_run: float = 0.0,
    skip: frozenset[str] | set[str] = frozenset(),
    on_done: Callable[[str], None] | None = None,
) -> SweepResult:
    """Expand, write the manifest, then train every unfinished run in a worker pool.

    skip: run ids to treat as done (e.g. a study's runs whose records are committed); on_done: called
    with each run id as soon as it finishes (e.g. to write its record). The sweep folder is locked
    while it runs: a second sweep on it is refused (FolderLockedError).
    """
    check_pool(workers, gpus_per_run)
    out = Path(out)
    runs = expand(spec)
    with folder_lock(out):
        return _run_sweep(spec, runs, out, workers, progress, executor, address, gpus_per_run, skip, on_done)


def _run_sweep(spec, runs, out, workers, progress, executor, address, gpus_per_run, skip, on_done) -> SweepResult:
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(spec, runs, out)
    result = SweepResult(out)
    _check_data(runs)
    todo = []
    for r in runs:
        (result.skipped if r.run_id in skip or RunDir(out / r.run_id).is_done() else todo).append(r)
    result.skipped = [r.run_id for r in result.skipped]
    todo.sort(key=lambda r: _run_order(spec.order, r))
    workers = workers or default_workers(todo)
    threads = max(1, (os.cpu_count() or 1) // workers)
    tic = time.perf_counter()
    bar = CostBar(runs, result.skipped, spec.name, progress, out)
    statuses = []
    try:  # closed on an interrupt or error too, so that the error's line starts a line of its own
        for chunk in _chunks(spec.order, todo, workers):
            # baselines first: a run relative to its `none` run reads that run's finished probes
            first = [r for r in chunk if not r.config.intervention.baseline]
            then = [r for r in chunk if r.config.intervention.baseline]
            statuses += execute(first, out, workers, threads, executor, address, bar, gpus_per_run, on_done)
            statuses += execute(then, out, workers, threads, executor, address, bar, gpus_per_run, on_done)
    finally:
        bar.close()
    for s in statuses:
        if s["status"] == "done":
            result.done.append(s["run_id"])
        else:
            result.failed[s["run_id"]] = s["error"]
    result.seconds = time.perf_counter() - tic
    return result


def gpu_slots(todo: list[RunSpec], executor: str, workers: int) -> list[str] | None:
    """The GPUs a local pool spreads its workers over: every visible one, when more than one worker
    trains runs that all ask for plain `cuda` (a run that names `cuda:N` is placed by its config, and
    the pool leaves every worker's view alone)."""
    if executor != "local" or workers < 2 or not todo or any(r.config.train.device != "cuda" for r in todo):
        return None
    return D.visible_gpus() or None


def execute(
    todo: list[RunSpec],
    out: Path,
    workers: int,
    threads: int,
    executor: str,
    address: str | None,
    bar: CostBar | None = None,
    gpus_per_run: float = 0.0,
    on_done: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Train `todo` through qkgeom.executor; statuses as runs finish (a run whose worker died twice
    gets an error.json)."""
    out = Path(out).resolve()  # Ray tasks may run elsewhere on the shared storage
    jobs = [Job(r.run_id, (C.to_dict(r.config), str(out / r.run_id), threads)) for r in todo]
    statuses = []
    devices = gpu_slots(todo, executor, workers)
    for run_id, status in run_jobs(run_one, jobs, executor, workers, threads, address, gpus_per_run, devices):
        if isinstance(status, JobLost):
            RunDir(out / run_id).write_error(str(status))
            status = {"run_id": run_id, "status": "failed", "error": str(status), "seconds": 0.0}
        statuses.append(status)
        if on_done is not None and status["status"] == "done":
            on_done(run_id)
        if bar is not None:
            bar.update(1, run_id, failed=status["status"] != "done")
    return statuses
