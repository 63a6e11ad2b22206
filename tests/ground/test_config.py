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
    """A miss lists the presets the command reads (the study files and the pretrained config were listed
    as run presets); another command's file says which command reads it."""
    from qkgeom.families.config import load_pretrained

    with pytest.raises(C.ConfigError, match=r"neither a file nor a preset \(presets: cpu, paper, smoke, tiny\)$"):
        C.load("no-such-preset")
    with pytest.raises(C.ConfigError, match=r"\(presets: pretrained\)$"):
        load_pretrained("no-such-preset")
    with pytest.raises(C.ConfigError, match=r"study-smoke.toml is a \[sweep\] file.*`qkgeom study study-smoke`"):
        C.load("study-smoke")
    with pytest.raises(C.ConfigError, match=r"pretrained.toml is a \[pretrained\] file.*qkgeom pretrained MODEL"):
        C.load("pretrained")


def test_orthogonal_needs_room():
    with pytest.raises(C.ConfigError, match="2\\*d_head <= d_model"):
        C.load("tiny", ["model.n_heads=1", "model.qk_init=orthogonal"])


def test_probe_settings_are_one_checked_value_with_one_zero_means_all_door():
    """A run's [probe], a measurement's [pretrained] and an API call's keywords give the same
    ProbeSettings; "0 = all" becomes None in ProbeSettings.of only; bad values are refused in one line."""
    from qkgeom.families.config import load_pretrained

    run = C.load("tiny", ["probe.logit_max_seqs=0", "probe.pr_convention='singular'"]).probe.settings
    assert run == C.ProbeSettings(C.Conventions("singular"), None, "float64")
    assert run == C.ProbeSettings.of(0, "singular") == C.ProbeSettings.of(None, "singular")
    assert run.logit_count(7) == 7 and C.ProbeSettings.of(4).logit_count(7) == 4
    assert C.ProbeSettings.of(4).logit_count(3) == 3
    pre = load_pretrained(None, ["model=x", "logit_max_seqs=2"]).settings
    assert pre == C.ProbeSettings(C.DEFAULT_CONVENTIONS, 2, "float32")
    import torch

    assert pre.torch_gram_dtype is torch.float32 and C.DEFAULT_PROBE.torch_gram_dtype is torch.float64
    with pytest.raises(C.ConfigError, match=r"^probe.logit_max_seqs must be >= 0 \(0 = all\), got -2$"):
        C.load("tiny", ["probe.logit_max_seqs=-2"])
    with pytest.raises(C.ConfigError, match=r"^pretrained.gram_dtype must be one of .* got 'float16'$"):
        load_pretrained(None, ["model=x", "gram_dtype='float16'"])
    with pytest.raises(C.ConfigError, match=r"logit_seqs must be None \(all\) or >= 1, got 0"):
        C.ProbeSettings(logit_seqs=0)  # None is "all" inside the value: 0 there is a mistake
