"""The README's code blocks marked `<!-- run by tests/e2e/test_readme.py -->` run verbatim here, each in
an empty working directory; a block that trains writes run folders under runs/, which
`qkgeom analyze` and `qkgeom report` must then read."""

import re

import pytest

from tests.conftest import REPO

MARK = r"<!-- run by tests/e2e/test_readme.py -->\n```python\n(.*?)```"
BLOCKS = re.findall(MARK, (REPO / "README.md").read_text(), re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 5
    assert sum("QKGeometryCallback" in b for b in BLOCKS) == 2 and sum("qkgeom.Probe(" in b for b in BLOCKS) == 1


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_verbatim(code, tmp_path, monkeypatch, request):
    if "load_corpus" in code:
        request.getfixturevalue("wikitext")  # the block reads WikiText-2: a skip without it, a failure under CI
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # what a block sets is undone after it
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    rows = namespace["rows"]
    assert {"layer", "head", "site", "metric", "value"} <= set(rows.columns)
    pr = rows[rows["metric"] == "key_participation_ratio"]
    assert len(pr) and pr["value"].between(1.0, 64.0).all()  # a participation ratio lies in [1, d]
    studies = sorted(p for p in (tmp_path / "runs").glob("*") if list(p.glob("*/done.json")))
    if "qkgeom.Probe(" in code or "QKGeometryCallback" in code:
        from qkgeom.cli import main

        assert studies, "the block wrote no finished run folder"
        for study in studies:
            assert main(["analyze", str(study)]) == 0
            assert main(["report", str(study)]) == 0
            assert (study / "report" / "index.html").is_file()
