"""PersistentBufferPool: bookkeeping through a fake allocator (no device), then for real on pocl."""

from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest

from fastckpt.device.pool import MIN_CLASS, OpenFiles, PersistentBufferPool, PoolBuffer, arena_size, size_class


class FakeBuffer:
    """What a fake allocator returns: only a size, plus an id to tell buffers apart."""

    def __init__(self, size: int, serial: int):
        self.size = size
        self.serial = serial

    def __repr__(self):
        return f"<FakeBuffer #{self.serial} size={self.size}>"


class FakeAllocator:
    """Counts allocations and can fail like a full device (MemoryError) beyond ``capacity`` live bytes."""

    def __init__(self, capacity: int | None = None, error: type[BaseException] = MemoryError):
        self.capacity = capacity
        self.error = error
        self.calls = []
        self.live: dict[int, int] = {}
        self._serial = 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> FakeBuffer:
        with self._lock:
            self.calls.append(nbytes)
            if self.capacity is not None:
                gc.collect()  # count only buffers still referenced, as a device would
            if self.capacity is not None and sum(self.live.values()) + nbytes > self.capacity:
                raise self.error(f"fake device full: {nbytes} asked, {sum(self.live.values())} live")
            self._serial += 1
            buf = FakeBuffer(nbytes, self._serial)
            self.live[buf.serial] = nbytes
            import weakref

            weakref.finalize(buf, self.live.pop, buf.serial, None)
            return buf


def make_pool(**kw):
    alloc = FakeAllocator(**{k: kw.pop(k) for k in ("capacity", "error") if k in kw})
    return PersistentBufferPool(None, allocator=alloc, **kw), alloc


# -- size classes ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 300, 511, 512, 513, 1000, 4095, 4096, 4097,
                               65537, 10**6, 3 * 2**20 + 1, 2**31 - 1, 2**31 + 1])
def test_size_class_bounds_padding(n):
    c = size_class(n)
    assert c >= max(n, 1)
    if n > MIN_CLASS:
        assert c - n <= n // 8, "at most 12.5 % padding"
    assert size_class(c) == c, "a class size is its own class"


