"""The ``memory`` suite: what a large save and a pooled device load cost in memory, and a cold-cache load.

Run ``python -m fastckpt bench --suite memory`` (``--quick`` for 64 MiB instead of 2 GiB). The state is
``--mib`` MiB of float32 in tensors of 64 MiB (fewer, smaller ones with ``--quick``), made before anything
is measured. For each of

* ``fastckpt.save_safetensors`` and ``fastckpt.save_npz`` of the state (atomic, fsynced), and
* ``fastckpt.device.load.load_file(path, queue, pool=pool)`` of the safetensors file through a new pool,

it reports the growth of the process's peak RSS over the call (``VmHWM`` reset first, less ``VmRSS``
before; :class:`fastckpt.bench.timing.PeakMemory`) and of its sampled anonymous memory (``RssAnon``, which
leaves out the file's pages mapped and read: those are page cache, given back under pressure). A load puts
the arrays' bytes in device memory; on a CPU device (pocl) that memory is the process's own, so the load's
figures are shown less the arrays' bytes: what the load costs beyond the tensors it delivers. The target:
at most 64 MiB above the arrays for the save and for the load, read on the anonymous column (the RSS column
also counts the page cache pages of the mapped file that the copy reads).

Then a warm load (page cache full, file open in the pool) beside a cold one, and a cold plain read of the
file into a preallocated buffer (the disk's own pace): before each cold run the pool
forgets the file (a mapped page cannot be dropped) and its pages are dropped with
``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` after an ``os.sync()``.

>>> from fastckpt.bench.timing import Timing
>>> fake = {"nbytes": 2**31, "tensors": 32, "device": "pocl", "rows": [
...     ("save_safetensors", 10 * 2**20, 2**20, False), ("load_file, new pool", 2**32, 2**31 + 2**20, True)],
...     "timings": {"warm": Timing(0.5, 0.4), "cold": Timing(2.0, 1.9)}}
>>> print("\\n".join(report(fake)[2:6]))
| call | peak RSS growth | above the arrays | anon growth | above the arrays |
|---|---:|---:|---:|---:|
| save_safetensors | 10.0 MiB | 10.0 MiB | 1.0 MiB | 1.0 MiB |
| load_file, new pool | 4,096.0 MiB | 2,048.0 MiB | 2,049.0 MiB | 1.0 MiB |
"""

from __future__ import annotations

import gc
import os
import tempfile

import numpy as np

from fastckpt.bench.timing import (PeakMemory, add_repeat_option, format_duration, format_ratio, format_size,
                                  round_robin, table_lines)

__all__ = ["configure", "run", "measure", "report", "state", "TARGET_BYTES"]

TARGET_BYTES = 64 * 2**20
DEFAULT_MIB = 2048
QUICK_MIB = 64
TENSOR_BYTES = 64 * 2**20


