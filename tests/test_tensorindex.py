"""The columnar tensor index (fastckpt._native.tensorindex), the safetensors fast path, and TensorFile.hosts."""

import json
import struct
import warnings
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_numpy
from fastckpt._native.mapped import MappedFile
from fastckpt._native.safetensors import (
    _read_index_checking,
    _read_table_fast_only,
    read_safetensors_index,
    read_safetensors_table,
)
from fastckpt._native.tensorindex import TensorIndex

import fastckpt
from fastckpt import FormatError, TensorInfo
from fastckpt.errors import TensorNotFoundError


def _tensors():
    return {
        "z.bias": np.arange(3, dtype=np.float32),
        "a.weight": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": np.array(2.5, np.float64),
        "empty": np.zeros((0, 4), np.uint8),
        "bf": np.arange(4).astype(ml_dtypes.bfloat16),
        "ünï": np.array([True, False]),
    }


def _raw_file(path, header: dict, data: bytes, separators=(",", ":"), indent=None) -> None:
    raw = json.dumps(header, separators=separators, indent=indent, ensure_ascii=False).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture
def st_file(tmp_path):
    p = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(p, _tensors(), metadata={"step": "3", "ü": "x"}, fsync=False)
    return p


# -- the fast path takes the headers writers produce, and gives what the checking parser gives ---------------------


def _agree_and_fast(path) -> None:
    with MappedFile(path) as m:
        checking = _read_index_checking(m)
        fast = _read_table_fast_only(m)
        assert fast is not None, "the fast path left a common header to the checking parser"
        assert (fast[0].info_list(), fast[1], fast[2]) == checking
        assert read_safetensors_index(m) == checking


def test_fast_path_reads_fastckpt_files(st_file):
    _agree_and_fast(st_file)


def test_fast_path_reads_reference_writer_files(tmp_path):
    p = tmp_path / "ref.safetensors"
    st_numpy.save_file({"x": np.arange(4, dtype=np.float64), "y": np.arange(3, dtype=np.uint8),
                        "e": np.zeros((2, 0), np.int32)}, p, metadata={"format": "np"})
    _agree_and_fast(p)


@pytest.mark.parametrize("indent", [None, 2, "\t"])
def test_fast_path_reads_any_json_whitespace_and_key_order(tmp_path, indent):
    p = tmp_path / "ws.safetensors"
    header = {"b": {"shape": [2], "data_offsets": [4, 6], "dtype": "U8"},
              "__metadata__": {},
              "a": {"data_offsets": [0, 4], "dtype": "F32", "shape": []}}
    _raw_file(p, header, bytes(range(6)), separators=(" , ", " : "), indent=indent)
    _agree_and_fast(p)
    with fastckpt.open(p) as f:
        assert list(f) == ["a", "b"]  # data order, not header order
        assert f.metadata == {}
        assert f.host("b").tolist() == [4, 5]
        assert f.info("a").offset == p.stat().st_size - 6


def test_ties_of_empty_tensors_sort_by_name_as_the_checking_parser_does(tmp_path):
    p = tmp_path / "ties.safetensors"
    header = {"c": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
              "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
              "é": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]},
              "d": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]}}
    _raw_file(p, header, b"\x07")
    _agree_and_fast(p)
    with fastckpt.open(p) as f:
        assert list(f) == ["a", "c", "b", "d", "é"]


@pytest.mark.parametrize("header_text, data", [
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
     b"12"),
    ('{"a":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}}', b"1"),
    ('{"__metadata__":null,"__metadata__":{}}', b""),
    ('{"a":{"dtype":"U8","shape":[01],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}} }', b"1"),
    ('{"\\u0061":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"12"),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"12"),
    ('{"a":{"dtype":"U8","shape":[1000000000000000000],"data_offsets":[0,1]}}', b"1"),
    ('{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}', b""),
])
def test_headers_the_fast_path_leaves_raise_the_checking_parsers_error(tmp_path, header_text, data):
    p = tmp_path / "odd.safetensors"
    raw = header_text.encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    with MappedFile(p) as m:
        assert _read_table_fast_only(m) is None
        try:
            expected = ("parsed", _read_index_checking(m))
        except FormatError as e:
            expected = ("refused", str(e))
        for reader in (read_safetensors_index, read_safetensors_table):
            try:
                got = ("parsed", reader(m))
            except FormatError as e:
                got = ("refused", str(e))
            if reader is read_safetensors_table and got[0] == "parsed":
                got = ("parsed", (got[1][0].info_list(), *got[1][1:]))
            assert got == expected


