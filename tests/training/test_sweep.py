"""sweep: expansion, manifest, parallel pool with a failing run, skip-on-restart, parity with train()."""

import json
import os

import pytest

from qkgeom import config as C
from qkgeom.results import RunDir
from qkgeom.training import grid as G
from qkgeom.training import sweep as S
from qkgeom.training.loop import train


def write_sweep(tmp_path, grid: str, fixed: str = '"train.steps" = 8', name="t") -> str:
    p = tmp_path / f"{name}.toml"
    p.write_text(f'[sweep]\nname = "{name}"\nbase = "tiny"\n\n[set]\n{fixed}\n\n[grid]\n{grid}\n')
    return str(p)


def test_expand_grid_and_zipped_keys(tmp_path):
    spec = G.load_sweep(
        write_sweep(tmp_path, '"model.n_layers" = [1, 2, 3]\n"train.seed,train.data_seed" = [[0, 0], [1, 5]]')
    )
    runs = G.expand(spec)
    assert len(runs) == 6 and len({r.run_id for r in runs}) == 6
    assert [r.run_id for r in runs] == [r.run_id for r in G.expand(spec)]  # deterministic
    last = runs[-1].config
    assert (last.model.n_layers, last.train.seed, last.train.data_seed, last.train.steps) == (3, 1, 5, 8)


def test_study_presets_expand_to_the_paper_grids():
    assert len(G.expand(G.load_sweep("smoke"))) == 36
    runs = G.expand(G.load_sweep("intervention-smoke"))
    assert len(runs) == 35 and {r.config.intervention.kind for r in runs} == {"none", "hold", "contract", "expand"}
    assert {r.config.model.n_layers for r in runs} == {4}
    # every contract/expand arm points at the none run of its own seed
    none = {r.config.train.seed: r.run_id for r in runs if r.config.intervention.kind == "none"}
    for r in runs:
        if r.config.intervention.kind in ("contract", "expand"):
            assert r.config.intervention.baseline == none[r.config.train.seed]


@pytest.mark.parametrize(
    "grid, message",
    [
        ('"model.nlayers" = [1, 2]', "unknown config key 'model.nlayers'"),
        ('"model.n_layers" = []', "empty grid"),
        ('"train.seed,train.data_seed" = [1, 2]', "each value must be a list of 2"),
        # seventeenth session: a TypeError traceback, and two runs training into one folder
        ('"model.n_layers" = 2', "must be a list of values, got 2"),
        ('"train.seed" = [1, 1]', "holds run .* twice: its grid repeats a value"),
    ],
)
def test_bad_grids(tmp_path, grid, message):
    with pytest.raises(G.SweepError, match=message):
        G.expand(G.load_sweep(write_sweep(tmp_path, grid)))


@pytest.mark.parametrize(
    "tables, message",
    [
        ('[set]\n"train.seed" = 3\n[grid]\n"train.seed" = [1, 2]', r"'train.seed' is in both \[set\] and \[grid\]"),
        ('[grid]\n"train.seed" = [1]\n[analysis]\nmargin = "0.1"', "margin in .* must be a positive number, got '0.1'"),
        ('[grid]\n"train.seed" = [1]\n[analysis]\nmargin = -0.1', "must be a positive number, got -0.1"),
        ('[grid]\n"train.seed" = [1]\n[analysis]\nprimary = ["P1"]', r"primary in .* must be a list of tables"),
        ('[grid]\n"train.seed" = [1]\n[analysis]\nprimary = [{ id = "P1" }]', "must be a list of tables"),
        ('[grid]\n"train.seed" = [1]\n[analysis]\nrobustness = "leave one seed out"', "a list of variant names"),
    ],
)
def test_bad_sweep_tables_are_refused_when_read(tmp_path, tables, message):
    """A margin of "x" or a primary named by a bare string crashed the analysis with a traceback after the
    whole sweep had run; a [set] key the grid also sets was silently overridden."""
    f = tmp_path / "s.toml"
    f.write_text(f'[sweep]\nname = "s"\nbase = "tiny"\n{tables}\n')
    with pytest.raises(G.SweepError, match=message):
        G.load_sweep(f)


