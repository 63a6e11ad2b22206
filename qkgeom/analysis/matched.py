"""Causal v4: key-spectrum arms at a closed-loop matched logit scale, read against a sham arm, per layer.

A v4 study (configs/study-causal-v4-cpu.toml) has, per seed: the uncontrolled `none` run; a **sham**
arm (SHAM: the shape control at ratio 1 through the same projection and the same closed-loop rescaling,
intervention.match_row_std); dose arms (`shape:activation:<r>:closed`, r < 1 restricts the key
spectrum, r > 1 widens it); `hold:key:closed` (the initial dispersion of W_K at the none run's
per-row logit std); and a temperature arm (the scale calibration, read against none by causal.py).

Every contrast is arm - sham, paired by seed, **per controlled layer** (a pooled mean let opposite
layers cancel in causal-shape-cpu), over one window per seed (from its none run's transient end):

1. **Scale check (K1)**: log(arm / sham) of the per-row logit std (logit_row_std) on the probe batch;
   `scale matched` only if its 90% t-interval lies inside +-log 1.05 (TOST). With a control set
   (intervention.control_seqs > 0) the loop fits on training text and the probe batch is validation
   text it never saw: the check can fail. Without one (v4 as first registered) it reads the rows the
   loop set, an identity, and says so in its detail. Beside it, disclosed and not gating: two other
   notions of scale (the input-weighted logit variance, input_logit_scale; the spread of the row std
   across queries, logit_row_std_cv) and what the controller's fit did on its own control set.
2. **Delivered dose**: log(arm / sham) of the per-head activation PR_K (the PR the control steers,
   averaged over the layer's heads); `manipulation ok` only if its 95% interval lies on the intended
   side (restrict down, widen up, hold up).
3. **Outcome**: arm - sham of the layer's mean attention entropy (nats), with the paper's predicted
   sign (restricting sharpens: -, widening and holding soften: +), read only where 1 and 2 pass in
   that layer; otherwise its numbers stay, its verdict names the failed check.

Reported beside them: the sham's own validity (none - sham per controlled layer: entropy, row std,
PR_K), the uncontrolled layers of every arm, the temperature arm against none per layer (the scale
calibration), and per arm the zero-training complement against the learned effect.

**Blind until complete.** While fewer seeds than registered are recorded, `blind` drops every outcome
row (entropy, loss, the complement) and keeps the checks: the primaries are read once, at full n.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.arms import SCALE_MARGIN, claim_id, parse_arm
from qkgeom.analysis.claims import window
from qkgeom.analysis.dose import seed_window_note, with_seed_window
from qkgeom.analysis.rows import rows_table, seed_row
from qkgeom.analysis.runs import INSTANT_METRIC
from qkgeom.arms import Arm

SHAM = "shape:activation:1:closed"  # the sham arm's label (config.arm_label)
ROW_STD_TARGET = "logit_row_std_target"  # logged by the closed loop for its controlled heads
CONTROL_ROW_STD = "logit_row_std_control"  # interventions.CONTROL_ROW_STD_METRIC: the fit set's row std
# what an outcome row's claim names: hidden while a study is incomplete (blind)
OUTCOME_STATS = ("attention_entropy", "final_validation_loss", "instant_entropy_change", "learned_entropy_effect")


def is_matched_study(df: pd.DataFrame) -> bool:
    """Whether `df` holds a v4 study: a sham arm beside other closed-loop arms."""
    return SHAM in set(df["intervention"].unique())


def controlled_layers(df: pd.DataFrame) -> list[int]:
    """The layers the sham arm's closed loop controlled (those with logged row-std targets)."""
    t = df[(df["intervention"] == SHAM) & (df["metric"] == ROW_STD_TARGET)]
    return sorted(int(x) for x in t["layer"].unique())


def dose_arms(df: pd.DataFrame) -> list[str]:
    """The closed-loop arms read against the sham: every `:closed` arm but the sham, sorted."""
    return sorted(a for a in df["intervention"].unique() if a.endswith(":closed") and a != SHAM)


def predicted_signs(arm: str) -> tuple[int, int]:
    """(intended sign of the arm's dose on per-head activation PR_K vs sham, predicted sign of its
    attention-entropy change): restricting (ratio < 1) lowers both, widening (> 1) and holding the
    initial dispersion raise both (the paper's directions)."""
    a = Arm.parse(arm)
    return a.move, a.predicted