def test_size_classes_are_monotone_and_geometric():
    classes = sorted({size_class(n) for n in range(1, 1 << 16, 7)})
    per_octave = [sum(1 for c in classes if 2**k < c <= 2**(k + 1)) for k in range(9, 15)]
    assert per_octave == [8] * 6


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 10**6, 3 * 2**20 + 1, 2**29 + 1, 2**31 - 1, 10**10])
def test_arena_size_pads_at_most_one_sixty_fourth(n):
    a = arena_size(n)
    assert a >= n and a % 4096 == 0
    assert a - n < max(4096, n // 64 + 1)


# -- hits, misses, returns ---------------------------------------------------------------------
def test_same_class_is_a_hit_and_allocates_nothing():
    pool, alloc = make_pool()
    a = pool.allocate(1000)
    assert (a.nbytes, a.size, a.hit) == (1000, 1024, False)
    raw = a.buffer
    a.release()
    b = pool.allocate(1010)
    assert b.hit and b.buffer is raw
    s = pool.stats
    assert (s.hits, s.misses, s.allocations, s.bytes_allocated) == (1, 1, 1, 1024)
    assert alloc.calls == [1024]


def test_lease_returns_on_garbage_collection():
    pool, _ = make_pool()
    lease = pool.allocate(5000)
    assert pool.stats.bytes_in_use == 5120
    del lease
    gc.collect()
    s = pool.stats
    assert (s.bytes_in_use, s.bytes_idle, s.buffers_held) == (0, 5120, 1)


def test_release_is_idempotent_and_context_manager_releases():
    pool, _ = make_pool()
    with pool.allocate(100) as lease:
        assert not lease.released
    assert lease.released
    lease.release()
    pool.release(lease)
    s = pool.stats
    assert (s.bytes_in_use, s.buffers_held) == (0, 1)


def test_in_use_buffers_are_never_handed_out_twice():
    pool, _ = make_pool()
    leases = [pool.allocate(4096) for _ in range(5)]
    assert len({id(lease.buffer) for lease in leases}) == 5
    assert pool.stats.misses == 5


def test_small_request_may_borrow_a_slightly_larger_idle_class_but_not_a_much_larger_one():
    pool, _ = make_pool()
    pool.allocate(4608).release()  # class 4608 = 4096 * 1.125
    borrowed = pool.allocate(4096)
    assert borrowed.hit and borrowed.size == 4608  # 4608 <= 4096 * 1.25
    pool.allocate(8192).release()
    assert not pool.allocate(4096).hit


# -- arenas ----------------------------------------------------------------------------------
def test_arena_takes_the_best_fitting_idle_buffer():
    pool, _ = make_pool()
    leases = [pool.arena(n) for n in (10_000_000, 4_000_000, 6_000_000)]
    sizes = {lease.buffer.serial: lease.size for lease in leases}
    for lease in leases:
        lease.release()
    got = pool.arena(3_900_000)
    assert got.hit and got.size == leases[1].size, sizes
    got2 = pool.arena(5_000_000)
    assert got2.hit and got2.size == leases[2].size


def test_arena_is_not_reused_for_a_region_less_than_half_its_size():
    pool, _ = make_pool()
    pool.arena(10_000_000).release()
    small = pool.arena(4_000_000)
    assert not small.hit
    assert pool.stats.allocations == 2


def test_arena_reload_of_same_region_allocates_nothing():
    pool, alloc = make_pool()
    for _ in range(5):
        lease = pool.arena(123_457)
        assert lease.size >= 123_457
        lease.release()
    s = pool.stats
    assert (s.misses, s.hits, len(alloc.calls)) == (1, 4, 1)


def test_arena_larger_than_one_allocation_is_refused_with_the_limit():
    pool = PersistentBufferPool(None, allocator=FakeAllocator(), max_alloc_size=1 << 20)
    assert pool.arena(1 << 20).size == 1 << 20  # rounded up to the class would exceed the limit
    with pytest.raises(ValueError, match="max_mem_alloc_size is 1048576"):
        pool.arena((1 << 20) + 1)


# -- bounds and eviction -----------------------------------------------------------------------
def test_max_bytes_evicts_least_recently_used_idle_first():
    pool, _ = make_pool(max_bytes=3 * 4096)
    a, b, c = (pool.allocate(4096) for _ in range(3))
    ids = {lease.buffer.serial: name for lease, name in ((a, "a"), (b, "b"), (c, "c"))}
    b.release()
    a.release()
    c.release()  # LRU order now: b, a, c
    d = pool.allocate(8192)  # needs 8192 more: evicts b then a
    assert not d.hit
    s = pool.stats
    assert s.evictions == 2 and s.bytes_held == 4096 + 8192
    survivor = pool.allocate(4096)
    assert survivor.hit and ids[survivor.buffer.serial] == "c"


def test_request_beyond_max_bytes_is_served_and_freed_on_return():
    pool, _ = make_pool(max_bytes=4096)
    big = pool.allocate(100_000)
    assert pool.stats.bytes_held > 4096
    big.release()
    s = pool.stats
    assert (s.bytes_held, s.evictions) == (0, 1)


def test_out_of_memory_frees_idle_and_retries_once():
    pool, alloc = make_pool(capacity=3 * 4096)
    held = [pool.allocate(4096) for _ in range(3)]
    for lease in held:
        lease.release()
    del held, lease
    big = pool.allocate(8192)  # fails once (12288 live), then succeeds after freeing the idle 3
    assert not big.hit
    assert alloc.calls == [4096] * 3 + [8192, 8192]
    s = pool.stats
    assert s.bytes_held == 8192 and s.evictions == 3


def test_out_of_memory_twice_raises_a_clear_error():
    pool, _ = make_pool(capacity=8192)
    keep = pool.allocate(8192)
    with pytest.raises(MemoryError, match=r"device allocation of 4096 bytes failed.*holds 8192 bytes in use"):
        pool.allocate(4096)
    assert keep.buffer.size == 8192
    assert pool.stats.bytes_in_use == 8192


class FakeClError(Exception):
    def __init__(self, code):
        super().__init__(f"clCreateBuffer failed: code {code}")
        self.code = code


@pytest.mark.parametrize("code, retried", [(-4, True), (-5, True), (-61, False), (-30, False)])
def test_only_out_of_resources_codes_are_retried(code, retried):
    calls = []

    def allocator(n):
        calls.append(n)
        raise FakeClError(code)

    pool = PersistentBufferPool(None, allocator=allocator)
    with pytest.raises(MemoryError if retried else FakeClError):
        pool.allocate(1)
    assert len(calls) == (2 if retried else 1)


def test_free_idle_and_clear():
    pool, alloc = make_pool()
    live = pool.allocate(1 << 16)
    for n in (1 << 12, 1 << 13):
        pool.allocate(n).release()
    assert pool.free_idle() == (1 << 12) + (1 << 13)
    pool.allocate(1 << 12).release()
    assert pool.clear() == 1 << 12
    s = pool.stats
    assert (s.bytes_held, s.bytes_in_use, s.evictions) == (1 << 16, 1 << 16, 0)
    live.release()
    assert pool.stats.bytes_idle == 1 << 16


@pytest.mark.parametrize("bad", [-1, -(1 << 40)])
def test_negative_sizes_are_refused(bad):
    pool, _ = make_pool()
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(bad)


def test_pool_needs_a_context_or_allocator():
    with pytest.raises(ValueError, match="allocator"):
        PersistentBufferPool(None)


# -- allocator protocol ------------------------------------------------------------------------
def test_allocator_protocol_returns_dropped_buffers():
    pool, _ = make_pool()
    buf = pool(3000)
    assert isinstance(buf, FakeBuffer) and buf.size == size_class(3000)
    assert pool.collect() == 0, "still referenced here"
    assert pool.stats.bytes_in_use == buf.size
    del buf
    assert pool.collect() == 1
    assert pool.stats.bytes_in_use == 0
    again = pool(3000)
    assert pool.stats.hits == 1 and again.size == size_class(3000)


def test_allocator_protocol_buffer_kept_by_a_container_is_not_taken_back():
    pool, _ = make_pool()
    holder = [pool(100)]
    pool.allocate(10**6).release()  # unrelated traffic
    assert pool.stats.buffers_in_use == 1
    holder.clear()
    assert pool.stats.buffers_in_use == 0


def test_release_of_a_protocol_buffer_and_of_a_stranger():
    pool, _ = make_pool()
    buf = pool(100)
    pool.release(buf)
    assert pool.stats.bytes_in_use == 0
    with pytest.raises(ValueError, match="not handed out by this pool"):
        pool.release(buf)
    with pytest.raises(ValueError, match="not handed out by this pool"):
        pool.release(object())


# -- concurrency and re-entrancy -----------------------------------------------------------------
def test_a_sweep_between_handing_out_and_returning_a_protocol_buffer_keeps_it_in_use():
    pool, _ = make_pool()
    real_release = pool._release_lock
    swept = []

    def release_then_sweep_as_another_thread_would():
        real_release()
        if pool._handed and not swept:  # once the buffer is registered, and once only
            swept.append(None)
            swept[0] = pool.collect()  # takes and releases the lock itself

    pool._release_lock = release_then_sweep_as_another_thread_would
    buf = pool(100)
    pool._release_lock = real_release
    assert swept == [0], "the buffer on its way to the caller is referenced"
    assert pool.stats.buffers_in_use == 1
    other = pool(100)
    assert other is not buf, "a buffer in use is never handed out twice"
    del buf, other
    assert pool.collect() == 2 and pool.stats.buffers_in_use == 0


def test_a_return_queued_while_the_lock_is_held_is_applied_when_it_is_released():
    pool, _ = make_pool()
    lease = pool.allocate(4096)
    pool._lock.acquire()  # as if the pool were mid-update when a finalizer ran
    try:
        del lease
        gc.collect()
        assert len(pool._returned) == 1 and pool._bytes_in_use == 4096
    finally:
        pool._release_lock()
    assert pool._bytes_in_use == 0 and not pool._returned


def test_threads_share_one_pool_consistently():
    pool, alloc = make_pool(max_bytes=1 << 20)
    errors = []
    holders: dict[int, int] = {}  # id(buffer) -> the thread holding it: a buffer never has two
    holders_lock = threading.Lock()

    def take(buffer, seed):
        with holders_lock:
            if id(buffer) in holders:
                errors.append(f"{buffer!r} handed to thread {seed} while thread {holders[id(buffer)]} holds it")
            holders[id(buffer)] = seed

    def give_up(buffer):
        with holders_lock:
            del holders[id(buffer)]

    def worker(seed):
        rng = random.Random(seed)
        held: list[PoolBuffer] = []
        kept_protocol_buffers = []
        try:
            for _ in range(400):
                op = rng.random()
                if op < 0.4:
                    held.append(pool.allocate(rng.choice((100, 4000, 5000, 70_000))))
                    take(held[-1].buffer, seed)
                elif op < 0.55:
                    held.append(pool.arena(rng.randrange(1, 300_000)))
                    take(held[-1].buffer, seed)
                elif op < 0.6:
                    pool(rng.randrange(1, 9000))  # dropped at once: taken back by a sweep
                elif op < 0.65:
                    kept_protocol_buffers.append(pool(rng.randrange(1, 9000)))
                    take(kept_protocol_buffers[-1], seed)
                elif op < 0.7 and kept_protocol_buffers:
                    give_up(kept_protocol_buffers.pop(rng.randrange(len(kept_protocol_buffers))))
                elif held:
                    lease = held.pop(rng.randrange(len(held)))
                    give_up(lease.buffer)
                    if rng.random() < 0.5:
                        lease.release()
                    # else dropped: the finalizer returns it
                for lease in held:
                    assert lease.buffer.size >= lease.nbytes
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            for lease in held:
                give_up(lease.buffer)
            for buffer in kept_protocol_buffers:
                give_up(buffer)
            held.clear()
            kept_protocol_buffers.clear()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors
    s = pool.stats
    assert s.bytes_in_use == 0 and s.buffers_in_use == 0
    assert s.bytes_held == s.bytes_idle <= 1 << 20
    assert s.allocations == s.misses == len(alloc.calls)
    assert s.bytes_held == sum(b.size for b in pool._idle.values())


# -- files kept open (no device) -------------------------------------------------------------------
def test_a_kept_file_is_served_while_unchanged(tmp_path):
    import fastckpt

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"x": np.arange(4, dtype=np.int32)}, fsync=False)
    files = OpenFiles(2)
    tf = fastckpt.open(path)
    assert files.put(path, tf) and files.get(str(path)) is tf


