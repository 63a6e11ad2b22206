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
    own-1-thread            the own paths at one thread (the portable paths' thread count: their cost's baseline)
    portable                train.portable (`qkgeom train --portable`: one code path whatever the vector width)
    portable-mkl-sse42      the same with oneMKL held to SSE4.2, standing in for a CPU with other features

For each: the first step whose training loss differs from the own path's, the final validation loss, the
largest relative difference of the geometry rows at the first probe (step 0: the untrained forward only)
and at the last, the last probe's layer-mean PR_Q and PR_K, and the seconds the run took. Then whether
the two portable paths are bit-identical, and the portable run's fingerprint (sha256 of its losses and
geometry): `--fingerprint FILE` compares it with the one FILE keeps for this preset (the project keeps
its own in docs/results/portable/fingerprint.json), `--write` puts it there.

    python bench/cpu_paths.py [--preset tiny] [--set train.steps=200 ...] [--fingerprint FILE [--write]]
    python bench/cpu_paths.py --preset tiny --fingerprint docs/results/portable/fingerprint.json --portable-only

Another vendor's silicon cannot be stood in for by settings (its rsqrtps / rcpps estimates differ), but
qemu's user-mode emulation computes those (and everything else) its own way: `--emulate CPU` trains the
portable path under `qemu-x86_64 -cpu CPU` (Skylake-Client: Intel, EPYC-Rome: AMD; Debian's qemu-user),
20-30x slower, and prints its fingerprint to compare with the native one:

    python bench/cpu_paths.py --emulate Skylake-Client --fingerprint docs/results/portable/fingerprint.json

A whole study made on two CPUs (the same configs, trained on each, analysed by one qkgeom) is compared
from its two claims tables: verdicts that differ, each row's shift in units of its interval's half-width,
and for the named primaries the paired per-seed difference against the spread between seeds, written to
--out as CSV:

    python bench/cpu_paths.py --compare A/claims.csv B/claims.csv [--out cross_cpu.csv]

2026-12-05, this project's Intel Xeon (AVX-512, AMX), preset smoke (150 steps): losses part at step 1
(scalar), 6 (torch at AVX2), 24 (oneMKL at AVX2); by step 150 the final layer-mean PR_K is 1.302 on the
own path and 1.439 with torch at AVX2. keys-cpu trained on an AMD EPYC and on this Xeon, compared:
every verdict the same (docs/LOG.md, thirteenth session; docs/results/study-keys-cpu/cross_cpu.csv).
2026-12-06, same Xeon: the portable paths bit-identical at tiny, smoke and cpu (200 steps), at 1.50x,
1.87x and 3.30x the own paths' time at one thread; not across vendors then (docs/LOG.md, fourteenth
session: oneMKL's SSE2 vector math starts from rsqrtps / rcpps estimates). Fifteenth session, an AMD EPYC
(AVX-512), with sqrt and log off oneMKL's vector math (device.exact_math): the native portable run and
the same run emulated as an Intel Skylake and an AMD EPYC-Rome give one fingerprint (docs/LOG.md).
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom.device import PORTABLE_ENV, kernel_capability  # noqa: E402
from qkgeom.results import RunDir  # noqa: E402

PATHS = {  # name: (environment, further arguments of `qkgeom train`)
    "own": ({}, []),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, []),
    "mkl-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, []),
    "scalar": ({"ATEN_CPU_CAPABILITY": "default"}, []),
    "own-1-thread": ({}, ["--set", "train.threads=1"]),
    "portable": ({}, ["--portable"]),
    "portable-mkl-sse42": ({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, ["--portable"]),
}


def train(preset: str, sets: list[str], out: Path, env: dict[str, str], extra: list[str] = (),
          emulate: str | None = None) -> tuple:  # fmt: skip
    """(metrics, geometry, seconds) of one run trained in a fresh process under `env`; with `emulate`, in
    qemu's user-mode emulation of that CPU model, the portable settings set first (the CLI would otherwise
    start itself again outside the emulator)."""
    args = [sys.executable, "-m", "qkgeom.cli", "train", preset, "--out", str(out), "--no-progress"]
    if emulate:
        args, env = ["qemu-x86_64", "-cpu", emulate, *args], {**env, **PORTABLE_ENV}
    tic = time.perf_counter()  # the path's own arguments last: its --set wins over the shared ones
    r = subprocess.run(args + [x for s in sets for x in ("--set", s)] + list(extra), capture_output=True,
                       text=True, env={**os.environ, **env})  # fmt: skip
    if r.returncode:
        sys.exit(f"train under {env or 'the own paths'} {' '.join(extra)} failed: {r.stderr.strip()[-300:]}")
    run = RunDir(out)
    return pd.DataFrame(run.read_metrics()), run.read_geometry(), time.perf_counter() - tic


def digest(metrics: pd.DataFrame, geometry: pd.DataFrame) -> str:
    """sha256 of a run's numbers: each training and validation loss, learning rate and gradient norm by
    step, and every geometry row's value by (step, layer, head, site, metric); timings left out, NaN as
    one NaN."""
    h = hashlib.sha256()
    m = metrics.sort_values(["step", "split"])
    g = geometry.sort_values(["step", "layer", "head", "site", "metric"])
    for frame, cols in ((m, ["loss", "lr", "grad_norm"]), (g, ["value"])):
        for col in cols:
            v = frame[col].to_numpy(dtype="<f8", na_value=np.nan)
            h.update(np.where(np.isnan(v), np.nan, v).astype("<f8").tobytes())
    h.update(pd.util.hash_pandas_object(g[["step", "layer", "head", "site", "metric"]], index=False).to_numpy())
    return h.hexdigest()


def fingerprint(file: Path, key: str, value: str, write: bool) -> None:
    """Compare the portable run's digest with the one `file` keeps under `key`; with `write`, keep it."""
    kept = json.loads(file.read_text()) if file.exists() else {}
    if write:
        from qkgeom.provenance import provenance

        p = provenance()  # the commit too: a later one may change the numbers on purpose; check at this one
        kept[key] = {"sha256": value, "torch": p["torch"], "libc": " ".join(platform.libc_ver()), "cpu": p["cpu"],
                     "git_sha": p["git_sha"], "git_dirty": p["git_dirty"]}  # fmt: skip
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")
        print(f"fingerprint of {key} written to {file}")
    elif key not in kept:
        print(f"fingerprint: {file} keeps none for {key} (--write puts this one there)")
    else:
        k = kept[key]
        same = "the same bits" if k["sha256"] == value else "OTHER BITS"
        print(f"fingerprint: {same} as the run {file} keeps for {key}, made on {k['cpu']['model']} "
              f"({k['cpu']['vendor']}; {k['libc']}; torch {k['torch']}; qkgeom at {k['git_sha'][:10]})")  # fmt: skip


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


def table(runs: dict[str, tuple]) -> None:
    """Each path against the own one, then the portable paths against each other."""
    own_metrics, own_geometry, _ = runs["own"]
    first, last = own_geometry["step"].min(), own_geometry["step"].max()
    own_train = own_metrics[own_metrics["split"] == "train"].set_index("step")["loss"]
    print("| path | first step whose loss differs | final valid loss | rows apart, step 0 | rows apart, last "
          "probe | last PR_Q / PR_K (layer mean) | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (metrics, geometry, seconds) in runs.items():
        loss = metrics[metrics["split"] == "train"].set_index("step")["loss"]
        apart = own_train.index[(own_train != loss.reindex(own_train.index)).to_numpy()]
        valid = metrics[metrics["split"] == "valid"]["loss"].iloc[-1]
        layer = geometry[(geometry["step"] == last) & (geometry["head"] == -1)]
        pr = layer.groupby("metric")["value"].mean()
        print(f"| {name} | {apart.min() if len(apart) else 'none'} | {valid:.6f} | "
              f"{largest_relative_difference(own_geometry, geometry, first):.1e} | "
              f"{largest_relative_difference(own_geometry, geometry, last):.1e} | "
              f"{pr['query_participation_ratio']:.4f} / {pr['key_participation_ratio']:.4f} | "
              f"{seconds:.1f} |")  # fmt: skip
    same = digest(*runs["portable"][:2]) == digest(*runs["portable-mkl-sse42"][:2])
    print(
        f"\nportable and portable-mkl-sse42: {'bit-identical' if same else 'NOT bit-identical'}; "
        f"portable costs {runs['portable'][2] / runs['own-1-thread'][2]:.2f}x the own paths at one thread"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", action="append", default=[], help="a config override for every run")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="two claims.csv of one design")
    ap.add_argument("--out", type=Path, help="with --compare: write the per-seed table here")
    ap.add_argument("--fingerprint", type=Path, help="compare the portable run's digest with the one this file keeps")
    ap.add_argument("--write", action="store_true", help="with --fingerprint: keep this run's digest in the file")
    ap.add_argument("--portable-only", action="store_true", help="train the portable path only (with --fingerprint)")
    ap.add_argument(
        "--emulate",
        metavar="CPU",
        help="train the portable path only, under qemu-x86_64 -cpu CPU "
        "(e.g. EPYC-Rome, Skylake-Client: another vendor's estimates; needs qemu-user; ~20x slower)",
    )
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare, a.out)
    require_wikitext()
    capability = kernel_capability()
    paths = {k: v for k, v in PATHS.items() if not (k == "aten-avx2" and capability in ("DEFAULT", "AVX2"))}
    if a.portable_only or a.emulate:
        paths = {"portable": PATHS["portable"]}
    if a.emulate and a.write:
        sys.exit("--write keeps a native run's fingerprint (it records this machine's CPU): not with --emulate")
    if a.emulate and shutil.which("qemu-x86_64") is None:
        sys.exit("--emulate needs qemu-x86_64 on PATH (Debian: apt-get install qemu-user)")
    print(f"torch {torch.__version__}, this CPU's own width {capability}; preset {a.preset} {' '.join(a.set)}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(a.preset, a.set, Path(tmp) / name, *v, emulate=a.emulate) for name, v in paths.items()}
    if len(runs) > 1:
        table(runs)
    port = digest(*runs["portable"][:2])
    where = f", under qemu as {a.emulate}" if a.emulate else ""
    print(f"portable run's fingerprint {port[:16]} ({runs['portable'][2]:.1f} s{where})")
    if a.fingerprint:
        fingerprint(a.fingerprint, " ".join([a.preset, *a.set]), port, a.write)


if __name__ == "__main__":
    main()
