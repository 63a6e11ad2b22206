"""The study driver: a folder of runs (or their records) in, judged tables out. `analyze` writes
summary, claims, verdicts (and the study's own tables) beside the runs; `verdicts` is the verdict
table; `ladder_tables` does the same for a token ladder; the format_* functions are what the command
line prints. Nothing here draws: report.study renders these tables (measure < judge < draw).

<dir>/summary.parquet|csv   seed-averaged layer trajectories
<dir>/claims.parquet|csv    the claims table (main and/or intervention study)
<dir>/verdicts.csv          one line per judged claim (verdicts)
<dir>/interim_checks.csv    instead of both, while a study is blind (fewer seeds than registered)
<dir>/energy_ranks.csv, lifecycle_depth.csv   what the report shows of the weight spectra (analysis.shown)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from qkgeom.analysis import causal, dose, layers, matched
from qkgeom.analysis import claims as A
from qkgeom.analysis import primary as P
from qkgeom.analysis import robustness as R
from qkgeom.analysis.prereg import study_analysis
from qkgeom.analysis.shown import Shown, shown
from qkgeom.results import SWEEP_MANIFEST, read_json, write_json, write_table

# a family study's headline rows (families.study's F1-F4), by (claim_id, group, window)
FAMILY_HEADLINE = {
    ("family:contrast_trend", "layer mean", "early"),
    ("family:contrast_trend_decay", "layer mean", "early vs late"),
    ("family:early_regime", "layer mean", "early vs late"),
    ("family:heads_link", "all heads", "revisions after step 0"),
}
INTERIM_CHECKS = "interim_checks"  # a blind study's table: its checks, without any outcome row
# what analyze is doing, on one status line of a terminal's stderr (a causal study's analysis takes ~20 s)
STAGES = ("loading the runs", "claims", "robustness variants", "per-layer tables", "what the report shows")
LADDER_STAGES = ("loading the runs", "claims and local slopes", "robustness variants")


@dataclass
class Analysis:
    path: Path
    geometry: pd.DataFrame
    metrics: pd.DataFrame
    trajectories: pd.DataFrame
    claims: pd.DataFrame
    sensitivity: pd.DataFrame
    skipped: list[str] = field(default_factory=list)
    horizon: pd.DataFrame | None = None
    # what the figures draw, computed here by the analysis (the report only draws)
    per_run: pd.DataFrame | None = None  # per (run, layer) post-transient statistics of the none runs
    slope_depth: pd.DataFrame | None = None  # claims.slope_by_depth of per_run: mean and 95% t by relative depth
    dose_points: pd.DataFrame | None = None  # per (seed, arm) window means (intervention studies)
    dose_slopes: pd.DataFrame | None = None  # per seed dose-response fit
    dose_summary: dict | None = None  # their mean, 95% t-interval and n (dose.dose_summary)
    matched_dose: pd.DataFrame | None = None  # causal v4: per (layer, arm) dose and entropy vs sham, 95% t
    blind: str = ""  # an incomplete study's outcomes hidden: "k of n seeds recorded; primary outcome hidden"
    shown: Shown | None = None  # context, spectral tables, a single run's table (analysis.shown)
    verdict_table: pd.DataFrame | None = None  # verdicts(claims): what verdicts.csv holds
    judged: pd.DataFrame | None = None  # verdict_rows(claims): the claims rows behind it, with their per_seed
    headline: pd.DataFrame | None = None  # an intervention study's one row per arm (causal.headline)

    @property
    def claims_path(self) -> Path:
        """The claims table analyze wrote: claims.csv, or interim_checks.csv while the study is blind."""
        return self.path / f"{INTERIM_CHECKS if self.blind else 'claims'}.csv"

    @property
    def is_intervention(self) -> bool:
        return self.geometry["intervention"].nunique() > 1


@contextmanager
def _status(stages: tuple[str, ...]) -> Iterator[Callable[[], None]]:
    """One line on a terminal's stderr, "analyze: i/n <stage> [elapsed]"; the function it gives moves it
    to the next of `stages`. Cleared on exit, an error's included; nothing off a terminal (tqdm's
    disable=None: a pipe, a log file, a notebook)."""
    with tqdm(total=len(stages), bar_format="analyze: {desc} [{elapsed}]", disable=None, leave=False) as bar:
        labels = iter(f"{i}/{len(stages)} {what}" for i, what in enumerate(stages, 1))
        bar.set_description_str(next(labels))

        def advance() -> None:
            bar.update(1)
            bar.set_description_str(next(labels))

        yield advance


def analyze(path: str | Path, extra: Callable[[Path], list[pd.DataFrame]] | None = None) -> Analysis:
    """Load every finished run under `path`, compute trajectories and claims, write the tables.
    extra: claims parts a higher wing adds (families.study.analyze_study: a family study's trends)."""
    with _status(STAGES) as advance:
        return _analyze(Path(path), extra, advance)


def _analyze(path: Path, extra: Callable[[Path], list[pd.DataFrame]] | None, advance: Callable[[], None]) -> Analysis:
    """analyze, stage by stage (advance: on to the next of STAGES)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", A.RunWarning)
        geometry = A.load_runs(path)
        metrics = A.load_metrics(path, runs=geometry["run_id"].unique())
    skipped = sorted({str(w.message) for w in caught if issubclass(w.category, A.RunWarning)})
    geometry = A.with_transient(geometry)
    traj = A.trajectories(geometry)
    base = geometry[geometry["intervention"] == "none"]
    advance()
    claims, tables = _claim_parts(path, geometry, metrics, extra)
    sens = tables.get("sensitivity", pd.DataFrame(columns=A.CLAIM_COLUMNS))
    pre = study_analysis(path)
    claims = A.apply_margin(claims, float(pre.get("margin", np.nan)))  # the pre-registered TOST margin, if any
    claims, blind = _blind_until_complete(path, geometry, claims, tables)
    claims = A.numeric_columns(P.adjust_primary(claims, pre.get("primary", []), strict=not blind))
    judged = verdict_rows(claims)
    tables["verdicts"] = verdicts(judged, select=False)
    advance()
    if (families := R.registered(pre, R.MAIN_VARIANTS)) and not blind and extra is None:  # analysis.robustness
        tables[R.TABLE] = _variants(path, geometry, metrics, claims, float(pre.get("margin", np.nan)), families)
    if "matched_dose" in tables:  # the per-layer checks, each arm against the sham
        tables["scale_check"] = claims[claims["claim_id"].str.contains(r"-sham\.(?:scale_check|delivered_dose):")]
    written = {"summary": traj, "claims": claims, **tables}
    if blind:  # no claims.csv or verdicts.csv until the registered n is in: the checks go to their own table
        written = {"summary": traj, INTERIM_CHECKS: claims}
    advance()
    post = A.window(base if len(base) else geometry, "post-transient")
    per_run = A.per_run_statistics(post)
    by_layer = pd.concat([layers.slope_layer_rows(post, per_run, claims, float(pre.get("margin", np.nan))),
                          layers.claim_layer_rows(claims)], ignore_index=True)  # fmt: skip
    if len(by_layer) and not blind:  # a pooled primary's per-layer rows (analysis.layers)
        written[layers.TABLE] = by_layer
    for name, df in written.items():
        write_table(path, name, df, parquet=True)
    advance()
    extra_tables = shown(path, geometry, per_run)  # what the report shows besides the claims
    for name in ("energy_ranks", "lifecycle_depth"):
        if (df := getattr(extra_tables, name)) is not None and len(df):
            write_table(path, name, df)
    points = dose.dose_points(geometry) if geometry["intervention"].nunique() > 1 and not blind else None
    fits = dose.dose_response(points) if points is not None else None
    return Analysis(
        path, geometry, metrics, traj, claims, sens, skipped, tables.get("horizon"), per_run=per_run,
        slope_depth=A.slope_by_depth(per_run) if len(per_run) else None, dose_points=points, dose_slopes=fits,
        dose_summary=dose.dose_summary(fits) if fits is not None and len(fits) else None,
        matched_dose=tables.get("matched_dose"), blind=blind, shown=extra_tables,
        verdict_table=tables["verdicts"], judged=judged, headline=causal.headline(claims),
    )  # fmt: skip


def _claim_parts(
    path: Path,
    geometry: pd.DataFrame,
    metrics: pd.DataFrame,
    extra: Callable[[Path], list[pd.DataFrame]] | None,
    with_tables: bool = True,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """The claims the study's design calls for (matched arms, intervention arms, the main claims of its
    none runs, a higher wing's extra parts) and, with_tables, the tables that come with them (a
    leave-one-seed-out rebuild reads only the claims)."""
    parts, tables = [], {}
    if matched.is_matched_study(geometry):  # causal v4: closed-loop arms against a sham, per layer
        parts.append(matched.claims_matched(geometry, metrics))
        if with_tables:
            tables["matched_dose"] = matched.dose_table(geometry)
    elif geometry["intervention"].nunique() > 1:
        parts.append(causal.claims_intervention(geometry, metrics))
    base = geometry[geometry["intervention"] == "none"]
    if len(base) and (base["n_layers"].nunique() > 1 or base["qk_init"].nunique() > 1 or not parts):
        parts.append(A.claims_main(base))
        if with_tables:
            tables |= {"sensitivity": A.sensitivity(base), "seed_agreement": A.seed_agreement(base),
                       "horizon": A.horizon(base)}  # fmt: skip
    if extra is not None:
        parts += extra(path)
    return pd.concat(parts, ignore_index=True), tables


def _variants(
    path: Path, geometry: pd.DataFrame, metrics: pd.DataFrame, claims: pd.DataFrame, margin: float, families: list
) -> pd.DataFrame:
    """robustness.csv: a main study's slope and co-movement primaries under the registered variants, or
    an intervention study's contrasts without each seed (its own claims builder on the rest). A family
    study's trends are varied by the families wing, which judges them."""
    base = geometry[geometry["intervention"] == "none"]
    if len(base) and R.pooled_primaries(claims):
        return R.main_variants(base, claims, margin, families)
    R.only_seed_variant(families)

    def rebuild(seed: int) -> pd.DataFrame:
        kept = geometry[geometry["seed"] != seed], metrics[metrics["seed"] != seed]
        return A.apply_margin(_claim_parts(path, *kept, None, with_tables=False)[0], margin)

    return R.leave_one_seed_out(claims, sorted(geometry["seed"].unique()), rebuild)


