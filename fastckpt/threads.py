"""Thread pools kept for the life of the process, made again in a forked child: the package's one way to keep threads.

Starting a thread costs about 100 us and a trip through the scheduler, so the threads that read files, fill staging
buffers, copy snapshots and run a sharded load's tasks are started once and kept, one pool per name and size (a pool
starts its threads as work arrives, and idle ones cost no CPU). A forked child has none of its parent's threads, and
a pool made before the fork would wait for them forever: the child starts with no pools and makes its own.

>>> pool = kept_pool("example", 2)
>>> pool is kept_pool("example", 2), pool.submit(pow, 2, 10).result()
(True, 1024)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["kept_pool"]

_pools: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}
_lock = threading.Lock()


def kept_pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of ``workers`` threads named ``fastckpt-{name}``, made on first use (never shut down: a
    caller on another thread may be using it)."""
    with _lock:
        pool = _pools.get((name, workers))
        if pool is None:
            pool = _pools[(name, workers)] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"fastckpt-{name}")
        return pool


def _forked() -> None:
    global _lock
    _lock = threading.Lock()  # held by a parent thread at the fork, it would be held forever here
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
