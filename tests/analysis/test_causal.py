"""causal: the intervention study's analysis on synthetic runs with known answers (one window per
seed, the causal estimate three ways, hold at matched validation loss)."""

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import causal, stats
from qkgeom.analysis.dose import DOSE_CLAIM, SHAPE_DOSE_CLAIM, seed_window_note, with_seed_window
from tests.analysis.test_analysis import STEPS, claim, synthetic

SEEDS = range(5)


def _metrics(df, loss):
    """Validation losses at every probe step, loss(arm, step, seed)."""
    runs = df[["run_id", "intervention", "seed"]].drop_duplicates().itertuples(index=False)
    return pd.DataFrame(
        [
            dict(run_id=r, intervention=k, seed=s, split="valid", step=t, steps=40, loss=loss(k, t, s))
            for r, k, s in runs
            for t in STEPS
        ]
    )


def test_one_window_per_seed_from_its_none_run():
    def collapse(at):  # both PRs collapse 20 -> 2 at progress `at`, then flat
        return lambda p, s, layer: {
            k: 2.0 if p >= at else 20.0 for k in ("query_participation_ratio", "key_participation_ratio")
        }

    df = pd.concat(
        [
            synthetic(seeds=SEEDS, inits=("independent",), intervention="none", fn=collapse(0.25)),
            synthetic(seeds=SEEDS, inits=("independent",), intervention="hold:key", fn=collapse(0.5)),
        ]
    )
    w = with_seed_window(df)
    assert set(w["transient_end"]) == {10}  # the hold runs' own ends (20) are not used
    assert seed_window_note(w).endswith("0: 10, 1: 10, 2: 10, 3: 10, 4: 10")


def test_reduced_form_first_stage_and_iv_known_values():
    # log PR_K = log 4 + 0.5 log r (first stage 0.5 exactly); entropy = 2 + b_s log r (reduced form b_s)
    b = {s: 0.3 * (1 + 0.1 * s) for s in SEEDS}

    def arm(r):
        return lambda p, s, layer: {"key_participation_ratio": 4 * r**0.5, "attention_entropy": 2 + b[s] * np.log(r)}

    arms = (("none", 1.0), ("contract:key:0.6", 0.6), ("contract:key:0.4", 0.4), ("expand:key:1.25", 1.25))
    df = pd.concat([synthetic(seeds=SEEDS, inits=("independent",), intervention=k, fn=arm(r)) for k, r in arms])
    c = causal.claims_intervention(df, _metrics(df, lambda k, t, s: 1.0))
    group = "none + contract/expand on W_K"
    bs = np.array(list(b.values()))
    rf = claim(c, "reduced form: attention entropy per unit assigned log ratio of W_K", group, "post-transient")
    assert rf["value"] == pytest.approx(bs.mean()) and rf["n"] == 5 and rf["verdict"] == "holds"
    assert rf["mde_80"] == pytest.approx(stats.mde(bs))
    fs = claim(c, "first stage: log activation PR_K per unit assigned log ratio of W_K", group, "post-transient")
    assert fs["value"] == pytest.approx(0.5) and fs["ci_low"] == pytest.approx(0.5)
    iv = claim(
        c, "IV: attention entropy per unit log activation PR_K (reduced form / first stage)", group, "post-transient"
    )
    lo, hi = stats.t_mean_ci(bs)
    assert (iv["value"], iv["ci_low"], iv["ci_high"]) == pytest.approx((bs.mean() / 0.5, lo / 0.5, hi / 0.5))
    dose = claim(c, DOSE_CLAIM, group, "post-transient")
    assert dose["value"] == pytest.approx(bs.mean() / 0.5)  # entropy on achieved log PR_K: b_s / 0.5


def test_hold_at_matched_loss_differs_from_equal_step():
    # none learns twice as fast (loss 3 - t/20) as hold (3 - t/40); entropy falls with step in both,
    # and hold sits 0.1 + 0.01 s above none at the same loss, but 0.1 + 0.01 s + t/80 at the same step
    def ent(k):
        return lambda p, s, layer: {
            "attention_entropy": (2.1 + 0.01 * s - 40 * p / 80) if k == "hold:key" else 2 - 40 * p / 40,
            "key_participation_ratio": 4.0 + (1.0 if k == "hold:key" else 0.0),
        }

    df = pd.concat(
        [synthetic(seeds=SEEDS, inits=("independent",), intervention=k, fn=ent(k)) for k in ("none", "hold:key")]
    )
    metrics = _metrics(df, lambda k, t, s: 3 - t / (40 if k == "hold:key" else 20))
    matched = causal.loss_matched(df, metrics)
    assert matched.to_numpy() == pytest.approx([0.1 + 0.01 * s for s in SEEDS])
    c = causal.claims_intervention(df, metrics)
    row = claim(c, "hold:key - none at matched validation loss: attention entropy (nats)", "mean over layers",
                "post-transient, loss-matched")  # fmt: skip
    assert row["verdict"] == "holds" and row["n"] == 5
    equal_step = claim(c, "hold:key - none: attention entropy (nats)", "mean over layers", "post-transient")
    assert equal_step["value"] == pytest.approx(0.1 + 0.02 + np.mean(STEPS) / 80)


