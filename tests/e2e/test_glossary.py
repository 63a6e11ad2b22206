"""Every metric a run emits has its entry in docs/GLOSSARY.md's metric table (issue 55): a new metric
without a definition, range and gauge reading fails here."""

import fnmatch
import re

import pandas as pd
import pytest

from tests.conftest import REPO, tiny_config


def glossary_names() -> list[str]:
    """The metric table's names: every backticked name in its first column (`*_x` a family)."""
    text = (REPO / "docs" / "GLOSSARY.md").read_text()
    table = text[text.index("| metric |") : text.index("\n\n", text.index("| metric |"))]
    return [n for line in table.splitlines()[2:] for n in re.findall(r"`([^`]+)`", line.split("|")[1])]


@pytest.mark.usefixtures("wikitext")
def test_every_emitted_metric_has_a_glossary_entry(tmp_path):
    from qkgeom.training.loop import train

    names = glossary_names()
    assert "key_participation_ratio" in names and "*_effective_rank" in names
    # a controlled run emits its control's metrics too
    for kind, arm in (("none", {}), ("hold", {"kind": "hold"})):
        train(tiny_config(train={"steps": 12}, intervention=arm), tmp_path / kind, progress=False)
    emitted = set()
    for kind in ("none", "hold"):
        emitted |= set(pd.read_parquet(tmp_path / kind / "geometry.parquet")["metric"])
    missing = sorted(m for m in emitted if not any(fnmatch.fnmatchcase(m, n) for n in names))
    assert missing == []
