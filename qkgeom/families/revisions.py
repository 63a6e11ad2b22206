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
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from qkgeom import config as C

# the judging half lives in the analysis wing (qkgeom.analysis.families); its names stay importable here
from qkgeom.analysis.families import (  # noqa: F401
    CONTRAST_SLOPE,
    CONTRAST_TREND,
    FAMILY_DATASET_COLUMNS,
    HEADS_LINK,
    LAYER_TABLE,
    N_PERMUTATIONS,
    REVISION_COLUMNS,
    WITHIN_LAYER_LINK,
    family_dataset,
    family_tables,
    family_trends,
    layer_table,
    left_out_revisions,
    load_family,
    model_headline,
    within_layer_link,
)
from qkgeom.device import check_device
from qkgeom.errors import read_text
from qkgeom.families.config import PretrainedConfig
from qkgeom.probing import archs
from qkgeom.provenance import provenance
from qkgeom.results import (
    EXPORT_INFO,
    EXPORT_VOCAB,
    DamagedRunError,
    RunDir,
    read_json,
    write_json,
)

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


# a training step, tokens and stage in a revision's name: step1000 (Pythia), step_1000 (our exports),
# step20000-tokens84B (OLMo), stage1-step5000-tokens21B (OLMo-2)
_STEP = re.compile(r"(?:^|[-_])step[-_]?(\d+)(?=$|[-_])")
_TOKENS = re.compile(r"(?:^|[-_])tokens(\d+(?:\.\d+)?)([KMBT])(?=$|[-_])")
_STAGE = re.compile(r"stage(\d+)[-_]")
_UNIT = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def step_of(revision: str) -> int | None:
    """The optimiser step a revision's name carries (step1000, step_1000, step20000-tokens84B), if any."""
    m = _STEP.search(revision)
    return int(m.group(1)) if m else None


def tokens_of(revision: str) -> int | None:
    """The training tokens a revision's name carries (tokens84B: 84e9, as the name rounds them), if any."""
    m = _TOKENS.search(revision)
    return round(float(m.group(1)) * _UNIT[m.group(2)]) if m else None


def stage_of(revision: str) -> int:
    """The training stage a revision's name opens with (stage2-ingredient1-step1000: 2); 1 where none."""
    m = _STAGE.match(revision)
    return int(m.group(1)) if m else 1


def thinned(revisions: list[str], every: int, keep_through: int) -> list[str]:
    """Revisions in step order thinned as --every thins Pythia's schedule: all up to step `keep_through`
    (the early window the family trends are judged in), then every k-th of the rest, and the last; in
    the order given (a revision whose name has no step counts as early)."""
    late = [r for r in revisions if (step_of(r) or 0) > keep_through]
    dropped = set(late) - set(late[every - 1 :: every]) - set(late[-1:])
    return [r for r in revisions if r not in dropped]


