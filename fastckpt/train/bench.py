"""Benchmark of training checkpoints: sync save against a raw write, async blocking time, verified loads.

``python -m fastckpt.train.bench [--mib 256] [--runs 5] [--dir DIR]`` builds a
training state of about ``--mib`` MiB (a :class:`~fastckpt.train.TinyLM` and
its Adam moments, so weights are a third of it) and, in one process, times
the median of ``--runs`` runs of:

* ``raw write+fsync``: the same array bytes written to one file and fsynced —
  the floor for a durable save;
* ``save_checkpoint``: the full atomic, hashed, fsynced checkpoint directory;
* ``async save, blocking``: how long ``CheckpointManager.save(blocking=False)``
  holds the trainer (the snapshot copy), first call and steady state (reused
  staging buffers), and the time until the background save is durable;
* ``load_checkpoint`` with and without hash verification (warm page cache).

It prints a markdown table with the ratios the design aims at (sync save
within 1.3x of the raw write; async blocking at most 15% of the sync save).
Timings on a shared machine are noisy: quote them with the load they ran under.

>>> rows = run(mib=2, runs=1)
>>> sorted(rows)[:2]
['async_block_first_s', 'async_block_steady_s']
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fastckpt.train.checkpoint import load_checkpoint, save_checkpoint
from fastckpt.train.manager import CheckpointManager
from fastckpt.train.model import TinyLM
from fastckpt.train.optim import Adam


def build_state(mib: float) -> tuple[TinyLM, Adam]:
    """A model + Adam whose arrays total about ``mib`` MiB (weights, m, v: a third each)."""
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


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def run(mib: float = 256, runs: int = 5, directory: str | None = None) -> dict[str, float]:
    """Time every case; returns seconds (medians) and sizes keyed by name."""
    model, opt = build_state(mib)
    arrays = _arrays(model, opt)
    nbytes = sum(a.nbytes for a in arrays)
    root = Path(tempfile.mkdtemp(prefix="fastckpt-train-bench-", dir=directory))
    try:
        raw, sync, blocks, async_total, load_v, load_nv = [], [], [], [], [], []
        for i in range(runs):
            path = root / f"raw-{i}.bin"
            t = time.perf_counter()
            _raw_write(path, arrays)
            raw.append(time.perf_counter() - t)
            path.unlink()

            out = root / f"sync-{i}"
            t = time.perf_counter()
            save_checkpoint(model, opt, None, None, None, out, step=i)
            sync.append(time.perf_counter() - t)

            t = time.perf_counter()
            load_checkpoint(out, verify=True)
            load_v.append(time.perf_counter() - t)
            t = time.perf_counter()
            load_checkpoint(out, verify=False)
            load_nv.append(time.perf_counter() - t)
            shutil.rmtree(out)

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
        "raw_s": _median(raw),
        "sync_s": _median(sync),
        "async_block_first_s": blocks[0],
        "async_block_steady_s": _median(blocks[1:]),
        "async_total_s": _median(async_total[1:]),
        "load_verify_s": _median(load_v),
        "load_noverify_s": _median(load_nv),
    }


def table(r: dict[str, float]) -> str:
    """The results as a markdown table."""
    mib = r["state_bytes"] / 2**20
    rows = [
        ("raw write + fsync (floor)", r["raw_s"], "1.00x raw"),
        ("save_checkpoint (sync)", r["sync_s"], f"{r['sync_s'] / r['raw_s']:.2f}x raw (target <= 1.3x)"),
        ("async save: trainer blocked, first", r["async_block_first_s"],
         f"{100 * r['async_block_first_s'] / r['sync_s']:.0f}% of sync (fresh staging buffers)"),
        ("async save: trainer blocked, steady", r["async_block_steady_s"],
         f"{100 * r['async_block_steady_s'] / r['sync_s']:.0f}% of sync (target <= 15%)"),
        ("async save: until durable", r["async_total_s"], f"{r['async_total_s'] / r['sync_s']:.2f}x sync"),
        ("load_checkpoint(verify=True)", r["load_verify_s"], f"{r['load_verify_s'] / r['load_noverify_s']:.2f}x unverified"),
        ("load_checkpoint(verify=False)", r["load_noverify_s"], ""),
    ]
    lines = [f"Training state: {mib:.1f} MiB (weights + Adam m, v), medians", "",
             "| case | seconds | MiB/s | note |", "|---|---:|---:|---|"]
    for name, sec, note in rows:
        lines.append(f"| {name} | {sec:.3f} | {mib / sec:,.0f} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastckpt.train.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256, help="training state size in MiB (default 256)")
    parser.add_argument("--runs", type=int, default=5, help="runs per case; medians are reported (default 5)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    args = parser.parse_args(argv)
    print(table(run(args.mib, args.runs, args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
