"""The ``stateful`` suite: reader throughput, state capture, checkpoint save/load of :mod:`fastckpt.stateful`.

Run ``python -m fastckpt bench --suite stateful`` (``--quick`` for a smaller
run). It measures an epoch of :class:`~fastckpt.stateful.ArrayReader` (plain,
with checkpointing, with a prefetch queue), ``get_state`` of a reader and of an
MT19937 :class:`~fastckpt.stateful.RNG`, a :class:`~fastckpt.stateful.Checkpoint`
collect + save (with and without fsync) and a load + apply, and prints one
line per case: what was measured and the best of ``--repeats`` runs, the cases
taken round-robin (:func:`fastckpt.bench.timing.round_robin`).
Timed tests are not used; numbers from a shared machine are noisy.

>>> "reader sync" in measure(quick=True, repeats=1)
True
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np

from fastckpt.bench.timing import add_repeat_option, round_robin
from fastckpt.stateful import RNG, ArrayReader, Checkpoint

__all__ = ["configure", "run", "measure", "make_data", "ArrayState", "make_checkpoint", "restore_checkpoint"]


def make_data(samples: int) -> dict[str, np.ndarray]:
    """The suite's data set: ``x`` (``samples`` x 16 float32) and ``y`` (``samples`` ints).

    >>> {k: v.shape for k, v in make_data(10).items()}
    {'x': (10, 16), 'y': (10,)}
    """
    return {"x": np.arange(samples * 16, dtype=np.float32).reshape(samples, 16), "y": np.arange(samples)}


class ArrayState:
    """A stateful object of one float32 array of ``mib`` MiB (a model's parameters, as a checkpoint sees them).

    >>> ArrayState(1).state_dict()["w"].nbytes
    1048576
    """

    def __init__(self, mib: int = 1):
        self.w = np.ones(mib * 2**18, dtype=np.float32)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        self.w = state["w"]


def make_checkpoint(data: dict[str, np.ndarray], mib: int, batch: int = 256) -> tuple[Checkpoint, ArrayReader]:
    """A :class:`Checkpoint` of a reader of ``data`` one batch into its epoch, an MT19937 :class:`RNG` and an
    :class:`ArrayState` of ``mib`` MiB (registered as ``reader``, ``rng``, ``params``); returns it and the reader.

    >>> ckpt, reader = make_checkpoint(make_data(1000), 1)
    >>> reader.get_state() is not None
    True
    """
    reader = ArrayReader(data, enable_checkpointing=True)
    next(reader.next_epoch(batch_size=batch))
    ckpt = Checkpoint()
    ckpt.register(reader, "reader")
    ckpt.register(RNG(seed=0, bit_generator="MT19937"), "rng")
    ckpt.register(ArrayState(mib), "params")
    return ckpt, reader


def restore_checkpoint(pattern: str, data: dict[str, np.ndarray]) -> Checkpoint:
    """Load the newest checkpoint saved with ``pattern`` and apply it to a new reader of ``data``, a new
    :class:`RNG` and a new :class:`ArrayState`; returns the loaded :class:`Checkpoint`."""
    other = Checkpoint()
    other.load(pattern)
    other.register(ArrayReader(data), "reader")
    other.register(RNG(bit_generator="MT19937"), "rng")
    other.register(ArrayState(), "params")
    return other


def measure(*, quick: bool = False, repeats: int = 3) -> dict[str, tuple[float, str]]:
    """Measure every case; returns ``{case: (seconds, unit-rate text)}`` from each case's best run."""
    samples = 5_000 if quick else 200_000
    data = make_data(samples)
    batch = 256
    batches = -(-samples // batch)
    n = 200 if quick else 2000
    paths = {}
    for label, options in [
        ("reader sync", dict(shuffle=True)),
        ("reader sync+checkpointing", dict(shuffle=True, enable_checkpointing=True)),
        ("reader prefetch=4+checkpointing", dict(shuffle=True, enable_checkpointing=True, prefetch_queue_depth=4)),
    ]:
        epoch_reader = ArrayReader(data, **options)

        def epoch(reader=epoch_reader):
            for _ in reader.next_epoch(batch_size=batch):
                pass

        paths[label] = epoch

    mib = 1 if quick else 8
    ckpt, reader = make_checkpoint(data, mib, batch)
    paths["reader get_state"] = lambda: [reader.get_state() for _ in range(n)]

    rng = RNG(seed=0, bit_generator="MT19937")
    paths["MT19937 get_state+str"] = lambda: [str(rng.get_state()) for _ in range(n)]

    with tempfile.TemporaryDirectory() as tmp:
        pattern = str(Path(tmp) / "ckpt_{seq:06d}.json")

        def save(fsync):
            ckpt.collect()
            ckpt.save(pattern, keep=2, fsync=fsync)

        for fsync in (True, False):
            paths[f"checkpoint collect+save fsync={fsync}"] = functools.partial(save, fsync)

        def load():
            restore_checkpoint(pattern, data)

        paths["checkpoint load+apply"] = load  # the warm-up round saves before any load: a checkpoint exists
        best = {label: timing.best for label, timing in round_robin(paths, repeats).items()}

    rows: dict[str, tuple[float, str]] = {}
    for label in ("reader sync", "reader sync+checkpointing", "reader prefetch=4+checkpointing"):
        rows[label] = (best[label], f"{batches / best[label]:,.0f} batches/s of {batch}")
    for label in ("reader get_state", "MT19937 get_state+str"):
        per_call = best[label] / n
        rows[label] = (per_call, f"{per_call * 1e6:.1f} us per call")
    for label in ("checkpoint collect+save fsync=True", "checkpoint collect+save fsync=False",
                  "checkpoint load+apply"):
        rows[label] = (best[label], f"{mib:.0f} MiB array state: {best[label] * 1e3:.1f} ms")
    return rows


def configure(parser) -> None:
    """Add the stateful suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args(["--quick"]).repeats
    3
    """
    parser.add_argument("--quick", action="store_true", help="smaller data (seconds instead of tens of seconds)")
    add_repeat_option(parser, dest="repeats", default=3, help="best of this many runs (default 3)")


def run(args) -> int:
    """Run the stateful suite with parsed options; prints one line per case, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "stateful", "--quick", "--repeats", "1"])  # doctest: +ELLIPSIS
    reader sync ...
    0
    """
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    for label, (_seconds, text) in measure(quick=args.quick, repeats=args.repeats).items():
        print(f"{label:40s} {text}")
    return 0
