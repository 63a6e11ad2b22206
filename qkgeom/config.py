"""Typed, frozen run configuration: defaults, then a TOML file, then ``--set`` overrides.

Every field has a docstring-style comment; unknown keys and wrongly typed values are
rejected with a one-line :class:`ConfigError` naming the key. Derived values are
properties, never written back, so ``config.json`` records exactly what was asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from qkgeom.arms import Arm, check_arm
from qkgeom.device import device_name_problem
from qkgeom.errors import ConfigError, read_text
from qkgeom.settings import (  # noqa: F401 (the config types, C.RunConfig, ...: defined in qkgeom.settings)
    ALPHA_CONVENTIONS,
    DEFAULT_CONVENTIONS,
    DEFAULT_PROBE,
    GRAM_DTYPES,
    PR_CONVENTIONS,
    Conventions,
    DataConfig,
    InterventionConfig,
    ModelConfig,
    ProbeConfig,
    ProbeSettings,
    RunConfig,
    TrainConfig,
)

# Where this package runs from: the one place that derives it from __file__, so that moving a module
# never moves what it points at. From a checkout (an editable install, or a clone on PYTHONPATH) REPO_ROOT
# is the clone: configs/, docs/results/ and git lie in it, the shared WikiText mirror beside it
# (training.data.wikitext_mirror). From an installed wheel there is no checkout: the presets ship inside
# the package (pyproject's package-dir maps configs/ to qkgeom/configs/), and what a study keeps in the
# project (its records) goes under the current directory instead (project_path).
PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "configs").is_dir()

QK_INITS = ("independent", "orthogonal", "tied", "anti_tied")
# the arm kinds (which, their targets, ratio rules, matchings) live in qkgeom.arms (KINDS)
REFERENCES, CONTROL_MODES = ("baseline", "initial"), ("one-sided", "two-sided")
EARLY_MAX_STEP = 1000  # claim 4's early window ends here (family-cpu's and ladder-cpu's pre-registrations)
# keys and values of earlier versions: a one-line error that names the replacement
REPLACED = {
    "intervention.target_fraction": "intervention.ratio (with intervention.reference = 'initial' for the old "
    "schedule relative to the initial spectrum)",
    "intervention.shrink": "intervention.kind = 'contract' (a one-sided ceiling at intervention.ratio x the "
    "reference; reference = 'initial' gives the old schedule)",
}
TOKENIZERS = ("char", "byte")


# scalar annotation -> (accepts the TOML value, what the message says it expects)
_SCALARS: dict[type, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true/false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert: an integer where a float is expected) `value` against the annotation `tp`."""
    if typing.get_origin(tp) is tuple:
        (inner, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} expects a list, got {value!r}")
        return tuple(_coerce(v, inner, key) for v in value)
    if tp not in _SCALARS:
        raise ConfigError(f"config key {key!r} has unsupported type {tp}")  # pragma: no cover
    accepts, what = _SCALARS[tp]
    if not accepts(value):
        raise ConfigError(f"config key {key!r} expects {what}, got {value!r}")
    return float(value) if tp is float else value


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """A frozen config dataclass `cls` from nested plain data (TOML, config.json): every key known
    (a replaced key names its successor), every value of its field's type; `prefix` names the
    section in errors. Validation beyond types is the caller's (validate, for a RunConfig)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in unknown:
        if prefix + key in REPLACED:
            raise ConfigError(f"config key {prefix + key!r} was replaced by {REPLACED[prefix + key]}")
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build_dataclass(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from nested plain data (as in config.json or TOML)."""
    cfg = build_dataclass(RunConfig, data)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for JSON."""
    out = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [fix(v) for v in x]
        return x

    return fix(out)


def parse_scalar(text: str) -> Any:
    """Parse an override value with TOML rules; bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to nested plain data (a copy is returned)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override key {key!r} does not name a config field")
        value = parse_scalar(text.strip())
        if isinstance(node.get(parts[-1]), dict) or (isinstance(value, dict) and len(parts) == 1):
            # `--set model={...}` used to replace the whole [model] table, silently dropping the rest
            raise ConfigError(f"override {key!r} names a table; set its fields one by one ({key}.FIELD=value)")
        node[parts[-1]] = value
    return out


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file at `path`, then `overrides`; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_preset(path)
        try:
            data = tomllib.loads(read_text(p, ConfigError))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for table, command in (("sweep", f"qkgeom study {path}"), ("pretrained", "qkgeom pretrained MODEL --config")):
            if table in data:  # another command's file: say which, not "unknown config key"
                raise ConfigError(f"{p} is a [{table}] file, not a run config: run it with `{command}`")
    return from_dict(apply_overrides(data, overrides or []))


