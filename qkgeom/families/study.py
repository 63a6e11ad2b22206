"""The paper's claim 4 on our own runs: a study whose runs keep log-spaced checkpoints is read as one
checkpoint family per seed, through the Hugging Face path, and judged across seeds.

    <study>/family/<run_id>/export/step_<n>/   each kept checkpoint as a GPT-2 folder (qkgeom.families.export)
    <study>/family/<run_id>/analysis/          `qkgeom pretrained EXPORT --all-revisions` output
    <study>/family_seeds.csv                   per seed: early / late trends, across-heads correlations
    <study>/family_claims.csv                  the verdict rows (also in claims.csv, study = family)
    <study>/family_windows.csv                 F1 and F2 with the early window ending elsewhere (WINDOW_FACTORS)

Per seed (a run): Spearman rho of the paired contrast PR_Q - PR_K (layer mean, token level) against
log(1 + step) in the early window (step <= early_max_step) and in the late one, and the across-heads
Spearman rho of interaction rank with attention entropy at every revision (qkgeom.analysis.families.family_trends).
Across seeds: mean, 95% t-interval, mde_80 and a verdict by the sign rule. Both stages resume: a
revision already analysed (done.json) is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from qkgeom import config as C
from qkgeom.analysis import robustness as R
from qkgeom.analysis.families import (
    CONTRAST_SLOPE,
    CONTRAST_TREND,
    HEADS_LINK,
    WITHIN_LAYER_LINK,
    contrast_trends,
    family_trends,
    load_family,
)
from qkgeom.analysis.prereg import study_analysis
from qkgeom.analysis.rows import CLAIM_COLUMNS, claim_row, numeric_columns, seed_row
from qkgeom.analysis.runs import run_folders
from qkgeom.families.config import PretrainedConfig
from qkgeom.families.revisions import run_pretrained
from qkgeom.results import (
    FAMILY_CLAIMS_CSV,
    FAMILY_RECORD,
    FAMILY_SEEDS_CSV,
    RECORDS_DIR,
    DamagedRunError,
    RunDir,
    read_json,
    revision_name,
    write_table,
)

FAMILY_DIR = "family"
FAMILY_WINDOWS = "family_windows"  # <study>/family_windows.csv (window_sensitivity)
# where the early window may end, as multiples of the end it was analysed with (each tried in turn): at
# family-cpu's 1000, steps 300-3000, each with at least 5 of a run's 22 revisions on either side
WINDOW_FACTORS = (0.3, 0.5, 1.0, 2.0, 3.0)
# the claims of configs/study-family-cpu.toml
F1 = "F1 early trend of PR_Q - PR_K: " + CONTRAST_TREND
F2 = "F2 decay: early rho - late rho"
F3 = "F3 an early regime that decays (F1 and F2)"
F4 = "F4 interaction rank vs attention entropy across heads, pooled over revisions: " + HEADS_LINK
F5 = "F5 " + HEADS_LINK
F6 = "F6 late trend of PR_Q - PR_K: " + CONTRAST_TREND
PER_LAYER = "per layer: " + CONTRAST_TREND
# analysis v2 (issue 29), not pre-registered for family-cpu: unbounded decay, within-layer link (claim 4b)
F2_SLOPE = "F2u decay, unbounded (analysis v2): early slope - late slope of PR_Q - PR_K on log step"
F4_WITHIN = "F4w interaction rank vs normalised entropy within layer (analysis v2), pooled over revisions"
# each claim's claim_id (what a pre-registration names; with group and window it picks one row): F1, F6
# and the per-layer rows are one statistic in other windows or groups, as F4 and F5 are
CLAIM_IDS = {
    F1: "family:contrast_trend", F6: "family:contrast_trend", PER_LAYER: "family:contrast_trend",
    F2: "family:contrast_trend_decay", F3: "family:early_regime", F2_SLOPE: "family:contrast_slope_decay",
    F4: "family:heads_link", F5: "family:heads_link", F4_WITHIN: "family:within_layer_link",
}  # fmt: skip


def family_runs(path: str | Path) -> list[Path]:
    """The finished runs under `path` that kept at least C.MIN_FAMILY_REVISIONS checkpoints; [] if any
    finished run kept fewer (then the study is not a family study)."""
    runs, kept = [], []
    for d in (d for d in run_folders(path) if RunDir(d).is_done()):
        try:
            kept.append(len(read_json(RunDir(d).config).get("kept_checkpoints", [])))
        except (OSError, DamagedRunError):  # a damaged run: analyze names it and skips it
            continue
        runs.append(d)
    return runs if runs and min(kept) >= C.MIN_FAMILY_REVISIONS else []


def is_family_study(path: str | Path) -> bool:
    """Whether the finished runs under `path` kept log-spaced checkpoints (a family study)."""
    return bool(family_runs(path))


def analyse_families(
    path: str | Path, early_max_step: int = C.EARLY_MAX_STEP, progress: bool = True, **settings
) -> dict[str, Path]:
    """Export every run's kept checkpoints and analyse each run as a family; {run_id: analysis folder}.
    A study record that carries its family (analysis.records: family/<revision>/) is read as it is.
    settings: further PretrainedConfig fields (n_tokens, seq_len, ...; defaults: configs/pretrained.toml)."""
    return {run.name: _measure_family(path, run, early_max_step, progress, **settings) for run in family_runs(path)}


def _measure_family(path: str | Path, run: Path, early_max_step: int, progress: bool, **settings) -> Path:
    """One run measured as a family under `path`/family/<run>/ (its kept checkpoints exported, then read
    through `qkgeom pretrained --all-revisions`; both resume), or its record's family/ as it is."""
    from qkgeom.families.export import export_run

    if (run / FAMILY_RECORD).is_dir():
        return run / FAMILY_RECORD
    if not (run / "checkpoints").is_dir():
        raise DamagedRunError(
            f"{run} kept no checkpoints and no family measurements (a record written before its family "
            "was measured): delete it and run the study again to re-train that run"
        )
    base = Path(path) / FAMILY_DIR / run.name
    export, analysis = base / "export", base / "analysis"
    kept = read_json(RunDir(run).config)["kept_checkpoints"]
    if not all((export / revision_name(s) / "config.json").is_file() for s in kept):
        export_run(run, export)
    pc = PretrainedConfig(model=str(export), all_revisions=True, early_max_step=early_max_step, **settings)
    run_pretrained(pc, analysis, progress=progress, label=run.name)
    return analysis


