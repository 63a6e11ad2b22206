"""From run folders to tables: load_runs, seed-averaged trajectories, and the claims table.

Every trajectory statistic is computed over the whole run (`whole`) and over the post-transient
window (`post-transient`: steps >= each run's transient end, detected from its data by
stats.transient_end), and, in the sensitivity table, from fixed window starts. Statistics are
computed within each run and aggregated over seeds, with t-intervals (right coverage at 4-5
seeds). The claims table reports what was measured on the user's runs, never the paper's numbers.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.rows import (  # noqa: F401 (the row builders are part of analysis' API: A.seed_row, ...)
    CLAIM_COLUMNS,
    NUMERIC_COLUMNS,
    PARAMETRIC_ONLY,
    apply_margin,
    claim_row,
    gauge_invariant,
    n_aware,
    numeric_columns,
    per_seed_text,
    per_seed_values,
    reading,
    rows_table,
    seed_row,
)
from qkgeom.analysis.runs import (  # noqa: F401 (the loaders are part of analysis' API: A.load_runs, ...)
    RUN_COLUMNS,
    AnalysisError,
    RunWarning,
    arm_label,
    check_one_design,
    load_metrics,
    load_runs,
    run_folders,
)

# Unchanged by W_Q -> W_Q M, W_K -> W_K M^{-T}: attention, scores, W_Q W_K^T and losses. PR_Q, PR_K are not.
WINDOWS = ("whole", "post-transient")
TRANSIENT_TOLERANCE = 0.1  # stats.transient_end: the rebound has settled when a probe-to-probe change is <= 10%
SENSITIVITY_STARTS = (0.0, 0.1, 0.2, 1 / 3, 0.5)  # fixed window starts (fraction of training) for the sensitivity table


def transient_ends(df: pd.DataFrame, tolerance: float = TRANSIENT_TOLERANCE) -> pd.Series:
    """Per run, the step at which its early transient ends (stats.transient_end on the layer mean of
    (PR_Q + PR_K) / 2: symmetric in Q and K, so the rule favours neither side of the contrast)."""
    rows = df[(df["head"] == -1) & df["metric"].isin(["query_participation_ratio", "key_participation_ratio"])]
    level = rows.groupby(["run_id", "step"])["value"].mean()
    return level.groupby("run_id").apply(
        lambda x: stats.transient_end(x.index.get_level_values("step").to_numpy(), x.to_numpy(), tolerance)
    )


def run_values(df: pd.DataFrame, per_run: pd.Series) -> pd.Series:
    """`per_run` (indexed by run_id) at each row of df: df["run_id"].map(per_run), looked up once per run.
    (Series.map on pandas' arrow-backed strings converts row by row: 16 s of a causal study's 54 s analysis.)"""
    codes, runs = pd.factorize(df["run_id"])
    return pd.Series(per_run.reindex(runs).to_numpy()[codes], index=df.index)


def with_transient(df: pd.DataFrame, tolerance: float = TRANSIENT_TOLERANCE) -> pd.DataFrame:
    """df with a `transient_end` column (per run); a no-op if it is there already."""
    if "transient_end" in df:
        return df
    ends = transient_ends(df, tolerance)
    return df.assign(transient_end=run_values(df, ends).fillna(0).astype(int))


def window(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """Rows of a window: `whole`, `post-transient` (steps >= the run's detected transient end;
    needs with_transient), or `from F` (progress >= F, a fixed start for the sensitivity table)."""
    if name == "whole":
        return df
    if name == "post-transient":
        return df[df["step"] >= df["transient_end"]]
    if name.startswith("from "):
        return df[df["progress"] >= float(name.removeprefix("from ")) - 1e-9]
    raise ValueError(f"unknown window {name!r}")


def window_note(df: pd.DataFrame, name: str) -> str:
    """How a window was chosen, for the claims table."""
    if name == "whole":
        return "all probes"
    if name == "post-transient":
        ends = df.groupby("run_id")["transient_end"].first()
        frac = (ends / df.groupby("run_id")["steps"].first()).to_numpy()
        return (
            f"steps >= detected transient end per run (median step {ends.median():.0f}, range {ends.min()}-"
            f"{ends.max()}; {frac.max():.0%} of training at most)"
        )
    return f"progress >= {name.removeprefix('from ')}"


def layer_metric(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Whole-layer (head = -1) rows of one metric."""
    return df[(df["metric"] == metric) & (df["head"] == -1)]


