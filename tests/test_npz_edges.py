"""Edge cases of the NPZ writer's batch path and the fast reader, and a differential fuzz of the fast path.

- a dict whose conversion of one value moves a key to its end (same size, so no RuntimeError) must not make
  ``save_npz`` write a member name twice: names go unchecked one by one only when no caller code can run;
- ``MemberWriter.add_items(..., unique_names)`` that fails on an item leaves the names it did not write free;
- a zip64 local-header offset of 2**63 or more is a FormatError, not an OverflowError;
- a bounded differential fuzz of the fast path against the checking parser over archives built field by
  field (names, flags, zip64 extras, sentinels, order, central-directory bounds).
"""

import io
import os
import struct
import warnings
import zipfile

import numpy as np
import pytest
from fastckpt._native.mapped import MappedFile
from fastckpt._native.npz import _read_npz_checking, _read_npz_fast_only, read_npz_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastckpt
import fastckpt.formats.npz as npz_module
from fastckpt import FormatError
from fastckpt.formats.npz import save_npz


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


class _MovesKeyA:
    """Converting it moves key 'a' to the end of its dict without changing the dict's size: the resize the
    temporary keys force compacts the entries, so the dict's iteration goes on and yields 'a' again."""

    def __init__(self, d):
        self.d = d

    def __array__(self, dtype=None, copy=None):
        d = self.d
        del d["a"]
        for i in range(64):
            d[f"t{i}"] = 0
        d["a"] = np.zeros(1, "<f4")
        for i in range(64):
            del d[f"t{i}"]
        return np.ones(2, "<f4")


def test_a_dict_changed_while_saved_never_gives_a_file_with_a_repeated_member(tmp_path):
    d = {}
    d["a"] = _MovesKeyA(d)
    d["b"] = np.zeros(1, "<f4")
    d["c"] = np.zeros(1, "<f4")
    path = tmp_path / "x.npz"
    try:
        save_npz(path, d)
    except (ValueError, RuntimeError):
        assert not path.exists()  # refused ("given twice", as before unique_names): nothing written
        return
    names = zipfile.ZipFile(path).namelist()
    assert len(names) == len(set(names)), names  # got ['a.npy', 'c.npy', 'a.npy']
    with MappedFile(path) as m:
        read_npz_index(m)


def test_a_failed_add_items_leaves_unwritten_names_free(tmp_path):
    from fastckpt._native.gather import GatherWriter
    from fastckpt._native.npz import MemberWriter

    with open(tmp_path / "m.bin", "wb") as f:
        out = GatherWriter(f.fileno())
        members = MemberWriter(out, 64, npz_module._ZIP64_LIMIT, npz_module._crc32, npz_module.npy_header,
                               npz_module._large_payload, npz_module._LARGE_PAYLOAD)
        tensors = {"a": np.zeros(1), "b": np.array([None], dtype=object)}  # 'b' has no .npy header
        with pytest.raises(ValueError, match="tensor 'b'"):
            members.add_items(tensors.items(), True, np.asarray, tensors)
        assert members.count == 1 and not members.broken
        members.add("b", np.zeros(1))  # never written: free (raises "'b' given twice")
        assert members.count == 2
        with pytest.raises(ValueError, match="'a' given twice"):
            members.add("a", np.zeros(1))
        out.flush()


def test_a_zip64_local_offset_past_int64_is_a_format_error(tmp_path):
    npy = _npy(np.zeros(2, "<f4"))
    name = b"a.npy"
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, 0, len(npy), len(npy), len(name), 0)
    extra = struct.pack("<HHQ", 1, 8, 2**63)  # the local header offset, in the zip64 extra field
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, 0, len(npy), len(npy),
                          len(name), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + name + extra
    body = local + name + npy
    path = tmp_path / "o.npz"
    path.write_bytes(body + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(body), 0))
    with MappedFile(path) as m:
        assert _read_npz_fast_only(m) is None
        with pytest.raises(FormatError, match="local header"):  # raises OverflowError
            read_npz_index(m)


