"""CheckpointReader against checkpoints written by real TensorFlow (golden fixtures) and by TF 1.x."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from fastckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    FormatError,
    IntegrityError,
    NotZeroCopyWarning,
    TensorNotFoundError,
)
from fastckpt.formats.tf.proto import BundleHeader, encode_entry, encode_header
from fastckpt.formats.tf.reader import encode_tensor_name_slice
from fastckpt.formats.tf.table import TableBuilder
from fastckpt.tf import CheckpointReader, describe, is_tf_checkpoint

DATA = Path(__file__).parent / "data" / "tf"
EXPECTED = json.loads((DATA / "expected.json").read_text())
FIXTURES = ["object_based", "name_based", "sharded"]
SWIFT_INDEX_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "tf-index-files"

GOLDEN = [(fx, name) for fx in FIXTURES for name in sorted(EXPECTED[fx]["tensors"])]


def prefix_of(fixture: str) -> str:
    return str(DATA / EXPECTED[fixture]["prefix"])


@pytest.mark.parametrize("fixture", FIXTURES)
def test_lists_exactly_what_tensorflow_lists(fixture):
    with CheckpointReader(prefix_of(fixture)) as reader:
        assert reader.tensor_names() == sorted(EXPECTED[fixture]["tensors"])
        assert list(reader) == list(reader.keys()) == reader.tensor_names()
        assert reader.get("no such tensor") is None
        assert len(reader) == len(EXPECTED[fixture]["tensors"])
        for name, entry in EXPECTED[fixture]["tensors"].items():
            assert reader.tensor_shape(name) == tuple(entry["shape"])
            assert reader.info(name).tf_dtype_name == entry["tf_dtype"]


@pytest.mark.parametrize("fixture,name", GOLDEN, ids=[f"{f}:{n}" for f, n in GOLDEN])
def test_values_match_tensorflow_bit_for_bit(fixture, name):
    entry = EXPECTED[fixture]["tensors"][name]
    with CheckpointReader(prefix_of(fixture)) as reader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotZeroCopyWarning)  # partitioned variables are assembled
            value = reader.read_tensor(name)
        assert value.shape == tuple(entry["shape"])
        if "strings" in entry:
            assert value.dtype == object
            assert [x.hex() for x in value.reshape(-1)] == entry["strings"]
        else:
            assert str(value.dtype) == entry["dtype"]
            assert value.tobytes() == bytes.fromhex(entry["hex"])


def test_object_based_keys_and_escaping():
    names = CheckpointReader(prefix_of("object_based")).tensor_names()
    assert "model/table/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE" in names
    assert "save_counter/.ATTRIBUTES/VARIABLE_VALUE" in names
    assert names[0] == "_CHECKPOINTABLE_OBJECT_GRAPH"


def test_object_graph_decodes_to_the_stored_keys():
    reader = CheckpointReader(prefix_of("object_based"))
    graph = reader.object_graph()
    keys = {key for node in graph.nodes for _, _, key in node.attributes}
    assert keys == set(reader.tensor_names()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    paths = graph.paths()
    kernel = next(i for i, n in enumerate(graph.nodes)
                  if any(k == "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE" for _, _, k in n.attributes))
    assert paths[kernel] == ["model", "dense", "kernel"]


def test_zero_copy_views_are_read_only_and_copies_are_not():
    with CheckpointReader(prefix_of("object_based")) as reader:
        name = "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"
        view = reader.read_tensor(name)
        assert not view.flags.writeable and not view.flags.owndata
        copy = reader.read_tensor(name, copy=True)
        assert copy.flags.writeable and copy.flags.owndata
        assert np.array_equal(view, copy)
    assert view.sum() == copy.sum()  # the view outlives close()


def test_scalar_zero_size_and_strings():
    with CheckpointReader(prefix_of("object_based")) as reader:
        assert reader["model/scalar/.ATTRIBUTES/VARIABLE_VALUE"].shape == ()
        empty = reader["model/empty/.ATTRIBUTES/VARIABLE_VALUE"]
        assert empty.shape == (0, 4) and empty.dtype == np.float32
        text = reader["model/text/.ATTRIBUTES/VARIABLE_VALUE"]
        assert text.tolist() == [b"ab", b"", b"xyz" * 50, "gr\u00fc\u00df".encode()]


def test_partitioned_variable_is_assembled_and_slices_hidden():
    with CheckpointReader(prefix_of("name_based")) as reader:
        assert not any(n.startswith("\x00") for n in reader.tensor_names())
        assert reader.info("emb").slices == (((0, 3), (0, 3)), ((3, 2), (0, 3)))
        with pytest.warns(NotZeroCopyWarning, match="partitioned"):
            emb = reader.read_tensor("emb")
        assert emb.tobytes() == bytes.fromhex(EXPECTED["name_based"]["tensors"]["emb"]["hex"])
        # one Adam step (lr 0.1) moved each element of arange(15) by about -0.1: rows are in place
        step = emb - np.arange(15, dtype=np.float32).reshape(5, 3)
        assert ((step < -0.09) & (step > -0.11)).all()
        assert np.array_equal(reader.read_tensor("emb", copy=True), emb)
        assert not reader.has_tensor("\x00emb")


def test_slice_key_encoding_matches_tensorflow():
    # the hidden key TensorFlow wrote for rows 3-4 of "emb"
    with CheckpointReader(prefix_of("name_based")) as reader:
        key = encode_tensor_name_slice(b"emb", [(3, 2), (0, 3)])
        assert key in reader._entries


@pytest.mark.parametrize("value,expected", [(0, b"\x80"), (63, b"\xbf"), (-1, b"\x7f"), (-64, b"\x40"),
                                            (64, b"\xc0\x40"), (-65, b"\x3f\xbf"), (0x424242, b"\xf0\x42\x42\x42"),
                                            (-0x800, b"\x38\x00")])
def test_ordered_code_signed_numbers(value, expected):
    from fastckpt.formats.tf.reader import _ordered_signed

    assert _ordered_signed(value) == expected


def test_multi_shard():
    with CheckpointReader(prefix_of("sharded")) as reader:
        assert reader.header.num_shards == 2
        assert {reader.info(n).shard for n in reader} == {0, 1}


@pytest.mark.parametrize("form", ["prefix", "index", "data", "directory"])
def test_path_forms(form):
    prefix = prefix_of("object_based")
    path = {"prefix": prefix, "index": prefix + ".index", "data": prefix + ".data-00000-of-00001",
            "directory": str(DATA / "object_based")}[form]
    assert is_tf_checkpoint(path)
    with CheckpointReader(path) as reader:
        assert reader.prefix == prefix


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"hello")
    assert not is_tf_checkpoint(tmp_path / "x.bin")
    assert not is_tf_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no TensorFlow checkpoint"):
        CheckpointReader(tmp_path / "x")
    with pytest.raises(CheckpointNotFoundError, match="'checkpoint' state file"):
        CheckpointReader(tmp_path)


def test_directory_without_state_file_names_the_prefixes(tmp_path):
    shutil.copy(prefix_of("sharded") + ".index", tmp_path / "model.index")
    with pytest.raises(CheckpointNotFoundError, match="model"):
        CheckpointReader(tmp_path)


def test_unknown_name_is_a_key_error_with_suggestions():
    with CheckpointReader(prefix_of("name_based")) as reader:
        with pytest.raises(TensorNotFoundError, match="dense/kernel") as info:
            reader.read_tensor("dense/kernal")
        assert isinstance(info.value, KeyError)
        assert "dense/kernal" not in reader
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            reader["nope"]


def test_missing_data_shard(tmp_path):
    shutil.copy(prefix_of("sharded") + ".index", tmp_path / "model.index")
    shutil.copy(prefix_of("sharded") + ".data-00000-of-00002", tmp_path / "model.data-00000-of-00002")
    with CheckpointReader(tmp_path / "model") as reader:
        assert reader.read_tensor("a").tolist() == [0, 1, 2, 3]
        with pytest.raises(CheckpointNotFoundError, match="data-00001-of-00002"):
            reader.read_tensor("b")


def _copy_fixture(tmp_path, fixture="object_based"):
    dst = tmp_path / fixture
    shutil.copytree(DATA / fixture, dst)
    return str(dst / Path(EXPECTED[fixture]["prefix"]).name)


def test_damaged_tensor_fails_its_checksum_unless_verify_is_off(tmp_path):
    prefix = _copy_fixture(tmp_path)
    name = "model/dense/bias/.ATTRIBUTES/VARIABLE_VALUE"
    info = CheckpointReader(prefix).info(name)
    data_path = prefix + ".data-00000-of-00001"
    raw = bytearray(Path(data_path).read_bytes())
    raw[info.offset] ^= 0x01
    Path(data_path).write_bytes(bytes(raw))
    with CheckpointReader(prefix) as reader:
        with pytest.raises(ChecksumMismatchError, match="checksum mismatch") as err:
            reader.read_tensor(name)
        assert isinstance(err.value, IntegrityError) and isinstance(err.value, FormatError)
        assert "verify=False" in str(err.value)
    with CheckpointReader(prefix, verify=False) as reader:
        assert reader.read_tensor(name).tobytes() == bytes(raw[info.offset:info.offset + info.nbytes])


def test_damaged_string_bytes_fail_the_entry_checksum(tmp_path):
    prefix = _copy_fixture(tmp_path)
    name = "model/text/.ATTRIBUTES/VARIABLE_VALUE"
    info = CheckpointReader(prefix).info(name)
    data_path = prefix + ".data-00000-of-00001"
    raw = bytearray(Path(data_path).read_bytes())
    raw[info.offset + info.nbytes - 1] ^= 0x20  # last byte of the last string
    Path(data_path).write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"model/text.*checksum mismatch \(stored"):
        CheckpointReader(prefix).read_tensor(name)
    assert CheckpointReader(prefix, verify=False).read_tensor(name)[-1] == "gr\u00fc\u00ff".encode()


def test_damaged_string_length_checksum(tmp_path):
    from fastckpt._native.tftable import decode_varint

    prefix = _copy_fixture(tmp_path)
    name = "model/text/.ATTRIBUTES/VARIABLE_VALUE"
    info = CheckpointReader(prefix).info(name)
    data_path = prefix + ".data-00000-of-00001"
    raw = bytearray(Path(data_path).read_bytes())
    at = info.offset
    for _ in range(info.size):  # skip the varint lengths: the masked length checksum follows them
        _, at = decode_varint(raw, at)
    raw[at] ^= 0x01
    Path(data_path).write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"model/text.*length checksum mismatch"):
        CheckpointReader(prefix).read_tensor(name)
    unverified = CheckpointReader(prefix, verify=False).read_tensor(name)
    assert unverified.tolist() == [b"ab", b"", b"xyz" * 50, "gr\u00fc\u00df".encode()]


def test_truncated_data_file(tmp_path):
    prefix = _copy_fixture(tmp_path)
    data_path = prefix + ".data-00000-of-00001"
    raw = Path(data_path).read_bytes()
    Path(data_path).write_bytes(raw[:100])
    with CheckpointReader(prefix) as reader:
        late = max(reader.infos.values(), key=lambda i: i.offset)
        with pytest.raises(FormatError, match="truncated"):
            reader.read_tensor(late.name)


def test_describe_lists_locations():
    d = describe(prefix_of("sharded"))
    assert d["format"] == "tensorflow"
    assert d["header"] == {"num_shards": 2, "endianness": "little",
                           "version": {"producer": 1, "min_consumer": 0, "bad_consumers": []}}
    assert [(t["name"], t["dtype"], t["shape"], t["shard"], t["offset"], t["nbytes"]) for t in d["tensors"]] == [
        ("a", "int32", [4], 0, 0, 16), ("b", "float64", [5], 1, 0, 40)]
    assert d["files"][1].endswith("model.data-00001-of-00002")
    tensors = {t["name"]: t for t in describe(prefix_of("name_based"), verify=True)["tensors"]}
    assert tensors["emb"]["slices"] == [[[0, 3], [0, 3]], [[3, 2], [0, 3]]]
    assert tensors["emb"]["file"] is None
    json.dumps(describe(prefix_of("object_based")))  # JSON-ready


# -- hand-made bundles: big-endian data, version checks ---------------------------------------------


def _bundle(tmp_path, header: BundleHeader, entries: dict, data: bytes = b"") -> str:
    prefix = str(tmp_path / "hand")
    Path(prefix + ".data-00000-of-00001").write_bytes(data)
    with open(prefix + ".index", "wb") as f:
        builder = TableBuilder(f)
        builder.add(b"", encode_header(header))
        for key in sorted(entries):
            builder.add(key, entries[key])
        builder.finish()
    return prefix


@pytest.mark.parametrize("num_shards", [2**31 - 1, 2**31, 2**40, -1])
def test_absurd_shard_counts_cost_nothing_or_are_refused(tmp_path, num_shards):
    import crc32c
    from fastckpt._native.tftable import mask_crc

    payload = np.arange(3, dtype=np.int32).tobytes()
    entries = {b"a": encode_entry(3, (3,), size=12, crc32c=mask_crc(crc32c.crc32c(payload)))}
    prefix = _bundle(tmp_path, BundleHeader(num_shards=num_shards), entries, payload)
    if not 0 < num_shards < 2**31:
        with pytest.raises(FormatError, match=f"num_shards={num_shards}"):
            CheckpointReader(prefix)
        return
    with CheckpointReader(prefix) as reader:  # no per-shard list of two billion entries
        assert reader.num_shards == num_shards
        with pytest.raises(CheckpointNotFoundError, match=f"data-00000-of-{num_shards}"):
            reader.read_tensor("a")
    d = describe(prefix)
    assert d["header"]["num_shards"] == num_shards
    assert d["files"] == [f"{prefix}.data-00000-of-{num_shards}"]


@pytest.mark.parametrize("dtype,tf_enum", [("f4", 1), ("f8", 2), ("i4", 3), ("i2", 5), ("i8", 9), ("c8", 8),
                                           ("f2", 19), ("u2", 17), ("u8", 23), ("u1", 4)])
def test_big_endian_file_is_byte_swapped(tmp_path, dtype, tf_enum):
    import crc32c
    from fastckpt._native.tftable import mask_crc

    value = (np.arange(6) * 3 - 2).astype("<" + dtype).reshape(2, 3)
    stored = value.astype(">" + dtype).tobytes()
    entry = encode_entry(tf_enum, (2, 3), size=len(stored), crc32c=mask_crc(crc32c.crc32c(stored)))
    prefix = _bundle(tmp_path, BundleHeader(big_endian=True), {b"w": entry}, stored)
    with CheckpointReader(prefix) as reader:
        if value.dtype.itemsize > 1:
            with pytest.warns(NotZeroCopyWarning, match="big-endian"):
                got = reader.read_tensor("w")
        else:
            got = reader.read_tensor("w")
        assert got.dtype == value.dtype and got.dtype.isnative
        assert got.tobytes() == value.tobytes()
        assert reader.read_tensor("w", copy=True).tobytes() == value.tobytes()


@pytest.mark.parametrize("header,match", [
    (BundleHeader(min_consumer=2), "newer TensorFlow"),
    (BundleHeader(bad_consumers=(1,)), "bad_consumers"),
    (BundleHeader(producer=-1), "older than"),
])
def test_version_checks(tmp_path, header, match):
    prefix = _bundle(tmp_path, header, {})
    with pytest.raises(FormatError, match=match):
        CheckpointReader(prefix)


@pytest.mark.parametrize("entry,match", [
    (encode_entry(1, (2, 3), size=20), "invalid size"),
    (encode_entry(1, (-1, 3), size=0), "negative dimension"),
    (encode_entry(1, (2,), shard_id=3, size=8), "shard_id 3"),
    (encode_entry(99, (1,), size=4), "DataType\\(99\\)"),
])
def test_bad_entries(tmp_path, entry, match):
    prefix = _bundle(tmp_path, BundleHeader(), {b"w": entry}, bytes(64))
    with pytest.raises(FormatError, match=match):
        CheckpointReader(prefix)


def test_header_must_come_first(tmp_path):
    prefix = str(tmp_path / "noheader")
    Path(prefix + ".data-00000-of-00001").write_bytes(b"")
    with open(prefix + ".index", "wb") as f:
        builder = TableBuilder(f)
        builder.add(b"a", encode_entry(1, (0,)))
        builder.finish()
    with pytest.raises(FormatError, match="header"):
        CheckpointReader(prefix)


# -- TF 1.x index files from swift-models (data files do not exist upstream) -------------------------

SWIFT_FILES = ["minigo", "style", "transformer"]


@pytest.mark.skipif(not SWIFT_INDEX_DIR.is_dir(), reason="shared/reference/tf-index-files is not available")
@pytest.mark.parametrize("name", SWIFT_FILES)
def test_tf1_index_files(name):
    expected = json.loads((SWIFT_INDEX_DIR / f"expected_{name}.json").read_text())
    with CheckpointReader(SWIFT_INDEX_DIR / f"{name}.index") as reader:
        assert reader.header.num_shards == 1
        assert reader.tensor_names() == sorted(expected, key=lambda n: n.encode())
        for tensor, entry in expected.items():
            info = reader.info(tensor)
            assert info.tf_dtype == entry["dtype_enum"]
            assert info.tf_dtype_name == entry["tf_dtype"]
            assert str(info.dtype) == entry["dtype"]
            assert list(info.shape) == entry["shape"]


@pytest.mark.skipif(not SWIFT_INDEX_DIR.is_dir(), reason="shared/reference/tf-index-files is not available")
def test_tf1_snappy_index_file_really_is_compressed():
    from fastckpt._native.mapped import MappedFile

    from fastckpt.formats.tf.table import IndexTable

    with MappedFile(SWIFT_INDEX_DIR / "minigo.index") as mapped:
        table = IndexTable(mapped)
        off, size = table.block_handles[0]
        assert mapped.read(off + size, 1) == b"\x01"
        assert len(table.block(0)) > size
    summary = json.loads((SWIFT_INDEX_DIR / "summary.json").read_text())
    assert "minigo" in json.dumps(summary)


def test_reader_repr_and_close():
    reader = CheckpointReader(prefix_of("sharded"))
    assert "tensors=2" in repr(reader)
    reader.read_tensor("a")
    reader.close()
    reader.close()
    assert "Closed" in repr(reader) and reader.closed
    with pytest.raises(ValueError, match="closed"):
        reader.read_tensor("a")
    assert os.path.exists(reader.index_path)


def test_big_endian_bfloat16_and_zero_size(tmp_path):
    import crc32c
    import ml_dtypes
    from fastckpt._native.tftable import mask_crc

    value = np.array([1.0, -2.5, 3e38], ml_dtypes.bfloat16)
    stored = value.view(np.uint16).astype(">u2").tobytes()
    entries = {b"b": encode_entry(14, (3,), size=6, crc32c=mask_crc(crc32c.crc32c(stored))),
               b"z": encode_entry(1, (0, 2), offset=6, crc32c=mask_crc(0))}
    prefix = _bundle(tmp_path, BundleHeader(big_endian=True), entries, stored)
    with CheckpointReader(prefix) as reader:
        got = reader.read_tensor("b", copy=True)
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes()
        assert reader.read_tensor("z", copy=True).shape == (0, 2)


@pytest.mark.parametrize("name", [None, 3, b"a"])
def test_non_string_names_are_not_found(name):
    with CheckpointReader(prefix_of("sharded")) as reader:
        assert name not in reader
        with pytest.raises(TensorNotFoundError):
            reader.read_tensor(name)


def _partitioned(tmp_path, slices, full_shape=(4, 2), make_entries_for=None):
    """A hand-made partitioned variable 'p' whose slices hold rows of arange(8)."""
    import crc32c
    from fastckpt._native.tftable import mask_crc

    full = np.arange(np.prod(full_shape), dtype=np.float32).reshape(full_shape)
    entries = {b"p": encode_entry(1, full_shape, slices=slices)}
    data = b""
    for extents in (make_entries_for if make_entries_for is not None else slices):
        index = tuple(slice(s, None if n < 0 else s + n) for s, n in extents)
        payload = np.ascontiguousarray(full[index]).tobytes()
        entries[encode_tensor_name_slice(b"p", extents)] = encode_entry(
            1, full[index].shape, offset=len(data), size=len(payload), crc32c=mask_crc(crc32c.crc32c(payload)))
        data += payload
    return _bundle(tmp_path, BundleHeader(), entries, data), full


def test_hand_made_partitioned_variable(tmp_path):
    prefix, full = _partitioned(tmp_path, [[(0, 2), (0, -1)], [(2, 2), (0, -1)]])
    with CheckpointReader(prefix) as reader:
        assert reader.tensor_names() == ["p"]
        assert reader.read_tensor("p", copy=True).tobytes() == full.tobytes()


@pytest.mark.parametrize("slices,made,match", [
    ([[(0, 2), (0, -1)], [(2, 2), (0, -1)]], [[(0, 2), (0, -1)]], "missing from the index"),
    ([[(0, 2), (0, -1)]], None, "do not cover"),
    ([[(0, 2), (0, -1)], [(0, 2), (0, -1)]], [[(0, 2), (0, -1)]], "do not cover"),
    ([[(0, 3), (0, -1)], [(1, 3), (0, -1)]], None, r"do not cover its shape \[4, 2\] exactly \(32 bytes\): they hold 48"),
    ([[(3, 2), (0, -1)]], [[(0, 2), (0, -1)]], "outside dimension"),
    ([[(0, 4)]], [], "rank 1 differs"),
])
def test_bad_partitions(tmp_path, slices, made, match):
    prefix, _ = _partitioned(tmp_path, slices, make_entries_for=made)
    with CheckpointReader(prefix) as reader:
        with pytest.raises(FormatError, match=match):
            reader.read_tensor("p", copy=True)


@pytest.mark.parametrize("ranges,expected", [
    ([], 0), ([(0, 5, 5)], 0), ([(0, 0, 10), (0, 5, 15)], 15), ([(0, 0, 10), (1, 0, 10)], 20),
    ([(0, 10, 20), (0, 0, 10)], 20), ([(0, 0, 10), (0, 2, 3)], 10), ([(0, 0, 4), (0, 0, 4), (0, 0, 4)], 4),
])
def test_union_length_counts_each_data_byte_once(ranges, expected):
    from fastckpt.formats.tf.reader import _union_length

    assert _union_length(ranges) == expected


def test_slices_that_share_their_data_bytes_are_refused(tmp_path):
    import crc32c
    from fastckpt._native.tftable import mask_crc

    rows = np.arange(1000 * 256, dtype=np.float32).reshape(1000, 256)  # 1 MB of data
    payload = rows.tobytes()
    crc = mask_crc(crc32c.crc32c(payload))
    count = 64  # 64 slice entries over the same megabyte would make the reader fill a 64 MB array
    slices = [[(1000 * i, 1000), (0, -1)] for i in range(count)]
    entries = {b"p": encode_entry(1, (1000 * count, 256), slices=slices)}
    for extents in slices:
        entries[encode_tensor_name_slice(b"p", extents)] = encode_entry(1, (1000, 256), size=len(payload), crc32c=crc)
    prefix = _bundle(tmp_path, BundleHeader(), entries, payload)
    with CheckpointReader(prefix) as reader:
        with pytest.raises(FormatError, match=r"they hold 65536000 bytes, 1024000 of them distinct"):
            reader.read_tensor("p", copy=True)


def test_partition_claiming_a_huge_shape_is_refused_before_allocating(tmp_path):
    import crc32c
    from fastckpt._native.tftable import mask_crc

    payload = np.arange(4, dtype=np.float32).tobytes()
    entries = {b"p": encode_entry(1, (2**40, 2), slices=[[(0, 2), (0, -1)]]),
               encode_tensor_name_slice(b"p", [(0, 2), (0, -1)]): encode_entry(
                   1, (2, 2), size=16, crc32c=mask_crc(crc32c.crc32c(payload)))}
    prefix = _bundle(tmp_path, BundleHeader(), entries, payload)
    with CheckpointReader(prefix) as reader:
        with pytest.raises(FormatError, match="do not cover"):  # 8 TiB would be needed; nothing is allocated
            reader.read_tensor("p", copy=True)


def test_state_file_that_is_not_text_is_a_format_error(tmp_path):
    shutil.copytree(DATA / "object_based", tmp_path / "d")
    (tmp_path / "d" / "checkpoint").write_bytes(b'model_checkpoint_path: "ckpt-1\xff"\n')
    with pytest.raises(FormatError, match=r"checkpoint: a checkpoint state file is text, but byte 30 is not UTF-8"):
        CheckpointReader(tmp_path / "d")
    assert not is_tf_checkpoint(tmp_path / "d")


def test_an_older_ml_dtypes_costs_only_the_types_it_lacks(monkeypatch):
    import importlib

    import ml_dtypes

    import fastckpt.formats.tf.dtypes as dtypes

    monkeypatch.delattr(ml_dtypes, "int2")
    monkeypatch.delattr(ml_dtypes, "float4_e2m1fn")
    try:
        importlib.reload(dtypes)  # what an import with ml_dtypes 0.4 sees
        with pytest.raises(FormatError, match=r"dtype int2 \(31\).*has no int2; pip install -U ml_dtypes"):
            dtypes.numpy_dtype(dtypes.DT_INT2)
        assert dtypes.numpy_dtype(dtypes.DT_UINT2) == np.dtype(ml_dtypes.uint2)
        assert dtypes.numpy_dtype(dtypes.DT_BFLOAT16) == np.dtype(ml_dtypes.bfloat16)
    finally:
        monkeypatch.undo()
        importlib.reload(dtypes)
    assert dtypes.numpy_dtype(dtypes.DT_INT2) == np.dtype(ml_dtypes.int2)


def test_threads_reading_one_shard_map_it_once(monkeypatch):
    import threading
    import time

    import fastckpt.formats.tf.reader as reader_module

    opened = []
    real = reader_module.MappedFile

    def counting(path, **kwargs):
        opened.append(path)
        time.sleep(0.02)  # a slow open: without the lock every waiting thread would map the shard too
        return real(path, **kwargs)

    monkeypatch.setattr(reader_module, "MappedFile", counting)
    with CheckpointReader(prefix_of("object_based")) as reader:
        del opened[:]  # the index
        names = reader.tensor_names()
        barrier = threading.Barrier(8)

        def read_all():
            barrier.wait()
            for name in names:
                reader.read_tensor(name, copy=True)

        threads = [threading.Thread(target=read_all) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(opened) == 1