def _blind_until_complete(
    path: Path, geometry: pd.DataFrame, claims: pd.DataFrame, tables: dict[str, pd.DataFrame]
) -> tuple[pd.DataFrame, str]:
    """A matched study short of its registered seeds shows only its checks: (claims, why blind or "")."""
    if not matched.is_matched_study(geometry) or not (planned := registered_design(path)):
        return claims, ""
    done = matched.seeds_complete(geometry, planned[1])
    if done >= planned[0]:
        return claims, ""
    tables.pop("matched_dose")
    return matched.blind(claims), f"{done} of {planned[0]} seeds recorded; primary outcome hidden"


def registered_design(path: Path) -> tuple[int, int] | None:
    """(seeds, arms) a sweep registered in its manifest (SWEEP_MANIFEST), None where there is none."""
    from qkgeom.config import arm_label

    f = path / SWEEP_MANIFEST
    if not f.is_file():
        return None
    runs = [r["config"] for r in read_json(f).get("runs", [])]
    if not runs:
        return None
    seeds = {r["train"]["seed"] for r in runs}
    arms = {arm_label(r["intervention"]) for r in runs}
    return len(seeds), len(arms)


VERDICT_WINDOWS = ("post-transient", "final", "post-transient mean", "post-transient, loss-matched")
# The groups a verdict table shows: pooled, the relative-depth bands, and the causal estimates.
CAUSAL_GROUPS = tuple(f"none + contract/expand on {t}" for t in causal.TARGET.values())
VERDICT_GROUPS = ("all", "mean over layers", *A.LAYER_BANDS, *CAUSAL_GROUPS)


