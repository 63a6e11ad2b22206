"""qkgeom.device: one door from a device to the host, guarded on a CPU, and device names checked.

CI has no GPU, so the guard runs the GPU-bound paths on the CPU under a torch function mode that
refuses `.numpy()`, `.item()`, `.tolist()`, `float()`, `int()` and `np.asarray` on a tensor when the
call is made by qkgeom code outside `qkgeom.device.to_host`: on a GPU `.numpy()` raises there
(issue 53: the trainer crashed at its first probe) and every other such call is a host sync of its
own. A second mode refuses a torch.linalg decomposition made by qkgeom outside
`qkgeom.solves.host` (on CUDA a batch of them is a loop of sequential solver calls). Library code
(torch, transformers) is not judged, only qkgeom's own frames.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

import qkgeom
from qkgeom import device as D
from qkgeom import solves as S

PACKAGE = Path(qkgeom.__file__).resolve().parent
CONVERSIONS = {"numpy", "item", "tolist", "__float__", "__int__", "__index__", "__array__"}


MACHINERY = ("torch/overrides.py", "torch/_tensor.py")  # how a call reaches the mode, not who made it


def _caller() -> str | None:
    """The file of the frame that made the conversion (library code inside torch or transformers counts
    as itself, not as the qkgeom code that called the library)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name != __file__ and not name.endswith(MACHINERY):
            return name
        f = f.f_back
    return None


class DoorGuard(TorchFunctionMode):
    """Refuses a call named in `names` made by qkgeom code while `inside()` says it is not in its door."""

    def __init__(self, names: set[str], inside, door: str) -> None:
        super().__init__()
        self.names, self.inside, self.door = names, inside, door

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.names and not self.inside():
            caller = _caller()
            if caller is not None and Path(caller).resolve().is_relative_to(PACKAGE):
                raise AssertionError(f"{name} outside {self.door}, called from {caller}")
        return func(*args, **(kwargs or {}))


def HostGuard() -> DoorGuard:
    """Refuses a tensor-to-host conversion made by qkgeom code outside qkgeom.device."""
    return DoorGuard(CONVERSIONS, D.converting, "qkgeom.device.to_host")


DECOMPOSITIONS = {
    "linalg_eigh", "linalg_eigvalsh", "linalg_svd", "linalg_svdvals", "linalg_qr", "linalg_cholesky",
    "linalg_cholesky_ex", "linalg_eig", "linalg_eigvals",
}  # fmt: skip


def SolveGuard() -> DoorGuard:
    """Refuses a torch.linalg decomposition made by qkgeom code outside qkgeom.solves.host (on CUDA each
    matrix of a batch over 32 x 32 is one sequential cuSOLVER call; qkgeom solves them on the host)."""
    return DoorGuard(DECOMPOSITIONS, S.solving, "qkgeom.solves.host")


@contextmanager
def guarded():
    """Both guards: conversions only through qkgeom.device, decompositions only through qkgeom.solves."""
    with HostGuard(), SolveGuard():
        yield


def test_the_solve_guard_refuses_a_decomposition_outside_the_door():
    """An eigvalsh as the probe made it before the door (geometry.robust_eigvalsh called
    torch.linalg.eigvalsh on the device's matrix), run from a qkgeom frame, is refused; through the door
    it passes with the values of the plain call, and a nested door call runs as it is."""
    a = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    code = compile("torch.linalg.eigvalsh(a)", str(PACKAGE / "probing" / "geometry.py"), "eval")
    with SolveGuard(), pytest.raises(AssertionError, match="linalg_eigvalsh outside qkgeom.solves.host"):
        eval(code, {"a": a, "torch": torch})
    with SolveGuard():
        assert S.eigvalsh(a).tolist() == [1.0, 3.0]
        assert S.host(lambda m: S.eigh(m).eigenvalues)(a).tolist() == [1.0, 3.0]  # names kept


