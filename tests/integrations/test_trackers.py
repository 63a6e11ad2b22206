"""integrations.trackers: the probe's layer-mean scalars in the dashboards the host already uses,
read back from the real stores, offline: MLflow (SQLite backend, through its client), W&B (an offline
run's transaction log) and TensorBoard (its own event reader), for a Trainer and a Lightning run."""

from __future__ import annotations

import glob
import json
import struct
import time
import zlib

import pandas as pd
import pytest
import torch

from qkgeom.probing.scalars import SCALARS, layer_means
from qkgeom.results import read_json
from tests.conftest import need

VOCAB, T, B = 40, 32, 8


def blocks(n: int = 128) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(7))


def folder_means(run) -> dict[int, dict[str, float]]:
    """The run folder's layer means per probe step: what every tracker must have received."""
    g = pd.read_parquet(run / "geometry.parquet")
    return {int(s): layer_means(rows) for s, rows in g.groupby("step")}


def _wandb_records(data: bytes) -> tuple[list, bool]:
    """The whole records of an offline W&B run's .wandb file, a LevelDB-style log (a 7-byte header, 32 KiB
    blocks of pieces: crc32 seeded with the piece's type, length, type (1 whole, 2-4 first, middle, last))
    of protobuf `Record`s (wandb.proto); and whether its exit record is among them. Reading stops at a
    piece not yet written whole (its length or checksum short)."""
    from wandb.proto import wandb_internal_pb2 as pb

    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        piece = data[pos + 7 : pos + 7 + length]
        if len(piece) < length or zlib.crc32(piece, zlib.crc32(bytes([kind]))) != crc:
            break
        chunk, pos = chunk + piece, pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            out.append(pb.Record.FromString(chunk))
            chunk = b""
    return out, any(r.WhichOneof("record_type") == "exit" for r in out)


def wandb_history(path: str, timeout: float = 60.0) -> list[dict]:
    """The history rows of an offline W&B run, once its file holds the exit record: wandb.finish() can
    return before wandb-core has written the file out (CI on a loaded machine read half a record)."""
    deadline = time.monotonic() + timeout
    while True:
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        records, done = _wandb_records(data)
        if done:
            break
        assert time.monotonic() < deadline, f"{path} holds no exit record after {timeout:.0f} s"
        time.sleep(0.2)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item} for h in history]


def test_a_trainer_run_sends_the_scalars_to_every_tracker_report_to_names(tmp_path, monkeypatch):
    mlflow, wandb = need("mlflow"), need("wandb")
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from qkgeom.integrations.transformers import QKGeometryCallback

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4))
    args = TrainingArguments(
        str(tmp_path / "hf"), max_steps=12, per_device_train_batch_size=B, learning_rate=3e-3, logging_steps=4,
        save_strategy="no", report_to=["mlflow", "wandb", "tensorboard"], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    run = tmp_path / "run"
    data = [{"input_ids": b, "labels": b} for b in blocks()]
    trainer = Trainer(model, args, train_dataset=data, callbacks=[QKGeometryCallback(blocks()[:4], run, every=4)])
    trainer.train()
    expected = folder_means(run)
    assert sorted(expected) == [0, 1, 2, 4, 8, 12] and set(expected[12]) == set(SCALARS)
    assert read_json(run / "done.json")["scalars_sent"] == {"mlflow": 6, "wandb": 6, "tensorboard": 6}

    client = mlflow.tracking.MlflowClient(store)
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for metric in SCALARS:
        got = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, f"qkgeom/{metric}")}
        assert got == pytest.approx({s: v[metric] for s, v in expected.items()}, rel=1e-6), metric
    assert "loss" in mlrun.data.metrics  # beside the Trainer's own loss, in the same run

    wandb.finish()  # the offline run is written out when it ends (the Trainer leaves it open)
    (offline,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = [r for r in wandb_history(offline) if "qkgeom/key_participation_ratio" in r]
    got = {r["train/global_step"]: r["qkgeom/key_participation_ratio"] for r in rows}
    assert got == pytest.approx({s: v["key_participation_ratio"] for s, v in expected.items()}, rel=1e-6)

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    got = {e.step: e.value for e in events.Scalars("qkgeom/attention_entropy")}
    assert got == pytest.approx({s: v["attention_entropy"] for s, v in expected.items()}, rel=1e-6)
    assert "train/loss" in events.Tags()["scalars"]  # the Trainer's own scalars, in the same folder


def test_a_lightning_run_sends_the_scalars_through_each_logger(tmp_path):
    need("mlflow")
    lightning = need("lightning")
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
    from mlflow.tracking import MlflowClient

    from qkgeom.integrations.lightning import QKGeometryCallback
    from tests.conftest import tiny_llama_module

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlf, csv = MLFlowLogger(experiment_name="qk", tracking_uri=store), CSVLogger(tmp_path / "csv")
    lightning.seed_everything(0, verbose=False)
    run = tmp_path / "run"
    trainer = lightning.Trainer(
        max_steps=10, accelerator="cpu", logger=[mlf, csv], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[QKGeometryCallback(blocks()[:4], run, every=5)],
    )  # fmt: skip
    trainer.fit(tiny_llama_module(VOCAB, T), torch.utils.data.DataLoader(blocks(), batch_size=B))
    expected = folder_means(run)
    assert sorted(expected) == [0, 1, 2, 4, 5, 10]
    assert read_json(run / "done.json")["scalars_sent"] == {"MLFlowLogger": 6, "CSVLogger": 6}
    history = MlflowClient(store).get_metric_history(mlf.run_id, "qkgeom/query_participation_ratio")
    got = {m.step: m.value for m in history}
    assert got == pytest.approx({s: v["query_participation_ratio"] for s, v in expected.items()}, rel=1e-6)
    table = pd.read_csv(glob.glob(str(tmp_path / "csv" / "**" / "metrics.csv"), recursive=True)[0])
    col = table.dropna(subset=["qkgeom/key_weight_alpha"])
    assert dict(zip(col["step"], col["qkgeom/key_weight_alpha"], strict=True)) == pytest.approx(
        {s: v["key_weight_alpha"] for s, v in expected.items()}, rel=1e-6
    )
