"""The study report: an analysed folder (analysis.study.Analysis, its judged tables) drawn as one
self-contained HTML page plus PNG figures. It draws what the analysis wrote, and judges nothing.

<dir>/report/index.html     figures embedded as data URIs; <dir>/report/*.png alongside
"""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from tqdm import tqdm

from qkgeom.analysis.context import context_sentence
from qkgeom.analysis.rows import PARAMETRIC_ONLY, per_seed_values
from qkgeom.analysis.shown import run_folder
from qkgeom.analysis.study import CAUSAL_GROUPS, LADDER_FACTS, LADDER_TABLE, Analysis
from qkgeom.metrics import metric_label
from qkgeom.report import family_plots, plots
from qkgeom.report.layout import tidy
from qkgeom.results import (
    REPORT_INDEX,
    SWEEP_MANIFEST,
    RunDir,
    atomic_write_bytes,
    read_json,
)

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
        colour = VERDICT_COLOURS.get(row.verdict.removesuffix(PARAMETRIC_ONLY), "#fff")
        cells = "".join(f"<td>{html.escape(str(v))}</td>" for v in row)
        body.append(f"<tr style='background:{colour}'>{cells}</tr>")
    return f"<table class='verdicts'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def png_bytes(fig) -> bytes:
    """A matplotlib figure, tidied (report.layout.tidy), as PNG bytes (the figure is closed)."""
    tidy(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)  # constrained layout (tidy) fits it: no second, bbox-finding draw
    plt.close(fig)
    return buf.getvalue()


def _spectra_by_init(a: Analysis) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each init, the W_Q W_K^T spectra of its lowest-seed run at the middle depth."""
    runs = a.geometry[["run_id", "qk_init", "n_layers", "seed", "intervention"]].drop_duplicates()
    depths = sorted(runs["n_layers"].unique())
    depth = depths[len(depths) // 2]
    out = {}
    for key, g in runs[runs["n_layers"] == depth].groupby(["intervention", "qk_init"]):
        r = g.sort_values("seed").iloc[0]
        spec = RunDir(run_folder(a.path, r["run_id"])).read_spectra()
        if "W_QK_singular_values" in spec:
            title = f"{key[1]}, depth {depth}" + (f", {key[0]}" if a.is_intervention else "") + f", seed {r['seed']}"
            out[title] = (spec["step"], spec["W_QK_singular_values"])
    return out


def figures(a: Analysis) -> dict[str, tuple[str, bytes]]:
    """name -> (caption, PNG bytes): the verdicts' seeds, the arms' figures, the none runs', then the
    spectral ones."""
    figs = _verdict_figure(a) | _intervention_figures(a) | _baseline_figures(a) | _spectral_figures(a)
    drawn = tqdm(figs.items(), desc="report: drawing", unit="figure", disable=None, leave=False)  # a terminal's
    return {k: (cap, png_bytes(fig)) for k, (cap, fig) in drawn}


def _verdict_figure(a: Analysis) -> dict[str, tuple[str, object]]:
    """The per-seed values behind each row of the verdict table (rows without two or more per-seed values,
    such as a Fieller ratio or a single run's, are left out)."""
    if a.judged is None or "per_seed" not in a.judged:
        return {}
    rows = a.judged.assign(
        label=a.judged["claim_id"].astype(str) + " · " + a.judged["group"] + " · " + a.judged["window"],
        values=a.judged["per_seed"].map(per_seed_values),
    )
    rows = rows[rows["values"].map(len) > 1]  # one seed (a single run's report): no spread to draw
    if rows.empty:
        return {}
    return {
        "verdict_seeds": (
            "The verdict table's rows, each from its per-seed values: dots (one a seed), their mean and 95% "
            "interval (blue), each row scaled by its largest |per-seed value|. A lone seed far from the rest "
            "makes a skewed row, whose interval covers less than 95% (docs/GLOSSARY.md, Coverage, measured).",
            plots.verdict_seeds(rows, VERDICT_COLOURS),
        )
    }


def _intervention_figures(a: Analysis) -> dict[str, tuple[str, object]]:
    """An intervention study's figures (none for a study without arms)."""
    g = a.geometry
    figs: dict[str, tuple[str, object]] = {}
    if a.is_intervention and not a.blind:  # blind: no outcome is drawn until the registered n is in
        figs["intervention_entropy"] = (
            "Attention entropy per condition (layer mean; band: min-max over seeds).",
            plots.by_condition(
                g,
                "attention_entropy",
                metric_label("attention_entropy"),
                "Attention entropy under key-spectrum control",
            ),
        )
    if a.is_intervention:
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
                plots.dose_response(a.dose_points, slopes, a.dose_summary),
            )
        if not a.blind:
            figs["loss"] = ("Validation loss per run.", plots.loss_curves(a.metrics, "intervention"))
    return figs


