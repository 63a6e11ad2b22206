"""`QKGeometryCallback` for PyTorch Lightning: Q/K geometry of the model being trained, at qkgeom's
probe schedule, into a run folder that `qkgeom analyze` and `qkgeom report` read.

    trainer = L.Trainer(max_steps=..., callbacks=[QKGeometryCallback(batch, "runs/mine/seed0")])

The LightningModule is searched for the model to read (itself, or the first sub-module that is a
qkgeom GPT or a supported Hugging Face model). Only global rank zero probes. The layer-mean scalars
(`qkgeom/PR_Q`, ...) go through every configured logger (trainer.loggers: TensorBoard, MLflow, W&B,
CSV, ...) at the global step. The step is
trainer.global_step (optimiser steps; with gradient accumulation a step is probed once).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("the Lightning callback needs lightning: pip install 'qkgeom[lightning]'") from e

from qkgeom.integrations.trackers import lightning_sinks
from qkgeom.probing.tracking import Probe


class QKGeometryCallback(Callback):
    """batch: a fixed probe batch of input ids (B, T); out: the run folder; every: probe interval in
    optimiser steps; tokens_per_step: training tokens per optimiser step (for tokens_seen);
    val_loss_key: the logged metric recorded as validation loss; seed: recorded for analyze's seed
    grouping (default: the one `lightning.seed_everything` set, PL_GLOBAL_SEED, else 0); further keyword
    arguments go to qkgeom.Probe (tensorboard=DIR, ...)."""

    def __init__(
        self,
        batch: torch.Tensor,
        out: str | Path,
        every: int = 100,
        tokens_per_step: int | None = None,
        val_loss_key: str = "val_loss",
        seed: int | None = None,
        **probe_kwargs: Any,
    ) -> None:
        Probe.check_arguments(batch, every, probe_kwargs, fixed=("resume",))  # here, not when training starts
        self.batch, self.out, self.every, self.tokens_per_step = batch, out, every, tokens_per_step
        self.val_loss_key, self.seed, self.probe_kwargs = val_loss_key, seed, probe_kwargs
        self.probe: Probe | None = None

    def _tokens(self, trainer) -> int | None:
        return trainer.global_step * self.tokens_per_step if self.tokens_per_step else None

    def on_train_start(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's
        kw = {"seed": seed, "steps": steps, "sinks": lightning_sinks(trainer.loggers)} | self.probe_kwargs
        self.probe = Probe(pl_module, self.batch, self.every, self.out, resume=trainer.global_step > 0, **kw)
        self.probe(trainer.global_step, self._tokens(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.probe is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.probe.log_metrics(trainer.global_step, loss, "train", self._tokens(trainer))
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        self.probe(
            trainer.global_step, self._tokens(trainer), force=last and trainer.global_step > self.probe.last_step
        )

    def on_validation_epoch_end(self, trainer, pl_module):
        value = trainer.callback_metrics.get(self.val_loss_key)
        if self.probe is not None and value is not None and not trainer.sanity_checking:
            self.probe.log_metrics(trainer.global_step, value, "valid", self._tokens(trainer))

    def on_train_end(self, trainer, pl_module):
        if self.probe is not None:
            self.probe.finish(trainer.global_step, self._tokens(trainer))
            self.probe = None

    def on_exception(self, trainer, pl_module, exception):
        if self.probe is not None:  # the folder stays resumable (resume=True) and is released
            self.probe.close()
            self.probe = None
