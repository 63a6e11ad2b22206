"""train.portable: one float code path whatever the CPU, so a run repeats bit for bit on another x86-64 CPU,
Intel or AMD.

Another CPU cannot be had in a test; what it changes can. A CPU picks torch's kernels by its vector
width and oneMKL's by its instruction set (and vendor). Holding oneMKL to SSE4.2 and torch to its scalar
kernels stands in for a CPU with other features: outside portable mode it changes a run's bits (the case
built to fail: the stand-in really moves the kernels), inside it the run keeps every bit. What the stand-in
cannot move is the silicon's rsqrtps / rcpps estimates, which oneMKL's SSE2 vector math starts from: the
portable mode computes sqrt and log without it (device.exact_math), checked here against the IEEE square
root and glibc's log called apart from torch. Whether another machine gives the committed run's bits is
what `python bench/cpu_paths.py --fingerprint docs/results/portable/fingerprint.json` tells on it, and
`--emulate CPU` under qemu on this one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkgeom import config as C
from qkgeom.device import PORTABLE_ENV, DeviceError, check_portable, numpy_wide_loops, portable_env_missing
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


_EXACT_MATH = r"""
import ctypes, json, math, sys
import numpy as np, torch
from qkgeom import device as D

rng = np.random.default_rng(0)
x64 = np.concatenate([rng.uniform(0, 100, 100_000), 1 + rng.uniform(-1e-3, 1e-3, 50_000),
                      np.ldexp(rng.uniform(1, 2, 50_000), rng.integers(-100, 100, 50_000))])
x32 = x64.astype(np.float32)
sqrt32_cr = np.sqrt(x32.astype(np.float64)).astype(np.float32)  # correctly rounded: 53 bits >= 2 x 24 + 2
logf = ctypes.CDLL("libm.so.6").logf
logf.restype, logf.argtypes = ctypes.c_float, [ctypes.c_float]
some = rng.choice(len(x64), 4000, replace=False)
log64_glibc, log32_glibc = [math.log(x64[i]) for i in some], [logf(float(x32[i])) for i in some]

def counts():
    t32, t64 = torch.from_numpy(x32.copy()), torch.from_numpy(x64.copy())
    return [int((t32.sqrt().numpy() != sqrt32_cr).sum()),
            int((t64.sqrt().numpy() != np.array([math.sqrt(v) for v in x64])).sum()),
            int((t64.log().numpy()[some] != np.array(log64_glibc)).sum()),
            int((t32.log().numpy()[some] != np.array(log32_glibc, dtype=np.float32)).sum())]

before = counts()
D.exact_math(); D.exact_math()  # once, then nothing
after = counts()
y = torch.empty(0)
torch.sqrt(torch.tensor([4.0, 2.0]), out=y)
z = torch.tensor([9.0, 0.25]); z.sqrt_()
w = torch.tensor([4.0, 16.0], requires_grad=True); torch.sqrt(w).sum().backward()
specials = torch.log(torch.tensor([0.0, -1.0, math.inf, math.nan, 1.0])).tolist()
others = [torch.tensor([4, 9]).sqrt().tolist(), torch.tensor([6.25], dtype=torch.bfloat16).sqrt().item(),
          torch.tensor(2.25).sqrt().item(), torch.tensor(1.0).log().item(), str(torch.tensor(-4 + 0j).sqrt().item())]
try:
    torch.atan(torch.ones(3)); refused = ""
except D.DeviceError as e:
    refused = str(e)
print(json.dumps([before, after, y.tolist(), z.tolist(), w.grad.tolist(), specials, others, refused]))
"""


def test_portable_math_takes_no_estimate_of_the_silicon():
    """sqrt and log, where oneMKL's vector math under MKL_CBWR=COMPATIBLE starts from rsqrtps / rcpps
    (whose bits differ between CPU vendors), agree under exact_math with the IEEE square root and glibc's
    log called apart from torch; the first measure shows oneMKL's own differ (the case built to fail)."""
    env = {**os.environ, **PORTABLE_ENV}
    r = subprocess.run([sys.executable, "-c", _EXACT_MATH], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-800:]
    before, after, out, in_place, grad, specials, others, refused = json.loads(r.stdout.strip().splitlines()[-1])
    assert before[0] > 1000 and before[1] > 100 and before[2] > 10  # oneMKL's: not the IEEE / glibc results
    assert after == [0, 0, 0, 0]
    assert out == [2.0, float(np.float32(2.0**0.5))] and in_place == [3.0, 0.5] and grad == [0.25, 0.125]
    assert specials[0] == float("-inf") and specials[2] == float("inf") and specials[4] == 0.0
    assert np.isnan(specials[1]) and np.isnan(specials[3])
    assert others == [[2.0, 3.0], 2.5, 1.5, 0.0, "2j"]  # int and bfloat16 inputs, 0-dim, complex
    assert refused.startswith("train.portable: torch.atan on CPU runs oneMKL code whose bits differ")


NUMPY_VS_GLIBC = (
    "import math, numpy as np\n"
    "x = np.random.default_rng(0).uniform(0, 100, 200_000); y = x - 50\n"
    "print(int((np.log(x) != [math.log(v) for v in x]).sum()), int((np.exp(y) != [math.exp(v) for v in y]).sum()),"
    " int((np.power(x, 1.7) != [math.pow(v, 1.7) for v in x]).sum()))"
)


def test_portable_turns_off_numpys_avx512_loops_and_refuses_a_numpy_started_with_them():
    """numpy's AVX-512 float64 log, exp and power give other bits than the glibc calls it makes on an AVX2
    CPU. PORTABLE_ENV names those loops as numpy 2.0-2.3 and numpy >= 2.4 call them (the floors venv runs
    this with numpy 2.0.2): under it numpy computes glibc's bits, and a numpy that started before it is refused."""
    if not numpy_wide_loops():
        pytest.skip("this CPU has no AVX-512: numpy has no wide loops to turn off here")
    own, portable = os.environ, {**os.environ, **PORTABLE_ENV}
    differ = subprocess.run([sys.executable, "-c", NUMPY_VS_GLIBC], env=own, capture_output=True, text=True)
    assert min(int(n) for n in differ.stdout.split()) > 0, differ.stdout  # the case built to fail: they differ
    same = subprocess.run([sys.executable, "-c", NUMPY_VS_GLIBC], env=portable, capture_output=True, text=True)
    assert same.stdout.split() == ["0", "0", "0"], same.stdout + same.stderr[-300:]
    code = (
        "import os, numpy\nfrom qkgeom.device import PORTABLE_ENV, check_portable\n"
        "os.environ.update(PORTABLE_ENV)\ncheck_portable()"
    )
    env = {k: v for k, v in portable.items() if k != "NPY_DISABLE_CPU_FEATURES"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    line = r.stderr.splitlines()[-1] if r.stderr else ""
    refused = re.fullmatch(r"(qkgeom\.device\.)?DeviceError: train\.portable: numpy runs its (X86_V4|AVX512F) .*", line)
    assert r.returncode == 1 and refused, line
    r = subprocess.run([sys.executable, "-c", code], env=portable, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
