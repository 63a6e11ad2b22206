"""Judging checkpoint families: a `qkgeom pretrained` folder of measured revisions read back
(load_family, with hash-based duplicate flags; left_out_revisions), its tidy dataset (family_dataset),
its trends over steps (family_trends: the contrast's Spearman and slope on log step per window, the
across-heads link of interaction rank with entropy per revision, and its within-layer form with a
permutation null), one model's headline and per-layer table, and family_tables, which writes all that
the report draws. The measuring half (revisions, text, tokens, one model at a time) is
families.revisions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as sps

from qkgeom import config as C
from qkgeom.analysis import spectral, stats
from qkgeom.metrics import metric_label
from qkgeom.probing import archs
from qkgeom.results import FAMILY_FACTS, RunDir, read_json, write_json

# one row per revision in revisions.csv and the report (logit_seqs: the logit-spectrum sample)
REVISION_COLUMNS = ("model", "revision", "step", "tokens_seen", "n_tokens", "logit_seqs", "weights_sha256")


def load_family(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(geometry rows of every finished revision, one row per revision with hash-based flags)."""
    frames, infos = [], []
    for d in sorted(Path(path).iterdir()):
        rd = RunDir(d)
        if not rd.is_done() or d.name.startswith("."):
            continue
        info = read_json(rd.config)
        g = rd.read_geometry()
        g["revision"], g["model"] = info["revision"], info["model"]
        frames.append(g)
        infos.append({k: info.get(k) for k in REVISION_COLUMNS})
    if not frames:
        from qkgeom.analysis.claims import AnalysisError

        raise AnalysisError(f"no finished revisions under {path}")
    revs = pd.DataFrame(infos).sort_values("step", na_position="last").reset_index(drop=True)
    first = revs.groupby("weights_sha256")["revision"].transform("first")
    revs["duplicate_of"] = np.where(first != revs["revision"], first, "")
    revs["flag"] = np.where(revs["duplicate_of"] != "", "identical weights to " + revs["duplicate_of"], "")
    return pd.concat(frames, ignore_index=True), revs


def left_out_revisions(path: str | Path) -> list[str]:
    """'<folder> (why)' for every revision folder under `path` that load_family leaves out: unfinished
    (no done.json: a killed or failed measurement) or a hidden temp folder of a killed write."""
    out = []
    for d in sorted(Path(path).iterdir()):
        rd = RunDir(d)
        if not d.is_dir() or not (rd.config.is_file() or rd.error.is_file() or d.name.startswith(".")):
            continue  # the report folder, tables
        if d.name.startswith("."):
            out.append(f"{d.name} (a temp folder of a killed write)")
        elif not rd.is_done():
            why = "failed: " + rd.read_error() if rd.error.is_file() else "unfinished: no done.json"
            out.append(f"{d.name} ({why})")
    return out


# family.parquet: the columns, in order (docs/GLOSSARY.md, "family.parquet")
FAMILY_DATASET_COLUMNS = [
    "model", "revision", "step", "tokens", "layer", "head", "site", "metric", "value", "convention", "note",
]  # fmt: skip


def family_dataset(geometry: pd.DataFrame, revs: pd.DataFrame) -> pd.DataFrame:
    """A family's geometry as one tidy long table (FAMILY_DATASET_COLUMNS), one row per checkpoint x layer
    x head x site x metric: `step` and `tokens` of the checkpoint (null where unknown), `convention` the
    PR convention of PR rows (null for other metrics), `note` why a value is NaN. Duplicate revisions
    (identical weights) are kept; revisions.csv flags them."""
    from qkgeom.probing.geometry import is_pr_metric

    g = geometry.copy()
    info = revs.set_index("revision")
    g["step"] = g["revision"].map(info["step"]).astype("Int64")
    g["tokens"] = g["revision"].map(info["tokens_seen"]).astype("Int64")
    note = g["note"].astype("string") if "note" in g else pd.Series(pd.NA, index=g.index, dtype="string")
    is_pr = g["metric"].map(is_pr_metric)
    convention = note.str.removeprefix("pr=").where(is_pr & note.str.startswith("pr=").fillna(False))
    # rows written before the note column existed: the variance convention (the only one then)
    g["convention"] = convention.mask(is_pr & convention.isna(), "variance").astype("string")
    g["note"] = note.mask(note.str.startswith("pr=").fillna(False)).astype("string")
    for col in ("layer", "head"):
        g[col] = g[col].astype("int64")
    return g[FAMILY_DATASET_COLUMNS].sort_values(["step", "revision", "site", "layer", "head", "metric"],
                                                 na_position="last").reset_index(drop=True)  # fmt: skip


