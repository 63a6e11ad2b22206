"""Robustness variants of a study's primary rows (issue 56): the same claim re-judged under another
reasonable choice (axis, window start, one budget or seed left out). A primary whose verdict changes
under any registered variant reads `choice-dependent`; robustness.csv keeps every variant's row.

A study registers its variant set in `[analysis] robustness` (names from the study's own VARIANTS);
an unregistered study gets no variants, and an unknown name is refused."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from qkgeom.analysis.claims import PARAMETRIC_ONLY
from qkgeom.analysis.runs import AnalysisError

TABLE = "robustness"  # robustness.csv beside claims.csv
COLUMNS = ["primary", "variant", "value", "ci_low", "ci_high", "n", "p_value", "p_sign_flip", "verdict", "same"]


def registered(analysis: dict, known: Iterable[str]) -> list[str]:
    """The variant families a study's [analysis] registers, checked against those its analysis knows."""
    names = list(analysis.get("robustness", []))
    unknown = [v for v in names if v not in set(known)]
    if unknown:
        raise AnalysisError(f"unknown robustness variant {unknown[0]!r} (known: {', '.join(known)})")
    return names


def _base(verdict: object) -> str:
    return str(verdict).removesuffix(PARAMETRIC_ONLY)


def variant_table(primary: dict[str, pd.Series], variants: Iterable[tuple[str, dict[str, pd.Series]]]) -> pd.DataFrame:
    """One row per (primary id, variant): the variant's estimate, interval, n, p, sign-flip p and
    verdict, and whether the verdict is the registered one's (`same`; `(parametric only)` ignored)."""
    rows = []
    for name, found in variants:
        for cid, r in found.items():
            rows.append({
                "primary": cid, "variant": name, "value": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                "n": r["n"], "p_value": r["p_value"], "p_sign_flip": r.get("p_sign_flip"), "verdict": r["verdict"],
                "same": _base(r["verdict"]) == _base(primary[cid]["verdict"]),
            })  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["primary"], kind="stable").reset_index(drop=True)


def reading(table: pd.DataFrame, cid: str) -> str:
    """A primary's word on its variants: `robust (k variants)`, `choice-dependent (j of k variants
    differ)`, or '' where none were registered."""
    mine = table[table["primary"] == cid]
    if mine.empty:
        return ""
    same = mine["same"].astype(str).str.lower().eq("true")
    differ = int((~same).sum())
    return (
        f"robust ({len(mine)} variants)"
        if differ == 0
        else f"choice-dependent ({differ} of {len(mine)} variants differ)"
    )
