"""Benchmark of ``load_model(path, pool=pool)`` against the usual ways of getting the same weights onto the device.

Two models: an 8-layer MLP of about 64 MiB (``Linear(1448, 1448)`` x 8) and a
model of 400 small layers (``Linear(16, 16)`` x 400, 800 tensors). For each,
in one process and on the same files (page cache warm: every method reads files
it has read before), the median wall time of:

- ``fastckpt load_model, pool warm``: ``load_model(path, pool=pool)`` where
  the pool already holds a fitting arena (the model of the previous repeat was
  dropped): rebuild + one copy, no allocation;
- ``fastckpt load_model, new pool``: the same with a fresh pool (allocates);
- ``fastckpt load_model, no pool``: one exact-size buffer per tensor;
- ``np.load + new buffers``: ``np.load`` of the ``.netcl`` file, one
  ``cl.Buffer(COPY_HOST_PTR)`` per array (what netcl 0.4.4 does, minus its
  model rebuild);
- ``safetensors + enqueue_copy``: ``safetensors.numpy.load_file`` of the same
  tensors, then one buffer and one blocking ``enqueue_copy`` per tensor.

Only fastckpt's rows rebuild a model object; the baselines only produce buffers.

Run: ``python -m fastckpt.io.bench [--repeats 7]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import numpy as np

__all__ = ["run_benchmark", "main"]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        del result
    return statistics.median(times) * 1e3


def _make_model(queue, kind: str):
    import fastckpt.nn as nn

    if kind == "mlp":
        config = [{"type": "Linear", "args": {"in_features": 1448, "out_features": 1448, "bias": True}}] * 8
    else:
        config = [{"type": "Linear", "args": {"in_features": 16, "out_features": 16, "bias": True}}] * 400
    return nn.build_sequential(queue, config)


def run_benchmark(repeats: int = 7, directory: str | None = None) -> str:
    """Time every method on both models and return the markdown table (also usable from asv or a notebook)."""
    import pyopencl as cl

    from fastckpt.device import default
    from fastckpt.io import load_model, save_model
    from fastckpt.pool import PersistentBufferPool

    try:
        from safetensors.numpy import load_file as st_load, save_file as st_save
    except ImportError:  # optional: a test extra
        st_load = st_save = None

    dev = default()
    ctx, queue = dev.context, dev.queue
    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for kind, label in (("mlp", "MLP, 8 layers"), ("many", "400 small layers")):
            model = _make_model(queue, kind)
            path = os.path.join(tmp, f"{kind}.netcl")
            save_model(model, path)
            state = model.state_dict()
            st_path = os.path.join(tmp, f"{kind}.safetensors")
            if st_save is not None:
                st_save(state, st_path)
            mib = sum(v.nbytes for v in state.values()) / 2**20
            del model

            warm_pool = PersistentBufferPool(ctx, queue)
            load_model(path, pool=warm_pool)  # the arena now exists; its model is dropped at once

            def fastckpt_warm():
                m = load_model(path, pool=warm_pool)
                queue.finish()
                return m

            def fastckpt_new_pool():
                m = load_model(path, pool=PersistentBufferPool(ctx, queue))
                queue.finish()
                return m

            def fastckpt_no_pool():
                m = load_model(path, queue)
                queue.finish()
                return m

            def np_load_buffers():
                flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
                with np.load(path, allow_pickle=False) as z:
                    bufs = [cl.Buffer(ctx, flags, hostbuf=z[k]) for k in z.files if k != "__netcl_meta__"]
                queue.finish()
                return bufs

            def safetensors_copy():
                arrays = st_load(st_path)
                bufs = []
                for a in arrays.values():
                    b = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, a.nbytes)
                    cl.enqueue_copy(queue, b, a, is_blocking=True)
                    bufs.append(b)
                return bufs

            methods = [("fastckpt load_model, pool warm", fastckpt_warm),
                       ("fastckpt load_model, new pool", fastckpt_new_pool),
                       ("fastckpt load_model, no pool", fastckpt_no_pool),
                       ("np.load + new buffers", np_load_buffers)]
            if st_load is not None:
                methods.append(("safetensors + enqueue_copy", safetensors_copy))
            for fn_label, fn in methods:
                fn()  # warm-up: page cache, kernels, imports
                rows.append((label, f"{mib:.1f}", fn_label, _median_ms(fn, repeats)))
            assert warm_pool.stats.misses == 1, warm_pool.stats  # warm loads never allocated

    base = {label: ms for label, _, m, ms in rows if m == "np.load + new buffers"}
    lines = [f"Device: {dev.name}; median of {repeats} runs, page cache warm.", "",
             "| model | MiB | method | median ms | vs np.load |", "|---|---:|---|---:|---:|"]
    for label, mib, method, ms in rows:
        lines.append(f"| {label} | {mib} | {method} | {ms:.2f} | {base[label] / ms:.1f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastckpt.io.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per method (median reported)")
    parser.add_argument("--dir", default=None, help="directory for the temporary files (default: system temp)")
    args = parser.parse_args(argv)
    print(run_benchmark(args.repeats, args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