def test_a_round_trip_returns_every_result_to_the_device_it_was_asked_for():
    """solves.round_trip for a non-CPU device: the routine runs on host copies and each tensor it returns
    (alone, in a tuple with None, or in a torch.return_types value with its names) comes back on that
    device; here the `meta` device stands in for a GPU (its tensors hold shapes, not values)."""
    a = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    meta = torch.device("meta")

    def seen_on(x: torch.Tensor) -> tuple[str, None, torch.Tensor]:
        return x.device.type, None, x.sum()

    where, nothing, total = S.round_trip(seen_on, (a,), {}, meta)
    assert (where, nothing, total.device.type) == ("cpu", None, "meta")
    out = S.round_trip(torch.linalg.eigh, (a,), {}, meta)
    assert out.eigenvalues.device.type == out.eigenvectors.device.type == "meta"
    assert out.eigenvalues.shape == (2,) and out.eigenvectors.shape == (2, 2)


def test_the_guard_refuses_a_conversion_outside_the_door():
    """The guard fails on the pattern that crashed the trainer on a GPU ((s**2).numpy() in the probe's
    alpha rows, before the fix), run here from a qkgeom frame, and lets the door through."""
    t = torch.arange(4, dtype=torch.float64)
    code = compile("t.numpy()", str(PACKAGE / "probing" / "probe.py"), "eval")  # a frame in qkgeom
    with HostGuard(), pytest.raises(AssertionError, match="numpy outside qkgeom.device.to_host"):
        eval(code, {"t": t})
    with HostGuard():
        assert D.to_host(t).tolist() == [0.0, 1.0, 2.0, 3.0] and D.host_float(t[2]) == 2.0
        assert D.host_list(t[:2]) == [0.0, 1.0]


def test_probe_trainer_and_instant_complement_convert_only_through_the_door(tmp_path, wikitext):
    """A closed-loop run with a control set and the none run's zero-training complement (every probe
    path the trainer has), trained on the CPU under the guard."""
    from qkgeom import config as C
    from qkgeom.training.loop import train

    base = ["train.steps=12", "probe.every=6", "train.eval_every=6", "intervention.control_seqs=2"]
    instant = "intervention.instant=['shape:activation:0.8:closed']"
    closed = ["intervention.kind='shape'", "intervention.ratio=0.8", "intervention.match_row_std=true"]
    with guarded():
        none = train(C.load("tiny", [*base, instant]), tmp_path / "none", progress=False)
        arm = C.load("tiny", [*base, *closed, f"intervention.baseline='{tmp_path / 'none'}'"])
        train(arm, tmp_path / "arm", progress=False)
    assert none.is_done() and (tmp_path / "arm" / "done.json").is_file()


def test_pretrained_path_converts_only_through_the_door():
    """analyse_model on a GPT-2 built from a config (the Hugging Face path), under the guard."""
    transformers = pytest.importorskip("transformers")
    from qkgeom.probing.hf import analyse_model

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (2, 16))
    with guarded():
        rows, _ = analyse_model(model, iter([ids]))
    assert {r["metric"] for r in rows} >= {"query_participation_ratio", "attention_entropy"}


def test_check_device_names_what_the_machine_has():
    """A device the machine lacks is one line naming it and what is available; cpu always passes."""
    assert D.check_device("cpu") == "cpu"
    with pytest.raises(D.DeviceError, match=r"'cuda:7' is not on this machine \(available: cpu"):
        D.check_device("cuda:7", "train.device")
    with pytest.raises(D.DeviceError, match="is not a device"):
        D.check_device("tpu")


