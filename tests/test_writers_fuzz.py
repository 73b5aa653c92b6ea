"""The writers' compiled record and header builders, driven by hypothesis: whatever they are given,
the file is what the format says, byte for byte where that is defined."""

import io
import json
import zipfile

import numpy as np
import pytest
import safetensors.numpy as st_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastckpt.formats.npz as npz
from fastckpt import open as open_tensors
from fastckpt.formats.npz import save_npz
from fastckpt.formats.safetensors import save_safetensors

# The default run keeps a short fuzz; the *_long tests (-m slow) run the same properties on many more inputs.
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LONG = settings(SETTINGS, max_examples=1500)

# Names: any text a ZIP member or JSON key can hold, including characters that need escaping.
_name_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/\\")
_names = st.text(_name_chars, min_size=1, max_size=12).filter(lambda n: n not in (".", "..") and n[1:2] != ":")
_dtypes = st.sampled_from(["<f4", "<f2", "<i8", "|b1", "<c8", "|u1", ">f8", ">i2", "<M8[s]", "<U2", "|S3"])
_shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@st.composite
def _arrays(draw, dtypes=_dtypes):
    dtype = np.dtype(draw(dtypes))
    shape = draw(_shapes)
    arr = np.zeros(shape, dtype)
    if arr.nbytes:
        raw = draw(st.binary(min_size=arr.nbytes, max_size=arr.nbytes))
        arr = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape).copy()
    layout = draw(st.sampled_from(["c", "f", "strided"]))
    if layout == "f":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim and arr.shape[0] > 1:
        arr = arr[::2]
    return arr


_NPZ_CASES = given(tensors=st.dictionaries(_names, _arrays(), max_size=6),
                   alignment=st.sampled_from([1, 8, 64, 4096, 32768]), zip64=st.booleans())


@SETTINGS
@_NPZ_CASES
def test_npz_writer_output_is_a_valid_zip_numpy_reads(tmp_path, tensors, alignment, zip64):
    path = tmp_path / "f.npz"
    limits = npz._ZIP64_LIMIT, npz._ZIP_FILECOUNT_LIMIT
    if zip64:  # every zip64 structure, in a small file
        npz._ZIP64_LIMIT = npz._ZIP_FILECOUNT_LIMIT = 0
    try:
        save_npz(path, tensors, alignment=alignment, overwrite=True)
    finally:
        npz._ZIP64_LIMIT, npz._ZIP_FILECOUNT_LIMIT = limits
    data = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None  # every member's CRC-32 and size
        assert z.namelist() == [name + ".npy" for name in tensors]
    # np.load recognizes an archive by its first bytes; an empty one forced into zip64 starts with the
    # zip64 end record, which it does not know (a real empty archive never needs zip64).
    if tensors or not zip64:
        with np.load(path, allow_pickle=False) as z:
            for name, arr in tensors.items():
                got = z[name]
                assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes()
    with open_tensors(path) as f:
        for name, arr in tensors.items():
            assert f.info(name).offset % alignment == 0
            assert f.host(name).tobytes() == arr.tobytes()


_st_dtypes = st.sampled_from(["<f4", "<f2", "<i8", "|b1", "<c8", "|u1", ">f8", ">i2", "<u4", "|i1"])


_SAFETENSORS_CASES = given(
    tensors=st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
                            .filter(lambda n: n != "__metadata__"), _arrays(_st_dtypes), max_size=6),
    metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    alignment=st.sampled_from([8, 64, 4096]))


@SETTINGS
@_SAFETENSORS_CASES
def test_safetensors_header_is_json_dumps_and_the_reference_reads_the_data(tmp_path, tensors, metadata, alignment):
    path = tmp_path / "f.safetensors"
    save_safetensors(path, tensors, metadata, alignment=alignment, overwrite=True)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    order = sorted(tensors, key=lambda k: (-_rank(tensors[k].dtype), k))
    expected, offset = {}, 0
    if metadata is not None:
        expected["__metadata__"] = dict(sorted(metadata.items()))
    for name in order:
        nbytes = tensors[name].nbytes
        expected[name] = {"dtype": _DTYPE_NAMES[tensors[name].dtype.newbyteorder("<").str],
                          "shape": list(tensors[name].shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    assert data[8:8 + n].rstrip(b" ") == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()
    assert (8 + n) % alignment == 0 and len(data) == 8 + n + offset
    loaded = st_numpy.load(data)
    for name, arr in tensors.items():
        assert loaded[name].shape == arr.shape
        assert loaded[name].tobytes() == arr.astype(arr.dtype.newbyteorder("<")).tobytes()


_DTYPE_NAMES = {"<f4": "F32", "<f2": "F16", "<i8": "I64", "|b1": "BOOL", "<c8": "C64", "|u1": "U8", "<f8": "F64",
                "<i2": "I16", "<u4": "U32", "|i1": "I8"}


def _rank(dtype):
    from fastckpt._native.safetensors import DTYPE_RANK

    return DTYPE_RANK[_DTYPE_NAMES[dtype.newbyteorder("<").str]]


@pytest.mark.parametrize("name", ["a\x00b", "../up", "/abs", "c:drive", "back\\slash"])
def test_npz_writer_refuses_names_readers_refuse(tmp_path, name):
    with pytest.raises(ValueError, match="readers refuse such ZIP member names"):
        save_npz(tmp_path / "f.npz", {name: np.zeros(1)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@LONG
@_NPZ_CASES
def test_npz_writer_output_is_a_valid_zip_numpy_reads_long(tmp_path, tensors, alignment, zip64):
    test_npz_writer_output_is_a_valid_zip_numpy_reads.hypothesis.inner_test(tmp_path, tensors, alignment, zip64)


@pytest.mark.slow
@LONG
@_SAFETENSORS_CASES
def test_safetensors_header_is_json_dumps_and_the_reference_reads_the_data_long(tmp_path, tensors, metadata,
                                                                                  alignment):
    test_safetensors_header_is_json_dumps_and_the_reference_reads_the_data.hypothesis.inner_test(
        tmp_path, tensors, metadata, alignment)
