"""The ``memory`` suite's headline cases: the peak memory of a save and of a pooled device load.

The state is :func:`fastckpt.bench.memory.state`'s at 64 MiB (the suite's
default: 2 GiB). asv's ``peakmem_`` is the benchmark process's peak resident
set, the state's arrays included (made in ``setup``); the ``track_`` methods
give what the memory suite reports: the growth of the peak resident set over
the one call (:class:`fastckpt.bench.timing.PeakMemory`, ``VmHWM`` reset
before it), where a copy of the state would show as 64 MiB more. A pooled load
on a device sharing host memory (pocl) puts the arrays' bytes in the process's
own memory and reads the file's pages through a mapping (page cache, counted
in the resident set): its growth is about twice the state.
"""

from __future__ import annotations

import os

import fastckpt
from fastckpt.bench.memory import state
from fastckpt.bench.timing import PeakMemory
from fastckpt.device.load import load_file
from fastckpt.device.pool import PersistentBufferPool

from .common import device, remove, scratch

MIB = 64


class MemorySave:
    """``fastckpt.save_safetensors`` of the state (atomic, fsynced) to a new file."""

    def setup(self):
        self.tensors = state(MIB)
        self.root = scratch("memory-save")
        self.path = os.path.join(self.root, "state.safetensors")

    def teardown(self):
        remove(self.root)

    def peakmem_save_safetensors(self):
        fastckpt.save_safetensors(self.path, self.tensors, overwrite=True)  # asv calls it again on one path

    def track_save_peak_growth(self):
        """Bytes the peak resident set grew by over the save (the writers gather the arrays: no copy)."""
        with PeakMemory() as peak:
            fastckpt.save_safetensors(self.path, self.tensors, overwrite=True)
        if peak.growth is None:
            raise NotImplementedError("no /proc/self/status here")
        return peak.growth

    track_save_peak_growth.unit = "bytes"


class MemoryPooledLoad:
    """``load_file(path, queue, pool=<a new pool>)`` of the state's safetensors file (page cache warm)."""

    def setup_cache(self):
        path = os.path.abspath("memory-state.safetensors")
        fastckpt.save_safetensors(path, state(MIB), fsync=False)
        return path

    def setup(self, path):
        self.dev = device()
        load_file(path, self.dev.queue)  # page cache warm, kernels and first-call costs paid

    def _load(self, path):
        loaded = load_file(path, self.dev.queue, pool=PersistentBufferPool(self.dev.context, self.dev.queue))
        self.dev.queue.finish()
        return loaded

    def peakmem_load_pooled(self, path):
        self._load(path)

    def track_load_peak_growth(self, path):
        """Bytes the peak resident set grew by over the load (arena + the mapped file's pages read)."""
        with PeakMemory() as peak:
            loaded = self._load(path)
        del loaded
        if peak.growth is None:
            raise NotImplementedError("no /proc/self/status here")
        return peak.growth

    track_load_peak_growth.unit = "bytes"
