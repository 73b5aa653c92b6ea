"""The default device and device Tensors: lazy pyopencl, clear errors, exact bytes for every dtype."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from _device_data import DTYPES, sample

from fastckpt.device import context as device_mod
from fastckpt.device.tensor import Tensor, as_bytes

SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4)]


def test_importing_fastckpt_does_not_import_pyopencl():
    code = ("import sys, fastckpt, fastckpt.formats.reader, fastckpt.device.pool, fastckpt.device.load, fastckpt.device.tensor, fastckpt.device\n"
            "assert 'pyopencl' not in sys.modules, sorted(m for m in sys.modules if 'opencl' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'tpu'"):
        device_mod.default("tpu")


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(device_mod, "_cache", {})


@pytest.mark.parametrize("failure", ["raise", "empty"])
def test_no_platform_gives_install_advice(monkeypatch, fresh_cache, failure):
    import pyopencl as cl

    def get_platforms():
        if failure == "raise":
            raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
        return []

    monkeypatch.setattr(cl, "get_platforms", get_platforms)
    with pytest.raises(RuntimeError, match="pip install pocl-binary-distribution"):
        device_mod.default("auto")


def test_env_override_is_checked(monkeypatch, fresh_cache):
    monkeypatch.setenv("FASTCKPT_DEVICE", "fpga")
    with pytest.raises(ValueError, match="FASTCKPT_DEVICE"):
        device_mod.default("auto")


# conftest's `device` (each kind present) under the name these tests use.
@pytest.fixture(scope="module")
def dev(device):
    return device


@pytest.mark.device
def test_default_cpu_is_a_working_pocl_device(cpu_device):
    import pyopencl as cl

    dev = cpu_device
    assert dev.kind == "cpu" and dev.device.type & cl.device_type.CPU
    assert dev is device_mod.default("cpu"), "cached"
    assert dev.host_unified_memory
    data = np.arange(100, dtype=np.int32)
    buf = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=data)
    out = np.empty_like(data)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    assert np.array_equal(out, data)


@pytest.mark.device
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_tensor_round_trip_keeps_dtype_and_bytes(dev, dtype, shape):
    host = sample(dtype, shape)
    t = Tensor.from_host(dev.queue, host)
    assert (t.shape, t.dtype, t.nbytes, t.size) == (host.shape, host.dtype, host.nbytes, host.size)
    back = t.to_host()
    assert back.dtype == host.dtype and back.shape == host.shape
    assert back.tobytes() == host.tobytes()
    if not np.issubdtype(host.dtype, np.inexact) and host.dtype != ml_dtypes.bfloat16:
        assert np.array_equal(back, host)


@pytest.mark.device
def test_tensor_at_an_offset_reads_and_writes_only_its_bytes(dev):
    import pyopencl as cl

    backing = np.arange(64, dtype=np.uint8)
    buf = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=backing)
    t = Tensor(buf, (3,), "<f4", offset=5, queue=dev.queue)  # unaligned on purpose
    assert t.to_host().tobytes() == backing[5:17].tobytes()
    t.write(np.array([1.5, -2.0, 3.25], np.float32))
    whole = np.empty_like(backing)
    cl.enqueue_copy(dev.queue, whole, buf, is_blocking=True)
    assert whole[:5].tobytes() == backing[:5].tobytes() and whole[17:].tobytes() == backing[17:].tobytes()
    assert whole[5:17].tobytes() == np.array([1.5, -2.0, 3.25], np.float32).tobytes()


@pytest.mark.device
def test_to_host_waits_for_a_pending_copy(dev):
    import pyopencl as cl

    host = sample(np.float64, (1 << 16,))
    buf = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, host.nbytes)
    source = host.copy()
    event = cl.enqueue_copy(dev.queue, buf, as_bytes(source), is_blocking=False)
    t = Tensor(buf, host.shape, host.dtype, queue=dev.queue, event=event, keepalive=source)
    assert t.pending
    del source  # the tensor keeps the source alive until the copy is done
    assert t.to_host().tobytes() == host.tobytes()
    assert not t.pending and t._keepalive is None


@pytest.mark.device
def test_write_refuses_another_shape_or_dtype(dev):
    t = Tensor.from_host(dev.queue, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"cannot write float64\(2, 3\)"):
        t.write(np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        t.write(np.zeros((3, 2), np.float32))


@pytest.mark.device
def test_to_host_out_must_match(dev):
    t = Tensor.from_host(dev.queue, np.arange(4, dtype=np.int16))
    out = np.empty(4, np.int16)
    assert t.to_host(out) is out and out.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="out must be"):
        t.to_host(np.empty(4, np.int32))


@pytest.mark.device
def test_from_host_with_a_pool_uses_it(dev):
    from fastckpt.device.pool import PersistentBufferPool

    pool = PersistentBufferPool(dev.context, dev.queue)
    t = Tensor.from_host(dev.queue, np.arange(10, dtype=np.int64), pool=pool)
    assert pool.stats.buffers_in_use == 1
    assert t.to_host().tolist() == list(range(10))


@pytest.mark.device
def test_asarray_copies_and_refuses_copy_false(dev):
    t = Tensor.from_host(dev.queue, np.arange(5, dtype=np.int32))
    assert np.asarray(t).tolist() == [0, 1, 2, 3, 4]
    assert np.asarray(t, dtype=np.int64).dtype == np.int64
    with pytest.raises(ValueError, match=r"copy=False\) cannot avoid a copy; use t\.to_host\(\)"):
        np.asarray(t, copy=False)
