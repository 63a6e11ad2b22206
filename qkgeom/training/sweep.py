"""Sweeps: a grid over config keys, expanded into deterministic runs, run by a local worker pool.

A sweep file is TOML with three tables::

    [sweep]   name = "study-smoke"; base = "smoke"   (a run preset or TOML file)
              order = "cost" (default: longest runs first) | "seed" (whole seeds first, longest first
              within a seed, so that a study run in several sittings completes whole seeds)
    [set]     fixed overrides, e.g. "train.steps" = 100
    [grid]    "model.n_layers" = [4, 6, 8]; "train.seed,train.data_seed" = [[0, 0], [1, 1]]  (zipped keys)
    [analysis] (optional, a pre-registration's machine-readable part) primary = [{id = "P1", claim = "PR_K
              shrinks", group = "all", window = "post-transient"}, ...]: the primary family, Holm-adjusted
              together (analysis.primary.adjust_primary); margin = 0.1: the equivalence margin of TOST;
              records = "docs/results/<study>": a study that accumulates across sessions (its committed
              per-run records are skipped, each finished run's record written at once; analysis.records)

``sweep.json`` (the expanded grid) is written before anything runs. Finished runs (done.json)
are skipped; a partial run resumes from its checkpoint; a failing run writes error.json and the
others go on.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.errors import QKGeomError, read_text
from qkgeom.executor import Job, JobLost, run_jobs
from qkgeom.results import SWEEP_MANIFEST, RunDir, folder_lock, write_json


class SweepError(QKGeomError, ValueError):
    """A sweep file or grid that cannot be expanded."""


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: str
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    order: str = "cost"
    analysis: dict[str, Any] = field(default_factory=dict)


SWEEP_ORDERS = ("cost", "seed")


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    overrides: dict[str, Any]
    config: C.RunConfig


def _is_primary(s: object) -> bool:
    keys = {"id", "claim_id", "group", "window"}
    return isinstance(s, dict) and {"id", "claim_id"} <= set(s) <= keys and all(isinstance(v, str) for v in s.values())


# what a study file's [analysis] may hold: its primary family, TOST margin, records folder and the
# robustness variants its primaries are re-judged under (analysis.robustness); each value's type is
# checked when the file is read, not by the analysis after the sweep has run
ANALYSIS_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "primary": (
        "a list of tables {id, claim_id, group, window} of strings (group and window optional), ids unique",
        lambda v: isinstance(v, list) and all(map(_is_primary, v)) and len({x["id"] for x in v}) == len(v),
    ),
    "margin": ("a positive number", lambda v: type(v) in (int, float) and 0 < v < float("inf")),
    "records": ("a folder (a string)", lambda v: isinstance(v, str)),
    "robustness": ("a list of variant names", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
ANALYSIS_KEYS = tuple(ANALYSIS_TYPES)


def resolve_sweep(path: str | Path) -> Path:
    """A sweep TOML path, or a study preset name (`smoke` -> configs/study-smoke.toml)."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (C.CONFIG_DIR / f"study-{path}.toml", C.CONFIG_DIR / f"{path}.toml"):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem.removeprefix("study-") for x in C.CONFIG_DIR.glob("study-*.toml")))
    raise SweepError(f"sweep {str(path)!r} is neither a file nor a study preset (presets: {known})")


def _check_tables(data: dict, p: Path) -> None:
    """A sweep file's tables and the keys of [sweep] and [analysis] (with each [analysis] value's type)."""
    unknown = sorted(set(data) - {"sweep", "set", "grid", "analysis"})
    if unknown or "sweep" not in data:
        raise SweepError(
            f"sweep file {p} needs a [sweep] table and only [sweep], [set], [grid], [analysis] (found {unknown})"
        )
    bad_analysis = sorted(set(data.get("analysis", {})) - set(ANALYSIS_KEYS))
    if bad_analysis:
        known = ", ".join(ANALYSIS_KEYS)
        raise SweepError(f"unknown key {bad_analysis[0]!r} in [analysis] of {p} (known: {known})")
    for key, value in data.get("analysis", {}).items():
        if not ANALYSIS_TYPES[key][1](value):
            raise SweepError(f"[analysis] {key} in {p} must be {ANALYSIS_TYPES[key][0]}, got {value!r}")
    head = data["sweep"]
    if "kind" in head:  # earlier sweep files: the analysis now reads each run's own config instead
        raise SweepError(f"[sweep] kind in {p} is no longer used (analyze reads each run's config); delete the line")
    bad = sorted(set(head) - {"name", "base", "order"})
    if bad:
        raise SweepError(f"unknown key {bad[0]!r} in [sweep] of {p}")
    if head.get("order", "cost") not in SWEEP_ORDERS:
        raise SweepError(f"[sweep] order in {p} is {head['order']!r}; allowed: {', '.join(SWEEP_ORDERS)}")


