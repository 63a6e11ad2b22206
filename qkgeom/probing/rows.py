"""The tidy rows a probe gives (layer, head, site, metric, value[, note]), built with their values still
on the model's device and read in one transfer at the end: the activation side (probing.probe) and
the weight side (probing.weights) both write through :class:`Rows`."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from qkgeom import device as D
from qkgeom.probing import geometry as G

Tensor = torch.Tensor


class Rows:
    """Rows of one site, each PR row noted with its convention (`conv`; a bias-corrected PR is always
    under the variance convention). A value given as a tensor is read at `finish()`: every such value,
    and whatever else is queued on `later`, in one transfer per device and dtype (qkgeom.device.Later),
    not one device sync per row."""

    def __init__(self, site: str, conv: str) -> None:
        self.site, self.conv, self.rows = site, conv, []
        self.later = D.Later()

    def add(self, layer: int, head: int, metric: str, value: float | Tensor) -> None:
        pr_conv = "variance" if metric.endswith("bias_corrected") else self.conv
        note = G.pr_note(pr_conv) if G.is_pr_metric(metric) else ""
        read = isinstance(value, torch.Tensor)
        known = math.nan if read else float(value)
        row = {"layer": layer, "head": head, "site": self.site, "metric": metric, "value": known}
        self.rows.append(row | {"note": note} if note else row)
        if read:
            self.later.want(value, self._filler(len(self.rows) - 1))

    def heads(self, layer: int, metric: str, values: Tensor | list) -> None:
        """One row per head (head h the h-th value)."""
        first, read = len(self.rows), isinstance(values, torch.Tensor)
        for h in range(len(values)):
            self.add(layer, h, metric, math.nan if read else values[h])
        if read:
            self.later.want(values, self._filler(first))

    def heads_and_mean(self, layer: int, metric: str, values: Tensor) -> None:
        """Each head's value, then the layer's (head -1) as their mean."""
        self.heads(layer, metric, values)
        self.add(layer, -1, metric, values.mean())

    def _filler(self, first: int) -> Callable[[np.ndarray], None]:
        """Writes an array's values into the rows from `first` on, as Python floats."""

        def put(values: np.ndarray) -> None:
            for i, v in enumerate(values.reshape(-1).tolist()):
                self.rows[first + i]["value"] = float(v)

        return put

    def finish(self) -> list[dict]:
        """The rows, every value read."""
        self.later.fetch()
        return self.rows
