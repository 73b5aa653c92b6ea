"""The ``model`` suite: ``load_model(path, pool=pool)`` against the usual ways of getting its weights onto the device.

Two models: an 8-layer MLP of about 64 MiB (``Linear(1448, 1448)`` x 8) and a
model of 400 small layers (``Linear(16, 16)`` x 400, 800 tensors). For each,
in one process and on the same files (page cache warm: every method reads files
it has read before), the median wall time of:

- ``fastckpt load_model, pool warm``: ``load_model(path, pool=pool)`` where
  the pool already holds a fitting arena (the model of the previous run was
  dropped): rebuild + one copy, no allocation;
- ``fastckpt load_model, new pool``: the same with a fresh pool (allocates);
- ``fastckpt load_model, no pool``: one exact-size buffer per tensor;
- ``np.load + new buffers``: ``np.load`` of the ``.netcl`` file, one
  ``cl.Buffer(COPY_HOST_PTR)`` per array (what netcl 0.4.4 does, minus its
  model rebuild);
- ``safetensors + enqueue_copy``: ``safetensors.numpy.load_file`` of the same
  tensors, then one buffer and one blocking ``enqueue_copy`` per tensor;
- ``one copy of the bytes``: one blocking ``enqueue_copy`` of all the weights'
  bytes from one numpy array in RAM into one buffer allocated before (the bound
  a load of those bytes cannot beat).

Only fastckpt's rows rebuild a model object; the baselines only produce buffers.

In one long-lived process the ``no pool`` row's buffers come from memory the
allocator recycles from the previous runs, while a new pool's arena is fresh
memory the kernel must zero. A second table times the first load of a model in
a new process (``--repeats`` processes per method, alternating; each loads a
tiny model first, so imports, kernels and the device's first allocation are not
counted): ``load_model(path, pool=<new pool>)`` against ``load_model(path,
queue)``, where both paths get fresh memory, as a server's first load does.

After the tables come the targets, each met or MISSED: the 400 small layers load
through a warm pool in at most 1.5 ms; the MLP's warm load takes at most 1.15x
one copy of its bytes; a first load through a new pool takes at most 1.3x a load
without a pool (both models; in one process and in new processes).
The methods of one model are timed round-robin (:func:`fastckpt.bench.timing.round_robin`,
``--repeats`` rounds, one untimed warm-up run each); what a method returns is
dropped after its clock stops.

Run: ``python -m fastckpt bench --suite model [--repeats 7]``; prints a markdown table (``--quick``: one run
and one new process per method, a smoke run of seconds).

>>> from fastckpt.cli import main
>>> main(["bench", "--suite", "model", "--repeats", "1"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from fastckpt.bench.timing import add_repeat_option, round_robin, table_lines
from fastckpt.words import plural

__all__ = ["configure", "run", "measure", "first_loads_in_new_processes"]

WARM = "fastckpt load_model, pool warm"
NEW_POOL = "fastckpt load_model, new pool"
NO_POOL = "fastckpt load_model, no pool"
NPLOAD = "np.load + new buffers"
SAFETENSORS = "safetensors + enqueue_copy"
ONE_COPY = "one copy of the bytes"

SMALL_WARM_MAX = 1.5e-3  # seconds: 400 small layers through a warm pool
WARM_OVER_COPY_MAX = 1.15  # the MLP's warm load against one copy of its bytes
NEW_POOL_OVER_NO_POOL_MAX = 1.3  # a first load through a new pool against a load without one


def _make_model(queue, kind: str):
    import fastckpt.nn as nn

    if kind == "mlp":
        config = [{"type": "Linear", "args": {"in_features": 1448, "out_features": 1448, "bias": True}}] * 8
    elif kind == "tiny":
        config = [{"type": "Linear", "args": {"in_features": 2, "out_features": 2, "bias": True}}]
    else:
        config = [{"type": "Linear", "args": {"in_features": 16, "out_features": 16, "bias": True}}] * 400
    return nn.build_sequential(queue, config)


def measure(repeats: int = 7, directory: str | None = None) -> str:
    """Time every method on both models and return the markdown table (also usable from asv or a notebook).

    >>> print(measure(repeats=1))  # doctest: +SKIP
    """
    import pyopencl as cl

    from fastckpt.device import default
    from fastckpt.device.pool import PersistentBufferPool
    from fastckpt.io import load_model, save_model

    try:
        from safetensors.numpy import load_file as st_load
        from safetensors.numpy import save_file as st_save
    except ImportError:  # optional: a test extra
        st_load = st_save = None

    dev = default()
    ctx, queue = dev.context, dev.queue
    rows = []
    verdicts = []
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
            flat = np.concatenate([v.reshape(-1).view(np.uint8) for v in state.values()])
            one = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, flat.nbytes)
            del model, state

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

            def one_copy(one=one, flat=flat):
                cl.enqueue_copy(queue, one, flat, is_blocking=True)

            methods = {WARM: fastckpt_warm, NEW_POOL: fastckpt_new_pool, NO_POOL: fastckpt_no_pool,
                       NPLOAD: np_load_buffers}
            if st_load is not None:
                methods[SAFETENSORS] = safetensors_copy
            methods[ONE_COPY] = one_copy
            # warm-up run first (page cache, kernels, imports); results dropped untimed, as a loaded model is
            # what is measured, not its release
            timings = round_robin(methods, repeats, time_release=False)
            rows += [(label, f"{mib:.1f}", method, timing.median * 1e3) for method, timing in timings.items()]
            assert warm_pool.stats.misses == 1, warm_pool.stats  # warm loads never allocated
            verdicts += _verdicts(kind, label, {method: timing.median for method, timing in timings.items()})
            del one, flat

        tiny = os.path.join(tmp, "tiny.netcl")
        save_model(_make_model(queue, "tiny"), tiny)
        fresh_rows = []
        for kind, label in (("mlp", "MLP, 8 layers"), ("many", "400 small layers")):
            t = first_loads_in_new_processes(os.path.join(tmp, f"{kind}.netcl"), tiny, repeats)
            fresh_rows += [[label, method, f"{ms * 1e3:.2f}", f"{min(times) * 1e3:.2f}"]
                           for method, times in t.items() for ms in [float(np.median(times))]]
            new, no = float(np.median(t[NEW_POOL])), float(np.median(t[NO_POOL]))
            verdicts.append(f"- {'met' if new / no <= NEW_POOL_OVER_NO_POOL_MAX else 'MISSED'}: {label}, first load "
                            f"in a new process, new pool <= {NEW_POOL_OVER_NO_POOL_MAX:.1f}x no pool: {new / no:.2f}x "
                            f"({new * 1e3:.2f} ms / {no * 1e3:.2f} ms)")

    base = {label: ms for label, _, m, ms in rows if m == NPLOAD}
    body = [[label, mib, method, f"{ms:.2f}", f"{base[label] / ms:.1f}x"] for label, mib, method, ms in rows]
    lines = [f"Device: {dev.name}; median of {plural(repeats, 'run')}, page cache warm.", "",
             *table_lines(["model", "MiB", "method", "median ms", "vs np.load"], body, "lrlrr"),
             "", f"### first load in a new process ({repeats} processes per method)", "",
             *table_lines(["model", "method", "median ms", "best ms"], fresh_rows, "llrr"),
             "", "### targets", "", *verdicts]
    return "\n".join(lines)


_FIRST_LOAD = """
import sys, time
from fastckpt.device import default
from fastckpt.device.pool import PersistentBufferPool
from fastckpt.io import load_model
method, path, tiny = sys.argv[1:4]
queue = default().queue
load_model(tiny, queue)  # imports, kernels, the device's first allocation: not the model's load
queue.finish()
start = time.perf_counter()
model = load_model(path, pool=PersistentBufferPool(queue.context, queue)) if method == "pool" else load_model(path, queue)
queue.finish()
print(time.perf_counter() - start)
"""


def first_loads_in_new_processes(path: str, tiny: str, repeats: int) -> dict:
    """Seconds of the first ``load_model`` of ``path`` in new processes: ``{NEW_POOL: [...], NO_POOL: [...]}``,
    ``repeats`` processes each, alternating which goes first; each process loads ``tiny`` before.

    >>> first_loads_in_new_processes("model.netcl", "tiny.netcl", 3)  # doctest: +SKIP
    {'fastckpt load_model, new pool': [0.0141, ...], 'fastckpt load_model, no pool': [0.0402, ...]}
    """
    import subprocess
    import sys

    import fastckpt

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = {NEW_POOL: [], NO_POOL: []}
    for i in range(repeats):
        for method in (("pool", "nopool") if i % 2 else ("nopool", "pool")):
            done = subprocess.run([sys.executable, "-c", _FIRST_LOAD, method, path, tiny], capture_output=True,
                                  text=True, env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"first-load process ({method}) failed: {done.stderr.strip()[-2000:]}")
            out[NEW_POOL if method == "pool" else NO_POOL].append(float(done.stdout.strip().splitlines()[-1]))
    return out


def _verdicts(kind: str, label: str, t: dict) -> list[str]:
    """The target lines of one model (medians in seconds), each ``- met: ...`` or ``- MISSED: ...``.

    >>> for line in _verdicts("many", "400 small layers", {WARM: 1e-3, NEW_POOL: 6e-3, NO_POOL: 4e-3}):
    ...     print(line)
    - met: 400 small layers, pool warm <= 1.5 ms: 1.00 ms
    - MISSED: 400 small layers, new pool <= 1.3x no pool: 1.50x (6.00 ms / 4.00 ms)
    """
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else 'MISSED'}: {text}")

    if kind == "many":
        line(t[WARM] <= SMALL_WARM_MAX, f"{label}, pool warm <= {SMALL_WARM_MAX * 1e3:.1f} ms: {t[WARM] * 1e3:.2f} ms")
    else:
        r = t[WARM] / t[ONE_COPY]
        line(r <= WARM_OVER_COPY_MAX, f"{label}, pool warm <= {WARM_OVER_COPY_MAX:.2f}x one copy of its bytes: "
                                      f"{r:.2f}x ({t[WARM] * 1e3:.2f} ms / {t[ONE_COPY] * 1e3:.2f} ms)")
    r = t[NEW_POOL] / t[NO_POOL]
    line(r <= NEW_POOL_OVER_NO_POOL_MAX, f"{label}, new pool <= {NEW_POOL_OVER_NO_POOL_MAX:.1f}x no pool: {r:.2f}x "
                                         f"({t[NEW_POOL] * 1e3:.2f} ms / {t[NO_POOL] * 1e3:.2f} ms)")
    return out


REPEATS, QUICK_REPEATS = 7, 1


def repeats_of(args) -> int:
    """The runs per method that parsed options ask for: ``--repeats``, else 1 with ``--quick``, else 7.

    >>> import argparse
    >>> repeats_of(argparse.Namespace(repeats=None, quick=True)), repeats_of(argparse.Namespace(repeats=5, quick=True))
    (1, 5)
    """
    if args.repeats is not None:
        return args.repeats
    return QUICK_REPEATS if args.quick else REPEATS


def configure(parser) -> None:
    """Add the model suite's options to ``parser`` (an :class:`argparse.ArgumentParser`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> configure(parser)
    >>> parser.parse_args([]).repeats, repeats_of(parser.parse_args([])), repeats_of(parser.parse_args(["--quick"]))
    (None, 7, 1)
    """
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEATS} runs and new processes per method instead of {REPEATS} (seconds)")
    add_repeat_option(parser, dest="repeats", default=None,
                      help=f"timed runs per method, median reported (default {REPEATS}; --quick {QUICK_REPEATS})")
    parser.add_argument("--dir", default=None, help="directory for the temporary files (default: system temp)")


def run(args) -> int:
    """Run the model suite with parsed options; prints the markdown table and the targets, returns 0.

    >>> from fastckpt.cli import main
    >>> main(["bench", "--suite", "model", "--repeats", "1"])  # doctest: +SKIP
    """
    repeats = repeats_of(args)
    if repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    print(measure(repeats, args.dir))
    return 0
