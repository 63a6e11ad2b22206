"""A study's pre-registered primary family: which claims rows it names (primary_mask), which of them
can be read (readable), and Holm over them on a p their n can reach (error_control_p, adjust_primary)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.rows import PARAMETRIC_ONLY
from qkgeom.analysis.runs import AnalysisError


def primary_mask(claims: pd.DataFrame, primary: list[dict]) -> pd.Series:
    """The rows a pre-registration names primary: each spec {id, claim_id, group, window} picks the
    judged row of that claim_id (and group / window, where given), never by the row's wording."""
    hit = pd.Series(False, index=claims.index)
    ids = claims["claim_id"].astype(str) if "claim_id" in claims else pd.Series("", index=claims.index)
    for spec in primary:
        if "claim_id" not in spec:
            raise AnalysisError(f"pre-registered primary {spec.get('id', '?')} names no claim_id")
        m = (ids == spec["claim_id"]) & (claims["verdict"].astype(str) != "")
        for key in ("group", "window"):
            if key in spec:
                m &= claims[key].astype(str) == spec[key]
        hit |= m
    return hit


JUDGED = ("holds", "fails", "inconclusive")  # a row read by its own test; anything else is unreadable


def plain_verdict(verdict: object) -> str:
    """A verdict without its n-aware qualifier: `holds (parametric only)` -> `holds`."""
    return str(verdict).removesuffix(PARAMETRIC_ONLY)


def readable(verdict: object) -> bool:
    """Whether a row's verdict reads its outcome (holds / fails / inconclusive, n-aware or not). A row
    whose manipulation or scale check failed (`scale not matched (...)`, `manipulation failed`) says
    nothing about its claim and enters no Holm family."""
    return plain_verdict(verdict) in JUDGED


def error_control_p(p_value: object, p_sign_flip: object) -> float:
    """The p a family-wise adjustment reads: the larger of the row's own test p and its exact
    sign-flip p, so a row whose n cannot reach 0.05 without normality (floor 2 / 2^n) cannot survive
    Holm on the parametric p alone. Without a sign-flip p (no per-seed values), the row's own p."""
    p, flip = pd.to_numeric(pd.Series([p_value, p_sign_flip]), errors="coerce")
    return float(np.fmax(p, flip))


def adjust_primary(claims: pd.DataFrame, primary: list[dict], strict: bool = True) -> pd.DataFrame:
    """Mark a study's pre-registered primary rows (primary_mask; `primary` holds the row's id) and
    give the readable ones Holm-adjusted p over that family (p_holm, from error_control_p): the
    family-wise error of the study's confirmatory claims, whatever their dependence. An unreadable
    primary row (readable) keeps its id and gets no p_holm. strict: a spec that picks no judged row, or
    more than one, is an error (a reworded claim would otherwise leave its family in silence); off only
    for a blind study, whose primary rows are hidden until its registered n is in."""
    out = claims.copy()
    out["primary"], out["p_holm"] = "", np.nan
    for spec in primary:
        hit = primary_mask(out, [spec])
        if strict and hit.sum() != 1:
            raise AnalysisError(
                f"pre-registered primary {spec['id']} ({spec['claim_id']!r}) picks {int(hit.sum())} judged rows of the "
                "claims table, not 1: name its group and window, or the claim_id the analysis writes"
            )
        out.loc[hit, "primary"] = spec["id"]
    rows = (out["primary"] != "") & out["verdict"].map(readable)
    if rows.any():
        flip = out.loc[rows, "p_sign_flip"] if "p_sign_flip" in out else pd.Series(np.nan, index=out.index)[rows]
        p = [error_control_p(a, b) for a, b in zip(out.loc[rows, "p_value"], flip, strict=True)]
        out.loc[rows, "p_holm"] = stats.holm(np.array(p))
    return out