# -- the fast path against the checking parser, on archives built field by field -----------------------------

_HEADERS = [_npy(np.zeros((2, 3), "<f4")), _npy(np.zeros((3, 2), "<f4")), _npy(np.asfortranarray(np.zeros((2, 3)))),
            _npy(np.uint8(7)), _npy(np.zeros(0, ">i2")), _npy(np.zeros((1,) * 33, "u1")),
            _npy(np.zeros(2, "M8[s]")), _npy(np.zeros(2, [("a", "<u2"), ("b", "S2")])),
            _npy(np.zeros(3, "u1"))[:-1], _npy(np.zeros(3, "u1")) + b"\0", b"\x93NUMPY\x01\x00", b"",
            b"\x93NUMPY\x02\x00\xff\xff\xff\xff",
            b"\x93NUMPY\x01\x00\x46\x00{'descr': '<f4', 'fortran_order': False, 'shape': (0, 9223372036854775808), }\n"]
_PIECES = [b"a", b"/", b".", b"..", b":", b"C", b"\\", b"\x00", b"\xc3\xa9", b"\xf0\x9f\x98\x80", b"\x82", b"\xff",
           b"\xc0\x80", b"\xed\xa0\x80", b"\xc3"]
_NAMES = st.one_of(st.sampled_from([b"a.npy", b"b.npy", b".npy", b"\xc3\xa9:a.npy", b"1:a.npy", b"a/../b.npy"]),
                   st.lists(st.sampled_from(_PIECES), max_size=4).map(lambda p: b"".join(p) + b".npy"),
                   st.binary(max_size=6))
_SENTINELS = st.sets(st.sampled_from(["u", "c", "l"]), max_size=3)
_Z64_VALUE = st.sampled_from([None, None, 2**63, 2**64 - 1, -1])


@st.composite
def _member(draw):
    return dict(name=draw(_NAMES), utf8=draw(st.booleans()), data=draw(st.sampled_from(_HEADERS)),
                method=draw(st.sampled_from([0] * 8 + [8])), flags=draw(st.sampled_from([0] * 8 + [1, 0x2000])),
                gap=draw(st.sampled_from([0] * 6 + [1])), lextra=draw(st.sampled_from([b""] * 4 + [b"\x35\xd9\x02\x00\x40\x00"])),
                zip64=draw(_SENTINELS), fsize=draw(st.sampled_from([None] * 4 + [0, 8, 23])), z64=draw(_Z64_VALUE),
                cextra=draw(st.sampled_from([b""] * 4 + [b"zz", b"\x00\x00\x04\x00abcd"])),
                comment=draw(st.sampled_from([b""] * 6 + [b"c"])), disk=draw(st.sampled_from([0] * 10 + [1, 0xFFFF])))


def _archive(members, order, zip64_end, cd_delta) -> bytes:
    out, central = bytearray(), bytearray()
    for m in members:
        out += bytes(m["gap"])
        m["local"] = len(out)
        flags = 0x800 if m["utf8"] else 0
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, m["method"], 0, 0x21, 0, len(m["data"]),
                           len(m["data"]), len(m["name"]), len(m["lextra"])) + m["name"] + m["lextra"] + m["data"]
    for i in order:
        m = members[i]
        size, local = len(m["data"]), m["local"]
        values = {"u": size, "c": size, "l": local}
        if m["z64"] is not None:
            values[sorted(m["zip64"] or "u")[0]] = m["z64"] % 2**64
        extra = m["cextra"]
        if m["zip64"]:
            payload = b"".join(struct.pack("<Q", values[k]) for k in "ucl" if k in m["zip64"])
            fsize = len(payload) if m["fsize"] is None else m["fsize"]
            extra += struct.pack("<HH", 1, fsize) + (payload + bytes(32))[:fsize]
        sentinel = {k: 0xFFFFFFFF if k in m["zip64"] else values[k] % 2**32 for k in "ucl"}
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, m["flags"] | (0x800 if m["utf8"] else 0),
                               m["method"], 0, 0x21, 0, sentinel["c"], sentinel["u"], len(m["name"]), len(extra),
                               len(m["comment"]), m["disk"], 0, 0, sentinel["l"]) + m["name"] + extra + m["comment"]
    cd_offset, cd_size, count = len(out), len(central) + cd_delta[1], len(order) + cd_delta[0]
    out += central
    if zip64_end:
        at = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, at, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size % 2**32, cd_offset, 0)
    return bytes(out)


