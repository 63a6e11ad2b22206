"""Devices: which one a run asks for, and the one door from it to the host.

Tensors stay on the model's device until their values are read; then `to_host` (or `host_list`,
`host_float`) detaches them and moves them to the CPU in one copy. Nothing else in qkgeom calls
`.numpy()`, `.item()`, `.tolist()`, `float()` or `int()` on a tensor: on a GPU `.numpy()` raises and
each `.item()` is a host sync of its own. tests/ground/test_device.py runs the probe, the trainer, the
callbacks and the pretrained path under a mode that refuses any such call made by qkgeom outside this
module (`converting` tells that mode a conversion is ours).

`check_device` turns a device name into a one-line error when the machine does not have it, naming
what it has. `PORTABLE_ENV`, `check_portable` and `exact_math` hold a run to one float code path
whatever the CPU (train.portable).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:  # torch is imported where it is used: config reads device_name_problem without it
    import numpy as np
    import torch

_CONVERTING: ContextVar[bool] = ContextVar("qkgeom_host_conversion", default=False)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
# Apple's GPUs: torch's MPS backend has no float64 (pytorch/pytorch#122602, closed as a known limit), and
# qkgeom measures in it; a run there would stop at the first float64 it met (a divergence check, the first
# probe), so it is refused at once
NO_FLOAT64 = (
    "Apple's MPS backend has no float64 (pytorch/pytorch#122602), in which qkgeom computes its probes, "
    "divergence checks and spectrum controls: run on cpu or cuda"
)


def device_name_problem(name: str) -> str | None:
    """What a config's device setting `name` says wrongly (to follow the setting's name in its one-line
    error), or None: `mps` (NO_FLOAT64), or no name of cpu, cuda, cuda:N. Whether this machine has it is
    check_device's question, asked when the device is used."""
    if name == "mps":
        return f"'mps': {NO_FLOAT64}"
    if not DEVICE_PATTERN.fullmatch(name):
        return f"must be cpu, cuda or cuda:N, got {name!r}"
    return None


class DeviceError(QKGeomError, ValueError):
    """A device this machine does not have, or a name that is no device."""


def converting() -> bool:
    """Whether the current call is inside `to_host` (the guard in tests/ground/test_device.py reads it)."""
    return _CONVERTING.get()


def to_host(t: torch.Tensor) -> np.ndarray:
    """The values of `t` as a NumPy array: detached and copied to the CPU (a no-op copy there); the
    dtype is kept (float64 stays float64)."""
    token = _CONVERTING.set(True)
    try:
        return t.detach().cpu().numpy()
    finally:
        _CONVERTING.reset(token)


def host_list(t: torch.Tensor) -> list:
    """`t`'s values as (nested) Python numbers: one transfer for the whole tensor."""
    return to_host(t).tolist()


def host_float(t: torch.Tensor) -> float:
    """A one-element tensor's value as a Python float."""
    return float(to_host(t).reshape(()))


