"""The ``incremental`` suite: delta checkpoints of a sparse table against full ones, in bytes and time.

``python -m fastckpt bench --suite incremental [--ids N] [--dim D] [--fractions 0.01,0.1] [--deltas K]
[--repeat R] [--parallel P] [--dir DIR] [--quick]`` builds one rank's state of a recommendation model: a
:class:`~fastckpt.sharded.HashTable` of ``--ids`` ids (default 8,000,000) x ``--dim`` (default 48) float32
values with Adam slots ``m`` and ``v``, and for each fraction ``f`` of ``--fractions``:

1. saves it full (the base of a chain);
2. ``--deltas`` times (default 10), untimed, *touches* the table as training between two saves does:
   updates the values, ``m`` and ``v`` of ``f`` of its rows (random ids), inserts ``f / 20`` of that many new
   ids and deletes as many; then, timed, saves a delta
   (:class:`Saver(..., incremental=DeltaPolicy(max_chain=K, max_fraction=1)) <fastckpt.sharded.Saver>`, one
   link more of the chain) and a full save of the same table to a new directory (removed afterwards). Before
   each timed save: a garbage collection, ``os.sync()`` and 0.1 s of idle. The full save runs after the delta,
   then the table is marked clean against the delta again (``HashTable.mark_clean``), so that the chain goes on;
3. loads, round-robin, ``--repeat`` times each: the head of the chain (its full base and every delta applied,
   :class:`~fastckpt.sharded.Loader`) and the last full save (kept for this) into new tables, and checks that
   both equal the table.

It reports the bytes on disk and the median time of a delta save against a full save (targets: at most 3% of
the bytes and 5% of the time at 1% touched) and the restore of base + K deltas against a full restore
(target: at most 1.5x).

>>> results = measure(ids=5000, dim=4, fractions=(0.01,), deltas=2, repeat=1, parallel=1)
>>> [(r["fraction"], r["deltas"]) for r in results["runs"]]
[(0.01, 2)]
>>> "| 1% |" in report(results)
True
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fastckpt.bench.sharded import SLOTS, TABLE, directory_bytes, table_ids
from fastckpt.bench.timing import add_repeat_option, format_duration, format_ratio, round_robin, summarize, table_lines
from fastckpt.sharded import DeltaPolicy, HashTable, Loader, Saver
from fastckpt.sharded.chain import manifest_digest

__all__ = ["configure", "options", "run", "measure", "report", "build_table", "touch"]

DEFAULTS = {"ids": 8_000_000, "dim": 48, "fractions": "0.01,0.1", "deltas": 10, "repeat": 3, "parallel": 4}
QUICK = {"ids": 20_000, "dim": 8, "fractions": "0.01,0.1", "deltas": 3, "repeat": 1, "parallel": 2}
TARGET_BYTES = 0.03  # delta bytes / full bytes at 1% touched, at most
TARGET_TIME = 0.05  # delta save time / full save time at 1% touched, at most
TARGET_RESTORE = 1.5  # base + K deltas / full restore, at most
SETTLE = 0.1

RESTORE_CHAIN = "restore base + deltas"
RESTORE_FULL = "restore a full checkpoint"


def build_table(ids: int, dim: int, seed: int = 0) -> HashTable:
    """One rank's table: ``ids`` ids (:func:`~fastckpt.bench.sharded.table_ids`) x ``dim`` random float32 values,
    Adam slots ``m`` and ``v`` derived from them (also the asv suite's fixture).

    >>> t = build_table(100, 4); len(t), t.dim
    (100, 4)
    """
    rng = np.random.default_rng(seed)
    keys = table_ids(ids)
    values = rng.random((ids, dim), dtype=np.float32)
    m = values * np.float32(0.1)
    v = values * values
    table = HashTable(dim, slots=SLOTS, name=TABLE)
    table.adopt(keys, values, {"m": m, "v": v})
    return table


def touch(table: HashTable, fraction: float, rng: np.random.Generator) -> int:
    """Update ``fraction`` of the rows (values, m, v), insert and delete ``fraction / 20`` as many; returns rows
    touched.

    >>> t = HashTable(2, slots=SLOTS); t.insert(np.arange(1000), np.zeros((1000, 2)))
    >>> t.mark_clean(None); touch(t, 0.1, np.random.default_rng(0)), len(t)
    (110, 1000)
    """
    held, _, _ = table.rows()
    n = max(1, int(len(held) * fraction))
    updated = rng.choice(held, n, replace=False)
    rows = rng.random((n, table.dim), dtype=np.float32)
    table.update(updated, rows, slots={"m": rows * np.float32(0.1), "v": rows * rows})
    churn = max(1, n // 20)
    fresh = rng.integers(-(2**62), -1, churn)  # negative: never among the table's ids
    table.insert(fresh, rng.random((churn, table.dim), dtype=np.float32))
    table.delete(rng.choice(np.setdiff1d(updated, fresh), churn, replace=False))
    return n + 2 * churn


def _quiet() -> None:
    gc.collect()
    os.sync()
    time.sleep(SETTLE)


def _timed(fn) -> float:
    _quiet()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _chain(root: Path, table: HashTable, fraction: float, deltas: int, parallel: int, seed: int, log) -> dict:
    rng = np.random.default_rng(seed)
    policy = DeltaPolicy(max_chain=deltas, max_fraction=1.0)
    tag = f"{fraction:g}"
    base = root / f"base-{tag}"
    saver = Saver(path=str(base), parallel=parallel, hashtables={TABLE: table}, incremental=policy)
    first_full = _timed(saver.save)
    full_bytes = directory_bytes(base)
    delta_times, full_times, delta_bytes, touched = [], [], [], 0
    head = base
    for k in range(1, deltas + 1):
        touched = touch(table, fraction, rng)
        head = root / f"delta-{tag}-{k}"
        saver = Saver(path=str(head), parallel=parallel, hashtables={TABLE: table}, incremental=policy)
        delta_times.append(_timed(saver.save))
        if saver.kind != "delta":
            raise RuntimeError(f"save {k} of the chain was {saver.kind}, not a delta")
        delta_bytes.append(directory_bytes(head))
        full = root / f"full-{tag}"
        shutil.rmtree(full, ignore_errors=True)
        full_times.append(_timed(Saver(path=str(full), parallel=parallel, hashtables={TABLE: table}).save))
        table.mark_clean((str(head.absolute()), manifest_digest(head)))  # the chain goes on from the delta
        log(f"{tag}: delta {k}: {format_duration(delta_times[-1])} {delta_bytes[-1]:,} bytes; full "
            f"{format_duration(full_times[-1])}")
    return {"fraction": fraction, "deltas": deltas, "touched": touched, "head": head, "full": root / f"full-{tag}",
            "full_bytes": full_bytes, "delta_bytes": delta_bytes, "delta": summarize(delta_times),
            "full_save": summarize(full_times + [first_full])}


def measure(ids: int = DEFAULTS["ids"], dim: int = DEFAULTS["dim"], fractions=(0.01, 0.1),
            deltas: int = DEFAULTS["deltas"], repeat: int = DEFAULTS["repeat"], parallel: int = DEFAULTS["parallel"],
            directory: str | None = None, log=lambda line: None) -> dict[str, Any]:
    """Run the suite (see the module docs); returns the figures :func:`report` prints."""
    results: dict[str, Any] = {"ids": ids, "dim": dim, "repeat": repeat, "parallel": parallel, "runs": []}
    root = Path(tempfile.mkdtemp(prefix="fastckpt-bench-incremental-", dir=directory))
    try:
        for i, fraction in enumerate(fractions):
            table = build_table(ids, dim)
            results["table_bytes"] = table.nbytes
            run = _chain(root, table, fraction, deltas, parallel, seed=1 + i, log=log)

            def restore(path: Path):
                loaded = Loader(str(path), hashtables={}, parallel=parallel).load()[0][TABLE]
                return loaded

            for path in (run["head"], run["full"]):  # the loads give the table back, bit for bit
                if restore(path) != table:
                    raise AssertionError(f"{path}: the restored table differs from the saved one")
            timings = round_robin({RESTORE_CHAIN: lambda: restore(run["head"]),
                                   RESTORE_FULL: lambda: restore(run["full"])}, repeat, warmup=0, sync=True,
                                  settle=SETTLE)
            run.update(restore_chain=timings[RESTORE_CHAIN], restore_full=timings[RESTORE_FULL])
            del run["head"], run["full"], table
            results["runs"].append(run)
            shutil.rmtree(root)
            root.mkdir()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def report(results: dict, quick: bool = False) -> str:
    """The results of :func:`measure` as markdown tables, then the targets met or missed."""
    r = results
    lines = [f"Incremental checkpoints: a table of {r['ids']:,} ids x {r['dim']} float32 with Adam m, v "
             f"({r['table_bytes'] / 2**30:.2f} GiB), one rank, parallel {r['parallel']}; {os.cpu_count()} CPUs. "
             "Touched between saves: that fraction of the rows updated (values, m, v), 1/20 as many inserted "
             "and deleted. Save times: medians over the deltas of the chain (full saves: the same table saved "
             f"whole after each delta); restores: medians of {r['repeat']} round-robin run(s), into new tables.", ""]
    rows = []
    for run in r["runs"]:
        delta_bytes = float(np.median(run["delta_bytes"]))
        rows.append([f"{100 * run['fraction']:g}%", f"{run['full_bytes']:,}", f"{int(delta_bytes):,}",
                     _pct(delta_bytes / run["full_bytes"]), format_duration(run["full_save"].median),
                     format_duration(run["delta"].median), _pct(run["delta"].median / run["full_save"].median),
                     f"{run['deltas']}", format_duration(run["restore_full"].median),
                     format_duration(run["restore_chain"].median),
                     format_ratio(run["restore_chain"].median / run["restore_full"].median)])
    lines += table_lines(["touched", "full bytes", "delta bytes", "delta/full bytes", "full save", "delta save",
                          "delta/full time", "deltas", "full restore", "base + deltas restore", "ratio"],
                         rows, "lrrrrrrrrrr")
    lines += ["", "### targets", ""]
    for run in r["runs"]:
        share = float(np.median(run["delta_bytes"])) / run["full_bytes"]
        time_share = run["delta"].median / run["full_save"].median
        restore = run["restore_chain"].median / run["restore_full"].median
        tag = f"{100 * run['fraction']:g}% touched"
        if run["fraction"] <= 0.01:
            lines.append(f"- {'met' if share <= TARGET_BYTES else 'MISSED'}: {tag}, delta bytes <= "
                         f"{_pct(TARGET_BYTES)} of a full save's: {_pct(share)}")
            lines.append(f"- {'met' if time_share <= TARGET_TIME else 'MISSED'}: {tag}, delta save time <= "
                         f"{_pct(TARGET_TIME)} of a full save's: {_pct(time_share)}")
        lines.append(f"- {'met' if restore <= TARGET_RESTORE else 'MISSED'}: {tag}, restore of base + "
                     f"{run['deltas']} deltas <= {TARGET_RESTORE}x a full restore: {format_ratio(restore)}")
    if quick:
        lines.append("- (--quick sizes: the targets are stated for the full sizes)")
    return "\n".join(lines)


def configure(parser) -> None:
    """Add the incremental suite's options to ``parser``.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(); configure(parser)
    >>> options(parser.parse_args(["--quick", "--deltas", "2"]))["deltas"]
    2
    """
    for name, kind in (("ids", int), ("dim", int), ("fractions", str), ("deltas", int), ("parallel", int)):
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help=f"default {DEFAULTS[name]}; --quick {QUICK[name]}")
    add_repeat_option(parser, dest="repeat", default=None,
                      help=f"timed restores of each kind; default {DEFAULTS['repeat']}; --quick {QUICK['repeat']}")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for smoke tests)")


def options(args) -> dict[str, Any]:
    """The keyword arguments of :func:`measure` that parsed options ask for."""
    base = QUICK if args.quick else DEFAULTS
    pick = {name: base[name] if getattr(args, name) is None else getattr(args, name) for name in base}
    try:
        fractions = tuple(float(f) for f in str(pick["fractions"]).split(",") if f.strip())
    except ValueError:
        raise SystemExit(f"--fractions takes numbers separated by commas, got {pick['fractions']!r}") from None
    if not fractions or not all(0 < f <= 0.5 for f in fractions):
        raise SystemExit(f"--fractions must be in (0, 0.5], got {pick['fractions']!r}")
    if min(pick["ids"], pick["dim"], pick["deltas"], pick["repeat"], pick["parallel"]) < 1:
        raise SystemExit("--ids, --dim, --deltas, --repeat and --parallel must be at least 1")
    return {"ids": pick["ids"], "dim": pick["dim"], "fractions": fractions, "deltas": pick["deltas"],
            "repeat": pick["repeat"], "parallel": pick["parallel"], "directory": args.dir}


def run(args) -> int:
    """Run the suite with parsed options; prints the tables and the targets, returns 0."""
    results = measure(**options(args), log=lambda line: print(f"[incremental] {line}", file=sys.stderr, flush=True))
    print(report(results, quick=args.quick))
    return 0