class LayerMeans:
    """The window means of one metric per (intervention, seed, layer), each layer's (seed x intervention)
    table unstacked once and kept: a build reads arm - sham from them about 90 times."""

    def __init__(self, means: pd.Series) -> None:
        self.means = means
        self._tables: dict[tuple[int, bool], pd.DataFrame] = {}

    def table(self, layer: int, log: bool) -> pd.DataFrame:
        """One layer's values (or their logs) as a table: seeds down, interventions across."""
        if (layer, log) not in self._tables:
            v = np.log(self.means) if log else self.means
            self._tables[layer, log] = v.xs(layer, level="layer").unstack("intervention")
        return self._tables[layer, log]


def layer_means(df: pd.DataFrame, metric: str) -> LayerMeans:
    """Per (intervention, seed, layer): the window mean of the mean over the layer's heads of `metric`."""
    rows = window(df[(df["metric"] == metric) & (df["head"] >= 0) & (df["site"] == "none")], "post-transient")
    per_step = rows.groupby(["intervention", "seed", "layer", "step"])["value"].mean()
    return LayerMeans(per_step.groupby(["intervention", "seed", "layer"]).mean())


def paired(values: LayerMeans, arm: str, ref: str, layer: int, log: bool = False) -> pd.Series:
    """Per seed: arm - ref (or log(arm / ref)) at one layer."""
    wide = values.table(layer, log)
    if arm not in wide or ref not in wide:
        return pd.Series(dtype=float)
    return (wide[arm] - wide[ref]).dropna()


def _row(v: pd.Series, claim: str, cid: str, layer: int | str, sign: int | None, note: str, **kw) -> dict:
    x = v.to_numpy()
    detail = f"per-seed values {np.round(x, 4).tolist()}"
    if sign is not None:
        _, _, p_sign = stats.sign_test(x, sign)
        detail = f"sign test p = {p_sign:.3g}; {detail}"
    group = f"layer={int(layer)}" if isinstance(layer, (int, np.integer)) else layer
    row = seed_row(x, study="intervention", claim=claim, claim_id=cid, group=group, window="post-transient",
                   sign=sign, note=note, detail=detail, **kw)  # fmt: skip
    row["interval"] = "95% t over seeds (paired)"
    return row


def scale_check(std: LayerMeans, arm: str, layer: int, note: str, held_out: bool = True) -> dict | None:
    """log(arm / sham) of the per-row logit std at one layer: `scale matched` if its 90% interval lies
    inside +-log 1.05 (TOST), else `scale not matched`. held_out: whether the probe batch is text the
    closed loop never fitted on (a control set); if not, the detail says the check is an identity."""
    v = paired(std, arm, SHAM, layer, log=True)
    if v.empty:
        return None
    lo, hi, ok = stats.tost(v.to_numpy(), SCALE_MARGIN)
    row = _row(v, f"{arm} - sham: scale check, log per-row logit std (TOST +-5%)",
               claim_id(arm, "sham", "scale_check:logit_row_std"), layer, None, note)  # fmt: skip
    where = ("held-out validation text (the loop fits on training text)" if held_out
             else "the rows the loop sets (no control set: an identity, cannot fail)")  # fmt: skip
    row.update(
        verdict="scale matched" if ok else "scale not matched",
        margin=SCALE_MARGIN,
        detail=f"90% CI [{lo:.4f}, {hi:.4f}] vs +-{SCALE_MARGIN:.4f}, read on {where}; " + row["detail"],
    )
    return row


def scale_secondaries(values: dict[str, LayerMeans], arm: str, layer: int, note: str) -> list[dict]:
    """Disclosed, not gating: arm - sham at one layer in the other notions of scale (input-weighted logit
    variance in log, the CV of row std across queries) and, with a control set, the loop's own fit there
    (log row std on the control set: ~0 by construction, shown as what the controller wrote)."""
    rows = []
    for metric, what, log in (
        ("input_logit_scale", "secondary scale, log input-weighted logit variance", True),
        ("logit_row_std_cv", "secondary scale, CV of per-row logit std across queries", False),
        (CONTROL_ROW_STD, "controller fit, log per-row logit std on its own control set (not a check)", True),
    ):
        if metric in values:
            v = paired(values[metric], arm, SHAM, layer, log=log)
            if not v.empty:
                cid = claim_id(arm, "sham", f"scale:{metric}")
                rows.append(_row(v, f"{arm} - sham: {what}", cid, layer, None, note))
    return rows


