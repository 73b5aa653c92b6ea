"""The ``device`` suite: file-to-device load times against the usual ways, in one process.

``python -m fastckpt bench [--suite device]`` builds its fixtures in a
temporary directory, then loads the same files (page cache warm) by every path
and prints median times and ratios as markdown tables, for

* (a) 512 MiB in 64 float32 tensors, and (b) 1000 float32 tensors of 4 KiB
  (``--quick``: 16 MiB in 64 tensors and 200 tensors of 4 KiB);
* paths: the bound (on a discrete device one pinned buffer copied to the device, the pageable
  per-tensor copy beside it), fastckpt through a warm :class:`~fastckpt.device.pool.PersistentBufferPool`
  (``load_file(path)``, the pool keeping the file open between loads; and a
  fresh ``fastckpt.open`` + ``load_file`` each time), fastckpt zero-copy
  (where the device shares host memory), fastckpt without a pool; the bound
  (``enqueue_copy`` from in-RAM numpy arrays into buffers already allocated);
  ``safetensors.safe_open(framework="numpy")`` + ``enqueue_copy`` per tensor
  into buffers already allocated; ``np.load`` + a new ``cl.Buffer`` per tensor;
* (d, only with ``--case d``) 4 GiB in 64 float32 tensors of 64 MiB (``--quick``: 64 MiB in 16 of
  4 MiB), against the bound measured here, on this device: one pinned (``ALLOC_HOST_PTR``,
  mapped) buffer copied to device buffers in 256 MiB commands, with pageable RAM beside it; the
  fastckpt loads (warm pool, new pool, no pool, unstaged or, on a device sharing host memory,
  staging forced), each read back and compared; and, where torch with CUDA imports,
  ``safetensors.torch.load_file(device="cuda")`` and torch's pinned copy;
* (c) 100,000 float32 tensors of 16 B (``--quick``: 20,000), where the index,
  not the bytes, is the cost: the index alone (``fastckpt.open`` + ``hosts()``),
  the first pooled load (a new pool each time: the file opened and its arena
  allocated), the warm pooled load, and one ``enqueue_copy`` of the file's data
  region from the mapping; the target is a first load within twice the index
  time plus that one copy.

Paths are timed round-robin (:func:`fastckpt.bench.timing.round_robin`: one
run of each per round in the same order, ``--repeat`` rounds, each run after a
collection and 5 ms of idle) so that changes in machine load hit them alike.
Per-tensor baselines enqueue non-blocking copies and wait once at the end
(the fastest way to issue them); the row marked "blocking" is the common
``is_blocking=True`` loop. After the tables it reports the pool's misses over
the repeated loads (0 means nothing was allocated), the device bytes the pool
allocated, and whether each target was met.

>>> from fastckpt.cli import main
>>> main(["bench", "--quick", "--repeat", "1", "--case", "b"])  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from typing import Callable

import numpy as np

from fastckpt.bench.formats import random_tensors, save_as
from fastckpt.bench.timing import add_repeat_option, format_duration, format_size, round_robin, table_lines

__all__ = ["configure", "run", "bench_case", "bench_many_case"]

CASES = {"a": ("512 MiB in 64 float32 tensors", 64, 2**21), "b": ("1000 float32 tensors of 4 KiB", 1000, 1024),
         "c": ("100,000 float32 tensors of 16 B", 100_000, 4),
         "d": ("4 GiB in 64 float32 tensors of 64 MiB", 64, 2**24)}
QUICK = {"a": ("16 MiB in 64 float32 tensors", 64, 2**16), "b": ("200 float32 tensors of 4 KiB", 200, 1024),
         "c": ("20,000 float32 tensors of 16 B", 20_000, 4),
         "d": ("64 MiB in 16 float32 tensors of 4 MiB", 16, 2**20)}
MANY = "c"  # the case timed by bench_many_case
LARGE = "d"  # the case timed by bench_large_case, run only when asked for (--case d)
DEFAULT_CASES = ("a", "b", "c")
BOUND_CHUNK = 256 * 1024 * 1024  # the bound's commands: large enough that a command's own cost vanishes

SETTLE = 0.005  # seconds of idle before each timed run (see round_robin)
NPLOAD_RUNS = 3  # np.load + new buffers is slow: three runs are enough

POOLED = "fastckpt: load_file(path), warm pool (file kept open by the pool)"
POOLED_TOUCH = "fastckpt: load_file(path), warm pool, then every Tensor view made"
POOLED_FRESH = "fastckpt: fastckpt.open + load_file, warm pool (fresh mapping)"
ZERO_COPY = "fastckpt: open + load, zero-copy"
UNPOOLED = "fastckpt: open + load, no pool (a buffer per tensor)"
BOUND = "bound: enqueue_copy per tensor from RAM into allocated buffers"
BOUND_ONE = "one enqueue_copy of all bytes from RAM into one buffer"
SAFETENSORS = "safetensors safe_open + enqueue_copy per tensor"
SAFETENSORS_BLOCKING = "safetensors safe_open + blocking enqueue_copy per tensor"
NPLOAD = "np.load + a new cl.Buffer per tensor"
OPEN_ONLY = "fastckpt.open alone (parse the index)"
INDEX = "index: fastckpt.open + hosts()"
MANY_FIRST = "fastckpt: load_file(path, pool=a new pool), first load"
MANY_WARM = "fastckpt: load_file(path, pool=pool), warm pool (file kept open)"
REGION_COPY = "one enqueue_copy of the data region from the mapping"
PINNED_BOUND = "bound: a pinned (ALLOC_HOST_PTR) buffer -> device, 256 MiB commands"
PAGEABLE = "pageable RAM (numpy) -> device, 256 MiB commands"
LARGE_WARM = "fastckpt: load_file(path, pool=pool), warm pool"
LARGE_STAGED = "fastckpt: load_file(path, pool=pool, staging=True), warm pool"
LARGE_UNSTAGED = "fastckpt: load_file(path, pool=pool, staging=False), warm pool"
LARGE_NEW = "fastckpt: load_file(path, pool=a new pool)"
LARGE_NOPOOL = "fastckpt: load_file(path), no pool"
TORCH_ST = "torch: safetensors.torch.load_file(path, device='cuda')"
TORCH_PINNED = "torch: pinned -> cuda, 256 MiB copies"


def _table(title: str, rows: list[tuple[str, float]], nbytes: int, base: str) -> str:
    ref = dict(rows)[base]
    body = [[label, format_duration(t), f"{nbytes / t / 1e9:.1f}" if t > 0 else "-", f"{t / ref:.2f}x"]
            for label, t in rows]
    return "\n".join([f"### {title}", "", *table_lines(["path", "median", "GB/s", "vs. bound"], body, "lrrr")])


def _fixtures(tmp: str, key: str, n: int, elems: int, fmt: str) -> tuple[dict, str, str, str]:
    import fastckpt

    tensors = random_tensors(n, elems)
    main_path = os.path.join(tmp, f"{key}.{fmt}")
    save_as(main_path, fmt, tensors)
    st_path = main_path if fmt == "safetensors" else os.path.join(tmp, f"{key}.safetensors")
    if st_path != main_path:
        fastckpt.save_safetensors(st_path, tensors, fsync=False)
    np_path = os.path.join(tmp, f"{key}.np.npz")
    np.savez(np_path, **tensors)
    return tensors, main_path, st_path, np_path


def bench_case(key: str, label: str, n: int, elems: int, fmt: str, tmp: str, repeat: int, dev) -> tuple[str, dict]:
    """Time every path on one fixture; returns the markdown and the facts the targets are checked on.

    >>> from fastckpt.device import default
    >>> text, facts = bench_case("b", "8 tensors of 4 KiB", 8, 1024, "safetensors", ".", 1, default())  # doctest: +SKIP
    >>> facts["repeat_misses"]  # doctest: +SKIP
    0
    """
    import pyopencl as cl

    import fastckpt
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    queue, ctx = dev.queue, dev.context
    tensors, path, st_path, np_path = _fixtures(tmp, key, n, elems, fmt)
    nbytes = sum(a.nbytes for a in tensors.values())
    rw = cl.mem_flags.READ_WRITE
    buffers = {name: cl.Buffer(ctx, rw, a.nbytes) for name, a in tensors.items()}
    flat = np.concatenate([a.reshape(-1) for a in tensors.values()])
    one = cl.Buffer(ctx, rw, flat.nbytes)
    paths: dict[str, Callable[[], object]] = {}

    def bound():
        for name, a in tensors.items():
            cl.enqueue_copy(queue, buffers[name], a, is_blocking=False)
        queue.finish()

    paths[BOUND] = bound
    paths[BOUND_ONE] = lambda: cl.enqueue_copy(queue, one, flat, is_blocking=True)
    base = BOUND
    if not dev.host_unified_memory:  # a discrete device: what its DMA engine carries from pinned memory is the bound
        paths[PINNED_BOUND] = host_to_device_bounds(dev, nbytes, flat)[PINNED_BOUND]
        base = PINNED_BOUND

    pool = PersistentBufferPool(ctx, queue)
    load_file(path, queue, pool=pool)  # the first load fills the pool
    misses_before = pool.stats.misses

    def pooled():
        load_file(path, queue, pool=pool)

    def pooled_touch():
        loaded = load_file(path, queue, pool=pool)
        for name in loaded:
            loaded[name]

    def pooled_fresh():
        with fastckpt.open(path) as tf:
            load_file(tf, queue, pool=pool)

    paths[POOLED] = pooled
    paths[POOLED_TOUCH] = pooled_touch
    paths[POOLED_FRESH] = pooled_fresh
    if dev.host_unified_memory:
        paths[ZERO_COPY] = lambda: load_file(path, queue, zero_copy=True)
    paths[UNPOOLED] = lambda: load_file(path, queue)
    paths[OPEN_ONLY] = lambda: fastckpt.open(path).close()

    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors is a test dependency
        safe_open = None
    if safe_open is not None:
        def safetensors_load(blocking: bool):
            def run_once():
                with safe_open(st_path, framework="numpy") as f:
                    for name in f.keys():
                        cl.enqueue_copy(queue, buffers[name], f.get_tensor(name), is_blocking=blocking)
                queue.finish()
            return run_once

        paths[SAFETENSORS] = safetensors_load(False)
        paths[SAFETENSORS_BLOCKING] = safetensors_load(True)

    def npload():
        flags = rw | cl.mem_flags.COPY_HOST_PTR
        with np.load(np_path) as z:
            out = [cl.Buffer(ctx, flags, hostbuf=z[name]) for name in z.files]
        queue.finish()
        return out

    paths[NPLOAD] = npload
    # The same order every round (seed=None): the paths that allocate new device buffers (no pool, np.load) are
    # timed after the same neighbours each round, which keeps their figures comparable from one version to the next
    # (in shuffled order the unpooled 512 MiB load measured 280 ms instead of 45-80 ms on pocl, its time depending
    # on which path had run just before it).
    timings = round_robin(paths, repeat, max_runs={NPLOAD: NPLOAD_RUNS}, settle=SETTLE, seed=None)
    rows = [(label, timing.median) for label, timing in timings.items()]
    one = flat = None  # freed now (rebound, not deleted: the timed path above still names them)

    stats = pool.stats
    facts = {"repeat_misses": stats.misses - misses_before, "pool_bytes_allocated": stats.bytes_allocated,
             "pool_allocations": stats.allocations, "nbytes": nbytes}
    check = load_file(path, queue, pool=pool)
    facts["copies"] = check.report.copies
    facts["exact"] = all(check[k].to_host().tobytes() == tensors[k].tobytes() for k in tensors)
    del check
    facts["times"] = dict(rows)
    title = f"({key}) {label}, {fmt}, {format_size(nbytes)}, device {dev.name}"
    facts["bound"] = base
    return _table(title, rows, nbytes, base), facts


def bench_many_case(key: str, label: str, n: int, elems: int, fmt: str, tmp: str, repeat: int,
                    dev) -> tuple[str, dict]:
    """Time the index, the first and the warm pooled load and one region copy on a file of ``n`` tiny tensors.

    >>> from fastckpt.device import default
    >>> text, facts = bench_many_case("c", "64 tensors", 64, 4, "safetensors", ".", 1, default())  # doctest: +SKIP
    >>> facts["exact"]  # doctest: +SKIP
    True
    """
    import pyopencl as cl

    import fastckpt
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    queue, ctx = dev.queue, dev.context
    tensors = random_tensors(n, elems, digits=6)
    path = os.path.join(tmp, f"{key}.{fmt}")
    save_as(path, fmt, tensors)
    with fastckpt.open(path) as tf:
        start, end = tf.data_region
    region = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max(end - start, 1))
    kept = fastckpt.open(path)  # the region copy reads a mapping that is already there, as the warm load does
    source = kept.mapped.view(start, end - start)
    warm_pool = PersistentBufferPool(ctx, queue)
    load_file(path, queue, pool=warm_pool)
    misses_before = warm_pool.stats.misses

    def index():
        with fastckpt.open(path) as tf:
            tf.hosts()

    def first():
        load_file(path, queue, pool=PersistentBufferPool(ctx, queue))

    paths = {INDEX: index, MANY_FIRST: first, MANY_WARM: lambda: load_file(path, queue, pool=warm_pool),
             REGION_COPY: lambda: cl.enqueue_copy(queue, region, source, is_blocking=True)}
    timings = round_robin(paths, repeat, settle=SETTLE, seed=None)
    rows = [(name, timing.median) for name, timing in timings.items()]
    stats = warm_pool.stats
    check = load_file(path, queue, pool=warm_pool)
    facts = {"repeat_misses": stats.misses - misses_before, "pool_bytes_allocated": stats.bytes_allocated,
             "pool_allocations": stats.allocations, "nbytes": sum(a.nbytes for a in tensors.values()),
             "copies": check.report.copies, "times": dict(rows),
             "exact": all(check[k].to_host().tobytes() == a.tobytes() for k, a in list(tensors.items())[::97])}
    del check
    kept.close()  # unmapped once the last view of it (the region copy's source) is gone
    ref = dict(rows)[INDEX]
    body = [[name, format_duration(t), f"{t / ref:.2f}x"] for name, t in rows]
    title = f"({key}) {label}, {fmt}, {format_size(facts['nbytes'])}, device {dev.name}"
    return "\n".join([f"### {title}", "", *table_lines(["path", "median", "vs. index"], body, "lrr")]), facts


def host_to_device_bounds(dev, nbytes: int, source: np.ndarray) -> dict[str, Callable[[], None]]:
    """``{label: run}`` for the bounds a load of ``nbytes`` is measured against on ``dev``: one pinned buffer
    (``ALLOC_HOST_PTR``, mapped, holding the bytes of ``source``, repeated) copied to device buffers of ``nbytes``
    in all, in ``BOUND_CHUNK`` commands (what a discrete device's DMA engine carries), and the same from pageable
    RAM.

    >>> from fastckpt.device import default
    >>> runs = host_to_device_bounds(default(), 1 << 20, np.zeros(1 << 20, np.uint8))  # doctest: +SKIP
    >>> sorted(runs) == sorted([PINNED_BOUND, PAGEABLE])  # doctest: +SKIP
    True
    """
    import pyopencl as cl

    queue, ctx = dev.queue, dev.context
    chunk = min(BOUND_CHUNK, nbytes)
    pinned = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, chunk)
    host, _event = cl.enqueue_map_buffer(queue, pinned, cl.map_flags.WRITE, 0, (chunk,), np.uint8, is_blocking=True)
    data = source.reshape(-1).view(np.uint8)
    for lo in range(0, chunk, len(data)):  # source repeated where it is shorter than one command
        host[lo:lo + len(data)] = data[:chunk - lo]
    pageable = host.copy()
    sizes = [min(chunk, nbytes - lo) for lo in range(0, nbytes, chunk)]
    targets = [cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n) for n in sizes]

    def copies(src):
        def run_once():
            for dst, n in zip(targets, sizes):
                cl.enqueue_copy(queue, dst, src[:n], is_blocking=False)
            queue.finish()
        run_once.keep = (pinned, host)  # the mapping stays while the run does
        return run_once

    return {PINNED_BOUND: copies(host), PAGEABLE: copies(pageable)}


def _torch_cuda():
    """torch, where it imports and has a CUDA device; else None."""
    try:
        import torch
    except Exception:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def bench_large_case(key: str, label: str, n: int, elems: int, fmt: str, tmp: str, repeat: int,
                     dev) -> tuple[str, dict]:
    """Time a large file's loads against the pinned bound measured on ``dev`` (see the module docstring, case d).

    ``facts["rows"]`` holds ``(path, median seconds, GB/s, share of the pinned bound, exact)`` for each path
    (exact is None for the bounds, which copy one buffer over and over).

    >>> from fastckpt.device import default
    >>> text, facts = bench_large_case("d", "4 x 1 MiB", 4, 2**18, "safetensors", ".", 1, default())  # doctest: +SKIP
    >>> all(row[4] for row in facts["rows"] if row[4] is not None)  # doctest: +SKIP
    True
    """
    import fastckpt
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    queue, ctx = dev.queue, dev.context
    rng = np.random.default_rng(0)
    base = rng.standard_normal(elems, dtype=np.float32)
    tensors = {f"t{i:03d}": np.roll(base, i * 4099) for i in range(n)}  # distinct, cheap to make at 4 GiB
    path = os.path.join(tmp, f"{key}.{fmt}")
    (fastckpt.save_safetensors if fmt == "safetensors" else fastckpt.save_npz)(path, tensors, fsync=False)
    nbytes = sum(a.nbytes for a in tensors.values())
    discrete = not dev.host_unified_memory
    paths: dict[str, Callable[[], object]] = dict(host_to_device_bounds(dev, nbytes, base))
    pool = PersistentBufferPool(ctx, queue)
    loads = {LARGE_WARM: lambda: load_file(path, queue, pool=pool),
             (LARGE_UNSTAGED if discrete else LARGE_STAGED): (
                 lambda: load_file(path, queue, pool=pool, staging=not discrete)),
             LARGE_NEW: lambda: load_file(path, queue, pool=PersistentBufferPool(ctx, queue)),
             LARGE_NOPOOL: lambda: load_file(path, queue)}
    for name, load in loads.items():
        paths[name] = lambda load=load: load().wait()  # dropped at once: its arena returns to the pool
    for load in loads.values():  # the warm pool holds an arena and staging buffers before the timed runs
        load().release()
    torch = _torch_cuda()
    if torch is not None and fmt == "safetensors":
        from safetensors.torch import load_file as torch_load_file

        chunk = min(BOUND_CHUNK, nbytes)
        src = torch.empty(chunk, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def torch_pinned():
            for lo in range(0, nbytes, chunk):
                m = min(chunk, nbytes - lo)
                dst[lo:lo + m].copy_(src[:m], non_blocking=True)
            torch.cuda.synchronize()

        def torch_safetensors():
            torch_load_file(path, device="cuda")
            torch.cuda.synchronize()

        paths[TORCH_PINNED] = torch_pinned
        paths[TORCH_ST] = torch_safetensors
    timings = round_robin(paths, repeat, settle=SETTLE, seed=None)
    times = {name: timing.median for name, timing in timings.items()}
    exact: dict[str, bool] = {}
    for name, load in loads.items():
        loaded = load()
        exact[name] = all(loaded[k].to_host().tobytes() == a.tobytes() for k, a in tensors.items())
        if name == (LARGE_WARM if discrete else LARGE_STAGED):  # the staged one
            facts_report = loaded.report
        loaded.release()
    if TORCH_ST in paths:
        got = torch_load_file(path, device="cuda")
        exact[TORCH_ST] = all(np.array_equal(got[k].cpu().numpy(), a) for k, a in tensors.items())
        del got
    bound = times[PINNED_BOUND]
    rows = [(name, t, nbytes / t / 1e9, bound / t, exact.get(name)) for name, t in times.items()]
    facts = {"rows": rows, "nbytes": nbytes, "discrete": discrete, "exact": all(exact.values()),
             "staging": (facts_report.staging_chunk, facts_report.staging_buffers, facts_report.fill_threads),
             "times": times, "repeat_misses": 0, "pool_bytes_allocated": pool.stats.bytes_allocated,
             "pool_allocations": pool.stats.allocations, "copies": facts_report.copies}
    body = [[name, format_duration(t), f"{gbs:.1f}", f"{share:.2f}", "-" if ok is None else ("yes" if ok else "NO")]
            for name, t, gbs, share, ok in rows]
    title = (f"({key}) {label}, {fmt}, {format_size(nbytes)}, device {dev.name} "
             f"({'discrete' if discrete else 'shares host memory'}; staging of the warm staged load: "
             f"{facts['staging'][1]} x {format_size(facts['staging'][0])}, {facts['staging'][2]} fill threads)")
    return "\n".join([f"### {title}", "", *table_lines(["path", "median", "GB/s", "share of the pinned bound",
                                                         "exact"], body, "lrrrl")]), facts


def _targets(results: dict, quick: bool) -> list[str]:
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else 'MISSED'}: {text}")

    fmt = format_duration
    if "a" in results:
        t = results["a"]["times"]
        r = t[POOLED] / t[results["a"]["bound"]]
        line(r <= 1.10, f"(a) pooled load within 1.10x of the bound: {r:.2f}x")
        if SAFETENSORS in t:
            s = t[SAFETENSORS] / t[POOLED]
            line(s >= 1.4, f"(a) pooled load >= 1.4x faster than safetensors + enqueue_copy: {s:.2f}x")
        if ZERO_COPY in t:
            line(t[ZERO_COPY] <= 2e-3, f"(a) zero-copy load <= 2 ms: {fmt(t[ZERO_COPY])}")
    if LARGE in results:
        facts = results[LARGE]
        share = {name: share for name, _t, _gbs, share, _ok in facts["rows"]}
        where = ("" if facts["discrete"] else " (this device shares host memory: the targets are for discrete "
                 "devices, where the default load is staged; here the staged row is staging=True, forced)")
        warm = share[LARGE_WARM] if facts["discrete"] else share[LARGE_STAGED]
        line(warm >= 0.8, f"({LARGE}) warm pooled load >= 0.8x the pinned bound: {warm:.2f}x{where}")
        line(share[LARGE_NEW] >= 0.6, f"({LARGE}) load with a new pool >= 0.6x the pinned bound: "
                                      f"{share[LARGE_NEW]:.2f}x")
        line(facts["exact"], f"({LARGE}) every load read back and compared: exact {facts['exact']}")
    if "b" in results:
        t = results["b"]["times"]
        line(t[POOLED] <= 1e-3, f"(b) pooled load <= 1 ms: {fmt(t[POOLED])} (every view made: {fmt(t[POOLED_TOUCH])}; "
                                f"a fresh fastckpt.open each time: {fmt(t[POOLED_FRESH])}; "
                                f"fastckpt.open alone: {fmt(t[OPEN_ONLY])})")
        if SAFETENSORS in t:
            s = t[SAFETENSORS] / t[POOLED]
            sb = t[SAFETENSORS_BLOCKING] / t[POOLED]
            line(s >= 40, f"(b) pooled load >= 40x faster than safetensors + per-tensor enqueue_copy: {s:.1f}x "
                          f"(against blocking copies: {sb:.1f}x)")
    if MANY in results:
        t = results[MANY]["times"]
        bound = 2 * t[INDEX] + t[REGION_COPY]
        line(t[MANY_FIRST] <= bound, f"({MANY}) first pooled load <= 2x the index time + one region copy: "
                                     f"{fmt(t[MANY_FIRST])} against {fmt(bound)} (index {fmt(t[INDEX])}, region copy "
                                     f"{fmt(t[REGION_COPY])}; warm load {fmt(t[MANY_WARM])})")
    for key, facts in sorted(results.items()):
        if key == LARGE:
            continue
        line(facts["repeat_misses"] == 0,
             f"({key}) repeated pooled loads: {facts['repeat_misses']} pool misses; the pool allocated "
             f"{format_size(facts['pool_bytes_allocated'])} in {facts['pool_allocations']} buffer(s) for "
             f"{format_size(facts['nbytes'])} of tensors, {facts['copies']} copy per load; values exact: {facts['exact']}")
    if quick:
        out.append("- (--quick sizes: the targets are stated for the full sizes)")
    return out


def configure(parser) -> None:
    """Add the device suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args(["--quick", "--case", "b"]).repeat
    7
    """
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds; for smoke tests)")
    add_repeat_option(parser, dest="repeat", default=7, help="timed runs per path; the median is reported")
    parser.add_argument("--format", choices=("safetensors", "npz"), default="safetensors",
                        help="file format fastckpt loads (baselines use their own formats)")
    parser.add_argument("--case", choices=sorted(CASES), action="append",
                        help="run only this case (repeatable); d, 4 GiB, runs only when named")
    parser.add_argument("--dir", default=None, help="where to write fixtures (default: a temporary directory)")
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto", help="which OpenCL device")


def run(args) -> int:
    """Run the device suite with parsed options; prints the markdown tables and targets, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "device", "--quick", "--repeat", "1", "--case", "b"])  # doctest: +SKIP
    """
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    from fastckpt.device import default

    dev = default(args.device)
    cases = QUICK if args.quick else CASES
    results = {}
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-", dir=args.dir) as tmp:
        for key in args.case or DEFAULT_CASES:
            label, n, elems = cases[key]
            case = {MANY: bench_many_case, LARGE: bench_large_case}.get(key, bench_case)
            text, facts = case(key, label, n, elems, args.format, tmp, args.repeat, dev)
            results[key] = facts
            print(text, end="\n\n")
            sys.stdout.flush()
            gc.collect()
    print("### targets\n")
    print("\n".join(_targets(results, args.quick)))
    return 0
