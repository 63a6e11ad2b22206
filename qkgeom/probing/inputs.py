"""What measure() and a capture function hand over, checked before anything is computed: per-layer q, k,
the attention pattern and the optional weights, with one MeasureError line naming the layer, the tensor
and what is wrong (a shape, a non-finite value, a pattern that is not attention weights)."""

from __future__ import annotations

import torch

from qkgeom import device as D
from qkgeom.errors import QKGeomError

Tensor = torch.Tensor


class MeasureError(QKGeomError, ValueError):
    """Activations or weights handed to measure() of the wrong shape or with non-finite values."""


def check_activations(
    qs: list[Tensor], ks: list[Tensor], pats: list[Tensor | None], w_qs: list | None = None, w_ks: list | None = None
) -> None:
    """Shapes and finiteness of per-layer q (B, H_q, T, E), k (B, H_kv, T, E), pattern (B, H_q, T, T) and,
    where given, weights W_Q (H_q, D, E) and W_K (H_kv, D, E); raises MeasureError naming the layer, the
    tensor and what is wrong."""
    if not (len(qs) == len(ks) == len(pats)) or not qs:
        raise MeasureError(f"q, k and pattern give {len(qs)}, {len(ks)} and {len(pats)} layers")
    D.check_float64(qs[0].device, "q")
    for i, (q, k, pat) in enumerate(zip(qs, ks, pats, strict=True)):
        if q.dim() != 4 or k.dim() != 4:
            raise MeasureError(f"layer {i}: q and k must be (B, H, T, E), got {tuple(q.shape)} and {tuple(k.shape)}")
        (b, hq, t, e), (bk, hk, tk, ek) = q.shape, k.shape
        if (b, t, e) != (bk, tk, ek) or hq % hk:
            raise MeasureError(
                f"layer {i}: k {tuple(k.shape)} does not match q {tuple(q.shape)} "
                "(same B, T, E; H_q a multiple of H_kv)"
            )
        if pat is not None and tuple(pat.shape) != (b, hq, t, t):
            raise MeasureError(
                f"layer {i}: pattern has shape {tuple(pat.shape)}, expected (B, H_q, T, T) = {(b, hq, t, t)}"
            )
        for name, x in (("q", q), ("k", k), ("pattern", pat)):
            if x is not None and not torch.isfinite(x).all():
                bad = D.host_list((~torch.isfinite(x)).sum())
                raise MeasureError(f"layer {i}: {name} has {bad} non-finite values (NaN or inf)")
        if pat is not None and not _distributions(pat):
            sums = pat.sum(-1, dtype=torch.float64)
            lo, hi = D.host_list(torch.stack([sums.min(), sums.max()]))
            raise MeasureError(f"layer {i}: pattern rows must be attention weights, non-negative and summing to 1 "
                               f"(row sums {lo:.4g} to {hi:.4g})")  # fmt: skip
    if w_qs is not None or w_ks is not None:  # after q and k: their shapes are known good
        check_weights(qs, ks, w_qs, w_ks)


def _distributions(pat: Tensor, atol: float = 1e-2) -> bool:
    """Whether every row of `pat` is a probability distribution (to bf16 softmax's rounding: atol)."""
    return bool((pat >= 0).all()) and bool(((pat.sum(-1, dtype=torch.float64) - 1).abs() <= atol).all())


def check_weights(qs: list[Tensor], ks: list[Tensor], w_qs: list | None, w_ks: list | None) -> None:
    """W_Q (H_q, D, E) and W_K (H_kv, D, E) per layer, both or neither, of the heads and width of q and k."""
    if w_qs is None or w_ks is None or not len(w_qs) == len(w_ks) == len(qs):
        n = [None if w is None else len(w) for w in (w_qs, w_ks)]
        raise MeasureError(f"w_q and w_k must both be given, one per layer of q ({len(qs)}), got {n[0]} and {n[1]}")
    for i, (q, k, wq, wk) in enumerate(zip(qs, ks, w_qs, w_ks, strict=True)):
        want = [(q.shape[1], "D", q.shape[3]), (k.shape[1], "D", k.shape[3])]
        got = [tuple(wq.shape), tuple(wk.shape)]
        if wq.dim() != 3 or wk.dim() != 3 or [(g[0], "D", g[2]) for g in got] != want or got[0][1] != got[1][1]:
            raise MeasureError(f"layer {i}: w_q and w_k must be (H, D, E) of q's and k's heads and width, one D: "
                               f"expected {want[0]} and {want[1]}, got {got[0]} and {got[1]}")  # fmt: skip
        for name, w in (("w_q", wq), ("w_k", wk)):
            if not torch.isfinite(w).all():
                raise MeasureError(f"layer {i}: {name} has non-finite values (NaN or inf)")
