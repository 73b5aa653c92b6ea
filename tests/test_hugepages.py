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
