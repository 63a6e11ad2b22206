"""Pure maps on one layer's attention weights: tensors in, tensors out, no state.

- Singular-value profiles with a given participation ratio, in closed form: in energy space
  p = s^2 / sum s^2 the profile moves along the segment toward the top direction (lower PR) or the
  flat profile (higher PR); along both, sum(p^2) is a convex quadratic in the mixing weight, monotone
  on [0, 1]. `hold_profile` keeps an initial profile's shape at the current norm.
- The key spectrum (W_K^h = U diag(s) V^T) and the interaction spectrum (W_Q^h W_K^h^T = P diag(s) Q^T,
  the change split evenly between the two factors) set in place of the old ones, singular vectors kept.
- The scale and shape maps of causal v3/v4: the input-weighted logit scale and its matching, the
  per-row logit std (batch_row_std) and its closed-loop matching, the temperature map, and the map
  that steers the keys' activation PR with queries untouched (key_shape_map).

training.interventions applies them after each optimiser step (SpectrumControl); training.complement
applies them once to a copy of a run's weights.
"""

from __future__ import annotations

import torch

from qkgeom import solves as S
from qkgeom.probing.geometry import input_logit_scale, triangular_factor
from qkgeom.probing.logits import logit_row_std

Tensor = torch.Tensor


def profiles_with_pr(sv: Tensor, target_pr: Tensor) -> Tensor:
    """Batched: singular values (N, E), descending, -> (N, E) with PR(s'^2) = target_pr (N,) per row
    and the same norm. Targets are clipped to the feasible [1, E]."""
    sv = sv.to(torch.float64)
    norm2 = (sv**2).sum(-1, keepdim=True)
    p = sv**2 / norm2
    d = p.shape[-1]
    want = 1.0 / torch.as_tensor(target_pr, dtype=torch.float64).clamp(1.0, float(d))  # sum(p'^2) = 1 / PR
    a = (p**2).sum(-1)
    lower = want >= a
    # lower PR: mix toward the top direction e_1 (sum e_1^2 = 1, <p, e_1> = p_1); raise PR: toward
    # the flat profile u (sum u^2 = 1/d, <p, u> = 1/d). f(beta) = |(1-beta) p + beta end|^2 is a
    # convex quadratic, monotone on [0, 1] in both cases, so one root lies in [0, 1].
    end = torch.where(lower.unsqueeze(-1), torch.zeros_like(p), torch.full_like(p, 1.0 / d))
    end[..., 0] = torch.where(lower, torch.ones_like(a), torch.full_like(a, 1.0 / d))
    b = torch.where(lower, p[..., 0], torch.full_like(a, 1.0 / d))
    c = torch.where(lower, torch.ones_like(a), torch.full_like(a, 1.0 / d))
    qa, qb, qc = a - 2 * b + c, 2 * (b - a), a - want
    disc = (qb * qb - 4 * qa * qc).clamp_min(0.0).sqrt()
    safe = qa.abs() > 1e-15
    qa_s = torch.where(safe, qa, torch.ones_like(qa))
    r1, r2 = (-qb - disc) / (2 * qa_s), (-qb + disc) / (2 * qa_s)  # r1 <= r2 (qa >= 0)
    beta = torch.where((r1 >= -1e-12) & (r1 <= 1 + 1e-12), r1, r2)
    linear = torch.where(qb != 0, -qc / torch.where(qb != 0, qb, torch.ones_like(qb)), torch.zeros_like(qb))
    beta = torch.where(safe, beta, linear).clamp(0.0, 1.0).unsqueeze(-1)
    return torch.sqrt(((1 - beta) * p + beta * end) * norm2)


def hold_profile(sv: Tensor, sv0: Tensor) -> Tensor:
    """The initial profile sv0 rescaled to the norm of sv; (..., E)."""
    sv, sv0 = sv.to(torch.float64), sv0.to(torch.float64)
    return sv0 * (sv.norm(dim=-1, keepdim=True) / sv0.norm(dim=-1, keepdim=True))


def scheduled_target(pr0: Tensor | float, step: int, total_steps: int, ratio: float, reach: float) -> Tensor | float:
    """reference = initial: linear from PR0 at step 0 to ratio * PR0 at step reach * total_steps, then flat."""
    progress = min(1.0, step / max(1e-12, reach * total_steps))
    return pr0 * (1 - (1 - ratio) * progress)


@S.host
def key_spectrum(w_k: Tensor) -> tuple[Tensor, Tensor]:
    """Singular values (descending) and right singular vectors of W_K heads (h, D, E), from the
    E x E Gram matrix (float64): s (h, E), V (h, E, E); an SVD of W_K where that eigh fails."""
    try:
        ev, v = torch.linalg.eigh(w_k.transpose(-1, -2) @ w_k)  # ascending
    except torch.linalg.LinAlgError:
        _, s, vh = torch.linalg.svd(w_k, full_matrices=False)
        return s, vh.transpose(-1, -2)
    return ev.flip(-1).clamp_min(0).sqrt(), v.flip(-1)


