"""The one private CPython API qkgeom relies on (executor.pool_internals): fail loudly, with the
reason, if a Python release renames it, instead of sweeps that no longer stop their workers."""

from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from qkgeom.executor import pool_internals


def test_process_pool_private_attributes_still_exist():
    pool = ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"))
    try:
        assert pool.submit(abs, -3).result(timeout=60) == 3
        assert hasattr(pool, "_processes") and hasattr(pool, "_executor_manager_thread"), (
            "concurrent.futures renamed ProcessPoolExecutor._processes / ._executor_manager_thread: "
            "update qkgeom.executor.pool_internals"
        )
        procs, manager = pool_internals(pool)
        assert len(procs) == 1 and procs[0].is_alive() and manager is not None
    finally:
        pool.shutdown()