def dose_check(pr: LayerMeans, arm: str, layer: int, note: str) -> dict | None:
    """The delivered dose at one layer: log(arm / sham) of the per-head activation PR_K, judged on its
    intended side (`manipulation ok` / `manipulation failed`)."""
    v = paired(pr, arm, SHAM, layer, log=True)
    if v.empty:
        return None
    sign, _ = predicted_signs(arm)
    _, target, ratio = parse_arm(arm)
    assigned = f" (assigned {np.log(ratio):+.3f})" if target == "activation" else ""
    row = _row(v, f"{arm} - sham: delivered dose, log per-head activation PR_K{assigned}",
               claim_id(arm, "sham", "delivered_dose:key_participation_ratio"), layer, sign, note)  # fmt: skip
    row["verdict"] = "manipulation ok" if row["verdict"] == "holds" else "manipulation failed"
    return row


def claims_matched(df: pd.DataFrame, metrics: pd.DataFrame | None = None) -> pd.DataFrame:
    """The v4 rows (module docstring): per arm and controlled layer the scale check, the delivered dose
    and the entropy contrast vs sham (verdict only where both checks pass); none - sham per layer; the
    uncontrolled layers' entropy and row std vs sham (where the model may move what the control holds);
    the zero-training complement against the learned effect (mean over the controlled layers); the
    final validation loss vs sham (with `metrics`)."""
    df = with_seed_window(df)
    note = seed_window_note(df)
    layers = controlled_layers(df)
    free = sorted(set(df.loc[df["head"] >= 0, "layer"].unique()) - set(layers))
    std, pr = layer_means(df, "logit_row_std"), layer_means(df, "key_participation_ratio")
    ent = layer_means(df, "attention_entropy")
    present = set(df["metric"].unique())
    held_out = CONTROL_ROW_STD in present
    scales = {m: layer_means(df, m) for m in ("input_logit_scale", "logit_row_std_cv", CONTROL_ROW_STD) if m in present}
    rows: list[dict] = []
    for arm in dose_arms(df):
        _, sign = predicted_signs(arm)
        for layer in layers:
            checks = [r for r in (scale_check(std, arm, layer, note, held_out), dose_check(pr, arm, layer, note)) if r]
            rows += checks
            rows += scale_secondaries(scales, arm, layer, note)
            failed = [r["verdict"] for r in checks if r["verdict"] in ("scale not matched", "manipulation failed")]
            v = paired(ent, arm, SHAM, layer)
            if v.empty:
                continue
            kw = {"verdict": failed[0]} if failed or len(checks) < 2 else {}
            rows.append(_row(v, f"{arm} - sham: attention entropy (nats)", claim_id(arm, "sham", "attention_entropy"),
                             layer, sign, note, **kw))  # fmt: skip
    rows += reference_rows(df, ent, std, pr, layers, note)
    for arm in [*dose_arms(df), "none"]:
        for layer in free:
            for what, slug, v in (
                ("attention entropy (nats), uncontrolled layer", "attention_entropy:uncontrolled",
                 paired(ent, arm, SHAM, layer)),
                ("log per-row logit std, uncontrolled layer", "logit_row_std:uncontrolled",
                 paired(std, arm, SHAM, layer, log=True)),
            ):  # fmt: skip
                if not v.empty:
                    rows.append(_row(v, f"{arm} - sham: {what}", claim_id(arm, "sham", slug), layer, None, note))
    rows += instant_vs_learned(df, ent, layers, note)
    if metrics is not None and len(metrics):
        rows += final_loss_rows(df, metrics, note)
    return rows_table(rows)


def final_loss_rows(df: pd.DataFrame, metrics: pd.DataFrame, note: str) -> list[dict]:
    """Each arm's (and none's) final validation loss minus the sham's, per seed: the effects' cost."""
    rows: list[dict] = []
    val = metrics[metrics["split"] == "valid"]
    final = val[val["step"] == val["steps"]].groupby(["intervention", "seed"])["loss"].mean()
    wide = final.unstack("intervention")
    for arm in [*dose_arms(df), "none"]:
        if arm in wide and SHAM in wide:
            v = (wide[arm] - wide[SHAM]).dropna()
            rows.append(_row(v, f"{arm} - sham: final validation loss (nats/char)",
                             claim_id(arm, "sham", "final_validation_loss"), "final", None, note))  # fmt: skip
    return rows


