"""The data side of a head's logits: the scores q.k / sqrt(d_head) of a batch's queries and keys (causal
or not), their singular values (the logit spectrum, and the row-centred one whose 90%-energy rank is
counted against W_Q W_K^T's), each query row's logit std (the scale the closed loop matches), and the
per-head sums of them a probe folds (logit_sums). Tensors in, tensors out; the solves go through
probing.geometry's, on the host."""

from __future__ import annotations

import math

import torch

from qkgeom.probing import geometry as G

Tensor = torch.Tensor


def visible_scores(q: Tensor, k: Tensor, causal: bool, window: int | None = None) -> tuple[Tensor, Tensor]:
    """Scores q.k / sqrt(d_head) (..., T, T) in float64 for float64 input, else float32, and the (T, T)
    mask of the keys each query sees: all, or keys j <= i if causal, and of those only the last `window`
    (i - window < j: a sliding-window layer's, e.g. Mistral's or Gemma's local layers)."""
    work = torch.float64 if q.dtype == torch.float64 or k.dtype == torch.float64 else torch.float32
    scores = (q.detach().to(work) @ k.detach().to(work).transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
    t = scores.shape[-1]
    visible = torch.ones(t, t, dtype=torch.bool, device=scores.device)
    if window is not None:
        if window < 1:
            raise ValueError(f"a sliding window must see at least one key, got {window}")
        visible = torch.triu(visible, -(window - 1))
    return scores, torch.tril(visible) if causal else visible


def logit_singular_values(q: Tensor, k: Tensor, causal: bool = True, window: int | None = None) -> Tensor:
    """Singular values (descending, float64) of the score matrix S = Q K^T / sqrt(d_head), future
    entries zeroed if causal (and those past a sliding `window`, visible_scores). q, k: (..., T, d_head) -> (..., T).

    S is formed in the inputs' precision (float32 for a float32 model: the scores the model itself
    computes; float64 inputs stay float64) and its singular values taken as sqrt(eig(S^T S)) with
    the T x T eigenproblem solved in float32 (the dominant cost, 2x cheaper than float64): the
    relative error is ~1e-6 of the largest squared singular value, far below what the reported
    summaries (PR of s^2, s_max) resolve. If the float32 solve fails (it can, on some CPUs, for
    ill-conditioned input), geometry.robust_eigvalsh falls back to float64, then to an SVD.
    """
    return singular_values_of_scores(*visible_scores(q, k, causal, window))


def singular_values_of_scores(scores: Tensor, visible: Tensor) -> Tensor:
    """:func:`logit_singular_values` from the scores (..., T, T) and the (T, T) mask of visible keys, as
    :func:`visible_scores` gives them (so callers that also need :func:`row_std_of_scores` form the
    scores once). `scores` is overwritten (its masked, normalised copy is not needed afterwards)."""
    work = scores.dtype
    scores.masked_fill_(~visible, 0)
    # normalise first (singular values scale linearly) so float32 cannot overflow on huge weights
    top = torch.maximum(scores.amax(dim=(-1, -2), keepdim=True), -scores.amin(dim=(-1, -2), keepdim=True))
    scale = top.clamp_min(torch.finfo(work).tiny)
    unit = scores.div_(scale)
    ev = G.robust_eigvalsh(unit.transpose(-1, -2) @ unit, fast=True, what="logit spectrum")
    return ev.flip(-1).clamp_min(0).sqrt() * scale[..., 0].to(torch.float64)


def centred_logit_singular_values(q: Tensor, k: Tensor, causal: bool = True) -> Tensor:
    """Singular values (descending, float64) of the row-centred score matrix: S = Q K^T / sqrt(d_head),
    each query row minus its mean over the keys it sees, unseen entries zero (the data side of a head's
    logits, the "energy field" whose components are counted against W_Q W_K^T's). (..., T).

    Without the causal mask the centred matrix is low-rank: each row minus its mean over all keys is
    q_i . (k_j - mean k) / sqrt(d_head), i.e. Q K_c^T with K_c the keys centred over positions, so its
    singular values are those of R_Q R_Kc^T (triangular factors, min(T, d_head) square), padded with
    zeros to T: exact, in float64, and d_head^3 instead of T^3 work (the probe's costliest solve). A
    matrix with a non-finite q or k gets NaN, the others their own values (no device sync to decide)."""
    if not causal:
        qd, kc = q.detach().to(torch.float64), k.detach().to(torch.float64)
        finite = torch.isfinite(qd).all(-1).all(-1) & torch.isfinite(kc).all(-1).all(-1)  # (...,) per matrix
        qd = torch.where(finite[..., None, None], qd, 0.0)
        kc = torch.where(finite[..., None, None], kc, 0.0)
        kc = kc - kc.mean(-2, keepdim=True)
        sv = G.interaction_singular_values(qd, kc) / math.sqrt(q.shape[-1])  # (..., min(T, E))
        sv = torch.nn.functional.pad(sv, (0, q.shape[-2] - sv.shape[-1]))  # zeros up to T
        return torch.where(finite[..., None], sv, math.nan)
    scores, visible = visible_scores(q, k, causal)
    work = scores.dtype
    zero = torch.zeros((), dtype=work, device=scores.device)
    masked = torch.where(visible, scores, zero)
    centred = torch.where(visible, masked - masked.sum(-1, keepdim=True) / visible.sum(-1, keepdim=True), zero)
    top = centred.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(torch.finfo(work).tiny)
    unit = centred / top
    ev = G.robust_eigvalsh(unit.transpose(-1, -2) @ unit, fast=True, what="centred logit spectrum")
    return ev.flip(-1).clamp_min(0).sqrt() * top[..., 0].to(torch.float64)


def logit_row_std(q: Tensor, k: Tensor, causal: bool = True, window: int | None = None) -> Tensor:
    """Per query row, the standard deviation of its scores q.k / sqrt(d_head) over the keys it sees
    (all keys, or keys <= its position if causal; within a sliding `window`, visible_scores): the logit
    scale that sets how peaked its softmax can be. q, k: (..., T, d_head) -> (..., T), NaN for rows that
    see fewer than 2 keys."""
    return row_std_of_scores(*visible_scores(q, k, causal, window))


def row_std_of_scores(scores: Tensor, visible: Tensor) -> Tensor:
    """:func:`logit_row_std` from the scores (..., T, T) and the (T, T) mask of visible keys (unchanged)."""
    work = scores.dtype
    n = visible.sum(-1).to(work)  # (T,)
    zero = torch.zeros((), dtype=work, device=scores.device)
    mean = torch.where(visible, scores, zero).sum(-1) / n
    dev = torch.where(visible, scores - mean.unsqueeze(-1), zero)
    std = ((dev**2).sum(-1) / n).sqrt().to(torch.float64)
    return torch.where(n >= 2, std, torch.full_like(std, float("nan")))


def logit_sums(q: Tensor, k: Tensor, causal: bool, convention: str, window: int | None = None) -> dict[str, Tensor]:
    """Per-head sums over the sequences of q, k (..., B, H, T, E) of the logit statistics at logit scale 1:
    PR of the (causal, windowed) score matrix's squared singular values, its top singular value, the
    90%-energy rank of the row-centred scores, and the per-row logit std (sum, sum of squares, finite-row
    count)."""
    scores, visible = visible_scores(q, k, causal, window)  # formed once for the row std and the spectrum
    row_std = row_std_of_scores(scores, visible).transpose(-3, -2).flatten(-2)  # (..., H, B*T)
    finite = torch.isfinite(row_std[..., :1, :]).expand_as(row_std)  # rows with >= 2 keys (head 0 decides)
    row_std = torch.where(finite, row_std, 0.0)
    sv = singular_values_of_scores(scores, visible)  # (..., B, H, T); overwrites scores
    # the bilinear form's energy on the data: Q K^T over all key positions (a causal mask would make
    # any low-rank matrix full-rank), each row centred
    ranks = G.energy_rank(centred_logit_singular_values(q, k, causal=False))
    return {
        "row_std": row_std.sum(-1),
        "row_std_sq": (row_std**2).sum(-1),
        "row_n": finite[..., 0, :].sum(-1),
        "rank": ranks.sum(-2),
        "pr": G.participation_ratio_as(sv**2, convention).sum(-2),
        "top": sv[..., 0].sum(-2),
    }
