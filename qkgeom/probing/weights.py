"""The weight side of a probe: each layer's W_Q, W_K, W_Q W_K^T (and W_V, W_O) per head and whole,
their singular values solved in batches of one shape (_spectra_of), the rows they give (weight PRs,
interaction rank and spectral norm, heavy-tail alphas with their convention: weight_geometry), and
the check that a model's weights are finite (nonfinite_weights). probing.probe measures the
activations beside it."""

from __future__ import annotations

import math

import numpy as np
import torch

from qkgeom import device as D
from qkgeom.config import DEFAULT_CONVENTIONS, Conventions
from qkgeom.probing import alpha as AL
from qkgeom.probing import geometry as G
from qkgeom.probing.rows import Rows

Tensor = torch.Tensor


# alpha rows: the heavy-tail exponent of each head's matrix (and, head = -1, of the layer's whole
# projection), as WeightWatcher reports it; NaN with a note where the fit has too few tail eigenvalues
ALPHA_METRICS = {
    "W_Q": "query_weight_alpha",
    "W_K": "key_weight_alpha",
    "W_QK": "interaction_alpha",
    "W_V": "value_weight_alpha",
    "W_O": "output_weight_alpha",
}


def _alpha_rows(
    layer: int, name: str, head_sv: Tensor, layer_sv: Tensor | None, site: str, later: D.Later
) -> list[list]:
    """alpha rows per head from its singular values (H, E) (eigenvalues of W^T W = s^2), and of the layer's
    whole matrix from layer_sv (its singular values), each as [row, spectrum to fit]: the spectra are
    read with `later` and the caller fits them all in one batch (:func:`_fill_alphas`)."""
    metric = ALPHA_METRICS[name]
    pending = [[{"layer": layer, "head": h, "site": site, "metric": metric, "value": math.nan, "note": ""}, None]
               for h in [*range(head_sv.shape[0]), *([-1] if layer_sv is not None else [])]]  # fmt: skip

    def put(entries: list[list]):
        def fill(evs: np.ndarray) -> None:
            for entry, ev in zip(entries, evs.reshape(len(entries), -1), strict=True):
                entry[1] = ev

        return fill

    later.want(head_sv**2, put(pending[: head_sv.shape[0]]))
    if layer_sv is not None:
        later.want(layer_sv**2, put(pending[-1:]))
    return pending


def _fill_alphas(pending: list[list], convention: str) -> None:
    """Each row's value the alpha of its spectrum under `convention`; its note names the convention,
    and the fit's reason where alpha is NaN."""
    fits = AL.power_law_alphas([ev for _, ev in pending], convention=convention)
    for (row, _), fit in zip(pending, fits, strict=True):
        row["value"], row["note"] = fit["alpha"], AL.alpha_note(convention, fit["reason"])