class Later:
    """Host values wanted later, read together: `want(t, put)` queues tensor `t`; `fetch()` reads every
    queued tensor in one transfer per device and dtype (flattened and joined on its device, split on
    the host) and calls each `put` with its array, as `to_host` would give it. On a GPU each read is a
    device sync: a probe's rows at GPT-2-small width were ~600 of them."""

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, Callable[[np.ndarray], None]]] = []

    def want(self, t: torch.Tensor, put: Callable[[np.ndarray], None]) -> None:
        self._queue.append((t.detach(), put))

    def want_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Queue each tensor; the dict returned holds their arrays, by the same keys, once fetch() ran."""
        out: dict[str, np.ndarray] = {}
        for key, t in tensors.items():
            self.want(t, functools.partial(out.__setitem__, key))
        return out

    def fetch(self) -> None:
        import numpy as np
        import torch

        queue, self._queue = self._queue, []
        groups: dict[tuple, list[int]] = {}
        for i, (t, _) in enumerate(queue):
            groups.setdefault((t.device, t.dtype), []).append(i)
        for idxs in groups.values():
            flat = to_host(torch.cat([queue[i][0].reshape(-1) for i in idxs]))
            ends = np.cumsum([queue[i][0].numel() for i in idxs])
            for i, part in zip(idxs, np.split(flat, ends[:-1]), strict=True):
                queue[i][1](part.reshape(queue[i][0].shape))


def as_float(v: float | torch.Tensor) -> float:
    """A Python float from a number or a one-element tensor on any device (a tensor through the door)."""
    import torch

    return host_float(v) if isinstance(v, torch.Tensor) else float(v)


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """float32 matmuls at `precision` inside ("highest": full float32; "high": TF32 allowed on a GPU;
    "medium": bf16 allowed), and the caller's setting back after. torch has two APIs for it (since
    2.9 one per backend) and refuses to read the global setting once the per-backend one was set: it
    is changed and restored through the one the caller's state speaks."""
    import torch

    # what set_float32_matmul_precision(precision) sets each backend to (torch 2.11 and 2.13)
    per_backend = {"highest": {"cuda": "ieee", "mkldnn": "ieee"}, "high": {"cuda": "tf32", "mkldnn": "tf32"},
                   "medium": {"cuda": "tf32", "mkldnn": "bf16"}}[precision]  # fmt: skip
    try:
        before: str | dict[str, str] = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)  # sets every backend's flag as well
    except RuntimeError:  # set per backend (torch >= 2.9): speak that API
        before = {b: getattr(torch.backends, b).matmul.fp32_precision for b in _FP32_BACKENDS}
        for b in before:
            getattr(torch.backends, b).matmul.fp32_precision = per_backend[b]
    try:
        yield
    finally:
        if isinstance(before, str):
            torch.set_float32_matmul_precision(before)
        else:
            for b, value in before.items():
                getattr(torch.backends, b).matmul.fp32_precision = value


_FP32_BACKENDS = ("cuda", "mkldnn")  # the backends whose float32 matmuls may be reduced (TF32, bf16)


@contextmanager
def exact_float32() -> Iterator[None]:
    """Inside: float32 matmuls in full float32 and no autocast; after: the caller's settings, as they were.

    Training may allow reduced precision for float32 products: TF32 on a GPU (qkgeom's trainer on cuda
    and nanoGPT allow it; ~1e-3 relative), bf16 on a CPU with bf16 arithmetic (`"medium"`), or an
    autocast region around the loop. A measurement must not inherit it: every probe, pretrained
    analysis and callback measures inside this block (also a decorator), so geometry on cuda is the
    CPU's."""
    import torch

    with ExitStack() as stack:
        stack.enter_context(matmul_precision("highest"))
        for dev in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(dev, enabled=False))
        yield


def visible_gpus() -> list[str]:
    """The ids of the CUDA GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (else 0 .. N-1);
    [] without CUDA. What a local pool spreads its workers over (qkgeom.executor)."""
    import os

    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in named.split(",")] if named is not None else [str(i) for i in range(n)]
    return ids[:n]  # CUDA stops at the first id it cannot use; device_count() counts what it took


def available() -> list[str]:
    """The devices this machine has that qkgeom can run on: cpu, cuda:0 ... cuda:N-1."""
    import torch

    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def check_float64(device: str | torch.device, what: str) -> None:
    """DeviceError in one line where `device` cannot hold float64 (mps: NO_FLOAT64)."""
    kind = device if isinstance(device, str) else device.type
    if kind.split(":")[0] == "mps":
        raise DeviceError(f"{what} is on mps: {NO_FLOAT64}")


