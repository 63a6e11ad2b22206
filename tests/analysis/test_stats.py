"""stats: known answers and parity with direct numpy computations."""

import itertools

import numpy as np
import pytest
from scipy import stats as sp_stats

from qkgeom.analysis import stats


def test_slope_exact_line():
    x = np.linspace(0, 1, 11)
    assert stats.slope(x, 3 * x - 2) == pytest.approx(3.0)
    assert np.isnan(stats.slope([1, 1], [2, 3]))


def test_sign_test_known_p_values():
    assert stats.sign_test([1, 2, 3, 4, 5], +1) == (5, 5, pytest.approx(2 / 32))
    k, n, p = stats.sign_test([-1, 2, 0, -3], -1)
    assert (k, n) == (2, 3) and p == pytest.approx(1.0)


def test_bootstrap_ci_contains_mean_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small, large = rng.normal(1, 1, 10), rng.normal(1, 1, 1000)
    lo, hi = stats.bootstrap_mean_ci(small)
    assert lo < small.mean() < hi
    lo2, hi2 = stats.bootstrap_mean_ci(large)
    assert hi2 - lo2 < (hi - lo) / 3
    assert stats.bootstrap_mean_ci([2.0, 2.0]) == (2.0, 2.0)


def test_probability_of_direction():
    assert stats.probability_of_direction([1.0, 2.0, 3.0], +1) == 1.0
    assert stats.probability_of_direction([1.0, 2.0, 3.0], -1) == 0.0
    assert 0.2 < stats.probability_of_direction([-1.0, 1.0, -0.9, 1.1], +1) < 0.8


def test_spearman_monotone_and_degenerate():
    x = np.arange(10.0)
    rho, p, n = stats.spearman(x, np.exp(x))
    assert rho == pytest.approx(1.0) and n == 10 and p < 1e-6
    assert np.isnan(stats.spearman(x, np.ones(10))[0])


def test_t_interval_known_value():
    # mean 2.5, sd sqrt(5/3), n 4: half-width t_{3,0.975} * sd / 2 with t_{3,0.975} = 3.182446
    lo, hi = stats.t_mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * np.sqrt(5 / 3) / 2
    assert (lo, hi) == (pytest.approx(2.5 - half), pytest.approx(2.5 + half))
    assert np.isnan(stats.t_mean_ci([1.0])[0])


@pytest.mark.parametrize("n", [4, 5])
def test_t_interval_coverage_at_few_seeds(n):
    # what a 4-5 seed study needs: the stated 95% coverage, which the percentile bootstrap lacks
    rng = np.random.default_rng(1)
    draws = rng.normal(0.3, 1.0, size=(4000, n))
    covered = [lo <= 0.3 <= hi for lo, hi in map(stats.t_mean_ci, draws)]
    assert 0.92 <= np.mean(covered) <= 0.98
    boot = [lo <= 0.3 <= hi for lo, hi in (stats.bootstrap_mean_ci(d, n_resamples=400) for d in draws[:300])]
    assert np.mean(boot) < 0.9  # the old interval: ~80% at n = 4


def test_verdict_rule():
    assert stats.verdict(0.1, 0.5, +1) == "holds"
    assert stats.verdict(0.1, 0.5, -1) == "fails"
    assert stats.verdict(-0.1, 0.5, +1) == "inconclusive"
    assert stats.verdict(-0.5, -0.1, -1) == "holds"
    assert stats.verdict(float("nan"), float("nan"), +1) == "inconclusive"


def test_transient_end_on_known_trajectories():
    steps = np.array([0, 1, 2, 4, 8, 16, 32, 50, 100, 150, 200, 250, 300])
    # collapse 30 -> 3 by step 50, rebound to ~4 by 150, then flat: ends at 150
    level = np.array([30, 30, 30, 29, 28, 12, 4, 3, 3.6, 4.0, 4.1, 4.0, 4.05])
    assert stats.transient_end(steps, level) == 150
    # a looser tolerance accepts the first rebound step (+20%): the transient ends at the bottom
    assert stats.transient_end(steps, level, tolerance=0.25) == 50
    # no collapse: no transient
    assert stats.transient_end(steps, np.linspace(10, 8, len(steps))) == 0
    # order of the probes does not matter
    perm = np.random.default_rng(0).permutation(len(steps))
    assert stats.transient_end(steps[perm], level[perm]) == 150


