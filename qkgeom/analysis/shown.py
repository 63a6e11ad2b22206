"""What a report shows beyond the claims, computed by the analysis so that the report only draws
(issue 55: measure < judge < draw): the context row of every run, the spectral tables of the first
unconstrained run (weight rank against realised rank, the alpha / PR lifecycle), the lifecycle by
depth over every unconstrained run, and for a single run the per-layer table with the window it
covers. `shown` computes them; analyze writes energy_ranks.csv and lifecycle_depth.csv beside
the claims."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from qkgeom.analysis import claims as A
from qkgeom.analysis import spectral
from qkgeom.analysis.context import study_context
from qkgeom.results import RECORDS_DIR

MIN_WINDOW_PROBES = 3  # probes a window needs for the single-run table's slopes


@dataclass
class Shown:
    context: pd.DataFrame  # analysis.context.study_context, one row per run
    spectral_run: str = ""  # the run the spectral tables describe: the first unconstrained run (lowest seed)
    energy_ranks: pd.DataFrame | None = None  # at its last probe (spectral.energy_ranks), with run_id
    lifecycle: pd.DataFrame | None = None  # spectral.lifecycle of that run
    lifecycle_depth: pd.DataFrame | None = None  # spectral.lifecycle_depth of every unconstrained run
    run_window: str = ""  # one run: the window its per-layer table covers, in words
    run_per_layer: pd.DataFrame | None = None  # one run: per_run_statistics over that window


def run_folder(path: Path, run_id: str) -> Path:
    """The folder of `run_id`: a sub-folder of the analysed path (or of its records, runs/), or the path
    itself for one run."""
    for folder in (path / run_id, path / RECORDS_DIR / run_id):
        if folder.is_dir():
            return folder
    return path


def unconstrained(g: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs without an intervention (all rows where the table has no intervention column)."""
    return g[g["intervention"] == "none"] if "intervention" in g else g


def shown(path: Path, geometry: pd.DataFrame, per_run: pd.DataFrame) -> Shown:
    """Every table the report shows besides the claims, for the analysed folder `path` (geometry with
    transient ends; per_run: the post-transient per_run_statistics analyze computed)."""
    runs = {rid: run_folder(path, rid) for rid in sorted(geometry["run_id"].unique())}
    out = Shown(context=study_context(runs, geometry))
    base = unconstrained(geometry)
    base = geometry if base.empty and len(runs) == 1 else base  # one constrained run: its own spectra
    if len(base):
        out.spectral_run = base.sort_values(["seed", "run_id"])["run_id"].iloc[0]
        rows = base[base["run_id"] == out.spectral_run]
        out.energy_ranks = spectral.energy_ranks(rows).assign(run_id=out.spectral_run)
        out.lifecycle = spectral.lifecycle(rows)
        starts = base.groupby("run_id")["transient_end"].first().to_dict()  # as analyze detected them
        out.lifecycle_depth = spectral.lifecycle_depth(base, starts)
    if len(runs) == 1:
        start = int(geometry["transient_end"].iloc[0])
        n_post = geometry.loc[geometry["step"] >= start, "step"].nunique()
        out.run_window, out.run_per_layer = f"the post-transient window (from step {start})", per_run
        if n_post < MIN_WINDOW_PROBES:  # e.g. a short run whose transient ends at its last probe
            out.run_per_layer = A.per_run_statistics(A.window(geometry, "whole"))
            out.run_window = (f"the whole run: the post-transient window (from step {start}) holds {n_post} "
                              f"probe(s), too few for a slope (at least {MIN_WINDOW_PROBES})")  # fmt: skip
    return out
