"""How long `qkgeom analyze` takes on a committed study's records, split by stage, and whether it still
re-derives the committed tables byte for byte.

`qkgeom analyze` is run on every study a user makes (`qkgeom study` ends with it, `make study` spends
about a third of its time there after the runs). This copies a committed study's per-run records
(docs/results/<study>/runs, with the [analysis] they were judged under) to a scratch folder, analyses
them once in this process under cProfile, and prints:

- the wall seconds of the whole analysis (cProfile's own overhead included: compare like with like);
- the cumulative seconds of its stages: loading the runs' geometry, the causal tables' per-seed
  windows (a causal study's), per-run statistics (slopes and within-run Spearman rhos of
  each (run, layer)), co-movement (first-difference Pearson r against the cross-seed null), the
  sensitivity and horizon tables (every claim re-judged from other window starts / fractions of the
  run), robustness variants, and every Spearman / Pearson call inside them;
- whether each table the analysis writes equals the committed one (the re-derivation test_records
  checks, here on the timed code).

    python bench/analyze_time.py [--study study-keys-cpu] [--top 0]

Before / after: run it on an older tree with that tree's qkgeom on PYTHONPATH, one after the other on
the same quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
# (label, function name as cProfile reports it): cumulative seconds, calls
STAGES = (
    ("loading the runs (load_runs)", "load_runs"),
    ("per-seed windows (with_seed_window)", "with_seed_window"),
    ("per-run statistics", "per_run_statistics"),
    ("co-movement (per seed)", "comovement_per_seed"),
    ("  of which comovement_excess", "comovement_excess"),
    ("sensitivity table", "sensitivity"),
    ("horizon table", "horizon"),
    ("robustness variants", "main_variants"),
    ("Spearman, pair by pair (spearman)", "spearman"),
    ("Spearman, stacked (spearman_pairs)", "spearman_pairs"),
    ("OLS slopes, one by one (slope)", "slope"),
    ("OLS slopes, stacked (slopes)", "slopes"),
    ("numpy corrcoef calls", "corrcoef"),
)
COPIED = ("sweep.json", "preregistration.toml", "preregistration_versions.json")


def scratch_copy(study: str, into: Path) -> Path:
    """The study's records and what its analysis reads, copied under `into`; exits if there are none."""
    src = RESULTS / study
    if not (src / "runs").is_dir():
        known = sorted(d.name for d in RESULTS.iterdir() if (d / "runs").is_dir())
        sys.exit(f"no committed records under {src / 'runs'}; studies with records: {', '.join(known)}")
    dst = into / study
    shutil.copytree(src / "runs", dst / "runs")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def stage_seconds(profile: cProfile.Profile) -> dict[str, tuple[float, int]]:
    """Cumulative seconds and primitive call count of each STAGES function (summed over same-named ones)."""
    st = pstats.Stats(profile)
    out: dict[str, tuple[float, int]] = {}
    for label, name in STAGES:
        secs, calls = 0.0, 0
        for (_, _, fn), (cc, _, _, ct, _) in st.stats.items():  # type: ignore[attr-defined]
            if fn == name:
                secs, calls = secs + ct, calls + cc
        out[label] = (secs, calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="study-keys-cpu", help="a committed study with records (docs/results/)")
    ap.add_argument("--top", type=int, default=0, help="also print cProfile's top N functions by cumulative time")
    args = ap.parse_args()

    from qkgeom.cli import main as qkgeom_main

    with tempfile.TemporaryDirectory() as tmp:
        copy = scratch_copy(args.study, Path(tmp))
        n_runs = sum(1 for d in (copy / "runs").iterdir() if d.is_dir())
        profile = cProfile.Profile()
        out = io.StringIO()
        tic = time.perf_counter()
        with contextlib.redirect_stdout(out):
            profile.enable()
            rc = qkgeom_main(["analyze", str(copy)])
            profile.disable()
        wall = time.perf_counter() - tic
        if rc != 0:
            sys.exit(f"qkgeom analyze failed (exit {rc}) on the copy of {args.study}")
        written = sorted(p.name for p in copy.glob("*.csv") if (RESULTS / args.study / p.name).is_file())
        same = {n: (copy / n).read_bytes() == (RESULTS / args.study / n).read_bytes() for n in written}

    print(f"qkgeom analyze on {args.study}'s {n_runs} records (under cProfile): {wall:.2f} s wall")
    print(f"{'stage':<36} {'seconds':>8} {'share':>6} {'calls':>8}")
    for label, (secs, calls) in stage_seconds(profile).items():
        print(f"{label:<36} {secs:8.2f} {secs / wall:6.1%} {calls:8d}")
    print("tables equal to the committed ones: " + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in same.items()))
    if args.top:
        buf = io.StringIO()
        pstats.Stats(profile, stream=buf).sort_stats("cumulative").print_stats(args.top)
        print(buf.getvalue())
    if not all(same.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
