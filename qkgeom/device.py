"""Devices: which one a run asks for, and the one door from it to the host.

Tensors stay on the model's device until their values are read; then `to_host` (or `host_list`,
`host_float`) detaches them and moves them to the CPU in one copy. Nothing else in qkgeom calls
`.numpy()`, `.item()`, `.tolist()`, `float()` or `int()` on a tensor: on a GPU `.numpy()` raises and
each `.item()` is a host sync of its own. tests/ground/test_device.py runs the probe, the trainer, the
callbacks and the pretrained path under a mode that refuses any such call made by qkgeom outside this
module (`converting` tells that mode a conversion is ours).

`check_device` turns a device name into a one-line error when the machine does not have it, naming
what it has.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import TYPE_CHECKING

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:  # torch is imported where it is used: config reads DEVICE_PATTERN without it
    import numpy as np
    import torch

_CONVERTING: ContextVar[bool] = ContextVar("qkgeom_host_conversion", default=False)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|mps")


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


def as_float(v: float | torch.Tensor) -> float:
    """A Python float from a number or a one-element tensor on any device (a tensor through the door)."""
    import torch

    return host_float(v) if isinstance(v, torch.Tensor) else float(v)


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
    """The devices this machine has: cpu, cuda:0 ... cuda:N-1, mps."""
    import torch

    out = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def check_device(name: str, what: str = "device") -> str:
    """`name` if this machine has it (`cuda` means cuda:0), else DeviceError in one line naming it and
    what is available."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise DeviceError(f"{what} {name!r} is not a device (cpu, cuda, cuda:N or mps)")
    have = available()
    wanted = "cuda:0" if name == "cuda" else name
    if wanted not in have:
        raise DeviceError(f"{what} {name!r} is not on this machine (available: {', '.join(have)})")
    return name
