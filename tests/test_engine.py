"""The engines of sharded saves: barrier, broadcast and gather on one rank, on threads and on MPI processes.

Every engine returns JSON round trips, waits at most its timeout, and names exactly the ranks that did not
arrive. The MPI tests start real jobs with the ``mpiexec`` next to ``sys.executable`` (``pip install
"fastckpt[mpi]"``), each rank writing what it saw to a JSON file that the test checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec

import pytest

from fastckpt.errors import FastCkptError
from fastckpt.sharded.engine import BarrierTimeoutError, Engine, EngineError, LocalEngine, ThreadEngine, default_engine


def run_ranks(engines, work):
    """``work(engine)`` on one thread per engine; each rank's return value or the exception it raised."""
    def guarded(engine):
        try:
            return work(engine)
        except Exception as exc:  # the test looks at it
            return exc

    with ThreadPoolExecutor(len(engines)) as threads:
        return list(threads.map(guarded, engines))


# -- one rank ----------------------------------------------------------------------------------------------------

def test_local_engine_is_rank_0_of_1_and_round_trips_json():
    engine = LocalEngine()
    assert (engine.rank, engine.size) == (0, 1)
    assert isinstance(engine, Engine)
    assert engine.barrier("written", timeout=0) is None
    assert engine.broadcast({"shape": (2, 3), "nan": None}) == {"shape": [2, 3], "nan": None}
    assert engine.gather((1, "a")) == [[1, "a"]]
    engine.abort("nothing to tell")


@pytest.mark.parametrize("make", [lambda: LocalEngine(), lambda: ThreadEngine.group(1)[0]], ids=["local", "thread"])
def test_values_that_are_not_json_are_refused(make):
    engine = make()
    with pytest.raises(TypeError, match="JSON only .never pickles., and set is not JSON-serializable"):
        engine.broadcast({1, 2})
    with pytest.raises(TypeError, match="object is not JSON-serializable"):
        engine.gather(object())


@pytest.mark.parametrize("make", [lambda: LocalEngine(), lambda: ThreadEngine.group(1)[0]], ids=["local", "thread"])
@pytest.mark.parametrize("call, match", [
    (lambda e: e.barrier("t", timeout=-1), "timeout must be a number of seconds >= 0"),
    (lambda e: e.barrier("t", timeout=float("nan")), "timeout must be"),
    (lambda e: e.barrier("t", timeout="30"), "timeout must be"),
    (lambda e: e.broadcast(1, root=1), r"root must be a rank in \[0, 1\), got 1"),
    (lambda e: e.gather(1, root=-1), r"root must be a rank in \[0, 1\), got -1"),
])
def test_bad_arguments_are_refused(make, call, match):
    with pytest.raises(ValueError, match=match):
        call(make())


def test_a_tag_must_be_a_str():
    with pytest.raises(TypeError, match="tag must be a str, got 3"):
        LocalEngine().barrier(3, timeout=1)


# -- ranks as threads --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_thread_group_barrier_broadcast_gather(n):
    engines = ThreadEngine.group(n)
    assert [(e.rank, e.size) for e in engines] == [(r, n) for r in range(n)]
    assert all(isinstance(e, Engine) for e in engines)

    def work(engine):
        seen = [engine.barrier("start", timeout=10)]
        for root in range(n):  # every root in turn; the others pass values that must not show
            seen.append(engine.broadcast({"root": root, "pair": (root, "x")} if engine.rank == root else "ignored",
                                         root=root, timeout=10))
            seen.append(engine.gather([engine.rank, root], root=root, timeout=10))
        engine.barrier("end", timeout=10)
        return seen

    results = run_ranks(engines, work)
    for rank, seen in enumerate(results):
        expected = [None]
        for root in range(n):
            expected.append({"root": root, "pair": [root, "x"]})
            expected.append([[r, root] for r in range(n)] if rank == root else None)
        assert seen == expected
    assert engines[0]._group.rounds == {}  # every call's state is dropped once every rank has left it


def test_thread_ranks_that_do_not_arrive_are_named():
    engines = ThreadEngine.group(4)
    start = time.monotonic()
    errors = run_ranks(engines[:2], lambda e: e.barrier("written", timeout=0.3))
    assert 0.29 <= time.monotonic() - start < 2
    for error in errors:
        assert isinstance(error, BarrierTimeoutError) and isinstance(error, TimeoutError)
        assert isinstance(error, FastCkptError)
        assert str(error).startswith("ranks 2, 3 of 4 did not reach 'written' within 0.3 s (")
        assert (error.missing, error.tag, error.timeout, error.size) == ((2, 3), "written", 0.3, 4)
    # A rank that comes after the others gave up learns it at once, with the same error.
    start = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match="^ranks 2, 3 of 4 did not reach 'written' within 0.3 s") as late:
        engines[2].barrier("written", timeout=30)
    assert late.value.missing == (2, 3) and time.monotonic() - start < 1


