"""load_file: every dtype, every offset the formats produce, pooled arenas, zero-copy, fallbacks, threads."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import warnings

import ml_dtypes
import numpy as np
import pytest
from _device_data import DTYPES, sample
from _threads import run_in_threads

import fastckpt
from fastckpt.device.load import MERGE_GAP, LoadedTensors, load_file, plan_regions
from fastckpt.device.staging import STAGING_ROUND
from fastckpt.device.pool import PersistentBufferPool
from fastckpt.errors import NotZeroCopyWarning, TensorNotFoundError
from fastckpt.info import TensorInfo

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 1, 3)]


_ST_DTYPE = {"bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
             "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "float32": "F32",
             "float64": "F64", "bfloat16": "BF16", "complex64": "C64"}


def write_raw_safetensors(path, tensors: dict) -> None:
    """A safetensors file in the given tensor order, header unpadded: payloads at odd offsets."""
    header, pos, blobs = {}, 0, []
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": _ST_DTYPE[arr.dtype.name], "shape": list(arr.shape), "data_offsets": [pos, pos + len(blob)]}
        pos += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def write(kind: str, path, tensors: dict) -> None:
    if kind == "safetensors-raw":
        write_raw_safetensors(path, tensors)
    elif kind == "safetensors-ref":
        import safetensors.numpy

        safetensors.numpy.save_file(tensors, str(path))
    elif kind == "safetensors":
        fastckpt.save_safetensors(path, tensors, fsync=False)
    elif kind == "npz":
        fastckpt.save_npz(path, tensors, fsync=False)
    elif kind == "np.savez":
        np.savez(path, **tensors)
    else:  # pragma: no cover
        raise AssertionError(kind)


WRITERS = ["safetensors-raw", "safetensors-ref", "safetensors", "npz", "np.savez"]
UNSUPPORTED = {  # (writer, dtype name): the format or the writer cannot store it
    **{(w, "complex128"): "safetensors has no complex128" for w in ("safetensors-raw", "safetensors-ref", "safetensors")},
    ("np.savez", "bfloat16"): "numpy.savez writes bfloat16 as '<V2' (fastckpt's NPZ names it)",
}


# conftest's `device` (each kind present) under the name these tests use; tests of zero-copy take `unified_device`.
@pytest.fixture(scope="module")
def dev(device):
    return device


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def corpus(dtype) -> dict:
    """A uint8 tensor of 3 bytes first, so that later payloads land at odd offsets in unpadded files."""
    tensors = {"lead": np.arange(3, dtype=np.uint8)}
    for i, shape in enumerate(SHAPES):
        tensors[f"t{i}"] = sample(dtype, shape, seed=i)
    return tensors


def check_exact(loaded: LoadedTensors, path, originals: dict) -> None:
    raw = file_bytes(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)  # the reader's own note on compressed members
        tf = fastckpt.open(path)
    with tf:
        assert set(loaded) == set(originals)
        for name, want in originals.items():
            got = loaded[name].to_host()
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name
            info = tf.info(name)
            if info.compression is None and not info.fortran_order:
                assert got.tobytes() == raw[info.offset:info.offset + info.nbytes], name
            if not np.issubdtype(want.dtype, np.inexact) and want.dtype != ml_dtypes.bfloat16:
                assert np.array_equal(got, want), name


# -- every dtype x writer x path ---------------------------------------------------------------
@pytest.mark.device
@pytest.mark.parametrize("mode", ["pool", "per-tensor", "zero-copy"])
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_values_equal_file_bytes(tmp_path, dev, pool, dtype, writer, mode):
    reason = UNSUPPORTED.get((writer, np.dtype(dtype).name))
    if reason:
        pytest.skip(reason)
    path = tmp_path / ("m.npz" if writer in ("npz", "np.savez") else "m.safetensors")
    tensors = corpus(dtype)
    write(writer, path, tensors)
    from fastckpt.device.context import shares_host_memory

    unified = shares_host_memory(dev.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always" if mode == "zero-copy" and not unified else "error", NotZeroCopyWarning)
        loaded = load_file(path, dev.queue, pool=pool if mode == "pool" else None, zero_copy=mode == "zero-copy")
    check_exact(loaded, path, tensors)
    paths = set(loaded.report.paths.values()) - {"empty"}
    if mode == "zero-copy" and not unified:  # a discrete device: said, and copied per tensor
        assert paths == {"buffer"} and any("does not share host memory" in str(w.message) for w in caught)
        return
    assert paths == {{"pool": "arena", "per-tensor": "buffer", "zero-copy": "zero-copy"}[mode]}
    if mode == "pool":
        assert loaded.report.copies == 1


@pytest.mark.device
@pytest.mark.parametrize("writer", ["safetensors-raw", "np.savez"])
def test_formats_really_produce_unaligned_payloads(tmp_path, writer):
    path = tmp_path / ("m.npz" if writer in ("npz", "np.savez") else "m.safetensors")
    write(writer, path, corpus(np.float32))
    with fastckpt.open(path) as tf:
        start, _ = tf.data_region
        # inside the arena (offsets relative to the region) and in the file
        assert any((i.offset - start) % 4 for i in tf.infos.values() if i.dtype == np.float32)
        if writer == "np.savez":
            assert any(i.offset % 4 for i in tf.infos.values() if i.dtype == np.float32)


@pytest.mark.device
def test_three_byte_tensor_then_float32_in_one_arena(tmp_path, dev, pool):
    path = tmp_path / "odd.safetensors"
    tensors = {"a": np.array([1, 2, 3], np.uint8), "b": np.array([1.5, -0.0, np.inf, 7e-45], np.float32)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool)
    assert loaded["b"].offset == 3 and loaded["a"].offset == 0
    assert loaded["a"].buffer is loaded["b"].buffer
    check_exact(loaded, path, tensors)


# -- the pooled path -------------------------------------------------------------------------
def model(seed: int, n: int = 12) -> dict:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.w": rng.standard_normal((i + 1, 17)).astype(np.float32) for i in range(n)}


@pytest.mark.device
@pytest.mark.parametrize("writer", ["safetensors", "npz", "np.savez"])
def test_repeated_pooled_load_allocates_nothing(tmp_path, dev, pool, writer):
    path = tmp_path / ("m.npz" if writer in ("npz", "np.savez") else "m.safetensors")
    write(writer, path, model(0))
    first = load_file(path, dev.queue, pool=pool)
    assert (first.report.pool_misses, first.report.copies, first.report.regions) == (1, 1, 1)
    start, end = fastckpt.open(path).data_region
    assert first.report.bytes_copied == end - start
    del first
    for _ in range(3):
        again = load_file(path, dev.queue, pool=pool)
        assert (again.report.pool_misses, again.report.pool_hits, again.report.bytes_allocated) == (0, 1, 0)
        check_exact(again, path, model(0))
        del again
    assert pool.stats.allocations == 1


@pytest.mark.device
def test_same_shaped_model_reuses_the_arena_with_its_own_values(tmp_path, dev, pool):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    fastckpt.save_safetensors(a, model(1), fsync=False)
    fastckpt.save_safetensors(b, model(2), fsync=False)
    load_file(a, dev.queue, pool=pool).release()
    loaded_b = load_file(b, dev.queue, pool=pool)
    assert loaded_b.report.pool_misses == 0
    check_exact(loaded_b, b, model(2))


@pytest.mark.device
def test_a_tensor_kept_alive_keeps_its_arena_in_use(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(3), fsync=False)
    kept = load_file(path, dev.queue, pool=pool)["layer5.w"]
    gc.collect()
    assert pool.stats.buffers_in_use == 1, "the tensor owns the arena lease"
    second = load_file(path, dev.queue, pool=pool)
    assert second.report.pool_misses == 1, "the arena in use is not handed out again"
    assert np.array_equal(kept.to_host(), model(3)["layer5.w"])
    del kept, second
    gc.collect()
    assert pool.stats.buffers_in_use == 0


@pytest.mark.device
def test_release_returns_arenas_at_once(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(4), fsync=False)
    with load_file(path, dev.queue, pool=pool) as loaded:
        assert pool.stats.buffers_in_use == 1
    assert pool.stats.buffers_in_use == 0 and len(loaded) == 0


@pytest.mark.device
def test_region_split_at_tensor_boundaries_when_allocations_are_small(tmp_path, dev):
    path = tmp_path / "m.safetensors"
    tensors = {f"t{i}": sample(np.float32, (100 + i,), seed=i) for i in range(10)}  # ~400 bytes each
    write_raw_safetensors(path, tensors)
    small = PersistentBufferPool(dev.context, dev.queue, max_alloc_size=1024)
    loaded = load_file(path, dev.queue, pool=small)
    assert loaded.report.regions == loaded.report.copies >= 4
    assert all(lease.size <= 1024 for lease in loaded._leases)
    check_exact(loaded, path, tensors)


@pytest.mark.device
@pytest.mark.parametrize("blocking", [True, False])
def test_large_region_is_copied_in_chunks_into_one_arena(tmp_path, dev, pool, monkeypatch, blocking):
    import fastckpt.device.load as load_mod

    monkeypatch.setattr(load_mod, "COPY_CHUNK", 1000)
    path = tmp_path / "m.safetensors"
    tensors = {f"t{i}": sample(np.float64, (77 + i,), seed=i) for i in range(6)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, blocking=blocking, staging=False)  # COPY_CHUNK: unstaged
    region = sum(a.nbytes for a in tensors.values())
    assert loaded.report.regions == 1 and loaded.report.copies == -(-region // 1000)
    assert len({id(t.buffer) for t in loaded.values()}) == 1
    check_exact(loaded, path, tensors)


@pytest.mark.device
def test_tensor_larger_than_one_allocation_is_a_clear_error(tmp_path, dev):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"big": np.zeros(1000, np.float32)}, fsync=False)
    small = PersistentBufferPool(dev.context, dev.queue, max_alloc_size=1024)
    with pytest.raises(ValueError, match="'big' has 4000 bytes.*max_mem_alloc_size = 1024"):
        load_file(path, dev.queue, pool=small)
    assert small.stats.buffers_in_use == 0


@pytest.mark.device
def test_names_loads_a_subset_and_unknown_names_fail(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(5), fsync=False)
    loaded = load_file(path, dev.queue, pool=pool, names=["layer7.w", "layer2.w", "layer7.w"])
    assert list(loaded) == ["layer2.w", "layer7.w"]
    assert np.array_equal(loaded["layer7.w"].to_host(), model(5)["layer7.w"])
    with pytest.raises(TensorNotFoundError, match=r"m.safetensors: no tensor named 'nope'"):
        load_file(path, dev.queue, pool=pool, names=["nope"])
    with pytest.raises(TypeError, match="list of tensor names"):
        load_file(path, dev.queue, names="layer2.w")
    with pytest.raises(TensorNotFoundError, match="no tensor named 'layer1.w' was loaded"):
        loaded["layer1.w"]


@pytest.mark.device
def test_arena_views_are_made_once_on_access(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(9), fsync=False)
    loaded = load_file(path, dev.queue, pool=pool, names=(n for n in ["layer1.w", "layer4.w"]))
    assert list(loaded) == ["layer1.w", "layer4.w"] and len(loaded) == 2 and "layer4.w" in loaded
    assert "layer2.w" not in loaded
    first = loaded["layer4.w"]
    assert loaded["layer4.w"] is first
    assert first.shape == (5, 17) and first.dtype == np.float32 and first._owner is loaded._leases[0]
    assert loaded.nbytes == (2 + 5) * 17 * 4


@pytest.mark.device
def test_an_open_tensorfile_is_reused_and_left_open(tmp_path, dev, pool):
    path = tmp_path / "m.npz"
    fastckpt.save_npz(path, model(6), fsync=False)
    with fastckpt.open(path) as tf:
        for _ in range(2):
            loaded = load_file(tf, dev.queue, pool=pool)
            check_exact(loaded, path, model(6))
        assert not tf.closed


@pytest.mark.device
def test_pool_keeps_a_loaded_file_open_for_the_next_load(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(20), fsync=False)
    first = load_file(path, dev.queue, pool=pool)
    second = load_file(str(path), dev.queue, pool=pool)
    assert (first.report.file_reused, second.report.file_reused) == (False, True)
    assert len(pool.files) == 1
    check_exact(second, path, model(20))
    pool.clear()
    assert len(pool.files) == 0 and not load_file(path, dev.queue, pool=pool).report.file_reused


@pytest.mark.device
def test_a_replaced_file_is_opened_anew(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(21), fsync=False)
    old = load_file(path, dev.queue, pool=pool)["layer3.w"]
    fastckpt.save_safetensors(path, model(22), fsync=False, overwrite=True)  # same shapes, new inode
    loaded = load_file(path, dev.queue, pool=pool)
    assert not loaded.report.file_reused
    check_exact(loaded, path, model(22))
    assert np.array_equal(old.to_host(), model(21)["layer3.w"]), "earlier tensors keep their values"


@pytest.mark.device
def test_a_file_changed_in_place_is_opened_anew(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"x": np.zeros(16, np.int32)}, fsync=False)
    load_file(path, dev.queue, pool=pool)
    with fastckpt.open(path) as tf:
        offset = tf.info("x").offset
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.arange(16, dtype=np.int32).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # even on a coarse clock
    loaded = load_file(path, dev.queue, pool=pool)
    assert not loaded.report.file_reused
    assert loaded["x"].to_host().tolist() == list(range(16))


@pytest.mark.device
def test_kept_files_are_bounded_and_optional(tmp_path, dev):
    paths = []
    for i in range(3):
        p = tmp_path / f"m{i}.safetensors"
        fastckpt.save_safetensors(p, model(30 + i, n=2), fsync=False)
        paths.append(p)
    two = PersistentBufferPool(dev.context, dev.queue, keep_files=2)
    for p in paths:
        load_file(p, dev.queue, pool=two)
    assert len(two.files) == 2
    assert not load_file(paths[0], dev.queue, pool=two).report.file_reused, "the oldest was dropped"
    assert load_file(paths[2], dev.queue, pool=two).report.file_reused
    none = PersistentBufferPool(dev.context, dev.queue, keep_files=0)
    load_file(paths[0], dev.queue, pool=none)
    assert len(none.files) == 0 and not load_file(paths[0], dev.queue, pool=none).report.file_reused


@pytest.mark.device
def test_zero_copy_never_reuses_a_mapping(tmp_path, dev, pool):
    import pyopencl as cl

    path = tmp_path / "z.safetensors"
    fastckpt.save_safetensors(path, {"w": np.zeros(8, np.float32)}, fsync=False)
    add_one = cl.Kernel(cl.Program(dev.context, ADD_ONE).build(), "add_one")
    from fastckpt.device.context import shares_host_memory

    unified = shares_host_memory(dev.device)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error" if unified else "ignore", NotZeroCopyWarning)  # discrete: copied, said so
            loaded = load_file(path, dev.queue, pool=pool, zero_copy=True)
        assert loaded.report.mode == ("zero-copy" if unified else "pool")
        w = loaded["w"]
        assert np.array_equal(w.to_host(), np.zeros(8, np.float32)), "a fresh private mapping each time"
        add_one(dev.queue, (8,), None, w.buffer, np.uint64(w.offset), np.uint32(8))
        dev.queue.finish()
    assert len(pool.files) == 0


@pytest.mark.device
def test_non_blocking_load_waits_before_reading(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    big = {f"t{i}": sample(np.float64, (1 << 15,), seed=i) for i in range(4)}
    fastckpt.save_safetensors(path, big, fsync=False)
    loaded = load_file(path, dev.queue, pool=pool, blocking=False)
    assert all(t.pending for t in loaded.values())
    assert all(t._keepalive is not None for t in loaded.values()), "the source view is kept"
    check_exact(loaded, path, big)
    loaded.wait()
    assert not any(t.pending for t in loaded.values())


@pytest.mark.device
@pytest.mark.parametrize("use_pool", [True, False])
def test_non_blocking_copies_keep_the_mapping_after_every_handle_is_gone(tmp_path, dev, pool, monkeypatch,
                                                                          use_pool):
    import fastckpt.device.load as load_mod

    monkeypatch.setattr(load_mod, "COPY_CHUNK", 1 << 16)  # several commands per region, and a marker
    path = tmp_path / "m.safetensors"
    big = {f"t{i}": sample(np.float64, (1 << 15,), seed=i) for i in range(4)}
    fastckpt.save_safetensors(path, big, fsync=False)
    tf = fastckpt.open(path)
    loaded = load_file(tf, dev.queue, pool=pool if use_pool else None, blocking=False)
    kept = {name: loaded[name] for name in ("t0", "t3")}
    tf.close()
    del tf, loaded  # the file handle, the load and its events: only the pending tensors remain
    gc.collect()
    for name, t in kept.items():
        assert t.to_host().tobytes() == big[name].tobytes(), name


@pytest.mark.device
@pytest.mark.parametrize("staging", [False, 256], ids=["direct", "staged"])
def test_a_failing_copy_raises_and_returns_the_arenas(tmp_path, dev, pool, monkeypatch, staging):
    import pyopencl as cl

    import fastckpt.device.load as load_mod

    monkeypatch.setattr(load_mod, "COPY_CHUNK", 256)
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(40), fsync=False)
    real = cl.enqueue_copy
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise cl.RuntimeError("clEnqueueWriteBuffer failed: OUT_OF_RESOURCES")
        return real(*args, **kw)

    monkeypatch.setattr(cl, "enqueue_copy", failing)
    with pytest.raises(cl.RuntimeError, match="OUT_OF_RESOURCES"):
        load_file(path, dev.queue, pool=pool, staging=staging)
    assert len(calls) == 3
    gc.collect()
    s = pool.stats
    assert s.buffers_in_use == 0 and s.bytes_idle == s.bytes_held > 0
    monkeypatch.setattr(cl, "enqueue_copy", real)
    check_exact(load_file(path, dev.queue, pool=pool, staging=staging), path, model(40))


@pytest.mark.device
def test_empty_file_and_empty_tensors(tmp_path, dev, pool):
    path = tmp_path / "e.safetensors"
    fastckpt.save_safetensors(path, {"z": np.zeros((0, 4), np.float32)}, fsync=False)
    for p in (pool, None):
        loaded = load_file(path, dev.queue, pool=p)
        assert loaded["z"].to_host().shape == (0, 4) and loaded.report.copies == 0


@pytest.mark.device
def test_queue_and_pool_must_share_a_context(tmp_path, dev, pool):
    import pyopencl as cl

    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(41), fsync=False)
    other = cl.CommandQueue(cl.Context([dev.device]))
    with pytest.raises(ValueError, match="different OpenCL contexts"):
        load_file(path, other, pool=pool)


@pytest.mark.device
def test_source_must_be_a_path_or_tensorfile(dev):
    with pytest.raises(TypeError, match="path or an open fastckpt.TensorFile"):
        load_file(b"\x00" * 10, dev.queue)


def test_queue_defaults_to_the_default_device(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"x": np.arange(3, dtype=np.int32)}, fsync=False)
    assert load_file(path)["x"].to_host().tolist() == [0, 1, 2]


# -- fallbacks that warn -------------------------------------------------------------------------
@pytest.mark.device
@pytest.mark.parametrize("use_pool", [True, False])
def test_deflate_npz_warns_and_is_exact(tmp_path, dev, pool, use_pool):
    path = tmp_path / "c.npz"
    tensors = {"a": sample(np.float32, (50,)), "b": np.arange(7, dtype=np.int16)}
    np.savez_compressed(path, **tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)  # the reader's own warning at open
        tf = fastckpt.open(path)
    with pytest.warns(NotZeroCopyWarning, match=r"2 tensor\(s\) are compressed \(deflate\)"):
        loaded = load_file(tf, dev.queue, pool=pool if use_pool else None)
    assert set(loaded.report.paths.values()) == {"decoded"}
    assert loaded.report.warnings and "save_npz" in loaded.report.warnings[0]
    check_exact(loaded, path, tensors)


@pytest.mark.device
def test_fortran_order_member_is_decoded_to_c_order(tmp_path, dev, pool):
    path = tmp_path / "f.npz"
    f_arr = np.asfortranarray(sample(np.int32, (3, 4)))
    np.savez(path, f=f_arr, c=np.arange(5, dtype=np.uint8))
    with pytest.warns(NotZeroCopyWarning, match="Fortran-ordered"):
        loaded = load_file(path, dev.queue, pool=pool)
    assert loaded.report.paths == {"f": "decoded", "c": "arena"}
    assert np.array_equal(loaded["f"].to_host(), f_arr)
    assert loaded["c"].to_host().tolist() == [0, 1, 2, 3, 4]


# -- zero-copy ---------------------------------------------------------------------------------------
ADD_ONE = """
__kernel void add_one(__global uchar *base, ulong offset, uint n) {
    __global float *x = (__global float *)(base + offset);
    uint i = get_global_id(0);
    if (i < n) x[i] += 1.0f;
}
"""


@pytest.mark.device
def test_zero_copy_kernel_writes_stay_private(tmp_path, unified_device):
    dev = unified_device  # zero-copy needs a device that shares host memory
    import pyopencl as cl

    path = tmp_path / "z.safetensors"
    tensors = {"w": np.arange(64, dtype=np.float32), "v": np.full(8, 5, np.float32)}
    fastckpt.save_safetensors(path, tensors, fsync=False)
    before = hashlib.sha256(file_bytes(path)).hexdigest()
    loaded = load_file(path, dev.queue, zero_copy=True)
    assert loaded.report.mode == "zero-copy" and loaded.report.copies == 0 and loaded.report.bytes_allocated == 0
    w = loaded["w"]
    program = cl.Program(dev.context, ADD_ONE).build()
    program.add_one(dev.queue, (64,), None, w.buffer, np.uint64(w.offset), np.uint32(w.size))
    dev.queue.finish()
    assert np.array_equal(w.to_host(), tensors["w"] + 1)
    assert np.array_equal(loaded["v"].to_host(), tensors["v"])
    assert hashlib.sha256(file_bytes(path)).hexdigest() == before, "the file must not change"
    with fastckpt.open(path) as fresh:
        assert np.array_equal(fresh.host("w"), tensors["w"])


@pytest.mark.device
def test_zero_copy_from_an_open_read_only_file_maps_it_privately_again(tmp_path, unified_device, pool):
    dev = unified_device  # zero-copy needs a device that shares host memory
    import pyopencl as cl

    path = tmp_path / "z.safetensors"
    w = np.arange(16, dtype=np.float32)
    fastckpt.save_safetensors(path, {"w": w}, fsync=False)
    before = file_bytes(path)
    with fastckpt.open(path) as tf:
        host_view = tf.host("w")
        loaded = load_file(tf, dev.queue, pool=pool, zero_copy=True)
        assert loaded.report.mode == "zero-copy" and not tf.closed
        t = loaded["w"]
        cl.Program(dev.context, ADD_ONE).build().add_one(dev.queue, (16,), None, t.buffer, np.uint64(t.offset),
                                                         np.uint32(16))
        dev.queue.finish()
        assert np.array_equal(t.to_host(), w + 1)
        assert np.array_equal(host_view, w), "the read-only mapping the caller holds is not the one written"
    assert file_bytes(path) == before
    again = load_file(path, dev.queue, pool=pool)
    assert np.array_equal(again["w"].to_host(), w)


@pytest.mark.device
def test_zero_copy_of_an_unaligned_region_rounds_the_buffer_start_down(tmp_path, unified_device):
    dev = unified_device  # zero-copy needs a device that shares host memory
    path = tmp_path / "u.safetensors"
    tensors = {"a": np.array([9, 8, 7], np.uint8), "b": sample(np.float32, (33,))}
    write_raw_safetensors(path, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotZeroCopyWarning)
        loaded = load_file(path, dev.queue, zero_copy=True)
    buffer = loaded["a"].buffer
    align = dev.device.mem_base_addr_align // 8
    assert np.frombuffer(buffer.hostbuf, np.uint8).ctypes.data % align == 0
    assert loaded["b"].offset - loaded["a"].offset == 3
    check_exact(loaded, path, tensors)


@pytest.mark.device
def test_zero_copy_impossible_alignment_warns_and_copies(tmp_path, unified_device, pool, monkeypatch):
    dev = unified_device  # zero-copy needs a device that shares host memory
    import fastckpt.device.load as load_mod

    monkeypatch.setattr(load_mod, "_base_align", lambda device: 1 << 40)
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(7), fsync=False)
    with pytest.warns(NotZeroCopyWarning, match=r"aligned to 1099511627776 bytes"):
        loaded = load_file(path, dev.queue, pool=pool, zero_copy=True)
    assert loaded.report.mode == "pool" and set(loaded.report.paths.values()) == {"arena"}
    check_exact(loaded, path, model(7))


@pytest.mark.device
def test_zero_copy_without_a_mapping_warns_and_copies(tmp_path, unified_device):
    dev = unified_device  # zero-copy needs a device that shares host memory
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(8), fsync=False)
    tf = fastckpt.open(path, backend="pread")
    with pytest.warns(NotZeroCopyWarning, match="not memory-mapped"):
        loaded = load_file(tf, dev.queue, zero_copy=True)
    assert set(loaded.report.paths.values()) == {"buffer"}
    check_exact(loaded, path, model(8))


# -- concurrency ---------------------------------------------------------------------------------
@pytest.mark.device
def test_threads_loading_through_one_pool(tmp_path, dev, pool):
    import pyopencl as cl

    paths = []
    for i in range(3):
        p = tmp_path / f"m{i}.safetensors"
        fastckpt.save_safetensors(p, model(10 + i), fsync=False)
        paths.append(p)
    errors = []

    def worker(k):
        queue = cl.CommandQueue(dev.context)  # a queue per thread, as real loaders use
        for r in range(6):
            i = (k + r) % 3
            loaded = load_file(paths[i], queue, pool=pool)
            for name, want in model(10 + i).items():
                if loaded[name].to_host().tobytes() != want.tobytes():
                    errors.append((k, r, name))

    errors += run_in_threads(worker, 4)
    gc.collect()
    assert not errors
    s = pool.stats
    assert s.buffers_in_use == 0 and s.allocations <= 4 * 3, s


# -- staging through pinned buffers (the discrete-GPU path, forced on pocl) -----------------------------------------
def odd_sized(n: int, seed: int = 0) -> dict:
    """``n`` uint8/float32/float64 tensors of odd lengths: unpadded, their payloads land at every offset mod 8."""
    dtypes = (np.uint8, np.float32, np.float64)
    return {f"t{i:05d}": sample(dtypes[i % 3], ((seed + 7 * i) % 23 + 1,), seed=seed + i) for i in range(n)}


@pytest.mark.device
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("use_pool", [True, False])
def test_staged_load_of_many_chunks_is_exact(tmp_path, dev, pool, use_pool, blocking):
    path = tmp_path / "m.safetensors"
    tensors = {"lead": np.arange(3, dtype=np.uint8),
               **{f"w{i}": sample(np.float64, (1000 + 37 * i,), seed=i) for i in range(5)}}  # ~42 KB
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool if use_pool else None, staging=3001, blocking=blocking)
    report = loaded.report
    assert report.staging_chunk == 3001
    region = sum(a.nbytes for a in tensors.values())
    assert report.bytes_copied == region
    if use_pool:
        # One region, copied a chunk at a time (one command per chunk, the last one short).
        assert report.copies == -(-region // 3001)
        assert set(report.paths.values()) == {"arena"}
    else:
        # A command per piece: a tensor straddling a chunk boundary is two.
        pieces = len({*range(0, region, 3001)} | set(np.cumsum([0] + [a.nbytes for a in tensors.values()])[:-1]))
        assert report.copies == pieces
        assert set(report.paths.values()) == {"buffer"}
    if not blocking:
        assert all(t.pending for t in loaded.values())
        assert all(t._keepalive is not None for t in loaded.values()), "the staging buffers are kept"
    check_exact(loaded, path, tensors)


@pytest.mark.device
@pytest.mark.parametrize("use_pool", [True, False])
def test_staged_load_of_many_small_tensors_packs_them_into_chunks(tmp_path, dev, pool, use_pool):
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(3000)
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool if use_pool else None, staging=1 << 12)
    assert loaded.report.staging_chunk == 4096
    check_exact(loaded, path, tensors)
    assert list(loaded) == list(tensors)


@pytest.mark.device
@pytest.mark.parametrize("use_pool", [True, False])
def test_a_tensor_straddling_chunks_arrives_whole(tmp_path, dev, pool, use_pool):
    path = tmp_path / "m.safetensors"
    # 5 bytes, then 10,001 bytes across three 4 KiB chunks (starting 5 bytes in), then 3 bytes.
    tensors = {"a": sample(np.uint8, (5,), 1), "b": sample(np.uint8, (10_001,), 2), "c": sample(np.uint8, (3,), 3)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool if use_pool else None, staging=4096)
    assert loaded.report.copies == (3 if use_pool else 1 + 3 + 1)  # "b": 4091 + 4096 + 1814 bytes
    for name, want in tensors.items():
        assert loaded[name].to_host().tobytes() == want.tobytes(), name


@pytest.mark.device
@pytest.mark.parametrize("writer", ["npz", "np.savez"])
def test_staged_npz_with_odd_offsets_and_empty_tensors(tmp_path, dev, pool, writer):
    path = tmp_path / "m.npz"
    tensors = {**odd_sized(40, seed=5), "empty": np.zeros((0, 3), np.float32), "scalar": np.array(7, np.int16)}
    write(writer, path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, staging=1000)
    assert loaded.report.paths["empty"] == "empty" and loaded.report.staging_chunk == 1000
    check_exact(loaded, path, tensors)


@pytest.mark.device
@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
def test_a_dropped_load_gives_its_arena_back_without_the_cycle_collector(tmp_path, dev, pool, staging):
    import gc

    path = tmp_path / "m.safetensors"
    tensors = odd_sized(50)
    write_raw_safetensors(path, tensors)
    gc.collect()
    gc.disable()  # only reference counting: no cycle may hold a load's leases
    try:
        for _ in range(3):
            loaded = load_file(path, dev.queue, pool=pool, staging=staging)
            check_exact(loaded, path, tensors)
            del loaded
            assert pool.stats.bytes_in_use == 0
    finally:
        gc.enable()
    assert pool.stats.misses == 1  # the first load allocated; the others reused its arena


@pytest.mark.device
def test_the_pool_reuses_its_staging_buffers(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(200)
    write_raw_safetensors(path, tensors)
    first = load_file(path, dev.queue, pool=pool, staging=True)
    chunk, buffers = first.report.staging_chunk, first.report.staging_buffers
    assert chunk == STAGING_ROUND  # a load smaller than one chunk gets buffers of its own size, rounded up
    assert buffers == 1, "one chunk holds the whole load"
    s = pool.stats
    assert (s.staging_allocations, s.staging_bytes) == (buffers, buffers * chunk)
    check_exact(first, path, tensors)
    for _ in range(3):
        again = load_file(path, dev.queue, pool=pool, staging=True)
        check_exact(again, path, tensors)
    s = pool.stats
    assert (s.staging_allocations, s.staging_bytes) == (buffers, buffers * chunk), "nothing new"
    smaller = load_file(path, dev.queue, pool=pool, staging=True)  # the same chunk again, from the held set
    assert smaller.report.staging_chunk == chunk and pool.stats.staging_allocations == buffers
    check_exact(smaller, path, tensors)
    pool.clear()
    assert pool.stats.staging_bytes == 0


@pytest.mark.device
def test_staging_buffers_leased_from_the_pool_are_pinned_and_mapped(dev, pool):
    with pool.staging(dev.queue, 1 << 16, 3) as stage:
        assert (stage.count, stage.chunk, stage.nbytes, stage.hit) == (3, 1 << 16, 3 << 16, False)
        assert all(h.dtype == np.uint8 and h.shape == (1 << 16,) and h.flags.writeable for h in stage.hosts)
        stage.hosts[2][:4] = [1, 2, 3, 4]
    again = pool.staging(dev.queue, 1 << 10, 3)
    assert again is stage and again.hit and bytes(again.hosts[2][:4]) == b"\x01\x02\x03\x04"
    assert pool.staging(dev.queue, 1 << 10, 4) is not stage, "a set of fewer buffers does not serve more"
    again.release()
    assert pool.staging(dev.queue, 1 << 10, 2) is stage, "a set of more buffers serves fewer"
    with pytest.raises(ValueError, match="above 0"):
        pool.staging(dev.queue, 0)


@pytest.mark.device
def test_a_non_blocking_staged_load_then_another_through_the_same_buffers(tmp_path, dev, pool):
    paths, models = [], []
    for i in range(2):
        p = tmp_path / f"m{i}.safetensors"
        models.append({f"w{k}": sample(np.float32, (3000 + k,), seed=10 * i + k) for k in range(8)})
        write_raw_safetensors(p, models[-1])
        paths.append(p)
    # 2 KiB chunks: each load cycles through the two buffers many times; the second load must wait for the
    # first one's copies before it overwrites a buffer they read.
    first = load_file(paths[0], dev.queue, pool=pool, staging=2048, blocking=False)
    second = load_file(paths[1], dev.queue, pool=pool, staging=2048, blocking=False)
    assert pool.stats.staging_allocations == first.report.staging_buffers == second.report.staging_buffers
    check_exact(second, paths[1], models[1])
    check_exact(first, paths[0], models[0])


@pytest.mark.device
def test_large_staged_chunks_are_filled_by_several_threads(tmp_path, dev, pool, monkeypatch):
    import threading

    from fastckpt.device import staging

    monkeypatch.setattr(staging, "_cpus", lambda: 3)
    monkeypatch.setattr(staging, "FILL_SPLIT", 1 << 20)
    seen, names, files = [], set(), set()
    real = staging.fill

    def fill(pending, pairs):
        seen.append(sum(src.nbytes for _dst, src, _file in pairs))
        names.add(threading.current_thread().name)
        files.update(file is not None for _dst, _src, file in pairs)
        real(pending, pairs)

    monkeypatch.setattr(staging, "fill", fill)
    path = tmp_path / "m.safetensors"
    tensors = {"big": sample(np.uint8, (5 << 20,), 1), "tail": sample(np.uint8, (12_345,), 2)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, staging=4 << 20)
    assert loaded.report.fill_threads == 3 and loaded.report.staging_buffers == 2  # 2 batches: 2 buffers suffice
    # 1 MiB parts (a quarter of a chunk): four for the first chunk, two for the second (1 MiB + 12,345 bytes).
    assert sorted(seen) == [12_345] + [1 << 20] * 5
    assert all(name.startswith("fastckpt-stage-fill") for name in names)
    assert files == {True}, "read from the file (preadv), not copied out of the mapping"
    check_exact(loaded, path, tensors)


@pytest.mark.device
@pytest.mark.parametrize("read", ["auto", "preadv", "mmap"])
@pytest.mark.parametrize("use_pool", [True, False], ids=["pool", "no-pool"])
def test_staged_bytes_are_the_same_read_from_the_file_or_the_mapping(tmp_path, dev, pool, monkeypatch, read,
                                                                     use_pool):
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "READ", read)
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(500, seed=3)
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool if use_pool else None, staging=4096)
    check_exact(loaded, path, tensors)
    again = load_file(path, dev.queue, pool=pool if use_pool else None, staging=4096)  # a kept file, with a pool
    check_exact(again, path, tensors)


@pytest.mark.device
def test_staging_reads_a_file_it_mapped_itself_and_copies_from_a_mapping_open_before(tmp_path, dev, pool,
                                                                                    monkeypatch):
    from fastckpt.device import staging

    routes = []
    real = staging.fill

    def fill(pending, pairs):
        routes.extend("read" if file is not None else "copy" for _dst, _src, file in pairs)
        real(pending, pairs)

    monkeypatch.setattr(staging, "fill", fill)
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(100)
    write_raw_safetensors(path, tensors)
    for source, want in ((path, "read"), (path, "copy"), (None, "copy")):  # opened; kept by the pool; the caller's
        routes.clear()
        if source is None:
            with fastckpt.open(path) as tf:
                loaded = load_file(tf, dev.queue, pool=pool, staging=True)
                check_exact(loaded, path, tensors)
        else:
            loaded = load_file(source, dev.queue, pool=pool, staging=True)
            check_exact(loaded, path, tensors)
        assert set(routes) == {want}, (source, routes)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_short_read_into_a_destination_names_the_file_and_offset(tmp_path, threads):
    from fastckpt.formats.readinto import read_into

    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.zeros(60, np.uint8)
        read_into(fd, [(dst[:40], 60)], str(path), threads=threads, piece=16)
        assert dst[:40].tolist() == list(range(60, 100))
        with pytest.raises(OSError, match=r"short.bin: the file ended at byte 100 while 20 more bytes"):
            read_into(fd, [(dst, 60)], str(path), threads=threads, piece=40)
    finally:
        os.close(fd)


@pytest.mark.device
def test_a_file_replaced_since_it_was_mapped_is_copied_from_the_mapping(tmp_path, dev, pool, monkeypatch):
    # The path now names another file: reading it would load other bytes than the mapping's index describes.
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "READ", "preadv")  # read wherever the file is the mapped one
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(50)
    write_raw_safetensors(path, tensors)
    with fastckpt.open(path) as tf:
        write_raw_safetensors(tmp_path / "new", odd_sized(50, seed=9))
        os.replace(tmp_path / "new", path)  # a new file under the same name; the mapping keeps the old one
        loaded = load_file(tf, dev.queue, pool=pool, staging=True)
        for name, want in tensors.items():
            assert loaded[name].to_host().tobytes() == want.tobytes(), name


@pytest.mark.device
def test_the_fill_runs_ahead_of_the_copies_across_the_staging_buffers(tmp_path, dev, pool, monkeypatch):
    # One fill thread (the caller's), so the order is fixed: each batch is sent the moment it is filled, and the fill
    # of batch k + 1 runs while its copies are on their way; batch k + N (N buffers) waits only for batch k's copies.
    from fastckpt.device import staging

    monkeypatch.setattr(staging, "_cpus", lambda: 1)
    steps = []
    real_fill, real_send = staging.fill, staging.Stager._send

    def fill(pending, pairs):
        steps.append(("fill", pairs[0][0].ctypes.data, None if pending is None else tuple(map(id, pending))))
        real_fill(pending, pairs)

    def send(self, slot, batch):
        event = real_send(self, slot, batch)
        steps.append(("send", self.stage.hosts[slot].ctypes.data, tuple(map(id, self.stage.pending[slot]))))
        return event

    monkeypatch.setattr(staging, "fill", fill)
    monkeypatch.setattr(staging.Stager, "_send", send)
    path = tmp_path / "m.safetensors"
    tensors = {"w": sample(np.uint8, (10 * 4096 - 7,), 3)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, staging=4096)
    check_exact(loaded, path, tensors)
    n = loaded.report.staging_buffers
    assert n == 3  # one thread: one buffer filling, one being copied, one ready
    kinds = [kind for kind, _, _ in steps]
    assert kinds == ["fill", "send"] * 10
    sends = [(at, events) for kind, at, events in steps if kind == "send"]
    fills = [(at, events) for kind, at, events in steps if kind == "fill"]
    for k, (at, events) in enumerate(fills):
        assert at == sends[k][0], "batch k is sent from the buffer it was filled into"
        if k >= n:
            assert at == sends[k - n][0] and events == sends[k - n][1], "it waits for that buffer's copies only"


@pytest.mark.device
def test_a_load_of_a_few_chunks_is_staged_in_several_batches(tmp_path, dev, pool):
    from fastckpt.device.staging import MIN_BATCHES, batch_sizes

    path = tmp_path / "m.safetensors"
    tensors = {"w": sample(np.uint8, (6 << 20,), 4), "b": sample(np.uint8, (1000,), 5)}
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, staging=True)
    assert loaded.report.staging_chunk == 1 << 20 and loaded.report.copies == 7, "STAGING_ROUND chunks at least"
    check_exact(loaded, path, tensors)
    larger = tmp_path / "l.safetensors"
    big = {"w": sample(np.uint8, (64 << 20,), 6), "b": sample(np.uint8, (1000,), 7)}
    write_raw_safetensors(larger, big)
    cut = load_file(larger, dev.queue, pool=pool, staging=True)
    # 1 MiB first and last batches (batch_sizes: the pipeline's fill and drain), 2 MiB ones between
    sizes = batch_sizes((64 << 20) + 1000, 2 << 20)
    assert sizes[0] == sizes[-1] == 1 << 20 and sizes.count(2 << 20) == 31 and sum(sizes) == (64 << 20) + 1000
    assert cut.report.staging_chunk == 2 << 20 and cut.report.copies == len(sizes) == 34 > MIN_BATCHES
    check_exact(cut, larger, big)
    named = load_file(path, dev.queue, pool=pool, staging=8 << 20)  # a chunk the caller names is kept
    assert named.report.staging_chunk == 7 << 20 and named.report.copies == 1
    check_exact(named, path, tensors)


@pytest.mark.device
def test_threads_staging_loads_of_different_sizes_use_their_own_fill_threads(tmp_path, dev, pool, monkeypatch):
    # Each size gets another thread count, so the loads ask for fill-thread pools of different sizes at once.
    import pyopencl as cl

    from fastckpt.device import staging

    monkeypatch.setattr(staging, "FILL_SPLIT", 64 << 10)
    monkeypatch.setattr(staging, "_cpus", lambda: 8)
    paths, models = [], []
    for i, n in enumerate((150_000, 300_000, 600_000)):
        models.append({"w": sample(np.uint8, (n,), i), "v": sample(np.float32, (1000 + i,), i)})
        paths.append(tmp_path / f"m{i}.safetensors")
        write_raw_safetensors(paths[-1], models[-1])
    errors, threads = [], set()

    def worker(k):
        queue = cl.CommandQueue(dev.context)
        for r in range(6):
            i = (k + r) % 3
            loaded = load_file(paths[i], queue, pool=pool, staging=32 << 10)
            threads.add(loaded.report.fill_threads)
            for name, want in models[i].items():
                if loaded[name].to_host().tobytes() != want.tobytes():
                    errors.append((k, r, name))

    errors += run_in_threads(worker, 3)
    assert not errors
    assert threads == {2, 4, 8}


def test_staging_shape_follows_the_machine_and_the_load():
    from fastckpt.device.staging import FILL_SPLIT, MAX_FILL_THREADS, staging_shape

    mib = 1 << 20
    assert staging_shape(4096 * mib, 64 * mib, cpus=16) == (64 * mib, 4, 8)
    assert staging_shape(4096 * mib, 16 * mib, cpus=16) == (16 * mib, 6, 8)  # a discrete GPU's 4 GiB load
    assert staging_shape(4096 * mib, 64 * mib, cpus=64).threads == MAX_FILL_THREADS
    assert staging_shape(4096 * mib, 64 * mib, cpus=2) == (64 * mib, 3, 2)
    assert staging_shape(3 * FILL_SPLIT, 64 * mib, cpus=16) == (64 * mib, 1, 3)  # one batch: one buffer
    assert staging_shape(100, 4096, cpus=16) == (4096, 1, 1)
    assert staging_shape(4096 * mib, 64 * mib, cpus=16, max_bytes=200 * mib).buffers == 3
    assert staging_shape(4096 * mib, 64 * mib, cpus=16, max_bytes=0).buffers == 2  # two at least


@pytest.mark.device
def test_the_pool_bounds_and_counts_its_pinned_staging_memory(tmp_path, dev):
    chunk = 4096
    pool = PersistentBufferPool(dev.context, dev.queue, max_staging_bytes=2 * chunk)
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(3000)
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool, staging=chunk)
    assert loaded.report.staging_buffers == 2, "sized to the bound"
    check_exact(loaded, path, tensors)
    s = pool.stats
    assert (s.staging_bytes, s.max_staging_bytes) == (2 * chunk, 2 * chunk)
    held = pool.staging(dev.queue, chunk, 2)  # leased: counted
    other = pool.staging(dev.queue, chunk, 2)  # a second set while the first is out: counted, then let go
    assert pool.stats.staging_bytes == 4 * chunk
    other.release()
    held.release()
    assert pool.stats.staging_bytes <= 2 * chunk and len(pool._staging) == 1
    with pytest.raises(ValueError, match="max_staging_bytes"):
        PersistentBufferPool(dev.context, dev.queue, max_staging_bytes=-1)


@pytest.mark.device
def test_staged_progress_counts_every_byte_once(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(50)
    write_raw_safetensors(path, tensors)
    calls = []
    loaded = load_file(path, dev.queue, pool=pool, staging=256, progress=lambda d, t, item: calls.append((d, t)))
    total = sum(a.nbytes for a in tensors.values())
    assert calls[-1] == (total, total) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    check_exact(loaded, path, tensors)


def test_staging_follows_host_unified_memory_unless_forced():
    from types import SimpleNamespace

    from fastckpt.device.staging import STAGING_CHUNK
    from fastckpt.device.staging import staging_chunk as _staging_chunk

    discrete, unified = SimpleNamespace(host_unified_memory=False), SimpleNamespace(host_unified_memory=True)
    assert [_staging_chunk(None, discrete), _staging_chunk(None, unified)] == [STAGING_CHUNK, 0]
    assert [_staging_chunk(True, unified), _staging_chunk(False, discrete), _staging_chunk(5000, unified)] == [
        STAGING_CHUNK, 0, 5000]
    for bad in (0, -1, 1.5, "64MiB"):
        with pytest.raises(ValueError, match="staging must be None"):
            _staging_chunk(bad, discrete)


@pytest.mark.device
def test_default_load_on_pocl_is_not_staged(tmp_path, unified_device, pool):
    dev = unified_device
    assert dev.queue.device.host_unified_memory
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, model(3), fsync=False)
    assert load_file(path, dev.queue, pool=pool).report.staging_chunk == 0
    assert pool.stats.staging_allocations == 0



@pytest.mark.device
def test_threads_staging_through_one_pool(tmp_path, dev, pool):
    import pyopencl as cl

    paths = []
    for i in range(3):
        p = tmp_path / f"m{i}.safetensors"
        write_raw_safetensors(p, odd_sized(300, seed=i))
        paths.append(p)
    errors = []

    def worker(k):
        queue = cl.CommandQueue(dev.context)
        for r in range(5):
            i = (k + r) % 3
            loaded = load_file(paths[i], queue, pool=pool, staging=1024, blocking=r % 2 == 0)
            for name, want in odd_sized(300, seed=i).items():
                if loaded[name].to_host().tobytes() != want.tobytes():
                    errors.append((k, r, name))

    errors += run_in_threads(worker, 4)
    assert not errors
    # Every set came back; the pool keeps STAGING_KEEP of them (sets beyond are let go) and counts what it keeps.
    from fastckpt.device.pool import STAGING_KEEP

    idle = pool._staging
    assert 1 <= len(idle) <= STAGING_KEEP and pool.stats.staging_bytes == sum(stage.nbytes for stage in idle)
    assert all(stage.chunk == 1024 and stage.count >= 2 for stage in idle)

# -- planning a whole file from the index's columns ----------------------------------------------------------------
@pytest.mark.device
def test_a_warm_reload_makes_its_views_from_the_entries_of_the_first(tmp_path, dev, pool):
    # Reading shape, dtype and offset out of the index's columns cost more than the view (1000 views of a warm
    # 4 MiB load: 1.8 ms against a 0.5 ms load on pocl); the plan's index keeps what it read.
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(300)
    write_raw_safetensors(path, tensors)
    first = load_file(path, dev.queue, pool=pool)
    check_exact(first, path, tensors)
    index = first._index
    assert len(index.made) == len(tensors)
    del first
    again = load_file(path, dev.queue, pool=pool)
    assert again._index is index, "the same plan, kept with the open file"
    check_exact(again, path, tensors)
    assert again["t00007"].buffer is not None and again["t00007"] is again["t00007"]


@pytest.mark.device
def test_a_file_of_many_tensors_loads_exactly_and_views_are_made_on_access(tmp_path, dev, pool):
    path = tmp_path / "m.safetensors"
    tensors = odd_sized(20_000)
    write_raw_safetensors(path, tensors)
    loaded = load_file(path, dev.queue, pool=pool)
    assert loaded.report.copies == 1 and loaded.report.tensors == len(loaded) == 20_000
    assert list(loaded) == list(tensors) and loaded._tensors == {}
    assert "t19999" in loaded and "t20000" not in loaded and 3 not in loaded
    raw = file_bytes(path)
    with fastckpt.open(path) as tf:
        for name in ("t00000", "t00001", "t12345", "t19999"):
            info = tf.info(name)
            got = loaded[name]
            assert got.shape == info.shape and got.dtype == info.dtype
            assert got.to_host().tobytes() == raw[info.offset:info.offset + info.nbytes] == tensors[name].tobytes()
    assert loaded["t12345"] is loaded["t12345"]
    with pytest.raises(TensorNotFoundError, match="no tensor named 't20000' was loaded"):
        loaded["t20000"]
    assert loaded.report.paths["t00007"] == "arena" and len(loaded.report.paths) == 20_000



@pytest.mark.device
def test_an_index_out_of_offset_order_is_planned_by_offset(tmp_path, dev, pool):
    from fastckpt._native.tensorindex import TensorIndex

    from fastckpt.formats.reader import TensorFile

    path = tmp_path / "m.safetensors"
    tensors = {"a": sample(np.float32, (3, 2), 1), "z": np.zeros((0, 2), np.float32), "b": sample(np.int16, (5,), 2),
               "c": sample(np.float64, (), 3), "d": sample(np.uint8, (2, 1, 3), 4)}
    write_raw_safetensors(path, tensors)
    with fastckpt.open(path) as tf:
        backwards = [tf.infos[name] for name in reversed(list(tf.infos))]
        shuffled = TensorFile(tf.mapped, "safetensors", TensorIndex.from_infos(tf.mapped, backwards), None)
        assert list(shuffled.infos) == ["d", "c", "b", "z", "a"]
        loaded = load_file(shuffled, dev.queue, pool=pool)
        assert list(loaded) == ["a", "b", "z", "c", "d"]  # by offset ("z", empty, at b's offset: a stable sort)
        assert loaded.report.copies == 1 and loaded.report.paths["z"] == "empty"
        check_exact(loaded, path, tensors)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("limit", [None, 64, 1000, 5000])
def test_regions_from_columns_equal_plan_regions(seed, limit):
    from fastckpt.device.load import _column_regions

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    sizes = rng.integers(1, 60, n)
    gaps = np.where(rng.random(n) < 0.1, MERGE_GAP + rng.integers(-2, 3, n), rng.integers(0, 40, n))
    offsets = np.cumsum(gaps + np.concatenate([[0], sizes[:-1]]))
    infos = [info(f"t{k}", int(o), int(s)) for k, (o, s) in enumerate(zip(offsets, sizes))]
    want = plan_regions(infos, limit=limit)
    got = _column_regions(offsets.astype(np.int64), sizes.astype(np.int64), limit, lambda k: f"t{k}")
    assert [(s, e, [i.name for i in infos[g]]) for s, e, g in got] == [(s, e, [i.name for i in g]) for s, e, g in want]


def test_regions_from_columns_leave_overlaps_to_plan_regions_and_name_a_tensor_too_large():
    from fastckpt.device.load import _column_regions

    assert _column_regions(np.array([0, 50]), np.array([100, 10]), None, str) is None
    assert _column_regions(np.array([], np.int64), np.array([], np.int64), None, str) == []
    with pytest.raises(ValueError, match="'t1' has 2000 bytes, more than one device allocation"):
        _column_regions(np.array([0, 10]), np.array([10, 2000]), 1000, lambda k: f"t{k}")


# -- planning (no device) ------------------------------------------------------------------------
def info(name, offset, nbytes):
    return TensorInfo(name, np.dtype("u1"), (nbytes,), offset, nbytes)


def test_plan_merges_small_gaps_and_splits_large_ones():
    infos = [info("a", 100, 10), info("b", 200, 10), info("c", 210 + MERGE_GAP + 1, 5)]
    regions = plan_regions(infos, limit=None)
    assert [(s, e, [i.name for i in g]) for s, e, g in regions] == [
        (100, 210, ["a", "b"]), (210 + MERGE_GAP + 1, 210 + MERGE_GAP + 6, ["c"])]


def test_plan_respects_the_allocation_limit_at_tensor_boundaries():
    infos = [info(f"t{i}", 1000 + 300 * i, 300) for i in range(10)]
    regions = plan_regions(infos, limit=1000)
    assert [len(g) for _, _, g in regions] == [3, 3, 3, 1]
    assert all(e - s <= 1000 for s, e, _ in regions)
    assert [i.name for _, _, g in regions for i in g] == [f"t{i}" for i in range(10)]


def test_plan_handles_overlapping_payloads():
    regions = plan_regions([info("a", 0, 100), info("b", 50, 10), info("c", 100, 1)], limit=None)
    assert [(s, e) for s, e, _ in regions] == [(0, 101)]


def test_plan_refuses_a_tensor_beyond_the_limit():
    with pytest.raises(ValueError, match="'t' has 2000 bytes"):
        plan_regions([info("t", 0, 2000)], limit=1000)


def test_importing_load_and_pool_keeps_pyopencl_out():
    import subprocess
    import sys

    code = "import sys, fastckpt.device.load, fastckpt.device.pool\nassert 'pyopencl' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_bench_command_runs_and_reports_zero_repeat_misses(tmp_path, capsys):
    from fastckpt.cli import main

    assert main(["bench", "--quick", "--repeat", "1", "--case", "b", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| bound: enqueue_copy per tensor" in out and "safetensors safe_open" in out
    assert "(b) repeated pooled loads: 0 pool misses" in out and "values exact: True" in out
    assert os.listdir(tmp_path) == [], "fixtures are removed"


@pytest.mark.slow  # a benchmark smoke run
@pytest.mark.device
def test_bench_case_of_many_tensors_states_its_target(tmp_path, capsys):
    from fastckpt.cli import main

    assert main(["bench", "--quick", "--repeat", "1", "--case", "c", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| index: fastckpt.open + hosts() |" in out and "| one enqueue_copy of the data region" in out
    assert "(c) first pooled load <= 2x the index time + one region copy: " in out
    assert "(c) repeated pooled loads: 0 pool misses" in out and "values exact: True" in out
    assert os.listdir(tmp_path) == [], "fixtures are removed"
