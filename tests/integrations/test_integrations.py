"""The callbacks through the real trainers: a Hugging Face `Trainer` run and a Lightning run of tiny
random models, each giving run folders that `qkgeom analyze` and `qkgeom report` read; and the core
never imports them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from qkgeom.results import read_json
from tests.conftest import REPO, need

VOCAB, T, B = 40, 32, 8


def blocks(n: int = 256) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(7))


def test_trainer_callback_runs_to_analyze_and_report(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from qkgeom.cli import main
    from qkgeom.integrations.transformers import QKGeometryCallback

    data = [{"input_ids": b, "labels": b} for b in blocks()]
    histories = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4))
        args = TrainingArguments(
            str(tmp_path / f"hf{seed}"), max_steps=24, per_device_train_batch_size=B, learning_rate=3e-3, seed=seed,
            logging_steps=8, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        callback = QKGeometryCallback(blocks()[:4], tmp_path / "runs" / f"seed{seed}", every=8, tokens_per_step=B * T)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
        trainer.train()
        histories[seed] = trainer.state.log_history
    run = tmp_path / "runs" / "seed1"
    g = pd.read_parquet(run / "geometry.parquet")
    assert sorted(g["step"].unique()) == [0, 1, 2, 4, 8, 16, 24]
    assert set(g.loc[g["step"] == 16, "tokens_seen"]) == {16 * B * T}
    cfg = read_json(run / "config.json")["config"]
    assert (cfg["train"]["seed"], cfg["train"]["steps"], cfg["model"]["n_layers"]) == (1, 24, 2)
    logged = {h["step"]: h["loss"] for h in histories[1] if "loss" in h}
    train_rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in train_rows if r["split"] == "train"} == logged  # the Trainer's own losses

    assert main(["analyze", str(tmp_path / "runs")]) == 0, capsys.readouterr().err
    claims = pd.read_csv(tmp_path / "runs" / "claims.csv")
    contrast = claims[claims["claim"].str.startswith("PR_Q - PR_K > 0") & (claims["group"] == "all")]
    assert set(contrast["n"]) == {2}  # two seeds, one design
    assert main(["report", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "runs" / "report" / "index.html").is_file()


def test_lightning_callback_runs_to_analyze_and_report(tmp_path, capsys):
    import lightning as L

    from qkgeom.cli import main
    from qkgeom.integrations.lightning import QKGeometryCallback
    from tests.conftest import tiny_llama_module

    for seed in (0, 1):
        L.seed_everything(seed, verbose=False)
        callback = QKGeometryCallback(blocks()[:4], tmp_path / "runs" / f"seed{seed}", every=5)  # seed_everything's
        trainer = L.Trainer(
            max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, accumulate_grad_batches=2, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(tiny_llama_module(VOCAB, T), torch.utils.data.DataLoader(blocks(), batch_size=B))
    recorded = [json.loads((tmp_path / "runs" / f"seed{s}" / "config.json").read_text()) for s in (0, 1)]
    assert [c["config"]["train"]["seed"] for c in recorded] == [0, 1]  # were both 0: one replicate for analyze
    g = pd.read_parquet(tmp_path / "runs" / "seed0" / "geometry.parquet")
    # two micro-batches per optimiser step: each step is probed once
    assert sorted(g["step"].unique()) == [0, 1, 2, 4, 5, 10, 12]
    assert len(g[(g["step"] == 5) & (g["metric"] == "key_participation_ratio") & (g["head"] == -1)]) == 4  # 2 sites
    from qkgeom import load_runs

    rows = load_runs(tmp_path / "runs")  # one site per metric for a training-run analysis
    assert rows.groupby(["run_id", "step", "layer", "head", "metric"]).size().max() == 1
    assert set(rows.loc[rows["metric"] == "key_participation_ratio", "site"]) == {"post_rotary"}
    assert main(["analyze", str(tmp_path / "runs")]) == 0, capsys.readouterr().err
    assert main(["report", str(tmp_path / "runs")]) == 0
    losses = [json.loads(x) for x in (tmp_path / "runs" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 24 and np.isfinite([r["loss"] for r in losses]).all()  # one per micro-batch


@pytest.mark.parametrize("extra", ["transformers", "lightning"])
@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"every": 0}, "every must be a positive number of steps, got 0"),
        ({"tensorbaord": "tb"}, "unexpected keyword argument 'tensorbaord'"),
        ({"resume": True}, "resume is set by the callback itself"),
        ({"steps": -1}, r"steps \(the run's length\) must be >= 0, got -1"),
        ({"logit_max_seqs": -2}, "logit_max_seqs must be >= 0"),
        ({"pr_convention": "rank"}, "pr_convention must be one of"),
        ({"batch": blocks()[:4].float()}, "the probe batch must be input ids"),
    ],
)
def test_callbacks_refuse_bad_arguments_when_built(extra, kwargs, why, tmp_path):
    """Refused where the callback is built, not after the trainer has set up and training started
    (the Probe they build then would refuse the same, the typo as a TypeError)."""
    from qkgeom.probing.tracking import ProbeError

    need({"transformers": "accelerate", "lightning": "lightning"}[extra])
    module = __import__(f"qkgeom.integrations.{extra}", fromlist=["QKGeometryCallback"])
    kwargs = {"batch": blocks()[:4], "out": tmp_path / "run"} | kwargs
    with pytest.raises(ProbeError, match=why):
        module.QKGeometryCallback(**kwargs)
    assert not (tmp_path / "run").exists()
    module.QKGeometryCallback(blocks()[:4], tmp_path / "run", every=5, logit_max_seqs=2, pr_convention="singular")


def test_the_core_never_imports_the_integrations():
    code = (
        "import sys, qkgeom, qkgeom.cli, qkgeom.report.study, qkgeom.probing.tracking, qkgeom.training.loop\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'accelerate', 'tensorboard')"
        " or m.startswith('qkgeom.integrations'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    from tests.e2e.test_layering import imports_of  # every import, also inside functions

    core = [p for p in (REPO / "qkgeom").rglob("*.py") if "integrations" not in p.parts]
    assert not [p.name for p in core if any(d.startswith("integrations") for d in imports_of(p))]


def test_trainer_resume_from_checkpoint_continues_the_run_folder(tmp_path):
    """A Trainer run that dies at step 12 and resumes from its step-8 checkpoint ends with the
    probes of an uninterrupted run."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from qkgeom.integrations.transformers import QKGeometryCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 12:
                raise RuntimeError("crash at step 12")

    data = [{"input_ids": b, "labels": b} for b in blocks()]

    def trainer(name: str, callbacks: list) -> Trainer:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4))
        args = TrainingArguments(
            str(tmp_path / name), max_steps=16, per_device_train_batch_size=B, learning_rate=3e-3, seed=0,
            save_steps=8, report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=2,
        )  # fmt: skip
        return Trainer(model, args, train_dataset=data, callbacks=callbacks)

    trainer("whole", [QKGeometryCallback(blocks()[:4], tmp_path / "whole", every=8)]).train()
    callback = QKGeometryCallback(blocks()[:4], tmp_path / "resumed", every=8)
    with pytest.raises(RuntimeError, match="crash at step 12"):
        trainer("ckpt", [callback, Crash()]).train()
    assert not (tmp_path / "resumed" / "done.json").exists()
    trainer("ckpt", [callback]).train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-8"))
    whole = pd.read_parquet(tmp_path / "whole" / "geometry.parquet")
    resumed = pd.read_parquet(tmp_path / "resumed" / "geometry.parquet")
    assert sorted(resumed["step"].unique()) == sorted(whole["step"].unique()) == [0, 1, 2, 4, 8, 16]
    key = ["step", "layer", "head", "site", "metric"]
    merged = whole.merge(resumed, on=key, suffixes=("_whole", "_resumed"))
    assert len(merged) == len(whole) == len(resumed)
    np.testing.assert_allclose(merged["value_resumed"], merged["value_whole"], rtol=1e-5, atol=1e-8)
    # the losses the crashed run logged after its checkpoint are logged again, not twice
    assert metric_steps(tmp_path / "resumed") == metric_steps(tmp_path / "whole") == list(range(2, 17, 2))