def test_mps_is_refused_in_one_line_wherever_a_device_enters():
    """Apple's MPS has no float64, which the probes, divergence checks and spectrum controls compute in: a
    run there would stop at the first of them. Every way in names it at once (a torch.device("mps") can be
    made on any machine; a model or tensor on it cannot here, so those paths are checked by their device)."""
    from qkgeom import config as C
    from qkgeom.errors import ConfigError
    from qkgeom.families.config import load_pretrained

    why = r"has no float64 \(pytorch/pytorch#122602\).*run on cpu or cuda$"
    with pytest.raises(ConfigError, match=r"train.device 'mps': Apple's MPS backend " + why):
        C.load("tiny", ["train.device='mps'"])
    with pytest.raises(ConfigError, match=r"pretrained.device 'mps': Apple's MPS backend " + why):
        load_pretrained(None, ["model='gpt2'", "device='mps'"])
    with pytest.raises(D.DeviceError, match=r"^train.device is on mps: Apple's MPS backend " + why):
        D.check_device("mps", "train.device")
    with pytest.raises(D.DeviceError, match=r"^the model is on mps: "):
        D.check_float64(torch.device("mps"), "the model")
    for fine in ("cpu", "cuda", "cuda:1", torch.device("cpu"), torch.device("cuda", 0)):
        D.check_float64(fine, "x")  # no error
    assert "mps" not in D.available()


def test_the_kernel_capability_calls_torchs_default_kernels_one_name(monkeypatch):
    """torch 2.6 on x86 calls its scalar default kernels "NO AVX", torch 2.13 "DEFAULT": train.portable
    and the provenance read one name (under 2.6 portable was refused as "runs its kernels at NO AVX")."""
    for torch_says, read in (("NO AVX", "DEFAULT"), ("DEFAULT", "DEFAULT"), ("AVX2", "AVX2"), ("AVX512", "AVX512")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda v=torch_says: v)
        assert D.kernel_capability() == read


def test_to_host_keeps_dtype_and_values():
    """float64 stays float64 (the geometry's precision), values exact."""
    t = torch.tensor([1.0, 2.0 / 3.0], dtype=torch.float64)
    out = D.to_host(t)
    assert out.dtype == np.float64 and out[1] == 2.0 / 3.0


def test_later_reads_everything_in_one_transfer_per_dtype():
    """D.Later: each queued tensor comes back as to_host gives it (dtype, shape, values, 0-d included),
    in one copy per device and dtype, whatever the number of tensors queued."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.tensor(2.0 / 3.0, dtype=torch.float64),
          torch.randn(5, generator=g), torch.arange(6).reshape(2, 3), torch.randn(2, 2, generator=g)]  # fmt: skip
    got: dict[int, np.ndarray] = {}
    later = D.Later()
    for i, t in enumerate(ts):
        later.want(t, lambda a, i=i: got.__setitem__(i, a))
    copies = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "cpu":
                copies.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Count():
        later.fetch()
    assert sorted(map(str, copies)) == ["torch.float32", "torch.float64", "torch.int64"]  # 5 tensors, 3 copies
    for i, t in enumerate(ts):
        want = D.to_host(t)
        assert got[i].dtype == want.dtype and got[i].shape == want.shape and np.array_equal(got[i], want)
    later.fetch()  # the queue is empty once read: nothing is read twice
    assert len(copies) == 3
    by_name = later.want_all({"first": ts[0], "ids": ts[3]})  # a dict that fills at fetch
    assert by_name == {}
    later.fetch()
    assert list(by_name) == ["first", "ids"] and np.array_equal(by_name["ids"], D.to_host(ts[3]))


def test_streaming_a_layer_reads_nothing_from_the_device():
    """GeometryAccumulator.update_layer (what the probe runs as the forward reaches each layer) keeps its
    sums on the model's device: covariances and entropy make no conversion, copy to the host or bool of
    a tensor by qkgeom code, even through the door (on a GPU each would stall the forward); the logit
    spectrum copies only inside the solve door (its solves run on the host). The reads wait for
    rows(), which gives measure()'s rows for the same batch."""
    from qkgeom.probing.probe import GeometryAccumulator, measure

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 16, 8, generator=g), torch.randn(3, 4, 16, 8, generator=g)
    pattern = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -torch.inf)
    pattern = pattern.softmax(-1)
    support = torch.arange(1, 17).expand(3, 16)
    with DoorGuard(CONVERSIONS | {"cpu", "__bool__"}, lambda: False, "rows()"):
        GeometryAccumulator(logit_spectrum=False).update_layer(0, q, k, pattern, support)
    acc = GeometryAccumulator()
    with DoorGuard(CONVERSIONS | {"cpu"}, S.solving, "qkgeom.solves.host"):
        acc.update_layer(0, q, k, pattern, support)
    streamed = pd.DataFrame(acc.rows()).set_index(["layer", "head", "metric"])["value"].sort_index()
    whole = measure([q], [k], [pattern]).set_index(["layer", "head", "metric"])["value"].sort_index()
    assert len(streamed) == 100 and streamed.index.equals(whole.index)
    np.testing.assert_array_equal(streamed.to_numpy(), whole.to_numpy())


