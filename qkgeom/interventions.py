"""Key-spectrum control: pure functions on singular-value profiles, and the per-step applier.

Weight-side PR of a head's key weights: PR(s^2) for the singular values s of W_K^h (D, E),
in [1, E]. After every optimiser step, each controlled head's W_K^h = U diag(s) V^T is
replaced by U diag(s') V^T with ||s'|| = ||s|| (Frobenius norm preserved):

- hold:   s' = s0 * ||s|| / ||s0||  (the initial profile's shape, current norm).
- shrink: s' = the current profile moved, in energy space p = s^2 / sum s^2, along the segment
  toward the top direction (to lower PR) or toward the flat profile (to raise it), by exactly the
  amount that gives PR = target(step) = PR0 * (1 - (1 - fraction) * min(1, step / (reach * steps))).

Along both segments sum(p^2) is a convex quadratic in the mixing weight, monotone on [0, 1], so
the weight is found in closed form. With `tied` / `anti_tied` inits the control acts on W_K only
and so breaks the tie from the first step (recorded in the run's config.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkgeom.config import InterventionConfig
from qkgeom.geometry import participation_ratio

Tensor = torch.Tensor


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


def shrink_target(pr0: float, step: int, total_steps: int, fraction: float, reach: float) -> float:
    """Linear schedule from PR0 at step 0 to fraction * PR0 at step reach * total_steps, then flat."""
    progress = min(1.0, step / max(1e-12, reach * total_steps))
    return pr0 * (1 - (1 - fraction) * progress)


def notes(cfg: InterventionConfig, qk_init: str) -> list[str]:
    """Plain-language notes on what the control does to this run, stored in config.json."""
    if cfg.kind != "none" and qk_init in ("tied", "anti_tied"):
        sign = "" if qk_init == "tied" else "-"
        return [
            f"intervention '{cfg.kind}' acts on W_K only: the {qk_init} init's W_K = {sign}W_Q "
            "holds at step 0 and is broken from the first controlled step on"
        ]
    return []


@dataclass
class KeyControl:
    """Applies an InterventionConfig to per-layer key weights (H, D, E) views, in place."""

    cfg: InterventionConfig
    targets: dict[int, list[int]]  # layer -> controlled heads
    sv0: dict[int, Tensor]  # layer -> (H, E) initial singular values
    total_steps: int

    @classmethod
    def create(cls, cfg: InterventionConfig, w_k: list[Tensor], total_steps: int) -> KeyControl:
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
        targets = {li: heads for li in layers}
        sv0 = {li: torch.linalg.svdvals(w_k[li].detach().to(torch.float64)) for li in layers}
        return cls(cfg, targets, sv0, total_steps)

    def target_pr(self, layer: int, head: int, step: int) -> float:
        pr0 = float(participation_ratio(self.sv0[layer][head] ** 2))
        if self.cfg.kind == "hold":
            return pr0
        return shrink_target(pr0, step, self.total_steps, self.cfg.target_fraction, self.cfg.reach_fraction)

    @torch.no_grad()
    def apply(self, w_k: list[Tensor], step: int) -> None:
        """Overwrite the controlled heads of each layer's W_K after optimiser step `step`.

        With W = U S V^T, the new matrix U S' V^T equals W V diag(s'/s) V^T, so only the small
        E x E Gram matrix W^T W = V S^2 V^T is decomposed (float64; exact up to round-off, which
        grows as eps * (s_max / s)^2 and stays far below the 1e-6 the tests check).
        """
        for li, heads in self.targets.items():
            w = w_k[li]  # (H, D, E) view of the parameter
            sel = w[heads].to(torch.float64)  # (h, D, E)
            ev, v = torch.linalg.eigh(sel.transpose(-1, -2) @ sel)  # ascending
            ev, v = ev.flip(-1).clamp_min(0), v.flip(-1)
            s = ev.sqrt()  # (h, E) descending singular values
            if self.cfg.kind == "hold":
                s_new = hold_profile(s, self.sv0[li][heads])
            else:
                s_new = torch.stack([profile_with_pr(s[i], self.target_pr(li, h, step)) for i, h in enumerate(heads)])
            ratio = torch.where(s > 1e-12 * s[..., :1], s_new / s.clamp_min(1e-300), torch.zeros_like(s))
            new = sel @ (v * ratio.unsqueeze(-2)) @ v.transpose(-1, -2)
            for i, h in enumerate(heads):
                w[h].copy_(new[i].to(w.dtype))

    def rows(self, step: int) -> list[dict]:
        """Target weight-PR_K rows of the controlled heads, next to the achieved value."""
        return [
            {
                "layer": li,
                "head": h,
                "site": "none",
                "metric": "key_weight_participation_ratio_target",
                "value": self.target_pr(li, h, step),
            }
            for li, heads in self.targets.items()
            for h in heads
        ]

    def state_dict(self) -> dict:
        return {"sv0": {str(k): v for k, v in self.sv0.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.sv0 = {int(k): v for k, v in state["sv0"].items()}
