"""Does a fresh process's first vector-math call on a CPU give the bits of its second?

torch computes sqrt, log, exp and their kin on a CPU with oneMKL's vector math, each of its threads on
its chunk of the tensor; oneMKL 2024.2 (inside torch 2.13's CPU wheels) picks a function's kernel on
that function's first call, and a first call made by two threads at once can run one thread's chunk
on a low-accuracy kernel (pytorch/pytorch#188792). The next call is right again.

Each of N fresh processes (2 torch threads) runs one layer of a GPT-2-small-width model and, inside the
forward as a probe does, makes its first vector-math call twice: torch.log of the (B, H, T) float64 key
counts (as the entropy did) or torch.sqrt of float32 (B, H, T, T) score magnitudes (as the logit row
std does), and compares the first call with the second. Two arms alternate:
`cold` (QKGEOM_VML_WARMUP=0: qkgeom leaves the kernels unresolved, as it did before 2026-12-05) and
`settled` (importing qkgeom.solves first calls each vector-math function once on one element, on one
thread). Prints, per arm and op, in how many processes the first call differed from the second.

    python bench/vml_race.py [--processes 100] [--threads 2]   # 4 x 100 processes: ~10 minutes

Run it on a quiet machine: the race needs both threads in the first call at the same moment.
"""

import argparse
import os
import subprocess
import sys
from collections import Counter

CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from qkgeom import config as C
from qkgeom.probing import geometry as G
from qkgeom.probing.probe import stream_gpt
from qkgeom.training.model import GPT
cfg = C.load("paper", ["model.d_model=768", "model.n_layers=1", "model.n_heads=12", "model.n_ctx=64"])
torch.manual_seed(0)
model, idx = GPT(cfg.model, vocab_size=284).eval(), torch.randint(0, 284, (30, 64))
support = G.causal_support(64).expand(30, -1)[:, None, :].expand(30, 12, 64)
def on_layer(i, q, k, pat):
    G.attention_entropy(pat, support)
    if sys.argv[2] == "log":  # the first vector-math call of the process, made twice
        x, f = support.to(torch.float64), torch.log
    else:
        x, f = (q @ k.transpose(-1, -2)).abs(), torch.sqrt
    a, b = f(x), f(x)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).max()
    print(int((a != b).sum()), float(rel))
stream_gpt(model, idx, on_layer)
"""

OPS = {"log float64": "log", "sqrt float32": "sqrt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=100, help="processes per arm and op")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    arms = {"cold": "0", "settled": "1"}
    bad: dict[str, Counter] = {arm: Counter() for arm in arms}
    worst: dict[str, float] = {arm: 0.0 for arm in arms}
    for i in range(args.processes):
        for arm, flag in arms.items():  # alternating, so every arm sees the same machine
            for op, name in OPS.items():
                env = {**os.environ, "QKGEOM_VML_WARMUP": flag}
                child = [sys.executable, "-c", CHILD, str(args.threads), name]
                n, rel = subprocess.run(child, capture_output=True, text=True, check=True, env=env).stdout.split()
                bad[arm][op] += int(n) > 0
                worst[arm] = max(worst[arm], float(rel))
        print(f"\r{i + 1}/{args.processes} processes per arm and op", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for arm in arms:
        counts = ", ".join(f"{op} {bad[arm][op]}" for op in OPS)
        print(f"{arm:8s} first call differed from the second in: {counts} (of {args.processes} processes; "
              f"largest relative difference {worst[arm]:.1e})")  # fmt: skip


if __name__ == "__main__":
    main()
