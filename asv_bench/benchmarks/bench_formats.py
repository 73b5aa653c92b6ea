"""The ``formats`` suite's paths: opening files (the index), host views of many small tensors, and saves.

Open-only cases read the files of :mod:`files` (page cache warm); the many-small
case is the formats suite's (e): 10,000 tensors of 16 bytes, safetensors, NPZ
and a TensorFlow checkpoint (CRC32C checked).
"""

from __future__ import annotations

import os

import numpy as np

import fastckpt
from fastckpt.bench.formats import save_as

from .common import CPU, counts
from .files import FORMATS, LAYOUTS, Files, tensors


class TimeOpen(CPU, Files):
    """Opening a file: map it and parse its index."""

    def setup(self, paths, fmt, layout):
        fastckpt.open(paths[fmt, layout]).close()  # warm: first-call costs are not the open

    def time_open(self, paths, fmt, layout):
        fastckpt.open(paths[fmt, layout]).close()

    def track_allocated(self, paths, fmt, layout):
        """Bytes an open allocates at its peak (the index's columns, the names)."""
        return counts(lambda: fastckpt.open(paths[fmt, layout]).close())["allocated"]

    track_allocated.unit = "bytes"


class OpenManySmall(CPU):
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
            save_as(paths[fmt], fmt, tensors)
        return paths

    def time_open_hosts(self, paths, fmt):
        with fastckpt.open(paths[fmt]) as f:
            f.hosts()

    def track_allocated(self, paths, fmt):
        """Bytes the open and the 10,000 views allocate at their peak."""
        def views():
            with fastckpt.open(paths[fmt]) as f:
                f.hosts()
        return counts(views)["allocated"]

    track_allocated.unit = "bytes"


class Save(CPU):
    """Aligned atomic saves (without fsync: the page cache, not the disk, is measured)."""

    params = (FORMATS, list(LAYOUTS))
    param_names = ["format", "layout"]

    def setup(self, fmt, layout):
        self.tensors = tensors(layout)
        self.path = os.path.abspath(f"save-{layout}.{fmt}")

    def teardown(self, fmt, layout):
        if os.path.exists(self.path):
            os.remove(self.path)

    def time_save(self, fmt, layout):
        save_as(self.path, fmt, self.tensors)

    def track_allocated(self, fmt, layout):
        """Bytes a save allocates at its peak (never a copy of the tensors: 0.3-0.6 MiB of header and buffers)."""
        try:
            return counts(lambda: save_as(self.path, fmt, self.tensors))["allocated"]
        finally:
            os.remove(self.path)

    track_allocated.unit = "bytes"
