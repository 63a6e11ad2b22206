"""The report of `qkgeom pretrained` results: a checkpoint family (trend statistics, the contrast
over steps, revisions with duplicate flags) or a single model (a headline and a compact per-layer
table). Tables are written beside the revisions: revisions.csv, trends.csv, family.parquet (the tidy
dataset, one row per checkpoint x layer x head x site x metric)."""

from __future__ import annotations

import html
import sys
from pathlib import Path

import pandas as pd

from qkgeom.report import family_plots as fp
from qkgeom.report import plots
from qkgeom.report.study import figure_html, png_bytes, write_page
from qkgeom.results import (
    FAMILY_CLAIMS_CSV,
    FAMILY_FACTS,
    FAMILY_SEEDS_CSV,
    REPORT_DIR,
    REVISIONS_CSV,
    TRENDS_CSV,
    atomic_write_bytes,
    read_json,
)


def write_family_report(path: str | Path) -> Path:
    """report/index.html of a checkpoint family or one model, drawn from what analysis.families.family_tables
    wrote (revisions.csv, trends.csv, energy_ranks.csv, family_facts.json; one model: headline.csv,
    layers.csv) and the measured rows of its revisions."""
    from qkgeom.analysis.families import load_family

    path = Path(path)
    geometry = load_family(path)[0]
    revs = pd.read_csv(path / REVISIONS_CSV, keep_default_na=False, na_values=[""])
    # an all-empty column reads as float64 NaN: filling it with "" is refused by pandas 3's casting rules
    revs["flag"] = revs["flag"].astype(object).where(revs["flag"].notna(), "")
    trends, facts = pd.read_csv(path / TRENDS_CSV), read_json(path / FAMILY_FACTS)
    left_out, early_max_step = facts["left_out"], facts["early_max_step"]
    for why in left_out:
        print(f"warning: revision left out of {path.name}: {why}", file=sys.stderr)
    out = path / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    if len(revs) == 1:
        return _write_model_report(path, geometry, revs)
    parts = [
        f"<h1>qkgeom checkpoint family: {html.escape(path.name)}</h1>",
        f"<p>{len(revs)} revisions; early window: steps &le; {early_max_step}. Revisions whose weights hash "
        "identically to an earlier one are flagged (public checkpoint suites are known to serve duplicated "
        "revisions). Every token enters the covariances and entropies; the logit-spectrum rows (logit_*) are "
        "averages over the first <code>logit_seqs</code> sequences only (the same sequences in every "
        "revision), a sample, since each needs T &times; T eigen-solves.</p>",
    ]
    figures = []
    if geometry["step"].ge(0).any():
        figures.append(("family_contrast", fp.family_contrast(geometry, revs), "PR_Q - PR_K per layer against step"))
    for rev in list(revs["revision"])[-1:]:
        figures.append(("model_heads", fp.model_heads(geometry, rev), f"{rev}: per layer and per head"))
        ranks = _energy_ranks(path)
        if len(ranks):
            title = f"{rev}: weight rank against realised rank (energy_ranks.csv)"
            figures.append(("energy_ranks", plots.energy_ranks(ranks, rev), title))
    for name, fig, caption in figures:
        png = png_bytes(fig)
        atomic_write_bytes(out / f"{name}.png", png)
        parts.append(figure_html(name, png, caption))
    layer_values = geometry[geometry["head"] == -1].pivot_table(
        index=["revision", "site", "layer"], columns="metric", values="value"
    )
    parts += [f"<p class='warn'>left out: {html.escape(why)}</p>" for why in left_out]
    parts += [
        "<h2>Trend statistics</h2>",
        trends.to_html(index=False, float_format=lambda v: f"{v:.4g}"),
        "<h2>Revisions</h2>",
        revs.to_html(index=False),
        "<details><summary><b>Per-layer values</b></summary>",
        layer_values.reset_index().to_html(index=False, float_format=lambda v: f"{v:.4g}"),
        "</details>",
    ]
    return write_page(out, f"qkgeom family: {path.name}", parts)


