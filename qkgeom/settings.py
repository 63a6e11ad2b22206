"""The run configuration's types: frozen dataclasses with their defaults and a docstring per field
(data, model, train, probe, intervention), and the spectral conventions. qkgeom.config loads,
overrides, validates and names them, and re-exports them (C.RunConfig, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qkgeom.errors import ConfigError

PR_CONVENTIONS = ("variance", "singular")  # = probing.geometry.PR_CONVENTIONS (config may not import it)
ALPHA_CONVENTIONS = ("weightwatcher", "clauset")  # heavy-tail alpha fits (probing.alpha.power_law_alpha)


@dataclass(frozen=True)
class Conventions:
    """The conventions the spectral summaries are computed under: one value, built and checked here,
    passed from a config (or an API call) down to every metric; each row's `note` names the one that
    made it (docs/GLOSSARY.md, 'Conventions')."""

    pr: str = "variance"
    """Participation ratio of `variance`s ((sum l)^2 / sum l^2) or of `singular` values."""
    alpha: str = "weightwatcher"
    """Heavy-tail alpha as WeightWatcher 0.7.7 fits it, or `clauset` (powerlaw's fit without xmax)."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("pr", self.pr, PR_CONVENTIONS), ("alpha", self.alpha, ALPHA_CONVENTIONS)):
            if value not in allowed:
                raise ConfigError(f"{name}_convention must be one of {allowed}, got {value!r}")


DEFAULT_CONVENTIONS = Conventions()
GRAM_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class ProbeSettings:
    """How a probe measures: the spectral conventions, the sequences whose T x T logit spectrum is
    taken, and the precision of each batch's centered Gram product. One checked value, built from a
    run's [probe] or a measurement's [pretrained] (their `.settings`) or from an API call's keywords
    (`ProbeSettings.of`, the one place where "0 = all" becomes None), and passed whole to the probe,
    the accumulator and the Hugging Face path."""

    conventions: Conventions = DEFAULT_CONVENTIONS
    logit_seqs: int | None = 4
    """The first this many sequences give the logit spectrum (its eigen-solves are a probe's costliest
    part; a per-sequence average, so a cap widens its noise, adds no bias); None = all."""
    gram_dtype: str = "float64"
    """float64, or float32 (half the cost on wide layers; ~1e-6 relative on the spectrum); the
    running covariances are float64 either way."""

    def __post_init__(self) -> None:
        if self.logit_seqs is not None and self.logit_seqs < 1:  # ProbeSettings.of maps a config's 0 to None
            raise ConfigError(f"logit_seqs must be None (all) or >= 1, got {self.logit_seqs}")
        if self.gram_dtype not in GRAM_DTYPES:
            raise ConfigError(f"gram_dtype must be one of {GRAM_DTYPES}, got {self.gram_dtype!r}")

    @classmethod
    def of(
        cls,
        logit_max_seqs: int | None = 4,
        pr_convention: str = "variance",
        alpha_convention: str = "weightwatcher",
        gram_dtype: str = "float64",
    ) -> ProbeSettings:
        """From the flat fields a config or a call spells out; logit_max_seqs 0 (or None) = all."""
        if logit_max_seqs is not None and logit_max_seqs < 0:
            raise ConfigError(f"logit_max_seqs must be >= 0 (0 = all), got {logit_max_seqs}")
        return cls(Conventions(pr_convention, alpha_convention), logit_max_seqs or None, gram_dtype)

    def logit_count(self, n_seqs: int) -> int:
        """How many of `n_seqs` probe sequences give the logit spectrum (recorded with every run)."""
        return n_seqs if self.logit_seqs is None else min(n_seqs, self.logit_seqs)

    @property
    def torch_gram_dtype(self):  # noqa: ANN201 - torch.dtype (torch is not imported by the config types)
        """The Gram precision as a torch dtype."""
        import torch

        return getattr(torch, self.gram_dtype)


DEFAULT_PROBE = ProbeSettings()


@dataclass(frozen=True)
class DataConfig:
    source: str = "wikitext-2"
    """`wikitext-2`, `wikitext-103`, or a folder holding train.txt, valid.txt, test.txt."""
    tokenizer: str = "char"
    """`char` (vocabulary built from the training split) or `byte` (256 ids + unk)."""


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int = 2
    """Number of Transformer blocks."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per layer; must divide d_model."""
    n_ctx: int = 64
    """Context length (tokens)."""
    d_mlp: int = 0
    """Hidden width of the MLP; 0 means 4 * d_model."""
    qk_init: str = "independent"
    """Query/key initialisation: independent, orthogonal, tied, anti_tied (energy-matched)."""
    init_std: float = 0.02
    """Standard deviation of the Gaussian initialisation (GPT-2's 0.02)."""

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_hidden(self) -> int:
        return self.d_mlp or 4 * self.d_model

    def n_parameters(self, vocab_size: int) -> int:
        """Trainable parameters of training/model.py's GPT at this shape, counted without building it:
        token and position embeddings (the token one tied to the output), per block W_Q, W_K, W_V, W_O,
        the MLP's two bias-free matrices and two LayerNorms (weight and bias), and the final LayerNorm.
        tests/training/test_model.py checks it against the built model's count."""
        D, L = self.d_model, self.n_layers
        block = 4 * D * self.n_heads * self.d_head + 2 * D * self.d_hidden + 2 * 2 * D
        return vocab_size * D + self.n_ctx * D + L * block + 2 * D


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    """Number of optimiser steps."""
    batch_size: int = 16
    """Sequences per step."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule as a fraction of lr."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on gains, biases, embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seed of the weight initialisation."""
    data_seed: int = 0
    """Seed of the data order (separate from the weight seed)."""
    eval_every: int = 50
    """Validation loss every this many steps (and at the end)."""
    eval_batches: int = 4
    """Validation batches per evaluation (fixed offsets)."""
    checkpoint_every: int = 50
    """Write the resume checkpoint every this many steps (and at the end)."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps whose weights are kept permanently under checkpoints/ (as step_<n>.pt)."""
    keep_checkpoints: str = "none"
    """Checkpoints kept beside last.pt, for `qkgeom export` as a checkpoint family: `none`, or `log`
    (about 16 log-spaced steps and the last; each file holds weights and AdamW state, ~12 bytes per
    parameter: ~10 MB at the cpu preset, depth 4). Explicit steps: checkpoint_steps."""
    device: str = "cpu"
    """Torch device (`cpu`, `cuda`, `cuda:N`; not `mps`, which has no float64)."""
    precision: str = "auto"
    """Training matmuls: `float32`, `bf16` (autocast), or `auto` = bf16 on cuda, float32 elsewhere.
    Probes and geometry always run in float32 / float64. On cuda, TF32 and a fused AdamW are used."""
    compile: bool = False
    """torch.compile the training forward (probes use the eager model); use it where bench/ shows a gain."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default (with `portable`: 1)."""
    portable: bool = False
    """One float code path whatever the CPU (vector width, vendor): oneMKL's COMPATIBLE branch, torch's
    kernels without vector instructions, sqrt and log off oneMKL's vector math (device.exact_math), a
    fixed thread count (`threads`, 1 when 0), so the run repeats bit for bit on another x86-64 CPU, Intel
    or AMD, with the same torch build and C library (qkgeom.device.PORTABLE_ENV). Slower:
    1.9x at the smoke preset, 3.3x at the cpu preset, one thread each (bench/cpu_paths.py). CPU, float32
    and eager only; the settings must be in place before torch starts (`qkgeom train|sweep|study
    --portable` sees to it)."""


@dataclass(frozen=True)
class ProbeConfig:
    every: int = 50
    """Probe every this many steps after the log-spaced early steps."""
    log_early: bool = True
    """Also probe at steps 0, 1, 2, 4, 8, ... below `every`."""
    n_seqs: int = 0
    """Sequences in the fixed probe batch (validation split); 0 = enough for min_tokens_per_dim."""
    min_tokens_per_dim: float = 10.0
    """With n_seqs = 0: probe tokens >= this x d_model (PR is biased low on small samples)."""
    logit_max_seqs: int = 4
    """Probe sequences whose logit (Q K^T) spectrum is taken, the first ones of the fixed batch
    (0 = all). Its T x T eigen-solves are a probe's costliest part; the logit PR and spectral norm are
    per-sequence averages, so a cap widens their sampling noise but adds no bias."""
    pr_convention: str = "variance"
    """Participation ratio of `variance`s (covariance eigenvalues, (sum l)^2 / sum l^2: qkgeom's) or of
    `singular` values ((sum s)^2 / sum s^2, as public Pythia weight datasets compute it); every PR row
    names its convention in the `note` column (docs/GLOSSARY.md relates the two)."""
    alpha_convention: str = "weightwatcher"
    """Heavy-tail alpha fit: `weightwatcher` (WeightWatcher 0.7.7's own, what papers report) or `clauset`
    (the powerlaw package's fit without xmax, tail >= 10 eigenvalues); every alpha row's note names it."""

    @property
    def settings(self) -> ProbeSettings:
        """How this run's probes measure, as one checked value (training probes: float64 Grams)."""
        return ProbeSettings.of(self.logit_max_seqs, self.pr_convention, self.alpha_convention)


@dataclass(frozen=True)
class InterventionConfig:
    kind: str = "none"
    """Spectrum control after every optimiser step: none, hold (initial profile), contract, expand on
    the weight spectra (`on`); `shape`: the *activation* PR of the keys, PR(Cov k), tracks ratio x the
    same seed's none run per head, queries untouched; `temperature`: the head's input-weighted logit
    scale tracks ratio^2 x the none run's (logits times ratio), no change of any spectrum's shape."""
    on: str = "key"
    """What is controlled: `key` (singular values of W_K^h) or `interaction` (of W_Q^h W_K^h^T)."""
    reference: str = "baseline"
    """contract/expand target = ratio x reference: `baseline` = the same seed's `none` run at the same
    step; `initial` = the head's initial PR on a linear schedule (training alone contracts W_K to
    ~0.4-0.6x, so an initial-relative target can leave W_K *less* contracted than the baseline)."""
    ratio: float = 1.0
    """Target ratio: < 1 for contract, > 1 for expand, any for shape and temperature; none and hold have
    none (1; anything else is refused)."""
    mode: str = "one-sided"
    """`one-sided`: contract is a ceiling, expand a floor (project only when past the target);
    `two-sided`: track the target exactly. Other kinds have one form: `two-sided` is refused there."""
    reach_fraction: float = 0.5
    """reference = initial: fraction of training by which ratio x initial PR is reached (refused otherwise)."""
    baseline: str = ""
    """reference = baseline: the `none` run's folder (relative to this run's parent folder); sweeps
    fill it in. Refused on an arm that does not read it (config.needs_baseline)."""
    match_scale: bool = False
    """After the projection, rescale W_Q^h and W_K^h by sqrt(gamma) so the head's input-weighted logit
    scale tr(M C M^T C) (M = W_Q W_K^T / sqrt(E), C the running input covariance) is what it was before
    it: the arm changes spectrum shape only. Any kind but temperature."""
    match_row_std: bool = False
    """Closed-loop logit scale (causal v4): after the projection, rescale W_Q^h and W_K^h by one factor
    so the head's per-row logit std on the control set (control_seqs) equals the same seed's none run's
    on that set at that step, interpolated between its probes. Shape, hold, contract or expand; needs
    the none run (reference = 'baseline'). Arm labels end in `:closed`."""
    control_seqs: int = 0
    """The closed loop's control set. 0: the probe batch's first 4 validation sequences (causal v4 as
    first registered: the scale check then reads the very rows the loop sets, so it cannot fail). N > 0:
    N fixed sequences of the *training* split, disjoint from every validation measure (probe, scale
    check, entropy, validation loss); every run with it set, the none run included, records its per-row
    logit std there at each probe (`logit_row_std_control`), which is what the closed loop tracks."""
    floor: float = 1.5
    """shape: targets below this PR are raised to it (a PR of 1 is a rank-1 clamp); such heads are
    flagged in the probe rows (`key_participation_ratio_floor_raised`)."""
    cov_decay: float = 0.9
    """shape, temperature, match_scale: the running centred covariance C of each layer's attention
    input is an exponential average over training batches with this decay per step."""
    instant: tuple[str, ...] = ()
    """The zero-training complement: arm labels (`shape:activation:0.7:matched`, `hold:key:matched`,
    `temperature:logit:0.5`, ... as tables name them) whose map is applied to a copy of this run's
    weights at every regular probe (multiples of probe.every) without any training, relative to this
    run itself; the change of attention entropy is recorded per head (metric
    `attention_entropy_instant_change`, site = the arm). Set on a study's none runs."""
    layers: tuple[int, ...] = ()
    """Layers controlled; empty means all."""
    heads: tuple[int, ...] = ()
    """Heads controlled; empty means all."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Human-readable run name (the run id adds a hash of the config)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    intervention: InterventionConfig = field(default_factory=InterventionConfig)
