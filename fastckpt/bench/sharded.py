"""The ``sharded`` suite: sharded saves and loads (ranks as threads) against raw writes and reads of the same bytes.

``python -m fastckpt bench --suite sharded [--ids N] [--dim D] [--dense-mib M] [--ranks 1,2,4]
[--parallel 1,2,4] [--repeat R] [--reshard 4:3,4:2,2:3,1:4] [--reshard-only] [--save-only] [--baseline PATH] [--s3]
[--dir DIR] [--against DIR] [--quick]`` builds the state of a
recommendation model, in one process:

* a :class:`~fastckpt.sharded.HashTable` of ``--ids`` ids (default 8,000,000; unique int64 ids spread over
  the whole range) x ``--dim`` (default 48) float32 values, with Adam slots ``m`` and ``v``, split over the
  ranks by ``id mod ranks`` (one table per rank, as each training rank holds its own ids);
* dense tensors of ``--dense-mib`` MiB in all (default 256): four float32 matrices of 1024 columns,
  replicated on every rank as in data parallel training, each rank saving its rows of them.

It prints the state's total bytes, then measures:

1. **save and load, for every ranks x parallel** (``--ranks`` x ``--parallel``): ``ranks`` ranks as threads
   of this process (:meth:`~fastckpt.sharded.engine.ThreadEngine.group`), each calling
   :meth:`Saver(...).save() <fastckpt.sharded.Saver.save>` with ``parallel`` writer threads, to a new
   directory every run; and every rank's share loaded back, ``ranks`` threads each calling
   :meth:`Loader(..., shard_index=i, shard_num=ranks, dense="rows").load() <fastckpt.sharded.Loader.load>`
   into a new, empty table (``dense="rows"``: each rank reads its rows of the dense tensors, so that the
   ranks together load each byte of the state once), with ``verify=False`` and with the default
   verification (every file hashed against the manifest while the load reads it), beside one BLAKE3 pass
   over the checkpoint's files (target: verified <= 1.3x the unverified load + that pass). The baselines
   move the same bytes with the same number of files and threads (``ranks * parallel``): *raw write +
   fsync* writes, per file, exactly the arrays the saver puts in it (the rank's ids, values, m, v and its
   rows of the dense tensors, spread over the files the way the saver spreads them: largest first onto the
   lightest file) with plain
   ``open(path, "wb").write(memoryview)`` and ``os.fsync``, to new files every run; *raw read* reads files
   of those same bytes back with ``readinto`` into new buffers (``np.empty``, which glibc may serve from memory
   it kept from buffers freed in earlier rounds); *raw read, new pages* reads them into buffers no allocator handed
   out before (:func:`new_pages`: a mapping of their own, as a process's first load finds memory), printed beside
   the load for comparison. Throughput is the state's bytes over the
   wall time of all ranks together; the ratio is fastckpt's throughput over the raw one (target >= 0.85x,
   the load unverified, against the ``np.empty`` raw read).
   The saver does more than the raw write: it orders each table part by key-space slice (a radix sort)
   and gathers its rows into that order a piece at a time as it writes them, hashes every file (BLAKE3, for
   the manifest), writes and fsyncs the JSON files and renames the directory into place, fsyncing it and its
   parent (the raw write fsyncs its files only). ``Saver.save(direct=True)`` runs in the same rounds, shown in
   a table of its own: the same save past the page cache (``O_DIRECT``), which spends less CPU where the disk
   takes direct writes as fast as the kernel's write-back;
   the loader maps the files, gathers each rank's rows and builds its hash index.
2. **resharding** (``--reshard 4:3,4:2,2:3,1:4``): for each pair N:M, one checkpoint saved by N ranks, loaded on
   M ranks (all M shares) against the same checkpoint loaded on N (all N shares); target: at most 1.3x the time.
   ``--baseline PATH`` adds the same pairs saved and loaded by an earlier fastckpt (format version 3 from
   a worktree of 0.3.0 built in place, say) in a worker process, ``--s3`` the same checkpoints loaded from an S3 server on
   loopback whose ranged reads take time in proportion to the range (:mod:`fastckpt.bench.objectserver`), ``--reshard-only`` skips the other cases: :mod:`fastckpt.bench.reshard`.
3. **HashTable.export() and import_()** of the whole table (one rank's table with ``ranks=1``), import into a
   new table: GB/s (target >= 1 GB/s).
4. **peak memory** of one save and one load per ranks x parallel (the runs that write the checkpoint and
   warm the page cache before the timed rounds): the growth of the process's peak resident set (Linux
   ``VmHWM``, reset before each run by writing ``5`` to ``/proc/self/clear_refs``, less ``VmRSS`` before the
   run), divided by the number of ranks, since the ranks are threads of one process. ``VmHWM`` counts the
   pages of the mapped checkpoint files a load touches (page cache, not the process's own memory), so the
   peak of ``RssAnon`` (the process's own memory, sampled every 5 ms) is given beside it. A load's growth
   includes the share it loads (kept until the peak is read), a save's its slice order and piece buffers.

``--against DIR`` (a checkout of an earlier commit, built: a worktree of 0.3.0 built in place, say) runs that fastckpt's
``Saver.save`` and both loads in the same rounds, in a worker process that imports it (:class:`Against`), and
prints them beside this fastckpt's (rows marked ``(before)``): the before and after of a change from one run.

Timed paths run round-robin (:func:`fastckpt.bench.timing.round_robin`): every path once per round in a
shuffled order, ``--repeat`` rounds (medians reported), each run after a garbage collection, an
``os.sync()`` and 0.1 s of idle; the previous run's output is removed untimed (``prepare``). Loads read
files just written (page cache warm, as a restart on the same machine finds them). There is no separate
warm-up round: the save and the load that measure memory, untimed, come first. The GB in GB/s are 10^9
bytes. On a shared machine the figures move with the load: the load average is printed with them.

``--save-only`` runs the save rows alone (raw write + fsync, ``Saver.save``, ``Saver.save(direct=True)`` and with
``--against`` its ``Saver.save``, with their memory): no loads, resharding or HashTable copies.

``--quick`` (20,000 ids x 8, 1 MiB dense, ranks 1,2, parallel 1,2, one round) runs in seconds, for smoke
tests; explicit options override it.

>>> results = measure(ids=2000, dim=4, dense_mib=0.25, ranks=(1, 2), parallel=(1,), repeat=1, reshard=[(2, 1)])
>>> [(c["ranks"], c["parallel"]) for c in results["configs"]]
[(1, 1), (2, 1)]
>>> "| ranks | parallel | files |" in report(results)
True
>>> from fastckpt.cli import main
>>> main(["bench", "--suite", "sharded", "--quick"])  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt.bench.timing import (PeakMemory, add_repeat_option, format_duration, format_ratio, paired_ratio,
                                   round_robin, table_lines)
from fastckpt.formats.hashing import blake3_file
from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.format import rows_of
from fastckpt.sharded.recis import slice_owner  # (--against's worker runs this file on older fastckpts too)

__all__ = ["configure", "options", "run", "measure", "report", "table_ids", "dense_tensors", "rank_state",
           "new_pages", "file_plan", "PeakMemory", "sharded_save", "sharded_load", "directory_bytes"]

TABLE = "emb"
SLOTS = ("m", "v")
DENSE_MATRICES = 4
DENSE_COLUMNS = 1024

RAW_SAVE = "raw write + fsync"
SAVE = "Saver.save"
SAVE_DIRECT = "Saver.save(direct=True)"
RAW_LOAD = "raw read"
RAW_LOAD_NEW = "raw read, new pages"  # beside the target's bound, not instead of it (see _new_pages_table)
LOAD = "Loader.load(verify=False)"
LOAD_VERIFIED = "Loader.load() (verified)"
HASH = "BLAKE3 of the files"
BEFORE = " (before)"  # the suffix of a path run by the fastckpt of --against, in a worker process
EXPORT = "HashTable.export()"
IMPORT = "HashTable.import_() into a new table"

TARGET_SAVE = 0.85  # fastckpt throughput / raw throughput, at least
TARGET_LOAD = 0.85  # unverified
TARGET_VERIFY = 1.3  # verified load time / (unverified load + one BLAKE3 pass of the files), at most
TARGET_RESHARD = 1.3  # N -> M load time / N -> N load time, at most
TARGET_TABLE_GBPS = 1.0  # export and import, at least

DEFAULTS = {"ids": 8_000_000, "dim": 48, "dense_mib": 256.0, "ranks": "1,2,4", "parallel": "1,2,4", "repeat": 3}
QUICK = {"ids": 20_000, "dim": 8, "dense_mib": 1.0, "ranks": "1,2", "parallel": "1,2", "repeat": 1}
TIMEOUT = 600.0  # seconds a rank waits for the others (a failed rank makes the others raise after this)
SETTLE = 0.1


# ------------------------------------------------------------------ the state

def table_ids(n: int) -> np.ndarray:
    """``n`` distinct int64 ids spread over ``[0, 2**63)``, ascending (a multiplicative hash of ``0..n-1``).

    The multiplier is odd, so the ids are distinct, and ``id mod 2**k`` is ``i mod 2**k``: the ranks of a
    power of two get the same number of ids.

    >>> ids = table_ids(1000)
    >>> len(np.unique(ids)), bool((np.diff(ids) > 0).all()), int(ids.min()) >= 0
    (1000, True, True)
    """
    scrambled = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # wraps modulo 2**64
    return np.sort((scrambled & np.uint64((1 << 63) - 1)).astype(np.int64))


def dense_tensors(mib: float) -> dict[str, np.ndarray]:
    """Four float32 matrices of 1024 columns, ``mib`` MiB in all (at least one row each).

    >>> {name: a.shape for name, a in dense_tensors(1).items()}
    {'dense0': (64, 1024), 'dense1': (64, 1024), 'dense2': (64, 1024), 'dense3': (64, 1024)}
    """
    rows = max(1, int(mib * 2**20 / 4 / DENSE_COLUMNS) // DENSE_MATRICES)
    rng = np.random.default_rng(1)
    out = {}
    for k in range(DENSE_MATRICES):
        out[f"dense{k}"] = array = np.empty((rows, DENSE_COLUMNS), np.float32)
        rng.random(out=array, dtype=np.float32)
    return out


class RankState:
    """One rank's table and the arrays it was built from: exactly the arrays its :class:`Saver` writes.

    ``ids`` ascending, ``values`` and ``slots`` (``{"m": ..., "v": ...}``) their rows in that order, as
    :meth:`HashTable.export` returns them; ``table`` the :class:`HashTable` holding them.
    """

    def __init__(self, ids: np.ndarray, values: np.ndarray, slots: dict[str, np.ndarray]):
        self.ids, self.values, self.slots = ids, values, slots
        self.table = HashTable.from_export(ids, values, slots, name=TABLE)

    @property
    def arrays(self) -> list[np.ndarray]:
        return [self.ids, self.values, *self.slots.values()]


def rank_state(ids: np.ndarray, dim: int, rank: int, ranks: int, seed: int = 0, rule: str = "slice") -> RankState:
    """Rank ``rank`` of ``ranks``: the ids of its key-space slices (the owner rule of sharded format version 4, which
    a load of ``ranks`` ranks applies; ``rule="mod"``: ``id mod ranks``, the rule of versions 1-3), random float32
    rows and slots.

    >>> s = rank_state(table_ids(100), 4, 1, 2)
    >>> len(s.table) == len(s.values) == int((slice_owner(table_ids(100), 2) == 1).sum()), sorted(s.slots)
    (True, ['m', 'v'])
    >>> bool((slice_owner(s.ids, 2) == 1).all()), s.values.shape[1]
    (True, 4)
    """
    mine = ids[(np.mod(ids, ranks) if rule == "mod" else slice_owner(ids, ranks)) == rank]
    rng = np.random.default_rng([seed, ranks, rank])
    rows = []
    for _ in range(1 + len(SLOTS)):
        rows.append(np.empty((len(mine), dim), np.float32))
        rng.random(out=rows[-1], dtype=np.float32)
    return RankState(mine, rows[0], dict(zip(SLOTS, rows[1:])))


def _dense_rows(dense: dict[str, np.ndarray], rank: int, ranks: int) -> list[np.ndarray]:
    out = []
    for array in dense.values():
        start, end = rows_of(rank, ranks, array.shape[0])
        out.append(array[start:end])
    return out


def file_plan(arrays: list[np.ndarray], parallel: int) -> list[list[np.ndarray]]:
    """Spread one rank's arrays over ``parallel`` files as the saver does: largest first onto the lightest file.

    >>> [[a.size for a in f] for f in file_plan([np.zeros(5), np.zeros(3), np.zeros(4), np.zeros(1)], 2)]
    [[5, 1], [4, 3]]
    """
    files: list[list[np.ndarray]] = [[] for _ in range(parallel)]
    loads = [0] * parallel
    for array in sorted(arrays, key=lambda a: -a.nbytes):  # sorted() is stable: ties keep their order
        k = loads.index(min(loads))
        files[k].append(array)
        loads[k] += array.nbytes
    return files


# ------------------------------------------------------------------ the paths

def _threads(n: int, fn: Callable[[int], Any]) -> list:
    """``fn(0) .. fn(n-1)``, each in its own thread; the first error is raised once all have returned."""
    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="fastckpt-bench") as pool:
        return list(pool.map(fn, range(n)))


def _write_file(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for array in arrays:
            view = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
            while view:  # a raw write may be short (Linux writes at most 2 GiB - 4 KiB a call)
                view = view[f.write(view):]
        os.fsync(f.fileno())


def raw_save(directory: Path, files: list[list[np.ndarray]]) -> None:
    """Write each file's arrays to ``directory/raw-NNNNN.bin`` and fsync it, one thread per file."""
    directory.mkdir()
    _threads(len(files), lambda k: _write_file(directory / f"raw-{k:05d}.bin", files[k]))


