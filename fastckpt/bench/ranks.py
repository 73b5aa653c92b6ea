"""The ``ranks`` suite: what each rank of a sharded load pays to open a checkpoint of many files, as threads and
under MPI.

``python -m fastckpt bench --suite ranks [--files 16,32,64] [--ranks 4] [--ids N] [--dim D] [--dense-mib M]
[--repeat R] [--against DIR] [--mpi/--no-mpi] [--layout fastckpt|recis|both] [--steady [--steady-ids N]
[--steady-dense-mib M]] [--dir DIR] [--quick]``

For each file count F of ``--files``, one checkpoint is saved by ``--ranks`` ranks (threads) with ``F / ranks``
writers each: a :class:`~fastckpt.sharded.HashTable` of ``--ids`` ids x ``--dim`` float32 with Adam's ``m`` and
``v`` (each rank holding the ids of its own key-space slice, as a training job under the slice rule holds them)
and ``--dense-mib`` MiB of dense float32 matrices. The data is small on purpose (default 100,000 ids x 16, 4
MiB dense: 19 MiB), so that what a rank pays for the files it opens, rather than for the bytes it copies, is
what moves the figures. ``--layout recis`` saves RecIS's layout instead (``Saver(layout="recis")``: the dense
matrices whole in rank 0's files, and only writers given a block write a file, so the files written, which the
table gives beside the files asked, may be fewer); ``--layout both`` saves both and runs them in the same rounds,
and adds a table of RecIS's layout's figures over fastckpt's at the same files asked, ranks and state.

Then every rank's share is loaded back (:class:`~fastckpt.sharded.Loader`, ``verify=False``, ``dense="rows"``,
``shard_index=r``, ``shard_num=ranks``), in a fresh process every run (a restart's first load: nothing of the
checkpoint checked or opened before in that process, page cache warm), two ways:

* **threads**: one process, the ranks as threads, each its own ``Loader``;
* **MPI**: ``mpiexec -n ranks``, one process a rank (as a training job loads; mpi4py and MPICH from the
  ``mpi`` extra), each timing its own load after a barrier.

Each row gives, medians over ``--repeat`` runs: the *opening per rank*, the CPU time spent opening the
checkpoint (``CheckpointReader.__init__``; the loader's ``resolve_chain``, where a load of fastckpt's layout reads
and checks its metadata before its reader opens, which RecIS's reader does in its ``__init__``: 0.9.0's suite
left it out, so fastckpt's layout's figures were short of that reading and checking; and where files open on first
use each file's opening, its pin, map, header parse and checks; CPU time of the thread that opens, so that ranks
as threads waiting for the GIL or for one another are not counted; ranks as threads share one reader, so its
time is divided by the ranks); the tensor
files mapped per rank (each map of a tensor file counted, summed over ranks and divided by the ranks); the
slowest rank's wall time of the load (what the job waits for); and the CPU time per rank (process CPU time,
divided by the ranks for threads). With
``--against DIR`` (a built checkout of an earlier fastckpt, e.g. /work/wt/base-0.7) the same runs are made
with that fastckpt in the same rounds, interleaved (every version once per round, in a shuffled order), and
the ratios before / after are printed. Every load is checked: each rank's ids are exactly those of its slice.

``--steady`` adds a second table: repeated loads, each path alone in a process of its own (so that neither
feeds the other memory its allocator kept), ``--steady-ids`` ids x ``--dim`` of the sharded suite's state
(default 1,000,000 ids x 16 with ``m`` and ``v`` + 64 MiB dense, ``--ranks`` ranks as threads, 4 writers each):
the raw threaded ``readinto`` of the same bytes into ``np.empty`` buffers (:func:`fastckpt.bench.sharded.
raw_load`, the sharded suite's bound) against every rank's ``Loader.load(verify=False)``
(:func:`fastckpt.bench.sharded.sharded_load`), ``--repeat`` runs each after one untimed run, medians of wall
time, CPU time and minor page faults; with ``--against``, the earlier fastckpt's load too.

>>> results = measure(files=(4,), ranks=2, ids=2000, dim=4, dense_mib=0.25, repeat=1, mpi=False)
>>> [row["files"] for row in results["rows"]], results["rows"][0]["mapped"]
([4], 2.0)
>>> "| files | ranks | mode |" in report(results)
True
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastckpt.bench.timing import add_repeat_option, format_duration, format_ratio, table_lines

__all__ = ["configure", "options", "run", "measure", "report"]

#: ``--layout both`` runs these, in the same rounds.
LAYOUTS = ("recis", "fastckpt")
DEFAULTS = {"files": (16, 32, 64), "ranks": 4, "ids": 100_000, "dim": 16, "dense_mib": 4.0, "repeat": 5}
QUICK = {"files": (4, 8), "ranks": 2, "ids": 20_000, "dim": 8, "dense_mib": 1.0, "repeat": 1}
TIMEOUT = 300


def _here() -> str:
    import fastckpt

    return os.path.dirname(os.path.dirname(os.path.abspath(fastckpt.__file__)))


def _mpiexec() -> str | None:
    from fastckpt.sharded.engine import mpiexec

    return mpiexec(search_path=True)


def _save(path: Path, files: int, ranks: int, ids: int, dim: int, dense_mib: float, layout: str = "fastckpt") -> int:
    """Save the suite's state to ``path``; returns the tensor files written."""
    from fastckpt.bench.sharded import dense_tensors, rank_state, sharded_save, table_ids

    all_ids = table_ids(ids)
    states = [rank_state(all_ids, dim, r, ranks) for r in range(ranks)]
    sharded_save(path, states, dense_tensors(dense_mib), files // ranks,
                 **({"layout": layout} if layout != "fastckpt" else {}))
    return sum(1 for name in os.listdir(path) if name.endswith(".safetensors"))


