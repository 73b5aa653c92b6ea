"""The ``tf`` suite: read every tensor of a TensorFlow checkpoint, fastckpt against TensorFlow itself.

Run ``python -m fastckpt bench --suite tf`` (``--help`` for sizes; ``--quick``: 16 MiB in 16 tensors, 2 runs).
It writes a checkpoint of ``--tensors`` float32 tensors totalling ``--mib`` MiB (plus one
of an eighth of that size), reads it once to warm the page cache, then times,
in this one process, the median of ``--runs`` full reads, the cases taken
round-robin (:func:`fastckpt.bench.timing.round_robin`):

- fastckpt, checksums verified, zero-copy views (``read_tensor``);
- fastckpt, checksums verified, copies (``read_tensor(copy=True)``, what
  TensorFlow hands out);
- fastckpt, ``verify=False``: zero-copy, so its time does not grow with size;
- TensorFlow: ``tf.train.load_checkpoint`` + ``get_tensor`` for every name
  (it always verifies), when ``tensorflow`` is importable (otherwise its row
  is left out, with a note on stderr).

Each timing includes opening the checkpoint. It prints a markdown table.

>>> rows = measure(mib=1, tensors=4, runs=1, use_tensorflow=False)
>>> [label for label, _size, _seconds in rows][:2]
['fastckpt, verified, zero-copy', 'fastckpt, verified, copies']
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np

from fastckpt.bench.timing import add_repeat_option, round_robin, table_lines
from fastckpt.formats.tf.reader import CheckpointReader
from fastckpt.formats.tf.writer import write_checkpoint
from fastckpt.words import plural

__all__ = ["configure", "run", "measure", "format_table", "make_checkpoint", "read_all"]


def make_checkpoint(directory: str, name: str, mib: float, tensors: int) -> str:
    """Write ``directory/name``: a TensorFlow checkpoint of ``tensors`` float32 tensors, ``mib`` MiB in all; returns
    its prefix (also the asv suite's fixture).

    >>> import tempfile
    >>> read_all(make_checkpoint(tempfile.mkdtemp(), "c", 1, 4), verify=True, copy=False)
    1048576
    """
    prefix = os.path.join(directory, name)
    per = int(mib * 2**20) // tensors // 4
    rng = np.random.default_rng(0)
    block = rng.standard_normal(per, dtype=np.float32)
    write_checkpoint(prefix, ((f"layer_{i:03d}/kernel", block + np.float32(i)) for i in range(tensors)), fsync=False)
    return prefix


def read_all(prefix: str, *, verify: bool, copy: bool) -> int:
    """Read every tensor of the checkpoint at ``prefix`` with :class:`CheckpointReader` (CRC32C checked with
    ``verify``, copies with ``copy``); returns the bytes read."""
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


def measure(*, mib: int = 512, tensors: int = 64, runs: int = 5, directory: str | None = None,
            use_tensorflow: bool = True) -> list:
    """Time the reads; returns ``[(label, size_mib, seconds)]``, the seconds being medians."""
    tf = None
    if use_tensorflow:
        try:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
            import tensorflow as tf
        except ImportError:
            print("tensorflow is not installed: its row is left out", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="fastckpt-tf-bench-", dir=directory)
    try:
        small_mib = max(1, mib // 8)
        big = make_checkpoint(work, "big", mib, tensors)
        small = make_checkpoint(work, "small", small_mib, tensors)
        for prefix in (big, small):
            read_all(prefix, verify=True, copy=False)  # page cache warm for everyone
        cases = [
            ("fastckpt, verified, zero-copy", mib, lambda: read_all(big, verify=True, copy=False)),
            ("fastckpt, verified, copies", mib, lambda: read_all(big, verify=True, copy=True)),
            ("fastckpt, verify=False (zero-copy)", mib, lambda: read_all(big, verify=False, copy=False)),
            ("fastckpt, verify=False (zero-copy)", small_mib,
             lambda: read_all(small, verify=False, copy=False)),
        ]
        if tf is not None:
            cases.append(("TensorFlow load_checkpoint + get_tensor (verifies)", mib,
                          lambda: _tensorflow_read(tf, big)))
        # one label is shown for two checkpoint sizes: the case index keeps the timed paths apart
        timings = round_robin({f"{i}: {label}": fn for i, (label, _size, fn) in enumerate(cases)}, runs)
        return [(label, size, timing.median)
                for (label, size, _fn), timing in zip(cases, timings.values())]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_table(rows: list, tensors: int, runs: int) -> str:
    """The rows of :func:`measure` as a markdown table, each read's speed-up over TensorFlow's at the same size.

    >>> print(format_table([("fastckpt", 512, 0.05), ("TensorFlow x", 512, 0.2)], 64, 5))
    Reading all 64 tensors of a TensorFlow checkpoint (median of 5 runs, warm page cache)
    <BLANKLINE>
    | reader | checkpoint | median time | throughput | vs TensorFlow |
    |---|---:|---:|---:|---:|
    | fastckpt | 512 MiB | 50.0 ms | 10.00 GiB/s | 4.0x |
    | TensorFlow x | 512 MiB | 200.0 ms | 2.50 GiB/s | 1.0x |
    """
    tf_row = next(((size, s) for label, size, s in rows if label.startswith("TensorFlow")), None)
    body = []
    for label, size, seconds in rows:
        speedup = f"{tf_row[1] / seconds:.1f}x" if tf_row and tf_row[0] == size else "n/a"
        body.append([label, f"{size} MiB", f"{seconds * 1e3:.1f} ms", f"{size / 1024 / seconds:.2f} GiB/s", speedup])
    lines = [f"Reading all {plural(tensors, 'tensor')} of a TensorFlow checkpoint (median of {plural(runs, 'run')}, "
             "warm page cache)", "",
             *table_lines(["reader", "checkpoint", "median time", "throughput", "vs TensorFlow"], body, "lrrrr")]
    return "\n".join(lines)


DEFAULTS = {"mib": 512, "tensors": 64, "runs": 5}
QUICK = {"mib": 16, "tensors": 16, "runs": 2}


def configure(parser) -> None:
    """Add the tf suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args(["--mib", "8"]).mib
    8
    """
    parser.add_argument("--quick", action="store_true",
                        help="16 MiB in 16 tensors, 2 runs per case (seconds; options given still count)")
    parser.add_argument("--mib", type=int, default=None, help="checkpoint size in MiB (default 512; --quick 16)")
    parser.add_argument("--tensors", type=int, default=None, help="number of tensors (default 64; --quick 16)")
    add_repeat_option(parser, dest="runs", default=None,
                      help="timed runs per case; the median is shown (default 5; --quick 2)")
    parser.add_argument("--dir", default=None, help="where to write the temporary checkpoints (default: the temp dir)")
    parser.add_argument("--no-tensorflow", action="store_true", help="skip the TensorFlow row")


def run(args) -> int:
    """Run the tf suite with parsed options; prints the markdown table, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "tf", "--mib", "1", "--tensors", "4", "--runs", "1"])  # doctest: +SKIP
    """
    sizes = QUICK if args.quick else DEFAULTS
    mib, tensors, runs = (sizes[k] if getattr(args, k) is None else getattr(args, k) for k in ("mib", "tensors", "runs"))
    if runs < 1:
        raise SystemExit("--runs must be at least 1")
    rows = measure(mib=mib, tensors=tensors, runs=runs, directory=args.dir, use_tensorflow=not args.no_tensorflow)
    print(format_table(rows, tensors, runs))
    return 0
