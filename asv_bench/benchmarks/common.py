"""What the benchmark modules share: the default device, scratch directories, and the timing of slow cases.

The fixtures and workloads themselves come from :mod:`fastckpt.bench` (the
same builders the ``fastckpt bench`` suites time at full size), so that a
change to a workload moves both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import tracemalloc


def device():
    """The default OpenCL device of :mod:`fastckpt.device` (pocl on a machine without a GPU)."""
    from fastckpt.device import default

    return default()


def scratch(prefix: str) -> str:
    """A new temporary directory for one benchmark process's outputs."""
    return tempfile.mkdtemp(prefix=f"fastckpt-asv-{prefix}-")


def remove(path) -> None:
    """Remove a file or a directory tree if it is there."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


class Slow:
    """Timing for cases of a tenth of a second and more: one call per sample (``setup`` runs before each, so a
    save writes a new file every time), 3 to 7 samples within 6 seconds, asv's rounds taking them in turn."""

    number = 1
    repeat = (3, 7, 6.0)
    warmup_time = 0.0
    timeout = 120.0


class CPU:
    """Timing by the CPU time of the benchmark's process (``time.process_time``: every thread of it, pocl's copy
    threads included) for cases whose work is the process's own (a warm page cache, no fsync, no network). On a
    shared machine other processes' load stretches wall time by up to 4.6x between two runs of one commit; it
    stretches CPU time far less, which is what lets a 1.5x slowdown show (see ``tools/asv-check.sh``). A wait (a
    sleep, I/O) is not CPU time: such cases keep wall time, and their ``track_`` counters watch them."""

    timer = time.process_time


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def counts(fn) -> dict:
    """Run ``fn()`` once and return what it did that does not vary from run to run: ``allocated`` (the peak of the
    bytes it allocated through Python's and numpy's allocators, tracemalloc), ``read_calls`` and ``bytes_read``
    (its read system calls and the bytes they returned, ``/proc/self/io``; a copy out of a mapping reads none).
    An extra copy of the bytes shows in ``allocated``; an extra read in the other two. ``fn()`` runs once before,
    uncounted, so that first-call costs (imports, caches) are not counted; ``allocated`` still moves by a few
    hundred bytes between processes (freelists, interning): ``tools/asv-check.sh`` holds it to 1.2x, as memory."""
    fn()
    before = _io()
    tracemalloc.start()
    try:
        fn()
        allocated = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    after = _io()
    return {"allocated": allocated, "read_calls": after["syscr"] - before["syscr"],
            "bytes_read": after["rchar"] - before["rchar"]}