def _baseline_figures(a: Analysis) -> dict[str, tuple[str, object]]:
    """The none runs' trajectories, slopes, sensitivity and loss figures."""
    figs: dict[str, tuple[str, object]] = {}
    base = a.geometry[a.geometry["intervention"] == "none"]
    if len(base):
        figs["pr_trajectories"] = ("PR_Q and PR_K (layer mean) per depth and init.", plots.pr_trajectories(base))
        figs["pr_post_transient"] = (
            "PR_Q and PR_K after each run's detected transient end (linear steps): where the claims are judged.",
            plots.pr_trajectories(base, post_transient=True),
        )
        figs["slope_by_depth"] = (
            "Post-transient PR_Q and PR_K slopes against relative depth, per init and depth (seed mean, 95% t).",
            plots.slope_by_depth(a.slope_depth),
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
    return figs


def _spectral_figures(a: Analysis) -> dict[str, tuple[str, object]]:
    """Energy ranks, the spectral lifecycle and the W_Q W_K^T spectra, where the analysis has them."""
    figs: dict[str, tuple[str, object]] = {}
    sh = a.shown
    if sh is not None and sh.energy_ranks is not None and len(sh.energy_ranks):
        figs["energy_ranks"] = (
            f"Weight rank against realised rank per head at {sh.spectral_run}'s last probe (table: energy_ranks.csv).",
            plots.energy_ranks(sh.energy_ranks, f"{sh.spectral_run}: last probe"),
        )
    if sh is not None and sh.lifecycle is not None and len(sh.lifecycle):
        figs["spectral_lifecycle"] = (
            f"alpha and PR of W_Q, W_K, W_V, W_O per layer over training ({sh.spectral_run}).",
            plots.spectral_lifecycle(sh.lifecycle, sh.spectral_run),
        )
    spectra = _spectra_by_init(a)
    if spectra:
        figs["interaction_spectrum"] = (
            "Spectrum of W_Q^h (W_K^h)^T over training.",
            plots.interaction_spectra(spectra),
        )
    return figs


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _cpu(prov: dict) -> str | None:
    """'<model> (<torch's vector width>[, kernel settings])', None for runs made before provenance named
    the CPU."""
    c = prov.get("cpu")
    if not isinstance(c, dict):
        return None
    extra = [c.get("torch_capability")] + [f"{k}={v}" for k, v in (prov.get("kernel_env") or {}).items()]
    return f"{c.get('model') or c.get('vendor')} ({', '.join(x for x in extra if x)})"


def _provenance(a: Analysis) -> pd.DataFrame:
    rows = []
    for run_id in sorted(a.geometry["run_id"].unique()):
        rd = RunDir(run_folder(a.path, run_id))
        cfg, done = read_json(rd.config), read_json(rd.done)
        prov = cfg["provenance"]
        rows.append(
            {
                "run_id": run_id,
                "git_sha": (prov.get("git_sha") or "")[:10],
                "dirty": prov.get("git_dirty"),
                "torch": prov.get("torch"),
                "threads": prov.get("torch_threads"),
                "cpu": _cpu(prov),
                "seconds": round(done["elapsed"], 1),
                "final_valid_loss": _rounded(done.get("final_valid_loss"), 4),
                "notes": "; ".join(cfg.get("notes", [])),
            }
        )
    return pd.DataFrame(rows)


def verdict_section(a: Analysis) -> list[str]:
    """The verdicts. An intervention study leads with one row per arm (check, outcome, verdict) and
    the causal estimates; its per-mediator verdict rows are folded below."""
    table = a.verdict_table
    if not a.is_intervention:
        return [verdicts_html(table)]
    causal_rows = table[table["group"].isin(CAUSAL_GROUPS) | table["window"].str.contains("loss-matched")]
    main = table[table["group"] == "all"]  # the none runs' own claims, when the study has a grid of them
    return [
        "<h3>Per arm: manipulation check, then the outcome</h3>",
        verdicts_html(a.headline),
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
    ctx = a.shown.context
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


def figure_html(name: str, png: bytes, caption: str) -> str:
    """A figure embedded as a data URI, captioned with its PNG's file name."""
    data = base64.b64encode(png).decode()
    return (
        f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(caption)} ({name}.png)</figcaption></figure>"
    )


def write_page(out: Path, title: str, parts: list[str]) -> Path:
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
    life_depth = a.shown.lifecycle_depth if a.shown is not None else None
    life_depth = life_depth if life_depth is not None else pd.DataFrame()
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
        *(
            [
                f"<p class='warn'><b>Blind:</b> {html.escape(a.blind)}. The checks are shown; the outcomes are "
                "read once the registered number of seeds is in.</p>"
            ]
            if a.blind
            else []
        ),
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
        parts.append(figure_html(name, png, cap))
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
    return write_page(out, f"qkgeom report: {a.path.name}", parts)


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
    g, sh = a.geometry, a.shown
    per_layer = sh.run_per_layer[["layer", *RUN_TABLE]].rename(columns=RUN_TABLE)
    figs = {
        "layer_trajectories": ("PR_Q and PR_K of every layer against step.", plots.layer_trajectories(g)),
        "loss": ("Validation loss.", plots.loss_curves(a.metrics, "qk_init")),
    }
    ranks = sh.energy_ranks if sh.energy_ranks is not None else pd.DataFrame()
    if len(ranks):
        figs["energy_ranks"] = (
            "Weight rank against realised rank per head at the last probe (table below, and energy_ranks.csv).",
            plots.energy_ranks(ranks, "last probe"),
        )
    if sh.lifecycle is not None and len(sh.lifecycle):
        figs["spectral_lifecycle"] = (
            "alpha and PR of W_Q, W_K, W_V, W_O per layer over training.",
            plots.spectral_lifecycle(sh.lifecycle, a.path.name),
        )
    whole = sh.run_window.startswith("the whole run")
    parts = [
        f"<h1>run: {html.escape(a.path.name)}</h1>",
        *context_box(a),
        f"<p>One run: statistics per layer over {html.escape(sh.run_window)}; claims need several seeds (a study) "
        "for intervals and verdicts.</p>",
        f"<h2>Per layer, {'whole run' if whole else 'post-transient'}</h2>",
        per_layer.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
    ]
    if len(ranks):
        parts += [
            "<h2>Weight rank and realised rank (last probe)</h2>",
            ranks.drop(columns="run_id").to_html(index=False, float_format=lambda v: f"{v:.3g}"),
        ]
    for name, (cap, fig) in figs.items():
        png = png_bytes(fig)
        atomic_write_bytes(out / f"{name}.png", png)
        parts.append(figure_html(name, png, cap))
    parts += ["<h2>Provenance</h2>", _provenance(a).to_html(index=False, escape=True)]
    return write_page(out, f"qkgeom run: {a.path.name}", parts)


def write_ladder_report(path: str | Path) -> Path:
    """A token ladder's page, report/ladder_key_slopes.png and report/index.html, drawn from the tables
    analysis.study.ladder_tables wrote (verdicts.csv, ladder_key_slopes.csv, ladder_facts.json)."""
    path = Path(path)
    table = pd.read_csv(path / "verdicts.csv", keep_default_na=False, dtype=str)
    summary, facts = pd.read_csv(path / f"{LADDER_TABLE}.csv"), read_json(path / LADDER_FACTS)
    out = path / "report"
    out.mkdir(parents=True, exist_ok=True)
    png = png_bytes(family_plots.ladder_slopes(summary))
    atomic_write_bytes(out / f"{LADDER_TABLE}.png", png)
    n_runs, planned = facts["runs"], facts["planned"]
    parts = [
        f"<h1>token ladder: {html.escape(path.name)}</h1>",
        f"<p>{n_runs} runs{f' of {planned} planned (interim)' if planned and n_runs < planned else ''}; "
        f"{facts['seeds']} seeds; budgets {', '.join(f'{b:g}' for b in facts['budgets'])} M "
        "tokens, each with its own warm-up + cosine schedule.</p>",
        "<h2>Verdicts</h2>",
        verdicts_html(table),
        figure_html(
            LADDER_TABLE, png, "PR_K slope per doubling of steps, by layer, against tokens; one line per budget"
        ),
        *(f"<p class='warn'>{html.escape(s)}</p>" for s in facts["skipped"]),
    ]
    return write_page(out, f"ladder {path.name}", parts)