def test_headline_has_one_row_per_arm_with_its_check_and_outcome():
    def arm(d_ent, d_prk):
        return lambda p, s, layer: {
            "attention_entropy": 2.0 + d_ent * (1 + 0.1 * s),
            "key_participation_ratio": 4.0 * (1 + d_prk) + 0.01 * s,
            "logit_participation_ratio": 3.0,
        }

    arms = (("none", 0, 0), ("contract:key:0.6", -0.2, -0.1), ("hold:key", 0.1, 0.0))
    df = pd.concat([synthetic(seeds=SEEDS, inits=("independent",), intervention=k, fn=arm(e, r)) for k, e, r in arms])
    h = causal.headline(causal.claims_intervention(df, _metrics(df, lambda k, t, s: 1.0))).set_index("arm")
    assert list(h.index) == ["contract:key:0.6", "hold:key"]
    assert h.loc["contract:key:0.6", "manipulation check"].startswith("manipulation ok (activation PR_K -0.4 ")
    assert h.loc["contract:key:0.6", "verdict"] == "holds" and h.loc["contract:key:0.6", "n"] == 5
    assert h.loc["hold:key", "verdict"] == "manipulation failed"  # PR_K unmoved: its outcome is not read


def test_shape_arms_at_matched_scale_known_dose_response_and_scale_gate():
    """Shape arms: log PR_K = log 4 + log r exactly (full delivery), entropy = 2 + b_s log PR_K ratio;
    the dose-response at matched scale recovers mean b_s, and the scale check reads the per-row logit
    std: within 1% it passes; an arm 10% off is not read (numbers kept, verdict says why)."""
    b = {s: 0.2 * (1 + 0.1 * s) for s in SEEDS}

    def arm(r, row_std=1.0):
        return lambda p, s, layer: {
            "key_participation_ratio": 4 * r,
            "attention_entropy": 2 + b[s] * np.log(r),
            "logit_row_std": row_std * (1 + 0.002 * s),
            "input_logit_scale": 1.0,
        }

    def run(std_14):
        arms = (
            ("none", 1.0, 1.0),
            ("shape:activation:0.7:matched", 0.7, 1.005),
            ("shape:activation:1.4:matched", 1.4, std_14),
        )
        frames = [synthetic(seeds=SEEDS, inits=("independent",), intervention=k, fn=arm(r, sd)) for k, r, sd in arms]
        df = pd.concat(frames)
        return causal.claims_intervention(df, _metrics(df, lambda k, t, s: 1.0))

    c = run(1.0)
    group = "none + shape on the key activations' PR (shape) at matched logit scale"
    dose = claim(c, SHAPE_DOSE_CLAIM, group, "post-transient")
    assert dose["value"] == pytest.approx(np.mean(list(b.values()))) and dose["verdict"] == "holds"
    check = claim(c, "shape:activation:0.7:matched - none: scale check, log per-row logit std (TOST +-5%)",
                  "mean over layers", "post-transient")  # fmt: skip
    assert check["verdict"] == "scale matched" and check["value"] == pytest.approx(np.log(1.005))
    delivered = claim(c, "shape:activation:0.7:matched - none: delivered dose, log activation PR_K ratio "
                      "(assigned -0.357)", "mean over layers", "post-transient")  # fmt: skip
    assert delivered["value"] == pytest.approx(np.log(0.7))
    c = run(1.10)
    check = claim(c, "shape:activation:1.4:matched - none: scale check, log per-row logit std (TOST +-5%)",
                  "mean over layers", "post-transient")  # fmt: skip
    assert check["verdict"] == "scale not matched"
    dose = claim(c, SHAPE_DOSE_CLAIM, group, "post-transient")
    assert dose["value"] == pytest.approx(np.mean(list(b.values())))  # the number is kept ...
    assert dose["verdict"] == "scale not matched (shape:activation:1.4:matched)"  # ... not read
    out = claim(c, "shape:activation:1.4:matched - none: attention entropy (nats)", "mean over layers",
                "post-transient")  # fmt: skip
    assert out["verdict"] == "scale not matched"


