"""The ``stateful`` suite's headline cases: a :class:`fastckpt.stateful.Checkpoint` of a reader, an RNG and 8 MiB
of arrays collected and saved, and loaded and applied; and an epoch of a checkpointing reader.

The objects come from :func:`fastckpt.bench.stateful.make_checkpoint` and
:func:`~fastckpt.bench.stateful.restore_checkpoint`, the suite's own.
"""

from __future__ import annotations

import os

from fastckpt.bench.stateful import make_checkpoint, make_data, restore_checkpoint
from fastckpt.stateful import ArrayReader

from .common import CPU, remove, scratch

SAMPLES, MIB, BATCH = 20_000, 8, 256


class _Checkpoint:
    def setup(self, *fsync):
        self.data = make_data(SAMPLES)
        self.ckpt, _reader = make_checkpoint(self.data, MIB, BATCH)
        self.root = scratch("stateful")
        self.pattern = os.path.join(self.root, "ckpt_{seq:06d}.json")
        self.ckpt.collect()
        self.ckpt.save(self.pattern, keep=2, fsync=False)  # what a load reads; the page cache warm

    def teardown(self, *fsync):
        remove(self.root)


class StatefulSave(_Checkpoint):
    """``collect`` + ``save`` of the checkpoint (fsynced and not); each save replaces the oldest (``keep=2``)."""

    params = [False, True]
    param_names = ["fsync"]

    def time_collect_save(self, fsync):
        self.ckpt.collect()
        self.ckpt.save(self.pattern, keep=2, fsync=fsync)


class StatefulLoad(_Checkpoint):
    """``load`` of the newest checkpoint + applying it to a new reader, RNG and arrays."""

    def time_load_apply(self):
        restore_checkpoint(self.pattern, self.data)


class StatefulReader(CPU):
    """One epoch of a shuffling :class:`ArrayReader` with checkpointing on, batches of 256."""

    def setup(self):
        self.reader = ArrayReader(make_data(SAMPLES), shuffle=True, enable_checkpointing=True)

    def time_epoch(self):
        for _ in self.reader.next_epoch(batch_size=BATCH):
            pass
