"""Shared set-up for benchmarks: the WikiText mirror setting, as the tests use it."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WIKITEXT = REPO.parent / "shared" / "data" / "wikitext"


def require_wikitext() -> Path:
    """QKGEOM_WIKITEXT_DIR (default ../shared/data/wikitext); exits with a clear message if absent."""
    root = Path(os.environ.setdefault("QKGEOM_WIKITEXT_DIR", str(DEFAULT_WIKITEXT)))
    if not (root / "wikitext-2" / "train.txt").is_file():
        sys.exit(f"benchmark needs the WikiText-2 mirror at {root} (set QKGEOM_WIKITEXT_DIR)")
    return root