def trajectories(df: pd.DataFrame) -> pd.DataFrame:
    """Seed-averaged layer trajectories: one row per (qk_init, n_layers, layer, step, metric, intervention),
    with mean, std and n over seeds."""
    layer_rows = df[df["head"] == -1]
    keys = ["intervention", "qk_init", "n_layers", "layer", "step", "progress", "metric"]
    return layer_rows.groupby(keys, as_index=False)["value"].agg(mean="mean", std="std", n="count")


# Layer-resolved claims by relative depth (MISSION.md, "Layer resolution"): at cpu scale first-layer
# keys shrink in every run and last-layer keys rarely, so a pooled slope averages opposite effects.
LAYER_BANDS = {
    "layers: first": lambda layer, n: layer == 0,
    "layers: lower half": lambda layer, n: layer < n / 2,
    "layers: upper half": lambda layer, n: layer >= n / 2,
    "layers: last": lambda layer, n: layer == n - 1,
    "layers: all but the first": lambda layer, n: layer > 0,
}


def layer_band(df: pd.DataFrame, band: str) -> pd.DataFrame:
    """Rows of df whose layer lies in a relative-depth band (LAYER_BANDS) of its own run's depth."""
    return df[LAYER_BANDS[band](df["layer"], df["n_layers"])]


