"""Shared set-up for benchmarks: the WikiText mirror setting, as the tests use it; a clock on qkgeom's
decompositions."""

import sys
import time
from pathlib import Path

from qkgeom import solves as S
from qkgeom.training.data import wikitext_mirror


def require_wikitext() -> Path:
    """$QKGEOM_WIKITEXT_DIR (default ../shared/data/wikitext); exits with a clear message if absent."""
    root = wikitext_mirror()
    if not (root / "wikitext-2" / "train.txt").is_file():
        sys.exit(f"benchmark needs the WikiText-2 mirror at {root} (set QKGEOM_WIKITEXT_DIR)")
    return root


class SolveClock:
    """Wall seconds spent inside qkgeom's decompositions while active: every eigen-, singular-value, QR
    and Cholesky solve goes through qkgeom.solves.host, whose outermost calls run through round_trip
    (on a GPU: copied to the host, solved by LAPACK there, copied back)."""

    def __init__(self) -> None:
        self.seconds, self.original = 0.0, S.round_trip

    def __enter__(self) -> "SolveClock":
        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tic

        S.round_trip = timed
        return self

    def __exit__(self, *exc) -> None:
        S.round_trip = self.original
