"""Cost of the spectrum control as a share of a training step (cpu preset).

Target (issue 10): <= 3%. Times full optimiser steps with and without each control's `apply`, in
one process, interleaved, so machine noise hits both alike. Controls: hold and a two-sided
contraction on W_K (the one-sided ceiling costs the same decomposition plus nothing when inactive),
and a two-sided contraction of W_Q W_K^T (`on = "interaction"`). Usage:
    python bench/intervention_cost.py [--depth 4] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from qkgeom import config as C
from qkgeom.probing.probe import gpt_weights
from qkgeom.training import interventions as I
from qkgeom.training.loop import make_optimizer
from qkgeom.training.model import GPT

CONTROLS = {
    "hold on W_K": dict(kind="hold"),
    "contract W_K": dict(kind="contract", ratio=0.5, reference="initial", mode="two-sided"),
    "contract W_QW_K^T": dict(kind="contract", on="interaction", ratio=0.5, reference="initial", mode="two-sided"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = C.load("cpu", [f"model.n_layers={args.depth}"])
    model = GPT(cfg.model, vocab_size=284)
    opt = make_optimizer(model, cfg.train)
    idx = torch.randint(0, 284, (cfg.train.batch_size, cfg.model.n_ctx))
    w_q, w_k = gpt_weights(model)
    controls = {
        name: I.SpectrumControl.create(C.InterventionConfig(**kw), w_q, w_k, 1000) for name, kw in CONTROLS.items()
    }

    def step() -> float:
        tic = time.perf_counter()
        loss = model.loss(idx, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - tic

    def control(name: str, s: int) -> float:
        tic = time.perf_counter()
        controls[name].apply(w_q, w_k, s)
        return time.perf_counter() - tic

    for _ in range(3):
        step()
    t_step, t_ctl = 0.0, dict.fromkeys(controls, 0.0)
    for s in range(args.steps):
        t_step += step()
        for name in t_ctl:
            t_ctl[name] += control(name, s + 1)
    n_heads = args.depth * cfg.model.n_heads
    print(
        f"cpu preset, depth {args.depth}, batch {cfg.train.batch_size}, {n_heads} controlled heads, "
        f"{args.steps} steps, {args.threads} threads"
    )
    print(f"training step        : {1000 * t_step / args.steps:8.2f} ms")
    for name, t in t_ctl.items():
        share = 100 * t / t_step
        print(f"{name:20s} : {1000 * t / args.steps:8.2f} ms  = {share:5.2f}% of a step (target <= 3%)")


if __name__ == "__main__":
    main()
