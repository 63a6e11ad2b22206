"""Context managers that read (capture) or replace (patch) outputs of named modules.

Hooks exist only inside the ``with`` block and are always removed, even on error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _modules(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
    table = dict(model.named_modules())
    missing = [n for n in names if n not in table]
    if missing:
        raise KeyError(f"no hook site named {missing[0]!r} in {type(model).__name__}")
    return {n: table[n] for n in names}


@contextmanager
def capture(model: nn.Module, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Yield a dict filled, during forward passes in the block, with each site's detached output."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    try:
        for name, mod in _modules(model, list(names)).items():
            handles.append(mod.register_forward_hook(lambda m, i, o, name=name: store.__setitem__(name, o.detach())))
        yield store
    finally:
        for h in handles:
            h.remove()


@contextmanager
def observe(model: nn.Module, fns: dict[str, Callable[[torch.Tensor], None]]) -> Iterator[None]:
    """Call each named site's fn with its detached output during forward passes in the block (the
    output is not changed, nor kept)."""
    handles = []
    try:
        for name, mod in _modules(model, list(fns)).items():
            handles.append(mod.register_forward_hook(lambda m, i, o, fn=fns[name]: fn(o.detach())))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def patch(model: nn.Module, fns: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[None]:
    """Replace each named site's output with fn(output) during the block."""
    handles = []
    try:
        for name, mod in _modules(model, list(fns)).items():
            handles.append(mod.register_forward_hook(lambda m, i, o, fn=fns[name]: fn(o)))
        yield
    finally:
        for h in handles:
            h.remove()
