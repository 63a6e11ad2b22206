"""From a model's queries and keys to tidy geometry rows.

Every model, ours or a Hugging Face one, is reduced to :class:`QKSnapshot` (q, k and
optionally the attention pattern of each layer for one batch). :class:`GeometryAccumulator`
streams snapshots (memory independent of the token count) and emits rows
``(layer, head, site, metric, value)``; ``head = -1`` marks a whole-layer value. Weight-side
spectra come from :func:`weight_geometry`. Adding a metric = one line here + one glossary entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from qkgeom import device as D
from qkgeom.config import DEFAULT_PROBE, ProbeSettings
from qkgeom.probing import geometry as G
from qkgeom.probing import logits as LG
from qkgeom.probing.inputs import MeasureError, check_activations  # noqa: F401 (measure's errors)
from qkgeom.probing.rows import Rows
from qkgeom.probing.weights import ALPHA_METRICS, nonfinite_weights, weight_geometry  # noqa: F401 (part of the probe API)

Tensor = torch.Tensor
ENTROPY_BINS = 1000  # histogram resolution of normalised entropy, for a streaming median
# logit scores (B x H x T x T) held for one solve at most: on a GPU each solve is a sync (256 MB held); a CPU
# is faster with a few layers' in its caches (GPT-2-small width: 12 layers at once 1.1 s, 1 or 2 at a time 0.8 s)
_HELD_SCORES = {"cpu": 2**22, "cuda": 2**26}


@dataclass
class QKSnapshot:
    """Queries, keys (and pattern) of every layer for one batch.

    q[l]: (B, H_q, T, E); k[l]: (B, H_kv, T, E) with H_q a multiple of H_kv (grouped-query
    attention: query head h reads key head h // (H_q // H_kv)); pattern[l]: (B, H_q, T, T) or None.
    token_mask: (B, T) True for real tokens (padding excluded from every statistic). window: a causal
    sliding-window layer's keys per query (query t sees keys t - window < j <= t), or None.
    """

    q: list[Tensor]
    k: list[Tensor]
    pattern: list[Tensor | None]
    causal: bool = True
    site: str = "none"
    token_mask: Tensor | None = None
    window: int | None = None


def _support(valid: Tensor, causal: bool, window: int | None) -> Tensor:
    """(B, T) real keys each query sees: all, the earlier ones if causal, of those the last `window`."""
    if not causal:
        return valid.long().sum(1, keepdim=True).expand_as(valid)
    seen = torch.cumsum(valid.long(), 1)
    if window is None:
        return seen
    return seen - torch.nn.functional.pad(seen, (window, 0))[:, : seen.shape[1]]  # those in (t - window, t]


def _rows_of(x: Tensor, mask: Tensor | None) -> Tensor:
    """(B, H, T, E) -> (H, N, E) rows of real tokens."""
    x = x.permute(1, 0, 2, 3)  # (H, B, T, E)
    if mask is None:
        return x.reshape(x.shape[0], -1, x.shape[-1])
    return x[:, mask]  # boolean (B, T) mask over dims 1, 2


@dataclass
class _Layer:
    q_all: G.CovarianceAccumulator  # (H_q*E)-dim rows
    k_all: G.CovarianceAccumulator  # (H_kv*E)-dim rows
    n_q_heads: int = 0
    n_k_heads: int = 0
    ent_sum: Tensor | None = None  # (H,) sums over rows with k >= 2
    ent_norm_sum: Tensor | None = None
    ent_n: int | Tensor = 0  # a device tensor while streaming, an int once rows() has read it
    ent_hist: Tensor | None = None  # (H, bins) of normalised entropy
    logit_pr_sum: Tensor | None = None  # (H,)
    logit_top_sum: Tensor | None = None
    logit_n: int = 0
    row_std_sum: Tensor | None = None  # (H,) sums over query rows of the per-row logit std
    row_std_sq_sum: Tensor | None = None
    row_n: int | Tensor = 0
    energy_rank_sum: Tensor | None = None  # (H,) sums over sequences of the row-centred logits' 90%-energy rank
    logit_gain: float = 1.0  # the model's scores are q k^T / sqrt(E) times this


def _spectrum_rows(out: Rows, li: int, st: _Layer) -> None:
    """Layer `li`'s covariance-spectrum summaries of queries and keys (the layer's whole and per head),
    and the PR contrast PR_Q - PR_K (read with every other row, at out.finish())."""
    conv = out.conv
    head_eigs = {}
    for side, acc, n_heads in (("query", st.q_all, st.n_q_heads), ("key", st.k_all, st.n_k_heads)):
        head_eigs[side] = acc.block_eigenvalues(n_heads)
        layer_sum, head_sum = _summary(acc.eigenvalues(), acc.n, conv), _summary(head_eigs[side], acc.n, conv)
        for name, v in layer_sum.items():
            out.add(li, -1, f"{side}_{name}", v)
        for name, vals in head_sum.items():
            out.heads(li, f"{side}_{name}", vals)
    pr_q = G.participation_ratio_as(head_eigs["query"], conv)
    pr_k = G.participation_ratio_as(head_eigs["key"], conv)
    whole = G.participation_ratio_as(st.q_all.eigenvalues(), conv) - G.participation_ratio_as(
        st.k_all.eigenvalues(), conv
    )
    out.add(li, -1, "participation_ratio_contrast", whole)
    out.heads(li, "participation_ratio_contrast", pr_q - pr_k.repeat_interleave(len(pr_q) // len(pr_k)))


class _Held(NamedTuple):
    """One layer's logit sequences, held by update_layer until rows() solves them with the others."""

    layer: int
    q: Tensor  # (B, H_q, T, E)
    k: Tensor  # (B, H_kv, T, E)
    causal: bool
    scale: float
    window: int | None  # a sliding-window layer's keys per query (None: all it may see)


