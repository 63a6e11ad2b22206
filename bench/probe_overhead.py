"""The probe's cost over an uninstrumented baseline, in the protocol interpretability-tooling papers
report (5 warm-ups, 10 repetitions, median +- std, one process per system):

- `eager`:    a plain PyTorch loop training Hugging Face GPT-2 (from a config) on WikiText-2 characters,
              without and with `qkgeom.Probe` at every = 100 (steady state: steps 0, 100, 200; the
              log-spaced early probes, 8 more in the first 100 steps, with --log-early);
- `compiled`: the same loop on `torch.compile(model)` (inductor), the probe reading through the wrapper;
- `trainer`:  the README's `Trainer` example without and with `QKGeometryCallback`.

    python bench/probe_overhead.py [--systems eager,compiled,trainer] [--steps 200] [--warmups 5]
                                   [--reps 10] [--log-early] [--d-model 128] [--layers 4] [--threads 2]

Every (system, variant) runs in its own fresh Python process: `--steps` training steps per
repetition, the first `--warmups` repetitions discarded (imports, allocator, compilation), the next
`--reps` timed. Prints, per system, the median +- std seconds of both variants and the overhead
median(with) / median(without) - 1. Target (issue 22): <= 3%. A system that cannot run here (e.g.
no C++ compiler for inductor) is reported as such.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("eager", "compiled", "trainer")


def _data(args):
    import torch
    from common import require_wikitext

    from qkgeom.config import DataConfig
    from qkgeom.training.data import load_corpus

    require_wikitext()
    ids = torch.from_numpy(load_corpus(DataConfig()).splits["train"].astype("int64"))
    blocks = ids[: len(ids) // args.ctx * args.ctx].view(-1, args.ctx)[:20_000]
    return blocks, int(ids.max()) + 1


def _model(args, vocab: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=args.ctx, n_embd=args.d_model, n_layer=args.layers, n_head=4)
    return GPT2LMHeadModel(cfg)


def _loop_once(args, blocks, vocab: int, probed: bool, compiled: bool) -> float:
    """One repetition of the plain loop: a fresh model, --steps updates, with or without a Probe."""
    import torch

    import qkgeom

    model = _model(args, vocab)
    net = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with tempfile.TemporaryDirectory() as tmp:
        probe = (
            qkgeom.Probe(net, blocks[:10], every=100, out=Path(tmp) / "run", steps=args.steps, log_early=args.log_early)
            if probed
            else None
        )
        tic = time.perf_counter()
        for step in range(args.steps):
            if probe is not None:
                probe(step)
            x = blocks[(step * args.batch) % (len(blocks) - args.batch) :][: args.batch]
            net(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if probe is not None:
            probe.finish(args.steps)
        return time.perf_counter() - tic


def _trainer_once(args, blocks, vocab: int, probed: bool) -> float:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from qkgeom.integrations.transformers import QKGeometryCallback

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            str(Path(tmp) / "hf"), max_steps=args.steps, per_device_train_batch_size=args.batch,
            learning_rate=2e-3, seed=0, logging_steps=100, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        data = [{"input_ids": b, "labels": b} for b in blocks[: args.steps * args.batch]]
        callbacks = (
            [
                QKGeometryCallback(
                    blocks[:10],
                    Path(tmp) / "run",
                    every=100,
                    tokens_per_step=args.batch * args.ctx,
                    log_early=args.log_early,
                )
            ]  # fmt: skip
            if probed
            else []
        )
        trainer = Trainer(_model(args, vocab), targs, train_dataset=data, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)
        tic = time.perf_counter()
        trainer.train()
        return time.perf_counter() - tic


def child(args) -> None:
    """One process: one (system, variant), warm-ups then timed repetitions; prints a JSON line."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    blocks, vocab = _data(args)
    probed = args.variant == "with"

    def once() -> float:
        if args.system == "trainer":
            return _trainer_once(args, blocks, vocab, probed)
        return _loop_once(args, blocks, vocab, probed, compiled=args.system == "compiled")

    times = [once() for _ in range(args.warmups + args.reps)][args.warmups :]
    print(json.dumps({"system": args.system, "variant": args.variant, "times": times}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-early", action="store_true", help="also probe at steps 1, 2, 4, ... below 100")
    p.add_argument("--warmups", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system", help=argparse.SUPPRESS)  # set in the child processes
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.system:
        return child(args)
    import numpy as np

    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        sys.exit(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    print(
        f"GPT-2 d_model {args.d_model} x {args.layers} layers, batch {args.batch} x {args.ctx}, {args.steps} steps "
        f"a repetition, {args.warmups} warm-ups + {args.reps} timed, {args.threads} threads; probe every 100 steps"
        f"{' (+ log-spaced early)' if args.log_early else ''}, 10 sequences; one process per system and variant"
    )
    keys = ("steps", "warmups", "reps", "d_model", "layers", "ctx", "batch", "threads")
    passthrough = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    passthrough += ["--log-early"] if args.log_early else []
    for system in systems:
        medians = {}
        for variant in ("without", "with"):
            cmd = [sys.executable, __file__, *passthrough, "--system", system, "--variant", variant]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{system:9s} {variant:7s} could not run here: {last}")
                break
            times = np.array(json.loads(r.stdout.strip().splitlines()[-1])["times"])
            medians[variant] = float(np.median(times))
            print(f"{system:9s} {variant:7s} {np.median(times):8.3f} s +- {times.std(ddof=1):.3f} (median +- std)")
        if len(medians) == 2:
            print(f"{system:9s} overhead {medians['with'] / medians['without'] - 1:+.2%} (target <= 3%)")


if __name__ == "__main__":
    main()
