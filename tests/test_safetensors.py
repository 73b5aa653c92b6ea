"""safetensors: exact round trips with fastckpt and the reference library, the writer's layout, and
every way a damaged header must fail."""

import errno
import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as st_numpy
from _writing import RefilledBuffer, file_size_limit
from fastckpt._native.mapped import MappedFile

from fastckpt import FormatError
from fastckpt.formats.safetensors import (
    dtype_from_safetensors,
    dtype_to_safetensors,
    read_safetensors_index,
    read_tensor,
    save_safetensors,
)

BACKENDS = ["mmap", "pread"]

# Written out here rather than taken from the code under test.
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "F32": np.dtype(np.float32),
    "C64": np.dtype(np.complex64),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
# The reference library's numpy loader has no mapping for the float8 types (it looks them up on numpy).
LIBRARY_NUMPY_LOADS = [n for n in DTYPES if not n.startswith("F8_")]
SHAPES = [(), (0,), (3, 0, 2), (7,), (4, 5, 3)]


def sample(dtype, shape, seed=0):
    """Deterministic values covering every bit pattern of ``dtype`` except NaN (so that
    ``np.array_equal`` is meaningful); signed zeros, infinities and subnormals stay."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    arr = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    if dtype.kind in "fcV":
        arr = arr.copy()
        with np.errstate(invalid="ignore"):
            arr[np.isnan(arr)] = dtype.type(1)
    return arr


def assert_exact(got, want):
    want = np.asarray(want)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()  # bit-exact: -0.0, payloads, padding bits


def load(path, backend="mmap"):
    """Every tensor (as a copy) and the metadata, through fastckpt's reader."""
    with MappedFile(path, backend=backend) as m:
        infos, metadata, data_start = read_safetensors_index(m)
        return {i.name: np.array(read_tensor(m, i)) for i in infos}, metadata, data_start


def raw_file(tmp_path, header, data=b"", pad=b"", length=None, name="bad.safetensors"):
    """A hand-made file: 8-byte length, header (dict -> compact JSON, or bytes), padding, data."""
    if not isinstance(header, bytes):
        header = json.dumps(header, separators=(",", ":")).encode()
    body = header + pad
    n = len(body) if length is None else length
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


def split(path):
    blob = Path(path).read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return blob[:8], blob[8 : 8 + n], blob[8 + n :]


# -- dtype helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DTYPES))
def test_dtype_helpers_map_both_ways(name):
    assert dtype_from_safetensors(name) == DTYPES[name]
    assert dtype_to_safetensors(DTYPES[name]) == name


@pytest.mark.parametrize("dtype,name", [(">f4", "F32"), (">i8", "I64"), (">c8", "C64"), (">u2", "U16"),
                                        (np.longlong, "I64"), (np.intc, "I32"), ("?", "BOOL")])
def test_dtype_to_safetensors_ignores_byte_order_and_aliases(dtype, name):
    assert dtype_to_safetensors(dtype) == name


@pytest.mark.parametrize("name,match", [("F4", "packs 4-bit"), ("F6_E2M3", "packs 6-bit"), ("F6_E3M2", "packs 6-bit"),
                                        ("F32 ", "unknown dtype 'F32 '"), ("f32", "unknown dtype 'f32'"),
                                        ("C128", "unknown dtype"), (["F32"], "unknown dtype"), (None, "unknown dtype")])
def test_dtype_from_safetensors_refuses_unreadable_names(name, match):
    with pytest.raises(ValueError, match=match):
        dtype_from_safetensors(name)


@pytest.mark.parametrize("dtype,match", [
    (np.complex128, "complex64"), (np.longdouble, r"astype\(np.float64\)"), (object, "numeric"),
    ("<U3", "numeric"), ("S2", "numeric"), ("M8[s]", "numeric"), ([("a", "<i4")], "structured"),
    (ml_dtypes.int4, "no safetensors"), (ml_dtypes.float6_e2m3fn, "6-bit elements share bytes"),
    (ml_dtypes.float6_e3m2fn, "F6_E3M2"),
    (ml_dtypes.float8_e4m3, "no safetensors"), ("V2", "no safetensors"),
])
def test_dtype_to_safetensors_refuses_inexpressible_dtypes(dtype, match):
    with pytest.raises(TypeError, match=match):
        dtype_to_safetensors(dtype)


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(DTYPES))
def test_round_trip_every_dtype_and_shape(tmp_path, name, shape, backend):
    want = sample(DTYPES[name], shape)
    path = tmp_path / "t.safetensors"
    save_safetensors(path, {"x": want}, fsync=False)
    got, metadata, _ = load(path, backend)
    assert metadata is None
    assert list(got) == ["x"]
    assert_exact(got["x"], want)


@pytest.mark.parametrize("name", list(DTYPES))
def test_reference_library_reads_fastckpt_files_bit_exactly(tmp_path, name):
    tensors = {"a": sample(DTYPES[name], (3, 4), seed=1), "b": sample(DTYPES[name], (), seed=2),
               "empty": sample(DTYPES[name], (2, 0))}
    path = tmp_path / "t.safetensors"
    save_safetensors(path, tensors, {"format": "np"})
    decoded = dict(safetensors.deserialize(path.read_bytes()))
    assert sorted(decoded) == ["a", "b", "empty"]
    for key, want in tensors.items():
        assert decoded[key]["dtype"] == name
        assert decoded[key]["shape"] == list(want.shape)
        assert bytes(decoded[key]["data"]) == want.tobytes()
        assert bytes(decoded[key]["data"]) == want.reshape(-1).view(np.uint8).tobytes()


