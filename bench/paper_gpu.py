"""The `paper` preset on a GPU: training tokens/s, model FLOPs utilisation, probe share.

The one prepared script for a lent GPU (issue 13): trains the paper preset (6 layers, d_model 256,
bf16 autocast, TF32, fused AdamW) for --steps steps on WikiText-2 characters (WikiText-103 is not
reachable offline; the shape and cost per token are the same), with probes as dense as in the
full preset, once eager and once with torch.compile, and prints

    tokens/s, MFU = 6 * parameters * tokens/s / peak bf16 FLOP/s, probe share of training time.

Usage (on the GPU machine): python bench/paper_gpu.py [--steps 400] [--peak-tflops 989]
(989 TFLOP/s: dense bf16 of an H100/H200 SXM.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.training.loop import train  # noqa: E402
from qkgeom.training.model import GPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (default 989)")
    ap.add_argument(
        "--budget-minutes", type=float, default=40.0,
        help="GPU minutes for `qkgeom study gpu-hour` (default 40): prints the steps per run it affords",
    )  # fmt: skip
    args = ap.parse_args()
    require_wikitext()
    if not torch.cuda.is_available():
        sys.exit("paper_gpu.py needs a CUDA device")
    full = C.load("paper")
    f = args.steps / full.train.steps
    base = [
        "data.source=wikitext-2",
        f"train.steps={args.steps}",
        f"train.warmup_steps={max(1, round(full.train.warmup_steps * f))}",
        f"probe.every={max(1, round(full.probe.every * f))}",
        f"train.eval_every={max(1, round(full.train.eval_every * f))}",
        f"train.checkpoint_every={max(1, round(full.train.checkpoint_every * f))}",
    ]
    print(f"device: {torch.cuda.get_device_name(0)}; paper preset, {args.steps} steps")
    best = 0.0
    for compiled in (False, True):
        cfg = C.load("paper", [*base, f"train.compile={'true' if compiled else 'false'}"])
        n_params = sum(p.numel() for p in GPT(cfg.model, 284).parameters())
        tokens = args.steps * cfg.train.batch_size * cfg.model.n_ctx
        with tempfile.TemporaryDirectory() as tmp:
            done = json.loads(train(cfg, Path(tmp) / "run", progress=False).done.read_text())
        seconds = done["segment_seconds"]
        tps = tokens / seconds
        mfu = 6 * n_params * tps / (args.peak_tflops * 1e12)
        print(
            f"{'compiled' if compiled else 'eager   '}: {tps:10.0f} tokens/s, MFU {100 * mfu:5.2f}% "
            f"({n_params / 1e6:.2f} M parameters), probes {100 * done['probe_seconds_last_segment'] / seconds:.2f}% "
            f"of {seconds:.1f} s (compile time included)",
            flush=True,
        )
        best = max(best, tps)
    # sizing the pre-registered study (configs/study-gpu-hour.toml): its runs one after another
    import tomllib

    spec = tomllib.loads((C.CONFIG_DIR / "study-gpu-hour.toml").read_text())
    n_runs = 1
    for values in spec["grid"].values():
        n_runs *= len(values)
    tokens_per_step = full.train.batch_size * full.model.n_ctx
    steps = int(args.budget_minutes * 60 * best / n_runs / tokens_per_step)
    planned = spec["set"]["train.steps"]
    fit = "fits" if steps >= planned else "LOWER train.steps before running"
    print(
        f"gpu-hour study: {n_runs} runs in {args.budget_minutes:g} min at {best:.0f} tokens/s afford {steps} steps "
        f"per run (the study file plans {planned}: {fit})"
    )


if __name__ == "__main__":
    main()
