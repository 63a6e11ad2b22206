"""Where and with what a result was made: the commit (and whether the tree was dirty), the versions of
qkgeom, torch, numpy and Python, the CPU with the features its float kernels are chosen by, the settings
that choose those kernels, and the GPU. provenance() goes into every run's config.json and every
measured revision's; a study report's provenance table reads it back."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from qkgeom.config import REPO_ROOT
from qkgeom.device import PORTABLE_ENV, kernel_capability


def package_version() -> str:
    """qkgeom's installed version, from the package metadata (importing the package itself from here
    would run an import arrow back up: provenance -> qkgeom/__init__ -> ... -> provenance)."""
    try:
        return importlib.metadata.version("qkgeom")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# settings that choose which float kernels a CPU runs, and so a trained run's last digits (README, "What
# repeats where"); provenance records those that are set
KERNEL_ENV = (*PORTABLE_ENV, "MKL_ENABLE_INSTRUCTIONS", "QKGEOM_VML_WARMUP")  # train.portable's, and two more
CPU_ISA = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")  # the features torch's and oneMKL's kernels pick by


def cpu() -> dict[str, Any]:
    """The CPU a result was made on: model and vendor, the features its kernels are chosen by (Linux:
    /proc/cpuinfo; elsewhere the model from platform.processor() only), and the vector width torch's own
    kernels run at on it (device.kernel_capability: torch's name, its scalar default "DEFAULT")."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "vendor_id", "flags"):
                info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    return {
        "model": info.get("model name") or platform.processor() or None,
        "vendor": info.get("vendor_id"),
        "isa": [f for f in CPU_ISA if f in flags],
        "torch_capability": kernel_capability(),
    }


def git_state(root: Path) -> tuple[str | None, bool]:
    """(commit, dirty) of the checkout at `root`; (None, False) where `root` is not the top of a git
    checkout, as for a wheel installed in a venv inside another project's repository (that repository's
    commit says nothing about the qkgeom that ran). Dirty: changes to tracked files, or new files outside
    docs/results/ (a study writing its own records there, as an accumulating study does, does not make
    the code it runs dirty)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--show-toplevel", "HEAD")
        top, _, sha = head.stdout.strip().partition("\n")
        if head.returncode or Path(top).resolve() != root.resolve():
            return None, False
        return sha, bool(git("status", "--porcelain", "--", ".", ":(exclude)docs/results").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def provenance() -> dict[str, Any]:
    """Where and with what a result was made: git sha, package versions, machine (the CPU, and the
    vector width torch's own kernels run at on it)."""
    import torch

    sha, dirty = git_state(REPO_ROOT)
    return {
        "git_sha": sha,
        "git_dirty": dirty,
        "qkgeom": package_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu(),
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # which GPU a pool worker was given
    }