def set_key_spectrum(w_k: Tensor, s: Tensor, v: Tensor, s_new: Tensor) -> Tensor:
    """W_K U diag(s) V^T -> U diag(s_new) V^T, computed as W_K V diag(s_new / s) V^T; (h, D, E)."""
    ratio = torch.where(s > 1e-12 * s[..., :1], s_new / s.clamp_min(1e-300), torch.zeros_like(s))
    return w_k @ (v * ratio.unsqueeze(-2)) @ v.transpose(-1, -2)


def _update_factor(w: Tensor, u: Tensor | None, m: Tensor, r: Tensor) -> Tensor:
    """W + U M R for W = U R, without forming U when it is None: U = W R^-1."""
    if u is None:
        return w + w @ torch.linalg.solve_triangular(r, m @ r, upper=True)
    return w + u @ m @ r


@S.host
def interaction_svd(w_q: Tensor, w_k: Tensor) -> tuple[Tensor, ...]:
    """W_Q W_K^T = (U_q A) diag(s) (U_k B)^T for heads (h, D, E), from the E x E product R_q R_k^T;
    returns (s, A, B, U_q, R_q, U_k, R_k) (U None where not formed, see geometry.triangular_factor)."""
    u_q, r_q = triangular_factor(w_q)
    u_k, r_k = triangular_factor(w_k)
    m = r_q @ r_k.transpose(-1, -2)
    # eigh of M^T M is ~2x faster than an SVD; its singular values carry a relative error of about
    # eps (s_max / s_i)^2, so it is used only while every s_i >= 1e-4 s_max (error <= 1e-8), and
    # the SVD is the route wherever eigh fails
    try:
        ev, b = torch.linalg.eigh(m.transpose(-1, -2) @ m)
        s, b = ev.flip(-1).clamp_min(0).sqrt(), b.flip(-1)
        if bool((s[..., -1] >= 1e-4 * s[..., 0]).all()):
            return s, (m @ b) / s.unsqueeze(-2), b, u_q, r_q, u_k, r_k
    except torch.linalg.LinAlgError:
        pass
    a, s, bh = torch.linalg.svd(m)
    return s, a, bh.transpose(-1, -2), u_q, r_q, u_k, r_k


def set_interaction(w_q: Tensor, w_k: Tensor, svd: tuple[Tensor, ...], s_new: Tensor) -> tuple[Tensor, Tensor]:
    """(W_Q', W_K') whose interaction W_Q' W_K'^T has singular values s_new and the singular vectors of
    W_Q W_K^T (svd: interaction_svd of w_q, w_k): each side takes the square root of the ratio
    s_new / s in the interaction's own basis; directions with s ~ 0 are left as they are."""
    s, a, b, u_q, r_q, u_k, r_k = svd
    d = torch.where(s > 1e-12 * s[..., :1], (s_new / s.clamp_min(1e-300)).sqrt(), torch.ones_like(s)) - 1
    new_q = _update_factor(w_q, u_q, (a * d.unsqueeze(-2)) @ a.transpose(-1, -2), r_q)
    new_k = _update_factor(w_k, u_k, (b * d.unsqueeze(-2)) @ b.transpose(-1, -2), r_k)
    return new_q, new_k


# --- causal v3 (issue 30): key-spectrum *shape* at matched logit scale, and a temperature arm -------
# Pure maps on one layer's heads; the training-loop wiring (running input covariances, the arms of
# study causal-shape-cpu) builds on them. C is a head input's centred covariance (D, D): the LayerNorm'd
# residual stream x at the attention block, as the probe batch or a running estimate gives it.


def logit_scale(w_q: Tensor, w_k: Tensor, cov_x: Tensor, mean_x: Tensor | None = None) -> Tensor:
    """Input-weighted logit scale per head: the expected variance of a query's logits q.k / sqrt(E) over
    keys, for queries and keys drawn from inputs x of mean mu and centred covariance C,
    tr(M C M^T S) with M = W_Q W_K^T / sqrt(E) and S = C + mu mu^T. Within one row the key mean shifts
    every logit alike and cancels; the query mean does not (q^T Cov(k) q keeps it), and where the
    residual stream has a strong mean direction it carries most of the per-row logit spread. With
    mean_x None (or zero) this is tr(M C M^T C), the spec's formula for centred inputs.
    w_q, w_k (H, D, E); cov_x (D, D) or (H, D, D); mean_x (D,) or (H, D); returns (H,) in float64."""
    w_q, w_k, c = w_q.to(torch.float64), w_k.to(torch.float64), cov_x.to(torch.float64)
    # tr(M C M^T S) = tr((Cov q + mu_q mu_q^T) Cov k) / E with Cov q = W_Q^T C W_Q, mu_q = W_Q^T mu,
    # Cov k = W_K^T C W_K: the probe's input_logit_scale of the heads' own covariances (E x E products)
    mean_q = None if mean_x is None else (mean_x.to(torch.float64).unsqueeze(-2) @ w_q).squeeze(-2)
    return input_logit_scale(w_q.transpose(-1, -2) @ c @ w_q, w_k.transpose(-1, -2) @ c @ w_k, mean_q)


