"""analyze (tables on disk) and report (one self-contained HTML file plus PNG figures).

<dir>/summary.parquet|csv   seed-averaged layer trajectories
<dir>/claims.parquet|csv    the claims table (main and/or intervention study)
<dir>/report/index.html     figures embedded as data URIs; <dir>/report/*.png alongside
"""

from __future__ import annotations

import base64
import html
import io
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from qkgeom.analysis import causal, matched, spectral
from qkgeom.analysis import claims as A
from qkgeom.analysis.context import context_sentence, study_context
from qkgeom.analysis.prereg import check_records, registered_versions, study_analysis
from qkgeom.families.study import FAMILY_DIR, write_family_tables
from qkgeom.report import plots
from qkgeom.results import (
    RECORDS_DIR,
    REPORT_INDEX,
    SWEEP_MANIFEST,
    DamagedRunError,
    RunDir,
    atomic_write_bytes,
    read_json,
    write_table,
)


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
    dose_points: pd.DataFrame | None = None  # per (seed, arm) window means (intervention studies)
    dose_slopes: pd.DataFrame | None = None  # per seed dose-response fit
    matched_dose: pd.DataFrame | None = None  # causal v4: per (layer, arm) dose and entropy vs sham, 95% t

    @property
    def is_intervention(self) -> bool:
        return self.geometry["intervention"].nunique() > 1


def analyze(path: str | Path) -> Analysis:
    """Load every finished run under `path`, compute trajectories and claims, write the tables."""
    path = Path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", A.RunWarning)
        geometry, metrics = A.load_runs(path), A.load_metrics(path)
    skipped = sorted({str(w.message) for w in caught if issubclass(w.category, A.RunWarning)})
    geometry = A.with_transient(geometry)
    traj = A.trajectories(geometry)
    parts = []
    tables = {}
    if geometry["intervention"].nunique() > 1:
        parts.append(causal.claims_intervention(geometry, metrics))
    if matched.is_matched_study(geometry):  # causal v4: closed-loop arms against a sham, per layer
        parts.append(matched.claims_matched(geometry, metrics))
        tables["matched_dose"] = matched.dose_table(geometry)
    base = geometry[geometry["intervention"] == "none"]
    sens = pd.DataFrame(columns=A.CLAIM_COLUMNS)
    if len(base) and (base["n_layers"].nunique() > 1 or base["qk_init"].nunique() > 1 or not parts):
        parts.append(A.claims_main(base))
        sens = A.sensitivity(base)
        tables |= {"sensitivity": sens, "seed_agreement": A.seed_agreement(base), "horizon": A.horizon(base)}
    if (path / FAMILY_DIR).is_dir():  # a family study: its runs' checkpoints analysed as families
        parts.append(write_family_tables(path))
    claims = pd.concat(parts, ignore_index=True)
    pre = study_analysis(path)
    claims = A.apply_margin(claims, float(pre.get("margin", np.nan)))  # the pre-registered TOST margin, if any
    claims = A.numeric_columns(A.adjust_primary(claims, pre.get("primary", [])))
    tables["verdicts"] = verdicts(claims)
    if "matched_dose" in tables:  # the per-layer checks, each arm against the sham
        tables["scale_check"] = claims[claims["claim"].str.contains(" - sham: (?:scale check|delivered dose)")]
    for name, df in {"summary": traj, "claims": claims, **tables}.items():
        write_table(path, name, df, parquet=True)
    per_run = A.per_run_statistics(A.window(base if len(base) else geometry, "post-transient"))
    points = causal.dose_points(geometry) if geometry["intervention"].nunique() > 1 else None
    fits = causal.dose_response(points) if points is not None else None
    return Analysis(
        path, geometry, metrics, traj, claims, sens, skipped, tables.get("horizon"), per_run, points, fits,
        tables.get("matched_dose"),
    )  # fmt: skip


VERDICT_WINDOWS = ("post-transient", "final", "post-transient mean", "post-transient, loss-matched")
# The groups a verdict table shows: pooled, the relative-depth bands, and the causal estimates.
CAUSAL_GROUPS = tuple(f"none + contract/expand on {t}" for t in causal.TARGET.values())
VERDICT_GROUPS = ("all", "mean over layers", *A.LAYER_BANDS, *CAUSAL_GROUPS)


