"""A training job's time, split and recomposed at another cadence (shared by paper_gpu.py and gpu_check.py).

A short run measures four unit costs: the bare optimiser step, one probe, one evaluation and one
checkpoint (done.json keeps each kind's seconds; the run's config and metrics give their counts). A
study's job is then composed at its own cadence (steps, probe.every with the log-spaced early probes,
eval_every, checkpoint_every) instead of the short run's, whose probes may be 50 times denser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qkgeom import config as C
from qkgeom.results import read_json
from qkgeom.training.loop import probe_steps, train


@dataclass(frozen=True)
class UnitCosts:
    step: float  # seconds per bare optimiser step
    probe: float  # seconds per probe
    eval: float  # seconds per evaluation
    checkpoint: float  # seconds per checkpoint
    tokens_per_step: int

    @property
    def bare_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step


def counts(t: C.TrainConfig, p: C.ProbeConfig, kept: set[int] | None = None) -> tuple[int, int, int]:
    """(probes, evaluations, checkpoints) a run of this cadence makes, as training/loop.py schedules them."""
    probes = len(set(probe_steps(t.steps, p.every, p.log_early)))
    evals = sum(1 for s in range(t.steps + 1) if s % t.eval_every == 0 or s == t.steps)
    kept = kept or set()
    ckpts = sum(1 for s in range(t.steps + 1) if s in kept or s % t.checkpoint_every == 0 or s == t.steps)
    return probes, evals, ckpts


def measure(cfg: C.RunConfig, folder: Path) -> UnitCosts:
    """Train `cfg` into `folder` once and split its segment time into unit costs."""
    rd = train(cfg, folder, progress=False)
    done = json.loads(rd.done.read_text())
    info = read_json(rd.config)
    n_probe, n_eval, n_ckpt = counts(cfg.train, cfg.probe, set(info.get("kept_checkpoints", [])))
    probe = done["probe_seconds_last_segment"]
    ev = done["eval_seconds_last_segment"]
    ck = done["checkpoint_seconds_last_segment"]
    bare = (done["segment_seconds"] - probe - ev - ck) / cfg.train.steps
    return UnitCosts(bare, probe / n_probe, ev / n_eval, ck / max(n_ckpt, 1), info["tokens_per_step"])


def compose(u: UnitCosts, t: C.TrainConfig, p: C.ProbeConfig) -> dict[str, float]:
    """A job of this cadence: its seconds, whole-job tokens/s and the probe's share of its time."""
    n_probe, n_eval, n_ckpt = counts(t, p)
    parts = {
        "steps": t.steps * u.step,
        "probes": n_probe * u.probe,
        "evals": n_eval * u.eval,
        "checkpoints": n_ckpt * u.checkpoint,
    }
    total = sum(parts.values())
    return {
        "seconds": total,
        "tokens_per_s": t.steps * u.tokens_per_step / total,
        "probe_share": parts["probes"] / total,
        "overhead": total / parts["steps"],  # the whole job against its own training steps
        "n_probes": n_probe,
    }
