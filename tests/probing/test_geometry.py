"""geometry: every definition against analytic answers."""

import math
import warnings

import numpy as np
import pytest
import torch

from qkgeom import solves as S
from qkgeom.probing import alpha as AL
from qkgeom.probing import geometry as G
from qkgeom.probing import logits as LG


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


def test_interaction_factors_are_chosen_matrix_by_matrix_so_a_batch_changes_no_value():
    """A batch of three heads whose middle W_K^h has two equal columns (its Gram singular: Cholesky
    cannot factor it well): the other two heads keep the Gram route's values bit for bit, equal to each
    solved alone; the singular one takes QR and still matches the direct SVD. With the route chosen
    for the batch as a whole (triangular_factor), the neighbours move to QR's rounding."""
    g = torch.Generator().manual_seed(5)
    w_q = torch.randn(3, 24, 6, generator=g, dtype=torch.float64)
    w_k = torch.randn(3, 24, 6, generator=g, dtype=torch.float64)
    w_k[1, :, 5] = w_k[1, :, 4]
    batch = G.interaction_singular_values(w_q, w_k)
    alone = [G.interaction_singular_values(w_q[i : i + 1], w_k[i : i + 1])[0] for i in range(3)]
    for i in range(3):
        assert torch.equal(batch[i], alone[i]), i
    direct = torch.linalg.svdvals(w_q @ w_k.transpose(-1, -2))[..., :6]
    torch.testing.assert_close(batch, direct, rtol=0, atol=1e-12 * float(direct.max()))
    _, coupled = G.triangular_factor(w_k)  # one route for all: QR, the neighbours' R no longer the Gram's
    assert not torch.equal(coupled[0].abs(), G.triangular_r(w_k[:1])[0].abs())
    assert torch.equal(G.triangular_r(w_k)[0], G.triangular_r(w_k[:1])[0])


def test_logit_singular_values_causal():
    q = torch.randn(2, 5, 3, dtype=torch.float64)
    k = torch.randn(2, 5, 3, dtype=torch.float64)
    scores = torch.tril(q @ k.transpose(-1, -2) / math.sqrt(3))
    sv, ref = LG.logit_singular_values(q, k), torch.linalg.svdvals(scores)
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


def test_float32_rows_centered_in_float32_stay_close_to_float64():
    # float32 activations with a mean 1,000x the spread of the smallest direction (as in LLMs' massive
    # activations): the float32 path (no float64 copy) matches float64 maths on the same values
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(0, -2, 48, dtype=torch.float64)
    x = (torch.randn(12, 512, 48, generator=g, dtype=torch.float64) * scales + 10.0).to(torch.float32)
    exact, fast = G.CovarianceAccumulator(), G.CovarianceAccumulator(torch.float32)
    for chunk in x:
        exact.update(chunk.double())
        fast.update(chunk)
    assert torch.allclose(fast.eigenvalues(), exact.eigenvalues(), rtol=1e-4, atol=1e-6 * exact.eigenvalues()[0])
    pr_exact, pr_fast = G.participation_ratio(exact.eigenvalues()), G.participation_ratio(fast.eigenvalues())
    assert pr_fast.item() == pytest.approx(pr_exact.item(), rel=1e-5)
    spread = x.double().std((0, 1))
    assert ((fast.mean - exact.mean).abs() <= 1e-6 * spread).all()  # the mean to ~1e-7 of the spread


def test_logit_singular_values_do_not_overflow_on_huge_scores():
    q = torch.randn(2, 6, 3, dtype=torch.float64) * 1e25  # S^T S would overflow float32 unscaled
    k = torch.randn(2, 6, 3, dtype=torch.float64) * 1e25
    sv = LG.logit_singular_values(q, k)
    ref = torch.linalg.svdvals(torch.tril(q @ k.transpose(-1, -2) / 3**0.5))
    assert torch.isfinite(sv).all() and torch.allclose(sv[..., 0], ref[..., 0], rtol=1e-5)


def _gaussian(spectrum: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(spectrum), generator=g, dtype=torch.float64) * spectrum.sqrt()


