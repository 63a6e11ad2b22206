"""qkgeom.Probe in a loop of one's own: its schedule, its rows against an independent recomputation
and the in-memory analysis, the model left as it was, TensorBoard scalars equal to the Parquet rows,
and the folders it refuses. The Trainer and Lightning callbacks: tests/test_integrations.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import qkgeom
from qkgeom.results import FolderLockedError, read_json
from qkgeom.tracking import ProbeError, probe_schedule
from qkgeom.train import probe_steps

VOCAB, T = 40, 32


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation("sdpa")  # what a training loop would use
    return model


def fixed_batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(seed))


def train_with_probe(out, steps: int = 12, every: int = 10, seed: int = 0, **kw) -> GPT2LMHeadModel:
    """A plain loop: probe(step) before each update, finish(steps) after the last one."""
    model, batch = gpt2(seed), fixed_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + seed)
    probe = qkgeom.Probe(model, batch, every=every, out=out, seed=seed, **kw)
    for step in range(steps):
        probe(step, tokens_seen=step * 8 * T)
        x = torch.randint(0, VOCAB, (8, T), generator=data)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        probe.log_metrics(step + 1, 0.0)
    probe.finish(steps, tokens_seen=steps * 8 * T)
    return model


def test_the_schedule_is_qkgeom_trains():
    assert [s for s in range(41) if probe_schedule(s, 10)] == [0, 1, 2, 4, 8, 10, 20, 30, 40]
    assert [s for s in range(41) if probe_schedule(s, 10, log_early=False)] == [0, 10, 20, 30, 40]
    steps = 1000
    assert [s for s in range(steps + 1) if probe_schedule(s, 50)] == probe_steps(steps, 50)


def test_probe_rows_match_an_independent_recomputation_and_leave_the_model_as_it_was(tmp_path):
    out = tmp_path / "run"
    model = train_with_probe(out)
    assert model.config._attn_implementation == "sdpa" and model.training  # restored after every probe
    g = pd.read_parquet(out / "geometry.parquet")
    assert sorted(g["step"].unique()) == [0, 1, 2, 4, 8, 10, 12]  # the schedule, then finish's last step
    assert set(g.loc[g["step"] == 4, "tokens_seen"]) == {4 * 8 * T}
    assert read_json(out / "config.json")["config"]["train"]["steps"] == 12
    info = read_json(out / "config.json")
    assert info["config"]["model"]["n_layers"] == 2 and info["model_config"]["n_embd"] == 32  # what was probed
    assert info["config"]["probe"] == {"every": 10, "log_early": True, "n_seqs": 4, "seq_len": T, "logit_max_seqs": 4}
    assert (out / "done.json").is_file() and not (out / "geometry.parts").exists()

    # the last probe equals the in-memory analysis of the final model on the same batch
    last = g[g["step"] == 12].set_index(["layer", "head", "site", "metric"])["value"]
    model.eval()
    now = qkgeom.analyse(model, [fixed_batch()]).set_index(["layer", "head", "site", "metric"])["value"]
    both = pd.concat([last, now], axis=1, join="inner").dropna()
    assert len(both) == len(now.dropna()) > 50
    np.testing.assert_allclose(both.iloc[:, 0], both.iloc[:, 1], rtol=1e-6, atol=1e-9)

    # ... and layer 0's key participation ratio, from the projection output by hand in float64
    seen = {}
    hook = model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, o: seen.update(qkv=o))
    with torch.no_grad():
        model(input_ids=fixed_batch())
    hook.remove()
    k = seen["qkv"].split(32, dim=-1)[1].reshape(-1, 32).double().numpy()
    eig = np.linalg.eigvalsh(np.cov(k, rowvar=False, bias=True))
    pr = eig.sum() ** 2 / (eig**2).sum()
    assert last[(0, -1, "none", "key_participation_ratio")] == pytest.approx(pr, rel=1e-4)


def test_a_model_read_through_a_capture_function(tmp_path):
    """Any model: q, k (and pattern) handed over by a function, as with qkgeom.measure."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, bias=False)
    emb = torch.nn.Embedding(VOCAB, 32)
    model = torch.nn.ModuleDict({"emb": emb, "mha": mha})
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)

    def capture(model, batch):
        x = model["emb"](batch)
        _, pattern = model["mha"](x, x, x, attn_mask=mask, average_attn_weights=False)
        w_q, w_k, _ = model["mha"].in_proj_weight.chunk(3)
        split = lambda t: t.view(batch.shape[0], T, 4, 8).transpose(1, 2)  # noqa: E731
        return {"q": [split(x @ w_q.T)], "k": [split(x @ w_k.T)], "pattern": [pattern]}

    with qkgeom.Probe(model, fixed_batch(), every=5, out=tmp_path / "run", capture=capture) as probe:
        for step in range(6):
            probe(step)
    g = pd.read_parquet(tmp_path / "run" / "geometry.parquet")
    assert sorted(g["step"].unique()) == [0, 1, 2, 4, 5]
    model_info = read_json(tmp_path / "run" / "config.json")["config"]["model"]
    assert model_info["n_layers"] == 1 and model_info["model_type"] == "custom (capture function)"
    got = capture(model, fixed_batch())
    ref = qkgeom.measure(got["q"], got["k"], got["pattern"]).set_index(["layer", "head", "metric"])["value"]
    mine = g[g["step"] == 5].set_index(["layer", "head", "metric"])["value"]
    np.testing.assert_allclose(mine.loc[ref.index], ref, rtol=1e-6)


