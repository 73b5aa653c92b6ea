"""The cold case of tools/gpu-check.sh: loads of a file that is not in the page cache, each in a fresh process.

    python3 tools/gpu-cold.py [--quick] [--kind gpu|cpu] [--runs 5] [--mib 4096] [--dir DIR]

Writes a safetensors file (4 GiB in float32 tensors of 64 MiB, --mib sets the size; --quick: 64 MiB in 16), then, --runs times in
turn, each in a new process after ``posix_fadvise(DONTNEED)`` on the file (its pages written back first, no mapping
of it alive), every row below. The bound is the fastest of the plain reads: a buffered read of the file 64 MiB at a
time into one reused buffer, and ``O_DIRECT`` ``preadv`` on 8 and 16 threads into page-aligned memory (the cold
suite's own bound rows, :mod:`fastckpt.bench.cold`). The loads: ``load_file(path, queue)`` (staged where the device
does not share host memory; staging forced with ``--kind cpu``, so the script runs where there is no GPU), the same
with a new :class:`~fastckpt.device.pool.PersistentBufferPool` (a serving process's first load), and, where torch
with CUDA is importable, ``safetensors.torch.load_file(path, device="cuda")``, every tensor of every load read back
and compared with the file. Prints one markdown table: medians, GB/s, share of the bound, exact, each run's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHUNK = 64 << 20
ROWS = {
    "read": "bound: plain buffered read, 64 MiB at a time",
    "direct8": "bound: O_DIRECT preadv, 8 threads",
    "direct16": "bound: O_DIRECT preadv, 16 threads",
    "load": "load_file(path, queue), no pool",
    "pooled": "load_file(path, queue, pool=new pool)",
    "pooled-64": "the same with 0.5.0's staging (64 MiB chunks, up to 16 fill threads)",
    "torch": "safetensors.torch.load_file(path, device='cuda')",
}
BOUNDS = ("read", "direct8", "direct16")


def drop(path: str) -> None:
    """Drop the file's pages from the page cache (written back first: only clean pages are dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def has_torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def one(kind: str, path: str, device: str) -> dict:
    """One measurement in this (fresh) process: seconds, whether the bytes were exact, the staging shape."""
    import numpy as np

    import fastckpt

    if kind == "torch":
        import torch
        from safetensors.torch import load_file as torch_load

        torch.zeros(1, device="cuda")  # CUDA started before the clock
        torch.cuda.synchronize()
        drop(path)
        began = time.perf_counter()
        loaded = torch_load(path, device="cuda")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        with fastckpt.open(path) as tf:
            exact = all(np.array_equal(loaded[name].cpu().numpy().view(np.uint8), tf.host(name).view(np.uint8))
                        for name in tf.keys())
        return {"seconds": seconds, "exact": exact, "staging": None}
    if kind in BOUNDS:
        drop(path)
        if kind == "read":
            buf = bytearray(CHUNK)
            began = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        else:
            from fastckpt.bench.cold import _bound_preadv

            began = time.perf_counter()
            _bound_preadv(path, os.path.getsize(path), int(kind[len("direct"):]), True)
        return {"seconds": time.perf_counter() - began, "exact": None, "staging": None}
    from fastckpt.device import default, staging
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    if kind == "pooled-64":  # the staging constants 0.5.0 had, for a comparison in the same run
        staging.STAGING_CHUNK, staging.MAX_FILL_THREADS = 64 << 20, 16
    dev = default(device)
    dev.queue.finish()  # the device started before the clock
    pool = PersistentBufferPool(dev.context, dev.queue) if kind.startswith("pooled") else None
    drop(path)
    began = time.perf_counter()
    loaded = load_file(path, dev.queue, pool=pool, staging=None if device == "gpu" else True)
    seconds = time.perf_counter() - began
    report = loaded.report
    with fastckpt.open(path) as tf:
        exact = all(np.array_equal(loaded[name].to_host().view(np.uint8), tf.host(name).view(np.uint8))
                    for name in tf.keys())
    return {"seconds": seconds, "exact": exact, "staging": [report.staging_buffers, report.staging_chunk,
                                                            report.fill_threads]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kind", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=4096, help="size of the file (64 MiB tensors)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--one", nargs=2, metavar=("WHAT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.kind)))
        return 0
    import numpy as np

    import fastckpt

    count, elems = (16, 1 << 20) if args.quick else (max(1, args.mib // 64), 1 << 24)
    rng = np.random.default_rng(0)
    kinds = [k for k in ROWS if k != "torch" or (args.kind == "gpu" and has_torch_cuda())]
    with tempfile.TemporaryDirectory(prefix="fastckpt-gpu-cold-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        fastckpt.save_safetensors(path, {f"t{i:02d}": rng.standard_normal(elems, dtype=np.float32)
                                         for i in range(count)}, fsync=True)
        nbytes = os.path.getsize(path)
        runs: dict = {k: [] for k in kinds}
        for _ in range(args.runs):
            for what in runs:  # in turn, so that the disk's moods hit every row alike
                done = subprocess.run([sys.executable, __file__, "--kind", args.kind, "--one", what, path],
                                      capture_output=True, text=True)
                if done.returncode:
                    runs[what].append({"seconds": float("nan"), "exact": False, "staging": None,
                                       "error": done.stderr.strip().splitlines()[-1:]})
                    print(f"{what}: {done.stderr.strip()[-2000:]}", file=sys.stderr)
                else:
                    runs[what].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {what: statistics.median(r["seconds"] for r in runs[what]) for what in runs}
    bound_row = min(BOUNDS, key=lambda k: median[k])
    bound = median[bound_row]
    print(f"### cold: {nbytes >> 20} MiB safetensors, dropped from the page cache before each run, a new process "
          f"each ({args.kind}, {os.cpu_count()} cores, medians of {args.runs}); the bound is the fastest plain read "
          f"({ROWS[bound_row]})\n")
    print("| path | median | GB/s | share of the bound | exact | staging (buffers, chunk, fill threads) | runs (s) |")
    print("|---|---:|---:|---:|---|---|---|")
    for what in runs:
        seconds = median[what]
        exact = {r["exact"] for r in runs[what]}
        shape = runs[what][0]["staging"]
        each = ", ".join(f"{r['seconds']:.3f}" for r in runs[what])
        print(f"| {ROWS[what]} | {seconds * 1e3:.1f} ms | {nbytes / seconds / 1e9:.2f} | {bound / seconds:.2f} | "
              f"{'-' if exact == {None} else ('yes' if exact == {True} else 'NO')} | "
              f"{'-' if shape is None else f'{shape[0]} x {shape[1] >> 20} MiB, {shape[2]}'} | {each} |")
    ok = all(r["exact"] for what in ("load", "pooled") for r in runs[what])
    print(f"\n- {'met' if ok else 'MISSED'}: the cold loads are exact")
    for what in ("load", "pooled"):
        share = bound / median[what]
        print(f"- {'met' if share >= 0.9 else 'MISSED'}: cold {ROWS[what]} >= 0.9x the bound ({share:.2f}x)")
    if "torch" in runs:
        ahead = median["pooled"] < median["torch"]
        print(f"- {'met' if ahead else 'MISSED'}: the cold pooled load ahead of safetensors.torch "
              f"({median['torch'] / median['pooled']:.2f}x its speed)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