def _fmt(v: float) -> str:
    return "" if pd.isna(v) else f"{v:.3g}"


def verdicts(claims: pd.DataFrame, select: bool = True) -> pd.DataFrame:
    """One line per judged claim: predicted direction, measured effect [95% interval], n, seeds
    agreeing, mde_80 and what an inconclusive verdict rules out, window and verdict. Groups: pooled
    (`all` / `mean over layers`), the relative-depth bands and the causal estimates."""
    sel = claims
    if select:
        sel = claims[
            (claims["verdict"] != "") & claims["group"].isin(VERDICT_GROUPS) & claims["window"].isin(VERDICT_WINDOWS)
        ]
        # by depth band, the slopes only (the other claims per band stay in the full claims table)
        sel = sel[~sel["group"].isin(list(A.LAYER_BANDS)) | sel["claim"].str.contains("slope of")]
        # causal v4's per-layer rows against the sham (analysis.matched)
        per_layer = claims[(claims["verdict"] != "") & claims["claim"].str.contains(" - sham: ")]
        sel = pd.concat([sel, per_layer[~per_layer.index.isin(sel.index)]])
        is_family = (claims["study"] == "family") & claims["claim"].str.match(r"F[1-4] ") & (claims["verdict"] != "")
        sel = pd.concat([claims[is_family], sel])  # a family study's primary claims (families/study.py) lead
    mde = pd.to_numeric(sel.get("mde_80", pd.Series(np.nan, index=sel.index)), errors="coerce")
    interval = [
        "" if pd.isna(lo) else f" [{_fmt(lo)}, {_fmt(hi)}]"
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
            "measured [95% CI]": [f"{_fmt(v)}{i}" for v, i in zip(sel["value"], interval, strict=True)],
            "n": sel["n"],
            "seeds agreeing": sel["seeds_agreeing"],
            "mde_80": mde.map(_fmt),
            "window": sel["window"],
            "verdict": [A.n_aware(v, f) for v, f in zip(sel["verdict"], p_floor, strict=True)],
            "primary": sel["primary"] if "primary" in sel else "",
            "p": p_raw.map(_fmt),
            "p (exact sign-flip)": p_flip.map(_fmt),
            "p (Holm, primary)": p_holm.map(_fmt),
            "reading": sel["reading"] if "reading" in sel else "",
        }
    ).reset_index(drop=True)


GREEN, RED, AMBER = "#d8f0d8", "#f6d5d5", "#f3ecd0"
VERDICT_COLOURS = {
    "holds": GREEN,
    "manipulation ok": GREEN,
    "fails": RED,
    "manipulation failed": RED,
    "inconclusive": AMBER,
}