def test_every_study_preset_passes_the_checks_and_a_misspelt_variant_is_refused(tmp_path, capsys):
    from qkgeom.cli import main

    for f in sorted(C.CONFIG_DIR.glob("study-*.toml")):
        G.expand(G.load_sweep(f))
    f = tmp_path / "s.toml"
    f.write_text('[sweep]\nname = "s"\nbase = "tiny"\n[grid]\n"train.seed" = [1]\n[analysis]\n'
                 'robustness = ["leave one sed out"]\n')  # fmt: skip
    assert main(["sweep", str(f), "--dry-run", "--out", str(tmp_path / "s")]) == 2
    assert "unknown robustness variant 'leave one sed out'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_unknown_sweep_preset():
    with pytest.raises(G.SweepError, match="neither a file nor a study preset"):
        G.load_sweep("nope")


@pytest.mark.usefixtures("wikitext")
def test_pool_isolates_failures_skips_finished_and_matches_train(tmp_path, capsys):
    spec = G.load_sweep(write_sweep(tmp_path, '"train.lr" = [3e-3, 1e6]\n"train.seed" = [0, 1]'))
    out = tmp_path / "runs"
    res = S.run_sweep(spec, out, workers=2, progress=True)  # stderr is not a terminal here
    assert len(res.done) == 2 and len(res.failed) == 2 and not res.skipped
    # no bar without a terminal: one line per finished run (a log file got nothing for 9 minutes)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" runs finished")[0] for line in lines] == [f"{spec.name}: {k}/4" for k in (1, 2, 3, 4)]
    assert sum(" FAILED;" in line for line in lines) == 2 and all(" min so far, " in line for line in lines)
    assert all("diverged" in e for e in res.failed.values())
    manifest = json.loads((out / "sweep.json").read_text())
    assert len(manifest["runs"]) == 4
    for rid in res.failed:
        assert "diverged" in json.loads((out / rid / "error.json").read_text())["error"]
    stamps = {rid: (out / rid / "done.json").stat().st_mtime_ns for rid in res.done}
    again = S.run_sweep(spec, out, workers=2, progress=False)
    assert sorted(again.skipped) == sorted(res.done) and len(again.failed) == 2
    assert stamps == {rid: (out / rid / "done.json").stat().st_mtime_ns for rid in res.done}
    # a run from the pool equals the same config trained directly (same thread count)
    r = next(r for r in G.expand(spec) if r.run_id in res.done)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # what the pool gave each of its 2 workers
    try:
        direct = train(r.config, tmp_path / "direct", progress=False)
    finally:
        torch.set_num_threads(before)
    a, b = RunDir(out / r.run_id).read_metrics(), direct.read_metrics()
    assert [(x["step"], x["loss"]) for x in a] == [(x["step"], x["loss"]) for x in b]


def test_seed_order_runs_whole_seeds_baselines_first(tmp_path):
    """order = "seed": groups of `workers` seeds, each group's none runs before its relative arms."""
    from qkgeom.training.grid import expand, load_sweep
    from qkgeom.training.sweep import _chunks

    path = tmp_path / "s.toml"
    path.write_text(
        '[sweep]\nname = "s"\nbase = "tiny"\norder = "seed"\n'
        '[grid]\n"intervention.kind,intervention.ratio" = [["none", 1.0], ["contract", 0.5]]\n'
        '"train.seed" = [0, 1, 2]\n'
    )
    runs = expand(load_sweep(path))
    chunks = _chunks("seed", runs, 2)
    assert [sorted({r.config.train.seed for r in c}) for c in chunks] == [[0, 1], [2]]
    assert all(
        r.config.intervention.baseline in {b.run_id for b in c}
        for c in chunks
        for r in c
        if r.config.intervention.baseline
    )
    assert _chunks("", runs, 2) == [runs]