def hub_revisions(model: str) -> list[str]:
    """The branches of a hub model named by a training step, in step order: its first training stage's
    (OLMo-2's stage1-...; a later stage restarts its steps, so it is left out, and stderr says so)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise archs.PretrainedError(
            f"--all-revisions lists the branches of {model} on the hub, and HF_HUB_OFFLINE is set: "
            "name the cached revisions with --revision"
        )
    try:
        branches = [b.name for b in HfApi().list_repo_refs(model).branches]
    except Exception as e:  # the hub's and the network's errors, whichever HTTP library the client uses
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise archs.PretrainedError(f"cannot list the revisions of {model} on the hub: {first}") from None
    named = [b for b in branches if step_of(b) is not None]
    if not named:
        some = ", ".join(sorted(branches)[:5]) or "none"
        raise archs.PretrainedError(
            f"{model} has no branch named by a training step on the hub (branches: {some}): name revisions "
            "with --revision"
        )
    first = min(map(stage_of, named))
    kept = [b for b in named if stage_of(b) == first]
    if len(kept) < len(named):
        print(
            f"qkgeom pretrained: {len(named) - len(kept)} revision(s) of {model} from later training stages "
            "left out (their steps restart); name them with --revision",
            file=sys.stderr,
        )
    return sorted(kept, key=lambda r: (step_of(r), r))


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
    from qkgeom.probing.hf import analyse_model, load_model, token_batches, weights_digest

    rev = revision or "main"
    rd = RunDir(out / C.safe_name(rev))  # `refs/pr/1` or `../x` stay inside `out` (config.json keeps the name)
    if rd.is_done():
        return rd.path
    device = check_device(pc.device, "pretrained.device")  # before a model is loaded
    model = load_model(pc.model, revision).to(device)
    limit = archs.context_length(model)
    seq_len = min(pc.seq_len, limit) if limit else pc.seq_len  # e.g. our exported runs have n_ctx < 256
    path, _ = archs.resolve_revision(pc.model, revision)
    tokens, prefix = tokens_fn(path)
    n_vocab = model.get_input_embeddings().num_embeddings
    top = max([int(tokens.max()) if len(tokens) else -1, *prefix])
    if top >= n_vocab:  # an embedding lookup would fail deep inside the model
        raise archs.PretrainedError(
            f"the tokenizer gives id {top}, beyond the {n_vocab}-entry vocabulary of {pc.model}: it is not this "
            "model's tokenizer (pass --tokenizer NAME_OR_FOLDER)"
        )
    batches = token_batches(tokens, seq_len, pc.batch_size, pc.n_tokens, prefix)
    rows, spectra = analyse_model(model, batches, progress, pc.settings)
    step = step_of(rev)
    tps = tokens_per_step(path)
    tokens_seen = step * tps if step is not None and tps else tokens_of(rev)  # else the name's (OLMo's tokens84B)
    n_seqs = min(pc.n_tokens, len(tokens)) // ((seq_len - len(prefix)) * pc.batch_size) * pc.batch_size
    info = {
        "model": pc.model,
        "revision": rev,
        "step": step,
        "tokens_seen": tokens_seen,
        "weights_sha256": weights_digest(model),
        "model_type": model.config.model_type,
        "pretrained_config": C.to_dict(pc),  # every setting that changes a number
        "n_tokens": n_seqs * seq_len,
        "seq_len": seq_len,
        # the logit spectrum (T x T eigen-solves) is sampled: the first logit_seqs sequences
        "logit_seqs": pc.settings.logit_count(n_seqs),
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
                "tokens_seen": -1 if tokens_seen is None else tokens_seen,
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
    folders = []
    with tqdm(total=len(revisions), desc=desc, unit="rev", disable=not progress or len(revisions) == 1) as bar:
        for _, folder in run_jobs(analyse_revision, jobs, executor, workers=1, threads=1, address=address):
            folders.append(folder)
            bar.update(1)
    return folders  # the bar is closed on an error too: the error's line starts a line of its own


def local_revisions(root: Path) -> list[str]:
    """The revision sub-folders of a local model folder: those with a config.json, never a hidden
    one (a killed export's temp folder); in a qkgeom export (any revision carries EXPORT_INFO, written
    last) only the revisions that carry it, i.e. that were exported whole."""
    found = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / "config.json").is_file()]
    if any((d / EXPORT_INFO).is_file() for d in found):
        found = [d for d in found if (d / EXPORT_INFO).is_file()]
    return [d.name for d in found]


def family_revisions(pc: PretrainedConfig) -> list[str | None]:
    """The revisions a config names: its list, its family schedule, every sub-folder of a local folder
    or every step-named branch of a hub model (ordered by step, thinned by `every` past the early
    window), or [None] (the default revision); each once, in that order."""
    revisions: list[str | None] = list(pc.revisions)
    if pc.family == "pythia":
        revisions += pythia_revisions(pc.every)
    if pc.all_revisions:
        root = Path(pc.model)
        if root.is_dir():
            listed = sorted(local_revisions(root), key=lambda r: (step_of(r) is None, step_of(r) or 0, r))
        else:
            listed = hub_revisions(pc.model)
        revisions += thinned(listed, pc.every, pc.early_max_step)
    revisions = list(dict.fromkeys(revisions))  # --revision step1000 --family pythia names it twice
    stages = sorted({stage_of(r) for r in revisions if r is not None and step_of(r) is not None})
    if len(stages) > 1:  # stage2-...-step1000 is not later than stage1-step5000: one step axis cannot hold both
        raise archs.PretrainedError(
            f"the revisions come from training stages {', '.join(map(str, stages))}, whose steps restart: "
            "analyse each stage as a family of its own (--out apart)"
        )
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
        if vocab.is_file() and pc.tokenizer:  # it would be recorded as used, and was not
            why = f"read with its own vocabulary ({EXPORT_VOCAB}): --tokenizer does not apply to it; leave it out"
            raise archs.PretrainedError(f"{path} is an exported qkgeom run, {why}")
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
