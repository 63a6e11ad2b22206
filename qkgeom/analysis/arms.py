"""What an intervention arm is, read back from its label: kind, target and ratio (parse_arm), its
intended move on its check mediator and its predicted effect on attention entropy (arm_signs), the
mediators and their labels, a contrast row's claim_id, and how well each arm's control met its
target (control_rows). analysis.causal and analysis.matched judge the arms with these."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.rows import claim_row
from qkgeom.arms import Arm

# The kinds, their check mediators (CHECK_MEDIATOR), intended moves and predicted signs on attention
# entropy (the pre-registered directions of configs/study-intervention-*.toml, study-causal-*.toml)
# are one table: qkgeom.arms.KINDS. Every mediator a causal table checks, with its label:
MEDIATORS = (
    ("key_weight_participation_ratio", "weight PR_K"),
    ("key_participation_ratio", "activation PR_K"),
    ("interaction_rank", "interaction rank"),
    ("logit_participation_ratio", "logit-spectrum PR"),
    ("input_logit_scale", "input logit scale"),
    ("logit_row_std", "per-row logit std"),
    ("logit_row_std_cv", "CV of per-query logit std (the Jensen channel)"),
)
LABEL = dict(MEDIATORS)
TARGET = {"key": "W_K", "interaction": "W_Q W_K^T", "activation": "the key activations' PR (shape)"}
# a matched-scale arm's per-row logit std must lie within +-5% of none's (TOST, 90% interval of the
# per-seed log ratio) before its outcome is read
SCALE_MARGIN = float(np.log(1.05))
MATCHED_ARM = "hold:key"


def parse_arm(arm: str) -> tuple[str, str, float]:
    """`contract:key:0.6` -> (contract, key, 0.6); `hold:key` -> (hold, key, 1.0); `none` -> (none, key, 1.0);
    `shape:activation:0.8:closed` -> (shape, activation, 0.8): the matching is is_matched()'s."""
    a = Arm.parse(arm)
    return a.kind, a.target, a.ratio


def arm_signs(arm: str) -> tuple[int, int, str]:
    """(intended sign of the arm's move on its check mediator, predicted sign of its effect on attention
    entropy, the check mediator), from its kind's row of qkgeom.arms.KINDS: a lower temperature (ratio
    < 1) lowers the logit scale and raises entropy; the other kinds move both the same way."""
    a = Arm.parse(arm)
    return a.move, a.predicted, a.check


def is_matched(arm: str) -> bool:
    """Whether the arm ran at matched logit scale (intervention.match_scale, or match_row_std: `:closed`)."""
    return Arm.parse(arm).matching != ""


def claim_id(arm: str, ref: str, what: str) -> str:
    """A contrast row's claim_id: the arm, its reference and the statistic, free of the row's prose
    (`contract:interaction:0.4-none.attention_entropy`)."""
    return f"{arm}-{ref}.{what}"


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
            rule = Arm.parse(arm).spec.ratio  # a one-sided control: a ceiling below 1, a floor above it
            rel = (g["value"] - g["value_target"]) / g["value_target"]
            if rule == "below 1":
                err, what = rel.clip(lower=0).max(), "largest excess above the ceiling"
            elif rule == "above 1":
                err, what = (-rel).clip(lower=0).max(), "largest shortfall below the floor"
            else:
                err, what = rel.abs().max(), "max relative error"
            active = float((rel.abs() < 1e-6).mean())
            rows.append(
                claim_row(
                    study="intervention",
                    claim=f"{arm}: achieved {metric} vs target",
                    claim_id=f"{arm}.control_error:{metric}",
                    group="all controlled heads",
                    window="whole",
                    value=err,
                    n=len(g),
                    detail=f"{what} over {g['run_id'].nunique()} runs x probes x heads; "
                    f"share of probes at the target (control active) {active:.2f}",
                )
            )
    return rows
