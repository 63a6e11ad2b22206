"""executor: a tiny grid and a family through a real local Ray instance (2 CPUs) equal the local executor."""

import json

import pytest

from qkgeom.families.config import load_pretrained
from qkgeom.results import RunDir
from qkgeom.training import grid as G
from qkgeom.training import sweep as S
from tests.training.test_sweep import write_sweep

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("wikitext")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_executor_matches_local_pool(tmp_path, local_ray):
    spec = G.load_sweep(write_sweep(tmp_path, '"train.lr" = [3e-3, 1e6]\n"train.seed" = [0, 1]'))
    via_ray = S.run_sweep(spec, tmp_path / "ray", progress=False, executor="ray", workers=2)
    assert len(via_ray.done) == 2 and len(via_ray.failed) == 2
    assert all("diverged" in e for e in via_ray.failed.values())
    for rid in via_ray.failed:
        assert "diverged" in json.loads((tmp_path / "ray" / rid / "error.json").read_text())["error"]
    again = S.run_sweep(spec, tmp_path / "ray", progress=False, executor="ray", workers=2)
    assert sorted(again.skipped) == sorted(via_ray.done)
    local = S.run_sweep(spec, tmp_path / "local", progress=False, executor="local", workers=2)
    assert sorted(local.done) == sorted(via_ray.done)
    for rid in local.done:
        a = [(r["step"], r["loss"]) for r in RunDir(tmp_path / "ray" / rid).read_metrics()]
        b = [(r["step"], r["loss"]) for r in RunDir(tmp_path / "local" / rid).read_metrics()]
        assert a == b


def test_ray_family_equals_local(tmp_path, local_ray):
    import numpy as np

    from qkgeom.families import revisions as F
    from qkgeom.families.export import export_run
    from qkgeom.training.loop import train
    from tests.conftest import tiny_config

    rd = train(tiny_config(train={"steps": 6, "checkpoint_steps": [0, 3]}), tmp_path / "run", progress=False)
    export_run(rd.path, tmp_path / "hf")
    tokens = np.arange(2048) % 50
    revs = ["step_0", "step_3", "step_6"]

    pc = load_pretrained(overrides=[f'model="{tmp_path / "hf"}"', "n_tokens=1024", "seq_len=32", "batch_size=4"])
    F.analyse_family(pc, revs, tmp_path / "ray", lambda _: (tokens, ()), executor="ray", progress=False)
    F.analyse_family(pc, revs, tmp_path / "local", lambda _: (tokens, ()), progress=False)
    (ga, ra), (gb, rb) = F.load_family(tmp_path / "ray"), F.load_family(tmp_path / "local")
    assert list(ra["weights_sha256"]) == list(rb["weights_sha256"])
    key = ["revision", "site", "layer", "head", "metric"]
    a, b = ga.sort_values(key).reset_index(drop=True), gb.sort_values(key).reset_index(drop=True)
    assert np.allclose(a["value"], b["value"], rtol=1e-6, equal_nan=True)


def test_ray_workers_run_portable_under_the_drivers_settings(tmp_path, local_ray, monkeypatch):
    """Ray's workers were started with the cluster (here before the settings were made): train.portable's
    settings travel with each task, so its runs take the portable kernels rather than being refused."""
    from qkgeom.device import PORTABLE_ENV

    for k, v in PORTABLE_ENV.items():
        monkeypatch.setenv(k, v)  # as `qkgeom sweep --portable` runs: the driver under them
    spec = G.load_sweep(write_sweep(tmp_path, '"train.seed" = [0, 1]', '"train.steps" = 4\n"train.portable" = true'))
    res = S.run_sweep(spec, tmp_path / "ray", progress=False, executor="ray", workers=2)
    assert not res.failed and len(res.done) == 2
    for rid in res.done:
        prov = json.loads((tmp_path / "ray" / rid / "config.json").read_text())["provenance"]
        assert prov["kernel_env"] == PORTABLE_ENV and prov["cpu"]["torch_capability"] == "DEFAULT"
