"""Heavy-tail exponents of spectra: the power-law alpha of a matrix's eigenvalues (W^T W), fitted as
WeightWatcher 0.7.7 fits it (`weightwatcher`, the default) or by Clauset-Shalizi-Newman (`clauset`);
many spectra fitted together in one vectorised pass (power_law_alphas). Arrays in, dicts out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from qkgeom.config import ALPHA_CONVENTIONS
from qkgeom.solves import thread_map

Tensor = torch.Tensor


ALPHA_MIN_TAIL = 10  # `clauset`: eigenvalues the power-law tail must hold for alpha to be reported
# `weightwatcher`: WeightWatcher 0.7.7's own fit (WW_powerlaw.WWFit, its default pl_package): it fits
# matrices with >= WW_MIN_EVALS eigenvalues (its min_evals), drops eigenvalues <= WW_EVALS_THRESH (its
# EVALS_THRESH, absolute), tries every eigenvalue but the largest as xmin (xmax = the largest: no upper
# cut), and below WW_SMALL_N eigenvalues switches to its bias-corrected small-sample estimator.
WW_MIN_EVALS, WW_EVALS_THRESH, WW_SMALL_N, WW_SMALL_K_MIN = 8, 1e-5, 20, 8


def alpha_note(convention: str, reason: str = "") -> str:
    """The `note` an alpha row carries: its convention, and why the value is NaN where it is."""
    return f"alpha={convention}" + (f"; {reason}" if reason else "")


def power_law_alpha(
    eigenvalues: np.ndarray | Tensor, min_tail: int = ALPHA_MIN_TAIL, convention: str = "weightwatcher"
) -> dict:
    """Heavy-tail exponent alpha of an eigenvalue spectrum (e.g. of W^T W), under a convention.

    `weightwatcher` (the default; what papers that use WeightWatcher report): WeightWatcher 0.7.7's own
    fit, equal to its per-layer alpha (tests/probing/test_geometry.py runs it): see WW_MIN_EVALS above;
    min_tail does not apply. `clauset`: the `powerlaw` package's fit without xmax, as below.

    `clauset` (Clauset, Shalizi & Newman 2009): for each candidate xmin among the
    distinct eigenvalues, the continuous maximum-likelihood alpha = 1 + n / sum(ln(x_i / xmin)) over
    the n eigenvalues >= xmin, and the Kolmogorov-Smirnov distance D between the tail's empirical CDF
    (0, 1/n, ..., (n-1)/n at the sorted values) and 1 - (x / xmin)^(1 - alpha); the xmin of least D
    wins. Range alpha > 1; heavier tails have smaller alpha (WeightWatcher reads 2-6 as trained).

    With min_tail = 2 this is exactly powerlaw 2.0.0's `Fit(x, discrete=False, parameter_ranges={"alpha":
    [1, None]})` (tests/probing/test_geometry.py); powerlaw's own default only accepts fits with alpha < 3,
    which would hide the alphas of 4-8 that trained weights often show.

    Returns {alpha, xmin, n_tail, ks_distance, reason}: alpha is NaN, with the reason, for a spectrum
    with non-finite values, an all-zero or rank-one matrix, or no candidate with >= min_tail tail
    eigenvalues; never a number from too few points. :func:`power_law_alphas` fits many at once."""
    return power_law_alphas([eigenvalues], min_tail, convention)[0]


_NAN_FIT = dict(alpha=math.nan, xmin=math.nan, n_tail=0, ks_distance=math.nan, reason="")


def _ww_small_n(x: np.ndarray) -> dict:
    """WeightWatcher 0.7.7's small-sample fit (WWFit.fit_powerlaw_smallN, lambda_prior 0) of an ascending
    spectrum of fewer than WW_SMALL_N eigenvalues: bias-corrected alpha = 1 + (n - 1) / sum ln(x / xmin)
    over tails of >= WW_SMALL_K_MIN points. WWFit's constructor then takes the xmin of least D_KS (its
    own D_KS - 0.868 / sqrt(n) choice is overwritten), and so does this."""
    logx, big_n = np.log(x), len(x)
    best, best_d = None, 1.0  # WWFit's D of a candidate it skips
    for i in range(big_n - 1):
        n = big_n - i
        total = logx[i:].sum() - n * logx[i]
        if n < WW_SMALL_K_MIN or total <= 1e-12:
            continue
        alpha = 1.0 + (n - 1.0) / total
        if alpha <= 1.0:
            continue
        ks = float(np.max(np.abs(np.arange(n) / n - (1.0 - (x[i:] / x[i]) ** (1.0 - alpha)))))
        if ks < best_d:
            best, best_d = dict(alpha=float(alpha), xmin=float(x[i]), n_tail=n, ks_distance=ks, reason=""), ks
    if best is None:  # WeightWatcher then reports a fit over all points, or alpha = 1: not a tail either way
        return _NAN_FIT | dict(reason=f"no tail of {WW_SMALL_K_MIN} eigenvalues with a finite fit ({big_n})")
    return best


def _fit_input(ev: np.ndarray | Tensor, ww: bool) -> np.ndarray | dict:
    """A spectrum as the grid fit takes it (ascending, the convention's zeros dropped), or its finished
    fit where there is nothing to grid: non-finite, too few or all-zero values, WeightWatcher's small N."""
    x = np.asarray(ev.detach().cpu().numpy() if isinstance(ev, Tensor) else ev, float)
    if not np.isfinite(x).all():
        return _NAN_FIT | dict(reason="non-finite values")
    if ww and len(x) < WW_MIN_EVALS:
        return _NAN_FIT | dict(reason=f"fewer than {WW_MIN_EVALS} eigenvalues ({len(x)}: WeightWatcher's min_evals)")
    x = np.sort(x[x > WW_EVALS_THRESH]) if ww else np.sort(x[x > 0])
    top = x[-1] if len(x) else 0.0
    x = x if ww else x[x > top * 1e-12]  # numerically zero eigenvalues are no part of a spectrum
    if len(x) < 2:
        return _NAN_FIT | dict(reason="rank one" if len(x) else "all-zero matrix")
    return _ww_small_n(x) if ww and len(x) < WW_SMALL_N else x


def _ks_distances(
    logx: np.ndarray, row: np.ndarray, start: np.ndarray, n_tail: np.ndarray, alphas: np.ndarray
) -> np.ndarray:
    """The KS distance of each candidate (spectrum row[c], tail from start[c]) of spectra logx (M, N):
    each candidate one row of a grid, computed in chunks of rows spread over torch's threads (NumPy
    releases the GIL inside each operation; every value is computed by the same operations whatever
    the chunking, so the distances are the same bit for bit)."""
    big_n = logx.shape[1]
    ks = np.empty(len(row))
    j = np.arange(big_n)
    threads = torch.get_num_threads() if len(row) * big_n >= 2**20 else 1  # below ~1M cells, one thread
    chunk = max(1, 8_000_000 // (big_n * threads))  # grid rows at a time: ~64 MB in all for any N

    def fill(a: int) -> None:
        r, i = row[a : a + chunk], start[a : a + chunk]
        al, nt, log_min = alphas[a : a + chunk, None], n_tail[a : a + chunk, None], logx[r, i][:, None]
        i = i[:, None]
        model = 1.0 - np.exp(np.minimum((1.0 - al) * (logx[r] - log_min), 0.0))  # <= 0 in the tail
        dist = np.abs((j[None, :] - i) / nt - model)
        ks[a : a + chunk] = np.where(j[None, :] >= i, dist, -np.inf).max(axis=1)

    starts = range(0, len(row), chunk)
    if threads > 1 and len(starts) > 1:
        thread_map(fill, starts, threads)
    else:
        for a in starts:
            fill(a)
    return ks


def power_law_alphas(
    spectra: Sequence[np.ndarray | Tensor], min_tail: int = ALPHA_MIN_TAIL, convention: str = "weightwatcher"
) -> list[dict]:
    """:func:`power_law_alpha` of each spectrum, bit for bit, with the spectra of one length fitted in
    one vectorised pass (96 spectra of a cpu-preset probe's sizes: 6.4 -> 3.2 ms): every candidate xmin
    of every such spectrum is one row of a (candidates x N) grid, each row computed with the same
    operations, in the same order, as a fit on its own."""
    if convention not in ALPHA_CONVENTIONS:
        raise ValueError(f"alpha convention {convention!r}; allowed: {', '.join(ALPHA_CONVENTIONS)}")
    ww = convention == "weightwatcher"
    out: list[dict | None] = [None] * len(spectra)
    nan = _NAN_FIT
    by_length: dict[int, list[tuple[int, np.ndarray]]] = {}
    for s, ev in enumerate(spectra):
        x = _fit_input(ev, ww)
        if isinstance(x, dict):  # no tail to fit, or WeightWatcher's small-N fit
            out[s] = x
        else:
            by_length.setdefault(len(x), []).append((s, x))
    for big_n, members in by_length.items():
        x = np.stack([m[1] for m in members])  # (M, N), each row ascending
        # candidate (m, i): tail of spectrum m from index i, the first copy of a distinct value other
        # than the largest, with n = N - i >= min_tail points and a positive log sum
        if ww:  # WeightWatcher tries every eigenvalue but the largest, repeated values too
            first = np.broadcast_to(np.arange(big_n) <= big_n - 2, x.shape).copy()
        else:
            first = np.concatenate([np.ones((len(x), 1), bool), x[:, 1:] != x[:, :-1]], axis=1)
            first &= (x != x[:, -1:]) & (np.arange(big_n) <= big_n - min_tail)
        logx = np.log(x)
        suffix = np.cumsum(logx[:, ::-1], axis=1)[:, ::-1]  # suffix[m, i] = sum of logx[m, i:]
        row, start = np.nonzero(first)  # row-major: each spectrum's candidates in ascending xmin
        n_tail = big_n - start
        total = suffix[row, start] - n_tail * logx[row, start]  # sum over the tail of ln(x_j / xmin)
        ok = total > 0
        row, start, n_tail, total = row[ok], start[ok], n_tail[ok], total[ok]
        alphas = 1.0 + n_tail / total
        ks = _ks_distances(logx, row, start, n_tail, alphas)
        bounds = np.searchsorted(row, np.arange(len(members) + 1))
        for m, (s, xs) in enumerate(members):
            lo, hi = bounds[m], bounds[m + 1]
            if lo == hi:
                out[s] = nan | dict(reason=f"fewer than {min_tail} eigenvalues in any tail ({big_n} non-zero)")
                continue
            best = lo + int(np.argmin(ks[lo:hi]))  # the first of equal distances, as a scan from the smallest xmin
            out[s] = dict(
                alpha=float(alphas[best]), xmin=float(xs[start[best]]), n_tail=int(n_tail[best]),
                ks_distance=float(ks[best]), reason="",
            )  # fmt: skip
    return out  # type: ignore[return-value]
