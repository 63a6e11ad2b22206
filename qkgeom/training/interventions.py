"""Key-spectrum control: pure functions on singular-value profiles, and the per-step applier.

After every optimiser step, each controlled head's spectrum is replaced, norm preserved, on one of
two objects (``on``):

- ``key``: the singular values s of W_K^h (D, E). W_K^h = U diag(s) V^T -> U diag(s') V^T. The model
  can partly undo this through W_Q (only W_Q W_K^T enters attention).
- ``interaction``: the singular values of W_Q^h (W_K^h)^T (rank <= E), which is what attention sees.
  With W_Q W_K^T = P diag(s) Q^T, the change is split evenly between the two factors: W_Q ->
  (P D^1/2 P^T) W_Q and W_K -> (Q D^1/2 Q^T) W_K with D = diag(s'/s), so W_Q' W_K'^T = P diag(s') Q^T
  exactly (singular vectors kept) and each factor only changes inside its own E-dim column space.

What s' is (``kind``), for a head whose current weight-side PR is PR(s^2):

- hold:     s' = s0 * ||s|| / ||s0||, the initial profile's shape at the current norm.
- contract: target PR = ratio * reference (ratio < 1); a *ceiling*: projected only when above it.
- expand:   target PR = ratio * reference (ratio > 1); a *floor*: projected only when below it.
  (``mode = "two-sided"`` tracks the target exactly instead.)

``reference = "baseline"`` takes the reference from the same seed's unconstrained (``none``) run at
the same step, interpolated between its probes; ``reference = "initial"`` uses the head's initial PR
on a linear schedule reaching ``ratio`` at ``reach_fraction`` of training (unconstrained training
itself contracts W_K to ~0.4-0.6x at small scale, so an absolute target can undershoot the baseline).

Two kinds act on what attention sees through the data (causal v3), both relative to the same seed's
``none`` run at the same step (``reference = "baseline"``, two-sided):

- shape:       the activation PR of each head's keys, PR(Cov k) with Cov k = W_K^T C W_K, is set to
               ratio x the none run's, queries untouched (key_shape_map; targets below ``floor`` are
               raised to it and flagged, so no head is clipped to rank 1).
- temperature: the head's input-weighted logit scale (logit_scale: the expected per-row variance of
               its logits, tr(M C M^T S), M = W_Q W_K^T / sqrt(E)) is set to ratio^2 x the none run's
               (logits times ratio) by rescaling W_Q and W_K: no spectrum changes shape.

C is a running centred covariance of each layer's attention input (RunningCovariance, fed by a hook
on the training forward). ``match_scale`` rescales W_Q^h, W_K^h after any shape-changing projection so
the head's logit scale is what it was before it (a shape change at matched scale: open loop, its own
scale, which training then drifts). ``match_row_std`` closes the loop (causal v4): after the projection
W_Q^h, W_K^h are rescaled by one factor so that the head's per-row logit std (geometry.logit_row_std,
the statistic the probe reports and the scale check reads) equals the same seed's none run's at that
step, interpolated between its probes: a per-head gain, no gradient, on fixed sequences (cached
inputs; on each training batch instead, the batch-to-batch change of the row std left the probed scale
off by up to +-25% per probe on the tiny preset, LOG 2026-12-04). Which sequences is
``intervention.control_seqs``: 0 keeps v4's first registration (the probe's first ROW_STD_SEQS
validation sequences, the very rows the scale check read: a check that could not fail); N > 0 takes N
fixed *training* sequences (data.fixed_offsets over the training split), so the scale check, read on
the validation probe batch, is judged on text the loop never saw. Every run with a control set records its row std there
(CONTROL_ROW_STD_METRIC, control_rows): the none run's is the arms' target.

A profile with a given PR is found in closed form: in energy space p = s^2 / sum s^2, the profile
moves along the segment toward the top direction (lower PR) or the flat profile (higher PR); along
both, sum(p^2) is a convex quadratic in the mixing weight, monotone on [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from qkgeom import device as D
from qkgeom.config import InterventionConfig
from qkgeom.probing.geometry import (
    input_logit_scale,
    interaction_singular_values,
    logit_row_std,
    participation_ratio,
    singular_values,
    triangular_factor,
)

Tensor = torch.Tensor
# the probe metric each control acts on (a per-head row in geometry.parquet)
CONTROLLED_METRIC = {"key": "key_weight_participation_ratio", "interaction": "interaction_rank"}
ROW_STD_METRIC = "logit_row_std"  # what match_row_std tracks (the none run's per-head probe rows)
ROW_STD_SEQS = 4  # control_seqs = 0: the probe sequences the closed loop fits on (v4 as first registered)
CONTROL_ROW_STD_METRIC = "logit_row_std_control"  # control_seqs > 0: the per-head row std on the control set
# ... for the kinds that act through the data, by kind
KIND_METRIC = {"shape": "key_participation_ratio", "temperature": "input_logit_scale"}
FLOOR_METRIC = "key_participation_ratio_floor_raised"


def controlled_metric(cfg: InterventionConfig) -> str:
    """The per-head probe metric an intervention steers (and reads from its baseline run)."""
    return KIND_METRIC.get(cfg.kind, CONTROLLED_METRIC[cfg.on])


def row_std_metric(cfg: InterventionConfig) -> str:
    """The per-head probe metric the closed loop tracks in the none run: the row std on the control set
    (control_seqs > 0), else the probe's own logit_row_std (v4's first registration)."""
    return CONTROL_ROW_STD_METRIC if cfg.control_seqs else ROW_STD_METRIC


@torch.no_grad()
def control_rows(model: torch.nn.Module, idx: Tensor, w_q: list[Tensor], w_k: list[Tensor]) -> list[dict]:
    """Per head and layer mean: the per-row logit std on the control sequences idx (B, T)
    (metric CONTROL_ROW_STD_METRIC), as batch_row_std measures it for the closed loop."""
    xs = attention_inputs(model, idx)
    rows = []
    for li, x in xs.items():
        std = D.host_list(batch_row_std(w_q[li], w_k[li], x.unsqueeze(0).expand(len(w_q[li]), -1, -1, -1)))
        rows += [{"layer": li, "head": h, "site": "none", "metric": CONTROL_ROW_STD_METRIC, "value": v}
                 for h, v in enumerate(std)]  # fmt: skip
        rows.append(
            {"layer": li, "head": -1, "site": "none", "metric": CONTROL_ROW_STD_METRIC, "value": sum(std) / len(std)}
        )
    return rows


def needs_covariance(cfg: InterventionConfig) -> bool:
    """Whether the control needs the running covariance of each layer's attention input."""
    return cfg.kind in KIND_METRIC or cfg.match_scale