@pytest.mark.parametrize("name", LIBRARY_NUMPY_LOADS)
def test_reference_numpy_loaders_read_fastckpt_files_exactly(tmp_path, name):
    tensors = {"a": sample(DTYPES[name], (3, 4), seed=1), "b": sample(DTYPES[name], (), seed=2),
               "empty": sample(DTYPES[name], (2, 0))}
    path = tmp_path / "t.safetensors"
    save_safetensors(path, tensors, {"format": "np", "note": "ünïcode ✓"})
    loaded = st_numpy.load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for key, want in tensors.items():
        assert_exact(loaded[key], want)
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "np", "note": "ünïcode ✓"}
        for key, want in tensors.items():
            assert_exact(f.get_tensor(key), want)


@pytest.mark.parametrize("name", list(DTYPES))
def test_fastckpt_reads_reference_files_exactly(tmp_path, name):
    tensors = {"a": sample(DTYPES[name], (5, 3), seed=3), "z": sample(DTYPES[name], ()),
               "e": sample(DTYPES[name], (0, 4))}
    path = tmp_path / "ref.safetensors"
    st_numpy.save_file(tensors, path, metadata={"k": "v"})
    got, metadata, _ = load(path)
    assert metadata == {"k": "v"}
    assert sorted(got) == sorted(tensors)
    for key, want in tensors.items():
        assert_exact(got[key], want)


def test_fastckpt_reads_a_reference_file_with_every_dtype(tmp_path):
    tensors = {f"t_{name}": sample(dt, (3, 2), seed=i) for i, (name, dt) in enumerate(DTYPES.items())}
    path = tmp_path / "ref.safetensors"
    st_numpy.save_file(tensors, path)
    got, metadata, _ = load(path)
    assert metadata is None
    for key, want in tensors.items():
        assert_exact(got[key], want)


def test_large_tensors_round_trip(tmp_path):
    tensors = {"big": sample(np.float32, (1024, 1024), seed=5), "mid": sample(np.int64, (300, 700), seed=6),
               "odd": sample(ml_dtypes.bfloat16, (999, 1001), seed=7)}
    path = tmp_path / "big.safetensors"
    save_safetensors(path, tensors, fsync=False)
    got, _, _ = load(path)
    for key, want in tensors.items():
        assert_exact(got[key], want)
    assert_exact(st_numpy.load_file(path)["big"], tensors["big"])


@pytest.mark.parametrize("metadata", [None, {}, {"a": ""}, {"step": "10", "ünï": "cödé ✓", "json": '{"x": [1]}'}],
                         ids=["none", "empty", "empty-value", "several"])
def test_metadata_round_trips_exactly(tmp_path, metadata):
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"w": np.arange(3, dtype=np.int8)}, metadata)
    assert load(path)[1] == metadata
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == metadata


# -- inputs the writer must convert ----------------------------------------------------------


class _ArrayLike:
    def __init__(self, arr):
        self._arr = arr

    def __array__(self, dtype=None, copy=None):
        return np.array(self._arr, dtype=dtype)


@pytest.mark.parametrize("make,want", [
    (lambda: np.arange(12, dtype=">f4").reshape(3, 4), np.arange(12, dtype="<f4").reshape(3, 4)),
    (lambda: np.arange(6, dtype=">i8"), np.arange(6, dtype="<i8")),
    (lambda: (np.arange(4) + 1j).astype(">c8"), (np.arange(4) + 1j).astype("<c8")),
    (lambda: np.arange(12, dtype=np.int32).reshape(3, 4).T, np.arange(12, dtype=np.int32).reshape(3, 4).T.copy()),
    (lambda: np.asfortranarray(np.arange(12, dtype=">u2").reshape(3, 4)), np.arange(12, dtype="<u2").reshape(3, 4)),
    (lambda: np.arange(20, dtype=np.float64)[::-3], np.arange(20, dtype=np.float64)[::-3].copy()),
    (lambda: sample(ml_dtypes.bfloat16, (6, 4))[::2, 1::2], sample(ml_dtypes.bfloat16, (6, 4))[::2, 1::2].copy()),
    (lambda: [[1, 2], [3, 4]], np.array([[1, 2], [3, 4]])),
    (lambda: 2.5, np.array(2.5)),
    (lambda: memoryview(np.arange(5, dtype=np.uint16)), np.arange(5, dtype=np.uint16)),
    (lambda: _ArrayLike(np.arange(5, dtype=np.float16)), np.arange(5, dtype=np.float16)),
], ids=["big-endian-2d", "big-endian-i8", "big-endian-c8", "transposed", "fortran-big-endian",
        "negative-stride", "strided-bf16", "list", "python-scalar", "memoryview", "__array__"])
def test_writer_converts_byte_order_and_layout_exactly(tmp_path, make, want):
    path = tmp_path / "c.safetensors"
    save_safetensors(path, {"x": make()})
    assert_exact(load(path)[0]["x"], want)
    assert_exact(st_numpy.load_file(path)["x"], want)


