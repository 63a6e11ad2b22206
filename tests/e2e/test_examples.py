"""examples/: the scripts the README points to run, at a few steps, and write what `qkgeom analyze` reads.

The study behind docs/results/study-trainer-gpt2 is examples/trainer_gpt2_study.py; no test ran it, so a
change to the callback or the data API could break the one way a user re-runs that study."""

from __future__ import annotations

import json
import subprocess
import sys

import qkgeom
from qkgeom.analysis.prereg import PREREGISTRATION, check_records, digest
from tests.conftest import REPO


def test_the_trainer_study_runs_resumes_and_is_read_as_runs(wikitext, tmp_path):
    script = REPO / "examples" / "trainer_gpt2_study.py"
    cmd = [sys.executable, str(script), "--out", str(tmp_path), "--seeds", "1", "--steps", "20", "--threads", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    rows = qkgeom.load_runs(tmp_path)
    # every=50 over 20 steps: step 0 and the powers of 2 below 50, then the last step (finish)
    assert sorted(rows["step"].unique()) == [0, 1, 2, 4, 8, 16, 20]
    assert set(rows["layer"].unique()) == {0, 1, 2, 3} and set(rows["run_id"]) == {"seed0"}
    done = json.loads((tmp_path / "seed0" / "done.json").read_text())
    assert done["step"] == 20 and done["final_valid_loss"] is not None
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and f"{tmp_path / 'seed0'}: done, skipped" in again.stdout
    # --records: the finished seed's record goes to the study's runs/, stamped with its pre-registration
    # and sealed (a replication keeps its records there); once recorded, the seed is skipped outright
    study = tmp_path / "study"
    study.mkdir()
    (study / PREREGISTRATION).write_text(
        (REPO / "docs/results/study-trainer-gpt2-replication" / PREREGISTRATION).read_text()
    )
    recorded = subprocess.run(
        [*cmd, "--records", str(study)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert recorded.returncode == 0 and f"seed0: recorded as {study / 'runs' / 'seed0'}" in recorded.stdout
    check_records(study)  # seal and stamp read back: a record the study's analysis accepts
    stamp = json.loads((study / "runs" / "seed0" / "config.json").read_text())["record"]["preregistration"]
    assert stamp == digest(study)
    skipped = subprocess.run([*cmd, "--records", str(study)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert skipped.returncode == 0 and f"seed0: recorded in {study}, skipped" in skipped.stdout
