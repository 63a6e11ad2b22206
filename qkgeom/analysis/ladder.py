"""A token ladder (configs/study-ladder-cpu.toml): one design trained at several token budgets, each
run with its own full warm-up + cosine schedule, so that a trend across budgets is a trend in tokens
read at a matched point of the schedule, not the LR decaying inside one run.

Statistics (the pre-registration's, in its words):
- last-half slope: per run and layer, the OLS slope of a layer-level metric against log2(step) over
  the probes with step >= steps / 2 (PR per doubling of steps);
- budget trend: per seed and layer, the OLS slope of those last-half slopes against log2(budget
  tokens) (per doubling of the budget);
- decay (claim 4a, unbounded): per run, the layer-mean contrast's slope against log2(step) over
  steps 1..early_max minus its slope over steps > early_max;
- local slopes (the figure): the slope against log2(step) in the windows [s/8, s/4], [s/4, s/2] and
  [s/2, s] of each run, placed at the window's middle token count.
Across seeds every row goes through claims.seed_row (t-intervals, TOST at the pre-registered margin,
sign-flip p), and the primary rows L1-L4 through primary.adjust_primary (Holm).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.claims import LAYER_BANDS
from qkgeom.analysis.rows import rows_table, seed_row
from qkgeom.analysis.runs import BUDGET_KEYS, load_metrics, load_runs
from qkgeom.config import EARLY_MAX_STEP
from qkgeom.metrics import metric_label

# metric -> (short name, the paper's predicted sign of its slope)
METRICS = {m: (metric_label(m), sign) for m, sign in (
    ("key_participation_ratio", -1), ("query_participation_ratio", +1), ("participation_ratio_contrast", +1)
)}  # fmt: skip
LOCAL_WINDOWS = ((1 / 8, 1 / 4), (1 / 4, 1 / 2), (1 / 2, 1.0))


def load_ladder(path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Layer-level geometry rows (head = -1) and metrics of a ladder's finished runs, each run's budget
    in tokens (`budget`, the tokens seen at its last step) and in millions (`budget_m`)."""
    g = load_runs(path, BUDGET_KEYS)
    g = g[g["head"] == -1]
    budget = g.groupby("run_id")["tokens_seen"].max().rename("budget")
    g = g.join(budget, on="run_id")
    g["budget_m"] = (g["budget"] / 1e6).round(1)
    return g, load_metrics(path, BUDGET_KEYS, runs=g["run_id"].unique()).join(budget, on="run_id")


AXES = ("log2 step", "progress")  # the registered axis, and a linear one: the fraction of the run


def _slope_log_step(rows: pd.DataFrame, axis: str = "log2 step") -> float:
    """The OLS slope of `value` against log2(step) (per doubling), or with axis="progress" against
    step / steps (per whole run: linear, and in the same unit at every budget)."""
    rows = rows[rows["step"] > 0]
    step = rows["step"].to_numpy(float)
    x = np.log2(step) if axis == "log2 step" else step / rows["steps"].to_numpy(float)
    return stats.slope(x, rows["value"].to_numpy(float))


def last_half_slopes(g: pd.DataFrame, start: float = 0.5, axis: str = "log2 step") -> pd.DataFrame:
    """One row per (run, layer, metric): seed, budget, n_layers, slope per doubling of steps over the
    run's last half (or from `start` x steps on; `axis` as in _slope_log_step)."""
    last = g[(g["step"] >= g["steps"] * start) & g["metric"].isin(list(METRICS))]
    keys = ["run_id", "seed", "budget", "budget_m", "n_layers", "layer", "metric"]
    slope = last.groupby(keys).apply(lambda r: _slope_log_step(r, axis), include_groups=False)
    return slope.rename("slope").reset_index()


def budget_trends(slopes: pd.DataFrame) -> pd.DataFrame:
    """One row per (seed, layer, metric): the slope of the last-half slope against log2(budget)."""

    def trend(rows: pd.DataFrame) -> float:
        return stats.slope(np.log2(rows["budget"].to_numpy(float)), rows["slope"].to_numpy(float))

    keys = ["seed", "n_layers", "layer", "metric"]
    return slopes.groupby(keys).apply(trend, include_groups=False).rename("trend").reset_index()


