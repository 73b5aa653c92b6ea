"""safetensors' packed sub-byte types (F4, F6_E2M3, F6_E3M2): read and written exactly as safetensors does.

A tensor of n elements of b bits is stored in n * b / 8 bytes (whole bytes, or the file is refused), with the
logical shape in the header. safetensors' own serialisation is the reference for every byte here.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors

import fastckpt
from fastckpt import FormatError
from fastckpt.arrays import PackedArray, PackedTypeError, pack_float4, packed_array, to_numpy
from fastckpt.formats.safetensors import load_bytes, save_bytes, save_safetensors

F4_BYTES = bytes([0x21, 0x43, 0xF5, 0x00, 0x77, 0x10])  # F4 [2, 6], the first element of a byte in its low nibble
F4_VALUES = [[0.5, 1.0, 1.5, 2.0, 3.0, -6.0], [0.0, 0.0, 6.0, 6.0, 0.0, 0.5]]
F6A_BYTES = bytes([1, 2, 3])  # F6_E2M3 [4]
F6B_BYTES = bytes(range(6))  # F6_E3M2 [2, 4]


def _spec(dtype: str, shape: list[int], data: bytes, keep: list):
    buffer = np.frombuffer(bytearray(data or b"\0"), np.uint8)
    keep.append(buffer)
    return safetensors.TensorSpec(dtype=dtype, shape=shape, data_ptr=buffer.ctypes.data, data_len=len(data))


def _reference() -> bytes:
    """F4 (from PyTorch's float4_e2m1fn_x2 storage shape [2, 3]: [2, 6] in the header) beside plain types, by
    safetensors' own writer."""
    keep: list = []
    return safetensors.serialize({
        "q": _spec("float4_e2m1fn_x2", [2, 3], F4_BYTES, keep),
        "e": _spec("float8_e8m0fnu", [3], bytes([127, 128, 1]), keep),
        "w": _spec("float32", [2], np.array([1.5, -2], np.float32).tobytes(), keep),
        "z": _spec("float4_e2m1fn_x2", [0, 3], b"", keep),
    })


def hand_built(entries: list[tuple[str, str, list[int], bytes]]) -> bytes:
    """A file laid out as the reference writer lays it out (tensors in the given order, compact JSON, the header
    padded with spaces to 8 bytes); its Python API writes no F6, so F6 files are built here."""
    header, offset = {}, 0
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(data for *_, data in entries)


F6_FILE = [("t", "F6_E3M2", [2, 4], F6B_BYTES), ("s", "F6_E2M3", [4], F6A_BYTES),
           ("odd", "F4", [2, 3], F4_BYTES[:3])]


@pytest.fixture
def reference_file(tmp_path):
    path = tmp_path / "packed.safetensors"
    path.write_bytes(_reference())
    return path


def _header(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n])


def _file(tmp_path, entries: dict, data: bytes):
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "hand.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_packed_tensors_read_as_their_stored_bytes_with_the_logical_shape(reference_file):
    with fastckpt.open(reference_file) as f:
        info = f.info("q")
        assert (info.packed, info.bits, info.shape, info.nbytes, info.zero_copy) == ("F4", 4, (2, 6), 6, False)
        assert info.dtype == np.dtype(ml_dtypes.float4_e2m1fn)
        hosts = f.hosts()
        q = f.host("q")
        assert type(q) is PackedArray and type(hosts["q"]) is PackedArray
        assert (q.packed, q.logical_shape, q.dtype, q.shape, q.tobytes()) == ("F4", (2, 6), np.uint8, (6,), F4_BYTES)
        assert q.unpack().dtype == np.dtype(ml_dtypes.float4_e2m1fn)
        assert q.unpack().astype(np.float32).tolist() == F4_VALUES
        assert hosts["z"].nbytes == 0 and hosts["z"].logical_shape == (0, 6)
        # The plain tensors of the same file are untouched by their packed neighbours.
        assert hosts["w"].tolist() == [1.5, -2.0]
        assert hosts["e"].dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
        assert hosts["e"].view(np.uint8).tolist() == [127, 128, 1]
    # The bytes API parses the same way.
    assert load_bytes(_reference())["q"].tobytes() == F4_BYTES


def test_f6_and_odd_f4_read_as_the_reference_reader_reads_them(tmp_path):
    blob = hand_built(F6_FILE)
    reference = dict(safetensors.deserialize(blob))
    path = tmp_path / "f6.safetensors"
    path.write_bytes(blob)
    with fastckpt.open(path) as f:
        assert [i.name for i in f.infos.values()] == ["t", "s", "odd"]
        for name, dtype, shape, data in F6_FILE:
            info, host = f.info(name), f.host(name)
            assert (info.packed, list(info.shape), info.nbytes) == (dtype, shape, len(data))
            assert (host.packed, list(host.logical_shape), host.tobytes()) == (dtype, shape, data)
            assert (reference[name]["dtype"], reference[name]["shape"], bytes(reference[name]["data"])) == (
                dtype, shape, data)
        assert f.info("s").dtype == np.dtype(ml_dtypes.float6_e2m3fn)
        assert f.info("t").dtype == np.dtype(ml_dtypes.float6_e3m2fn)
        assert f.host("odd").unpack().astype(np.float32).tolist() == [F4_VALUES[0][:3], F4_VALUES[0][3:]]
        with pytest.raises(PackedTypeError, match="6-bit elements"):
            f.host("s").unpack()
        # Written back: the bytes the reference writer lays out.
        assert save_bytes(f.hosts(), alignment=8) == blob


