"""File-to-device loads: open, pooled and unpooled loads, zero-copy, saves.

Fixtures are written once per class by ``setup_cache`` (deterministic data)
and read with a warm page cache. Sizes stay small enough for ``--quick`` runs;
``fastckpt bench`` measures the full 512 MiB case.

``setup`` is not re-run between the iterations of one sample, so first-load
timings use ``number = 1`` (a fresh pool per sample); ``track_`` methods report
the bytes copied and the pool's hits and misses, which ``peakmem_`` cannot
see for mapped files.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

import fastckpt
from fastckpt.load import load_file
from fastckpt.pool import PersistentBufferPool

FORMATS = ["safetensors", "npz"]
LAYOUTS = {"64x256KiB": (64, 65536), "1000x4KiB": (1000, 1024)}


def _tensors(layout: str) -> dict:
    n, elems = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    return {f"t{i:04d}": rng.standard_normal(elems, dtype=np.float32) for i in range(n)}


def _write(path: str, fmt: str, tensors: dict, fsync: bool = False) -> None:
    (fastckpt.save_safetensors if fmt == "safetensors" else fastckpt.save_npz)(path, tensors, fsync=fsync)


def _write_all() -> dict:
    paths = {}
    for fmt in FORMATS:
        for layout in LAYOUTS:
            path = os.path.abspath(f"{layout}.{fmt}")
            _write(path, fmt, _tensors(layout))
            paths[fmt, layout] = path
    return paths


def _device():
    from fastckpt.device import default

    return default()


class _Files:
    params = (FORMATS, list(LAYOUTS))
    param_names = ["format", "layout"]

    def setup_cache(self):
        return _write_all()


class TimeOpen(_Files):
    """Opening a file: map it and parse its index."""

    def setup(self, paths, fmt, layout):
        fastckpt.open(paths[fmt, layout]).close()  # warm: first-call costs are not the open

    def time_open(self, paths, fmt, layout):
        fastckpt.open(paths[fmt, layout]).close()


class OpenManySmall:
    """Open + a host view of every tensor of a file of 10,000 tensors of 16 bytes: the index is the cost."""

    params = (["safetensors", "npz", "tensorflow"],)
    param_names = ["format"]
    N = 10_000

    def setup_cache(self):
        from fastckpt.tf import write_checkpoint

        tensors = {f"layers.{i}.weight": np.full(4, i, np.float32) for i in range(self.N)}
        paths = {"tensorflow": os.path.abspath("many-tf/ckpt")}
        write_checkpoint(paths["tensorflow"], tensors)
        for fmt in ("safetensors", "npz"):
            paths[fmt] = os.path.abspath(f"many.{fmt}")
            _write(paths[fmt], fmt, tensors)
        return paths

    def time_open_hosts(self, paths, fmt):
        with fastckpt.open(paths[fmt]) as f:
            f.hosts()


class LoadPooled(_Files):
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


class LoadPooledFirst(_Files):
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


class LoadUnpooled(_Files):
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


class LoadZeroCopy(_Files):
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


class Save:
    """Aligned atomic saves (without fsync: the page cache, not the disk, is measured)."""

    params = (FORMATS, list(LAYOUTS))
    param_names = ["format", "layout"]

    def setup(self, fmt, layout):
        self.tensors = _tensors(layout)
        self.path = os.path.abspath(f"save-{layout}.{fmt}")

    def teardown(self, fmt, layout):
        if os.path.exists(self.path):
            os.remove(self.path)

    def time_save(self, fmt, layout):
        _write(self.path, fmt, self.tensors)
