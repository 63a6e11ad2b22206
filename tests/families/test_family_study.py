"""family_study: a study's runs read as checkpoint families and judged across seeds (the claims of
configs/study-family-cpu.toml), on known per-seed values and end to end on tiny runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from qkgeom.families import study as FS


def _seeds(early: list[float], late: list[float], heads: dict[int, list[float]]) -> pd.DataFrame:
    rows = []
    for seed, (e, lt) in enumerate(zip(early, late, strict=True)):
        rows += [
            {"statistic": FS.CONTRAST_TREND, "window": "early", "layer": "mean", "rho": e, "seed": seed},
            {"statistic": FS.CONTRAST_TREND, "window": "late", "layer": "mean", "rho": lt, "seed": seed},
            {"statistic": FS.CONTRAST_TREND, "window": "early", "layer": "0", "rho": e / 2, "seed": seed},
        ]
        for step, values in heads.items():
            rows.append({"statistic": FS.HEADS_LINK, "window": f"step_{step}", "layer": "all", "rho": values[seed],
                         "seed": seed, "step": step})  # fmt: skip
    out = pd.DataFrame(rows)
    out["early_max_step"] = 1000
    return out


def _t(v):
    v = np.asarray(v, float)
    return sps.t.interval(0.95, len(v) - 1, loc=v.mean(), scale=sps.sem(v))


def test_family_claims_on_known_values():
    early, late = [0.9, 0.8, 0.85, 0.95], [0.1, -0.2, 0.0, 0.3]
    heads = {0: [-0.9, -0.9, -0.9, -0.9], 10: [0.2, 0.4, 0.3, 0.5], 20: [0.4, 0.6, 0.5, 0.3]}
    c = FS.family_claims(_seeds(early, late, heads)).set_index("claim")
    f1 = c.loc[FS.F1]  # correlations are averaged through Fisher z (bounded), by hand here
    assert f1["value"] == pytest.approx(_fz(early)[0]) and f1["n"] == 4 and f1["verdict"] == "holds"
    assert (f1["ci_low"], f1["ci_high"]) == pytest.approx(_fz(early)[1:])
    assert -1 < f1["ci_low"] < f1["ci_high"] < 1
    decay = np.subtract(early, late)  # a difference of rhos: the t scale
    f2 = c.loc[FS.F2]
    assert f2["value"] == pytest.approx(decay.mean()) and (f2["ci_low"], f2["ci_high"]) == pytest.approx(_t(decay))
    assert f2["verdict"] == "holds" and c.loc[FS.F3, "verdict"] == "holds"
    assert c.loc[FS.F6, "verdict"] == "" and c.loc[FS.F6, "value"] == pytest.approx(_fz(late)[0])  # no sign
    pooled = np.mean([heads[10], heads[20]], axis=0)  # step 0 (the random init) is left out
    assert c.loc[FS.F4, "value"] == pytest.approx(_fz(pooled)[0])
    assert (c.loc[FS.F4, "ci_low"], c.loc[FS.F4, "ci_high"]) == pytest.approx(_fz(pooled)[1:])
    f5 = c.loc[[FS.F5]]
    assert list(f5["window"]) == ["step 10", "step 20"]
    assert f5["value"].to_numpy() == pytest.approx([_fz(heads[10])[0], _fz(heads[20])[0]])
    assert c.loc[FS.PER_LAYER, "value"] == pytest.approx(_fz(np.divide(early, 2))[0])


def _fz(rhos) -> tuple[float, float, float]:
    """Fisher z by hand: tanh of the mean atanh and of its t-interval over seeds."""
    z = np.arctanh(np.clip(np.asarray(rhos, float), -0.999999, 0.999999))  # a seed at +-1 stays finite
    half = sps.t.ppf(0.975, len(z) - 1) * z.std(ddof=1) / np.sqrt(len(z))
    return float(np.tanh(z.mean())), float(np.tanh(z.mean() - half)), float(np.tanh(z.mean() + half))


def test_the_joint_verdict_fails_when_the_trend_grows_late():
    c = FS.family_claims(_seeds([0.9, 0.8, 0.85, 0.95], [0.99, 0.97, 0.98, 0.99], {})).set_index("claim")
    assert c.loc[FS.F1, "verdict"] == "holds" and c.loc[FS.F2, "verdict"] == "fails"
    assert c.loc[FS.F3, "verdict"] == "fails"
    c = FS.family_claims(_seeds([0.5, -0.4, 0.3, -0.2], [0.1, -0.2, 0.0, 0.3], {})).set_index("claim")
    assert c.loc[FS.F1, "verdict"] == "inconclusive" and c.loc[FS.F3, "verdict"] in ("inconclusive", "fails")


@pytest.mark.usefixtures("wikitext")
def test_a_family_study_end_to_end(tmp_path, capsys):
    """Three tiny runs keeping log-spaced checkpoints: exported, analysed as families, judged across
    seeds in claims.csv, shown in the study report."""
    from qkgeom.cli import main
    from qkgeom.training.grid import load_sweep
    from qkgeom.training.sweep import run_sweep

    sweep = tmp_path / "fam.toml"
    sweep.write_text(
        '[sweep]\nname = "fam"\nbase = "tiny"\n[set]\n"train.keep_checkpoints" = "log"\n'
        '[grid]\n"train.seed,train.data_seed" = [[0, 1000], [1, 1001], [2, 1002]]\n'
    )
    out = tmp_path / "fam"
    run_sweep(load_sweep(sweep), out, workers=1, progress=False)
    assert FS.is_family_study(out)
    FS.analyse_families(out, early_max_step=10, progress=False, n_tokens=512, seq_len=32, batch_size=4)
    assert main(["report", str(out)]) == 0, capsys.readouterr().err
    claims = pd.read_csv(out / "claims.csv")
    family = claims[claims["study"] == "family"].set_index("claim")
    assert family.loc[FS.F1, "n"] == 3 and family.loc[FS.F1, "window_start"] == "steps <= 10"
    seeds = pd.read_csv(out / "family_seeds.csv")
    early = seeds[(seeds["statistic"] == FS.CONTRAST_TREND) & (seeds["layer"] == "mean") & (seeds["window"] == "early")]
    assert _fz(early["rho"])[0] == pytest.approx(family.loc[FS.F1, "value"])
    assert set(early["n"]) == {8}  # kept steps 0, 1, 2, 3, 4, 6, 7, 9 of a 40-step run lie in the early window
    html = (out / "report" / "index.html").read_text()
    assert "Checkpoint families (the paper" in html and "F3 an early regime that decays" in html
    assert (out / "report" / "family_seeds_contrast.png").is_file()
    windows = pd.read_csv(out / "family_windows.csv")  # the early window ending at 0.3-3 times its 10 steps
    assert sorted(windows["early_max_step"].unique()) == [3, 5, 10, 20, 30]
    at_10 = windows[(windows["early_max_step"] == 10) & (windows["group"] == "layer mean")].set_index("claim")
    assert at_10.loc["F1", "value"] == pytest.approx(family.loc[FS.F1, "value"], rel=1e-12)
    f2 = claims[(claims["claim"] == FS.F2) & (claims["group"] == "layer mean")]["value"].item()
    assert at_10.loc["F2", "value"] == pytest.approx(f2, rel=1e-12)
    assert (out / "report" / "family_windows.png").is_file()
    assert not FS.is_family_study(tmp_path / "fam" / "family")  # exports are not runs


def test_the_unbounded_decay_sees_what_a_saturated_rank_correlation_cannot():
    """Early and late trends both monotone (Spearman 1 in every seed: F2 = 0), but the contrast rises
    3x faster early: the slope-based decay F2u holds."""
    seeds = _seeds([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], {})
    extra = []
    for seed, (e, lt) in enumerate([(3.0, 1.0), (2.8, 1.1), (3.2, 0.9), (3.1, 1.2)]):
        for win, v in (("early", e), ("late", lt)):
            extra.append({"statistic": FS.CONTRAST_SLOPE, "window": win, "layer": "mean", "slope": v, "seed": seed,
                          "early_max_step": 1000})  # fmt: skip
    c = FS.family_claims(pd.concat([seeds, pd.DataFrame(extra)], ignore_index=True)).set_index("claim")
    assert c.loc[FS.F2, "value"] == 0.0 and c.loc[FS.F2, "verdict"] == "inconclusive"
    assert c.loc[FS.F2_SLOPE, "value"] == pytest.approx(np.mean([2.0, 1.7, 2.3, 1.9]))
    assert c.loc[FS.F2_SLOPE, "verdict"] == "holds"


def test_the_within_layer_link_removes_a_depth_gradient_and_has_a_permutation_null():
    from qkgeom.families.revisions import within_layer_link

    idx = pd.MultiIndex.from_product([range(4), range(8)], names=["layer", "head"])
    rng = np.random.default_rng(0)
    depth = np.repeat(np.arange(4.0), 8)
    ir = pd.Series(depth * 10 + rng.normal(0, 1, 32), index=idx)
    unrelated = pd.Series(depth * 5 + rng.normal(0, 1, 32), index=idx)  # shares only the depth gradient
    rho, p, n = within_layer_link(ir, unrelated)
    assert n == 32 and abs(rho) < 0.4 and p > 0.05
    from scipy import stats as sps

    assert sps.spearmanr(ir, unrelated).statistic > 0.8  # what pooling over layers would have reported
    related = pd.Series(depth * 5 + (ir - depth * 10) * 0.9 + rng.normal(0, 0.2, 32), index=idx)
    rho, p, n = within_layer_link(ir, related)
    assert rho > 0.8 and p < 0.001


def test_within_layer_shuffles_draw_what_one_permutation_per_layer_draws():
    """The permutation null shuffles each layer's heads with rng.permutation, 2,000 times a layer; layers of
    one size are shuffled in one rng.permuted call instead (5.5 s of a family study's analysis was these
    calls), which must draw the same numbers in the same order: the committed p-values depend on it."""
    from qkgeom.analysis.families import within_group_permutations

    def one_by_one(groups, n, times, rng):
        order = np.tile(np.arange(n), (times, 1))
        for i in range(times):
            for idx in groups:
                order[i, idx] = rng.permutation(idx)
        return order

    interleaved = [np.arange(0, 24, 3), np.arange(1, 24, 3), np.arange(2, 24, 3)]  # three layers of 8 heads
    for groups, n in ((interleaved, 24), ([np.arange(0, 5), np.arange(5, 12)], 12)):  # one size; two sizes
        fast = within_group_permutations(groups, n, 500, np.random.default_rng(7))
        np.testing.assert_array_equal(fast, one_by_one(groups, n, 500, np.random.default_rng(7)))
        for idx in groups:  # each row permutes every group within itself
            assert (np.sort(fast[:, idx], axis=1) == np.sort(idx)).all()
        assert len({tuple(r) for r in fast}) > 400  # and the rows differ


def test_a_family_study_keeps_its_families_in_its_records(tmp_path):
    """family-cpu could not be re-derived: its records (run folders without checkpoints) could not be
    measured as families again. A family study's record now keeps each revision's measurement
    (family/<revision>/), sealed with the rest: the records alone give the same family rows, and an
    edited byte of a family measurement is refused."""
    import shutil

    from qkgeom.analysis.prereg import RecordError, check_records
    from qkgeom.training.grid import load_sweep
    from qkgeom.training.sweep import run_sweep

    sweep = tmp_path / "fam.toml"
    sweep.write_text(
        '[sweep]\nname = "fam"\nbase = "tiny"\n[set]\n"train.keep_checkpoints" = "log"\n'
        '[grid]\n"train.seed,train.data_seed" = [[0, 1000], [1, 1001]]\n'
    )
    out, study = tmp_path / "fam", tmp_path / "results" / "fam"
    run_sweep(load_sweep(sweep), out, workers=1, progress=False)
    small = dict(early_max_step=10, n_tokens=512, seq_len=32, batch_size=4)
    # as a sitting writes each run's record when it finishes (studies.record_writer)
    records = [FS.record_run(run, study, **small) for run in sorted(out.iterdir()) if (run / "done.json").is_file()]
    assert len(records) == 2 and all(len(list((r / "family").iterdir())) >= 8 for r in records)
    assert not list(study.rglob("spectra.npz")) and not list(study.rglob("*.pt"))
    # as the next sitting writes a run that finished without its record (studies.settle_records): the same
    from functools import partial

    from qkgeom.analysis.records import record_missing

    one = record_missing(out, tmp_path / "at-once", [records[0].name], write=partial(FS.record_run, **small))[0]
    assert (one / "seal.json").read_text() == (records[0] / "seal.json").read_text()
    full = FS.analyze_study(out).claims
    shutil.rmtree(out)  # the next session: no run folders, no checkpoints, only the records
    assert FS.analyse_families(study, progress=False) == {r.name: r / "family" for r in records}
    slim = FS.analyze_study(study).claims
    pd.testing.assert_frame_equal(full[full["study"] == "family"], slim[slim["study"] == "family"])
    check_records(study)
    geometry = sorted(records[0].glob("family/*/geometry.parquet"))[3]
    geometry.write_bytes(geometry.read_bytes()[:-1] + b"\0")
    with pytest.raises(RecordError, match="family/"):
        check_records(study)


def test_the_window_sensitivity_re_judges_f1_and_f2_where_early_ends():
    """family_windows.csv on the committed replication's records: at the registered end (1000) its rows are
    the study's claims; at 500 the layer-mean decay is the mean over seeds of scipy's Spearman rho early
    minus late, each seed's contrast averaged over layers by hand from its revisions' geometry."""
    from pathlib import Path

    from qkgeom.analysis.families import load_family

    study = Path(__file__).resolve().parents[2] / "docs" / "results" / "study-family-replication"
    if not (study / "runs").is_dir():
        pytest.skip("no committed family-replication records")
    table = FS.window_sensitivity(FS.read_families(study))
    assert sorted(table["early_max_step"].unique()) == [300, 500, 1000, 2000, 3000]
    assert len(table) == 5 * 2 * 5  # F1 and F2 at 5 ends: the layer mean and 4 layers
    claims = pd.read_csv(study / "family_claims.csv")
    registered = table[table["early_max_step"] == 1000]
    for claim, window in (("F1", "early"), ("F2", "early vs late")):
        want = claims[claims["claim_id"].isin(["family:contrast_trend", "family:contrast_trend_decay"])]
        want = want[want["window"] == window].set_index("group")["value"]
        got = registered[registered["claim"] == claim].set_index("group")["value"]
        assert got.to_dict() == pytest.approx(want.to_dict(), rel=1e-9)
    decays = []
    for run in sorted((study / "runs").iterdir()):
        geometry, _ = load_family(run / "family")
        c = geometry[(geometry["metric"] == "participation_ratio_contrast") & (geometry["head"] == -1)]
        mean = c[c["step"] >= 0].groupby("step")["value"].mean()  # over layers
        early, late = mean[mean.index <= 500], mean[mean.index > 500]
        rho = [sps.spearmanr(np.log1p(w.index.to_numpy(float)), w.to_numpy())[0] for w in (early, late)]
        decays.append(rho[0] - rho[1])
    row = table[(table["early_max_step"] == 500) & (table["claim"] == "F2") & (table["group"] == "layer mean")]
    assert row["value"].item() == pytest.approx(np.mean(decays), rel=1e-12)
    assert row["verdict"].item() == "fails" and np.mean(decays) < row["ci_high"].item() < 0