def _rank_load(path: str, rank: int, ranks: int, dim: int) -> dict[str, Any]:
    """One rank's load, timed (wall and this thread's CPU), with the ids checked to be its slice's."""
    import numpy as np

    from fastckpt.sharded import HashTable, Loader
    from fastckpt.sharded.recis import slice_owner

    tables = {"emb": HashTable(dim, slots=("m", "v"), name="emb")}
    started, cpu = time.perf_counter(), time.thread_time()
    Loader(path, hashtables=tables, tensors={}, shard_index=rank, shard_num=ranks, dense="rows", verify=False,
           parallel=4).load()
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    ids = tables["emb"].ids()
    if len(ids) == 0 or not bool(np.all(slice_owner(ids, ranks) == rank)):
        raise RuntimeError(f"rank {rank} of {ranks} loaded {len(ids)} ids, not exactly its slice's")
    return {"wall": wall, "cpu": cpu}


def _count_maps() -> tuple[list[str], list[float]]:
    """Count the tensor files the sharded reader maps in this process (its ``open_file``, every version's), and
    time its opening: ``CheckpointReader.__init__`` (RecIS's reader's too), the loader's ``resolve_chain`` (a load
    of fastckpt's layout reads and checks the manifest and the metadata files there, before its reader opens;
    RecIS's reader reads and checks them itself) and, where files open on first use, each file's opening
    (``TensorFiles._open``, outside an ``__init__``); returns ``(names mapped, [seconds opening])``."""
    import functools
    import threading

    import fastckpt.sharded.loader as loader_module
    import fastckpt.sharded.reader as reader_module
    import fastckpt.sharded.recis as recis_module

    mapped: list[str] = []
    opening = [0.0]
    real = reader_module.open_file
    inside = threading.local()

    def counting(path, **options):
        mapped.append(os.path.basename(path))
        return real(path, **options)

    def timed(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if getattr(inside, "depth", 0):  # a file opened by an opening already timed
                return fn(*args, **kwargs)
            inside.depth = 1
            started = time.thread_time()  # CPU: not the waits of ranks as threads for the GIL or one another
            try:
                return fn(*args, **kwargs)
            finally:
                opening[0] += time.thread_time() - started
                inside.depth = 0
        return call

    reader_module.open_file = counting
    reader_module.CheckpointReader.__init__ = timed(reader_module.CheckpointReader.__init__)
    recis_module.RecisCheckpointReader.__init__ = timed(recis_module.RecisCheckpointReader.__init__)
    if hasattr(loader_module, "resolve_chain"):  # 0.5.0 on: the metadata read and checked before the reader opens
        loader_module.resolve_chain = timed(loader_module.resolve_chain)
    files = getattr(reader_module, "TensorFiles", None)  # 0.8.0 on: each file opened on first use
    if files is not None:
        files._open = timed(files._open)
    return mapped, opening


def _worker(argv: list[str]) -> int:
    """``--worker threads|mpi PATH RANKS DIM``: one load of every rank's share; prints JSON per rank."""
    mode, path, ranks, dim = argv[0], argv[1], int(argv[2]), int(argv[3])
    mapped, opening = _count_maps()
    if mode == "threads":
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(ranks) as pool:
            started, cpu = time.perf_counter(), time.process_time()
            rows = list(pool.map(lambda r: _rank_load(path, r, ranks, dim), range(ranks)))
            job, cpu = time.perf_counter() - started, time.process_time() - cpu
        for row in rows:  # the process's CPU (the loads' own threads too) and opening: a rank's share of them
            row["cpu"], row["opening"] = cpu / ranks, opening[0] / ranks
        print(json.dumps({"ranks": rows, "job": job, "mapped": len(mapped)}), flush=True)
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    comm.Barrier()
    started, cpu = time.perf_counter(), time.process_time()
    row = _rank_load(path, rank, comm.Get_size(), dim)
    row["cpu"] = time.process_time() - cpu  # the whole process's: the load's threads too
    row["mapped"], row["opening"] = len(mapped), opening[0]
    ended = time.perf_counter()
    rows = comm.gather(row, root=0)
    bounds = comm.gather((started, ended), root=0)
    if rank == 0:
        job = max(e for _, e in bounds) - min(s for s, _ in bounds)
        print(json.dumps({"ranks": rows, "job": job, "mapped": sum(r["mapped"] for r in rows)}), flush=True)
    return 0


def _steady(argv: list[str]) -> int:
    """``--steady raw|load DIRECTORY RANKS DIM REPEAT``: one path alone, one untimed run then ``REPEAT`` timed;
    prints JSON ``{"wall", "cpu", "faults"}`` (medians)."""
    import gc
    import resource

    from fastckpt.bench.sharded import raw_load, sharded_load

    what, where, ranks, dim, repeat = argv[0], Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    run = (lambda: raw_load(where)) if what == "raw" else \
        (lambda: sharded_load(where, ranks, dim, 4, verify=False))  # noqa: E731
    run()
    rows = []
    for _ in range(repeat):
        gc.collect()
        time.sleep(0.05)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = run()
        del out  # dropped inside the timing, as the sharded suite times it
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        rows.append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                     after.ru_minflt - before.ru_minflt))
    print(json.dumps({key: statistics.median(r[i] for r in rows) for i, key in enumerate(("wall", "cpu", "faults"))}),
          flush=True)
    return 0


