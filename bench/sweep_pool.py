"""Sweep throughput: the local worker pool against the same runs one after another, in one process;
with --ray, also the Ray executor on a local instance (its overhead against the pool).

Targets: pool >= 1.6x sequential on 2 cores (issue 3); Ray / pool wall-time ratio >= 0.9 (issue 6).
The sequential baseline gives each run all cores (torch threads = cores); the pool and Ray run
one worker per core with one thread each. Usage:
    python bench/sweep_pool.py [--sweep smoke] [--runs 12] [--ray]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_wikitext  # noqa: E402

from qkgeom import config as C  # noqa: E402
from qkgeom.training.grid import SweepSpec, expand, load_sweep  # noqa: E402
from qkgeom.training.sweep import execute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default="smoke", help="study preset or sweep file (default smoke)")
    ap.add_argument("--runs", type=int, default=12, help="first N runs of the grid (default 12; 0 = all)")
    ap.add_argument("--ray", action="store_true", help="also time the Ray executor (local instance, all cores)")
    args = ap.parse_args()
    require_wikitext()
    spec: SweepSpec = load_sweep(args.sweep)
    runs = expand(spec)[: args.runs or None]
    cores = os.cpu_count() or 1
    from qkgeom.training.data import load_corpus

    load_corpus(runs[0].config.data)  # warm the encoding cache for both
    with tempfile.TemporaryDirectory() as tmp:
        tic = time.perf_counter()
        st = execute(runs, Path(tmp) / "seq", 1, cores, "local", None)
        seq = time.perf_counter() - tic
        tic = time.perf_counter()
        st += execute(runs, Path(tmp) / "pool", cores, 1, "local", None)
        pool = time.perf_counter() - tic
        if args.ray:
            from qkgeom.executor import connect

            connect(None, num_cpus=cores)  # start-up is not counted: a cluster is already running
            tic = time.perf_counter()
            st += execute(runs, Path(tmp) / "ray", cores, 1, "ray", None)
            ray_s = time.perf_counter() - tic
    assert all(s["status"] == "done" for s in st), st
    print(f"{len(runs)} runs of {spec.name} ({C.to_dict(runs[0].config)['model']}), {cores} cores")
    print(f"sequential ({cores} threads/run): {seq:7.1f} s  {len(runs) / seq * 60:6.1f} runs/min")
    print(f"pool ({cores} workers x 1 thread): {pool:7.1f} s  {len(runs) / pool * 60:6.1f} runs/min")
    print(f"speed-up: {seq / pool:.2f}x (target >= 1.6x on 2 cores)")
    if args.ray:
        print(f"ray ({cores} CPUs, 1 thread/task):  {ray_s:7.1f} s  {len(runs) / ray_s * 60:6.1f} runs/min")
        print(f"ray / pool throughput: {pool / ray_s:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
