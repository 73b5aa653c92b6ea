"""The ``device`` suite's paths: file -> OpenCL device loads, pooled, unpooled, zero-copy and staged.

Fixtures (:func:`fastckpt.bench.formats.random_tensors`, the device and
formats suites' tensors) are written once by ``setup_cache`` and read with a
warm page cache, in two layouts: 64 tensors of 256 KiB (16 MiB) and 1000 of
4 KiB; ``fastckpt bench`` measures the full 512 MiB case.

``setup`` is not re-run between the iterations of one sample, so first-load
timings use ``number = 1`` (a fresh pool per sample); ``track_`` methods report
the bytes copied, the copy commands and the pool's hits and misses, which
``peakmem_`` cannot see for mapped files.
"""

from __future__ import annotations

import warnings

from fastckpt.load import load_file
from fastckpt.pool import PersistentBufferPool

from .common import CPU as _CPU
from .common import counts
from .common import device as _device
from .files import Files as _Files


class LoadPooled(_CPU, _Files):
    """Open + load through a warm pool: one copy, no allocation."""

    def setup(self, paths, fmt, layout):

        dev = _device()
        self.queue = dev.queue
        self.pool = PersistentBufferPool(dev.context, dev.queue)
        self.path = paths[fmt, layout]
        self.report = load_file(self.path, self.queue, pool=self.pool).report  # fills the pool

    def time_load(self, paths, fmt, layout):

        load_file(self.path, self.queue, pool=self.pool)

    def track_repeat_misses(self, paths, fmt, layout):
        """Pool misses over three more loads of the same file (must be 0)."""

        before = self.pool.stats.misses
        for _ in range(3):
            load_file(self.path, self.queue, pool=self.pool)
        return self.pool.stats.misses - before

    track_repeat_misses.unit = "misses"

    def track_repeat_hits(self, paths, fmt, layout):

        before = self.pool.stats.hits
        for _ in range(3):
            load_file(self.path, self.queue, pool=self.pool)
        return self.pool.stats.hits - before

    track_repeat_hits.unit = "hits"

    def track_bytes_copied(self, paths, fmt, layout):
        return self.report.bytes_copied

    track_bytes_copied.unit = "bytes"

    def track_copies(self, paths, fmt, layout):
        return self.report.copies

    track_copies.unit = "commands"

    def track_allocated(self, paths, fmt, layout):
        """Host bytes one warm load allocates (tracemalloc's peak): an extra host copy shows here."""
        return counts(lambda: load_file(self.path, self.queue, pool=self.pool))["allocated"]

    track_allocated.unit = "bytes"


class LoadPooledStaged(_CPU, _Files):
    """A warm pooled load with ``staging=True``: every copy goes through the pool's pinned staging buffers, the
    path ``load_file`` takes on a discrete GPU, forced so that a device sharing host memory (pocl) runs it too."""

    def setup(self, paths, fmt, layout):
        dev = _device()
        self.queue = dev.queue
        self.pool = PersistentBufferPool(dev.context, dev.queue)
        self.path = paths[fmt, layout]
        self.report = load_file(self.path, self.queue, pool=self.pool, staging=True).report  # arena + staging

    def time_load(self, paths, fmt, layout):
        load_file(self.path, self.queue, pool=self.pool, staging=True)

    def track_staging_chunk(self, paths, fmt, layout):
        """The staging buffers' size: the load's bytes rounded up, below one chunk (0 would mean not staged)."""
        return self.report.staging_chunk

    track_staging_chunk.unit = "bytes"

    def track_repeat_misses(self, paths, fmt, layout):
        """Pool misses over three more staged loads (must be 0: the arena and the staging buffers are reused)."""
        before = self.pool.stats.misses
        for _ in range(3):
            load_file(self.path, self.queue, pool=self.pool, staging=True)
        return self.pool.stats.misses - before

    track_repeat_misses.unit = "misses"


class LoadPooledFirst(_CPU, _Files):
    """The first load into an empty pool (allocates the arena)."""

    number = 1
    repeat = (3, 10, 10.0)

    def setup(self, paths, fmt, layout):

        dev = _device()
        self.queue = dev.queue
        self.pool = PersistentBufferPool(dev.context, dev.queue)
        self.path = paths[fmt, layout]

    def time_first_load(self, paths, fmt, layout):

        load_file(self.path, self.queue, pool=self.pool)

    def track_first_load_misses(self, paths, fmt, layout):

        return load_file(self.path, self.queue, pool=self.pool).report.pool_misses

    track_first_load_misses.unit = "misses"


class LoadUnpooled(_CPU, _Files):
    """Open + load with a new exact-size buffer per tensor."""

    def setup(self, paths, fmt, layout):
        self.queue = _device().queue
        self.path = paths[fmt, layout]
        load_file(self.path, self.queue)  # warm: first-call costs (kernels, caches) are not the load

    def time_load(self, paths, fmt, layout):

        load_file(self.path, self.queue)

    def track_bytes_allocated(self, paths, fmt, layout):

        return load_file(self.path, self.queue).report.bytes_allocated

    track_bytes_allocated.unit = "bytes"


class LoadZeroCopy(_CPU, _Files):
    """Open copy-on-write + wrap the mapping as device memory (host-unified devices)."""

    def setup(self, paths, fmt, layout):
        dev = _device()
        if not dev.host_unified_memory:
            raise NotImplementedError("zero-copy needs a device sharing host memory")
        self.queue = dev.queue
        self.path = paths[fmt, layout]
        load_file(self.path, self.queue, zero_copy=True)

    def time_load(self, paths, fmt, layout):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to copying would time the wrong thing
            load_file(self.path, self.queue, zero_copy=True)

    def track_bytes_copied(self, paths, fmt, layout):

        return load_file(self.path, self.queue, zero_copy=True).report.bytes_copied

    track_bytes_copied.unit = "bytes"