def record_run(run: str | Path, results: str | Path, progress: bool = False, **settings) -> Path:
    """A finished run's record under `results`/runs/, written as the run finishes: for a run that kept a
    family's checkpoints, measured as a family first (while its checkpoints exist) and kept in it, so a
    sitting that ends early loses no run. settings: as analyse_families. Returns the record."""
    from qkgeom.analysis.records import write_record

    run, dest = Path(run), Path(results) / RECORDS_DIR
    if len(read_json(RunDir(run).config).get("kept_checkpoints", [])) < C.MIN_FAMILY_REVISIONS:
        return write_record(run, dest)
    family = _measure_family(run.parent, run, settings.pop("early_max_step", C.EARLY_MAX_STEP), progress, **settings)
    return write_record(run, dest, family=family)


def early_max_step_of(analysis: Path) -> int:
    """The early window a family was analysed with (each revision's config.json records it)."""
    first = next(d for d in sorted(analysis.iterdir()) if RunDir(d).is_done())
    return int(read_json(RunDir(first).config)["pretrained_config"]["early_max_step"])


def family_folder(path: str | Path, run: Path) -> Path:
    """Where a run's family measurement lies: in its study record (family/), else under
    `path`/family/<run>/analysis/ (analyse_families)."""
    return run / FAMILY_RECORD if (run / FAMILY_RECORD).is_dir() else Path(path) / FAMILY_DIR / run.name / "analysis"


def has_families(path: str | Path) -> bool:
    """Whether any run under `path` has been measured as a family."""
    return any(family_folder(path, run).is_dir() for run in family_runs(path))


class Family(NamedTuple):
    """One run measured as a family: its record folder, seed, every revision's geometry rows, the
    revisions (name, step) and the analysis folder they were read from."""

    run: Path
    seed: int
    geometry: pd.DataFrame
    revisions: pd.DataFrame
    analysis: Path


def read_families(path: str | Path) -> list[Family]:
    """Every run under `path` analysed as a family so far, each read once."""
    families = []
    for run in family_runs(path):
        analysis = family_folder(path, run)
        if analysis.is_dir():
            geometry, revs = load_family(analysis)
            seed = read_json(RunDir(run).config)["config"]["train"]["seed"]
            families.append(Family(run, seed, geometry, revs, analysis))
    return families