def fmt(v: float) -> str:
    """A number as the verdict tables print it: three significant digits, blank for NaN."""
    return "" if pd.isna(v) else f"{v:.3g}"


def verdict_rows(claims: pd.DataFrame) -> pd.DataFrame:
    """The claims rows a verdict table shows, in its order: a family study's primaries first, then the
    judged rows of the pooled groups, the relative-depth bands (slopes only) and the causal estimates
    in the verdict windows, then causal v4's per-layer rows against the sham."""
    sel = claims[
        (claims["verdict"] != "") & claims["group"].isin(VERDICT_GROUPS) & claims["window"].isin(VERDICT_WINDOWS)
    ]
    # by depth band, the slopes only (the other claims per band stay in the full claims table)
    sel = sel[~sel["group"].isin(list(A.LAYER_BANDS)) | sel["claim_id"].str.startswith("slope:")]
    # causal v4's per-layer rows against the sham (analysis.matched)
    per_layer = claims[(claims["verdict"] != "") & claims["claim_id"].str.contains("-sham.", regex=False)]
    sel = pd.concat([sel, per_layer[~per_layer.index.isin(sel.index)]])
    keys = zip(claims["claim_id"], claims["group"], claims["window"], strict=True)
    is_family = pd.Series([k in FAMILY_HEADLINE for k in keys], index=claims.index) & (claims["verdict"] != "")
    return pd.concat([claims[is_family], sel])  # a family study's primary claims (families/study.py) lead


