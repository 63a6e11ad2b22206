"""geometry: every definition against analytic answers."""

import math

import pytest
import torch

from qkgeom import geometry as G


def test_isotropic_cloud_has_pr_d():
    # rows +-e_i: centered covariance is exactly (2/2d) I, so every measure equals d
    d = 7
    x = torch.cat([torch.eye(d), -torch.eye(d)]) * 3.0
    ev = G.covariance_eigenvalues(x)
    s = G.spectrum_summary(ev)
    assert s["participation_ratio"].item() == pytest.approx(d)
    assert s["normalised_participation_ratio"].item() == pytest.approx(1.0)
    assert s["effective_rank"].item() == pytest.approx(d)
    assert s["stable_rank"].item() == pytest.approx(d)


def test_rank_one_cloud_has_pr_one():
    v = torch.randn(5, dtype=torch.float64)
    x = torch.randn(100, 1, dtype=torch.float64) * v + 4.0  # offset: centering must remove it
    ev = G.covariance_eigenvalues(x)
    assert G.participation_ratio(ev).item() == pytest.approx(1.0)
    assert G.effective_rank(ev).item() == pytest.approx(1.0, abs=1e-6)
    assert G.stable_rank(ev).item() == pytest.approx(1.0)


def test_known_spectrum_values():
    ev = torch.tensor([3.0, 1.0, 0.0])
    assert G.participation_ratio(ev).item() == pytest.approx(16 / 10)
    p = torch.tensor([0.75, 0.25])
    assert G.effective_rank(ev).item() == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert G.stable_rank(ev).item() == pytest.approx(4 / 3)


def test_pr_invariant_under_rotation_and_scale():
    x = torch.randn(500, 6, dtype=torch.float64) * torch.tensor([3, 2, 1, 1, 0.5, 0.1], dtype=torch.float64)
    rot, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    a = G.participation_ratio(G.covariance_eigenvalues(x))
    b = G.participation_ratio(G.covariance_eigenvalues(7 * x @ rot))
    assert a.item() == pytest.approx(b.item(), rel=1e-10)


def test_streaming_equals_batch_with_leading_dims():
    x = torch.randn(3, 1000, 8, dtype=torch.float64) * 2 + 5
    acc = G.CovarianceAccumulator()
    for chunk in torch.split(x, [1, 10, 300, 689], dim=1):
        acc.update(chunk)
    ref = torch.stack([torch.cov(x[i].T, correction=0) for i in range(3)])
    assert torch.allclose(acc.covariance(), ref, atol=1e-10)


def test_streaming_rejects_changed_shape():
    acc = G.CovarianceAccumulator()
    acc.update(torch.randn(4, 3))
    with pytest.raises(ValueError, match="shape"):
        acc.update(torch.randn(4, 5))


def test_attention_entropy_uniform_and_one_hot():
    T = 6
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    h, hn = G.attention_entropy(uniform)
    assert torch.allclose(h, torch.log(torch.arange(1, T + 1, dtype=torch.float64)))
    assert torch.isnan(hn[0]) and torch.allclose(hn[1:], torch.ones(T - 1, dtype=torch.float64))
    one_hot = torch.eye(T)
    h, hn = G.attention_entropy(one_hot)
    assert torch.allclose(h, torch.zeros(T, dtype=torch.float64))
    assert torch.allclose(hn[1:], torch.zeros(T - 1, dtype=torch.float64))


def test_attention_entropy_bidirectional_support():
    T = 4
    p = torch.full((T, T), 1 / T)
    h, hn = G.attention_entropy(p, support=torch.full((T,), T))
    assert torch.allclose(h, torch.full((T,), math.log(T), dtype=torch.float64))
    assert torch.allclose(hn, torch.ones(T, dtype=torch.float64))


def test_interaction_singular_values_match_direct_svd():
    w_q = torch.randn(3, 16, 4, dtype=torch.float64)
    w_k = torch.randn(3, 16, 4, dtype=torch.float64)
    direct = torch.linalg.svdvals(w_q @ w_k.transpose(-1, -2))[..., :4]
    assert torch.allclose(G.interaction_singular_values(w_q, w_k), direct, atol=1e-10)
    # interaction rank of an isometry-like product: equal singular values -> rank = d_head
    basis, _ = torch.linalg.qr(torch.randn(16, 8, dtype=torch.float64))
    assert G.interaction_rank(G.interaction_singular_values(basis[:, :4], basis[:, :4])).item() == pytest.approx(4)


def test_logit_singular_values_causal():
    q = torch.randn(2, 5, 3, dtype=torch.float64)
    k = torch.randn(2, 5, 3, dtype=torch.float64)
    scores = torch.tril(q @ k.transpose(-1, -2) / math.sqrt(3))
    sv, ref = G.logit_singular_values(q, k), torch.linalg.svdvals(scores)
    assert torch.allclose(sv**2, ref**2, atol=1e-5 * ref.max().item() ** 2)
    assert G.participation_ratio(sv**2).allclose(G.participation_ratio(ref**2), rtol=1e-5)


def test_float32_gram_stays_close_to_float64():
    x = torch.randn(20, 256, 64, dtype=torch.float64) * torch.logspace(0, -3, 64, dtype=torch.float64) + 3.0
    exact, fast = G.CovarianceAccumulator(), G.CovarianceAccumulator(torch.float32)
    for chunk in x:
        exact.update(chunk)
        fast.update(chunk)
    pr_exact, pr_fast = G.participation_ratio(exact.eigenvalues()), G.participation_ratio(fast.eigenvalues())
    assert pr_fast.item() == pytest.approx(pr_exact.item(), rel=1e-5)
    assert torch.allclose(fast.mean, exact.mean)  # means stay exact


def test_logit_singular_values_do_not_overflow_on_huge_scores():
    q = torch.randn(2, 6, 3, dtype=torch.float64) * 1e25  # S^T S would overflow float32 unscaled
    k = torch.randn(2, 6, 3, dtype=torch.float64) * 1e25
    sv = G.logit_singular_values(q, k)
    ref = torch.linalg.svdvals(torch.tril(q @ k.transpose(-1, -2) / 3**0.5))
    assert torch.isfinite(sv).all() and torch.allclose(sv[..., 0], ref[..., 0], rtol=1e-5)
