"""Pure statistics for the claims table: arrays in, numbers out (scipy underneath).

- slope:                 OLS slope of y on x (scipy.stats.linregress's formula, through np.cov).
- slopes:                the same for several y at once (stacked np.cov; the same bits, one call).
- t_mean_ci:             Student-t CI of the mean over independent units (seeds); exact coverage for
                         normal data at any n >= 2, which a percentile bootstrap lacks at n = 4-5 (~80%).
- bootstrap_mean_ci:     percentile CI of the mean by resampling units (scipy.stats.bootstrap); kept for
                         large n only.
- transient_end:         the data-driven end of the early transient of a PR trajectory (rule below).
- verdict:               holds / fails / inconclusive from a CI and a predicted sign.
- sign_test:             two-sided binomial test of the count of positive signs (scipy.stats.binomtest).
- probability_of_direction: share of the bootstrap distribution of the mean on the predicted side.
- spearman:              rank correlation and p-value (scipy.stats.spearmanr).
- spearman_pairs:        rho of several pairs of series, each series ranked once (spearmanr's bits).
- mde:                   minimum detectable effect of a one-sample t-test at a power (noncentral t).
- fieller_ratio_ci:      Fieller's CI of a ratio of two means over paired units (the IV estimate).
- tost, inside_margin:   two one-sided tests of equivalence: the 90% t-interval (or any interval)
                         inside +-margin.
- fisher_z_mean_ci:      mean of per-seed correlations through Fisher's z, t over seeds, back-transformed
                         (bounded in (-1, 1), unlike a t-interval on the correlations themselves).
- sign_flip_p:           exact sign-flip (permutation) p of mean = 0 over n units, and the smallest p
                         the design can reach (2 / 2^n two-sided): at n <= 5 it says what n can show.
- comovement_excess:     first-difference correlation of two series per seed minus its cross-seed
                         surrogate null (seed i's increments of one against seed j's of the other),
                         which removes what a shared schedule (LR, the training clock) alone gives.
- holm:                  Holm's step-down adjustment of a family of p-values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
from scipy import optimize
from scipy import stats as S


def slope(x: np.ndarray, y: np.ndarray) -> float:
    """OLS slope of y against x; NaN with fewer than two distinct x. One row of `slopes`: cov(x, y) / var(x)
    from one np.cov call, as scipy's linregress computed it up to 1.17 (1.18 computes it otherwise, with
    other last bits, which moved a committed table's 12th digit): the same bits under any scipy."""
    return float(slopes(x, np.asarray(y, float)[None])[0])


# np.cov and np.corrcoef over a few stacked rows give each entry the bits of the same call on two rows:
# their product X X^T is BLAS's, and at <= STACKED rows its kernel sums each entry as it does for two
# (checked here for 3 to 300 columns; tests/analysis/test_stats.py compares them). One call for a
# handful of series costs what one call for two did: slopes, spearman_pairs and comovement_excess stack.
STACKED = 7


def _chunks(n: int, size: int) -> list[np.ndarray]:
    return [np.arange(i, min(i + size, n)) for i in range(0, n, size)]


