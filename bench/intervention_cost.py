"""Cost of the key-spectrum control as a share of a training step (cpu preset, depth 6).

Target (issue 4): <= 5%. Times full optimiser steps with and without `control.apply`, in one
process, alternating, so machine noise hits both alike. Usage:
    python bench/intervention_cost.py [--depth 6] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from qkgeom import config as C
from qkgeom import interventions as I
from qkgeom.model import GPT
from qkgeom.probe import gpt_weights
from qkgeom.train import make_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = C.load("cpu", [f"model.n_layers={args.depth}"])
    model = GPT(cfg.model, vocab_size=284)
    opt = make_optimizer(model, cfg.train)
    idx = torch.randint(0, 284, (cfg.train.batch_size, cfg.model.n_ctx))
    controls = {
        kind: I.KeyControl.create(C.InterventionConfig(kind=kind), gpt_weights(model)[1], 1000)
        for kind in ("hold", "shrink")
    }

    def step() -> float:
        tic = time.perf_counter()
        loss = model.loss(idx, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - tic

    def control(kind: str, s: int) -> float:
        tic = time.perf_counter()
        controls[kind].apply(gpt_weights(model)[1], s)
        return time.perf_counter() - tic

    for _ in range(3):
        step()
    t_step, t_ctl = 0.0, {"hold": 0.0, "shrink": 0.0}
    for s in range(args.steps):
        t_step += step()
        for kind in t_ctl:
            t_ctl[kind] += control(kind, s)
    n_heads = args.depth * cfg.model.n_heads
    print(
        f"cpu preset, depth {args.depth}, batch {cfg.train.batch_size}, {n_heads} controlled heads, {args.steps} steps"
    )
    print(f"training step      : {1000 * t_step / args.steps:8.2f} ms")
    for kind, t in t_ctl.items():
        share = 100 * t / t_step
        print(f"{kind:6s} control     : {1000 * t / args.steps:8.2f} ms  = {share:5.2f}% of a step (target <= 5%)")


if __name__ == "__main__":
    main()
