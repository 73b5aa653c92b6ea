"""Threads kept between sharded loads (fastckpt.sharded.workers): a lane's limit, order, errors and waits; loads after
the first start no thread; a forked child gets threads of its own."""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.sharded.workers import Lane


def test_a_lane_runs_at_most_its_limit_at_once_in_order_and_its_exit_waits_for_all():
    running, most, order, lock = [0], [0], [], threading.Lock()

    def task(k):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
            order.append(k)
        return k * k

    with Lane("rows", 3) as lane:
        futures = [lane.submit(task, k) for k in range(30)]
    assert all(f.done() for f in futures)  # the exit waited
    assert [f.result() for f in futures] == [k * k for k in range(30)]
    assert most[0] <= 3 and sorted(order) == list(range(30))
    with Lane("rows", 1) as lane:  # one at a time: exactly in the order submitted
        seen: list = []
        for k in range(10):
            lane.submit(seen.append, k)
    assert seen == list(range(10))
    with pytest.raises(ValueError, match="at least one task"):
        Lane("rows", 0)


def test_a_task_error_reaches_its_future_and_the_lane_goes_on():
    with Lane("load", 2) as lane:
        bad = lane.submit(int, "not a number")
        good = [lane.submit(abs, -k) for k in range(5)]
    with pytest.raises(ValueError, match="not a number"):
        bad.result()
    assert [f.result() for f in good] == list(range(5))


def test_tasks_may_wait_for_tasks_of_another_kind_with_every_thread_of_theirs_busy():
    def job(k):  # a table's job, waiting for its row copies
        with Lane("rows", 2) as rows:
            parts = [rows.submit(pow, k, e) for e in range(4)]
        return sum(f.result() for f in parts)

    with Lane("load", 8) as lane:
        futures = [lane.submit(job, k) for k in range(16)]
    assert [f.result() for f in futures] == [sum(k ** e for e in range(4)) for k in range(16)]


def _thread_starts(monkeypatch) -> list:
    """The names of the threads started from here on (a list filled as they start)."""
    started: list = []
    real_start = threading.Thread.start

    def start(thread):
        started.append(thread.name)
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


def _checkpoint(tmp_path) -> str:
    rng = np.random.default_rng(0)
    table = HashTable(4, slots=("m",))
    ids = rng.choice(10**9, 5000, replace=False)
    table.insert(ids, rng.random((5000, 4), dtype=np.float32), {"m": rng.random((5000, 4), dtype=np.float32)})
    out = str(tmp_path / "c")
    Saver(path=out, parallel=2, hashtables={"emb": table}, tensors={"w": np.arange(64.0).reshape(8, 8)}).save()
    return out


def test_loads_run_on_threads_kept_between_them(tmp_path, monkeypatch):
    """Ten loads start no more threads than one load's lanes run at once (each kind's threads grow to the most
    that ran together, twice that for a thread still on its way back to idle): a load used to start its own."""
    out = _checkpoint(tmp_path)
    started = _thread_starts(monkeypatch)
    first = Loader(out, parallel=4).load()
    for k in range(10):
        again = Loader(out, parallel=4, verify=bool(k % 2)).load()
        assert again[0]["emb"] == first[0]["emb"] and np.array_equal(again[1]["w"], first[1]["w"])
    assert len(started) <= 2 * (4 + 4 + 1), started  # the load, rows and verify lanes (was 7 threads a load)


def _load_in_child(out, answer):
    # unverified: blake3's own threads (max_threads=AUTO) do not survive a fork either, apart from these
    tables, tensors = Loader(out, parallel=4, verify=False).load()
    answer.put((len(tables["emb"]), float(tensors["w"].sum())))


def test_a_forked_child_loads_on_threads_of_its_own(tmp_path):
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork here")
    out = _checkpoint(tmp_path)
    Loader(out, parallel=4, verify=False).load()  # the parent's threads exist now
    context = multiprocessing.get_context("fork")
    answer = context.Queue()
    child = context.Process(target=_load_in_child, args=(out, answer))
    child.start()
    child.join(60)
    assert child.exitcode == 0, "the child hung or failed"
    assert answer.get(timeout=5) == (5000, float(np.arange(64.0).sum()))