def test_thread_gather_and_broadcast_time_out_too():
    engines = ThreadEngine.group(3)
    errors = run_ranks(engines[:2], lambda e: e.gather(e.rank, root=1, timeout=0.3))
    sentence = "rank 2 of 3 did not reach the gather to rank 1 within 0.3 s"
    assert [str(e).partition(" (")[0] for e in errors] == [sentence] * 2
    assert all(e.missing == (2,) and e.tag == "gather" for e in errors)
    engines = ThreadEngine.group(3)
    errors = run_ranks(engines[1:], lambda e: e.broadcast(None, root=0, timeout=0.3))
    sentence = "rank 0 of 3 did not reach the broadcast from rank 0 within 0.3 s"
    assert [str(e).partition(" (")[0] for e in errors] == [sentence] * 2
    assert all(e.missing == (0,) for e in errors)


def test_a_thread_rank_that_aborts_makes_the_others_fail_at_once():
    engines = ThreadEngine.group(3)

    def work(engine):
        if engine.rank == 1:
            time.sleep(0.1)  # the others are waiting by now
            engine.abort("disk full")
            return "aborted"
        return engine.barrier("written", timeout=30)

    start = time.monotonic()
    results = run_ranks(engines, work)
    assert time.monotonic() - start < 5
    assert results[1] == "aborted"
    for error in (results[0], results[2]):
        assert isinstance(error, BarrierTimeoutError)
        assert str(error) == "rank 1 of 3 aborted and will not reach 'written' (rank 1: disk full)"
        assert error.missing == (1,)
    with pytest.raises(BarrierTimeoutError, match="rank 1 of 3 aborted and will not reach the gather to rank 0"):
        engines[0].gather(1, timeout=30)
    with pytest.raises(EngineError, match="rank 1 of 3 aborted this engine"):
        engines[1].barrier("again", timeout=30)


def test_thread_ranks_out_of_step_are_told_so():
    engines = ThreadEngine.group(2)
    results = run_ranks(engines, lambda e: e.barrier("written", 10) if e.rank == 0 else e.gather(1, timeout=10))
    for error in results:
        assert isinstance(error, EngineError)
        assert str(error) == ("the 2 ranks are out of step (rank 0 at 'written', rank 1 at the gather to rank 0): "
                              "each rank must make the same engine calls in the same order")


def test_thread_engines_in_a_real_save_loop():
    # Many calls in a row with uneven arrival times: no call takes another's values.
    engines = ThreadEngine.group(3)

    def work(engine):
        out = []
        for step in range(50):
            if (step + engine.rank) % 7 == 0:
                time.sleep(0.001)
            out.append(engine.gather(step * 10 + engine.rank, root=step % 3, timeout=10))
        return out

    results = run_ranks(engines, work)
    for rank, out in enumerate(results):
        assert out == [[step * 10 + r for r in range(3)] if step % 3 == rank else None for step in range(50)]


# -- choosing an engine ------------------------------------------------------------------------------------------

def test_default_engine_for_one_rank_is_local():
    assert isinstance(default_engine(0, 1), LocalEngine)


@pytest.mark.parametrize("index, num, error", [(1, 1, ValueError), (-1, 2, ValueError), (0, 0, ValueError),
                                               (0.0, 1, TypeError), (True, 2, TypeError)])
def test_default_engine_refuses_impossible_ranks(index, num, error):
    with pytest.raises(error, match="shard_"):
        default_engine(index, num)


def _fake_mpi4py(size, rank):
    world = types.SimpleNamespace(Get_size=lambda: size, Get_rank=lambda: rank)
    return types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_WORLD=world))