@pytest.mark.parametrize("kind", ["isotropic", "decaying"])
def test_pr_small_sample_bias_and_its_correction(kind):
    # the probe's default: a d = 128 covariance from 10 x 128 tokens (GLOSSARY.md states these figures)
    d, n = 128, 1280
    spectrum = torch.ones(d, dtype=torch.float64) if kind == "isotropic" else 1 / torch.arange(1, d + 1.0)
    true = G.participation_ratio(spectrum).item()
    naive, corrected = [], []
    for seed in range(20):
        ev = G.covariance_eigenvalues(_gaussian(spectrum, n, seed))
        naive.append(G.participation_ratio(ev).item())
        corrected.append(G.participation_ratio_bias_corrected(ev, n).item())
    bias_naive = np.mean(naive) / true - 1
    bias_corrected = np.mean(corrected) / true - 1
    assert bias_naive < -0.04 if kind == "isotropic" else bias_naive < -0.01  # plug-in PR is biased low
    assert abs(bias_corrected) < 0.01  # the corrected estimator is unbiased to within 1%
    assert abs(bias_corrected) < abs(bias_naive) / 2


def test_bias_corrected_pr_exact_in_expectation_for_isotropic():
    # d = 2, isotropic: the estimator's expectation is exactly d; check over many small samples
    ev = torch.stack(
        [G.covariance_eigenvalues(_gaussian(torch.ones(2, dtype=torch.float64), 50, s)) for s in range(4000)]
    )
    pr = G.participation_ratio_bias_corrected(ev, 50)
    assert pr.mean().item() == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError, match="n >= 3"):
        G.participation_ratio_bias_corrected(ev[0], 2)


def test_robust_eigvalsh_falls_back_instead_of_raising(monkeypatch):
    a = torch.randn(5, 5, dtype=torch.float64)
    psd = a @ a.T
    ref = torch.linalg.eigvalsh(psd)
    # 1e200 overflows float32 to inf on every CPU: the float32 route fails, float64 answers
    with pytest.warns(G.NumericalWarning, match="used float64"):
        ev = G.robust_eigvalsh(psd * 1e200, fast=True)
    assert torch.allclose(ev / 1e200, ref, rtol=1e-10)
    # every eigvalsh route failing (as LAPACK may on ill-conditioned input on some CPUs): the SVD route
    real = torch.linalg.eigvalsh

    def failing(m):
        raise torch.linalg.LinAlgError("failed to converge (simulated)")

    monkeypatch.setattr(torch.linalg, "eigvalsh", failing)
    with pytest.warns(G.NumericalWarning, match="SVD route"):
        ev = G.robust_eigvalsh(psd, fast=True)
    assert torch.allclose(ev, ref, rtol=1e-10)
    monkeypatch.setattr(torch.linalg, "eigvalsh", real)
    # non-finite input: NaN with a warning, never an exception
    bad = psd.clone()
    bad[0, 0] = float("nan")
    with pytest.warns(G.NumericalWarning, match="NaN"):
        ev = G.robust_eigvalsh(bad)
    assert torch.isnan(ev).all() and ev.shape == (5,)


def test_logit_spectrum_of_huge_and_nonfinite_scores_never_raises():
    q = torch.randn(2, 3, 16, 8, dtype=torch.float64) * 1e150  # huge weights: scores ~1e300
    k = torch.randn(2, 3, 16, 8, dtype=torch.float64) * 1e150
    sv = LG.logit_singular_values(q, k)
    ref = torch.linalg.svdvals(torch.tril(q @ k.transpose(-1, -2) / math.sqrt(8)))
    top = ref[..., :1]
    assert torch.allclose((sv / top) ** 2, (ref / top) ** 2, atol=1e-5)  # float32 route: error relative to s_max^2
    q[0, 0, 0, 0] = float("inf")
    with pytest.warns(G.NumericalWarning):
        sv = LG.logit_singular_values(q, k)
    assert torch.isnan(sv[0, 0]).all() and torch.isfinite(sv[1]).all()


def test_batched_eigvalsh_split_over_threads_gives_the_same_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 130, 130, generator=g, dtype=torch.float64)  # enough work to be split
    mats = x @ x.transpose(-1, -2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = G.batched_eigvalsh(mats)
        torch.set_num_threads(3)
        split = G.batched_eigvalsh(mats)
        assert torch.get_num_threads() == 3  # restored after the split
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, split)  # each matrix solved with one LAPACK thread either way
    assert torch.allclose(one, torch.linalg.eigvalsh(mats), rtol=1e-12, atol=1e-12)