def seed_statistics(families: list[Family]) -> pd.DataFrame:
    """One row per (run, statistic, window, layer): rho of each run's family trends (in the early
    window it was analysed with), with its seed and, for per-revision rows, the revision's step."""
    frames = []
    for f in families:
        early_max_step = early_max_step_of(f.analysis)
        t = family_trends(f.geometry, early_max_step)
        t["early_max_step"] = early_max_step
        steps = dict(zip(f.revisions["revision"], f.revisions["step"], strict=True))
        t["step"] = t["window"].map(steps)  # per-revision rows; NaN for the early / late trend rows
        t["run_id"], t["seed"] = f.run.name, f.seed
        frames.append(t)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _seed_row(v: np.ndarray, claim: str, group: str, win: str, sign: int | None, note: str) -> dict:
    """A family claim over per-seed values; F2 (a difference of rhos) on the t scale, the rest as
    correlations (Fisher z, bounded)."""
    cid = CLAIM_IDS[claim]
    return seed_row(
        v, study="family", claim=claim, claim_id=cid, group=group, window=win, sign=sign, note=note,
        detail=f"per-seed values {np.round(v, 4).tolist()}", correlation=cid != CLAIM_IDS[F2],
    )  # fmt: skip


def family_claims(seeds: pd.DataFrame) -> pd.DataFrame:
    """The verdict rows of configs/study-family-cpu.toml (F1-F6) from seed_statistics."""
    if seeds.empty:
        return pd.DataFrame(columns=CLAIM_COLUMNS)
    early_max_step = int(seeds["early_max_step"].max())
    trend = seeds[seeds["statistic"] == CONTRAST_TREND]
    mean = trend[trend["layer"] == "mean"].pivot_table(index="seed", columns="window", values="rho")
    early_note, late_note = f"steps <= {early_max_step}", f"steps > {early_max_step}"
    rows = []
    if "early" in mean:
        early = mean["early"].dropna().to_numpy()
        rows.append(_seed_row(early, F1, "layer mean", "early", +1, early_note))
    if {"early", "late"} <= set(mean):
        both = mean[["early", "late"]].dropna()
        windows = f"{early_note} vs {late_note}"
        decay = (both["early"] - both["late"]).to_numpy()
        rows.append(_seed_row(decay, F2, "layer mean", "early vs late", +1, windows))
        f1, f2 = rows[0]["verdict"], rows[1]["verdict"]
        joint = "fails" if "fails" in (f1, f2) else "holds" if f1 == f2 == "holds" else "inconclusive"
        detail = f"F1 {f1}, F2 {f2}: holds if both hold, fails if either fails"
        rows.append(
            claim_row(study="family", claim=F3, claim_id=CLAIM_IDS[F3], group="layer mean", window="early vs late",
                      value=np.nan, n=len(both), detail=detail,
                      predicted="+", verdict=joint, window_start=windows)
        )  # fmt: skip
        rows.append(_seed_row(both["late"].to_numpy(), F6, "layer mean", "late", None, late_note))
    slopes = seeds[seeds["statistic"] == CONTRAST_SLOPE]
    if "slope" in slopes and len(slopes):
        sm = slopes[slopes["layer"] == "mean"].pivot_table(index="seed", columns="window", values="slope")
        if {"early", "late"} <= set(sm):
            d = (sm["early"] - sm["late"]).dropna().to_numpy()
            rows.append(
                seed_row(d, study="family", claim=F2_SLOPE, claim_id=CLAIM_IDS[F2_SLOPE], group="layer mean",
                         window="early vs late", sign=+1,
                         note=f"{early_note} vs {late_note}", detail=f"per-seed values {np.round(d, 4).tolist()}")
            )  # fmt: skip
    within = seeds[seeds["statistic"] == WITHIN_LAYER_LINK]
    within = within[within["step"] > 0] if "step" in within else within.iloc[:0]
    if len(within):
        v = within.groupby("seed")["rho"].mean().to_numpy()
        rows.append(_seed_row(v, F4_WITHIN, "all heads", "revisions after step 0", +1, "layer means removed"))
    heads = seeds[seeds["statistic"] == HEADS_LINK]
    heads = heads[heads["step"] > 0] if "step" in heads else heads.iloc[:0]  # step 0: the random init
    if len(heads):
        pooled = heads.groupby("seed")["rho"].mean().to_numpy()
        note = "mean over a seed's revisions after step 0"
        rows.append(_seed_row(pooled, F4, "all heads", "revisions after step 0", +1, note))
        for step, g in heads.groupby("step"):
            win = f"step {int(step)}"
            rows.append(_seed_row(g["rho"].to_numpy(), F5, "all heads", win, +1, f"revision step_{int(step)}"))
    for (win, layer), g in trend[trend["layer"] != "mean"].groupby(["window", "layer"]):
        note = early_note if win == "early" else late_note
        sign = +1 if win == "early" else None  # F1 per layer (analysis.layers reads it); late: descriptive
        rows.append(_seed_row(g["rho"].to_numpy(), PER_LAYER, f"layer {layer}", win, sign, note))
    rows += _per_layer_decay(trend, early_note, late_note)
    return numeric_columns(pd.DataFrame(rows, columns=CLAIM_COLUMNS))


