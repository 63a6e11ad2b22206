"""The `paper` preset on a GPU: training tokens/s, model FLOPs utilisation, and the gpu-hour study sized
at its own cadence.

Trains the paper preset (6 layers, d_model 256, bf16 autocast, TF32, fused AdamW) for --steps steps on
WikiText-2 characters (WikiText-103 is not reachable offline; the shape and cost per token are the
same), once eager and once with torch.compile, with ~10 probes, evaluations and checkpoints so that
each unit cost is measured (bench/cadence.py): the bare step, one probe, one evaluation, one
checkpoint. Then it composes the jobs at their own cadence, not the short run's:

    the paper preset (20,000 steps, a probe every 500) and the gpu-hour study (3,000 steps, every 250):
    whole-job tokens/s, probe share, and how many steps per run --budget-minutes affords the study.

(An earlier version scaled probe.every with --steps, so its 400-step run probed 50 times as often as
the study and told the user to cut the pre-registered study from 3,000 to 467 steps per run.)

Usage (on the GPU machine): python bench/paper_gpu.py [--steps 400] [--peak-tflops 989]
(989 TFLOP/s: dense bf16 of an H100/H200 SXM.) `--device cpu --steps 20` checks the script anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cadence  # noqa: E402
from common import require_wikitext  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.training.model import GPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="steps of each measuring run (default 400)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (default 989)")
    ap.add_argument("--device", default="cuda", help="torch device (default cuda; cpu checks the script)")
    ap.add_argument(
        "--budget-minutes", type=float, default=40.0,
        help="GPU minutes for `qkgeom study gpu-hour` (default 40): prints the steps per run it affords",
    )  # fmt: skip
    args = ap.parse_args()
    require_wikitext()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("paper_gpu.py needs a CUDA device (or --device cpu to check the script)")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; paper preset, measuring runs of {args.steps} steps")
    study = C.load("paper", study_overrides())
    paper = C.load("paper")
    best = None
    for compiled in (False, True):
        cfg = C.load("paper", measuring_overrides(args.steps, args.device, compiled))
        n_params = sum(p.numel() for p in GPT(cfg.model, 284).parameters())
        with tempfile.TemporaryDirectory() as tmp:
            u = cadence.measure(cfg, Path(tmp) / "run")
        mfu = 6 * n_params * u.bare_tokens_per_s / (args.peak_tflops * 1e12)
        label = "compiled" if compiled else "eager   "
        print(
            f"{label}: bare step {u.bare_tokens_per_s:10.0f} tokens/s (MFU {100 * mfu:5.2f}%, "
            f"{n_params / 1e6:.2f} M parameters); one probe {u.probe:.3f} s, eval {u.eval:.3f} s, "
            f"checkpoint {u.checkpoint:.3f} s",
            flush=True,
        )
        for what, c in (("paper preset", paper), ("gpu-hour study", study)):
            job = cadence.compose(u, c.train, c.probe)
            print(
                f"          {what} at its cadence ({c.train.steps} steps, {job['n_probes']} probes): "
                f"{job['tokens_per_s']:10.0f} tokens/s, probes {100 * job['probe_share']:.1f}%, "
                f"{job['overhead']:.3f}x its training steps",
                flush=True,
            )
        if best is None or u.step < best.step:
            best = u
    size_study(study, best, args.budget_minutes)


def study_overrides() -> list[str]:
    """The gpu-hour study's [set] (configs/study-gpu-hour.toml), as overrides of the paper preset."""
    spec = tomllib.loads((C.CONFIG_DIR / "study-gpu-hour.toml").read_text())
    return [f"{k}={json.dumps(v)}" for k, v in spec["set"].items()]


def measuring_overrides(steps: int, device: str, compiled: bool) -> list[str]:
    """A short run with ~10 of each event, so every unit cost is measured more than once."""
    every = max(1, steps // 10)
    return [
        "data.source='wikitext-2'", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 20)}",
        f"probe.every={every}", "probe.log_early=false", f"train.eval_every={every}",
        f"train.checkpoint_every={every}", f"train.device='{device}'", f"train.compile={str(compiled).lower()}",
    ]  # fmt: skip


def size_study(study: C.RunConfig, u: cadence.UnitCosts, budget_minutes: float) -> None:
    """How many steps per run the budget affords the gpu-hour study, its runs one after another."""
    spec = tomllib.loads((C.CONFIG_DIR / "study-gpu-hour.toml").read_text())
    n_runs = 1
    for values in spec["grid"].values():
        n_runs *= len(values)
    per_run = cadence.compose(u, study.train, study.probe)["seconds"]
    planned = study.train.steps
    affordable = int(planned * budget_minutes * 60 / (n_runs * per_run))
    fit = "fits" if affordable >= planned else "LOWER train.steps before running"
    print(
        f"gpu-hour study: {n_runs} runs x {per_run:.1f} s at its own cadence = {n_runs * per_run / 60:.1f} min; "
        f"{budget_minutes:g} min afford ~{affordable} steps per run (the study file plans {planned}: {fit})"
    )


if __name__ == "__main__":
    main()