# the statistics of trends.csv (family_trends), by name; families.study reads them back by these names
CONTRAST_TREND = "Spearman(PR_Q - PR_K, log step)"
CONTRAST_SLOPE = "OLS slope(PR_Q - PR_K, log step)"
HEADS_LINK = "Spearman(interaction rank, attention entropy) across heads"
WITHIN_LAYER_LINK = "Spearman(interaction rank, normalised entropy) across heads within layer"
N_PERMUTATIONS = 2000


def within_group_permutations(groups: list[np.ndarray], n: int, times: int, rng: np.random.Generator) -> np.ndarray:
    """(times, n) indices 0..n-1, each row permuted within every group of `groups` (index arrays that
    partition 0..n-1): row by row, group by group, rng.permutation(group). Groups of one size take one
    rng.permuted call over the rows in that same order, which draws the same numbers (tested): 2,000
    permutations of 4 layers were 8,000 calls, 5.5 s of a family study's analysis."""
    order = np.tile(np.arange(n), (times, 1))
    if len({len(g) for g in groups}) == 1:
        shuffled = rng.permuted(np.tile(np.stack(groups), (times, 1)), axis=1)  # rows: (time 0, group 0), ...
        order[:, np.concatenate(groups)] = shuffled.reshape(times, -1)
        return order
    for i in range(times):
        for idx in groups:
            order[i, idx] = rng.permutation(idx)
    return order


def within_layer_link(ir: pd.Series, entropy: pd.Series, seed: int = 0) -> tuple[float, float, int]:
    """Claim 4b for one model: Spearman of interaction rank with normalised attention entropy across
    heads after removing each layer's mean from both (so a depth gradient in both does not count),
    and its permutation p (entropy shuffled among the heads of each layer; two-sided, N_PERMUTATIONS).
    ir, entropy: indexed by (layer, head). Returns (rho, p, n)."""
    both = pd.concat([ir.rename("ir"), entropy.rename("h")], axis=1, join="inner").dropna()
    if len(both) < 4:
        return np.nan, np.nan, len(both)
    layer = both.index.get_level_values(0)
    centred = both - both.groupby(layer).transform("mean")
    rho = stats.spearman(centred["ir"].to_numpy(), centred["h"].to_numpy())[0]
    if not np.isfinite(rho):
        return rho, np.nan, len(both)
    # A within-layer shuffle of h shuffles its ranks the same way, so every permuted Spearman is the
    # Pearson r of the fixed rank vectors with permuted indices: ranked once, correlated in one product.
    groups = [np.flatnonzero(layer == v) for v in np.unique(layer)]
    order = within_group_permutations(groups, len(both), N_PERMUTATIONS, np.random.default_rng(seed))

    def standardised_ranks(v: np.ndarray) -> np.ndarray:
        r = sps.rankdata(v)
        return (r - r.mean()) / np.linalg.norm(r - r.mean())

    null = standardised_ranks(centred["h"].to_numpy())[order] @ standardised_ranks(centred["ir"].to_numpy())
    p = (1 + np.sum(np.abs(null) >= abs(rho) - 1e-12)) / (N_PERMUTATIONS + 1)
    return float(rho), float(p), len(both)