def _run_steady(folder: str, what: str, where: Path, ranks: int, dim: int, repeat: int) -> dict[str, Any]:
    return _run_module(folder, ["--steady", what, str(where), str(ranks), str(dim), str(repeat)], f"steady {what}")


def measure_steady(ranks: int, ids: int, dim: int, dense_mib: float, repeat: int, versions: dict[str, str],
                   root: Path, rounds: int = 2) -> list[dict[str, Any]]:
    """The ``--steady`` table's rows: each path alone in its own process, ``rounds`` processes each (interleaved)."""
    from fastckpt.bench.sharded import _dense_rows, dense_tensors, file_plan, raw_save, rank_state, sharded_save
    from fastckpt.bench.sharded import table_ids

    all_ids = table_ids(ids)
    states = [rank_state(all_ids, dim, r, ranks) for r in range(ranks)]
    dense = dense_tensors(dense_mib)
    raw_save(root / "steady-raw", [f for rank, s in enumerate(states)
                                   for f in file_plan(s.arrays + _dense_rows(dense, rank, ranks), 4)])
    sharded_save(root / "steady-checkpoint", states, dense, 4)
    del states, dense
    paths = [("raw read", versions["after"], "raw", root / "steady-raw")]
    paths += [(f"Loader.load(verify=False) ({version})", folder, "load", root / "steady-checkpoint")
              for version, folder in versions.items()]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in paths}
    for _ in range(rounds):
        for name, folder, what, where in paths:
            runs[name].append(_run_steady(folder, what, where, ranks, dim, repeat))
    return [{"path": name, **{key: statistics.median(r[key] for r in results) for key in ("wall", "cpu", "faults")}}
            for name, results in runs.items()]


def _run_once(folder: str, mode: str, path: Path, ranks: int, dim: int) -> dict[str, Any]:
    launch = [_mpiexec(), "-n", str(ranks)] if mode == "mpi" else []
    return _run_module(folder, ["--worker", mode, str(path), str(ranks), str(dim)], f"{mode} load", launch)


