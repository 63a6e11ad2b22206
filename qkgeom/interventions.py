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

A profile with a given PR is found in closed form: in energy space p = s^2 / sum s^2, the profile
moves along the segment toward the top direction (lower PR) or the flat profile (higher PR); along
both, sum(p^2) is a convex quadratic in the mixing weight, monotone on [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from qkgeom.config import InterventionConfig
from qkgeom.geometry import participation_ratio

Tensor = torch.Tensor
# the probe metric each control acts on (a per-head row in geometry.parquet)
CONTROLLED_METRIC = {"key": "key_weight_participation_ratio", "interaction": "interaction_rank"}


def _mix_weight(a: float, b: float, c: float, target: float) -> float:
    """Smallest beta in [0, 1] with (1-beta)^2 a + 2 beta (1-beta) b + beta^2 c = target."""
    qa, qb, qc = a - 2 * b + c, 2 * (b - a), a - target
    if abs(qa) < 1e-15:
        return min(1.0, max(0.0, -qc / qb)) if qb else 0.0
    disc = max(qb * qb - 4 * qa * qc, 0.0)
    roots = [(-qb - math.sqrt(disc)) / (2 * qa), (-qb + math.sqrt(disc)) / (2 * qa)]
    ok = [r for r in roots if -1e-12 <= r <= 1 + 1e-12]
    return min(1.0, max(0.0, min(ok))) if ok else 1.0


def profile_with_pr(sv: Tensor, target_pr: float) -> Tensor:
    """Singular values (descending, 1-D) with PR(s'^2) = target_pr and the same norm as sv."""
    sv = sv.to(torch.float64)
    norm2 = (sv**2).sum()
    p = sv**2 / norm2
    d = p.numel()
    target_pr = min(max(target_pr, 1.0), float(d))
    a = float((p**2).sum())
    want = 1.0 / target_pr  # sum(p'^2) = 1 / PR
    if want >= a:  # lower PR: mix toward the top direction e_1 (sum e_1^2 = 1, <p, e_1> = p_1)
        beta = _mix_weight(a, float(p[0]), 1.0, want)
        end = torch.zeros_like(p)
        end[0] = 1.0
    else:  # raise PR: mix toward the flat profile (sum u^2 = 1/d, <p, u> = 1/d)
        beta = _mix_weight(a, 1.0 / d, 1.0 / d, want)
        end = torch.full_like(p, 1.0 / d)
    return torch.sqrt(((1 - beta) * p + beta * end) * norm2)


def hold_profile(sv: Tensor, sv0: Tensor) -> Tensor:
    """The initial profile sv0 rescaled to the norm of sv; (..., E)."""
    sv, sv0 = sv.to(torch.float64), sv0.to(torch.float64)
    return sv0 * (sv.norm(dim=-1, keepdim=True) / sv0.norm(dim=-1, keepdim=True))


def scheduled_target(pr0: float, step: int, total_steps: int, ratio: float, reach: float) -> float:
    """reference = initial: linear from PR0 at step 0 to ratio * PR0 at step reach * total_steps, then flat."""
    progress = min(1.0, step / max(1e-12, reach * total_steps))
    return pr0 * (1 - (1 - ratio) * progress)


def needs_projection(kind: str, mode: str, current: float, target: float) -> bool:
    """One-sided controls: a ceiling (contract) acts only above the target, a floor (expand) only below."""
    if mode == "two-sided" or kind == "hold":
        return True
    return current > target if kind == "contract" else current < target


def key_spectrum(w_k: Tensor) -> tuple[Tensor, Tensor]:
    """Singular values (descending) and right singular vectors of W_K heads (h, D, E), from the
    E x E Gram matrix (float64): s (h, E), V (h, E, E)."""
    ev, v = torch.linalg.eigh(w_k.transpose(-1, -2) @ w_k)  # ascending
    return ev.flip(-1).clamp_min(0).sqrt(), v.flip(-1)


def set_key_spectrum(w_k: Tensor, s: Tensor, v: Tensor, s_new: Tensor) -> Tensor:
    """W_K U diag(s) V^T -> U diag(s_new) V^T, computed as W_K V diag(s_new / s) V^T; (h, D, E)."""
    ratio = torch.where(s > 1e-12 * s[..., :1], s_new / s.clamp_min(1e-300), torch.zeros_like(s))
    return w_k @ (v * ratio.unsqueeze(-2)) @ v.transpose(-1, -2)


def set_interaction_spectrum(w_q: Tensor, w_k: Tensor, s_new: Tensor | None = None) -> tuple[Tensor, ...]:
    """The spectrum s of W_Q W_K^T for heads (h, D, E) and, if s_new is given, the new (W_Q, W_K)
    whose product has singular values s_new and the same singular vectors (split evenly, see the
    module docstring). Returns (s,) or (s, W_Q', W_K')."""
    u_q, r_q = torch.linalg.qr(w_q)
    u_k, r_k = torch.linalg.qr(w_k)
    a, s, bh = torch.linalg.svd(r_q @ r_k.transpose(-1, -2))  # W_Q W_K^T = (U_q A) diag(s) (U_k B)^T
    if s_new is None:
        return (s,)
    b = bh.transpose(-1, -2)
    d = torch.where(s > 1e-12 * s[..., :1], (s_new / s.clamp_min(1e-300)).sqrt(), torch.ones_like(s)) - 1
    new_q = w_q + u_q @ (a * d.unsqueeze(-2)) @ a.transpose(-1, -2) @ r_q
    new_k = w_k + u_k @ (b * d.unsqueeze(-2)) @ b.transpose(-1, -2) @ r_k
    return s, new_q, new_k


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
    """

    cfg: InterventionConfig
    targets: dict[int, list[int]]  # layer -> controlled heads
    sv0: dict[int, Tensor]  # layer -> (H, E) initial singular values of the controlled object
    total_steps: int
    baseline: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def create(
        cls,
        cfg: InterventionConfig,
        w_q: list[Tensor],
        w_k: list[Tensor],
        total_steps: int,
        baseline: tuple[np.ndarray, np.ndarray] | None = None,
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
        if cfg.kind in ("contract", "expand") and cfg.reference == "baseline":
            if baseline is None:
                raise ValueError("intervention.reference = 'baseline' needs the baseline run's spectra")
            if baseline[1].shape[:2] != (len(w_k), w_k[0].shape[0]):
                raise ValueError(
                    f"baseline run has {baseline[1].shape[:2]} (layers, heads), this model "
                    f"{(len(w_k), w_k[0].shape[0])}"
                )
        ctl = cls(cfg, {li: heads for li in layers}, {}, total_steps, baseline)
        ctl.sv0 = {li: ctl.spectrum(w_q, w_k, li) for li in layers}
        return ctl

    def spectrum(self, w_q: list[Tensor], w_k: list[Tensor], layer: int) -> Tensor:
        """Singular values (H, E) of the controlled object of every head of `layer`."""
        if self.cfg.on == "key":
            return torch.linalg.svdvals(w_k[layer].detach().to(torch.float64))
        return set_interaction_spectrum(w_q[layer].detach().double(), w_k[layer].detach().double())[0]

    def target_pr(self, layer: int, head: int, step: int) -> float:
        """The PR the controlled head is steered to (hold: its initial PR), clipped to the feasible [1, E]."""
        pr0 = float(participation_ratio(self.sv0[layer][head] ** 2))
        if self.cfg.kind == "hold":
            return pr0
        if self.cfg.reference == "initial":
            target = scheduled_target(pr0, step, self.total_steps, self.cfg.ratio, self.cfg.reach_fraction)
        else:
            steps, values = self.baseline
            target = self.cfg.ratio * float(np.interp(step, steps, values[layer, head]))
        return min(max(target, 1.0), float(self.sv0[layer].shape[-1]))  # a PR lies in [1, E]

    @torch.no_grad()
    def apply(self, w_q: list[Tensor], w_k: list[Tensor], step: int) -> None:
        """Overwrite the controlled heads of each layer after optimiser step `step` (float64 maths)."""
        for li, heads in self.targets.items():
            sel_k = w_k[li][heads].to(torch.float64)  # (h, D, E)
            if self.cfg.on == "key":
                s, v = key_spectrum(sel_k)
            else:
                sel_q = w_q[li][heads].to(torch.float64)
                (s,) = set_interaction_spectrum(sel_q, sel_k)
            s_new = s.clone()
            for i, h in enumerate(heads):
                if self.cfg.kind == "hold":
                    s_new[i] = hold_profile(s[i], self.sv0[li][h])
                    continue
                target = self.target_pr(li, h, step)
                if needs_projection(self.cfg.kind, self.cfg.mode, float(participation_ratio(s[i] ** 2)), target):
                    s_new[i] = profile_with_pr(s[i], target)
            if torch.equal(s_new, s):
                continue  # no head of this layer crossed its ceiling / floor
            if self.cfg.on == "key":
                new_k = set_key_spectrum(sel_k, s, v, s_new)
            else:
                _, new_q, new_k = set_interaction_spectrum(sel_q, sel_k, s_new)
                for i, h in enumerate(heads):
                    w_q[li][h].copy_(new_q[i].to(w_q[li].dtype))
            for i, h in enumerate(heads):
                w_k[li][h].copy_(new_k[i].to(w_k[li].dtype))

    def rows(self, step: int) -> list[dict]:
        """Target rows (`<controlled metric>_target`) of the controlled heads, next to the achieved value."""
        metric = CONTROLLED_METRIC[self.cfg.on] + "_target"
        return [
            {"layer": li, "head": h, "site": "none", "metric": metric, "value": self.target_pr(li, h, step)}
            for li, heads in self.targets.items()
            for h in heads
        ]

    def state_dict(self) -> dict:
        return {"sv0": {str(k): v for k, v in self.sv0.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.sv0 = {int(k): v for k, v in state["sv0"].items()}