def test_temperature_scale_path_and_instantaneous_complement_known_values():
    """Temperature 0.5: the logit scale x 0.25 (log factor log 0.5), entropy + c_s; the scale path is
    mean(c) / log 0.5 by Fieller (exact: the denominator has no spread). The none runs carry an
    instantaneous change d_s for the arm; the learned effect is c_s - d_s."""
    c_s = {s: 0.3 + 0.01 * s for s in SEEDS}
    d_s = {s: 0.1 + 0.02 * s for s in SEEDS}

    def arm(scale, de):
        return lambda p, s, layer: {
            "input_logit_scale": scale,
            "attention_entropy": 2 + de * c_s[s],
            "query_participation_ratio": 5.0,
            "key_participation_ratio": 3.0,
        }

    df = pd.concat(
        [
            synthetic(seeds=SEEDS, inits=("independent",), intervention="none", fn=arm(1.0, 0)),
            synthetic(seeds=SEEDS, inits=("independent",), intervention="temperature:logit:0.5", fn=arm(0.25, 1)),
        ]
    )
    none = df[(df.intervention == "none") & (df.metric == "attention_entropy")]
    inst = none.assign(metric=causal.INSTANT_METRIC, site="temperature:logit:0.5", value=none["seed"].map(d_s))
    df = pd.concat([df, inst])
    c = causal.claims_intervention(df, _metrics(df, lambda k, t, s: 1.0))
    path = claim(c, "temperature:logit:0.5: attention entropy per unit delivered log logit factor (the scale path)",
                 "mean over layers", "post-transient")  # fmt: skip
    assert path["value"] == pytest.approx(np.mean(list(c_s.values())) / np.log(0.5)) and path["verdict"] == "holds"
    out = claim(c, "temperature:logit:0.5 - none: attention entropy (nats)", "mean over layers", "post-transient")
    assert out["predicted"] == "+" and out["verdict"] == "holds"  # a lower temperature softens attention
    learned = claim(c, "temperature:logit:0.5 - none: learned effect (trained - instantaneous), attention entropy "
                    "(nats)", "mean over layers", "post-transient")  # fmt: skip
    assert learned["value"] == pytest.approx(np.mean([c_s[s] - d_s[s] for s in SEEDS]))


def test_a_damaged_none_run_leaves_its_seed_out_and_no_traceback(tmp_path):
    """A none run whose geometry.parquet is damaged was skipped by load_runs (with its warning) but not by
    load_metrics: its losses stayed, and the loss-matched rows looked up its entropy (KeyError, exit 1,
    "a bug in qkgeom"). Now the metrics keep only the runs the geometry has: the seed without its none
    run leaves the paired rows. Three seeds of study-causal-cpu's committed records, seed 0's none damaged."""
    import shutil
    from pathlib import Path

    from qkgeom.analysis import runs as A
    from qkgeom.analysis.study import analyze

    records = Path(__file__).resolve().parents[2] / "docs" / "results" / "study-causal-cpu" / "runs"
    for run in records.iterdir():
        if any(run.name.endswith(f"_seed={s}_data_seed=100{s}-" + run.name.rsplit("-", 1)[1]) for s in (0, 1, 2)):
            shutil.copytree(run, tmp_path / run.name, ignore=shutil.ignore_patterns("seal.json"))
    assert len(list(tmp_path.iterdir())) == 9  # none, contract, hold x 3 seeds
    none0 = next(tmp_path.glob("kind=none_*_seed=0_*"))
    (none0 / "geometry.parquet").write_bytes(b"not parquet")
    a = analyze(tmp_path)
    claims = a.claims
    assert len(a.skipped) == 1 and none0.name in a.skipped[0]  # named, as before
    row = claims[(claims["claim_id"] == "hold:key-none.attention_entropy:loss_matched")
                 & (claims["group"] == "mean over layers")]  # fmt: skip
    assert row["n"].tolist() == [2]  # seeds 1 and 2
    assert set(A.load_metrics(tmp_path, runs=A.load_runs(tmp_path)["run_id"].unique())["run_id"]) == {
        p.name for p in tmp_path.iterdir() if p.is_dir() and p != none0
    }
