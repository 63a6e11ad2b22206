"""Dispatch sweep runs to a Ray cluster (optional extra: pip install 'qkgeom[ray]').

Each run is one Ray task calling the same `sweep.run_one` as the local pool, writing into the
same (shared) runs folder, so the semantics match: finished runs are skipped before dispatch,
a failing run comes back as a status (error.json written) without stopping the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkgeom.sweep import RunSpec


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray executor needs Ray: pip install 'qkgeom[ray]'") from None
    return ray


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` ("auto" inside `ray start` / Slurm), or start a local instance."""
    ray = _ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def run_ray(
    todo: list[RunSpec], out: Path, threads: int, address: str | None, bar: Any, gpus_per_run: float = 0.0
) -> list[dict[str, Any]]:
    """Run every RunSpec as a Ray task (CPUs = threads, optional GPUs); statuses as runs finish."""
    from qkgeom import config as C
    from qkgeom.sweep import run_one

    ray = _ray()
    connect(address)
    task = ray.remote(num_cpus=threads, num_gpus=gpus_per_run, max_retries=0)(run_one)
    pending = [task.remote(C.to_dict(r.config), str(Path(out).resolve() / r.run_id), threads) for r in todo]
    statuses = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        statuses.append(ray.get(done[0]))
        bar.update(1, statuses[-1]["run_id"])
    return statuses