CONFIG_DIR = REPO_ROOT / "configs" if IN_CHECKOUT else PACKAGE_DIR / "configs"


def project_path(rel: str | Path) -> Path:
    """A path the project keeps (a study's records, docs/results/<study>/runs): in the checkout qkgeom
    runs from, else (an installed wheel) under the current directory."""
    return (REPO_ROOT if IN_CHECKOUT else Path.cwd()) / rel


def resolve_preset(path: str | Path, kind: str = "run") -> Path:
    """A TOML path, or the name of a preset in the repository's configs/ folder (e.g. `tiny`); a miss
    lists the presets of `kind` (run configs, or `pretrained`; study files are `qkgeom study`'s)."""
    p = Path(path)
    if p.is_file():
        return p
    preset = CONFIG_DIR / f"{path}.toml"
    if preset.is_file():
        return preset
    stems = sorted(x.stem for x in CONFIG_DIR.glob("*.toml") if not x.stem.startswith("study-"))
    known = ", ".join(x for x in stems if (x == "pretrained") == (kind == "pretrained"))
    raise ConfigError(f"config {str(path)!r} is neither a file nor a preset (presets: {known})")


MAX_CTX = 8192  # a T x T probe pattern per head beyond this does not fit a workstation's memory
# run names become folder names: no path separators, no "..", nothing a shell would misread
SAFE_NAME = re.compile(r"[A-Za-z0-9_=,+\-][A-Za-z0-9._=,+\-]*")


def arm_label(iv: dict) -> str:
    """A condition's name in tables (qkgeom.arms.Arm): `none`, `hold:key`, `contract:key:0.6`,
    `shape:activation:0.7`, `temperature:logit:0.5`; `:matched` at open-loop matched logit scale
    (match_scale), `:closed` at closed-loop matched per-row logit std (match_row_std)."""
    return Arm.of(iv).label


def arm_config(label: str) -> InterventionConfig:
    """The intervention an arm label names (the inverse of arm_label), relative to the baseline."""
    return InterventionConfig(**Arm.parse(label).fields())


def needs_baseline(iv: InterventionConfig) -> bool:
    """Whether an intervention reads the same seed's none run (its targets, or its closed-loop scale)."""
    if iv.kind == "none" or iv.reference != "baseline":
        return False
    return iv.kind != "hold" or iv.match_row_std


# config keys added after studies had committed their run ids (causal v3), with their defaults
HASHED_ONLY_IF_SET = {
    "intervention.match_scale": False,
    "intervention.match_row_std": False,
    "intervention.floor": 1.5,
    "intervention.cov_decay": 0.9,
    "intervention.instant": [],
    "intervention.control_seqs": 0,
    "probe.pr_convention": "variance",
    "probe.alpha_convention": "weightwatcher",
    "train.portable": False,
}


def run_id(cfg: RunConfig) -> str:
    """A run's deterministic id and folder name: its name plus a hash of the resolved config (keys
    added after runs were committed enter the hash only when set away from their default, so every
    committed record keeps its id)."""
    d = to_dict(cfg)
    for key, default in HASHED_ONLY_IF_SET.items():
        section, name = key.split(".")
        if d[section].get(name) == default:
            del d[section][name]
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
    return f"{cfg.name}-{digest}"


