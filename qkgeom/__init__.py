"""qkgeom: measure and causally steer the geometry of queries and keys in Transformer attention."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

try:
    __version__ = importlib.metadata.version("qkgeom")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"


def __getattr__(name: str):
    """`qkgeom.Probe` (qkgeom.probing.tracking), imported on first use: a bare `import qkgeom` stays light."""
    if name == "Probe":
        from qkgeom.probing.tracking import Probe

        return Probe
    raise AttributeError(f"module 'qkgeom' has no attribute {name!r}")


def load_runs(path: str | Path) -> pd.DataFrame:
    """Tidy geometry rows of every finished run under `path` (see qkgeom.analysis.claims.load_runs)."""
    from qkgeom.analysis.claims import load_runs as _load_runs

    return _load_runs(path)


def measure(
    q,
    k,
    pattern=None,
    causal: bool = True,
    w_q=None,
    w_k=None,
    pr_convention: str = "variance",
    alpha_convention: str = "weightwatcher",
    window: int | None = None,
) -> pd.DataFrame:
    """Geometry rows from your own q, k (and pattern), from any model (see qkgeom.probing.probe.measure);
    pr_convention: `variance` (default) or `singular` participation ratios; alpha_convention:
    `weightwatcher` (default: WeightWatcher 0.7.7's fit) or `clauset` heavy-tail alphas; window: a
    sliding-window layer's keys per query (query t sees keys t - window < j <= t)."""
    from qkgeom.probing.probe import measure as _measure

    return _measure(q, k, pattern, causal, w_q, w_k, pr_convention, alpha_convention, window)


def analyse(
    model,
    batches,
    logit_max_seqs: int | None = 4,
    pr_convention: str = "variance",
    alpha_convention: str = "weightwatcher",
) -> pd.DataFrame:
    """Geometry rows of a supported Hugging Face model already in memory (see the README's table),
    streamed over `batches` of input ids (B, T): layer, head, site, metric, value. The model's own
    attention is used (captured through transformers' attention interface); nothing is written.
    For other models, read q, k with hooks and call `measure`."""
    import pandas as pd

    from qkgeom.config import ProbeSettings
    from qkgeom.probing.hf import analyse_model

    settings = ProbeSettings.of(logit_max_seqs, pr_convention, alpha_convention)
    rows, _ = analyse_model(model, iter(batches), settings=settings)
    return pd.DataFrame(rows)
