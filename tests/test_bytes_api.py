"""save_bytes / load_bytes: exactly the file writers' bytes, read back by the file readers' parsers."""

from __future__ import annotations

import io
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

import fastckpt
from fastckpt.errors import FormatError
from fastckpt.formats import filebytes, npz, safetensors


def _corpus(fmt: str) -> dict:
    tensors = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f64_scalar": np.array(2.5),
        "i8": np.array([-3, 0, 7], np.int8),
        "u16_big_endian": np.array([1, 258], ">u2"),
        "empty": np.zeros((0, 3), np.int64),
        "bool": np.array([[True, False]]),
        "strided": np.arange(20, dtype=np.int32)[::3],
        "c64": np.array([1 + 2j], np.complex64),
    }
    if fmt == "safetensors":
        tensors["bf16"] = np.array([1.5, -2], ml_dtypes.bfloat16)
    else:
        tensors["fortran"] = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
        tensors["text"] = np.array(["ab", "cde"])
    return tensors


def _file_bytes(tmp_path, fmt: str, tensors, **options) -> bytes:
    path = tmp_path / f"t.{fmt}"
    if fmt == "safetensors":
        fastckpt.save_safetensors(path, tensors, **options)
    else:
        fastckpt.save_npz(path, tensors, **options)
    return path.read_bytes()


SAVE_BYTES = {"safetensors": safetensors.save_bytes, "npz": npz.save_bytes}
LOAD_BYTES = {"safetensors": safetensors.load_bytes, "npz": npz.load_bytes}


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
@pytest.mark.parametrize("alignment", [None, 64])
def test_save_bytes_is_byte_for_byte_the_file(tmp_path, fmt, alignment):
    options = {} if alignment is None else {"alignment": alignment}
    tensors = _corpus(fmt)
    expected = _file_bytes(tmp_path, fmt, tensors, **options)
    assert SAVE_BYTES[fmt](tensors, **options) == expected
    assert fastckpt.save_bytes(tensors, format=fmt, **options) == expected


def test_safetensors_save_bytes_with_metadata_is_the_file(tmp_path):
    tensors, metadata = {"w": np.ones((2, 2), np.float16)}, {"step": "10", "é": "ü"}
    fastckpt.save_safetensors(tmp_path / "m.safetensors", tensors, metadata)
    expected = (tmp_path / "m.safetensors").read_bytes()
    assert safetensors.save_bytes(tensors, metadata) == expected
    assert fastckpt.save_bytes(tensors, metadata) == expected
    with fastckpt.open(tmp_path / "m.safetensors") as f:
        assert f.metadata == metadata


def test_safetensors_save_bytes_matches_the_spec_example():
    # The 66 bytes of the example in fastckpt.formats.safetensors' docstring.
    expected = (b"\x38" + bytes(7) + b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}' + b"   " + b"\x01\x02")
    assert safetensors.save_bytes({"a": np.array([1, 2], np.uint8)}, alignment=64) == expected


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_load_bytes_gives_the_arrays_back_exactly(fmt):
    tensors = _corpus(fmt)
    data = SAVE_BYTES[fmt](tensors)
    for loaded in (LOAD_BYTES[fmt](data), fastckpt.load_bytes(data)):
        assert sorted(loaded) == sorted(tensors)
        for name, original in tensors.items():
            got = loaded[name]
            # safetensors stores little-endian (big-endian input is converted); NPZ keeps the byte order.
            expected_dtype = original.dtype.newbyteorder("<") if fmt == "safetensors" else original.dtype
            assert got.dtype == expected_dtype, name
            assert got.shape == original.shape, name
            np.testing.assert_array_equal(got, original)
            assert got.flags.writeable, name


def test_safetensors_load_bytes_keeps_data_order():
    data = safetensors.save_bytes({"b": np.zeros(1, np.uint8), "a": np.zeros(1, np.float64),
                                   "c": np.zeros(1, np.uint8)})
    assert list(safetensors.load_bytes(data)) == ["a", "b", "c"]  # rank descending (F64 before U8), then name


def test_npz_load_bytes_keeps_archive_order():
    data = npz.save_bytes([("z", np.zeros(1)), ("a", np.ones(1))])
    assert list(npz.load_bytes(data)) == ["z", "a"]


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_loaded_arrays_are_independent_of_the_bytes(fmt):
    original = SAVE_BYTES[fmt]({"w": np.arange(4, dtype=np.int32)})
    data = bytearray(original)
    loaded = fastckpt.load_bytes(data)
    loaded["w"][0] = 99  # writing the array leaves the caller's bytes alone
    assert data == original
    data[:] = bytes(len(data))  # and the caller may reuse its buffer
    assert loaded["w"].tolist() == [99, 1, 2, 3]


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "uint8 array", "memoryview slice"])
def test_load_bytes_takes_any_contiguous_buffer(kind):
    data = safetensors.save_bytes({"w": np.array([7, 8], np.int64)})
    source = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data),
              "uint8 array": np.frombuffer(data, np.uint8), "memoryview slice": memoryview(b"xx" + data)[2:]}[kind]
    assert fastckpt.load_bytes(source)["w"].tolist() == [7, 8]


def test_npz_bytes_read_by_numpy_and_numpy_bytes_read_by_fastckpt():
    data = npz.save_bytes({"w": np.arange(3, dtype=np.float32)})
    with np.load(io.BytesIO(data)) as z:
        assert z["w"].tolist() == [0.0, 1.0, 2.0]
    for save in (np.savez, np.savez_compressed):
        buffer = io.BytesIO()
        save(buffer, a=np.arange(5, dtype=np.uint16), b=np.eye(2))
        loaded = fastckpt.load_bytes(buffer.getvalue())
        assert list(loaded) == ["a", "b"]
        assert loaded["a"].dtype == np.uint16 and loaded["a"].tolist() == [0, 1, 2, 3, 4]
        assert loaded["b"].tolist() == [[1.0, 0.0], [0.0, 1.0]]