@pytest.mark.parametrize("mpi4py, says", [
    (None, "mpi4py is not usable here"),
    (_fake_mpi4py(1, 0), "this process is rank 0 of 1 of MPI.COMM_WORLD"),
    (_fake_mpi4py(3, 1), "this process is rank 1 of 3 of MPI.COMM_WORLD"),
])
def test_default_engine_without_the_ranks_says_how_to_run_them(monkeypatch, mpi4py, says):
    # A stand-in for mpi4py: the real one would start MPI inside the test process.
    monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
    with pytest.raises(EngineError) as error:
        default_engine(1, 2)
    message = str(error.value)
    assert message.startswith("shard 1 of 2 needs an engine to coordinate the ranks")
    for part in (says, "mpiexec -n 2 python", 'pip install "fastckpt[mpi]"', "engine=ThreadEngine.group(2)[i]"):
        assert part in message


# -- ranks as MPI processes --------------------------------------------------------------------------------------

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

# Each rank runs one scenario and writes what it saw to OUT/rank<R>.json.
RANK_SCRIPT = r'''
import json, os, sys, time
from mpi4py import MPI
from fastckpt.sharded.engine import BarrierTimeoutError, EngineError, MPIEngine, default_engine

out, scenario = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
seen = {}

def attempt(name, call):
    start = time.monotonic()
    try:
        seen[name] = {"value": call()}
    except (BarrierTimeoutError, EngineError) as exc:
        seen[name] = {"error": type(exc).__name__, "message": str(exc), "missing": list(getattr(exc, "missing", []))}
    seen[name]["seconds"] = time.monotonic() - start

if scenario == "collectives":
    seen["default"] = type(default_engine(rank, size)).__name__
    engine = MPIEngine()
    seen["rank, size"] = [engine.rank, engine.size]
    attempt("barrier", lambda: engine.barrier("start", timeout=30))
    for root in range(size):
        attempt(f"broadcast {root}", lambda: engine.broadcast({"root": root, "pair": (root, "x")} if rank == root
                                                              else "ignored", root=root, timeout=30))
        attempt(f"gather {root}", lambda: engine.gather([rank, root], root=root, timeout=30))
    attempt("big", lambda: engine.broadcast("x" * 1_000_000 if rank == 0 else None, timeout=30) == "x" * 1_000_000)
    again = MPIEngine()  # a second engine over COMM_WORLD goes on where the first left off
    attempt("end", lambda: again.barrier("end", timeout=30))
elif scenario == "rank 2 has no engine":
    if rank != 2:
        attempt("written", lambda: MPIEngine().barrier("written", timeout=0.3))
else:
    engine = MPIEngine()
    engine.barrier("started", timeout=30)  # slow starts out of the way: only the scenario is timed
    if scenario == "rank 2 late":  # rank 2 comes after the others gave up
        if rank == 2:
            time.sleep(1.0)
        attempt("written", lambda: engine.barrier("written", timeout=0.3))
    elif scenario == "rank 2 exits":
        if rank == 2:
            sys.exit(0)
        attempt("written", lambda: engine.gather(rank, timeout=0.3))
    elif scenario == "root silent":  # rank 0 leaves without answering
        if rank != 0:
            attempt("written", lambda: engine.barrier("written", timeout=0.2))
    elif scenario == "abort":
        if rank == 1:
            time.sleep(0.1)
            engine.abort("disk full")
            attempt("after", lambda: engine.barrier("written", timeout=30))
        else:
            attempt("written", lambda: engine.barrier("written", timeout=30))
    elif scenario == "out of step":
        attempt("written", lambda: engine.barrier("written", timeout=30) if rank != 1 else engine.gather(1, timeout=30))
        attempt("next", lambda: engine.barrier("next", timeout=30))  # the ranks are in step again

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
'''


# Every job the tests below check, started together (most of each is Python starting and waiting out
# timeouts, which overlap well).
MPI_JOBS = [(1, "collectives"), (2, "collectives"), (3, "collectives"), (4, "collectives"), (4, "rank 2 late"),
            (3, "rank 2 exits"), (2, "root silent"), (3, "abort"), (3, "out of step"), (3, "rank 2 has no engine")]