def _read_file(path: Path, new: bool = False) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        out = new_pages(size) if new else np.empty(size, np.uint8)
        view, done = memoryview(out), 0
        while done < len(out):
            got = f.readinto(view[done:])
            if not got:
                raise EOFError(f"{path}: ended after {done} of {len(out)} bytes")
            done += got
    return out


def raw_load(directory: Path, new: bool = False) -> list[np.ndarray]:
    """Read every file of ``directory`` into a new buffer (``np.empty``; ``new=True``: :func:`new_pages`), one thread
    per file."""
    paths = sorted(directory.iterdir())
    return _threads(len(paths), lambda k: _read_file(paths[k], new))


_HUGE_ADVICE = 4 << 20  # numpy advises huge pages for arrays from this size on; the new-pages buffers do the same


def new_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` uint8 of memory no allocator has handed out before: a private anonymous mapping of its own
    (unmapped when the array is collected), advised to use huge pages from 4 MiB on as numpy advises its large
    arrays. What a process's first load finds, where ``np.empty`` may return memory that glibc kept from buffers freed
    earlier (the bench's rounds free the same sizes again and again).

    >>> a = new_pages(5 << 20); a.nbytes, a.flags.writeable, int(a[::4096].max())
    (5242880, True, 0)
    """
    import mmap

    if nbytes == 0:
        return np.empty(0, np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_ADVICE and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, np.uint8)


def sharded_save(path: Path, states: list[RankState], dense: dict[str, np.ndarray], parallel: int,
                 direct: bool = False, **options) -> None:
    """Every rank's :class:`Saver` ``.save()``, the ranks as threads (:meth:`ThreadEngine.group`); ``direct``: past
    the page cache; ``options``: more of the Saver's (``layout="recis"``)."""
    ranks = len(states)
    engines = ThreadEngine.group(ranks)
    asked = {"direct": True} if direct else {}  # (an --against fastckpt before 0.7 has no direct=)
    asked.update(options)

    def save(rank: int) -> str:
        return Saver(shard_index=rank, shard_num=ranks, parallel=parallel, path=str(path),
                     hashtables={TABLE: states[rank].table}, tensors=dense, engine=engines[rank],
                     timeout=TIMEOUT, **asked).save()

    _threads(ranks, save)


def sharded_load(path: Path, ranks: int, dim: int, parallel: int, verify: bool = True,
                 storage_options: dict | None = None) -> list[tuple[dict, dict]]:
    """Every rank's share, the ranks as threads: ``(hashtables, tensors)`` per rank, into new tables."""

    def load(rank: int) -> tuple[dict, dict]:
        tables = {TABLE: HashTable(dim, slots=SLOTS, name=TABLE)}
        return Loader(str(path), hashtables=tables, tensors={}, parallel=parallel, shard_index=rank,
                      shard_num=ranks, dense="rows", verify=verify, storage_options=storage_options).load()

    return _threads(ranks, load)


def hash_files(path: Path) -> list[str]:
    """One BLAKE3 pass over every file of a checkpoint, one file after another, each on every core: what a
    verified load adds at least."""
    return [blake3_file(p)[0] for p in sorted(path.iterdir())]


def _check_loaded(loaded: list[tuple[dict, dict]], states: list[RankState], dense: dict[str, np.ndarray]) -> None:
    """The load gave each rank exactly its ids (the first and last rows compared) and, together, every dense row."""
    for rank, ((tables, tensors), state) in enumerate(zip(loaded, states)):
        table = tables[TABLE]
        if not np.array_equal(table.ids(), state.ids):
            raise AssertionError(f"rank {rank} loaded other ids than it saved")
        ends = state.ids[[0, -1]] if len(state.ids) else state.ids
        if len(ends) and not np.array_equal(table.lookup_slot("v", ends), state.slots["v"][[0, -1]]):
            raise AssertionError(f"rank {rank} loaded other rows than it saved")
        if set(tensors) != set(dense):
            raise AssertionError(f"rank {rank} loaded dense tensors {sorted(tensors)}, not {sorted(dense)}")
    for name, array in dense.items():
        parts = [t[name] for _, t in loaded if len(t[name])]
        rows = sum(len(part) for part in parts)
        if rows != len(array) or not np.array_equal(parts[-1][-1], array[-1]):
            raise AssertionError(f"the ranks loaded {rows} rows of {name!r}, not its {len(array)}")


# ------------------------------------------------------------------ another fastckpt (--against)

class Against:
    """A worker process that imports fastckpt from ``folder`` (a checkout of an earlier commit, built) and runs the
    save and load paths there, one call at a time, so that they join the same round-robin rounds as this fastckpt's.

    The worker is this file run by path, so ``folder`` needs no bench code of its own beyond the helpers it
    calls (``rank_state``, ``sharded_save``, ``sharded_load``: its own fastckpt's Saver and Loader). It builds
    the same ranks' state from the same seeds (the same bytes); its loads read a checkpoint it saved itself (an
    earlier fastckpt reads no newer format version). Messages are JSON lines; each call returns once the worker has finished
    and dropped what it made, as a run timed here does; a save or load answers ``{"seconds", "cpu"}``, its wall time
    and the worker's CPU time (user + system, every thread) measured there.

    >>> import fastckpt
    >>> worker = Against(os.path.dirname(os.path.dirname(fastckpt.__file__)))  # this checkout, say
    >>> worker.where == os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    True
    >>> worker.close()
    """

    def __init__(self, folder: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(folder), env.get("PYTHONPATH")) if p)
        start = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        self.folder = folder
        self._process = subprocess.Popen([sys.executable, "-c", start, os.path.abspath(__file__), "--worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                         cwd=os.path.abspath(folder))
        self.where = self.call("where")

    def call(self, op: str, **args) -> Any:
        """Run ``op`` in the worker (``"where"``: the folder of the fastckpt it imported; ``"state"``, ``"save"``,
        ``"load"``: what :func:`measure`'s rounds ask of it); its answer, or a ``RuntimeError`` with the worker's
        error.

        >>> import fastckpt
        >>> worker = Against(os.path.dirname(os.path.dirname(fastckpt.__file__)))
        >>> worker.call("where") == worker.where
        True
        >>> worker.close()
        """
        self._process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the --against worker ({self.folder}) exited (status {self._process.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the --against worker ({self.folder}): {answer['error']}")
        return answer.get("value")

    def close(self) -> None:
        """End the worker (its input closed, its exit awaited).

        >>> import fastckpt
        >>> worker = Against(os.path.dirname(os.path.dirname(fastckpt.__file__))); worker.close(); worker.close()
        """
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread (microseconds, where ``os.times`` counts
    clock ticks)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker() -> int:
    """The --against worker's loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    import fastckpt

    states: list[RankState] = []
    dense: dict[str, np.ndarray] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "where":
                value = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
            elif op == "state":
                states = []
                gc.collect()
                ids = table_ids(request["ids"])
                states = [rank_state(ids, request["dim"], rank, request["ranks"], rule=request.get("rule", "slice"))
                          for rank in range(request["ranks"])]
                dense = dense_tensors(request["dense_mib"])
                value = None
            elif op in ("save", "load"):
                started, cpu = time.perf_counter(), _cpu_seconds()
                if op == "save":
                    sharded_save(Path(request["path"]), states, dense, request["parallel"])
                else:
                    sharded_load(request["path"], request["ranks"], request["dim"], request["parallel"],
                                 verify=request["verify"], storage_options=request.get("storage_options"))
                    # dropped at once, as a timed run here drops it
                value = {"seconds": time.perf_counter() - started, "cpu": _cpu_seconds() - cpu}
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001 - told to the parent, which raises it
            print(json.dumps({"error": f"{op}: {type(exc).__name__}: {exc}"}), flush=True)
            continue
        print(json.dumps({"value": value}), flush=True)
        gc.collect()  # between the parent's rounds, not in its next timed run
    return 0


# ------------------------------------------------------------------ measuring

def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def directory_bytes(path: Path) -> int:
    """The bytes of the files directly in ``path`` (a checkpoint's files, written flat).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "a").write_bytes(b"abc"); directory_bytes(d)
    3
    """
    return sum(p.stat().st_size for p in path.iterdir())


def _config(root: Path, states: list[RankState], dense: dict[str, np.ndarray], parallel: int, dim: int,
            repeat: int, against: Against | None = None, save_only: bool = False) -> dict[str, Any]:
    """One ranks x parallel: memory of a save and a load, then the paths round-robin (with ``against``, its save and
    loads too, in the same rounds; ``save_only``: the saves alone)."""
    ranks = len(states)
    where = root / f"ranks{ranks}-parallel{parallel}"
    where.mkdir()
    files = [f for rank, s in enumerate(states) for f in file_plan(s.arrays + _dense_rows(dense, rank, ranks),
                                                                     parallel)]
    raw_reference, checkpoint = where / "raw-reference", where / "checkpoint"
    raw_save(raw_reference, files)  # what the raw reads read: the same bytes in the same files, once
    with PeakMemory() as save_peak:
        sharded_save(checkpoint, states, dense, parallel)  # what the loads read
    load_peak = None
    if not save_only:
        with PeakMemory() as load_peak:
            loaded = sharded_load(checkpoint, ranks, dim, parallel)
        _check_loaded(loaded, states, dense)
        del loaded

    counter = itertools.count()
    current = {RAW_SAVE: where / "raw-0", SAVE: where / "save-0", SAVE_DIRECT: where / "direct-0",
               SAVE + BEFORE: where / "before-0"}
    prefixes = {RAW_SAVE: "raw", SAVE: "save", SAVE_DIRECT: "direct", SAVE + BEFORE: "before"}

    def fresh(name: str) -> None:  # untimed: remove the previous run's output, name a new one
        _remove(current[name])
        current[name] = where / f"{prefixes[name]}-{next(counter)}"

    paths = {
        RAW_SAVE: lambda: raw_save(current[RAW_SAVE], files),
        SAVE: lambda: sharded_save(current[SAVE], states, dense, parallel),
        SAVE_DIRECT: lambda: sharded_save(current[SAVE_DIRECT], states, dense, parallel, direct=True),
        RAW_LOAD: lambda: raw_load(raw_reference),
        RAW_LOAD_NEW: lambda: raw_load(raw_reference, new=True),
        LOAD: lambda: sharded_load(checkpoint, ranks, dim, parallel, verify=False),
        LOAD_VERIFIED: lambda: sharded_load(checkpoint, ranks, dim, parallel),
        HASH: lambda: hash_files(checkpoint),
    }
    if save_only:
        paths = {name: paths[name] for name in (RAW_SAVE, SAVE, SAVE_DIRECT)}
    prepare = {RAW_SAVE: lambda: fresh(RAW_SAVE), SAVE: lambda: fresh(SAVE), SAVE_DIRECT: lambda: fresh(SAVE_DIRECT)}
    # On a busy machine the CPU time each run took (this process's, or the worker's for a (before) row) says more
    # than its wall time, and a ratio of two paths' runs in the same round more than a ratio of medians taken over
    # rounds the load changed between: every run's wall and CPU time are kept, in round order.
    cpu: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}

    def here(name: str, run: Callable[[], Any]) -> Callable[[], Any]:
        def counted():
            started, started_cpu = time.perf_counter(), _cpu_seconds()
            try:
                run()  # what it made is dropped before the clocks stop, as round_robin times it
            finally:
                cpu.setdefault(name, []).append(_cpu_seconds() - started_cpu)
                walls.setdefault(name, []).append(time.perf_counter() - started)
        return counted

    for name in list(paths):
        paths[name] = here(name, paths[name])
    if against is not None:
        def in_worker(name: str, op: str, **args) -> None:
            answer = against.call(op, **args)
            cpu.setdefault(name, []).append(answer["cpu"])
            walls.setdefault(name, []).append(answer["seconds"])

        paths[SAVE + BEFORE] = lambda: in_worker(SAVE + BEFORE, "save", path=str(current[SAVE + BEFORE]),
                                                 parallel=parallel)
        # its loads read a checkpoint it saved itself, in its own format (an earlier fastckpt reads no newer one)
        before = where / "before-checkpoint"
        if not save_only:
            against.call("save", path=str(before), parallel=parallel)
        for name, verify in () if save_only else ((LOAD + BEFORE, False), (LOAD_VERIFIED + BEFORE, True)):
            paths[name] = lambda name=name, verify=verify: in_worker(name, "load", path=str(before), ranks=ranks,
                                                                     dim=dim, parallel=parallel, verify=verify)
        prepare[SAVE + BEFORE] = lambda: fresh(SAVE + BEFORE)
    load_before = _load_average(1)
    timings = round_robin(paths, repeat, warmup=0, prepare=prepare, sync=True, settle=SETTLE)
    result = {"ranks": ranks, "parallel": parallel, "files": ranks * parallel, "load": (load_before, _load_average(1)),
              "checkpoint_bytes": directory_bytes(checkpoint), "timings": timings,
              "save_peak": save_peak.growth, "save_anon": save_peak.anon_growth,
              "load_peak": load_peak and load_peak.growth, "load_anon": load_peak and load_peak.anon_growth,
              "hwm_reset": save_peak.reset}
    result["cpu"] = {name: statistics.median(seconds) for name, seconds in cpu.items()}
    result["rounds"] = walls  # each path's wall time per round, in round order (one run of every path a round)
    shutil.rmtree(where)
    return result


def _hashtable(state: RankState, dim: int, repeat: int) -> dict[str, Any]:
    def import_new() -> HashTable:
        table = HashTable(dim, slots=SLOTS, name=TABLE)
        table.import_(state.ids, state.values, state.slots)
        return table

    timings = round_robin({EXPORT: state.table.export, IMPORT: import_new}, repeat, settle=SETTLE,
                          time_release=False)
    return {"bytes": state.table.nbytes, "ids": len(state.table), EXPORT: timings[EXPORT], IMPORT: timings[IMPORT]}


def measure(ids: int = DEFAULTS["ids"], dim: int = DEFAULTS["dim"], dense_mib: float = DEFAULTS["dense_mib"],
            ranks=(1, 2, 4), parallel=(1, 2, 4), repeat: int = DEFAULTS["repeat"], reshard=((4, 3),),
            directory: str | None = None, log: Callable[[str], None] = lambda line: None,
            against: str | None = None, baseline: str | None = None, s3: bool = False,
            reshard_only: bool = False, save_only: bool = False) -> dict[str, Any]:
    """Build the state and time every case (see the module docs); returns what :func:`report` prints.

    The ranks' tables are built for one ranks count at a time (then dropped), that count's configurations
    measured, the resharding pairs (``reshard``: ``[(N, M), ...]``, :mod:`fastckpt.bench.reshard`, with
    ``baseline`` and ``s3``) once every ranks count is done, export and import on the table of one rank
    (``reshard_only``: the resharding alone; ``save_only``: the save paths alone). ``log`` receives a line as each step starts. ``against`` (a folder
    holding another fastckpt, built): its ``Saver.save`` and loads run in the same rounds, in a worker process
    (:class:`Against`), as rows marked ``(before)``.
    """
    ranks, parallel = ([], []) if reshard_only else (list(ranks), list(parallel))
    reshard = [] if save_only else list(reshard)
    all_ids = table_ids(ids)
    dense = dense_tensors(dense_mib)
    dense_bytes = sum(a.nbytes for a in dense.values())
    table_bytes = ids * (8 + dim * 4 * (1 + len(SLOTS)))
    results: dict[str, Any] = {"ids": ids, "dim": dim, "dense_bytes": dense_bytes, "table_bytes": table_bytes,
                               "state_bytes": table_bytes + dense_bytes, "repeat": repeat, "configs": [],
                               "load_before": _load_average()}
    log(f"state: {results['state_bytes']:,} bytes ({results['state_bytes'] / 2**30:.2f} GiB)")
    root = Path(tempfile.mkdtemp(prefix="fastckpt-sharded-bench-", dir=directory))
    worker = None
    try:
        if against is not None:
            worker = Against(against)
            results["against"] = worker.where
            log(f"(before): the fastckpt in {worker.where}, in a worker process")
        for n in list(dict.fromkeys([*ranks, *([] if reshard_only else [1])])):  # each ranks count once
            log(f"building the tables of {n} rank(s)")
            states = [rank_state(all_ids, dim, rank, n) for rank in range(n)]
            if n in ranks:
                if worker is not None:
                    worker.call("state", ids=ids, dim=dim, dense_mib=dense_mib, ranks=n)
                for p in parallel:
                    log(f"ranks {n}, parallel {p}")
                    results["configs"].append(_config(root, states, dense, p, dim, repeat, worker, save_only))
            if n == 1 and not save_only:
                log("HashTable export / import")
                results["hashtable"] = _hashtable(states[0], dim, repeat)
            del states
            gc.collect()
        if reshard:
            from fastckpt.bench import reshard as resharding

            p = max(parallel) if parallel else 4
            results["reshard"] = resharding.measure(
                root, lambda n: [rank_state(all_ids, dim, rank, n) for rank in range(n)], all_ids, dense, reshard,
                dim=dim, parallel=p, repeat=repeat, save=sharded_save, load=sharded_load,
                sizes={"ids": ids, "dim": dim, "dense_mib": dense_mib}, baseline=Against(baseline) if baseline else None,
                s3=s3, log=log, table=TABLE)
            results["reshard_pairs"], results["reshard_parallel"] = reshard, p
    finally:
        if worker is not None:
            worker.close()
        shutil.rmtree(root, ignore_errors=True)
    results["load_after"] = _load_average()
    return results


def _load_average(count: int = 3) -> str:
    """The load average over 1, 5 and 15 minutes (the first ``count`` of them), as the reports print it."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg()[:count])
    except OSError:
        return "n/a"


# ------------------------------------------------------------------ reporting

def _gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _mib(nbytes: float | None) -> str:
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 100 * 2**20 else f"{nbytes / 2**20:.1f} MiB"


def _throughput_table(results: dict, raw: str, ours: str, target: float) -> list[str]:
    nbytes = results["state_bytes"]
    rows = []
    for c in results["configs"]:
        t_raw, t_ours = c["timings"][raw], c["timings"][ours]
        ratio = t_raw.median / t_ours.median
        rounds, cpu = c.get("rounds", {}), c.get("cpu", {})
        paired = paired_ratio(rounds.get(raw, []), rounds.get(ours, []))
        cpu_raw, cpu_ours = cpu.get(raw), cpu.get(ours)
        rows.append([c["ranks"], c["parallel"], c["files"], format_duration(t_raw.median), _gbps(nbytes, t_raw.median),
                     format_duration(t_ours.median), _gbps(nbytes, t_ours.median), format_ratio(ratio),
                     format_ratio(t_raw.best / t_ours.best), "n/a" if paired is None else format_ratio(paired),
                     "n/a" if cpu_raw is None else format_duration(cpu_raw),
                     "n/a" if cpu_ours is None else format_duration(cpu_ours),
                     "n/a" if not cpu_raw or not cpu_ours else format_ratio(cpu_raw / cpu_ours),
                     " / ".join(c.get("load", ("n/a", "n/a"))), _met(ratio >= target)])
    return table_lines(["ranks", "parallel", "files", raw, "GB/s", ours, "GB/s", "ratio", "ratio of bests",
                        "ratio in the same round (median)", f"CPU {raw}", f"CPU {ours}", "CPU ratio",
                        "load average before / after", f">= {target:.2f}x"], rows, "rrrrrrrrrrrrrll")


def _memory_table(results: dict) -> list[str]:
    rows = []
    for c in results["configs"]:
        n, share = c["ranks"], results["state_bytes"] / c["ranks"]
        row = [n, c["parallel"]]
        for peak, anon in ((c["save_peak"], c["save_anon"]), (c["load_peak"], c["load_anon"])):
            per_rank = None if peak is None else peak / n
            row += [_mib(peak), _mib(per_rank), "n/a" if per_rank is None else f"{per_rank / share:.2f}x",
                    _mib(None if anon is None else anon / n)]
        rows.append(row)
    return table_lines(["ranks", "parallel", "save: peak RSS growth", "per rank", "per rank / rank's share",
                        "anon peak per rank", "load: peak RSS growth", "per rank", "per rank / rank's share",
                        "anon peak per rank"], rows, "rrrrrrrrrr")


def _new_pages_table(results: dict) -> list[str]:
    """The unverified load beside both raw reads: into ``np.empty`` buffers (the target's bound) and into new pages
    (:func:`new_pages`), with the CPU time of each; the target stays judged on the first."""
    rows = []
    for c in results["configs"]:
        t, cpu = c["timings"], c.get("cpu", {})
        if RAW_LOAD_NEW not in t:
            continue
        raw, new, load = t[RAW_LOAD].median, t[RAW_LOAD_NEW].median, t[LOAD].median
        rows.append([c["ranks"], c["parallel"], format_duration(raw), format_duration(new), format_duration(load),
                     format_ratio(raw / load), format_ratio(new / load),
                     *(format_duration(cpu[name]) if name in cpu else "-" for name in (RAW_LOAD, RAW_LOAD_NEW, LOAD))])
    return table_lines(["ranks", "parallel", RAW_LOAD, RAW_LOAD_NEW, LOAD, "load / raw read (the target's)",
                        "load / raw read, new pages", "CPU raw read", "CPU raw read, new pages", "CPU load"], rows,
                       "rrrrrrrrrr")


def _verify_table(results: dict) -> list[str]:
    rows = []
    for c in results["configs"]:
        t = c["timings"]
        plain, hashing, verified = t[LOAD].median, t[HASH].median, t[LOAD_VERIFIED].median
        ratio = verified / (plain + hashing)
        rows.append([c["ranks"], c["parallel"], format_duration(plain), format_duration(hashing),
                     format_duration(verified), format_ratio(verified / plain), format_ratio(ratio),
                     _met(ratio <= TARGET_VERIFY)])
    return table_lines(["ranks", "parallel", LOAD, HASH, LOAD_VERIFIED, "verified / unverified",
                        "verified / (unverified + BLAKE3)", f"<= {TARGET_VERIFY:.1f}x"], rows, "rrrrrrrl")


def _before_table(results: dict) -> list[str]:
    """Each path of this fastckpt beside the same path of the fastckpt of ``--against``, from the same rounds: wall
    times, and the median CPU time of the runs (user + system, every thread of the process that ran them)."""
    rows = []
    for c in results["configs"]:
        t, cpu = c["timings"], c["cpu"]
        for raw, ours in ((RAW_SAVE, SAVE), (RAW_LOAD, LOAD), (None, LOAD_VERIFIED)):
            if ours + BEFORE not in t:  # --save-only
                continue
            before, after = t[ours + BEFORE].median, t[ours].median
            vs_raw = ([format_ratio(t[raw].median / before), format_ratio(t[raw].median / after)] if raw else
                      ["-", "-"])
            rows.append([c["ranks"], c["parallel"], ours, format_duration(before), format_duration(after), *vs_raw,
                         format_ratio(before / after), format_duration(cpu[ours + BEFORE]),
                         format_duration(cpu[ours]), format_duration(cpu[raw]) if raw else "-"])
    return table_lines(["ranks", "parallel", "path", "before", "after", "before / raw", "after / raw",
                        "speed-up", "CPU before", "CPU after", "CPU raw"], rows, "rrlrrrrrrrr")


def _summary(results: dict, raw: str, ours: str, target: float, what: str) -> str:
    ratios = [(c["timings"][raw].median / c["timings"][ours].median, c) for c in results["configs"]]
    met = sum(r >= target for r, _ in ratios)
    worst, c = min(ratios, key=lambda x: x[0])
    best, b = max(ratios, key=lambda x: x[0])
    return (f"- {_met(met == len(ratios))}: {what} throughput >= {target:.2f}x the raw one: met in {met} of "
            f"{len(ratios)} (worst {format_ratio(worst)} at ranks {c['ranks']}, parallel {c['parallel']}; best "
            f"{format_ratio(best)} at ranks {b['ranks']}, parallel {b['parallel']})")


def report(results: dict, quick: bool = False) -> str:
    """The results of :func:`measure` as markdown: the state, the tables, then the targets met or missed.

    >>> from fastckpt.bench.timing import Timing
    >>> t = Timing(1.0, 1.0)
    >>> timings = {RAW_SAVE: t, SAVE: Timing(1.25, 1.2), RAW_LOAD: Timing(0.5, 0.5), LOAD: Timing(0.5, 0.4)}
    >>> config = {"ranks": 2, "parallel": 1, "files": 2, "checkpoint_bytes": 2**30 + 4096, "timings": timings,
    ...           "save_peak": 2**29, "save_anon": 2**29, "load_peak": 2**30, "load_anon": 2**29, "hwm_reset": True,
    ...           "rounds": {RAW_SAVE: [1.0, 1.0, 1.0], SAVE: [1.2, 1.25, 1.3]}, "cpu": {RAW_SAVE: 0.5, SAVE: 0.8},
    ...           "load": ("1.50", "2.50")}
    >>> results = {"ids": 1000, "dim": 4, "dense_bytes": 2**29, "table_bytes": 2**29, "state_bytes": 2**30,
    ...            "repeat": 3, "configs": [config], "load_before": "1.00", "load_after": "1.00"}
    >>> text = report(results)
    >>> text.splitlines()[0]
    'Sharded state: 1,073,741,824 bytes (1.00 GiB): a table of 1,000 ids x 4 float32 with Adam m, v (512 MiB) + ...'
    >>> [line for line in text.splitlines() if line.startswith("| 2 | 1 | 2 |")][0]
    '| 2 | 1 | 2 | 1.000 s | 1.07 | 1.250 s | 0.86 | 0.80x | 0.83x | 0.80x | 500.00 ms | 800.00 ms | 0.62x | 1.50 / 2.50 | MISSED |'
    """
    r = results
    state = (f"Sharded state: {r['state_bytes']:,} bytes ({r['state_bytes'] / 2**30:.2f} GiB): a table of "
             f"{r['ids']:,} ids x {r['dim']} float32 with Adam m, v ({_mib(r['table_bytes'])}) + dense "
             f"{_mib(r['dense_bytes'])}")
    how = (f"{os.cpu_count()} CPUs; load average (1, 5, 15 min) {r['load_before']} before, {r['load_after']} "
           f"after. Medians of {r['repeat']} round-robin run(s); GB/s = state bytes / wall time of all ranks "
           "(10^9 bytes); ratio = fastckpt GB/s / raw GB/s (of the medians; the target is judged on it), "
           "ratio of bests: of the shortest runs; ratio in the same round: the median over the rounds of the raw "
           "run's time over fastckpt's in that round; CPU: the median CPU time of a run (user + system, every thread "
           "of the process), a CPU ratio above 1 meaning fastckpt spent less; the load average (1 min) before and "
           "after each configuration's rounds.")
    lines = [state, "", how, ""]
    if r["configs"]:
        c = r["configs"][0]
        disk = (f"A checkpoint's files hold {c['checkpoint_bytes']:,} bytes ({c['ranks']} rank(s), parallel "
                f"{c['parallel']}: payload, safetensors headers and 4096-byte alignment, JSON files): "
                f"{100 * (c['checkpoint_bytes'] / r['state_bytes'] - 1):.2f}% more than the raw files.")
        save = ("### save: ranks as threads, Saver.save() each (new directory every run) vs. the same bytes "
                "written to as many new files by as many threads, fsynced")
        load = ("### load: every rank's share (Loader, dense='rows', into new tables) vs. readinto of files of "
                "the same bytes by as many threads; page cache warm. Both run in this process, so the raw read's "
                "np.empty buffers come from whatever glibc kept of the process's earlier frees: since 0.8.0 the "
                "loads' arrays are mappings of their own (fastckpt.sharded.kept), glibc's arenas no longer hold "
                "their freed memory, and the raw read here pays the faults it did not before. `python -m fastckpt "
                "bench --suite ranks --steady` times each path alone in a process of its own")
        lines += [disk, "", save, "", *_throughput_table(r, RAW_SAVE, SAVE, TARGET_SAVE), ""]
        if SAVE_DIRECT in c["timings"]:
            lines += [("### the same save past the page cache: Saver(direct=True), O_DIRECT (not the default; less "
                       "CPU, and as fast as the disk takes direct writes), in the same rounds"), "",
                      *_throughput_table(r, RAW_SAVE, SAVE_DIRECT, TARGET_SAVE), ""]
        if LOAD in c["timings"]:
            lines += [load, "", *_throughput_table(r, RAW_LOAD, LOAD, TARGET_LOAD), ""]
        if RAW_LOAD_NEW in c["timings"]:
            lines += ["### the raw read into new pages: the same read into buffers no allocator handed out before "
                      "(a mapping of their own each, huge pages advised from 4 MiB as numpy advises), as a process's "
                      "first load finds memory; the raw read above uses np.empty, which may return memory glibc kept "
                      "from the buffers freed in earlier rounds (throughput ratios; the target stays on the first)", "",
                      *_new_pages_table(r), ""]
        if LOAD_VERIFIED in c["timings"]:
            lines += ["### what verification costs: the verified load (the default: every file hashed against the "
                      "manifest while it is read) beside the unverified one and one BLAKE3 pass over the files", "",
                      *_verify_table(r), ""]
        if SAVE + BEFORE in c["timings"]:
            lines += [f"### before and after: the same paths run by the fastckpt in {r.get('against')} (a worker "
                      "process), in the same rounds; x / raw: throughput over the raw path's (the targets' ratio); "
                      "speed-up: before's time / after's; CPU: the median CPU time of a run (user + system, all "
                      "threads), which a busy machine moves less than the wall time", "", *_before_table(r), ""]
    if "reshard" in r:
        from fastckpt.bench import reshard as resharding

        reshard_lines = resharding.report(r["reshard"], r["reshard_pairs"], r["reshard_parallel"])
        lines += [*reshard_lines[: reshard_lines.index("", 2)], ""]
        fetched = resharding.fetch_report([row for row in r["reshard"] if "fetch" in row])
        lines += [*fetched, ""] if fetched else []
    if "hashtable" in r:
        h = r["hashtable"]
        rows = [[name, format_duration(h[name].median), _gbps(h["bytes"], h[name].median)] for name in (EXPORT, IMPORT)]
        lines += [f"### HashTable bulk copies: {h['ids']:,} ids, {_mib(h['bytes'])} (ids, values, m, v)", "",
                  *table_lines(["call", "median", "GB/s"], rows, "lrr"), ""]
    if r["configs"]:
        reset = all(c["hwm_reset"] for c in r["configs"])
        hwm = ("VmHWM reset before the run (/proc/self/clear_refs), less VmRSS before it" if reset else
               "VmHWM after less VmHWM before (it could not be reset: a lower bound)")
        title = ("### peak memory of one save and one load (the ranks are threads of one process: the "
                 "process's growth is divided by the ranks)")
        method = (f"Peak RSS growth: {hwm}; it counts the mapped checkpoint pages a load touches (page cache). "
                  "Anon: the peak of RssAnon (the process's own memory) sampled every 5 ms, less RssAnon before. "
                  "A load's growth includes the share it loaded; a rank's share is the state's bytes / ranks.")
        lines += [title, "", method, "", *_memory_table(r), ""]
    lines += ["### targets", ""]
    if r["configs"]:
        lines.append(_summary(r, RAW_SAVE, SAVE, TARGET_SAVE, "save"))
        if LOAD in r["configs"][0]["timings"]:
            lines.append(_summary(r, RAW_LOAD, LOAD, TARGET_LOAD, "unverified load"))
        if LOAD_VERIFIED in r["configs"][0]["timings"]:
            ratios = [c["timings"][LOAD_VERIFIED].median / (c["timings"][LOAD].median + c["timings"][HASH].median)
                      for c in r["configs"]]
            lines.append(f"- {_met(max(ratios) <= TARGET_VERIFY)}: verified load <= {TARGET_VERIFY}x (unverified "
                         f"load + one BLAKE3 pass): met in {sum(x <= TARGET_VERIFY for x in ratios)} of {len(ratios)} "
                         f"(worst {format_ratio(max(ratios))})")
    if "reshard" in r:
        lines += reshard_lines[reshard_lines.index("", 2) + 1:]
    if "hashtable" in r:
        h = r["hashtable"]
        for name in (EXPORT, IMPORT):
            gbps = h["bytes"] / h[name].median / 1e9
            lines.append(f"- {_met(gbps >= TARGET_TABLE_GBPS)}: {name} >= {TARGET_TABLE_GBPS:g} GB/s: {gbps:.2f} GB/s")
    if quick:
        lines.append("- (--quick sizes: the targets are stated for the full sizes)")
    return "\n".join(lines)


