"""What `qkgeom pretrained` measures: a frozen, validated config (defaults -> a [pretrained] TOML
table -> key=value overrides), written to every revision's config.json. The same machinery as the
run configs (config.py), kept apart so each file stays one room."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.config import (
    EARLY_MAX_STEP,
    ConfigError,
    ProbeSettings,
    apply_overrides,
    build_dataclass,
    resolve_preset,
)
from qkgeom.device import device_name_problem
from qkgeom.errors import read_text


@dataclass(frozen=True)
class PretrainedConfig:
    """What `qkgeom pretrained` measures on a Hugging Face model or checkpoint family; every field
    that can change a number is here and is written to each revision's config.json."""

    model: str = ""
    """Hub name or local folder."""
    revisions: tuple[str, ...] = ()
    """Revisions to analyse (empty: the default revision, unless family / all_revisions add some)."""
    family: str = ""
    """A built-in revision schedule to add: `pythia` (step0, 1, 2, 4, ..., 143000) or empty."""
    every: int = 1
    """With family: keep every k-th revision of the schedule's linear part; with all_revisions: every
    revision up to early_max_step, then every k-th and the last."""
    all_revisions: bool = False
    """Every revision sub-folder of a local model folder (e.g. an exported qkgeom run), or every branch
    of a hub model named by a training step (OLMo's step20000-tokens84B), of its first training stage."""
    text: str = ""
    """Text file to sample; empty: WikiText-2 validation (raw where the mirror has it)."""
    tokenizer: str = ""
    """Tokenizer name or folder; empty: the model's own."""
    n_tokens: int = 65_536
    """Tokens to stream through the model."""
    seq_len: int = 256
    """Sequence length (capped at the model's context)."""
    batch_size: int = 8
    """Sequences per forward pass."""
    strip_special_tokens: bool = False
    """Do not open each sequence with the model's own start tokens (BOS / CLS)."""
    logit_max_seqs: int = 4
    """Sequences in the logit-spectrum sample, the first ones (the same in every revision, so trends
    are paired); its T x T eigen-solves cost ~0.5 s per sequence at 30 layers x 9 heads, T = 256,
    more than the forward pass. 0 = all."""
    pr_convention: str = "variance"
    """PR of `variance`s (covariance eigenvalues, qkgeom's) or of `singular` values (public Pythia weight
    datasets); every PR row's note names it (see probe.pr_convention)."""
    alpha_convention: str = "weightwatcher"
    """Heavy-tail alpha fit: `weightwatcher` (WeightWatcher 0.7.7's) or `clauset` (see probe.alpha_convention)."""
    gram_dtype: str = "float32"
    """Precision of each batch's centered Gram matrix (running state is float64): float32 or float64."""
    early_max_step: int = EARLY_MAX_STEP
    """Last step of the early window of the family trend statistics."""
    device: str = "cpu"
    """Torch device the model runs on (`cpu`, `cuda`, `cuda:N`; not `mps`, which has no float64); geometry is
    the same on each (float64 results within 1e-6 relative, tests/e2e/test_gpu.py), a GPU only faster."""

    @property
    def settings(self) -> ProbeSettings:
        """How each revision is measured, as one checked value."""
        return ProbeSettings.of(self.logit_max_seqs, self.pr_convention, self.alpha_convention, self.gram_dtype)


def load_pretrained(path: str | Path | None = None, overrides: list[str] | None = None) -> PretrainedConfig:
    """Defaults, then a TOML file (a [pretrained] table), then `overrides` (key=value); validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_preset(path, "pretrained")
        try:
            whole = tomllib.loads(read_text(p, ConfigError))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        if set(whole) != {"pretrained"} or not isinstance(whole["pretrained"], dict):  # a key outside was ignored
            raise ConfigError(f"config file {p} must hold a [pretrained] table and no other key: found {sorted(whole)}")
        data = whole["pretrained"]
    # keys are written bare (n_tokens=...) or as in the file's table and the messages (pretrained.n_tokens=...)
    overrides = [o.removeprefix("pretrained.") for o in overrides or []]
    pc = build_dataclass(PretrainedConfig, apply_overrides(data, overrides), "pretrained.")

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(bool(pc.model), "pretrained.model is empty: name a hub model or a local folder")
    need(pc.n_tokens > 0, f"pretrained.n_tokens must be positive, got {pc.n_tokens}")
    need(pc.seq_len > 1, f"pretrained.seq_len must be > 1, got {pc.seq_len}")
    need(pc.batch_size > 0, f"pretrained.batch_size must be positive, got {pc.batch_size}")
    need((wrong := device_name_problem(pc.device)) is None, f"pretrained.device {wrong}")
    need(pc.every >= 1, f"pretrained.every must be >= 1, got {pc.every}")
    need(
        pc.every == 1 or bool(pc.family) or pc.all_revisions,
        f"pretrained.every = {pc.every} thins a family schedule or all_revisions; neither is named",
    )
    need(pc.early_max_step >= 0, f"pretrained.early_max_step must be >= 0, got {pc.early_max_step}")
    need(pc.family in ("", "pythia"), f"pretrained.family must be 'pythia' or empty, got {pc.family!r}")
    try:
        pc.settings  # noqa: B018 - builds and checks the probe settings (one door)
    except ConfigError as e:
        raise ConfigError(f"pretrained.{e}") from None
    return pc
