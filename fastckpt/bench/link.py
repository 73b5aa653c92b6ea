"""The ``link`` suite: the staged (discrete-GPU) load path over a simulated link, against its own bounds.

``python -m fastckpt bench --suite link`` writes a safetensors file (256 MiB in
16 float32 tensors; ``--quick``: 32 MiB in 8) and loads it with
``load_file(path, queue, pool=pool, staging=True)`` (warm pool, the path a
discrete GPU takes by default) on a :class:`~fastckpt.device.simlink.SimulatedQueue`:
pocl's device, with the staged copies sent over a simulated DMA link that takes
``bytes / rate`` of wall time and no CPU. The bounds of a staged load are the
link's rate and the *fill rate*: how fast the fill threads read the file into
the pinned staging buffers (``preadv``, or a copy out of a mapping with
``--read mmap``), with no copies to wait for, measured here. A pipeline that
overlaps both reaches ``min(fill, link)``.

Link rates are real links' (``--links``, GB/s: 2 to 50, PCIe gen 3 x4 to gen 5
x16) scaled to this machine: a 16-core GPU host fills pinned memory at about
``--ref-fill`` GB/s (40: 38-52 GB/s on 12 threads, shared/reference/gpu-notes.md),
so a link of ``L`` GB/s there is simulated here at ``L / ref_fill`` times this
machine's fill rate: link-bound below 40, fill-bound above it, both at 40.

Every round measures, for each link rate in a shuffled order, the fill rate and
then the load (the order alternating between rounds), so each load's share of
``min(fill, link)`` is taken against a fill measured moments before or after it
on a shared machine; the tables give medians of rates and of per-round shares.
Timed loads send nothing to the device (``exact=False``: the link is asleep, as a
DMA engine leaves the CPU alone) and are checked against the file by the samples
the link takes as each copy starts and ends; one exact load per configuration is
read back and compared byte for byte first (column "exact").

The sweep (not with ``--no-sweep``) runs the same pipeline (:class:`~fastckpt.device.staging.Stager`)
with every buffer count and chunk of ``--buffers`` x ``--chunks`` at the link
rates of ``--sweep-links``, to find the shape the real path should use.

>>> from fastckpt.cli import main
>>> main(["bench", "--suite", "link", "--quick", "--repeat", "1", "--no-sweep"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np

from fastckpt.bench.formats import random_tensors, save_as
from fastckpt.bench.timing import table_lines

__all__ = ["configure", "run", "fill_time", "scaled_rates", "link_time"]

REF_FILL = 40.0  # GB/s a 16-core GPU host fills pinned staging memory at (gpu-notes: 38-52 on 12 threads)
LINKS = (2.0, 5.0, 10.0, 25.0, 40.0, 50.0)
SWEEP_LINKS = (25.0, 40.0, 50.0)
BUFFERS = (3, 6)  # every shape's buffers are held at once: the 12 shapes of these, CHUNKS and RAMPS hold 504 MiB
CHUNKS = (4, 8, 16)  # MiB (64 ran at 0.80-0.86x of 16 in the last sweep that had it)
RAMPS = (0, 3)  # smaller batches at each end of a load (staging.batch_sizes)
TARGET = 0.9  # of min(fill, link)
SIZES = {False: (16, 4 << 20), True: (8, 1 << 20)}  # --quick: (tensors, float32 elements each)


def scaled_rates(links, fill: float, ref_fill: float = REF_FILL) -> list[float]:
    """Simulated link rates (bytes/s) for real links of ``links`` GB/s on a machine filling at ``fill`` bytes/s,
    where a GPU host fills at ``ref_fill`` GB/s.

    >>> scaled_rates([2, 40], 4e9)
    [200000000.0, 4000000000.0]
    """
    return [float(link) / ref_fill * fill for link in links]


def fill_time(hosts: list, chunk: int, threads: int, data: np.ndarray, fd: int | None, start: int, path: str,
              executor) -> float:
    """Seconds to fill ``len(data)`` bytes (file bytes ``start``.. of ``path``) into the pinned ``hosts`` in turn,
    ``chunk`` bytes each, as :class:`~fastckpt.device.staging.Stager` does (parts of ``max(FILL_SPLIT, chunk / 4)``
    on ``threads`` threads; ``preadv`` on ``fd``, or copies from the mapping ``data`` where ``fd`` is None), with no
    copies to wait for: the fill rate's measurement."""
    from fastckpt.device import staging

    part = min(chunk, max(staging.FILL_SPLIT, chunk // staging.PART_OF_CHUNK))
    tasks = []
    n = len(data)
    for base in range(0, n, chunk):
        host = hosts[(base // chunk) % len(hosts)]
        for lo in range(base, min(base + chunk, n), part):
            hi = min(lo + part, base + chunk, n)
            dst = host[lo - base:hi - base]
            tasks.append([(dst, data[lo:hi], None if fd is None else (fd, start + lo, path))])
    began = time.perf_counter()
    if threads > 1:
        list(executor.map(lambda task: staging.fill(None, task), tasks))
    else:
        for task in tasks:
            staging.fill(None, task)
    return time.perf_counter() - began


def link_time(copies, began: float, ended: float) -> dict:
    """Where the seconds of one load from ``began`` to ``ended`` (``perf_counter``) went on the link, from its
    ``copies`` (:class:`~fastckpt.device.simlink.LinkCopy`, in the order sent): ``start`` until the engine took the
    first copy (the load's opening and first fill), ``busy`` copying, ``gaps`` idle between copies (the fill behind
    the link), ``tail`` after the last copy's window (waiting for its event, the load's closing).

    >>> from fastckpt.device.simlink import LinkCopy
    >>> c = [LinkCopy(8, 1.0, 1.0, 2.0, 2.0, 0, 0, 0), LinkCopy(8, 2.5, 2.5, 3.0, 3.1, 0, 8, 0)]
    >>> link_time(c, 0.5, 3.25)
    {'start': 0.5, 'busy': 1.5, 'gaps': 0.5, 'tail': 0.25}
    """
    if not copies:
        return {"start": ended - began, "busy": 0.0, "gaps": 0.0, "tail": 0.0}
    busy = sum(c.end - c.start for c in copies)
    return {"start": copies[0].start - began, "busy": busy, "gaps": copies[-1].end - copies[0].start - busy,
            "tail": ended - copies[-1].end}


class _Case:
    """The file, its mapping and descriptor, the simulated queue and the warm pool the suite loads through."""

    def __init__(self, path: str, tensors: dict, dev, read: str):
        import fastckpt
        from fastckpt.device.pool import PersistentBufferPool
        from fastckpt.device.simlink import SimulatedQueue

        self.path, self.tensors, self.read = path, tensors, read
        with fastckpt.open(path) as tf:
            infos = sorted((tf.info(name) for name in tf.keys()), key=lambda i: i.offset)
        self.offsets = {i.name: i.offset for i in infos}
        self.start = infos[0].offset
        self.end = infos[-1].offset + infos[-1].nbytes
        self.nbytes = self.end - self.start
        self.file = np.memmap(path, np.uint8, mode="r")
        self.data = self.file[self.start:self.end]
        self.data.sum()  # the page cache warm, the mapping's pages present (the kept mapping a warm pool copies from)
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.queue = SimulatedQueue(dev.context, dev.device, exact=False)
        self.pool = PersistentBufferPool(dev.context, self.queue)
        self.deltas: dict = {}
        self.spans: list = []  # (link copies, began, ended) of each timed load, for link_time

    def load(self):
        from fastckpt.device import staging
        from fastckpt.device.load import load_file

        saved, staging.READ = staging.READ, self.read
        try:
            return load_file(self.path, self.queue, pool=self.pool, staging=True)
        finally:
            staging.READ = saved

    def exact(self, rate: float) -> bool:
        """One load with the bytes really copied, read back and compared; learns where each buffer's bytes are."""
        link = self.queue.link
        link.rate, link.exact = rate, True
        try:
            loaded = self.load()
            ok = all(np.array_equal(loaded[name].to_host(), want) for name, want in self.tensors.items())
            for name in self.tensors:
                t = loaded[name]
                self.deltas[t.buffer.int_ptr] = self.offsets[name] - t.offset
            loaded.release()
        finally:
            link.exact = False
        return ok and not link.torn

    def expected(self, buffer: int, at: int, n: int) -> np.ndarray:
        lo = at + self.deltas[buffer]
        return self.file[lo:lo + n]

    def close(self) -> None:
        self.queue.close()
        os.close(self.fd)


def _hosts(pool, queue, chunk: int, count: int) -> list:
    """The pinned host arrays of the staging set ``pool`` holds for loads of this shape (the fill measurement writes
    into the same memory the loads do); the set goes back to the pool at once."""
    with pool.staging(queue, chunk, count) as stage:
        return list(stage.hosts)


def _executor(threads: int):
    from fastckpt.device import staging

    return staging._fillers(threads)


def _timed_pair(case: _Case, rate: float, fill_first: bool, hosts: list, chunk: int, threads: int,
                run_load) -> tuple[float, float, float]:
    """(fill seconds, load seconds, the load's own fill seconds), the fill and the load measured back to back in the
    order ``fill_first`` says; ``run_load()`` returns the seconds during which its fill threads were writing
    (``LoadReport.staging_fill``, ``Stager.fill_seconds``)."""
    link = case.queue.link
    link.rate = rate
    fd = None if case.read == "mmap" else case.fd
    times = {}
    for what in (("fill", "load") if fill_first else ("load", "fill")):
        if what == "fill":
            times[what] = fill_time(hosts, chunk, threads, case.data, fd, case.start, case.path, _executor(threads))
        else:
            link.reset()
            began = time.perf_counter()
            filled = run_load()
            ended = time.perf_counter()
            times[what] = ended - began
            case.spans.append((list(link.copies), began, ended))
            if link.torn or link.errors:
                raise AssertionError(f"the staged load broke its order: torn copies {link.torn[:3]}, "
                                     f"errors {link.errors[:3]}")
    return times["fill"], times["load"], filled


def _stats(n: int, rate: float, pairs: list) -> dict:
    """Medians over the rounds: the fill rate measured beside each load and during it, the load's rate, and its
    share of min(fill, link) against either fill rate (with their ranges)."""
    beside = [(n / t) / min(n / f, rate) for f, t, _ in pairs]
    during = [(n / t) / min(n / g, rate) for _, t, g in pairs]
    return {"fill": statistics.median(n / f for f, _, _ in pairs),
            "fill_during": statistics.median(n / g for _, _, g in pairs),
            "achieved": statistics.median(n / t for _, t, _ in pairs),
            "share": statistics.median(beside), "spread": (min(beside), max(beside)),
            "share_during": statistics.median(during), "spread_during": (min(during), max(during))}


def _headline(case: _Case, links, rates, repeat: int) -> list:
    """The real path (``load_file``, default staging shape) at every link rate: rows of the first table."""
    first = case.load()  # warm: the pool's arena and staging buffers, the fill threads
    report = first.report
    shape = (report.staging_buffers, report.staging_chunk, report.fill_threads)
    first.release()
    hosts = _hosts(case.pool, case.queue, shape[1], shape[0])
    exact = {link: case.exact(rate) for link, rate in zip(links, rates)}
    pairs: dict = {link: [] for link in links}
    order = list(zip(links, rates))
    shuffle = random.Random(0).shuffle

    def run_load():
        loaded = case.load()
        filled = loaded.report.staging_fill
        loaded.release()
        return filled

    spent: dict = {link: [] for link in links}
    for r in range(repeat):
        shuffle(order)
        for link, rate in order:
            pairs[link].append(_timed_pair(case, rate, r % 2 == 0, hosts, shape[1], shape[2], run_load))
            case.queue.link.check(case.expected)
            spent[link].append(link_time(*case.spans.pop()))
    rows = []
    for link, rate in zip(links, rates):
        stats = _stats(case.nbytes, rate, pairs[link])
        stats["spent"] = {k: statistics.median(s[k] for s in spent[link]) for k in spent[link][0]}
        rows.append((link, rate, stats, shape, exact[link]))
    return rows


def _sweep(case: _Case, links, rates, shapes, default: tuple, threads: int, repeat: int) -> list:
    """The :class:`~fastckpt.device.staging.Stager` with each ``(buffers, chunk, ramp, fill threads)`` of ``shapes``
    at each rate (``ramp``: how many smaller batches at each end, :func:`~fastckpt.device.staging.batch_sizes`; the
    fill rate beside each load is measured on ``threads`` threads, the machine's), the
    shapes in a shuffled order within every round and rate (all of them held at once, each in a pool of its own), so
    that each is compared with ``default`` in the same round: rows of the sweep table."""
    import pyopencl as cl

    from fastckpt.device.pool import PersistentBufferPool
    from fastckpt.device.staging import Shape, Stager

    ctx = case.queue.context
    target = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, case.nbytes)
    ptr = target.int_ptr
    shapes = list(dict.fromkeys([default, *shapes]))
    runs, hosts, pools = {}, {}, []
    for count, chunk, ramp, fillers in shapes:
        shape = Shape(chunk, count, fillers)
        pool = PersistentBufferPool(ctx, case.queue)
        pools.append(pool)

        def run_load(shape=shape, pool=pool, ramp=ramp):
            events: list = []
            stager = Stager(case.queue, pool, shape, events, True)
            stager.ramp = ramp
            try:
                stager.add(case.data, target, 0, file=None if case.read == "mmap" else
                           (case.fd, case.start, case.path))
                stager.finish()
                cl.wait_for_events(events)
            finally:
                stager.close()
            return stager.fill_seconds

        run_load()
        runs[(count, chunk, ramp, fillers)] = run_load
        hosts[(count, chunk, ramp, fillers)] = _hosts(pool, case.queue, chunk, count)
    pairs: dict = {(key, link): [] for key in shapes for link in links}
    order = list(shapes)
    shuffle = random.Random(1).shuffle
    for r in range(repeat):
        for link, rate in zip(links, rates):
            shuffle(order)
            for key in order:
                pairs[(key, link)].append(_timed_pair(case, rate, r % 2 == 0, hosts[key], key[1], threads,
                                                      runs[key]))
                case.spans.clear()
                case.queue.link.check(lambda b, at, n: case.data[at:at + n] if b == ptr else None)
    rows = []
    for link, rate in zip(links, rates):
        for key in shapes:
            stats = _stats(case.nbytes, rate, pairs[(key, link)])
            stats["vs_default"] = statistics.median(d[1] / p[1] for d, p in zip(pairs[(default, link)],
                                                                                pairs[(key, link)]))
            rows.append((link, rate, key[0], key[1], stats, key[2], key[3]))
    hosts.clear()
    for pool in pools:
        pool.clear()
    return rows


def _share(s: dict, which: str) -> str:
    low, high = s[f"spread{which}"]
    return f"{s[f'share{which}']:.2f} ({low:.2f}-{high:.2f})"


def _gbs(x: float) -> str:
    return f"{x / 1e9:.2f}"


def configure(parser) -> None:
    """Add the link suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser(); configure(parser)
    >>> parser.parse_args(["--links", "2,50"]).links
    '2,50'
    """
    parser.add_argument("--quick", action="store_true", help="32 MiB, few shapes (seconds; for smoke tests)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are reported")
    parser.add_argument("--links", default=",".join(f"{x:g}" for x in LINKS),
                        help="real link rates to simulate, GB/s, comma-separated (scaled, see --ref-fill)")
    parser.add_argument("--ref-fill", type=float, default=REF_FILL,
                        help="GB/s a GPU host fills pinned memory at: a link of that rate is simulated at this "
                             "machine's fill rate")
    parser.add_argument("--read", choices=("preadv", "mmap"), default="preadv",
                        help="how the fill reads the file (staging.READ): preadv (a fresh load's) or copies from "
                             "the mapping (a pool-kept file's)")
    parser.add_argument("--no-sweep", action="store_true", help="only the default staging shape")
    parser.add_argument("--sweep-links", default=",".join(f"{x:g}" for x in SWEEP_LINKS),
                        help="real link rates (GB/s) the sweep runs at")
    parser.add_argument("--buffers", default=",".join(map(str, BUFFERS)), help="buffer counts the sweep tries")
    parser.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="chunks (MiB) the sweep tries")
    parser.add_argument("--ramps", default=",".join(map(str, RAMPS)),
                        help="smaller first and last batches the sweep tries (staging.RAMP; 0: whole chunks)")
    parser.add_argument("--threads", default=None,
                        help="fill thread counts the sweep tries (default: the load's own and twice as many)")
    parser.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run(args) -> int:
    """Run the link suite with parsed options; prints the markdown tables and the target, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "link", "--quick", "--repeat", "1", "--no-sweep"])  # doctest: +SKIP
    """
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    from fastckpt.device import default
    from fastckpt.device.staging import _cpus, staging_shape

    dev = default()
    links = _floats(args.links)
    count, elems = SIZES[args.quick]
    tensors = random_tensors(count, elems)
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_as(path, "safetensors", tensors)
        case = _Case(path, tensors, dev, args.read)
        try:
            first = case.load()
            shape = (first.report.staging_buffers, first.report.staging_chunk, first.report.fill_threads)
            first.release()
            hosts = _hosts(case.pool, case.queue, shape[1], shape[0])
            fill = statistics.median(case.nbytes / fill_time(hosts, shape[1], shape[2], case.data,
                                                             None if args.read == "mmap" else case.fd, case.start,
                                                             path, _executor(shape[2])) for _ in range(5))
            rates = scaled_rates(links, fill, args.ref_fill)
            print(f"### simulated link: staged load_file of {case.nbytes >> 20} MiB ({count} float32 tensors), "
                  f"warm pool, fill by {args.read} on {shape[2]} threads ({_cpus()} cores)\n")
            print(f"Fill rate measured first: {_gbs(fill)} GB/s (median of 5); links scaled by "
                  f"{fill / 1e9:.3g} / {args.ref_fill:g}. Shares are medians (and ranges) over the rounds of load "
                  f"rate / min(fill, link), with the fill rate measured beside the load (the same bytes into the "
                  f"same buffers on as many threads, just before or after it) or during it (its bytes over the "
                  f"seconds during which its fill threads were writing). The machine is shared: fill rates move "
                  f"from second to second, which the second measure follows.\n")
            engine = ("real-time (SCHED_FIFO), as a DMA engine needs no core" if case.queue.link.realtime else
                      "at ordinary priority (real-time was refused): its copies complete late where the cores are busy")
            print(f"The simulated link's engine thread runs {engine}.\n")
            rows = _headline(case, links, rates, args.repeat)
            header = ["link (GB/s, real)", "simulated link (GB/s)", "fill beside (GB/s)", "fill during (GB/s)",
                      "achieved (GB/s)", "share of min(fill beside, link)", "share of min(fill during, link)",
                      "buffers x chunk", "exact"]
            lines = [[f"{link:g}", _gbs(rate), _gbs(s["fill"]), _gbs(s["fill_during"]), _gbs(s["achieved"]),
                      _share(s, ""), _share(s, "_during"), f"{b} x {c / 2**20:g} MiB", "yes" if ok else "NO"]
                     for link, rate, s, (b, c, _t), ok in rows]
            print("\n".join(table_lines(header, lines, "rrrrrrrlr")), end="\n\n")
            print("Where a load's time went on the link (medians over the rounds, ms): before the engine took the "
                  "first copy (opening the file, the first fill), copying, idle between copies (the fill behind the "
                  "link: a fill-bound stretch), after the last copy (its event, the load's closing).\n")
            header = ["link (GB/s, real)", "load (ms)", "before the first copy", "copying", "idle between copies",
                      "after the last copy"]
            lines = [[f"{link:g}", f"{case.nbytes / s['achieved'] * 1e3:.2f}"] +
                     [f"{s['spent'][k] * 1e3:.2f}" for k in ("start", "busy", "gaps", "tail")]
                     for link, _r, s, _shape, _ok in rows]
            print("\n".join(table_lines(header, lines, "rrrrrr")), end="\n\n")
            missed = [link for link, _r, s, _shape, ok in rows if s["share_during"] < TARGET or not ok]
            if not args.no_sweep:
                sweep_links = _floats(args.sweep_links)
                buffers = [int(x) for x in args.buffers.split(",")]
                chunks = [int(x) << 20 for x in args.chunks.split(",")]
                if args.quick:
                    chunks = [c >> 4 for c in chunks]
                ramps = [int(x) for x in args.ramps.split(",")]
                fillers = [int(x) for x in args.threads.split(",")] if args.threads else [shape[2], 2 * shape[2]]
                shapes = [(b, c, r, t) for b in buffers for c in chunks for r in ramps for t in fillers]
                from fastckpt.device.staging import RAMP

                sweep = _sweep(case, sweep_links, scaled_rates(sweep_links, fill, args.ref_fill), shapes,
                               (shape[0], shape[1], RAMP, shape[2]), shape[2], args.repeat)
                print(f"### sweep: the staging pipeline with each buffer count, chunk and fill thread count (the "
                      f"fill rate beside is on {shape[2]} threads)\n")
                print(f"Every shape ran once per round and link rate, in a shuffled order; \"vs. default\" is the "
                      f"median over the rounds of its rate over the default shape's ({shape[0]} x "
                      f"{shape[1] / 2**20:g} MiB, ramp {RAMP}, {shape[2]} threads) in the same round; ramp: how many smaller batches "
                      f"start and end the load (0: whole chunks).\n")
                header = ["link (GB/s, real)", "buffers x chunk", "ramp", "fill threads", "fill beside (GB/s)",
                          "fill during (GB/s)",
                          "achieved (GB/s)", "share of min(fill beside, link)", "share of min(fill during, link)",
                          "vs. default"]
                lines = [[f"{link:g}", f"{b} x {c / 2**20:g} MiB", f"{ramp}", f"{t}", _gbs(s["fill"]),
                          _gbs(s["fill_during"]), _gbs(s["achieved"]), _share(s, ""), _share(s, "_during"),
                          f"{s['vs_default']:.2f}x"]
                         for link, _r, b, c, s, ramp, t in sweep]
                print("\n".join(table_lines(header, lines, "rlrrrrrrrr")), end="\n\n")
                for link in sweep_links:
                    best = max((r for r in sweep if r[0] == link), key=lambda r: r[4]["share_during"])
                    print(f"- best at {link:g} GB/s: {best[2]} x {best[3] / 2**20:g} MiB, ramp {best[5]}, {best[6]} "
                          f"fill threads, share "
                          f"{best[4]['share_during']:.2f} (of min(fill during, link))")
                print()
            default_shape = staging_shape(case.nbytes, shape[1])
            print(f"- staging_shape for this load: {default_shape}")
            print(f"- {'met' if not missed else 'MISSED'}: staged load_file >= {TARGET}x min(fill, link) at every "
                  f"link rate{'' if not missed else ' (missed at ' + ', '.join(f'{x:g}' for x in missed) + ' GB/s)'}")
        finally:
            case.close()
    sys.stdout.flush()
    return 0
