"""stats: known answers and parity with direct numpy computations."""

import numpy as np
import pytest

from qkgeom import stats


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