def test_mde_has_its_power_by_simulation_and_the_normal_limit():
    v = np.random.default_rng(1).normal(size=16)
    v = (v - v.mean()) / v.std(ddof=1)  # sd exactly 1: the mde is in units of sd
    d = stats.mde(v)
    assert 0.6 < d < 0.9
    # an independent check: simulated t-tests at a true mean of d reject with probability 0.80
    rng = np.random.default_rng(2)
    x = rng.normal(d, 1.0, size=(40000, 16))
    t = x.mean(1) / (x.std(1, ddof=1) / 4)
    assert np.mean(np.abs(t) > 2.131449545559323) == pytest.approx(0.80, abs=0.01)  # t_{15, 0.975}
    big = np.random.default_rng(3).normal(size=2000)
    big = (big - big.mean()) / big.std(ddof=1)
    assert stats.mde(big) == pytest.approx((1.959964 + 0.841621) / np.sqrt(2000), rel=2e-3)  # z_.975 + z_.8
    assert np.isnan(stats.mde([1.0]))
    # solved once per (n, power, level), then scaled by each sample's SD: the cache keys on all three
    assert stats.mde(3 * v) == pytest.approx(3 * d, rel=1e-12)
    assert stats.mde(v, power=0.9) > d and stats.mde(v, level=0.99) > d
    v8 = (v[:8] - v[:8].mean()) / v[:8].std(ddof=1)
    assert stats.mde(v8) > d  # sd 1 again, n 8: its own root, not the cached one of n = 16


def test_fieller_interval_reduces_to_t_interval_and_opens_on_a_weak_denominator():
    a = np.array([1.0, 1.5, 0.7, 1.2, 0.9, 1.4])
    r, lo, hi = stats.fieller_ratio_ci(a, np.full(6, 2.0))  # an exact denominator: the t-interval / 2
    tlo, thi = stats.t_mean_ci(a)
    assert (r, lo, hi) == pytest.approx((a.mean() / 2, tlo / 2, thi / 2))
    r, lo, hi = stats.fieller_ratio_ci(a, np.array([0.1, -0.2, 0.3, -0.1, 0.05, -0.1]))  # covers 0
    assert (lo, hi) == (-np.inf, np.inf)


def test_median_ci_order_statistics_known_ranks():
    # n = 10: the 95% interval is (x_(2), x_(9)), coverage 1 - 2 P(B <= 1) = 0.9785
    med, lo, hi = stats.median_ci(np.arange(1.0, 11.0))
    assert (med, lo, hi) == (5.5, 2.0, 9.0)
    assert np.isnan(stats.median_ci([1.0, 2.0, 3.0])[1])  # n = 3 cannot reach 95%


def test_spearman_ci_fisher_z():
    x = np.arange(20.0)
    y = x + np.random.default_rng(0).normal(0, 5, 20)
    rho, lo, hi, n = stats.spearman_ci(x, y)
    half = 1.959964 * np.sqrt((1 + rho**2 / 2) / 17)  # Bonett and Wright's standard error of z
    assert n == 20 and (lo, hi) == pytest.approx((np.tanh(np.arctanh(rho) - half), np.tanh(np.arctanh(rho) + half)))


def test_tost_rules_out_only_when_the_90_interval_lies_inside_the_margin():
    v = np.array([0.01, -0.02, 0.015, 0.0, -0.005, 0.01])
    lo, hi, eq = stats.tost(v, margin=0.05)
    half = sp_stats.t.ppf(0.95, 5) * v.std(ddof=1) / np.sqrt(6)  # the 90% t half-width, by hand
    assert (lo, hi) == pytest.approx((v.mean() - half, v.mean() + half)) and eq
    assert not stats.tost(v, margin=0.01)[2]  # the interval reaches past 0.01
    assert not stats.tost(np.array([0.3, 0.5, 0.4]), margin=0.05)[2]
    assert not stats.tost(v, margin=0.0)[2]


