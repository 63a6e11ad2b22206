"""analysis.matched (causal v4): per-layer checks and contrasts against the sham, on a planted study."""

import numpy as np
import pandas as pd
import pytest

from qkgeom.analysis import matched as M

ARMS = {  # arm -> (PR_K factor, entropy shift in nats, per-row logit std factor) in the controlled layers
    "none": (1.0, 0.03, 1.0),
    M.SHAM: (1.0, 0.0, 1.0),
    "shape:activation:0.8:closed": (0.8, -0.10, 1.0),
    "shape:activation:1.25:closed": (1.25, 0.06, 1.0),
    "hold:key:closed": (1.2, 0.0, 1.0),
}


def planted(n_seeds: int = 12, bent_layer: int = 3) -> pd.DataFrame:
    """A 4-layer, 2-head study: layer 0 uncontrolled (every arm as none there); in `bent_layer` the
    1.25 arm's per-row logit std is 20% high (its scale check must fail there, and only there)."""
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(n_seeds):
        for arm, (f_pr, d_ent, f_std) in ARMS.items():
            run = f"{arm}-{seed}"
            for step in range(0, 101, 10):
                for layer in range(4):
                    on = layer > 0
                    for head in range(2):
                        pr = 4.0 * (f_pr if on else 1.0) * np.exp(rng.normal(0, 0.02))
                        std = (
                            (f_std * (1.2 if arm.endswith("1.25:closed") and layer == bent_layer else 1.0)) if on else 1
                        )
                        std = 2.0 * std * np.exp(rng.normal(0, 0.005))
                        ent = 2.0 + (d_ent if on else 0.0) + rng.normal(0, 0.03)
                        vals = {"key_participation_ratio": pr, "logit_row_std": std, "attention_entropy": ent}
                        if arm.endswith(":closed") and on:
                            vals["logit_row_std_target"] = 2.0
                        for metric, v in vals.items():
                            rows.append((run, seed, arm, step, layer, head, metric, v))
                    for metric in ("query_participation_ratio", "key_participation_ratio"):
                        rows.append((run, seed, arm, step, layer, -1, metric, 5.0))
    df = pd.DataFrame(rows, columns=["run_id", "seed", "intervention", "step", "layer", "head", "metric", "value"])
    return df.assign(site="none", steps=100, progress=df["step"] / 100)


def test_checks_and_contrasts_are_per_layer_against_the_sham():
    c = M.claims_matched(planted()).set_index(["claim", "group"])
    low, high = "shape:activation:0.8:closed", "shape:activation:1.25:closed"
    checked = {g for claim, g in c.index if "scale check" in claim or "delivered dose" in claim}
    assert checked == {"layer=1", "layer=2", "layer=3"}  # layer 0 is free: only reported
    free = c.xs("layer=0", level="group")
    assert (
        set(free.index)
        == {
            f"{arm} - sham: {what}, uncontrolled layer"
            for arm in (*[a for a in ARMS if a.endswith(":closed") and a != M.SHAM], "none")
            for what in ("attention entropy (nats)", "log per-row logit std")
        }
        and (free["verdict"] == "").all()
    )
    for layer in (1, 2, 3):
        g = f"layer={layer}"
        assert c.loc[(f"{low} - sham: scale check, log per-row logit std (TOST +-5%)", g), "verdict"] == "scale matched"
        dose = c.loc[(f"{low} - sham: delivered dose, log per-head activation PR_K (assigned -0.223)", g)]
        assert dose["verdict"] == "manipulation ok" and dose["value"] == pytest.approx(np.log(0.8), abs=0.01)
        ent = c.loc[(f"{low} - sham: attention entropy (nats)", g)]
        assert ent["verdict"] == "holds" and ent["predicted"] == "-" and ent["value"] == pytest.approx(-0.1, abs=0.02)
        assert c.loc[("hold:key:closed - sham: attention entropy (nats)", g), "verdict"] == "inconclusive"
    # the bent layer: the 1.25 arm's scale check fails there, and its outcome is not read there only
    assert c.loc[(f"{high} - sham: scale check, log per-row logit std (TOST +-5%)", "layer=3"), "verdict"] == (
        "scale not matched"
    )
    assert c.loc[(f"{high} - sham: attention entropy (nats)", "layer=3"), "verdict"] == "scale not matched"
    assert c.loc[(f"{high} - sham: attention entropy (nats)", "layer=2"), "verdict"] == "holds"
    under = c.loc[("none - sham: attention entropy (nats), being under the control", "layer=1")]
    assert under["value"] == pytest.approx(0.03, abs=0.02) and under["verdict"] == ""


def test_the_dose_table_is_what_the_figure_draws():
    t = M.dose_table(planted()).set_index(["layer", "arm"])
    assert sorted(t.index.get_level_values("layer").unique()) == [1, 2, 3]
    row = t.loc[(2, "shape:activation:0.8:closed")]
    assert row["dose"] == pytest.approx(np.log(0.8), abs=0.01) and row["dose_low"] < row["dose"] < row["dose_high"]
    assert row["entropy_low"] < -0.1 + 0.03 and row["entropy_high"] > -0.1 - 0.03 and row["n"] == 12
    assert t.loc[(1, M.SHAM), "dose"] == 0 and t.loc[(1, M.SHAM), "entropy"] == 0
