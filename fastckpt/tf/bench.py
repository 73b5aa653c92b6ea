"""Benchmark: read every tensor of a TensorFlow checkpoint, fastckpt against TensorFlow itself.

Run ``python -m fastckpt.tf.bench`` (``--help`` for sizes). It writes a
checkpoint of ``--tensors`` float32 tensors totalling ``--mib`` MiB (plus one
of an eighth of that size), reads it once to warm the page cache, then times,
in this one process, the median of ``--runs`` full reads:

- fastckpt, checksums verified, zero-copy views (``read_tensor``);
- fastckpt, checksums verified, copies (``read_tensor(copy=True)``, what
  TensorFlow hands out);
- fastckpt, ``verify=False``: zero-copy, so its time does not grow with size;
- TensorFlow: ``tf.train.load_checkpoint`` + ``get_tensor`` for every name
  (it always verifies), when ``tensorflow`` is importable.

Each timing includes opening the checkpoint. It prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from fastckpt.tf.reader import CheckpointReader
from fastckpt.tf.writer import write_checkpoint


def _make(directory: str, name: str, mib: int, tensors: int) -> str:
    prefix = os.path.join(directory, name)
    per = mib * 2**20 // tensors // 4
    rng = np.random.default_rng(0)
    block = rng.standard_normal(per, dtype=np.float32)
    write_checkpoint(prefix, ((f"layer_{i:03d}/kernel", block + np.float32(i)) for i in range(tensors)), fsync=False)
    return prefix


def _fastckpt_read(prefix: str, *, verify: bool, copy: bool) -> int:
    total = 0
    with CheckpointReader(prefix, verify=verify) as reader:
        for name in reader.tensor_names():
            total += reader.read_tensor(name, copy=copy).nbytes
    return total


def _tensorflow_read(tf, prefix: str) -> int:
    reader = tf.train.load_checkpoint(prefix)
    total = 0
    for name in reader.get_variable_to_shape_map():
        total += reader.get_tensor(name).nbytes
    return total


def _median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_benchmark(*, mib: int = 512, tensors: int = 64, runs: int = 5, directory: str | None = None,
                  use_tensorflow: bool = True) -> list:
    """Time the reads; returns ``[(label, size_mib, seconds)]``."""
    tf = None
    if use_tensorflow:
        try:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
            import tensorflow as tf
        except ImportError:
            print("tensorflow is not installed: its row is left out", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="fastckpt-tf-bench-", dir=directory)
    rows = []
    try:
        small_mib = max(1, mib // 8)
        big = _make(work, "big", mib, tensors)
        small = _make(work, "small", small_mib, tensors)
        for prefix in (big, small):
            _fastckpt_read(prefix, verify=True, copy=False)  # page cache warm for everyone
        cases = [
            ("fastckpt, verified, zero-copy", big, mib, lambda: _fastckpt_read(big, verify=True, copy=False)),
            ("fastckpt, verified, copies", big, mib, lambda: _fastckpt_read(big, verify=True, copy=True)),
            ("fastckpt, verify=False (zero-copy)", big, mib, lambda: _fastckpt_read(big, verify=False, copy=False)),
            ("fastckpt, verify=False (zero-copy)", small, small_mib,
             lambda: _fastckpt_read(small, verify=False, copy=False)),
        ]
        if tf is not None:
            cases.append(("TensorFlow load_checkpoint + get_tensor (verifies)", big, mib,
                          lambda: _tensorflow_read(tf, big)))
        for label, _prefix, size, fn in cases:
            rows.append((label, size, _median_seconds(fn, runs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def format_table(rows: list, tensors: int, runs: int) -> str:
    tf_row = next(((size, s) for label, size, s in rows if label.startswith("TensorFlow")), None)
    lines = [f"Reading all {tensors} tensors of a TensorFlow checkpoint (median of {runs} runs, warm page cache)", "",
             "| reader | checkpoint | median time | throughput | vs TensorFlow |", "|---|---:|---:|---:|---:|"]
    for label, size, seconds in rows:
        speedup = f"{tf_row[1] / seconds:.1f}x" if tf_row and tf_row[0] == size else "n/a"
        lines.append(f"| {label} | {size} MiB | {seconds * 1e3:.1f} ms | {size / 1024 / seconds:.2f} GiB/s | "
                     f"{speedup} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastckpt.tf.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB (default 512)")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case; the median is shown (default 5)")
    parser.add_argument("--dir", default=None, help="where to write the temporary checkpoints (default: the temp dir)")
    parser.add_argument("--no-tensorflow", action="store_true", help="skip the TensorFlow row")
    args = parser.parse_args(argv)
    rows = run_benchmark(mib=args.mib, tensors=args.tensors, runs=args.runs, directory=args.dir,
                         use_tensorflow=not args.no_tensorflow)
    print(format_table(rows, args.tensors, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
