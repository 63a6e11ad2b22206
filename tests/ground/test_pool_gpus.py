"""The local pool on a machine of several GPUs: each worker sees one GPU (CUDA_VISIBLE_DEVICES, set in
the worker before anything starts CUDA), round robin over the ids given; a sweep spreads only runs
that ask for plain `cuda`. The workers here are real spawned processes; only the GPUs are absent, so
the ids are what each worker's environment says."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest
import torch

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.executor import Job, run_jobs
from qkgeom.training.grid import RunSpec
from qkgeom.training.sweep import default_workers, gpu_slots


def seen(i: int) -> tuple[int, str | None]:
    """A job: which process ran it, and which GPUs that process was shown."""
    time.sleep(0.5)  # long enough that every worker takes a job
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def pool_view(workers: int, n_jobs: int, devices: list[str] | None) -> dict[int, set]:
    by_pid: dict[int, set] = defaultdict(set)
    for _, (pid, ids) in run_jobs(seen, [Job(str(i), (i,)) for i in range(n_jobs)], workers=workers, devices=devices):
        by_pid[pid].add(ids)
    return by_pid


def test_each_worker_sees_one_gpu_of_its_own():
    view = pool_view(3, 9, ["4", "5", "6"])
    assert all(len(ids) == 1 for ids in view.values())  # a worker keeps its GPU for every job it runs
    given = [next(iter(ids)) for ids in view.values()]
    assert len(set(given)) == len(given) and set(given) <= {"4", "5", "6"}  # no two workers share one


def test_more_workers_than_gpus_share_them_round_robin():
    view = pool_view(4, 12, ["0", "1"])
    given = [next(iter(ids)) for ids in view.values()]
    assert set(given) <= {"0", "1"} and all(given.count(d) <= 2 for d in ("0", "1"))


def test_without_devices_a_worker_sees_what_the_parent_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert {ids for s in pool_view(2, 4, None).values() for ids in s} == {"2,3"}


def run(device: str) -> RunSpec:
    return RunSpec("r", {}, C.load("tiny", [f"train.device='{device}'"]))


def test_runs_on_cuda_default_to_one_worker_per_gpu(monkeypatch):
    """Not one CUDA process per CPU core on one GPU (16 on a 16-core machine could fill a small GPU's
    memory): one per visible GPU, no more than there are runs; runs on the CPU keep one per core."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_workers([run("cuda")] * 5) == 2
    assert default_workers([run("cuda:1")] * 5) == 2
    assert default_workers([run("cuda")]) == 1
    assert default_workers([run("cpu")] * 20) == 16
    assert default_workers([run("cpu")] * 3) == 3


def test_a_sweep_spreads_only_plain_cuda_runs_over_a_local_pool(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs, as CUDA would count them
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert gpu_slots([run("cuda"), run("cuda")], "local", 2) == ["5", "7"]
    assert gpu_slots([run("cuda"), run("cuda:1")], "local", 2) is None  # placed by its config
    assert gpu_slots([run("cpu")], "local", 2) is None
    assert gpu_slots([run("cuda")], "local", 1) is None  # in-process: CUDA may already be started
    assert gpu_slots([run("cuda")], "ray", 2) is None  # Ray places GPUs itself (--gpus-per-run)


@pytest.mark.parametrize(
    "named, count, ids",
    [(None, 3, ["0", "1", "2"]), ("5,7", 2, ["5", "7"]), ("5,-1,7", 1, ["5"]), ("", 0, [])],
)
def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(monkeypatch, named, count, ids):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if named is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", named)
    assert D.visible_gpus() == ids
