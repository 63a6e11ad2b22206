"""The README's code blocks marked `<!-- run by tests/test_readme.py -->` run verbatim here."""

import re

import pytest

from tests.conftest import REPO

MARK = r"<!-- run by tests/test_readme.py -->\n```python\n(.*?)```"
BLOCKS = re.findall(MARK, (REPO / "README.md").read_text(), re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_verbatim(code):
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    rows = namespace["rows"]
    assert {"layer", "head", "site", "metric", "value"} <= set(rows.columns)
    pr = rows[rows["metric"] == "key_participation_ratio"]
    assert len(pr) and pr["value"].between(1.0, 64.0).all()  # a participation ratio lies in [1, d]
