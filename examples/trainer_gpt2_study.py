"""The paper's claims on someone else's training stack: Hugging Face GPT-2 trained by the `Trainer`,
measured only through `QKGeometryCallback`, then judged by `qkgeom analyze` as any study.

    python examples/trainer_gpt2_study.py --out runs/study-trainer-gpt2 [--seeds 4] [--steps 2000]
    qkgeom report runs/study-trainer-gpt2

Its replication on 8 fresh seeds (docs/results/study-trainer-gpt2-replication/preregistration.toml),
each finished run's record kept there (seeds split over two processes of one thread each):

    python examples/trainer_gpt2_study.py --first-seed 4 --seeds 4 --threads 1 \
        --records docs/results/study-trainer-gpt2-replication &
    python examples/trainer_gpt2_study.py --first-seed 8 --seeds 4 --threads 1 \
        --records docs/results/study-trainer-gpt2-replication
    qkgeom analyze docs/results/study-trainer-gpt2-replication

Model: `GPT2LMHeadModel` from a config at the cpu preset's shape (d_model 128, 4 layers, 4 heads,
context 128; Hugging Face's own init, biases, gelu_new; dropout 0), character-level WikiText-2 as
non-overlapping 128-character blocks of the training split. Trainer: AdamW, lr 2e-3, 50 warm-up steps,
cosine, weight decay 0.1, batch 16, 2,000 steps (4.1 M tokens), data order seed 1000 + seed,
validation loss every 250 steps on 64 validation blocks. Probe: 10 fixed validation sequences (the
cpu preset's own probe batch), every 50 steps (+ log-spaced early).

PRE-REGISTERED (committed before the run; nothing below is changed after it). Verdicts by
`qkgeom analyze` (post-transient window, slopes vs training progress, 95% t over the 4 seeds, mde_80):
  T1  PR_Q slope, pooled > 0           T2  PR_K slope, pooled < 0
  T3  contrast slope, pooled > 0       T4  interaction rank tracks attention entropy (co-movement) > 0
What family-cpu (our own GPT, first 2 M tokens) leads us to expect: T1, T3, T4 hold; for keys, the
first layer contracts and the last layer expands, so T2 may be inconclusive.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from qkgeom.analysis.records import recorded_runs, write_record
from qkgeom.config import DataConfig
from qkgeom.integrations.transformers import QKGeometryCallback
from qkgeom.results import RECORDS_DIR
from qkgeom.training.data import fixed_offsets, gather, load_corpus

CTX, BATCH = 128, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/study-trainer-gpt2")
    p.add_argument("--seeds", type=int, default=4, help="how many seeds")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (the replication starts at 4)")
    p.add_argument("--records", type=Path, help="a study folder: each finished run's record goes to its runs/")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    corpus = load_corpus(DataConfig())
    train, valid = (torch.from_numpy(corpus.splits[s].astype("int64")) for s in ("train", "valid"))
    blocks = train[: len(train) // CTX * CTX].view(-1, CTX)
    valid_blocks = valid[: len(valid) // CTX * CTX].view(-1, CTX)[:64]
    probe_batch = torch.from_numpy(gather(corpus.splits["valid"], fixed_offsets(len(valid), CTX, 10), CTX)[0]).long()
    train_set = [{"input_ids": b, "labels": b} for b in blocks]
    eval_set = [{"input_ids": b, "labels": b} for b in valid_blocks]
    recorded = recorded_runs(args.records) if args.records is not None else set()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        out = Path(args.out) / f"seed{seed}"
        if out.name in recorded:
            print(f"{out.name}: recorded in {args.records}, skipped")
            continue
        if (out / "done.json").is_file():
            print(f"{out}: done, skipped")
            record(out, args.records)
            continue
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=corpus.vocab.size, n_positions=CTX, n_embd=128, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        # eval_steps divides the steps, so the last step is evaluated whatever transformers' version (5.0
        # evaluates only at multiples of eval_steps; later ones also at the end)
        targs = TrainingArguments(
            str(Path(args.out) / "hf" / f"seed{seed}"), max_steps=args.steps, per_device_train_batch_size=BATCH,
            per_device_eval_batch_size=BATCH, learning_rate=2e-3, warmup_steps=50, lr_scheduler_type="cosine",
            weight_decay=0.1, max_grad_norm=1.0, seed=seed, data_seed=1000 + seed, eval_strategy="steps",
            eval_steps=math.gcd(250, args.steps), logging_steps=50, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=False,
        )  # fmt: skip
        callback = QKGeometryCallback(probe_batch, out, every=50, tokens_per_step=BATCH * CTX)
        trainer = Trainer(GPT2LMHeadModel(config), targs, train_dataset=train_set, eval_dataset=eval_set,
                          callbacks=[callback])  # fmt: skip
        trainer.train()
        print(f"{out}: done")
        record(out, args.records)


def record(run: Path, study: Path | None) -> None:
    """The finished run's record under `study`/runs/, stamped with the study's pre-registration."""
    if study is not None:
        print(f"{run.name}: recorded as {write_record(run, study / RECORDS_DIR)}")


if __name__ == "__main__":
    main()
