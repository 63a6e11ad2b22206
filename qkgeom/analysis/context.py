"""How far training got: the numbers every study and run report opens with (MISSION.md, "Context").

At two CPU cores the models see early training, so a verdict means little without them: final
validation loss against the character-unigram baseline of the same corpus (the loss of a model that
ignores context), mean normalised attention entropy (1 = uniform over the causal support), tokens
seen, and tokens per parameter.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom import config as C
from qkgeom.results import RunDir, read_json
from qkgeom.training.data import DataError, Vocab, load_corpus
from qkgeom.training.data import unigram_baseline as data_unigram_baseline


@lru_cache(maxsize=8)
def unigram_baseline(source: str, tokenizer: str, vocab_json: str) -> float:
    """Cross-entropy (nats/token) of the validation split under the training split's token
    frequencies (add-one smoothed): what a model that ignores all context would score."""
    return data_unigram_baseline(
        load_corpus(C.DataConfig(source=source, tokenizer=tokenizer), Vocab.from_json(vocab_json))
    )


def n_parameters(model_cfg: dict, vocab_size: int) -> int:
    """Trainable parameters of our GPT (tied embeddings counted once), from its shape alone: for runs
    recorded before done.json kept the count (analysis imports no torch)."""
    return C.from_dict({"model": model_cfg}).model.n_parameters(vocab_size)


def run_context(run: Path, geometry: pd.DataFrame) -> dict:
    """One run's context row; `geometry` holds its rows (layer-mean normalised entropy at the last probe)."""
    rd = RunDir(run)
    info, done = read_json(rd.config), read_json(rd.done)
    cfg = info["config"]
    if info.get("source") == "qkgeom.Probe":  # someone else's training run: what the probe knows
        return external_context(cfg, done, geometry)
    # the facts the trainer wrote into done.json when it knew them; runs finished before it did are rebuilt
    if "unigram_baseline" in done:
        baseline = done["unigram_baseline"]
    else:
        try:
            baseline = unigram_baseline(cfg["data"]["source"], cfg["data"]["tokenizer"], rd.vocab.read_text())
        except (DataError, OSError):
            baseline = float("nan")  # the corpus is not on this machine: said as n/a
    ent = geometry[(geometry["metric"] == "attention_entropy_normalised") & (geometry["head"] == -1)]
    ent = ent[ent["step"] == ent["step"].max()]["value"].mean()
    params = done.get("n_parameters") or n_parameters(cfg["model"], Vocab.from_json(rd.vocab.read_text()).size)
    tokens = done.get("tokens_seen", cfg["train"]["steps"] * cfg["train"]["batch_size"] * cfg["model"]["n_ctx"])
    return {
        "final_valid_loss": done["final_valid_loss"],
        "unigram_baseline": baseline,
        "normalised_entropy": float(ent),
        "tokens_seen": tokens,
        "parameters": params,
        "tokens_per_parameter": tokens / params,
        "precision": "bf16 autocast" if C.uses_bf16(C.from_dict(cfg).train) else "float32",
    }


def external_context(cfg: dict, done: dict, geometry: pd.DataFrame) -> dict:
    """The context row of a qkgeom.Probe run: its tokenizer is not ours, so no unigram baseline;
    tokens from the last probe's tokens_seen (n/a if the loop did not pass it)."""
    last = geometry[geometry["step"] == geometry["step"].max()] if len(geometry) else geometry
    ent = last[(last["metric"] == "attention_entropy_normalised") & (last["head"] == -1)]["value"].mean()
    tokens = float(last["tokens_seen"].max()) if len(last) else float("nan")
    tokens = tokens if tokens >= 0 else float("nan")
    params = cfg["model"]["parameters"]
    loss = done.get("final_valid_loss")
    return {
        "final_valid_loss": float("nan") if loss is None else float(loss),
        "unigram_baseline": float("nan"),
        "normalised_entropy": float(ent),
        "tokens_seen": tokens,
        "parameters": params,
        "tokens_per_parameter": tokens / params,
        "precision": "as trained (qkgeom.Probe)",
    }


def study_context(runs: dict[str, Path], geometry: pd.DataFrame) -> pd.DataFrame:
    """Context rows of every run (index run_id)."""
    ent = geometry[(geometry["metric"] == "attention_entropy_normalised") & (geometry["head"] == -1)]
    by_run = dict(tuple(ent.groupby("run_id")))  # one pass, not one scan of every row per run
    rows = {rid: run_context(path, by_run.get(rid, ent.iloc[:0])) for rid, path in runs.items()}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("run_id")


def context_sentence(ctx: pd.DataFrame) -> str:
    """The report's opening box, in words (ranges over runs; n/a where no run recorded a value)."""

    def span(col: str, fmt: str) -> str:
        x = ctx[col].dropna()
        if x.empty:
            return "n/a"
        lo, hi = x.min(), x.max()
        return format(lo, fmt) if np.isclose(lo, hi) else f"{format(lo, fmt)}-{format(hi, fmt)}"

    external = ctx["precision"].str.contains("qkgeom.Probe").all()  # someone else's runs and tokenizer
    if external:
        loss = f"Final validation loss {span('final_valid_loss', '.3f')} nats/token (as the training loop logged it)"
    else:
        base = "n/a (corpus not found)" if ctx["unigram_baseline"].isna().all() else span("unigram_baseline", ".3f")
        loss = (
            f"Final validation loss {span('final_valid_loss', '.3f')} nats/token against a unigram baseline of "
            f"{base} nats/token (a token is one character)"
        )
    return (
        f"{loss}; mean normalised attention entropy at the last probe "
        f"{span('normalised_entropy', '.2f')} (1 = uniform); {span('tokens_seen', ',.0f')} tokens seen, "
        f"{span('tokens_per_parameter', '.2f')} tokens per parameter ({span('parameters', ',.0f')} parameters); "
        f"precision {', '.join(sorted(set(ctx['precision'])))}."
    )
