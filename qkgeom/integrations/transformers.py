"""`QKGeometryCallback` for the Hugging Face `Trainer`: Q/K geometry of the model being trained, at
qkgeom's probe schedule, into a run folder that `qkgeom analyze` and `qkgeom report` read.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[QKGeometryCallback(batch, "runs/mine/seed0")])

Only the main process probes (state.is_world_process_zero). Losses the Trainer logs (loss,
eval_loss) go to the folder's metrics.jsonl for the report's curves. The layer-mean scalars
(`qkgeom/PR_Q`, ...) go to every tracker `report_to` names (MLflow, W&B, TensorBoard:
qkgeom.integrations.trackers), at the probe's step; the last step is probed before the trackers
close their runs. `trainer.train(
resume_from_checkpoint=...)` continues the run folder: probes after the checkpoint's step are
redone. After a train() that raised, pass the same callback again (it releases the folder first).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("the Trainer callback needs accelerate: pip install 'qkgeom[transformers]'") from e

from qkgeom.integrations.trackers import trainer_sinks
from qkgeom.probing.tracking import Probe


class QKGeometryCallback(TrainerCallback):
    """batch: a fixed probe batch of input ids (B, T); out: the run folder; every: probe interval in
    optimiser steps (steps 0, 1, 2, 4, ... below it are probed too); tokens_per_step: training tokens
    per optimiser step, for tokens_seen (default: the Trainer's num_input_tokens_seen where it counts
    them, else not recorded); further keyword arguments go to qkgeom.Probe (tensorboard=DIR, ...)."""

    def __init__(
        self,
        batch: torch.Tensor,
        out: str | Path,
        every: int = 100,
        tokens_per_step: int | None = None,
        **probe_kwargs: Any,
    ) -> None:
        Probe.check_arguments(batch, every, probe_kwargs, fixed=("resume",))  # here, not when training starts
        self.batch, self.out, self.every = batch, out, every
        self.tokens_per_step, self.probe_kwargs = tokens_per_step, probe_kwargs
        self.probe: Probe | None = None
        self.started = time.time()  # the TensorBoardCallback makes its folder after this (trackers.tensorboard_dir)

    def _tokens(self, state) -> int | None:
        if self.tokens_per_step:
            return state.global_step * self.tokens_per_step
        return getattr(state, "num_input_tokens_seen", 0) or None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.probe is not None:  # an earlier train() of this callback raised: release its folder
            self.probe.close()
        sinks, _ = trainer_sinks(args, self.started)
        kw = {"seed": args.seed, "data_seed": args.data_seed, "steps": state.max_steps or None, "sinks": sinks}
        self.probe = Probe(
            model, self.batch, self.every, self.out, resume=state.global_step > 0, **kw | self.probe_kwargs
        )
        self.probe(state.global_step, self._tokens(state))

    def on_step_end(self, args, state, control, **kwargs):
        if self.probe is not None:  # the last step now, while the trackers' runs are open (they close at train end)
            last = bool(state.max_steps) and state.global_step >= state.max_steps
            force = last and state.global_step > self.probe.last_step
            self.probe(state.global_step, self._tokens(state), force=force)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.probe is None or not logs:
            return
        for key, split in (("loss", "train"), ("eval_loss", "valid")):
            if key in logs:
                self.probe.log_metrics(state.global_step, logs[key], split, self._tokens(state))

    def on_train_end(self, args, state, control, **kwargs):
        if self.probe is not None:
            self.probe.finish(state.global_step, self._tokens(state))
            self.probe = None
