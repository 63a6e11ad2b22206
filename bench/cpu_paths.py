"""How much do a trained run's numbers depend on the CPU's float kernels?

On one CPU a run repeats bit for bit (resumed or not, from one process to the next); on another CPU it
does not, because float32 training takes that CPU's kernels: torch's own at the widest vector width the
CPU has (torch.backends.cpu.get_cpu_capability()), oneMKL's matrix products by its ISA and vendor. This
bench trains one config in fresh processes, each on another kernel path this CPU can take, each standing
in for a CPU with other features, and compares each with the machine's own path:

    own        the machine's own paths
    aten-avx2  torch's kernels at AVX2 width (ATEN_CPU_CAPABILITY=avx2; shown only where the CPU has more)
    mkl-avx2   oneMKL's kernels held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2; Intel CPUs)
    scalar     torch's kernels without vector instructions (ATEN_CPU_CAPABILITY=default)

For each: the first step whose training loss differs from the own path's, the final validation loss, the
largest relative difference of the geometry rows at the first probe (step 0: the untrained forward only)
and at the last, and the last probe's layer-mean PR_Q and PR_K.

    python bench/cpu_paths.py [--preset tiny] [--set train.steps=200 ...]

A whole study made on two CPUs (the same configs, trained on each, analysed by one qkgeom) is compared
from its two claims tables: verdicts that differ, each row's shift in units of its interval's half-width,
and for the named primaries the paired per-seed difference against the spread between seeds, written to
--out as CSV:

    python bench/cpu_paths.py --compare A/claims.csv B/claims.csv [--out cross_cpu.csv]

2026-12-05, this project's Intel Xeon (AVX-512, AMX), preset smoke (150 steps): losses part at step 1
(scalar), 6 (torch at AVX2), 24 (oneMKL at AVX2); by step 150 the final layer-mean PR_K is 1.302 on the
own path and 1.439 with torch at AVX2. keys-cpu trained on an AMD EPYC and on this Xeon, compared:
every verdict the same (docs/LOG.md, thirteenth session; docs/results/study-keys-cpu/cross_cpu.csv).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom.results import RunDir  # noqa: E402

PATHS = {
    "own": {},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "scalar": {"ATEN_CPU_CAPABILITY": "default"},
}


def train(preset: str, sets: list[str], out: Path, env: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(metrics, geometry) of one run trained in a fresh process under `env`."""
    args = [sys.executable, "-m", "qkgeom.cli", "train", preset, "--out", str(out), "--no-progress"]
    r = subprocess.run(args + [x for s in sets for x in ("--set", s)], capture_output=True, text=True,
                       env={**os.environ, **env})  # fmt: skip
    if r.returncode:
        sys.exit(f"train under {env or 'the own paths'} failed: {r.stderr.strip()[-300:]}")
    run = RunDir(out)
    return pd.DataFrame(run.read_metrics()), run.read_geometry()


def largest_relative_difference(a: pd.DataFrame, b: pd.DataFrame, step: int) -> float:
    key = ["layer", "head", "site", "metric"]
    m = a[a["step"] == step].merge(b[b["step"] == step], on=key, suffixes=("_a", "_b"))
    rel = (m["value_a"] - m["value_b"]).abs() / m[["value_a", "value_b"]].abs().max(axis=1).clip(lower=1e-30)
    return float(rel.max(skipna=True))


def compare(a_csv: Path, b_csv: Path, out: Path | None) -> None:
    """Two claims tables of one design (two CPUs): verdicts, shifts, and the per-seed pairing of each
    post-transient slope row over all layers and the depth bands."""
    key = ["claim_id", "group", "window"]
    a, b = pd.read_csv(a_csv), pd.read_csv(b_csv)
    m = a.merge(b, on=key, suffixes=("_a", "_b"))
    judged = m[m["verdict_a"].notna()]
    shift = (m["value_b"] - m["value_a"]).abs() / ((m["ci_high_a"] - m["ci_low_a"]) / 2)
    print(f"{len(m)} rows in both; verdicts {(judged['verdict_a'] != judged['verdict_b']).sum()} of {len(judged)} "
          f"differ; shift / half-width: median {shift.median():.3f}, 90th percentile {shift.quantile(0.9):.3f}, "
          f"largest {shift.max():.3f}")  # fmt: skip
    rows = []
    slopes = m[m["claim_id"].str.startswith("slope:") & (m["window"] == "post-transient") & m["per_seed_a"].notna()]
    for _, r in slopes.iterrows():
        sa, sb = (pd.Series([float(x) for x in r[f"per_seed_{s}"].split()]) for s in "ab")
        d = sb - sa
        rows.append({"claim_id": r["claim_id"], "group": r["group"], "value_a": r["value_a"], "value_b": r["value_b"],
                     "verdict_a": r["verdict_a"], "verdict_b": r["verdict_b"], "n": len(d),
                     "paired_difference_mean": d.mean(), "paired_difference_sd": d.std(),
                     "between_seed_sd_a": sa.std(), "per_seed_correlation": sa.corr(sb)})  # fmt: skip
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if out:
        table.to_csv(out, index=False, float_format="%.6g")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", action="append", default=[], help="a config override for every run")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="two claims.csv of one design")
    ap.add_argument("--out", type=Path, help="with --compare: write the per-seed table here")
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare, a.out)
    require_wikitext()
    capability = torch.backends.cpu.get_cpu_capability()
    paths = {k: v for k, v in PATHS.items() if not (k == "aten-avx2" and capability in ("DEFAULT", "AVX2"))}
    print(f"torch {torch.__version__}, this CPU's own width {capability}; preset {a.preset} {' '.join(a.set)}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(a.preset, a.set, Path(tmp) / name, env) for name, env in paths.items()}
    own_metrics, own_geometry = runs["own"]
    first, last = own_geometry["step"].min(), own_geometry["step"].max()
    own_train = own_metrics[own_metrics["split"] == "train"].set_index("step")["loss"]
    print("| path | first step whose loss differs | final valid loss | rows apart, step 0 | rows apart, last "
          "probe | last PR_Q / PR_K (layer mean) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, (metrics, geometry) in runs.items():
        loss = metrics[metrics["split"] == "train"].set_index("step")["loss"]
        apart = own_train.index[(own_train != loss.reindex(own_train.index)).to_numpy()]
        valid = metrics[metrics["split"] == "valid"]["loss"].iloc[-1]
        layer = geometry[(geometry["step"] == last) & (geometry["head"] == -1)]
        pr = layer.groupby("metric")["value"].mean()
        print(f"| {name} | {apart.min() if len(apart) else 'none'} | {valid:.6f} | "
              f"{largest_relative_difference(own_geometry, geometry, first):.1e} | "
              f"{largest_relative_difference(own_geometry, geometry, last):.1e} | "
              f"{pr['query_participation_ratio']:.4f} / {pr['key_participation_ratio']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
