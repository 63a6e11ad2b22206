"""Intervention arms: one table of kinds (KINDS) and the arm value (Arm) every table names.

An arm is what a study compares: a kind acting on a target, with a ratio and, for a kind that
changes spectrum shape, a logit-scale matching (`matched`: open loop, intervention.match_scale;
`closed`: closed loop, intervention.match_row_std). Its label is what tables and arm lists say:
`none`, `hold:key`, `contract:interaction:0.4`, `shape:activation:0.8:closed`, `temperature:logit:0.5`.

Whatever needs to know what a kind is reads its row here: the config's validation (targets, ratio
rule, matchings, whether it is relative to the none run), the labels (Arm.label, Arm.parse), the
analysis (the check mediator, the intended move, the predicted sign on attention entropy, the
assigned dose). A new kind is one row of KINDS plus its map in training.interventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qkgeom.errors import ConfigError

KEY_TARGETS = ("key", "interaction")  # what a weight-spectrum kind acts on: W_K, or W_Q W_K^T
# the mediator an arm must move before its outcome is read, by the target its label names
CHECK_MEDIATOR = {
    "key": "key_participation_ratio",
    "interaction": "logit_participation_ratio",
    "activation": "key_participation_ratio",
    "logit": "input_logit_scale",
}
MATCHINGS = ("", "matched", "closed")  # none, open-loop logit scale, closed-loop per-row logit std


@dataclass(frozen=True)
class Kind:
    """What a kind of intervention is (one row of KINDS)."""

    name: str
    shows: str | None  # the target its label names whatever `on` is (shape: activation), or None: `on`
    ratio: str  # "none" (no ratio: the label has none), "below 1", "above 1", "any" (positive)
    matchings: tuple[str, ...]  # the logit-scale matchings it may run at (MATCHINGS)
    relative: bool  # its target is ratio x the same seed's none run, always (reference = baseline)
    move: int  # intended sign of its move on the check mediator; 0: the sign of log(ratio)
    entropy: int  # predicted sign on attention entropy per unit move (+1 same way, -1 opposite)
    dose: float  # assigned dose per unit log(ratio) of the steered quantity (a variance: 2)

    @property
    def bounded(self) -> bool:
        """A ceiling (ratio below 1) or a floor (above 1): intervention.mode chooses one- or two-sided."""
        return self.ratio in ("below 1", "above 1")


KINDS = {
    k.name: k
    for k in (
        Kind("none", None, "none", ("",), relative=False, move=0, entropy=0, dose=0.0),
        Kind("hold", None, "none", MATCHINGS, relative=False, move=+1, entropy=+1, dose=0.0),
        Kind("contract", None, "below 1", MATCHINGS, relative=False, move=-1, entropy=+1, dose=1.0),
        Kind("expand", None, "above 1", MATCHINGS, relative=False, move=+1, entropy=+1, dose=1.0),
        Kind("shape", "activation", "any", MATCHINGS, relative=True, move=0, entropy=+1, dose=1.0),
        Kind("temperature", "logit", "any", ("",), relative=True, move=0, entropy=-1, dose=2.0),
    )
}
INTERVENTIONS = tuple(KINDS)
BASELINE_KINDS = tuple(k for k, v in KINDS.items() if v.relative)  # always relative to the none run
GRAMMAR = "none, hold:<on>[:matched|:closed] or <kind>:<on>:<ratio>[:matched|:closed]"


@dataclass(frozen=True)
class Arm:
    """One arm: its kind, its target (`on`: key or interaction for the weight-spectrum kinds), ratio
    and logit-scale matching. Arm.of(intervention) and Arm.parse(label) are inverses of .label."""

    kind: str = "none"
    on: str = "key"
    ratio: float = 1.0
    matching: str = ""

    @classmethod
    def of(cls, iv: object) -> Arm:
        """The arm of an intervention config (an InterventionConfig, or its dict in config.json)."""
        get = iv.get if isinstance(iv, dict) else lambda k, d=None: getattr(iv, k, d)
        matching = "matched" if get("match_scale") else "closed" if get("match_row_std") else ""
        return cls(get("kind"), get("on", "key"), float(get("ratio", 1.0)), matching)

    @classmethod
    def parse(cls, label: str) -> Arm:
        """The arm a label names; ConfigError (one line) for a label outside GRAMMAR."""
        parts = label.split(":")
        matching = parts[-1] if parts[-1] in MATCHINGS[1:] else ""
        parts = parts[:-1] if matching else parts
        kind = KINDS.get(parts[0])
        ok = kind is not None and len(parts) == (1 if kind.name == "none" else 2 if kind.ratio == "none" else 3)
        try:
            ratio = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"arm label {label!r} is not {GRAMMAR} (kind one of {INTERVENTIONS})")
        on = parts[1] if kind.shows is None and len(parts) > 1 else "key"
        return cls(kind.name, on, ratio, matching)

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    @property
    def target(self) -> str:
        """The target the label names: `on`, or what a data-acting kind steers (activation, logit)."""
        return self.spec.shows or self.on

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        ratio = "" if self.spec.ratio == "none" else f":{self.ratio:g}"
        return f"{self.kind}:{self.target}{ratio}" + (f":{self.matching}" if self.matching else "")

    @property
    def check(self) -> str:
        """The mediator its move is checked on (CHECK_MEDIATOR)."""
        return CHECK_MEDIATOR[self.target]

    @property
    def move(self) -> int:
        """The intended sign of its move on the check mediator."""
        return self.spec.move or (1 if self.ratio > 1 else -1)

    @property
    def predicted(self) -> int:
        """The predicted sign of its effect on attention entropy."""
        return self.move * self.spec.entropy

    @property
    def assigned_dose(self) -> float:
        """The dose assigned to the steered quantity, in log units (temperature: a logit variance)."""
        return self.spec.dose * math.log(self.ratio)

    def fields(self) -> dict:
        """The intervention config fields of this arm (relative to the baseline; a ceiling or floor tracked
        two-sided)."""
        return dict(
            kind=self.kind, on=self.on, ratio=self.ratio, match_scale=self.matching == "matched",
            match_row_std=self.matching == "closed", reference="baseline",
            mode="two-sided" if self.spec.bounded else "one-sided",  # the others have one form
        )  # fmt: skip


def _ratio_problem(spec: Kind, ratio: float) -> str | None:
    """What is wrong with `ratio` for a kind's ratio rule (Kind.ratio), or None."""
    kind = spec.name
    if spec.ratio == "none" and ratio != 1:  # hold keeps its initial PR, none steers nothing: it was ignored
        return f"intervention.ratio does not apply to {kind!r} (it has none): leave it at 1, got {ratio}"
    if spec.ratio == "below 1" and not 0 < ratio < 1:
        return f"intervention.ratio must be in (0, 1) for {kind}, got {ratio}"
    if spec.ratio == "above 1" and not ratio > 1:
        return f"intervention.ratio must be > 1 for {kind}, got {ratio}"
    if not ratio > 0:
        return f"intervention.ratio must be positive, got {ratio}"
    return None


