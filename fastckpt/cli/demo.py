"""``fastckpt demo``: write a file, read it back through the mapping, and say how long each step took."""

from __future__ import annotations

import os
import tempfile
import time

__all__ = ["HELP", "add_parser", "run"]

HELP = "save and load a small model on the default device, with timings"


def add_parser(subparsers):
    parser = subparsers.add_parser("demo", help=HELP, description=HELP)
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    parser.add_argument("--mib", type=float, default=64.0, help="total size in MiB (default 64)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="hidden width of the demo MLP saved as a .netcl model file (default 1024)")
    return parser


def run(args) -> int:
    import numpy as np

    import fastckpt
    import fastckpt._native.npz  # noqa: F401  (imported here so that the timings below are of the work, not the import)
    import fastckpt._native.safetensors  # noqa: F401

    rng = np.random.default_rng(0)
    per = max(1, int(args.mib * 2**20 / 4 / args.tensors))
    tensors = {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(args.tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, save in (("safetensors", fastckpt.save_safetensors), ("npz", fastckpt.save_npz)):
            path = os.path.join(tmp, f"demo.{fmt}")
            t0 = time.perf_counter()
            save(path, tensors)
            t1 = time.perf_counter()
            with fastckpt.open(path) as f:
                views = {name: f.host(name) for name in f}
            t2 = time.perf_counter()
            exact = all(np.array_equal(views[k], v) for k, v in tensors.items())
            aligned = all(i.offset % 4096 == 0 for i in f.infos.values()) if fmt == "npz" else None
            print(f"{fmt:12s} saved {len(tensors)} tensors ({os.path.getsize(path) / 2**20:.1f} MiB) in "
                  f"{(t1 - t0) * 1e3:.1f} ms (atomic, fsynced); opened with zero-copy views in "
                  f"{(t2 - t1) * 1e3:.2f} ms; bytes identical: {exact}"
                  + (f"; payloads 4096-aligned: {aligned}" if aligned is not None else ""))
        _model_demo(tmp, args.hidden)
    return 0


def _median_ms(fn, repeats: int = 5) -> float:
    import gc
    import statistics

    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _model_demo(tmp: str, hidden: int) -> None:
    """Save an MLP as a .netcl model file, load it through a pool, run it, and compare with np.load."""
    import numpy as np
    import pyopencl as cl

    from fastckpt.device import default
    from fastckpt.device.pool import PersistentBufferPool
    from fastckpt.io import load_model, save_model
    from fastckpt.nn import Linear, ReLU, Sequential

    dev = default()
    q = dev.queue
    model = Sequential(Linear(q, 784, hidden), ReLU(), Linear(q, hidden, hidden), ReLU(), Linear(q, hidden, 10))
    x = np.random.default_rng(1).standard_normal((64, 784)).astype(np.float32)
    expected = model(x).to_host()
    path = os.path.join(tmp, "mlp.netcl")
    t0 = time.perf_counter()
    save_model(model, path)
    save_ms = (time.perf_counter() - t0) * 1e3

    pool = PersistentBufferPool(dev.context, q)
    t0 = time.perf_counter()
    loaded = load_model(path, pool=pool)
    first_ms = (time.perf_counter() - t0) * 1e3
    same = loaded(x).to_host().tobytes() == expected.tobytes()
    copies = loaded.load_report.file_report.copies
    del loaded
    misses = pool.stats.misses

    def pooled():
        m = load_model(path, pool=pool)
        q.finish()
        del m

    def numpy_buffers():
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        with np.load(path, allow_pickle=False) as z:
            buffers = [cl.Buffer(dev.context, flags, hostbuf=z[k]) for k in z.files if k != "__netcl_meta__"]
        q.finish()
        del buffers

    warm_ms, numpy_ms = _median_ms(pooled), _median_ms(numpy_buffers)
    print(f"model file   saved MLP 784-{hidden}-{hidden}-10 ({os.path.getsize(path) / 2**20:.1f} MiB) as .netcl "
          f"in {save_ms:.1f} ms; load_model through a pool: first {first_ms:.1f} ms ({copies} copy), then "
          f"{warm_ms:.2f} ms median (pool allocations since the first load: {pool.stats.misses - misses}); "
          f"np.load + new buffers: {numpy_ms:.2f} ms; forward output bytes identical after the round trip: {same}")
