"""The simulated discrete device (fastckpt.device.simlink): its link's timing model, exact staged loads over it, and
the order the staged pipeline keeps (fills never write a staging buffer a copy is still reading)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _device_data import sample

from fastckpt.device.load import load_file
from fastckpt.device.pool import PersistentBufferPool

from test_load import check_exact, write_raw_safetensors

pytestmark = pytest.mark.device
EPS = 1e-9  # the rounding of a window's length recomputed from perf_counter floats (end - start)


@pytest.fixture
def sim(device):
    """A simulated queue on the test device, closed after the test; ``sim(rate, exact=...)`` makes it."""
    from fastckpt.device.simlink import SimulatedQueue

    made = []

    def make(rate, **kw):
        made.append(SimulatedQueue(device.context, device.device, rate=rate, **kw))
        return made[-1]

    yield make
    for queue in made:
        queue.close()


def _buffer(device, nbytes):
    import pyopencl as cl

    return cl.Buffer(device.context, cl.mem_flags.READ_WRITE, nbytes)


def _read(device, buffer, nbytes):
    import pyopencl as cl

    out = np.empty(nbytes, np.uint8)
    cl.enqueue_copy(device.queue, out, buffer, is_blocking=True)
    return out


def test_a_copy_takes_at_least_its_bytes_over_the_rate(device, sim):
    n, rate = 1 << 20, 0.5e9  # 2.1 ms a copy
    queue = sim(rate)
    link = queue.link
    buffer = _buffer(device, 3 * n)
    data = sample(np.uint8, (3 * n,), 1)
    sent = time.perf_counter()
    events = [link.copy(queue, buffer, data[k * n:(k + 1) * n], k * n) for k in range(3)]
    events[0].wait()
    first = time.perf_counter()
    events[-1].wait()
    last = time.perf_counter()
    assert first - sent >= n / rate
    assert last - sent >= 3 * n / rate, "one engine: three copies sent at once take three windows"
    copies = link.copies
    assert [c.at for c in copies] == [0, n, 2 * n] and all(c.nbytes == n for c in copies)
    for c in copies:
        assert c.end - c.start >= n / rate - EPS and c.done >= c.end and c.start >= c.sent
    for a, b in zip(copies, copies[1:]):
        assert b.start >= a.end, "the windows never overlap"
    assert _read(device, buffer, 3 * n).tobytes() == data.tobytes(), "exact: the bytes reached the buffer"
    assert not link.torn and not link.errors


def test_a_copy_adds_its_latency_and_a_later_copy_waits_for_the_engine(device, sim):
    queue = sim(1e9, latency=0.004)
    buffer = _buffer(device, 8192)
    event = queue.link.copy(queue, buffer, np.ones(4096, np.uint8), 0)
    event.wait()
    c = queue.link.copies[0]
    assert c.end - c.start >= 0.004 + 4096 / 1e9 - EPS
    # A command queued on the queue after a staged copy waits for it: the queue stays in order.
    import pyopencl as cl

    slow = sim(2e6, exact=False)  # 20 ms for 40 KB
    slow.link.copy(slow, buffer, np.zeros(40_000, np.uint8), 0)
    cl.enqueue_marker(slow).wait()
    done = time.perf_counter()
    # Against the copy's own window, not a clock started after it was queued: a thread descheduled between the two
    # calls on a loaded machine saw the marker "wait" less than the copy's 20 ms.
    (copy,) = slow.link.copies
    assert copy.end - copy.start >= 40_000 / 2e6 - EPS and done >= copy.end


def test_the_link_waits_without_using_the_cpu(device, sim):
    queue = sim(1e8, exact=False)  # 100 ms for 10 MB
    data = np.zeros(10_000_000, np.uint8)
    buffer = _buffer(device, len(data))
    import pyopencl as cl

    cpu, wall = time.process_time(), time.perf_counter()
    event = queue.link.copy(queue, buffer, data, 0)
    # Polled, not event.wait(): waiting with event.wait() on an H200, the process spent 0.2 s of CPU over a 0.1 s copy
    # (NVIDIA's OpenCL may spin in clWaitForEvents): the waiting thread's cost, not the link's.
    while event.command_execution_status != cl.command_execution_status.COMPLETE:
        time.sleep(0.002)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 0.1
    assert cpu < 0.5 * wall, f"the engine slept: {cpu:.3f} s of CPU over {wall:.3f} s"


def test_the_link_sees_bytes_changed_while_it_reads_them_and_bytes_that_do_not_belong(device, sim):
    queue = sim(1e7, exact=False)  # 10 ms for 100 KB
    data = sample(np.uint8, (100_000,), 2)
    buffer = _buffer(device, len(data))
    event = queue.link.copy(queue, buffer, data, 0)
    data[::4096] ^= 0xFF  # a fill writing into a staging buffer still being copied
    event.wait()
    assert queue.link.torn == [(buffer.int_ptr, 0, len(data))]
    with pytest.raises(AssertionError, match="to byte 0 of buffer"):
        queue.link.check(lambda b, at, n: data[at:at + n])
    queue.link.reset()
    queue.link.copy(queue, buffer, data, 0).wait()
    assert not queue.link.torn and queue.link.check(lambda b, at, n: data[at:at + n]) == 1
    with pytest.raises(AssertionError, match="when it started"):
        queue.link.check(lambda b, at, n: np.zeros(n, np.uint8))


def test_bad_link_settings_are_refused(device):
    from fastckpt.device.simlink import SimulatedLink

    with pytest.raises(ValueError, match="bytes per second"):
        SimulatedLink(device.context, rate=0)
    with pytest.raises(ValueError, match="latency"):
        SimulatedLink(device.context, rate=1e9, latency=-1)


@pytest.mark.parametrize("read", ["preadv", "mmap"])
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("use_pool", [True, False])
def test_staged_loads_over_the_link_are_exact(tmp_path, device, sim, monkeypatch, read, blocking, use_pool):
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "READ", read)
    monkeypatch.setattr(staging, "FILL_SPLIT", 16 << 10)  # several fill threads on these small chunks
    monkeypatch.setattr(staging, "_cpus", lambda: 3)
    path = tmp_path / "m.safetensors"
    tensors = {"lead": np.arange(3, dtype=np.uint8),
               **{f"w{i}": sample(np.float64, (5000 + 37 * i,), seed=i) for i in range(6)}}  # ~240 KB
    write_raw_safetensors(path, tensors)
    queue = sim(2e9)
    pool = PersistentBufferPool(device.context, queue) if use_pool else None
    for _ in range(2):  # the second through the pool's kept file and staging buffers
        queue.link.reset()
        loaded = load_file(path, queue, pool=pool, staging=64 << 10, blocking=blocking)
        report = loaded.report
        assert report.staging_chunk == 64 << 10 and report.fill_threads == 3
        check_exact(loaded, path, tensors)
        link = queue.link
        assert not link.torn and not link.errors
        assert len(link.copies) == report.copies and sum(c.nbytes for c in link.copies) == report.bytes_copied
        loaded.release()


def test_the_staged_pipeline_keeps_its_order_over_a_slow_link(tmp_path, device, sim, monkeypatch):
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "FILL_SPLIT", 16 << 10)
    monkeypatch.setattr(staging, "_cpus", lambda: 2)
    fills, lock = [], threading.Lock()
    real_fill = staging.fill

    def fill(pending, pairs):
        if pending:
            staging._wait_events(pending)  # what the real fill does first: the writes begin after it
        began = time.perf_counter()
        real_fill(None, pairs)
        with lock:
            fills.extend((dst.ctypes.data, len(dst), began, time.perf_counter()) for dst, _src, _file in pairs)

    monkeypatch.setattr(staging, "fill", fill)
    path = tmp_path / "m.safetensors"
    chunk = 64 << 10
    tensors = {"w": sample(np.uint8, (12 * chunk - 5,), 3)}
    write_raw_safetensors(path, tensors)
    queue = sim(20e6)  # 3.3 ms a chunk: the fill of the next batches runs while a copy is on the link
    loaded = load_file(path, queue, pool=None, staging=chunk)
    check_exact(loaded, path, tensors)
    report = loaded.report
    copies = queue.link.copies
    assert report.staging_buffers == 3 and len(copies) == 12
    # Each batch goes out once filled, in whichever order the fills completed: together they cover the stream once.
    assert sorted((c.at, c.nbytes) for c in copies) == [(k * chunk, chunk) for k in range(11)] + [(11 * chunk,
                                                                                                   chunk - 5)]
    for addr, n, began, ended in fills:
        for c in copies:
            if c.host < addr + n and addr < c.host + c.nbytes:  # the fill and the copy share staging memory
                assert c.done <= began or c.sent >= ended, "a fill wrote a staging buffer a copy was reading"
    overlapped = sum(1 for _a, _n, began, _e in fills for c in copies if c.start < began < c.end)
    assert overlapped > 0, "the fill runs ahead while copies are on the link"
    assert not queue.link.torn


def _stall_one_fill(monkeypatch, nth: int, until) -> dict:
    """Make the ``nth`` call of ``staging.fill`` wait first (a fill thread preempted mid-part): ``until`` seconds, or
    until that many batches have been sent; the returned dict gets ``ended``, when that fill returned."""
    from fastckpt.device import staging

    real_fill, real_send, lock, calls, stalled = staging.fill, staging.Stager._send, threading.Lock(), [], {}
    sent, go = [], threading.Event()

    def send(self, slot, batch):
        real_send(self, slot, batch)
        sent.append(slot)
        if isinstance(until, int) and len(sent) >= until:
            go.set()

    def fill(pending, pairs):
        with lock:
            calls.append(None)
            mine = len(calls) == nth
        if mine:
            go.wait(until if isinstance(until, float) else 10.0)
        got = real_fill(pending, pairs)
        if mine:
            stalled["ended"] = time.perf_counter()
        return got

    monkeypatch.setattr(staging, "fill", fill)
    monkeypatch.setattr(staging.Stager, "_send", send)
    return stalled


def test_a_stalled_fill_holds_back_no_batch_filled_after_it(tmp_path, device, sim, monkeypatch):
    # One fill thread stops for 0.3 s in the middle of batch 1 (preempted, or a slow read): the other fills and
    # sends every later batch meanwhile, each into the buffer freed first. Sent in the stream's order, the batches
    # filled after batch 1 waited for it, and batch 1 + buffers waited for its buffer: the other thread stood idle.
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "FILL_SPLIT", 64 << 10)  # a part is a whole batch: one thread each
    monkeypatch.setattr(staging, "_cpus", lambda: 2)
    stalled = _stall_one_fill(monkeypatch, 2, 0.3)
    path = tmp_path / "m.safetensors"
    chunk = 64 << 10
    tensors = {"w": sample(np.uint8, (12 * chunk,), 11)}
    write_raw_safetensors(path, tensors)
    queue = sim(1e9)  # 66 us a batch: the link is never what the fills wait for
    loaded = load_file(path, queue, pool=None, staging=chunk)
    check_exact(loaded, path, tensors)
    copies = queue.link.copies
    assert loaded.report.staging_buffers == 4 and loaded.report.fill_threads == 2 and len(copies) == 12
    before = [c for c in copies if c.sent < stalled["ended"]]
    assert len(before) == 11, "every batch but the stalled one went out while it was stalled"
    assert sorted((c.at, c.nbytes) for c in copies) == [(k * chunk, chunk) for k in range(12)]
    assert not queue.link.torn and not queue.link.errors


@pytest.mark.parametrize("blocking", [True, False])
def test_progress_reports_a_tensor_once_every_copy_of_its_bytes_is_done_when_batches_go_out_of_order(
        tmp_path, device, sim, monkeypatch, blocking):
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "FILL_SPLIT", 64 << 10)
    monkeypatch.setattr(staging, "_cpus", lambda: 2)
    _stall_one_fill(monkeypatch, 2, 4)  # batch 1 goes out after four later ones, before the rest
    path = tmp_path / "m.safetensors"
    chunk = 64 << 10
    # "big" spans batches 0-3 with no tensor ending in batch 1, the stalled one: its report must wait for batch 1's
    # copy, sent after batch 3's
    tensors = {"a": sample(np.uint8, (1000,), 1), "big": sample(np.uint8, (chunk * 7 // 2 - 1000,), 2),
               **{f"w{i}": sample(np.uint8, (chunk // 2 + 17 * i,), i) for i in range(8)}}
    write_raw_safetensors(path, tensors)
    queue = sim(0.25e9)  # 262 us a batch: batch 1's copy waits behind those sent before it
    reported: list = []
    pool = PersistentBufferPool(device.context, queue)
    loaded = load_file(path, queue, pool=pool, staging=chunk, blocking=blocking,
                       progress=lambda done, total, item: reported.append((time.perf_counter(), item, done)))
    loaded.wait()
    check_exact(loaded, path, tensors)
    copies = queue.link.copies
    assert [c.at for c in copies] != sorted(c.at for c in copies), "the stall sent batches out of order"
    assert [item for _t, item, _d in reported] == list(tensors), "in the file's order, each once"
    assert reported[-1][2] == sum(t.nbytes for t in tensors.values())
    if blocking:  # a non-blocking load counts each tensor as its copies are queued
        for at, name, _done in reported:
            t = loaded[name]
            lo, hi = t.offset, t.offset + tensors[name].nbytes
            mine = [c for c in copies if c.buffer == t.buffer.int_ptr and c.at < hi and lo < c.at + c.nbytes]
            assert sum(min(hi, c.at + c.nbytes) - max(lo, c.at) for c in mine) == hi - lo, name
            assert max(c.done for c in mine) <= at, f"{name} was reported before its last copy was done"
    assert not queue.link.torn and not queue.link.errors


def test_a_cold_batch_goes_to_the_buffer_its_pieces_were_placed_for_where_buffers_differ_in_alignment(
        tmp_path, device, sim, monkeypatch):
    # A cold load places each piece where its buffer's address agrees with its file offset modulo DIRECT_ALIGN, for
    # O_DIRECT. Buffers whose addresses differ modulo DIRECT_ALIGN: a batch sent out of order must still take the
    # buffer it was placed for, or its reads lose their alignment and go through the page cache.
    from fastckpt.device import load, staging
    from fastckpt.device.pool import StagingBuffers
    from fastckpt.formats.readinto import DIRECT_ALIGN, direct_pieces

    from test_readinto import _has_direct

    if not _has_direct(tmp_path):
        pytest.skip("the file system of the temporary directory has no O_DIRECT")
    real_allocate, residues = StagingBuffers.allocate.__func__, set()

    def allocate(cls, queue, chunk, count=2):
        made = real_allocate(cls, queue, chunk + DIRECT_ALIGN, count)
        hosts = [h[512 * i:512 * i + chunk] for i, h in enumerate(made.hosts)]  # 512 bytes apart modulo 4096
        residues.update(h.ctypes.data % DIRECT_ALIGN for h in hosts)
        return cls(chunk, made.buffers, hosts)

    monkeypatch.setattr(StagingBuffers, "allocate", classmethod(allocate))
    monkeypatch.setattr(load, "cached", lambda *a, **k: False)  # the cold path
    monkeypatch.setattr(staging, "FILL_SPLIT", 64 << 10)  # fill threads on this small load
    _stall_one_fill(monkeypatch, 2, 2)  # batch 0 or 1 goes out after two later ones
    real_read, direct_reads = staging.read_into, []

    def read_into(fd, pairs, path, **kw):
        if kw.get("direct_fd") is not None:
            for dst, offset in pairs:
                direct_reads.extend((len(v), d) for v, _o, d in direct_pieces(memoryview(dst), offset, 1 << 30))
        return real_read(fd, pairs, path, **kw)

    monkeypatch.setattr(staging, "read_into", read_into)
    path = tmp_path / "m.safetensors"
    chunk = 256 << 10
    tensors = {f"w{i}": sample(np.uint8, (chunk + 4099 * i,), i) for i in range(10)}
    write_raw_safetensors(path, tensors)
    queue = sim(2e9)
    loaded = load_file(path, queue, pool=PersistentBufferPool(device.context, queue), staging=chunk)
    check_exact(loaded, path, tensors)
    assert loaded.report.fill_threads > 1
    assert len(residues) == loaded.report.staging_buffers > 2, "the buffers differ modulo DIRECT_ALIGN"
    assert [c.at for c in queue.link.copies] != sorted(c.at for c in queue.link.copies), "sent out of order"
    direct = sum(n for n, d in direct_reads if d)
    assert direct >= 0.9 * sum(n for n, _d in direct_reads), "most bytes are read whole blocks directly"
    assert not queue.link.torn and not queue.link.errors


@pytest.mark.slow  # a benchmark smoke run
def test_link_suite(tmp_path, capsys):
    from fastckpt.cli import main

    assert main(["bench", "--suite", "link", "--quick", "--repeat", "1", "--links", "2,40", "--sweep-links", "40",
                 "--buffers", "2,3", "--chunks", "16,64", "--ramps", "3", "--threads", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| link (GB/s, real) | simulated link (GB/s) | fill beside (GB/s) | fill during (GB/s) |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 2 |", "| 40 |")) and line.count("|") != 7]
    assert len(rows) == 2 + 5 and all(row.endswith("| yes |") for row in rows[:2]), out  # the sweep: 4 + default
    assert "| vs. default |" in out and rows[2].endswith("| 1.00x |"), "the default shape first, against itself"
    assert "best at 40 GB/s" in out and ("- met:" in out or "- MISSED:" in out)
    assert "| link (GB/s, real) | load (ms) | before the first copy | copying | idle between copies |" in out
    spent = [line for line in out.splitlines() if line.count("|") == 7 and line.startswith(("| 2 |", "| 40 |"))]
    assert len(spent) == 2, out


def test_link_time_splits_a_load_at_its_copies():
    # Where a load's time went on the link: before the engine took the first copy, copying, idle between copies,
    # after the last window; the four add up to the load's seconds.
    from fastckpt.bench.link import link_time
    from fastckpt.device.simlink import LinkCopy

    copies = [LinkCopy(4, 10.0, 10.25, 10.5, 10.5, 1, 0, 0), LinkCopy(4, 10.5, 10.5, 11.0, 11.0, 1, 4, 0),
              LinkCopy(8, 11.75, 11.75, 12.0, 12.125, 1, 8, 0)]
    spent = link_time(copies, 10.0, 12.5)
    assert spent == {"start": 0.25, "busy": 1.0, "gaps": 0.75, "tail": 0.5}
    assert sum(spent.values()) == 2.5
    assert link_time([], 1.0, 1.5) == {"start": 0.5, "busy": 0.0, "gaps": 0.0, "tail": 0.0}


def test_a_fill_that_does_not_wait_for_the_copies_is_caught(tmp_path, device, sim, monkeypatch):
    # The order test above can fail: fills that overwrite a staging buffer still on the link are seen.
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "_wait_events", lambda events: None)
    monkeypatch.setattr(staging, "_cpus", lambda: 1)
    path = tmp_path / "m.safetensors"
    chunk = 64 << 10
    tensors = {"w": sample(np.uint8, (12 * chunk,), 5)}
    write_raw_safetensors(path, tensors)
    queue = sim(20e6)
    loaded = load_file(path, queue, pool=None, staging=chunk)
    assert queue.link.torn
    assert loaded["w"].to_host().tobytes() != tensors["w"].tobytes()


def test_a_failed_fill_stops_the_staged_load_and_the_next_load_is_exact(tmp_path, device, sim, monkeypatch):
    # The fill threads send the batches themselves: one whose part fails must stop the others (some of them waiting
    # for a batch that will never be sent) and the load must raise, not hang, with no fill left writing.
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "FILL_SPLIT", 16 << 10)
    monkeypatch.setattr(staging, "_cpus", lambda: 3)
    real_fill, calls, lock = staging.fill, [], threading.Lock()

    def fill(pending, pairs):
        with lock:
            calls.append(time.perf_counter())
            n = len(calls)
        if n == 7:
            raise OSError("the disk went away")
        real_fill(pending, pairs)

    monkeypatch.setattr(staging, "fill", fill)
    path = tmp_path / "m.safetensors"
    chunk = 64 << 10
    tensors = {"w": sample(np.uint8, (24 * chunk - 3,), 8)}
    write_raw_safetensors(path, tensors)
    queue = sim(50e6)
    pool = PersistentBufferPool(device.context, queue)
    with pytest.raises(OSError, match="the disk went away"):
        load_file(path, queue, pool=pool, staging=chunk)
    stopped = len(calls)
    time.sleep(0.05)
    assert len(calls) == stopped, "no fill runs after the load has raised"
    assert stopped < 24 * 2, "the parts after the failure were not filled"
    monkeypatch.setattr(staging, "fill", real_fill)
    loaded = load_file(path, queue, pool=pool, staging=chunk)
    check_exact(loaded, path, tensors)
    assert not queue.link.torn and not queue.link.errors


def test_the_engine_runs_real_time_where_the_process_may(device, sim, monkeypatch):
    import os

    from fastckpt.device import simlink

    queue = sim(1e9)
    asked: list = []
    probe = threading.Thread(target=lambda: asked.append(simlink._realtime()))  # a thread that asks as the engine's
    probe.start()
    probe.join()
    assert queue.link.realtime == asked[0]
    if asked[0]:
        assert os.sched_getscheduler(queue.link._thread.native_id) == os.SCHED_FIFO
        assert os.sched_getscheduler(0) == os.SCHED_OTHER, "only the engine's thread"
    assert sim(1e9, realtime=False).link.realtime is False
    monkeypatch.setattr(simlink, "_realtime", lambda: False)  # refused: the link still runs, at ordinary priority
    refused = sim(1e9)
    assert refused.link.realtime is False
    buffer = _buffer(device, 4096)
    refused.link.copy(refused, buffer, np.ones(4096, np.uint8), 0).wait()
    assert _read(device, buffer, 4096).tolist() == [1] * 4096
