"""Spectral rows set beside those of the 2025-26 literature: weight rank against realised rank, and
the per-matrix heavy-tail exponent and PR over training (the "spectral lifecycle").

- **Energy ranks.** Per head, the number of components carrying 90% of the energy of W_Q W_K^T
  (`interaction_energy_rank90`, weights) and of the probe batch's row-centred Q K^T logits
  (`logit_energy_rank90`, data), side by side with their ratio weights / data.
- **Lifecycle.** Per layer and step, alpha of each projection's whole matrix (head = -1 rows) and its
  mean per-head PR, for W_Q, W_K, W_V, W_O (W_O not for BERT, whose output projection sits outside
  its attention module).
"""

from __future__ import annotations

import pandas as pd

WEIGHT_RANK, DATA_RANK = "interaction_energy_rank90", "logit_energy_rank90"
MATRICES = {
    "W_Q": ("query_weight_alpha", "query_weight_participation_ratio"),
    "W_K": ("key_weight_alpha", "key_weight_participation_ratio"),
    "W_V": ("value_weight_alpha", "value_weight_participation_ratio"),
    "W_O": ("output_weight_alpha", "output_weight_participation_ratio"),
}
_NOT_A_SITE = ("norm_folded",)  # the q/k-norm-folded weights are a second reading, not the model


def _last(g: pd.DataFrame) -> pd.DataFrame:
    """Rows of the last probe (the largest step), where there is a step column."""
    if "step" in g and g["step"].notna().any():
        return g[g["step"] == g["step"].max()]
    return g


def energy_ranks(geometry: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, head) at the last probe: weight_rank90 (W_Q W_K^T), data_rank90 (row-centred logits,
    averaged over the logit sample's sequences) and ratio = weights / data. Empty if either is missing."""
    g = _last(geometry)
    g = g[(g["head"] >= 0) & ~g["site"].isin(_NOT_A_SITE)]
    out = {}
    for col, metric in (("weight_rank90", WEIGHT_RANK), ("data_rank90", DATA_RANK)):
        rows = g[g["metric"] == metric]
        if rows.empty:
            return pd.DataFrame(columns=["layer", "head", "weight_rank90", "data_rank90", "ratio"])
        out[col] = rows.groupby(["layer", "head"])["value"].mean()
    table = pd.DataFrame(out).reset_index()
    table["ratio"] = table["weight_rank90"] / table["data_rank90"]
    return table


def lifecycle(geometry: pd.DataFrame) -> pd.DataFrame:
    """Per (matrix, layer, step): alpha of the layer's whole matrix and the mean per-head PR (the
    convention the run used), for the projections the geometry has. Columns: matrix, layer, step,
    alpha, pr."""
    g = geometry[~geometry["site"].isin(_NOT_A_SITE) & (geometry["head"] == -1)]
    frames = []
    for matrix, (alpha, pr) in MATRICES.items():
        part = g[g["metric"].isin([alpha, pr])]
        if part.empty:
            continue
        wide = part.pivot_table(index=["layer", "step"], columns="metric", values="value", dropna=False)
        frames.append(
            pd.DataFrame(
                {
                    "matrix": matrix,
                    "alpha": wide[alpha] if alpha in wide else float("nan"),
                    "pr": wide[pr] if pr in wide else float("nan"),
                }
            ).reset_index()
        )
    if not frames:
        return pd.DataFrame(columns=["matrix", "layer", "step", "alpha", "pr"])
    return pd.concat(frames, ignore_index=True)[["matrix", "layer", "step", "alpha", "pr"]]
