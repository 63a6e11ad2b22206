"""From run folders to tidy tables: finding finished runs, skipping damaged ones with a named
warning, refusing runs that are not seeds of one design, and load_runs / load_metrics."""

from __future__ import annotations

import json
import warnings
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from qkgeom.config import arm_label  # noqa: F401 - the table name of an arm, read here and by claims
from qkgeom.errors import QKGeomError
from qkgeom.probing.archs import one_site
from qkgeom.results import RECORDS_DIR, RunDir, is_pretrained_output, read_json

INSTANT_METRIC = "attention_entropy_instant_change"  # training.complement.INSTANT_METRIC: site = an arm

RUN_COLUMNS = ["run_id", "n_layers", "qk_init", "seed", "data_seed", "intervention", "steps", "warmup_steps"]


class AnalysisError(QKGeomError, ValueError):
    """Nothing (valid) to analyse."""


class RunWarning(UserWarning):
    """A run folder skipped by the loader (unfinished or corrupt); the message names it."""


def run_folders(path: str | Path) -> list[Path]:
    """The run folders under `path` (a sweep folder, a folder of runs, or one run)."""
    p = Path(path)
    if not p.is_dir():
        raise AnalysisError(f"{p} is not a folder")
    if RunDir(p).config.is_file():
        return [p]
    if (p / RECORDS_DIR).is_dir():  # a committed study: its runs' records (analysis.records), checked
        from qkgeom.analysis.prereg import check_records

        check_records(p)
        p = p / RECORDS_DIR
    # hidden folders are a killed write's temp folders, never runs
    return sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith(".") and RunDir(d).is_run())


def _run_info(rd: RunDir) -> dict:
    cfg = read_json(rd.config)["config"]
    return {
        "run_id": rd.path.name,
        "n_layers": cfg["model"]["n_layers"],
        "qk_init": cfg["model"]["qk_init"],
        "seed": cfg["train"]["seed"],
        "data_seed": cfg["train"]["data_seed"],
        "intervention": arm_label(cfg["intervention"]),
        "steps": cfg["train"]["steps"],
        "warmup_steps": cfg["train"]["warmup_steps"],
    }


# What may differ between the runs of one analysis: the seeds (the units), the study's conditions
# (depth, Q/K init, intervention arm) and bookkeeping. Anything else (width, tokenizer, steps, lr, ...)
# would be pooled as if it were seed noise.
CONDITION_KEYS = ("name", "train.seed", "train.data_seed", "train.threads", "model.n_layers", "model.qk_init")
BOOKKEEPING_KEYS = ("name", "train.data_seed", "train.threads")  # two runs alike but in these are one replicate


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": str(v)})
    return out


# A token ladder's condition: the budget, with the probe and eval intervals scaled to it (analysis.ladder).
BUDGET_KEYS = ("train.steps", "probe.every", "train.eval_every")


def differing_keys(configs: dict[str, dict], allowed: tuple[str, ...] = ()) -> list[str]:
    """The config keys whose values differ between runs, outside CONDITION_KEYS, intervention.* and `allowed`."""
    flat = {rid: _flat(cfg) for rid, cfg in configs.items()}
    keys = sorted({k for f in flat.values() for k in f})
    return [
        k for k in keys
        if k not in CONDITION_KEYS + allowed and not k.startswith("intervention.")
        and len({f.get(k) for f in flat.values()}) > 1
    ]  # fmt: skip


def is_ladder(path: str | Path) -> bool:
    """Whether the finished runs under `path` are a token ladder: one design at several budgets."""
    configs = {}
    for d in run_folders(path):
        if not RunDir(d).is_done():
            continue
        try:
            configs[d.name] = read_json(RunDir(d).config)["config"]
        except (OSError, ValueError, KeyError):  # a damaged run: the loaders name it and skip it
            continue
    return len(configs) > 1 and "train.steps" in differing_keys(configs) and not differing_keys(configs, BUDGET_KEYS)


