"""What stacking seeds would buy: N runs' training steps as N models one after another, against one
step of the N models stacked (torch.func.stack_module_state + vmap), before building it into the trainer.

Issue 53 asks that a pre-registered GPU study fit a short lease: a 5 M-parameter run uses a fraction
of a percent of an H200, whose eager steps are bound by kernel launches. Two ways to fill the device:
several runs as processes at once (the local pool; bench/gpu_check.py's many-runs rows), or several
seeds in one process as one stacked model, one launch per kernel for all of them. This script measures
the second at a preset's shape, on any device:

- separate: N GPT models (seeds 0..N-1), each with its own AdamW, stepped one after another (what N
  runs cost a device that runs them in turn);
- stacked: the same N models' weights stacked along a new first dimension, the forward vmapped over it
  (each seed its own batch), one backward, each seed's gradient clipped by its own norm, one AdamW over
  the stacked tensors (elementwise, so each seed's update is its own).

It prints both rates in tokens/s (all seeds), their ratio, and how far the stacked seeds' losses are from
the separate runs' after the timed steps (same initial weights, same batches): a check that the stacked
step computes the same training, to float rounding (batched kernels sum in another order).

    python bench/stacked_seeds.py [--preset smoke] [--seeds 8] [--steps 10] [--device cpu] [--threads 2]

(timed steps after 2 warm-up steps, from the same initial weights for both)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sync  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.training.loop import make_optimizer  # noqa: E402
from qkgeom.training.model import GPT  # noqa: E402

VOCAB = 284  # WikiText-2's characters: the shape of the real runs, random ids for the timing


def batches(n_seeds: int, steps: int, cfg: C.RunConfig) -> torch.Tensor:
    """(steps, seeds, B, T + 1) token ids: each seed its own batches, as runs with their own data seeds."""
    g = torch.Generator().manual_seed(0)
    shape = (steps, n_seeds, cfg.train.batch_size, cfg.model.n_ctx + 1)
    return torch.randint(0, VOCAB, shape, generator=g).to(cfg.train.device)


def autocast(cfg: C.RunConfig):
    dev = cfg.train.device.split(":")[0]
    return torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")


def separate(models: list[GPT], cfg: C.RunConfig):
    """One step of every model in turn, as the trainer takes it (AdamW, clip at train.grad_clip)."""
    opts = [make_optimizer(m, cfg.train) for m in models]

    def step(data: torch.Tensor) -> torch.Tensor:
        losses = []
        for m, opt, seq in zip(models, opts, data, strict=True):
            with autocast(cfg):
                loss = m.loss(seq[:, :-1], seq[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), cfg.train.grad_clip or float("inf"))
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    return step


def stacked(models: list[GPT], cfg: C.RunConfig):
    """One step of all models at once: weights stacked on dim 0, the forward vmapped over it."""
    params, buffers = stack_module_state(models)  # each (N, ...) a leaf that requires grad
    base = copy.deepcopy(models[0]).to("meta")
    t = cfg.train
    decay = [p for p in params.values() if p.dim() >= 3]  # matrices (one dim more than in one model)
    rest = [p for p in params.values() if p.dim() < 3]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=t.device.startswith("cuda") or None)
    clip = t.grad_clip or float("inf")

    def one(p, b, seq):
        logits = functional_call(base, (p, b), (seq[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, 1:].reshape(-1))

    many = torch.func.vmap(one)

    def step(data: torch.Tensor) -> torch.Tensor:
        with autocast(cfg):
            losses = many(params, buffers, data)
        opt.zero_grad(set_to_none=True)
        losses.sum().backward()  # each seed's loss reaches only its own slice of the stacked weights
        grads = [p.grad for p in params.values()]
        norms = torch.stack([g.flatten(1).float().pow(2).sum(1) for g in grads]).sum(0).sqrt()  # (N,)
        scale = (clip / (norms + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s rule, per seed
        torch._foreach_mul_(grads, [scale.view(-1, *[1] * (g.dim() - 1)).to(g.dtype) for g in grads])
        opt.step()
        return losses.detach()

    return step


def timed(step, data: torch.Tensor, device: str, warmup: int) -> tuple[float, torch.Tensor]:
    """Seconds of the steps after the first `warmup` (allocations, optimiser state), and the last losses;
    every step from the same initial weights, so the two kinds' losses can be compared."""
    for i, d in enumerate(data):
        if i == warmup:
            sync(device)
            tic = time.perf_counter()
        losses = step(d)
    sync(device)
    return time.perf_counter() - tic, losses


@dataclass
class Comparison:
    separate: float  # tokens/s in all, the seeds one after another (median over reps)
    stacked: float  # tokens/s in all, the seeds stacked
    loss_gap: float  # largest |loss difference| after the timed steps, stacked vs separate
    fallbacks: list[str]  # torch's warnings of operations vmap runs one seed at a time


def compare(cfg: C.RunConfig, n: int, steps: int, reps: int, warmup: int = 2) -> Comparison:
    """`n` seeds at cfg's shape and device: `steps` timed steps of each kind, alternating, `reps` times
    (fresh models each time, both kinds from the same initial weights and batches)."""
    dev = cfg.train.device
    data = batches(n, warmup + steps, cfg)
    tokens = steps * n * cfg.train.batch_size * cfg.model.n_ctx
    rates: dict[str, list[float]] = {"separate": [], "stacked": []}
    last: dict[str, torch.Tensor] = {}
    fallbacks: set[str] = set()
    for _ in range(reps):
        for kind, make in (("separate", separate), ("stacked", stacked)):
            models = [GPT(cfg.model, VOCAB, seed=s).to(dev) for s in range(n)]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                seconds, losses = timed(make(models, cfg), data, dev, warmup)
            fallbacks |= {str(w.message).split(".")[0] for w in caught if "batching rule" in str(w.message)}
            rates[kind].append(tokens / seconds)
            last[kind] = losses.float().cpu()
    gap = (last["stacked"] - last["separate"]).abs().max().item()
    return Comparison(statistics.median(rates["separate"]), statistics.median(rates["stacked"]), gap, sorted(fallbacks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smoke", help="the model and batch shape (smoke, cpu, paper, ...)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions; medians reported")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = C.load(args.preset, [f"train.device='{args.device}'"])
    r = compare(cfg, args.seeds, args.steps, args.reps)
    m = cfg.model
    shape = f"{m.n_layers} layers, d_model {m.d_model}, batch {cfg.train.batch_size} x {m.n_ctx}"
    print(f"{args.preset} shape ({shape}), {args.seeds} seeds, {args.steps} steps, {args.device}, "
          f"{torch.get_num_threads()} threads, median of {args.reps}:")  # fmt: skip
    print(f"  separate (one after another): {r.separate:12,.0f} tokens/s in all")
    print(f"  stacked (vmap over seeds):    {r.stacked:12,.0f} tokens/s in all  ({r.stacked / r.separate:.2f}x)")
    print(f"  after {args.steps} steps, largest |loss difference| stacked vs separate: {r.loss_gap:.2e}")
    for f in r.fallbacks:
        print(f"  torch: {f} (run one seed at a time inside the stacked step)")


if __name__ == "__main__":
    main()