def decay(
    g: pd.DataFrame, early_max: int = EARLY_MAX_STEP, early_min: int = 1, axis: str = "log2 step"
) -> pd.DataFrame:
    """Per run: early (steps early_min..early_max) and late (after early_max) slopes of the layer-mean
    contrast against log2(step) (or `axis`), and early - late."""
    c = g[g["metric"] == "participation_ratio_contrast"]
    mean = c.groupby(["run_id", "seed", "budget", "budget_m", "steps", "step"])["value"].mean().reset_index()
    out = []
    for (rid, seed, budget, budget_m), rows in mean.groupby(["run_id", "seed", "budget", "budget_m"]):
        early = _slope_log_step(rows[(rows["step"] >= early_min) & (rows["step"] <= early_max)], axis)
        late = _slope_log_step(rows[rows["step"] > early_max], axis)
        out.append(dict(run_id=rid, seed=seed, budget=budget, budget_m=budget_m, early=early, late=late))
    df = pd.DataFrame(out)
    if len(df):
        df["decay"] = df["early"] - df["late"]
    return df


def local_slopes(g: pd.DataFrame, metric: str = "key_participation_ratio") -> pd.DataFrame:
    """Per run and layer, the slope against log2(step) in each LOCAL_WINDOWS window of the run, at the
    window's middle token count (geometric mean of its ends): the figure's lines, one per budget."""
    rows = g[g["metric"] == metric]
    out = []
    for (_, seed, budget_m, steps, layer), r in rows.groupby(["run_id", "seed", "budget_m", "steps", "layer"]):
        tokens_per_step = r["tokens_seen"].max() / steps
        for lo, hi in LOCAL_WINDOWS:
            w = r[(r["step"] >= lo * steps) & (r["step"] <= hi * steps)]
            tokens = np.sqrt(lo * hi) * steps * tokens_per_step
            out.append(dict(seed=seed, budget_m=budget_m, layer=layer, tokens=tokens, slope=_slope_log_step(w)))
    return pd.DataFrame(out)


def _rows(v: pd.Series, **kw) -> dict:
    return seed_row(
        v.dropna().to_numpy(float), study="ladder", detail=f"per-seed {np.round(v.to_numpy(), 4).tolist()}", **kw
    )


def _secondary_rows(
    slopes: pd.DataFrame,
    trends: pd.DataFrame,
    metrics: pd.DataFrame,
    budgets: list,
    note: str,
    trend_win: str,
    margin: float,
) -> list:
    """The ladder's secondary rows: S1 claim 1 per depth band and budget, S2 the PR_Q and contrast
    trends across budgets per layer, S3 the final validation loss per budget (context)."""
    rows: list = []
    for budget in budgets:  # S1: claim 1 per band and budget
        at = slopes[slopes["budget_m"] == budget]
        for band, pick in LAYER_BANDS.items():
            sel = at[[pick(layer, n) for layer, n in zip(at["layer"], at["n_layers"], strict=True)]]
            for metric, (short, sign) in METRICS.items():
                v = sel[sel["metric"] == metric].groupby("seed")["slope"].mean()
                if len(v):
                    rows.append(
                        _rows(
                            v,
                            claim=f"S1 {short} last-half slope (per doubling)",
                            claim_id=f"last_half_slope:{metric}",
                            group=band,
                            window=f"last half, {budget:g} M",
                            sign=sign,
                            note=note,
                            margin=margin,
                        )
                    )
    for metric in ("query_participation_ratio", "participation_ratio_contrast"):  # S2
        for layer, t in trends[trends["metric"] == metric].groupby("layer"):
            rows.append(
                _rows(
                    t.set_index("seed")["trend"],
                    claim=f"S2 {METRICS[metric][0]} last-half slope: trend across budgets",
                    claim_id=f"budget_trend:{metric}",
                    group=f"layer {layer}",
                    window=trend_win,
                    sign=None,
                    note=note,
                    margin=margin,
                )
            )
    valid = metrics[metrics["split"] == "valid"]
    final = valid[valid["step"] == valid["steps"]]
    for budget, f in final.groupby("budget"):  # S3: context
        rows.append(
            _rows(
                f.set_index("seed")["loss"],
                claim="S3 final validation loss (nats per character)",
                claim_id="final_validation_loss",
                group="all",
                window=f"final, {budget / 1e6:.1f} M",
                sign=None,
                note=note,
            )
        )
    return rows


