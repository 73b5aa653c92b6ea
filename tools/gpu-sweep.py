"""The staging shapes of a discrete device's staged load, measured on the device: part of tools/gpu-check.sh.

    python3 tools/gpu-sweep.py [--quick] [--kind gpu|cpu] [--rounds 2] [--buffers 2,4,6,8] [--chunks 16,32,64,128]
                               [--threads 8,16] [--shapes 6x64x16,6x16x8] [--dir DIR]

Writes a safetensors file (4 GiB in 64 float32 tensors of 64 MiB; --quick: 256 MiB in 16) and keeps it in the page
cache. Measures the pinned bound first: one mapped ``ALLOC_HOST_PTR`` buffer of 256 MiB copied into device buffers,
256 MiB a command (no fill). Then, for each way a fill reads the file (``preadv``, a fresh load's, and copies from the
mapping, a pool-kept file's: ``staging.READ``), each staging shape (buffers x chunk, fill threads) runs the
:class:`~fastckpt.device.staging.Stager` over the whole data region into one device buffer, in a shuffled order in
every round, each in a pool of its own whose pinned buffers were leased by an untimed load first. The default shape
(:func:`~fastckpt.device.staging.staging_shape`) runs beside them, and ``load_file(path, queue, pool=pool)`` (the
public path, the file kept by the pool) last. The last round's device buffer is read back and compared with the file.
Prints markdown: GB/s (median over rounds), share of the pinned bound, and the best shape per read.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kind", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--buffers", default="2,4,6,8")
    parser.add_argument("--chunks", default="16,32,64,128", help="MiB")
    parser.add_argument("--threads", default="8,16")
    parser.add_argument("--shapes", default=None,
                        help="instead of the grid above: BUFFERSxCHUNK_MIBxTHREADS shapes, comma-separated (6x64x16,...)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)

    import numpy as np
    import pyopencl as cl

    import fastckpt
    from fastckpt.device import default, staging
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool
    from fastckpt.device.staging import RAMP, STAGING_CHUNK, Shape, Stager, staging_shape

    dev = default(args.kind)
    queue, ctx = dev.queue, dev.context
    count, elems = (16, 1 << 22) if args.quick else (64, 1 << 24)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="fastckpt-gpu-sweep-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        fastckpt.save_safetensors(path, {f"t{i:02d}": rng.standard_normal(elems, dtype=np.float32)
                                         for i in range(count)})
        with fastckpt.open(path) as tf:
            infos = sorted((tf.info(n) for n in tf.keys()), key=lambda i: i.offset)
        start, end = infos[0].offset, infos[-1].offset + infos[-1].nbytes
        nbytes = end - start
        mapped = np.memmap(path, np.uint8, mode="r")
        data = mapped[start:end]
        data.sum()  # in the page cache, the mapping's pages present
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        target = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)

        # The pinned bound: a mapped ALLOC_HOST_PTR buffer into device memory, 256 MiB a command.
        piece = min(256 << 20, nbytes)
        pinned = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.ALLOC_HOST_PTR, piece)
        host, _ev = cl.enqueue_map_buffer(queue, pinned, cl.map_flags.WRITE, 0, (piece,), np.uint8)
        host[:] = data[:piece]
        bound_runs = []
        for _ in range(3):
            queue.finish()
            began = time.perf_counter()
            for at in range(0, nbytes - piece + 1, piece):
                cl.enqueue_copy(queue, target, host, dst_offset=at, is_blocking=False)
            queue.finish()
            bound_runs.append((nbytes // piece * piece) / (time.perf_counter() - began))
        bound = statistics.median(bound_runs)
        del host

        chunks = [int(c) << 20 for c in args.chunks.split(",")]
        if args.quick:
            chunks = [c >> 2 for c in chunks]
        shapes = [Shape(c, b, t) for b in map(int, args.buffers.split(","))
                  for c in chunks for t in map(int, args.threads.split(","))]
        if args.shapes:
            shapes = [Shape(int(c) << (18 if args.quick else 20), int(b), int(t))
                      for b, c, t in (x.split("x") for x in args.shapes.split(","))]
        own = staging_shape(nbytes, STAGING_CHUNK)
        shapes = list(dict.fromkeys([own, *shapes]))
        rates: dict = {}
        order = list(shapes)
        shuffle = random.Random(1).shuffle
        for read in ("preadv", "mmap"):
            saved, staging.READ = staging.READ, read
            try:
                for r in range(args.rounds):
                    shuffle(order)
                    for shape in order:
                        pool = PersistentBufferPool(ctx, queue)

                        def run(shape=shape, pool=pool):
                            events: list = []
                            stager = Stager(queue, pool, shape, events, True)
                            stager.ramp = RAMP
                            try:
                                stager.add(data, target, 0, file=None if read == "mmap" else (fd, start, path))
                                stager.finish()
                                cl.wait_for_events(events)
                            finally:
                                stager.close()
                            queue.finish()

                        run()  # leases the pinned buffers, untimed
                        began = time.perf_counter()
                        run()
                        rates.setdefault((read, shape), []).append(nbytes / (time.perf_counter() - began))
                        pool.clear()
            finally:
                staging.READ = saved
        back = np.empty(nbytes, np.uint8)
        cl.enqueue_copy(queue, back, target)
        exact = bool(np.array_equal(back, data))

        pool = PersistentBufferPool(ctx, queue)
        load_file(path, queue, pool=pool).release()  # the pool's arena, staging and open file made
        public = []
        for _ in range(max(3, args.rounds)):
            began = time.perf_counter()
            loaded = load_file(path, queue, pool=pool)
            public.append(nbytes / (time.perf_counter() - began))
            shape_used = (loaded.report.staging_buffers, loaded.report.staging_chunk >> 20, loaded.report.fill_threads)
            loaded.release()
        os.close(fd)
        del mapped, data

    print(f"### staging sweep: {nbytes >> 20} MiB from the page cache into device memory ({dev.name}, "
          f"{os.cpu_count()} cores; medians of {args.rounds} rounds)\n")
    print(f"Pinned bound (mapped ALLOC_HOST_PTR buffer -> device, {piece >> 20} MiB commands): "
          f"{bound / 1e9:.1f} GB/s. Default shape for this load: {own.buffers} x {own.chunk >> 20} MiB, "
          f"{own.threads} fill threads, ramp {RAMP}. Read back and compared: {'exact' if exact else 'NOT EXACT'}.\n")
    print("| fill reads by | buffers x chunk | fill threads | GB/s | share of the pinned bound | vs. default |")
    print("|---|---|---:|---:|---:|---:|")
    for read in ("preadv", "mmap"):
        base = statistics.median(rates[(read, own)])
        for shape in shapes:
            g = statistics.median(rates[(read, shape)])
            mark = " (default)" if shape == own else ""
            print(f"| {read} | {shape.buffers} x {shape.chunk >> 20} MiB{mark} | {shape.threads} | {g / 1e9:.1f} | "
                  f"{g / bound:.2f} | {g / base:.2f}x |")
    print()
    for read in ("preadv", "mmap"):
        best = max(shapes, key=lambda s: statistics.median(rates[(read, s)]))
        print(f"- best by {read}: {best.buffers} x {best.chunk >> 20} MiB, {best.threads} threads, "
              f"{statistics.median(rates[(read, best)]) / 1e9:.1f} GB/s")
    g = statistics.median(public)
    print(f"- load_file(path, queue, pool=pool), warm pool (shape {shape_used[0]} x {shape_used[1]} MiB, "
          f"{shape_used[2]} threads): {g / 1e9:.1f} GB/s, {g / bound:.2f} of the pinned bound")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
