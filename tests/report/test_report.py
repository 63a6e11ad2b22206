"""report and the study command: a real tiny study through the CLI, opened in headless Chromium."""

import shutil
import subprocess
import sys

import pandas as pd
import pytest

from tests.conftest import REPO, unavailable

pytestmark = pytest.mark.usefixtures("wikitext")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    sweep = tmp / "mini.toml"
    sweep.write_text(
        '[sweep]\nname = "mini"\nbase = "tiny"\n[set]\n"train.steps" = 12\n"probe.every" = 4\n'
        '[grid]\n"model.n_layers" = [1, 2]\n"model.qk_init" = ["independent", "tied"]\n'
        '"train.seed" = [0, 1]\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "qkgeom.cli", "study", str(sweep), "--out", str(tmp / "mini"), "--no-progress"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    return tmp / "mini", r.stdout


def test_study_writes_tables_and_prints_claims(study):
    out, stdout = study
    # the study ends with the verdict table and the report's path; the full table stays on disk
    assert (
        stdout.index("VERDICTS") < stdout.index("PR_K shrinks") < stdout.index("report:") and "ALL CLAIMS" not in stdout
    )
    assert stdout.rstrip().endswith("report/index.html") and len(stdout.splitlines()) < 60
    traj = pd.read_parquet(out / "summary.parquet")
    assert traj.groupby(["qk_init", "n_layers", "layer"]).ngroups == 2 * (1 + 2)
    claims = pd.read_csv(out / "claims.csv")
    assert set(claims["window"]) == {"whole", "post-transient"}
    assert set(claims["verdict"].dropna()) <= {"holds", "fails", "inconclusive"} and claims["n"].eq(2).all()
    raw = claims["claim"].str.contains("raw trend")
    assert raw.any() and claims.loc[raw, "verdict"].isna().all()  # kept for comparison, never judged
    judged = claims["verdict"].notna() & ~claims["claim"].str.startswith("PR_Q - PR_K > 0")
    assert claims.loc[judged, "mde_80"].notna().all()  # every judged row says what it could detect
    verdicts = pd.read_csv(out / "verdicts.csv")
    assert {"layers: first", "layers: last", "layers: lower half", "layers: upper half"} <= set(verdicts["group"])
    assert claims["interval"].str.startswith("95% t over seeds").all()
    sens = pd.read_csv(out / "sensitivity.csv")
    assert {"post-transient", "from 0.5"} <= set(sens["window"])
    assert {"all", "depth=1", "depth=2", "init=independent", "init=tied"} <= set(claims["group"])


def test_analyze_warns_on_a_corrupt_run_and_keeps_it(study, tmp_path):
    out, _ = study
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    victim = sorted(p for p in copy.iterdir() if p.is_dir() and p.name != "report")[0]
    (victim / "geometry.parquet").write_bytes(b"garbage")
    r = subprocess.run(
        [sys.executable, "-m", "qkgeom.cli", "analyze", str(copy)], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0 and f"corrupt run {victim.name}" in r.stderr
    assert (victim / "geometry.parquet").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "qkgeom.cli", "analyze", str(empty)], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 2 and "no finished runs" in r.stderr and r.stderr.count("\n") == 1


def test_report_renders_in_headless_chromium(study):
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    out, _ = study
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        unavailable("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get((out / "report" / "index.html").as_uri())
        assert driver.title == "qkgeom report: mini"
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])"
        )
        pngs = sorted(p.stem for p in (out / "report").glob("*.png"))
        assert sorted(i[0] for i in images) == pngs and len(pngs) >= 5
        assert all(complete and width > 100 for _, complete, width in images), images
        body = driver.find_element("tag name", "body").text
        # the report opens with the verdicts; the full table is folded away
        assert body.index("\nVerdicts\n") < body.index("\nFigures\n") < body.index("Full claims table")
        # the context box opens the report; a tiny-preset study says it checks the pipeline only
        assert body.index("How far training got.") < body.index("\nVerdicts\n")
        assert "nats/token against a unigram baseline of 3." in body  # one unit, as loss.png's axis says
        assert "This is a pipeline check, not the science." in body
        assert "window_sensitivity" in pngs
    finally:
        driver.quit()


def test_report_sets_weight_rank_beside_realised_rank_and_the_spectral_lifecycle(study):
    """energy_ranks.csv holds, per head of the first none run's last probe, the 90%-energy ranks of
    W_Q W_K^T and of the data's logits with their ratio, equal to the geometry rows; the report shows
    it and the alpha / PR lifecycle of W_Q, W_K, W_V, W_O."""
    out, _ = study
    ranks = pd.read_csv(out / "energy_ranks.csv")  # written by analyze (analysis.shown), drawn by the report
    run_id = ranks["run_id"].iloc[0]
    g = pd.read_parquet(out / run_id / "geometry.parquet")
    last = g[(g.step == g.step.max()) & (g["head"] >= 0)]
    for _, r in ranks.iterrows():
        w = last[(last.metric == "interaction_energy_rank90") & (last.layer == r.layer) & (last["head"] == r["head"])]
        d = last[(last.metric == "logit_energy_rank90") & (last.layer == r.layer) & (last["head"] == r["head"])]
        assert (r.weight_rank90, r.data_rank90) == pytest.approx((w.value.iloc[0], d.value.iloc[0]))
        assert r.ratio == pytest.approx(r.weight_rank90 / r.data_rank90)
    html = (out / "report" / "index.html").read_text()
    assert "energy_ranks" in html and "spectral_lifecycle" in html
    assert (out / "report" / "spectral_lifecycle.png").stat().st_size > 10_000