def test_big_endian_input_is_stored_little_endian_bytes(tmp_path):
    path = tmp_path / "be.safetensors"
    save_safetensors(path, {"x": np.array([1, 2], dtype=">u4")}, alignment=64)
    assert split(path)[2] == b"\x01\x00\x00\x00\x02\x00\x00\x00"


def test_writer_leaves_input_arrays_unchanged(tmp_path):
    arr = np.arange(8, dtype=">i4")
    before = arr.tobytes()
    save_safetensors(tmp_path / "u.safetensors", {"x": arr})
    assert arr.tobytes() == before and arr.dtype == np.dtype(">i4")


@pytest.mark.parametrize("make,limit_mib", [
    (lambda i: np.full((1024, 1024), i, np.float32), 0.5),  # written straight from the arrays' buffers
    (lambda i: np.full((1024, 1024), i, ">f4"), 4.5),  # byte-swapped copies, one at a time
    (lambda i: np.full((2048, 1024), i, np.float32)[::2], 4.5),  # strided: contiguous copies, one at a time
], ids=["native", "big-endian", "strided"])
def test_writer_peak_memory_is_at_most_one_tensor(tmp_path, make, limit_mib):
    import tracemalloc

    tensors = {f"t{i}": make(i) for i in range(6)}  # 6 tensors of 4 MiB
    tracemalloc.start()
    try:
        save_safetensors(tmp_path / "p.safetensors", tensors, fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit_mib * 2**20


@pytest.mark.parametrize("tensors,metadata,error,match", [
    ({"o": np.array([1, None], dtype=object)}, None, TypeError, "tensor 'o'.*numeric"),
    ({"s": np.array(["ab", "c"])}, None, TypeError, "tensor 's'.*numeric"),
    ({"c": np.zeros(2, np.complex128)}, None, TypeError, r"tensor 'c'.*complex128.*astype\(np.complex64\)"),
    ({"l": np.zeros(2, np.longdouble)}, None, TypeError, "tensor 'l'.*float128"),
    ({"i4": np.zeros(2, ml_dtypes.int4)}, None, TypeError, "tensor 'i4'.*int4"),
    ({"m": np.ma.masked_array([1, 2], mask=[0, 1])}, None, TypeError, r"tensor 'm'.*mask.*\.filled"),
    ({"__metadata__": np.zeros(2)}, None, ValueError, "reserved.*metadata="),
    ({1: np.zeros(2)}, None, TypeError, "names must be str"),
    ({"bad\udc80": np.zeros(2)}, None, ValueError, "UTF-8"),
    ({"w": np.zeros(2)}, {"step": 10}, TypeError, r"str to str.*'step': 10.*str\(\)"),
    ({"w": np.zeros(2)}, {1: "x"}, TypeError, "str to str"),
    ({"w": np.zeros(2)}, {"k": None}, TypeError, "str to str"),
    ({"w": np.zeros(2)}, [("k", "v")], TypeError, "metadata must be a mapping"),
    ([("w", np.zeros(2))], None, TypeError, "tensors must be a mapping"),
], ids=["object", "unicode", "complex128", "longdouble", "int4", "masked", "reserved-name", "int-name", "surrogate-name",
        "int-metadata-value", "int-metadata-key", "none-metadata-value", "metadata-list", "tensors-list"])
def test_writer_refuses_what_safetensors_cannot_express(tmp_path, tensors, metadata, error, match):
    path = tmp_path / "r.safetensors"
    with pytest.raises(error, match=match):
        save_safetensors(path, tensors, metadata)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("alignment", [0, 4, 7, 100, 4095, -4096, 64.0, True])
def test_writer_refuses_bad_alignment(tmp_path, alignment):
    with pytest.raises(ValueError, match="power of two >= 8"):
        save_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2)}, alignment=alignment)


def test_header_over_the_size_limit_is_refused_before_writing(tmp_path, monkeypatch):
    import fastckpt.formats.safetensors as mod

    monkeypatch.setattr(mod, "MAX_HEADER_SIZE", 4096)
    with pytest.raises(ValueError, match="over the safetensors limit of 4096"):
        save_safetensors(tmp_path / "h.safetensors", {"w": np.zeros(2)}, {"k": "x" * 5000}, alignment=8)
    assert list(tmp_path.iterdir()) == []


# -- layout ----------------------------------------------------------------------------------


def test_golden_bytes_of_a_tiny_file(tmp_path):
    path = tmp_path / "g.safetensors"
    save_safetensors(path, {"a": np.array([1, 2], np.uint8)}, alignment=64)
    assert path.read_bytes() == (
        b"\x38\x00\x00\x00\x00\x00\x00\x00"
        b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
        b"   "
        b"\x01\x02"
    )


def test_golden_header_with_metadata_and_two_dtypes(tmp_path):
    path = tmp_path / "g.safetensors"
    save_safetensors(path, {"b": np.array([1, 2], np.uint8), "a": np.array([[1.5]], np.float32), "é": np.zeros((0,), np.int16)},
                     {"z": "1", "a": "ü"}, alignment=8)
    _, header, data = split(path)
    text = ('{"__metadata__":{"a":"ü","z":"1"},"a":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]},'
            '"é":{"dtype":"I16","shape":[0],"data_offsets":[4,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}')
    raw = text.encode("utf-8")
    assert header == raw + b" " * (-(8 + len(raw)) % 8)
    assert data == b"\x00\x00\xc0\x3f\x01\x02"