# -- bad bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("data, message", [
    (b"", "<bytes>: not safetensors or NPZ bytes: the 0 bytes at offset 0 are b''"),
    (b"hello", "<bytes>: not safetensors or NPZ bytes: the 5 bytes at offset 0 are b'hello'"),
])
def test_unknown_bytes_are_a_format_error_at_offset_0(data, message):
    with pytest.raises(FormatError) as e:
        fastckpt.load_bytes(data)
    assert str(e.value).startswith(message)


def test_truncated_safetensors_bytes_name_the_offset():
    data = safetensors.save_bytes({"w": np.ones(4, np.float32)})[:100]
    with pytest.raises(FormatError, match=r"^<bytes>: header length at byte 0 says 4088 bytes of JSON, but only "
                                          r"92 bytes follow it \(file size 100; file seems truncated\?\)$"):
        safetensors.load_bytes(data)


def test_safetensors_bytes_with_a_short_data_section_name_the_tensor():
    data = safetensors.save_bytes({"w": np.ones(4, np.float32)}, alignment=64)
    with pytest.raises(FormatError, match=r"^<bytes>: tensor 'w': data_offsets \[0, 16\] reach absolute byte 80, past "
                                          r"the end of the file \(79 bytes; the data section has 15\)"):
        fastckpt.load_bytes(data[:-1])


def test_npz_bytes_with_a_bad_central_directory_name_the_offset():
    data = bytearray(npz.save_bytes({"w": np.ones(2)}, alignment=64))
    at = data.rindex(b"PK\x01\x02")
    data[at + 3] = 0x09
    with pytest.raises(FormatError, match=rf"^<bytes>: bad central directory signature at offset {at} \(entry 0\): "
                                          r"expected PK\\x01\\x02, got b'PK\\x01\\t'$"):
        npz.load_bytes(bytes(data))


def test_npz_bytes_with_a_damaged_deflate_member_fail_naming_the_member():
    buffer = io.BytesIO()
    np.savez_compressed(buffer, a=np.arange(1000))
    data = bytearray(buffer.getvalue())
    start = 30 + len("a.npy") + int.from_bytes(data[28:30], "little")
    data[start + 20:start + 40] = bytes(20)
    with pytest.raises(FormatError, match=r"^<bytes>: member 'a\.npy' \(local header at offset 0\): corrupt DEFLATE "
                                          r"stream \(Error -3 "):
        fastckpt.load_bytes(bytes(data))


@pytest.mark.parametrize("fmt, other", [("safetensors", "npz"), ("npz", "safetensors")])
def test_each_format_module_refuses_the_other_and_names_the_reader(fmt, other):
    data = SAVE_BYTES[other]({"w": np.ones(1)})
    with pytest.raises(FormatError, match=rf"^<bytes>: these are {other} bytes, not {fmt} \(offset 0\); read them "
                                          rf"with fastckpt\.formats\.{other}\.load_bytes or fastckpt\.load_bytes"):
        LOAD_BYTES[fmt](data)


def test_save_bytes_options_are_checked():
    with pytest.raises(ValueError, match="^NPZ archives have no metadata"):
        fastckpt.save_bytes({"w": np.ones(1)}, {"k": "v"}, format="npz")
    with pytest.raises(ValueError, match=r"^format must be one of 'safetensors', 'npz', got 'tf'$"):
        fastckpt.save_bytes({"w": np.ones(1)}, format="tf")
    with pytest.raises(TypeError, match=r"^tensor 'o': dtype object has no safetensors equivalent"):
        fastckpt.save_bytes({"o": np.array([None])})


def test_from_buffer_refuses_a_non_contiguous_buffer():
    with pytest.raises(BufferError):
        fastckpt.MappedFile.from_buffer(memoryview(b"abcdef")[::2])


def test_from_buffer_copies_to_a_page_aligned_private_block():
    source = bytearray(b"hello world")
    m = fastckpt.MappedFile.from_buffer(source, path="<mine>")
    source[:5] = b"HELLO"
    assert (bytes(m.view(0, 5)), m.address % 4096, m.path, m.size) == (b"hello", 0, "<mine>", 11)


def test_crc_of_npz_bytes_is_right():
    data = npz.save_bytes({"w": np.arange(3, dtype=np.int8)}, alignment=64)
    crc = int.from_bytes(data[14:18], "little")
    start = 30 + int.from_bytes(data[26:28], "little") + int.from_bytes(data[28:30], "little")
    member = data[start:start + int.from_bytes(data[18:22], "little")]
    assert crc == zlib.crc32(member)


# -- the scratch file -----------------------------------------------------------------------------


def test_the_scratch_file_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(filebytes, "_MEMORY_DIR", str(tmp_path))
    safetensors.save_bytes({"w": np.ones(3)})
    npz.save_bytes({"w": np.ones(3)})
    with pytest.raises(TypeError):
        safetensors.save_bytes({"w": np.array(["text"])})
    assert os.listdir(tmp_path) == []


def test_without_a_memory_filesystem_the_temporary_directory_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(filebytes, "_MEMORY_DIR", str(tmp_path / "absent"))
    monkeypatch.setattr(filebytes.tempfile, "tempdir", str(tmp_path))
    seen = []

    def write(path):
        seen.append(os.path.dirname(os.path.dirname(path)))
        with open(path, "wb") as f:
            f.write(b"xyz")

    assert filebytes.written_bytes(write, {}) == b"xyz"
    assert seen == [str(tmp_path)]
    assert os.listdir(tmp_path) == []
