"""records: a committed study's per-run records re-derive its verdicts byte for byte, and a record
analyses like the run folder it came from."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis.records import recorded_runs, write_record
from qkgeom.cli import main
from qkgeom.results import RunDir
from tests.conftest import REPO, tiny_config

RESULTS = REPO / "docs" / "results"
# committed studies with records: the tables each must re-derive byte-identical, and its primary ids
REDERIVED = {
    "ladder-cpu": (
        ("claims.csv", "verdicts.csv", "ladder_key_slopes.csv", "robustness.csv", "per_layer.csv", "ladder_facts.json"),
        ["L1", "L2", "L3", "L4"],
    ),
    "study-keys-cpu": (("claims.csv", "verdicts.csv", "per_layer.csv", "robustness.csv"), ["P1"]),
    "causal-shape-cpu": (("claims.csv", "verdicts.csv"), ["C1"]),
    "causal-v4-cpu": (
        ("claims.csv", "verdicts.csv", "matched_dose.csv", "scale_check.csv", "robustness.csv"),
        ["V1", "V2", "V3", "V4"],
    ),
    "study-trainer-gpt2": (("claims.csv", "verdicts.csv", "per_layer.csv", "robustness.csv"), ["T1", "T2", "T3", "T4"]),
    "study-trainer-gpt2-replication": (
        ("claims.csv", "verdicts.csv", "per_layer.csv", "robustness.csv"),
        ["R1", "R2", "R3", "R4"],
    ),
    "study-causal-cpu": (("claims.csv", "verdicts.csv", "per_layer.csv", "robustness.csv"), ["O1", "O2"]),
    "study-family-cpu": (
        ("claims.csv", "verdicts.csv", "family_claims.csv", "family_seeds.csv", "per_layer.csv", "robustness.csv")
        + ("family_windows.csv",),
        ["F1", "F2", "F4"],
    ),
    "study-family-replication": (
        ("claims.csv", "verdicts.csv", "family_claims.csv", "family_seeds.csv", "per_layer.csv", "robustness.csv")
        + ("family_windows.csv",),
        ["F1", "F2", "F2L0", "F4"],
    ),
}


def test_every_study_with_records_is_rederived_here():
    """A committed study with per-run records that this file does not re-derive would be unguarded."""
    with_records = {d.name for d in RESULTS.iterdir() if (d / "runs").is_dir() and (d / "claims.csv").is_file()}
    assert with_records <= set(REDERIVED)


@pytest.mark.parametrize("study", sorted(REDERIVED))
def test_a_committed_study_reanalyses_byte_identical(study, tmp_path, capsys):
    """`qkgeom analyze docs/results/<study>` from the records alone rewrites the committed tables
    exactly: every committed verdict is re-derivable."""
    committed = RESULTS / study
    if not (committed / "runs").is_dir():
        pytest.skip(f"no committed {study} records")
    names, primary = REDERIVED[study]
    copy = tmp_path / study
    shutil.copytree(committed / "runs", copy / "runs")
    for name in ("sweep.json", "preregistration.toml", "preregistration_versions.json"):  # [analysis], amendments
        if (committed / name).is_file():
            shutil.copy(committed / name, copy / name)
    assert main(["analyze", str(copy)]) == 0, capsys.readouterr().err
    for name in names:
        assert (copy / name).read_bytes() == (committed / name).read_bytes(), name
    claims = pd.read_csv(copy / "claims.csv")
    assert sorted(claims.loc[claims["primary"].notna(), "primary"]) == primary


def test_rewording_every_claim_changes_no_verdict(tmp_path, capsys, monkeypatch):
    """Claims were keyed by their prose: rewording one in the code silently dropped it from its Holm
    family. trainer-gpt2's records analysed with every main claim reworded give the same primary rows,
    verdicts, Holm p, per-layer rows and variants; only the wording column differs."""
    from qkgeom.analysis import claims as A

    committed = RESULTS / "study-trainer-gpt2"
    copy = tmp_path / "study-trainer-gpt2"
    shutil.copytree(committed / "runs", copy / "runs")
    for name in ("preregistration.toml", "preregistration_versions.json"):
        shutil.copy(committed / name, copy / name)
    monkeypatch.setattr(A, "SLOPE_CLAIMS", tuple((m, f"reworded {c}", s) for m, c, s in A.SLOPE_CLAIMS))
    monkeypatch.setattr(A, "CORRELATION_CLAIMS", tuple((x, y, f"x {c}", s) for x, y, c, s in A.CORRELATION_CLAIMS))
    monkeypatch.setattr(A, "CO_MOVEMENT", ": co-movement, in other words")
    assert main(["analyze", str(copy)]) == 0, capsys.readouterr().err
    for name in ("claims.csv", "per_layer.csv"):
        new, old = pd.read_csv(copy / name), pd.read_csv(committed / name)
        assert (new["claim"] != old["claim"]).sum() >= 4  # reworded, and the four primaries still found
        pd.testing.assert_frame_equal(new.drop(columns="claim"), old.drop(columns="claim"))
    assert (copy / "robustness.csv").read_bytes() == (committed / "robustness.csv").read_bytes()


def test_a_record_is_a_slim_run_folder_that_analyses_the_same(tmp_path):
    from qkgeom.analysis.study import analyze
    from qkgeom.training.loop import train

    for seed in (0, 1):
        train(tiny_config(train={"steps": 12, "seed": seed}), tmp_path / "runs" / f"s{seed}", progress=False)
    for seed in (0, 1):
        rec = write_record(tmp_path / "runs" / f"s{seed}", tmp_path / "study" / "runs")
        assert sorted(p.name for p in rec.iterdir()) == [
            "config.json", "done.json", "geometry.parquet", "metrics.jsonl", "seal.json", "vocab.json"
        ]  # fmt: skip
    assert recorded_runs(tmp_path / "study") == {"s0", "s1"}
    full, slim = analyze(tmp_path / "runs").claims, analyze(tmp_path / "study").claims
    pd.testing.assert_frame_equal(full, slim)
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        (tmp_path / "runs" / "s0" / "done.json").unlink()
        write_record(tmp_path / "runs" / "s0", Path(tmp_path / "study" / "runs"))


def test_the_verdicts_index_matches_the_committed_csvs():
    """docs/results/VERDICTS.md is what `qkgeom verdicts` derives from the committed claims.csv files
    and pre-registrations today: a changed CSV or statistic without a rewritten index fails here."""
    from qkgeom.analysis.verdict_index import verdicts_index

    root = REPO / "docs" / "results"
    assert verdicts_index(root) == (root / "VERDICTS.md").read_text()


@pytest.mark.usefixtures("wikitext")
def test_an_accumulating_study_records_each_run_and_skips_recorded_ones(tmp_path, capsys, monkeypatch):
    """`qkgeom study` on a ladder with [analysis] records: every finished run's record is written at
    once, the study is analysed from the records (interim while runs are missing), and a second
    sitting trains nothing that is recorded; --dry-run says recorded / to do."""
    records = tmp_path / "results" / "mini-ladder"
    sweep = tmp_path / "mini-ladder.toml"
    sweep.write_text(
        '[sweep]\nname = "mini-ladder"\nbase = "tiny"\norder = "seed"\n'
        '[grid]\n"train.steps,probe.every,train.eval_every" = [[20, 5, 5], [40, 10, 10]]\n'
        '"train.seed,train.data_seed" = [[0, 1000], [1, 1001], [2, 1002]]\n'
        f'[analysis]\nrecords = "{records}"\nmargin = 0.1\n'
        'primary = [{ id = "L1", claim_id = "budget_trend:key_participation_ratio:first_layer" }]\n'
    )
    out = tmp_path / "runs"
    assert main(["study", str(sweep), "--out", str(out), "--dry-run"]) == 0  # a first sitting: nothing to time by
    assert "recorded 0 / 6; to do 6 runs; no time estimate until a run of their shapes" in capsys.readouterr().out
    args = ["study", str(sweep), "--out", str(out), "--no-progress", "--workers", "1"]
    assert main(args) == 0, capsys.readouterr().err
    assert recorded_runs(records) == {d.name for d in out.iterdir() if (d / "done.json").is_file()}
    assert len(recorded_runs(records)) == 6 and (records / "sweep.json").is_file()
    claims = pd.read_csv(records / "claims.csv")
    l1 = claims[claims["primary"] == "L1"].iloc[0]
    assert l1["n"] == 3 and not str(l1["reading"]).startswith("interim")
    shutil.rmtree(out)  # the next session has no run folders, only the committed records
    capsys.readouterr()
    assert main(args) == 0
    assert "0 trained, 6 already done" in capsys.readouterr().out
    assert main(["study", str(sweep), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text.count("[recorded]") == 6 and "recorded 6 / 6; to do 0 runs" in text

    # killed between a run's done.json and its record's write: the temp folder of the record write is
    # left, the record is not; a rerun lost that run for good (verdicts from 2 of 3 seeds)
    import qkgeom.analysis.records as R

    lost = sorted((records / "runs").iterdir())[0]
    shutil.move(lost, records / "runs" / f".{lost.name}.tmp")  # a record write cut short

    def killed(run, dest):
        raise KeyboardInterrupt  # the study dies after the run's done.json, before its record

    monkeypatch.setattr(R, "write_record", killed)
    assert main(args) == 130 and RunDir(out / lost.name).is_done()
    monkeypatch.undo()
    (records / "runs" / f".{lost.name}.tmp").mkdir()  # the killed write's half folder
    capsys.readouterr()
    assert main(args) == 0
    text, err = capsys.readouterr()
    assert "0 trained" in text
    assert f"recorded {lost.name} (finished earlier without its record)" in err and "removed" in err
    assert (lost / "done.json").is_file() and not list((records / "runs").glob(".*"))
    assert len(recorded_runs(records)) == 6 and "skipping" not in err
    claims = pd.read_csv(records / "claims.csv")
    assert claims[claims["primary"] == "L1"].iloc[0]["n"] == 3


def _ladder_copy(tmp_path) -> Path:
    """The committed ladder-cpu records (and what `verdicts` reads) in a scratch study folder."""
    committed = RESULTS / "ladder-cpu"
    if not (committed / "runs").is_dir():
        pytest.skip("no committed ladder-cpu records")
    copy = tmp_path / "results" / "ladder-cpu"
    shutil.copytree(committed / "runs", copy / "runs")
    for name in ("sweep.json", "claims.csv", "preregistration_versions.json"):
        shutil.copy(committed / name, copy / name)
    return copy


def test_a_changed_preregistration_is_refused_unless_registered_as_a_new_version(tmp_path, capsys):
    """Editing the [analysis] a study's records were judged under silently changed verdicts (one primary
    went from not surviving Holm to surviving). Now analyze and verdicts refuse it in one line naming
    the file, until `qkgeom amend` registers the change; VERDICTS.md then lists both versions."""
    import json

    copy = _ladder_copy(tmp_path)
    sweep = json.loads((copy / "sweep.json").read_text())
    sweep["analysis"]["margin"] = 0.2
    (copy / "sweep.json").write_text(json.dumps(sweep))
    for cmd in (["analyze", str(copy)], ["verdicts", str(copy.parent)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "sweep.json [analysis]" in err and "changed after its records" in err, err
    assert main(["amend", str(copy), "--note", "margin 0.2 (test) | <b>x</b>\n# not a heading"]) == 0
    assert main(["analyze", str(copy)]) == 0
    capsys.readouterr()
    assert main(["verdicts", str(copy.parent)]) == 0
    text = (copy.parent / "VERDICTS.md").read_text()
    assert "- ladder-cpu v1: as first registered" in text and "- ladder-cpu v2 (" in text and "margin 0.2" in text
    assert "margin 0.2 (test) \\| \\<b\\>x\\</b\\> \\# not a heading" in text  # a note is inert text on one line
    assert main(["amend", str(copy), "--note", "again"]) == 2  # nothing changed since v2
    sweep["analysis"]["margin"] = 0.3  # an unregistered change after the amendment is refused again
    (copy / "sweep.json").write_text(json.dumps(sweep))
    assert main(["analyze", str(copy)]) == 2


def test_bent_records_are_refused_naming_both(tmp_path, capsys):
    """A record copied over another's folder cut n from 4 to 3 without a word; a record that stopped
    short of its steps was used; two records of one (arm, seed, budget) would be pooled."""
    import json

    from qkgeom import config as C

    copy = _ladder_copy(tmp_path)
    runs = sorted((copy / "runs").iterdir())
    a, b = runs[0], runs[1]
    shutil.rmtree(b)
    shutil.copytree(a, b)
    assert main(["analyze", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"record folder {b.name} holds the record of run {a.name}" in err and err.count("\n") == 1
    shutil.rmtree(b)
    done = json.loads((a / "done.json").read_text())
    (a / "done.json").write_text(json.dumps({**done, "step": done["step"] // 2}))
    assert main(["analyze", str(copy)]) == 2
    assert f"record {a.name} finished at step {done['step'] // 2}" in capsys.readouterr().err
    (a / "done.json").write_text(json.dumps(done))
    info = json.loads((a / "config.json").read_text())
    info["config"]["name"] = "renamed"  # another id, the same (arm, seed, budget)
    twin = C.run_id(C.from_dict(info["config"]))
    shutil.copytree(a, copy / "runs" / twin)
    (copy / "runs" / twin / "config.json").write_text(json.dumps({**info, "run_id": twin}))
    assert main(["analyze", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "are the same (arm, seed, budget)" in err and a.name in err and twin in err


def test_records_are_sealed_by_their_data(tmp_path, capsys):
    """Editing a record's geometry (PR_Q x 1.5 in one run) or moving one run's geometry and metrics into
    another's record (its config kept) changed the claims with rc 0. Every record now carries seal.json
    (sha256 of each of its files); analyze and verdicts refuse any change, naming the record and file. A
    record without a seal, or re-sealed without its stamp, is refused too."""
    import json

    copy = _ladder_copy(tmp_path)
    a, b = sorted((copy / "runs").iterdir())[:2]
    g = pd.read_parquet(a / "geometry.parquet")
    g.loc[g["metric"] == "query_participation_ratio", "value"] *= 1.5
    g.to_parquet(a / "geometry.parquet", index=False)
    for cmd in (["analyze", str(copy)], ["verdicts", str(copy.parent)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"record {a.name}: geometry.parquet changed after" in err, err
    shutil.copy(RESULTS / "ladder-cpu" / "runs" / a.name / "geometry.parquet", a / "geometry.parquet")
    assert main(["analyze", str(copy)]) == 0  # restored byte for byte: read again
    capsys.readouterr()
    for name in ("geometry.parquet", "metrics.jsonl"):  # b's data under a's config
        shutil.copy(b / name, a / name)
    assert main(["analyze", str(copy)]) == 2
    assert f"record {a.name}: geometry.parquet changed" in capsys.readouterr().err
    for name in ("geometry.parquet", "metrics.jsonl"):
        shutil.copy(RESULTS / "ladder-cpu" / "runs" / a.name / name, a / name)
    (a / "seal.json").unlink()
    assert main(["analyze", str(copy)]) == 2
    assert f"record {a.name} in {copy} has no seal.json" in capsys.readouterr().err
    info = json.loads((a / "config.json").read_text())
    del info["record"]["preregistration"]  # unstamped, then sealed on purpose: still not read
    (a / "config.json").write_text(json.dumps(info))
    assert main(["amend", str(copy), "--seal", "--note", "test"]) == 0
    capsys.readouterr()
    assert main(["analyze", str(copy)]) == 2
    assert f"record {a.name} in {copy} carries no pre-registration stamp" in capsys.readouterr().err
    assert main(["amend", str(tmp_path / "nowhere"), "--note", "x"]) == 2 and not (tmp_path / "nowhere").exists()


def test_a_refused_sitting_changes_nothing_and_amend_registers_the_edit(tmp_path, capsys):
    """A sitting refused for an edited [analysis] had already rewritten the records' sweep.json with the
    edit. Now every check runs before anything is written; `qkgeom amend --sweep FILE` registers the
    edit (the manifest takes it), and the next sitting runs."""
    records = tmp_path / "results" / "mini"
    sweep = tmp_path / "mini.toml"
    text = (
        '[sweep]\nname = "mini"\nbase = "tiny"\n[set]\n"train.steps" = 10\n"probe.every" = 5\n'
        '[grid]\n"train.seed,train.data_seed" = [[0, 1000], [1, 1001]]\n'
        f'[analysis]\nrecords = "{records}"\nmargin = 0.1\n'
    )
    sweep.write_text(text)
    args = ["study", str(sweep), "--out", str(tmp_path / "runs"), "--no-progress", "--workers", "1"]
    assert main(args) == 0, capsys.readouterr().err
    before = {p: p.read_bytes() for p in records.rglob("*") if p.is_file() and p.suffix != ".csv"}
    sweep.write_text(text.replace("margin = 0.1", "margin = 0.3"))
    capsys.readouterr()
    assert main(args) == 2
    assert "changed after its records" in capsys.readouterr().err
    assert before == {p: p.read_bytes() for p in records.rglob("*") if p.is_file() and p.suffix != ".csv"}
    assert main(["amend", str(records), "--note", "margin 0.3", "--sweep", str(sweep)]) == 0
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads((records / "sweep.json").read_text())["analysis"]["margin"] == 0.3


def test_a_study_without_records_is_pinned(tmp_path, capsys, monkeypatch):
    """causal-cpu had no records: cutting a primary from its study file changed VERDICTS.md silently. A
    study's pin (preregistration_pin.json: the pre-registration's and claims.csv's digests) makes
    verdicts refuse an edited study file or claims.csv in one line; an unpinned study with primaries is
    refused. Every committed study has records now: the pinned study here is family-cpu's tables
    without them, pinned as `qkgeom amend --pin` pins."""
    from qkgeom import config as C
    from qkgeom.analysis.prereg import write_pin

    root = tmp_path / "results"
    shutil.copytree(RESULTS / "study-family-cpu", root / "study-family-cpu", ignore=shutil.ignore_patterns("runs"))
    write_pin(root / "study-family-cpu")
    configs = tmp_path / "configs"
    shutil.copytree(C.CONFIG_DIR, configs)
    monkeypatch.setattr(C, "CONFIG_DIR", configs)
    assert main(["verdicts", str(root)]) == 0
    capsys.readouterr()
    study = configs / "study-family-cpu.toml"
    original = study.read_text()
    study.write_text(original.replace("primary = [", "primary = [  # one cut\n", 1))
    assert main(["verdicts", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "study-family-cpu.toml" in err and "changed" in err, err
    study.write_text(original)
    claims = root / "study-family-cpu" / "claims.csv"
    claims.write_text(claims.read_text().replace("holds", "fails", 1))
    assert main(["verdicts", str(root)]) == 2
    assert "claims.csv changed after the study was pinned" in capsys.readouterr().err
    shutil.copy(RESULTS / "study-family-cpu" / "claims.csv", claims)
    (root / "study-family-cpu" / "preregistration_pin.json").unlink()
    assert main(["verdicts", str(root)]) == 2
    assert "is not pinned" in capsys.readouterr().err


def test_a_pinned_study_amended_to_take_records_accepts_its_own_manifest(tmp_path, monkeypatch):
    """causal-cpu's re-run (issue 56): pinned, amended to name its records folder (version 2), its first
    sitting wrote sweep.json into that folder, and the second sitting was refused: the same [analysis]
    table, read from the manifest, had another digest key than the registered version's. The key now
    says what the table is, not where it was read; a manifest with another table is still refused."""
    from qkgeom import config as C
    from qkgeom.analysis.prereg import RecordError, check_records
    from qkgeom.training.grid import expand, load_sweep, write_manifest

    study = tmp_path / "study-causal-cpu"
    shutil.copytree(RESULTS / "study-causal-cpu", study)
    spec = load_sweep(C.CONFIG_DIR / "study-causal-cpu.toml", [])
    assert spec.analysis["records"] == "docs/results/study-causal-cpu"
    check_records(study, spec.analysis)  # the sitting's check before it writes its manifest
    write_manifest(spec, expand(spec), study)
    check_records(study, spec.analysis)  # the next sitting (refused before the fix)
    check_records(study)
    edited = {**spec.analysis, "margin": 0.3}
    with pytest.raises(RecordError, match=r"sweep\.json \[analysis\].*changed after its records"):
        check_records(study, edited)


@pytest.mark.usefixtures("wikitext")
def test_a_baseline_recorded_in_an_earlier_sitting_is_restored_for_its_arms(tmp_path):
    """causal-v4's seed 5: its none run was recorded in one session, two of its arms were left for the
    next, where the run folder was gone and both arms failed ("baseline run ... is not finished").
    The sitting now restores a baseline from its record before training the arms that read it."""
    from qkgeom.analysis.records import restore_baselines
    from qkgeom.training.loop import train

    runs, study = tmp_path / "runs", tmp_path / "study"
    train(tiny_config(train={"steps": 12}), runs / "none0", progress=False)
    write_record(runs / "none0", study / "runs")
    shutil.rmtree(runs / "none0")  # a new sitting: run folders are not kept
    needs = {"arm0": "none0", "arm1": "never-recorded", "none0-twin": "none0"}
    assert restore_baselines(runs, study, needs) == [runs / "none0"]
    assert RunDir(runs / "none0").is_done()
    pd.testing.assert_frame_equal(
        RunDir(runs / "none0").read_geometry(), RunDir(study / "runs" / "none0").read_geometry()
    )
    assert restore_baselines(runs, study, {"arm0": "none0"}) == []  # a finished folder is kept


def test_leave_one_seed_out_rejudges_each_primary_on_the_other_seeds():
    """robustness.csv of a study of contrasts or trends (issue 56 item 4): each primary without each seed,
    judged by the study's own builder. Checked against values computed here from the committed per-seed
    data: family-cpu's F1 is the Fisher-z mean of the other seeds' early rank trends, causal-cpu's O1
    the mean of the other seeds' arm - none differences. Such a study may register no slope variant."""
    from qkgeom.analysis import robustness as R
    from qkgeom.analysis.runs import AnalysisError

    seeds = pd.read_csv(RESULTS / "study-family-cpu" / "family_seeds.csv")
    early = seeds[seeds["statistic"].str.startswith("Spearman(PR_Q - PR_K") & (seeds["layer"] == "mean")
                  & (seeds["window"] == "early")].set_index("seed")["rho"]  # fmt: skip
    table = pd.read_csv(RESULTS / "study-family-cpu" / "robustness.csv")
    f1 = table[table["primary"] == "F1"].set_index("variant")["value"]
    for s in early.index:
        assert f1[f"leave out seed {s}"] == pytest.approx(np.tanh(np.arctanh(early.drop(s)).mean()), rel=1e-9)
    claims = pd.read_csv(RESULTS / "study-causal-cpu" / "claims.csv", keep_default_na=False)
    per_seed = np.array(claims.loc[claims["primary"] == "O1", "per_seed"].iloc[0].split(), float)
    table = pd.read_csv(RESULTS / "study-causal-cpu" / "robustness.csv")
    o1 = np.sort(table.loc[table["primary"] == "O1", "value"].to_numpy())
    assert len(o1) == len(per_seed) == 16
    np.testing.assert_allclose(o1, np.sort([np.delete(per_seed, i).mean() for i in range(16)]), rtol=1e-9)
    with pytest.raises(AnalysisError, match="applies to slope primaries"):
        R.only_seed_variant(["leave one seed out", "axis: log step"])


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm's disable=None shows bars only on one)."""

    def isatty(self) -> bool:
        return True


