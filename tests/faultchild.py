"""Run the qkgeom CLI with a fault injected at an exact point, deterministically (no racing a
process from outside). Used by tests/e2e/test_faults.py:

    python -m tests.faultchild write:NAME:N  -- ARGS   SIGKILL half-way through the N-th atomic
                                                       write of a file called NAME (e.g. last.pt:2)
    python -m tests.faultchild step:N:SIGNAL -- ARGS   send SIGNAL (KILL, INT, TERM) to this process
                                                       right after the metrics row of step N is written
The fault lives here, in the tests, by monkeypatching qkgeom.results: production code has no hook.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from qkgeom import results
from qkgeom.cli import main


def _kill_during_write(name: str, nth: int) -> None:
    real, seen = results.atomic_write_bytes, {"n": 0}

    def writer(path: Path, data: bytes) -> None:
        if Path(path).name == name:
            seen["n"] += 1
            if seen["n"] == nth:  # half a temp file on disk, then die like the OOM killer
                tmp = Path(path).parent / f".{Path(path).name}.faultchild.tmp"
                tmp.write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    results.atomic_write_bytes = writer


def _signal_at_step(step: int, sig: signal.Signals) -> None:
    real = results.RunDir.append_metrics

    def append(self, row):
        real(self, row)
        if row.get("split") == "train" and row.get("step", -1) >= step:
            results.RunDir.append_metrics = real  # once
            os.kill(os.getpid(), sig)

    results.RunDir.append_metrics = append


def log_start(folder: str, key: str, dies: bool) -> str:
    """A pool job that appends its key to folder/started as it starts; a `dies` job then SIGKILLs its
    worker the first time it runs (tests/e2e/test_faults.py: the order jobs are resubmitted in)."""
    with open(Path(folder) / "started", "a") as f:
        f.write(key + "\n")
    return die_first_time(folder, key, dies, 0.0)


def die_first_time(folder: str, key: str, dies: bool, seconds: float) -> str:
    """A pool job (tests/e2e/test_faults.py): a `dies` job SIGKILLs its worker the first time it runs;
    every job takes `seconds`."""
    mark = Path(folder) / f"{key}.ran"
    if dies and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    return key


if __name__ == "__main__":
    spec, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.faultchild SPEC -- ARGS"
    kind, a, b = spec.split(":")
    if kind == "write":
        _kill_during_write(a, int(b))
    else:
        _signal_at_step(int(a), getattr(signal, f"SIG{b}"))
    sys.exit(main(args))
