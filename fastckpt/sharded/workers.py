"""Threads kept between sharded loads: each load runs its tasks on shared worker threads, at most ``limit`` at a time.

A load used to start thread pools of its own (its jobs, each table's row copies, the hashing of a verified load):
about seven new threads a rank, each ``Thread.start()`` waiting until the new thread runs. On a busy machine every
such wait is a trip through the scheduler on the load's critical path; four ranks as threads of one process started
28 threads a load. Here the threads of each kind of task (``"load"``, ``"rows"``, ``"verify"``) live on in the
process and serve every load: :class:`Lane` is one load's share of them.

A lane runs at most ``limit`` of its tasks at once (a load's ``parallel``), the rest in the order submitted, each
started by the thread that finished the one before (no hand-over between threads). Leaving a lane's ``with`` block
waits for every task submitted to it, as leaving a ``ThreadPoolExecutor``'s does. A task may wait for tasks of
another kind (a table's job for its row copies) but never for one of its own kind; the threads of a kind grow to as
many as run at once, up to :data:`MOST`, and idle ones cost no CPU. A forked child starts threads of its own (the
parent's do not exist there). :meth:`Lane.submit_bundled` hands tasks of a few MiB to a thread together
(:func:`bundles`, :data:`BUNDLE_BYTES`): a resharding rank's dense jobs and row runs, where ranks run as threads.

>>> with Lane("rows", 2) as lane:
...     futures = [lane.submit(pow, 2, k) for k in range(5)]
>>> [f.result() for f in futures]
[1, 2, 4, 8, 16]
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from fastckpt.threads import kept_pool

__all__ = ["BUNDLE_BYTES", "MOST", "Lane", "bundles"]

#: The most threads one kind of task may grow to in a process (tasks beyond wait in its queue).
MOST = 256

#: The fewest bytes :meth:`Lane.submit_bundled` hands to another thread at once, where the tasks hold more in all.
#: Handing a task over wakes a thread, which then waits for the GIL: with four ranks as threads on two cores, 25
#: hand-offs cost a 1 -> 4 load 2.1 ms, where the copies each carried 4-16 MiB that one thread reads as fast.
BUNDLE_BYTES = 32 << 20


def bundles(sizes: list[int], limit: int, least: int = BUNDLE_BYTES) -> list[list[int]]:
    """The positions of tasks of ``sizes`` (bytes) in bundles to hand to a thread each: at most ``limit`` bundles,
    and no more than the bytes give ``least`` to each (one where they hold less); the largest task first, each to
    the bundle holding the fewest bytes so far, every bundle in the order the tasks came.

    >>> bundles([10, 40, 30, 20], 4, least=30)   # 100 bytes: 3 bundles of 30 or more
    [[1], [2], [0, 3]]
    >>> bundles([10, 40, 30, 20], 2, least=1)
    [[0, 1], [2, 3]]
    >>> bundles([5, 5], 4, least=100)
    [[0, 1]]
    """
    if not sizes:
        return []
    count = max(1, min(limit, len(sizes), sum(sizes) // max(1, least)))
    held = [0] * count
    out: list[list[int]] = [[] for _ in range(count)]
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        lightest = held.index(min(held))
        held[lightest] += sizes[k]
        out[lightest].append(k)
    return [sorted(group) for group in out if group]


def _run(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    """``fn(*args)`` on this thread, its result or error to ``future`` (nothing where it was cancelled)."""
    if future.set_running_or_notify_cancel():
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)


def _run_all(tasks: list[tuple[concurrent.futures.Future, Callable[..., Any], tuple]]) -> None:
    """Each task in turn on this thread (every task runs, whatever one before it raised)."""
    for task in tasks:
        _run(*task)


def _pool(kind: str) -> concurrent.futures.ThreadPoolExecutor:
    """The worker threads of ``kind`` in this process (:func:`fastckpt.threads.kept_pool`: made on first use, and
    again in a forked child)."""
    return kept_pool(kind, MOST)


class Lane:
    """One load's tasks of one kind on the shared threads of that kind, at most ``limit`` at a time (see the module
    docs); ``submit(fn, *args)`` returns a :class:`concurrent.futures.Future`.

    >>> import threading
    >>> seen = set()
    >>> with Lane("load", 3) as lane:
    ...     _ = [lane.submit(lambda: seen.add(threading.current_thread().name)) for _ in range(9)]
    >>> len(seen) <= 3, all(name.startswith("fastckpt-load") for name in seen)
    (True, True)
    """

    def __init__(self, kind: str, limit: int):
        if type(limit) is not int or limit < 1:
            raise ValueError(f"a lane runs at least one task at a time, got limit {limit!r}")
        self._pool = _pool(kind)
        self._limit = limit
        self._running = 0
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._futures.append(future)
            start = self._running < self._limit
            if start:
                self._running += 1
            else:
                self._waiting.append((future, fn, args))
        if start:
            try:
                self._pool.submit(self._drain, future, fn, args)
            except BaseException:
                with self._lock:
                    self._running -= 1
                raise
        return future

    def submit_bundled(self, tasks: list[tuple[Callable[..., Any], tuple]], sizes: list[int],
                       least: int = BUNDLE_BYTES) -> list[concurrent.futures.Future]:
        """Tasks ``(fn, args)`` of ``sizes`` bytes in :func:`bundles`, one hand-off to a thread each; returns a
        future per task, in their order.

        >>> with Lane("rows", 4) as lane:
        ...     futures = lane.submit_bundled([(pow, (2, k)) for k in range(5)], [1] * 5, least=2)
        >>> [f.result() for f in futures]
        [1, 2, 4, 8, 16]
        """
        futures = [concurrent.futures.Future() for _ in tasks]
        for group in bundles(sizes, self._limit, least):
            self.submit(_run_all, [(futures[k], *tasks[k]) for k in group])
        return futures

    def _drain(self, future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        """Run a task, then the lane's waiting ones in order on this thread, until none waits."""
        while True:
            _run(future, fn, args)
            with self._lock:
                if not self._waiting:
                    self._running -= 1
                    return
                future, fn, args = self._waiting.popleft()

    def __enter__(self) -> Lane:  # noqa: PYI034 - Self is Python 3.11 on; 3.10 is supported
        return self

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            futures = list(self._futures)
        concurrent.futures.wait(futures)