def family_trends(geometry: pd.DataFrame, early_max_step: int = C.EARLY_MAX_STEP) -> pd.DataFrame:
    """Spearman and OLS slope of the paired contrast on log(1 + step), early (step <= early_max_step)
    and late, per layer and for the layer mean (contrast_trends); plus at each revision the across-heads
    interaction-rank vs entropy correlation, pooled and within layer with its permutation p (claim
    4b). Uses post-rotary q/k where the model has rotary embeddings."""
    frames = [t for t in (contrast_trends(geometry, early_max_step), _heads_links(geometry)) if len(t)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def contrast_trends(geometry: pd.DataFrame, early_max_step: int = C.EARLY_MAX_STEP) -> pd.DataFrame:
    """family_trends' contrast rows alone: Spearman rho and OLS slope of PR_Q - PR_K on log(1 + step) in
    the early window (step <= early_max_step) and the late one, per layer and for the layer mean."""
    site = "post_rotary" if (geometry["site"] == "post_rotary").any() else "none"
    g = geometry[geometry["step"] >= 0]
    c = g[(g["metric"] == "participation_ratio_contrast") & (g["head"] == -1) & (g["site"] == site)]
    rows = []
    for part, sel in (("early", c["step"] <= early_max_step), ("late", c["step"] > early_max_step)):
        sub = c[sel]
        if sub["step"].nunique() < 3:  # a single model, or too few revisions in this window: no trend
            continue
        groups = [(str(layer), x.groupby("step")["value"].mean()) for layer, x in sub.groupby("layer")]
        groups.append(("mean", sub.groupby("step")["value"].mean()))
        for layer, series in groups:
            x, y = np.log1p(series.index.to_numpy(float)), series.to_numpy()
            rho, p, n = stats.spearman(x, y)
            rows.append(
                {
                    "statistic": CONTRAST_TREND,
                    "window": part,
                    "layer": layer,
                    "rho": rho,
                    "p_value": p,
                    "n": n,
                }
            )
            # unbounded: a rank correlation at its ceiling of 1 cannot show a trend that weakens
            rows.append(
                {"statistic": CONTRAST_SLOPE, "window": part, "layer": layer, "slope": stats.slope(x, y), "n": n}
            )
    return pd.DataFrame(rows)


def _heads_links(geometry: pd.DataFrame) -> pd.DataFrame:
    """At each revision: the across-heads Spearman of interaction rank with attention entropy, pooled
    and within layer (family_trends)."""
    rows = []
    heads = geometry[geometry["head"] >= 0]  # every revision, step-less ones (a single model) included
    for rev, x in heads.groupby("revision"):
        ir = archs.one_site(x[x["metric"] == "interaction_rank"]).set_index(["layer", "head"])["value"]
        en = archs.one_site(x[x["metric"] == "attention_entropy"]).set_index(["layer", "head"])["value"]
        both = pd.concat([ir, en], axis=1, join="inner").dropna()
        rho, p, n = (
            stats.spearman(both.iloc[:, 0].to_numpy(), both.iloc[:, 1].to_numpy()) if len(both) else (np.nan, np.nan, 0)
        )
        rows.append(
            {
                "statistic": HEADS_LINK,
                "window": rev,
                "layer": "all",
                "rho": rho,
                "p_value": p,
                "n": n,
            }
        )
        hn = archs.one_site(x[x["metric"] == "attention_entropy_normalised"]).set_index(["layer", "head"])["value"]
        rho, p, n = within_layer_link(ir, hn)
        rows.append({"statistic": WITHIN_LAYER_LINK, "window": rev, "layer": "all", "rho": rho, "p_value": p, "n": n})
    return pd.DataFrame(rows)


# the per-layer columns a single-model report shows (one site each, archs.SITE_PREFERENCE)
LAYER_TABLE = {
    m: metric_label(m)
    for m in (
        "query_participation_ratio", "key_participation_ratio", "participation_ratio_contrast",
        "attention_entropy_normalised", "interaction_rank", "logit_participation_ratio",
    )
}  # fmt: skip


def layer_table(geometry: pd.DataFrame, revision: str) -> pd.DataFrame:
    """One model's compact per-layer table: LAYER_TABLE's metrics at one site each, no empty column."""
    g = geometry[(geometry["revision"] == revision) & (geometry["head"] == -1)]
    cols = {}
    for metric, label in LAYER_TABLE.items():
        rows = archs.one_site(g[g["metric"] == metric])
        if len(rows) and rows["value"].notna().any():
            cols[label] = rows.set_index("layer")["value"]
    return pd.DataFrame(cols).rename_axis("layer").reset_index()


def model_headline(geometry: pd.DataFrame, revision: str) -> pd.DataFrame:
    """A single model's answer: layers with PR_Q > PR_K (count, share), the median contrast over
    layers with its order-statistic 95% interval, and the across-heads Spearman correlation of
    interaction rank with attention entropy with its Fisher-z 95% interval."""
    g = geometry[geometry["revision"] == revision]
    contrast = archs.one_site(g[(g["metric"] == "participation_ratio_contrast") & (g["head"] == -1)])["value"]
    med, lo, hi = stats.median_ci(contrast.to_numpy())
    heads = g[g["head"] >= 0]
    ir = archs.one_site(heads[heads["metric"] == "interaction_rank"]).set_index(["layer", "head"])["value"]
    en = archs.one_site(heads[heads["metric"] == "attention_entropy"]).set_index(["layer", "head"])["value"]
    both = pd.concat([ir.rename("ir"), en.rename("en")], axis=1, join="inner").dropna()
    rho, rlo, rhi, n = stats.spearman_ci(both["ir"].to_numpy(), both["en"].to_numpy())
    positive = int((contrast > 0).sum())

    def ci(a: float, b: float) -> str:
        return "n/a (too few)" if not np.isfinite(a) else f"[{a:.3g}, {b:.3g}]"

    return pd.DataFrame(
        [
            ("layers with PR_Q > PR_K", f"{positive}/{len(contrast)} ({positive / max(len(contrast), 1):.0%})", "",
             f"{len(contrast)} layers"),
            ("median PR_Q - PR_K over layers", f"{med:+.3g}", ci(lo, hi), "order-statistic interval over layers"),
            ("interaction rank vs attention entropy across heads (Spearman)", f"{rho:+.3f}", ci(rlo, rhi),
             f"{n} heads, Fisher-z interval"),
        ],
        columns=["statistic", "value", "95% interval", "over"],
    )  # fmt: skip


def family_tables(
    path: str | Path, early_max_step: int | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, list[str], int]:
    """A checkpoint family's judged tables, written beside its revisions: revisions.csv (hash flags),
    trends.csv (family_trends), family.parquet (family_dataset), energy_ranks.csv (its last revision's
    weight and realised ranks), family_facts.json (the early window, the revisions left out and why)
    and, for one model, headline.csv and layers.csv: all that report.family draws. early_max_step: the
    early window's end; by default the one the family was measured with. Returns (geometry, revisions,
    trends, the revisions left out and why, the early window's end)."""
    import io

    from qkgeom.results import FAMILY_PARQUET, REVISIONS_CSV, TRENDS_CSV, atomic_write_bytes, write_table

    path = Path(path)
    geometry, revs = load_family(path)
    if early_max_step is None:
        first = next(d for d in sorted(path.iterdir()) if RunDir(d).is_done() and not d.name.startswith("."))
        early_max_step = (
            read_json(RunDir(first).config).get("pretrained_config", {}).get("early_max_step", C.EARLY_MAX_STEP)
        )
    trends = family_trends(geometry, early_max_step)
    write_table(path, Path(REVISIONS_CSV).stem, revs)
    write_table(path, Path(TRENDS_CSV).stem, trends)
    buf = io.BytesIO()
    family_dataset(geometry, revs).to_parquet(buf, index=False)
    atomic_write_bytes(path / FAMILY_PARQUET, buf.getvalue())
    last = revs["revision"].iloc[-1]
    ranks = spectral.energy_ranks(geometry[geometry["revision"] == last])
    if len(ranks):
        write_table(path, "energy_ranks", ranks.assign(revision=last))
    if len(revs) == 1:  # one model: its headline and compact per-layer table
        write_table(path, "headline", model_headline(geometry, last))
        write_table(path, "layers", layer_table(geometry, last))
    left_out = left_out_revisions(path)
    write_json(path / FAMILY_FACTS, {"early_max_step": int(early_max_step), "left_out": left_out})
    return geometry, revs, trends, left_out, early_max_step
