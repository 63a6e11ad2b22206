"""`qkgeom pretrained` streaming vs a plain forward with output_attentions=True, in one process.

Models (random weights, built from configs, no hub access):
  --shape pythia   Pythia-70M-shaped GPT-NeoX (6 layers, d_model 512, 8 heads, partial rotary 25%)
  --shape gqa30    SmolLM2-135M-shaped Llama (30 layers, d_model 576, 9 query / 3 key heads)
Targets (issues 5, 12): tokens/s >= 0.7x the plain forward's with output_attentions (issue 12: on
gqa30 at >= 8,192 tokens); peak memory the same at two token counts --factor (10) x apart. Peak memory is the
resident set size sampled every 5 ms during each call, above the level before the call.
Plain forward and qkgeom alternate, --rounds times per token count; the ratio is given with a 95%
t-interval over rounds.
Usage: python bench/pretrained_throughput.py [--shape gqa30] [--tokens 8192] [--factor 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from qkgeom import config as C
from qkgeom.analysis import stats
from qkgeom.probing.hf import analyse_model, load_model, token_batches


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def measure(fn) -> tuple[float, int]:
    """(seconds, peak RSS increase in bytes) of fn()."""
    base, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    tic = time.perf_counter()
    fn()
    seconds = time.perf_counter() - tic
    stop.set()
    t.join()
    return seconds, max(peak[0], rss()) - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="smaller token count (the larger is --factor x)")
    ap.add_argument("--factor", type=int, default=10, help="the larger token count / the smaller (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per token count (default 3)")
    ap.add_argument("--seq-len", type=int, default=256, help="as qkgeom pretrained (default 256)")
    ap.add_argument("--batch-size", type=int, default=8, help="as qkgeom pretrained (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=["pythia", "gqa30"], default="pythia")
    ap.add_argument("--logit-seqs", type=int, default=4, help="sequences in the logit-spectrum sample (default 4)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.shape == "pythia":
        cfg = GPTNeoXConfig(
            num_hidden_layers=6,
            hidden_size=512,
            num_attention_heads=8,
            intermediate_size=2048,
            vocab_size=50304,
            rotary_pct=0.25,
            max_position_embeddings=2048,
        )
        label = "Pythia-70M-shaped GPT-NeoX"
    else:
        cfg = LlamaConfig(
            num_hidden_layers=30,
            hidden_size=576,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        label = "SmolLM2-135M-shaped Llama (30 layers, 9/3 GQA heads)"
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.factor * args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        ours = load_model(tmp)
        plain = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()

    def run_plain(n: int) -> None:
        with torch.no_grad():
            for idx in token_batches(tokens, args.seq_len, args.batch_size, n):
                plain(input_ids=idx, output_attentions=True)

    def run_ours(n: int) -> None:
        analyse_model(
            ours, token_batches(tokens, args.seq_len, args.batch_size, n),
            settings=C.ProbeSettings.of(args.logit_seqs, gram_dtype="float32"),
        )  # fmt: skip

    run_plain(args.seq_len * args.batch_size)  # warm-up
    run_ours(args.seq_len * args.batch_size)
    print(
        f"{label}, random weights; batches of {args.batch_size} x {args.seq_len}, {args.threads} threads, "
        f"logit spectrum from the first {args.logit_seqs} sequences"
    )
    peak = {}
    for n in (args.tokens, args.factor * args.tokens):
        ratios, tps = [], {"plain": [], "ours": []}
        for _ in range(args.rounds):  # alternating, so drifts in machine load hit both sides alike
            s_plain, m_plain = measure(lambda n=n: run_plain(n))
            s_ours, m_ours = measure(lambda n=n: run_ours(n))
            ratios.append(s_plain / s_ours)
            tps["plain"].append(n / s_plain)
            tps["ours"].append(n / s_ours)
            peak[n] = max(peak.get(n, 0), m_ours)
        lo, hi = stats.t_mean_ci(np.array(ratios)) if len(ratios) > 1 else (math.nan, math.nan)
        print(
            f"{n:7d} tokens: plain forward + output_attentions {np.mean(tps['plain']):6.0f} tokens/s "
            f"(peak RSS +{m_plain / 2**20:.0f} MiB), qkgeom pretrained {np.mean(tps['ours']):6.0f} tokens/s; "
            f"ratio {np.mean(ratios):.3f} [95% t {lo:.3f}, {hi:.3f}] over {len(ratios)} rounds "
            f"({', '.join(f'{r:.3f}' for r in ratios)}) (target >= 0.7)",
            flush=True,
        )
    small, large = peak[args.tokens], peak[args.factor * args.tokens]
    print(
        f"qkgeom peak memory: +{small / 2**20:.1f} MiB at {args.tokens} tokens, +{large / 2**20:.1f} MiB at "
        f"{args.factor * args.tokens} tokens (target: the same)"
    )


if __name__ == "__main__":
    main()
