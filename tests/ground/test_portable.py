"""train.portable: one float code path whatever the CPU's vector width, so a run repeats bit for bit on another
CPU of the same vendor.

Another CPU cannot be had in a test; what it changes can. A CPU picks torch's kernels by its vector
width and oneMKL's by its instruction set (and vendor). Holding oneMKL to SSE4.2 and torch to its scalar
kernels stands in for a CPU with other features: outside portable mode it changes a run's bits (the case
built to fail: the stand-in really moves the kernels), inside it the run keeps every bit. What the stand-in
cannot move is the silicon's rsqrtps / rcpps estimates, which oneMKL's SSE2 vector math starts from: across
vendors the bits are not promised. Whether another machine gives the committed run's bits is what `python
bench/cpu_paths.py --fingerprint docs/results/portable/fingerprint.json` tells on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkgeom import config as C
from qkgeom.device import PORTABLE_ENV, DeviceError, check_portable, portable_env_missing
from qkgeom.errors import ConfigError
from qkgeom.results import RunDir
from qkgeom.training.loop import train

STAND_IN = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"}  # another CPU's kernels


def _train(out: Path, env: dict[str, str], *extra: str) -> tuple[list[float], np.ndarray]:
    """Train the tiny preset in a fresh process through the CLI; (its losses, lr and gradient norms in
    order; its geometry values sorted by key, NaN kept)."""
    args = [sys.executable, "-m", "qkgeom.cli", "train", "tiny", "--out", str(out), "--no-progress", *extra]
    clean = {k: v for k, v in os.environ.items() if k not in {*PORTABLE_ENV, *STAND_IN}}
    r = subprocess.run(args, env={**clean, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    run = RunDir(out)
    numbers = [m.get(k) for m in run.read_metrics() for k in ("loss", "lr", "grad_norm")]
    g = run.read_geometry().sort_values(["step", "layer", "head", "site", "metric"])
    return numbers, g["value"].to_numpy()


def _same(a: tuple[list[float], np.ndarray], b: tuple[list[float], np.ndarray]) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1], equal_nan=True)


def test_a_portable_run_keeps_its_bits_on_another_cpus_kernels(wikitext, tmp_path):
    own, own_elsewhere = _train(tmp_path / "own", {}), _train(tmp_path / "own2", STAND_IN)
    assert not _same(own, own_elsewhere), "the stand-in for another CPU changed no kernel: the test proves nothing"
    port = _train(tmp_path / "port", {}, "--portable")
    port_elsewhere = _train(tmp_path / "port2", STAND_IN, "--portable")
    assert _same(port, port_elsewhere)
    assert len(port[1]) > 1000 and not _same(port, own)  # a whole run's geometry, on kernels of its own
    prov = json.loads((tmp_path / "port2" / "config.json").read_text())["provenance"]
    assert prov["kernel_env"] == {**PORTABLE_ENV, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}  # what it ran under
    assert prov["cpu"]["torch_capability"] == "DEFAULT" and prov["torch_threads"] == 1


def test_portable_is_refused_where_torch_started_without_its_settings(wikitext, tmp_path, monkeypatch):
    for k in PORTABLE_ENV:
        monkeypatch.delenv(k, raising=False)
    assert set(portable_env_missing()) == set(PORTABLE_ENV)
    with pytest.raises(DeviceError, match=r"MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default .*--portable"):
        train(C.load("tiny", ["train.portable=true"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the folder is made
    # set now, after torch started at its own width: too late, and said so
    for k, v in PORTABLE_ENV.items():
        monkeypatch.setenv(k, v.lower())  # oneMKL and torch read these settings in either case
    assert portable_env_missing() == {}
    with pytest.raises(DeviceError, match=r"torch started before ATEN_CPU_CAPABILITY=default was set"):
        check_portable()


def test_portable_is_for_eager_float32_cpu_runs_and_keeps_existing_run_ids():
    with pytest.raises(ConfigError, match=r"train.portable is for CPU runs, got train.device='cuda'"):
        C.validate(C.load("tiny", ["train.portable=true", "train.device=cuda"]))
    with pytest.raises(ConfigError, match=r"train.portable runs eager"):
        C.validate(C.load("tiny", ["train.portable=true", "train.compile=true"]))
    with pytest.raises(ConfigError, match=r"train.portable trains in float32"):
        C.validate(C.load("tiny", ["train.portable=true", 'train.precision="bf16"']))
    C.validate(C.load("tiny", ["train.portable=true", 'train.precision="float32"']))  # auto is float32 on a CPU
    cfg = C.load("tiny")
    assert C.run_id(cfg) == C.run_id(C.load("tiny", ["train.portable=false"]))  # committed runs keep their ids
    assert C.run_id(cfg) != C.run_id(C.load("tiny", ["train.portable=true"]))