@pytest.mark.parametrize("change", ["replace", "rewrite in place"])
def test_a_file_changed_between_open_and_keep_is_never_kept(tmp_path, change):
    import os

    import fastckpt

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"x": np.zeros(4, np.int32)}, fsync=False)
    tf = fastckpt.open(path)
    if change == "replace":  # same size, new inode
        fastckpt.save_safetensors(path, {"x": np.ones(4, np.int32)}, fsync=False, overwrite=True)
    else:
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(tf.info("x").offset)
            f.write(np.ones(4, np.int32).tobytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # even on a coarse clock
    files = OpenFiles(2)
    assert not files.put(path, tf), "the mapping is of the file as it was"
    assert files.get(path) is None and len(files) == 0


# -- on a real device ----------------------------------------------------------------------------
# conftest's `device` (each kind present) under the name these tests use.
@pytest.fixture(scope="module")
def dev(device):
    return device


@pytest.mark.device
def test_device_pool_backs_pyopencl_arrays(dev):
    import pyopencl.array as cla

    pool = PersistentBufferPool(dev.context, dev.queue)
    host = np.arange(1000, dtype=np.float32)
    a = cla.to_device(dev.queue, host, allocator=pool)
    assert np.array_equal((a + 1).get(), host + 1)  # the temporary came from the pool too
    assert pool.stats.bytes_in_use >= 4096
    del a
    gc.collect()
    assert pool.stats.bytes_in_use == 0
    b = cla.to_device(dev.queue, host[::-1].copy(), allocator=pool)
    assert pool.stats.hits >= 1
    assert np.array_equal(b.get(), host[::-1])


@pytest.mark.device
def test_device_pool_lease_buffer_round_trips_bytes(dev):
    import pyopencl as cl

    pool = PersistentBufferPool(dev.context, dev.queue)
    assert pool.max_alloc_size == dev.device.max_mem_alloc_size
    data = np.frombuffer(np.random.default_rng(0).bytes(12345), np.uint8)
    with pool.arena(data.nbytes) as lease:
        cl.enqueue_copy(dev.queue, lease.buffer, data, is_blocking=True)
        out = np.empty_like(data)
        cl.enqueue_copy(dev.queue, out, lease.buffer, is_blocking=True)
        assert out.tobytes() == data.tobytes()
    assert pool.arena(data.nbytes).hit


@pytest.mark.device
def test_device_allocation_beyond_the_device_limit_is_a_clear_error(dev):
    pool = PersistentBufferPool(dev.context, dev.queue)
    with pytest.raises(ValueError, match="max_mem_alloc_size"):
        pool.allocate(pool.max_alloc_size + 1)


# -- a second load that cannot reuse the pool's buffer says so ------------------------------------
@pytest.mark.device
def test_a_leftover_tensor_of_an_earlier_load_is_named_once_and_counted(dev, tmp_path):
    # One tensor kept from the previous load pinned its arena: the second load allocated again (~20x slower),
    # silently.
    import warnings

    import fastckpt
    from fastckpt.device.load import load_file

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {f"layer.{i}.weight": np.full((256, 256), i, np.float32) for i in range(4)})
    pool = PersistentBufferPool(dev.context, dev.queue)
    first = load_file(path, dev.queue, pool=pool)
    kept = first["layer.2.weight"]
    del first
    gc.collect()
    with pytest.warns(fastckpt.FastCkptWarning, match=r"buffer pool: the .* buffer of an earlier load of .*m\."
                                                        r"safetensors is still held by its tensor 'layer.2.weight'"):
        second = load_file(path, dev.queue, pool=pool)
    assert second.report.pool_misses == 1
    stats = pool.stats
    assert stats.blocked_misses == 1 and "'layer.2.weight'" in stats.last_blocked
    del second
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per pool
        third = load_file(path, dev.queue, pool=pool)  # reuses the second load's buffer: a hit
    assert third.report.pool_hits == 1 and pool.stats.blocked_misses == 1
    assert np.array_equal(kept.to_host(), np.full((256, 256), 2, np.float32))
    del third, kept
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fourth = load_file(path, dev.queue, pool=pool)
    assert fourth.report.pool_hits == 1


