"""Shared set-up for benchmarks: the WikiText mirror setting, as the tests use it."""

import sys
from pathlib import Path

from qkgeom.training.data import wikitext_mirror


def require_wikitext() -> Path:
    """$QKGEOM_WIKITEXT_DIR (default ../shared/data/wikitext); exits with a clear message if absent."""
    root = wikitext_mirror()
    if not (root / "wikitext-2" / "train.txt").is_file():
        sys.exit(f"benchmark needs the WikiText-2 mirror at {root} (set QKGEOM_WIKITEXT_DIR)")
    return root
