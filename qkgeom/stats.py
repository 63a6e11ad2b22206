"""Pure statistics for the claims table: arrays in, numbers out (scipy underneath).

- slope:                 OLS slope of y on x (scipy.stats.linregress).
- bootstrap_mean_ci:     percentile CI of the mean by resampling units (scipy.stats.bootstrap).
- sign_test:             two-sided binomial test of the count of positive signs (scipy.stats.binomtest).
- probability_of_direction: share of the bootstrap distribution of the mean on the predicted side.
- spearman:              rank correlation and p-value (scipy.stats.spearmanr).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as S


def slope(x: np.ndarray, y: np.ndarray) -> float:
    """OLS slope of y against x; NaN with fewer than two distinct x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(np.unique(x)) < 2:
        return math.nan
    return float(S.linregress(x, y).slope)


def bootstrap_mean_ci(
    values: np.ndarray, level: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean; (nan, nan) with fewer than two values or no spread."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) < 2 or np.all(v == v[0]):
        return (float(v[0]), float(v[0])) if len(v) >= 2 else (math.nan, math.nan)
    res = S.bootstrap(
        (v,),
        np.mean,
        confidence_level=level,
        n_resamples=n_resamples,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def bootstrap_means(values: np.ndarray, n_resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """The bootstrap distribution of the mean (resampling values with replacement)."""
    v = np.asarray(values, float)
    rng = np.random.default_rng(seed)
    return v[rng.integers(0, len(v), size=(n_resamples, len(v)))].mean(1)


def probability_of_direction(values: np.ndarray, predicted_sign: int, n_resamples: int = 2000, seed: int = 0) -> float:
    """Share of bootstrap means with the predicted sign (+1 or -1), in [0, 1]."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return math.nan
    means = bootstrap_means(v, n_resamples, seed)
    return float(np.mean(np.sign(means) == predicted_sign))


def sign_test(values: np.ndarray, predicted_sign: int) -> tuple[int, int, float]:
    """(count with the predicted sign, count of non-zero values, two-sided binomial p-value at 1/2)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v != 0)]
    k = int(np.sum(np.sign(v) == predicted_sign))
    if len(v) == 0:
        return 0, 0, math.nan
    return k, len(v), float(S.binomtest(k, len(v), 0.5).pvalue)


def spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float, int]:
    """(rho, p-value, n) over the finite pairs; NaNs with fewer than three pairs."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.all(x[ok] == x[ok][0]) or np.all(y[ok] == y[ok][0]):
        return math.nan, math.nan, int(ok.sum())
    r = S.spearmanr(x[ok], y[ok])
    return float(r.statistic), float(r.pvalue), int(ok.sum())
