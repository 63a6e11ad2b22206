"""Shared fixtures: the real WikiText-2 mirror (QKGEOM_WIKITEXT_DIR) and an isolated cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qkgeom.training.data import wikitext_mirror

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _env(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["QKGEOM_WIKITEXT_DIR"] = str(wikitext_mirror())  # subprocesses see the same setting
    os.environ["QKGEOM_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def wikitext() -> Path:
    """Folder holding wikitext-2/{train,valid,test}.txt; a failure under CI, a skip elsewhere."""
    root = wikitext_mirror()
    if not (root / "wikitext-2" / "train.txt").is_file():
        msg = f"WikiText-2 mirror not found at {root} (set QKGEOM_WIKITEXT_DIR)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return root


def tiny_config(**sections):
    """The tiny preset with per-section overrides, e.g. tiny_config(train={"steps": 10})."""
    from qkgeom import config as C

    overrides = [f"{sec}.{k}={_toml(v)}" for sec, kv in sections.items() for k, v in kv.items()]
    return C.load("tiny", overrides)


def _toml(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def need(module: str):
    """Import an optional extra's module: a clean skip where it is absent, a failure under CI (which
    installs every extra, so that no test is skipped there)."""
    try:
        return __import__(module)
    except ImportError:
        msg = f"{module} is not installed (an optional extra; pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
