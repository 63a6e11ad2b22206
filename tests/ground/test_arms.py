"""qkgeom.arms: one table of kinds read by validation, labels and the analysis; a label and a config
are inverses for every arm a committed study ran; a new kind is one row."""

import json
from pathlib import Path

import pytest

from qkgeom import arms
from qkgeom import config as C
from qkgeom.analysis.arms import arm_signs, is_matched, parse_arm

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _committed_arms() -> dict[str, dict]:
    """label -> intervention config, for every record of every committed study."""
    out = {}
    for cfg in RESULTS.glob("*/runs/*/config.json"):
        info = json.loads(cfg.read_text())
        iv = info["config"]["intervention"]
        out.setdefault(C.arm_label(iv), iv)
    return out


def test_every_committed_arm_label_round_trips():
    """The arms of every committed record (none, hold, contract/expand, shape, temperature, matched and
    closed): Arm.of(config).label is the label, Arm.parse(label) gives back the same arm, and the
    config arm_config builds labels the same."""
    seen = _committed_arms()
    assert {"none", "hold:key:closed", "shape:activation:0.8:closed", "temperature:logit:0.5"} <= set(seen)
    assert len(seen) >= 8
    for label, iv in seen.items():
        arm = arms.Arm.of(iv)
        assert arm.label == label and arms.Arm.parse(label) == arm, label
        assert C.arm_label(C.to_dict(C.arm_config(label))) == label


@pytest.mark.parametrize(
    ("label", "move", "predicted", "check", "dose"),
    [
        ("contract:interaction:0.4", -1, -1, "logit_participation_ratio", -0.916291),
        ("expand:key:1.25", +1, +1, "key_participation_ratio", 0.223144),
        ("hold:key", +1, +1, "key_participation_ratio", 0.0),
        ("shape:activation:0.8:closed", -1, -1, "key_participation_ratio", -0.223144),
        ("temperature:logit:0.5", -1, +1, "input_logit_scale", -1.386294),
    ],
)
def test_what_a_kind_predicts_comes_from_its_row(label, move, predicted, check, dose):
    """The pre-registered directions: contracting W_Q W_K^T lowers the logit-spectrum PR and, by the
    paper, entropy; a temperature below 1 lowers the logit scale and raises entropy; the dose of a
    logit-scale arm is a variance (2 log ratio)."""
    a = arms.Arm.parse(label)
    assert (a.move, a.predicted, a.check) == (move, predicted, check) == arm_signs(label)
    assert a.assigned_dose == pytest.approx(dose, abs=1e-6)
    assert is_matched(label) == label.endswith(":closed") and parse_arm(label)[0] == a.kind


def test_validation_reads_the_table():
    """Each rule of a row refuses in one line naming the key: contract's ratio below 1, a matching a
    kind may not run at, a relative kind without the baseline reference."""
    cases = [
        (["kind=contract", "ratio=1.2"], "ratio must be in \\(0, 1\\) for contract"),
        (["kind=expand", "ratio=0.8"], "ratio must be > 1 for expand"),
        (
            ["kind=temperature", "ratio=0.5", "match_scale=true"],
            "match_scale applies to a shape-changing kind, not 'te",
        ),
        (["kind=none", "match_row_std=true"], "match_row_std applies to a shape-changing kind, not 'none'"),
        (["kind=shape", "ratio=0.8", "reference=initial"], "'shape' is relative to the none run"),
        # a row without a ratio (none, hold), and a baseline an arm never reads, were accepted and ignored
        (["kind=hold", "ratio=0.5"], "intervention.ratio does not apply to 'hold' \\(it has none\\): leave it at 1"),
        (["kind=none", "ratio=0.5"], "intervention.ratio does not apply to 'none'"),
        (["baseline='runs/x'"], "intervention.baseline is read only by an arm that tracks its none run; none does not"),
        (
            ["kind=contract", "ratio=0.5", "reference=initial", "baseline='runs/x'"],
            "baseline is read only by .*; contract:key:0.5 does not",
        ),
        (["kind=hold", "mode='two-sided'"], "mode = 'two-sided' applies to a ceiling or floor \\(contract, expand\\)"),
        (["kind=contract", "ratio=0.5", "reach_fraction=0.3"], "reach_fraction .* needs reference = 'initial'"),
    ]
    for sets, msg in cases:
        with pytest.raises(C.ConfigError, match=msg):
            C.validate(C.load("tiny", [f"intervention.{s}" for s in sets]))
    with pytest.raises(C.ConfigError, match="arm label 'shape:0.7' is not none, hold:<on>"):
        arms.Arm.parse("shape:0.7")
    labels = ["none", "hold:key:closed", "contract:interaction:0.4", "expand:key:1.25", "shape:activation:0.8:matched",
              "temperature:logit:0.5"]  # fmt: skip
    for label in labels:  # an arm's own config (the zero-training complement's) passes the same rules
        iv = C.arm_config(label)
        assert arms.check_arm(iv.kind, iv.on, iv.ratio, arms.Arm.of(iv).matching, iv.reference, iv.mode) is None
        assert iv.mode == ("two-sided" if iv.kind in ("contract", "expand") else "one-sided")
    assert C.validate(C.load("tiny", ["intervention.kind=contract", "intervention.ratio=0.5",
                                      "intervention.reference='initial'", "intervention.reach_fraction=0.3",
                                      "intervention.mode='two-sided'"])) is None  # fmt: skip


def test_a_new_kind_is_one_row(monkeypatch):
    """A kind `widen` (a floor on the key activations' PR, ratio above 1) added as one row of KINDS is a
    valid config, has a label that round-trips, and has the analysis' check mediator and signs, with
    no other edit (its map in training/interventions.py is what makes it train)."""
    row = arms.Kind("widen", "activation", "above 1", arms.MATCHINGS, relative=True, move=+1, entropy=+1, dose=1.0)
    monkeypatch.setitem(arms.KINDS, "widen", row)
    cfg = C.load("tiny", ["intervention.kind=widen", "intervention.ratio=1.5", "intervention.match_row_std=true"])
    C.validate(cfg)
    label = C.arm_label(C.to_dict(cfg)["intervention"])
    assert label == "widen:activation:1.5:closed"
    assert C.arm_config(label).kind == "widen" and arm_signs(label) == (1, 1, "key_participation_ratio")
    with pytest.raises(C.ConfigError, match="ratio must be > 1 for widen"):
        C.validate(C.load("tiny", ["intervention.kind=widen", "intervention.ratio=0.5"]))