@st.composite
def _archives(draw):
    members = draw(st.lists(_member(), max_size=4))
    order = list(range(len(members)))
    if members and draw(st.integers(0, 4)) == 0:
        order = draw(st.permutations(order)) + draw(st.lists(st.sampled_from(order), max_size=1))
    cd_delta = draw(st.sampled_from([(0, 0)] * 8 + [(1, 0), (-1, 0), (0, 1), (0, -1)]))
    if len(order) + cd_delta[0] < 0 or (not members and cd_delta[1] < 0):
        cd_delta = (0, 0)
    return _archive(members, order, draw(st.booleans()), cd_delta)


def _outcome(read, m):
    try:
        return "parsed", read(m)
    except FormatError as e:
        return "refused", str(e)
    except OverflowError as e:  # the checking parser's zip64 offsets past int64 (the test above)
        return "overflow", str(e)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=_archives())
def test_the_fast_path_equals_the_checking_parser_on_built_archives(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("b") / "x.npz"
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with MappedFile(path) as m:
            checking = _outcome(_read_npz_checking, m)
            fast = _outcome(_read_npz_fast_only, m)
            assert _outcome(read_npz_index, m) == checking
    if fast[0] != "parsed":
        assert fast == checking  # only the end records' errors, which both share, come out of the fast path
    elif fast[1] is not None:
        assert fast == checking
        assert all(0 <= i.offset and i.offset + i.nbytes <= len(data) for i in fast[1])


def test_the_builder_makes_archives_both_paths_read():
    data = _archive([dict(name=n, utf8=u, data=_HEADERS[0], method=0, flags=0, gap=0, lextra=b"", zip64=z,
                          fsize=None, z64=None, cextra=b"", comment=b"", disk=0)
                     for n, u, z in [(b"a.npy", False, set()), (b"\xc3\xa9.npy", True, {"u", "c", "l"})]],
                    [0, 1], True, (0, 0))
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"npz-review-{os.getpid()}.npz")
    with open(path, "wb") as f:
        f.write(data)
    try:
        with MappedFile(path) as m:
            infos = _read_npz_checking(m)
            assert [(i.name, i.shape) for i in infos] == [("a", (2, 3)), ("é", (2, 3))]
            assert _read_npz_fast_only(m) == infos
    finally:
        os.unlink(path)


def test_a_field_whose_format_is_itself_a_sub_array_round_trips(tmp_path):
    # [('a', ('<f4', (2,)), (3,))]: numpy writes and reads it (its descr names the field's format as (format, shape));
    # fastckpt refused to write it, saying its descr read back as None, with advice about ml_dtypes.
    dtype = np.dtype([("a", ("<f4", (2,)), (3,))])
    array = np.arange(12, dtype=np.float32).view(dtype)
    path = tmp_path / "sub.npz"
    fastckpt.save_npz(path, {"x": array})
    with fastckpt.open(path) as f:
        assert f.host("x").dtype == dtype and f.host("x").tobytes() == array.tobytes()
    assert np.load(path)["x"].dtype == dtype
    np.savez(tmp_path / "numpy.npz", x=array)
    with fastckpt.open(tmp_path / "numpy.npz") as f:
        assert f.host("x").tobytes() == array.tobytes()
