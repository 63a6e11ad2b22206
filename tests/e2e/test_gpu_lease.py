"""bench/gpu_lease.sh, the one call a lent GPU gets, run here as far as a CPU can: on a clone of this
repository (with the working tree's uncommitted changes applied), `kit` packs the data, `lighten`
brings what a call sends under the device tool's 64 MiB, the files such a call would send (tracked,
untracked and not ignored, the carried kit) are copied alone into a fresh folder, and `run --device cpu
--quick` measures every row there (those against nanoGPT excepted: no copy of it can be fetched
here, and a stand-in shows that a failing section leaves the rest running; the gpu tests run as a
dry run of their own code, cpu against cpu); `restore` leaves the index as HEAD has it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout"),
]
LIMIT_MIB = 64


def sh(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def sent_mib(out: str) -> int:
    return int(re.search(r"a call sends (\d+) MiB", out).group(1))


def test_a_lease_fits_the_call_and_runs_from_what_the_call_sends(tmp_path, wikitext):
    clone = tmp_path / "repo"
    assert sh("git", "clone", "-q", "--shared", str(REPO), str(clone), cwd=tmp_path).returncode == 0
    diff = sh("git", "diff", "HEAD", "--binary", cwd=REPO).stdout
    if diff:
        assert subprocess.run(["git", "apply", "-"], input=diff, cwd=clone, text=True).returncode == 0
    nanogpt = tmp_path / "nanogpt"
    nanogpt.mkdir()
    # a stand-in (no network here): carried like the real one, but with no GPTConfig in it, so the two
    # nanoGPT comparisons must come back as error rows while every other section still runs
    (nanogpt / "model.py").write_text("# stands in for nanoGPT's model.py\n")
    env = {**os.environ, "QKGEOM_WIKITEXT_DIR": str(Path(wikitext).resolve())}  # the clone is elsewhere
    lease = ["bash", "bench/gpu_lease.sh"]

    kit = sh(*lease, "kit", str(nanogpt), cwd=clone, env=env)
    assert kit.returncode == 0, kit.stderr
    assert (clone / ".lease" / "wikitext" / "wikitext-2" / "train.txt").is_file()
    tracked = sh("git", "ls-files", cwd=clone).stdout
    exclude = (clone / ".git" / "info" / "exclude").read_bytes()

    light = sh(*lease, "lighten", cwd=clone, env=env)
    assert light.returncode == 0, light.stderr
    assert sent_mib(light.stdout) < LIMIT_MIB and sent_mib(light.stdout) < sent_mib(kit.stdout)
    assert sh("git", "ls-files", "docs/results", cwd=clone).stdout == ""
    assert sh("git", "check-ignore", "-q", "docs/results/VERDICTS.md", cwd=clone).returncode == 0
    assert (clone / "docs" / "results" / "VERDICTS.md").is_file()  # untracked, not deleted

    # exactly what the tool would send, alone in a fresh folder (no docs/results, no ../shared)
    sent = tmp_path / "device"
    names = sh("git", "ls-files", cwd=clone).stdout.split("\n") + sh(
        "git", "ls-files", "-o", "--exclude-standard", cwd=clone
    ).stdout.split("\n")
    for name in filter(None, names):
        (sent / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(clone / name, sent / name)
    shutil.copytree(clone / ".lease", sent / ".lease")
    restore = sh(*lease, "restore", cwd=clone, env=env)
    assert restore.returncode == 0, restore.stderr
    assert sh("git", "diff", "--cached", "--quiet", cwd=clone).returncode == 0
    assert sh("git", "ls-files", cwd=clone).stdout == tracked
    assert (clone / ".git" / "info" / "exclude").read_bytes() == exclude

    bare = {k: v for k, v in env.items() if k not in ("QKGEOM_WIKITEXT_DIR", "PYTHONPATH")}
    run = sh(*lease, "run", "--device", "cpu", "--quick", "--concurrent", "1", "--deadline", "inf",
             cwd=sent, env={**bare, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable})  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    machine = (tmp_path / "out" / "machine.txt").read_text()  # its libraries beside its GPU: a version can fail a row
    assert f"numpy {version('numpy')}, pandas {version('pandas')}, pyarrow " in machine, machine
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| check")]
    errors = [r for r in rows if "error:" in r]
    assert [r.split(" | ")[0] for r in errors] == ["| paper: bare step, eager", "| GPT-2-small width: bare step, eager"]
    assert all("has no attribute 'GPTConfig'" in r for r in errors) and "not run:" not in table, table
    # the gpu tests' own code, dry-run on the CPU (cpu against cpu): all six pass
    assert len([r for r in rows if r.startswith("| gpu test: ") and r.endswith(" | PASSED |")]) == 6, table
    for row in ("solve door", "paper: one probe", "GPT-2-small width: probe split", "whole job at its cadence",
                "1 paper-preset runs at once (20 steps each, 1/1 done)", "seeds stacked"):  # fmt: skip
        assert row in table, table