def test_the_verdict_figure_draws_each_verdict_rows_seeds(study):
    """verdict_seeds.png draws, for each row of the verdict table, the per-seed values claims.csv holds for
    it, scaled by the row's largest |value|, with its mean and 95% interval on the same scale."""
    import numpy as np

    from qkgeom.analysis.rows import per_seed_values
    from qkgeom.analysis.study import analyze
    from qkgeom.report import plots
    from qkgeom.report import study as RS

    out, _ = study
    a = analyze(out)
    keys = ["claim", "group", "window"]
    assert a.judged[keys].values.tolist() == a.verdict_table[keys].values.tolist()  # the same rows, in order
    assert "verdict_seeds" in RS.figures(a) and (out / "report" / "verdict_seeds.png").is_file()
    rows = pd.DataFrame({"label": ["a", "b"], "values": [np.array([1.0, -2.0, 4.0]), np.array([0.5, 0.25])],
                         "value": [1.0, 0.375], "ci_low": [-3.0, 0.1], "ci_high": [5.0, 0.6],
                         "verdict": ["inconclusive", "holds"]})  # fmt: skip
    fig = plots.verdict_seeds(rows, RS.VERDICT_COLOURS)
    ax = fig.axes[0]
    assert sorted(ax.collections[0].get_offsets()[:, 0]) == [-0.5, 0.25, 1.0]  # / 4, the row's largest |value|
    assert sorted(ax.collections[1].get_offsets()[:, 0]) == [0.5, 1.0]  # / 0.5
    lines = [ln.get_xdata() for ln in ax.lines if len(ln.get_xdata()) == 2]
    assert [list(x) for x in lines[:2]] == [[-0.75, 1.25], [0.2, 1.2]]  # the intervals, on each row's scale
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert per_seed_values(a.judged["per_seed"].iloc[0]).size == a.judged["n"].iloc[0]


def test_every_report_figure_reads_at_a_glance(study, monkeypatch):
    """The window-sensitivity figure was 17 stacked panels with x tick labels under the last only, no
    y-axis label and empty panels, and two figures' titles overlapped their first panel's. Every figure
    of a study's report and of a single run's report is now checked as drawn (report.layout): no
    overlapping text boxes, tick labels and a y-axis label on every panel with data, no empty panel.
    The check itself fails on a figure built with its title over a panel's title."""
    import matplotlib.pyplot as plt

    from qkgeom.analysis.study import analyze
    from qkgeom.report import study as RS
    from qkgeom.report.layout import layout_problems, tidy

    drawn: dict[str, list[str]] = {}
    real = RS.png_bytes

    def checked(fig):
        tidy(fig)  # as png_bytes does before drawing (tidy is idempotent)
        title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()
        drawn[title] = layout_problems(fig)
        return real(fig)

    monkeypatch.setattr(RS, "png_bytes", checked)
    path, _ = study
    RS.figures(analyze(path))
    one_run = next(p for p in sorted(path.iterdir()) if (p / "done.json").is_file())
    RS.write_report(analyze(one_run))
    assert len(drawn) >= 10, sorted(drawn)
    assert {t: p for t, p in drawn.items() if p} == {}
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("y")
    ax.set_title("a panel title")
    fig.suptitle("the figure title", y=0.91)  # no layout engine: drawn over the panel's title
    assert "figure title overlaps axes 0 ('a panel title') 'a panel title'" in layout_problems(fig)
    ax.set_xticks([])
    assert "axes 0 ('a panel title'): no x tick labels" in layout_problems(fig)
    plt.close(fig)


def test_a_short_runs_report_falls_back_to_the_whole_run_and_says_why(tmp_path):
    """`qkgeom report` on the tiny preset's run gave a per-layer table NaN in every slope column: its
    post-transient window starts at its last probe. The table now covers the whole run, the page says
    why, and the slopes are those of the whole-run window."""
    import re

    from qkgeom.analysis import claims as A
    from qkgeom.analysis.runs import load_runs
    from qkgeom.cli import main
    from qkgeom.training.loop import train
    from tests.conftest import tiny_config

    run = tmp_path / "tiny"
    train(tiny_config(), run, progress=False)
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "<h2>Per layer, whole run</h2>" in page
    assert re.search(r"the post-transient window \(from step 40\) holds 1 probe\(s\), too few for a slope", page)
    expected = A.per_run_statistics(A.window(A.with_transient(load_runs(run)), "whole"))
    table = page[page.index("<h2>Per layer") : page.index("</table>", page.index("<h2>Per layer"))]
    pr_k = [float(x) for x in re.findall(r"<td>([-0-9.e]+)</td>", table)[2::6]]  # column 3 of 6: the PR_K slope
    assert pr_k == pytest.approx(expected["slope:key_participation_ratio"].to_numpy(), rel=2e-3)  # shown at 3 digits


def test_the_context_reads_the_facts_a_run_wrote_and_rebuilds_them_the_same(tmp_path):
    """analysis/context.py rebuilt a GPT on the meta device and reloaded the corpus to learn a run's
    parameter count and unigram baseline (issue 55). done.json records them when the run finishes;
    the context reads them, and for a run finished before it did rebuilds the very same numbers."""
    import json

    from qkgeom.analysis.context import run_context
    from qkgeom.analysis.runs import load_runs
    from qkgeom.training.loop import train
    from tests.conftest import tiny_config

    run = tmp_path / "run"
    train(tiny_config(train={"steps": 12}), run, progress=False)
    g = load_runs(run)
    written = run_context(run, g)
    done = json.loads((run / "done.json").read_text())
    assert (written["parameters"], written["unigram_baseline"]) == (done["n_parameters"], done["unigram_baseline"])
    old = {k: v for k, v in done.items() if k not in ("n_parameters", "tokens_seen", "vocab_size", "unigram_baseline")}
    (run / "done.json").write_text(json.dumps(old))
    assert run_context(run, g) == written