def slopes(x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """slope(x, y) for each row y of `ys` (linregress's ratio of covariances, from stacked np.cov calls);
    a row with a NaN gives NaN, as linregress does."""
    x = np.asarray(x, float)
    ys = np.asarray(ys, float).reshape(len(ys), len(x))  # no y at all: shape (0, len(x))
    out = np.full(len(ys), math.nan)
    if len(ys) == 0 or len(np.unique(x)) < 2 or np.isnan(x).any():
        return out
    for rows in _chunks(len(ys), STACKED - 1):
        c = np.cov(np.vstack([x, ys[rows]]), bias=1)
        out[rows] = c[0, 1:] / c[0, 0]
    return out


def t_mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Student-t CI of the mean: mean +- t_{n-1, (1+level)/2} * sd / sqrt(n), over the finite values.

    Units must be independent (seeds, not probe steps). (nan, nan) with fewer than two values;
    a zero-width interval when all values are equal.
    """
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) < 2:
        return math.nan, math.nan
    half = float(S.t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return float(v.mean() - half), float(v.mean() + half)


def t_test_p(values: np.ndarray) -> float:
    """Two-sided one-sample t-test p-value of mean = 0 over independent units; NaN below n = 2."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) < 2 or np.all(v == v[0]):
        return math.nan
    return float(S.ttest_1samp(v, 0.0).pvalue)


def verdict(lo: float, hi: float, predicted_sign: int) -> str:
    """`holds` if the CI excludes 0 on the predicted side, `fails` if it excludes 0 on the other
    side, else `inconclusive` (also for a NaN interval)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if (predicted_sign > 0 and lo > 0) or (predicted_sign < 0 and hi < 0):
        return "holds"
    if (predicted_sign > 0 and hi < 0) or (predicted_sign < 0 and lo > 0):
        return "fails"
    return "inconclusive"


def transient_end(steps: np.ndarray, level: np.ndarray, tolerance: float = 0.1) -> int:
    """The step at which the early transient of a PR trajectory ends (MISSION.md: both PRs collapse
    together in warm-up, then rebound). `level` is a symmetric Q/K summary per probe step, e.g. the
    layer mean of (PR_Q + PR_K) / 2, so the rule favours neither side of the contrast.

    Rule: (1) the collapse is the first probe at which the level is <= half its step-0 value (no
    such probe: no transient, return the first step); (2) follow it down to its local minimum;
    (3) the transient ends at the first probe from there whose change to the next probe is at most
    `tolerance` (relative), i.e. when the rebound has settled. Returns the last step if it never
    settles.
    """
    steps, s = np.asarray(steps), np.asarray(level, float)
    order = np.argsort(steps)
    steps, s = steps[order], s[order]
    below = np.nonzero(s <= 0.5 * s[0])[0]
    if len(below) == 0:
        return int(steps[0])
    i = int(below[0])
    while i + 1 < len(s) and s[i + 1] < s[i]:
        i += 1
    while i + 1 < len(s) and abs(s[i + 1] - s[i]) > tolerance * abs(s[i]):
        i += 1
    return int(steps[i])


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


def spearman_pairs(series: dict[str, np.ndarray], pairs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """spearman(series[x], series[y])[0] for each (x, y) of `pairs` whose series both exist (else NaN).
    Finite series of one length, at most STACKED of them, are ranked in one call and correlated in one
    np.corrcoef (the rho scipy's spearmanr gives, bit for bit); a pair with a non-finite value, series of
    other lengths, or more series than that go through spearman one pair at a time."""
    pairs = list(pairs)
    names = [m for m in dict.fromkeys(m for p in pairs for m in p) if m in series]
    arrays = {m: np.asarray(series[m], float) for m in names}
    stack = [m for m in names if np.isfinite(arrays[m]).all()]
    if len(stack) > STACKED or len({len(arrays[m]) for m in stack}) > 1:
        stack = []
    c = np.full((len(stack), len(stack)), math.nan)
    if stack and len(arrays[stack[0]]) >= 3:
        rows = np.vstack([arrays[m] for m in stack])
        constant = (rows == rows[:, :1]).all(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            c = np.atleast_2d(np.corrcoef(S.rankdata(rows, axis=1)))
        c[constant, :] = c[:, constant] = math.nan
    at = {m: i for i, m in enumerate(stack)}
    out = {}
    for x, y in pairs:
        if x not in arrays or y not in arrays:
            out[x, y] = math.nan
        elif x in at and y in at:
            out[x, y] = float(c[at[y], at[x]])  # spearmanr's entry: y's row, x's column
        else:
            out[x, y] = spearman(arrays[x], arrays[y])[0]
    return out


def mde(values: np.ndarray, power: float = 0.8, level: float = 0.95) -> float:
    """Minimum detectable effect: the smallest true mean that a two-sided one-sample t-test at
    1 - `level` detects with probability `power`, given n and the observed SD of `values`.

    Solves P(|T| > t_crit) = power for T ~ noncentral t(n - 1, delta * sqrt(n)) and returns
    delta * sd (the units of `values`). Smaller is better; an inconclusive verdict rules out true
    effects larger than this (at that power). NaN below n = 2.
    """
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n < 2:
        return math.nan
    return _mde_in_sd(n, power, level) * float(v.std(ddof=1))


@functools.lru_cache(maxsize=256)
def _mde_in_sd(n: int, power: float, level: float) -> float:
    """mde() in units of the SD: a function of n alone at a given power and level, so an analysis that
    judges a thousand rows at a few n solves it a few times (a root of the noncentral t's power)."""
    crit = S.t.ppf((1 + level) / 2, n - 1)

    def shortfall(delta: float) -> float:
        nc = delta * math.sqrt(n)
        lower = np.nan_to_num(S.nct.cdf(-crit, n - 1, nc))  # the far tail (< 1 - level); NaN at large nc
        return float(S.nct.sf(crit, n - 1, nc) + lower) - power

    return optimize.brentq(shortfall, 0.0, 4 * (crit + 1) / math.sqrt(n))  # power(upper) ~ 1


def fieller_ratio_ci(num: np.ndarray, den: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(ratio, low, high) for mean(num) / mean(den) over paired independent units (seeds).

    Fieller's interval: the set of r with |mean(num) - r mean(den)| <= t * se(num - r den), exact
    for normal data, and unbounded ((-inf, inf)) when the denominator's own t-interval covers 0,
    i.e. when the first stage is too weak to say anything about the ratio. Returned as a bounded
    interval only; a disjoint two-piece set (weak but significant-looking denominator) is also
    reported as (-inf, inf).
    """
    a, b = np.asarray(num, float), np.asarray(den, float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = len(a)
    if n < 3:
        return math.nan, math.nan, math.nan
    ma, mb = a.mean(), b.mean()
    saa, sbb, sab = np.cov(a, b, ddof=1).ravel()[[0, 3, 1]] / n  # variances of the means
    t2 = S.t.ppf((1 + level) / 2, n - 1) ** 2
    ratio = ma / mb if mb != 0 else math.nan
    # (mb^2 - t2 sbb) r^2 - 2 (ma mb - t2 sab) r + (ma^2 - t2 saa) <= 0
    qa, qb, qc = mb**2 - t2 * sbb, -2 * (ma * mb - t2 * sab), ma**2 - t2 * saa
    disc = qb**2 - 4 * qa * qc
    if qa <= 0 or disc < 0:
        return float(ratio), -math.inf, math.inf
    root = math.sqrt(disc)
    return float(ratio), float((-qb - root) / (2 * qa)), float((-qb + root) / (2 * qa))


def median_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the distribution-free interval for the median from order statistics
    (binomial(n, 1/2) ranks; coverage >= level for any continuous distribution). NaNs below n = 6,
    where no pair of order statistics reaches 95%."""
    v = np.sort(np.asarray(values, float)[np.isfinite(values)])
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(v))
    j = int(S.binom.ppf((1 - level) / 2, n, 0.5))  # P(B < j) <= (1 - level) / 2
    while j > 0 and 1 - 2 * S.binom.cdf(j - 1, n, 0.5) < level:
        j -= 1
    if j < 1:
        return med, math.nan, math.nan
    return med, float(v[j - 1]), float(v[n - j])


def spearman_ci(x: np.ndarray, y: np.ndarray, level: float = 0.95) -> tuple[float, float, float, int]:
    """(rho, low, high, n): Spearman's rho with the Fisher-z interval of Bonett and Wright (2000), standard
    error sqrt((1 + rho^2 / 2) / (n - 3)). On bivariate normal data (n 12 to 144, 20,000 draws) Fieller,
    Hartley and Pearson's sqrt(1.06 / (n - 3)) covered 0.92-0.94 at rho 0.8 and 0.9; this one 0.950-0.963
    at rho 0, 0.5, 0.8 and 0.9 (bench/interval_coverage.py keeps checking it). NaNs below n = 4."""
    rho, _, n = spearman(x, y)
    if not math.isfinite(rho) or n < 4:
        return rho, math.nan, math.nan, n
    z = math.atanh(min(max(rho, -0.999999), 0.999999))
    half = S.norm.ppf((1 + level) / 2) * math.sqrt((1 + rho**2 / 2) / (n - 3))
    return rho, math.tanh(z - half), math.tanh(z + half), n


def tost(values: np.ndarray, margin: float, level: float = 0.90) -> tuple[float, float, bool]:
    """Equivalence by two one-sided t-tests at (1 - level) / 2 each: (low, high, equivalent), where
    (low, high) is the `level` t-interval of the mean and equivalent means it lies inside
    (-margin, +margin). Only then does a row "rule out |effect| >= margin". NaN/False below n = 2
    or without a positive margin."""
    lo, hi = t_mean_ci(values, level)
    return lo, hi, inside_margin(lo, hi, margin)


def inside_margin(lo: float, hi: float, margin: float) -> bool:
    """Whether the interval (lo, hi) lies strictly inside (-margin, +margin): TOST's equivalence, for
    any interval (a t-interval, a back-transformed Fisher-z one). False for a NaN bound or margin."""
    ok = math.isfinite(margin) and margin > 0 and math.isfinite(lo) and math.isfinite(hi)
    return bool(ok and -margin < lo and hi < margin)


def fisher_z_mean_ci(rhos: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of per-unit correlations: z = atanh(rho) (rho clipped to +-0.999999, so a
    seed at the ceiling of 1 stays finite), Student-t interval of the mean z over units, then tanh.
    The interval always lies inside (-1, 1). NaNs below n = 2 (the mean alone at n = 1)."""
    r = np.asarray(rhos, float)
    r = r[np.isfinite(r)]
    if len(r) == 0:
        return math.nan, math.nan, math.nan
    z = np.arctanh(np.clip(r, -0.999999, 0.999999))
    lo, hi = t_mean_ci(z, level)
    mean = math.tanh(float(z.mean()))
    return mean, (math.tanh(lo) if math.isfinite(lo) else math.nan), (math.tanh(hi) if math.isfinite(hi) else math.nan)


@functools.lru_cache(maxsize=32)
def _sign_patterns(n: int) -> np.ndarray:
    """Every pattern of n signs, (2^n, n) as floats (built once per n: at n = 16 building it cost more
    than the test); read-only, shared between calls."""
    signs = (1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)).astype(float)
    signs.flags.writeable = False
    return signs


def sign_flip_p(
    values: np.ndarray, max_exact: int = 16, n_resamples: int = 20000, seed: int = 0
) -> tuple[float, float]:
    """(p, smallest reachable p): two-sided sign-flip test of mean = 0 over independent units,
    exact (all 2^n sign patterns) up to n = max_exact, Monte Carlo beyond. Under the null each unit's
    sign is a fair coin; p = share of patterns with |mean| >= the observed |mean|. The smallest p
    the design can reach is 2 / 2^n (1 / 2^(n-1)): at n = 4 no test can get below 0.125."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan
    obs = abs(v.mean()) - 1e-12 * max(1.0, float(np.abs(v).max()))
    if n <= max_exact:
        means = np.abs(_sign_patterns(n) @ v) / n
        return float(np.mean(means >= obs)), float(2.0 / 2**n)
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(n_resamples, n))
    return float((1 + np.sum(np.abs(signs @ v) / n >= obs)) / (n_resamples + 1)), float(1.0 / (n_resamples + 1))


def comovement_excess(x: list[np.ndarray], y: list[np.ndarray], level: float = 0.95) -> dict[str, float]:
    """Does y move with x beyond what their shared clock gives? x[i], y[i]: seed i's series at the
    same probe steps. Per seed, r_ii = corr(diff x_i, diff y_i) (Pearson on first differences); its
    surrogate null is the mean over j != i of r_ij = corr(diff x_i, diff y_j), which keeps everything
    the seeds share (the schedule) and breaks only the within-run coupling. Returns the mean observed
    r, the mean null r, the excess (mean over seeds of r_ii - null_i) with its t-interval over seeds
    and n. Two uncoupled series driven by one schedule give an excess near 0."""
    dx = [np.diff(np.asarray(a, float)) for a in x]
    dy = [np.diff(np.asarray(b, float)) for b in y]
    n = len(dx)
    out = dict(observed=math.nan, null=math.nan, excess=math.nan, low=math.nan, high=math.nan, n=n)
    if n < 2:
        return out

    r = _cross_r(dx, dy)
    own = np.diag(r).copy()
    null = np.array([finite_mean([r[i, j] for j in range(n) if j != i]) for i in range(n)])
    excess = own - null
    lo, hi = t_mean_ci(excess, level)
    return dict(
        observed=finite_mean(own), null=finite_mean(null), excess=finite_mean(excess),
        low=lo, high=hi, n=int(np.isfinite(excess).sum()), per_unit=excess,
    )  # fmt: skip


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson r over the first min(len) entries, finite pairs only; NaN below 3 pairs or a constant side."""
    m = min(len(a), len(b))
    a, b = a[:m], b[:m]
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.std(a[ok]) == 0 or np.std(b[ok]) == 0:
        return math.nan
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


def _cross_r(dx: list[np.ndarray], dy: list[np.ndarray]) -> np.ndarray:
    """r[i, j] = _pearson(dx[i], dy[j]). Finite series of one length (what comovement_per_seed passes):
    each dx[i] stacked with up to STACKED - 1 of the dy in one np.corrcoef, entry for entry the bits of
    the pairwise call; otherwise pair by pair."""
    n = len(dx)
    if len({len(a) for a in dx + dy}) > 1 or not all(np.isfinite(a).all() for a in dx + dy) or len(dx[0]) < 3:
        return np.array([[_pearson(dx[i], dy[j]) for j in range(n)] for i in range(n)])
    xs, ys = np.vstack(dx), np.vstack(dy)
    r = np.full((n, n), math.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        for i in range(n):
            for cols in _chunks(n, STACKED - 1):
                r[i, cols] = np.corrcoef(np.vstack([xs[i], ys[cols]]))[0, 1:]
    r[np.std(xs, axis=1) == 0, :] = math.nan
    r[:, np.std(ys, axis=1) == 0] = math.nan
    return r


def finite_mean(values) -> float:
    """Mean of the finite values; NaN (no warning) when there are none."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else math.nan


def holm(pvalues: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error control, any dependence); NaNs stay NaN
    and do not count toward the family's size."""
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    running = 0.0
    for rank, idx in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[idx]))
        out[idx] = running
    return out
