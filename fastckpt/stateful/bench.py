"""Benchmark of the stateful layer: reader throughput, state capture, checkpoint save/load.

Run ``python -m fastckpt.stateful.bench`` (``--quick`` for a smaller run). It
prints one line per case: what was measured and the best of a few repeats.
Timed tests are not used; numbers from a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from fastckpt.stateful import RNG, ArrayReader, Checkpoint

__all__ = ["run", "main"]


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(*, quick: bool = False, repeats: int = 3) -> dict[str, tuple[float, str]]:
    """Measure every case; returns ``{case: (seconds, unit-rate text)}``.

    >>> "reader sync" in run(quick=True, repeats=1)
    True
    """
    samples = 5_000 if quick else 200_000
    data = {"x": np.arange(samples * 16, dtype=np.float32).reshape(samples, 16), "y": np.arange(samples)}
    rows: dict[str, tuple[float, str]] = {}
    batch = 256
    batches = -(-samples // batch)
    for label, options in [
        ("reader sync", dict(shuffle=True)),
        ("reader sync+checkpointing", dict(shuffle=True, enable_checkpointing=True)),
        ("reader prefetch=4+checkpointing", dict(shuffle=True, enable_checkpointing=True, prefetch_queue_depth=4)),
    ]:
        reader = ArrayReader(data, **options)

        def epoch(reader=reader):
            for _ in reader.next_epoch(batch_size=batch):
                pass

        seconds = _best(epoch, repeats)
        rows[label] = (seconds, f"{batches / seconds:,.0f} batches/s of {batch}")

    reader = ArrayReader(data, enable_checkpointing=True)
    next(reader.next_epoch(batch_size=batch))
    n = 200 if quick else 2000
    seconds = _best(lambda: [reader.get_state() for _ in range(n)], repeats)
    rows["reader get_state"] = (seconds / n, f"{seconds / n * 1e6:.1f} us per call")

    rng = RNG(seed=0, bit_generator="MT19937")
    seconds = _best(lambda: [str(rng.get_state()) for _ in range(n)], repeats)
    rows["MT19937 get_state+str"] = (seconds / n, f"{seconds / n * 1e6:.1f} us per call")

    class Params:
        def __init__(self):
            self.w = np.ones((1 if quick else 8) * 2**18, dtype=np.float32)  # 1 MiB or 8 MiB

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, state):
            self.w = state["w"]

    params = Params()
    with tempfile.TemporaryDirectory() as tmp:
        pattern = str(Path(tmp) / "ckpt_{seq:06d}.json")
        ckpt = Checkpoint()
        ckpt.register(reader, "reader")
        ckpt.register(rng, "rng")
        ckpt.register(params, "params")
        mib = params.w.nbytes / 2**20

        def save(fsync):
            ckpt.collect()
            ckpt.save(pattern, keep=2, fsync=fsync)

        for fsync in (True, False):
            seconds = _best(lambda: save(fsync), repeats)
            rows[f"checkpoint collect+save fsync={fsync}"] = (seconds, f"{mib:.0f} MiB array state: {seconds * 1e3:.1f} ms")

        def load():
            other = Checkpoint()
            other.load(pattern)
            fresh = ArrayReader(data)
            other.register(fresh, "reader")
            other.register(RNG(bit_generator="MT19937"), "rng")
            other.register(Params(), "params")

        seconds = _best(load, repeats)
        rows["checkpoint load+apply"] = (seconds, f"{mib:.0f} MiB array state: {seconds * 1e3:.1f} ms")
    return rows


def main(argv=None) -> int:
    """Command-line entry: print the benchmark table.

    >>> main(["--quick", "--repeats", "1"])  # doctest: +ELLIPSIS
    reader sync ...
    0
    """
    parser = argparse.ArgumentParser(prog="python -m fastckpt.stateful.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data (seconds instead of tens of seconds)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    args = parser.parse_args(argv)
    for label, (_seconds, text) in run(quick=args.quick, repeats=args.repeats).items():
        print(f"{label:40s} {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