# ------------------------------------------------------------------ the command line

def _counts(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: positive ints, each once, in the order given.

    >>> _counts("4, 2,4")
    [4, 2]
    """
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"expected positive integers separated by commas, got {text!r}")
    return list(dict.fromkeys(values))


def configure(parser) -> None:
    """Add the sharded suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    Sizes left out take the defaults, or with ``--quick`` the quick sizes (:func:`options`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> args = parser.parse_args(["--ids", "2_000_000", "--ranks", "1,4"])
    >>> args.ids, args.ranks, args.dim
    (2000000, '1,4', None)
    """
    parser.add_argument("--ids", type=int, default=None,
                        help=f"ids in the hashtable (default {DEFAULTS['ids']:_}; --quick {QUICK['ids']:_})")
    parser.add_argument("--dim", type=int, default=None,
                        help=f"values per id (default {DEFAULTS['dim']}; --quick {QUICK['dim']})")
    parser.add_argument("--dense-mib", type=float, default=None,
                        help=f"dense tensors in MiB (default {DEFAULTS['dense_mib']:g}; "
                             f"--quick {QUICK['dense_mib']:g})")
    parser.add_argument("--ranks", default=None,
                        help=f"rank counts, comma-separated (default {DEFAULTS['ranks']}; --quick {QUICK['ranks']})")
    parser.add_argument("--parallel", default=None,
                        help=f"writer threads per rank, comma-separated (default {DEFAULTS['parallel']}; "
                             f"--quick {QUICK['parallel']})")
    add_repeat_option(parser, dest="repeat", default=None,
                      help=f"timed rounds; medians are reported (default {DEFAULTS['repeat']}; "
                           f"--quick {QUICK['repeat']})")
    parser.add_argument("--reshard", default=None,
                        help="resharding pairs SAVED:LOADED, comma-separated (default 4:3,4:2,2:3,1:4; --quick 2:3)")
    parser.add_argument("--reshard-only", action="store_true", help="the resharding pairs alone")
    parser.add_argument("--save-only", action="store_true",
                        help="the save rows alone (raw write + fsync, Saver.save, Saver.save(direct=True), --against's "
                             "Saver.save): no loads, resharding or HashTable copies")
    parser.add_argument("--baseline", default=None, metavar="PATH",
                        help="an earlier fastckpt checkout to reshard beside this one (its own checkpoint and loader, "
                             "in a worker process with PYTHONPATH=PATH), e.g. a built checkout of 0.3.0")
    parser.add_argument("--s3", action="store_true",
                        help="also load the resharding checkpoints from S3 on loopback (fastckpt.bench.objectserver: "
                             "ranged reads in time proportional to the range)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for smoke tests)")
    parser.add_argument("--against", default=None,
                        help="a folder holding another fastckpt (a checkout of an earlier commit, built): its "
                             "Saver.save and loads run too, in a worker process, marked (before), in the same rounds")


def options(args) -> dict[str, Any]:
    """The keyword arguments of :func:`measure` that parsed options ask for.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(); configure(parser)
    >>> o = options(parser.parse_args(["--quick", "--ids", "500"]))
    >>> o["ids"], o["dim"], o["ranks"], o["reshard"]
    (500, 8, [1, 2], [(2, 3)])
    """
    base = QUICK if args.quick else DEFAULTS
    pick = {name: base[name] if getattr(args, name) is None else getattr(args, name) for name in base}
    if pick["ids"] < 1 or pick["dim"] < 1 or pick["dense_mib"] <= 0 or pick["repeat"] < 1:
        raise SystemExit("--ids, --dim and --repeat must be at least 1, --dense-mib above 0")
    from fastckpt.bench.reshard import PAIRS, parse_pairs

    reshard = parse_pairs(args.reshard or ("2:3" if args.quick else PAIRS))
    return {"ids": pick["ids"], "dim": pick["dim"], "dense_mib": pick["dense_mib"],
            "ranks": _counts(str(pick["ranks"])), "parallel": _counts(str(pick["parallel"])),
            "repeat": pick["repeat"], "reshard": reshard, "directory": args.dir,
            "against": getattr(args, "against", None), "baseline": getattr(args, "baseline", None),
            "s3": getattr(args, "s3", False), "reshard_only": getattr(args, "reshard_only", False),
            "save_only": getattr(args, "save_only", False)}


def run(args) -> int:
    """Run the sharded suite with parsed options; prints the state's size, the tables and the targets, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "sharded", "--ids", "2_000_000"])  # doctest: +SKIP
    """
    results = measure(**options(args), log=lambda line: print(f"[sharded] {line}", file=sys.stderr, flush=True))
    print(report(results, quick=args.quick))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # the --against worker (Against), run by path with the other fastckpt
        sys.exit(_worker())
    from fastckpt.bench import main

    sys.exit(main(["--suite", "sharded", *sys.argv[1:]]))
