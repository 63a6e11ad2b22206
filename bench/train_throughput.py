"""Training throughput of `qkgeom train` against nanoGPT's own model.py, in one process, alternating rounds.

qkgeom runs its whole job (probes, evaluations, checkpoints and metrics at the cpu preset's own
intervals, so as dense per step as in a full run; log-spaced early probes off). The peer is
nanoGPT's unmodified `model.py` (karpathy/nanoGPT) in its own training-loop essentials: the same
WikiText-2 characters, batch sampler, shape (cpu preset), AdamW from its `configure_optimizers`,
gradient clipping, `loss.item()` every step. nanoGPT is not vendored: point at its model.py with
--nanogpt or $NANOGPT_MODEL, e.g.

    git -C /path/to/nanoGPT show HEAD:model.py > /tmp/nanogpt_model.py
    python bench/train_throughput.py --nanogpt /tmp/nanogpt_model.py

Without it, an in-file nanoGPT-style loop (fused qkv, SDPA) stands in, and the output says so.
Prints tokens/s of both per configuration, the ratio with a 95% t-interval over rounds, and the
probe share of qkgeom's training time. Targets (issue 13): ratio >= 1.10 at depth 4 and 8, 1 and
2 threads; probes <= 3%.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom import stats  # noqa: E402
from qkgeom.training.data import batch_offsets, gather, load_corpus  # noqa: E402
from qkgeom.training.loop import lr_at, train  # noqa: E402


class PlainBlock(nn.Module):
    """nanoGPT-style block (fallback peer): one fused qkv Linear, SDPA, MLP; no biases."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
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
        self.ln_f = nn.LayerNorm(d, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def load_nanogpt(path: str | None):
    """nanoGPT's (GPT, GPTConfig) from its model.py, or None for the in-file stand-in."""
    if not path:
        return None
    if not Path(path).is_file():
        sys.exit(f"--nanogpt / $NANOGPT_MODEL: no file at {path}")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT, module.GPTConfig


def peer_round(cfg: C.RunConfig, nanogpt, vocab: int, data: np.ndarray, steps: int, seed: int) -> float:
    """Seconds for `steps` steps of the peer's training loop (model built outside the timing)."""
    m, t = cfg.model, cfg.train
    torch.manual_seed(seed)
    if nanogpt:
        GPT, GPTConfig = nanogpt
        conf = GPTConfig(
            block_size=m.n_ctx, vocab_size=vocab, n_layer=m.n_layers, n_head=m.n_heads, n_embd=m.d_model,
            dropout=0.0, bias=False,
        )  # fmt: skip
        model = GPT(conf)
    else:
        model = PlainGPT(vocab, m.d_model, m.n_heads, m.n_layers, m.n_ctx)
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter counts here
        opt = model.configure_optimizers(t.weight_decay, t.lr, (t.beta1, t.beta2), "cpu")
    model.train()
    tic = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = gather(data, batch_offsets(len(data), m.n_ctx, t.batch_size, t.data_seed, step), m.n_ctx)
        _, loss = model(torch.from_numpy(x).contiguous(), torch.from_numpy(y).contiguous())  # nanoGPT .view()s them
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):  # nanoGPT's train.py logs loss.item() every step
            raise RuntimeError("peer diverged")
    return time.perf_counter() - tic


def scaled_config(depth: int, steps: int, compile: bool = False) -> C.RunConfig:
    """The cpu preset at `depth`, shortened to `steps`, with probes, evals and checkpoints at the
    preset's own intervals (so as dense per step as in the full run: 27 probes per 1,000 steps);
    the log-spaced early probes are off, since a short round would otherwise be mostly probes."""
    return C.load(
        "cpu",
        [
            f"model.n_layers={depth}",
            f"train.steps={steps}",
            f"train.warmup_steps={min(steps, 50)}",
            "probe.log_early=false",
            f"train.compile={'true' if compile else 'false'}",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", default=os.environ.get("NANOGPT_MODEL"), help="path to nanoGPT's model.py")
    ap.add_argument("--steps", type=int, default=100, help="optimiser steps per round (default 100)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per configuration (default 4)")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--compile", action="store_true", help="qkgeom side with train.compile = true (torch.compile)")
    args = ap.parse_args()
    require_wikitext()
    nanogpt = load_nanogpt(args.nanogpt)
    peer = f"nanoGPT model.py ({args.nanogpt})" if nanogpt else "in-file nanoGPT-style loop (no --nanogpt given)"
    print(f"peer: {peer}; {args.rounds} alternating rounds of {args.steps} steps per configuration")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for depth in args.depths:
            cfg = scaled_config(depth, args.steps, args.compile)
            corpus = load_corpus(cfg.data)
            data, tokens = corpus.splits["train"], args.steps * cfg.train.batch_size * cfg.model.n_ctx
            peer_round(cfg, nanogpt, corpus.vocab.size, data, 3, 0)  # warm-up
            ratios, ours_tps, peer_tps, probe_share = [], [], [], []
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory() as tmp:
                    done = json.loads(train(cfg, Path(tmp) / "run", progress=False).done.read_text())
                ours = done["segment_seconds"]  # the loop: probes, evals, checkpoints, metrics included
                theirs = peer_round(cfg, nanogpt, corpus.vocab.size, data, args.steps, r)
                ratios.append(theirs / ours)
                ours_tps.append(tokens / ours)
                peer_tps.append(tokens / theirs)
                probe_share.append(done["probe_seconds_last_segment"] / ours)
            lo, hi = stats.t_mean_ci(np.array(ratios))
            print(
                f"threads {threads} depth {depth}: qkgeom {np.mean(ours_tps):8.0f} tok/s, "
                f"peer {np.mean(peer_tps):8.0f} "
                f"tok/s, ratio {np.mean(ratios):.3f} [95% t {lo:.3f}, {hi:.3f}] (target >= 1.10), "
                f"probes {100 * np.mean(probe_share):.2f}% (target <= 3%)",
                flush=True,
            )


if __name__ == "__main__":
    main()
