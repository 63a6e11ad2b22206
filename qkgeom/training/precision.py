"""bf16 training on a CPU: which attention kernel is fastest *here*, measured once and recorded.

Under bf16 autocast, PyTorch's CPU flash-attention kernel can be slower than float32 on some CPUs
(measured on an AMX Xeon: the default path 0.8x, the math path 1.2x a float32 step), while on others
the math path is the slow one. So with `train.precision = "bf16"` on a CPU the training step times
one forward + backward of the run's own model and batch under each scaled-dot-product backend and
keeps the faster. The choice is cached per machine and shape (QKGEOM_CACHE/attention_paths.json: CPU
model and bf16 flags, torch version, batch and model shape) and recorded in the run's config.json
(`attention_path`). float32 (the default) never uses it: its results do not depend on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from qkgeom.config import RunConfig
from qkgeom.results import atomic_write_bytes
from qkgeom.training.data import batch_offsets, cache_dir, gather

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
CACHE_FILE = "attention_paths.json"


def _cpu_model_and_flags() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: the platform strings alone
        pass
    return model, flags


def cpu_signature() -> str:
    """The CPU model and its bf16 / AVX-512 flags, and the torch version: what the timing depends on."""
    model, flags = _cpu_model_and_flags()
    wanted = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{model} [{' '.join(wanted)}] torch {torch.__version__}"


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AMX or AVX-512 BF16); elsewhere oneDNN emulates bf16 through
    float32 and a bf16 step is slower than a float32 one (measured on an AVX2 AMD EPYC, docs/LOG.md)."""
    return bool(_cpu_model_and_flags()[1] & {"amx_bf16", "avx512_bf16"})


@contextlib.contextmanager
def attention_path(path: str | None) -> Iterator[None]:
    """The scaled-dot-product backend `path` (a key of BACKENDS) for the block, or PyTorch's own choice."""
    if path is None:
        yield
        return
    with sdpa_kernel([BACKENDS[path]]):
        yield


def _time_step(step: Callable[[], torch.Tensor], trials: int) -> float:
    step()  # warm-up: kernels chosen, buffers allocated
    best = float("inf")
    for _ in range(trials):
        tic = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - tic)
    return best


def choose_cpu_attention(
    model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], shape: str, cache: Path | None, trials: int = 3
) -> dict:
    """The faster backend for bf16 training of `model` on this CPU: {"path", "ms": {backend: ms per
    forward + backward}, "cached", "machine"}. loss_fn computes the training loss of one real batch
    (it runs under bf16 autocast here); gradients are cleared afterwards, the weights never change.
    `shape` names what the timing depends on besides the machine (batch and model shape)."""
    key = f"{cpu_signature()} | {shape}"
    path = cache / CACHE_FILE if cache is not None else None
    known: dict = {}
    if path is not None and path.is_file():
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}  # a damaged cache is measured again and rewritten whole
    if key in known:
        return {**known[key], "cached": True, "machine": key}

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        return loss

    ms = {}
    for name in BACKENDS:
        try:
            with attention_path(name):
                ms[name] = 1000 * _time_step(step, trials)
        except RuntimeError:  # a backend this build or input cannot run
            continue
    for p in model.parameters():
        p.grad = None
    choice = {
        "path": min(ms, key=ms.get) if ms else None,
        "ms": {k: round(v, 2) for k, v in ms.items()},
        "native_bf16": native_bf16(),
    }
    if path is not None and choice["path"] is not None:
        known[key] = choice
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(known, indent=1, sort_keys=True).encode())
    return {**choice, "cached": False, "machine": key}


def cpu_bf16_attention(
    model: torch.nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cfg: RunConfig,
    train_data: np.ndarray,
) -> dict:  # fmt: skip
    """The attention kernel for bf16 training of `model` on this CPU (training/precision.py), timed on
    the run's first real batch and cached per machine and shape; warns where bf16 is emulated."""
    t, m = cfg.train, cfg.model
    x, y = gather(train_data, batch_offsets(len(train_data), m.n_ctx, t.batch_size, t.data_seed, 0), m.n_ctx)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    shape = f"batch {t.batch_size}x{m.n_ctx}, {m.n_layers} layers x d_model {m.d_model}, {m.n_heads} heads"
    choice = choose_cpu_attention(model, lambda: loss(x, y), shape, cache_dir())
    if not choice.get("native_bf16", True):
        warnings.warn(
            "train.precision = bf16 on a CPU without bf16 arithmetic (no amx_bf16 / avx512_bf16): it is "
            "emulated here and slower than float32 (train.precision = float32 is faster on this machine)",
            stacklevel=3,
        )
    return choice