def test_tensorboard_scalars_equal_the_parquet_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_with_probe(tmp_path / "run", tensorboard=tmp_path / "tb")
    g = pd.read_parquet(tmp_path / "run" / "geometry.parquet")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    metrics = ["query_participation_ratio", "key_participation_ratio", "participation_ratio_contrast",
               "attention_entropy", "interaction_rank"]  # fmt: skip
    assert sorted(events.Tags()["scalars"]) == sorted(f"qkgeom/{m}" for m in metrics)
    for metric in metrics:
        expected = g[(g["metric"] == metric) & (g["head"] == -1)].groupby("step")["value"].mean()
        logged = {e.step: e.value for e in events.Scalars(f"qkgeom/{metric}")}
        assert sorted(logged) == list(expected.index)
        np.testing.assert_allclose([logged[s] for s in expected.index], expected.to_numpy(np.float32), rtol=1e-6)


def test_qkgeom_train_writes_tensorboard_scalars_too(tmp_path, wikitext):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qkgeom.cli import main

    run, tb = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "tiny", "--no-progress", "--out", str(run), "--tensorboard", str(tb)]) == 0
    g = pd.read_parquet(run / "geometry.parquet")
    events = EventAccumulator(str(tb))
    events.Reload()
    expected = g[(g["metric"] == "key_participation_ratio") & (g["head"] == -1)].groupby("step")["value"].mean()
    logged = {e.step: e.value for e in events.Scalars("qkgeom/key_participation_ratio")}
    assert sorted(logged) == list(expected.index) == [0, 1, 2, 4, 8, 10, 20, 30, 40]
    np.testing.assert_allclose([logged[s] for s in expected.index], expected.to_numpy(np.float32), rtol=1e-6)


def test_folders_and_inputs_it_refuses(tmp_path):
    with pytest.raises(ProbeError, match="cannot read Linear"):
        qkgeom.Probe(torch.nn.Linear(3, 3), fixed_batch(), out=tmp_path / "a")
    with pytest.raises(ProbeError, match="must be input ids"):
        qkgeom.Probe(gpt2(), fixed_batch().float(), out=tmp_path / "a")

    out = tmp_path / "run"
    first = qkgeom.Probe(gpt2(), fixed_batch(), every=2, out=out)
    with pytest.raises(FolderLockedError):  # the folder is held until finish / close
        qkgeom.Probe(gpt2(), fixed_batch(), out=out)
    for step in range(5):
        first(step)
    first.close()  # interrupted: probes 0, 1, 2, 4 on disk, no done.json
    with pytest.raises(ProbeError, match="interrupted run: pass resume=True"):
        qkgeom.Probe(gpt2(), fixed_batch(), out=out)
    again = qkgeom.Probe(gpt2(), fixed_batch(), every=2, out=out, resume=True)
    again(2)  # resumed from step 2: the interrupted run's probe 4 is dropped, 2 redone
    again.finish()
    assert sorted(pd.read_parquet(out / "geometry.parquet")["step"].unique()) == [0, 1, 2]
    with pytest.raises(ProbeError, match="holds a finished run"):
        qkgeom.Probe(gpt2(), fixed_batch(), out=out)