def _run_module(folder: str, args: list[str], what: str, launch: list[str] = ()) -> dict[str, Any]:
    """This module run as a script with ``args`` (under ``launch``, e.g. ``mpiexec -n 4``) in a fresh process that
    imports the fastckpt in ``folder``: the JSON object of the last such line it prints."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(folder), env.get("PYTHONPATH")) if p)
    start = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run([*launch, sys.executable, "-c", start, os.path.abspath(__file__), *args],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=os.path.abspath(folder))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} with {folder} failed (status {done.returncode}): "
                           f"{(done.stdout + done.stderr).strip()[-2000:]}")
    return json.loads(lines[-1])


def measure(files=DEFAULTS["files"], ranks: int = DEFAULTS["ranks"], ids: int = DEFAULTS["ids"],
            dim: int = DEFAULTS["dim"], dense_mib: float = DEFAULTS["dense_mib"], repeat: int = DEFAULTS["repeat"],
            against: str | None = None, mpi: bool | None = None, directory: str | None = None,
            steady: bool = False, steady_ids: int = 1_000_000, steady_dense_mib: float = 64.0,
            layout: str = "fastckpt") -> dict[str, Any]:
    """Run the suite (see the module docs); ``mpi=None``: under MPI too where ``mpiexec`` and mpi4py are there."""
    if mpi is None:
        mpi = _mpiexec() is not None
    modes = ["threads"] + (["mpi"] if mpi else [])
    versions = {"after": _here(), **({"before": os.path.abspath(against)} if against else {})}
    root = Path(tempfile.mkdtemp(prefix="fastckpt-bench-ranks-", dir=directory))
    layouts = LAYOUTS if layout == "both" else (layout,)
    rows = []
    try:
        for count in files:
            if count % ranks:
                raise ValueError(f"--files {count} is not a multiple of --ranks {ranks}")
            paths = {kind: root / f"{kind}{count}" for kind in layouts}
            written = {kind: _save(path, count, ranks, ids, dim, dense_mib, kind) for kind, path in paths.items()}
            runs: dict[tuple[str, str, str], list[dict]] = {(m, v, k): [] for m in modes for v in versions
                                                             for k in layouts}
            order = list(runs)
            rng = random.Random(count)
            for _ in range(repeat):
                rng.shuffle(order)
                for mode, version, kind in order:
                    runs[mode, version, kind].append(_run_once(versions[version], mode, paths[kind], ranks, dim))
            for (mode, version, kind), results in runs.items():
                rows.append({"files": count, "written": written[kind], "ranks": ranks, "mode": mode,
                             "version": version, "layout": kind,
                             "job": statistics.median(r["job"] for r in results),
                             "slowest": statistics.median(max(x["wall"] for x in r["ranks"]) for r in results),
                             "cpu": statistics.median(statistics.fmean(x["cpu"] for x in r["ranks"]) for r in results),
                             "opening": statistics.median(statistics.fmean(x["opening"] for x in r["ranks"])
                                                          for r in results),
                             "mapped": statistics.median(r["mapped"] / ranks for r in results)})
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
        steady_rows = measure_steady(ranks, steady_ids, dim, steady_dense_mib, repeat, versions, root) if steady \
            else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "versions": versions, "repeat": repeat, "ids": ids, "dim": dim, "dense_mib": dense_mib,
            "load": _load_average(), "steady": steady_rows, "steady_size": (steady_ids, steady_dense_mib, ranks),
            "layout": layout}


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def report(results: dict[str, Any]) -> str:
    """The suite's table: a row per file count, mode and version (and layout, with ``--layout both``); with a
    before, the ratios beside; with both layouts, RecIS's over fastckpt's."""
    rows = results["rows"]
    both = results.get("layout") == "both"
    before = {(r["files"], r["mode"], r.get("layout")): r for r in rows if r["version"] == "before"}
    layout = {"recis": "RecIS's layout", "both": "RecIS's layout and fastckpt's, in the same rounds"}.get(
        results.get("layout"), "fastckpt's layout")
    lines = [f"Sharded load ({layout}), each rank its share (verify=False), {results['ids']:,} ids x "
             f"{results['dim']} + "
             f"{results['dense_mib']:g} MiB dense, a fresh process every run, medians of {results['repeat']}; "
             f"load average {results['load']}",
             ""]
    body = []
    for r in rows:
        was = before.get((r["files"], r["mode"], r.get("layout"))) if r["version"] == "after" else None
        ratio = (lambda key: format_ratio(was[key] / r[key]) if was and r[key] > 0 else "")  # noqa: E731
        written = r.get("written", r["files"])
        files = r["files"] if written == r["files"] else f"{written} ({r['files']} asked)"
        body.append([files, r["ranks"], r["mode"], r["version"], *([r["layout"]] if both else []),
                     format_duration(r["opening"]), f"{r['mapped']:g}", format_duration(r["slowest"]),
                     format_duration(r["cpu"]), ratio("opening"), ratio("slowest"), ratio("cpu")])
    lines += table_lines(["files", "ranks", "mode", "fastckpt", *(["layout"] if both else []), "opening CPU per rank",
                          "files mapped per rank", "slowest rank's load", "CPU per rank", "before / after (opening)",
                          "before / after (load)", "before / after (CPU)"], body, "rrll" + "l" * both + "rrrrrrr")
    if both:
        own = {(r["files"], r["mode"], r["version"]): r for r in rows if r["layout"] == "fastckpt"}
        pairs = [(r, own[r["files"], r["mode"], r["version"]]) for r in rows if r["layout"] == "recis"]
        lines += ["", "RecIS's layout over fastckpt's, the same files asked, ranks and state, the same rounds "
                      "(target for the opening: <= 1.3x)", ""]
        lines += table_lines(["files asked", "ranks", "mode", "fastckpt", "opening CPU per rank", "slowest rank's load",
                              "CPU per rank"],
                             [[r["files"], r["ranks"], r["mode"], r["version"], format_ratio(r["opening"] / o["opening"]),
                               format_ratio(r["slowest"] / o["slowest"]), format_ratio(r["cpu"] / o["cpu"])]
                              for r, o in pairs if o["opening"] > 0 and o["slowest"] > 0 and o["cpu"] > 0],
                             "rrllrrr")
    if results.get("steady"):
        ids, mib, ranks = results["steady_size"]
        raw = results["steady"][0]
        lines += ["", f"Repeated loads, each path alone in a process of its own (one untimed run, then {results['repeat']}"
                      f" timed, two processes each, medians): {ids:,} ids x {results['dim']} with m, v + {mib:g} MiB "
                      f"dense, {ranks} ranks as threads, 4 files each", ""]
        lines += table_lines(["path", "wall", "CPU", "minor faults", "raw read / path (wall)"],
                             [[r["path"], format_duration(r["wall"]), format_duration(r["cpu"]), f"{r['faults']:.0f}",
                               format_ratio(raw["wall"] / r["wall"])] for r in results["steady"]], "lrrrr")
    where = ", ".join(f"{k}: {v}" for k, v in results["versions"].items())
    lines += ["", f"({where}; the machine is shared: compare the versions within one run)"]
    return "\n".join(lines)


def configure(parser) -> None:
    """The suite's options (see the module docs)."""
    parser.add_argument("--files", default=None, help="tensor files of each checkpoint, comma-separated "
                                                      f"(default {','.join(map(str, DEFAULTS['files']))})")
    parser.add_argument("--ranks", type=int, default=None, help=f"ranks (default {DEFAULTS['ranks']})")
    parser.add_argument("--ids", type=int, default=None, help=f"table ids (default {DEFAULTS['ids']:,})")
    parser.add_argument("--dim", type=int, default=None, help=f"values per id (default {DEFAULTS['dim']})")
    parser.add_argument("--dense-mib", type=float, default=None,
                        help=f"dense MiB (default {DEFAULTS['dense_mib']:g})")
    add_repeat_option(parser, dest="repeat", default=None, help=f"runs of each (default {DEFAULTS['repeat']})")
    parser.add_argument("--against", default=None, help="a built checkout of an earlier fastckpt, run in the "
                                                        "same rounds")
    parser.add_argument("--mpi", action="store_true", default=None, help="under MPI too (default: where there)")
    parser.add_argument("--no-mpi", dest="mpi", action="store_false", help="threads only")
    parser.add_argument("--layout", choices=("fastckpt", "recis", "both"), default="fastckpt",
                        help="the checkpoint's layout (default fastckpt's; recis: Saver(layout='recis'); both: "
                             "each, in the same rounds, and RecIS's over fastckpt's)")
    parser.add_argument("--steady", action="store_true",
                        help="also repeated loads and raw reads of the sharded suite's state, each alone in a process")
    parser.add_argument("--steady-ids", type=int, default=1_000_000, help="--steady's ids (default 1,000,000)")
    parser.add_argument("--steady-dense-mib", type=float, default=64.0, help="--steady's dense MiB (default 64)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (for smoke tests)")


def options(args) -> dict[str, Any]:
    """:func:`measure`'s keywords from parsed options (``--quick`` first, explicit options over it)."""
    out = dict(QUICK if args.quick else DEFAULTS)
    for key in ("ranks", "ids", "dim", "dense_mib", "repeat"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.files is not None:
        out["files"] = tuple(int(x) for x in args.files.split(","))
    return {**out, "against": args.against, "mpi": args.mpi, "directory": args.dir, "steady": args.steady,
            "steady_ids": args.steady_ids, "steady_dense_mib": args.steady_dense_mib, "layout": args.layout}


def run(args) -> int:
    """Measure and print (see the module docs)."""
    print(report(measure(**options(args))))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    if sys.argv[1:2] == ["--steady"]:
        sys.exit(_steady(sys.argv[2:]))