def test_same_bytes_as_the_reference_writer_apart_from_padding(tmp_path):
    tensors = {name.lower(): sample(dt, (2, 3), seed=i) for i, (name, dt) in enumerate(DTYPES.items())}
    tensors["aa"] = sample(np.float32, (4,), seed=40)
    tensors["empty"] = sample(np.int64, (0, 2))
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    save_safetensors(ours, tensors, {"framework": "np"})
    st_numpy.save_file(tensors, ref, metadata={"framework": "np"})
    _, our_header, our_data = split(ours)
    _, ref_header, ref_data = split(ref)
    assert our_header.rstrip(b" ") == ref_header.rstrip(b" ")
    assert our_data == ref_data


@pytest.mark.parametrize("alignment", [8, 64, 4096, 65536])
def test_data_section_and_every_tensor_are_aligned(tmp_path, alignment):
    tensors = {f"t{i}": sample(dt, (i % 4 + 1, 3), seed=i) for i, dt in enumerate(DTYPES.values())}
    path = tmp_path / "al.safetensors"
    save_safetensors(path, tensors, alignment=alignment)
    with MappedFile(path) as m:
        infos, _, data_start = read_safetensors_index(m)
        assert data_start % alignment == 0
        assert (data_start - 8) % 8 == 0
        for info in infos:
            assert (info.offset - data_start) % info.dtype.itemsize == 0
            assert read_tensor(m, info).flags.aligned
    assert [i.dtype.itemsize for i in infos] == sorted((i.dtype.itemsize for i in infos), reverse=True)


def test_saving_twice_gives_identical_bytes_whatever_the_insertion_order(tmp_path):
    tensors = {f"w{i}": sample(dt, (3, 2), seed=i) for i, dt in enumerate(DTYPES.values())}
    metadata = {"b": "2", "a": "1"}
    first, second = tmp_path / "1.safetensors", tmp_path / "2.safetensors"
    save_safetensors(first, tensors, metadata)
    save_safetensors(second, dict(reversed(list(tensors.items()))), dict(reversed(list(metadata.items()))))
    assert first.read_bytes() == second.read_bytes()


def test_read_tensor_is_a_zero_copy_read_only_view(tmp_path):
    path = tmp_path / "v.safetensors"
    save_safetensors(path, {"w": np.arange(6, dtype=np.float32)})
    m = MappedFile(path)
    infos, _, _ = read_safetensors_index(m)
    view = read_tensor(m, infos[0])
    assert view.ctypes.data == m.address + infos[0].offset
    assert not view.flags.writeable
    m.close()
    assert view.tolist() == [0, 1, 2, 3, 4, 5]  # the view keeps the mapping alive


def test_empty_file_of_tensors(tmp_path):
    path = tmp_path / "none.safetensors"
    save_safetensors(path, {}, alignment=8)
    assert path.read_bytes() == b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    assert load(path) == ({}, None, 16)
    assert st_numpy.load_file(path) == {}


# -- atomicity -------------------------------------------------------------------------------


class _FailsOnSecondConversion:
    """Converts once (the header pass) and fails when its bytes are due, after others were written."""

    def __init__(self, error=None):
        self.calls = 0
        self.error = error or RuntimeError("source went away")

    def __array__(self, dtype=None, copy=None):
        self.calls += 1
        if self.calls > 1:
            raise self.error
        return np.zeros(4, np.uint8)


@pytest.mark.parametrize("error", [RuntimeError("source went away"), KeyboardInterrupt(),
                                   OSError(28, "No space left on device")], ids=["error", "interrupt", "disk-full"])
def test_failure_mid_save_leaves_no_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "f.safetensors"
    with pytest.raises(type(error)):
        save_safetensors(path, {"a": np.ones(1 << 16, np.float64), "z": _FailsOnSecondConversion(error)})
    assert list(tmp_path.iterdir()) == []


def test_a_write_the_kernel_refuses_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.safetensors"
    save_safetensors(path, {"a": np.arange(10, dtype=np.int32)})
    before = path.read_bytes()
    with file_size_limit(1 << 20):  # a short write, then EFBIG, as on a full disk
        with pytest.raises(OSError) as info:
            save_safetensors(path, {f"t{i}": np.full(1 << 16, i, np.float64) for i in range(4)}, overwrite=True)
    assert info.value.errno == errno.EFBIG
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors"]


