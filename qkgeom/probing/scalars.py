"""One number per metric per probe, for dashboards: the layer means that `qkgeom train --tensorboard`
and `qkgeom.Probe(..., tensorboard=DIR)` log as TensorBoard scalars.

A scalar is the mean over layers of the metric's whole-layer rows (head -1) at one site
(archs.one_site), so it can be recomputed from geometry.parquet:

    g = rows[(rows.step == s) & (rows.metric == m) & (rows.head == -1)]; one_site(g).value.mean()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.errors import QKGeomError
from qkgeom.metrics import metric_label
from qkgeom.probing.archs import one_site

# metric -> what the dashboard calls it (the tag is qkgeom/<metric>, the geometry.parquet name)
SCALARS = {
    m: metric_label(m)
    for m in (
        "query_participation_ratio", "key_participation_ratio", "participation_ratio_contrast", "attention_entropy",
        "interaction_rank", "query_weight_alpha", "key_weight_alpha",
    )
}  # fmt: skip


def layer_means(rows: list[dict[str, Any]] | pd.DataFrame) -> dict[str, float]:
    """{metric: mean over layers of its head -1 rows at one site} for the SCALARS a probe measured."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    whole = df[df["head"] == -1]
    out = {}
    for metric in SCALARS:
        values = one_site(whole[whole["metric"] == metric])["value"].dropna()
        if len(values):
            out[metric] = float(values.mean())
    return out


class TensorBoardLog:
    """Writes each probe's layer means as scalars `qkgeom/<metric>` at its step into `logdir`."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise QKGeomError(
                "TensorBoard logging needs the tensorboard package: pip install 'qkgeom[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(str(logdir))

    def write(self, step: int, rows: list[dict[str, Any]] | pd.DataFrame) -> dict[str, float]:
        means = layer_means(rows)
        for metric, value in means.items():
            self.writer.add_scalar(f"qkgeom/{metric}", value, step)
        self.writer.flush()
        return means

    def close(self) -> None:
        self.writer.close()
