"""train: end-to-end runs on real WikiText-2, determinism, kill-and-resume, bad input via the CLI."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from qkgeom.results import RunDir
from qkgeom.training.loop import lr_at, probe_steps, train
from tests.conftest import REPO, tiny_config

pytestmark = pytest.mark.usefixtures("wikitext")


def losses(rd: RunDir):
    return [(r["step"], r["split"], r["loss"]) for r in rd.read_metrics()]


def test_schedule_helpers():
    assert probe_steps(100, 25) == [0, 1, 2, 4, 8, 16, 25, 50, 75, 100]
    assert probe_steps(30, 25, log_early=False) == [0, 25, 30]
    t = tiny_config(train={"steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1}).train
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0) and lr_at(100, t) == pytest.approx(0.1)
    assert lr_at(55, t) == pytest.approx(0.55)


def test_run_folder_is_complete_and_deterministic(tmp_path):
    cfg = tiny_config(train={"steps": 20, "checkpoint_steps": [10]})
    a, b = train(cfg, tmp_path / "a", progress=False), train(cfg, tmp_path / "b", progress=False)
    for name in ("config.json", "vocab.json", "metrics.jsonl", "geometry.parquet", "spectra.npz", "done.json"):
        assert (a.path / name).is_file(), name
    assert (a.path / "checkpoints" / "step_10.pt").is_file()
    assert losses(a) == losses(b)
    ga, gb = a.read_geometry(), b.read_geometry()
    pd.testing.assert_frame_equal(ga, gb)
    assert sorted(ga.step.unique()) == probe_steps(20, 10)
    cfg_json = json.loads(a.config.read_text())
    assert cfg_json["config"]["train"]["steps"] == 20 and "git_sha" in cfg_json["provenance"]
    first, last = losses(a)[0], [x for x in losses(a) if x[1] == "valid"][-1]
    assert last[2] < first[2]  # it learns
    c = train(tiny_config(train={"steps": 20, "seed": 1}), tmp_path / "c", progress=False)
    assert losses(c) != losses(a)
    # where the job's time went besides its steps (bench/train_throughput.py): each part timed, and
    # together less than the segment they are part of
    done = json.loads(a.done.read_text())
    parts = [done[f"{p}_seconds_last_segment"] for p in ("probe", "eval", "checkpoint")] + [done["consolidate_seconds"]]
    assert all(p > 0 for p in parts) and sum(parts) < done["segment_seconds"]
    assert done["startup_seconds_last_segment"] > 0


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "qkgeom.cli", *args], capture_output=True, text=True, cwd=REPO, **kw)


@pytest.mark.slow
def test_killed_run_resumes_to_identical_result(tmp_path):
    args = [
        "train",
        "tiny",
        "--no-progress",
        "--set",
        "train.steps=150",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "probe.every=20",
        "--set",
        "train.eval_every=30",
    ]
    full = cli(*args, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    out = tmp_path / "killed"
    # killed by itself right after step 47's metrics (past a checkpoint, mid-way between two): no race
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faultchild", "step:47:KILL", "--", *args, "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert not (out / "done.json").exists(), "run finished before it could be killed"
    resumed = cli(*args, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunDir(tmp_path / "full"), RunDir(out)
    assert losses(a) == losses(b)
    ga, gb = a.read_geometry(), b.read_geometry()
    pd.testing.assert_frame_equal(ga.reset_index(drop=True), gb.reset_index(drop=True))
    sa, sb = a.read_spectra(), b.read_spectra()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_a_killed_closed_loop_arm_resumes_to_identical_result(tmp_path):
    """Causal v4's closed loop caches its inputs between probes: the checkpoint carries the cache, so a
    run killed between two refreshes resumes to the uninterrupted run's losses and rows, bit for bit."""
    common = ["train", "tiny", "--no-progress", "--set", "train.steps=60", "--set", "train.checkpoint_every=10",
              "--set", "probe.every=20", "--set", "train.eval_every=30"]  # fmt: skip
    assert cli(*common, "--out", str(tmp_path / "none")).returncode == 0
    args = [*common, "--set", "intervention.kind='shape'", "--set", "intervention.ratio=0.7", "--set",
            "intervention.match_row_std=true", "--set", f"intervention.baseline='{tmp_path / 'none'}'"]  # fmt: skip
    full = cli(*args, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faultchild", "step:37:KILL", "--", *args, "--out", str(out)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.wait(timeout=120) == -signal.SIGKILL and not (out / "done.json").exists()
    resumed = cli(*args, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunDir(tmp_path / "full"), RunDir(out)
    assert losses(a) == losses(b)
    pd.testing.assert_frame_equal(a.read_geometry().reset_index(drop=True), b.read_geometry().reset_index(drop=True))


def test_a_run_records_the_cpu_and_the_kernel_settings_it_trained_under(tmp_path):
    """The last digits of a trained run depend on the CPU's float kernels (README, "What repeats where"),
    so config.json names the CPU, the vector width torch's kernels ran at and any setting that chose it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # torch's scalar kernels: valid on every CPU
    r = cli("train", "tiny", "--set", "train.steps=4", "--out", str(tmp_path / "r"), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    prov = json.loads((tmp_path / "r" / "config.json").read_text())["provenance"]
    assert prov["cpu"]["torch_capability"] == "DEFAULT" and prov["kernel_env"] == {"ATEN_CPU_CAPABILITY": "default"}
    if sys.platform == "linux":  # the features read from /proc/cpuinfo, as the kernels see them
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
        assert prov["cpu"]["isa"] == [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
        assert prov["cpu"]["model"] and prov["cpu"]["vendor"]


def test_corrupt_checkpoint_gives_one_line_error(tmp_path):
    out = tmp_path / "r"
    assert cli("train", "tiny", "--no-progress", "--set", "train.steps=10", "--out", str(out)).returncode == 0
    (out / "done.json").unlink()
    ckpt = out / "checkpoints" / "last.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    r = cli("train", "tiny", "--no-progress", "--set", "train.steps=10", "--out", str(out), "--resume")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "corrupt or truncated" in r.stderr and "last.pt" in r.stderr
    assert before == {
        p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"
    }  # nothing lost


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "data.source=/no/such/folder"], "neither a folder"),
        (["--set", "model.dropout=0.1"], "unknown config key 'model.dropout'"),
        (["--set", "model.n_layers=1.5"], "expects an integer"),
        (["--set", "model.n_heads=3"], "does not divide"),
        (["--set", "train.lr=-1"], "train.lr must be positive"),
        (["--set", "train.lr=1e6"], "diverged"),
    ],
)
def test_bad_input_one_line_nonzero(tmp_path, extra, message):
    out = tmp_path / "r"
    r = cli("train", "tiny", "--no-progress", "--set", "train.steps=10", "--out", str(out), *extra)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (out / "done.json").exists()


def test_resume_from_the_step_0_checkpoint_does_not_duplicate_step_0(tmp_path):
    # a run killed after its step-0 checkpoint and before the next: resumed, it equals an
    # uninterrupted run with step 0 recorded once (twice before the fix, in all three files)
    cfg = tiny_config(train={"steps": 12, "checkpoint_every": 10, "checkpoint_steps": [0]}, probe={"every": 4})
    full = train(cfg, tmp_path / "full", progress=False)
    part = train(cfg, tmp_path / "part", progress=False)
    (part.checkpoints / "step_0.pt").replace(part.last_checkpoint)  # last.pt as the kill left it
    part.done.unlink()
    train(cfg, part.path, resume=True, progress=False)
    assert losses(full) == losses(part)
    assert sum(1 for r in part.read_metrics() if r["step"] == 0 and r["split"] == "valid") == 1
    pd.testing.assert_frame_equal(full.read_geometry(), part.read_geometry())
    assert list(part.read_spectra()["step"]) == list(full.read_spectra()["step"])


def test_finished_run_refuses_a_different_config(tmp_path):
    out = tmp_path / "r"
    assert cli("train", "tiny", "--no-progress", "--set", "train.steps=5", "--out", str(out)).returncode == 0
    r = cli("train", "tiny", "--no-progress", "--set", "train.steps=6", "--out", str(out))
    assert r.returncode == 2 and "finished run with a different config" in r.stderr
    assert cli("train", "tiny", "--no-progress", "--set", "train.steps=5", "--out", str(out)).returncode == 0


def test_probe_samples_ten_tokens_per_dimension_by_default(tmp_path):
    from qkgeom import config as C

    cfg = tiny_config(train={"steps": 4})
    assert C.probe_n_seqs(cfg) * cfg.model.n_ctx >= 10 * cfg.model.d_model
    assert C.probe_n_seqs(C.load("cpu")) == 10 and C.probe_n_seqs(C.load("smoke")) * 64 >= 320
    rd = train(cfg, tmp_path / "r", progress=False)
    meta = json.loads(rd.config.read_text())
    assert meta["probe_tokens"] >= 10 * cfg.model.d_model and meta["config"]["probe"]["n_seqs"] == 0


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "r"
    train(tiny_config(train={"steps": 5}), out, progress=False)
    (out / "done.json").unlink()
    before = (out / "metrics.jsonl").read_bytes()
    r = cli("train", "tiny", "--no-progress", "--set", "train.steps=5", "--out", str(out))
    assert r.returncode == 2 and "--resume" in r.stderr
    assert (out / "metrics.jsonl").read_bytes() == before


def test_losses_equal_a_plain_loop_with_the_same_seeds(tmp_path):
    # the whole job (probes, evals, checkpoints, metrics) must not change the numbers: the losses
    # equal those of a bare PyTorch loop over the same model, batches, schedule and optimiser
    import torch

    from qkgeom.training.data import batch_offsets, gather, load_corpus
    from qkgeom.training.loop import make_optimizer
    from qkgeom.training.model import GPT

    cfg = tiny_config(train={"steps": 20, "checkpoint_every": 5, "eval_every": 5}, probe={"every": 4})
    rd = train(cfg, tmp_path / "r", progress=False)
    ours = [r["loss"] for r in rd.read_metrics() if r["split"] == "train"]
    t, m = cfg.train, cfg.model
    corpus = load_corpus(cfg.data)
    data = corpus.splits["train"]
    model = GPT(m, corpus.vocab.size, seed=t.seed)
    opt = make_optimizer(model, t)
    plain = []
    for step in range(t.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = gather(data, batch_offsets(len(data), m.n_ctx, t.batch_size, t.data_seed, step), m.n_ctx)
        loss = model.loss(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        plain.append(loss.item())
    assert np.allclose(ours, plain, rtol=1e-6, atol=0)


def test_bf16_autocast_training_path_on_cpu(tmp_path):
    # the GPU preset's code path (bf16 autocast for training; float32/float64 probes), run on CPU
    f32 = train(tiny_config(train={"steps": 12}), tmp_path / "f32", progress=False)
    bf16 = train(tiny_config(train={"steps": 12, "precision": "bf16"}), tmp_path / "bf16", progress=False)
    a = np.array([r["loss"] for r in f32.read_metrics() if r["split"] == "train"])
    b = np.array([r["loss"] for r in bf16.read_metrics() if r["split"] == "train"])
    assert not np.array_equal(a, b)  # autocast really ran in bf16 ...
    assert np.allclose(a, b, rtol=0.03)  # ... and trains the same model to bf16 accuracy
    g = bf16.read_geometry()
    why = g["note"].str.contains("; ", na=False)  # an alpha row's note gives the reason after its convention
    assert g.loc[~why, "value"].notna().all() and g.loc[why, "value"].isna().all()  # NaN only where it says why
    assert (g.query("metric == 'key_participation_ratio'")["value"] >= 1).all()
    assert json.loads(bf16.config.read_text())["config"]["train"]["precision"] == "bf16"


@pytest.mark.usefixtures("wikitext")
def test_bf16_on_a_cpu_times_both_attention_kernels_once_and_records_the_faster(tmp_path, monkeypatch):
    """precision = bf16 on a CPU: both SDPA kernels are timed on the run's own model and batch, the
    faster is used and recorded in config.json and done.json, and cached: the next run of the same
    shape reuses it; float32 records none. Training itself is unchanged by the timing (it never steps)."""
    import json

    from qkgeom.training import precision

    monkeypatch.setenv("QKGEOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "native_bf16", lambda: False)  # an AVX2 CPU: bf16 emulated, said so
    with pytest.warns(UserWarning, match="without bf16 arithmetic"):
        rd = train(tiny_config(train={"steps": 5, "precision": "bf16"}), tmp_path / "a", progress=False)
    first = json.loads(rd.config.read_text())["attention_path"]
    assert first["native_bf16"] is False
    assert first["path"] in precision.BACKENDS and set(first["ms"]) == set(precision.BACKENDS)
    assert first["path"] == min(first["ms"], key=first["ms"].get) and not first["cached"]
    assert json.loads(rd.done.read_text())["attention_path"] == first
    cache = json.loads((tmp_path / "cache" / precision.CACHE_FILE).read_text())
    assert cache[first["machine"]] == {"path": first["path"], "ms": first["ms"], "native_bf16": False}
    again = train(tiny_config(train={"steps": 5, "precision": "bf16", "seed": 1}), tmp_path / "b", progress=False)
    second = json.loads(again.config.read_text())["attention_path"]
    assert second["cached"] and second["path"] == first["path"]
    plain = train(tiny_config(train={"steps": 5}), tmp_path / "c", progress=False)
    assert json.loads(plain.config.read_text())["attention_path"] is None
    # the timing never steps the weights: the first loss equals a bf16 forward of the fresh model on the
    # same batch under the chosen kernel
    import torch

    from qkgeom.training.data import batch_offsets, gather, load_corpus
    from qkgeom.training.model import GPT

    cfg = tiny_config(train={"steps": 5, "precision": "bf16"})
    corpus = load_corpus(cfg.data)
    data = corpus.splits["train"]
    x, y = gather(data, batch_offsets(len(data), cfg.model.n_ctx, cfg.train.batch_size, cfg.train.data_seed, 0),
                  cfg.model.n_ctx)  # fmt: skip
    model = GPT(cfg.model, corpus.vocab.size, seed=cfg.train.seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), precision.attention_path(first["path"]):
        expected = model.loss(torch.from_numpy(x), torch.from_numpy(y)).item()
    first_train = next(r for r in rd.read_metrics() if r["split"] == "train")
    assert first_train["loss"] == pytest.approx(expected, rel=1e-6)


def test_divergence_names_the_first_bad_tensor_and_its_rms():
    """One fused norm finds a NaN, an RMS over the limit, and values too large for a float32 norm
    (3e19: its squares overflow, the RMS is still read exactly)."""
    import torch

    from qkgeom.config import ModelConfig
    from qkgeom.training.loop import divergence
    from qkgeom.training.model import GPT

    model = GPT(ModelConfig(n_layers=2, d_model=16, n_heads=2, n_ctx=8), 20, seed=0)
    assert divergence(model) is None
    with torch.no_grad():
        model.blocks[1].fc.weight[0, 0] = float("nan")
        assert divergence(model) == "blocks.1.fc.weight became non-finite"
        model.blocks[1].fc.weight[0, 0] = 0.0
        model.blocks[0].attn.W_K.fill_(250.0)
        assert divergence(model) == "blocks.0.attn.W_K has RMS 250 (> 100)"
        model.blocks[0].attn.W_K.fill_(3e19)
        assert divergence(model) == "blocks.0.attn.W_K has RMS 3e+19 (> 100)"
