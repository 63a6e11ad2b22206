"""Does a probe's normalised attention entropy repeat bit for bit from one process to the next on a CPU?

Each of N fresh processes (2 torch threads) runs one layer of a GPT-2-small-width model on the same
batch and, inside the forward as the probe does, divides each row's entropy by log k (k the keys the
row sees) two ways: `torch.log` of the (B, H, T) float64 support, as qkgeom did up to 2026-12-05,
and qkgeom.probing.geometry.attention_entropy (a table of math.log values, gathered). Prints how many
distinct results each way gave over the N processes: 1 means it repeats.

    python bench/entropy_repeat.py [--processes 40] [--threads 2]

2026-12-05, this project's 2-core CPU (Intel, AVX-512, torch 2.13): torch.log gave 3 distinct results in
40 processes (5 off by ~1 ulp in most rows, at most 2e-13 relative), the table 1 (the majority's bits);
with 1 thread torch.log repeated in 19 of 19 processes (found by comparing two runs of a whole probe).
"""

import argparse
import subprocess
import sys
from collections import Counter

CHILD = """
import hashlib, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from qkgeom import config as C
from qkgeom.probing import geometry as G
from qkgeom.probing.probe import stream_gpt
from qkgeom.training.model import GPT
cfg = C.load("paper", ["model.d_model=768", "model.n_layers=1", "model.n_heads=12", "model.n_ctx=64"])
torch.manual_seed(0)
model, idx = GPT(cfg.model, vocab_size=284).eval(), torch.randint(0, 284, (30, 64))
support = G.causal_support(64).expand(30, -1)[:, None, :].expand(30, 12, 64)
def digest(t): return hashlib.md5(t.numpy().tobytes()).hexdigest()[:12]
def on_layer(i, q, k, pat):
    h, table = G.attention_entropy(pat, support)
    kk = support.to(torch.float64)
    old = torch.where(kk >= 2, h / torch.where(kk >= 2, torch.log(kk), 1.0), float("nan"))
    print(digest(old), digest(table))
stream_gpt(model, idx, on_layer)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    seen: dict[str, Counter] = {"torch.log": Counter(), "log table": Counter()}
    for i in range(args.processes):
        child = [sys.executable, "-c", CHILD, str(args.threads)]
        out = subprocess.run(child, capture_output=True, text=True, check=True)
        old, table = out.stdout.split()
        seen["torch.log"][old] += 1
        seen["log table"][table] += 1
        print(f"\r{i + 1}/{args.processes} processes", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for way, counts in seen.items():
        tally = ", ".join(f"{n} x {d[:6]}" for d, n in counts.most_common())
        print(f"{way:10s} {len(counts)} distinct result(s) in {args.processes} processes: {tally}")


if __name__ == "__main__":
    main()