def test_saves_write_and_encode_on_threads_kept_between_them(tmp_path, monkeypatch):
    """Ten saves start no more writing and encoding threads than one save runs at once (twice that at most, as
    above): a save used to start parallel new ones."""
    table = HashTable(4, slots=("m",))
    table.insert(np.arange(3000), np.ones((3000, 4), np.float32), {"m": np.zeros((3000, 4), np.float32)})
    started = _thread_starts(monkeypatch)
    outs = [Saver(path=str(tmp_path / f"c{k}"), parallel=4, hashtables={"emb": table},
                  compression="zstd" if k % 2 else None).save() for k in range(10)]
    ours = [name for name in started if not name.startswith("fastckpt-commit")]  # the commit starts its own
    assert len(ours) <= 2 * (4 + 4), ours  # the write and encode lanes (was 4 a save, 8 with zstd)
    for out in outs:
        assert Loader(out, verify=True).load()[0]["emb"] == table


def test_a_resharding_rank_hands_its_small_tasks_to_two_threads_at_most(tmp_path, monkeypatch):
    """A 1 -> 4 rank's dense jobs and row copies (a few KiB to MiB each) go to other threads in bundles by bytes
    (fastckpt.sharded.workers.bundles): one hand-off a lane, where each job and each copy used to take one (seven
    a rank here; with four ranks as threads on two cores each waited for the GIL)."""
    from fastckpt.sharded import workers

    rng = np.random.default_rng(0)
    table = HashTable(4, slots=("m", "v"))
    ids = rng.choice(10**9, 8000, replace=False)
    table.insert(ids, rng.random((8000, 4), dtype=np.float32),
                 {s: rng.random((8000, 4), dtype=np.float32) for s in ("m", "v")})
    out = str(tmp_path / "c")
    dense = {f"w{k}": np.arange(256.0 * (k + 1)).reshape(-1, 8) for k in range(4)}
    Saver(path=out, parallel=4, hashtables={"emb": table}, tensors=dense).save()
    handed: list = []
    real_pool = workers._pool

    class Counting:
        def __init__(self, pool):
            self.pool = pool

        def submit(self, fn, *args):
            handed.append(threading.current_thread().name)
            return self.pool.submit(fn, *args)

    monkeypatch.setattr(workers, "_pool", lambda kind: Counting(real_pool(kind)))
    loaded = []
    for rank in range(4):
        handed.clear()
        loaded.append(Loader(out, parallel=4, shard_index=rank, shard_num=4, dense="rows", verify=False).load())
        assert len(handed) <= 2, handed  # was 7 (three dense jobs, three row copies and one more)
    assert sorted(np.concatenate([t["emb"].ids() for t, _ in loaded]).tolist()) == sorted(ids.tolist())
    for name, array in dense.items():
        assert np.array_equal(np.concatenate([d[name] for _, d in loaded]), array)
    merged = {int(i): row for t, _ in loaded for i, row in zip(t["emb"].ids(), t["emb"].lookup_slot("v", t["emb"].ids()))}
    assert all(np.array_equal(merged[int(i)], row) for i, row in zip(ids, table.lookup_slot("v", ids)))


def test_bundles_keep_every_task_once_and_a_failed_task_does_not_stop_its_bundle():
    from fastckpt.sharded.workers import bundles

    for sizes, limit, least in [([5] * 7, 3, 10), ([1, 100, 1, 1], 4, 1), ([0, 0], 2, 1), ([], 3, 1)]:
        groups = bundles(sizes, limit, least)
        assert sorted(k for g in groups for k in g) == list(range(len(sizes)))
        assert len(groups) <= max(1, min(limit, sum(sizes) // least)) and all(g == sorted(g) for g in groups)
    assert bundles([5] * 7, 3, 10) == [[0, 3, 6], [1, 4], [2, 5]]
    ran: list = []
    with Lane("rows", 2) as lane:
        futures = lane.submit_bundled([(int, ("x",)), (ran.append, (1,)), (ran.append, (2,))], [1, 1, 1], least=10)
    with pytest.raises(ValueError):
        futures[0].result()
    assert ran == [1, 2] and futures[1].result() is None