def safe_name(label: str) -> str:
    """`label` made a valid run name: any character outside SAFE_NAME's set becomes '-'."""
    out = re.sub(r"[^A-Za-z0-9._=,+\-]", "-", label).lstrip(".")
    return out or "run"


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError for values that cannot make a sensible run."""
    m, t, p, iv = cfg.model, cfg.train, cfg.probe, cfg.intervention

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(cfg.data.tokenizer in TOKENIZERS, f"data.tokenizer must be one of {TOKENIZERS}, got {cfg.data.tokenizer!r}")
    for k in ("n_layers", "d_model", "n_heads", "n_ctx"):
        need(getattr(m, k) > 0, f"model.{k} must be positive, got {getattr(m, k)}")
    need(m.d_model % m.n_heads == 0, f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}")
    need(m.qk_init in QK_INITS, f"model.qk_init must be one of {QK_INITS}, got {m.qk_init!r}")
    need(
        m.qk_init != "orthogonal" or 2 * m.d_head <= m.d_model,
        f"model.qk_init='orthogonal' needs 2*d_head <= d_model, got d_head={m.d_head}, d_model={m.d_model}",
    )
    need(m.n_ctx <= MAX_CTX, f"model.n_ctx must be <= {MAX_CTX} (learned positions, T x T probes), got {m.n_ctx}")
    need(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    need((wrong := device_name_problem(t.device)) is None, f"train.device {wrong}")
    need(t.threads >= 0, f"train.threads must be >= 0 (0 = torch's default), got {t.threads}")
    need(not t.portable or t.device == "cpu", f"train.portable is for CPU runs, got train.device={t.device!r}")
    need(not (t.portable and t.compile), "train.portable runs eager: torch.compile builds kernels for this CPU")
    need(
        not t.portable or t.precision != "bf16",
        "train.portable trains in float32: bf16 matmuls take kernels this CPU's bf16 support picks",
    )
    need(
        SAFE_NAME.fullmatch(cfg.name) is not None,
        f"name {cfg.name!r} may hold only letters, digits and . _ = , + - (it names a folder)",
    )
    need(m.d_mlp >= 0, f"model.d_mlp must be >= 0, got {m.d_mlp}")
    need(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    need(t.batch_size > 0, f"train.batch_size must be positive, got {t.batch_size}")
    need(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    need(0 <= t.warmup_steps <= t.steps, f"train.warmup_steps must be in [0, steps], got {t.warmup_steps}")
    need(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    for k in ("beta1", "beta2"):  # NaN fails the comparison too
        need(0 <= getattr(t, k) < 1, f"train.{k} must be in [0, 1) (an AdamW moment decay), got {getattr(t, k)}")
    for k in ("seed", "data_seed"):  # numpy's generators take seeds in [0, 2**32)
        need(0 <= getattr(t, k) < 2**32, f"train.{k} must be in [0, 2**32), got {getattr(t, k)}")
    need(t.grad_clip >= 0, f"train.grad_clip must be >= 0, got {t.grad_clip}")
    need(
        t.precision in ("auto", "float32", "bf16"),
        f"train.precision must be auto, float32 or bf16, got {t.precision!r}",
    )
    for k in ("eval_every", "eval_batches", "checkpoint_every"):
        need(getattr(t, k) > 0, f"train.{k} must be positive, got {getattr(t, k)}")
    need(all(0 <= s <= t.steps for s in t.checkpoint_steps), f"train.checkpoint_steps must lie in [0, {t.steps}]")
    need(
        t.keep_checkpoints in KEEP_CHECKPOINTS,
        f"train.keep_checkpoints must be one of {KEEP_CHECKPOINTS} (explicit steps: train.checkpoint_steps), "
        f"got {t.keep_checkpoints!r}",
    )
    need(p.every > 0, f"probe.every must be positive, got {p.every}")
    need(p.n_seqs >= 0, f"probe.n_seqs must be >= 0 (0 = automatic), got {p.n_seqs}")
    need(p.min_tokens_per_dim > 0, f"probe.min_tokens_per_dim must be positive, got {p.min_tokens_per_dim}")
    try:
        p.settings  # noqa: B018 - builds and checks the probe settings (one door)
    except ConfigError as e:
        raise ConfigError(f"probe.{e}") from None
    if iv.kind == "shrink":
        raise ConfigError(f"intervention.kind 'shrink' was replaced by {REPLACED['intervention.shrink']}")
    need(iv.reference in REFERENCES, f"intervention.reference must be one of {REFERENCES}, got {iv.reference!r}")
    need(iv.mode in CONTROL_MODES, f"intervention.mode must be one of {CONTROL_MODES}, got {iv.mode!r}")
    need(
        not (iv.match_row_std and iv.match_scale),
        "intervention.match_row_std (closed loop) and match_scale (open loop) exclude each other",
    )
    arm = Arm.of(iv)
    problem = check_arm(arm.kind, arm.on, arm.ratio, arm.matching, iv.reference, iv.mode)
    need(problem is None, str(problem))
    need(
        not iv.baseline or needs_baseline(iv),
        f"intervention.baseline is read only by an arm that tracks its none run; {arm.label} does not",
    )
    need(iv.floor >= 1, f"intervention.floor must be >= 1 (a PR), got {iv.floor}")
    need(
        iv.control_seqs >= 0, f"intervention.control_seqs must be >= 0 (0 = the probe's first 4), got {iv.control_seqs}"
    )
    need(0 <= iv.cov_decay < 1, f"intervention.cov_decay must be in [0, 1), got {iv.cov_decay}")
    for label in iv.instant:
        arm_config(label)  # raises ConfigError naming a malformed label

    bad_layers = [x for x in iv.layers if not 0 <= x < m.n_layers]
    need(not bad_layers, f"intervention.layers {bad_layers} do not exist (model has {m.n_layers} layers)")
    bad_heads = [x for x in iv.heads if not 0 <= x < m.n_heads]
    need(not bad_heads, f"intervention.heads {bad_heads} do not exist (model has {m.n_heads} heads)")
    need(0 < iv.reach_fraction <= 1, f"intervention.reach_fraction must be in (0, 1], got {iv.reach_fraction}")
    need(
        iv.reference == "initial" or iv.reach_fraction == InterventionConfig.reach_fraction,
        "intervention.reach_fraction schedules a target relative to the initial PR: it needs reference = 'initial'",
    )
    _check_finite(cfg)


def _check_finite(cfg: RunConfig) -> None:
    """TOML reads inf, which passes "> 0" (NaN fails every range check above, which names it first)."""
    for sec in ("model", "train", "probe", "intervention"):
        for f in dataclasses.fields(part := getattr(cfg, sec)):
            if isinstance(v := getattr(part, f.name), float) and not math.isfinite(v):
                raise ConfigError(f"{sec}.{f.name} must be finite, got {v}")


KEEP_CHECKPOINTS = ("none", "log")
N_LOG_CHECKPOINTS = 16
MIN_FAMILY_REVISIONS = 5  # runs keeping fewer checkpoints are not read as checkpoint families (family_study)


def kept_steps(t: TrainConfig) -> list[int]:
    """The steps whose checkpoints a run keeps: checkpoint_steps, plus for keep_checkpoints = `log`
    step 0, about 16 log-spaced steps, and the last step."""
    steps = set(t.checkpoint_steps)
    if t.keep_checkpoints == "log":
        steps |= {0, t.steps} | {int(round(t.steps ** (i / (N_LOG_CHECKPOINTS - 1)))) for i in range(N_LOG_CHECKPOINTS)}
    return sorted(steps)


def uses_bf16(t: TrainConfig) -> bool:
    """Whether training runs under bf16 autocast (precision bf16, or auto on a cuda device)."""
    return t.precision == "bf16" or (t.precision == "auto" and t.device.startswith("cuda"))


def probe_n_seqs(cfg: RunConfig) -> int:
    """Probe sequences: probe.n_seqs, or (if 0) the fewest giving min_tokens_per_dim x d_model tokens,
    so the layer covariance (dimension d_model) gets at least that many samples per dimension."""
    if cfg.probe.n_seqs:
        return cfg.probe.n_seqs
    return max(1, math.ceil(cfg.probe.min_tokens_per_dim * cfg.model.d_model / cfg.model.n_ctx))
