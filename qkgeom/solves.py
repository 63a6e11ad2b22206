"""Dense decompositions: the one door from a device to LAPACK on the host.

On CUDA, torch solves a batch of symmetric eigenproblems larger than 32 x 32 one matrix after another
(cuSOLVER's batched routine is used only up to n = 32; pytorch/pytorch#175585), each call with a
launch and an error check that waits for the device; SVDs and QR likewise. One probe at GPT-2-small
width solves 3,024 such matrices (64 x 64 head covariances and weight Grams, 256 x 256 logit Grams,
768 x 768 layer covariances and weight Grams; bench/probe_syncs.py counts them): issue 53 measured
~10 s a probe on an H200, where ten training steps take ~0.3 s. A CPU solves the same batch with
LAPACK in milliseconds per matrix, split over its threads (probing.geometry.batched_eigvalsh, on the
one pool below: `thread_map`, with `one_thread` LAPACK thread per chunk).

So every eigendecomposition, SVD, QR and Cholesky factorisation qkgeom makes runs inside `host`: its
tensor arguments are copied to the CPU once, the routine runs there (its fallbacks and finiteness
checks too, so they cost no device sync), and its tensor results are copied back to the device of the
first tensor argument. On a CPU `host` is the call itself: the numbers are the CPU's either way, so a
probe on a GPU gives the CPU's spectra of the device's Gram matrices. The products that form those
matrices stay on the device. tests/ground/test_device.py runs the probe, the trainer with its closed
loop, the complement and the pretrained path under a mode that refuses a `torch.linalg` decomposition
made by qkgeom outside this door (its SolveGuard).

Importing this module also settles oneMKL's vector-math kernels (`settle_vector_math`): torch's CPU
sqrt, log, exp and their kin call them from each of its threads, and oneMKL 2024.2, inside torch 2.13's
CPU wheels, picks each function's kernel on its first call; a first call made on two threads at once
can run one thread's whole chunk on a low-accuracy kernel (pytorch/pytorch#188792).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from qkgeom.errors import QKGeomError

F = TypeVar("F", bound=Callable[..., Any])
_SOLVING: ContextVar[bool] = ContextVar("qkgeom_host_solve", default=False)


def solving() -> bool:
    """Whether the current call is inside `host` (the guard in tests/ground/test_device.py reads it)."""
    return _SOLVING.get()


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _moved(x: Any, device: torch.device) -> Any:
    """`x` with every tensor in it (alone, or in a tuple or list) moved to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        items = [_moved(v, device) for v in x]
        return type(x)(items) if hasattr(x, "n_fields") else tuple(items)  # torch.return_types keep their names
    if isinstance(x, list):
        return [_moved(v, device) for v in x]
    return x


def round_trip(fn: Callable, args: tuple, kwargs: dict, device: torch.device | None) -> Any:
    """fn on the host copies of args, its results copied back to `device`: one crossing each way on a
    device, the call itself on the CPU (bench/probe_syncs.py counts these)."""
    if device is None or device.type == "cpu":
        return fn(*args, **kwargs)
    cpu = torch.device("cpu")
    out = fn(*_moved(args, cpu), **{k: _moved(v, cpu) for k, v in kwargs.items()})
    return _moved(out, device)


def host(fn: F) -> F:
    """`fn` (a decomposition, or a routine built of them) solved on the host, its results on the input's
    device; a call already inside the door runs as it is."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _SOLVING.get():
            return fn(*args, **kwargs)
        token = _SOLVING.set(True)
        try:
            return round_trip(fn, args, kwargs, _device_of(args, kwargs))
        finally:
            _SOLVING.reset(token)

    return wrapper  # type: ignore[return-value]


eigh = host(torch.linalg.eigh)
eigvalsh = host(torch.linalg.eigvalsh)
svd = host(torch.linalg.svd)
svdvals = host(torch.linalg.svdvals)
qr = host(torch.linalg.qr)


T, R = TypeVar("T"), TypeVar("R")
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch (MKL/OpenMP) thread, then restore the count (for work that is
    itself spread over threads, so the two do not oversubscribe the cores)."""
    k = torch.get_num_threads()
    if k == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(k)


def thread_map(fn: Callable[[T], R], items: Iterable[T], k: int) -> list[R]:
    """[fn(x) for x in items] over one persistent pool of `k` threads (made again only when k changes):
    for work that releases the GIL (LAPACK, NumPy). Called from the main thread, never from the pool."""
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE != k:  # our own record of its size: no private attribute needed
        _POOL, _POOL_SIZE = ThreadPoolExecutor(k, thread_name_prefix="qkgeom-pool"), k
    return list(_POOL.map(fn, items))


# the torch ops a CPU computes with oneMKL's vector math: IMPLEMENT_VML_MKL in torch 2.13's
# ATen/cpu/vml.h (tests/ground/test_device.py reads the installed torch's header)
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
           "tan", "tanh", "trunc")  # fmt: skip


def settle_vector_math() -> None:
    """Call each of `VML_OPS` once on one float32 and one float64 element, on this thread (at import).

    oneMKL 2024.2 resolves a vector-math function's kernel on its first call; when torch's threads make
    that first call together, each on its chunk of a tensor, one thread can compute its whole chunk with
    a low-accuracy kernel (pytorch/pytorch#188792: up to ~4,000 ulp for sqrt), and the next call is
    right again. Here it made whole probes differ from one process to the next: at GPT-2-small width
    2 of 64 in layer 0's logit row std (up to 7e-6 relative; the first call a float32 sqrt), at the
    paper preset 1 of 120 in layers 3-5's weight PRs and alphas (7e-10; a float64 sqrt of singular
    values, one thread's half), and once normalised entropy by an ulp (a float64 log). A one-element
    call runs on one thread, so after this no first call is shared: `python bench/vml_race.py` counts
    corrupted first calls with and without it, `bench/probe_repeat.py` whole probes (QKGEOM_VML_WARMUP=0
    skips this, for their cold arms)."""
    if os.environ.get("QKGEOM_VML_WARMUP", "1") == "0":
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            try:
                getattr(torch, name)(one)
            except QKGeomError:  # refused under device.exact_math (train.portable): nothing to settle
                pass


settle_vector_math()