def metric_steps(run) -> list[int]:
    """The steps of a run's train-loss rows, asserting that no (split, step) occurs twice."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["split"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), keys
    return [r["step"] for r in rows if r["split"] == "train"]


def test_lightning_resume_from_checkpoint_continues_the_run_folder(tmp_path):
    """fit(ckpt_path=...) after a crash continues the Probe's folder: the probes after the checkpoint
    are redone and the run ends with the steps of an uninterrupted one."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers import GPT2Config, GPT2LMHeadModel

    from qkgeom.integrations.lightning import QKGeometryCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4))

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 12 and self.crash:
                raise RuntimeError("crash at step 12")
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def fit(module, callback, ckpt_path=None) -> None:
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
        trainer = L.Trainer(
            max_steps=16, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[callback, saver],
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(blocks(), batch_size=B), ckpt_path=ckpt_path)

    callback = QKGeometryCallback(blocks()[:4], tmp_path / "run", every=8)
    first = LM()
    first.crash = True
    with pytest.raises(RuntimeError, match="crash at step 12"):
        fit(first, callback)
    assert not (tmp_path / "run" / "done.json").exists()
    second = LM()
    second.crash = False
    fit(
        second,
        QKGeometryCallback(blocks()[:4], tmp_path / "run", every=8),
        ckpt_path=tmp_path / "ckpt" / "epoch=0-step=8.ckpt",
    )
    g = pd.read_parquet(tmp_path / "run" / "geometry.parquet")
    assert sorted(g["step"].unique()) == [0, 1, 2, 4, 8, 16]
    assert read_json(tmp_path / "run" / "done.json")["step"] == 16
    assert metric_steps(tmp_path / "run") == list(range(1, 17))  # the crashed run's 9-12 once, not twice