def verdicts_html(table: pd.DataFrame) -> str:
    """The verdict table as HTML, each row coloured by its verdict."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = []
    for row in table.itertuples(index=False):
        colour = VERDICT_COLOURS.get(row.verdict.removesuffix(A.PARAMETRIC_ONLY), "#fff")
        cells = "".join(f"<td>{html.escape(str(v))}</td>" for v in row)
        body.append(f"<tr style='background:{colour}'>{cells}</tr>")
    return f"<table class='verdicts'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def format_verdicts(claims: pd.DataFrame) -> str:
    """The verdict table as aligned text: what `qkgeom study` ends with."""
    return format_verdict_table(verdicts(claims))


def format_verdict_table(table: pd.DataFrame) -> str:
    """A verdict table (verdicts, verdicts_ladder) as aligned text, without the reading column."""
    table = table.drop(columns=["reading"])
    with pd.option_context("display.width", 250, "display.max_colwidth", 80, "display.max_rows", 500):
        return "VERDICTS (mde_80: the smallest effect each row could detect)\n" + table.to_string(index=False)


def format_claims(claims: pd.DataFrame) -> str:
    """The verdicts first, then the claims table per group, as aligned text for the terminal."""
    show = claims[~claims["group"].str.startswith("layer=")].copy()
    for c in ("value", "ci_low", "ci_high"):
        show[c] = show[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    show["ci"] = np.where(show["ci_low"] != "", "[" + show["ci_low"] + ", " + show["ci_high"] + "]", "")
    cols = ["claim", "group", "window", "value", "ci", "n", "seeds_agreeing", "verdict"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 70, "display.max_rows", 500):
        return (
            "VERDICTS\n"
            + verdicts(claims).to_string(index=False)
            + "\n\nALL CLAIMS\n"
            + show[cols].to_string(index=False)
        )


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _run_dir(a: Analysis, run_id: str) -> RunDir:
    """The folder of `run_id`: a sub-folder of the analysed path (or of its records, runs/), or the path
    itself for one run."""
    for folder in (a.path / run_id, a.path / RECORDS_DIR / run_id):
        if folder.is_dir():
            return RunDir(folder)
    return RunDir(a.path)


def _spectra_by_init(a: Analysis) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each init, the W_Q W_K^T spectra of its lowest-seed run at the middle depth."""
    runs = a.geometry[["run_id", "qk_init", "n_layers", "seed", "intervention"]].drop_duplicates()
    depths = sorted(runs["n_layers"].unique())
    depth = depths[len(depths) // 2]
    out = {}
    for key, g in runs[runs["n_layers"] == depth].groupby(["intervention", "qk_init"]):
        r = g.sort_values("seed").iloc[0]
        spec = _run_dir(a, r["run_id"]).read_spectra()
        if "W_QK_singular_values" in spec:
            title = f"{key[1]}, depth {depth}" + (f", {key[0]}" if a.is_intervention else "") + f", seed {r['seed']}"
            out[title] = (spec["step"], spec["W_QK_singular_values"])
    return out


def figures(a: Analysis) -> dict[str, tuple[str, bytes]]:
    """name -> (caption, PNG bytes)."""
    g = a.geometry
    figs: dict[str, tuple[str, object]] = {}
    if a.is_intervention:
        figs["intervention_entropy"] = (
            "Attention entropy per condition (layer mean; band: min-max over seeds).",
            plots.by_condition(
                g, "attention_entropy", "attention entropy (nats)", "Attention entropy under key-spectrum control"
            ),
        )
        figs["intervention_control"] = (
            "Achieved controlled spectrum per arm (solid), its target (dashed), the baseline none run (black).",
            plots.control_tracking(g),
        )
        if a.matched_dose is not None and len(a.matched_dose):
            figs["matched_dose"] = (
                "Causal v4: attention entropy against the delivered dose (log per-head activation PR_K), each "
                "arm minus the sham, per controlled layer (mean and 95% t-intervals over seeds; matched_dose.csv).",
                plots.matched_dose(a.matched_dose),
            )
        slopes = a.dose_slopes
        if slopes is not None and len(slopes) and slopes["n_arms"].min() >= 3:
            figs["dose_response"] = (
                "Dose-response: attention entropy against achieved log activation PR_K, per arm and seed "
                "(o: arms in the fit; x: other arms).",
                plots.dose_response(a.dose_points, slopes),
            )
        figs["loss"] = ("Validation loss per run.", plots.loss_curves(a.metrics, "intervention"))
    base = g[g["intervention"] == "none"]
    if len(base):
        figs["pr_trajectories"] = ("PR_Q and PR_K (layer mean) per depth and init.", plots.pr_trajectories(base))
        figs["pr_post_transient"] = (
            "PR_Q and PR_K after each run's detected transient end (linear steps): where the claims are judged.",
            plots.pr_trajectories(base, post_transient=True),
        )
        figs["slope_by_depth"] = (
            "Post-transient PR_Q and PR_K slopes against relative depth, per init and depth (seed mean, 95% t).",
            plots.slope_by_depth(a.per_run),
        )
        figs["contrast_heatmap"] = ("PR_Q - PR_K per layer over training (seed mean).", plots.contrast_heatmap(base))
        figs["entropy_vs_prk"] = ("Attention entropy against PR_K.", plots.entropy_vs_prk(base))
        if a.horizon is not None and len(a.horizon):
            figs["horizon"] = (
                "Each claim (all runs, post-transient) judged on the runs truncated at growing step counts.",
                plots.sensitivity(a.horizon, "Training length"),
            )
        if len(a.sensitivity):
            figs["window_sensitivity"] = (
                "Each claim (all runs) judged from the detected transient end and from fixed window starts.",
                plots.sensitivity(a.sensitivity),
            )
        if not a.is_intervention:
            figs["loss"] = ("Validation loss per run.", plots.loss_curves(a.metrics, "qk_init"))
    first = _spectral_run(a)
    if first is not None:
        run_id, rows = first
        ranks = spectral.energy_ranks(rows)
        if len(ranks):
            figs["energy_ranks"] = (
                f"Weight rank against realised rank per head at {run_id}'s last probe (table: energy_ranks.csv).",
                plots.energy_ranks(ranks, f"{run_id}: last probe"),
            )
        life = spectral.lifecycle(rows)
        if len(life):
            figs["spectral_lifecycle"] = (
                f"alpha and PR of W_Q, W_K, W_V, W_O per layer over training ({run_id}).",
                plots.spectral_lifecycle(life, run_id),
            )
    spectra = _spectra_by_init(a)
    if spectra:
        figs["interaction_spectrum"] = (
            "Spectrum of W_Q^h (W_K^h)^T over training.",
            plots.interaction_spectra(spectra),
        )
    return {k: (cap, _png(fig)) for k, (cap, fig) in figs.items()}


def _unconstrained(g: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs without an intervention (all rows where the table has no intervention column)."""
    return g[g["intervention"] == "none"] if "intervention" in g else g


def lifecycle_depth(a: Analysis) -> pd.DataFrame:
    """spectral.lifecycle_depth over the unconstrained runs, each from its detected transient end."""
    base = _unconstrained(a.geometry)
    if base.empty:
        return spectral.lifecycle_depth(base)
    return spectral.lifecycle_depth(base, A.transient_ends(base).to_dict())


def _spectral_run(a: Analysis) -> tuple[str, pd.DataFrame] | None:
    """The run whose spectral figures the report shows: the first unconstrained run (lowest seed)."""
    base = _unconstrained(a.geometry)
    if base.empty:
        return None
    run_id = base.sort_values(["seed", "run_id"])["run_id"].iloc[0]
    return run_id, base[base["run_id"] == run_id]


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _provenance(a: Analysis) -> pd.DataFrame:
    rows = []
    for run_id in sorted(a.geometry["run_id"].unique()):
        rd = _run_dir(a, run_id)
        cfg, done = read_json(rd.config), read_json(rd.done)
        prov = cfg["provenance"]
        rows.append(
            {
                "run_id": run_id,
                "git_sha": (prov.get("git_sha") or "")[:10],
                "dirty": prov.get("git_dirty"),
                "torch": prov.get("torch"),
                "threads": prov.get("torch_threads"),
                "seconds": round(done["elapsed"], 1),
                "final_valid_loss": _rounded(done.get("final_valid_loss"), 4),
                "notes": "; ".join(cfg.get("notes", [])),
            }
        )
    return pd.DataFrame(rows)


def verdict_section(a: Analysis) -> list[str]:
    """The verdicts. An intervention study leads with one row per arm (check, outcome, verdict) and
    the causal estimates; its per-mediator verdict rows are folded below."""
    table = verdicts(a.claims)
    if not a.is_intervention:
        return [verdicts_html(table)]
    causal_rows = table[table["group"].isin(CAUSAL_GROUPS) | table["window"].str.contains("loss-matched")]
    main = table[table["group"] == "all"]  # the none runs' own claims, when the study has a grid of them
    return [
        "<h3>Per arm: manipulation check, then the outcome</h3>",
        verdicts_html(causal.headline(a.claims)),
        "<h3>Causal estimates</h3>",
        verdicts_html(causal_rows),
        *([verdicts_html(main)] if len(main) else []),
        "<details><summary><b>Every verdict row</b> (each mediator, each window)</summary>",
        verdicts_html(table),
        "</details>",
    ]


PIPELINE_PRESETS = ("smoke", "tiny")  # presets that check the pipeline, not the science


def context_box(a: Analysis) -> list[str]:
    """The report's opening: how far training got (context.py), and for the smoke-scale presets a
    plain statement that the verdicts below check the pipeline, not the science."""
    runs = {rid: _run_dir(a, rid).path for rid in sorted(a.geometry["run_id"].unique())}
    ctx = study_context(runs, a.geometry)
    sweep = a.path / SWEEP_MANIFEST
    preset = read_json(sweep).get("base", "") if sweep.is_file() else ""
    out = [f"<div class='context'><b>How far training got.</b> {html.escape(context_sentence(ctx))}</div>"]
    if preset in PIPELINE_PRESETS or (ctx["final_valid_loss"] > 0.9 * ctx["unigram_baseline"]).any():
        out.append(
            "<p class='warn'><b>This is a pipeline check, not the science.</b> These models are far too small or "
            "too briefly trained (loss near the unigram baseline, attention near uniform) for the numbers below "
            "to say anything about the paper's claims; they show that every stage runs.</p>"
        )
    return out


CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}figure{margin:1.5em 0}.warn{color:#a40}
code{background:#f5f5f5;padding:0 3px}
.context{background:#eef3fb;border:1px solid #bcd;padding:.6em 1em;margin:1em 0}"""


def _figure_html(name: str, png: bytes, caption: str) -> str:
    """A figure embedded as a data URI, captioned with its PNG's file name."""
    data = base64.b64encode(png).decode()
    return (
        f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(caption)} ({name}.png)</figcaption></figure>"
    )


def _write_page(out: Path, title: str, parts: list[str]) -> Path:
    """out/index.html: one self-contained page (figures inline, the shared CSS)."""
    doc = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>"
    )
    atomic_write_bytes(out / REPORT_INDEX, doc.encode())
    return out / REPORT_INDEX


