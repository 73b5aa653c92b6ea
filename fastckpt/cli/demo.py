"""``fastckpt demo``: one line per capability a new user tries first, each checked and timed.

The device it ran on; tensor files written and read back zero-copy; a ``.netcl``
model file loaded through a pool and run; a training checkpoint resumed bit for
bit; a TensorFlow checkpoint written and read without TensorFlow; a sharded
save (on 2 MPI ranks when ``mpiexec`` and ``mpi4py`` are installed, else on 2
thread ranks) loaded on 3 ranks. Every line says whether the bytes came back
identical.
"""

from __future__ import annotations

import os
import tempfile
import time

from fastckpt.words import plural

__all__ = ["HELP", "add_parser", "run"]

HELP = "try each capability once on the default device (files, model, training, TF, sharded), with timings"


def add_parser(subparsers):
    parser = subparsers.add_parser("demo", help=HELP, description=HELP)
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    parser.add_argument("--mib", type=float, default=64.0, help="total size in MiB (default 64)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="hidden width of the demo MLP saved as a .netcl model file (default 1024)")
    parser.add_argument("--ids", type=int, default=1_000_000,
                        help="ids in the sharded demo's embedding table (default 1,000,000)")
    return parser


def run(args) -> int:
    import numpy as np

    import fastckpt
    import fastckpt._native.npz  # noqa: F401  (imported here so that the timings below are of the work, not the import)
    import fastckpt._native.safetensors  # noqa: F401
    from fastckpt.device import default

    dev = default()
    print(f"device       {dev.name} ({dev.kind}, {'unified' if dev.host_unified_memory else 'discrete'} memory)")
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
            aligned = all(i.offset % (4096 if i.nbytes >= 65536 else 64) == 0  # the "auto" alignment policy
                          for i in f.infos.values()) if fmt == "npz" else None
            print(f"{fmt:12s} saved {len(tensors)} tensors ({os.path.getsize(path) / 2**20:.1f} MiB) in "
                  f"{(t1 - t0) * 1e3:.1f} ms (atomic, fsynced); opened with zero-copy views in "
                  f"{(t2 - t1) * 1e3:.2f} ms; bytes identical: {exact}"
                  + (f"; payloads aligned (4096 from 64 KiB, else 64): {aligned}" if aligned is not None else ""))
        _model_demo(tmp, args.hidden)
        _training_demo(tmp)
        _tf_demo(tmp)
        _sharded_demo(tmp, args.ids)
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
          f"in {save_ms:.1f} ms; load_model through a pool: first {first_ms:.1f} ms ({plural(copies, 'copy')}), then "
          f"{warm_ms:.2f} ms median (pool allocations since the first load: {pool.stats.misses - misses}); "
          f"np.load + new buffers: {numpy_ms:.2f} ms; forward output bytes identical after the round trip: {same}")


def _training_demo(tmp: str) -> None:
    """Train a few steps, save, go on; resume fresh objects from the checkpoint and compare every later loss."""
    from fastckpt.train import apply_checkpoint, load_checkpoint, save_checkpoint
    from fastckpt.train.reference.selfcheck import build_fresh, train_n_steps

    run = build_fresh(seed=0)
    train_n_steps(run, 10)
    path = os.path.join(tmp, "train", "step-10")
    t0 = time.perf_counter()
    save_checkpoint(*run.save_args(), path, step=10, scaler=run.scaler)
    save_ms = (time.perf_counter() - t0) * 1e3
    expected = train_n_steps(run, 10)
    resumed = build_fresh(seed=1)  # other weights and seeds: everything must come from the checkpoint
    t0 = time.perf_counter()
    apply_checkpoint(load_checkpoint(path), *resumed.save_args(), scaler=resumed.scaler)
    load_ms = (time.perf_counter() - t0) * 1e3
    same = [x.tobytes() for x in train_n_steps(resumed, 10)] == [x.tobytes() for x in expected]
    print(f"training     saved model, optimizer, scheduler, data iterator, RNG and loss scaler at step 10 in "
          f"{save_ms:.1f} ms; loaded and verified in {load_ms:.1f} ms; the next 10 losses after the resume "
          f"identical bit for bit: {same}")


def _tf_demo(tmp: str) -> None:
    """Write a TensorFlow v2 checkpoint without TensorFlow and read it back through the same reader contract."""
    import numpy as np

    import fastckpt
    from fastckpt.tf import write_checkpoint

    rng = np.random.default_rng(2)
    tensors = {f"model/dense_{i}/kernel": rng.standard_normal((256, 256), dtype=np.float32) for i in range(8)}
    prefix = os.path.join(tmp, "tf", "ckpt-1")
    t0 = time.perf_counter()
    write_checkpoint(prefix, tensors, object_graph=True)
    t1 = time.perf_counter()
    with fastckpt.open(prefix) as ckpt:
        keys = [k for k in ckpt if k.endswith("/.ATTRIBUTES/VARIABLE_VALUE")]
        same = all(np.array_equal(ckpt.host(f"{name}/.ATTRIBUTES/VARIABLE_VALUE"), value)
                   for name, value in tensors.items())
    t2 = time.perf_counter()
    print(f"TensorFlow   wrote a v2 checkpoint (index, data shard, object graph; {len(keys)} variables) in "
          f"{(t1 - t0) * 1e3:.1f} ms and read its {len(tensors)} kernels back with CRC-32C checks in "
          f"{(t2 - t1) * 1e3:.1f} ms, no TensorFlow needed; values identical: {same}")


