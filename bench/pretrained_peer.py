"""`qkgeom pretrained` against what a researcher would write instead: an nnsight trace that saves
every layer's fused q/k/v projection and attention pattern, plus torch for the same whole-layer
numbers (PR_Q, PR_K from float64 running covariances; mean attention entropy), on a GPT-2-small-shaped
model (12 layers, d_model 768, 12 heads, random weights, no hub), alternating rounds in one process.

    pip install 'qkgeom[bench]'    # nnsight: not a qkgeom dependency, the benchmark's peer
    python bench/pretrained_peer.py [--tokens 8192] [--rounds 3] [--threads 2]

Prints tokens/s and peak memory of both, the ratio with a 95% t-interval over rounds, and the
largest relative difference between the peer's PR_Q, PR_K, entropy and qkgeom's (they must agree:
the same rows). qkgeom computes far more per pass (per-head PRs, effective and stable ranks, the
logit spectrum of 4 sequences, weight spectra), so a ratio near 1 means its extra rows come free.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys

import numpy as np
import torch
from pretrained_throughput import measure

from qkgeom import config as C
from qkgeom.analysis import stats
from qkgeom.probing.hf import analyse_model, token_batches

PRETRAINED = C.ProbeSettings.of(4, gram_dtype="float32")  # as configs/pretrained.toml measures


def peer_rows(model, batches, n_layers: int, d: int) -> dict[tuple[int, str], float]:
    """The researcher's version: nnsight trace per batch, then torch."""
    import nnsight

    wrapped = nnsight.NNsight(model)
    sums = {(i, s): [torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64), 0]
            for i in range(n_layers) for s in ("q", "k")}  # fmt: skip
    ent = {i: [0.0, 0] for i in range(n_layers)}
    for idx in batches:
        with torch.no_grad(), wrapped.trace(idx):
            qkv, pats = nnsight.save([]), nnsight.save([])
            for i in range(n_layers):
                qkv.append(wrapped.transformer.h[i].attn.c_attn.output)
                pats.append(wrapped.transformer.h[i].attn.output[1])
        for i in range(n_layers):
            q, k, _ = qkv[i].reshape(-1, 3 * d).double().split(d, dim=-1)
            for s, x in (("q", q), ("k", k)):
                acc = sums[(i, s)]
                acc[0] += x.sum(0)
                acc[1] += x.T @ x
                acc[2] += len(x)
            p = pats[i].double()
            h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, H, T) nats
            ent[i][0] += float(h[..., 1:].sum())  # rows with >= 2 visible keys, as qkgeom
            ent[i][1] += h[..., 1:].numel()
    out = {}
    for (i, s), (sx, sxx, n) in sums.items():
        mean = sx / n
        eig = torch.linalg.eigvalsh(sxx / n - torch.outer(mean, mean))
        out[(i, f"{'query' if s == 'q' else 'key'}_participation_ratio")] = float(eig.sum() ** 2 / (eig**2).sum())
    for i, (total, n) in ent.items():
        out[(i, "attention_entropy")] = total / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if importlib.util.find_spec("nnsight") is None:  # the peer is no qkgeom dependency: one line, not a traceback
        sys.exit("bench/pretrained_peer.py needs nnsight, its peer: pip install 'qkgeom[bench]'")
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    model = GPT2LMHeadModel(cfg).eval()
    model.set_attn_implementation("eager")  # the peer reads the pattern the model returns
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens)

    def batches():
        return token_batches(tokens, 256, 8, args.tokens)

    got: dict = {}

    def run_peer() -> None:
        got["peer"] = peer_rows(model, batches(), cfg.n_layer, cfg.n_embd)

    def run_ours() -> None:
        rows, _ = analyse_model(model, batches(), settings=PRETRAINED)
        got["ours"] = rows

    peer_rows(model, token_batches(tokens, 256, 8, 2048), cfg.n_layer, cfg.n_embd)  # warm-up: imports, first calls
    analyse_model(model, token_batches(tokens, 256, 8, 2048), settings=PRETRAINED)
    print(f"GPT-2-small shape, random weights; {args.tokens} tokens, batches of 8 x 256, {args.threads} threads")
    ratios, tps, mem = [], {"peer": [], "ours": []}, {"peer": 0, "ours": 0}
    for _ in range(args.rounds):
        s_peer, m_peer = measure(run_peer)
        s_ours, m_ours = measure(run_ours)
        ratios.append(s_peer / s_ours)
        tps["peer"].append(args.tokens / s_peer)
        tps["ours"].append(args.tokens / s_ours)
        mem = {"peer": max(mem["peer"], m_peer), "ours": max(mem["ours"], m_ours)}
    ours = {(r["layer"], r["metric"]): r["value"] for r in got["ours"] if r["head"] == -1 and r["site"] == "none"}
    diff = max(abs(ours[key] - v) / abs(v) for key, v in got["peer"].items())
    lo, hi = stats.t_mean_ci(np.array(ratios)) if len(ratios) > 1 else (math.nan, math.nan)
    print(
        f"nnsight trace + torch: {np.mean(tps['peer']):.0f} tokens/s, peak RSS +{mem['peer'] / 2**20:.0f} MiB "
        f"({len(got['peer'])} numbers)\n"
        f"qkgeom pretrained:     {np.mean(tps['ours']):.0f} tokens/s, peak RSS +{mem['ours'] / 2**20:.0f} MiB "
        f"({len(got['ours'])} rows)\n"
        f"speed ratio qkgeom / peer {np.mean(ratios):.3f} [95% t {lo:.3f}, {hi:.3f}] over {len(ratios)} rounds; "
        f"largest relative difference on the shared numbers {diff:.1e}"
    )


if __name__ == "__main__":
    main()
