"""Exploratory (chosen after seeing K1, not pre-registered): family-cpu's per-layer PR_K slopes from
the training probes, split at step 1,000 (2 M tokens, keys-cpu's horizon).

    python docs/results/study-family-cpu/split_key_slopes.py runs/study-family-cpu > key_slopes_split.csv

Per run and layer: the OLS slope of the layer's key PR against step / 1,000 over the probes from the
run's detected transient end to step 1,000, from 1,000 to 8,000, and over the whole post-transient
run; then the mean and 95% t-interval over seeds, and how many seeds have a positive slope.
"""

import sys

import numpy as np
import pandas as pd

import qkgeom
from qkgeom.analysis import claims as A
from qkgeom.analysis import stats


def main(path: str) -> None:
    g = A.with_transient(qkgeom.load_runs(path))
    k = g[(g["metric"] == "key_participation_ratio") & (g["head"] == -1) & (g["step"] >= g["transient_end"])]
    rows = []
    for name, lo, hi in (("to step 1000", 0, 1000), ("steps 1000-8000", 1000, 8000), ("whole run", 0, 8000)):
        w = k[(k["step"] >= lo) & (k["step"] <= hi)]
        for layer, x in w.groupby("layer"):
            per_seed = x.groupby("seed")
            v = np.array([stats.slope(r["step"].to_numpy() / 1000, r["value"].to_numpy()) for _, r in per_seed])
            lo_ci, hi_ci = stats.t_mean_ci(v)
            rows.append({"window": name, "layer": layer, "slope_per_1000_steps": v.mean(), "ci_low": lo_ci,
                         "ci_high": hi_ci, "n": len(v), "seeds_positive": int((v > 0).sum()),
                         "per_seed": np.round(v, 3).tolist()})  # fmt: skip
    pd.DataFrame(rows).to_csv(sys.stdout, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