def match_logit_scale(
    w_q: Tensor, w_k: Tensor, cov_x: Tensor, target: Tensor, mean_x: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """W_Q, W_K each rescaled by sqrt(gamma) per head (M by gamma) so that logit_scale = target (H,):
    gamma = sqrt(target / current). Every singular-value profile keeps its shape."""
    gamma = (target.to(torch.float64) / logit_scale(w_q, w_k, cov_x, mean_x)).sqrt()
    f = gamma.sqrt()[:, None, None]
    return (w_q.to(torch.float64) * f).to(w_q.dtype), (w_k.to(torch.float64) * f).to(w_k.dtype)


def batch_row_std(w_q: Tensor, w_k: Tensor, x: Tensor) -> Tensor:
    """Per head (N,): the mean over causal rows that see >= 2 keys, over sequences, of the per-row std of
    q.k / sqrt(E) with q = x W_Q^h, k = x W_K^h (geometry.logit_row_std, as the probe averages it).
    w_q, w_k (N, D, E); x (N, B, T, D) the inputs each head reads, or (B, T, D) read by every head
    (broadcast, bit-identical to expanding it). Scores in float32 (relative error
    ~1e-6, against a 5% scale margin: 2.4x faster than float64 here), the mean in float64."""
    x = x.to(torch.float32)
    q, k = x @ w_q.to(torch.float32).unsqueeze(1), x @ w_k.to(torch.float32).unsqueeze(1)  # (N, B, T, E)
    return logit_row_std(q, k, causal=True).nanmean(dim=(1, 2))


def match_row_std(w_q: Tensor, w_k: Tensor, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """W_Q^h, W_K^h each rescaled by sqrt(gamma) (the logits by gamma) so that batch_row_std = target (N,):
    gamma = target / current, exact because every score scales by gamma. No spectrum changes shape."""
    gamma = target.to(torch.float64) / batch_row_std(w_q, w_k, x)
    f = gamma.sqrt()[:, None, None]
    return (w_q.to(torch.float64) * f).to(w_q.dtype), (w_k.to(torch.float64) * f).to(w_k.dtype)


def temperature(w_q: Tensor, w_k: Tensor, factor: Tensor | float) -> tuple[Tensor, Tensor]:
    """The temperature arm: logits times `factor` per head (W_Q, W_K each by sqrt(factor)), no change of
    shape in any spectrum (W_K, W_Q W_K^T, the key covariance)."""
    f = torch.as_tensor(factor, dtype=torch.float64).reshape(-1, 1, 1).sqrt()
    return (w_q.to(torch.float64) * f).to(w_q.dtype), (w_k.to(torch.float64) * f).to(w_k.dtype)


def key_shape_map(w_k: Tensor, cov_x: Tensor, target_pr: Tensor, floor: float = 1.5) -> tuple[Tensor, Tensor, Tensor]:
    """Steer the *activation* PR of the keys, PR(Cov k) with k = x W_K^h, to `target_pr` (H,) per head,
    queries untouched: with Cov k = V diag(lam) V^T, W_K -> W_K V diag(a) V^T, a = sqrt(lam' / lam), where
    lam' is the profile of the same total key variance with PR = target (profiles_with_pr on sqrt(lam)).
    Targets below `floor` are raised to it (a PR of 1 would be the rank-1 clamp of causal-cpu): returns
    (new W_K, the target used (H,), whether the floor raised it (H,)). Targets above E clip to E."""
    w = w_k.to(torch.float64)
    cov_k = w.transpose(-1, -2) @ cov_x.to(torch.float64) @ w  # (H, E, E)
    lam, v = S.eigh(cov_k)
    lam, v = lam.flip(-1).clamp_min(0), v.flip(-1)  # descending
    e = lam.shape[-1]
    want = torch.as_tensor(target_pr, dtype=torch.float64)
    floored = want < floor
    used = want.clamp(floor, float(e))
    lam_new = profiles_with_pr(lam.sqrt(), used) ** 2
    a = torch.where(lam > 1e-12 * lam[..., :1], (lam_new / lam.clamp_min(1e-300)).sqrt(), torch.ones_like(lam))
    new = w @ (v * a.unsqueeze(-2)) @ v.transpose(-1, -2)
    return new.to(w_k.dtype), used, floored
