"""One row of a claims table: its columns, its builders (claim_row; seed_row over per-seed values: mean,
t-intervals, the exact sign-flip p, mde_80, the verdict), what an inconclusive row may say (reading, TOST
at a pre-registered margin) and the n-aware verdict label. Every claims table in qkgeom is built here;
analysis.claims, causal, matched, ladder, layers and families.study say what the rows are."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats

CLAIM_COLUMNS = [
    "study", "claim", "claim_id", "predicted", "group", "window", "value", "ci_low", "ci_high", "n", "seeds_agreeing",
    "interval", "p_value", "verdict", "mde_80", "window_start", "detail",
    # what an inconclusive row can say (TOST at a pre-registered margin), the small-n exact test, and
    # the family-wise adjustment over a study's pre-registered primary rows (analysis.primary.adjust_primary)
    "ci90_low", "ci90_high", "margin", "reading", "p_sign_flip", "p_floor", "primary", "p_holm",
    "per_seed",  # the per-seed values a row was computed from (space-separated), as data
]  # fmt: skip


def gauge_invariant(claim: str) -> bool:
    """True if a claim involves only gauge-invariant quantities (no PR_Q / PR_K)."""
    return "PR_Q" not in claim and "PR_K" not in claim


NUMERIC_COLUMNS = ("mde_80", "ci90_low", "ci90_high", "margin", "p_sign_flip", "p_floor", "p_holm")


def numeric_columns(out: pd.DataFrame) -> pd.DataFrame:
    """The claims table's numeric columns as numbers (rows without a verdict have none: NaN, not "")."""
    for col in NUMERIC_COLUMNS:
        if col in out:
            out[col] = pd.to_numeric(out[col], errors="coerce")
    return out


def rows_table(rows: list[dict]) -> pd.DataFrame:
    """Claims rows as a claims table: CLAIM_COLUMNS, numeric columns as numbers, gauge_invariant."""
    out = numeric_columns(pd.DataFrame(rows, columns=CLAIM_COLUMNS))
    out["gauge_invariant"] = out["claim"].map(gauge_invariant)
    return out


PARAMETRIC_ONLY = " (parametric only)"


def n_aware(verdict: str, p_floor: float) -> str:
    """A holds / fails verdict whose n cannot reach p < 0.05 without a distributional assumption (the
    exact sign-flip floor 2 / 2^n >= 0.05, n <= 5) reads `holds (parametric only)`: it rests on the
    t-test's normality alone (at n = 4, a skewed per-seed distribution gives the t-interval 82-88%
    coverage, not 95%)."""
    try:
        floor = float(p_floor)
    except (TypeError, ValueError):
        return verdict
    return verdict + PARAMETRIC_ONLY if verdict in ("holds", "fails") and floor >= 0.05 else verdict


def claim_row(
    *,
    study: str,
    claim: str,
    claim_id: str,
    group: str,
    window: str,
    value: float,
    lo: float = np.nan,
    hi: float = np.nan,
    n: int = 0,
    p: float = np.nan,
    detail: str = "",
    **extra,
) -> dict:
    """One row of the claims table (CLAIM_COLUMNS); fields not given are empty. claim_id: what the row
    estimates, free of its prose (a pre-registration names it; (claim_id, group, window) is one row)."""
    row = dict.fromkeys(CLAIM_COLUMNS, "")
    row.update(
        study=study, claim=claim, claim_id=claim_id, group=group, window=window, value=value, ci_low=lo, ci_high=hi, n=n
    )
    row.update(p_value=p, detail=detail, **extra)
    return row  # fmt: skip


