"""Training tokens/s of `qkgeom train` (cpu preset) vs a minimal plain-PyTorch loop, in one process.

Targets (issue 2): ratio >= 0.95, probes <= 5% of training time. Usage:
    python bench/train_throughput.py [--steps 300] [--depth 4] [--batch 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.data import batch_offsets, gather, load_corpus  # noqa: E402
from qkgeom.train import train  # noqa: E402


class PlainBlock(nn.Module):
    """nanoGPT-style block: one fused qkv Linear, SDPA, MLP; same sizes as qkgeom's GPT."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.fc, self.proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(z)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, d: int, h: int, n_layers: int, n_ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(n_ctx, d)
        self.blocks = nn.ModuleList(PlainBlock(d, h) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.T


def plain_loop(cfg: C.RunConfig, steps: int) -> float:
    """Seconds for `steps` optimiser steps of the plain loop (same data sampling, AdamW, clipping)."""
    corpus = load_corpus(cfg.data)
    data, m, t = corpus.splits["train"], cfg.model, cfg.train
    model = PlainGPT(corpus.vocab.size, m.d_model, m.n_heads, m.n_layers, m.n_ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    tic = time.perf_counter()
    for step in range(steps):
        x, y = gather(data, batch_offsets(len(data), m.n_ctx, t.batch_size, t.data_seed, step), m.n_ctx)
        logits = model(torch.from_numpy(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        if not math.isfinite(loss.item()):
            raise RuntimeError("plain loop diverged")
    return time.perf_counter() - tic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    require_wikitext()
    torch.set_num_threads(args.threads)
    cfg = C.load("cpu", [f"model.n_layers={args.depth}", f"train.batch_size={args.batch}", f"train.steps={args.steps}"])
    tokens = args.steps * args.batch * cfg.model.n_ctx
    plain_loop(cfg, 5)  # warm-up: allocator, thread pool, data cache
    plain_s = plain_loop(cfg, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        tic = time.perf_counter()
        rd = train(cfg, Path(tmp) / "run", progress=False)
        ours_s = time.perf_counter() - tic
        done = json.loads(rd.done.read_text())
        n_probes = len(json.loads(rd.config.read_text())["probe_steps"])
    # ours_s includes start-up (config/provenance, corpus open, model build); report training-loop time too
    loop_s = done["segment_seconds"]
    print(
        f"config: cpu preset, depth {args.depth}, batch {args.batch}, n_ctx {cfg.model.n_ctx}, {args.steps} steps, "
        f"{args.threads} threads, probe.every={cfg.probe.every} ({n_probes} probes incl. log-spaced early ones)"
    )
    print(f"plain PyTorch loop : {tokens / plain_s:10.0f} tokens/s  ({plain_s:.1f} s)")
    print(f"qkgeom train (loop): {tokens / loop_s:10.0f} tokens/s  ({loop_s:.1f} s, probes+eval+checkpoints included)")
    print(f"qkgeom train (call): {tokens / ours_s:10.0f} tokens/s  ({ours_s:.1f} s, start-up included)")
    print(f"ratio qkgeom/plain : {plain_s / loop_s:.3f}   (target >= 0.95)")
    print(
        f"probe share        : {100 * done['probe_seconds_last_segment'] / loop_s:.2f}% of training time (target <= 5%)"
    )


if __name__ == "__main__":
    main()
