"""Checkpoint families: one model at many revisions, processed one at a time with resume.

    <out>/<revision>/config.json      model, revision, step, tokens_seen, weights_sha256, settings, provenance
    <out>/<revision>/geometry.parquet same tidy schema as training runs (+ model, revision columns on load)
    <out>/<revision>/spectra.npz
    <out>/<revision>/done.json        written last; a re-run skips the revision

Also: export of our own runs' checkpoints as GPT-2 folders (``<out>/step_<n>/``), so the same
Hugging Face path analyses them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from qkgeom import config as C
from qkgeom.analysis import stats
from qkgeom.device import check_device
from qkgeom.errors import read_text
from qkgeom.families.config import PretrainedConfig
from qkgeom.probing import archs
from qkgeom.results import EXPORT_INFO, EXPORT_VOCAB, DamagedRunError, RunDir, provenance, read_json, write_json

PYTHIA_TOKENS_PER_STEP = 2_097_152  # 1024 sequences x 2048 tokens


def pythia_revisions(every: int = 1) -> list[str]:
    """Pythia's public schedule: step0, 1, 2, 4, ..., 512, then 1000, 2000, ..., 143000.
    `every` keeps every k-th of the linear part (the log-spaced early part is always kept)."""
    early = [0] + [2**i for i in range(10)]
    late = list(range(1000, 143_001, 1000))
    late = late[every - 1 :: every] if every > 1 else late
    if late[-1] != 143_000:
        late.append(143_000)
    return [f"step{s}" for s in early + late]


def step_of(revision: str) -> int | None:
    """The optimiser step encoded in a revision name (step1000, step_1000), if any."""
    m = re.fullmatch(r"step_?(\d+)", revision)
    return int(m.group(1)) if m else None


def tokens_per_step(model_path: str) -> int | None:
    """Training tokens per step of a revision folder: our export's own record, else Pythia's, else None."""
    p = Path(model_path)
    if (p / EXPORT_INFO).is_file():
        return int(read_json(p / EXPORT_INFO)["tokens_per_step"])
    return PYTHIA_TOKENS_PER_STEP if "pythia" in model_path.lower() else None


TokensFn = Callable[[str], tuple[np.ndarray, tuple[int, ...]]]  # model folder -> (text ids, start tokens)


def analyse_revision(
    pc: PretrainedConfig, revision: str | None, out: Path, tokens_fn: TokensFn, progress: bool = False
) -> Path:
    """Analyse one revision of pc.model into `out/<revision>/` unless already done; returns the folder."""
    from qkgeom.probing.hf import analyse_model, load_model, resolve_revision, token_batches, weights_digest

    rev = revision or "main"
    rd = RunDir(out / C.safe_name(rev))  # `refs/pr/1` or `../x` stay inside `out` (config.json keeps the name)
    if rd.is_done():
        return rd.path
    device = check_device(pc.device, "pretrained.device")  # before a model is loaded
    model = load_model(pc.model, revision).to(device)
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    seq_len = min(pc.seq_len, limit) if limit else pc.seq_len  # e.g. our exported runs have n_ctx < 256
    path, _ = resolve_revision(pc.model, revision)
    tokens, prefix = tokens_fn(path)
    n_vocab = model.get_input_embeddings().num_embeddings
    top = max([int(tokens.max()) if len(tokens) else -1, *prefix])
    if top >= n_vocab:  # an embedding lookup would fail deep inside the model
        raise archs.PretrainedError(
            f"the tokenizer gives id {top}, beyond the {n_vocab}-entry vocabulary of {pc.model}: it is not this "
            "model's tokenizer (pass --tokenizer NAME_OR_FOLDER)"
        )
    batches = token_batches(tokens, seq_len, pc.batch_size, pc.n_tokens, prefix)
    rows, spectra = analyse_model(
        model, batches, progress, pc.logit_max_seqs or None, getattr(torch, pc.gram_dtype),
        conventions=pc.conventions,
    )  # fmt: skip
    step = step_of(rev)
    tps = tokens_per_step(path)
    n_seqs = min(pc.n_tokens, len(tokens)) // ((seq_len - len(prefix)) * pc.batch_size) * pc.batch_size
    info = {
        "model": pc.model,
        "revision": rev,
        "step": step,
        "tokens_seen": step * tps if step is not None and tps else None,
        "weights_sha256": weights_digest(model),
        "model_type": model.config.model_type,
        "pretrained_config": C.to_dict(pc),  # every setting that changes a number
        "n_tokens": n_seqs * seq_len,
        "seq_len": seq_len,
        # the logit spectrum (T x T eigen-solves) is sampled: the first logit_seqs sequences
        "logit_seqs": min(n_seqs, pc.logit_max_seqs or n_seqs),
        "start_tokens": list(prefix),  # the model's own special tokens opening every sequence ([] if stripped)
        "provenance": provenance(),
    }
    rd.path.mkdir(parents=True, exist_ok=True)
    write_json(rd.config, info)
    rd.write_geometry(
        # -1: no step / token count known (a single model); step 0 keeps its 0 tokens
        [
            {
                "step": -1 if step is None else step,
                "tokens_seen": -1 if tps is None or step is None else step * tps,
                **r,
            }
            for r in rows
        ]
    )
    rd.write_spectra(spectra)
    write_json(rd.done, {"revision": rev})
    return rd.path


def analyse_family(
    pc: PretrainedConfig,
    revisions: list[str | None],
    out: Path,
    tokens_fn: TokensFn,
    executor: str = "local",
    address: str | None = None,
    progress: bool = True,
    label: str | None = None,
) -> list[Path]:
    """Every revision through `analyse_revision` via qkgeom.executor (in this process, or as Ray
    tasks). Finished revisions are skipped either way (done.json), so an interrupted family resumes.
    label: the progress bar's name (default: the model folder's)."""
    from tqdm.auto import tqdm

    from qkgeom.executor import Job, run_jobs

    local_progress = progress and len(revisions) == 1 and executor == "local"
    jobs = [Job(rev or "main", (pc, rev, out, tokens_fn, local_progress)) for rev in revisions]
    desc = label or Path(pc.model).name
    bar = tqdm(total=len(revisions), desc=desc, unit="rev", disable=not progress or len(revisions) == 1)
    folders = []
    for _, folder in run_jobs(analyse_revision, jobs, executor, workers=1, threads=1, address=address):
        folders.append(folder)
        bar.update(1)
    bar.close()
    return folders


def local_revisions(root: Path) -> list[str]:
    """The revision sub-folders of a local model folder: those with a config.json, never a hidden
    one (a killed export's temp folder); in a qkgeom export (any revision carries EXPORT_INFO, written
    last) only the revisions that carry it, i.e. that were exported whole."""
    found = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / "config.json").is_file()]
    if any((d / EXPORT_INFO).is_file() for d in found):
        found = [d for d in found if (d / EXPORT_INFO).is_file()]
    return [d.name for d in found]


def family_revisions(pc: PretrainedConfig) -> list[str | None]:
    """The revisions a config names: its list, its family schedule, every sub-folder of a local
    folder (ordered by step), or [None] (the default revision)."""
    revisions: list[str | None] = list(pc.revisions)
    if pc.family == "pythia":
        revisions += pythia_revisions(pc.every)
    if pc.all_revisions:
        root = Path(pc.model)
        if not root.is_dir():
            raise archs.PretrainedError(f"pretrained.all_revisions needs a local folder, got {pc.model!r}")
        revisions += sorted(local_revisions(root), key=lambda r: (step_of(r) is None, step_of(r) or 0, r))
    return revisions or [None]


def sample_text(pc: PretrainedConfig) -> str:
    """The text to stream: pc.text, or WikiText-2 validation (raw where the mirror has it)."""
    from qkgeom.training.data import resolve_source, wikitext_mirror

    if pc.text:
        path = Path(pc.text)
    else:
        raw = wikitext_mirror() / "wikitext-2-raw" / "valid.txt"
        path = raw if raw.is_file() else resolve_source("wikitext-2") / "valid.txt"
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    return read_text(path, archs.PretrainedError)[: pc.n_tokens * 8]  # ample: tokens are >= 1 character


def run_pretrained(
    pc: PretrainedConfig,
    out: Path,
    executor: str = "local",
    address: str | None = None,
    progress: bool = True,
    label: str | None = None,
) -> list[Path]:
    """The whole `qkgeom pretrained` job: revisions, text, tokens (the model's own tokenizer, or the
    vocabulary of an exported qkgeom run), then every revision analysed into out/<revision>/."""
    from qkgeom.probing.hf import text_tokens
    from qkgeom.training.data import Vocab

    text = sample_text(pc)
    cache: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}

    def tokens_fn(path: str) -> tuple[np.ndarray, tuple[int, ...]]:
        vocab = Path(path) / EXPORT_VOCAB
        key = str(vocab) if vocab.is_file() else (pc.tokenizer or pc.model)
        if key not in cache:
            cache[key] = (
                (Vocab.from_json(read_text(vocab, DamagedRunError)).encode(text).astype("int64"), ())
                if vocab.is_file()
                else text_tokens(path, text, pc.tokenizer or None, special_tokens=not pc.strip_special_tokens)
            )
        return cache[key]

    check_same_settings(pc, Path(out))
    return analyse_family(pc, family_revisions(pc), Path(out), tokens_fn, executor, address, progress, label)


# the settings that change a revision's numbers: revisions measured under others cannot share a family folder
MEASUREMENT_SETTINGS = (
    "model", "text", "tokenizer", "n_tokens", "seq_len", "batch_size", "strip_special_tokens", "logit_max_seqs",
    "gram_dtype", "pr_convention", "alpha_convention",
)  # fmt: skip


def check_same_settings(pc: PretrainedConfig, out: Path) -> None:
    """Refuse to add revisions to `out` if the revisions already there were measured under other
    settings (another model, --n-tokens, ...): one family folder holds one measurement."""
    if not out.is_dir():
        return
    now = C.to_dict(pc)
    for d in sorted(out.iterdir()):
        rd = RunDir(d)
        if not (rd.is_done() and rd.config.is_file()):
            continue
        was = read_json(rd.config).get("pretrained_config", {})
        for key in MEASUREMENT_SETTINGS:
            # older folders: the default of their day (alpha rows were fitted `clauset` before the setting)
            before = was.get(key, {"pr_convention": "variance", "alpha_convention": "clauset"}.get(key))
            if before is not None and before != now[key]:
                raise archs.PretrainedError(
                    f"{out} already holds revisions measured with {key} = {before!r} ({d.name}); this run has "
                    f"{now[key]!r}: choose another --out, or delete that folder"
                )


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
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(layer == v) for v in np.unique(layer)]
    order = np.tile(np.arange(len(both)), (N_PERMUTATIONS, 1))  # (N_PERMUTATIONS, n) permuted indices
    for i in range(N_PERMUTATIONS):
        for idx in groups:
            order[i, idx] = rng.permutation(idx)

    def standardised_ranks(v: np.ndarray) -> np.ndarray:
        r = sps.rankdata(v)
        return (r - r.mean()) / np.linalg.norm(r - r.mean())

    null = standardised_ranks(centred["h"].to_numpy())[order] @ standardised_ranks(centred["ir"].to_numpy())
    p = (1 + np.sum(np.abs(null) >= abs(rho) - 1e-12)) / (N_PERMUTATIONS + 1)
    return float(rho), float(p), len(both)


def family_trends(geometry: pd.DataFrame, early_max_step: int = C.EARLY_MAX_STEP) -> pd.DataFrame:
    """Spearman and OLS slope of the paired contrast on log(1 + step), early (step <= early_max_step)
    and late, per layer and for the layer mean; plus at each revision the across-heads
    interaction-rank vs entropy correlation, pooled and within layer with its permutation p (claim
    4b). Uses post-rotary q/k where the model has rotary embeddings."""
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
    "query_participation_ratio": "PR_Q",
    "key_participation_ratio": "PR_K",
    "participation_ratio_contrast": "PR_Q - PR_K",
    "attention_entropy_normalised": "entropy / uniform",
    "interaction_rank": "interaction rank",
    "logit_participation_ratio": "logit PR",
}


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
    trends.csv (family_trends) and family.parquet (family_dataset). early_max_step: the early window's
    end; by default the one the family was measured with. Returns (geometry, revisions, trends, the
    revisions left out and why, the early window's end)."""
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
    return geometry, revs, trends, left_out_revisions(path), early_max_step
