"""Model loads: ``load_model(path, pool=pool)`` through a warm pool, a new pool and no pool.

The models of ``fastckpt bench --suite model``: an 8-layer MLP of about 64 MiB
(``Linear(1448, 1448)`` x 8) and 400 small layers (``Linear(16, 16)`` x 400,
800 tensors), written once by ``setup_cache``. The targets these track: the
400 small layers through a warm pool in at most 1.5 ms; the MLP's warm load
within 1.15x one copy of its bytes (``TimeOneCopy``); a first load through a
new pool within 1.3x a load without a pool.

``setup`` is not re-run between the iterations of one sample, so the first
load through a new pool uses ``number = 1`` (a fresh pool per sample).
"""

from __future__ import annotations

import os

import numpy as np

from .common import CPU as _CPU
from .common import counts
from .common import device as _device

MODELS = {
    "mlp": [{"type": "Linear", "args": {"in_features": 1448, "out_features": 1448, "bias": True}}] * 8,
    "many": [{"type": "Linear", "args": {"in_features": 16, "out_features": 16, "bias": True}}] * 400,
}


class _Models:
    params = [list(MODELS)]
    param_names = ["model"]

    def setup_cache(self):
        import fastckpt.nn as nn
        from fastckpt.io import save_model

        queue = _device().queue
        paths = {}
        for kind, config in MODELS.items():
            path = os.path.abspath(f"model-{kind}.netcl")
            save_model(nn.build_sequential(queue, config), path, fsync=False)
            paths[kind] = path
        return paths


class TimeLoadModelWarm(_CPU, _Models):
    """A reload through a pool that holds the arena and keeps the file open: rebuild, one copy, no allocation."""

    def setup(self, paths, kind):
        from fastckpt.device.pool import PersistentBufferPool
        from fastckpt.io import load_model

        dev = _device()
        self.queue = dev.queue
        self.pool = PersistentBufferPool(dev.context, dev.queue)
        self.path = paths[kind]
        load_model(self.path, pool=self.pool)  # the arena now exists; its model is dropped at once

    def time_load_model(self, paths, kind):
        from fastckpt.io import load_model

        load_model(self.path, pool=self.pool)
        self.queue.finish()

    def track_repeat_misses(self, paths, kind):
        """Pool misses over three more loads (must be 0)."""
        from fastckpt.io import load_model

        before = self.pool.stats.misses
        for _ in range(3):
            load_model(self.path, pool=self.pool)
        return self.pool.stats.misses - before

    track_repeat_misses.unit = "misses"

    def track_allocated(self, paths, kind):
        """Host bytes a warm model load allocates at its peak (the model's objects; never a copy of the weights)."""
        from fastckpt.io import load_model

        return counts(lambda: load_model(self.path, pool=self.pool))["allocated"]

    track_allocated.unit = "bytes"

    def track_copies(self, paths, kind):
        """Copy commands of a warm load (one per 4 MiB of the file's region)."""
        from fastckpt.io import load_model

        return load_model(self.path, pool=self.pool).load_report.file_report.copies

    track_copies.unit = "commands"


class TimeLoadModelNewPool(_CPU, _Models):
    """The first load through a new pool (allocates the arena, opens the file)."""

    number = 1
    repeat = (3, 10, 10.0)

    def setup(self, paths, kind):
        from fastckpt.device.pool import PersistentBufferPool
        from fastckpt.io import load_model

        dev = _device()
        self.queue = dev.queue
        self.path = paths[kind]
        load_model(self.path, self.queue)  # warm: first-call costs (imports, caches) are not the load
        self.pool = PersistentBufferPool(dev.context, dev.queue)

    def time_first_load(self, paths, kind):
        from fastckpt.io import load_model

        load_model(self.path, pool=self.pool)
        self.queue.finish()


class TimeLoadModelNoPool(_CPU, _Models):
    """A load without a pool: a buffer per weight."""

    def setup(self, paths, kind):
        from fastckpt.io import load_model

        self.queue = _device().queue
        self.path = paths[kind]
        load_model(self.path, self.queue)

    def time_load_model(self, paths, kind):
        from fastckpt.io import load_model

        load_model(self.path, self.queue)
        self.queue.finish()


class TimeOneCopy(_CPU, _Models):
    """The bound: one blocking ``enqueue_copy`` of the model's bytes from RAM into one buffer allocated before."""

    def setup(self, paths, kind):
        import pyopencl as cl

        import fastckpt

        dev = _device()
        self.queue = dev.queue
        with fastckpt.open(paths[kind]) as f:
            self.flat = np.concatenate([f.host(k).reshape(-1).view(np.uint8) for k in f.keys()
                                        if k != "__netcl_meta__"])
        self.buffer = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, self.flat.nbytes)
        cl.enqueue_copy(self.queue, self.buffer, self.flat, is_blocking=True)

    def time_one_copy(self, paths, kind):
        import pyopencl as cl

        cl.enqueue_copy(self.queue, self.buffer, self.flat, is_blocking=True)