def test_the_probe_callback_path_converts_only_through_the_door(tmp_path):
    """qkgeom.Probe (what the Trainer and Lightning callbacks drive) in a plain loop with a loss passed
    as a tensor, under the guard."""
    from tests.probing.test_tracking import train_with_probe

    with guarded():
        train_with_probe(tmp_path / "p", steps=6, every=3)
    assert (tmp_path / "p" / "done.json").is_file()


def test_matmul_precision_sets_and_gives_back_through_the_callers_api():
    """device.matmul_precision on both of torch's APIs: the global one (set_float32_matmul_precision)
    and the per-backend one, whose use makes torch refuse to read the global one (torch >= 2.9; before,
    only the global one is there to test)."""
    import torch

    from qkgeom.device import matmul_precision

    per_backend = hasattr(torch.backends.mkldnn, "matmul")
    try:
        torch.set_float32_matmul_precision("medium")
        with matmul_precision("high"):
            assert torch.get_float32_matmul_precision() == "high"
            assert not per_backend or torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "medium"
        torch.set_float32_matmul_precision("highest")
        if not per_backend:
            return
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # per backend: the global getter now refuses
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        with matmul_precision("highest"):
            assert (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == (
                "ieee", "ieee")  # fmt: skip
        assert (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == (
            "bf16", "ieee")  # fmt: skip
    finally:
        if per_backend:
            torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        torch.set_float32_matmul_precision("highest")
    assert torch.get_float32_matmul_precision() == "highest"


RECORD_IMPORT = """
import json, torch
from torch.overrides import TorchFunctionMode
calls = []
class Record(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            calls.append([getattr(func, "__name__", str(func)), str(args[0].dtype), args[0].numel()])
        return func(*args, **(kwargs or {}))
with Record():
    import qkgeom.solves
print(json.dumps(calls))
"""


def _mkl_vector_math_ops() -> set[str]:
    """The torch ops the installed torch computes with oneMKL's vector math, read from its own header."""
    import re

    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.exists():
        pytest.skip(f"this torch ships no {header.name}")
    lines = [ln for ln in header.read_text().splitlines() if not ln.lstrip().startswith("//")]
    return set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", "\n".join(lines), flags=re.M))


def test_importing_the_solves_settles_every_vector_math_kernel_on_one_thread():
    """oneMKL 2024.2 picks a vector-math kernel on a function's first call, and a first call shared by
    torch's threads can compute one thread's chunk on a low-accuracy kernel (pytorch/pytorch#188792;
    bench/vml_race.py shows it). Importing qkgeom.solves must call every such op of the installed torch
    on one float32 and one float64 element (one element: one thread), and QKGEOM_VML_WARMUP=0 none."""
    import json
    import os
    import subprocess

    ops = _mkl_vector_math_ops()
    assert {"sqrt", "log", "exp"} <= ops, ops  # the header read as torch 2.13 writes it
    want = {(op, dtype) for op in ops for dtype in ("torch.float32", "torch.float64")}
    for flag in ("1", "0"):
        env = {**os.environ, "QKGEOM_VML_WARMUP": flag}
        out = subprocess.run([sys.executable, "-c", RECORD_IMPORT], env=env, capture_output=True, text=True, check=True)
        settled = {(name, dtype) for name, dtype, n in json.loads(out.stdout) if n == 1}
        if flag == "1":
            assert want <= settled, f"not settled at import: {sorted(want - settled)}"
        else:
            assert not want & settled