def seed_row(
    v: np.ndarray,
    *,
    study: str,
    claim: str,
    claim_id: str,
    group: str,
    window: str,
    sign: int | None,
    note: str,
    margin: float = np.nan,
    correlation: bool = False,
    **kw,
) -> dict:
    """A claims row over per-seed values `v` (independent units): mean, 95% and 90% t-intervals over
    seeds, mde_80, the exact sign-flip p with the smallest p n seeds can reach, and (with a predicted
    sign) the seeds agreeing and the verdict. correlation: `v` are per-seed correlations, averaged
    through Fisher's z (the interval stays inside (-1, 1)). margin: a pre-registered equivalence
    margin; an inconclusive row then reads "rules out |effect| >= margin" only if its 90% interval
    lies inside +-margin (TOST), else "inconclusive, CI [lo, hi]". kw overrides any field."""
    v = np.asarray(v, float)
    v = v[np.isfinite(v)]
    if correlation:
        value, lo, hi = stats.fisher_z_mean_ci(v)
        _, lo90, hi90 = stats.fisher_z_mean_ci(v, 0.90)
        z = np.arctanh(np.clip(v, -0.999999, 0.999999))
        p, interval = stats.t_test_p(z), "95% t over seeds on Fisher z, back-transformed"
        equivalent = stats.inside_margin(lo90, hi90, margin)  # TOST on the correlation's own interval
    else:
        value = float(np.mean(v)) if len(v) else np.nan
        lo, hi = stats.t_mean_ci(v)
        lo90, hi90, equivalent = stats.tost(v, margin)
        p, interval = stats.t_test_p(v), "95% t over seeds"
    p_flip, p_floor = stats.sign_flip_p(v)
    extra = dict(
        interval=interval, mde_80=stats.mde(v), window_start=note, ci90_low=lo90, ci90_high=hi90,
        margin=margin, p_sign_flip=p_flip, p_floor=p_floor, per_seed=per_seed_text(v),
    )  # fmt: skip
    if sign is not None:
        agree = f"{int(np.sum(np.sign(v) == sign))}/{len(v)}"
        extra |= dict(predicted="+" if sign > 0 else "-", seeds_agreeing=agree, verdict=stats.verdict(lo, hi, sign))
    extra |= kw
    extra["reading"] = reading(extra.get("verdict", ""), len(v), lo, hi, margin, equivalent, lo90, hi90)
    p = extra.pop("p_value", p)
    return claim_row(
        study=study, claim=claim, claim_id=claim_id, group=group, window=window, value=value, lo=lo, hi=hi,
        n=len(v), p=p, **extra,
    )  # fmt: skip


def per_seed_text(v: np.ndarray) -> str:
    """Per-seed values as the claims table stores them: space-separated, 10 significant digits."""
    return " ".join(f"{x:.10g}" for x in np.asarray(v, float))


def per_seed_values(text: object) -> np.ndarray:
    """The per-seed values of a claims row's `per_seed` cell (empty where it has none; a CSV reader gives a
    one-seed cell as a number)."""
    if isinstance(text, (int, float, np.number)):
        return np.array([float(text)]) if np.isfinite(text) else np.array([])
    return np.array([float(x) for x in str(text).split()]) if isinstance(text, str) and text.strip() else np.array([])


def reading(
    verdict: str, n: int, lo: float, hi: float, margin: float, equivalent: bool, lo90: float, hi90: float
) -> str:
    """What a judged row may say beyond its verdict: an inconclusive row rules out |effect| >= margin
    only when equivalence holds (TOST: the 90% interval inside +-margin, margin pre-registered);
    otherwise it gives its interval and no more."""
    if not verdict:
        return ""
    if n == 0:
        return "no seed has enough probes in this window: train longer or probe more often"
    if verdict != "inconclusive":
        return ""
    if equivalent:
        return f"rules out |effect| >= {_g(margin)} (TOST: 90% CI [{_g(lo90)}, {_g(hi90)}] inside +-{_g(margin)})"
    return f"inconclusive, CI [{_g(lo)}, {_g(hi)}]" if np.isfinite(lo) else "inconclusive, no interval (n < 2)"


def apply_margin(claims: pd.DataFrame, margin: float) -> pd.DataFrame:
    """A study's pre-registered equivalence margin on every judged row that has none yet: an
    inconclusive row whose 90% interval lies inside +-margin then reads "rules out |effect| >= margin"
    (TOST); rows without a 90% interval (Fieller ratios) are left as they are."""
    if not np.isfinite(margin):
        return claims
    out = claims.copy()
    lo90 = pd.to_numeric(out["ci90_low"], errors="coerce")
    hi90 = pd.to_numeric(out["ci90_high"], errors="coerce")
    todo = (
        out["verdict"].isin(["holds", "fails", "inconclusive"]) & pd.to_numeric(out["margin"], errors="coerce").isna()
    )
    todo &= lo90.notna() & hi90.notna()
    for i in out.index[todo]:
        r = out.loc[i]
        equivalent = stats.inside_margin(float(lo90[i]), float(hi90[i]), margin)
        out.loc[i, "margin"] = margin
        out.loc[i, "reading"] = reading(
            r["verdict"], int(r["n"]), float(r["ci_low"]), float(r["ci_high"]), margin, equivalent,
            float(lo90[i]), float(hi90[i]),
        )  # fmt: skip
    return out


def _g(x: float) -> str:
    return f"{x:.3g}"
