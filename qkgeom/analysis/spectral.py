"""Spectral rows set beside those of the 2025-26 literature: weight rank against realised rank, and
the per-matrix heavy-tail exponent and PR over training (the "spectral lifecycle").

- **Energy ranks.** Per head, the number of components carrying 90% of the energy of W_Q W_K^T
  (`interaction_energy_rank90`, weights) and of the probe batch's row-centred Q K^T logits
  (`logit_energy_rank90`, data), side by side with their ratio weights / data.
- **Lifecycle.** Per layer and step, alpha of each projection's whole matrix (head = -1 rows) and its
  mean per-head PR, for W_Q, W_K, W_V, W_O (W_O not for BERT, whose output projection sits outside
  its attention module).
- **Lifecycle by depth.** Whether Q/K carry depth-dependent dynamics while V/O change uniformly (the
  2026 lifecycle study's reading): per run, each layer's change of alpha and PR over the window, its
  spread across layers and its slope on relative depth, over seeds with t-intervals.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats

WEIGHT_RANK, DATA_RANK = "interaction_energy_rank90", "logit_energy_rank90"
MATRICES = {
    "W_Q": ("query_weight_alpha", "query_weight_participation_ratio"),
    "W_K": ("key_weight_alpha", "key_weight_participation_ratio"),
    "W_V": ("value_weight_alpha", "value_weight_participation_ratio"),
    "W_O": ("output_weight_alpha", "output_weight_participation_ratio"),
}
_NOT_A_SITE = ("norm_folded",)  # the q/k-norm-folded weights are a second reading, not the model


def _last(g: pd.DataFrame) -> pd.DataFrame:
    """Rows of the last probe (the largest step), where there is a step column."""
    if "step" in g and g["step"].notna().any():
        return g[g["step"] == g["step"].max()]
    return g


def energy_ranks(geometry: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, head) at the last probe: weight_rank90 (W_Q W_K^T), data_rank90 (row-centred logits,
    averaged over the logit sample's sequences) and ratio = weights / data. Empty if either is missing."""
    g = _last(geometry)
    g = g[(g["head"] >= 0) & ~g["site"].isin(_NOT_A_SITE)]
    out = {}
    for col, metric in (("weight_rank90", WEIGHT_RANK), ("data_rank90", DATA_RANK)):
        rows = g[g["metric"] == metric]
        if rows.empty:
            return pd.DataFrame(columns=["layer", "head", "weight_rank90", "data_rank90", "ratio"])
        out[col] = rows.groupby(["layer", "head"])["value"].mean()
    table = pd.DataFrame(out).reset_index()
    table["ratio"] = table["weight_rank90"] / table["data_rank90"]
    return table


def lifecycle(geometry: pd.DataFrame) -> pd.DataFrame:
    """Per (matrix, layer, step): alpha of the layer's whole matrix and the mean per-head PR (the
    convention the run used), for the projections the geometry has. Columns: matrix, layer, step,
    alpha, pr."""
    g = geometry[~geometry["site"].isin(_NOT_A_SITE) & (geometry["head"] == -1)]
    frames = []
    for matrix, (alpha, pr) in MATRICES.items():
        part = g[g["metric"].isin([alpha, pr])]
        if part.empty:
            continue
        wide = part.pivot_table(index=["layer", "step"], columns="metric", values="value", dropna=False)
        frames.append(
            pd.DataFrame(
                {
                    "matrix": matrix,
                    "alpha": wide[alpha] if alpha in wide else float("nan"),
                    "pr": wide[pr] if pr in wide else float("nan"),
                }
            ).reset_index()
        )
    if not frames:
        return pd.DataFrame(columns=["matrix", "layer", "step", "alpha", "pr"])
    return pd.concat(frames, ignore_index=True)[["matrix", "layer", "step", "alpha", "pr"]]


def _changes(life: pd.DataFrame, start: int) -> pd.DataFrame:
    """Per (matrix, layer), alpha and PR at the last probe minus at the first probe >= start."""
    win = life[life["step"] >= start]
    first, last = win["step"].min(), win["step"].max()
    at = {s: win[win["step"] == s].set_index(["matrix", "layer"])[["alpha", "pr"]] for s in (first, last)}
    return (at[last] - at[first]).reset_index()


def lifecycle_depth(geometry: pd.DataFrame, starts: dict[str, int] | None = None) -> pd.DataFrame:
    """Depth profile of each projection's spectral change over training, per run, then over runs.

    geometry: tidy rows of one or more runs (run_id, step, layer, head, site, metric, value);
    starts: the first step of each run's window (e.g. its transient end; default: its first probe).
    Per run, matrix (W_Q, W_K, W_V, W_O) and quantity (alpha of the whole matrix, mean per-head PR):
    the change d_l from the window's first to its last probe for every layer l, summarised as
    `mean change` (mean over layers), `depth spread` (sd over layers: 0 for a uniform change) and
    `depth slope` (OLS slope of d_l on relative depth l / (L - 1), per whole depth). Two contrasts per
    quantity are paired within a run: `Q/K - V/O depth spread` (mean of W_Q, W_K minus mean of W_V,
    W_O) and the same for |depth slope|. Columns: matrix, quantity, statistic, mean, ci_low, ci_high
    (95% t over runs), n, positive (runs with a value > 0). Empty without V/O rows or two layers.
    """
    per_run = []
    for run_id, g in geometry.groupby("run_id", sort=True):
        life = lifecycle(g)
        if not {"W_V", "W_O"} <= set(life["matrix"]) or life["layer"].nunique() < 2:
            continue
        d = _changes(life, (starts or {}).get(run_id, int(life["step"].min())))
        depth = d["layer"] / d["layer"].max()
        for q in ("alpha", "pr"):
            for matrix, part in d.assign(depth=depth).groupby("matrix"):
                v = part[q].to_numpy(float)
                per_run.append(
                    {"run_id": run_id, "matrix": matrix, "quantity": q, "mean change": float(np.mean(v)),
                     "depth spread": float(np.std(v, ddof=1)), "depth slope": stats.slope(part["depth"], v)}
                )  # fmt: skip
    if not per_run:
        return pd.DataFrame(columns=["matrix", "quantity", "statistic", "mean", "ci_low", "ci_high", "n", "positive"])
    runs = pd.DataFrame(per_run)
    long = runs.melt(["run_id", "matrix", "quantity"], var_name="statistic", value_name="value")
    for stat, fn in (("depth spread", lambda x: x), ("depth slope", np.abs)):
        wide = runs.pivot_table(index=["run_id", "quantity"], columns="matrix", values=stat).apply(fn)
        contrast = (wide[["W_Q", "W_K"]].mean(axis=1) - wide[["W_V", "W_O"]].mean(axis=1)).rename("value")
        label = f"Q/K - V/O {'|depth slope|' if stat == 'depth slope' else stat}"
        long = pd.concat([long, contrast.reset_index().assign(matrix="Q/K - V/O", statistic=label)], ignore_index=True)
    rows = []
    for (matrix, q, stat), g in long.groupby(["matrix", "quantity", "statistic"], sort=False):
        v = g["value"].to_numpy(float)
        lo, hi = stats.t_mean_ci(v)
        n, positive = int(np.isfinite(v).sum()), int((v > 0).sum())
        rows.append({"matrix": matrix, "quantity": q, "statistic": stat, "mean": float(np.nanmean(v)),
                     "ci_low": lo, "ci_high": hi, "n": n, "positive": positive})  # fmt: skip
    return pd.DataFrame(rows)
