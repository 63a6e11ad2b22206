"""Key-spectrum control: the per-step applier (SpectrumControl) and its running input covariance; the maps
it applies are in training.maps, the closed loop's inputs and the zero-training complement in
training.complement.

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
the validation probe batch, is judged on text the loop never saw. Every run with a control set
records its row std there (CONTROL_ROW_STD_METRIC, complement.control_rows): the none run's is the
arms' target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.arms import CHECK_MEDIATOR, KINDS
from qkgeom.config import InterventionConfig
from qkgeom.errors import QKGeomError
from qkgeom.probing.geometry import interaction_singular_values, participation_ratio, singular_values
from qkgeom.results import RunDir
from qkgeom.training.maps import (
    hold_profile,
    interaction_svd,
    key_shape_map,
    key_spectrum,
    logit_scale,
    match_logit_scale,
    match_row_std,
    profiles_with_pr,
    scheduled_target,
    set_interaction,
    set_key_spectrum,
)

Tensor = torch.Tensor
# the probe metric each control acts on (a per-head row in geometry.parquet)
CONTROLLED_METRIC = {"key": "key_weight_participation_ratio", "interaction": "interaction_rank"}
ROW_STD_METRIC = "logit_row_std"  # what match_row_std tracks (the none run's per-head probe rows)
ROW_STD_SEQS = 4  # control_seqs = 0: the probe sequences the closed loop fits on (v4 as first registered)
CONTROL_ROW_STD_METRIC = "logit_row_std_control"  # control_seqs > 0: the per-head row std on the control set
# ... for the kinds that act through the data, by kind
KIND_METRIC = {k: CHECK_MEDIATOR[v.shows] for k, v in KINDS.items() if v.shows}  # shape, temperature (qkgeom.arms)
FLOOR_METRIC = "key_participation_ratio_floor_raised"


class InterventionError(QKGeomError, ValueError):
    """A control cannot be set up (its baseline run is missing, unfinished or lacks the rows it reads)."""


def baseline_spectra(
    iv: InterventionConfig, rd: RunDir, metric: str | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """For reference = baseline: (probe steps (n,), per-head metric (L, H, n)) of the finished `none`
    run named by intervention.baseline (relative to this run's parent folder); the metric is
    interventions.controlled_metric (weight PR, activation PR_K or logit scale) unless named (the
    closed loop's logit_row_std)."""
    if not C.needs_baseline(iv) or (metric is None and iv.kind == "hold"):
        return None
    if not iv.baseline:
        raise InterventionError(
            "intervention.reference = 'baseline' needs intervention.baseline, the finished none run's folder "
            "(sweeps set it; or use intervention.reference = 'initial')"
        )
    base = RunDir(Path(iv.baseline) if Path(iv.baseline).is_absolute() else rd.path.parent / iv.baseline)
    if not base.is_done():
        raise InterventionError(f"baseline run {base.path} is not finished (train the none run first)")
    g = base.read_geometry()
    metric = metric or controlled_metric(iv)
    g = g[(g["metric"] == metric) & (g["head"] >= 0) & (g["site"] == "none")]
    if g.empty:
        raise InterventionError(
            f"baseline run {base.path} has no per-head {metric!r} rows (probed by an older qkgeom?)"
        )
    table = g.pivot_table(index=["layer", "head"], columns="step", values="value")  # (L*H, n)
    n_layers, n_heads = table.index.levshape
    return table.columns.to_numpy(), table.to_numpy().reshape(n_layers, n_heads, -1)


def controlled_metric(cfg: InterventionConfig) -> str:
    """The per-head probe metric an intervention steers (and reads from its baseline run)."""
    return KIND_METRIC.get(cfg.kind, CONTROLLED_METRIC[cfg.on])


def row_std_metric(cfg: InterventionConfig) -> str:
    """The per-head probe metric the closed loop tracks in the none run: the row std on the control set
    (control_seqs > 0), else the probe's own logit_row_std (v4's first registration)."""
    return CONTROL_ROW_STD_METRIC if cfg.control_seqs else ROW_STD_METRIC


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
            mapped = self._spectrum_map(sel_q, sel_k, step)
            if mapped is None:
                return  # no head crossed its ceiling / floor: weights stay bit-identical
            new_q, new_k, act = mapped
        if scale0 is not None:
            new_q, new_k = match_logit_scale(new_q, new_k, cov, scale0, mean)
        if self.cfg.match_row_std:  # closed loop: every controlled head, projected or not
            new_q, new_k = match_row_std(new_q, new_k, self._batches(step), self.row_std_targets(step))
            act = torch.ones_like(act)
        if new_q is not sel_q:
            self._scatter(w_q, new_q, act)
        self._scatter(w_k, new_k, act)

    def _spectrum_map(self, sel_q: Tensor, sel_k: Tensor, step: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """hold, contract, expand: the controlled spectrum (of W_K, or of W_Q W_K^T) reshaped; (W_Q, W_K,
        which heads acted), or None where no head crossed its ceiling / floor and nothing else steers."""
        kind = self.cfg.kind
        act = torch.ones(len(sel_k), dtype=torch.bool)
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
                return None
            s_new = torch.where(act.unsqueeze(-1), profiles_with_pr(s, target), s)
        if self.cfg.on == "key":
            return sel_q, set_key_spectrum(sel_k, s, v, s_new), act
        return (*set_interaction(sel_q, sel_k, svd, s_new), act)

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
        if hasattr(self.row_std_inputs, "state_dict"):  # complement.CachedInputs: its cached inputs travel too
            state["row_std_inputs"] = self.row_std_inputs.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict's state (set row_std_inputs before, as the training loop does)."""
        self.sv0 = {int(k): v for k, v in state["sv0"].items()}
        if self.cov is not None and "cov" in state:
            self.cov.load_state_dict(state["cov"])
        if hasattr(self.row_std_inputs, "load_state_dict") and "row_std_inputs" in state:
            self.row_std_inputs.load_state_dict(state["row_std_inputs"])
        self._sv0_all = None