def state(mib: float) -> dict[str, np.ndarray]:
    """About ``mib`` MiB of random float32 in tensors of at most 64 MiB, at least 8 of them below 512 MiB (the
    suite's state, and the asv suite's).

    >>> {name: a.nbytes for name, a in state(1).items()}["layer7.weight"]
    131072
    """
    total = int(mib * 2**20)
    per = min(TENSOR_BYTES, max(4, total // 8))
    count = max(1, total // per)
    rng = np.random.default_rng(0)
    return {f"layer{i}.weight": rng.random(per // 4, dtype=np.float32) for i in range(count)}


def _drop_from_page_cache(path: str) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(*, mib: float = DEFAULT_MIB, repeats: int = 3, directory: str | None = None) -> dict:
    """Measure the suite; returns ``{"nbytes", "tensors", "device", "rows": [(call, rss, anon, delivers)],
    "timings": {"warm", "cold"}}`` (``delivers``: the call puts the arrays' bytes in memory)."""
    import fastckpt
    from fastckpt.device import default
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    tensors = state(mib)
    nbytes = sum(a.nbytes for a in tensors.values())
    dev = default()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-memory-", dir=directory) as tmp:
        st_path, npz_path = os.path.join(tmp, "state.safetensors"), os.path.join(tmp, "state.npz")
        for label, save, path in (("save_safetensors (atomic, fsync)", fastckpt.save_safetensors, st_path),
                                  ("save_npz (atomic, fsync)", fastckpt.save_npz, npz_path)):
            with PeakMemory() as peak:
                save(path, tensors)
            rows.append((label, peak.growth, peak.anon_growth, False))
        os.remove(npz_path)
        gc.collect()

        pool = PersistentBufferPool(dev.context, dev.queue)
        with PeakMemory() as peak:
            loaded = load_file(st_path, dev.queue, pool=pool)
            dev.queue.finish()
        rows.append(("load_file, new pool", peak.growth, peak.anon_growth, True))
        del loaded
        gc.collect()

        def load():
            result = load_file(st_path, dev.queue, pool=pool)
            dev.queue.finish()
            return result

        def evict():  # the pool keeps the file mapped (its pages cannot be dropped while mapped): forget it first
            pool.files.clear()
            gc.collect()
            _drop_from_page_cache(st_path)

        def raw_read():  # the disk's own pace: the file read once into a preallocated buffer
            with open(st_path, "rb", buffering=0) as f:
                f.readinto(sink)

        sink = bytearray(os.path.getsize(st_path))
        timings = round_robin({"warm": load, "cold": load, "cold raw read": raw_read}, repeats,
                              prepare={"cold": evict, "cold raw read": evict})
    return {"nbytes": nbytes, "tensors": len(tensors), "device": dev.name, "rows": rows, "timings": timings}


def _size(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def report(result: dict, *, quick: bool = False) -> list[str]:
    """The suite's markdown lines for ``result`` (from :func:`measure`)."""
    nbytes = result["nbytes"]
    lines = [f"Memory: {format_size(nbytes)} of float32 in {result['tensors']} tensors, device {result['device']}; "
             "growth over each call (the arrays exist before it)", ""]
    rows, verdicts = [], []
    for call, rss, anon, delivers in result["rows"]:
        above_rss = None if rss is None else rss - (nbytes if delivers else 0)
        above_anon = None if anon is None else anon - (nbytes if delivers else 0)
        rows.append([call, _size(rss), _size(above_rss), _size(anon), _size(above_anon)])
        if above_anon is not None:
            ok = above_anon <= TARGET_BYTES
            verdicts.append(f"- {'met' if ok else 'MISSED'}: {call}: anonymous memory above the arrays <= "
                            f"{format_size(TARGET_BYTES)}: {_size(above_anon)}")
    lines += table_lines(["call", "peak RSS growth", "above the arrays", "anon growth", "above the arrays"],
                         rows, "lrrrr")
    warm, cold, raw = (result["timings"].get(k) for k in ("warm", "cold", "cold raw read"))
    lines += ["", "load_file(path, queue, pool=pool) with the pool warm: the file's pages in the page cache (warm), "
                  "and dropped from it with posix_fadvise(DONTNEED) before each run (cold)", ""]
    lines += table_lines(["page cache", "median", "best", "GB/s (median)", "vs warm"],
                         [["warm", format_duration(warm.median), format_duration(warm.best),
                           f"{nbytes / warm.median / 1e9:.2f}", "1.00x"],
                          ["cold", format_duration(cold.median), format_duration(cold.best),
                           f"{nbytes / cold.median / 1e9:.2f}", format_ratio(cold.median / warm.median)]]
                         + ([["cold raw read of the file (readinto)", format_duration(raw.median),
                              format_duration(raw.best), f"{nbytes / raw.median / 1e9:.2f}",
                              format_ratio(raw.median / warm.median)]] if raw is not None else []),
                         "lrrrr")
    lines += ["", "### targets", *verdicts]
    if quick:
        lines.append("- (--quick sizes: the targets are stated for 2 GiB)")
    return lines


def configure(parser) -> None:
    """Add the memory suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> args = parser.parse_args(["--quick"]); args.quick, args.mib, args.repeats
    (True, 2048.0, 3)
    """
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MIB} MiB instead of --mib, one round")
    parser.add_argument("--mib", type=float, default=float(DEFAULT_MIB),
                        help=f"size of the state in MiB (default {DEFAULT_MIB})")
    add_repeat_option(parser, dest="repeats", default=3, help="warm and cold loads timed (default 3; --quick: 1)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")


def run(args) -> int:
    """Run the memory suite with parsed options; prints the tables, returns 0."""
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    mib, repeats = (QUICK_MIB, 1) if args.quick else (args.mib, args.repeats)
    print("\n".join(report(measure(mib=mib, repeats=repeats, directory=args.dir), quick=args.quick)))
    return 0
