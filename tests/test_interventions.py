"""interventions: the pure spectrum maps, the in-place applier, and their effect inside training."""

import numpy as np
import pytest
import torch

from qkgeom import config as C
from qkgeom import interventions as I
from qkgeom.geometry import participation_ratio
from qkgeom.train import train
from tests.conftest import tiny_config


def pr2(sv):
    return participation_ratio(sv**2).item()


@pytest.mark.parametrize("target", [1.0, 1.7, 3.0, 5.5, 8.0])
def test_profile_with_pr_hits_target_and_keeps_norm(target):
    sv = torch.linspace(3, 0.5, 8, dtype=torch.float64)  # PR(s^2) ~ 4.9
    new = I.profile_with_pr(sv, target)
    assert pr2(new) == pytest.approx(target, rel=1e-9)
    assert new.norm().item() == pytest.approx(sv.norm().item(), rel=1e-12)
    assert torch.all(new[:-1] >= new[1:] - 1e-12)  # still sorted


def test_profile_with_pr_identity_at_own_pr():
    sv = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    assert torch.allclose(I.profile_with_pr(sv, pr2(sv)), sv)


def test_hold_profile_and_schedule():
    s0 = torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)
    s = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    held = I.hold_profile(s, s0)
    assert torch.allclose(held / held.norm(), s0 / s0.norm()) and held.norm().item() == pytest.approx(s.norm().item())
    assert I.shrink_target(10.0, 0, 100, 0.4, 0.5) == 10.0
    assert I.shrink_target(10.0, 25, 100, 0.4, 0.5) == pytest.approx(7.0)
    assert I.shrink_target(10.0, 50, 100, 0.4, 0.5) == pytest.approx(4.0)
    assert I.shrink_target(10.0, 90, 100, 0.4, 0.5) == pytest.approx(4.0)


def test_apply_touches_only_selected_heads_and_layers():
    torch.manual_seed(0)
    w = [torch.randn(4, 16, 4) for _ in range(3)]
    before = [x.clone() for x in w]
    cfg = C.InterventionConfig(kind="shrink", layers=(1,), heads=(0, 2), target_fraction=0.5, reach_fraction=0.5)
    ctl = I.KeyControl.create(cfg, w, total_steps=10)
    ctl.apply(w, 10)
    assert torch.equal(w[0], before[0]) and torch.equal(w[2], before[2])
    assert torch.equal(w[1][1], before[1][1]) and torch.equal(w[1][3], before[1][3])
    for h in (0, 2):
        s0 = torch.linalg.svdvals(before[1][h].double())
        s1 = torch.linalg.svdvals(w[1][h].double())
        assert pr2(s1) == pytest.approx(0.5 * pr2(s0), rel=1e-5)
        assert s1.norm().item() == pytest.approx(s0.norm().item(), rel=1e-5)


def test_bad_targets_rejected():
    with pytest.raises(ValueError, match="layer 5 does not exist"):
        I.KeyControl.create(C.InterventionConfig(kind="hold", layers=(5,)), [torch.randn(2, 8, 4)], 10)
    with pytest.raises(C.ConfigError, match="intervention.heads"):
        C.load("tiny", ["intervention.kind=hold", "intervention.heads=[4]"])
    with pytest.raises(C.ConfigError, match="target_fraction"):
        C.load("tiny", ["intervention.kind=shrink", "intervention.target_fraction=0"])


def weights(rd):
    return rd.load_checkpoint()["model"]


@pytest.mark.usefixtures("wikitext")
def test_none_is_bit_identical_to_no_section(tmp_path):
    a = train(tiny_config(train={"steps": 15}), tmp_path / "a", progress=False)
    b = train(
        tiny_config(train={"steps": 15}, intervention={"kind": "none", "layers": [0]}), tmp_path / "b", progress=False
    )
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["loss"] for r in a.read_metrics()] == [r["loss"] for r in b.read_metrics()]


def key_heads(state, layer, n_heads=4):
    w = state[f"blocks.{layer}.attn.W_K"].double()
    return w.view(w.shape[0], n_heads, -1).permute(1, 0, 2)  # (H, D, E)


@pytest.mark.usefixtures("wikitext")
def test_hold_keeps_initial_normalised_profile(tmp_path):
    cfg = tiny_config(train={"steps": 20, "checkpoint_steps": [0]}, intervention={"kind": "hold"})
    rd = train(cfg, tmp_path / "h", progress=False)
    w0 = key_heads(rd.load_checkpoint("step_0.pt")["model"], 1)
    w1 = key_heads(weights(rd), 1)
    s0, s1 = torch.linalg.svdvals(w0), torch.linalg.svdvals(w1)
    assert torch.allclose(s1 / s1.norm(dim=1, keepdim=True), s0 / s0.norm(dim=1, keepdim=True), atol=1e-5)
    assert not torch.allclose(w0, w1)  # training still moved the weights (directions and norm)


@pytest.mark.usefixtures("wikitext")
def test_shrink_follows_schedule_and_is_recorded(tmp_path):
    cfg = tiny_config(
        train={"steps": 40},
        intervention={"kind": "shrink", "layers": [0], "heads": [1], "target_fraction": 0.4, "reach_fraction": 0.5},
    )
    g = train(cfg, tmp_path / "s", progress=False).read_geometry()
    g = g[(g.layer == 0) & (g["head"] == 1)]
    achieved = g[g.metric == "key_weight_participation_ratio"].set_index("step")["value"]
    target = g[g.metric == "key_weight_participation_ratio_target"].set_index("step")["value"]
    pr0 = achieved.loc[0]
    for step in achieved.index[1:]:
        expected = pr0 * (1 - 0.6 * min(1.0, step / 20))
        assert target.loc[step] == pytest.approx(expected, rel=1e-9)
        assert achieved.loc[step] == pytest.approx(expected, rel=1e-3)
    other = g[g.metric == "key_weight_participation_ratio_target"]
    assert len(other) == len(achieved)  # only the controlled head has targets
    assert np.isclose(achieved.iloc[-1], 0.4 * pr0, rtol=1e-3)