class GeometryAccumulator:
    """Streams QKSnapshots; ``rows()`` and ``spectra()`` summarise everything seen."""

    def __init__(
        self,
        logit_spectrum: bool = True,
        site: str = "none",
        settings: ProbeSettings = DEFAULT_PROBE,
    ) -> None:
        self.settings = settings  # every PR row is computed under its conventions and says so in its note
        self.layers: list[_Layer] = []
        self.logit_spectrum = logit_spectrum
        self.site = site
        # update_layer's logit sequences, solved together at rows() (or past _HELD_SCORES): one round
        # trip to the host for many layers, not four for each
        self._held: list[_Held] = []

    @D.exact_float32()
    def update(self, snap: QKSnapshot) -> None:
        """Add one batch of every layer (the logit spectra of all layers solved together)."""
        self._solve_held()  # update_layer's first, in the order they came
        mask = snap.token_mask
        for i, (q, k, pat) in enumerate(zip(snap.q, snap.k, snap.pattern, strict=True)):
            B, _, T, _ = q.shape
            valid = mask if mask is not None else torch.ones(B, T, dtype=torch.bool)
            support = _support(valid, snap.causal, snap.window)
            self._update_stats(i, q, k, pat, support, mask)
        n = len(snap.q)
        self._update_logits(list(range(n)), snap.q, snap.k, snap.causal, mask, [1.0] * n, snap.window)
        self.site = snap.site

    @D.exact_float32()
    def update_layer(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        pattern: Tensor | None = None,
        support: Tensor | None = None,
        causal: bool = True,
        token_mask: Tensor | None = None,
        logit_scale: float = 1.0,
        window: int | None = None,
    ) -> None:
        """Add one batch of one layer. q (B, H_q, T, E), k (B, H_kv, T, E), pattern (B, H_q, T, S),
        support (B, T): keys visible to each query; token_mask (B, T): real tokens; logit_scale: the
        model's scores are q k^T / sqrt(E) times this (1 for the standard scaling); window: a sliding-window
        layer's keys per query (its logit statistics see those alone, as its softmax does). The logit
        sequences wait, and are solved with every other layer's at rows(): no round trip to the host here."""
        self._update_stats(layer, q, k, pattern, support, token_mask, logit_scale)
        self._hold_logits(layer, q, k, causal, token_mask, logit_scale, window)

    def _hold_logits(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        causal: bool,
        mask: Tensor | None,
        scale: float,
        window: int | None = None,  # last, defaulted: bench/probe_split.py calls this as older trees had it
    ) -> None:
        """Keep copies of the layer's logit sequences (the first, up to settings.logit_seqs in all) for
        _solve_held; solve what is held once it would form more than _HELD_SCORES scores."""
        if not self.logit_spectrum or mask is not None:
            return
        cap, st = self.settings.logit_seqs, self.layers[layer]
        held = sum(h.q.shape[0] for h in self._held if h.layer == layer)
        room = q.shape[0] if cap is None else cap - st.logit_n - held
        if room > 0:  # copies of the first sequences only: the batch itself is not kept alive
            self._held.append(_Held(layer, q.detach()[:room].clone(), k.detach()[:room].clone(), causal, scale, window))
            budget = _HELD_SCORES.get(q.device.type, _HELD_SCORES["cuda"])
            if sum(h.q.shape[0] * h.q.shape[1] * h.q.shape[2] ** 2 for h in self._held) > budget:
                self._solve_held()

    def _solve_held(self) -> None:
        """The held logit sequences solved as update() solves a batch, all layers in one call; a layer met
        again (a second batch) starts the next call, so each layer's sequences fold in the order they came."""
        held, self._held = self._held, []
        while held:
            wave: list[_Held] = []
            later: list[_Held] = []
            for h in held:
                same = not wave or (h.causal, h.window) == (wave[0].causal, wave[0].window)
                (wave if same and all(w.layer != h.layer for w in wave) else later).append(h)
            held = later
            layers, qs, ks = [h.layer for h in wave], [h.q for h in wave], [h.k for h in wave]
            self._update_logits(layers, qs, ks, wave[0].causal, None, [h.scale for h in wave], wave[0].window)

    def _update_stats(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        pattern: Tensor | None,
        support: Tensor | None,
        token_mask: Tensor | None,
        logit_scale: float = 1.0,
    ) -> None:
        """Everything of update_layer but the logit spectrum: covariances, entropy."""
        gram = self.settings.torch_gram_dtype
        while len(self.layers) <= layer:
            self.layers.append(_Layer(G.CovarianceAccumulator(gram), G.CovarianceAccumulator(gram)))
        st = self.layers[layer]
        qr, kr = _rows_of(q, token_mask), _rows_of(k, token_mask)  # (H, N, E)
        st.n_q_heads, st.n_k_heads = qr.shape[0], kr.shape[0]
        st.logit_gain = logit_scale
        st.q_all.update(qr.permute(1, 0, 2).reshape(qr.shape[1], -1))  # (H, N, E) -> (N, H*E)
        st.k_all.update(kr.permute(1, 0, 2).reshape(kr.shape[1], -1))
        if pattern is not None:
            self._update_entropy(st, pattern, support, token_mask)

    def _update_logits(
        self,
        layers: list[int],
        qs: list[Tensor],
        ks: list[Tensor],
        causal: bool,
        mask: Tensor | None,
        scales: list,
        window: int | None = None,
    ) -> None:
        """The logit spectrum of the first sequences (up to settings.logit_seqs in all) of each of `layers`;
        layers of one shape with the same room left are stacked and solved in one batch (same values:
        every statistic is per matrix)."""
        if not self.logit_spectrum or mask is not None:
            return
        groups: dict[tuple, list[int]] = {}
        for j, layer in enumerate(layers):
            st = self.layers[layer]
            cap = self.settings.logit_seqs
            room = qs[j].shape[0] if cap is None else cap - st.logit_n
            if room > 0:
                groups.setdefault((min(room, qs[j].shape[0]), qs[j].shape, ks[j].shape), []).append(j)
        for (room, _, _), members in groups.items():
            q = torch.stack([qs[j][:room] for j in members])  # (L, B, H_q, T, E)
            k = torch.stack([ks[j][:room] for j in members])
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # each query head with the key head it reads
            sums = LG.logit_sums(q, k, causal, self.settings.conventions.pr, window)
            for i, j in enumerate(members):
                self._add_logits(self.layers[layers[j]], {key: v[i] for key, v in sums.items()}, scales[j], room)

    @staticmethod
    def _add_logits(st: _Layer, sums: dict, scale: float, n_seqs: int) -> None:
        """Fold one layer's logit sums (at logit scale 1) into its state, at the model's logit scale."""
        # the row std and top singular value scale linearly with the logits; PR and energy rank not at all
        row_std, row_sq = sums["row_std"] * scale, sums["row_std_sq"] * scale**2
        top = sums["top"] * scale
        if st.row_std_sum is None:
            st.row_std_sum, st.row_std_sq_sum = row_std, row_sq
            st.energy_rank_sum, st.logit_pr_sum, st.logit_top_sum = sums["rank"], sums["pr"], top
        else:
            st.row_std_sum, st.row_std_sq_sum = st.row_std_sum + row_std, st.row_std_sq_sum + row_sq
            st.energy_rank_sum = st.energy_rank_sum + sums["rank"]
            st.logit_pr_sum, st.logit_top_sum = st.logit_pr_sum + sums["pr"], st.logit_top_sum + top
        st.row_n = st.row_n + sums["row_n"]  # on the device until rows() reads it
        st.logit_n += n_seqs

    @staticmethod
    def _update_entropy(st: _Layer, pat: Tensor, support: Tensor, mask: Tensor | None) -> None:
        B, H, T, _ = pat.shape
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool)
        support = support.to(pat.device)
        h, hn = G.attention_entropy(pat, support[:, None, :].expand(B, H, T))  # (B, H, T)
        # a non-finite pattern row (non-finite weights) has no entropy: it is left out, not binned
        valid = (mask.to(pat.device) & (support >= 2))[:, None, :].expand(B, H, T) & torch.isfinite(hn)
        hv = torch.where(valid, h, 0.0).sum((0, 2))
        hnv = torch.where(valid, hn, 0.0).sum((0, 2))
        # tokens of head 0 (the per-head sums share it unless rows were non-finite); on the device until
        # rows() reads it, as every sum here: streaming a batch makes no device sync
        n = valid[:, 0].sum()
        bins = (hn.clamp(0, 1) * (ENTROPY_BINS - 1)).round().long()
        # one count over (head, bin) cells: the valid rows of head h land in cells h * bins ...
        cells = (bins + ENTROPY_BINS * torch.arange(H, device=bins.device)[None, :, None])[valid]
        hist = torch.bincount(cells, minlength=H * ENTROPY_BINS).reshape(H, ENTROPY_BINS).to(torch.float64)
        if st.ent_sum is None:
            st.ent_sum, st.ent_norm_sum, st.ent_hist = hv, hnv, hist
        else:
            st.ent_sum, st.ent_norm_sum, st.ent_hist = st.ent_sum + hv, st.ent_norm_sum + hnv, st.ent_hist + hist
        st.ent_n = st.ent_n + n

    def rows(self) -> list[dict]:
        """Tidy rows (layer, head, site, metric, value) for everything streamed so far."""
        out = Rows(self.site, self.settings.conventions.pr)
        self._solve_held()
        self._read_counts()
        G.solve_together([acc for st in self.layers for acc in (st.q_all, st.k_all)])
        G.solve_blocks_together([(st.q_all, st.n_q_heads) for st in self.layers]
                                + [(st.k_all, st.n_k_heads) for st in self.layers])  # fmt: skip
        for li, st in enumerate(self.layers):
            _spectrum_rows(out, li, st)
            if st.ent_sum is not None and st.ent_n:
                ent, ent_n = st.ent_sum / st.ent_n, st.ent_norm_sum / st.ent_n
                out.heads(li, "attention_entropy", ent)
                out.heads(li, "attention_entropy_normalised", ent_n)
                out.heads(li, "attention_entropy_normalised_median", _hist_median(st.ent_hist))
                out.add(li, -1, "attention_entropy", ent.mean())
                out.add(li, -1, "attention_entropy_normalised", ent_n.mean())
                out.add(
                    li, -1, "attention_entropy_normalised_median", _hist_median(st.ent_hist.sum(0, keepdim=True))[0]
                )
            if st.logit_n:
                pr, top = st.logit_pr_sum / st.logit_n, st.logit_top_sum / st.logit_n
                out.heads(li, "logit_participation_ratio", pr)
                out.heads(li, "logit_spectral_norm", top)
                out.add(li, -1, "logit_participation_ratio", pr.mean())
                out.add(li, -1, "logit_spectral_norm", top.mean())
                # components carrying 90% of the energy, per sequence
                out.heads_and_mean(li, "logit_energy_rank90", st.energy_rank_sum / st.logit_n)
            # input-weighted logit scale (all probe tokens): from the head blocks of the layer's covariances
            cq, ck = st.q_all.block_covariances(st.n_q_heads), st.k_all.block_covariances(st.n_k_heads)
            mq = st.q_all.mean.reshape(st.n_q_heads, -1)
            scale = G.input_logit_scale(cq, ck.repeat_interleave(st.n_q_heads // st.n_k_heads, dim=0), mq)
            out.heads_and_mean(li, "input_logit_scale", scale * st.logit_gain**2)
            if st.row_n:
                mean = st.row_std_sum / st.row_n
                sd = (st.row_std_sq_sum / st.row_n - mean**2).clamp_min(0).sqrt()
                out.heads_and_mean(li, "logit_row_std", mean)
                out.heads_and_mean(li, "logit_row_std_cv", sd / mean)
        return out.finish()

    def _read_counts(self) -> None:
        """Each layer's token counts, device tensors while streaming, as Python ints: one transfer."""
        later = D.Later()
        for st in self.layers:
            for name in ("ent_n", "row_n"):
                if isinstance(getattr(st, name), torch.Tensor):
                    later.want(getattr(st, name), lambda a, st=st, name=name: setattr(st, name, int(a)))
        later.fetch()

    def spectra(self) -> dict[str, np.ndarray]:
        """Covariance eigenvalues per layer (L, H*E) and per head (L, H, E)."""
        per_layer = {
            "query_eigenvalues": [s.q_all.eigenvalues() for s in self.layers],
            "key_eigenvalues": [s.k_all.eigenvalues() for s in self.layers],
            "query_head_eigenvalues": [s.q_all.block_eigenvalues(s.n_q_heads) for s in self.layers],
            "key_head_eigenvalues": [s.k_all.block_eigenvalues(s.n_k_heads) for s in self.layers],
        }
        later = D.Later()
        spectra = later.want_all({name: torch.stack(layers) for name, layers in per_layer.items()})
        later.fetch()
        return spectra


def _summary(eigs: Tensor, n: int, convention: str = "variance") -> dict[str, Tensor]:
    """The dispersion measures of covariance spectra from n samples, plus the bias-corrected PR (a
    correction of the variance convention, so always under it)."""
    out = G.spectrum_summary(eigs, convention)
    if n >= 3:
        out["participation_ratio_bias_corrected"] = G.participation_ratio_bias_corrected(eigs, n)
    return out


def _hist_median(hist: Tensor) -> Tensor:
    """Median of normalised entropy from (H, bins) counts (resolution 1 / (bins - 1)), (H,)."""
    cdf = hist.cumsum(-1) / hist.sum(-1, keepdim=True)
    idx = (cdf < 0.5).sum(-1)
    return idx.double() / (ENTROPY_BINS - 1)


def measure(
    q: list[Tensor] | Tensor,
    k: list[Tensor] | Tensor,
    pattern: list[Tensor | None] | Tensor | None = None,
    causal: bool = True,
    w_q: list[Tensor] | None = None,
    w_k: list[Tensor] | None = None,
    pr_convention: str = "variance",
    alpha_convention: str = "weightwatcher",
    window: int | None = None,
):
    """Bring your own activations: q, k (and optionally the attention pattern) from any source ->
    the same tidy rows (layer, head, site, metric, value) as a DataFrame.

    q: per layer (B, H_q, T, E), or one such tensor for a single layer; k: per layer (B, H_kv, T, E)
    (grouped-query: query head h reads key head h // (H_q / H_kv)); pattern: per layer (B, H_q, T, T)
    rows summing to 1, or None (no entropy rows). causal: T x T causal support (entropy
    normalisation, logit spectrum). w_q, w_k: optional per-layer (H, D, E) weights for the weight-side
    metrics. pr_convention: `variance` (PR of covariance eigenvalues, the default) or `singular` (PR of
    singular values, as public Pythia weight datasets compute it); every PR row's `note` names it.
    alpha_convention: `weightwatcher` (WeightWatcher 0.7.7's fit, the default) or `clauset`.
    window: a sliding-window model's keys per query (query t sees keys t - window < j <= t, causal):
    the entropy's normalisation and the logit statistics then see those keys alone. For many batches,
    stream them through GeometryAccumulator.update instead (memory then does not grow with tokens).
    """
    import pandas as pd

    settings = ProbeSettings.of(0, pr_convention, alpha_convention)  # one batch handed in: all its sequences
    return pd.DataFrame(activation_geometry(q, k, pattern, causal, w_q, w_k, settings, window)[0])


@D.exact_float32()
def activation_geometry(
    q: list[Tensor] | Tensor,
    k: list[Tensor] | Tensor,
    pattern: list[Tensor | None] | Tensor | None = None,
    causal: bool = True,
    w_q: list[Tensor] | None = None,
    w_k: list[Tensor] | None = None,
    settings: ProbeSettings = DEFAULT_PROBE,
    window: int | None = None,
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """measure()'s rows as dicts, with the spectra: checked, detached activations through one
    GeometryAccumulator, plus the weight-side rows when w_q and w_k are given."""

    def one(t) -> Tensor | None:  # a tensor, or anything torch.as_tensor reads (a numpy array)
        return None if t is None else torch.as_tensor(t).detach()

    def layers(x) -> list:
        return [one(x)] if isinstance(x, Tensor | np.ndarray) else [one(t) for t in x]

    qs, ks = layers(q), layers(k)
    pats = layers(pattern) if pattern is not None else [None] * len(qs)
    w_q, w_k = (None if w is None else layers(w) for w in (w_q, w_k))
    check_activations(qs, ks, pats, w_q, w_k)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not causal):
        raise MeasureError(f"window must be a positive number of keys, on a causal layer; got {window!r}")
    acc = GeometryAccumulator(settings=settings)
    acc.update(QKSnapshot(q=qs, k=ks, pattern=pats, causal=causal, window=window))
    rows, spectra = acc.rows(), acc.spectra()
    if w_q is not None and w_k is not None:
        w_rows, w_spectra = weight_geometry(w_q, w_k, conventions=settings.conventions)
        rows, spectra = rows + w_rows, spectra | w_spectra
    return rows, spectra


def stream_gpt(model: torch.nn.Module, idx: Tensor, on_layer: Callable[[int, Tensor, Tensor, Tensor], None]) -> None:
    """Run our GPT's explicit attention path on idx (B, T), handing each layer's q, k (B, H, T, E) and
    pattern (B, H, T, T) to on_layer(i, q, k, pattern) as the forward reaches it; nothing of a layer is
    kept after its call (a whole-model snapshot at GPT-2-small width holds 1.2 GB of patterns)."""
    from qkgeom.probing.hooks import capture, observe

    n = len(model.blocks)
    sites = [f"blocks.{i}.attn.hook_{s}" for i in range(n) for s in ("q", "k")]

    def at_pattern(i: int) -> Callable[[Tensor], None]:
        return lambda pat: on_layer(i, store.pop(sites[2 * i]), store.pop(sites[2 * i + 1]), pat)

    patterns = {f"blocks.{i}.attn.hook_pattern": at_pattern(i) for i in range(n)}
    with torch.no_grad(), capture(model, sites) as store, observe(model, patterns):
        model(idx, explicit=True)


def gpt_weights(model: torch.nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer (H, D, E) views of W_Q and W_K of our GPT."""
    return [b.attn.heads(b.attn.W_Q) for b in model.blocks], [b.attn.heads(b.attn.W_K) for b in model.blocks]


def gpt_value_output(model: torch.nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer (H, D, E) W_V^h and W_O^h transposed (the E rows of W_O that head h writes) of our GPT."""
    return [b.attn.heads(b.attn.W_V) for b in model.blocks], [b.attn.heads(b.attn.W_O.T) for b in model.blocks]


@D.exact_float32()
def probe_gpt(
    model: torch.nn.Module,
    idx: Tensor,
    settings: ProbeSettings = DEFAULT_PROBE,
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """All activation- and weight-side rows and spectra of our GPT on the probe batch, measured as
    `settings` say (the logit spectrum's sequences, the Gram precision, the PR and alpha conventions)."""
    acc = GeometryAccumulator(settings=settings)

    def layer(i: int, q: Tensor, k: Tensor, pat: Tensor) -> None:  # each layer streamed, as update() would
        acc.update_layer(i, q, k, pat, G.causal_support(q.shape[2]).expand(q.shape[0], -1))

    stream_gpt(model, idx, layer)
    w_v, w_o = gpt_value_output(model)
    w_rows, w_spectra = weight_geometry(*gpt_weights(model), w_v=w_v, w_o=w_o, conventions=settings.conventions)
    return acc.rows() + w_rows, {**acc.spectra(), **w_spectra}
