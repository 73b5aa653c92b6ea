"""The ``train`` suite's headline cases: a training checkpoint saved (sync, and how long an async save blocks the
trainer) and loaded (hashes verified, and not).

The state is :func:`fastckpt.bench.train.build_state` at 16 MiB (a TinyLM and
its Adam moments; the suite's default is 256 MiB). Saves are atomic and
fsynced, as a trainer makes them, each to a directory removed before the next.
"""

from __future__ import annotations

import functools
import itertools
import os

from fastckpt.bench.train import build_state
from fastckpt.train.checkpoint import load_checkpoint, save_checkpoint
from fastckpt.train.manager import CheckpointManager

from .common import Slow, remove, scratch

MIB = 16


@functools.lru_cache(maxsize=1)
def _state():
    return build_state(MIB)  # once per benchmark process: each sample saves the same state


def _state_bytes(model, opt) -> int:
    return sum(p.data.nbytes for p in model.parameters()) + sum(a.nbytes for b in opt.state for a in b.values())


class TrainSave(Slow):
    """``save_checkpoint`` of the state (atomic, BLAKE3-hashed, fsynced) to a new directory."""

    def setup(self):
        self.model, self.opt = _state()
        self.root = scratch("train-save")
        self.out = os.path.join(self.root, "ckpt")

    def teardown(self):
        remove(self.root)

    def time_save_sync(self):  # asv calls it again on one directory: each save replaces the last
        save_checkpoint(self.model, self.opt, None, None, None, self.out, step=1, overwrite=True)

    def track_bytes_over_state(self):
        """The checkpoint directory's bytes / the state's array bytes (payload, headers, manifest)."""
        save_checkpoint(self.model, self.opt, None, None, None, self.out, step=1, overwrite=True)
        written = sum(entry.stat().st_size for entry in os.scandir(self.out) if entry.is_file())
        return written / _state_bytes(self.model, self.opt)

    track_bytes_over_state.unit = "ratio"


class TrainAsyncSave(Slow):
    """``CheckpointManager.save(blocking=False)``: how long the trainer is held (the snapshot copy), in the steady
    state (the staging buffers of an earlier save reused); the background save is waited for untimed."""

    def setup(self):
        self.model, self.opt = _state()
        self.root = scratch("train-async")
        self.manager = CheckpointManager(os.path.join(self.root, "managed"), max_to_keep=1)
        self.steps = itertools.count()
        self.manager.save(next(self.steps), self.model, self.opt, blocking=False).wait()  # staging buffers made
        self.handle = None

    def teardown(self):
        if self.handle is not None:
            self.handle.wait()
        self.manager.close()
        remove(self.root)

    def time_async_save_blocking(self):
        self.handle = self.manager.save(next(self.steps), self.model, self.opt, blocking=False)


class TrainLoad(Slow):
    """``load_checkpoint`` of the saved state, hashes verified (the default) and not; page cache warm."""

    params = [True, False]
    param_names = ["verify"]

    def setup_cache(self):
        model, opt = build_state(MIB)
        path = os.path.abspath("train-ckpt")
        save_checkpoint(model, opt, None, None, None, path, step=1)
        return path

    def setup(self, path, verify):
        load_checkpoint(path, verify=verify)  # page cache warm

    def time_load(self, path, verify):
        load_checkpoint(path, verify=verify)
