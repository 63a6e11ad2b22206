"""The intervals and tests behind the verdicts keep their stated coverage where the truth is known (by
simulation through qkgeom's own functions, at the n the studies use), and the readings they replaced do
not. bench/interval_coverage.py runs the same checks at more draws, shapes and n."""

import math

import numpy as np
import pytest
from scipy import stats as sp_stats

from qkgeom.analysis import stats


def bivariate(rng: np.random.Generator, rho: float, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=shape)
    return x, rho * x + math.sqrt(1 - rho**2) * rng.normal(size=shape)


def test_spearman_interval_covers_at_a_high_correlation():
    """Fieller-Hartley-Pearson's sqrt(1.06 / (n - 3)) covered 0.925 here (20,000 draws): too narrow near
    the ceiling. Bonett-Wright's keeps 95% there and at 0."""
    rng = np.random.default_rng(0)
    for rho, n in ((0.9, 48), (0.0, 24)):
        truth = 6 / math.pi * math.asin(rho / 2)  # Spearman's rho of a bivariate normal
        x, y = bivariate(rng, rho, (3000, n))
        hits = [lo <= truth <= hi for lo, hi in (stats.spearman_ci(a, b)[1:3] for a, b in zip(x, y, strict=True))]
        assert 0.94 <= np.mean(hits) <= 0.975, (rho, n, np.mean(hits))


def test_fieller_interval_has_its_coverage_and_opens_when_the_first_stage_is_weak():
    rng = np.random.default_rng(1)
    theta = -0.4
    for sd, low in ((0.3, 0.935), (3.0, 0.95)):  # strong first stage: ~exact; weak: unbounded, conservative
        hits, unbounded = [], []
        for _ in range(2000):
            b = rng.normal(1.0, sd, 12)
            _, lo, hi = stats.fieller_ratio_ci(theta * b + rng.normal(0, 0.5, 12), b)
            hits.append(lo <= theta <= hi)
            unbounded.append(math.isinf(lo))
        assert low <= np.mean(hits) <= (0.965 if sd < 1 else 1.0)
        # unbounded exactly when the denominator's own t-test does not reject: a noncentral t's mass
        tc, ncp = sp_stats.t.ppf(0.975, 11), 1.0 / (sd / math.sqrt(12))
        known = sp_stats.nct.cdf(tc, 11, ncp) - sp_stats.nct.cdf(-tc, 11, ncp)
        assert np.mean(unbounded) == pytest.approx(known, abs=3 * math.sqrt(known * (1 - known) / 2000) + 1e-9)


def test_median_interval_reaches_its_level_on_skewed_layers():
    rng = np.random.default_rng(2)
    x = rng.gamma(2.0, size=(3000, 12))
    truth = 1.6783469900166608  # the median of gamma(2, 1): the root of 1 - e^-m (1 + m) = 1/2
    assert math.isclose(1 - math.exp(-truth) * (1 + truth), 0.5, abs_tol=1e-12)
    hits = [lo <= truth <= hi for _, lo, hi in map(stats.median_ci, x)]
    assert np.mean(hits) >= 0.95  # the order statistics (3, 10) of 12: exact coverage 0.9614


def test_comovement_excess_is_null_under_a_shared_schedule_and_the_naive_reading_is_not():
    """Eight seeds whose x and y follow one schedule (random-walk noise, seed-varying amplitude), with no
    coupling: the excess's t-interval covers 0 at its level; a t-test of the same seeds' first-difference
    r (the reading the excess replaced) rejects far more often than 5%."""
    rng = np.random.default_rng(3)
    clock = np.cos(np.pi * np.arange(25) / 24)

    def seeds() -> list[np.ndarray]:
        return list((1 + 0.3 * rng.normal(size=(8, 1))) * clock + np.cumsum(rng.normal(0, 0.1, (8, 25)), 1))

    covered, naive_rejects = [], []
    for _ in range(400):
        xs, ys = seeds(), seeds()
        res = stats.comovement_excess(xs, ys)
        covered.append(res["low"] <= 0 <= res["high"])
        r = [np.corrcoef(np.diff(a), np.diff(b))[0, 1] for a, b in zip(xs, ys, strict=True)]
        naive_rejects.append(stats.t_test_p(np.array(r)) < 0.05)
    assert np.mean(covered) >= 0.93
    assert np.mean(naive_rejects) > 0.25


def test_sign_flip_test_is_exact_under_symmetry():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3000, 10))
    size = np.mean([stats.sign_flip_p(v)[0] < 0.05 for v in x])
    assert size <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 3000)  # p < 0.05 is p <= 50/1024: size 0.0488


def test_holm_controls_the_family_wise_error():
    rng = np.random.default_rng(5)
    z = math.sqrt(0.5) * rng.normal(size=(4000, 8)) + math.sqrt(0.5) * rng.normal(size=(4000, 1))
    p = 2 * sp_stats.norm.sf(np.abs(z))
    fwer = np.mean([(stats.holm(q) < 0.05).any() for q in p])
    assert fwer <= 0.05 and fwer > 0.01  # equicorrelated nulls: below 5%, but not vanishingly so
