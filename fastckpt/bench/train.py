"""The ``train`` suite: sync save of a training checkpoint against a raw write, async blocking time, verified loads.

``python -m fastckpt bench --suite train [--mib 256] [--runs 5] [--quick] [--dir DIR]``
builds a training state of about ``--mib`` MiB (a :class:`~fastckpt.train.TinyLM`
and its Adam moments, so weights are a third of it) and, in one process, times
the median of ``--runs`` runs of:

* ``raw write+fsync``: the same array bytes written to one file and fsynced —
  the floor for a durable save;
* ``save_checkpoint``: the full atomic, hashed, fsynced checkpoint directory;
* ``load_checkpoint`` with and without hash verification (warm page cache),
  the verified load of a BLAKE3 checkpoint (the default) and of one saved
  with ``hash="sha256"``, and the row "verified load vs unverified load":
  what verification adds, as a ratio (target: at most 1.3x);
* ``async save, blocking``: how long ``CheckpointManager.save(blocking=False)``
  holds the trainer (the snapshot copy), first call and steady state (reused
  staging buffers), and the time until the background save is durable.

The raw write, the save and the three loads are timed round-robin
(:func:`fastckpt.bench.timing.round_robin`); every raw write and every save
makes a new file or directory, the previous run's being removed untimed. The
async saves run one after another, as a trainer makes them: the first one
meets fresh staging buffers, and both of its figures (blocked, durable) come
from the same save.

It prints a markdown table with the ratios the design aims at (sync save
within 1.3x of the raw write; async blocking at most 15% of the sync save;
verified load within 1.3x of the unverified one). ``--quick`` is a smoke run
(8 MiB, 3 runs).
Timings on a shared machine are noisy: quote them with the load they ran under.

>>> rows = measure(mib=2, runs=1)
>>> sorted(rows)[:2]
['async_block_first_s', 'async_block_steady_s']
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from fastckpt.bench.timing import add_repeat_option, round_robin, summarize, table_lines
from fastckpt.train.checkpoint import load_checkpoint, save_checkpoint
from fastckpt.train.manager import CheckpointManager
from fastckpt.train.reference.model import TinyLM
from fastckpt.train.reference.optim import Adam

__all__ = ["configure", "run", "measure", "build_state", "table"]

RAW = "raw"
SYNC = "sync"
LOAD_VERIFY = "load_verify"
LOAD_VERIFY_SHA256 = "load_verify_sha256"
LOAD_NO_VERIFY = "load_noverify"
QUICK_MIB, QUICK_RUNS = 8, 3


def build_state(mib: float) -> tuple[TinyLM, Adam]:
    """A model + Adam whose arrays total about ``mib`` MiB (weights, m, v: a third each).

    >>> model, opt = build_state(2)
    >>> opt.t
    1000
    """
    floats = int(mib * 2**20 / 4 / 3)
    dim = 256 if mib < 64 else 640
    hidden = 4 * dim
    vocab = max(16, (floats - 2 * dim * hidden - hidden - dim) // dim)
    model = TinyLM(vocab=vocab, dim=dim, hidden=hidden, seed=0)
    opt = Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(1)
    for buffers in opt.state:
        for arr in buffers.values():
            arr[...] = rng.random(arr.shape, dtype=np.float32)
    opt.t = 1000
    return model, opt


def _arrays(model: TinyLM, opt: Adam) -> list[np.ndarray]:
    return [p.data for p in model.parameters()] + [a for b in opt.state for a in b.values()]


def _raw_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for a in arrays:
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def measure(mib: float = 256, runs: int = 5, directory: str | None = None) -> dict[str, float]:
    """Time every case; returns seconds (medians) and sizes keyed by name."""
    model, opt = build_state(mib)
    arrays = _arrays(model, opt)
    nbytes = sum(a.nbytes for a in arrays)
    root = Path(tempfile.mkdtemp(prefix="fastckpt-train-bench-", dir=directory))
    try:
        steps = itertools.count()
        raw_path, sync_dir, loaded_dir = root / "raw.bin", root / "sync", root / "loaded"
        sha256_dir = root / "loaded-sha256"
        save_checkpoint(model, opt, None, None, None, loaded_dir, step=next(steps))  # what the loads read
        save_checkpoint(model, opt, None, None, None, sha256_dir, step=next(steps), hash="sha256")
        paths = {
            RAW: functools.partial(_raw_write, raw_path, arrays),
            SYNC: lambda: save_checkpoint(model, opt, None, None, None, sync_dir, step=next(steps)),
            LOAD_VERIFY: lambda: load_checkpoint(loaded_dir, verify=True),
            LOAD_VERIFY_SHA256: lambda: load_checkpoint(sha256_dir, verify=True),
            LOAD_NO_VERIFY: lambda: load_checkpoint(loaded_dir, verify=False),
        }
        prepare = {RAW: functools.partial(_remove, raw_path), SYNC: functools.partial(_remove, sync_dir)}
        timings = round_robin(paths, runs, prepare=prepare)

        blocks, async_total = [], []
        mgr = CheckpointManager(root / "managed", max_to_keep=1)
        for i in range(runs + 1):
            t = time.perf_counter()
            handle = mgr.save(i, model, opt, blocking=False)
            blocks.append(time.perf_counter() - t)
            opt.t += 1  # the trainer goes on
            handle.wait()
            async_total.append(time.perf_counter() - t)
        mgr.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "state_bytes": float(nbytes),
        "raw_s": timings[RAW].median,
        "sync_s": timings[SYNC].median,
        "async_block_first_s": blocks[0],
        "async_block_steady_s": summarize(blocks[1:]).median,
        "async_total_s": summarize(async_total[1:]).median,
        "load_verify_s": timings[LOAD_VERIFY].median,
        "load_verify_sha256_s": timings[LOAD_VERIFY_SHA256].median,
        "load_noverify_s": timings[LOAD_NO_VERIFY].median,
    }


def table(r: dict[str, float]) -> str:
    """The results of :func:`measure` as a markdown table.

    >>> r = {"state_bytes": 2**20, "raw_s": 0.01, "sync_s": 0.012, "async_block_first_s": 0.002,
    ...      "async_block_steady_s": 0.001, "async_total_s": 0.02, "load_verify_s": 0.0025,
    ...      "load_verify_sha256_s": 0.004, "load_noverify_s": 0.002}
    >>> lines = table(r).splitlines()
    >>> print(lines[5]); print(lines[-1])
    | save_checkpoint (sync) | 0.012 | 83 | 1.20x raw (target <= 1.3x) |
    | verified load vs unverified load | 0.001 |  | 1.25x (BLAKE3; target <= 1.3x), sha256: 2.00x |
    """
    mib = r["state_bytes"] / 2**20
    rows = [
        ("raw write + fsync (floor)", r["raw_s"], "1.00x raw"),
        ("save_checkpoint (sync)", r["sync_s"], f"{r['sync_s'] / r['raw_s']:.2f}x raw (target <= 1.3x)"),
        ("async save: trainer blocked, first", r["async_block_first_s"],
         f"{100 * r['async_block_first_s'] / r['sync_s']:.0f}% of sync (fresh staging buffers)"),
        ("async save: trainer blocked, steady", r["async_block_steady_s"],
         f"{100 * r['async_block_steady_s'] / r['sync_s']:.0f}% of sync (target <= 15%)"),
        ("async save: until durable", r["async_total_s"], f"{r['async_total_s'] / r['sync_s']:.2f}x sync"),
        ("load_checkpoint(verify=True)", r["load_verify_s"], "BLAKE3 manifest (the default)"),
        ("load_checkpoint(verify=True), sha256", r["load_verify_sha256_s"], 'saved with hash="sha256"'),
        ("load_checkpoint(verify=False)", r["load_noverify_s"], ""),
        # What verification adds: the extra seconds, and the ratio the target speaks of.
        ("verified load vs unverified load", r["load_verify_s"] - r["load_noverify_s"],
         f"{r['load_verify_s'] / r['load_noverify_s']:.2f}x (BLAKE3; target <= 1.3x), "
         f"sha256: {r['load_verify_sha256_s'] / r['load_noverify_s']:.2f}x"),
    ]
    body = [[name, f"{sec:.3f}", "" if name.startswith("verified load vs") else f"{mib / sec:,.0f}", note]
            for name, sec, note in rows]
    lines = [f"Training state: {mib:.1f} MiB (weights + Adam m, v), medians", "",
             *table_lines(["case", "seconds", "MiB/s", "note"], body, "lrrl")]
    return "\n".join(lines)


def configure(parser) -> None:
    """Add the train suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args(["--mib", "2"]).mib
    2.0
    """
    parser.add_argument("--mib", type=float, default=256, help="training state size in MiB (default 256)")
    add_repeat_option(parser, dest="runs", default=5, help="runs per case; medians are reported (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_MIB} MiB, {QUICK_RUNS} runs (overrides --mib and --repeat)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")


def run(args) -> int:
    """Run the train suite with parsed options; prints the markdown table, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "train", "--mib", "2", "--runs", "1"])  # doctest: +SKIP
    """
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    mib, runs = (QUICK_MIB, QUICK_RUNS) if args.quick else (args.mib, args.runs)
    print(table(measure(mib, runs, args.dir)))
    return 0