def _groups(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    out = [("all", df)]
    out += [(band, layer_band(df, band)) for band in LAYER_BANDS]
    out += [(f"depth={d}", g) for d, g in df.groupby("n_layers")]
    out += [(f"init={i}", g) for i, g in df.groupby("qk_init")]
    return out


def slope_by_depth(per_run: pd.DataFrame) -> pd.DataFrame:
    """Post-transient PR_Q and PR_K slopes by relative depth (layer / (n_layers - 1)), per init and depth:
    mean over runs (seeds), 95% t-interval and n, from per_run_statistics rows (one per run and layer).
    Columns: qk_init, n_layers, rel, side (query / key), mean, low, high, n: what the figure draws."""
    df = per_run.assign(rel=per_run["layer"] / (per_run["n_layers"] - 1).clip(lower=1))
    rows = []
    for (init, depth, rel), g in df.groupby(["qk_init", "n_layers", "rel"]):
        for side in ("query", "key"):
            v = g[f"slope:{side}_participation_ratio"].dropna().to_numpy()
            lo, hi = stats.t_mean_ci(v)
            mean = float(np.mean(v)) if len(v) else np.nan
            rows.append({"qk_init": init, "n_layers": depth, "rel": rel, "side": side, "mean": mean, "low": lo,
                         "high": hi, "n": len(v)})  # fmt: skip
    return pd.DataFrame(rows, columns=["qk_init", "n_layers", "rel", "side", "mean", "low", "high", "n"])


# The paper's trajectory claims (MISSION.md): name, per-run statistic, predicted sign.
SLOPE_CLAIMS = (
    ("query_participation_ratio", "PR_Q grows: slope of PR_Q vs training progress", +1),
    ("key_participation_ratio", "PR_K shrinks: slope of PR_K vs training progress", -1),
    ("participation_ratio_contrast", "PR_Q - PR_K grows: slope of the contrast vs training progress", +1),
)
# "X tracks Y" is judged on co-movement beyond the shared clock: the first-difference Pearson r of a
# run's own X and Y minus a cross-seed surrogate null (comovement_per_seed). The Spearman of first
# differences (no null) and of the raw series (shared trends: any two monotone series correlate, and
# its sign flips with the window) are kept, unjudged, beside it.
CORRELATION_CLAIMS = (
    ("key_participation_ratio", "attention_entropy", "PR_K tracks attention entropy", +1),
    ("key_participation_ratio", "interaction_rank", "PR_K tracks interaction rank", +1),
    ("key_participation_ratio", "logit_participation_ratio", "PR_K tracks logit-spectrum PR", +1),
    ("interaction_rank", "attention_entropy", "interaction rank tracks attention entropy", +1),
)
CO_MOVEMENT = ": first-difference r minus its cross-seed surrogate null (co-movement beyond the shared schedule)"
SPEARMAN_DIFF = ": Spearman of first differences over probe steps (no null; for comparison, not judged)"
RAW_TREND = ": Spearman over probe steps (raw trend, for comparison; not judged)"
CONTRAST_CLAIM = "PR_Q - PR_K > 0 at every probe of the window (share of layer trajectories)"
CONTRAST_ID = "contrast_positive"
CONTRAST_HOLDS, CONTRAST_FAILS = 0.9, 0.5  # share of trajectories; see docs/GLOSSARY.md, "Verdicts"


def per_run_statistics(w: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, layer): slopes vs progress, within-run Spearman correlations over probe
    steps, and the window-mean contrast. Statistics never pool probe steps across runs."""
    layer_rows = w[w["head"] == -1].pivot_table(
        index=["run_id", "seed", "qk_init", "n_layers", "layer", "step", "progress"], columns="metric", values="value"
    )
    keys = ["run_id", "seed", "qk_init", "n_layers", "layer"]
    pairs = [(x, y) for x, y, _, _ in CORRELATION_CLAIMS]
    ranked = {m for pair in pairs for m in pair}  # the metrics whose first differences are ranked
    out = []
    for key, g in layer_rows.groupby(level=keys):
        prog = g.index.get_level_values("progress").to_numpy()
        # each group read once as an array: a Series per metric cost more than the statistics themselves
        series = dict(zip(layer_rows.columns, g.to_numpy().T, strict=True))
        row = dict(zip(keys, key, strict=True))
        sloped = [m for m, _, _ in SLOPE_CLAIMS if m in series]  # every statistic of a kind in one stacked call
        row.update({f"slope:{m}": np.nan for m, _, _ in SLOPE_CLAIMS})
        row.update(zip((f"slope:{m}" for m in sloped), stats.slopes(prog, [series[m] for m in sloped]), strict=True))
        diffs = stats.spearman_pairs({m: np.diff(v) for m, v in series.items() if m in ranked}, pairs)
        raw = stats.spearman_pairs(series, pairs)
        for x, y in pairs:
            row[f"rho:{x}:{y}"], row[f"raw:{x}:{y}"] = diffs[x, y], raw[x, y]
        c = g.get("participation_ratio_contrast")
        row["contrast_mean"] = float(c.mean()) if c is not None else np.nan
        out.append(row)
    return pd.DataFrame(out)


def _seed_rows(
    per_run: pd.DataFrame, column: str, claim: str, sign: int, group: str, win: str, note: str, judged: bool = True
) -> dict:  # claim_id: the per-run statistic's column (slope:<metric>, rho:<x>:<y>, raw:<x>:<y>)
    """Mean over layers and runs per seed, then seed_row (no verdict if not `judged`)."""
    v = per_run.groupby("seed")[column].mean().dropna().to_numpy()
    kw = {} if judged else {"verdict": ""}
    detail = f"per-seed values {np.round(v, 4).tolist()}"
    correlation = column.startswith(("rho:", "raw:"))
    return seed_row(
        v, study="main", claim=claim, claim_id=column, group=group, window=win, sign=sign, note=note,
        detail=detail, correlation=correlation, **kw,
    )  # fmt: skip


def comovement_table(w: pd.DataFrame) -> pd.DataFrame:
    """The layer-level series of the CORRELATION_CLAIMS metrics, (init, depth, layer, seed, step) x
    metric: what comovement_per_seed reads, pivoted once for all of them."""
    metrics = {m for x, y, _, _ in CORRELATION_CLAIMS for m in (x, y)}
    lm = w[(w["head"] == -1) & w["metric"].isin(metrics)]
    return lm.pivot_table(index=["qk_init", "n_layers", "layer", "seed", "step"], columns="metric", values="value")


def comovement_per_seed(table: pd.DataFrame, x: str, y: str) -> tuple[np.ndarray, float, float]:
    """Per seed, the co-movement of layer metrics x and y beyond their shared clock: in each
    (init, depth, layer) cell, at the probe steps every seed of the cell has, the first-difference
    Pearson r of a seed's own x and y minus the mean r of its x against the other seeds' y
    (stats.comovement_excess); then the mean over the seed's cells. Also the mean observed and null r.
    table: comovement_table of the window's rows."""
    if x not in table or y not in table or table.empty:
        return np.array([]), np.nan, np.nan
    per_seed: dict[int, list[float]] = {}
    observed, null = [], []
    wide = table[[x, y]].unstack("seed")  # (init, depth, layer, step) x (metric, seed), sorted; NaN: no probe
    seeds = wide[x].columns.to_numpy()
    xv, yv = wide[x].to_numpy(), wide[y].to_numpy()
    valid = ~(np.isnan(xv) | np.isnan(yv))  # a seed's probe with both metrics
    rows = pd.Series(np.arange(len(wide)), index=wide.index)  # each cell's rows, as positions into the arrays
    for _, at in rows.groupby(level=["qk_init", "n_layers", "layer"]):
        at = at.to_numpy()
        have = valid[at]
        present = have.any(axis=0)  # the cell's seeds
        common = have[:, present].all(axis=1)  # the probe steps every seed of the cell has
        if present.sum() < 2 or common.sum() < 5:
            continue
        xs = list(xv[at][common][:, present].T)
        ys = list(yv[at][common][:, present].T)
        seeds_here = seeds[present]
        res = stats.comovement_excess(xs, ys)
        observed.append(res["observed"])
        null.append(res["null"])
        for s, e in zip(seeds_here, res["per_unit"], strict=True):
            per_seed.setdefault(int(s), []).append(float(e))
    v = np.array([stats.finite_mean(e) for _, e in sorted(per_seed.items())])
    return v, stats.finite_mean(observed), stats.finite_mean(null)


def _contrast_row(w: pd.DataFrame, per_run: pd.DataFrame, group: str, win: str, note: str) -> dict:
    """The paper's "PR_Q - PR_K > 0 in all trajectories": per seed, the share of its layer
    trajectories positive at every probe of the window; mean and t-interval over seeds."""
    contrast = layer_metric(w, "participation_ratio_contrast")
    per_seed_layer = contrast.groupby(["seed", "qk_init", "n_layers", "layer"])["value"].min() > 0
    share = per_seed_layer.groupby("seed").mean()
    v = share.to_numpy(dtype=float)
    lo, hi = stats.t_mean_ci(v)
    lo, hi = (max(lo, 0.0), min(hi, 1.0)) if np.isfinite(lo) else (lo, hi)  # a share lies in [0, 1]
    # the paper's own form: seed-averaged trajectories positive at every probe
    seed_mean = contrast.groupby(["qk_init", "n_layers", "layer", "step"])["value"].mean()
    traj_min = seed_mean.groupby(["qk_init", "n_layers", "layer"]).min()
    agree = per_run.groupby(["qk_init", "n_layers", "layer"])["contrast_mean"].apply(lambda x: int((x > 0).sum()))
    n_seeds, mean = len(v), float(v.mean()) if len(v) else np.nan
    verdict = "holds" if mean >= CONTRAST_HOLDS else "fails" if mean < CONTRAST_FAILS else "inconclusive"
    return claim_row(
        study="main",
        claim=CONTRAST_CLAIM,
        claim_id=CONTRAST_ID,
        group=group,
        window=win,
        value=mean,
        lo=lo,
        hi=hi,
        n=n_seeds,
        detail=(
            f"per-seed shares {np.round(v, 3).tolist()}; seed-averaged trajectories positive at every probe: "
            f"{int((traj_min > 0).sum())}/{len(traj_min)}"
        ),
        predicted="all > 0",
        seeds_agreeing=f"{int((agree == n_seeds).sum())}/{len(agree)} trajectories with window-mean > 0 in every seed",
        interval="95% t over seeds (per-seed share)",
        window_start=note,
        verdict=verdict,
        per_seed=per_seed_text(v),
    )


def claims_main(df: pd.DataFrame, windows: tuple[str, ...] = WINDOWS, groups: bool = True) -> pd.DataFrame:
    """The main study's claims per group (all, each depth, each init) and window, each with n (seeds),
    a 95% t-interval over seeds, seeds agreeing, the window's rule and a verdict (docs/GLOSSARY.md)."""
    df = with_transient(df)
    rows = []
    for win in windows:
        w = window(df, win)
        if w.empty:  # e.g. a horizon that ends before some run's transient does
            continue
        note = window_note(w, win)
        for group, g in _groups(w) if groups else [("all", w)]:
            per_run = per_run_statistics(g)
            if per_run.empty:
                continue
            rows.append(_contrast_row(g, per_run, group, win, note))
            for metric, claim, sign in SLOPE_CLAIMS:
                rows.append(_seed_rows(per_run, f"slope:{metric}", claim, sign, group, win, note))
            table = comovement_table(g)
            for x, y, claim, sign in CORRELATION_CLAIMS:
                v, obs, null = comovement_per_seed(table, x, y)
                detail = f"per-seed excess {np.round(v, 4).tolist()}; mean r {obs:.3f}, surrogate null r {null:.3f}"
                rows.append(
                    seed_row(v, study="main", claim=claim + CO_MOVEMENT, claim_id=f"comove:{x}:{y}", group=group,
                             window=win, sign=sign, note=note, detail=detail)
                )  # fmt: skip
                rows.append(
                    _seed_rows(per_run, f"rho:{x}:{y}", claim + SPEARMAN_DIFF, sign, group, win, note, judged=False)
                )
                raw = _seed_rows(per_run, f"raw:{x}:{y}", claim + RAW_TREND, sign, group, win, note, judged=False)
                rows.append(raw)
    return rows_table(rows)


PAPER_CONTRAST_CLAIM = "PR_Q - PR_K > 0 at every probe of the seed-averaged trajectory (paper's form; share)"
PAPER_CONTRAST_ID = "contrast_positive:seed_mean"


def _paper_contrast_row(w: pd.DataFrame, win: str, note: str) -> dict:
    """The contrast claim in the paper's own form: average each layer trajectory over seeds first,
    then the share of those trajectories positive at every probe of the window. No seed interval:
    the seeds are averaged away, so the verdict is the share rule alone."""
    contrast = layer_metric(w, "participation_ratio_contrast")
    seed_mean = contrast.groupby(["qk_init", "n_layers", "layer", "step"])["value"].mean()
    positive = seed_mean.groupby(["qk_init", "n_layers", "layer"]).min() > 0
    share = float(positive.mean()) if len(positive) else np.nan
    verdict = "holds" if share >= CONTRAST_HOLDS else "fails" if share < CONTRAST_FAILS else "inconclusive"
    return claim_row(
        study="main", claim=PAPER_CONTRAST_CLAIM, claim_id=PAPER_CONTRAST_ID, group="all", window=win, value=share,
        n=len(positive), predicted="all > 0", verdict=verdict,
        seeds_agreeing=f"{int(positive.sum())}/{len(positive)} trajectories", interval="none (seed means)",
        window_start=note, detail=f"over {contrast['seed'].nunique()} seeds",
    )  # fmt: skip


def sensitivity(df: pd.DataFrame) -> pd.DataFrame:
    """Every main claim (group `all`) at the detected window and at fixed window starts, and the
    contrast claim in the paper's seed-averaged form at each of them."""
    wins = ("post-transient", *(f"from {f:.2g}" for f in SENSITIVITY_STARTS))
    out = claims_main(df, wins, groups=False)
    df = with_transient(df)
    extra = [_paper_contrast_row(window(df, w), w, window_note(window(df, w), w)) for w in wins if len(window(df, w))]
    return pd.concat([out, rows_table(extra)], ignore_index=True)


HORIZONS = (0.25, 0.5, 0.75, 1.0)  # fractions of the run: the claims judged on truncated runs


def horizon(df: pd.DataFrame) -> pd.DataFrame:
    """Every main claim (group `all`, post-transient) on the runs truncated at fractions of their
    length; `window` reads `to step N`. Progress is rescaled to the truncated length. A truncated run
    is not a shorter run (its learning-rate schedule was the full run's)."""
    df = with_transient(df)
    out = []
    for f in HORIZONS:
        end = (df["steps"] * f).round()
        cut = df[df["step"] <= end].assign(progress=lambda x: x["step"] / (x["steps"] * f))
        c = claims_main(cut, ("post-transient",), groups=False)
        c["window"] = f"to step {int(df['steps'].max() * f)}"
        out.append(c)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=CLAIM_COLUMNS)


def seed_agreement(df: pd.DataFrame) -> pd.DataFrame:
    """Per seed-averaged trajectory (init, depth, layer), post-transient: how many seeds show each
    predicted sign (PR_Q slope > 0, PR_K slope < 0, window-mean contrast > 0)."""
    per_run = per_run_statistics(window(with_transient(df), "post-transient"))
    keys = ["qk_init", "n_layers", "layer"]
    return (
        per_run.groupby(keys)
        .agg(
            n_seeds=("seed", "nunique"),
            pr_q_slope_positive=("slope:query_participation_ratio", lambda x: int((x > 0).sum())),
            pr_k_slope_negative=("slope:key_participation_ratio", lambda x: int((x < 0).sum())),
            contrast_positive=("contrast_mean", lambda x: int((x > 0).sum())),
        )
        .reset_index()
    )