def check_arm(kind: str, on: str, ratio: float, matching: str, reference: str, mode: str = "one-sided") -> str | None:
    """What is wrong with an intervention's arm settings (one line naming the intervention.* key), or None.
    mode: `two-sided` only for a ceiling or floor (a kind whose ratio lies on one side of 1)."""
    spec = KINDS.get(kind)
    if spec is None:
        return f"intervention.kind must be one of {INTERVENTIONS}, got {kind!r}"
    if on not in KEY_TARGETS:
        return f"intervention.on must be one of {KEY_TARGETS}, got {on!r}"
    if (wrong := _ratio_problem(spec, ratio)) is not None:
        return wrong
    if mode != "one-sided" and not spec.bounded:  # its map has one form: the mode was ignored
        bounded = ", ".join(k for k, v in KINDS.items() if v.bounded)
        return f"intervention.mode = {mode!r} applies to a ceiling or floor ({bounded}), not {kind!r}"
    if spec.relative and reference != "baseline":
        return f"intervention.kind = {kind!r} is relative to the none run: it needs intervention.reference = 'baseline'"
    key = {"matched": "match_scale", "closed": "match_row_std"}.get(matching)
    if key and matching not in spec.matchings:
        return f"intervention.{key} applies to a shape-changing kind, not {kind!r}"
    if matching == "closed" and reference != "baseline":
        return "intervention.match_row_std tracks the none run: it needs intervention.reference = 'baseline'"
    return None