def verdicts(claims: pd.DataFrame, select: bool = True) -> pd.DataFrame:
    """One line per judged claim: predicted direction, measured effect [95% interval], n, seeds
    agreeing, mde_80 and what an inconclusive verdict rules out, window and verdict. Groups: pooled
    (`all` / `mean over layers`), the relative-depth bands and the causal estimates (verdict_rows)."""
    sel = verdict_rows(claims) if select else claims
    mde = pd.to_numeric(sel.get("mde_80", pd.Series(np.nan, index=sel.index)), errors="coerce")
    interval = [
        "" if pd.isna(lo) else f" [{fmt(lo)}, {fmt(hi)}]"
        for lo, hi in sel[["ci_low", "ci_high"]].itertuples(index=False)
    ]
    p_raw = pd.to_numeric(sel["p_value"], errors="coerce")
    p_holm = pd.to_numeric(sel["p_holm"], errors="coerce") if "p_holm" in sel else pd.Series(np.nan, index=sel.index)
    nan = pd.Series(np.nan, index=sel.index)
    p_flip = pd.to_numeric(sel["p_sign_flip"], errors="coerce") if "p_sign_flip" in sel else nan
    p_floor = pd.to_numeric(sel["p_floor"], errors="coerce") if "p_floor" in sel else nan
    return pd.DataFrame(
        {
            "claim": sel["claim"],
            "group": sel["group"],
            "predicted": sel["predicted"],
            "measured [95% CI]": [f"{fmt(v)}{i}" for v, i in zip(sel["value"], interval, strict=True)],
            "n": sel["n"],
            "seeds agreeing": sel["seeds_agreeing"],
            "mde_80": mde.map(fmt),
            "window": sel["window"],
            "verdict": [A.n_aware(v, f) for v, f in zip(sel["verdict"], p_floor, strict=True)],
            "primary": sel["primary"] if "primary" in sel else "",
            "p": p_raw.map(fmt),
            "p (exact sign-flip)": p_flip.map(fmt),
            "p (Holm, primary)": p_holm.map(fmt),
            "reading": sel["reading"] if "reading" in sel else "",
        }
    ).reset_index(drop=True)


def format_verdicts(claims: pd.DataFrame) -> str:
    """The verdict table as aligned text: what `qkgeom study` ends with."""
    return format_verdict_table(verdicts(claims))


TERMINAL_WIDTH = 100  # the verdict table as the terminal prints it: no line wider than this


def wrap_lines(text: str, width: int = TERMINAL_WIDTH, first: str = "") -> list[str]:
    """`text` wrapped at `width` for a terminal, continued 4 spaces in, never broken at a hyphen."""
    import textwrap

    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent="    ", break_on_hyphens=False)


def format_verdict_table(table: pd.DataFrame, width: int = TERMINAL_WIDTH) -> str:
    """A verdict table (verdicts, verdicts_ladder) as text no wider than `width`, two lines a row: the
    verdict with its numbers (measured [95% CI], n, seeds agreeing, mde_80, p; Holm for a primary),
    then the claim with its group and window (wrapped); a row with n = 0 says why (its reading). Every
    column is in verdicts.csv."""

    def txt(v: object) -> str:
        return "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)

    def wrap(text: str, first: str = "") -> list[str]:
        return wrap_lines(text, width, first)

    out = ["VERDICTS (mde_80: the smallest effect each row could detect; every column in verdicts.csv)"]
    for r in ({k: txt(v) for k, v in row.items()} for row in table.to_dict("records")):
        agree = r.get("seeds agreeing", "")
        tag = f"[{r['primary']}, Holm {r['p (Holm, primary)']}] " if r.get("primary") else ""
        numbers = [tag + (r["verdict"] or "reported"), r["measured [95% CI]"], f"n {r['n']}",
                   f"{agree} agree" if agree and len(agree) <= 7 else "",
                   f"mde_80 {r['mde_80']}" if r.get("mde_80") else "", f"p {r['p']}" if r.get("p") else ""]  # fmt: skip
        out += wrap(" | ".join(x for x in numbers if x))
        out += wrap(f"{r['claim']} ({r['group']}, {r['window']})", "    ")
        if r.get("n") in ("0", "0.0") and r.get("reading"):
            out += wrap(f"why: {r['reading']}", "    ")
    return "\n".join(out)


