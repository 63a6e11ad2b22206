"""The host's own trackers: each probe's layer-mean scalars (probing.scalars.SCALARS, tags
`qkgeom/<metric>`) sent at the probe's step to the dashboards the user already set up for the loss.

- Hugging Face Trainer: every integration `TrainingArguments.report_to` names that qkgeom knows
  (TRAINER_TRACKERS), through that integration's own run: MLflow's active run (the one MLflowCallback
  started), W&B's `wandb.run` against its `train/global_step` axis, and TensorBoard event files in the
  TensorBoardCallback's log folder ($TENSORBOARD_LOGGING_DIR, else its newest `output_dir/runs/*`).
  A tracker with no open run receives nothing (never a new run opened on the user's behalf); a name
  qkgeom does not know is reported once and recorded.
- Lightning: `log_metrics(scalars, step)` of each logger in `trainer.loggers`.

A sink is (name, fn(step, scalars) -> bool): whether the scalars were sent. qkgeom.Probe counts the
sends per tracker into done.json (`scalars_sent`); the per-head detail stays in the run folder.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

Sink = tuple[str, Callable[[int, dict[str, float]], bool]]
PREFIX = "qkgeom/"
TRAINER_TRACKERS = ("mlflow", "wandb", "tensorboard")


def tagged(scalars: dict[str, float]) -> dict[str, float]:
    """The scalars under their dashboard tags: qkgeom/<metric>."""
    return {PREFIX + k: v for k, v in scalars.items()}


def _mlflow(step: int, scalars: dict[str, float]) -> bool:
    import mlflow

    if mlflow.active_run() is None:  # MLflowCallback's run has ended (or never started)
        return False
    mlflow.log_metrics(tagged(scalars), step=step)
    return True


def _wandb(step: int, scalars: dict[str, float]) -> bool:
    import wandb

    if wandb.run is None:
        return False
    wandb.run.log({**tagged(scalars), "train/global_step": step})  # WandbCallback's step axis
    return True


def tensorboard_dir(output_dir: str | Path, since: float) -> Path:
    """Where the Trainer's TensorBoardCallback writes: $TENSORBOARD_LOGGING_DIR, else its newest folder
    under output_dir/runs/ made since `since` (it makes it at train begin), else output_dir/runs/qkgeom."""
    env = os.getenv("TENSORBOARD_LOGGING_DIR")
    if env:
        return Path(env).expanduser()
    runs = Path(output_dir) / "runs"
    made = [d for d in runs.iterdir() if d.is_dir() and d.stat().st_mtime >= since - 1] if runs.is_dir() else []
    return max(made, key=lambda d: d.stat().st_mtime) if made else runs / "qkgeom"


def _tensorboard(logdir: Path) -> Callable[[int, dict[str, float]], bool]:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(logdir))

    def send(step: int, scalars: dict[str, float]) -> bool:
        for tag, value in tagged(scalars).items():
            writer.add_scalar(tag, value, step)
        writer.flush()
        return True

    return send


def trainer_sinks(args: Any, started: float | None = None) -> tuple[list[Sink], list[str]]:
    """Sinks for the integrations a Trainer's `args.report_to` names, and the names qkgeom cannot
    reach (warned once). started: when training began (to find the TensorBoard folder)."""
    names = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    sinks: list[Sink] = []
    unknown = []
    for name in (n for n in names if n and n not in ("none", "all")):
        if name == "mlflow":
            sinks.append((name, _mlflow))
        elif name == "wandb":
            sinks.append((name, _wandb))
        elif name == "tensorboard":
            sinks.append((name, _tensorboard(tensorboard_dir(args.output_dir, started or time.time()))))
        else:
            unknown.append(name)
    if unknown:
        warnings.warn(
            f"qkgeom: the geometry scalars go to {', '.join(TRAINER_TRACKERS)}, not to {', '.join(unknown)} "
            "(report_to); they stay in the run folder",
            RuntimeWarning,
            stacklevel=2,
        )
    return sinks, unknown


def lightning_sinks(loggers: list[Any]) -> list[Sink]:
    """One sink per Lightning logger (trainer.loggers): its own log_metrics at the global step."""

    def sink(logger: Any) -> Callable[[int, dict[str, float]], bool]:
        def send(step: int, scalars: dict[str, float]) -> bool:
            logger.log_metrics(tagged(scalars), step=step)
            return True

        return send

    return [(type(lg).__name__, sink(lg)) for lg in loggers]