def _write_model_report(path: Path, geometry: pd.DataFrame, revs: pd.DataFrame) -> Path:
    """One model (one revision): a headline, a compact per-layer table and the per-head figure."""
    info, rev = revs.iloc[0], revs["revision"].iloc[0]
    name = f"{info['model']}" + (f" @ {rev}" if rev != "main" else "")
    png = png_bytes(fp.model_heads(geometry, rev))
    atomic_write_bytes(path / "report" / "model_heads.png", png)
    ranks = _energy_ranks(path)
    parts = [
        f"<h1>model: {html.escape(name)}</h1>",
        f"<p>{int(info['n_tokens']):,} tokens of text; the logit-spectrum rows (logit PR) are averages over the first "
        f"{int(info['logit_seqs'])} sequences only (a sample: each needs T &times; T eigen-solves).</p>",
        "<h2>Headline</h2>",
        pd.read_csv(path / "headline.csv", keep_default_na=False).to_html(index=False, escape=True),
        figure_html("model_heads", png, "Per layer and per head"),
        "<h2>Per-layer values</h2>",
        pd.read_csv(path / "layers.csv").to_html(index=False, float_format=lambda v: f"{v:.3g}"),
    ]
    if len(ranks):
        rank_png = png_bytes(plots.energy_ranks(ranks, name))
        atomic_write_bytes(path / "report" / "energy_ranks.png", rank_png)
        parts += [
            "<h2>Weight rank and realised rank</h2>",
            "<p>Per head, the components carrying 90% of the energy of W_Q W_K<sup>T</sup> (weights) and of "
            "the row-centred Q K<sup>T</sup> logits on the text (data, over the logit sample's sequences), and "
            "their ratio (energy_ranks.csv).</p>",
            figure_html("energy_ranks", rank_png, "Weight rank against realised rank per head"),
            ranks.to_html(index=False, float_format=lambda v: f"{v:.3g}"),
        ]
    return write_page(path / "report", f"qkgeom model: {name}", parts)


def _energy_ranks(path: Path) -> pd.DataFrame:
    """The last revision's energy-rank table (energy_ranks.csv, analysis.families.family_tables)."""
    f = path / "energy_ranks.csv"
    return pd.read_csv(f).drop(columns="revision") if f.is_file() else pd.DataFrame()


def family_study_section(path: str | Path) -> list[str]:
    """A family study's part of the study report: each seed's run read as a checkpoint family
    (families/study.py), the contrast over steps per layer with the early window marked, the
    per-revision interaction-rank vs entropy link, and every family row with its interval."""
    from qkgeom.families import study as FS

    path = Path(path)
    claims_file = path / FAMILY_CLAIMS_CSV
    if not claims_file.is_file():
        return []
    seeds, fam = pd.read_csv(path / FAMILY_SEEDS_CSV), FS.family_geometry(path)
    if seeds.empty or fam.empty:
        return []
    early = int(seeds["early_max_step"].max())
    claims = pd.read_csv(claims_file)
    n_revs = fam.groupby("seed")["revision"].nunique()
    parts = [
        "<h2>Checkpoint families (the paper's claim 4)</h2>",
        f"<p>Each of the {len(n_revs)} seeds' runs kept {n_revs.min()}&ndash;{n_revs.max()} checkpoints, exported "
        "as Hugging Face GPT-2 folders and analysed token-level through <code>qkgeom pretrained --all-revisions"
        f"</code> (<code>{FS.FAMILY_DIR}/&lt;run&gt;/analysis/</code>). Early window: steps &le; {early}. Per seed: "
        "Spearman rho of the layer-mean PR_Q &minus; PR_K against log(1 + step) in each window, and the "
        "across-heads rho of interaction rank with attention entropy at each revision; then 95% t-intervals "
        "over seeds. Per-seed values: <code>family_seeds.csv</code>; rows: <code>family_claims.csv</code>.</p>",
    ]
    figures = [
        ("family_seeds_contrast", fp.family_seeds_contrast(fam, early), "PR_Q - PR_K per layer over each seed's "
         "checkpoints; the early window shaded"),
        ("family_heads_link", fp.heads_link(fam, seeds, FS.HEADS_LINK, _per_step(claims)),
         "Interaction rank vs attention entropy "
         "across heads: per revision (left), and every head at three revisions"),
    ]  # fmt: skip
    if (windows := path / f"{FS.FAMILY_WINDOWS}.csv").is_file():  # written by `qkgeom analyze` since 3a30c2f
        figures.append(
            ("family_windows", fp.family_windows(pd.read_csv(windows), early),
             "F1 and F2 re-judged with the early window ending at each step on the x axis (family_windows.csv; "
             "exploratory, no pre-registration names these rows)")
        )  # fmt: skip
    for name, fig, caption in figures:
        png = png_bytes(fig)
        atomic_write_bytes(path / "report" / f"{name}.png", png)
        parts.append(figure_html(name, png, caption))
    table = claims[["claim", "group", "window", "value", "ci_low", "ci_high", "n", "seeds_agreeing", "mde_80",
                    "verdict", "detail"]]  # fmt: skip
    parts += [
        "<details><summary><b>Every family row</b> (per revision, per layer)</summary>",
        table.to_html(index=False, escape=True, na_rep="", float_format=lambda v: f"{v:.4g}"),
        "</details>",
    ]
    return parts


def _per_step(claims: pd.DataFrame) -> pd.DataFrame:
    """The F5 rows of a family study's claims (one per revision): step, value, ci_low, ci_high."""
    from qkgeom.families import study as FS

    ids = claims["claim_id"] if "claim_id" in claims else claims["claim"].map({FS.F5: FS.CLAIM_IDS[FS.F5]})
    f5 = claims[(ids == FS.CLAIM_IDS[FS.F5]) & claims["window"].astype(str).str.startswith("step ")].copy()
    f5["step"] = f5["window"].str.removeprefix("step ").astype(int)
    return f5[["step", "value", "ci_low", "ci_high"]]