def format_claims(claims: pd.DataFrame) -> str:
    """The verdicts first, then the claims table per group, as aligned text for the terminal."""
    show = claims[~claims["group"].str.startswith("layer=")].copy()
    for c in ("value", "ci_low", "ci_high"):
        show[c] = show[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}").astype(str)  # str even when empty
    show["ci"] = np.where(show["ci_low"] != "", "[" + show["ci_low"] + ", " + show["ci_high"] + "]", "")
    cols = ["claim", "group", "window", "value", "ci", "n", "seeds_agreeing", "verdict"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 70, "display.max_rows", 500):
        return (
            "VERDICTS\n"
            + verdicts(claims).to_string(index=False)
            + "\n\nALL CLAIMS\n"
            + show[cols].to_string(index=False)
        )


def verdicts_ladder(claims: pd.DataFrame) -> pd.DataFrame:
    """The ladder's verdict table: every judged row (primary first), in the shape of `verdicts`."""
    sel = claims[claims["verdict"].astype(str) != ""]
    sel = pd.concat([sel[sel["primary"] != ""], sel[sel["primary"] == ""]])
    return verdicts(sel, select=False)


LADDER_TABLE = "ladder_key_slopes"
LADDER_FACTS = "ladder_facts.json"  # what the ladder's page says of it: runs, planned, seeds, budgets, skipped


def ladder_tables(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """A token ladder's claims (analysis.ladder) with the pre-registration's margin and Holm family,
    written as claims.csv, verdicts.csv, ladder_key_slopes.csv and ladder_facts.json beside the runs (or
    their records): everything the ladder's page (report.study.write_ladder_report) reads.
    Returns (claims, verdict table, local-slope summary, facts for the page: runs, planned, seeds,
    budgets, skipped-run warnings)."""
    with _status(LADDER_STAGES) as advance:
        return _ladder_tables(Path(path), advance)


def _ladder_tables(path: Path, advance: Callable[[], None]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict]:
    """ladder_tables, stage by stage (advance: on to the next of LADDER_STAGES)."""
    from qkgeom.analysis import ladder as L

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", A.RunWarning)
        g, m = L.load_ladder(path)
    advance()
    pre = study_analysis(path)
    sweep = path / SWEEP_MANIFEST
    planned = len(read_json(sweep)["runs"]) if sweep.is_file() else None
    claims = L.claims_ladder(g, m, float(pre.get("margin", np.nan)), planned)
    claims = A.numeric_columns(P.adjust_primary(claims, pre.get("primary", [])))
    table = verdicts_ladder(claims)
    write_table(path, "claims", claims)
    write_table(path, "verdicts", table)
    summary = L.local_slope_summary(L.local_slopes(g))
    write_table(path, LADDER_TABLE, summary)
    families = R.registered(pre, L.VARIANTS)
    top = g[g["budget_m"] == g["budget_m"].max()]
    write_table(path, layers.TABLE, L.layer_rows_ladder(top, float(pre.get("margin", np.nan))))
    advance()
    if families:  # the registered robustness variants of L1-L4 (analysis.robustness)
        variants = L.robustness_variants(g, m, float(pre.get("margin", np.nan)), families)
        write_table(path, R.TABLE, R.variant_table(L.primary_rows(claims), variants))
    facts = {
        "runs": g["run_id"].nunique(),
        "planned": planned,
        "seeds": g["seed"].nunique(),
        "budgets": sorted(g["budget_m"].unique()),
        "skipped": sorted({str(w.message) for w in caught if issubclass(w.category, A.RunWarning)}),
    }
    write_json(path / LADDER_FACTS, {**facts, "budgets": [float(b) for b in facts["budgets"]]})
    return claims, table, summary, facts
