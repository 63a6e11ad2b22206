"""model: Q/K initialisations' defining properties, fused == explicit path, hook hygiene."""

import pytest
import torch

from qkgeom import config as C
from qkgeom.probing.hooks import capture, patch
from qkgeom.training.model import GPT


def make(qk_init: str, seed: int = 0, **kw) -> GPT:
    cfg = C.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_ctx=16, qk_init=qk_init, **kw)
    return GPT(cfg, vocab_size=11, seed=seed)


def per_head(model: GPT, layer: int = 0):
    a = model.blocks[layer].attn
    return a.heads(a.W_Q.detach()).double(), a.heads(a.W_K.detach()).double()


def test_orthogonal_init_reads_orthogonal_subspaces():
    for layer in range(2):
        wq, wk = per_head(make("orthogonal"), layer)
        cross = wq.transpose(-1, -2) @ wk  # (H, E, E): (W_Q^h)^T W_K^h
        assert cross.abs().max() < 1e-7 * wq.norm() * wk.norm()
        # and W_Q, W_K are not degenerate: full rank d_head
        assert torch.linalg.matrix_rank(wq[0]) == 8


def test_orthogonal_init_matches_independent_singular_values():
    # the init comparison must differ only in how Q and K relate: over 20 seeds, the per-head
    # weight PR (PR of squared singular values) of orthogonal is within 5% of independent's
    from qkgeom.probing import geometry as G

    def mean_weight_pr(kind: str) -> float:
        prs = []
        for seed in range(20):
            m = GPT(C.ModelConfig(n_layers=1, d_model=128, n_heads=4, n_ctx=8, qk_init=kind), vocab_size=11, seed=seed)
            for w in per_head(m):
                prs.append(G.interaction_rank(G.singular_values(w)).mean().item())
        return sum(prs) / len(prs)

    ind, orth = mean_weight_pr("independent"), mean_weight_pr("orthogonal")
    assert orth == pytest.approx(ind, rel=0.05)
    assert ind == pytest.approx(32 / (1 + 32 / 128), rel=0.05)  # Marchenko-Pastur: E[PR] ~ E / (1 + E/D)


def test_tied_and_anti_tied():
    wq, wk = per_head(make("tied"))
    assert torch.equal(wq, wk)
    sym = wq @ wk.transpose(-1, -2)
    assert torch.linalg.eigvalsh(sym).min() > -1e-9  # PSD
    wq, wk = per_head(make("anti_tied"))
    assert torch.equal(wq, -wk)


def test_independent_is_not_tied():
    wq, wk = per_head(make("independent"))
    assert not torch.allclose(wq, wk)


def test_energy_matched_across_kinds():
    target = 0.02 * (32 * 8) ** 0.5
    for kind in C.QK_INITS:
        wq, wk = per_head(make(kind))
        assert torch.allclose(wq.flatten(1).norm(dim=1), torch.full((4,), target, dtype=torch.float64), rtol=1e-5)
        assert torch.allclose(wk.flatten(1).norm(dim=1), torch.full((4,), target, dtype=torch.float64), rtol=1e-5)


def test_seed_determinism():
    a, b, c = make("independent", seed=3), make("independent", seed=3), make("independent", seed=4)
    for pa, pb, _pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.blocks[0].attn.W_Q, c.blocks[0].attn.W_Q)


def test_fused_and_explicit_paths_agree():
    model = make("independent")
    # larger weights so attention is far from uniform and the test has teeth
    with torch.no_grad():
        for b in model.blocks:
            b.attn.W_Q.mul_(30)
            b.attn.W_K.mul_(30)
    idx = torch.randint(0, 11, (3, 16))
    fused, explicit = model(idx), model(idx, explicit=True)
    assert torch.allclose(fused, explicit, atol=1e-5)
    # and the pattern is peaked, not uniform
    with capture(model, ["blocks.0.attn.hook_pattern"]) as store:
        model(idx, explicit=True)
    assert store["blocks.0.attn.hook_pattern"].max() > 0.5


def test_capture_shapes_and_hook_removal():
    model = make("independent")
    idx = torch.randint(0, 11, (2, 10))
    names = ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_scores", "blocks.1.attn.hook_pattern"]
    with capture(model, names) as store:
        model(idx, explicit=True)
    assert store["blocks.1.attn.hook_q"].shape == (2, 4, 10, 8)
    assert store["blocks.1.attn.hook_pattern"].shape == (2, 4, 10, 10)
    assert torch.allclose(store["blocks.1.attn.hook_pattern"].sum(-1), torch.ones(2, 4, 10))
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(KeyError, match="no hook site"):
        with capture(model, ["blocks.9.attn.hook_q"]):
            pass
    assert all(not m._forward_hooks for m in model.modules())


def test_patch_changes_output_and_is_removed():
    model = make("independent")
    idx = torch.randint(0, 11, (2, 10))
    base = model(idx, explicit=True)
    with patch(model, {"blocks.0.attn.hook_pattern": lambda p: torch.zeros_like(p)}):
        patched = model(idx, explicit=True)
    assert not torch.allclose(base, patched)
    assert torch.equal(model(idx, explicit=True), base)


@pytest.mark.parametrize(
    "shape, vocab",
    [
        (dict(n_layers=2, d_model=32, n_heads=4, n_ctx=16), 11),
        (dict(n_layers=3, d_model=48, n_heads=6, n_ctx=40, d_mlp=100), 284),
        (dict(n_layers=1, d_model=64, n_heads=1, n_ctx=8), 50304),
    ],
)
def test_the_counted_parameters_are_the_built_models(shape, vocab):
    """ModelConfig.n_parameters counts what training/model.py builds (analysis reads it for runs whose
    done.json has no count, without importing torch); the first shape also counted by hand."""
    cfg = C.ModelConfig(**shape)
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(cfg, vocab).parameters())
    assert cfg.n_parameters(vocab) == built
    if shape["d_model"] == 32:  # wte 11*32, wpe 16*32, 2 blocks of 4*32*32 + 2*32*128 + 4*32, ln_f 2*32
        assert built == 352 + 512 + 2 * (4096 + 8192 + 128) + 64 == 25760