@pytest.mark.device
def test_two_loads_held_at_once_are_counted_but_not_warned_about(dev, tmp_path):
    import warnings

    import fastckpt
    from fastckpt.device.load import load_file

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"w": np.ones((128, 128), np.float32)})
    pool = PersistentBufferPool(dev.context, dev.queue)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = load_file(path, dev.queue, pool=pool)
        b = load_file(path, dev.queue, pool=pool)  # two models wanted at once: a legitimate second buffer
    assert pool.stats.blocked_misses == 1 and "are in use" in pool.stats.last_blocked
    assert np.array_equal(a["w"].to_host(), b["w"].to_host())


@pytest.mark.device
def test_a_model_built_from_an_earlier_load_is_not_a_leftover(dev, tmp_path):
    # Most of the earlier load is alive (a model holds its tensors): a second buffer is what the user asked for.
    import warnings

    import fastckpt
    from fastckpt.device.load import load_file

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {f"w{i}": np.full(1024, i, np.float32) for i in range(4)})
    pool = PersistentBufferPool(dev.context, dev.queue)
    loaded = load_file(path, dev.queue, pool=pool)
    model = {name: loaded[name] for name in ("w0", "w1", "w2")}  # 3 of 4 tensors: most of the buffer
    del loaded
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_file(path, dev.queue, pool=pool)
    assert pool.stats.blocked_misses == 1 and again.report.pool_misses == 1 and len(model) == 3