def check_one_design(configs: dict[str, dict], path: str | Path, allowed: tuple[str, ...] = ()) -> None:
    """Refuse (one line) runs that differ in anything but seeds and study conditions (CONDITION_KEYS,
    intervention.*, `allowed`): they are not seeds of one design, and pooling them would hide it."""
    flat = {rid: _flat(cfg) for rid, cfg in configs.items()}
    differ = differing_keys(configs, allowed)
    if differ:
        shown = "; ".join(f"{k} = {sorted({f.get(k) or '-' for f in flat.values()})}" for k in differ[:3])
        raise AnalysisError(
            f"the runs under {path} are not one design: they differ in {shown}"
            f"{' ...' if len(differ) > 3 else ''}; analyse each design in its own folder"
        )
    units: dict[tuple, str] = {}  # (condition, train.seed) -> the run that has it
    for rid, f in sorted(flat.items()):
        unit = tuple(sorted((k, v) for k, v in f.items() if k not in BOOKKEEPING_KEYS))
        if unit in units:  # the statistics group by seed: the two would count as one replicate, unsaid
            raise AnalysisError(
                f"runs {units[unit]} and {rid} under {path} share their condition and train.seed "
                f"({f.get('train.seed')}): a seed is the unit of replication, so they would count once; give "
                "each run its own seed (qkgeom.Probe and the callbacks take seed=)"
            )
        units[unit] = rid


def _load(path: str | Path, reader, allowed: tuple[str, ...] = (), runs: set[str] | None = None) -> pd.DataFrame:
    """`reader`'s frame of every finished run under `path` (only those in `runs`, if given) with the run
    columns; damaged runs skipped with a RunWarning; the rest checked to be seeds of one design."""
    frames, configs = [], {}
    for d in run_folders(path):
        if runs is not None and d.name not in runs:  # left out before it is read, or checked
            continue
        rd = RunDir(d)
        if not rd.is_done():
            why = "failed: " + rd.read_error() if rd.error.exists() else "unfinished"
            warnings.warn(f"skipping run {d.name} ({why})", RunWarning, stacklevel=3)
            continue
        try:
            info = _run_info(rd)
            df = reader(rd)
        except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError, zipfile.BadZipFile) as e:
            warnings.warn(f"skipping corrupt run {d.name} ({type(e).__name__}: {e})", RunWarning, stacklevel=3)
            continue
        for k, v in info.items():
            df[k] = v
        frames.append(df)
        configs[d.name] = read_json(rd.config)["config"]
    if not frames:
        if is_pretrained_output(path):
            raise AnalysisError(
                f"{path} holds `qkgeom pretrained` results, not training runs: render them with "
                f"`qkgeom report {path}`, or read them with qkgeom.analysis.families.load_family"
            )
        raise AnalysisError(f"no finished runs under {path}")
    check_one_design(configs, path, allowed)
    return pd.concat(frames, ignore_index=True)


def _checked_geometry(rd: RunDir) -> pd.DataFrame:
    """A finished run's geometry, after checking the files the report reads are whole."""
    if not rd.geometry.is_file():
        raise ValueError("geometry.parquet is missing")
    read_json(rd.done)  # the report reads it
    if rd.spectra.is_file():
        rd.read_spectra()  # a truncated npz raises here, not later in the report
    geometry = rd.read_geometry()
    if geometry.empty:
        raise ValueError("geometry.parquet holds no rows")
    if geometry["site"].nunique() > 1:  # a qkgeom.Probe run of a rotary / q/k-norm model: one site per metric
        # (the zero-training complement's rows name an arm in `site`, not a place in the model: all kept)
        geometry = pd.concat(
            [g if name == INSTANT_METRIC else one_site(g) for name, g in geometry.groupby("metric", sort=False)],
            ignore_index=True,
        )
    return geometry


LABEL_COLUMNS = ("site", "metric", "run_id", "qk_init", "intervention")  # load_runs: categorical


def load_runs(path: str | Path, allowed: tuple[str, ...] = ()) -> pd.DataFrame:
    """Tidy geometry rows of every finished run under `path`, with run columns and `progress`.

    Columns: run_id, n_layers, qk_init, seed, data_seed, intervention, steps, warmup_steps,
    step, tokens_seen, progress (= step / steps), layer, head, site, metric, value.
    Unfinished or corrupt runs are skipped with a RunWarning naming them. The label columns are
    categorical: each boolean filter of pandas' arrow-backed strings takes every string again, and the
    analysis filters the frame (over a million rows for a causal study) thousands of times.
    """
    df = _load(path, _checked_geometry, allowed)
    df["progress"] = df["step"] / df["steps"]
    for col in LABEL_COLUMNS:
        df[col] = df[col].astype("category")
    return df


def load_metrics(path: str | Path, allowed: tuple[str, ...] = (), runs: Iterable[str] | None = None) -> pd.DataFrame:
    """metrics.jsonl of every finished run (step, split, loss, ...) with the run columns. runs: keep only
    these run ids, those load_runs read (a run whose geometry is damaged is skipped there, and its
    losses alone would leave, say, a seed's none run half present)."""
    return _load(path, lambda rd: pd.DataFrame(rd.read_metrics()), allowed, None if runs is None else set(runs))
