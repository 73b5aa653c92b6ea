"""The cold case of tools/gpu-check.sh: a staged load of a file that is not in the page cache, in a fresh process.

    python3 tools/gpu-cold.py [--quick] [--kind gpu|cpu] [--runs 5] [--dir DIR]

Writes a safetensors file (4 GiB in 64 float32 tensors of 64 MiB; --quick: 64 MiB in 16), then, --runs times in
turn, each in a new process after ``posix_fadvise(DONTNEED)`` on the file (its pages written back first, no mapping
of it alive): the bound, a plain buffered read of the file 64 MiB at a time into one reused buffer; and
``load_file(path, queue)`` on the device (staged where the device does not share host memory; staging forced with
``--kind cpu``, so the script runs where there is no GPU), every tensor read back and compared with the file.
Prints one markdown table: medians, GB/s, share of the bound, exact, and each run's seconds.
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


def drop(path: str) -> None:
    """Drop the file's pages from the page cache (written back first: only clean pages are dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def one(kind: str, path: str, device: str) -> dict:
    """One measurement in this (fresh) process: seconds and whether the bytes were exact."""
    import numpy as np

    drop(path)
    if kind == "read":
        buf = bytearray(CHUNK)
        began = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return {"seconds": time.perf_counter() - began, "exact": None}
    import fastckpt
    from fastckpt.device import default
    from fastckpt.device.load import load_file

    dev = default(device)
    dev.queue.finish()  # the device started before the clock
    began = time.perf_counter()
    loaded = load_file(path, dev.queue, staging=None if device == "gpu" else True)
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
    parser.add_argument("--dir", default=None)
    parser.add_argument("--one", nargs=2, metavar=("WHAT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.kind)))
        return 0
    import numpy as np

    import fastckpt

    count, elems = (16, 1 << 20) if args.quick else (64, 1 << 24)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="fastckpt-gpu-cold-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        fastckpt.save_safetensors(path, {f"t{i:02d}": rng.standard_normal(elems, dtype=np.float32)
                                         for i in range(count)}, fsync=True)
        nbytes = os.path.getsize(path)
        runs: dict = {"read": [], "load": []}
        for _ in range(args.runs):
            for what in runs:  # in turn, so that the disk's moods hit both alike
                out = subprocess.run([sys.executable, __file__, "--kind", args.kind, "--one", what, path],
                                     check=True, capture_output=True, text=True).stdout
                runs[what].append(json.loads(out.strip().splitlines()[-1]))
    bound = statistics.median(r["seconds"] for r in runs["read"])
    print(f"### cold: {nbytes >> 20} MiB safetensors, dropped from the page cache before each run, a new process "
          f"each ({args.kind}, medians of {args.runs})\n")
    print("| path | median | GB/s | share of the bound | exact | runs (s) |")
    print("|---|---:|---:|---:|---|---|")
    for what, label in (("read", "bound: plain buffered read, 64 MiB at a time"),
                        ("load", f"load_file(path, queue), staged {runs['load'][0]['staging']} "
                                 "(buffers, chunk, fill threads), no pool")):
        seconds = statistics.median(r["seconds"] for r in runs[what])
        exact = {r["exact"] for r in runs[what]}
        each = ", ".join(f"{r['seconds']:.3f}" for r in runs[what])
        print(f"| {label} | {seconds * 1e3:.1f} ms | {nbytes / seconds / 1e9:.2f} | {bound / seconds:.2f} | "
              f"{'-' if exact == {None} else ('yes' if exact == {True} else 'NO')} | "
              f"{each} |")
    ok = all(r["exact"] for r in runs["load"])
    print(f"\n- {'met' if ok else 'MISSED'}: the cold staged load is exact")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
