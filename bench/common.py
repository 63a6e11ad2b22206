"""Shared set-up for benchmarks: the WikiText mirror setting, as the tests use it; a device sync; a
clock on qkgeom's decompositions. Imports only what every qkgeom tree has (a before/after bench runs
against an older tree on PYTHONPATH): qkgeom.solves is imported when a SolveClock is made."""

import sys
import time
from pathlib import Path

import torch

from qkgeom.training.data import wikitext_mirror


def require_wikitext() -> Path:
    """$QKGEOM_WIKITEXT_DIR (default ../shared/data/wikitext); exits with a clear message if absent."""
    root = wikitext_mirror()
    if not (root / "wikitext-2" / "train.txt").is_file():
        sys.exit(f"benchmark needs the WikiText-2 mirror at {root} (set QKGEOM_WIKITEXT_DIR)")
    return root


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on a CPU): before and after anything timed."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class SolveClock:
    """Wall seconds spent inside qkgeom's decompositions while active: every eigen-, singular-value, QR
    and Cholesky solve goes through qkgeom.solves.host, whose outermost calls run through round_trip
    (on a GPU: copied to the host, solved by LAPACK there, copied back)."""

    def __init__(self) -> None:
        from qkgeom import solves as S

        self.solves, self.seconds, self.original = S, 0.0, S.round_trip

    def __enter__(self) -> "SolveClock":
        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tic

        self.solves.round_trip = timed
        return self

    def __exit__(self, *exc) -> None:
        self.solves.round_trip = self.original
