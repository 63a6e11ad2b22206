"""From run folders to tables: load_runs, seed-averaged trajectories, and the claims table.

Every trajectory statistic is computed twice: over the whole run (`whole`) and over the
post-transient window (`post-transient`: steps >= warmup_steps + transient_fraction * steps).
The claims table reports what was measured on the user's runs, never the paper's numbers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom import stats
from qkgeom.results import RunDir, read_json

RUN_COLUMNS = ["run_id", "n_layers", "qk_init", "seed", "data_seed", "intervention", "steps", "warmup_steps"]
CLAIM_COLUMNS = ["study", "claim", "group", "window", "value", "ci_low", "ci_high", "n", "p_value", "detail"]
# Unchanged by W_Q -> W_Q M, W_K -> W_K M^{-T}: attention, scores, W_Q W_K^T and losses. PR_Q, PR_K are not.
GAUGE_INVARIANT_METRICS = ("attention_entropy", "logit_", "interaction_", "loss")
WINDOWS = ("whole", "post-transient")


class AnalysisError(ValueError):
    """Nothing (valid) to analyse."""


class RunWarning(UserWarning):
    """A run folder skipped by the loader (unfinished or corrupt); the message names it."""


def run_folders(path: str | Path) -> list[Path]:
    """The run folders under `path` (a sweep folder, a folder of runs, or one run)."""
    p = Path(path)
    if not p.is_dir():
        raise AnalysisError(f"{p} is not a folder")
    if (p / "config.json").is_file():
        return [p]
    return sorted(
        d for d in p.iterdir() if d.is_dir() and ((d / "config.json").exists() or (d / "error.json").exists())
    )


def _run_info(rd: RunDir) -> dict:
    cfg = read_json(rd.config)["config"]
    return {
        "run_id": rd.path.name,
        "n_layers": cfg["model"]["n_layers"],
        "qk_init": cfg["model"]["qk_init"],
        "seed": cfg["train"]["seed"],
        "data_seed": cfg["train"]["data_seed"],
        "intervention": cfg["intervention"]["kind"],
        "steps": cfg["train"]["steps"],
        "warmup_steps": cfg["train"]["warmup_steps"],
    }


def _load(path: str | Path, reader) -> pd.DataFrame:
    frames = []
    for d in run_folders(path):
        rd = RunDir(d)
        if not rd.is_done():
            why = "failed: " + read_json(d / "error.json")["error"] if (d / "error.json").exists() else "unfinished"
            warnings.warn(f"skipping run {d.name} ({why})", RunWarning, stacklevel=3)
            continue
        try:
            info = _run_info(rd)
            df = reader(rd)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping corrupt run {d.name} ({type(e).__name__}: {e})", RunWarning, stacklevel=3)
            continue
        for k, v in info.items():
            df[k] = v
        frames.append(df)
    if not frames:
        raise AnalysisError(f"no finished runs under {path}")
    return pd.concat(frames, ignore_index=True)


def load_runs(path: str | Path) -> pd.DataFrame:
    """Tidy geometry rows of every finished run under `path`, with run columns and `progress`.

    Columns: run_id, n_layers, qk_init, seed, data_seed, intervention, steps, warmup_steps,
    step, tokens_seen, progress (= step / steps), layer, head, site, metric, value.
    Unfinished or corrupt runs are skipped with a RunWarning naming them.
    """
    df = _load(path, lambda rd: rd.read_geometry())
    df["progress"] = df["step"] / df["steps"]
    return df


def load_metrics(path: str | Path) -> pd.DataFrame:
    """metrics.jsonl of every finished run (step, split, loss, ...) with the run columns."""
    return _load(path, lambda rd: pd.DataFrame(rd.read_metrics()))


def window(df: pd.DataFrame, name: str, transient_fraction: float = 0.1) -> pd.DataFrame:
    """Rows of the `whole` run or of its `post-transient` part (per run's own warm-up and length)."""
    if name == "whole":
        return df
    if name != "post-transient":
        raise ValueError(f"unknown window {name!r}")
    return df[df["step"] >= df["warmup_steps"] + transient_fraction * df["steps"]]


def layer_metric(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Whole-layer (head = -1) rows of one metric."""
    return df[(df["metric"] == metric) & (df["head"] == -1)]


def trajectories(df: pd.DataFrame) -> pd.DataFrame:
    """Seed-averaged layer trajectories: one row per (qk_init, n_layers, layer, step, metric, intervention),
    with mean, std and n over seeds."""
    layer_rows = df[df["head"] == -1]
    keys = ["intervention", "qk_init", "n_layers", "layer", "step", "progress", "metric"]
    return layer_rows.groupby(keys, as_index=False)["value"].agg(mean="mean", std="std", n="count")


def gauge_invariant(claim: str) -> bool:
    """True if a claim involves only gauge-invariant quantities (no PR_Q / PR_K)."""
    return "PR_Q" not in claim and "PR_K" not in claim


def _finish(rows: list[dict]) -> pd.DataFrame:
    out = pd.DataFrame(rows, columns=CLAIM_COLUMNS)
    out["gauge_invariant"] = out["claim"].map(gauge_invariant)
    return out


def _groups(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    out = [("all", df)]
    out += [(f"depth={d}", g) for d, g in df.groupby("n_layers")]
    out += [(f"init={i}", g) for i, g in df.groupby("qk_init")]
    return out


def _row(study, claim, group, win, value, lo=np.nan, hi=np.nan, n=0, p=np.nan, detail="") -> dict:
    return dict(zip(CLAIM_COLUMNS, [study, claim, group, win, value, lo, hi, n, p, detail], strict=True))


def claims_main(df: pd.DataFrame, transient_fraction: float = 0.1) -> pd.DataFrame:
    """The main study's claims, per group (all, each depth, each init) and window."""
    rows = []
    for win in WINDOWS:
        w = window(df, win, transient_fraction)
        traj = trajectories(w)
        for group, g in _groups(w):
            tg = traj[traj.set_index(["qk_init", "n_layers"]).index.isin(g.set_index(["qk_init", "n_layers"]).index)]
            contrast = tg[tg["metric"] == "participation_ratio_contrast"]
            per_traj = contrast.sort_values("step").groupby(["qk_init", "n_layers", "layer"])["mean"]
            if len(per_traj):
                throughout, at_end = (per_traj.min() > 0), (per_traj.last() > 0)
                n = len(throughout)
                rows.append(
                    _row(
                        "main",
                        "trajectories with PR_Q - PR_K > 0 at every probe",
                        group,
                        win,
                        throughout.mean(),
                        n=n,
                        detail=f"{int(throughout.sum())}/{n} seed-averaged layers",
                    )
                )
                rows.append(
                    _row(
                        "main",
                        "trajectories with PR_Q - PR_K > 0 at the end",
                        group,
                        win,
                        at_end.mean(),
                        n=n,
                        detail=f"{int(at_end.sum())}/{n} seed-averaged layers",
                    )
                )
            for metric, label in (
                ("query_participation_ratio", "slope of PR_Q vs training progress"),
                ("key_participation_ratio", "slope of PR_K vs training progress"),
                ("participation_ratio_contrast", "slope of PR_Q - PR_K vs training progress"),
            ):
                lm = layer_metric(g, metric)
                per_run_layer = lm.groupby(["run_id", "seed", "layer"]).apply(
                    lambda x: stats.slope(x["progress"], x["value"]), include_groups=False
                )
                per_seed = per_run_layer.groupby("seed").mean().dropna()
                if len(per_seed):
                    lo, hi = stats.bootstrap_mean_ci(per_seed.to_numpy())
                    rows.append(
                        _row(
                            "main",
                            label,
                            group,
                            win,
                            per_seed.mean(),
                            lo,
                            hi,
                            len(per_seed),
                            detail="mean over layers and runs; 95% bootstrap CI over seeds",
                        )
                    )
            layer_rows = g[g["head"] == -1].pivot_table(
                index=["run_id", "layer", "step"], columns="metric", values="value"
            )
            for x, y, label in (
                ("key_participation_ratio", "attention_entropy", "Spearman PR_K vs attention entropy"),
                ("interaction_rank", "attention_entropy", "Spearman interaction rank vs attention entropy"),
                ("key_participation_ratio", "interaction_rank", "Spearman PR_K vs interaction rank"),
                ("key_participation_ratio", "logit_participation_ratio", "Spearman PR_K vs logit-spectrum PR"),
            ):
                if x in layer_rows and y in layer_rows:
                    rho, p, n = stats.spearman(layer_rows[x].to_numpy(), layer_rows[y].to_numpy())
                    rows.append(
                        _row(
                            "main", label, group, win, rho, n=n, p=p, detail="pooled over runs, layers and probe steps"
                        )
                    )
    return _finish(rows)


PREDICTED_ENTROPY_SIGN = {"shrink": -1, "hold": +1}  # MISSION.md: shrink sharpens, hold softens


def _paired(values: pd.Series, kind: str) -> pd.Series:
    """Per-seed difference kind - none of a Series indexed by (intervention, seed)."""
    wide = values.unstack("intervention")
    if kind not in wide or "none" not in wide:
        return pd.Series(dtype=float)
    return (wide[kind] - wide["none"]).dropna()


def _direction_rows(diffs: pd.Series, claim: str, group: str, win: str, sign: int | None) -> list[dict]:
    """One claims row for paired differences; with a predicted sign, also the sign test and PD."""
    if diffs.empty:
        return []
    v = diffs.to_numpy()
    lo, hi = stats.bootstrap_mean_ci(v)
    detail, p = f"per-seed diffs {np.round(v, 4).tolist()}", np.nan
    if sign is not None:
        k, n, p = stats.sign_test(v, sign)
        direction = stats.probability_of_direction(v, sign)
        detail = (
            f"{k}/{n} seeds with predicted sign ({'+' if sign > 0 else '-'}); "
            f"probability of direction {direction:.3f}; {detail}"
        )
    return [_row("intervention", claim, group, win, diffs.mean(), lo, hi, len(diffs), p, detail=detail)]


def claims_intervention(df: pd.DataFrame, metrics: pd.DataFrame, transient_fraction: float = 0.1) -> pd.DataFrame:
    """Paired-by-seed effects of hold/shrink against none on attention entropy and validation loss.

    Outcomes: attention entropy (nats) at the final probe and averaged over the post-transient
    window, as the mean over layers and per layer; final validation loss. The sign test is
    two-sided at 1/2; CIs are 95% bootstrap CIs of the mean paired difference.
    """
    rows: list[dict] = []
    ent = layer_metric(df, "attention_entropy")
    final = ent[ent["step"] == ent["steps"]]
    late = window(ent, "post-transient", transient_fraction)
    for kind, sign in PREDICTED_ENTROPY_SIGN.items():
        for win, src in (("final", final), ("post-transient mean", late)):
            mean_over_layers = src.groupby(["intervention", "seed"])["value"].mean()
            rows += _direction_rows(
                _paired(mean_over_layers, kind),
                f"{kind} - none: attention entropy (nats)",
                "mean over layers",
                win,
                sign,
            )
            per_layer = src.groupby(["intervention", "seed", "layer"])["value"].mean()
            for layer, s in per_layer.groupby("layer"):
                rows += _direction_rows(
                    _paired(s.droplevel("layer"), kind),
                    f"{kind} - none: attention entropy (nats)",
                    f"layer={layer}",
                    win,
                    sign,
                )
        val = metrics[metrics["split"] == "valid"]
        val = val[val["step"] == val["steps"]].groupby(["intervention", "seed"])["loss"].mean()
        rows += _direction_rows(
            _paired(val, kind), f"{kind} - none: validation loss (nats/char)", "final", "final", None
        )
    rows += control_rows(df)
    return _finish(rows)


def control_rows(df: pd.DataFrame) -> list[dict]:
    """How closely the achieved weight-PR_K tracked its target, per condition (max relative error)."""
    rows = []
    target = df[df["metric"] == "key_weight_participation_ratio_target"]
    if target.empty:
        return rows
    achieved = df[(df["metric"] == "key_weight_participation_ratio") & (df["head"] >= 0)]
    keys = ["run_id", "step", "layer", "head"]
    both = target.merge(achieved, on=keys, suffixes=("_target", ""))
    both["rel_err"] = (both["value"] - both["value_target"]).abs() / both["value_target"]
    for kind, g in both.groupby("intervention_target"):
        rows.append(
            _row(
                "intervention",
                f"{kind}: achieved weight-PR_K vs target",
                "all controlled heads",
                "whole",
                g["rel_err"].max(),
                n=len(g),
                detail=f"max relative error over {g['run_id'].nunique()} runs x probes x heads "
                f"(median {g['rel_err'].median():.2e})",
            )
        )
    return rows