# Each rank of the sharded demo holds this: executed by the MPI ranks and by the demo itself.
_SHARDED_STATE = r"""
import numpy as np
from fastckpt.sharded import HashTable

def demo_state(rank, world, ids=1_000_000, dim=16):
    all_ids = np.arange(ids, dtype=np.int64) * 7919
    mine = all_ids[all_ids % world == rank]
    table = HashTable(dim, slots=("m", "v"))
    values = (mine % 1009).astype(np.float32)[:, None] + np.arange(dim, dtype=np.float32)
    table.insert(mine, values, {"m": values / 2, "v": values / 4})
    dense = {"mlp.weight": np.arange(512 * 256, dtype=np.float32).reshape(512, 256)}
    return {"emb": table}, dense
"""

_SHARDED_RANK = _SHARDED_STATE + r"""
import sys
from mpi4py import MPI
from fastckpt.sharded import Saver

rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
tables, dense = demo_state(rank, world, int(sys.argv[2]))
Saver(shard_index=rank, shard_num=world, parallel=2, path=sys.argv[1], hashtables=tables, tensors=dense).save()
"""


def _mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python when mpi4py is importable (:func:`fastckpt.sharded.engine.mpiexec`)."""
    from fastckpt.sharded.engine import mpiexec

    return mpiexec()


def _sharded_demo(tmp: str, ids: int = 1_000_000) -> None:
    """Save a table of ``ids`` ids with Adam slots and a dense tensor on 2 ranks, load it on 3, compare every row."""
    import subprocess
    import sys
    import threading

    import numpy as np

    from fastckpt.sharded import HashTable, Loader, Saver
    from fastckpt.sharded.engine import ThreadEngine

    scope: dict = {}
    exec(_SHARDED_STATE, scope)  # the same state the MPI ranks build
    demo_state = scope["demo_state"]
    path = os.path.join(tmp, "sharded", "step-1")
    mpiexec, how = _mpiexec(), "2 MPI ranks"
    t0 = time.perf_counter()
    if mpiexec is not None:
        script = os.path.join(tmp, "sharded_rank.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(_SHARDED_RANK)
        done = subprocess.run([mpiexec, "-n", "2", sys.executable, script, path, str(ids)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:  # an MPI that cannot start here (no network namespace, ...): say so, use threads
            how = f"2 thread ranks (mpiexec failed: {done.stderr.strip().splitlines()[-1:]})"
            mpiexec = None
    if mpiexec is None:
        how = how if how != "2 MPI ranks" else "2 thread ranks (mpi4py or mpiexec not installed)"
        engines = ThreadEngine.group(2)

        def save(rank: int) -> None:
            tables, dense = demo_state(rank, 2, ids)
            Saver(shard_index=rank, shard_num=2, parallel=2, path=path, hashtables=tables, tensors=dense,
                  engine=engines[rank]).save()

        threads = [threading.Thread(target=save, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    save_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    loaded = [Loader(path, hashtables={"emb": HashTable(16, slots=("m", "v"))}, shard_index=r, shard_num=3).load()
              for r in range(3)]
    load_s = time.perf_counter() - t0
    tables, dense = demo_state(0, 1, ids)  # the whole state, as one rank holds it
    want_ids, want_values, want_slots = tables["emb"].export()
    order = np.argsort(want_ids)
    got = [t["emb"].export() for t, _ in loaded]
    got_ids = np.concatenate([g[0] for g in got])
    got_order = np.argsort(got_ids)
    same = (np.array_equal(got_ids[got_order], want_ids[order])
            and np.array_equal(np.concatenate([g[1] for g in got])[got_order], want_values[order])
            and all(np.array_equal(np.concatenate([g[2][s] for g in got])[got_order], want_slots[s][order])
                    for s in ("m", "v"))
            and all(np.array_equal(d["mlp.weight"], dense["mlp.weight"]) for _, d in loaded))
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    # The same checkpoint as RecIS's own files (2 ranks, ids by RecIS's slice rule), loaded back on one rank.
    from fastckpt.sharded.reshard import reshard

    t0 = time.perf_counter()
    recis = reshard(path, os.path.join(tmp, "sharded", "recis-1"), 2, layout="recis")
    back, back_dense = Loader(recis, hashtables={"emb": HashTable(16, slots=("m", "v"))}).load()
    recis_s = time.perf_counter() - t0
    b_ids, b_values, b_slots = back["emb"].export()
    b_order = np.argsort(b_ids)
    same_recis = (np.array_equal(b_ids[b_order], want_ids[order])
                  and np.array_equal(b_values[b_order], want_values[order])
                  and all(np.array_equal(b_slots[s][b_order], want_slots[s][order]) for s in ("m", "v"))
                  and np.array_equal(back_dense["mlp.weight"], dense["mlp.weight"]))
    print(f"sharded      saved {ids:,} ids x 16 float32 with Adam's m and v ({nbytes / 2**20:.0f} MiB) on {how} in "
          f"{save_s:.2f} s (starting the ranks included); loaded on 3 ranks (resharded 2 -> 3) in {load_s:.2f} s; "
          f"written as RecIS's own layout and loaded back in {recis_s:.2f} s, identical: {same_recis}; "
          f"every row identical: {same}")
