"""Per-layer rows of a pooled primary (issue 56): a primary that averages layers (P1, T1-T3, L3) gets
one row per layer, over the same seeds and window, judged like the pooled row, with Holm over the
claim's layers (its own family, secondary to the study's). Where layers move in opposite directions
the pooled row is their net, and `sign_reading` says so.

per_layer.csv columns: the claims columns of each layer row, `primary` (the pooled row's id) and
`p_holm_layers`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.primary import error_control_p, readable
from qkgeom.analysis.robustness import pooled_primaries
from qkgeom.analysis.rows import rows_table, seed_row

TABLE = "per_layer"  # per_layer.csv beside claims.csv


def layer_rows(
    cid: str,
    claim: str,
    claim_id: str,
    per_seed: dict[str, pd.Series],
    *,
    sign: int,
    window: str,
    margin: float = np.nan,
) -> pd.DataFrame:
    """A pooled primary's per-layer rows: per_seed maps a group ("layer 2") to its per-seed values
    (index: seed). Each row goes through seed_row; p_holm_layers is Holm over the claim's readable
    layer rows on error_control_p (the larger of p and the sign-flip p)."""
    rows = [
        seed_row(
            v.dropna().to_numpy(float), study="layers", claim=f"{cid} per layer: {claim}", claim_id=claim_id,
            group=group, window=window, sign=sign, note="", margin=margin,
            detail=f"per-seed {np.round(v.to_numpy(float), 4).tolist()}",
        )
        for group, v in per_seed.items()
    ]  # fmt: skip
    out = rows_table(rows).assign(primary=cid)
    ok = out["verdict"].map(readable)
    p = [error_control_p(a, b) if r else np.nan for a, b, r in zip(out["p_value"], out["p_sign_flip"], ok, strict=True)]
    return out.assign(p_holm_layers=stats.holm(np.array(p, float)))


def slope_layer_rows(per_run: pd.DataFrame, claims: pd.DataFrame, margin: float = np.nan) -> pd.DataFrame:
    """Per-layer rows of the study's pooled slope primaries (robustness.pooled_primaries of the claims
    table adjust_primary marked), from per_run_statistics rows of their post-transient window: per
    seed, the mean over its runs at that layer (a study of several depths keys its layers by depth)."""
    parts = []
    depths = per_run["n_layers"].nunique() if len(per_run) else 0
    for r, kind in pooled_primaries(claims):
        if kind[0] != "slope":
            continue
        _, metric, sign = kind
        per_seed = {
            (f"layer {layer}" if depths == 1 else f"depth {depth} layer {layer}"): g.groupby("seed")[
                f"slope:{metric}"
            ].mean()
            for (depth, layer), g in per_run.groupby(["n_layers", "layer"])
        }
        parts.append(layer_rows(r.primary, r.claim, r.claim_id, per_seed, sign=sign, window=r.window, margin=margin))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def sign_reading(table: pd.DataFrame, cid: str) -> str:
    """Whether a pooled primary's layers disagree in sign: `disagree in sign` where some layers' 95%
    intervals lie above 0 and others' below it; `estimates differ in sign` where only the point
    estimates do; else `agree in sign`. '' where the claim has no per-layer rows."""
    mine = table[table["primary"] == cid]
    if mine.empty:
        return ""
    names = mine["group"].astype(str).str.removeprefix("layer ")
    value = pd.to_numeric(mine["value"])

    def sides(up: pd.Series, down: pd.Series) -> str:
        return f"+ in {', '.join(names[up])}; - in {', '.join(names[down])}"

    up, down = pd.to_numeric(mine["ci_low"]) > 0, pd.to_numeric(mine["ci_high"]) < 0
    if up.any() and down.any():
        return f"disagree in sign ({sides(up, down)})"
    if (value > 0).any() and (value < 0).any():
        return f"estimates differ in sign ({sides(value > 0, value < 0)}), no two intervals do"
    return f"agree in sign ({len(mine)} layers)"
