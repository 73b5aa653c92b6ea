"""The columnar bundle index (fastckpt._native.tftable.read_bundle_index) against the per-entry path it replaces.

The reference below is the reader's former open: ``IndexTable.items()`` and one
``CheckpointReader._make_info`` per entry. For every checkpoint here the
columnar reader must give the same infos (every field, same types), the same
arrays, and for damaged files the same error (type and message).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import cramjam
import crc32c
import ml_dtypes
import numpy as np
import pytest
from _threads import run_in_threads
from fastckpt._native.mapped import MappedFile
from fastckpt._native.tftable import BundleIndex, crc32c_of, mask_crc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt.errors import ChecksumMismatchError, FormatError, TensorNotFoundError
from fastckpt.formats.tf.proto import BundleHeader, _len_field, _tag, decode_header, encode_entry, encode_header
from fastckpt.formats.tf.reader import INT32_MAX, CheckpointReader, TFTensorInfo, encode_tensor_name_slice
from fastckpt.formats.tf.table import IndexTable, TableBuilder
from fastckpt.tf import object_key, write_checkpoint

SWIFT_INDEX_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "tf-index-files"


# -- the per-entry path, as the reader had it -----------------------------------------------------


def _old_open(prefix: str, verify: bool = True):
    """``(listed {name: info}, hidden {key: info}, reader)`` as the per-entry path built them, or its error."""
    reader = CheckpointReader.__new__(CheckpointReader)
    reader.prefix, reader.index_path, reader.verify = prefix, prefix + ".index", verify
    reader._shards, reader._closed, reader._backend, reader._copy_on_write = {}, False, "mmap", False
    import threading

    reader._shard_lock = threading.Lock()
    reader.skipped = {}
    with MappedFile(reader.index_path, advise=False) as mapped:
        items = IndexTable(mapped).items()
    if not items or items[0][0] != b"":
        first = items[0][0] if items else None
        raise FormatError(f"{reader.index_path}: the first key must be the empty header key, got {first!r} "
                          "(not a tensor bundle?)")
    reader.header = decode_header(items[0][1], f"{reader.index_path}: header entry")
    reader._check_version()
    listed, hidden = {}, {}
    for key, value in items[1:]:
        name = key.decode("utf-8", "surrogateescape")
        info = reader._make_info(name, value)
        if info is None:  # an opaque entry, listed in reader.skipped
            continue
        if key.startswith(b"\x00"):
            hidden[key] = info
        else:
            listed[name] = info
    num_shards = reader.header.num_shards
    if num_shards < 0 or num_shards > INT32_MAX or (num_shards == 0 and listed):
        raise FormatError(f"{reader.index_path}: header says num_shards={num_shards} (an int32 of at least 1 "
                          "when there are tensors)")
    reader.num_shards = num_shards
    reader._entries = hidden
    reader._names = list(listed)
    reader._infos = listed
    return listed, hidden, reader


def _close_old(reader) -> None:
    for shard in reader._shards.values():
        shard.close()


def _old_host(reader, info):
    """``host`` as the per-entry path read it."""
    if info.slices:
        return reader._assemble(info)
    copy = reader.header.big_endian and info.dtype.itemsize > 1
    return reader._read_entry(info, copy=copy, stacklevel=2)


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # compared by type and message
        return type(exc), str(exc)


def _assert_same_info(new, old):
    assert type(new) is TFTensorInfo and new == old
    assert list(vars(new)) == list(vars(old))  # same fields, in the same order
    for field in dataclasses.fields(TFTensorInfo):
        a, b = getattr(new, field.name), getattr(old, field.name)
        assert type(a) is type(b) and a == b, field.name
        if field.name == "shape":
            assert all(type(d) is int for d in a)
    assert new.dtype is old.dtype or new.dtype == np.dtype(object)


def _assert_same_array(new, old):
    assert type(new) is type(old) is np.ndarray
    assert new.dtype == old.dtype and new.shape == old.shape
    assert new.flags.writeable == old.flags.writeable
    if new.dtype == object:
        assert new.tolist() == old.tolist()
    else:
        assert new.tobytes() == old.tobytes()
    if not old.flags.owndata:  # the per-entry path gave a view: so does the columnar one
        assert not new.flags.owndata


def check_same(prefix: str, **options):
    """Open ``prefix`` both ways; assert identical infos, hidden entries and arrays (``host``, ``hosts``,
    ``read_tensor``) or identical errors."""
    verify = options.get("verify", True)
    old = _outcome(lambda: _old_open(prefix, verify))
    new = _outcome(lambda: CheckpointReader(prefix, **options))
    if old[0] != "ok" or new[0] != "ok":
        assert new == old
        return None
    listed, hidden, old_reader = old[1]
    reader = new[1]
    assert isinstance(reader.infos, BundleIndex)
    assert list(reader.infos) == list(listed) == reader.tensor_names()
    assert len(reader) == len(listed)
    for name, info in listed.items():
        _assert_same_info(reader.info(name), info)
        assert reader.infos[name] is reader.info(name)  # made once
    assert list(reader._entries) == list(hidden)
    for key, info in hidden.items():
        _assert_same_info(reader._entries[key], info)
    assert reader.variable_to_shape_map() == {n: list(i.shape) for n, i in listed.items()}
    hosts = _outcome(reader.hosts)
    for name, info in listed.items():
        want = _outcome(lambda: _old_host(old_reader, info))
        got = _outcome(lambda: reader.host(name))
        assert got[0] == want[0], (name, got, want)
        if want[0] != "ok":
            assert got == want
            assert hosts[0] != "ok"
            continue
        _assert_same_array(got[1], want[1])
        if hosts[0] == "ok":
            _assert_same_array(hosts[1][name], want[1])
        if not info.slices and not (reader.header.big_endian and info.dtype.itemsize > 1):
            _assert_same_array(reader.read_tensor(name), want[1])
    if hosts[0] == "ok":
        assert list(hosts[1]) == list(listed)
    _close_old(old_reader)
    reader.close()
    return listed


# -- checkpoints ----------------------------------------------------------------------------------


def _bundle(path, header, entries, data=b"", *, num_data_files=None, block_size=262144, restart_interval=16,
            snappy=False):
    """A hand-made bundle: ``entries`` {key bytes: BundleEntryProto bytes}, one data file holding ``data``."""
    prefix = str(path)
    shards = header.num_shards if num_data_files is None else num_data_files
    for i in range(max(shards, 1)):
        Path(f"{prefix}.data-{i:05d}-of-{shards:05d}").write_bytes(data if i == 0 else b"")
    builder_type = _SnappyTableBuilder if snappy else TableBuilder
    with open(prefix + ".index", "wb") as f:
        builder = builder_type(f, block_size=block_size, restart_interval=restart_interval)
        builder.add(b"", encode_header(header))
        for key in sorted(entries):
            builder.add(key, entries[key])
        builder.finish()
    return prefix


class _SnappyTableBuilder(TableBuilder):
    """A TableBuilder whose blocks are stored Snappy-compressed (type 1), as TF 1.x could write them."""

    def _write_block(self, contents: bytes) -> tuple:
        packed = bytes(cramjam.snappy.compress_raw(contents))
        handle = (self.offset, len(packed))
        crc = mask_crc(crc32c.crc32c(b"\x01", crc32c.crc32c(packed)))
        self.f.write(packed + b"\x01" + crc.to_bytes(4, "little"))
        self.offset += len(packed) + 5
        return handle


def _crc(payload: bytes) -> int:
    return mask_crc(crc32c.crc32c(payload))


DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
          np.uint32, np.uint64, np.bool_, np.complex64, np.complex128, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, ml_dtypes.int4, ml_dtypes.uint4]


def _varied_tensors():
    rng = np.random.default_rng(7)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        dt = np.dtype(dtype)
        for shape in [(), (0,), (3,), (2, 3), (1, 0, 4), (2, 1, 1, 3)]:
            raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dt.itemsize, dtype=np.uint8)
            if dt.kind == "b":
                raw = raw & 1
            value = raw.view(dt).reshape(shape) if raw.size else np.zeros(shape, dt)
            tensors[f"t{i:02d}/{dt.name}/{'x'.join(map(str, shape)) or 'scalar'}"] = value
    tensors["strings/vector"] = np.array([b"", b"abc", b"\x00\xff" * 40], dtype=object)
    tensors["strings/scalar"] = np.array(b"one", dtype=object)
    tensors["strings/empty"] = np.zeros((0, 2), dtype=object)
    tensors["unicode/naïve/π"] = np.arange(3, dtype=np.int32)
    tensors["bad-utf8/\udcff\udcfe"] = np.arange(2, dtype=np.int16)
    tensors["rank8"] = np.arange(2**8, dtype=np.int8).reshape((2,) * 8)
    return tensors


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("verify", [True, False])
def test_written_checkpoints_give_the_same_infos_and_arrays(tmp_path, num_shards, verify):
    tensors = _varied_tensors()
    object_graph = num_shards > 1  # the object graph's encoder refuses names that are not UTF-8
    if object_graph:
        del tensors["bad-utf8/\udcff\udcfe"]
    prefix = str(tmp_path / "ckpt")
    write_checkpoint(prefix, tensors, num_shards=num_shards, object_graph=object_graph, fsync=False)
    listed = check_same(prefix, verify=verify)
    assert len(listed) == len(tensors) + 2 * object_graph  # the graph and save_counter
    assert {info.shard for info in listed.values()} == set(range(num_shards))
    with CheckpointReader(prefix, verify=verify) as reader:
        for name, value in tensors.items():
            got = reader.host(object_key(name) if object_graph else name)
            if value.dtype == object:
                assert got.tolist() == value.tolist()
            else:
                assert got.dtype == value.dtype and got.shape == value.shape and got.tobytes() == value.tobytes()
        views = reader.hosts()
        key = object_key("t00/float32/2x3") if object_graph else "t00/float32/2x3"
        assert not views[key].flags.writeable and not views[key].flags.owndata
        if not object_graph:
            assert reader.info("unicode/naïve/π").dtype == np.int32
            assert reader.info("bad-utf8/\udcff\udcfe").shape == (2,)
            assert reader.host("bad-utf8/\udcff\udcfe").tolist() == [0, 1]
            assert "bad-utf8/\udcff" not in reader


def test_exact_info_fields(tmp_path):
    payload = np.arange(6, dtype="<i4").tobytes()
    prefix = _bundle(tmp_path / "c", BundleHeader(num_shards=2), {
        b"a": encode_entry(3, (2, 3), shard_id=1, offset=0, size=24, crc32c=_crc(payload)),
        b"b": encode_entry(1, (), shard_id=0, offset=24, size=4, crc32c=0x12345678)})
    with CheckpointReader(prefix, verify=False) as reader:
        a, b = reader.info("a"), reader.info("b")
    assert vars(a) == {"name": "a", "dtype": np.dtype("<i4"), "shape": (2, 3), "offset": 0, "nbytes": 24,
                       "fortran_order": False, "compression": None, "shard": 1, "tf_dtype": 3,
                       "crc32c": _crc(payload), "slices": ()}
    assert (b.shape, b.offset, b.nbytes, b.shard, b.crc32c, b.tf_dtype_name) == ((), 24, 4, 0, 0x12345678, "float32")


def test_hand_made_entries_in_any_encoding_decoder_accepts(tmp_path):
    """Field order, repeated fields, unknown fields and dimension names, as decode_entry reads them."""
    payload = np.arange(8, dtype="<f4").tobytes()
    crc = _crc(payload[:16])
    fixed_crc = _tag(6, 5) + crc.to_bytes(4, "little")
    dims = _len_field(2, _len_field(2, b"\x08\x02" + _len_field(2, b"rows")) + _len_field(2, b"\x08\x02")
                      + _tag(3, 0) + b"\x00")  # dim names, unknown_rank = false
    entries = {
        b"canonical": encode_entry(1, (2, 2), size=16, crc32c=crc),
        b"reordered": fixed_crc + b"\x28\x10" + dims + b"\x08\x01",
        b"repeated": b"\x08\x03" + b"\x08\x01" + _len_field(2, b"") + dims + b"\x28\x04\x28\x10" + fixed_crc,
        b"unknown fields": (b"\x08\x01" + dims + b"\x28\x10" + fixed_crc + _tag(15, 0) + b"\x96\x01"
                            + _len_field(9, b"xyz") + _tag(10, 1) + bytes(8) + _tag(11, 5) + bytes(4)),
        b"dtype as fixed32": b"\x0d\x01\x00\x00\x00" + encode_entry(1, (2, 2), size=16, crc32c=crc),
        b"long varints": b"\x08\x81\x80\x80\x80\x00" + dims + b"\x28\x90\x80\x00" + fixed_crc,
        b"no crc": encode_entry(1, (2, 2), size=16),
        b"offset 16": encode_entry(1, (4,), offset=16, size=16, crc32c=_crc(payload[16:])),
        b"rank 33": encode_entry(1, (1,) * 33, size=4, crc32c=_crc(payload[:4])),
        b"zero with huge dims": encode_entry(1, (2**40, 2**40, 0), size=0, crc32c=_crc(b"")),
        b"zero size": encode_entry(1, (0, 5), offset=32, crc32c=_crc(b"")),
        b"string": encode_entry(7, (0,), offset=32, crc32c=_crc(b"\x00\x00\x00\x00")),
        b"dtype 200": b"\x08\xc8\x01" + dims + b"\x28\x10" + fixed_crc,  # past the native dtype table: the old path
    }
    del entries[b"dtype 200"]  # an error (tested below); the rest are valid
    prefix = _bundle(tmp_path / "h", BundleHeader(), entries, payload)
    listed = check_same(prefix, verify=False)
    assert listed["reordered"].shape == listed["canonical"].shape == (2, 2)
    assert listed["repeated"].tf_dtype == 1 and listed["repeated"].nbytes == 16
    assert listed["no crc"].crc32c is None
    assert listed["rank 33"].shape == (1,) * 33
    check_same(prefix, verify=True)
    with CheckpointReader(prefix) as reader:
        with pytest.raises(ChecksumMismatchError, match="has no stored crc32c"):
            reader.host("no crc")
        with pytest.raises(ChecksumMismatchError, match="has no stored crc32c"):
            reader.hosts()
        assert reader.hosts(["canonical", "long varints"])["long varints"].tolist() == [[0, 1], [2, 3]]


BAD_ENTRIES = [
    encode_entry(1, (2, 3), size=20),
    encode_entry(1, (-1, 3), size=0),
    encode_entry(1, (2,), shard_id=3, size=8),
    encode_entry(1, (2,), shard_id=-1, size=8),
    encode_entry(7 + 100, (1,), size=4),
    encode_entry(99, (1,), size=4),
    encode_entry(31 + 1000, (1,), size=4),
    encode_entry(-1, (1,), size=4),
    encode_entry(1, (2,), offset=-8, size=8),
    encode_entry(1, (2,), size=-8),
    encode_entry(1, (2**62, 4), size=0),
    encode_entry(1, (2**31, 2**31, 2**2), size=2**64 - 2),
    b"\x08\x01\x12\x02\x18\x01",  # shape: unknown rank
    b"\x08\x01\x12\x05\x12\x02\x08\x02",  # shape overruns the entry
    b"\x08\x01\x15\x00\x00\x00\x00",  # shape with the wrong wire type
    b"\x08\x01\x12\x02\x12\x02\x08\x02",  # dim overruns the shape
    b"\x08\x01\x12\x04\x12\x02\x0f\x02",  # wire type 7 inside a dim
    b"\x08\x01\x12\x00\x35\x01\x02",  # truncated crc32c
    b"\x08\x01\x12\x00\x30\x01",  # crc32c as a varint
    b"\x08\x01\x12\x00\x3a\x02\x0a",  # slice overruns
    b"\x08\x01\x12\x00\x38\x01",  # slices with the wrong wire type
    b"\x08\x01\x12\x00\x28",  # truncated varint
    b"\x08\x01\x12\x00\x28" + b"\xff" * 10 + b"\x01",  # varint longer than 10 bytes
    b"\x08\x01\x12\x00\x28" + b"\xff" * 9 + b"\x7f",  # varint overflowing 64 bits
    b"\x08\x01\x12\x00\x7f",  # wire type 7
    b"\x08\x01\x12\x00\x29\x00",  # truncated fixed64
]


@pytest.mark.parametrize("entry", BAD_ENTRIES, ids=range(len(BAD_ENTRIES)))
@pytest.mark.parametrize("hidden", [False, True])
def test_damaged_entries_give_the_same_errors(tmp_path, entry, hidden):
    key = encode_tensor_name_slice(b"p", [(0, 1)]) if hidden else b"w"
    good = encode_entry(1, (1,), size=4, crc32c=_crc(bytes(4)))
    prefix = _bundle(tmp_path / "bad", BundleHeader(), {key: entry, b"a": good, b"z": good}, bytes(64))
    old = _outcome(lambda: _old_open(prefix))
    assert old[0] is FormatError, old  # every one of them is refused
    assert _outcome(lambda: CheckpointReader(prefix)) == old


@pytest.mark.parametrize("header", [BundleHeader(num_shards=0), BundleHeader(num_shards=-1),
                                    BundleHeader(num_shards=2**40), BundleHeader(min_consumer=2),
                                    BundleHeader(big_endian=True)])
def test_headers_give_the_same_results(tmp_path, header):
    payload = np.arange(4, dtype="<f4").tobytes()
    entries = {b"w": encode_entry(1, (4,), size=16, crc32c=_crc(payload)),
               b"b": encode_entry(4, (2,), offset=0, size=2, crc32c=_crc(payload[:2]))}
    check_same(_bundle(tmp_path / "h", header, entries, payload, num_data_files=1))


def test_empty_and_header_only_tables(tmp_path):
    prefix = str(tmp_path / "empty")
    with open(prefix + ".index", "wb") as f:
        TableBuilder(f).finish()
    assert _outcome(lambda: CheckpointReader(prefix)) == _outcome(lambda: _old_open(prefix))
    with pytest.raises(FormatError, match="the first key must be the empty header key, got None"):
        CheckpointReader(prefix)
    listed = check_same(_bundle(tmp_path / "only", BundleHeader(), {}))
    assert listed == {}


def test_partitioned_variables_and_slices(tmp_path):
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    entries, data = {}, b""
    for name, slices in ((b"p", [[(0, 2), (0, -1)], [(2, 4), (0, -1)]]), (b"q", [[(0, 6), (0, 2)], [(0, 6), (2, 2)]])):
        entries[name] = encode_entry(1, full.shape, slices=slices)
        for extents in slices:
            index = tuple(slice(s, None if n < 0 else s + n) for s, n in extents)
            payload = np.ascontiguousarray(full[index]).tobytes()
            entries[encode_tensor_name_slice(name, extents)] = encode_entry(
                1, full[index].shape, offset=len(data), size=len(payload), crc32c=_crc(payload))
            data += payload
    entries[b"plain"] = encode_entry(1, (2,), offset=0, size=8, crc32c=_crc(data[:8]))
    prefix = _bundle(tmp_path / "part", BundleHeader(), entries, data)
    listed = check_same(prefix)
    assert list(listed) == ["p", "plain", "q"]
    assert listed["p"].slices == (((0, 2), (0, -1)), ((2, 4), (0, -1)))
    with CheckpointReader(prefix) as reader:
        assert len(reader._entries) == 4
        hosts = reader.hosts()
        assert hosts["p"].tobytes() == hosts["q"].tobytes() == full.tobytes()
        assert hosts["p"].flags.owndata and hosts["p"].flags.writeable  # assembled: a new array


@pytest.mark.parametrize("dtype,tf_enum", [("f4", 1), ("i2", 5), ("c8", 8), ("u1", 4), ("i1", 6)])
def test_big_endian(tmp_path, dtype, tf_enum):
    value = (np.arange(6) * 3 - 2).astype("<" + dtype).reshape(2, 3)
    stored = value.astype(">" + dtype).tobytes()
    entries = {b"w": encode_entry(tf_enum, (2, 3), size=len(stored), crc32c=_crc(stored))}
    prefix = _bundle(tmp_path / "be", BundleHeader(big_endian=True), entries, stored)
    check_same(prefix)
    with CheckpointReader(prefix) as reader:
        got = reader.hosts()["w"]
        assert got.tobytes() == value.tobytes()
        assert got.flags.writeable == (value.dtype.itemsize > 1)  # swapped into a copy; bytes are viewed in place


@pytest.mark.parametrize("snappy", [False, True])
@pytest.mark.parametrize("restart_interval", [1, 3, 16])
def test_many_blocks(tmp_path, snappy, restart_interval):
    n = 3000
    data = np.arange(n, dtype="<i4")
    entries = {f"layer_{i:05d}/kernel{'/' * (i % 3)}".encode(): encode_entry(
        3, (1,), offset=4 * i, size=4, crc32c=_crc(data[i:i + 1].tobytes())) for i in range(n)}
    prefix = _bundle(tmp_path / "many", BundleHeader(), entries, data.tobytes(), block_size=600,
                     restart_interval=restart_interval, snappy=snappy)
    with CheckpointReader(prefix) as reader:
        assert reader.num_data_blocks > 100
        hosts = reader.hosts()
        assert [int(hosts[k.decode()][0]) for k in sorted(entries)] == list(range(n))
    check_same(prefix)


@pytest.mark.skipif(not SWIFT_INDEX_DIR.is_dir(), reason="shared/reference/tf-index-files is not available")
@pytest.mark.parametrize("name", ["minigo", "style", "transformer"])
def test_tf1_index_files_give_the_same_infos(name):
    prefix = str(SWIFT_INDEX_DIR / name)
    listed, _hidden, old_reader = _old_open(prefix)
    with CheckpointReader(prefix + ".index") as reader:
        assert list(reader.infos) == list(listed)
        for tensor, info in listed.items():
            _assert_same_info(reader.info(tensor), info)


def test_hosts_verify_damage_and_lifetime(tmp_path):
    tensors = {"a": np.arange(5, dtype=np.float32), "b": np.ones((2, 2), np.int64), "c": np.zeros(70000, np.int8)}
    prefix = str(tmp_path / "d")
    write_checkpoint(prefix, tensors, fsync=False)
    data = Path(prefix + ".data-00000-of-00001")
    with CheckpointReader(prefix) as reader:
        at = reader.info("b").offset
        big = reader.info("c").offset
    raw = bytearray(data.read_bytes())
    raw[at + 3] ^= 1
    raw[big + 69999] ^= 1  # checksummed by the crc32c package (a large payload)
    data.write_bytes(bytes(raw))
    with CheckpointReader(prefix) as reader:
        for name in ("b", "c"):
            with pytest.raises(ChecksumMismatchError) as from_host:
                reader.host(name)
            with pytest.raises(ChecksumMismatchError) as from_hosts:
                reader.hosts([name])
            assert str(from_hosts.value) == str(from_host.value)
            assert f"tensor {name!r} at offset" in str(from_host.value)
        assert reader.hosts(["a"])["a"].tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(TensorNotFoundError):
            reader.hosts(["a", "nope"])
        with pytest.raises(TypeError, match="single name"):
            reader.hosts("a")
    with CheckpointReader(prefix, verify=False) as reader:
        views = reader.hosts()
        assert views["b"].tobytes() == bytes(raw[at:at + 32])
    reader.close()
    assert views["a"].tolist() == [0, 1, 2, 3, 4]  # views outlive the reader
    with pytest.raises(ValueError, match="closed"):
        reader.hosts()
    with pytest.raises(ValueError, match="closed"):
        reader.host("a")


@pytest.mark.parametrize("options", [{"backend": "pread"}, {"copy_on_write": True}])
def test_backends(tmp_path, options):
    prefix = str(tmp_path / "b")
    write_checkpoint(prefix, {"a": np.arange(4, dtype=np.float32), "b": np.array([b"x"], dtype=object)},
                     num_shards=2, fsync=False)
    check_same(prefix)
    with CheckpointReader(prefix, **options) as reader:
        views = reader.hosts()
        assert views["a"].tolist() == [0, 1, 2, 3] and views["b"].tolist() == [b"x"]
        if options.get("copy_on_write"):
            assert views["a"].flags.writeable and not views["a"].flags.owndata
            views["a"][0] = 9
        else:
            assert not views["a"].flags.writeable  # pread: read into a private, read-only block
    with CheckpointReader(prefix) as reader:
        assert reader.host("a").tolist() == [0, 1, 2, 3]  # copy-on-write never writes the file


def test_missing_shard_is_reported_by_hosts(tmp_path):
    prefix = str(tmp_path / "m")
    write_checkpoint(prefix, {"a": np.zeros(2), "b": np.ones(2)}, num_shards=2, fsync=False)
    os.remove(prefix + ".data-00001-of-00002")
    with CheckpointReader(prefix) as reader:
        assert reader.host(next(n for n in reader if reader.info(n).shard == 0)) is not None
        with pytest.raises(FileNotFoundError, match="data shard 1 of 2 is missing"):
            reader.hosts()


def test_threads_viewing_several_shards_get_each_tensor_from_its_own_shard(tmp_path):
    import threading

    tensors = {f"t{i:03d}": np.full(3, i, np.int32) for i in range(300)}
    prefix = str(tmp_path / "s")
    write_checkpoint(prefix, tensors, num_shards=4, fsync=False)
    with CheckpointReader(prefix) as reader:
        names = reader.tensor_names()
        assert len({reader.info(n).shard for n in names}) == 4
        barrier = threading.Barrier(6)

        def run(k):
            barrier.wait()
            for _ in range(5):
                order = names[k::2] + names[1 - k % 2::2]
                for name in order:
                    assert reader.host(name).tolist() == [int(name[1:])] * 3
                views = reader.hosts(order[::-1])
                assert all(v.tolist() == [int(n[1:])] * 3 for n, v in views.items())

        errors = run_in_threads(run, 6)
    assert errors == []


def test_reader_does_not_keep_itself_alive(tmp_path):
    import gc
    import weakref

    prefix = str(tmp_path / "w")
    write_checkpoint(prefix, {"a": np.zeros(2)}, fsync=False)
    gc.disable()
    try:
        reader = CheckpointReader(prefix)
        reader.hosts()
        ref = weakref.ref(reader)
        del reader
        assert ref() is None  # no reference cycle through the index
    finally:
        gc.enable()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000])
def test_crc32c_matches_the_package(n):
    data = bytes(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
    assert crc32c_of(data) == crc32c.crc32c(data)
    assert crc32c_of(data[n // 2:], crc32c_of(data[:n // 2])) == crc32c.crc32c(data)
    assert crc32c_of(b"123456789") == 0xE3069283


# -- fuzzing ----------------------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


def _fuzz_seed(tmp_path_factory):
    if "prefix" not in _FUZZ:
        d = tmp_path_factory.mktemp("tfindexfuzz")
        payload = np.arange(16, dtype="<f4").tobytes()
        full = np.arange(8, dtype=np.float32).reshape(4, 2)
        entries = {
            b"a": encode_entry(1, (2, 2), size=16, crc32c=_crc(payload[:16])),
            b"b/kernel": encode_entry(3, (3,), offset=16, size=12, crc32c=_crc(payload[16:28])),
            b"b/bias": encode_entry(14, (), offset=28, size=2, crc32c=_crc(payload[28:30])),
            b"c": encode_entry(7, (1,), offset=32, size=9, crc32c=_crc(payload[32:41])),
            b"p": encode_entry(1, (4, 2), slices=[[(0, 4), (0, -1)]]),
            encode_tensor_name_slice(b"p", [(0, 4), (0, -1)]): encode_entry(
                1, (4, 2), offset=0, size=32, crc32c=_crc(full.tobytes())),
        }
        entries.update({f"many/{i:03d}".encode(): encode_entry(1, (1,), offset=4 * i, size=4,
                                                              crc32c=_crc(payload[4 * i:4 * i + 4]))
                        for i in range(12)})
        _FUZZ["prefix"] = _bundle(d / "seed", BundleHeader(), entries, payload, block_size=200, restart_interval=4)
        _FUZZ["index"] = Path(_FUZZ["prefix"] + ".index").read_bytes()
        with MappedFile(_FUZZ["prefix"] + ".index") as mapped:
            _FUZZ["blocks"] = IndexTable(mapped).block_handles
        _FUZZ["target"] = str(d / "fuzzed")
        os.link(_FUZZ["prefix"] + ".data-00000-of-00001", _FUZZ["target"] + ".data-00000-of-00001")
    return _FUZZ


_FUZZ: dict = {}


def _fix_checksums(raw: bytearray, blocks) -> None:
    for off, size in blocks:
        raw[off + size + 1:off + size + 5] = mask_crc(crc32c.crc32c(bytes(raw[off:off + size + 1]))).to_bytes(4, "little")


def _same_or_format_error(prefix):
    old = _outcome(lambda: _old_open(prefix))
    new = _outcome(lambda: CheckpointReader(prefix))
    if old[0] == "ok":
        assert new[0] == "ok", new
        listed = old[1][0]
        _close_old(old[1][2])
        with new[1] as reader:
            assert list(reader.infos) == list(listed)
            for name, info in listed.items():
                _assert_same_info(reader.info(name), info)
            hosts = _outcome(reader.hosts)
            assert hosts[0] == "ok" or issubclass(hosts[0], (FormatError, FileNotFoundError, KeyError)), hosts
    else:
        assert new == old
        assert issubclass(new[0], FormatError), new


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6), st.booleans())
def test_fuzz_byte_flips_in_the_index(tmp_path_factory, edits, fix_checksums):
    """Random bytes in the index (with the block checksums then fixed, to reach the entries): never a crash,
    FormatError-family errors only, and always what the per-entry path did."""
    seed = _fuzz_seed(tmp_path_factory)
    raw = bytearray(seed["index"])
    data_end = max(off + size for off, size in seed["blocks"])
    for pos, value in edits:
        raw[pos % (data_end if fix_checksums else len(raw))] = value
    if fix_checksums:
        _fix_checksums(raw, seed["blocks"])
    Path(seed["target"] + ".index").write_bytes(bytes(raw))
    _same_or_format_error(seed["target"])
