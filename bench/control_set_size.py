"""The closed loop's control set: its size against what it costs a step and how far the scale it sets
lands off on held-out text (issue 52: choose intervention.control_seqs from a measured trade-off).

    qkgeom train cpu --set model.n_layers=4 --set intervention.control_seqs=16 \
        --set "train.checkpoint_steps=[200,300,400,500,600,700,800,900,1000]" --out runs/pilot-none
    python bench/control_set_size.py runs/pilot-none [--sizes 4 8 16 32 64] [--threads 1] [--from-step 200]

For each kept checkpoint of a finished none run, each control-set size n (n fixed *training* sequences:
the training split, data.fixed_offsets) and each closed-loop arm of causal-v4 (sham, shape 0.8, shape 1.25, hold)
on layers 1-3: the arm's map is applied to a copy of the weights and rescaled so each head's per-row
logit std on the control set equals the unmapped model's there (what the loop does every step). The
held-out error is log(mapped / unmapped) of the per-row logit std on the study's held-out probe batch
(32 validation sequences), per layer as the scale check reads it (the mean over the layer's heads).
The cost is the controller's per-step work at n, in ms on `--threads` threads: the rescaling
(batch_row_std on the 12 controlled heads) plus a tenth of the refresh forward (CachedInputs refreshes
its inputs every 10 steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from qkgeom import config as C
from qkgeom.probing.probe import gpt_weights
from qkgeom.results import RunDir, kept_checkpoint, read_json
from qkgeom.training import complement as K
from qkgeom.training import maps as M
from qkgeom.training.data import Vocab, fixed_offsets, gather, load_corpus
from qkgeom.training.model import GPT

ARMS = ("shape:activation:1:closed", "shape:activation:0.8:closed", "shape:activation:1.25:closed", "hold:key:closed")
LAYERS = (1, 2, 3)
HELD_OUT = 32  # the study's probe batch (probe.n_seqs)


@torch.no_grad()
def layer_row_std(model: GPT, idx: torch.Tensor, layers: tuple[int, ...]) -> np.ndarray:
    """Per layer in `layers`: the mean over heads of the per-row logit std on idx (B, T)."""
    xs = K.attention_inputs(model, idx)
    w_q, w_k = gpt_weights(model)
    out = []
    for li in layers:
        out.append(float(M.batch_row_std(w_q[li], w_k[li], xs[li]).mean()))
    return np.array(out)


def mapped(model: GPT, model0: GPT, label: str, control: torch.Tensor, steps: int) -> GPT:
    """A copy of `model` with arm `label`'s map applied on LAYERS and the closed loop's rescaling fitted
    on `control` (targets: the model's own PR_K and row std on the control set)."""
    ((_, ctl),) = K.instant_controls((label,), *gpt_weights(model0), steps, LAYERS, 1.2, len(control))
    current, cov, inputs = K.self_reference(model, control)
    return K.mapped_copy(model, ctl, 0, current, cov, inputs)


@torch.no_grad()
def step_cost(model: GPT, control: torch.Tensor, reps: int = 20) -> float:
    """ms per training step of the closed loop at this control set: the rescaling of the 12 controlled
    heads, plus a tenth of one refresh forward."""
    w_q, w_k = gpt_weights(model)
    q = torch.cat([w_q[li] for li in LAYERS])
    k = torch.cat([w_k[li] for li in LAYERS])
    tic = time.perf_counter()
    for _ in range(reps):
        xs = K.attention_inputs(model, control)
    refresh = (time.perf_counter() - tic) / reps
    x = torch.cat([xs[li].unsqueeze(0).expand(len(w_q[li]), -1, -1, -1) for li in LAYERS])
    target = torch.ones(len(q), dtype=torch.float64)
    tic = time.perf_counter()
    for _ in range(reps):
        M.match_row_std(q, k, x, target)
    return 1e3 * ((time.perf_counter() - tic) / reps + refresh / 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished none run of the cpu preset with kept checkpoints")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="control-set sizes to try")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a study worker uses 1)")
    ap.add_argument("--from-step", type=int, default=200, help="checkpoints from this step on (past the transient)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rd = RunDir(args.run)
    if not rd.config.is_file():
        sys.exit(f"{args.run} is not a qkgeom run folder (no config.json)")
    info = read_json(rd.config)
    cfg = C.from_dict(info["config"])
    corpus = load_corpus(cfg.data, Vocab.from_json(rd.vocab.read_text()))
    train, valid = corpus.splits["train"], corpus.splits["valid"]
    n_ctx = cfg.model.n_ctx
    held = torch.from_numpy(gather(valid, fixed_offsets(len(valid), n_ctx, HELD_OUT), n_ctx)[0])
    model0 = GPT(cfg.model, corpus.vocab.size, seed=cfg.train.seed)
    kept = info.get("kept_checkpoints", [])
    steps = sorted(s for s in kept if s >= args.from_step)
    if not steps:  # one line, not numpy's error on an empty quantile
        sys.exit(f"{args.run}: no kept checkpoint at step >= {args.from_step} (kept: {kept or 'none'}); "
                 "train it with train.checkpoint_steps as above, or lower --from-step")  # fmt: skip
    print(f"run {rd.path.name}: checkpoints {steps}; arms {', '.join(ARMS)}; layers {LAYERS}")
    print(f"held-out error: |log| of the layer's mean per-row logit std on {HELD_OUT} validation sequences")
    print(f"{'n':>4} {'ms/step':>8} {'|err| median':>13} {'|err| p95':>10} {'|err| max':>10}")
    for n in args.sizes:
        control = torch.from_numpy(gather(train, fixed_offsets(len(train), n_ctx, n), n_ctx)[0])
        errs = []
        model = GPT(cfg.model, corpus.vocab.size)
        for s in steps:
            model.load_state_dict(rd.load_checkpoint(kept_checkpoint(s))["model"])
            base = layer_row_std(model, held, LAYERS)
            for label in ARMS:
                errs += np.log(
                    layer_row_std(mapped(model, model0, label, control, cfg.train.steps), held, LAYERS) / base
                ).tolist()
        e = np.abs(np.array(errs))
        cost = step_cost(model, control)
        print(f"{n:>4} {cost:>8.2f} {np.median(e):>13.4f} {np.quantile(e, 0.95):>10.4f} {e.max():>10.4f}")


if __name__ == "__main__":
    main()
