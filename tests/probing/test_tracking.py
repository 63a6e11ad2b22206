"""qkgeom.Probe in a loop of one's own: its schedule, its rows against an independent recomputation
and the in-memory analysis, the model left as it was, TensorBoard scalars equal to the Parquet rows,
and the folders it refuses. The Trainer and Lightning callbacks: tests/integrations/test_integrations.py."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import qkgeom
from qkgeom.probing.tracking import ProbeError, probe_schedule
from qkgeom.results import FolderLockedError, read_json
from qkgeom.training.loop import probe_steps

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
    assert info["config"]["probe"] == {
        "every": 10, "log_early": True, "n_seqs": 4, "seq_len": T, "logit_max_seqs": 4, "pr_convention": "variance",
        "alpha_convention": "weightwatcher",
    }  # fmt: skip
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
               "attention_entropy", "interaction_rank", "query_weight_alpha", "key_weight_alpha"]  # fmt: skip
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
    with pytest.raises(ProbeError, match=r"logit_max_seqs must be >= 0 \(0 = all\), got -1"):
        qkgeom.Probe(gpt2(), fixed_batch(), out=tmp_path / "neg", logit_max_seqs=-1)
    assert not (tmp_path / "neg").exists()  # refused before the folder exists

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
    # seventeenth session: a probe called after finish (or close) wrote into the released folder
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    calls = [(lambda: again(4), "cannot probe step 4"), (lambda: again.log_metrics(5, 1.0), "cannot log step 5")]
    for call, says in [*calls, (again.finish, "cannot finish")]:
        with pytest.raises(ProbeError, match=f"{says}: the probe of .* is finished"):
            call()
    assert before == {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    with pytest.raises(ProbeError, match="step must be >= 0, got -1"):
        qkgeom.Probe(gpt2(), fixed_batch(), out=tmp_path / "neg-step")(-1)
    with pytest.raises(ProbeError, match=r"steps \(the run's length\) must be >= 0, got -1"):
        qkgeom.Probe(gpt2(), fixed_batch(), out=tmp_path / "neg-length", steps=-1)
    assert not (tmp_path / "neg-length").exists()


def test_a_probe_killed_while_consolidating_resumes_without_losing_geometry(tmp_path, monkeypatch):
    """Killed between writing geometry.parquet and spectra.npz at finish, then resumed and trained
    further: the later probes join the earlier ones (the consolidated file was split back into parts)."""
    from qkgeom.results import RunDir

    out = tmp_path / "run"
    probe = qkgeom.Probe(gpt2(), fixed_batch(), every=10, out=out)
    for step in range(13):
        probe(step)

    def killed(*_):
        raise KeyboardInterrupt("killed after geometry.parquet was written")

    monkeypatch.setattr(RunDir, "write_spectra", killed)
    with pytest.raises(KeyboardInterrupt):
        probe.finish(12)
    probe.close()
    monkeypatch.undo()
    assert (out / "geometry.parquet").exists() and not (out / "done.json").exists()
    again = qkgeom.Probe(gpt2(), fixed_batch(), every=10, out=out, resume=True)
    for step in range(13, 33):
        again(step)
    again.finish(32)
    assert read_json(out / "done.json")["step"] == 32
    assert sorted(pd.read_parquet(out / "geometry.parquet")["step"].unique()) == [0, 1, 2, 4, 8, 10, 12, 20, 30, 32]
    assert list(np.load(out / "spectra.npz")["step"]) == [0, 1, 2, 4, 8, 10, 12, 20, 30, 32]


def test_a_resume_logs_each_step_once_and_must_continue_the_same_run(tmp_path):
    out = tmp_path / "run"
    probe = qkgeom.Probe(gpt2(), fixed_batch(), every=4, out=out)
    for step in range(7):
        probe(step)
        probe.log_metrics(step + 1, 1.0)
    probe.close()  # killed after step 7's loss; the user's checkpoint is at step 4
    with pytest.raises(ProbeError, match="probed on another batch"):
        qkgeom.Probe(gpt2(), fixed_batch(seed=1), every=4, out=out, resume=True)
    other = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=3, n_head=4))
    with pytest.raises(ProbeError, match="model.n_layers = 2, not 3"):
        qkgeom.Probe(other, fixed_batch(), every=4, out=out, resume=True)
    again = qkgeom.Probe(gpt2(), fixed_batch(), every=4, out=out, resume=True)
    for step in range(4, 9):
        again(step)
        again.log_metrics(step + 1, 2.0)
    again.finish(9)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(s, 1.0) for s in range(1, 5)] + [(s, 2.0) for s in range(5, 10)]


def test_non_finite_weights_skip_the_probe_with_a_reason_instead_of_crashing(tmp_path):
    model = gpt2()
    probe = qkgeom.Probe(model, fixed_batch(), every=2, out=tmp_path / "run")
    assert probe(0)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[0, 0] = float("nan")
        model.transformer.h[1].attn.c_attn.weight[0, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"transformer.h.1.attn.c_attn.weight: 1 NaN, 1 inf of 3072"):
        assert not probe(2)
    probe.finish(2)
    assert sorted(pd.read_parquet(tmp_path / "run" / "geometry.parquet")["step"].unique()) == [0]
    assert "not finite" in (tmp_path / "run" / "warnings.jsonl").read_text()


def test_a_compiled_model_is_probed_through_to_its_weights(tmp_path):
    """torch.compile'd training (dynamo's graph capture, the eager backend: no C++ toolchain needed):
    Probe reads the module under the wrapper, and its last probe equals the eager analysis of it."""
    model, batch = gpt2(), fixed_batch()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe = qkgeom.Probe(compiled, batch, every=2, out=tmp_path / "run", steps=4)
    data = torch.Generator().manual_seed(7)
    for step in range(4):
        probe(step)
        x = torch.randint(0, VOCAB, (8, T), generator=data)
        compiled(input_ids=x, labels=x).loss.backward()  # the compiled forward trains the weights
        opt.step()
        opt.zero_grad()
    probe.finish(4)
    g = pd.read_parquet(tmp_path / "run" / "geometry.parquet")
    assert sorted(g["step"].unique()) == [0, 1, 2, 4]
    last = g[g["step"] == 4].set_index(["layer", "head", "site", "metric"])["value"]
    model.eval()
    now = qkgeom.analyse(model, [batch]).set_index(["layer", "head", "site", "metric"])["value"]
    both = pd.concat([last, now], axis=1, join="inner").dropna()
    assert len(both) == len(now.dropna()) > 50
    np.testing.assert_allclose(both.iloc[:, 0], both.iloc[:, 1], rtol=1e-6, atol=1e-9)


def test_a_failing_tracker_is_dropped_and_the_run_finishes(tmp_path, capsys):
    """A Lightning logger that raised OSError during training stopped the run through qkgeom's tracker
    code, leaving no done.json. Now the failing sink is reported once and dropped; the other sink and
    the run folder go on to the end."""
    good, calls = [], {"bad": 0}

    def bad(step, scalars):
        calls["bad"] += 1
        raise OSError("disk quota exceeded")

    train_with_probe(
        tmp_path / "r", steps=12, every=4, sinks=[("bad", bad), ("good", lambda s, m: good.append(s) or True)]
    )
    done = read_json(tmp_path / "r" / "done.json")
    assert calls["bad"] == 1 and good == [0, 1, 2, 4, 8, 12]  # log-spaced early probes, then every 4
    assert (
        done["sinks_dropped"] == {"bad": "OSError at step 0: disk quota exceeded"} and done["scalars_sent"]["good"] == 6
    )
    assert capsys.readouterr().err.count("tracker bad failed") == 1