def test_failed_save_keeps_the_previous_file_intact(tmp_path):
    path = tmp_path / "f.safetensors"
    save_safetensors(path, {"a": np.arange(10, dtype=np.int32)})
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="source went away"):
        save_safetensors(path, {"a": np.ones(1 << 16, np.float64), "z": _FailsOnSecondConversion()}, overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors"]


def test_saving_over_a_mapped_file_leaves_old_views_intact(tmp_path):
    # safetensors#764: writing in place zero-filled pages that a reader still had mapped.
    path = tmp_path / "live.safetensors"
    old = sample(np.float32, (256, 256), seed=1)
    save_safetensors(path, {"w": old})
    with MappedFile(path) as m:
        infos, _, _ = read_safetensors_index(m)
        view = read_tensor(m, infos[0])
        new = sample(np.float32, (256, 256), seed=2)
        save_safetensors(path, {"w": new, "extra": np.ones(10)}, overwrite=True)
        assert_exact(view, old)
    got, _, _ = load(path)
    assert_exact(got["w"], new)


def test_saving_the_views_of_a_file_back_over_it_reproduces_it(tmp_path):
    path = tmp_path / "same.safetensors"
    tensors = {f"w{i}": sample(dt, (64, 3), seed=i) for i, dt in enumerate(DTYPES.values())}
    save_safetensors(path, tensors, {"k": "v"})
    before = path.read_bytes()
    with MappedFile(path) as m:
        infos, metadata, _ = read_safetensors_index(m)
        save_safetensors(path, {i.name: read_tensor(m, i) for i in infos}, metadata, overwrite=True)
    assert path.read_bytes() == before


def test_parser_refuses_none():
    with pytest.raises(TypeError, match="MappedFile"):
        read_safetensors_index(None)


def test_a_changed_array_like_is_refused(tmp_path):
    class Shifty:
        calls = 0

        def __array__(self, dtype=None, copy=None):
            Shifty.calls += 1
            return np.zeros(Shifty.calls, np.uint8)

    path = tmp_path / "s.safetensors"
    with pytest.raises(ValueError, match=r"tensor 'x': converting it again gave uint8\[2\] instead of U8\[1\]"):
        save_safetensors(path, {"x": Shifty()})
    assert list(tmp_path.iterdir()) == []


# -- damaged files ---------------------------------------------------------------------------


def _small_valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.safetensors")
        save_safetensors(p, {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.array(1.5, np.float32),
                             "c": np.zeros(0, np.uint8)}, {"k": "v"}, alignment=8, fsync=False)
        return Path(p).read_bytes()


SMALL = _small_valid_file()


def test_small_file_is_valid(tmp_path):
    path = tmp_path / "small.safetensors"
    path.write_bytes(SMALL)
    got, metadata, _ = load(path)
    assert metadata == {"k": "v"}
    assert_exact(got["a"], np.arange(6, dtype=np.int16).reshape(2, 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", range(len(SMALL)))
def test_every_truncation_raises_format_error(tmp_path, length, backend):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(SMALL[:length])
    with pytest.raises(FormatError, match="cut.safetensors"):
        load(path, backend)


A_U8 = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
BIG = 2**64


def _pad8(header: bytes) -> bytes:
    return b" " * (-(8 + len(header)) % 8)


CORRUPTIONS = {
    # name: (header, data, pad, length override, message pattern)
    "length-2**64-1": ({"a": A_U8}, b"\x00\x00", b"", BIG - 1, r"header length at byte 0 is 18446744073709551615, larger than"),
    "length-over-cap": ({"a": A_U8}, b"\x00\x00", b"", 100_000_001, "larger than the safetensors limit of 100000000"),
    "length-past-eof": ({"a": A_U8}, b"\x00\x00", b"", 60, "says 60 bytes of JSON, but only 55 bytes follow"),
    "length-zero": (b"", b"", b"", None, "header length at byte 0 is 0"),
    "length-one": (b"{", b"", b"", None, "header length at byte 0 is 1"),
    "not-brace": (b"[]", b"", b"", None, r"must start with '\{' \(0x7b\), after JSON whitespace.*offset 8 is 0x5b"),
    "whitespace-then-not-brace": (b' \t\r\n[]', b"", b"", None, r"must start with '\{'.*offset 12 is 0x5b"),
    "whitespace-only": (b"  \t\n", b"", b"", None, r"bytes \[8, 16\)\) holds only JSON whitespace"),
    "bom": ("\ufeff{}".encode(), b"", b"", None, "offset 8 is 0xef"),
    "formfeed-before": (b"\x0c{}", b"", b"", None, "offset 8 is 0x0c"),
    "nul-padding": ({"a": A_U8}, b"\x00\x00", b"\x00\x00\x00", None,
                    r"followed only by JSON whitespace.*offset 63 is 0x00"),
    "formfeed-padding": ({"a": A_U8}, b"\x00\x00", b"\n \x0c", None, r"offset 63 is 0x0c"),
    "nbsp-padding": ({"a": A_U8}, b"\x00\x00", "\u00a0".encode() + b" ", None, r"offset 62 is 0xa0"),
    "garbage-after-object": (b'{} {}', b"", b"   ", None, "extra data after the top-level object at byte offset 10"),
    "invalid-utf8": (b'{"\xff":1}', b"", b"", None, r"not valid UTF-8: byte at offset 10 \(0xff\)"),
    "utf8-surrogate": (b'{"\xed\xa0\x80":1}', b"", b"", None, r"not valid UTF-8: byte at offset 10"),
    "truncated-json": (b'{"a":{"dtype"}', b"", b"", None, "not valid JSON at byte offset"),
    "nan": (b'{"a":NaN}', b"", b"", None, "NaN is not valid JSON"),
    "deep-nesting": (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", b"", None, "cannot be parsed"),
    "int-too-long": (b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,2]}}', b"", b"", None,
                     "cannot be parsed|not valid JSON"),
    "duplicate-tensor": (b'{"a":' + json.dumps(A_U8).encode() + b',"a":' + json.dumps(A_U8).encode() + b"}", b"\x00\x00",
                         b"", None, "the key 'a' more than once"),
    "duplicate-entry-key": (b'{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"\x00\x00", b"", None,
                            "the key 'dtype' more than once"),
    "duplicate-metadata-key": (b'{"__metadata__":{"k":"1","k":"2"}}', b"", b"", None, "the key 'k' more than once"),
    "duplicate-in-nested-list": (b'{"a":{"dtype":"U8","shape":[{"x":1,"x":2}],"data_offsets":[0,2]}}', b"\x00\x00", b"",
                                 None, "the key 'x' more than once"),
    "metadata-int-value": ({"__metadata__": {"k": 1}}, b"", b"", None, r"__metadata__\['k'\] must be a string, got int 1"),
    "metadata-null-value": ({"__metadata__": {"k": None}}, b"", b"", None, r"__metadata__\['k'\] must be a string"),
    "metadata-nested": ({"__metadata__": {"k": {"x": "y"}}}, b"", b"", None, r"__metadata__\['k'\] must be a string, got dict"),
    "metadata-list": ({"__metadata__": ["k"]}, b"", b"", None, "__metadata__ must be a JSON object of strings, got list"),
    "negative-zero-offset": (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[-0,2]}}', b"\x00\x00", b"", None,
                             "the number -0 at byte offset 55"),
    "negative-zero-dim": (b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b"", b"", None,
                          "the number -0 at byte offset 36"),
    "surrogate-escape-name": (b'{"\\ud800":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"\x00\x00", b"", None,
                              r"tensor name '\\ud800' is not valid Unicode"),
    "surrogate-escape-metadata": (b'{"__metadata__":{"k":"\\udfff"}}', b"", b"", None,
                                  r"__metadata__\['k'\] '\\udfff' is not valid Unicode"),
    "entry-not-object": ({"a": [1, 2]}, b"", b"", None, "tensor 'a': expected an object with dtype, shape and data_offsets"),
    "entry-missing-key": ({"a": {"dtype": "U8", "shape": [2]}}, b"\x00\x00", b"", None,
                          r"tensor 'a': expected exactly the keys .*got \['dtype', 'shape'\]"),
    "entry-extra-key": ({"a": {**A_U8, "extra": 1}}, b"\x00\x00", b"", None, "tensor 'a': expected exactly the keys"),
    "unknown-dtype": ({"a": {**A_U8, "dtype": "F128"}}, b"\x00\x00", b"", None, "tensor 'a': unknown dtype 'F128'"),
    "sub-byte-dtype": ({"a": {**A_U8, "dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\x00\x00", b"", None,
                       r"tensor 'a': shape \[3\] of F4 \(4-bit elements\) is 12 bits, not a whole number of bytes"),
    "dtype-not-string": ({"a": {**A_U8, "dtype": 8}}, b"\x00\x00", b"", None, "tensor 'a': dtype must be a string, got 8"),
    "shape-not-list": ({"a": {**A_U8, "shape": 2}}, b"\x00\x00", b"", None, "tensor 'a': shape must be a list"),
    "negative-dim": ({"a": {**A_U8, "shape": [-2]}}, b"\x00\x00", b"", None,
                     r"tensor 'a': shape\[0\]: expected a non-negative integer, got -2"),
    "float-dim": ({"a": {**A_U8, "shape": [2.0]}}, b"\x00\x00", b"", None, r"shape\[0\]: expected a non-negative integer, got 2.0 \(float\)"),
    "bool-dim": ({"a": {**A_U8, "shape": [True, 2]}}, b"\x00\x00", b"", None, r"shape\[0\].*got True \(bool\)"),
    "string-dim": ({"a": {**A_U8, "shape": ["2"]}}, b"\x00\x00", b"", None, r"shape\[0\].*got '2' \(str\)"),
    "dim-past-int64": ({"a": {**A_U8, "shape": [BIG, 0], "data_offsets": [0, 0]}}, b"", b"", None,
                       r"shape\[0\]: 18446744073709551616 is larger than"),
    "product-overflow": ({"a": {**A_U8, "shape": [2**32, 2**32], "data_offsets": [0, 0]}}, b"", b"", None,
                         r"tensor 'a': shape \[4294967296, 4294967296\] overflows a 64-bit element count at shape\[1\]"),
    "overflow-before-zero": ({"a": {**A_U8, "shape": [2**62, 4, 0], "data_offsets": [0, 0]}}, b"", b"", None,
                             r"overflows a 64-bit element count at shape\[1\]"),
    "bytes-overflow": ({"a": {**A_U8, "dtype": "F64", "shape": [2**61], "data_offsets": [0, 0]}}, b"", b"", None,
                       "of F64 overflows a 64-bit byte count"),
    "size-mismatch": ({"a": {**A_U8, "shape": [3]}}, b"\x00\x00", b"", None,
                      r"tensor 'a': shape \[3\] of U8 needs 3 bytes, but data_offsets \[0, 2\] hold 2 \(absolute bytes \[64, 66\)\)"),
    "offsets-not-pair": ({"a": {**A_U8, "data_offsets": [0, 1, 2]}}, b"\x00\x00", b"", None, r"data_offsets must be a list \[begin, end\]"),
    "offsets-reversed": ({"a": {**A_U8, "data_offsets": [2, 0]}}, b"\x00\x00", b"", None, r"data_offsets \[2, 0\] end before they begin"),
    "offset-negative": ({"a": {**A_U8, "data_offsets": [-2, 0]}}, b"\x00\x00", b"", None, r"data_offsets\[0\]: expected a non-negative"),
    "offset-float": ({"a": {**A_U8, "data_offsets": [0, 2.0]}}, b"\x00\x00", b"", None, r"data_offsets\[1\].*got 2.0"),
    "offsets-past-eof": ({"a": A_U8}, b"\x00", b"", None, r"tensor 'a': data_offsets \[0, 2\] reach absolute byte 66, past the end of the file \(65 bytes"),
    "hole": ({"a": {**A_U8, "data_offsets": [0, 2]}, "b": {**A_U8, "data_offsets": [3, 5]}}, b"\x00" * 5, b"", None,
             r"tensor 'b': data_offsets \[3, 5\] leave a hole.*expected begin 2 \(absolute byte \d+\), got 3"),
    "hole-at-start": ({"a": {**A_U8, "data_offsets": [1, 3]}}, b"\x00" * 3, b"", None, r"tensor 'a'.*leave a hole.*expected begin 0"),
    "overlap": ({"a": {**A_U8, "data_offsets": [0, 2]}, "b": {**A_U8, "data_offsets": [1, 3]}}, b"\x00" * 3, b"", None,
                r"tensor 'b': data_offsets \[1, 3\] leave an overlap"),
    "same-range-twice": ({"a": A_U8, "b": A_U8}, b"\x00" * 2, b"", None, r"tensor 'b'.*overlap.*expected begin 2"),
    "trailing-bytes": ({"a": A_U8}, b"\x00\x00\x00", b"", None, r"1 unexpected trailing bytes after the data section"),
    "data-without-tensors": ({}, b"\x00", b"", None, r"1 unexpected trailing bytes"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_targeted_corruption_raises_a_precise_format_error(tmp_path, case, backend):
    header, data, pad, length, pattern = CORRUPTIONS[case]
    if not isinstance(header, bytes):
        header = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if not pad and length is None and len(header) > 1:
        pad = _pad8(header)  # keep every case but the padding ones correctly padded
    path = raw_file(tmp_path, header, data, pad, length)
    with pytest.raises(FormatError, match=pattern) as info:
        load(path, backend)
    assert str(path) in str(info.value)


def test_hand_made_variants_that_are_valid(tmp_path):
    # Inner JSON whitespace, no padding at all, offsets listed out of order, null metadata, a 0-d tensor.
    header = (b'{ "b" : {"shape": [], "dtype": "I16", "data_offsets": [2, 4]},\n'
              b' "a": {"data_offsets": [0, 2], "dtype": "U8", "shape": [2]}, "__metadata__": null}')
    path = raw_file(tmp_path, header, b"\x01\x02\x03\x04")
    with MappedFile(path) as m:
        infos, metadata, data_start = read_safetensors_index(m)
        assert [i.name for i in infos] == ["a", "b"]
        assert metadata is None and data_start == 8 + len(header)
        assert read_tensor(m, infos[0]).tolist() == [1, 2]
        assert read_tensor(m, infos[1]).shape == () and int(read_tensor(m, infos[1])) == 0x0403


# JSON whitespace (space, tab, LF, CR) before and after the header's object, as safetensors' own tests have it
# (test_whitespace_padded_header, test_whitespace_leading_padded_header in safetensors/src/tensor.rs: serde_json takes
# whitespace around a value); 0.2's reader refused all but trailing spaces.
PADDINGS = {"spaces-after": (b"", b"   "), "tabs-after": (b"", b"\t\t"), "lf-after": (b"", b"\n"),
            "crlf-after": (b"", b"\r\n"), "all-four-after": (b"", b"\r \t\n"), "before": (b"\t\n", b""),
            "before-and-after": (b"\n\t ", b"\r\n \t"), "page-before": (b" " * 4000, b"")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", list(PADDINGS))
def test_headers_padded_with_json_whitespace_read_as_safetensors_reads_them(tmp_path, padding, backend):
    from fastckpt._native.safetensors import _read_index_checking, _read_table_fast_only

    before, after = PADDINGS[padding]
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}'
    data = np.array([1.5, -2.0], np.float32).tobytes()
    blob = struct.pack("<Q", len(before + header + after)) + before + header + after + data
    path = tmp_path / "padded.safetensors"
    path.write_bytes(blob)
    reference = st_numpy.load(blob)  # safetensors itself reads it
    assert reference["w"].tolist() == [1.5, -2.0]
    got, metadata, data_start = load(path, backend)
    assert got["w"].tolist() == [1.5, -2.0] and metadata == {"k": "v"} and data_start == len(blob) - 8
    with MappedFile(path, backend=backend) as m:  # both parsers: the fast one and the checking one
        assert _read_table_fast_only(m) is not None
        assert [(i.name, i.offset) for i in _read_index_checking(m)[0]] == [("w", len(blob) - 8)]
    import fastckpt

    with fastckpt.open(path) as f:  # the format is found behind leading padding too
        assert (f.format, f.host("w").tolist()) == ("safetensors", [1.5, -2.0])
    assert fastckpt.load_bytes(blob)["w"].tolist() == [1.5, -2.0]


def test_docs_page_has_the_same_text_as_the_module_docstring():
    import re

    import fastckpt.formats.safetensors as module

    page = (Path(__file__).parent.parent / "docs" / "formats" / "safetensors.md").read_text(encoding="utf-8")
    page = re.sub(r"<!--.*?-->", "", page, flags=re.S)
    docstring = re.sub(r":(?:class|func):`~?[\w.]*?(\w+)`", r"\1", module.__doc__)
    words = lambda text: re.findall(r"\w+", text)  # noqa: E731
    assert words(page) == words(docstring)


@pytest.mark.parametrize("name", ['a":b', "x\\\":-0", "-0", "k:\\u0041", "😀:", "\ud7ff\ue000"])
def test_names_and_metadata_may_hold_json_punctuation(tmp_path, name):
    path = tmp_path / "p.safetensors"
    save_safetensors(path, {name: np.arange(3, dtype=np.int8), "b": np.zeros(1, np.int8)}, {name: name + ":-0"})
    got, metadata, _ = load(path)
    assert metadata == {name: name + ":-0"}
    assert_exact(got[name], np.arange(3, dtype=np.int8))


def test_escaped_surrogate_pairs_are_valid_names(tmp_path):
    header = b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    path = raw_file(tmp_path, header, b"\x07", _pad8(header))
    got, _, _ = load(path)
    assert list(got) == ["\U0001f600"]


def test_header_is_what_json_dumps_writes_for_every_kind_of_name(tmp_path):
    # The writer builds the header text itself; names that need escaping must come out as json.dumps has them.
    names = [chr(c) + "x" for c in range(128)] + ["é", "\u2028\u2029", "😀", 'a"b\\c\x7f', "", " "]
    tensors = {name: np.array([i], np.uint16) for i, name in enumerate(names)}
    path = tmp_path / "names.safetensors"
    save_safetensors(path, tensors, {"k\x00": "v\n"}, alignment=8)
    expected = {"__metadata__": {"k\x00": "v\n"}}
    for offset, name in enumerate(sorted(names)):
        expected[name] = {"dtype": "U16", "shape": [1], "data_offsets": [2 * offset, 2 * offset + 2]}
    _, header, _ = split(path)
    assert header.rstrip(b" ") == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    got, _, _ = load(path)
    assert {name: int(a[0]) for name, a in got.items()} == {name: i for i, name in enumerate(names)}


class _ItemsMapping(Mapping):
    """A read-only mapping that is not a dict, whose items() the writer walks as given."""

    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, key):
        return dict(self._items)[key]

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)

    def items(self):
        return iter(self._items)


def test_any_mapping_gives_the_bytes_a_dict_gives(tmp_path):
    from types import MappingProxyType

    tensors = {"b": np.arange(3, dtype=np.int16), "a": np.ones((2, 2), np.float32), "é": [1.5, 2.5]}
    save_safetensors(tmp_path / "dict.safetensors", tensors)
    expected = (tmp_path / "dict.safetensors").read_bytes()
    for mapping in (MappingProxyType(tensors), _ItemsMapping(tensors.items())):
        save_safetensors(tmp_path / "other.safetensors", mapping, overwrite=True)
        assert (tmp_path / "other.safetensors").read_bytes() == expected


def test_a_mapping_that_repeats_a_name_is_refused_before_writing(tmp_path):
    repeating = _ItemsMapping([("w", np.zeros(2, np.float32)), ("v", np.ones(1, np.int8)), ("w", np.ones(2, np.int16))])
    with pytest.raises(ValueError, match="tensor name 'w' appears twice"):
        save_safetensors(tmp_path / "r.safetensors", repeating)
    assert list(tmp_path.iterdir()) == []


def test_array_likes_that_share_a_buffer_are_each_saved(tmp_path):
    shared = np.zeros(256, np.int32)
    tensors = {"a": np.full(8, 7, np.int32), **{f"t{i}": RefilledBuffer(shared, i) for i in range(3)},
               "z": np.full(8, 9, np.int32)}
    save_safetensors(tmp_path / "r.safetensors", tensors)
    loaded = st_numpy.load_file(str(tmp_path / "r.safetensors"))
    assert {k: v.tolist() for k, v in loaded.items()} == {
        "a": [7] * 8, "t0": [0] * 256, "t1": [1] * 256, "t2": [2] * 256, "z": [9] * 8}


def test_an_array_changed_by_a_later_conversion_is_saved_as_it_was_before(tmp_path):
    # Converting "c" changes "b" in place; "b" comes first in the file and must hold what it held
    # when its turn came, as a writer that writes each tensor as it goes would have it.
    b = np.zeros(4, np.int32)

    class Bumps:
        def __array__(self, dtype=None, copy=None):
            b[:] += 1  # caller code between tensors
            return np.full(4, 5, np.int32)

    save_safetensors(tmp_path / "c.safetensors", {"b": b, "c": Bumps()})
    loaded = st_numpy.load_file(str(tmp_path / "c.safetensors"))
    assert loaded["b"].tolist() == [1] * 4  # bumped once when planned, not again while being written
    assert loaded["c"].tolist() == [5] * 4 and b.tolist() == [2] * 4