class RunningCovariance:
    """Exponentially averaged mean and centred covariance (float64) of each layer's attention input,
    fed one training batch at a time: C <- decay C + (1 - decay) C_batch (the first batch sets it),
    C_batch about the batch mean; the mean likewise. `hook(layer)` is a forward hook for the layer's
    `hook_attn_in` site."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.cov: dict[int, Tensor] = {}
        self.mean: dict[int, Tensor] = {}

    @torch.no_grad()
    def update(self, layer: int, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        mu32 = x.mean(0)
        xc = x - mu32  # the Gram in float32 (relative error ~1e-6), accumulated in float64
        c = (xc.T @ xc).to(torch.float64) / len(xc)
        mu = mu32.to(torch.float64)
        if layer not in self.cov:
            self.cov[layer], self.mean[layer] = c, mu
        else:
            d = self.decay
            self.cov[layer] = d * self.cov[layer] + (1 - d) * c
            self.mean[layer] = d * self.mean[layer] + (1 - d) * mu

    def hook(self, layer: int):
        def fn(module, inputs, output):  # noqa: ARG001 (forward hook signature)
            if torch.is_grad_enabled():  # training forwards only, not probes or evaluation
                self.update(layer, output)

        return fn

    def state_dict(self) -> dict:
        return {"cov": {str(k): v for k, v in self.cov.items()}, "mean": {str(k): v for k, v in self.mean.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.cov = {int(k): v for k, v in state["cov"].items()}
        self.mean = {int(k): v for k, v in state["mean"].items()}


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


def profile_with_pr(sv: Tensor, target_pr: float) -> Tensor:
    """Singular values (descending, 1-D) with PR(s'^2) = target_pr and the same norm as sv."""
    return profiles_with_pr(sv[None], torch.tensor([float(target_pr)], dtype=torch.float64))[0]


def hold_profile(sv: Tensor, sv0: Tensor) -> Tensor:
    """The initial profile sv0 rescaled to the norm of sv; (..., E)."""
    sv, sv0 = sv.to(torch.float64), sv0.to(torch.float64)
    return sv0 * (sv.norm(dim=-1, keepdim=True) / sv0.norm(dim=-1, keepdim=True))


def scheduled_target(pr0: Tensor | float, step: int, total_steps: int, ratio: float, reach: float) -> Tensor | float:
    """reference = initial: linear from PR0 at step 0 to ratio * PR0 at step reach * total_steps, then flat."""
    progress = min(1.0, step / max(1e-12, reach * total_steps))
    return pr0 * (1 - (1 - ratio) * progress)


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


def set_interaction_spectrum(w_q: Tensor, w_k: Tensor, s_new: Tensor | None = None) -> tuple[Tensor, ...]:
    """The spectrum s of W_Q W_K^T for heads (h, D, E) and, if s_new is given, the new (W_Q, W_K)
    whose product has singular values s_new and the same singular vectors (split evenly, see the
    module docstring). Returns (s,) or (s, W_Q', W_K')."""
    if s_new is None:
        return (interaction_singular_values(w_q, w_k),)
    svd = interaction_svd(w_q, w_k)
    return (svd[0], *_set_interaction(w_q, w_k, svd, s_new))


def _set_interaction(w_q: Tensor, w_k: Tensor, svd: tuple[Tensor, ...], s_new: Tensor) -> tuple[Tensor, Tensor]:
    s, a, b, u_q, r_q, u_k, r_k = svd
    d = torch.where(s > 1e-12 * s[..., :1], (s_new / s.clamp_min(1e-300)).sqrt(), torch.ones_like(s)) - 1
    new_q = _update_factor(w_q, u_q, (a * d.unsqueeze(-2)) @ a.transpose(-1, -2), r_q)
    new_k = _update_factor(w_k, u_k, (b * d.unsqueeze(-2)) @ b.transpose(-1, -2), r_k)
    return new_q, new_k


def notes(cfg: InterventionConfig, qk_init: str) -> list[str]:
    """Plain-language notes on what the control does to this run, stored in config.json."""
    if cfg.kind != "none" and cfg.on == "key" and qk_init in ("tied", "anti_tied"):
        sign = "" if qk_init == "tied" else "-"
        return [
            f"intervention '{cfg.kind}' acts on W_K only: the {qk_init} init's W_K = {sign}W_Q "
            "holds at step 0 and is broken from the first controlled step on"
        ]
    return []


@dataclass
class SpectrumControl:
    """Applies an InterventionConfig to per-layer (H, D, E) views of W_Q and W_K, in place.

    baseline: for reference = "baseline", (steps (n,), values (L, H, n)) of the controlled metric in
    the same seed's unconstrained run; targets are interpolated linearly between its probes.
    cov: the running input covariances, for shape, temperature and match_scale.
    All controlled heads of all layers are decomposed and projected as one batch (one eigh / SVD
    call per step), so the control's cost does not grow with Python loops over heads.
    """

    cfg: InterventionConfig
    targets: dict[int, list[int]]  # layer -> controlled heads
    sv0: dict[int, Tensor]  # layer -> (H, E) initial singular values of the controlled object
    total_steps: int
    baseline: tuple[np.ndarray, np.ndarray] | None = None
    cov: RunningCovariance | None = None
    row_std_baseline: tuple[np.ndarray, np.ndarray] | None = None  # match_row_std: the none run's logit_row_std
    # match_row_std: step -> each layer's attention input (B, T, D) on the fixed probe sequences
    row_std_inputs: Callable[[int], dict[int, Tensor]] | None = None
    _sv0_all: Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls,
        cfg: InterventionConfig,
        w_q: list[Tensor],
        w_k: list[Tensor],
        total_steps: int,
        baseline: tuple[np.ndarray, np.ndarray] | None = None,
        row_std_baseline: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SpectrumControl:
        if cfg.kind == "none":
            return cls(cfg, {}, {}, total_steps)
        layers = list(cfg.layers) or list(range(len(w_k)))
        for li in layers:
            if not 0 <= li < len(w_k):
                raise ValueError(f"intervention layer {li} does not exist (model has {len(w_k)} layers)")
        heads = list(cfg.heads) or list(range(w_k[0].shape[0]))
        for h in heads:
            if not 0 <= h < w_k[0].shape[0]:
                raise ValueError(f"intervention head {h} does not exist (layers have {w_k[0].shape[0]} heads)")
        if cfg.kind != "hold" and cfg.reference == "baseline":
            if baseline is None:
                raise ValueError("intervention.reference = 'baseline' needs the baseline run's probe values")
            if baseline[1].shape[:2] != (len(w_k), w_k[0].shape[0]):
                raise ValueError(
                    f"baseline run has {baseline[1].shape[:2]} (layers, heads), this model "
                    f"{(len(w_k), w_k[0].shape[0])}"
                )
        if cfg.match_row_std and row_std_baseline is None:
            raise ValueError("intervention.match_row_std needs the baseline run's logit_row_std probe values")
        cov = RunningCovariance(cfg.cov_decay) if needs_covariance(cfg) else None
        ctl = cls(cfg, {li: heads for li in layers}, {}, total_steps, baseline, cov, row_std_baseline)
        ctl.sv0 = {li: ctl.spectrum(w_q, w_k, li) for li in layers}
        return ctl

    @property
    def _pairs(self) -> list[tuple[int, int]]:
        """(layer, head) of every controlled head, in the batch order of `apply`."""
        return [(li, h) for li, heads in self.targets.items() for h in heads]

    def _initial(self) -> Tensor:
        """Initial singular values (N, E) of the controlled heads, in the order of `_pairs` (cached)."""
        if self._sv0_all is None:
            self._sv0_all = torch.stack([self.sv0[li][h] for li, h in self._pairs]).to(torch.float64)
        return self._sv0_all

    def _gather(self, w: list[Tensor]) -> Tensor:
        """The controlled heads of every layer as one float64 batch (N, D, E)."""
        n_heads = w[0].shape[0]
        parts = [w[li] if len(heads) == n_heads else w[li][heads] for li, heads in self.targets.items()]
        return torch.cat(parts).to(torch.float64)

    def _covariances(self) -> tuple[Tensor, Tensor]:
        """The running input covariance (N, D, D) and mean (N, D) of each controlled head's layer."""
        if self.cov is None or any(li not in self.cov.cov for li in self.targets):
            raise RuntimeError("the control needs the running input covariance: no training batch has been seen")
        items = self.targets.items()
        return (
            torch.cat([self.cov.cov[li].expand(len(heads), -1, -1) for li, heads in items]),
            torch.cat([self.cov.mean[li].expand(len(heads), -1) for li, heads in items]),
        )

    def _scatter(self, w: list[Tensor], new: Tensor, act: Tensor) -> None:
        """Write the rows of `new` (N, D, E) whose `act` is set back into their heads, in place."""
        new, i = new.to(w[0].dtype), 0
        for li, heads in self.targets.items():
            rows = act[i : i + len(heads)]
            if bool(rows.all()) and len(heads) == w[li].shape[0]:
                w[li].copy_(new[i : i + len(heads)])
            else:
                for j in D.host_list(torch.nonzero(rows).flatten()):
                    w[li][heads[j]].copy_(new[i + j])
            i += len(heads)

    def spectrum(self, w_q: list[Tensor], w_k: list[Tensor], layer: int) -> Tensor:
        """Singular values (H, E) of the controlled weight object (`on`) of every head of `layer`."""
        if self.cfg.on == "key":
            return singular_values(w_k[layer])
        return interaction_singular_values(w_q[layer], w_k[layer])

    def target_prs(self, step: int) -> Tensor:
        """What each controlled head (N,) is steered to, in the order of `_pairs`: a PR (hold: its initial
        PR), clipped to the feasible [1, E]; for temperature a logit scale."""
        pairs, sv0 = self._pairs, self._initial()
        if self.cfg.kind == "hold":
            target = participation_ratio(sv0**2)
        elif self.cfg.reference == "initial":
            pr0 = participation_ratio(sv0**2)
            target = scheduled_target(pr0, step, self.total_steps, self.cfg.ratio, self.cfg.reach_fraction)
        else:
            steps, values = self.baseline
            ref = torch.tensor([np.interp(step, steps, values[li, h]) for li, h in pairs], dtype=torch.float64)
            if self.cfg.kind == "temperature":
                return self.cfg.ratio**2 * ref  # logits x ratio: their mean square x ratio^2
            target = self.cfg.ratio * ref
        return target.clamp(1.0, float(sv0.shape[-1]))  # a PR lies in [1, E]

    def row_std_targets(self, step: int) -> Tensor:
        """match_row_std: each controlled head's target per-row logit std (N,), the none run's at `step`."""
        steps, values = self.row_std_baseline
        return torch.tensor([np.interp(step, steps, values[li, h]) for li, h in self._pairs], dtype=torch.float64)

    def _batches(self, step: int) -> Tensor:
        """The attention inputs (N, B, T, D) each controlled head reads on the fixed probe sequences."""
        if self.row_std_inputs is None:
            raise RuntimeError("match_row_std needs row_std_inputs (the training loop sets it)")
        xs = self.row_std_inputs(step)
        return torch.cat([xs[li].expand(len(h), -1, -1, -1) for li, h in self.targets.items()])

    def target_pr(self, layer: int, head: int, step: int) -> float:
        """The target of one controlled head (see target_prs)."""
        return D.host_float(self.target_prs(step)[self._pairs.index((layer, head))])

    @torch.no_grad()
    def apply(self, w_q: list[Tensor], w_k: list[Tensor], step: int) -> None:
        """Overwrite the controlled heads after optimiser step `step` (float64 maths, one batch)."""
        if not self.targets:
            return
        kind = self.cfg.kind
        sel_q, sel_k = self._gather(w_q), self._gather(w_k)  # (N, D, E)
        cov, mean = self._covariances() if self.cov is not None else (None, None)
        scale0 = logit_scale(sel_q, sel_k, cov, mean) if self.cfg.match_scale else None
        act = torch.ones(len(sel_k), dtype=torch.bool)
        new_q = sel_q
        if kind == "shape":
            new_k, _, _ = key_shape_map(sel_k, cov, self.target_prs(step), self.cfg.floor)
        elif kind == "temperature":
            new_q, new_k = match_logit_scale(sel_q, sel_k, cov, self.target_prs(step), mean)
        else:
            if self.cfg.on == "key":
                s, v = key_spectrum(sel_k)
            else:
                svd = interaction_svd(sel_q, sel_k)
                s = svd[0]
            if kind == "hold":
                s_new = hold_profile(s, self._initial())
            else:
                target = self.target_prs(step)
                current = participation_ratio(s**2)
                if self.cfg.mode == "one-sided":  # a ceiling (contract) acts only above the target, a floor below
                    act = current > target if kind == "contract" else current < target
                if not bool(act.any()) and not self.cfg.match_row_std:
                    return  # no head crossed its ceiling / floor: weights stay bit-identical
                s_new = torch.where(act.unsqueeze(-1), profiles_with_pr(s, target), s)
            if self.cfg.on == "key":
                new_k = set_key_spectrum(sel_k, s, v, s_new)
            else:
                new_q, new_k = _set_interaction(sel_q, sel_k, svd, s_new)
        if scale0 is not None:
            new_q, new_k = match_logit_scale(new_q, new_k, cov, scale0, mean)
        if self.cfg.match_row_std:  # closed loop: every controlled head, projected or not
            new_q, new_k = match_row_std(new_q, new_k, self._batches(step), self.row_std_targets(step))
            act = torch.ones_like(act)
        if new_q is not sel_q:
            self._scatter(w_q, new_q, act)
        self._scatter(w_k, new_k, act)

    def rows(self, step: int) -> list[dict]:
        """Target rows (`<controlled metric>_target`) of the controlled heads, next to the achieved value;
        for shape also whether the floor raised the head's target (1 / 0)."""
        if not self.targets:
            return []
        metric = controlled_metric(self.cfg)
        out = [
            {"layer": li, "head": h, "site": "none", "metric": metric + "_target", "value": t}
            for (li, h), t in zip(self._pairs, D.host_list(self.target_prs(step)), strict=True)
        ]
        if self.cfg.match_row_std:
            out += [
                {"layer": li, "head": h, "site": "none", "metric": ROW_STD_METRIC + "_target", "value": t}
                for (li, h), t in zip(self._pairs, D.host_list(self.row_std_targets(step)), strict=True)
            ]
        if self.cfg.kind == "shape":
            raised = [float(r["value"] < self.cfg.floor) for r in out if r["metric"] == metric + "_target"]
            out += [
                {"layer": li, "head": h, "site": "none", "metric": FLOOR_METRIC, "value": r}
                for (li, h), r in zip(self._pairs, raised, strict=True)
            ]
        return out

    def state_dict(self) -> dict:
        """What a resumed run needs to steer exactly as an uninterrupted one: the initial spectra, the
        running covariance and the closed loop's cached inputs."""
        state = {"sv0": {str(k): v for k, v in self.sv0.items()}}
        if self.cov is not None:
            state["cov"] = self.cov.state_dict()
        if isinstance(self.row_std_inputs, CachedInputs):
            state["row_std_inputs"] = self.row_std_inputs.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict's state (set row_std_inputs before, as the training loop does)."""
        self.sv0 = {int(k): v for k, v in state["sv0"].items()}
        if self.cov is not None and "cov" in state:
            self.cov.load_state_dict(state["cov"])
        if isinstance(self.row_std_inputs, CachedInputs) and "row_std_inputs" in state:
            self.row_std_inputs.load_state_dict(state["row_std_inputs"])
        self._sv0_all = None


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
    w_q, w_k (N, D, E); x (N, B, T, D) the inputs each head reads. Scores in float32 (relative error
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
    lam, v = torch.linalg.eigh(cov_k)
    lam, v = lam.flip(-1).clamp_min(0), v.flip(-1)  # descending
    e = lam.shape[-1]
    want = torch.as_tensor(target_pr, dtype=torch.float64)
    floored = want < floor
    used = want.clamp(floor, float(e))
    lam_new = profiles_with_pr(lam.sqrt(), used) ** 2
    a = torch.where(lam > 1e-12 * lam[..., :1], (lam_new / lam.clamp_min(1e-300)).sqrt(), torch.ones_like(lam))
    new = w @ (v * a.unsqueeze(-2)) @ v.transpose(-1, -2)
    return new.to(w_k.dtype), used, floored


# --- the zero-training complement (causal v3): each arm's map on a copy of a run's weights, no training --


INSTANT_METRIC = "attention_entropy_instant_change"


def instant_controls(
    labels: tuple[str, ...],
    w_q: list[Tensor],
    w_k: list[Tensor],
    steps: int,
    layers: tuple[int, ...] = (),
    floor: float = 1.5,
    control_seqs: int = 0,
) -> list:
    """(label, SpectrumControl) per arm label, built on the run's *initial* weights (hold's profile), each
    relative to the run itself (its baselines are set at every use), on `layers` (empty: all) with the
    shape `floor` and the closed loop's `control_seqs`: the study's none run carries its arms' in
    [intervention]."""
    import dataclasses

    from qkgeom.config import arm_config

    out = []
    for label in labels:
        cfg = dataclasses.replace(arm_config(label), layers=tuple(layers), floor=floor, control_seqs=control_seqs)
        flat = (np.array([0]), np.ones((len(w_k), w_k[0].shape[0], 1)))
        base = flat if cfg.kind != "hold" else None
        out.append((label, SpectrumControl.create(cfg, w_q, w_k, steps, base, flat if cfg.match_row_std else None)))
    return out


@torch.no_grad()
def entropy_and_inputs(model: torch.nn.Module, idx: Tensor) -> tuple[Tensor, dict, dict, dict]:
    """One explicit forward of our GPT on idx: mean attention entropy (nats) per layer and head (L, H)
    over the query rows that see >= 2 keys, and each layer's attention-input covariance, mean and first
    ROW_STD_SEQS sequences (B, T, D)."""
    from qkgeom.probing.geometry import attention_entropy
    from qkgeom.probing.hooks import capture

    n = len(model.blocks)
    names = [f"blocks.{i}.{s}" for i in range(n) for s in ("hook_attn_in", "attn.hook_pattern")]
    with capture(model, names) as store:
        model(idx, explicit=True)
    ent, covs, means = [], {}, {}
    firsts = {i: store[f"blocks.{i}.hook_attn_in"][:ROW_STD_SEQS].float() for i in range(n)}  # match_row_std
    for i in range(n):
        h, _ = attention_entropy(store[f"blocks.{i}.attn.hook_pattern"].to(torch.float64))  # (B, H, T)
        ent.append(h[..., 1:].mean((0, 2)))
        x = store[f"blocks.{i}.hook_attn_in"].reshape(-1, store[f"blocks.{i}.hook_attn_in"].shape[-1]).double()
        means[i] = x.mean(0)
        covs[i] = torch.cov(x.T, correction=0)
    return torch.stack(ent), covs, means, firsts


class CachedInputs:
    """The closed loop's inputs: each layer's attention input on fixed sequences, recomputed at every
    step in `exact` (the probe steps, where the scale is checked) and otherwise every `every` steps: an
    input moves only through the layers below it, slowly, and a forward of the probe sequences every
    step cost as much as the row std itself (39 ms of a ~210 ms cpu-preset step)."""

    def __init__(self, model: torch.nn.Module, idx: Tensor, exact: set[int], every: int = 10) -> None:
        self.model, self.idx, self.exact, self.every = model, idx, exact, every
        self.inputs: dict[int, Tensor] | None = None
        self.at = -1

    def __call__(self, step: int) -> dict[int, Tensor]:
        if self.inputs is None or step in self.exact or step - self.at >= self.every:
            self.inputs, self.at = attention_inputs(self.model, self.idx), step
        return self.inputs

    def state_dict(self) -> dict:
        """The cached inputs and their step: a resumed run refreshes them when the uninterrupted one would."""
        return {"at": self.at, "inputs": None if self.inputs is None else {str(k): v for k, v in self.inputs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.at = int(state["at"])
        self.inputs = None if state["inputs"] is None else {int(k): v for k, v in state["inputs"].items()}


@torch.no_grad()
def attention_inputs(model: torch.nn.Module, idx: Tensor) -> dict[int, Tensor]:
    """Each layer's attention input (B, T, D), float32, on idx (B, T): one no-grad forward of our GPT."""
    from qkgeom.probing.hooks import capture

    names = [f"blocks.{i}.hook_attn_in" for i in range(len(model.blocks))]
    with capture(model, names) as store:
        model(idx)
    return {i: store[name].float() for i, name in enumerate(names)}


@torch.no_grad()
def mapped_copy(
    model: torch.nn.Module,
    ctl: SpectrumControl,
    step: int,
    current: dict[str, Tensor],
    cov: tuple[dict, dict],
    inputs: dict[int, Tensor],
) -> torch.nn.Module:
    """A copy of our GPT `model` with `ctl`'s map applied once, relative to the model itself:
    `current[metric]` (L, H) are its own values of the controlled metric and (closed loop) of the row
    std the loop holds; `cov` its layers' input covariances and means; `inputs` the closed loop's
    control-set attention inputs (layer -> (B, T, D)). The model itself is not changed."""
    import copy

    from qkgeom.probing.probe import gpt_weights

    if ctl.cfg.kind != "hold":
        ctl.baseline = (np.array([step]), D.to_host(current[controlled_metric(ctl.cfg)])[..., None])
    if ctl.cfg.match_row_std:  # closed loop: the model's own per-row logit std (its scale kept)
        ctl.row_std_baseline = (np.array([step]), D.to_host(current[row_std_metric(ctl.cfg)])[..., None])
    if ctl.cov is not None:
        ctl.cov.cov, ctl.cov.mean = cov
    ctl.row_std_inputs = lambda _step: inputs
    twin = copy.deepcopy(model)
    ctl.apply(*gpt_weights(twin), step)
    return twin


@torch.no_grad()
def self_reference(model: torch.nn.Module, idx: Tensor) -> tuple[dict[str, Tensor], tuple[dict, dict], dict]:
    """What mapped_copy needs to map our GPT `model` relative to itself on sequences idx (B, T): its
    per-head activation PR_K and per-row logit std there (L, H), its layers' input covariances and
    means, and its attention inputs (the closed loop's control set)."""
    from qkgeom.probing.probe import gpt_weights

    _, covs, means, _ = entropy_and_inputs(model, idx)
    inputs = attention_inputs(model, idx)
    w_q, w_k = gpt_weights(model)
    pr, std, scale = [], [], []
    for li, k in enumerate(w_k):
        cov_k = k.transpose(-1, -2).double() @ covs[li] @ k.double()  # (H, E, E)
        pr.append(participation_ratio(torch.linalg.eigvalsh(cov_k).clamp_min(0)))
        std.append(batch_row_std(w_q[li], k, inputs[li].unsqueeze(0).expand(len(k), -1, -1, -1)))
        scale.append(logit_scale(w_q[li], k, covs[li], means[li]))
    row_std = torch.stack(std)
    current = {
        KIND_METRIC["shape"]: torch.stack(pr),
        KIND_METRIC["temperature"]: torch.stack(scale),
        ROW_STD_METRIC: row_std,
        CONTROL_ROW_STD_METRIC: row_std,
    }
    return current, (covs, means), inputs


def instant_rows(
    model: torch.nn.Module,
    idx: Tensor,
    controls: list,
    step: int,
    current: dict[str, Tensor],
    control_idx: Tensor | None = None,
) -> list:
    """The zero-training complement at one probe: for each (label, control), its map applied to a copy
    of `model` (targets relative to this run: `current[metric]` (L, H), its own probe values), and the
    change of mean attention entropy per head and layer mean (metric INSTANT_METRIC, site = label). The
    input covariances are the probe batch's, as the training control's are its batch's; the closed
    loop holds the run's own row std on the control set `control_idx` (None: the probe's first
    ROW_STD_SEQS sequences)."""
    before, covs, means, firsts = entropy_and_inputs(model, idx)
    if control_idx is not None:
        firsts = attention_inputs(model, control_idx)
    rows = []
    for label, ctl in controls:
        twin = mapped_copy(model, ctl, step, current, (covs, means), firsts)
        delta = D.host_list(entropy_and_inputs(twin, idx)[0] - before)
        for li, heads in enumerate(delta):
            rows += [
                {"layer": li, "head": h, "site": label, "metric": INSTANT_METRIC, "value": v}
                for h, v in enumerate(heads)
            ]
            rows.append(
                {"layer": li, "head": -1, "site": label, "metric": INSTANT_METRIC, "value": sum(heads) / len(heads)}
            )
    return rows
