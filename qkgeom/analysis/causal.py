"""The causal test: an intervention study read against each seed's unconstrained (`none`) run.

- **One window per seed.** All arms of a seed are averaged over the same probes: from the transient
  end detected on that seed's `none` run (analysis.transient_ends) to the end of the run. An arm's
  own detected window could differ by a probe, worth about as much as the effects under test.
- **Manipulation first.** Each arm is checked against `none` on the mediators (weight PR_K,
  activation PR_K, interaction rank, logit-spectrum PR); its outcome (attention entropy) is judged
  only if it moved its activation-side mediator in the intended direction.
- **The causal estimate, three ways** (per target, W_K or W_Q W_K^T, over none + its contract/expand
  arms, one value per seed, t-interval over seeds):
  dose-response (slope of entropy on the achieved log mediator, >= 3 arms); reduced form (slope of
  entropy on the *assigned* log ratio, 0 for none); first stage (slope of the log mediator on the
  assigned log ratio); IV = reduced form / first stage, with Fieller's interval (unbounded when the
  first stage is too weak to identify it).
- **Hold at matched loss.** Holding W_K slows learning; hold's entropy is compared with none's at
  the same validation loss, interpolated along none's loss curve.
Every verdict row carries mde_80 (stats.mde): the smallest effect it had 80% power to detect.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.claims import _finish, claim_row, layer_metric, seed_row, transient_ends, window

# Pre-registered directions (configs/study-intervention-*.toml, study-causal-cpu.toml): each arm's
# intended effect on its mediator and predicted effect on attention entropy, by kind.
PREDICTED_SIGN = {"contract": -1, "expand": +1, "hold": +1}
# The activation-side mediator a manipulation must move before its outcome is read: the key
# activations for a control on W_K, the logit (Q K^T) spectrum for a control on W_Q W_K^T.
CHECK_MEDIATOR = {"key": "key_participation_ratio", "interaction": "logit_participation_ratio"}
MEDIATORS = (
    ("key_weight_participation_ratio", "weight PR_K"),
    ("key_participation_ratio", "activation PR_K"),
    ("interaction_rank", "interaction rank"),
    ("logit_participation_ratio", "logit-spectrum PR"),
)
LABEL = dict(MEDIATORS)
TARGET = {"key": "W_K", "interaction": "W_Q W_K^T"}
DOSE_CLAIM = "dose-response: slope of attention entropy on log activation PR_K"  # the pre-registered name
MATCHED_ARM = "hold:key"


def parse_arm(arm: str) -> tuple[str, str, float]:
    """`contract:key:0.6` -> (contract, key, 0.6); `hold:key` -> (hold, key, 1.0); `none` -> (none, key, 1.0);
    a `:matched` suffix (matched logit scale) is dropped: is_matched() reads it."""
    parts = [p for p in arm.split(":") if p != "matched"]
    return parts[0], parts[1] if len(parts) > 1 else "key", float(parts[2]) if len(parts) > 2 else 1.0


def is_matched(arm: str) -> bool:
    """Whether the arm ran at matched logit scale (intervention.match_scale)."""
    return arm.endswith(":matched")


def with_seed_window(df: pd.DataFrame) -> pd.DataFrame:
    """df with `transient_end` = the transient end of the same seed's `none` run, for every arm
    (a seed without a `none` run keeps its own runs' ends)."""
    ends = transient_ends(df)
    runs = df[["run_id", "seed", "intervention"]].drop_duplicates("run_id").set_index("run_id")
    none_end = runs[runs["intervention"] == "none"].reset_index().set_index("seed")["run_id"].map(ends)
    start = runs["seed"].map(none_end).fillna(ends)
    return df.assign(transient_end=df["run_id"].map(start).astype(int))


def seed_window_note(df: pd.DataFrame) -> str:
    starts = df.groupby("seed")["transient_end"].first()
    return "per seed, from its none run's transient end: " + ", ".join(f"{s}: {v}" for s, v in starts.items())


def _paired(values: pd.Series, arm: str) -> pd.Series:
    """Per-seed difference arm - none of a Series indexed by (intervention, seed)."""
    wide = values.unstack("intervention")
    if arm not in wide or "none" not in wide:
        return pd.Series(dtype=float)
    return (wide[arm] - wide["none"]).dropna()


def _verdict_row(v: np.ndarray, *, claim: str, group: str, window: str, sign: int | None, note: str, **kw) -> dict:
    """mean, 95% t-interval over seeds, mde_80 and (with a predicted sign) the verdict."""
    return seed_row(v, study="intervention", claim=claim, group=group, window=window, sign=sign, note=note, **kw)


def _direction_row(diffs: pd.Series, claim: str, group: str, win: str, sign: int | None, note: str, verdict=None):
    """One claims row for paired differences: mean, t-interval, sign test, PD, mde_80, verdict."""
    if diffs.empty:
        return []
    v = diffs.to_numpy()
    detail = f"per-seed diffs {np.round(v, 4).tolist()}"
    extra = {}
    if sign is not None:
        k, n, p = stats.sign_test(v, sign)
        pd_ = stats.probability_of_direction(v, sign)
        detail = f"sign test p = {p:.3g}; probability of direction {pd_:.3f}; {detail}"
        extra = dict(p_value=p) | (dict(verdict=verdict) if verdict else {})
    row = _verdict_row(v, claim=claim, group=group, window=win, sign=sign, note=note, detail=detail, **extra)
    row["interval"] = "95% t over seeds (paired)"
    return [row]


def _in_window(rows: pd.DataFrame, win: str) -> pd.DataFrame:
    """The rows of a window, or of the final probe (`final`)."""
    return rows[rows["step"] == rows["steps"]] if win == "final" else window(rows, win)


def arm_means(df: pd.DataFrame, metric: str, win: str = "post-transient") -> pd.Series:
    """Layer-mean `metric` per (intervention, seed): averaged over the window's probes, or at the final probe."""
    return _in_window(layer_metric(df, metric), win).groupby(["intervention", "seed"])["value"].mean()


def dose_points(df: pd.DataFrame) -> pd.DataFrame:
    """Per (arm, seed): window means of attention entropy and of each target's check mediator (log),
    the assigned log ratio, and `in_fit` for the W_K dose-response (none and contract/expand on W_K)."""
    return _dose_points(with_seed_window(df))


def _dose_points(df: pd.DataFrame) -> pd.DataFrame:
    """dose_points of a frame that already has the seed window (with_seed_window)."""
    pts = pd.DataFrame({"entropy": arm_means(df, "attention_entropy")})
    for metric in CHECK_MEDIATOR.values():
        if (df["metric"] == metric).any():
            pts[f"log_{metric}"] = np.log(arm_means(df, metric))
    pts = pts.reset_index()
    pts["log_pr_k"] = pts.get("log_key_participation_ratio", np.nan)
    parsed = pts["intervention"].map(parse_arm)
    pts["kind"], pts["on"] = parsed.str[0], parsed.str[1]
    pts["log_ratio"] = np.log(parsed.str[2].astype(float))
    pts["in_fit"] = (pts["kind"] == "none") | (pts["kind"].isin(["contract", "expand"]) & (pts["on"] == "key"))
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


def causal_estimates(df: pd.DataFrame, note: str) -> list[dict]:
    """Per target (W_K, W_Q W_K^T) with contract/expand arms: dose-response (>= 3 arms), reduced form,
    first stage and IV, one value per seed, intervals over seeds (module docstring). `df` has the
    seed window (with_seed_window)."""
    pts = _dose_points(df)
    rows: list[dict] = []
    for on in ("key", "interaction"):
        sel = pts[(pts["kind"] == "none") | (pts["kind"].isin(["contract", "expand"]) & (pts["on"] == on))]
        med = f"log_{CHECK_MEDIATOR[on]}"
        if sel["kind"].nunique() < 2 or med not in sel:
            continue
        group, label = f"none + contract/expand on {TARGET[on]}", LABEL[CHECK_MEDIATOR[on]]
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
        if arms >= 3:
            name = DOSE_CLAIM if on == "key" else f"dose-response: slope of attention entropy on log {label}"
            v = per_seed["dose"].to_numpy()
            rows.append(
                _verdict_row(
                    v,
                    claim=name,
                    group=group,
                    window="post-transient",
                    sign=+1,
                    note=note,
                    detail=f"per-seed slopes {np.round(v, 4).tolist()}; {arms} arms each",
                )
            )
        rf, fs = per_seed["reduced"].to_numpy(), per_seed["first"].to_numpy()
        rows.append(
            _verdict_row(
                rf,
                claim=f"reduced form: attention entropy per unit assigned log ratio of {TARGET[on]}",
                group=group,
                window="post-transient",
                sign=+1,
                note=note,
                detail=f"per-seed {np.round(rf, 4).tolist()}",
            )
        )
        first = _verdict_row(
            fs,
            claim=f"first stage: log {label} per unit assigned log ratio of {TARGET[on]}",
            group=group,
            window="post-transient",
            sign=+1,
            note=note,
            detail=f"per-seed {np.round(fs, 4).tolist()}",
        )
        rows.append(first)
        ratio, lo, hi = stats.fieller_ratio_ci(rf, fs)
        verdict = stats.verdict(lo, hi, +1)
        rows.append(
            claim_row(
                study="intervention",
                claim=f"IV: attention entropy per unit log {label} (reduced form / first stage)",
                group=group,
                window="post-transient",
                value=ratio,
                lo=lo,
                hi=hi,
                n=len(rf),
                predicted="+",
                verdict=verdict,
                seeds_agreeing=f"{int(np.sum(np.sign(rf) == np.sign(fs)))}/{len(rf)}",
                interval="95% Fieller over seeds",
                window_start=note,
                mde_80=stats.mde(rf) / abs(fs.mean()) if fs.mean() else np.nan,
                detail="mde_80 = reduced form's mde / mean first stage; unbounded interval: first stage too weak",
            )
        )
    return rows


def loss_matched(df: pd.DataFrame, metrics: pd.DataFrame, arm: str = MATCHED_ARM) -> pd.Series:
    """Per seed: mean over the arm's window probes of (arm entropy - none's entropy at the arm's
    validation loss). none's step at that loss is interpolated linearly along its own evaluations
    from the window start on; probes at a loss none never reaches in its window are dropped. The
    arm's loss at a probe step is interpolated from its evaluations. Layer-mean entropy."""
    return _loss_matched(with_seed_window(df), metrics, arm)


def _loss_matched(df: pd.DataFrame, metrics: pd.DataFrame, arm: str) -> pd.Series:
    """loss_matched of a frame that already has the seed window."""
    ent = layer_metric(df, "attention_entropy").groupby(["intervention", "seed", "step"])["value"].mean()
    val = metrics[metrics["split"] == "valid"].groupby(["intervention", "seed", "step"])["loss"].mean()
    starts = df.groupby("seed")["transient_end"].first()
    out = {}
    for seed, start in starts.items():
        if (arm, seed) not in ent.index.droplevel("step") or ("none", seed) not in val.index.droplevel("step"):
            continue
        a_ent, a_loss = ent.loc[(arm, seed)], val.loc[(arm, seed)]
        n_ent, n_loss = ent.loc[("none", seed)], val.loc[("none", seed)]
        n_loss = n_loss[n_loss.index >= start]
        steps = a_ent.index[(a_ent.index >= start) & (a_ent.index <= a_loss.index.max())]
        diffs = []
        for s in steps:
            loss = np.interp(s, a_loss.index, a_loss.to_numpy())
            below = np.nonzero(n_loss.to_numpy() <= loss)[0]
            if len(below) == 0 or below[0] == 0:  # never reached, or already passed before the window
                continue
            i = below[0]
            (s0, s1), (l0, l1) = n_loss.index[i - 1 : i + 1], n_loss.to_numpy()[i - 1 : i + 1]
            s_star = s0 + (l0 - loss) / (l0 - l1) * (s1 - s0)
            diffs.append(a_ent.loc[s] - np.interp(s_star, n_ent.index, n_ent.to_numpy()))
        if diffs:
            out[seed] = float(np.mean(diffs))
    return pd.Series(out, dtype=float)


def claims_intervention(df: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """The causal test: per arm, manipulation checks (arm - none on each mediator, paired by seed),
    then the outcome (attention entropy) judged only if the manipulation moved its activation-side
    mediator in the intended direction; the logit spectral norm and final loss for reference; then
    the causal estimates, hold at matched loss, and how well the control met its targets. Windows:
    the seed's none-run window (post-transient) and the final probe."""
    df = with_seed_window(df)
    note = seed_window_note(df)
    rows: list[dict] = []
    arms = sorted(a for a in df["intervention"].unique() if a != "none")
    for arm in arms:
        kind, on, _ = parse_arm(arm)
        sign = PREDICTED_SIGN[kind]
        check_ok = True
        for metric, label in MEDIATORS:
            r = _direction_row(
                _paired(arm_means(df, metric), arm),
                f"{arm} - none: manipulation check, {label}",
                "mean over layers",
                "post-transient",
                sign,
                note,
            )
            if r and metric == CHECK_MEDIATOR[on]:
                check_ok = r[0]["verdict"] == "holds"
                r[0]["verdict"] = "manipulation ok" if check_ok else "manipulation failed"
                r[0]["claim"] += " (the check)"
            rows += r
        rows += _direction_row(
            _paired(arm_means(df, "logit_spectral_norm"), arm),
            f"{arm} - none: logit spectral norm",
            "mean over layers",
            "post-transient",
            None,
            note,
        )
        for win in ("post-transient", "final"):
            rows += _direction_row(
                _paired(arm_means(df, "attention_entropy", win), arm),
                f"{arm} - none: attention entropy (nats)",
                "mean over layers",
                win,
                sign,
                note,
                verdict=None if check_ok else "manipulation failed",
            )
            for layer, g in _in_window(layer_metric(df, "attention_entropy"), win).groupby("layer"):
                rows += _direction_row(
                    _paired(g.groupby(["intervention", "seed"])["value"].mean(), arm),
                    f"{arm} - none: attention entropy (nats)",
                    f"layer={layer}",
                    win,
                    sign,
                    note,
                )
        val = metrics[metrics["split"] == "valid"]
        val = val[val["step"] == val["steps"]].groupby(["intervention", "seed"])["loss"].mean()
        rows += _direction_row(
            _paired(val, arm), f"{arm} - none: validation loss (nats/char)", "final", "final", None, note
        )
    rows += causal_estimates(df, note)
    if MATCHED_ARM in arms and len(metrics):
        m = _loss_matched(df, metrics, MATCHED_ARM)
        rows += _direction_row(
            m,
            f"{MATCHED_ARM} - none at matched validation loss: attention entropy (nats)",
            "mean over layers",
            "post-transient, loss-matched",
            +1,
            note,
        )
    rows += control_rows(df)
    return _finish(rows)


def control_rows(df: pd.DataFrame) -> list[dict]:
    """How the achieved spectrum met its target, per condition: for hold and two-sided controls the
    max relative error; for one-sided ceilings / floors the largest violation past the target."""
    rows = []
    for metric in ("key_weight_participation_ratio", "interaction_rank"):
        target = df[df["metric"] == f"{metric}_target"]
        if target.empty:
            continue
        achieved = df[(df["metric"] == metric) & (df["head"] >= 0)]
        keys = ["run_id", "step", "layer", "head"]
        both = target.merge(achieved, on=keys, suffixes=("_target", ""))
        both = both[both["step"] > 0]
        for arm, g in both.groupby("intervention_target"):
            kind = arm.split(":")[0]
            rel = (g["value"] - g["value_target"]) / g["value_target"]
            if kind == "contract":
                err, what = rel.clip(lower=0).max(), "largest excess above the ceiling"
            elif kind == "expand":
                err, what = (-rel).clip(lower=0).max(), "largest shortfall below the floor"
            else:
                err, what = rel.abs().max(), "max relative error"
            active = float((rel.abs() < 1e-6).mean())
            rows.append(
                claim_row(
                    study="intervention",
                    claim=f"{arm}: achieved {metric} vs target",
                    group="all controlled heads",
                    window="whole",
                    value=err,
                    n=len(g),
                    detail=f"{what} over {g['run_id'].nunique()} runs x probes x heads; "
                    f"share of probes at the target (control active) {active:.2f}",
                )
            )
    return rows


def headline(claims: pd.DataFrame) -> pd.DataFrame:
    """The intervention study's answer, one row per arm: its manipulation check (verdict, effect on the
    check mediator), its outcome (attention entropy difference vs none over the seed window, 95%
    interval, n, mde_80) and the outcome's verdict; the mediator rows stay in the claims table."""
    c = claims[(claims["study"] == "intervention") & (claims["group"] == "mean over layers")]
    rows = []
    for arm in sorted({x.split(" - none")[0] for x in c["claim"] if " - none: " in x}):
        check = c[
            c["claim"].str.startswith(f"{arm} - none: manipulation check") & c["claim"].str.endswith("(the check)")
        ]
        out = c[(c["claim"] == f"{arm} - none: attention entropy (nats)") & (c["window"] == "post-transient")]
        if check.empty or out.empty:
            continue
        ch, o = check.iloc[0], out.iloc[0]
        mediator = ch["claim"].split("check, ")[1].removesuffix(" (the check)")
        rows.append(
            {
                "arm": arm,
                "manipulation check": f"{ch['verdict']} ({mediator} {ch['value']:+.3g} "
                f"[{ch['ci_low']:.3g}, {ch['ci_high']:.3g}])",
                "predicted": o["predicted"],
                "entropy difference (nats) [95% CI]": f"{o['value']:+.3g} [{o['ci_low']:.3g}, {o['ci_high']:.3g}]",
                "n": o["n"],
                "seeds agreeing": o["seeds_agreeing"],
                "mde_80 (nats)": f"{o['mde_80']:.3g}",
                "verdict": o["verdict"],
            }
        )
    return pd.DataFrame(rows)
