"""Huge-page advice for the pool's large buffers: taken on a CPU device, a no-op elsewhere, never a change in bytes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from fastckpt.device.hugepages import HUGE_MIN, advise_huge_pages, buffer_allocator, huge_pages_available


def _advisable(device) -> bool:
    import pyopencl as cl

    cl_device = device.queue.device
    return bool(cl_device.type & cl.device_type.CPU) and bool(cl_device.host_unified_memory) \
        and huge_pages_available()


def test_small_buffers_are_not_advised(device):
    import pyopencl as cl

    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, HUGE_MIN - 4096)
    assert advise_huge_pages(device.queue, buffer, HUGE_MIN - 4096) is False
    assert advise_huge_pages(None, buffer, HUGE_MIN) is False  # no queue: nothing to map the buffer with


def test_a_large_buffer_is_advised_on_a_cpu_device_and_keeps_its_bytes(device):
    import pyopencl as cl

    nbytes = 3 * HUGE_MIN + 12345
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, nbytes)
    assert advise_huge_pages(device.queue, buffer, nbytes) is _advisable(device)
    data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    cl.enqueue_copy(device.queue, buffer, data, is_blocking=True)
    back = np.empty_like(data)
    cl.enqueue_copy(device.queue, back, buffer, is_blocking=True)
    assert back.tobytes() == data.tobytes()


def test_the_pools_default_allocator_gives_buffers_of_the_size_asked(device):
    allocate = buffer_allocator(device.context, device.queue)
    assert [allocate(n).size for n in (256, HUGE_MIN, 2 * HUGE_MIN + 4096)] == [256, HUGE_MIN, 2 * HUGE_MIN + 4096]


def test_a_first_load_through_a_new_pool_gives_exact_bytes(tmp_path, device):
    import fastckpt
    from fastckpt.device.load import load_file
    from fastckpt.device.pool import PersistentBufferPool

    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.standard_normal(HUGE_MIN // 4 + i, dtype=np.float32) for i in range(3)}
    path = tmp_path / "big.safetensors"
    fastckpt.save_safetensors(path, tensors)
    pool = PersistentBufferPool(device.context, device.queue)
    loaded = load_file(path, device.queue, pool=pool)
    assert loaded.report.pool_misses == 1
    assert {k: loaded[k].to_host().tobytes() for k in tensors} == {k: v.tobytes() for k, v in tensors.items()}


def test_huge_pages_false_leaves_a_new_buffer_unadvised_and_exact(device, monkeypatch):
    """The switch the cold suite's "4 KiB pages" row measures the arena without: no advice, the same bytes."""
    import pyopencl as cl

    from fastckpt.device import hugepages

    monkeypatch.setattr(hugepages, "HUGE_PAGES", False)
    nbytes = 2 * HUGE_MIN
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, nbytes)
    assert advise_huge_pages(device.queue, buffer, nbytes) is False
    data = np.arange(nbytes, dtype=np.uint8)
    cl.enqueue_copy(device.queue, buffer, data, is_blocking=True)
    back = np.empty_like(data)
    cl.enqueue_copy(device.queue, back, buffer, is_blocking=True)
    assert back.tobytes() == data.tobytes()


def test_host_address_is_the_buffers_own_memory_on_a_cpu_device(device):
    """What a staged load prefaults: the address a map returns, seen again after the unmap, only on a device that
    shares host memory; the callback runs while the buffer is mapped (where the huge-page advice is given)."""
    import pyopencl as cl

    from fastckpt.device.hugepages import host_address

    nbytes = HUGE_MIN
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, nbytes)
    seen = []
    first = host_address(device.queue, buffer, nbytes, seen.append)
    if not _advisable(device) and first is None:
        assert seen == []
        return
    assert first is not None and seen == [first]
    assert host_address(device.queue, buffer, nbytes) == first  # the buffer's memory stays where it is
    mapped, _event = cl.enqueue_map_buffer(device.queue, buffer, cl.map_flags.READ, 0, (nbytes,), np.uint8,
                                           is_blocking=True)
    try:
        assert mapped.__array_interface__["data"][0] == first
    finally:
        mapped.base.release(device.queue).wait()
