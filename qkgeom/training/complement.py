"""The closed loop's inputs and the zero-training complement.

- CachedInputs: each layer's attention input on the closed loop's fixed control sequences, refreshed
  at the probe steps and every few steps between (an input moves only through the layers below it).
- control_rows: the per-head row std on the control set, recorded at each probe (the none run's is
  the closed-loop arms' target).
- The zero-training complement (causal v3): each arm's map applied once to a copy of a run's weights,
  relative to the run itself, and the change of attention entropy it causes with no training
  (instant_controls, mapped_copy, instant_rows); self_reference gives what a map needs to act on a
  model relative to itself on given sequences (bench/control_set_size.py and the tests use it).
"""

from __future__ import annotations

import numpy as np
import torch

from qkgeom import device as D
from qkgeom import solves as S
from qkgeom.probing.geometry import participation_ratio
from qkgeom.training.interventions import (
    CONTROL_ROW_STD_METRIC,
    KIND_METRIC,
    ROW_STD_METRIC,
    ROW_STD_SEQS,
    SpectrumControl,
    controlled_metric,
    row_std_metric,
)
from qkgeom.training.maps import batch_row_std, logit_scale

Tensor = torch.Tensor


@torch.no_grad()
def control_rows(model: torch.nn.Module, idx: Tensor, w_q: list[Tensor], w_k: list[Tensor]) -> list[dict]:
    """Per head and layer mean: the per-row logit std on the control sequences idx (B, T)
    (metric CONTROL_ROW_STD_METRIC), as batch_row_std measures it for the closed loop."""
    xs = attention_inputs(model, idx)
    rows = []
    for li, x in xs.items():
        std = D.host_list(batch_row_std(w_q[li], w_k[li], x))
        rows += [{"layer": li, "head": h, "site": "none", "metric": CONTROL_ROW_STD_METRIC, "value": v}
                 for h, v in enumerate(std)]  # fmt: skip
        rows.append(
            {"layer": li, "head": -1, "site": "none", "metric": CONTROL_ROW_STD_METRIC, "value": sum(std) / len(std)}
        )
    return rows


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
        pr.append(participation_ratio(S.eigvalsh(cov_k).clamp_min(0)))
        std.append(batch_row_std(w_q[li], k, inputs[li]))
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
