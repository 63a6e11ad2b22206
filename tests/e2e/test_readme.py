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


def test_the_tiny_run_table_is_what_the_three_tiny_runs_give(wikitext, tmp_path):
    """The README's table of the tiny run (two PR conventions, two alpha conventions) against the three
    runs it names, trained here, at the digits it prints (it went stale once: the alpha default changed)."""
    import pandas as pd

    from qkgeom.cli import main

    text = (REPO / "README.md").read_text()
    block = re.search(r"trains the three runs and checks this table:\n\n```\n(.*?)```", text, re.S)
    assert block, "the README's tiny-run table is gone"
    lines = [ln.split() for ln in block[1].splitlines()]
    table = {int(r[0]): [float(v) for v in r[1:]] for r in lines if r[0].isdigit()}
    runs = {"default": [], "singular": ["--set", "probe.pr_convention='singular'"],
            "clauset": ["--set", "probe.alpha_convention='clauset'"]}  # fmt: skip
    layer = {}
    for name, sets in runs.items():
        assert main(["train", "tiny", "--out", str(tmp_path / name), "--no-progress", *sets]) == 0
        rows = pd.read_parquet(tmp_path / name / "geometry.parquet")
        last = rows[rows["step"] == rows["step"].max()]
        layer[name] = last[last["head"] == -1].pivot_table(index="layer", columns="metric", values="value")
        heads = last[(last["head"] >= 0) & (last["metric"] == "key_weight_alpha")]
        if name == "clauset":
            assert heads["value"].isna().all()
            assert set(heads["note"]) == {"alpha=clauset; fewer than 10 eigenvalues in any tail (8 non-zero)"}
        else:
            assert heads["value"].notna().all()  # WeightWatcher's small-sample fit of 8 eigenvalues
    alphas = [f"{w}_weight_alpha" for w in ("query", "key", "value", "output")]
    assert sorted(table) == [0, 1]
    for i, printed in table.items():
        d, s, c = (layer[n].loc[i] for n in runs)
        measured = [d["key_participation_ratio"], s["key_participation_ratio"], d["key_weight_participation_ratio"],
                    s["key_weight_participation_ratio"], *d[alphas], *c[alphas]]  # fmt: skip
        assert measured == pytest.approx(printed, abs=0.0051), f"layer {i}"


def test_every_command_line_in_the_readme_parses():
    """Each `qkgeom ...` line of the README's shell blocks is accepted by the CLI's parser as written
    (`a | b` lists alternatives, each parsed; `--help` exits 0), and every study it names exists."""
    import shlex

    from qkgeom.cli import build_parser
    from qkgeom.training.grid import resolve_sweep

    parser, parsed = build_parser(), 0
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.splitlines():
            code = line.split("#")[0].strip()
            for command in code.split("&&") if code.startswith("qkgeom ") else []:
                words = [re.sub(r"<[^>]+>", "x", w) for w in shlex.split(command)[1:]]
                last = max((i for i, w in enumerate(words) if w == "|"), default=-1)  # `cmd a | b | c rest`
                choices = words[1 : last + 2 : 2] if last > 0 else []
                for alternative in [[words[0], c, *words[last + 2 :]] for c in choices] or [words]:
                    try:
                        args = parser.parse_args(alternative)
                    except SystemExit as e:  # --help prints and exits 0; a bad line exits 2
                        assert e.code == 0, f"README: {command!r} does not parse"
                        continue
                    if args.fn.__name__ in ("cmd_study", "cmd_sweep"):
                        resolve_sweep(args.sweep)  # an unknown study is one line naming the known ones
                    parsed += 1
    assert parsed >= 25


def test_the_readme_lists_every_supported_architecture_as_archs_defines_it():
    """The README's table of supported model types against qkgeom/probing/archs.py's ARCHS: the same
    types, and for each whether it is rotary and whether it normalises q and k."""
    from qkgeom.probing.archs import ARCHS

    text = (REPO / "README.md").read_text()
    table = re.search(r"\| model type \|.*?\n\|---.*?\n((?:\|.*\n)+)", text)
    assert table, "the README's table of supported model types is gone"
    listed = {}
    for row in table[1].splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        for model_type in re.findall(r"`([\w.]+)`", cells[0]):
            norm = "head" if cells[4].startswith("per head") else "full" if cells[4] == "over all heads" else cells[4]
            listed[model_type] = (cells[3] != "no", norm)
    assert sorted(listed) == sorted(ARCHS)
    for name, arch in ARCHS.items():
        assert listed[name] == (arch.rotary, arch.qk_norm or "—"), name


def test_every_benchmark_is_in_the_readme_and_every_one_it_names_exists():
    """bench/ holds scripts that print their figures; the README says what each measures. Helpers the
    scripts import (common.py, cadence.py) are not scripts."""
    text = (REPO / "README.md").read_text()
    named, helpers = set(re.findall(r"bench/(\w+\.(?:py|sh))", text)), {"common.py", "cadence.py"}
    files = {p.name for p in (REPO / "bench").iterdir() if p.suffix in (".py", ".sh")}
    assert files - helpers <= named, f"benchmarks the README does not name: {sorted(files - helpers - named)}"
    assert named <= files, f"the README names benchmarks that do not exist: {sorted(named - files)}"