def reference_rows(
    df: pd.DataFrame, ent: LayerMeans, std: LayerMeans, pr: LayerMeans, layers: list[int], note: str
) -> list[dict]:
    """The references' own rows: the sham's validity (none - sham per controlled layer: entropy, log row
    std, log PR_K) and the temperature arm against none per layer (the scale calibration)."""
    rows: list[dict] = []
    for layer in layers:  # the sham's own validity: what being under the control does, per layer
        for what, slug, v in (
            ("attention entropy (nats)", "attention_entropy", paired(ent, "none", SHAM, layer)),
            ("log per-row logit std", "logit_row_std", paired(std, "none", SHAM, layer, log=True)),
            ("log per-head activation PR_K", "key_participation_ratio", paired(pr, "none", SHAM, layer, log=True)),
        ):
            if not v.empty:
                cid = claim_id("none", "sham", f"{slug}:under_control")
                rows.append(_row(v, f"none - sham: {what}, being under the control", cid, layer, None, note))
    for arm in sorted(a for a in df["intervention"].unique() if parse_arm(a)[1] == "logit"):  # scale kinds
        for layer in sorted(df.loc[df["head"] >= 0, "layer"].unique()):  # the scale calibration, per layer
            for what, slug, v in (
                ("attention entropy (nats)", "attention_entropy", paired(ent, arm, "none", layer)),
                ("log per-row logit std", "logit_row_std", paired(std, arm, "none", layer, log=True)),
            ):
                if not v.empty:
                    cid = claim_id(arm, "none", f"{slug}:scale_calibration")
                    rows.append(_row(v, f"{arm} - none: {what}, scale calibration", cid, layer, None, note))
    return rows


def is_outcome(cid: str) -> bool:
    """Whether a claims row (by its claim_id) reads an outcome, hidden while the study is blind, rather
    than a check: attention entropy, validation loss, the zero-training complement."""
    return str(cid).rsplit(".", 1)[-1].startswith(OUTCOME_STATS)


def seeds_complete(df: pd.DataFrame, planned_arms: int) -> int:
    """Seeds whose every planned arm is recorded (whole seeds: what the registered n counts)."""
    return int((df.groupby("seed")["intervention"].nunique() >= planned_arms).sum())


def blind(claims: pd.DataFrame) -> pd.DataFrame:
    """The claims table without its outcome rows (entropy, loss, the zero-training complement)."""
    return claims[~claims["claim_id"].map(is_outcome)].reset_index(drop=True)


def instant_vs_learned(df: pd.DataFrame, ent: LayerMeans, layers: list[int], note: str) -> list[dict]:
    """Per closed-loop arm: its map's instantaneous entropy change on the none runs' own weights minus the
    sham map's (no training), and the learned effect = (arm - sham, trained) - that; means over the
    controlled layers, per seed."""
    inst = df[(df["metric"] == INSTANT_METRIC) & (df["head"] == -1) & (df["intervention"] == "none")]
    inst = window(inst[inst["layer"].isin(layers)], "post-transient")
    if inst.empty or SHAM not in set(inst["site"]):
        return []
    change = inst.groupby(["site", "seed"])["value"].mean().unstack("site")
    rows = []
    for arm in dose_arms(df):
        if arm not in change:
            continue
        instant = (change[arm] - change[SHAM]).dropna()
        where = "mean over controlled layers"
        rows.append(_row(instant, f"{arm} - sham: instantaneous entropy change of its map (no training)",
                         claim_id(arm, "sham", "instant_entropy_change"), where, None, note))  # fmt: skip
        trained = pd.concat([paired(ent, arm, SHAM, la) for la in layers], axis=1).mean(axis=1)
        learned = (trained - instant).dropna()
        rows.append(_row(learned, f"{arm} - sham: learned effect (trained - instantaneous), attention entropy",
                         claim_id(arm, "sham", "learned_entropy_effect"), where, None, note))  # fmt: skip
    return rows


def dose_table(df: pd.DataFrame) -> pd.DataFrame:
    """What the v4 figure draws, per (layer, arm): the delivered dose (mean log per-head PR_K vs sham) and
    the entropy contrast vs sham, each with its 95% t-interval over seeds (the sham at 0, 0)."""
    df = with_seed_window(df)
    pr, ent = layer_means(df, "key_participation_ratio"), layer_means(df, "attention_entropy")
    out = []
    for layer in controlled_layers(df):
        for arm in [SHAM, *dose_arms(df), "none"]:
            d, e = paired(pr, arm, SHAM, layer, log=True), paired(ent, arm, SHAM, layer)
            if d.empty or e.empty:
                continue
            (d_lo, d_hi), (e_lo, e_hi) = stats.t_mean_ci(d.to_numpy()), stats.t_mean_ci(e.to_numpy())
            out.append({"layer": layer, "arm": arm, "n": len(e), "dose": d.mean(), "dose_low": d_lo, "dose_high": d_hi,
                        "entropy": e.mean(), "entropy_low": e_lo, "entropy_high": e_hi})  # fmt: skip
    return pd.DataFrame(out)
