"""The probe's cost inside someone else's training run: the README's Hugging Face `Trainer` example
(GPT-2 from a config, WikiText-2 characters) with and without `QKGeometryCallback` at the default
interval (every = 100), alternating rounds in one process.

    python bench/probe_overhead.py [--steps 1000] [--rounds 3] [--d-model 128] [--layers 4] [--threads 2]

Prints, per round, the wall time of both runs and their ratio, then the mean overhead with a 95%
t-interval over rounds, and the probe's own share of the run (probe seconds / run seconds, from the
run folder's done.json), which the machine's noise touches less. Target (issue 22): <= 3%.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import require_wikitext
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from qkgeom.analysis.stats import t_mean_ci
from qkgeom.config import DataConfig
from qkgeom.integrations.transformers import QKGeometryCallback
from qkgeom.training.data import load_corpus


def run(args, blocks: torch.Tensor, vocab: int, out: Path | None) -> float:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=args.ctx, n_embd=args.d_model, n_layer=args.layers, n_head=4)
    targs = TrainingArguments(
        str(Path(tempfile.mkdtemp()) / "hf"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=2e-3, seed=0, logging_steps=100, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    data = [{"input_ids": b, "labels": b} for b in blocks]
    callbacks = [QKGeometryCallback(blocks[:10], out, every=100, tokens_per_step=args.batch * args.ctx)] if out else []
    trainer = Trainer(GPT2LMHeadModel(cfg), targs, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # no loss dicts on stdout
    tic = time.perf_counter()
    trainer.train()
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    require_wikitext()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    ids = torch.from_numpy(load_corpus(DataConfig()).splits["train"].astype("int64"))
    blocks = ids[: len(ids) // args.ctx * args.ctx].view(-1, args.ctx)[:20_000]
    vocab = int(ids.max()) + 1
    print(
        f"Trainer, GPT-2 d_model {args.d_model} x {args.layers} layers, batch {args.batch} x {args.ctx}, "
        f"{args.steps} steps, {args.threads} threads; probe every 100 steps (+ log-spaced early), 10 sequences"
    )
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: first Trainer, first probe (imports, allocator)
        short = argparse.Namespace(**{**vars(args), "steps": 20})
        run(short, blocks, vocab, None)
        run(short, blocks, vocab, Path(tmp) / "run")
    overheads, shares = [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            plain = run(args, blocks, vocab, None)
            probed = run(args, blocks, vocab, Path(tmp) / "run")
            done = json.loads((Path(tmp) / "run" / "done.json").read_text())
        overheads.append(probed / plain - 1)
        shares.append(done["probe_seconds"] / probed)
        print(
            f"round {r}: without {plain:.1f} s, with {probed:.1f} s: overhead {overheads[-1]:+.2%}; "
            f"probes {done['probe_seconds']:.2f} s = {shares[-1]:.2%} of the run"
        )
    lo, hi = t_mean_ci(np.array(overheads))
    print(
        f"overhead {np.mean(overheads):+.2%} [{lo:+.2%}, {hi:+.2%}] (95% t over {args.rounds} rounds); "
        f"probe share {np.mean(shares):.2%} (target <= 3%)"
    )


if __name__ == "__main__":
    main()