def test_analyze_says_where_it_is_on_a_terminal_and_nothing_elsewhere(tmp_path, capsys, monkeypatch):
    """A causal study's analysis is ~20 s of silence without it: on a terminal's stderr `qkgeom analyze`
    keeps one status line (its stage of STAGES, elapsed time) and a bar over the leave-one-seed-out
    rebuilds, and `qkgeom report` one over the figures it draws (a token ladder: its own stages); written
    to a file or a pipe (here pytest's capture) stderr stays empty."""
    from qkgeom.analysis import robustness as R
    from qkgeom.analysis.study import LADDER_STAGES, STAGES

    committed = RESULTS / "study-trainer-gpt2"
    for run in (1, 2):
        copy = tmp_path / f"{run}" / committed.name
        shutil.copytree(committed / "runs", copy / "runs")
        shutil.copy(committed / "preregistration.toml", copy / "preregistration.toml")
        shutil.copy(committed / "preregistration_versions.json", copy / "preregistration_versions.json")
    assert main(["analyze", str(tmp_path / "1" / committed.name)]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: no bar
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["report", str(tmp_path / "2" / committed.name)]) == 0  # analyze, then the figures
    shown = terminal.getvalue()
    for i, stage in enumerate(STAGES, 1):
        assert f"analyze: {i}/{len(STAGES)} {stage} [00:" in shown
    assert "report: drawing:   0%|" in shown
    ladder = tmp_path / "ladder-cpu"  # a token ladder is analysed by its own path, with its own stages
    shutil.copytree(RESULTS / ladder.name / "runs", ladder / "runs")
    for name in ("sweep.json", "preregistration.toml", "preregistration_versions.json"):
        if (RESULTS / ladder.name / name).is_file():
            shutil.copy(RESULTS / ladder.name / name, ladder / name)
    assert main(["analyze", str(ladder)]) == 0
    for i, stage in enumerate(LADDER_STAGES, 1):
        assert f"analyze: {i}/{len(LADDER_STAGES)} {stage} [00:" in terminal.getvalue()
    claims = pd.DataFrame({"primary": ["X1"], "claim_id": ["c"], "group": ["all"], "window": ["w"], "value": [1.0],
                           "ci_low": [0.5], "ci_high": [1.5], "n": [3], "p_value": [0.01], "p_sign_flip": [0.25],
                           "verdict": ["holds"]})  # fmt: skip
    table = R.leave_one_seed_out(claims, [4, 5, 6], lambda seed: claims)
    assert list(table["variant"]) == ["leave out seed 4", "leave out seed 5", "leave out seed 6"]
    assert "leave one seed out:   0%|" in terminal.getvalue() and "| 0/3 [" in terminal.getvalue()
