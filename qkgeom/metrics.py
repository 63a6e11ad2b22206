"""The metrics that tables, figures and dashboards name, one row each: the short label they print,
the unit, whether a PR or alpha convention shapes the value (its rows' `note` then names it), and
whether it is gauge-invariant (unchanged under W_Q -> W_Q M, W_K -> W_K M^-T, which leaves every
attention score unchanged). docs/GLOSSARY.md defines each; tests/e2e/test_glossary.py checks that the
two agree and that every metric a run emits has a glossary entry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    label: str
    """What a figure, table column or dashboard calls it."""
    unit: str = ""
    """Empty for a dimensionless number."""
    convention: bool = False
    """Shaped by the PR convention (variance / singular) or the alpha convention."""
    gauge_invariant: bool = False
    """Depends on W_Q and W_K only through W_Q W_K^T (and so on the attention scores alone)."""


METRICS: dict[str, Metric] = {
    "query_participation_ratio": Metric("PR_Q", convention=True),
    "key_participation_ratio": Metric("PR_K", convention=True),
    "participation_ratio_contrast": Metric("PR_Q - PR_K", convention=True),
    "attention_entropy": Metric("attention entropy", "nats", gauge_invariant=True),
    "attention_entropy_normalised": Metric("entropy / uniform", gauge_invariant=True),
    "logit_participation_ratio": Metric("logit PR", convention=True, gauge_invariant=True),
    "logit_row_std": Metric("per-row logit std", gauge_invariant=True),
    "input_logit_scale": Metric("input-weighted logit scale", "logits²", gauge_invariant=True),
    "interaction_rank": Metric("interaction rank", convention=True, gauge_invariant=True),
    "query_weight_alpha": Metric("alpha of W_Q", convention=True),
    "key_weight_alpha": Metric("alpha of W_K", convention=True),
}


def metric_label(metric: str) -> str:
    """The metric's label with its unit, e.g. `attention entropy (nats)`; an unlisted metric: its name."""
    m = METRICS.get(metric)
    if m is None:
        return metric
    return f"{m.label} ({m.unit})" if m.unit else m.label
