"""The causal test: an intervention study read against each seed's unconstrained (`none`) run, on
one window per seed (dose.with_seed_window).

- **Manipulation first.** Each arm is checked against `none` on the mediators (weight PR_K,
  activation PR_K, interaction rank, logit-spectrum PR); its outcome (attention entropy) is judged
  only if it moved its activation-side mediator in the intended direction.
- **The causal estimate, three ways**: dose-response, reduced form and first stage, IV (dose.py).
- **Hold at matched loss.** Holding W_K slows learning; hold's entropy is compared with none's at
  the same validation loss, interpolated along none's loss curve.
Every verdict row carries mde_80 (stats.mde): the smallest effect it had 80% power to detect.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.arms import (  # noqa: F401 (the arm vocabulary, read by the report as causal.TARGET, ...)
    LABEL,
    MATCHED_ARM,
    MEDIATORS,
    SCALE_MARGIN,
    TARGET,
    arm_signs,
    claim_id,
    control_rows,
    is_matched,
    parse_arm,
)
from qkgeom.analysis.claims import layer_metric, window
from qkgeom.analysis.dose import (
    arm_means,
    causal_estimates,
    fieller_row,
    in_window,
    intervention_row,
    paired,
    seed_window_note,
    with_seed_window,
)
from qkgeom.analysis.rows import rows_table
from qkgeom.analysis.runs import INSTANT_METRIC
from qkgeom.arms import Arm


def _direction_row(
    diffs: pd.Series, claim: str, cid: str, group: str, win: str, sign: int | None, note: str, verdict=None
):
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
    row = intervention_row(v, claim=claim, claim_id=cid, group=group, window=win, sign=sign, note=note, detail=detail,
                       **extra)  # fmt: skip
    row["interval"] = "95% t over seeds (paired)"
    return [row]


def _log_paired(df: pd.DataFrame, metric: str, arm: str) -> pd.Series:
    """Per seed: log(arm / none) of the window-mean, layer-mean metric."""
    return paired(np.log(arm_means(df, metric)), arm)


def _delivered_dose_row(df: pd.DataFrame, arm: str, metric: str, note: str) -> list[dict]:
    """The dose the arm delivered: log(arm / none) of its steered metric, beside the assigned log ratio
    (2 log ratio for the logit scale, a mean square)."""
    assigned = Arm.parse(arm).assigned_dose
    r = _direction_row(
        _log_paired(df, metric, arm),
        f"{arm} - none: delivered dose, log {LABEL[metric]} ratio (assigned {assigned:+.3f})",
        claim_id(arm, "none", f"delivered_dose:{metric}"),
        "mean over layers",
        "post-transient",
        None,
        note,
    )
    return r


def _scale_check_row(df: pd.DataFrame, arm: str, note: str) -> list[dict]:
    """A matched-scale arm's scale check: per seed, log(arm / none) of the per-row logit std; `scale
    matched` only if its 90% interval lies inside +-log 1.05 (TOST)."""
    v = _log_paired(df, "logit_row_std", arm)
    if v.empty:
        return []
    lo, hi, ok = stats.tost(v.to_numpy(), SCALE_MARGIN)
    row = _direction_row(
        v, f"{arm} - none: scale check, log per-row logit std (TOST +-5%)",
        claim_id(arm, "none", "scale_check:logit_row_std"), "mean over layers", "post-transient", None, note,
    )[0]  # fmt: skip
    row.update(
        verdict="scale matched" if ok else "scale not matched",
        margin=SCALE_MARGIN,
        detail=f"90% CI [{lo:.4f}, {hi:.4f}] vs +-{SCALE_MARGIN:.4f}; " + row["detail"],
    )
    return [row]


def temperature_rows(df: pd.DataFrame, note: str) -> list[dict]:
    """The scale path: per temperature arm, attention entropy change per unit delivered log logit factor
    (half the log ratio of the logit scale), Fieller's interval over seeds; predicted < 0."""
    rows = []
    for arm in sorted(a for a in df["intervention"].unique() if parse_arm(a)[1] == "logit"):  # scale kinds
        ent = paired(arm_means(df, "attention_entropy"), arm)
        dose = 0.5 * _log_paired(df, "input_logit_scale", arm)
        both = pd.concat({"ent": ent, "dose": dose}, axis=1).dropna()
        if len(both) < 2:
            continue
        rows.append(
            fieller_row(
                both["ent"].to_numpy(), both["dose"].to_numpy(), -1, note,
                claim=f"{arm}: attention entropy per unit delivered log logit factor (the scale path)",
                claim_id=claim_id(arm, "none", "entropy_per_log_logit_factor"),
                group="mean over layers",
                detail=f"entropy diffs {np.round(both['ent'].to_numpy(), 4).tolist()}; "
                f"delivered log factors {np.round(both['dose'].to_numpy(), 4).tolist()}",
            )
        )  # fmt: skip
    return rows


def instant_rows(df: pd.DataFrame, note: str) -> list[dict]:
    """The zero-training complement (intervention.instant on the none runs): per arm, the instantaneous
    entropy change of its map on the none run's own weights (window mean, layer mean, per seed), and
    the learned effect = the trained arm's entropy difference vs none minus that instantaneous change."""
    inst = df[(df["metric"] == INSTANT_METRIC) & (df["head"] == -1) & (df["intervention"] == "none")]
    inst = window(inst, "post-transient")
    if inst.empty:
        return []
    rows = []
    trained_all = arm_means(df, "attention_entropy")
    for arm, g in inst.groupby("site"):
        change = g.groupby("seed")["value"].mean()
        rows += _direction_row(
            change, f"{arm}: instantaneous entropy change of its map on none weights (no training)",
            claim_id(arm, "none", "instant_entropy_change"), "mean over layers", "post-transient", None, note,
        )  # fmt: skip
        trained = paired(trained_all, arm)
        learned = (trained - change).dropna()
        rows += _direction_row(
            learned, f"{arm} - none: learned effect (trained - instantaneous), attention entropy (nats)",
            claim_id(arm, "none", "learned_entropy_effect"), "mean over layers", "post-transient", None, note,
        )  # fmt: skip
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
        keep = (a_ent.index >= start) & (a_ent.index <= a_loss.index.max())
        # plain arrays from here: the same scalar operations, without a pandas lookup per probe step
        steps, a_vals = a_ent.index.to_numpy()[keep], a_ent.to_numpy()[keep]
        a_steps, a_losses = a_loss.index.to_numpy(), a_loss.to_numpy()
        n_steps, n_losses = n_loss.index.to_numpy(), n_loss.to_numpy()
        e_steps, e_vals = n_ent.index.to_numpy(), n_ent.to_numpy()
        diffs = []
        for s, a_value in zip(steps, a_vals, strict=True):
            loss = np.interp(s, a_steps, a_losses)
            below = np.nonzero(n_losses <= loss)[0]
            if len(below) == 0 or below[0] == 0:  # never reached, or already passed before the window
                continue
            i = below[0]
            (s0, s1), (l0, l1) = n_steps[i - 1 : i + 1], n_losses[i - 1 : i + 1]
            s_star = s0 + (l0 - loss) / (l0 - l1) * (s1 - s0)
            diffs.append(a_value - np.interp(s_star, e_steps, e_vals))
        if diffs:
            out[seed] = float(np.mean(diffs))
    return pd.Series(out, dtype=float)


def _loss_matched_rows(df: pd.DataFrame, metrics: pd.DataFrame, note: str) -> list[dict]:
    """MATCHED_ARM - none in attention entropy at matched validation loss: over the layers' mean, then
    per layer (that layer's entropy, the same loss matching)."""
    what = f"{MATCHED_ARM} - none at matched validation loss: attention entropy (nats)"
    cid = claim_id(MATCHED_ARM, "none", "attention_entropy:loss_matched")
    win = "post-transient, loss-matched"
    layers = sorted(df.loc[df["head"] == -1, "layer"].unique())
    df = layer_metric(df, "attention_entropy")  # all it reads: each layer's subset is then cut from this
    rows = _direction_row(_loss_matched(df, metrics, MATCHED_ARM), what, cid, "mean over layers", win, +1, note)
    for layer in layers:
        m = _loss_matched(df[df["layer"] == layer], metrics, MATCHED_ARM)
        rows += _direction_row(m, what, cid, f"layer={layer}", win, +1, note)
    return rows


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
    unread: set[str] = set()  # matched-scale arms whose scale check failed: their outcomes are not read
    for arm in arms:
        kind, on, ratio = parse_arm(arm)
        med_sign, sign, check = arm_signs(arm)
        check_ok = True
        for metric, label in MEDIATORS:
            r = _direction_row(
                paired(arm_means(df, metric), arm),
                f"{arm} - none: manipulation check, {label}",
                claim_id(arm, "none", f"{'manipulation_check' if metric == check else 'mediator'}:{metric}"),
                "mean over layers",
                "post-transient",
                med_sign,
                note,
            )
            if r and metric == check:
                check_ok = r[0]["verdict"] == "holds"
                r[0]["verdict"] = "manipulation ok" if check_ok else "manipulation failed"
                r[0]["claim"] += " (the check)"
            rows += r
        if Arm.parse(arm).spec.relative:  # a kind steering a measured quantity: its delivered dose
            rows += _delivered_dose_row(df, arm, check, note)
        if is_matched(arm):
            scale = _scale_check_row(df, arm, note)
            rows += scale
            if scale and scale[0]["verdict"] != "scale matched":
                check_ok = False
                unread.add(arm)
        rows += _direction_row(
            paired(arm_means(df, "logit_spectral_norm"), arm),
            f"{arm} - none: logit spectral norm",
            claim_id(arm, "none", "logit_spectral_norm"),
            "mean over layers",
            "post-transient",
            None,
            note,
        )
        for win in ("post-transient", "final"):
            rows += _direction_row(
                paired(arm_means(df, "attention_entropy", win), arm),
                f"{arm} - none: attention entropy (nats)",
                claim_id(arm, "none", "attention_entropy"),
                "mean over layers",
                win,
                sign,
                note,
                verdict=None if check_ok else "scale not matched" if arm in unread else "manipulation failed",
            )
            for layer, g in in_window(layer_metric(df, "attention_entropy"), win).groupby("layer"):
                rows += _direction_row(
                    paired(g.groupby(["intervention", "seed"])["value"].mean(), arm),
                    f"{arm} - none: attention entropy (nats)",
                    claim_id(arm, "none", "attention_entropy"),
                    f"layer={layer}",
                    win,
                    sign,
                    note,
                )
        val = metrics[metrics["split"] == "valid"]
        val = val[val["step"] == val["steps"]].groupby(["intervention", "seed"])["loss"].mean()
        rows += _direction_row(
            paired(val, arm), f"{arm} - none: validation loss (nats/char)",
            claim_id(arm, "none", "final_validation_loss"), "final", "final", None, note,
        )  # fmt: skip
    rows += causal_estimates(df, note, unread)
    rows += temperature_rows(df, note)
    rows += instant_rows(df, note)
    if MATCHED_ARM in arms and len(metrics):
        rows += _loss_matched_rows(df, metrics, note)
    rows += control_rows(df)
    return rows_table(rows)


def headline(claims: pd.DataFrame) -> pd.DataFrame:
    """The intervention study's answer, one row per arm: its manipulation check (verdict, effect on the
    check mediator), its outcome (attention entropy difference vs none over the seed window, 95%
    interval, n, mde_80) and the outcome's verdict; the mediator rows stay in the claims table."""
    c = claims[(claims["study"] == "intervention") & (claims["group"] == "mean over layers")]
    rows = []
    ids = c["claim_id"].astype(str)
    for arm in sorted({x.split("-none.")[0] for x in ids if "-none." in x}):
        check = c[ids.str.startswith(claim_id(arm, "none", "manipulation_check:"))]
        out = c[(ids == claim_id(arm, "none", "attention_entropy")) & (c["window"] == "post-transient")]
        if check.empty or out.empty:
            continue
        ch, o = check.iloc[0], out.iloc[0]
        mediator = LABEL[ch["claim_id"].rsplit(":", 1)[-1]]
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
