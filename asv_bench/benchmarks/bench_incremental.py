"""The ``incremental`` suite's headline cases: a delta save after 1% of a table's rows were touched, and the restore
of a chain (a full base and 3 deltas) against a full restore.

The table is :func:`fastckpt.bench.incremental.build_table`'s (200,000 ids x
16 float32, Adam ``m`` and ``v``; the suite's default is 8,000,000 x 48), and
:func:`~fastckpt.bench.incremental.touch` changes it between saves as training
does: 1% of the rows updated, 1/20 as many inserted and deleted.
"""

from __future__ import annotations

import atexit
import functools
import os
from pathlib import Path

import numpy as np

from fastckpt.bench.incremental import build_table, touch
from fastckpt.bench.sharded import TABLE, directory_bytes
from fastckpt.sharded import DeltaPolicy, HashTable, Loader, Saver
from fastckpt.sharded.chain import manifest_digest

from .common import Slow, remove, scratch

IDS, DIM, FRACTION, DELTAS, PARALLEL = 200_000, 16, 0.01, 3, 2
POLICY = DeltaPolicy(max_chain=DELTAS, max_fraction=1.0)


def _save(path: Path, table: HashTable) -> str:
    saver = Saver(path=str(path), parallel=PARALLEL, hashtables={TABLE: table}, incremental=POLICY)
    saver.save()
    return saver.kind


@functools.lru_cache(maxsize=1)
def _base():
    """The table saved full (a chain's base) in a directory of this process: the directory, the table's rows
    exported (to rebuild it as saved) and the base's ``(path, manifest digest)``."""
    root = Path(scratch("incremental"))
    atexit.register(remove, root)
    table = build_table(IDS, DIM)
    base = root / "base"
    _save(base, table)
    return root, table.export(), (str(base.absolute()), manifest_digest(base))


class DeltaSave(Slow):
    """A delta save of the table after touching 1% of it (the same rows every sample: the table is rebuilt as the
    base saved it, marked clean against the base, then touched with one seed), and a full save of it."""

    def setup(self):
        self.root, exported, base = _base()
        self.table = HashTable.from_export(*exported, name=TABLE)
        self.table.mark_clean(base)
        touch(self.table, FRACTION, np.random.default_rng(1))
        self.out = self.root / "delta"
        remove(self.out)

    def time_delta_save(self):
        _save(self.out, self.table)

    def time_full_save(self):
        """The same table saved whole (what the delta's time is compared with: the suite's target is 5%)."""
        Saver(path=str(self.out), parallel=PARALLEL, hashtables={TABLE: self.table}).save()

    def track_delta_bytes_over_full(self):
        """The delta's bytes / the full base's (1% touched: about 1%; the suite's target is at most 3%)."""
        if _save(self.out, self.table) != "delta":
            raise RuntimeError("the save after touching 1% of the table was not a delta")
        return directory_bytes(self.out) / directory_bytes(self.root / "base")

    track_delta_bytes_over_full.unit = "ratio"


class ChainRestore(Slow):
    """Restoring the table into a new one: from the head of a chain (the full base, then 3 deltas of 1% touched
    each, applied in turn) and from a full save of the same table."""

    params = ["chain", "full"]
    param_names = ["checkpoint"]

    def setup_cache(self):
        table = build_table(IDS, DIM)
        rng = np.random.default_rng(1)
        root = Path(os.path.abspath("chain"))
        root.mkdir()
        kinds = [_save(root / "link0", table)]
        for k in range(1, DELTAS + 1):
            touch(table, FRACTION, rng)
            kinds.append(_save(root / f"link{k}", table))
        if kinds != ["full"] + ["delta"] * DELTAS:
            raise RuntimeError(f"the chain's saves were {kinds}, not a full save and {DELTAS} deltas")
        full = root / "full"
        Saver(path=str(full), parallel=PARALLEL, hashtables={TABLE: table}).save()
        return {"chain": str(root / f"link{DELTAS}"), "full": str(full)}

    def setup(self, paths, checkpoint):
        self.path = paths[checkpoint]
        self._restore()  # page cache warm

    def _restore(self) -> HashTable:
        return Loader(self.path, hashtables={}, parallel=PARALLEL).load()[0][TABLE]

    def time_restore(self, paths, checkpoint):
        self._restore()

    def track_rows_restored(self, paths, checkpoint):
        """The restored table's ids (the same for both: the chain gives the table back as the full save does)."""
        return len(self._restore())

    track_rows_restored.unit = "ids"