def test_a_valid_header_the_fast_path_leaves_still_opens(tmp_path):
    p = tmp_path / "escaped.safetensors"
    raw = b'{"\\u0061\\n":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x09")
    with fastckpt.open(p) as f:
        assert list(f) == ["a\n"] and f.host("a\n").tolist() == [9] and f.hosts() == {"a\n": f.host("a\n")}


# -- the index is the mapping name -> TensorInfo it replaces -------------------------------------------------------


def test_infos_is_a_read_only_mapping_of_equal_infos(st_file):
    with fastckpt.open(st_file) as f:
        infos = f.infos
        assert isinstance(infos, Mapping) and isinstance(infos, TensorIndex)
        with MappedFile(st_file) as m:
            listed = read_safetensors_index(m)[0]
        assert list(infos) == [i.name for i in listed] == list(f.keys())
        assert list(infos.values()) == listed
        assert dict(infos.items()) == {i.name: i for i in listed} == infos
        assert infos["a.weight"] is infos["a.weight"] is f.info("a.weight")  # made once
        assert infos.get("nope") is None and infos.get("nope", 1) == 1
        assert "scalar" in infos and "nope" not in infos and len(infos) == 6
        assert f.nbytes == sum(i.nbytes for i in listed)
        with pytest.raises(TypeError):
            infos["x"] = listed[0]
        with pytest.raises(TensorNotFoundError, match="no tensor named 'a.wieght'.*did you mean 'a.weight'"):
            f.info("a.wieght")
        with pytest.raises(TensorNotFoundError):
            f.info(["unhashable"])
        with pytest.raises(KeyError):
            infos["nope"]


def test_data_region_is_the_span_of_every_payload(st_file):
    with fastckpt.open(st_file) as f:
        start = min(i.offset for i in f.infos.values())
        assert f.data_region == (start, st_file.stat().st_size)


def test_from_infos_keeps_the_infos_it_is_given(tmp_path):
    p = tmp_path / "raw.bin"
    p.write_bytes(np.arange(8, dtype="<u2").tobytes())
    given = [TensorInfo("f", np.dtype("<u2"), (2, 2), 0, 8, fortran_order=True),
             TensorInfo("packed", np.dtype("u1"), (3,), 8, 2, compression="deflate")]
    with MappedFile(p) as m:
        index = TensorIndex.from_infos(m, given)
        assert index["f"] is given[0] and index["packed"] is given[1]
        assert index.view("f").tolist() == [[0, 2], [1, 3]] and index.view("f").flags.f_contiguous
        assert index.view("packed") is None  # compressed: the caller decodes it
        assert index.data_region() == (0, 8) and index.total_nbytes() == 10
        with pytest.raises(ValueError, match="tensor 'f' is listed twice"):
            TensorIndex.from_infos(m, [given[0], given[0]])
    with pytest.raises(TypeError, match="made by the parsers"):
        TensorIndex()


# -- views -----------------------------------------------------------------------------------------------------------


def test_host_views_are_the_views_the_general_path_makes(st_file):
    expected = _tensors()
    with fastckpt.open(st_file) as f:
        views = {k: f.host(k) for k in f}
        for name, arr in views.items():
            general = f.mapped.array(f.info(name).offset, f.info(name).dtype, f.info(name).shape)
            assert arr.dtype == general.dtype == expected[name].dtype and arr.shape == expected[name].shape
            assert arr.tobytes() == expected[name].tobytes()
            assert not arr.flags.writeable and arr.flags.c_contiguous and arr.flags.aligned
            assert arr.__array_interface__["data"][0] == general.__array_interface__["data"][0]
    assert views["a.weight"].tolist() == [[0, 1, 2], [3, 4, 5]]  # valid after close


def test_hosts_makes_every_view_in_file_order(st_file):
    with fastckpt.open(st_file) as f:
        every = f.hosts()
        assert list(every) == list(f)
        for name, arr in every.items():
            assert arr.tobytes() == f.host(name).tobytes() and arr.shape == f.info(name).shape
        some = f.hosts(["scalar", "a.weight"])
        assert list(some) == ["scalar", "a.weight"] and some["scalar"].item() == 2.5
        with pytest.raises(TensorNotFoundError, match="no tensor named 'nope'"):
            f.hosts(["scalar", "nope"])
        with pytest.raises(TypeError, match=r"pass \['scalar'\]"):
            f.hosts("scalar")


