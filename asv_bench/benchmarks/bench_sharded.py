"""The ``sharded`` suite's headline cases: a sharded save and load with the ranks as threads, and resharding N -> M.

The state is the suite's (:mod:`fastckpt.bench.sharded`): a hash table of
250,000 ids x 32 float32 with Adam slots ``m`` and ``v`` split over the ranks by
``id mod ranks``, and 32 MiB of dense tensors; about 130 MiB in all (the suite's
default is 8,000,000 ids and 256 MiB dense). Saves go to a new directory each
time; loads read a checkpoint written once (page cache warm), every rank's
share into new tables (``dense="rows"``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from fastckpt.bench.sharded import (
    TABLE, dense_tensors, directory_bytes, rank_state, sharded_load, sharded_save, table_ids,
)

from .common import Slow, remove, scratch

IDS, DIM, DENSE_MIB, PARALLEL = 250_000, 32, 32.0, 2


@functools.lru_cache(maxsize=2)
def _states(ranks: int):
    ids = table_ids(IDS)
    return [rank_state(ids, DIM, rank, ranks) for rank in range(ranks)], dense_tensors(DENSE_MIB)


def _state_bytes(states, dense) -> int:
    return sum(a.nbytes for s in states for a in s.arrays) + sum(a.nbytes for a in dense.values())


class ShardedSave(Slow):
    """Every rank's ``Saver.save()`` (parallel 2), the ranks as threads: export, write, BLAKE3, fsync, commit."""

    params = [1, 4]
    param_names = ["ranks"]

    def setup(self, ranks):
        self.states, self.dense = _states(ranks)
        self.root = Path(scratch("sharded-save"))
        self.out = self.root / "ckpt"

    def teardown(self, ranks):
        remove(self.root)

    def time_save(self, ranks):
        sharded_save(self.out, self.states, self.dense, PARALLEL)

    def track_bytes_over_state(self, ranks):
        """The checkpoint's bytes / the state's (payload, safetensors headers, 4096-byte alignment, JSON files)."""
        sharded_save(self.out, self.states, self.dense, PARALLEL)
        return directory_bytes(self.out) / _state_bytes(self.states, self.dense)

    track_bytes_over_state.unit = "ratio"


class ShardedLoad(Slow):
    """Every rank's share of a checkpoint saved by 4 ranks, loaded by ``ranks`` threads: 4 (the same ranks) and 3
    (resharding 4 -> 3: each rank gathers its ids from every file)."""

    params = [4, 3]
    param_names = ["ranks"]

    def setup_cache(self):
        states, dense = _states(4)
        path = Path(os.path.abspath("sharded-ckpt"))
        sharded_save(path, states, dense, PARALLEL)
        return str(path)

    def setup(self, path, ranks):
        sharded_load(Path(path), ranks, DIM, PARALLEL)  # page cache warm

    def time_load(self, path, ranks):
        sharded_load(Path(path), ranks, DIM, PARALLEL)

    def track_ids_loaded(self, path, ranks):
        """The ids all ranks loaded together (every id once: the table's size)."""
        return sum(len(tables[TABLE]) for tables, _tensors in sharded_load(Path(path), ranks, DIM, PARALLEL))

    track_ids_loaded.unit = "ids"