@D.exact_float32()
def weight_geometry(
    w_q: list[Tensor],
    w_k: list[Tensor],
    site: str = "none",
    w_v: list[Tensor] | None = None,
    w_o: list[Tensor] | None = None,
    conventions: Conventions = DEFAULT_CONVENTIONS,
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Weight-side rows and spectra. w_q[l]: (H_q, D, E), w_k[l]: (H_kv, D, E) per layer; optionally
    w_v[l] (H_kv, D, E) and w_o[l] (H_q, D, E) (W_O^h transposed: the rows of W_O that head h writes).

    Rows per head: query/key weight PR (PR of squared singular values of W_Q^h, W_K^h),
    interaction rank and effective rank of W_Q^h (W_K^h)^T, its spectral norm; and layer means.
    The heavy-tail exponent alpha (ALPHA_METRICS) of W_Q^h, W_K^h, W_Q^h W_K^h^T (and W_V^h, W_O^h if
    given) per head, and of each layer's whole W_Q, W_K (W_V, W_O) at head = -1; NaN with a note
    where a fit is not possible (too few tail eigenvalues, an all-zero or rank-one matrix, NaN/Inf).
    PRs and alphas under `conventions`; each such row's note names its convention.
    """
    pr_convention = conventions.pr
    out = Rows(site, pr_convention)  # every value this function reads from the device, read in one transfer
    alphas: list[list] = []  # [row, spectrum] waiting for their alpha, fitted together at the end

    def add_alphas(li: int, name: str, head_sv: Tensor, layer_sv: Tensor | None) -> None:
        pending = _alpha_rows(li, name, head_sv, layer_sv, site, out.later)
        out.rows.extend(row for row, _ in pending)
        alphas.extend(pending)

    kept: dict[str, list] = {"W_Q_singular_values": [], "W_K_singular_values": [], "W_QK_singular_values": []}
    given = {"W_Q": w_q, "W_K": w_k} | {n: ws for n, ws in (("W_V", w_v), ("W_O", w_o)) if ws is not None}
    per_layer = [dict(zip(given, ws, strict=True)) for ws in zip(*given.values(), strict=True)]
    mats = [m for layer in per_layer for w in layer.values() for m in (w, _whole(w))]
    solved = iter(_spectra_of(mats))  # every layer's per-head and whole matrices, solved together
    svs = [{name: (next(solved), next(solved)) for name in layer} for layer in per_layer]
    keys = [wk.repeat_interleave(wq.shape[0] // wk.shape[0], dim=0) for wq, wk in zip(w_q, w_k, strict=True)]
    interactions = G.solve_by_shape(G.interaction_singular_values, w_q, keys, max_elements=_BATCH_ELEMENTS)
    for li in range(len(w_q)):
        sv_q, sv_k, sv_qk = svs[li]["W_Q"][0], svs[li]["W_K"][0], interactions[li]  # (H, E)
        metrics = {
            "query_weight_participation_ratio": G.participation_ratio_as(sv_q**2, pr_convention),
            "key_weight_participation_ratio": G.participation_ratio_as(sv_k**2, pr_convention),
            "interaction_rank": G.participation_ratio_as(sv_qk**2, pr_convention),
            "interaction_effective_rank": G.effective_rank(sv_qk**2),
            "interaction_spectral_norm": sv_qk[:, 0],
            "interaction_energy_rank90": G.energy_rank(sv_qk),  # beside the data's logit_energy_rank90
        }
        for name, per_head in metrics.items():  # query and key heads may differ in number (GQA)
            out.heads_and_mean(li, name, per_head)
        add_alphas(li, "W_Q", sv_q, svs[li]["W_Q"][1])
        add_alphas(li, "W_K", sv_k, svs[li]["W_K"][1])
        add_alphas(li, "W_QK", sv_qk, None)
        for name in ("W_V", "W_O"):
            if name in svs[li]:  # the same spectral rows as W_Q, W_K: PR and alpha
                sv, whole = svs[li][name]
                pr = G.participation_ratio_as(sv**2, pr_convention)
                metric = ALPHA_METRICS[name].replace("alpha", "participation_ratio")
                out.heads_and_mean(li, metric, pr)
                add_alphas(li, name, sv, whole)
        for key, sv in zip(kept, (sv_q, sv_k, sv_qk), strict=True):
            kept[key].append(sv)
    spectra = out.later.want_all({key: torch.stack(svs_of) for key, svs_of in kept.items()})
    rows = out.finish()
    _fill_alphas(alphas, conventions.alpha)
    return rows, spectra


_BATCH_ELEMENTS = 2**23  # matrices solved together hold at most this many entries (64 MB in float64):
# a large pretrained model's float64 copies stay bounded


def _spectra_of(mats: list[Tensor]) -> list[Tensor]:
    """Singular values (G.gram_singular_values) of each batch of matrices (..., m, n) in `mats`, those of
    one matrix shape solved in one batched eigen-solve (instead of one per batch: 2x cheaper for the
    cpu preset's weight side, and split over the CPU's threads), _BATCH_ELEMENTS at a time."""
    return G.solve_by_shape(G.gram_singular_values, mats, max_elements=_BATCH_ELEMENTS)


def _whole(w: Tensor) -> Tensor:
    """Per-head (H, D, E) -> the layer's whole projection (D, H*E)."""
    return w.permute(1, 0, 2).reshape(w.shape[1], -1)


def nonfinite_weights(model: torch.nn.Module) -> str | None:
    """The first parameter of `model` holding NaN or inf, described ("name: 1 NaN, 0 inf of 1024"), or None."""
    for name, p in model.named_parameters():
        finite = torch.isfinite(p)
        if not finite.all():
            n_nan = int(torch.isnan(p).sum())
            return f"{name}: {n_nan} NaN, {int((~finite).sum()) - n_nan} inf of {p.numel()}"
    return None
