"""The benchmarks no other test runs still run: each at its smallest size, in its own process, exits 0 and
prints the figure it exists for. (Their figures are read from their output, never timed here; the
invariants below are what each script checks of itself at any size.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

TINY = ["--width", "64", "--layers", "2", "--heads", "2", "--ctx", "32"]
# (script, arguments, a line it must print: a regular expression)
SMALLEST = [
    ("probe_split", [*TINY, "--batch", "2", "--reps", "1"], r"probe_gpt, whole: [\d.]+ s; .* probe / step = [\d.]+"),
    ("probe_repeat", ["--processes", "1", *TINY], r"1 distinct result\(s\) in 1 processes \(\d+ rows\)"),
    # the door: no tensor leaves the device but through qkgeom.device.to_host, none is tested implicitly
    ("probe_syncs", [], r"direct copies \(tensor.cpu\(\) outside the door\)\s+0\n.*\n\s*implicit syncs .*\s0\n"),
    ("probe_writes", ["--probes", "2", "--depth", "2"], r"ratio old / now: [\d.]+x bytes, [\d.]+x time"),
    ("stacked_seeds", ["--preset", "tiny", "--seeds", "2", "--steps", "3", "--reps", "1"],
     r"largest \|loss difference\| stacked vs separate: [\d.e+-]+"),
    ("job_floor", ["--depth", "2", "--steps", "60", "--reps", "1"], r"whole job / own steps [\d.]+"),
    ("intervention_cost", ["--depth", "2", "--steps", "5"], r"contract W_QW_K\^T\s+:\s+[\d.]+ ms"),
    ("train_throughput", ["--steps", "5", "--rounds", "1", "--depths", "2", "--threads", "1"],
     r"whole job / its own training steps \(same process\) [\d.]+"),
    # qkgeom's settled vector-math kernels: a fresh process's first call gives its second's bits
    ("vml_race", ["--processes", "2", "--threads", "1"],
     r"settled\s+first call differed from the second in: log float64 0, sqrt float32 0 "),
    ("interval_coverage", ["--draws", "100", "--out", "{tmp}"], r"written to "),
    # the timed analysis still re-derives the committed tables, every one
    ("analyze_time", ["--study", "study-trainer-gpt2", "--top", "0"],
     r"tables equal to the committed ones: (?:[\w.]+ yes, )+[\w.]+ yes\n"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "args", "says"), SMALLEST, ids=[s[0] for s in SMALLEST])
def test_a_benchmark_runs_at_its_smallest_size(script, args, says, wikitext, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), *args], capture_output=True,
                       text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(says, r.stdout), r.stdout[-2000:]
    if script == "stacked_seeds":  # vmap over seeds trains the same models as one after another
        diff = float(re.search(r"stacked vs separate: ([\d.e+-]+)", r.stdout).group(1))
        assert diff < 1e-4


def test_the_control_set_benchmark_runs_on_a_small_run(tmp_path, wikitext):
    """bench/control_set_size.py reads a finished run's kept checkpoints (from step 200 by default; a run
    without any now gets one line, not numpy's error on an empty quantile): here a 20-step run of depth 4."""
    run = tmp_path / "run"
    sets = ["model.n_layers=4", "train.steps=20", "train.checkpoint_steps=[10, 20]"]
    train = [sys.executable, "-m", "qkgeom.cli", "train", "tiny", "--no-progress", "--out", str(run)]
    assert subprocess.run([*train, *(a for s in sets for a in ("--set", s))], capture_output=True).returncode == 0
    bench = [sys.executable, str(REPO / "bench" / "control_set_size.py"), str(run), "--sizes", "2", "4"]
    r = subprocess.run(bench, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"{run}: no kept checkpoint at step >= 200 (kept: [10, 20]); train it with train.checkpoint_steps as "
        "above, or lower --from-step"
    )
    r = subprocess.run([*bench, "--from-step", "10"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "checkpoints [10, 20]" in r.stdout, r.stderr[-2000:]
    assert re.search(r"\n\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\n\s+4\s+[\d.]+", r.stdout), r.stdout
