"""Per-layer rows of a pooled primary (issue 56): a primary that averages layers (P1, T1-T4, L3, L4,
O1, O2, F1, F2) gets one row per layer, over the same seeds and window, judged like the pooled row,
with Holm over the claim's layers (its own family, secondary to the study's). Where layers move in
opposite directions the pooled row is their net, and `sign_reading` says so.

per_layer.csv columns: the claims columns of each layer row, `primary` (the pooled row's id) and
`p_holm_layers`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.claims import comovement_per_seed, comovement_table
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
    return with_layer_holm(rows_table(rows).assign(primary=cid))


def with_layer_holm(rows: pd.DataFrame) -> pd.DataFrame:
    """One claim's layer rows with p_holm_layers: Holm over its readable rows on error_control_p (the
    larger of p and the sign-flip p); an unreadable row enters no family (NaN)."""
    ok = rows["verdict"].map(readable)
    p = [error_control_p(a, b) if r else np.nan for a, b, r in zip(rows["p_value"], rows["p_sign_flip"], ok,
                                                                     strict=True)]  # fmt: skip
    return rows.assign(p_holm_layers=stats.holm(np.array(p, float)))


def slope_layer_rows(window: pd.DataFrame, per_run: pd.DataFrame, claims: pd.DataFrame, margin: float) -> pd.DataFrame:
    """Per-layer rows of the study's pooled slope and co-movement primaries (robustness.pooled_primaries
    of the claims table adjust_primary marked), on their post-transient `window` rows. Slopes from its
    per_run_statistics `per_run`: per seed, the mean over its runs at that layer (a study of several
    depths keys its layers by depth). Co-movement: comovement_per_seed of the layer's own series, as the
    pooled row averages them."""
    parts = []
    depths = per_run["n_layers"].nunique() if len(per_run) else 0

    def name(depth: int, layer: int) -> str:
        return f"layer {layer}" if depths == 1 else f"depth {depth} layer {layer}"

    for r, kind in pooled_primaries(claims):
        if kind[0] == "slope":
            per_seed = {name(depth, layer): g.groupby("seed")[f"slope:{kind[1]}"].mean()
                        for (depth, layer), g in per_run.groupby(["n_layers", "layer"])}  # fmt: skip
        else:
            per_seed = {name(depth, layer): pd.Series(comovement_per_seed(comovement_table(g), kind[1], kind[2])[0])
                        for (depth, layer), g in window.groupby(["n_layers", "layer"])}  # fmt: skip
        parts.append(layer_rows(r.primary, r.claim, r.claim_id, per_seed, sign=kind[-1], window=r.window,
                                margin=margin))  # fmt: skip
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


POOLED_GROUPS = ("mean over layers", "layer mean")
LAYER_GROUP = r"^layer[= ](\d+)$"  # a claim's row for one layer: `layer=2` (causal) or `layer 2` (family)


def claim_layer_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """Per-layer rows of the pooled primaries (group `mean over layers` or `layer mean`) whose claims
    table holds the same claim per layer (same claim_id and window): those rows as the study judged
    them, under `layer <i>`, with the pooled row's id and Holm over the claim's readable layer rows."""
    parts = []
    layered = claims["group"].astype(str).str.extract(LAYER_GROUP, expand=False)
    for r in claims[(claims["primary"] != "") & claims["group"].isin(POOLED_GROUPS)].itertuples(index=False):
        mine = claims[(claims["claim_id"] == r.claim_id) & (claims["window"] == r.window) & layered.notna()]
        if mine.empty:
            continue
        parts.append(with_layer_holm(mine.assign(group="layer " + layered[mine.index], primary=r.primary)))
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