@pytest.mark.parametrize("backend, copy_on_write", [("pread", False), ("mmap", True)])
def test_hosts_for_copies_and_private_writable_views(st_file, backend, copy_on_write):
    with fastckpt.open(st_file, backend=backend, copy_on_write=copy_on_write) as f:
        every = f.hosts()
        assert {k: v.tobytes() for k, v in every.items()} == {k: v.tobytes() for k, v in _tensors().items()}
        if copy_on_write:
            assert all(v.flags.writeable for v in every.values())
            every["z.bias"][0] = 9
            assert f.host("z.bias")[0] == 9  # one private mapping
    with fastckpt.open(st_file) as f:
        assert f.host("z.bias")[0] == 0  # the file never changes


def test_host_after_close_raises_as_before(st_file):
    f = fastckpt.open(st_file)
    f.close()
    with pytest.raises(ValueError, match="the mapped file is closed"):
        f.host("z.bias")
    with pytest.raises(ValueError, match="the mapped file is closed"):
        f.hosts()


def test_more_dimensions_than_numpy_allows_raise_from_host_as_before(tmp_path):
    p = tmp_path / "deep.safetensors"
    _raw_file(p, {"deep": {"dtype": "U8", "shape": [1] * 40, "data_offsets": [0, 1]}}, b"\x01")
    with fastckpt.open(p) as f:
        assert f.info("deep").shape == (1,) * 40
        with pytest.raises(FormatError, match="40 dimensions; numpy allows at most 32"):
            f.host("deep")
        with pytest.raises(FormatError, match="40 dimensions"):
            f.hosts()


def test_npz_hosts_decode_compressed_members(tmp_path):
    p = tmp_path / "mixed.npz"
    with open(p, "wb") as out:
        np.savez_compressed(out, packed=np.arange(5, dtype=np.int32), other=np.ones((2, 2), np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f = fastckpt.open(p)
    with f:
        every = f.hosts()
        assert every["packed"].tolist() == [0, 1, 2, 3, 4] and every["other"].tolist() == [[1, 1], [1, 1]]
        assert f.data_region == (0, 0)


def test_every_reader_has_hosts(tmp_path):
    from fastckpt.tf import write_checkpoint

    prefix = str(tmp_path / "ckpt-1")
    write_checkpoint(prefix, {"b": np.arange(3, dtype=np.int32), "a/kernel": np.eye(2, dtype=np.float32)})
    with fastckpt.open(prefix) as r:
        every = r.hosts()
        assert list(every) == list(r.keys())
        assert every["b"].tolist() == [0, 1, 2] and every["a/kernel"].tolist() == [[1, 0], [0, 1]]
        assert list(r.hosts(["b"])) == ["b"]
        with pytest.raises(TensorNotFoundError):
            r.hosts(["nope"])
        with pytest.raises(TypeError, match="single name"):
            r.hosts("b")


def test_npz_table_is_in_payload_order_with_every_info_field(tmp_path):
    import zipfile

    from fastckpt._native.npz import read_npz_index, read_npz_table

    p = tmp_path / "reordered.npz"
    arrays = {"first": np.arange(6, dtype=">i4").reshape(2, 3), "second": np.asfortranarray(np.eye(2, 3)),
              "third": np.zeros((0, 5), np.uint8)}
    with zipfile.ZipFile(p, "w") as z:
        for name, arr in arrays.items():
            with z.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, arr)
        z.filelist.reverse()  # the central directory lists the members last to first
    with MappedFile(p) as m:
        listed = read_npz_index(m)
        table = read_npz_table(m)
    assert [i.name for i in listed] == ["third", "second", "first"]  # central-directory order, as before
    assert list(table) == ["first", "second", "third"]  # payload order
    assert table.info_list() == sorted(listed, key=lambda i: i.offset)
    assert table["second"].fortran_order and table["first"].dtype == np.dtype(">i4")
    assert [table[n].header_nbytes for n in table] == [i.header_nbytes for i in sorted(listed, key=lambda i: i.offset)]
    assert table["first"].crc32 == zipfile.ZipFile(p).getinfo("first.npy").CRC
    with fastckpt.open(p) as f:
        every = f.hosts()
        for name, arr in arrays.items():
            assert every[name].dtype == arr.dtype and every[name].shape == arr.shape
            assert np.array_equal(every[name], arr) and every[name].flags.f_contiguous == arr.flags.f_contiguous
