"""One window per seed, the arms' means over it, and the causal estimate three ways.

- **One window per seed.** All arms of a seed are averaged over the same probes: from the transient
  end detected on that seed's `none` run (analysis.transient_ends) to the end of the run. An arm's
  own detected window could differ by a probe, worth about as much as the effects under test.
- **The causal estimate, three ways** (per target, W_K or W_Q W_K^T, over none + its contract/expand
  arms; the key activations' PR for the shape arms at matched scale; one value per seed, t-interval
  over seeds): dose-response (slope of entropy on the achieved log mediator, >= 3 arms); reduced form
  (slope of entropy on the *assigned* log ratio, 0 for none); first stage (slope of the log mediator
  on the assigned log ratio); IV = reduced form / first stage, with Fieller's interval (unbounded
  when the first stage is too weak to identify it).
causal.py reads the arms one by one against `none` on these windows and gathers every row.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.arms import (
    LABEL,
    TARGET,
    parse_arm,
)
from qkgeom.analysis.claims import layer_metric, run_values, transient_ends, window
from qkgeom.analysis.rows import claim_row, seed_row
from qkgeom.arms import CHECK_MEDIATOR

SHAPE_DOSE_CLAIM = "dose-response at matched logit scale: slope of attention entropy on log activation PR_K"

DOSE_CLAIM = "dose-response: slope of attention entropy on log activation PR_K"  # the pre-registered name


def with_seed_window(df: pd.DataFrame) -> pd.DataFrame:
    """df with `transient_end` = the transient end of the same seed's `none` run, for every arm
    (a seed without a `none` run keeps its own runs' ends)."""
    ends = transient_ends(df)
    runs = df[["run_id", "seed", "intervention"]].drop_duplicates("run_id").set_index("run_id")
    none_end = runs[runs["intervention"] == "none"].reset_index().set_index("seed")["run_id"].map(ends)
    start = runs["seed"].map(none_end).fillna(ends)
    return df.assign(transient_end=run_values(df, start).astype(int))


def seed_window_note(df: pd.DataFrame) -> str:
    """The window note of a causal table: each seed's start, its none run's transient end."""
    starts = df.groupby("seed")["transient_end"].first()
    return "per seed, from its none run's transient end: " + ", ".join(f"{s}: {v}" for s, v in starts.items())


def paired(values: pd.Series, arm: str) -> pd.Series:
    """Per-seed difference arm - none of a Series indexed by (intervention, seed)."""
    wide = values.unstack("intervention")
    if arm not in wide or "none" not in wide:
        return pd.Series(dtype=float)
    return (wide[arm] - wide["none"]).dropna()


def intervention_row(
    v: np.ndarray, *, claim: str, claim_id: str, group: str, window: str, sign: int | None, note: str, **kw
) -> dict:
    """mean, 95% t-interval over seeds, mde_80 and (with a predicted sign) the verdict."""
    return seed_row(
        v, study="intervention", claim=claim, claim_id=claim_id, group=group, window=window, sign=sign, note=note, **kw
    )


def in_window(rows: pd.DataFrame, win: str) -> pd.DataFrame:
    """The rows of a window, or of the final probe (`final`)."""
    return rows[rows["step"] == rows["steps"]] if win == "final" else window(rows, win)


def arm_means(df: pd.DataFrame, metric: str, win: str = "post-transient") -> pd.Series:
    """Layer-mean `metric` per (intervention, seed): averaged over the window's probes, or at the final probe."""
    return in_window(layer_metric(df, metric), win).groupby(["intervention", "seed"])["value"].mean()


def dose_points(df: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, seed): window means of attention entropy and of each target's check mediator (log),
    the assigned log ratio, and `in_fit` for the W_K dose-response (none and contract/expand on W_K)."""
    return _dose_points(with_seed_window(df))


def _dose_points(df: pd.DataFrame) -> pd.DataFrame:
    """dose_points of a frame that already has the seed window (with_seed_window)."""
    pts = pd.DataFrame({"entropy": arm_means(df, "attention_entropy")})
    for metric in dict.fromkeys(CHECK_MEDIATOR.values()):
        if (df["metric"] == metric).any():
            pts[f"log_{metric}"] = np.log(arm_means(df, metric))
    pts = pts.reset_index()
    pts["log_pr_k"] = pts.get("log_key_participation_ratio", np.nan)
    parsed = pts["intervention"].map(parse_arm)
    pts["kind"], pts["on"] = parsed.str[0], parsed.str[1]
    pts["log_ratio"] = np.log(parsed.str[2].astype(float))
    pts["in_fit"] = (pts["kind"] == "none") | (pts["kind"].isin(["contract", "expand"]) & (pts["on"] == "key"))
    pts.loc[pts["kind"] == "shape", "in_fit"] = True  # the key activations' PR, steered directly
    return pts


def dose_response(pts: pd.DataFrame) -> pd.DataFrame:
    """Per seed, from dose_points: OLS slope of attention entropy on log activation PR_K (window means,
    layer mean) across the none / contract / expand arms on W_K. Columns: seed, slope, intercept,
    n_arms, and the range of log PR_K the fit spans (x_min, x_max: where the figure draws the line)."""
    out = []
    for seed, g in pts[pts["in_fit"]].groupby("seed"):
        b = stats.slope(g["log_pr_k"], g["entropy"])
        a = float(g["entropy"].mean() - b * g["log_pr_k"].mean()) if np.isfinite(b) else np.nan
        x = g["log_pr_k"]
        out.append({"seed": seed, "slope": b, "intercept": a, "n_arms": len(g), "x_min": x.min(), "x_max": x.max()})
    return pd.DataFrame(out, columns=["seed", "slope", "intercept", "n_arms", "x_min", "x_max"])


def dose_summary(slopes: pd.DataFrame) -> dict:
    """The dose-response estimate the figure's title states: mean of the per-seed slopes, its 95%
    t-interval and n."""
    v = slopes["slope"].dropna().to_numpy()
    lo, hi = stats.t_mean_ci(v)
    return {"slope": float(np.mean(v)) if len(v) else np.nan, "low": lo, "high": hi, "n": len(v)}


def causal_estimates(df: pd.DataFrame, note: str, unread: set[str] = frozenset()) -> list[dict]:
    """Per target (W_K, W_Q W_K^T; the key activations' PR for the shape arms at matched scale) with
    contract/expand/shape arms: dose-response (>= 3 arms), reduced form, first stage and IV, one value
    per seed, intervals over seeds (module docstring). `df` has the seed window (with_seed_window).
    unread: matched-scale arms whose scale check failed; a target with one gets no verdicts."""
    pts = _dose_points(df)
    rows: list[dict] = []
    for on in ("key", "interaction", "activation"):
        kinds = ["shape"] if on == "activation" else ["contract", "expand"]
        sel = pts[(pts["kind"] == "none") | (pts["kind"].isin(kinds) & (pts["on"] == on))]
        med = f"log_{CHECK_MEDIATOR[on]}"
        if sel["kind"].nunique() < 2 or med not in sel:
            continue
        group, label = f"none + {'/'.join(kinds)} on {TARGET[on]}", LABEL[CHECK_MEDIATOR[on]]
        if on == "activation":
            group += " at matched logit scale"
        blocked = sorted(set(sel["intervention"]) & set(unread))
        per_seed = pd.DataFrame(
            {
                "reduced": sel.groupby("seed").apply(lambda g: stats.slope(g["log_ratio"], g["entropy"])),
                "first": sel.groupby("seed").apply(lambda g: stats.slope(g["log_ratio"], g[med])),
                "dose": sel.groupby("seed").apply(lambda g: stats.slope(g[med], g["entropy"])),
                "n_arms": sel.groupby("seed").size(),
            }
        ).dropna(subset=["reduced", "first"])
        if len(per_seed) < 2:
            continue
        arms = int(per_seed["n_arms"].min())

        def judged(v: np.ndarray, claim: str, cid: str, detail: str, then: str = "") -> dict:  # a seed row
            return intervention_row(v, claim=claim, claim_id=f"{cid}:{on}", group=group, window="post-transient",
                                    sign=+1, note=note, detail=f"{detail} {np.round(v, 4).tolist()}{then}")  # fmt: skip

        if arms >= 3:
            name = {"key": DOSE_CLAIM, "activation": SHAPE_DOSE_CLAIM}.get(
                on, f"dose-response: slope of attention entropy on log {label}"
            )
            rows.append(judged(per_seed["dose"].to_numpy(), name, "dose_response", "per-seed slopes",
                               f"; {arms} arms each"))  # fmt: skip
        rf, fs = per_seed["reduced"].to_numpy(), per_seed["first"].to_numpy()
        rows.append(judged(rf, f"reduced form: attention entropy per unit assigned log ratio of {TARGET[on]}",
                           "reduced_form", "per-seed"))  # fmt: skip
        rows.append(judged(fs, f"first stage: log {label} per unit assigned log ratio of {TARGET[on]}",
                           "first_stage", "per-seed"))  # fmt: skip
        rows.append(
            fieller_row(
                rf, fs, +1, note,
                claim=f"IV: attention entropy per unit log {label} (reduced form / first stage)",
                claim_id=f"iv:{on}",
                group=group,
                seeds_agreeing=f"{int(np.sum(np.sign(rf) == np.sign(fs)))}/{len(rf)}",
                mde_80=stats.mde(rf) / abs(fs.mean()) if fs.mean() else np.nan,
                detail="mde_80 = reduced form's mde / mean first stage; unbounded interval: first stage too weak",
            )
        )  # fmt: skip
        if blocked:  # read only at matched scale: the target's rows keep their numbers, not their verdicts
            for r in rows:
                if r["group"] == group and r.get("predicted") and not r["claim_id"].startswith("first_stage:"):
                    r["verdict"] = f"scale not matched ({', '.join(blocked)})"
    return rows


def fieller_row(num: np.ndarray, den: np.ndarray, sign: int, note: str, **kw) -> dict:
    """A claims row for mean(num) / mean(den) over seeds with Fieller's 95% interval, judged by `sign`."""
    value, lo, hi = stats.fieller_ratio_ci(num, den)
    return claim_row(
        study="intervention", window="post-transient", value=value, lo=lo, hi=hi, n=len(num),
        predicted="+" if sign > 0 else "-", verdict=stats.verdict(lo, hi, sign), interval="95% Fieller over seeds",
        window_start=note, **kw,
    )  # fmt: skip