def claims_ladder(
    g: pd.DataFrame,
    metrics: pd.DataFrame,
    margin: float,
    planned: int | None = None,
    *,
    axis: str = "log2 step",
    start: float = 0.5,
    early_min: int = 1,
    secondary: bool = True,
) -> pd.DataFrame:
    """The ladder's claims table: primary L1-L4, secondary S1-S3 (the pre-registration's ids). The
    keywords are the registered choices (log2-step axis, last half, early window from step 1);
    robustness_variants varies them (without the secondary rows S1-S3: secondary=False)."""
    slopes, rows = last_half_slopes(g, start, axis), []
    trends = budget_trends(slopes)
    n_runs, n_layers = g["run_id"].nunique(), int(g["n_layers"].max())
    budgets = sorted(slopes["budget_m"].unique())
    top = budgets[-1]
    state = f"{n_runs} of {planned} planned runs" if planned else f"{n_runs} runs"
    interim = bool(planned and n_runs < planned)
    note = f"last half of each run; budgets {', '.join(f'{b:g}' for b in budgets)} M tokens; {state}"
    trend_win = "last half; trend over log2 budget"
    key = trends[trends["metric"] == "key_participation_ratio"]
    for cid, layer, sign, what in (("L1", 0, +1, "first"), ("L2", n_layers - 1, -1, "last")):
        v = key[key["layer"] == layer].set_index("seed")["trend"]
        rows.append(
            _rows(
                v,
                claim=f"{cid} {what}-layer PR_K last-half slope: trend across budgets (per doubling)",
                claim_id=CLAIM_IDS[cid],
                group=f"layer {layer}",
                window=trend_win,
                sign=sign,
                note=note,
                margin=margin,
            )
        )
    top_slopes = slopes[(slopes["budget_m"] == top) & (slopes["metric"] == "key_participation_ratio")]
    v = top_slopes.groupby("seed")["slope"].mean()
    rows.append(
        _rows(
            v,
            claim=f"L3 PR_K shrinks at {top:g} M tokens: layer-mean last-half slope (per doubling)",
            claim_id=CLAIM_IDS["L3"],
            group="mean over layers",
            window=f"last half, {top:g} M",
            sign=-1,
            note=note,
            margin=margin,
        )
    )
    d = decay(g, EARLY_MAX_STEP, early_min, axis)
    if len(d):
        v = d[d["budget_m"] == top].set_index("seed")["decay"]
        rows.append(
            _rows(
                v,
                claim=f"L4 early trend that decays at {top:g} M: contrast slope early - late (per doubling)",
                claim_id=CLAIM_IDS["L4"],
                group="mean over layers",
                window=f"steps <= {EARLY_MAX_STEP} vs later",
                sign=+1,
                note=note,
                margin=margin,
            )
        )
    if secondary:
        rows += _secondary_rows(slopes, trends, metrics, budgets, note, trend_win, margin)
    out = rows_table(rows)
    if interim:
        judged = out["verdict"].astype(str) != ""
        out.loc[judged, "reading"] = (f"interim ({state}): " + out.loc[judged, "reading"].astype(str)).str.rstrip(": ")
    return out


def local_slope_summary(local: pd.DataFrame) -> pd.DataFrame:
    """Mean and 95% t-interval over seeds of local_slopes, per (layer, budget, window): the figure's
    points and bands."""
    out = []
    for (layer, budget_m, tokens), g in local.groupby(["layer", "budget_m", "tokens"]):
        v = g["slope"].to_numpy(float)
        lo, hi = stats.t_mean_ci(v)
        out.append(dict(layer=layer, budget_m=budget_m, tokens=tokens, mean=stats.finite_mean(v), low=lo, high=hi,
                        n=int(np.isfinite(v).sum())))  # fmt: skip
    return pd.DataFrame(out)