def _per_layer_decay(trend: pd.DataFrame, early_note: str, late_note: str) -> list[dict]:
    """F2 per layer (analysis.layers gives the pooled primaries per-layer rows): each layer's early rho -
    late rho, per seed, judged as the layer-mean row is (t scale)."""
    rows = []
    for layer, g in trend[trend["layer"] != "mean"].groupby("layer"):
        by = g.pivot_table(index="seed", columns="window", values="rho")
        if {"early", "late"} <= set(by):
            both = by[["early", "late"]].dropna()
            decay = (both["early"] - both["late"]).to_numpy()
            rows.append(_seed_row(decay, F2, f"layer {layer}", "early vs late", +1, f"{early_note} vs {late_note}"))
    return rows


def window_sensitivity(families: list[Family], factors: tuple[float, ...] = WINDOW_FACTORS) -> pd.DataFrame:
    """F1 (early trend) and F2 (early - late decay) of the layer mean and of each layer, judged as
    family_claims judges them, with the early window ending at each of `factors` times the end the
    families were analysed with: does claim 4's reading hang on where "early" ends? Exploratory: no
    pre-registration names these rows."""
    cols = ["early_max_step", "claim", "group", "value", "ci_low", "ci_high", "n", "seeds_agreeing", "p_value",
            "p_sign_flip", "verdict", "mde_80"]  # fmt: skip
    if not families or not factors:
        return pd.DataFrame(columns=cols)
    analysed_end = early_max_step_of(families[0].analysis)
    frames = []
    for split in (round(factor * analysed_end) for factor in factors):
        seeds = pd.concat(
            [contrast_trends(f.geometry, split).assign(seed=f.seed, early_max_step=split) for f in families],
            ignore_index=True,
        )
        c = family_claims(seeds)
        c = c[((c["claim_id"] == CLAIM_IDS[F1]) & (c["window"] == "early")) | (c["claim_id"] == CLAIM_IDS[F2])]
        frames.append(c.assign(early_max_step=split, claim=np.where(c["window"] == "early", "F1", "F2")))
    return pd.concat(frames, ignore_index=True)[cols]


def write_family_tables(path: str | Path, seeds: pd.DataFrame) -> pd.DataFrame:
    """seed_statistics `seeds` and family_claims of the families under `path`, written as CSV; the claims."""
    claims = family_claims(seeds)
    write_table(path, Path(FAMILY_SEEDS_CSV).stem, seeds)
    write_table(path, Path(FAMILY_CLAIMS_CSV).stem, claims)
    return claims


def family_geometry(path: str | Path) -> pd.DataFrame:
    """Every family's whole-layer and per-head rows, with run_id and seed (for the report's figures)."""
    frames = [f.geometry.assign(run_id=f.run.name, seed=f.seed) for f in read_families(path)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def analyze_study(path: str | Path):
    """analysis.study.analyze of a folder of runs, with a family study's trends among its claims (the
    families wing adds them: the analysis wing does not import it). Returns the Analysis."""
    from qkgeom.analysis.study import analyze

    path = Path(path)
    if not has_families(path):
        return analyze(path)
    families = read_families(path)  # read once: the claims, each seed left out of them, the windows
    measured: dict[str, pd.DataFrame] = {}

    def family_parts(p: Path) -> list[pd.DataFrame]:  # inside analyze's claims stage (its status line)
        measured["seeds"] = seed_statistics(families)
        return [write_family_tables(p, measured["seeds"])]

    a = analyze(path, extra=family_parts)
    seeds = measured["seeds"]
    write_table(path, FAMILY_WINDOWS, window_sensitivity(families))
    if variants := R.registered(study_analysis(path), R.MAIN_VARIANTS):  # analysis.robustness
        R.only_seed_variant(variants)
        table = R.leave_one_seed_out(
            a.claims, sorted(seeds["seed"].unique()), lambda s: family_claims(seeds[seeds["seed"] != s])
        )
        write_table(path, R.TABLE, table)
    return a