# The settings under which a CPU run takes one float code path whatever the CPU, its vector width (AVX2 or
# AVX-512) and its vendor (train.portable; README, "What repeats where"). They are read when torch and
# oneMKL start, so they must be in the environment before Python imports torch: `qkgeom train|sweep|study
# --portable` starts itself again with them. With a fixed thread count (oneMKL's reproducibility
# condition; torch's parallel reductions split by it too) and `exact_math` (which check_portable turns
# on: sqrt and log kept off oneMKL's vector math, whose SSE2 kernels start from the rsqrtps / rcpps
# estimate, and those bits differ between vendors), a run then repeats bit for bit on another x86-64
# CPU with the same torch build and C library (docs/LOG.md, 2026-12-06 and fifteenth session).
PORTABLE_ENV = {
    "MKL_CBWR": "COMPATIBLE",  # oneMKL's conditional reproducibility, its SSE2 branch: one code path for
    # matrix products, LAPACK and vector math on any CPU (the last with estimates: exact_math)
    "ATEN_CPU_CAPABILITY": "default",  # torch's own kernels built without vector instructions
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN (where torch calls it) held to the ISA every x86-64 CPU has
    "MKL_DYNAMIC": "FALSE",  # the thread count asked for is the one used
    "OMP_DYNAMIC": "FALSE",
    # numpy's AVX-512 loops (its own float64 log, exp, power: other bits than the AVX2 CPUs' glibc
    # calls), by both sets of names: numpy >= 2.4's X86_V4 ..., 2.0-2.3's AVX512F ...; each numpy passes
    # over the names it does not know
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR "
    "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL",
}


# oneMKL's vector-math kernels that start from the rsqrtps / rcpps estimate (objdump of its SSE2 branch,
# docs/LOG.md 2026-12-06), among the ops torch computes with it (solves.VML_OPS), are sqrt, log and these:
# train.portable computes sqrt and log another way (`exact_math`) and refuses these, which no qkgeom run calls.
REFUSED_OPS = ("acos", "asin", "atan", "log10", "log2", "tan")
_EXACT_LIB: list = []  # the torch.library registration, kept alive for the process (once made, it stays)


def _numpy_op(name: str, x: torch.Tensor) -> torch.Tensor:
    """numpy's ufunc `name` on a CPU tensor (a 0-dim input gives numpy a scalar: made an array again)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(getattr(np, name)(x.detach().numpy()))).reshape(x.shape)


def _exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """numpy's square root: the CPU's own instruction, correctly rounded (IEEE 754) on every CPU."""
    import torch

    if x.dtype == torch.bfloat16:  # in float32, rounded once more: still correctly rounded
        return _exact_sqrt(x.float()).to(torch.bfloat16)
    if not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.get_default_dtype())
    return _numpy_op("sqrt", x)


def _exact_log(x: torch.Tensor) -> torch.Tensor:
    """glibc's log, through torch's xlogy (x * log(y), here 1 * log(y): exact), or numpy's for complex."""
    import torch

    return _numpy_op("log", x) if x.is_complex() else torch.xlogy(1, x)


def _refused(name: str) -> Callable:
    def kernel(*args: object, **kwargs: object) -> None:
        raise DeviceError(
            f"train.portable: torch.{name} on CPU runs oneMKL code whose bits differ between CPU vendors; "
            "qkgeom's portable mode does not compute it"
        )

    return kernel