def test_batched_eigvalsh_and_alpha_fits_run_their_chunks_side_by_side(monkeypatch):
    """With 3 torch threads, 3 chunks are solved at once: each waits at a barrier of 3 before solving,
    which only a pool of 3 threads passes (one that ran them one after another would time out)."""
    import threading

    solve = torch.linalg.eigvalsh
    barrier = threading.Barrier(3, timeout=20)

    def waiting(m):
        barrier.wait()
        return solve(m)

    x = torch.randn(12, 130, 130, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mats = x @ x.transpose(-1, -2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        monkeypatch.setattr(torch.linalg, "eigvalsh", waiting)
        out = G.batched_eigvalsh(mats)
        monkeypatch.undo()
        seen = S.thread_map(lambda _: barrier.wait(), range(3), 3)  # the pool alpha's KS grid uses
        torch.set_num_threads(1)
        alone = solve(mats)  # one LAPACK thread, as each chunk is solved
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, alone)
    assert sorted(seen) == [0, 1, 2]  # Barrier.wait returns each waiter's distinct index


def test_solve_together_fills_the_same_eigenvalues_as_one_by_one():
    g = torch.Generator().manual_seed(1)
    accs = [G.CovarianceAccumulator() for _ in range(5)]
    for i, acc in enumerate(accs):
        acc.update(torch.randn(64, 8 if i < 3 else 5, generator=g, dtype=torch.float64))
    ref = [torch.linalg.eigvalsh(acc.covariance()).flip(-1).clamp_min(0) for acc in accs]
    G.solve_together(accs)
    for acc, r in zip(accs, ref, strict=True):
        assert acc._eig is not None and torch.allclose(acc.eigenvalues(), r, rtol=1e-12, atol=1e-14)


def test_solve_blocks_together_is_one_round_trip_a_block_size_with_each_matrix_its_own_values(monkeypatch):
    """Per-head blocks of 4 layers (two of 3 heads x 8, one of 2 heads x 8, one of 4 heads x 5): one
    round trip to the host for each block size (2, not 4), every cache equal bit for bit to that
    accumulator's own block_eigenvalues, and a failing matrix (NaN) costs only its own values."""
    g = torch.Generator().manual_seed(2)
    shapes = [(3, 8), (3, 8), (2, 8), (4, 5)]
    accs, alone = [], []
    for heads, e in shapes:
        x = torch.randn(50, heads * e, generator=g, dtype=torch.float64)
        pair = [G.CovarianceAccumulator(), G.CovarianceAccumulator()]
        for acc in pair:
            acc.update(x)
        accs.append(pair[0])
        alone.append(pair[1].block_eigenvalues(heads))  # solved on its own
    trips = []
    real = S.round_trip
    monkeypatch.setattr(S, "round_trip", lambda *a, **k: trips.append(1) or real(*a, **k))
    G.solve_blocks_together([(acc, heads) for acc, (heads, _) in zip(accs, shapes, strict=True)])
    assert len(trips) == 2
    for acc, (heads, _), ref in zip(accs, shapes, alone, strict=True):
        assert torch.equal(acc._block_eig[heads], ref)
    bad = G.CovarianceAccumulator()
    bad.update(torch.full((50, 24), math.nan, dtype=torch.float64))
    fresh = G.CovarianceAccumulator()
    fresh.update(torch.randn(50, 24, generator=g, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G.solve_blocks_together([(bad, 3), (fresh, 3)])
    assert torch.isnan(bad._block_eig[3]).all()
    assert torch.equal(fresh._block_eig[3], G.CovarianceAccumulator.block_eigenvalues(_copy(fresh), 3))


def _copy(acc: G.CovarianceAccumulator) -> G.CovarianceAccumulator:
    """The same accumulator's state with empty caches."""
    out = G.CovarianceAccumulator()
    out.n, out.mean, out.m2 = acc.n, acc.mean, acc.m2
    return out


def test_power_law_alpha_equals_the_powerlaw_package():
    """`clauset`: the same fit as powerlaw 2.0.0 without xmax (the field's reference), with its alpha
    range opened to (1, inf) as WeightWatcher reads it: alpha, xmin, tail and KS equal."""
    import powerlaw

    rng = np.random.default_rng(0)
    for t in range(4):
        w = rng.standard_t(3, size=(256, 64)) if t % 2 else rng.normal(size=(200, 80))
        ev = np.linalg.eigvalsh(w.T @ w)
        ours = AL.power_law_alpha(ev, min_tail=2, convention="clauset")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = powerlaw.Fit(ev, discrete=False, verbose=False, parameter_ranges={"alpha": [1, None]})
        assert ours["alpha"] == pytest.approx(ref.alpha, rel=1e-9) and ours["xmin"] == ref.xmin
        assert ours["n_tail"] == ref.n_tail and ours["ks_distance"] == pytest.approx(ref.D, rel=1e-9)


def test_power_law_alphas_of_many_spectra_equal_each_fit_alone():
    """The batched fit (spectra of one length in one grid) gives each spectrum's own fit bit for bit,
    whatever else is in the batch: ties, zero and numerically-zero eigenvalues, NaN, rank one, too few
    points, several lengths (and so several groups) mixed."""
    rng = np.random.default_rng(3)
    spectra = []
    for t in range(60):
        n = [2, 9, 10, 12, 32, 128][t % 6]
        kind = t % 5
        if kind == 0:
            w = rng.standard_t(3, size=(2 * n, n))
            x = np.linalg.eigvalsh(w.T @ w)
        elif kind == 1:
            x = rng.pareto(1.5, n) + 1.0
        elif kind == 2:
            x = np.round(rng.uniform(0, 4, n))  # ties and exact zeros
        elif kind == 3:
            x = rng.exponential(size=n) * 1e-13 + (np.arange(n) == 0)  # one value above a numerical-zero floor
        else:
            x = rng.normal(size=n)
            x[n // 2] = np.nan
        spectra.append(x)
    for min_tail, conv in ((2, "clauset"), (10, "clauset"), (10, "weightwatcher")):
        batched = AL.power_law_alphas(spectra, min_tail, conv)
        alone = [AL.power_law_alphas([x], min_tail, conv)[0] for x in spectra]
        assert sum(np.isfinite(f["alpha"]) for f in batched) > 15  # real fits among them, not only reasons
        for b, a in zip(batched, alone, strict=True):
            assert b["reason"] == a["reason"] and b["n_tail"] == a["n_tail"]
            for key in ("alpha", "xmin", "ks_distance"):
                assert (b[key] == a[key]) or (np.isnan(b[key]) and np.isnan(a[key]))


def test_power_law_alpha_recovers_a_planted_exponent():
    """Pareto samples with density ~ x^-2.5 (alpha 2.5): the MLE's standard error is (alpha - 1) / sqrt(n)."""
    rng = np.random.default_rng(1)
    x = rng.pareto(1.5, 3000) + 1.0  # numpy's pareto(a): density ~ x^-(a + 1)
    for conv in AL.ALPHA_CONVENTIONS:
        fit = AL.power_law_alpha(x, convention=conv)
        se = (fit["alpha"] - 1) / np.sqrt(fit["n_tail"])
        assert abs(fit["alpha"] - 2.5) < 3 * se and fit["n_tail"] > 1000 and fit["reason"] == ""


def test_power_law_alpha_gives_a_reason_instead_of_a_number():
    assert AL.power_law_alpha(np.array([1.0, np.nan, 2.0]))["reason"] == "non-finite values"
    assert AL.power_law_alpha(np.array([1.0, np.inf]))["reason"] == "non-finite values"
    assert AL.power_law_alpha(np.zeros(16))["reason"] == "all-zero matrix"
    rank_one = np.linalg.eigvalsh(np.outer(np.arange(1.0, 9), np.arange(1.0, 9)))
    assert AL.power_law_alpha(rank_one)["reason"] == "rank one"
    few = AL.power_law_alpha(np.linspace(1, 2, 8), convention="clauset")
    assert np.isnan(few["alpha"]) and few["reason"].startswith("fewer than 10 eigenvalues")
    # WeightWatcher fits 8 eigenvalues (its small-sample estimator) and skips 7 (its min_evals)
    assert np.isfinite(AL.power_law_alpha(np.linspace(1, 2, 8))["alpha"])
    seven = AL.power_law_alpha(np.linspace(1, 2, 7))
    assert np.isnan(seven["alpha"]) and seven["reason"].startswith("fewer than 8 eigenvalues")
    with pytest.raises(ValueError, match="alpha convention 'hill'"):
        AL.power_law_alpha(np.linspace(1, 2, 30), convention="hill")


def test_weightwatcher_alpha_equals_weightwatchers_own_per_layer_alpha():
    """The default convention is WeightWatcher 0.7.7's alpha (what papers report): on every weight
    matrix of a d_model-128 GPT built from a config, trained a few steps further in a heavy-tailed
    direction (each layer's whole W_Q, W_K, W_V, W_O: 128 eigenvalues, its standard fit; each head's
    W_Q^h: 32, the same; and 12-eigenvalue slices: its small-sample fit), the probe's alpha rows equal
    WeightWatcher's own per-layer alpha to 1e-6 (the issue asks 1e-3)."""
    import logging

    weightwatcher = pytest.importorskip("weightwatcher", reason="dev extra: pip install -e .[dev]")
    from qkgeom import config as C
    from qkgeom.probing.probe import gpt_value_output, gpt_weights, probe_gpt
    from qkgeom.training.model import GPT

    cfg = C.load("tiny", ["model.d_model=128", "model.n_heads=4", "model.n_layers=2"])
    torch.manual_seed(0)
    model = GPT(cfg.model, vocab_size=50)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a heavy-tailed update, as training leaves, so the tails are not Gaussian
        for b in model.blocks:
            for w in (b.attn.W_Q, b.attn.W_K, b.attn.W_V, b.attn.W_O):
                w.add_(0.02 * torch.distributions.StudentT(2.5).sample(w.shape))
    rows, _ = probe_gpt(model, torch.randint(0, 50, (2, 32), generator=g))
    ours = {(r["layer"], r["head"], r["metric"]): r for r in rows if r["metric"].endswith("_alpha")}
    with torch.no_grad():
        (w_q, w_k), (w_v, w_o) = gpt_weights(model), gpt_value_output(model)
    w_q, w_k, w_v, w_o = ([w.detach() for w in ws] for ws in (w_q, w_k, w_v, w_o))
    mats, keys = [], []
    for li in range(2):
        for name, w in (("query", w_q), ("key", w_k), ("value", w_v), ("output", w_o)):
            mats.append(w[li].permute(1, 0, 2).reshape(128, -1))  # the layer's whole (D, H * E) matrix
            keys.append((li, -1, f"{name}_weight_alpha"))
        for h in range(4):
            mats.append(w_q[li][h])  # (D, E) = (128, 32)
            keys.append((li, h, "query_weight_alpha"))
    small = [w_q[li][h][:, :12] for li in range(2) for h in range(4)]  # 12 eigenvalues: the small-sample fit
    layers = []
    for m in mats + small:  # nn.Linear(in, out) holds (out, in): W^T, whose eigenvalues are those of W^T W
        lin = torch.nn.Linear(m.shape[0], m.shape[1], bias=False)
        with torch.no_grad():
            lin.weight.copy_(m.T)
        layers.append(lin)
    logging.disable(logging.WARNING)  # WeightWatcher logs every fit
    try:
        theirs = weightwatcher.WeightWatcher(model=torch.nn.Sequential(*layers)).analyze()
    finally:
        logging.disable(logging.NOTSET)
    theirs = theirs.sort_values("layer_id")["alpha"].to_numpy()
    assert len(theirs) == len(layers)
    for key, ww_alpha in zip(keys, theirs, strict=False):
        assert ours[key]["value"] == pytest.approx(ww_alpha, abs=1e-6), key
        assert ours[key]["note"] == "alpha=weightwatcher"
    for m, ww_alpha in zip(small, theirs[len(mats) :], strict=True):
        ev = torch.linalg.svdvals(m.double()).numpy() ** 2
        assert AL.power_law_alpha(ev)["alpha"] == pytest.approx(ww_alpha, abs=1e-6)
    # and the clauset convention is another number on the same matrices (the two differ in candidates)
    differ = [abs(AL.power_law_alpha(torch.linalg.svdvals(m.double()).numpy() ** 2, convention="clauset")["alpha"] - a)
              for m, a in zip(mats, theirs, strict=False)]  # fmt: skip
    assert max(differ) > 1e-3


def test_the_two_pr_conventions_on_analytic_cases():
    flat = torch.ones(3, 6)
    for conv in G.PR_CONVENTIONS:  # k equal values: PR = k under both
        torch.testing.assert_close(G.participation_ratio_as(flat, conv), torch.full((3,), 6.0, dtype=torch.float64))
    sigma = torch.tensor([2.0, 1.0])
    assert float(G.participation_ratio_as(sigma**2, "variance")) == pytest.approx(25 / 17)
    assert float(G.participation_ratio_as(sigma**2, "singular")) == pytest.approx(9 / 5)
    rng = torch.Generator().manual_seed(0)
    lam = torch.rand(50, 8, generator=rng, dtype=torch.float64) ** 3
    assert (G.participation_ratio_as(lam, "singular") >= G.participation_ratio_as(lam, "variance") - 1e-12).all()
    with pytest.raises(ValueError, match="allowed: variance, singular"):
        G.participation_ratio_as(lam, "eigen")


def test_energy_rank_and_the_row_centred_logit_spectrum_known_values():
    from qkgeom.probing.geometry import energy_rank
    from qkgeom.probing.logits import centred_logit_singular_values

    # energies 9, 4, 1, 0 of 14: 90% (12.6) needs two components; exactly 13/14 is reached at two too
    assert energy_rank(torch.tensor([3.0, 2.0, 1.0, 0.0])).item() == 2
    assert energy_rank(torch.tensor([1.0, 1.0, 1.0, 1.0])).item() == 4  # 0.9 of 4 equal parts needs all four
    assert energy_rank(torch.zeros(3)).item() == 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 16, 8, generator=g, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    centred = s - s.mean(-1, keepdim=True)
    got, want = centred_logit_singular_values(q, k, causal=False), torch.linalg.svdvals(centred)
    # the energies s^2 (float32 eigen-solve, as the logit spectrum's): to ~1e-6 of the largest
    torch.testing.assert_close(got**2, want**2, rtol=0, atol=1e-6 * float(want.max()) ** 2)
    low = q.clone()
    low[..., 2:] = 0.0  # queries in two dimensions: the logits have rank <= 2
    assert (energy_rank(centred_logit_singular_values(low, k, causal=False)) <= 2).all()


def test_row_centred_logit_spectrum_low_rank_route_is_exact():
    """Without the causal mask the centred logits are Q K_c^T (rank <= d_head), solved as a d_head
    problem: equal to float64 SVD of the T x T matrix to ~1e-12, for float32 probes (the training
    probe's dtype), for T < d_head, padded with zeros to T; a head with non-finite input gets NaN and
    the others their own values (no device sync decides the route)."""
    from qkgeom.probing.logits import centred_logit_singular_values

    g = torch.Generator().manual_seed(1)
    for t, e in ((128, 32), (16, 32), (40, 8)):
        q = torch.randn(3, 4, t, e, generator=g)  # float32, as the training probe captures them
        k = torch.randn(3, 4, t, e, generator=g) * 3 + 1  # a key mean, which the centring removes
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(e)
        want = torch.linalg.svdvals(s - s.mean(-1, keepdim=True))
        got = centred_logit_singular_values(q, k, causal=False)
        assert got.shape == (3, 4, t) and got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.max()))
        assert (got[..., min(t, e) :] == 0).all()
    q, k = torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)
    alone = centred_logit_singular_values(q[:, 1:], k[:, 1:], causal=False)
    q[0, 0, 3, 2] = float("nan")  # head 0 non-finite: NaN for it, head 1 its own values
    got = centred_logit_singular_values(q, k, causal=False)
    assert torch.isnan(got[0, 0]).all() and torch.equal(got[:, 1:], alone)


def test_gram_singular_values_equal_the_svd_in_both_orientations_and_nan_on_bad_input():
    """The probe's weight side takes s from the smaller Gram matrix's eigenvalues: equal to an SVD's
    (LAPACK gesdd) to float64 rounding on well-conditioned matrices, tall and wide, batched; NaN with
    a NumericalWarning for non-finite weights, as singular_values gives."""
    g = torch.Generator().manual_seed(3)
    for shape in [(5, 128, 32), (3, 32, 128), (128, 128)]:
        w = (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.02).float()  # as a model holds them
        ref = torch.linalg.svdvals(w.double())
        got = G.gram_singular_values(w)
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-10)
        assert got.shape == ref.shape and bool((got[..., :-1] >= got[..., 1:]).all())  # descending
    bad = torch.ones(4, 3)
    bad[0, 0] = math.nan
    with pytest.warns(G.NumericalWarning):
        assert torch.isnan(G.gram_singular_values(bad)).all()


def test_block_eigenvalues_are_each_blocks_covariance_spectrum_and_renewed_by_update():
    """Block h of a layer accumulator's spectrum is the covariance spectrum of that head's columns alone
    (numpy, float64); after more rows the cached values are replaced, never served stale."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(300, 12)) * np.linspace(0.5, 3.0, 12)
    acc = G.CovarianceAccumulator()
    acc.update(torch.from_numpy(x[:200]))
    first = acc.block_eigenvalues(3)
    assert acc.block_eigenvalues(3) is first  # solved once, then cached
    acc.update(torch.from_numpy(x[200:]))
    for h in range(3):
        ref = np.sort(np.linalg.eigvalsh(np.cov(x[:, 4 * h : 4 * h + 4].T, bias=True)))[::-1]
        np.testing.assert_allclose(acc.block_eigenvalues(3)[h].numpy(), ref, rtol=1e-10)
    assert not torch.equal(acc.block_eigenvalues(3), first)
