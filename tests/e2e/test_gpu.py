"""The GPU path: every measuring path on `cuda` gives the CPU's numbers (float64 results within 1e-6
relative). Marked `gpu` and skipped without CUDA: CI has none; bench/gpu_check.py runs them on a lent
GPU in one prepared call (`pytest -m gpu`). On a CPU, tests/ground/test_device.py guards the same paths.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

# the device under test: cuda, or cpu for a dry run of these tests' own code before a lease
# (QKGEOM_GPU_TESTS_ON=cpu; tests/e2e/test_gpu_lease.py does it): every comparison is then cpu with cpu
DEV = os.environ.get("QKGEOM_GPU_TESTS_ON", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEV.startswith("cuda") and not torch.cuda.is_available(),
        reason="needs a CUDA device (bench/gpu_check.py runs these)",
    ),
]
RTOL = 1e-6


def same_rows(a: list[dict] | pd.DataFrame, b: list[dict] | pd.DataFrame, rtol: float = RTOL) -> None:
    """Two row sets hold the same (layer, head, site, metric) values within rtol (NaN where NaN)."""
    key = ["layer", "head", "site", "metric"]
    da, db = (pd.DataFrame(x).set_index(key)["value"].sort_index() for x in (a, b))
    assert da.index.equals(db.index)
    np.testing.assert_allclose(da.to_numpy(), db.to_numpy(), rtol=rtol, atol=1e-9, equal_nan=True)


def test_probe_on_cuda_equals_probe_on_cpu():
    """probe_gpt of one model's weights on cuda and on the CPU: every row (activation, logit, weight
    spectra, alphas) equal within 1e-6 relative."""
    from qkgeom import config as C
    from qkgeom.probing.probe import probe_gpt
    from qkgeom.training.model import GPT

    cfg = C.load("cpu", ["model.n_layers=2"])
    model = GPT(cfg.model, 284, seed=0).eval()
    idx = torch.randint(0, 284, (10, cfg.model.n_ctx), generator=torch.Generator().manual_seed(0))
    cpu_rows, cpu_spec = probe_gpt(model, idx)
    gpu_rows, gpu_spec = probe_gpt(model.to(DEV), idx.to(DEV))
    same_rows(cpu_rows, gpu_rows)
    for k in cpu_spec:
        np.testing.assert_allclose(cpu_spec[k], gpu_spec[k], rtol=RTOL, atol=1e-9)


def test_train_with_closed_loop_runs_on_cuda(tmp_path, wikitext):
    """qkgeom train on cuda: a none run (with the zero-training complement) and a closed-loop arm with a
    control set finish; the step-0 probe (before any update) equals the CPU run's, measured in full
    float32 although the run allows TF32; the caller's matmul precision is back after."""
    from qkgeom import config as C
    from qkgeom.training.loop import train

    base = ["train.steps=20", "probe.every=10", "train.eval_every=10", "intervention.control_seqs=2"]
    instant = "intervention.instant=['shape:activation:0.8:closed']"
    precision = torch.get_float32_matmul_precision()  # TF32 is the run's, not the caller's after it
    runs = {}
    for side, dev in (("cpu", "cpu"), ("gpu", DEV)):
        runs[side] = train(C.load("tiny", [*base, instant, f"train.device='{dev}'"]), tmp_path / f"none-{side}", False,
                           progress=False)  # fmt: skip
    closed = ["intervention.kind='shape'", "intervention.ratio=0.8", "intervention.match_row_std=true"]
    arm = C.load("tiny", [*base, *closed, f"train.device='{DEV}'", f"intervention.baseline='{tmp_path / 'none-gpu'}'"])
    assert train(arm, tmp_path / "arm", progress=False).is_done()
    assert torch.get_float32_matmul_precision() == precision
    g = {d: rd.read_geometry() for d, rd in runs.items()}
    step0 = {d: x[(x["step"] == 0) & ~x["metric"].str.contains("instant")] for d, x in g.items()}
    same_rows(step0["cpu"], step0["gpu"], rtol=1e-5)  # float32 forwards: the same init, another kernel


def test_analyse_model_on_cuda_equals_cpu():
    """The Hugging Face path on cuda (a GPT-2 built from a config) gives the CPU's rows."""
    transformers = pytest.importorskip("transformers")
    from qkgeom.probing.hf import analyse_model

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64))
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    cpu_rows, _ = analyse_model(model.eval(), iter([ids]))
    gpu_rows, _ = analyse_model(model.to(DEV), iter([ids]))
    same_rows(cpu_rows, gpu_rows, rtol=1e-5)


def test_probe_callback_on_cuda(tmp_path):
    """qkgeom.Probe (the Trainer and Lightning callbacks' engine) on a model that trains on cuda."""
    import qkgeom
    from tests.probing.test_tracking import VOCAB, T, gpt2

    model = gpt2().to(DEV)
    batch = torch.randint(0, VOCAB, (4, T), device=DEV)
    probe = qkgeom.Probe(model, batch, every=2, out=tmp_path / "p")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        probe(step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        probe.log_metrics(step + 1, loss.detach())
    probe.finish(4)
    assert (tmp_path / "p" / "done.json").is_file()


def test_pretrained_cli_takes_a_device(tmp_path, wikitext):
    """`qkgeom pretrained --device cuda` on a local GPT-2 folder (a character vocabulary, as in
    tests/families/test_pretrained_cli.py) gives the rows of `--device cpu`."""
    from qkgeom.cli import main
    from qkgeom.training.data import build_vocab
    from tests.families.test_pretrained_cli import SMALL_RUN, _save

    vocab = build_vocab(wikitext / "wikitext-2-raw" / "valid.txt", "char")
    _save("gpt2", tmp_path / "m", vocab, 0)
    rows = {}
    for side, dev in (("cpu", "cpu"), ("gpu", DEV)):
        assert (
            main(["pretrained", str(tmp_path / "m"), "--device", dev, "--out", str(tmp_path / side), *SMALL_RUN]) == 0
        )
        info = json.loads(next((tmp_path / side).glob("*/config.json")).read_text())
        assert info["pretrained_config"]["device"] == dev
        rows[side] = pd.read_parquet(next((tmp_path / side).glob("*/geometry.parquet")))
    same_rows(rows["cpu"], rows["gpu"], rtol=1e-5)


def test_decompositions_solve_on_the_host_and_return_to_cuda():
    """qkgeom.solves.host on cuda tensors: results come back on the input's device, with the CPU's
    values (and torch.return_types' names); triangular_factor's Gram route gives the CPU's R."""
    from qkgeom import solves as S
    from qkgeom.probing.geometry import robust_eigvalsh, triangular_factor

    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 96, 64, generator=g, dtype=torch.float64)
    gram = w.transpose(-1, -2) @ w
    kind = torch.device(DEV).type
    out = S.eigh(gram.to(DEV))
    assert out.eigenvalues.device.type == kind and out.eigenvectors.device.type == kind
    assert torch.equal(out.eigenvalues.cpu(), torch.linalg.eigh(gram).eigenvalues)
    assert torch.equal(robust_eigvalsh(gram.to(DEV)).cpu(), robust_eigvalsh(gram))
    u, r = triangular_factor(w.to(DEV))
    assert u is None and r.device.type == kind  # the Gram route: R alone
    np.testing.assert_allclose(r.cpu().numpy(), triangular_factor(w)[1].numpy(), rtol=1e-10, atol=1e-12)
