"""A plain install (a wheel, as `pip install git+...` or `pip install .` makes) runs without the checkout:
the presets and study files ship inside the package, provenance records no commit that is not
qkgeom's, and a study's records go under the current directory. Built for real with pip and run from
the unpacked wheel (the editable install of the venv is shadowed by PYTHONPATH)."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qkgeom import config as C
from qkgeom.provenance import git_state
from tests.conftest import REPO, unavailable

SCRIPT = """
import json
import qkgeom
from qkgeom import config as C
from qkgeom.studies import records_dir
from qkgeom.training.grid import expand, load_sweep
print(json.dumps({
    "package": qkgeom.__file__, "in_checkout": C.IN_CHECKOUT, "config_dir": str(C.CONFIG_DIR),
    "smoke_runs": len(expand(load_sweep("smoke"))),
    "ladder_records": str(records_dir(load_sweep("ladder-cpu"))),
}))
"""


def git(cwd: Path, *args: str) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run(["git", *ident, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def build_wheel(tmp: Path) -> Path:
    """qkgeom's wheel, built from a copy of what it is made of (so no build/ folder of the checkout's
    can slip stale files into it), with this venv's setuptools (no network; the dev extra brings >= 77,
    as pyproject's SPDX license string needs)."""
    have = importlib.metadata.version("setuptools")
    if int(have.split(".")[0]) < 77:
        unavailable(f"setuptools {have} cannot build qkgeom (pyproject needs >= 77; pip install -U setuptools)")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("qkgeom", "configs"):
        shutil.copytree(REPO / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp.glob("qkgeom-*.whl")
    return wheel


def test_a_wheel_runs_without_the_checkout(tmp_path, wikitext):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {f"qkgeom/configs/{f.name}" for f in C.CONFIG_DIR.glob("*.toml")}
    assert presets and presets <= names, sorted(presets - names)

    # a user's project under git, with the wheel unpacked in its venv: the case where the project's commit
    # used to be recorded as qkgeom's
    project = tmp_path / "project"
    site = project / ".venv" / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    (project / "notes.txt").write_text("a user's own project\n")
    git(project, "init", "-q")
    git(project, "add", "notes.txt")
    git(project, "commit", "-q", "-m", "theirs")
    assert git_state(site) == (None, False)  # a commit exists up the tree, but it is not qkgeom's
    assert git_state(project)[0] == git(project, "rev-parse", "HEAD")  # the top of a checkout: read

    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=project, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert Path(got["package"]).is_relative_to(site), got  # not the checkout's editable install
    assert not got["in_checkout"] and got["config_dir"] == str(site / "qkgeom" / "configs")
    assert got["smoke_runs"] == 36
    assert got["ladder_records"] == str(project / "docs" / "results" / "ladder-cpu")

    out = project / "runs" / "t"
    cli = [sys.executable, "-m", "qkgeom.cli", "train", "tiny", "--out", str(out), "--no-progress"]
    r = subprocess.run([*cli, "--set", "train.steps=4"], cwd=project, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prov = json.loads((out / "config.json").read_text())["provenance"]
    assert prov["git_sha"] is None and prov["git_dirty"] is False, prov
    assert prov["qkgeom"] == wheel.name.split("-")[1]  # the wheel's own metadata


def test_the_checkout_records_its_own_commit():
    if not (REPO / ".git").exists():
        pytest.skip("a source tree without git: no commit to read")
    assert git_state(REPO)[0] == git(REPO, "rev-parse", "HEAD")


def _floors() -> dict[str, str]:
    lines = (REPO / ".ci" / "floors.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line.strip() and not line.startswith("#"))


def test_the_floors_are_pyprojects_lower_bounds():
    """.ci/floors.txt (what `make test-floors` installs) pins each core dependency at the lower bound
    pyproject.toml declares, so a raised or lowered bound without a floors run fails here."""
    import re
    import tomllib

    from packaging.version import Version

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = dict(re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d).groups() for d in deps)
    floors = _floors()
    assert set(bounds) == set(floors)
    assert {name: Version(bounds[name]) for name in floors} == {name: Version(v) for name, v in floors.items()}


def test_the_floors_venv_holds_the_floors():
    """Under `make test-floors` (QKGEOM_FLOORS=1) the tests must run on exactly the pinned versions: a
    resolver that quietly took newer ones would test nothing."""
    if not os.environ.get("QKGEOM_FLOORS"):
        pytest.skip("not the floors venv (make test-floors runs this)")
    from packaging.version import Version

    # torch's build tag aside (2.6.0+cpu from PyTorch's index, 2.6.0+cu124 from PyPI)
    installed = {name: Version(importlib.metadata.version(name)).public for name in _floors()}
    assert installed == _floors()
