"""config: defaults -> file -> overrides, and the errors bad input gets."""

import pytest

from qkgeom import config as C


def test_preset_and_override_types():
    cfg = C.load(
        "tiny", ["train.lr=0.01", "model.qk_init=tied", "train.checkpoint_steps=[10, 20]", "probe.log_early=false"]
    )
    assert cfg.train.lr == 0.01 and cfg.model.qk_init == "tied"
    assert cfg.train.checkpoint_steps == (10, 20) and cfg.probe.log_early is False
    assert cfg.model.d_head == cfg.model.d_model // cfg.model.n_heads
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_int_accepted_for_float():
    assert C.load("tiny", ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown config key 'train.lrr'"),
        ("model.n_layers=two", "model.n_layers' expects an integer"),
        ("model.n_heads=5", "n_heads=5 does not divide"),
        ("train.lr=-0.1", "train.lr must be positive"),
        ("model.qk_init=weird", "qk_init must be one of"),
        ("intervention.target_fraction=1.5", "was replaced by intervention.ratio"),
        ("intervention.on=query", "intervention.on must be one of"),
        ("intervention.layers=[7]", "intervention.layers [7] do not exist"),
        ("nosuch=1", "unknown config key 'nosuch'"),
        ("train", "not of the form key=value"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(C.ConfigError) as e:
        C.load("tiny", [override])
    assert message in str(e.value)


def test_unknown_preset():
    with pytest.raises(C.ConfigError, match="neither a file nor a preset"):
        C.load("no-such-preset")


def test_orthogonal_needs_room():
    with pytest.raises(C.ConfigError, match="2\\*d_head <= d_model"):
        C.load("tiny", ["model.n_heads=1", "model.qk_init=orthogonal"])