@pytest.fixture(scope="module")
def mpiexec(tmp_path_factory):
    """Starts every job of MPI_JOBS (RANK_SCRIPT under ``mpiexec -n N``); ``mpiexec(n, scenario)`` waits for one
    and returns its ranks' records, by rank."""
    if find_spec("mpi4py") is None:
        pytest.skip('mpi4py is not installed (pip install "fastckpt[mpi]")')
    if not os.path.exists(MPIEXEC):
        pytest.skip(f'no mpiexec next to {sys.executable} (pip install "fastckpt[mpi]" installs MPICH\'s)')
    probe = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-c", "from mpi4py import MPI"],
                           check=False, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"{MPIEXEC} cannot start a rank here: {(probe.stdout + probe.stderr).strip()[-500:]}")
    base = tmp_path_factory.mktemp("mpi")
    script = base / "ranks.py"
    script.write_text(RANK_SCRIPT)
    jobs = {}
    for n, scenario in MPI_JOBS:
        out = base / f"{n}-{scenario.replace(' ', '-')}"
        out.mkdir()
        jobs[n, scenario] = out, subprocess.Popen(
            [MPIEXEC, "-n", str(n), sys.executable, str(script), str(out), scenario],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result(n, scenario):
        out, job = jobs[n, scenario]
        output, _ = job.communicate(timeout=60)
        assert job.returncode == 0, output
        return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}

    yield result
    for _, job in jobs.values():  # the jobs of tests that were not run, or failed waiting
        if job.poll() is None:
            job.terminate()  # mpiexec passes it on to the ranks
            try:
                job.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                job.kill()
                job.communicate()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mpi_barrier_broadcast_gather(mpiexec, n):
    ranks = mpiexec(n, "collectives")
    assert sorted(ranks) == list(range(n))
    for rank, seen in ranks.items():
        assert seen["default"] == ("LocalEngine" if n == 1 else "MPIEngine")
        assert seen["rank, size"] == [rank, n]
        assert seen["barrier"]["value"] is None and seen["end"]["value"] is None
        for root in range(n):
            assert seen[f"broadcast {root}"]["value"] == {"root": root, "pair": [root, "x"]}
            assert seen[f"gather {root}"]["value"] == ([[r, root] for r in range(n)] if rank == root else None)
        assert seen["big"]["value"] is True


def test_mpi_root_names_the_rank_that_comes_late(mpiexec):
    ranks = mpiexec(4, "rank 2 late")
    for rank in range(4):
        written = ranks[rank]["written"]
        assert written["error"] == "BarrierTimeoutError", written
        assert written["missing"] == [2]
        assert written["message"].startswith("rank 2 of 4 did not reach 'written' within 0.3 s (")
    # Rank 1 was told by the root (on its own it would name rank 0); rank 2 learns at once when it comes.
    assert ranks[2]["written"]["seconds"] < 0.25


def test_mpi_root_names_the_rank_that_exited(mpiexec):
    ranks = mpiexec(3, "rank 2 exits")
    assert sorted(ranks) == [0, 1]
    for rank in (0, 1):
        written = ranks[rank]["written"]
        assert (written["error"], written["missing"]) == ("BarrierTimeoutError", [2])
        assert written["message"].startswith("rank 2 of 3 did not reach the gather to rank 0 within 0.3 s (")


def test_mpi_ranks_without_an_engine_cannot_be_named_but_are_not_waited_for(mpiexec):
    ranks = mpiexec(3, "rank 2 has no engine")
    for rank in (0, 1):
        written = ranks[rank]["written"]
        assert (written["error"], written["missing"]) == ("BarrierTimeoutError", [])
        assert written["message"].startswith(f"rank {rank} of 3 cannot start 'written': not every rank has made its "
                                             f"first MPIEngine within 0.3 s (")
        assert written["seconds"] < 2


def test_mpi_rank_without_an_answer_from_the_root_names_the_root(mpiexec):
    written = mpiexec(2, "root silent")[1]["written"]
    assert (written["error"], written["missing"]) == ("BarrierTimeoutError", [0])
    assert written["message"].startswith("rank 1 of 2 had no answer from rank 0 at 'written' within 0.2 s: ")
    assert 0.39 <= written["seconds"] < 3  # the timeout and the grace


def test_mpi_rank_that_aborts_makes_the_others_fail_at_once(mpiexec):
    ranks = mpiexec(3, "abort")
    for rank in (0, 2):
        written = ranks[rank]["written"]
        assert written["message"] == "rank 1 of 3 aborted and will not reach 'written' (rank 1: disk full)"
        assert written["missing"] == [1] and written["seconds"] < 5
    assert ranks[1]["after"]["error"] == "EngineError"


def test_mpi_ranks_out_of_step_are_told_so(mpiexec):
    ranks = mpiexec(3, "out of step")
    for rank in range(3):
        assert ranks[rank]["written"]["error"] == "EngineError"
        assert ranks[rank]["written"]["message"] == (
            "the 3 ranks are out of step (rank 0 at 'written', rank 1 at the gather to rank 0, rank 2 at 'written'): "
            "each rank must make the same engine calls in the same order")
        assert ranks[rank]["next"]["value"] is None
