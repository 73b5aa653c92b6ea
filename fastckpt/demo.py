"""``fastckpt demo``: write a file, read it back through the mapping, and say how long each step took."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

__all__ = ["configure", "run"]


def configure(parser) -> None:
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    parser.add_argument("--mib", type=float, default=64.0, help="total size in MiB (default 64)")


def run(args) -> int:
    import fastckpt

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
            aligned = all(i.offset % 4096 == 0 for i in fastckpt.open(path).infos.values()) if fmt == "npz" else None
            print(f"{fmt:12s} saved {len(tensors)} tensors ({os.path.getsize(path) / 2**20:.1f} MiB) in "
                  f"{(t1 - t0) * 1e3:.1f} ms (atomic, fsynced); opened with zero-copy views in "
                  f"{(t2 - t1) * 1e3:.2f} ms; bytes identical: {exact}"
                  + (f"; payloads 4096-aligned: {aligned}" if aligned is not None else ""))
    return 0