def _out_variant(fn: Callable) -> Callable:
    def kernel(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        out.resize_(y.shape)
        return out.copy_(y)

    return kernel


def _in_place(fn: Callable) -> Callable:
    return lambda x: x.copy_(fn(x))


def exact_math() -> None:
    """From now on, in this process, torch computes sqrt and log on CPU tensors without oneMKL's
    vector math, whose bits differ from one CPU vendor to another (docs/LOG.md, 2026-12-06), and
    refuses acos, asin, atan, log10, log2 and tan (DeviceError) rather than compute them there.

    sqrt is the CPU's square-root instruction (numpy's), correctly rounded by IEEE 754 on every CPU;
    log is glibc's (torch's xlogy with x = 1), one code on any x86-64 CPU with AVX2 and FMA. They are
    registered as torch's CPU kernels, so autograd, the optimisers and every caller get them. For
    train.portable (check_portable calls it); a second call does nothing."""
    if _EXACT_LIB:
        return
    import warnings

    import torch

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that each replaces its own kernel: that is the point
        warnings.simplefilter("ignore")
        for name, fn in (("sqrt", _exact_sqrt), ("log", _exact_log)):
            lib.impl(name, fn, "CPU")
            lib.impl(f"{name}.out", _out_variant(fn), "CPU")
            lib.impl(f"{name}_", _in_place(fn), "CPU")
        for name in REFUSED_OPS:
            for overload in (name, f"{name}.out", f"{name}_"):
                lib.impl(overload, _refused(name), "CPU")
    _EXACT_LIB.append(lib)


def portable_env_missing(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The settings of PORTABLE_ENV that `environ` (default os.environ) lacks or sets otherwise, with
    the value each needs ({} when all are in place)."""
    import os

    env = os.environ if environ is None else environ
    return {k: v for k, v in PORTABLE_ENV.items() if env.get(k, "").upper() != v.upper()}


def numpy_wide_loops() -> list[str]:
    """numpy's AVX-512 dispatch targets this process runs (numpy >= 2.4 names them X86_V4, AVX512_ICL,
    AVX512_SPR; older ones AVX512F, AVX512_SKX, ...): none under PORTABLE_ENV."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [t for t in __cpu_dispatch__ if t.startswith(("X86_V4", "AVX512")) and __cpu_features__.get(t)]


def kernel_capability() -> str:
    """The vector width torch's own CPU kernels run at (torch.backends.cpu.get_cpu_capability()), their
    scalar default called "DEFAULT" whatever the torch: torch 2.6 on x86 still calls it "NO AVX"."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return "DEFAULT" if capability == "NO AVX" else capability


def check_portable() -> None:
    """DeviceError in one line unless this process runs under PORTABLE_ENV, torch included (it reads
    ATEN_CPU_CAPABILITY when it starts: a setting made after `import torch` comes too late)."""
    missing = portable_env_missing()
    if missing:
        wanted = " ".join(f"{k}={v}" for k, v in missing.items())
        raise DeviceError(
            f"train.portable needs {wanted} in the environment before torch starts: run it through "
            "`qkgeom train|sweep|study --portable`, or set them before Python imports torch"
        )
    capability = kernel_capability()
    if capability != "DEFAULT":
        raise DeviceError(
            f"train.portable: torch started before ATEN_CPU_CAPABILITY=default was set and runs its kernels at "
            f"{capability}; set it before Python imports torch"
        )
    wide = numpy_wide_loops()
    if wide:
        raise DeviceError(
            f"train.portable: numpy runs its {' '.join(wide)} loops; it needs NPY_DISABLE_CPU_FEATURES to name "
            "them before numpy starts (PORTABLE_ENV names them as numpy 2.0 and later call them)"
        )
    exact_math()


def rerun_portable(argv: list[str], replace: bool) -> int:
    """Run `python -m qkgeom.cli argv` afresh under PORTABLE_ENV: the CLI's way into train.portable (this
    process's torch has already started). `replace`: this process becomes it (a signal sent to this pid
    reaches the run; for the command line); else a child process, its exit code returned (for callers
    of cli.main, which must get control back)."""
    import os
    import subprocess
    import sys

    cmd, env = [sys.executable, "-m", "qkgeom.cli", *argv], {**os.environ, **PORTABLE_ENV}
    if replace:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, cmd, env)
    return subprocess.call(cmd, env=env)


def check_device(name: str, what: str = "device") -> str:
    """`name` if this machine has it (`cuda` means cuda:0), else DeviceError in one line naming it and
    what is available."""
    check_float64(name, what)
    if not DEVICE_PATTERN.fullmatch(name):
        raise DeviceError(f"{what} {name!r} is not a device (cpu, cuda or cuda:N)")
    have = available()
    wanted = "cuda:0" if name == "cuda" else name
    if wanted not in have:
        raise DeviceError(f"{what} {name!r} is not on this machine (available: {', '.join(have)})")
    return name