def write_report(a: Analysis, sections: list[str] = ()) -> Path:
    """Write <dir>/report/index.html (self-contained) and report/*.png for an analysed folder.
    sections: more HTML placed after the verdicts (a family study's, from family_report)."""
    out = a.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    figs = figures(a)
    for name, (_, png) in figs.items():
        atomic_write_bytes(out / f"{name}.png", png)
    spectral_run = _spectral_run(a)
    if spectral_run is not None and len(ranks := spectral.energy_ranks(spectral_run[1])):
        write_table(out, "energy_ranks", ranks.assign(run_id=spectral_run[0]))
    life_depth = lifecycle_depth(a)
    if len(life_depth):
        write_table(out, "lifecycle_depth", life_depth)
    claims = a.claims.copy()
    for c in ("value", "ci_low", "ci_high", "p_value"):
        claims[c] = claims[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    n_runs = a.geometry["run_id"].nunique()
    if n_runs == 1:
        return _write_run_report(a)
    parts = [
        f"<h1>qkgeom report: {html.escape(a.path.name)}</h1>",
        f"<p>{n_runs} finished runs; generated {time.strftime('%Y-%m-%d %H:%M:%S')}. Windows: <b>whole</b> run and "
        "<b>post-transient</b> (from each run's detected transient end; rule in docs/GLOSSARY.md). Intervals are "
        "95% t-intervals over seeds; verdicts follow the written rules in docs/GLOSSARY.md. "
        "Figures are measured on these runs; nothing is taken from the paper.</p>",
        *context_box(a),
        "<h2>Verdicts</h2>",
        "<p>Each verdict comes with <code>mde_80</code>, the smallest true effect its n and spread had 80% "
        "power to detect (two-sided t-test at 5%); an inconclusive verdict rules out effects larger than that "
        "and says nothing about smaller ones.</p>",
        *verdict_section(a),
        "<p><b>Gauge note.</b> PR_Q and PR_K change under W_Q &rarr; W_Q M, W_K &rarr; W_K M<sup>-T</sup>, "
        "while attention, the score spectrum and W_Q W_K<sup>T</sup> do not; the column "
        "<code>gauge_invariant</code> marks claims that involve only the latter.</p>",
        *sections,
    ]
    if a.skipped:
        parts.append("<p class='warn'>Skipped: " + "<br>".join(html.escape(s) for s in a.skipped) + "</p>")
    parts.append("<h2>Figures</h2>")
    for name, (cap, png) in figs.items():
        parts.append(_figure_html(name, png, cap))
    parts += [
        "<details><summary><b>Full claims table</b> (every group and window)</summary>",
        claims.to_html(index=False, escape=True),
        "</details>",
    ]
    if len(life_depth):
        parts += [
            "<details><summary><b>Spectral lifecycle by depth</b> (lifecycle_depth.csv; exploratory): per "
            "unconstrained run, each layer's change of alpha and PR from its transient end to the last probe; "
            "its spread and slope over depth, Q/K against V/O, 95% t over runs</summary>",
            life_depth.to_html(index=False, escape=True, float_format=lambda v: f"{v:.4g}"),
            "</details>",
        ]
    if len(a.sensitivity):
        parts += [
            "<details><summary><b>Window sensitivity table</b></summary>",
            a.sensitivity.to_html(index=False, escape=True, float_format=lambda v: f"{v:.4g}"),
            "</details>",
        ]
    parts += ["<h2>Provenance</h2>", _provenance(a).to_html(index=False, escape=True)]
    return _write_page(out, f"qkgeom report: {a.path.name}", parts)


RUN_TABLE = {
    "slope:query_participation_ratio": "PR_Q slope (PR per run)",
    "slope:key_participation_ratio": "PR_K slope (PR per run)",
    "slope:participation_ratio_contrast": "contrast slope (PR per run)",
    "contrast_mean": "mean PR_Q - PR_K",
    "rho:key_participation_ratio:attention_entropy": "PR_K ~ entropy co-movement (Spearman of differences)",
}


def _write_run_report(a: Analysis) -> Path:
    """One run: no seeds, so no intervals and no verdicts; per-layer post-transient statistics and
    per-layer trajectories instead."""
    out = a.path / "report"
    g = a.geometry
    per_layer = a.per_run[["layer", *RUN_TABLE]].rename(columns=RUN_TABLE)
    figs = {
        "layer_trajectories": ("PR_Q and PR_K of every layer against step.", plots.layer_trajectories(g)),
        "loss": ("Validation loss.", plots.loss_curves(a.metrics, "qk_init")),
    }
    ranks, life = spectral.energy_ranks(g), spectral.lifecycle(g)
    if len(ranks):
        figs["energy_ranks"] = (
            "Weight rank against realised rank per head at the last probe (table below, and energy_ranks.csv).",
            plots.energy_ranks(ranks, "last probe"),
        )
    if len(life):
        figs["spectral_lifecycle"] = (
            "alpha and PR of W_Q, W_K, W_V, W_O per layer over training.",
            plots.spectral_lifecycle(life, a.path.name),
        )
    parts = [
        f"<h1>run: {html.escape(a.path.name)}</h1>",
        *context_box(a),
        f"<p>One run: statistics per layer over the post-transient window (from step {int(g['transient_end'].iloc[0])}"
        "); claims need several seeds (a study) for intervals and verdicts.</p>",
        "<h2>Per layer, post-transient</h2>",
        per_layer.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
    ]
    if len(ranks):
        write_table(out, "energy_ranks", ranks)
        parts += [
            "<h2>Weight rank and realised rank (last probe)</h2>",
            ranks.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
        ]
    for name, (cap, fig) in figs.items():
        png = _png(fig)
        atomic_write_bytes(out / f"{name}.png", png)
        parts.append(_figure_html(name, png, cap))
    parts += ["<h2>Provenance</h2>", _provenance(a).to_html(index=False, escape=True)]
    return _write_page(out, f"qkgeom run: {a.path.name}", parts)


LADDER_FIGURE = "ladder_key_slopes"


def analyze_ladder(path: str | Path) -> tuple[pd.DataFrame, Path]:
    """A token ladder's claims (analysis.ladder) with the pre-registration's margin and Holm family,
    written as claims.csv and verdicts.csv beside the runs (or their records), and its report:
    report/ladder_key_slopes.png and report/index.html. Returns (claims, report page)."""
    from qkgeom.analysis import ladder as L

    path = Path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", A.RunWarning)
        g, m = L.load_ladder(path)
    pre = study_analysis(path)
    sweep = path / SWEEP_MANIFEST
    planned = len(read_json(sweep)["runs"]) if sweep.is_file() else None
    claims = L.claims_ladder(g, m, float(pre.get("margin", np.nan)), planned)
    claims = A.numeric_columns(A.adjust_primary(claims, pre.get("primary", [])))
    table = verdicts_ladder(claims)
    write_table(path, "claims", claims)
    write_table(path, "verdicts", table)
    summary = L.local_slope_summary(L.local_slopes(g))
    write_table(path, "ladder_key_slopes", summary)
    out = path / "report"
    out.mkdir(parents=True, exist_ok=True)
    png = _png(plots.ladder_slopes(summary))
    atomic_write_bytes(out / f"{LADDER_FIGURE}.png", png)
    n_runs = g["run_id"].nunique()
    skipped = sorted({str(w.message) for w in caught if issubclass(w.category, A.RunWarning)})
    parts = [
        f"<h1>token ladder: {html.escape(path.name)}</h1>",
        f"<p>{n_runs} runs{f' of {planned} planned (interim)' if planned and n_runs < planned else ''}; "
        f"{g['seed'].nunique()} seeds; budgets {', '.join(f'{b:g}' for b in sorted(g['budget_m'].unique()))} M "
        "tokens, each with its own warm-up + cosine schedule.</p>",
        "<h2>Verdicts</h2>",
        verdicts_html(table),
        _figure_html(
            LADDER_FIGURE, png, "PR_K slope per doubling of steps, by layer, against tokens; one line per budget"
        ),
        *(f"<p class='warn'>{html.escape(s)}</p>" for s in skipped),
    ]
    return claims, _write_page(out, f"ladder {path.name}", parts)


def verdicts_ladder(claims: pd.DataFrame) -> pd.DataFrame:
    """The ladder's verdict table: every judged row (primary first), in the shape of `verdicts`."""
    sel = claims[claims["verdict"].astype(str) != ""]
    sel = pd.concat([sel[sel["primary"] != ""], sel[sel["primary"] == ""]])
    return verdicts(sel, select=False)


CLAIMS_NEEDED = ("claim", "group", "window", "value", "ci_low", "ci_high", "n", "verdict", "p_value", "detail")


def _committed_claims(path: Path) -> pd.DataFrame:
    """A committed claims.csv, refused in one line (DamagedRunError) where it is truncated or garbled."""
    if not path.read_bytes().endswith(b"\n"):  # every table qkgeom writes ends its last row
        raise DamagedRunError(f"{path} is damaged (its last row is cut off); re-derive it with qkgeom analyze")
    try:
        claims = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise DamagedRunError(
            f"{path} is damaged ({str(e).splitlines()[0]}); re-derive it with qkgeom analyze"
        ) from None
    lost = [c for c in CLAIMS_NEEDED if c not in claims.columns]
    if lost or claims["p_value"].map(lambda v: isinstance(v, str) and v != "").any():
        what = f"no column {lost[0]!r}" if lost else "a p_value that is not a number"
        raise DamagedRunError(f"{path} is damaged ({what}; truncated?); re-derive it with qkgeom analyze")
    claims["verdict"] = claims["verdict"].fillna("")
    return claims


def current_claims(d: Path) -> pd.DataFrame:
    """A committed study's claims as its current statistics give them: claims.csv, with the rows of its
    newest re-derived table of primaries (`*claims_v<N>.csv`, N >= 2, e.g. family-cpu's v2 Fisher-z
    rows re-derived from its per-seed table) in place of the rows of the same claim."""
    claims = _committed_claims(d / "claims.csv")
    newer = sorted(
        (f for f in d.glob("*claims_v*.csv") if re.search(r"_v(\d+)\.csv$", f.name)),
        key=lambda f: int(re.search(r"_v(\d+)\.csv$", f.name).group(1)),
    )
    newer = [f for f in newer if int(re.search(r"_v(\d+)\.csv$", f.name).group(1)) >= 2]
    if newer:
        v2 = _committed_claims(newer[-1])
        claims = pd.concat([v2, claims[~claims["claim"].isin(set(v2["claim"]))]], ignore_index=True)
    return claims


def verdicts_index(root: str | Path) -> str:
    """docs/results/VERDICTS.md: every pre-registered primary row of every committed study under its
    current statistics (current_claims), with its raw p, the exact sign-flip p from its per-seed values
    (and the smallest p its n can reach), its n-aware verdict (analysis.claims.n_aware), Holm over the
    study's primary family (the error control) and, descriptively, over every study's primary rows
    together; whether the row re-derives from committed per-run records. A pre-registered primary that
    matches no row is an error (a reworded claim would otherwise leave its Holm family in silence)."""
    root = Path(root)
    found = []
    amended = []
    for d in sorted(p for p in root.iterdir() if (p / "claims.csv").is_file()):
        spec = study_analysis(d, by_name=True).get("primary", [])
        if not spec:
            continue
        check_records(d)  # records judged under another pre-registration, or bent: refused
        amended += [(d.name, v) for v in registered_versions(d)]
        claims = A.adjust_primary(current_claims(d), spec)
        for spec_row in spec:
            rows = claims[claims["primary"] == spec_row["id"]]
            if rows.empty:
                raise A.AnalysisError(
                    f"{d.name}: pre-registered primary {spec_row['id']} ({spec_row['claim']!r}) matches no row "
                    "of its claims.csv"
                )
            for r in rows.itertuples(index=False):
                found.append((d.name, spec_row["id"], r, (d / RECORDS_DIR).is_dir()))
    p_all = A.stats.holm(np.array([float(r.p_value) for _, _, r, _ in found]))
    lines = [
        "# Pre-registered primary rows of every committed study",
        "",
        "Written by `qkgeom verdicts docs/results` from each study's committed claims (its current statistics:",
        "claims.csv, or a re-derived table of its primaries such as family-cpu's family_claims_v2.csv) and the",
        "primary family its pre-registration names (`[analysis] primary`). p: the row's own test as committed",
        "(t-test over seeds; the causal rows' sign test). p (sign-flip): exact, from the committed per-seed",
        "values; floor: the smallest p n seeds can reach. A verdict whose floor is >= 0.05 (n <= 5) reads",
        "`(parametric only)`: no distribution-free test at that n can reach 0.05, so it rests on normality.",
        "Holm (study), over the study's primary family, is the error control: a holds/fails verdict whose",
        "Holm p is >= 0.05 does not survive it. Holm (all studies) is descriptive and moves as studies are",
        "added. records: whether the row re-derives from committed per-run records (tests/test_records.py).",
        "",
        "| study | id | claim | group | window | measured [95% CI] | n | verdict | p | p (sign-flip) | floor "
        "| p (Holm, study) | survives Holm (study) | p (Holm, all studies; descriptive) | records |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (study, cid, r, recorded), p_a in zip(found, p_all, strict=True):
        ci = f" [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}]" if pd.notna(r.ci_low) else ""
        seeds = re.search(r"per-seed (?:[a-z]+ )?\[([^\]]*)\]", str(r.detail))
        v = np.array([float(x) for x in seeds.group(1).split(",")]) if seeds else np.array([])
        flip, floor = A.stats.sign_flip_p(v) if len(v) else (np.nan, np.nan)
        judged = r.verdict in ("holds", "fails")
        survives = ("yes" if r.p_holm < 0.05 else "no") if judged else ""
        lines.append(
            f"| {study} | {cid} | {r.claim} | {r.group} | {r.window} | {_fmt(r.value)}{ci} | {r.n} | "
            f"{A.n_aware(r.verdict, floor)} | {_fmt(r.p_value)} | {_fmt(flip)} | {_fmt(floor)} | {_fmt(r.p_holm)} | "
            f"{survives} | {_fmt(p_a)} | {'yes' if recorded else 'not re-derivable'} |"
        )
    if amended:  # a pre-registration amended after its records: every registered version, oldest first
        lines += [
            "",
            "Pre-registration versions (registered amendments; the records keep the digest they were judged under):",
            "",
        ]
        lines += [f"- {study} v{v['version']}{' (' + v['registered'] + ')' if v.get('registered') else ''}: "
                  f"{v['note']}" for study, v in amended]  # fmt: skip
    return "\n".join(lines) + "\n"