def test_fisher_z_interval_stays_inside_minus_one_one():
    rhos = np.array([0.70, 0.99, 1.0, 0.95])  # a seed at the ceiling: a t-interval on rho leaves [-1, 1]
    assert stats.t_mean_ci(rhos)[1] > 1
    mean, lo, hi = stats.fisher_z_mean_ci(rhos)
    z = np.arctanh(np.clip(rhos, -0.999999, 0.999999))
    zl, zh = stats.t_mean_ci(z)
    assert (mean, lo, hi) == pytest.approx((np.tanh(z.mean()), np.tanh(zl), np.tanh(zh)))
    assert -1 < lo < mean < hi < 1


def test_sign_flip_p_is_exact_and_names_the_floor_of_the_design():
    p, floor = stats.sign_flip_p(np.array([0.3, 0.1, 0.2, 0.4]))
    assert (p, floor) == (0.125, 0.125)  # 2 of 16 patterns as extreme: nothing at n = 4 gets below
    p, _ = stats.sign_flip_p(np.array([1.0, -1.0, 2.0, 3.0]))
    # |mean| >= 1.25: patterns whose flipped sum has |s| >= 5 -> count them independently
    v = np.array([1.0, -1.0, 2.0, 3.0])
    sums = [abs(np.dot(s, v)) for s in itertools.product([1, -1], repeat=4)]
    assert p == pytest.approx(np.mean([x >= 5 - 1e-9 for x in sums]))


def test_two_uncoupled_series_sharing_a_schedule_come_out_null():
    """Both follow the same LR-shaped trend plus their own noise: raw and first-difference
    correlations are high, but the cross-seed surrogate null has the same correlation, so the
    excess is null; a real coupling shows up as an excess."""
    rng = np.random.default_rng(0)
    steps = np.arange(40)
    schedule = np.cos(np.pi * steps / 39)  # the shared clock
    x = [schedule * 2 + rng.normal(0, 0.04, 40) for _ in range(8)]
    y = [schedule * 3 + rng.normal(0, 0.04, 40) for _ in range(8)]
    res = stats.comovement_excess(x, y)
    assert res["observed"] > 0.2  # what a naive first-difference reading calls "tracks"
    assert res["low"] < 0 < res["high"] and abs(res["excess"]) < 0.15 and res["n"] == 8
    coupled = [xi + rng.normal(0, 0.05, 40) for xi in x]  # y_i moves with x_i itself
    res = stats.comovement_excess(x, coupled)
    assert res["low"] > 0.2


def _same(a: float, b: float) -> bool:
    """Equal to 1e-13, or both NaN (the stacked calls give the pairwise bits on this machine's BLAS;
    tests/analysis/test_records.py holds the committed tables to that)."""
    return (np.isnan(a) and np.isnan(b)) or abs(a - b) <= 1e-13 * max(1.0, abs(b))


def test_a_slope_has_the_same_bits_under_any_scipy(monkeypatch):
    """scipy 1.18 rewrote linregress (a dot product of centred vectors in place of np.cov), which moved one
    committed value in its 12th digit (ladder-cpu's claims.csv, under Python 3.12 with scipy 1.18.1).
    slope is cov(x, y) / var(x) from one np.cov call, linregress's formula up to 1.17, and never calls it."""

    def refused(*args, **kwargs):
        raise AssertionError("stats.slope called scipy's linregress")

    monkeypatch.setattr(sp_stats, "linregress", refused)
    assert stats.slope([0.0, 1.0, 2.0, 3.0], [1.0, 4.0, 7.0, 10.0]) == 3.0  # exact in binary
    rng = np.random.default_rng(3)
    for n in range(2, 60):
        x, y = rng.uniform(0, 1, n), rng.normal(0, 1, n) * 10.0 ** rng.uniform(-3, 3)
        c = np.cov(x, y, bias=1)  # scipy 1.17's linregress: ssxm, ssxym, _, ssym = np.cov(x, y, bias=1).flat
        assert stats.slope(x, y) == c[0, 1] / c[0, 0]
    assert np.isnan(stats.slope([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])) and np.isnan(stats.slope([0.0, 1.0], [0.0, np.nan]))


