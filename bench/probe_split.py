"""One probe's time, split by part, at a given width (issue 53: probes were 83% of a GPT-2-small-width
job on a GPU, about 10 s each).

A probe of our GPT (qkgeom.probing.probe.probe_gpt) is five parts, timed here one by one on the same
model and batch:

- forward:    the instrumented forward pass that hands q, k and the attention pattern of each layer to
              the accumulator as it reaches the layer (probe_gpt streams; nothing of a layer is kept);
- accumulate: covariances (float64 Gram sums) and attention entropy, per layer, inside the forward
              (and the copies of the logit sequences it holds);
- logits:     the logit (Q K^T) spectra of the first `logit_max_seqs` sequences (T x T solves), every
              layer's together after the forward (a tree from before 2026-12-05: per layer, inside it);
- solves:     the covariance eigen-solves and the rows they give (GeometryAccumulator.rows);
- weights:    the weight side (singular values of W_Q, W_K, W_V, W_O and W_Q W_K^T per head) ...
- fits:       ... and its power-law alpha fits (timed apart from the weight spectra);
- write:      the rows as a parquet table (what a run folder keeps).

    python bench/probe_split.py [--width 768 --layers 12 --heads 12 --ctx 256] [--reps 3]
                                [--device cpu] [--threads 2]

Defaults are GPT-2-small width with the run's own probe batch (probe.n_seqs = 0: enough sequences for
10 tokens per dimension, 30 at d_model 768; logit_max_seqs = 4). Prints the median seconds of each
part over --reps repetitions (after one warm-up), its share, and the whole probe_gpt call timed on
its own, against the time of one bare training step at the same shape (the issue's target: a probe
costs at most 10 bare steps on a GPU).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch
from common import SolveClock, sync


def probe_parts(model, idx, cap: int, device: str) -> dict[str, float]:
    """Seconds of each part of one probe_gpt call on `model` and probe batch `idx` (logit spectra of the
    first `cap` sequences, 0: all), in the order probe_gpt runs them (the module docstring names the parts)."""
    import pandas as pd

    from qkgeom import config as C
    from qkgeom.probing import geometry as G
    from qkgeom.probing import probe as P
    from qkgeom.probing import weights as W
    from qkgeom.probing.alpha import power_law_alphas

    settings = C.ProbeSettings.of(cap)
    conv = settings.conventions
    t: dict[str, float] = {}

    def tick(name: str, t0: float) -> float:
        sync(device)
        now = time.perf_counter()
        t[name] = now - t0
        return now

    inner = {"accumulate": 0.0, "logits": 0.0}

    def on_layer(i: int, q, k, pat) -> None:  # probe_gpt's per-layer work, each half timed
        sync(device)
        t1 = time.perf_counter()
        acc._update_stats(i, q, k, pat, G.causal_support(q.shape[2]).expand(q.shape[0], -1), None)
        sync(device)
        t2 = time.perf_counter()
        if held:  # the layer's logit sequences copied aside, solved with the others' after the forward
            acc._hold_logits(i, q, k, True, None, 1.0)
        else:  # a tree from before 2026-12-05: each layer's logit spectra solved as the forward reaches it
            acc._update_logits([i], [q], [k], True, None, [1.0])
        sync(device)
        inner["accumulate"] += t2 - t1
        inner["logits"] += time.perf_counter() - t2

    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        acc = P.GeometryAccumulator(settings=settings)
        held = hasattr(acc, "_hold_logits")
        P.stream_gpt(model, idx, on_layer)  # the forward, each layer accumulated as it is reached
        t0 = tick("forward", t0)
        t["forward"] -= sum(inner.values())
        if held:
            acc._solve_held()
            t0 = tick("held logits", t0)
            inner["logits"] += t.pop("held logits")
        t |= inner
        rows = acc.rows()
        acc.spectra()
        t0 = tick("solves", t0)
        fitted = []
        real_fill = W._fill_alphas
        W._fill_alphas = lambda pending, convention: fitted.append((pending, convention))
        try:
            w_v, w_o = P.gpt_value_output(model)
            w_rows, _ = P.weight_geometry(*P.gpt_weights(model), w_v=w_v, w_o=w_o, conventions=conv)
        finally:
            W._fill_alphas = real_fill
        t0 = tick("weights", t0)
        for pending, convention in fitted:
            power_law_alphas([ev for _, ev in pending], convention=convention)
        t0 = tick("fits", t0)
        buf = io.BytesIO()
        pd.DataFrame(rows + w_rows).to_parquet(buf, index=False)
        tick("write", t0)
    return t


def seconds_per_probe(model, idx, cap: int, device: str, reps: int = 3) -> float:
    """One whole probe_gpt call on `model` and `idx` (logit spectra of the first `cap` sequences, 0: all),
    called as the training loop calls it (outside no_grad): the median of `reps` after a warm-up."""
    from qkgeom import config as C
    from qkgeom.probing.probe import probe_gpt

    def once() -> float:
        sync(device)
        t0 = time.perf_counter()
        probe_gpt(model, idx, C.ProbeSettings.of(cap))
        sync(device)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(reps))


def decomposition_seconds(model, idx, cap: int, device: str) -> tuple[float, float]:
    """(whole probe_gpt, the part of it inside qkgeom's decompositions, common.SolveClock) of one call
    after a warm-up."""
    from qkgeom import config as C
    from qkgeom.probing.probe import probe_gpt

    probe_gpt(model, idx, C.ProbeSettings.of(cap))
    with SolveClock() as clock:
        sync(device)
        t0 = time.perf_counter()
        probe_gpt(model, idx, C.ProbeSettings.of(cap))
        sync(device)
    return time.perf_counter() - t0, clock.seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="training batch of the bare-step reference")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from qkgeom import config as C
    from qkgeom.training.model import GPT

    cfg = C.load("paper", [f"model.d_model={args.width}", f"model.n_layers={args.layers}",
                           f"model.n_heads={args.heads}", f"model.n_ctx={args.ctx}"])  # fmt: skip
    n_seqs = C.probe_n_seqs(cfg)
    torch.manual_seed(0)
    model = GPT(cfg.model, vocab_size=284).to(args.device).eval()
    idx = torch.randint(0, 284, (n_seqs, args.ctx), device=args.device)
    cap = cfg.probe.logit_max_seqs

    def bare_step() -> float:
        train_model = GPT(cfg.model, vocab_size=284).to(args.device).train()
        opt = torch.optim.AdamW(train_model.parameters(), lr=1e-4)
        x = torch.randint(0, 284, (args.batch, args.ctx), device=args.device)
        times = []
        for _ in range(3):
            sync(args.device)
            t0 = time.perf_counter()
            loss = train_model.loss(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(args.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    probe_parts(model, idx, cap, args.device)  # warm-up
    reps = [probe_parts(model, idx, cap, args.device) for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    total = sum(med.values())
    probe = seconds_per_probe(model, idx, cap, args.device, args.reps)
    whole, solving = decomposition_seconds(model, idx, cap, args.device)
    step = bare_step()
    print(
        f"probe at d_model {args.width}, {args.layers} layers x {args.heads} heads, context {args.ctx}, "
        f"{n_seqs} probe sequences (logit spectra of {cap}), {args.device}, {torch.get_num_threads()} threads"
    )
    print(f"{'part':<12}{'median s':>10}{'share':>8}")
    for k, v in med.items():
        print(f"{k:<12}{v:>10.3f}{v / total:>8.1%}")
    print(f"{'sum':<12}{total:>10.3f}")
    print(f"decompositions (qkgeom.solves, on the host on any device): {solving:.3f} s of one {whole:.3f} s probe "
          f"({solving / whole:.0%})")  # fmt: skip
    print(f"probe_gpt, whole: {probe:.3f} s; one bare training step (batch {args.batch}): {step:.3f} s; "
          f"probe / step = {probe / step:.1f} (target on a GPU: <= 10)")  # fmt: skip


if __name__ == "__main__":
    main()