def load_sweep(path: str | Path, extra: list[str] | None = None) -> SweepSpec:
    """Parse a sweep file; `extra` are ``key=value`` overrides added to its [set] table."""
    p = resolve_sweep(path)
    try:
        data = tomllib.loads(read_text(p, SweepError))
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"sweep file {p} is not valid TOML: {e}") from None
    _check_tables(data, p)
    head = data["sweep"]
    name = head.get("name", p.stem)
    if not isinstance(name, str) or C.safe_name(name) != name:  # its folder is runs/<name>: nothing outside
        raise SweepError(f"[sweep] name {name!r} in {p} must be a plain folder name (letters, digits, . _ = , + -)")
    fixed = dict(data.get("set", {}))
    grid_keys = {k.strip() for key in data.get("grid", {}) for k in key.split(",")}
    if both := sorted(grid_keys & set(fixed)):
        raise SweepError(f"{both[0]!r} is in both [set] and [grid] of {p}: the grid would override [set]")
    for item in extra or []:
        key, _, text = item.partition("=")
        if key.strip() in grid_keys:
            raise SweepError(
                f"--set {key.strip()} names a grid key of {p.name}, which the grid would override; "
                "edit the sweep's [grid] (or copy the file) instead"
            )
        fixed[key.strip()] = C.parse_scalar(text.strip())
    spec = SweepSpec(
        name=name,
        base=head.get("base", "tiny"),
        fixed=fixed,
        grid=dict(data.get("grid", {})),
        order=head.get("order", "cost"),
        analysis=dict(data.get("analysis", {})),
    )
    return spec


def _as_override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # JSON scalars and lists are valid TOML values


def expand(spec: SweepSpec) -> list[RunSpec]:
    """Every combination of the grid (zipped keys move together), validated, with run ids."""
    for key, values in spec.grid.items():
        if not isinstance(values, list):
            raise SweepError(f"grid key {key!r} of sweep {spec.name!r} must be a list of values, got {values!r}")
    if not spec.grid or any(len(v) == 0 for v in spec.grid.values()):
        raise SweepError(f"sweep {spec.name!r} has an empty grid")
    axes = []
    for key, values in spec.grid.items():
        keys = [k.strip() for k in key.split(",")]
        if len(keys) > 1 and not all(isinstance(v, list) and len(v) == len(keys) for v in values):
            raise SweepError(f"grid key {key!r} zips {len(keys)} keys: each value must be a list of {len(keys)}")
        axes.append([dict(zip(keys, v if len(keys) > 1 else [v], strict=True)) for v in values])
    runs = []
    for combo in itertools.product(*axes):
        overrides = {**spec.fixed, **{k: v for part in combo for k, v in part.items()}}
        # a list value is named by its length (its items are in config.json), so names stay short
        label = "_".join(
            f"{k.split('.')[-1]}={len(v) if isinstance(v, list) else v}" for part in combo for k, v in part.items()
        )
        strings = [_as_override(k, v) for k, v in overrides.items()] + [_as_override("name", C.safe_name(label))]
        try:
            cfg = C.load(spec.base, strings)
        except C.ConfigError as e:
            raise SweepError(f"sweep {spec.name!r}: {e}") from None
        runs.append(RunSpec(C.run_id(cfg), overrides, cfg))
    if len({r.run_id for r in runs}) < len(runs):  # two runs would train into one folder
        twice = next(r for r in runs if sum(x.run_id == r.run_id for x in runs) > 1)
        raise SweepError(f"sweep {spec.name!r} holds run {twice.run_id} twice: its grid repeats a value")
    return [_with_baseline(spec, r, runs) for r in runs]


def _with_baseline(spec: SweepSpec, r: RunSpec, runs: list[RunSpec]) -> RunSpec:
    """A contract/expand run relative to its baseline gets intervention.baseline = the run id of the
    `none` run with the same overrides outside [intervention] (same seeds, same model)."""
    if not C.needs_baseline(r.config.intervention) or r.config.intervention.baseline:
        return r

    def outside(x: RunSpec) -> dict:
        return {k: v for k, v in x.overrides.items() if not k.startswith("intervention.")}

    match = [b for b in runs if b.config.intervention.kind == "none" and outside(b) == outside(r)]
    if not match:
        raise SweepError(
            f"sweep {spec.name!r}: run {r.run_id} is relative to its baseline, but the grid has no "
            "intervention.kind = 'none' run with the same other settings"
        )
    overrides = {**r.overrides, "intervention.baseline": match[0].run_id}
    cfg = C.from_dict(C.apply_overrides(C.to_dict(r.config), [_as_override("intervention.baseline", match[0].run_id)]))
    return RunSpec(C.run_id(cfg), overrides, cfg)


def write_manifest(spec: SweepSpec, runs: list[RunSpec], out: Path) -> None:
    """sweep.json: the expanded grid (and the study's [analysis]), written before any run."""
    write_json(
        out / SWEEP_MANIFEST,
        {
            "name": spec.name,
            "base": spec.base,
            "set": spec.fixed,
            "grid": spec.grid,
            "analysis": spec.analysis,
            "runs": [{"run_id": r.run_id, "overrides": r.overrides, "config": C.to_dict(r.config)} for r in runs],
        },
    )


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
    for chunk in _chunks(spec.order, todo, workers):
        # baselines first: a run relative to its `none` run reads that run's finished probes
        first = [r for r in chunk if not r.config.intervention.baseline]
        then = [r for r in chunk if r.config.intervention.baseline]
        statuses += execute(first, out, workers, threads, executor, address, bar, gpus_per_run, on_done)
        statuses += execute(then, out, workers, threads, executor, address, bar, gpus_per_run, on_done)
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
