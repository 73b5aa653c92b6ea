"""The ``cold`` suite's headline paths: loads of a file that is not in the page cache.

A 64 MiB safetensors file of 16 float32 tensors, written once by
``setup_cache``, dropped from the page cache before every sample
(``posix_fadvise(DONTNEED)``); each sample is one load
(``number = 1``), timed by the wall clock (the time is the disk's, not the
process's CPU). ``fastckpt bench --suite cold`` measures the full case, a fresh
process per run, against the bound and the peers. The ``track_`` counters are
what a regression of the read strategy changes whatever the disk does: the
bytes copied and the commands issued, the bytes allocated (an extra host copy),
the read system calls (a route that reads instead of mapping).
"""

from __future__ import annotations

import os

import numpy as np

from .common import counts
from .common import device as _device

TENSORS, ELEMENTS = 16, 1 << 20  # 64 MiB


class _ColdFile:
    number = 1
    repeat = (3, 7, 30.0)
    warmup_time = 0.0
    timeout = 120.0

    def setup_cache(self):
        import fastckpt
        from fastckpt.bench.formats import random_tensors

        path = os.path.abspath("cold.safetensors")
        fastckpt.save_safetensors(path, random_tensors(TENSORS, ELEMENTS), fsync=False, overwrite=True)
        return path

    def setup(self, path):
        # As fastckpt.bench.cold.drop_cache does; written out, so that the check can run this file against a base
        # commit that has no cold suite.
        fd = os.open(path, os.O_RDONLY)
        try:
            # Written back first: DONTNEED drops clean pages only, and setup_cache writes without fsync, so a first
            # sample could find the file still in the page cache (a warm load, and counters of the warm route).
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class ColdPooledLoad(_ColdFile):
    """``load_file(path, queue, pool=<new pool>)`` of the cold file: what a serving process pays at its first load."""

    def setup(self, path):
        from fastckpt.pool import PersistentBufferPool

        dev = _device()
        self.queue = dev.queue
        self.pool = PersistentBufferPool(dev.context, dev.queue)
        super().setup(path)

    def _load(self, path):
        from fastckpt.load import load_file

        return load_file(path, self.queue, pool=self.pool)

    def time_cold_load(self, path):
        self._load(path)

    def track_bytes_copied(self, path):
        return self._load(path).report.bytes_copied

    track_bytes_copied.unit = "bytes"

    def track_copies(self, path):
        return self._load(path).report.copies

    track_copies.unit = "commands"

    def track_allocated(self, path):
        return counts(lambda: self._load(path))["allocated"]

    track_allocated.unit = "bytes"

    def track_read_calls(self, path):
        # The load's own reads (its report), not the process's read system calls: a fill thread that the pool starts
        # during the load reads /sys/devices/system/cpu/online once (glibc's malloc making the thread's arena), and
        # whether the pool starts one depends on timing (10 or 11 calls, on 0.5.0's code as on later code).
        return self._load(path).report.reads

    track_read_calls.unit = "calls"


class ColdStagedLoad(ColdPooledLoad):
    """The same load with ``staging=True``, the discrete-GPU route (pinned staging buffers, ``O_DIRECT`` fills on
    ``DIRECT_THREADS`` threads): timed and counted as that load is (the methods it inherits), and how deep its
    staging is."""

    def _load(self, path):
        from fastckpt.load import load_file

        return load_file(path, self.queue, pool=self.pool, staging=True)

    def track_staging_buffers(self, path):
        # A cold load leases the buffers its 8 direct fill threads fill at once (12 x 2 MiB for 64 MiB), where 0.7
        # leased the cores' shape (6 x 2 MiB on 2 cores): fewer buffers keep fewer reads in the disk's queue.
        return self._load(path).report.staging_buffers

    track_staging_buffers.unit = "buffers"

    def track_fill_threads(self, path):
        return self._load(path).report.fill_threads

    track_fill_threads.unit = "threads"


class ColdHostCopies(_ColdFile):
    """``fastckpt.open`` + a copy of every tensor (``np.array(f.host(name))``) of the cold file."""

    def _copies(self, path):
        import fastckpt

        with fastckpt.open(path) as f:
            return {name: np.array(f.host(name)) for name in f.keys()}

    def time_cold_copies(self, path):
        self._copies(path)

    def track_allocated(self, path):
        return counts(lambda: self._copies(path))["allocated"]

    track_allocated.unit = "bytes"

    def track_read_calls(self, path):
        return counts(lambda: self._copies(path))["read_calls"]

    track_read_calls.unit = "calls"