def test_writer_is_byte_for_byte_safetensors(reference_file):
    with fastckpt.open(reference_file) as f:
        assert save_bytes(f.hosts(), alignment=8) == _reference()
    # Built by hand: ml_dtypes' float4 (one element a byte) is packed two a byte; packed_array takes stored bytes.
    tensors = {"q": np.array(F4_VALUES, ml_dtypes.float4_e2m1fn),
               "e": np.array([127, 128, 1], np.uint8).view(ml_dtypes.float8_e8m0fnu),
               "w": np.array([1.5, -2], np.float32), "z": packed_array(b"", "F4", (0, 6))}
    assert save_bytes(tensors, alignment=8) == _reference()
    assert save_bytes({"z": np.zeros((0, 6), ml_dtypes.float4_e2m1fn)}, alignment=8) == save_bytes(
        {"z": packed_array(b"", "F4", [0, 6])}, alignment=8)
    with pytest.raises(TypeError, match="does not say how 6-bit elements share bytes"):
        save_bytes({"s": np.zeros(4, ml_dtypes.float6_e2m3fn)})
    with pytest.raises(ValueError, match="tensor 'q3'.*whole number of bytes"):
        save_bytes({"q3": np.zeros(3, ml_dtypes.float4_e2m1fn)})


def test_save_and_reopen_file(tmp_path, reference_file):
    out = tmp_path / "again.safetensors"
    with fastckpt.open(reference_file) as f:
        save_safetensors(out, f.hosts(), alignment=8, fsync=False)
    assert out.read_bytes() == reference_file.read_bytes()
    assert bytes(dict(safetensors.deserialize(out.read_bytes()))["q"]["data"]) == F4_BYTES


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_large_packed_tensor_of_a_cold_file_reads_as_its_bytes(tmp_path, backend):
    # Large tensors of a file not in the page cache are read straight into new arrays (pread's host(), load_tree):
    # a packed one must come back as its stored bytes too, never reshaped to its element count.
    from fastckpt.formats.reader import COPY_READ_MIN, copies

    data = np.random.default_rng(0).integers(0, 256, COPY_READ_MIN * 2, dtype=np.uint8)
    path = tmp_path / "big.safetensors"
    save_safetensors(path, {"q": packed_array(data, "F4", (2, COPY_READ_MIN * 2)), "w": np.ones(3, np.float32)},
                     fsync=False)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the cold read paths
    os.close(fd)
    with fastckpt.open(path, backend=backend) as f:
        q = f.host("q")
        assert (type(q), q.packed, q.logical_shape) == (PackedArray, "F4", (2, COPY_READ_MIN * 2))
        assert np.array_equal(q.bytes_view(), data)
        copied = copies(f)
        assert copied["q"].packed == "F4" and np.array_equal(copied["q"].bytes_view(), data)


def test_float4_pack_unpack_every_code():
    codes = np.arange(16, dtype=np.uint8)
    elements = codes.view(ml_dtypes.float4_e2m1fn)
    packed = pack_float4(elements)
    assert packed.tobytes() == bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    assert packed.unpack().view(np.uint8).tolist() == codes.tolist()
    with pytest.raises(ValueError, match="whole number of bytes"):
        pack_float4(elements[:3])


@pytest.mark.parametrize("dtype_name, shape, nbytes, message", [
    ("F4", [3], 2, "not a whole number of bytes"),
    ("F4", [5], 3, "not a whole number of bytes"),
    ("F6_E2M3", [3], 3, "not a whole number of bytes"),
    ("F6_E3M2", [5], 4, "not a whole number of bytes"),
    ("F4", [4], 3, "needs 2 bytes"),
    ("F6_E2M3", [4], 4, "needs 3 bytes"),
    ("F4", [2**62, 2], 1, "overflows"),
])
def test_packed_sizes_are_checked_as_safetensors_checks_them(tmp_path, dtype_name, shape, nbytes, message):
    path = _file(tmp_path, {"x": {"dtype": dtype_name, "shape": shape, "data_offsets": [0, nbytes]}}, bytes(nbytes))
    with pytest.raises(FormatError, match=message) as e:
        fastckpt.open(path)
    assert str(path) in str(e.value) and "'x'" in str(e.value)
    with pytest.raises(Exception):  # the reference reader refuses the same files
        safetensors.deserialize(path.read_bytes())


