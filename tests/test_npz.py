"""NPZ: the aligned streaming writer, the Cython index parser, member reads, and what they refuse."""

import errno
import io
import os
import struct
import subprocess
import sys
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _writing import RefilledBuffer, file_size_limit
from fastckpt.store.commit import _owner
from fastckpt._native.mapped import MappedFile

import fastckpt.formats.npz as npz
from fastckpt import FormatError, IntegrityError, NotZeroCopyWarning
from fastckpt import open as fastckpt_open
from fastckpt.formats.npz import (
    NpzWriter,
    npy_header,
    parse_npy_header,
    read_member,
    read_npz_index,
    save_npz,
    verify_member,
)

BACKENDS = ["mmap", "pread"]
RNG_SEED = 1234


def random_array(dtype, shape, seed=RNG_SEED):
    """Arbitrary bit patterns (NaN payloads, subnormals, ...) so that equality means bit-exact."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape))
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool).reshape(shape)
    if dtype.kind == "U":
        chars = [chr(c) for c in rng.integers(0x20, 0x3000, count * dtype.itemsize // 4)]
        flat = ["".join(chars[i:i + rng.integers(0, dtype.itemsize // 4 + 1)]) for i in range(count)]
        return np.array(flat, dtype=dtype).reshape(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape) if count else np.zeros(shape, dtype)


def same(a, b):
    """Bit-exact equality of value, dtype and shape."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes(order="A") == b.tobytes(order="A") and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def same_fields(a, b):
    """Bit-exact equality of every field: np.load copies structured arrays field by field, so padding
    bytes between fields are not carried over (fastckpt's own reader keeps them: see ``same``)."""
    if a.dtype.names is None:
        return same(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and all(same_fields(a[n], b[n]) for n in a.dtype.names)


def read_all(path, backend="mmap", **kw):
    with MappedFile(path, backend=backend) as m:
        infos = read_npz_index(m, **kw)
        return {i.name: read_member(m, i) for i in infos}, infos


DTYPES = [
    "|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
    ">i2", ">i4", ">i8", ">u4", ">f2", ">f4", ">f8", ">c8", ">c16",
    "<U1", "<U7", ">U3", "|S1", "|S5", "|V4", "<M8[ns]", "<m8[s]", ">M8[D]",
    [("a", "<f4"), ("b", ">i2", (2,))],
    {"names": ["x", "y"], "formats": ["<u1", "<f8"], "offsets": [0, 8], "itemsize": 24},
    [("outer", [("inner", "<i4"), ("s", "|S3")]), ("u", "<U2", (2, 2))],
]
SHAPES = [(), (0,), (3, 0), (5,), (2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_npy_dtype_and_shape(tmp_path, dtype, shape):
    arr = random_array(dtype, shape)
    path = tmp_path / "a.npz"
    save_npz(path, {"x": arr})
    got, [info] = read_all(path)
    assert same(got["x"], arr)
    assert info.dtype == arr.dtype and info.shape == arr.shape and info.nbytes == arr.nbytes
    with np.load(path, allow_pickle=False) as z:
        assert same_fields(z["x"], arr)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<c16", "<U5", "|b1"])
def test_fortran_order_is_kept(tmp_path, dtype, backend):
    arr = np.asfortranarray(random_array(dtype, (7, 5, 3)))
    path = tmp_path / "f.npz"
    save_npz(path, {"f": arr})
    got, [info] = read_all(path, backend)
    assert info.fortran_order and got["f"].flags.f_contiguous
    assert same(got["f"], arr)
    with np.load(path) as z:
        assert same(z["f"], arr) and z["f"].flags.f_contiguous


def test_non_contiguous_arrays_are_written_in_c_order(tmp_path):
    base = random_array("<i8", (20, 30))
    arrs = {"strided": base[::3, ::2], "transposed_view": base[:, ::2].T, "negative": base[::-1]}
    path = tmp_path / "n.npz"
    save_npz(path, arrs)
    got, infos = read_all(path)
    assert not any(i.fortran_order for i in infos)
    for k, v in arrs.items():
        assert same(got[k], v), k


def test_large_ish_arrays_round_trip_through_both_readers(tmp_path):
    arrs = {f"t{i}": random_array(dt, (513, 1031), seed=i) for i, dt in enumerate(["<f4", ">f8", "<c8", "<u2"])}
    path = tmp_path / "big.npz"
    save_npz(path, arrs, alignment=4096)
    for backend in BACKENDS:
        got, infos = read_all(path, backend)
        assert all(same(got[k], v) for k, v in arrs.items())
    with np.load(path) as z:
        assert all(same(z[k], v) for k, v in arrs.items())


def test_scalar_array_likes_and_lists_are_accepted(tmp_path):
    path = tmp_path / "s.npz"
    save_npz(path, [("i", 7), ("f", 2.5), ("l", [[1, 2], [3, 4]]), ("s", "netcl"), ("b", b"raw")])
    got, _ = read_all(path)
    for k, v in {"i": 7, "f": 2.5, "l": [[1, 2], [3, 4]], "s": "netcl", "b": b"raw"}.items():
        assert same(got[k], np.asarray(v)), k


def test_netcl_meta_is_a_zero_d_unicode_array(tmp_path):
    meta = np.array('{"type": "Sequential", "config": [], "version": 2, "format": "netcl.single-file"}')
    path = tmp_path / "m.netcl"
    save_npz(path, {"0:weight": np.ones((2, 2), np.float32), "__netcl_meta__": meta})
    got, infos = read_all(path)
    assert got["__netcl_meta__"].shape == () and got["__netcl_meta__"].dtype == meta.dtype
    assert got["__netcl_meta__"].item() == meta.item()


def test_members_are_byte_identical_to_np_save(tmp_path):
    arrs = {"a": random_array("<f4", (3, 4)), "b": np.asfortranarray(random_array(">i8", (4, 6))),
            "c": random_array([("a", "<f4"), ("b", ">i2", (2,))], (3,)), "d": np.array("é"), "e": np.zeros((0, 7))}
    path = tmp_path / "m.npz"
    save_npz(path, arrs)
    with zipfile.ZipFile(path) as zf:
        for name, arr in arrs.items():
            buf = io.BytesIO()
            np.save(buf, arr)
            assert zf.read(name + ".npy") == buf.getvalue(), name


@pytest.mark.parametrize("arr", [
    np.zeros((2, 3), "<f4"), np.asfortranarray(np.zeros((2, 3), ">f8")), np.zeros((), "<U5"),
    np.zeros((10**12, 0), "|u1"), np.zeros((4,), [("x", "<f4"), ("y", "<i8", (3,))]),
    np.zeros(3, np.dtype([("a", "u1"), ("b", "<f4")], align=True)),
], ids=["f4", "fortran", "0d-unicode", "wide-empty", "structured", "aligned-struct"])
def test_npy_header_matches_numpy_write_array_header_1_0(arr):
    expected = io.BytesIO()
    np.lib.format.write_array_header_1_0(expected, np.lib.format.header_data_from_array_1_0(arr))
    assert npy_header(arr.dtype, arr.shape, not arr.flags.c_contiguous) == expected.getvalue()
    assert parse_npy_header(expected.getvalue())[:3] == (arr.dtype, arr.shape, not arr.flags.c_contiguous)


def test_long_and_non_latin1_headers_use_versions_2_and_3_like_numpy():
    long_dt = np.dtype([(f"field_{i:05d}", "<f4") for i in range(3000)])
    uni_dt = np.dtype([("größe", "<f4"), ("名前", "<i2")])
    for dt, version in ((long_dt, 2), (uni_dt, 3)):
        arr = np.zeros(2, dt)
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # numpy announces formats 2.0 and 3.0
            np.save(buf, arr)
        header = npy_header(dt, (2,), False)
        assert buf.getvalue()[:len(header)] == header and header[6] == version
        got = parse_npy_header(header, max_header_size=200_000)
        assert got[:3] == (dt, (2,), False) and got[3] == len(header)


@pytest.mark.parametrize("alignment", [64, 4096])
def test_every_payload_is_aligned(tmp_path, alignment):
    arrs = {f"t{i}": random_array(dt, shape, seed=i) for i, (dt, shape) in enumerate(
        [("<f4", (3,)), ("|u1", (7,)), ("<f8", ()), ("<c16", (5, 3)), ("|S3", (0,)), ("<U9", (2,)), ("<f2", (1000,))])}
    path = tmp_path / "a.npz"
    save_npz(path, arrs, alignment=alignment)
    got, infos = read_all(path)
    assert [i.name for i in infos] == list(arrs)
    assert all(i.offset % alignment == 0 for i in infos), [i.offset for i in infos]
    with np.load(path) as z:
        assert all(same(z[k], v) for k, v in arrs.items())
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC checks out


# The "auto" policy: payloads of 64 KiB or more at multiples of 4096, smaller ones at multiples of 64.
AUTO_SIZES = {"empty": 0, "one": 1, "kib": 1024, "below": 65535, "at": 65536, "mib": 1 << 20, "tail": 100}


def _auto_arrays():
    return {k: random_array("|u1", (n,), seed=i) for i, (k, n) in enumerate(AUTO_SIZES.items())}


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_alignment_pads_to_a_page_only_from_64_kib(tmp_path, backend):
    arrs = _auto_arrays()
    path = tmp_path / "auto.npz"
    save_npz(path, arrs)  # the default is "auto"
    got, infos = read_all(path, backend)
    offsets = {i.name: i.offset for i in infos}
    for name, n in AUTO_SIZES.items():
        boundary = 4096 if n >= 65536 else 64
        assert offsets[name] % boundary == 0, (name, offsets[name])
    # Each small payload sits right after the previous member: less than 64 bytes of padding, not a page.
    assert offsets["one"] - offsets["empty"] == 192 and offsets["kib"] - offsets["one"] == 192
    assert offsets["below"] - offsets["kib"] == 1024 + 192 and offsets["at"] % 4096 == 0
    data = path.read_bytes()
    for info in infos:  # the zipalign field names the member's own alignment
        field = data.rfind(b"\x35\xd9", 0, info.offset - 128)
        assert struct.unpack_from("<H", data, field + 4)[0] == (4096 if AUTO_SIZES[info.name] >= 65536 else 64)
    assert all(same(got[k], v) for k, v in arrs.items())
    assert all(not got[k].flags.owndata for k in arrs if arrs[k].size)  # viewed in place, not copied
    with np.load(path) as z:
        assert all(same(z[k], v) for k, v in arrs.items())
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None


def test_auto_is_the_default_and_4096_gives_the_earlier_layout(tmp_path):
    arrs = _auto_arrays()
    save_npz(tmp_path / "default.npz", arrs)
    save_npz(tmp_path / "auto.npz", arrs, alignment="auto")
    save_npz(tmp_path / "page.npz", arrs, alignment=4096)
    assert (tmp_path / "default.npz").read_bytes() == (tmp_path / "auto.npz").read_bytes()
    _, page = read_all(tmp_path / "page.npz")
    assert all(i.offset % 4096 == 0 for i in page)
    # Only large payloads: "auto" writes exactly the page-aligned layout.
    large = {k: v for k, v in arrs.items() if v.nbytes >= 65536}
    save_npz(tmp_path / "large-auto.npz", large)
    save_npz(tmp_path / "large-page.npz", large, alignment=4096)
    assert (tmp_path / "large-auto.npz").read_bytes() == (tmp_path / "large-page.npz").read_bytes()


def test_auto_keeps_many_small_tensors_lean(tmp_path):
    arrs = {f"t{i:04d}": np.full(256, i, np.float32) for i in range(1000)}  # 1000 x 1 KiB
    save_npz(tmp_path / "auto.npz", arrs, fsync=False)
    save_npz(tmp_path / "page.npz", arrs, alignment=4096, fsync=False)
    # Per member: local header 30 + "t0000.npy" 9 + zipalign field 6 + 19 bytes of padding + .npy header 128
    # + 1024 of payload = 1216; then the central directory (46 + 9 per member) and the 22-byte end record.
    assert os.path.getsize(tmp_path / "auto.npz") == 1000 * (1216 + 55) + 22
    assert os.path.getsize(tmp_path / "page.npz") == 1000 * 4096 + 1024 + 1000 * 55 + 22
    got, infos = read_all(tmp_path / "auto.npz")
    assert [i.offset for i in infos[:3]] == [192, 1408, 2624] and all(same(got[k], v) for k, v in arrs.items())


def test_alignment_1_writes_no_padding_field(tmp_path):
    path = tmp_path / "a.npz"
    save_npz(path, {"x": np.arange(3, dtype=np.int8)}, alignment=1)
    data = path.read_bytes()
    assert struct.unpack_from("<H", data, 28)[0] == 0  # local extra length
    assert len(data) == 30 + 5 + 131 + 46 + 5 + 22


@pytest.mark.parametrize("alignment", [0, 3, 96, 65536, 2**15 + 1, "64"])
def test_bad_alignment_is_refused(tmp_path, alignment):
    with pytest.raises(ValueError, match="alignment must be 'auto' or a power of two from 1 to 32768, got"):
        save_npz(tmp_path / "a.npz", {}, alignment=alignment)


def test_alignment_field_is_zipalign_style(tmp_path):
    path = tmp_path / "a.npz"
    save_npz(path, {"x": np.arange(3, dtype=np.int8)}, alignment=4096)
    data = path.read_bytes()
    nlen, elen = struct.unpack_from("<HH", data, 26)
    extra = data[30 + nlen:30 + nlen + elen]
    ident, size, align = struct.unpack_from("<HHH", extra)
    assert (ident, size, align) == (0xD935, elen - 4, 4096) and extra[6:] == bytes(elen - 6)
    assert (30 + nlen + elen + 128) % 4096 == 0


def test_empty_archive(tmp_path):
    path = tmp_path / "e.npz"
    save_npz(path, {})
    assert path.read_bytes() == b"PK\x05\x06" + bytes(18)
    assert read_all(path) == ({}, [])
    with np.load(path) as z:
        assert z.files == []


def test_two_saves_of_equal_input_give_identical_bytes(tmp_path):
    arrs = {"a": random_array("<f4", (30, 7)), "b": np.asfortranarray(random_array("<i2", (3, 9))), "m": np.array("x")}
    save_npz(tmp_path / "1.npz", arrs)
    save_npz(tmp_path / "2.npz", dict(arrs))
    save_npz(tmp_path / "3.npz", ((k, v.copy(order="K")) for k, v in arrs.items()))
    assert (tmp_path / "1.npz").read_bytes() == (tmp_path / "2.npz").read_bytes() == (tmp_path / "3.npz").read_bytes()


def test_writer_returns_where_each_payload_landed(tmp_path):
    path = tmp_path / "w.npz"
    with NpzWriter(path, alignment=64) as w:
        i1 = w.add("a", np.arange(5, dtype=np.int32))
        i2 = w.add("b/c", np.ones((2, 2)))
    _, infos = read_all(path)
    assert infos == [i1, i2]


def test_non_ascii_names_are_utf8_flagged(tmp_path):
    path = tmp_path / "u.npz"
    save_npz(path, {"größe": np.arange(2), "名": np.arange(3)})
    got, _ = read_all(path)
    assert sorted(got) == sorted(["größe", "名"])
    with zipfile.ZipFile(path) as zf:
        assert [i.flag_bits & 0x800 for i in zf.infolist()] == [0x800, 0x800]
    with np.load(path) as z:
        assert same(z["名"], np.arange(3))


# -- dtypes and names that the writer refuses ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "int4", "uint4"])
def test_ml_dtypes_are_stored_under_their_name_and_read_back_as_themselves(tmp_path, dtype):
    arr = np.arange(-3, 4, dtype=np.float32).astype(getattr(ml_dtypes, dtype))
    save_npz(tmp_path / "b.npz", {"w": arr})
    with zipfile.ZipFile(tmp_path / "b.npz") as z:
        header = z.read("w.npy")[:128]
    assert f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': (7,), }}".encode() in header
    got, _ = read_all(tmp_path / "b.npz")
    assert got["w"].dtype == arr.dtype and got["w"].tobytes() == arr.tobytes()
    # a fresh process: fastckpt's reader imports ml_dtypes itself; np.load reads it once ml_dtypes is imported
    code = (f"import fastckpt, numpy as np\nwith fastckpt.open({str(tmp_path / 'b.npz')!r}) as f: "
            f"print(f.host('w').dtype)\nwith np.load({str(tmp_path / 'b.npz')!r}) as z: print(z['w'].dtype)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.split() == [dtype, dtype], done.stderr


def test_bfloat16_round_trips_as_its_uint16_bits(tmp_path):
    arr = np.arange(-3, 4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    save_npz(tmp_path / "b.npz", {"w": arr.view(np.uint16)})
    got, _ = read_all(tmp_path / "b.npz")
    assert same(got["w"].view(ml_dtypes.bfloat16), arr)


@pytest.mark.parametrize("arr", [np.array([1, "a", None], dtype=object),
                                 np.zeros(2, [("a", "<f4"), ("o", "O")]),
                                 np.array(["x", "y"], dtype=np.dtypes.StringDType())],
                         ids=["object", "struct-with-object", "StringDType"])
def test_object_arrays_are_refused(tmp_path, arr):
    with pytest.raises(ValueError, match="Python objects.*never|never pickles"):
        save_npz(tmp_path / "o.npz", {"o": arr})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,problem", [
    ("../x", r"'\.\.' path component"), ("a/../../x", r"'\.\.'"), ("/abs", "absolute"), ("C:x", "absolute"),
    ("a\\b", "backslash"), ("a\x00b", "NUL"), ("é/../x", r"'\.\.'"), ("é:x", "absolute"), ("x/..\\", "backslash"),
])
def test_bad_names_are_refused(tmp_path, name, problem):
    with pytest.raises(ValueError, match=problem):
        save_npz(tmp_path / "n.npz", {name: np.zeros(1)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["..", "a/..", "a..b/c", "...", "ab:c", "1:y", "é", "a/./b", ""])
def test_names_near_the_rules_are_written_and_read_back(tmp_path, name):
    save_npz(tmp_path / "n.npz", {name: np.arange(3)})
    with np.load(tmp_path / "n.npz") as z:
        assert z.files == [name] and z[name].tolist() == [0, 1, 2]


def test_a_dict_of_str_names_is_not_checked_name_by_name_but_a_later_add_is(tmp_path):
    from fastckpt._native.gather import GatherWriter
    from fastckpt._native.npz import MemberWriter

    import fastckpt.formats.npz as npz_module

    with open(tmp_path / "m.bin", "wb") as f:
        out = GatherWriter(f.fileno())
        members = MemberWriter(out, 64, npz_module._ZIP64_LIMIT, npz_module._crc32, npz_module.npy_header,
                               npz_module._large_payload, npz_module._LARGE_PAYLOAD)
        tensors = {"a": np.zeros(1), "b": np.ones(2)}
        members.add_items(tensors.items(), True, np.asarray, tensors)
        with pytest.raises(ValueError, match="'b' given twice"):
            members.add("b", np.zeros(1))
        members.add("c", np.zeros(1))
        assert members.count == 3
        out.flush()


def test_the_c_crc32_writes_the_bytes_the_python_crc32_writes(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    arrays = {f"t{i}": rng.integers(0, 255, size=int(n), dtype=np.uint8) for i, n in
              enumerate([0, 1, 3, 63, 64, 65, 1000, 4095, 70_000, *rng.integers(0, 9000, size=40)])}
    assert npz._ZNG_CRC32 != 0  # zlib-ng's C crc32 is found, so the default below takes it
    save_npz(tmp_path / "c.npz", arrays)
    monkeypatch.setattr(npz, "_ZNG_CRC32", 0)
    save_npz(tmp_path / "python.npz", arrays)
    assert (tmp_path / "c.npz").read_bytes() == (tmp_path / "python.npz").read_bytes()
    with zipfile.ZipFile(tmp_path / "c.npz") as z:
        assert z.testzip() is None


def test_consecutive_arrays_of_one_dtype_get_each_their_own_header(tmp_path):
    arrays = [np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32).T,
              np.zeros((3, 2), np.float32), np.zeros(6, np.float32), np.zeros((6, 1, 1), np.float32)]
    save_npz(tmp_path / "h.npz", {f"t{i}": a for i, a in enumerate(arrays)})
    with np.load(tmp_path / "h.npz") as z:
        assert [z[f"t{i}"].shape for i in range(len(arrays))] == [a.shape for a in arrays]
    with fastckpt_open(tmp_path / "h.npz") as f:
        assert [f.info(f"t{i}").fortran_order for i in range(len(arrays))] == [False, False, True, False, False, False]


def test_duplicate_and_non_string_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        save_npz(tmp_path / "d.npz", [("a", 1), ("a", 2)])
    with pytest.raises(TypeError, match="names must be str"):
        save_npz(tmp_path / "d.npz", {3: np.zeros(1)})
    with pytest.raises(TypeError, match=r"iterable of \(name, array\) pairs"):
        save_npz(tmp_path / "d.npz", [np.zeros(1)])
    assert list(tmp_path.iterdir()) == []


# -- streaming and atomicity --------------------------------------------------------------------

class Exploding:
    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("cannot produce this array")


def test_failure_mid_save_leaves_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.npz"
    save_npz(path, {"old": np.arange(3)})
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="cannot produce"):
        save_npz(path, {"a": np.ones(1000), "b": Exploding(), "c": np.ones(3)}, overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_failing_write_leaves_no_file_and_no_temporary(tmp_path):
    with file_size_limit(3 << 20):  # a short write, then EFBIG, from the kernel
        with pytest.raises(OSError) as info:
            save_npz(tmp_path / "model.npz", {f"t{i}": np.ones(1 << 18) for i in range(4)})
    assert info.value.errno == errno.EFBIG
    assert list(tmp_path.iterdir()) == []


def test_a_failed_add_poisons_the_writer(tmp_path):
    path = tmp_path / "w.npz"
    with pytest.raises(RuntimeError, match="an add\\(\\) failed"):
        with NpzWriter(path) as w:
            w.add("a", np.ones(3))
            with file_size_limit(4096 + 128):
                with pytest.raises(OSError) as info:
                    w.add("b", np.ones(1 << 23, np.uint8))  # large: its bytes go out within add()
            assert info.value.errno == errno.EFBIG
            with pytest.raises(RuntimeError, match="an earlier add\\(\\) failed while writing"):
                w.add("c", np.ones(3))
    assert list(tmp_path.iterdir()) == []


def test_a_refused_array_does_not_poison_the_writer(tmp_path):
    path = tmp_path / "w.npz"
    with NpzWriter(path) as w:
        w.add("a", np.ones(3))
        with pytest.raises(ValueError, match=r"tensor 'o': dtype object holds Python objects"):
            w.add("o", np.array([None]))
        w.add("b", np.zeros(2))
    got, _ = read_all(path)
    assert sorted(got) == ["a", "b"]


def test_writer_must_be_entered_and_is_single_use(tmp_path):
    w = NpzWriter(tmp_path / "w.npz")
    with pytest.raises(RuntimeError, match="inside 'with"):
        w.add("a", np.ones(1))
    with w:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        w.__enter__()


def test_stale_temporary_of_a_dead_writer_is_removed(tmp_path):
    stale = tmp_path / f".model.npz.{_owner()}.999999999.0badf00d.partial"
    stale.write_bytes(b"PK\x03\x04half a file")
    save_npz(tmp_path / "model.npz", {"a": np.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_generator_input_is_consumed_once_in_order(tmp_path):
    produced = []

    def gen():
        for i in range(3):
            produced.append(i)
            yield f"t{i}", np.full(4, i)

    save_npz(tmp_path / "g.npz", gen())
    got, infos = read_all(tmp_path / "g.npz")
    assert produced == [0, 1, 2] and [i.name for i in infos] == ["t0", "t1", "t2"]


def test_contiguous_arrays_are_streamed_without_copies(tmp_path):
    arrs = {f"t{i}": np.full(1 << 20, i, np.float32) for i in range(8)}  # 8 x 4 MiB
    tracemalloc.start()
    try:
        save_npz(tmp_path / "s.npz", arrs, fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), peak  # no tensor (4 MiB) is ever copied


def test_non_contiguous_arrays_are_copied_one_at_a_time(tmp_path):
    arrs = {f"t{i}": np.full((1 << 20, 2), i, np.float32)[:, 0] for i in range(6)}  # 6 x 4 MiB strided views
    tracemalloc.start()
    try:
        save_npz(tmp_path / "s.npz", arrs, fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (4 << 20) <= peak < (6 << 20), peak


# -- files written by numpy and zip64 ----------------------------------------------------------

NUMPY_ARRAYS = {
    "w": random_array("<f4", (17, 3)), "b": random_array(">i8", (5,)), "u": np.array("unicode ✓"),
    "f": np.asfortranarray(random_array("<f8", (4, 6))), "e": np.zeros((3, 0), "<c8"), "s": random_array("|S4", (6,)),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_np_savez_files_read_exactly(tmp_path, backend):
    path = tmp_path / "np.npz"
    np.savez(path, **NUMPY_ARRAYS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stored members: no warning
        got, infos = read_all(path, backend)
    assert all(same(got[k], v) for k, v in NUMPY_ARRAYS.items()) and len(got) == len(NUMPY_ARRAYS)
    assert all(i.compression is None for i in infos)


@pytest.mark.parametrize("backend", BACKENDS)
def test_np_savez_compressed_reads_exactly_and_warns_once(tmp_path, backend):
    path = tmp_path / "npc.npz"
    np.savez_compressed(path, **NUMPY_ARRAYS)
    with pytest.warns(NotZeroCopyWarning) as record:
        with MappedFile(path, backend=backend) as m:
            infos = read_npz_index(m)
            got = {i.name: read_member(m, i) for i in infos}
            for i in infos:
                verify_member(m, i)
    assert len(record) == 1
    assert "6 of 6 members are compressed; they will be inflated on read, not viewed in place" in str(record[0].message)
    assert record[0].filename == __file__  # points at the code that opened the file
    assert all(i.compression == "deflate" for i in infos)
    assert all(same(got[k], v) for k, v in NUMPY_ARRAYS.items())
    assert all(a.flags.writeable and a.flags.aligned for a in got.values())


def test_archive_with_a_comment_and_mixed_members(tmp_path):
    path = tmp_path / "mixed.npz"
    with zipfile.ZipFile(path, "w") as zf:
        for i, (k, v) in enumerate(NUMPY_ARRAYS.items()):
            buf = io.BytesIO()
            np.save(buf, v)
            zf.writestr(k + ".npy", buf.getvalue(), zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED)
        zf.comment = b"a comment that holds PK\x05\x06 too"
    with pytest.warns(NotZeroCopyWarning, match="3 of 6"):
        got, _ = read_all(path)
    assert all(same(got[k], v) for k, v in NUMPY_ARRAYS.items())


def test_zip64_structures_are_written_and_read(tmp_path, monkeypatch):
    # Force every zip64 path (the thresholds are what files over 2 GiB / 65535 members hit).
    monkeypatch.setattr(npz, "_ZIP64_LIMIT", 0)
    monkeypatch.setattr(npz, "_ZIP_FILECOUNT_LIMIT", 0)
    path = tmp_path / "z64.npz"
    save_npz(path, NUMPY_ARRAYS, alignment=64)
    data = path.read_bytes()
    assert data[-22 - 20 - 56:-22 - 20][:4] == b"PK\x06\x06" and data[-42:-38] == b"PK\x06\x07"
    assert struct.unpack_from("<II", data, 18) == (0xFFFFFFFF, 0xFFFFFFFF)  # local sizes live in the zip64 field
    got, infos = read_all(path)
    assert all(same(got[k], v) for k, v in NUMPY_ARRAYS.items())
    assert all(i.offset % 64 == 0 for i in infos)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert all(i.file_size == i.compress_size for i in zf.infolist())
    with np.load(path) as z:
        assert all(same(z[k], v) for k, v in NUMPY_ARRAYS.items())


def test_numpy_zip64_archive_is_read(tmp_path):
    path = tmp_path / "np64.npz"
    with zipfile.ZipFile(path, "w", allowZip64=True) as zf:
        for k, v in NUMPY_ARRAYS.items():
            with zf.open(k + ".npy", "w", force_zip64=True) as f:  # what np.savez does
                np.lib.format.write_array(f, v)
    got, _ = read_all(path)
    assert all(same(got[k], v) for k, v in NUMPY_ARRAYS.items())


# -- netcl interop (real netcl 0.4.4, when installed) -------------------------------------------

def _netcl_queue():
    netcl = pytest.importorskip("netcl")
    from netcl.core.device import manager
    try:
        return netcl, manager.default().queue
    except Exception as e:  # no OpenCL device
        pytest.skip(f"netcl has no device: {e}")


def test_netcl_reads_aligned_files_and_fastckpt_reads_netcl_files(tmp_path):
    _, queue = _netcl_queue()
    import netcl.io as nio
    from netcl.nn.layers import Linear, ReLU, Sequential

    model = Sequential(Linear(queue=queue, in_features=4, out_features=3), ReLU(),
                       Linear(queue=queue, in_features=3, out_features=2))
    theirs = tmp_path / "theirs.netcl"
    nio.save_model(model, str(theirs))
    got, infos = read_all(theirs)
    with np.load(theirs) as z:
        assert sorted(got) == sorted(z.files) and all(same(got[k], z[k]) for k in z.files)
    assert any(i.offset % 4 for i in infos)  # netcl's own payloads are unaligned; fastckpt still reads them

    weights = {k: random_array("<f4", v.shape, seed=i).astype(np.float32) for i, (k, v) in enumerate(got.items())
               if k != "__netcl_meta__"}
    weights = {k: np.clip(np.nan_to_num(v), -1e3, 1e3) for k, v in weights.items()}
    ours = tmp_path / "ours.netcl"
    save_npz(ours, {**weights, "__netcl_meta__": got["__netcl_meta__"]})
    loaded = nio.load_model(str(ours), queue=queue)
    assert same(loaded.layers[0].weight.to_host(), weights["0:weight"])
    assert same(loaded.layers[2].bias.to_host(), weights["2:bias"])


# -- parse_npy_header ---------------------------------------------------------------------------

def hdr(text: str, version=(1, 0)) -> bytes:
    body = text.encode("utf-8" if version == (3, 0) else "latin-1")
    length = struct.pack("<H" if version == (1, 0) else "<I", len(body))
    return b"\x93NUMPY" + bytes(version) + length + body


@pytest.mark.parametrize("text,expected", [
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }   \n", (np.dtype("<f4"), (2, 3), False)),
    ('{"shape": (), "descr": "|b1", "fortran_order": True}', (np.dtype("?"), (), True)),
    ("{'descr': '<i8', 'fortran_order': False, 'shape': (3L, 4L), }", (np.dtype("<i8"), (3, 4), False)),
    ("{'descr': [('a\\x41\\u00e9', '<f4'), (('t', 'n'), '>i2', (2,))], 'fortran_order': False, 'shape': (1,)}",
     (np.dtype([("aAé", "<f4"), (("t", "n"), ">i2", (2,))]), (1,), False)),
])
def test_header_literals_numpy_writes_and_old_variants(text, expected):
    assert parse_npy_header(hdr(text))[:3] == expected


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_header_versions(version):
    text = "{'descr': [('größe', '<f4')], 'fortran_order': False, 'shape': (4,), }\n"
    if version != (3, 0):
        text = text.replace("größe", "gr\\xf6\\xdfe")
    data = hdr(text, version)
    dtype, shape, fortran, n = parse_npy_header(data + b"payload")
    assert dtype == np.dtype([("größe", "<f4")]) and shape == (4,) and n == len(data)


@pytest.mark.parametrize("text,match", [
    ("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", "Python objects"),
    ("{'descr': [('a', '<f4'), ('o', '|O')], 'fortran_order': False, 'shape': (1,), }", "Python objects"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", "non-negative"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': [1], }", "tuple"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (7), }", "tuple of non-negative ints, got 7"),  # (7) is 7
    ("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }", "True or False"),
    ("{'descr': '<f4', 'fortran_order': False}", "exactly"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}", "exactly"),
    ("{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (1,)}", "duplicate key"),
    ("{'descr': __import__('os').system('true'), 'fortran_order': False, 'shape': ()}", "cannot parse"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} junk", "after the header dict"),
    ("{'descr': 'not a dtype', 'fortran_order': False, 'shape': ()}", "not a numpy dtype"),
    ("{'descr': 7, 'fortran_order': False, 'shape': ()}", "dtype string or a list"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 30 + ",)}", "longer than 20 digits"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (2**62,)}", "cannot parse"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4)}", "numpy's limit"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 40 + ")" * 40 + "}", "nested deeper"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "1, " * 65 + ")}", "more than numpy's 64"),
    ("{'descr': '<f4\\q', 'fortran_order': False, 'shape': ()}", "unsupported escape"),
    ("{'descr': '<f4", "unterminated string"),
    ("['descr', '<f4']", "not a dict"),
    ("", "unexpected end of the header"),
    ("{'descr': ", "unexpected end of the header"),
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,", "unexpected end of the header"),
])
def test_bad_header_literals_are_refused(text, match):
    with pytest.raises(FormatError, match=match):
        parse_npy_header(hdr(text), where="f.npz: member 'x.npy'")


@pytest.mark.parametrize("data,match", [
    (b"\x93NUMPX\x01\x00\x10\x00", "bad npy magic"),
    (b"\x93NUMPY\x04\x00\x10\x00", r"unsupported npy format version 4\.0"),
    (b"\x93NUMPY\x01\x01\x10\x00", r"version 1\.1"),
    (b"\x93NUMPY\x01\x00\xff\xff", r"65535 bytes, over the 10000-byte cap.*max_header_size="),
    (b"\x93NUMPY\x02\x00\xff\xff\xff\xff", r"4294967295 bytes, over the 10000-byte cap"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr'", r"expected a 26-byte npy header, got 18"),
    (b"\x93NUM", r"got 4 bytes"),
    (b"\x93NUMPY\x03\x00\x02\x00\x00\x00\xff\xfe", "not valid utf-8"),
])
def test_bad_npy_preambles_are_refused(data, match):
    with pytest.raises(FormatError, match=match):
        parse_npy_header(data)


# -- corrupted archives -------------------------------------------------------------------------

def small_npz(tmp_path, name="s.npz", **kw) -> Path:
    path = tmp_path / name
    save_npz(path, {"a": np.arange(10, dtype="<f4"), "b": np.arange(6, dtype="<i2").reshape(2, 3)}, alignment=64, **kw)
    return path


def npz_parts(data: bytes):
    """(eocd offset, cd offset, [cd entry offsets], [local header offsets]) of an archive without a comment."""
    eocd = len(data) - 22
    count, cd_size, cd_offset = struct.unpack_from("<HII", data, eocd + 10)
    entries, locals_ = [], []
    pos = cd_offset
    for _ in range(count):
        entries.append(pos)
        nlen, elen, clen = struct.unpack_from("<HHH", data, pos + 28)
        locals_.append(struct.unpack_from("<I", data, pos + 42)[0])
        pos += 46 + nlen + elen + clen
    return eocd, cd_offset, entries, locals_


def patched(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def expect_format_error(tmp_path, data: bytes, match: str):
    path = tmp_path / "bad.npz"
    path.write_bytes(data)
    for backend in BACKENDS:
        with MappedFile(path, backend=backend) as m:
            with pytest.raises(FormatError, match=match) as info:
                read_npz_index(m)
            assert str(path) in str(info.value)


def corrupt_eocd_signature(d, p):
    return patched(d, p[0], b"PK\x05\x07")


def corrupt_central_signature(d, p):
    return patched(d, p[2][1], b"PK\x01\x03")


def corrupt_local_signature(d, p):
    return patched(d, p[3][1], b"PK\x03\x05")


def corrupt_count(d, p):
    return patched(d, p[0] + 8, struct.pack("<HH", 3, 3))


def corrupt_disk_counts(d, p):
    return patched(d, p[0] + 8, struct.pack("<H", 1))


def corrupt_multidisk(d, p):
    return patched(d, p[0] + 4, struct.pack("<H", 1))


def corrupt_cd_offset(d, p):
    return patched(d, p[0] + 16, struct.pack("<I", p[1] + 1))


def corrupt_cd_offset_past_end(d, p):
    return patched(d, p[0] + 12, struct.pack("<II", 0xFFFFFFF0, 0xFFFFFFF0))


def corrupt_local_offset_past_end(d, p):
    return patched(d, p[2][1] + 42, struct.pack("<I", 0x7FFFFFFF))


def corrupt_sizes_into_cd(d, p):
    return patched(d, p[2][1] + 20, struct.pack("<II", 4000, 4000))


def corrupt_sizes_overlap(d, p):
    grown = p[3][1] - p[3][0]  # member a now claims member b's local header
    return patched(d, p[2][0] + 20, struct.pack("<II", grown, grown))


def corrupt_same_local_offset(d, p):
    return patched(d, p[2][1] + 42, struct.pack("<I", p[3][0]))


def corrupt_encrypted(d, p):
    return patched(d, p[2][0] + 8, struct.pack("<H", 1))


def corrupt_method(d, p):
    return patched(d, p[2][0] + 10, struct.pack("<H", 12))


def corrupt_local_method(d, p):
    return patched(d, p[3][0] + 8, struct.pack("<H", 8))


def corrupt_local_name(d, p):
    return patched(d, p[3][0] + 30, b"z")


def corrupt_sentinel_without_zip64(d, p):
    return patched(d, p[2][0] + 20, struct.pack("<I", 0xFFFFFFFF))


def corrupt_name_length(d, p):
    return patched(d, p[2][1] + 28, struct.pack("<H", 0xFFFF))


def corrupt_trailing_cd_bytes(d, p):
    return patched(d, p[0] + 10 - 2, struct.pack("<HH", 1, 1))


def corrupt_shape(d, p):
    return d.replace(b"'shape': (10,)", b"'shape': (11,)")


def corrupt_header_length(d, p):
    return d.replace(b"\x93NUMPY\x01\x00v\x00", b"\x93NUMPY\x01\x00\xff\xff", 1)


def corrupt_npy_magic(d, p):
    return d.replace(b"\x93NUMPY", b"\x93NUMPZ", 1)


def corrupt_npy_version(d, p):
    return d.replace(b"\x93NUMPY\x01\x00", b"\x93NUMPY\x09\x00", 1)


def corrupt_object_descr(d, p):
    return d.replace(b"'descr': '<f4'", b"'descr': '|O' ", 1)


def corrupt_header_past_member(d, p):
    return patched(d, p[2][0] + 20, struct.pack("<II", 100, 100))


CORRUPTIONS = {
    corrupt_eocd_signature: "no ZIP end-of-central-directory record",
    corrupt_central_signature: r"bad central directory signature at offset \d+ \(entry 1\)",
    corrupt_local_signature: r"member 'b\.npy' \(local header at offset \d+\): bad local header signature",
    corrupt_count: r"ends at \d+; expected it to end|need at least",
    corrupt_disk_counts: "entries on this disk",
    corrupt_multidisk: "multi-disk",
    corrupt_cd_offset: r"central directory at offset \d+ with \d+ bytes ends at",
    corrupt_cd_offset_past_end: "central directory at offset 4294967280",
    corrupt_local_offset_past_end: r"member 'b\.npy' \(local header at offset 2147483647\).*past the\s+central",
    corrupt_sizes_into_cd: r"member 'b\.npy'.*runs past the start of the central directory",
    corrupt_sizes_overlap: r"members 'a\.npy' \[0, \d+\) and 'b\.npy' \[\d+, \d+\) overlap",
    corrupt_same_local_offset: "local header names b'a.npy', central directory names b'b.npy'",
    corrupt_encrypted: r"member 'a\.npy'.*encrypted",
    corrupt_method: r"compression method 12; expected 0 \(stored\) or 8",
    corrupt_local_method: "local header says compression method 8, central directory says 0",
    corrupt_local_name: "local header names b'z.npy'",
    corrupt_sentinel_without_zip64: "no zip64 extra field",
    corrupt_name_length: "run past the central\\s+directory's end",
    corrupt_trailing_cd_bytes: r"bytes after its 1 entries|expected it to end",
    corrupt_shape: r"member 'a\.npy'.*shape \(11,\) of float32 needs 44 payload bytes, the member holds 40",
    corrupt_header_length: r"member 'a\.npy'.*65535 bytes, over the 10000-byte cap",
    corrupt_npy_magic: r"member 'a\.npy'.*bad npy magic: expected b'\\x93NUMPY', got b'\\x93NUMPZ'",
    corrupt_npy_version: r"unsupported npy format version 9\.0",
    corrupt_object_descr: "holds Python objects",
    corrupt_header_past_member: "npy header needs 128 bytes but the member holds 100",
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=lambda f: f.__name__[len("corrupt_"):])
def test_targeted_corruptions_are_format_errors(tmp_path, corrupt):
    data = small_npz(tmp_path).read_bytes()
    bad = corrupt(data, npz_parts(data))
    assert bad != data and len(bad) == len(data)
    expect_format_error(tmp_path, bad, CORRUPTIONS[corrupt])


def zip_of(tmp_path, members, compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns about duplicate names
        with zipfile.ZipFile(buf, "w", compression) as zf:
            for name, payload in members:
                info = zipfile.ZipInfo(name)  # a ZipInfo keeps names as given (no normalisation)
                info.compress_type = compression
                zf.writestr(info, payload)
    return buf.getvalue()


def npy_bytes(arr=np.arange(3)):
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("names,match", [
    (["../evil.npy"], r"member '\.\./evil\.npy'.*'\.\.' path component"),
    (["a/../../evil.npy"], "'..' path component"),
    (["/etc/evil.npy"], "absolute name"),
    (["C:/evil.npy"], "absolute name"),
    (["a\\b.npy"], "backslash"),
    (["a.npy", "a.npy"], r"member 'a\.npy' appears twice"),
    (["a.npy", "data.txt"], r"member 'data\.txt'.*does not end in '\.npy'"),
    (["dir/"], "does not end in '.npy'"),
])
def test_bad_member_names_are_refused(tmp_path, names, match):
    expect_format_error(tmp_path, zip_of(tmp_path, [(n, npy_bytes()) for n in names]), match)


def test_nul_in_member_name_is_refused(tmp_path):
    data = zip_of(tmp_path, [("aXb.npy", npy_bytes())]).replace(b"aXb.npy", b"a\x00b.npy")
    expect_format_error(tmp_path, data, "NUL")


def test_invalid_utf8_name_is_refused(tmp_path):
    data = zip_of(tmp_path, [("é.npy", npy_bytes())]).replace("é".encode(), b"\xff\xfe")
    expect_format_error(tmp_path, data, "flagged UTF-8 but is not valid UTF-8")


def test_bzip2_member_is_refused(tmp_path):
    data = zip_of(tmp_path, [("a.npy", npy_bytes())], zipfile.ZIP_BZIP2)
    expect_format_error(tmp_path, data, "compression method 12")


def test_object_array_member_is_refused(tmp_path):
    buf = io.BytesIO()
    np.save(buf, np.array([1, None], dtype=object), allow_pickle=True)
    expect_format_error(tmp_path, zip_of(tmp_path, [("o.npy", buf.getvalue())]),
                        r"member 'o\.npy'.*holds Python objects; reading it would need pickle")


def test_header_over_the_cap_is_refused_unless_allowed(tmp_path):
    dt = np.dtype([(f"field_{i:05d}", "<u1") for i in range(600)])
    arr = np.zeros(2, dt)
    path = tmp_path / "wide.npz"
    np.savez(path, w=arr)
    expect_format_error(tmp_path, path.read_bytes(), r"over the 10000-byte cap.*max_header_size=")
    got, _ = read_all(path, max_header_size=20000)
    assert same(got["w"], arr)


def test_zip64_offsets_past_the_end_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(npz, "_ZIP64_LIMIT", 0)
    monkeypatch.setattr(npz, "_ZIP_FILECOUNT_LIMIT", 0)
    data = small_npz(tmp_path).read_bytes()
    rec = len(data) - 22 - 20 - 56
    cd_offset = struct.unpack_from("<Q", data, rec + 48)[0]
    nlen, elen = struct.unpack_from("<HH", data, cd_offset + 28)
    entry2 = cd_offset + 46 + nlen + elen
    extra2 = entry2 + 46 + struct.unpack_from("<H", data, entry2 + 28)[0]
    assert struct.unpack_from("<HH", data, extra2) == (1, 24)  # sizes and local header offset
    cases = {
        "zip64 local offset": (patched(data, extra2 + 20, struct.pack("<Q", 2**63 - 5)),
                               r"local header at offset 9223372036854775803"),
        "zip64 sizes": (patched(data, extra2 + 4, struct.pack("<QQ", 2**40, 2**40)), "runs past the start"),
        "zip64 sizes differ": (patched(data, extra2 + 4, struct.pack("<Q", 7)), "compressed size .* uncompressed size 7"),
        "zip64 extra overrun": (patched(data, extra2 + 2, struct.pack("<H", 255)), "extra field 0x0001 declares 255 bytes"),
        "zip64 extra short": (patched(data, extra2 + 2, struct.pack("<H", 16)), "zip64 extra field has 16 bytes; expected 24"),
        "zip64 record offset": (patched(data, len(data) - 22 - 20 + 8, struct.pack("<Q", 2**62)),
                                "points at a zip64 end record at offset 4611686018427387904"),
        "zip64 cd offset": (patched(data, rec + 48, struct.pack("<Q", 2**64 - 1)), "central directory at offset"),
        "zip64 count": (patched(data, rec + 24, struct.pack("<QQ", 2**60, 2**60)), "entries, which need"),
        "zip64 record size": (patched(data, rec + 4, struct.pack("<Q", 2**64 - 1)), "declares 18446744073709551615"),
        "zip64 signature": (patched(data, rec, b"PK\x06\x05"), "bad zip64 end-of-central-directory signature"),
        "zip64 disks": (patched(data, len(data) - 22 - 20 + 16, struct.pack("<I", 2)), "multi-disk"),
    }
    for label, (bad, match) in cases.items():
        assert bad != data, label
        expect_format_error(tmp_path, bad, match)


def test_stored_crc_damage_is_found_by_verify_member(tmp_path):
    data = bytearray(small_npz(tmp_path).read_bytes())
    path = tmp_path / "s.npz"
    with MappedFile(path) as m:
        info = read_npz_index(m)[1]
    data[info.offset] ^= 1
    path.write_bytes(bytes(data))
    with MappedFile(path) as m:
        infos = read_npz_index(m)  # the index does not read payloads
        verify_member(m, infos[0])
        with pytest.raises(IntegrityError, match=r"member 'b\.npy'.*CRC-32 is 0x[0-9a-f]{8}, the central directory"):
            verify_member(m, infos[1])


def compressed_npz(tmp_path) -> Path:
    path = tmp_path / "c.npz"
    np.savez_compressed(path, a=np.arange(1000, dtype="<f8"))
    return path


def test_deflate_crc_mismatch_is_an_integrity_error(tmp_path):
    data = compressed_npz(tmp_path).read_bytes()
    eocd, cd, entries, _ = npz_parts(data)
    crc = struct.unpack_from("<I", data, entries[0] + 16)[0]
    path = tmp_path / "bad.npz"
    path.write_bytes(patched(data, entries[0] + 16, struct.pack("<I", crc ^ 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        with MappedFile(path) as m:
            [info] = read_npz_index(m)
            with pytest.raises(IntegrityError, match="CRC-32 of the inflated member"):
                read_member(m, info)


@pytest.mark.parametrize("damage,match", [
    ("flip", "corrupt DEFLATE stream|inflates to|CRC|without its final block"),
    ("usize", "inflates to 8128 bytes; its header and shape declare 8136|DEFLATE"),
])
def test_deflate_stream_damage_is_reported(tmp_path, damage, match):
    data = compressed_npz(tmp_path).read_bytes()
    eocd, cd, entries, locals_ = npz_parts(data)
    if damage == "flip":
        start = locals_[0] + 30 + 5 + 20 + 10
        data = data[:start] + bytes(b ^ 0x5A for b in data[start:start + 40]) + data[start + 40:]
    path = tmp_path / "bad.npz"
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        with MappedFile(path) as m:
            try:
                [info] = read_npz_index(m)
            except FormatError:
                return  # damage already visible in the header: also fine
            if damage == "usize":
                import dataclasses
                info = dataclasses.replace(info, shape=(1001,), member_nbytes=info.member_nbytes + 8)
            with pytest.raises((FormatError, IntegrityError), match=match):
                read_member(m, info)


def test_declared_size_beyond_deflate_ratio_is_refused_before_allocating(tmp_path):
    import dataclasses

    path = compressed_npz(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        with MappedFile(path) as m:
            [info] = read_npz_index(m)
            huge = dataclasses.replace(info, shape=(2**40,))
            with pytest.raises(FormatError, match="cannot inflate to"):
                read_member(m, huge)


@pytest.mark.parametrize("kind", ["fastckpt", "np.savez", "np.savez_compressed"])
def test_every_truncation_is_a_format_error(tmp_path, kind):
    arrs = {"a": np.arange(5, dtype="<i2"), "m": np.array("meta")}
    path = tmp_path / "full.npz"
    if kind == "fastckpt":
        save_npz(path, arrs, alignment=1)
    elif kind == "np.savez":
        np.savez(path, **arrs)
    else:
        np.savez_compressed(path, **arrs)
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    wrong = []
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        for backend in BACKENDS:
            try:
                with MappedFile(cut, backend=backend) as m:
                    read_npz_index(m)
                wrong.append((n, backend, "parsed"))
            except FormatError:
                pass
            except Exception as e:  # anything else is a bug
                wrong.append((n, backend, repr(e)))
    assert wrong == []


def test_docs_page_is_the_module_docstring():
    doc = Path(__file__).parent.parent / "docs" / "formats" / "npz.md"
    text = doc.read_text()
    assert npz.__doc__.strip() in text


def raw_zip(members) -> bytes:
    """A minimal ZIP of (name, method, data, uncompressed size, crc) members, exactly as given."""
    out, central = b"", b""
    for name, method, data, usize, crc in members:
        raw = name.encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(data), usize,
                               len(raw), 0, 0, 0, 0, 0, len(out)) + raw
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), usize, len(raw), 0)
        out += raw + data
    return out + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central),
                                       len(out), 0)


def test_deflate_stream_that_ends_inside_the_npy_header_with_bytes_after_it(tmp_path):
    # Found by the fuzzer: a stream that ends early, followed by more bytes, once made the header read loop.
    member = npy_bytes(np.arange(30))
    c = zlib.compressobj(wbits=-15)
    stream = c.compress(member[:49]) + c.flush() + b"\x00" * 70000
    data = raw_zip([("a.npy", 8, stream, len(member), zlib.crc32(member))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        expect_format_error(tmp_path, data, r"member 'a\.npy'.*expected a 128-byte npy header, got 49 bytes")


def test_raw_zip_helper_builds_readable_archives(tmp_path):
    member = npy_bytes(np.arange(30))
    stored = raw_zip([("a.npy", 0, member, len(member), zlib.crc32(member))])
    (tmp_path / "ok.npz").write_bytes(stored)
    got, _ = read_all(tmp_path / "ok.npz")
    assert same(got["a"], np.arange(30))


def test_saving_over_a_mapped_file_leaves_its_views_intact(tmp_path):
    path = tmp_path / "m.npz"
    save_npz(path, {"w": np.arange(1000, dtype=np.int64)})
    with MappedFile(path) as m:
        [info] = read_npz_index(m)
        view = read_member(m, info)
        save_npz(path, {"w": np.zeros(1000, dtype=np.int64)}, overwrite=True)  # a new inode replaces the old name
        assert same(view, np.arange(1000, dtype=np.int64))
    got, _ = read_all(path)
    assert same(got["w"], np.zeros(1000, dtype=np.int64))


@pytest.mark.slow
def test_real_zip64_member_over_2_gib(tmp_path):
    size = (1 << 31) + 4096 * 3 + 5  # past zipfile's ZIP64_LIMIT, not a multiple of anything convenient
    src = tmp_path / "src.bin"
    with open(src, "wb") as f:  # sparse: the source costs no memory or disk
        f.truncate(size)
    big = np.memmap(src, dtype=np.uint8, mode="r", shape=(size,))
    path = tmp_path / "big.npz"
    save_npz(path, {"small": np.arange(3), "big": big, "after": np.arange(4)}, fsync=False)
    with zipfile.ZipFile(path) as zf:
        assert [(i.filename, i.file_size) for i in zf.infolist()] == [
            ("small.npy", 128 + 24), ("big.npy", 128 + size), ("after.npy", 128 + 32)]
        assert np.array_equal(np.load(io.BytesIO(zf.read("after.npy"))), np.arange(4))
    with MappedFile(path) as m:
        infos = read_npz_index(m)
        assert [(i.name, i.nbytes) for i in infos] == [("small", 24), ("big", size), ("after", 32)]
        assert infos[1].offset % 4096 == 0 and all(i.offset % 64 == 0 for i in infos)  # "auto": small ones at 64
        for info in infos:
            verify_member(m, info)
        assert same(read_member(m, infos[2]), np.arange(4))


@pytest.mark.slow
def test_real_zip64_entry_count(tmp_path):
    n = 0xFFFF + 2
    path = tmp_path / "many.npz"
    save_npz(path, ((f"t{i}", np.int32(i)) for i in range(n)), alignment=1, fsync=False)
    data = path.read_bytes()
    assert data[-42:-38] == b"PK\x06\x07" and struct.unpack_from("<HH", data, len(data) - 22 + 8) == (0xFFFF, 0xFFFF)
    with zipfile.ZipFile(path) as zf:
        assert len(zf.infolist()) == n
    with MappedFile(path) as m:
        infos = read_npz_index(m)
        assert len(infos) == n and same(read_member(m, infos[-1]), np.int32(n - 1))


def test_compression_warning_through_fastckpt_open_points_at_the_caller(tmp_path):
    import fastckpt

    path = compressed_npz(tmp_path)
    with pytest.warns(NotZeroCopyWarning) as record:
        with fastckpt.open(path) as f:
            assert same(f["a"], np.arange(1000, dtype="<f8"))
    assert len(record) == 1 and record[0].filename == __file__


CLOSE_MID_PARSE = """
import sys
import numpy as np
import fastckpt._native.npz as _npz
from fastckpt._native.mapped import MappedFile

m = MappedFile(sys.argv[1])
real = _npz._check_member_name

def close_then_check(*args):
    m.close()  # as another thread might, while the parser holds pointers into the central directory
    return real(*args)

_npz._check_member_name = close_then_check
try:
    _npz._read_npz_checking(m)  # the checking parser: the fast path calls no Python function per member
except ValueError as e:
    print("refused:", "closed" in str(e))
"""

# The fast path: another thread closes the file while the parse runs (switching threads every microsecond).
CLOSE_DURING_FAST_PARSE = """
import sys, threading
import fastckpt._native.npz as _npz
from fastckpt._native.mapped import MappedFile

sys.setswitchinterval(1e-6)
outcomes = set()
for attempt in range(40):
    m = MappedFile(sys.argv[1])
    closer = threading.Thread(target=m.close)
    closer.start()
    try:
        outcomes.add("parsed" if len(_npz.read_npz_index(m)) == 2000 else "short")
    except ValueError as e:
        outcomes.add("refused" if "closed" in str(e) else repr(e))
    closer.join()
print(" ".join(sorted(outcomes)))
"""


def test_closing_the_file_during_a_parse_never_reads_unmapped_memory(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "many.npz"
    save_npz(path, {f"t{i}": np.arange(i, dtype=np.int8) for i in range(50)}, fsync=False)
    done = subprocess.run([sys.executable, "-c", CLOSE_MID_PARSE, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "refused: True\n", "")

    path = tmp_path / "more.npz"
    save_npz(path, {f"t{i}": np.arange(i % 7, dtype=np.int8) for i in range(2000)}, fsync=False)
    done = subprocess.run([sys.executable, "-c", CLOSE_DURING_FAST_PARSE, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert set(done.stdout.split()) <= {"parsed", "refused"}  # a whole index or a clear refusal, never a crash


# -- arrays the caller changes after handing them over -----------------------------------------------

def _assert_filled(path, values):
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every member's CRC-32 matches its bytes
    with np.load(path) as z:
        for i, v in enumerate(values):
            assert np.array_equal(z[f"t{i}"], np.full(1024, v, np.float32))


def test_a_buffer_reused_after_add_returns_is_saved_as_it_was(tmp_path):
    buf = np.empty(1024, np.float32)
    with NpzWriter(tmp_path / "w.npz") as w:
        for i in range(3):
            buf[:] = i
            w.add(f"t{i}", buf)
    _assert_filled(tmp_path / "w.npz", range(3))


def test_a_generator_refilling_one_buffer_is_saved_as_it_was(tmp_path):
    buf = np.empty(1024, np.float32)

    def refill():
        for i in range(3):
            buf[:] = i
            yield f"t{i}", buf

    save_npz(tmp_path / "g.npz", refill())
    _assert_filled(tmp_path / "g.npz", range(3))


def test_array_likes_that_share_a_buffer_are_each_saved(tmp_path):
    shared = np.zeros(1024, np.float32)
    save_npz(tmp_path / "m.npz", {f"t{i}": RefilledBuffer(shared, i) for i in range(3)})
    _assert_filled(tmp_path / "m.npz", range(3))


def test_str_subclass_names_are_saved_as_their_text(tmp_path):
    save_npz(tmp_path / "s.npz", {np.str_("w"): np.arange(3)})
    with np.load(tmp_path / "s.npz") as z:
        assert z.files == ["w"] and type(z.files[0]) is str


def test_large_payloads_get_their_crc_in_the_local_header_too(tmp_path, monkeypatch):
    # Streaming unzip tools read the CRC from the local header, which a large payload gets last.
    monkeypatch.setattr(npz, "_CRC_PIECE", 1000)  # several pieces, one ending mid-array
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: the large-payload path
    path = tmp_path / "big.npz"
    save_npz(path, {"small": np.ones(3), "big": big})
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            (local_crc,) = struct.unpack_from("<I", data, info.header_offset + 14)
            member = z.read(info)
            assert local_crc == info.CRC == zlib.crc32(member), info.filename


# -- numpy.savez's calling form ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call,message", [
    (lambda p, a: save_npz(p, a, a, name=a),
     "save_npz(path, tensors) takes one mapping of name -> array, not numpy.savez's savez(file, *arrays, **named) "
     "(got 2 array(s) by position and keyword(s) 'name'): write save_npz(path, {'arr_0': <array 0>, "
     "'arr_1': <array 1>, 'name': name}) for the names np.savez would give"),
    (lambda p, a: save_npz(p, a),
     "save_npz(path, tensors) takes one mapping of name -> array, not numpy.savez's savez(file, *arrays, **named) "
     "(got 1 array(s) by position): write save_npz(path, {'arr_0': <array 0>}) for the names np.savez would give"),
    (lambda p, a: save_npz(p, {"a": a}, fsinc=False),
     "save_npz() got unknown keyword(s) 'fsinc': the options are alignment, fsync, progress, storage_options and overwrite; "
     "arrays go in the tensors mapping"),
])
def test_the_savez_form_is_refused_with_the_mapping_to_write(tmp_path, call, message):
    with pytest.raises(TypeError) as caught:
        call(tmp_path / "s.npz", np.ones((2, 2)))
    assert str(caught.value) == message
    assert not (tmp_path / "s.npz").exists()