# the claim_id of each primary row (what a pre-registration names; the prose may change)
CLAIM_IDS = {
    "L1": "budget_trend:key_participation_ratio:first_layer",
    "L2": "budget_trend:key_participation_ratio:last_layer",
    "L3": "last_half_slope:key_participation_ratio:top_budget",
    "L4": "early_decay:participation_ratio_contrast:top_budget",
}
PRIMARY_IDS = tuple(CLAIM_IDS)
ACROSS_BUDGETS = ("L1", "L2")  # the rows a trend over budgets gives: the only ones leaving a budget out moves
VARIANTS = ("axis: linear", "window: later start", "leave one budget out", "leave one seed out")


def primary_rows(claims: pd.DataFrame, ids: tuple[str, ...] = PRIMARY_IDS) -> dict[str, pd.Series]:
    """The ladder's primary rows by id (CLAIM_IDS), never by their wording."""
    return {cid: claims[claims["claim_id"] == CLAIM_IDS[cid]].iloc[0] for cid in ids}


def robustness_variants(
    g: pd.DataFrame, metrics: pd.DataFrame, margin: float, families: Iterable[str] = VARIANTS
) -> list[tuple[str, dict[str, pd.Series]]]:
    """The primary rows re-judged under each variant of the registered `families` (VARIANTS):
    the axis (linear: the fraction of the run, for log2 step); a later window (the last quarter for the
    last-half rows, L4's early window from step 256); leave one budget out (L1, L2: the trends over
    budgets); leave one seed out (all). Returns (variant, {id: row})."""
    families = set(families)
    out = []

    def judged(name, ids, rows, ms, **kw):
        out.append((name, primary_rows(claims_ladder(rows, ms, margin, secondary=False, **kw), ids)))

    if "axis: linear" in families:
        judged("axis: linear (fraction of the run)", PRIMARY_IDS, g, metrics, axis="progress")
    if "window: later start" in families:
        judged(
            "window: last quarter; L4 early window from step 256", PRIMARY_IDS, g, metrics, start=0.75, early_min=256
        )
    if "leave one budget out" in families:
        for b in sorted(g["budget_m"].unique()):
            keep = g["budget_m"] != b
            judged(
                f"leave out the {b:g} M budget",
                ACROSS_BUDGETS,
                g[keep],
                metrics,
            )
    if "leave one seed out" in families:
        for s in sorted(g["seed"].unique()):
            judged(f"leave out seed {s}", PRIMARY_IDS, g[g["seed"] != s], metrics)
    return out


def layer_rows_ladder(top: pd.DataFrame, margin: float) -> pd.DataFrame:
    """L3's and L4's per-layer rows (analysis.layers) at the top budget: the last-half PR_K slope, and the
    contrast's early - late slope, per layer."""
    from qkgeom.analysis.layers import layer_rows

    s = last_half_slopes(top)
    s = s[s["metric"] == "key_participation_ratio"]
    per_seed = {f"layer {layer}": g.set_index("seed")["slope"] for layer, g in s.groupby("layer")}
    budget = f"{top['budget_m'].max():g} M"
    claim = f"PR_K shrinks at {budget} tokens: last-half slope (per doubling)"
    l3 = layer_rows("L3", claim, CLAIM_IDS["L3"], per_seed, sign=-1, window=f"last half, {budget}", margin=margin)
    # L4 per layer: the layer's own contrast, early slope - late slope on log2(step), per seed
    per_seed = {f"layer {layer}": decay(g).set_index("seed")["decay"] for layer, g in top.groupby("layer")}
    claim = f"early trend that decays at {budget}: contrast slope early - late (per doubling)"
    l4 = layer_rows("L4", claim, CLAIM_IDS["L4"], per_seed, sign=+1, window=f"steps <= {EARLY_MAX_STEP} vs later",
                    margin=margin)  # fmt: skip
    return pd.concat([l3, l4], ignore_index=True)