def test_paths_that_cannot_hold_packed_bytes_name_the_tensor(tmp_path, reference_file):
    with fastckpt.open(reference_file) as f:
        hosts = f.hosts()
    with pytest.raises(PackedTypeError, match=r"tensor 'q' is packed F4 .* an NPZ file") as e:
        fastckpt.save_npz(tmp_path / "x.npz", {"q": hosts["q"]})
    assert "to_numpy(t, packed=True).unpack().astype(np.float32)" in str(e.value)
    assert not (tmp_path / "x.npz").exists()
    with pytest.raises(PackedTypeError, match=r"tensor 's' is packed F6_E2M3 .*bytes_view"):
        to_numpy(packed_array(F6A_BYTES, "F6_E2M3", (4,)), name="s")
    # A slice is plain bytes, not a packed tensor: nothing claims it is F4.
    assert type(hosts["q"][:1]) is PackedArray and hosts["q"][:1].packed is None
    np.save(tmp_path / "plain.npy", hosts["w"])
    with pytest.raises(TypeError, match="not pickled"):
        import pickle

        pickle.dumps(hosts["q"])


def test_convert_to_npz_refuses_naming_file_and_tensor(tmp_path, reference_file):
    from fastckpt.errors import DestinationError
    from fastckpt.formats.convert import convert

    with pytest.raises(DestinationError, match=r"'q': packed F4 .*only safetensors holds.*'z'") as e:
        convert(reference_file, tmp_path / "out.npz")
    assert str(reference_file) in str(e.value) and "skip_unsupported=True" in str(e.value)
    assert not (tmp_path / "out.npz").exists()
    report = convert(reference_file, tmp_path / "out.npz", skip_unsupported=True)
    assert sorted(report["skipped"]) == ["q", "z"]
    with fastckpt.open(tmp_path / "out.npz") as f:
        assert sorted(f) == ["e", "w"]
    # To safetensors, packed tensors travel as they are.
    convert(reference_file, tmp_path / "out.safetensors")
    with fastckpt.open(tmp_path / "out.safetensors") as f:
        assert f.host("q").tobytes() == F4_BYTES and f.info("q").shape == (2, 6)


def test_pool_refuses_naming_file_and_tensor_and_loads_the_rest(reference_file, pool):
    with pytest.raises(PackedTypeError, match=r"tensor 'q' is packed F4 .*OpenCL pool") as e:
        fastckpt.load_file(reference_file, pool=pool)
    assert str(reference_file) in str(e.value) and "names=[...]" in str(e.value)
    loaded = fastckpt.load_file(reference_file, pool=pool, names=["w", "e"])
    assert loaded["w"].to_host().tolist() == [1.5, -2.0]
    with pytest.raises(PackedTypeError, match=r"tensor 'q' is packed F4"):
        fastckpt.load_file(reference_file, pool=pool, names=["w", "q"])


# -- PyTorch ---------------------------------------------------------------------------------------------------


def test_torch_float4_state_dict_saves_as_safetensors_does(tmp_path):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    from safetensors.torch import save as st_save

    q = torch.tensor([[0x21, 0x43, 0xF5], [0, 0x77, 0x10]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    state = {"q": q, "w": torch.tensor([1.5, -2.0])}
    assert save_bytes(state, alignment=8) == st_save(state)
    path = tmp_path / "t.safetensors"
    save_safetensors(path, state, fsync=False)
    assert _header(path.read_bytes())["q"]["shape"] == [2, 6]

    # Back to torch: to_torch, load_torch; both give float4_e2m1fn_x2 of the storage shape, same bytes.
    with fastckpt.open(path) as f:
        back = fastckpt.to_torch(f.hosts())
        assert back["q"].dtype == torch.float4_e2m1fn_x2 and tuple(back["q"].shape) == (2, 3)
        assert back["q"].view(torch.uint8).tolist() == q.view(torch.uint8).tolist()
        assert fastckpt.to_torch(f.host("q"), copy=False).view(torch.uint8).tolist() == q.view(torch.uint8).tolist()
    loaded = fastckpt.load_torch(path)
    assert loaded["q"].dtype == torch.float4_e2m1fn_x2
    assert loaded["q"].view(torch.uint8).tolist() == q.view(torch.uint8).tolist()
    assert loaded["w"].tolist() == [1.5, -2.0]


def test_torch_float4_errors_name_the_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    q = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(PackedTypeError, match=r"tensor 'layer.q' is packed F4 .*an NPZ file"):
        fastckpt.save_npz(tmp_path / "t.npz", {"w": torch.ones(2), "layer.q": q})
    # F4 with an odd last dimension has no float4_e2m1fn_x2 form: named, with the way out.
    path = tmp_path / "odd.safetensors"
    path.write_bytes(hand_built([("odd", "F4", [2, 3], F4_BYTES[:3])]))
    with fastckpt.open(path) as f, pytest.raises(PackedTypeError, match=r"tensor 'odd' is F4 of shape \[2, 3\]"):
        fastckpt.to_torch(f.hosts())
    # F6 has no torch type.
    with pytest.raises(PackedTypeError, match="packed F6_E2M3"):
        fastckpt.to_torch({"s": packed_array(F6A_BYTES, "F6_E2M3", (4,))})