def test_stacked_slopes_and_rank_correlations_equal_scipys_one_at_a_time():
    """slopes, spearman_pairs and comovement_excess's cross-correlations stack several series in one
    numpy call (what made `qkgeom analyze` 1.9x faster); each value must be scipy's linregress slope,
    scipy's spearmanr rho and numpy's two-series corrcoef, with ties, NaNs, constant and missing series."""
    rng = np.random.default_rng(7)
    for t in range(300):
        n = int(rng.integers(2, 90))
        x = np.sort(rng.uniform(0, 1, n))
        ys = rng.normal(0, 1, (int(rng.integers(1, 9)), n)) * 5
        ys[0, rng.integers(0, n)] = np.nan if t % 3 == 0 else ys[0, 0]
        ys[-1] = 2.5 if t % 4 == 0 else ys[-1]
        for got, y in zip(stats.slopes(x, ys), ys, strict=True):
            want = sp_stats.linregress(x, y).slope if np.isfinite(y).all() else np.nan
            assert _same(got, want)
        series = {f"m{i}": np.round(v, 1) if t % 2 else v for i, v in enumerate(ys)}
        pairs = list(itertools.permutations(series, 2)) + [("absent", "m0")]
        for (a, b), got in stats.spearman_pairs(series, pairs).items():
            ok = a in series and np.isfinite(series[a]).all() and np.isfinite(series[b]).all()
            constant = ok and (np.ptp(series[a]) == 0 or np.ptp(series[b]) == 0)
            want = np.nan if not ok or constant or n < 3 else sp_stats.spearmanr(series[a], series[b]).statistic
            if a in series and not ok:  # a NaN: spearman over the finite pairs
                want = stats.spearman(series[a], series[b])[0]
            assert _same(got, want), (t, a, b)
        dx = [rng.normal(0, 1, n) for _ in range(int(rng.integers(2, 17)))]
        dy = [d * 0.5 + rng.normal(0, 1, n) for d in dx]
        dy[0] = np.zeros(n) if t % 5 == 0 else dy[0]
        r = stats._cross_r(dx, dy)
        for i, j in itertools.product(range(len(dx)), repeat=2):
            want = np.nan if n < 3 or not dy[j].any() else np.corrcoef(dx[i], dy[j])[0, 1]
            assert _same(r[i, j], want), (t, i, j)
    assert stats.spearman_pairs({"a": np.arange(6.0), "b": -(np.arange(6.0) ** 3)}, [("a", "b")])["a", "b"] == -1.0
    assert stats.slopes(np.arange(5.0), []).shape == (0,)  # a run with none of the slope metrics


def test_holm_matches_a_hand_computation():
    p = np.array([0.01, 0.04, 0.03, 0.005, np.nan])
    np.testing.assert_allclose(stats.holm(p)[:4], [0.03, 0.06, 0.06, 0.02])
    assert np.isnan(stats.holm(p)[4])


def test_a_studys_margin_reaches_every_judged_row_without_one():
    """apply_margin: an inconclusive row reads "rules out" only if its 90% interval lies inside +-d;
    holds/fails rows and rows that carry their own margin or no 90% interval keep their reading."""
    import pandas as pd

    from qkgeom.analysis.claims import apply_margin

    rows = pd.DataFrame(
        {
            "verdict": ["inconclusive", "inconclusive", "holds", "inconclusive", "inconclusive"],
            "n": [12] * 5,
            "ci_low": [-0.05, -0.2, 0.1, -0.01, -1.0],
            "ci_high": [0.04, 0.1, 0.3, 0.01, 1.0],
            "ci90_low": [-0.04, -0.15, 0.12, -0.008, np.nan],
            "ci90_high": [0.03, 0.08, 0.28, 0.008, np.nan],
            "margin": [np.nan, np.nan, np.nan, 0.0488, np.nan],
            "reading": ["", "", "", "kept", ""],
        }
    )
    out = apply_margin(rows, 0.05)
    assert out["reading"][0] == "rules out |effect| >= 0.05 (TOST: 90% CI [-0.04, 0.03] inside +-0.05)"
    assert out["reading"][1] == "inconclusive, CI [-0.2, 0.1]"
    assert out["reading"][2] == "" and out["margin"][2] == 0.05
    assert out["reading"][3] == "kept" and out["margin"][3] == 0.0488  # its own margin (a scale check)
    assert out["reading"][4] == "" and np.isnan(out["margin"][4])  # no 90% interval: left alone
    assert apply_margin(rows, np.nan).equals(rows)
