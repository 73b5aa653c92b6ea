"""What the benchmark modules share: the default device, scratch directories, and the timing of slow cases.

The fixtures and workloads themselves come from :mod:`fastckpt.bench` (the
same builders the ``fastckpt bench`` suites time at full size), so that a
change to a workload moves both.
"""

from __future__ import annotations

import os
import shutil
import tempfile


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
