"""Round trips of fastckpt-written TensorFlow checkpoints, checked without TensorFlow."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from fastckpt._native.mapped import MappedFile

from fastckpt.formats.tf.table import IndexTable
from fastckpt.formats.tf.writer import escape_local_name, unescape_local_name
from fastckpt.tf import CheckpointReader, CheckpointWriter, latest_checkpoint, object_key, save, write_checkpoint

DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "bool", "complex64", "complex128", ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn,
          ml_dtypes.int4, ml_dtypes.uint4]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


def sample(dtype, shape):
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    rng = np.random.default_rng(n)
    if dt == np.bool_:
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if dt.kind in "iu" and dt.itemsize >= 1 and dt.name not in ("int4", "uint4"):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True).reshape(shape)
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt).reshape(shape)
    return (rng.standard_normal(n) * 3).astype(dt).reshape(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_and_shape(tmp_path, dtype, shape):
    value = sample(dtype, shape)
    prefix = tmp_path / "ckpt"
    write_checkpoint(prefix, {"t": value})
    with CheckpointReader(prefix) as reader:
        got = reader.read_tensor("t")
        assert got.dtype == value.dtype and got.shape == value.shape
        assert got.tobytes() == value.tobytes()


def test_big_endian_input_is_stored_little_endian(tmp_path):
    value = np.arange(5, dtype=">i4")
    write_checkpoint(tmp_path / "c", {"t": value})
    got = CheckpointReader(tmp_path / "c")["t"]
    assert got.dtype == np.dtype("<i4") and got.tolist() == value.tolist()


def test_non_contiguous_input(tmp_path):
    value = np.arange(24, dtype=np.float32).reshape(4, 6)[::2, ::3]
    write_checkpoint(tmp_path / "c", {"t": value, "f": np.asfortranarray(np.arange(6.0).reshape(2, 3))})
    with CheckpointReader(tmp_path / "c") as reader:
        assert np.array_equal(reader["t"], value)
        assert np.array_equal(reader["f"], np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("value,expected", [
    (b"bytes", [b"bytes"]),
    ("str \u00e9", ["str \u00e9".encode()]),
    (np.array([b"a", b"", b"\x00\xff" * 300], dtype=object), [b"a", b"", b"\x00\xff" * 300]),
    (np.array(["x", "\u4e2d\u6587"]), [b"x", "\u4e2d\u6587".encode()]),
    (np.array([b"ab", b"c"]), [b"ab", b"c"]),
    (np.empty((0, 2), dtype=object), []),
])
def test_strings(tmp_path, value, expected):
    write_checkpoint(tmp_path / "s", {"s": value})
    got = CheckpointReader(tmp_path / "s")["s"]
    assert got.dtype == object
    assert got.shape == np.shape(value)
    assert list(got.reshape(-1)) == expected


def test_object_arrays_of_other_things_are_refused(tmp_path):
    with pytest.raises(TypeError, match="only bytes or str"):
        write_checkpoint(tmp_path / "s", {"s": np.array([1, None], dtype=object)})
    assert not list(tmp_path.iterdir())


def test_keys_sorted_as_utf8_bytes_and_non_ascii(tmp_path):
    names = ["\u00e9", "z", "a/b", "a", "A", "\U0001f600", "a\u00e9", "ab"]
    tensors = {n: np.array([i], np.int32) for i, n in enumerate(names)}
    write_checkpoint(tmp_path / "u", tensors)
    with CheckpointReader(tmp_path / "u") as reader:
        assert reader.tensor_names() == sorted(names, key=lambda n: n.encode())
        for i, n in enumerate(names):
            assert reader[n].tolist() == [i]


@pytest.mark.parametrize("count", [15, 16, 31, 300])
def test_many_tensors_and_blocks_keep_lookups_working(tmp_path, count):
    # long names push the index past TensorFlow's 256 KiB block size at the larger counts
    names = [f"layer_{i:04d}/" + "w" * (1000 if count > 100 else 10) for i in range(count)]
    write_checkpoint(tmp_path / "m", {n: np.array([i], np.int16) for i, n in enumerate(names)}, fsync=False)
    with MappedFile(tmp_path / "m.index") as mapped:
        table = IndexTable(mapped)
        if count == 300:
            assert len(table.block_handles) >= 2
        for key, value in table.items():
            assert table.get(key) == value  # TensorFlow's lookup path
        for i in range(len(table.index_keys) - 1):
            last_key_of_block = table.block_entries(i)[0][-1]
            first_key_of_next = table.block_entries(i + 1)[0][0]
            assert last_key_of_block <= table.index_keys[i] < first_key_of_next
    with CheckpointReader(tmp_path / "m") as reader:
        assert reader[names[-1]].tolist() == [count - 1]


def test_header_and_entry_layout(tmp_path):
    write_checkpoint(tmp_path / "c", {"w": np.zeros((2, 3), np.float32)})
    raw = (tmp_path / "c.index").read_bytes()
    assert raw.startswith(bytes.fromhex("000006" "08011a020801"))
    assert raw[-8:] == bytes.fromhex("57fb808b247547db")


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_data_alignment(tmp_path, alignment):
    tensors = {"a": np.ones(3, np.int8), "b": np.arange(5.0), "c": np.zeros(0, np.float32), "d": np.int16(7)}
    write_checkpoint(tmp_path / "c", tensors, data_alignment=alignment)
    with CheckpointReader(tmp_path / "c") as reader:
        for info in reader.infos.values():
            assert info.offset % alignment == 0
        for name, value in tensors.items():
            assert reader[name].tobytes() == np.asarray(value).tobytes()


@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_shards(tmp_path, num_shards):
    tensors = {f"t{i}": np.full(i + 1, i, np.int64) for i in range(4)}
    write_checkpoint(tmp_path / "c", tensors, num_shards=num_shards)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"c.data-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)] + ["c.index"]
    with CheckpointReader(tmp_path / "c") as reader:
        assert reader.header.num_shards == num_shards
        assert {reader.info(n).shard for n in tensors} == set(range(min(num_shards, 4)))
        for name, value in tensors.items():
            assert np.array_equal(reader[name], value)


def test_writer_streams_and_chooses_shards(tmp_path):
    with CheckpointWriter(tmp_path / "c", num_shards=2) as writer:
        assert writer.add("big", np.zeros(100, np.uint8), shard=1) == "big"
        writer.add("x", np.ones(3, np.uint8))
        with pytest.raises(ValueError, match="added twice"):
            writer.add("x", np.ones(3))
        with pytest.raises(ValueError, match="out of range"):
            writer.add("y", 1, shard=2)
    reader = CheckpointReader(tmp_path / "c")
    assert reader.info("big").shard == 1 and reader.info("x").shard == 0


@pytest.mark.parametrize("name", ["", "\x00slice"])
def test_reserved_names(tmp_path, name):
    with pytest.raises(ValueError, match="reserved"):
        write_checkpoint(tmp_path / "c", {name: np.zeros(1)})


def test_failed_write_leaves_nothing_and_keeps_the_old_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "c", {"w": np.ones(2)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def tensors():
        yield "w", np.zeros(2)
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_checkpoint(tmp_path / "c", tensors(), overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


class _FailingFile:
    """A data file that accepts a few bytes of its next write, then reports a full disk."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        self.real.write(bytes(memoryview(data).cast("B")[:3]))
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_write_that_fails_midway_poisons_the_writer(tmp_path):
    write_checkpoint(tmp_path / "c", {"w": np.ones(2)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(RuntimeError, match="an add\\(\\) failed while writing; the checkpoint was not written"):
        with CheckpointWriter(tmp_path / "c", overwrite=True) as writer:
            writer.add("a", np.arange(4, dtype=np.float32))
            writer._files[0] = _FailingFile(writer._files[0])
            with pytest.raises(OSError, match="No space left"):
                writer.add("b", np.arange(4, dtype=np.float32))  # 3 of its 16 bytes reached the file
            with pytest.raises(RuntimeError, match="earlier add\\(\\) failed"):
                writer.add("c", np.arange(4, dtype=np.float32))  # would be stored at a wrong offset
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_index_that_cannot_be_built_keeps_the_old_data_files(tmp_path, monkeypatch):
    import fastckpt.formats.tf.writer as writer_module

    write_checkpoint(tmp_path / "c", {"w": np.ones(2)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    class BrokenBuilder(writer_module.TableBuilder):
        def finish(self):
            raise MemoryError("index")

    monkeypatch.setattr(writer_module, "TableBuilder", BrokenBuilder)
    with pytest.raises(MemoryError, match="index"):
        write_checkpoint(tmp_path / "c", {"w": np.zeros(2)}, overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_unsupported_dtype(tmp_path):
    with pytest.raises(TypeError, match="'when'.*no TensorFlow equivalent"):
        write_checkpoint(tmp_path / "c", {"when": np.array(["2020-01-01"], dtype="datetime64[D]")})


def test_to_host_objects_are_stored(tmp_path):
    class DeviceTensor:
        def to_host(self):
            return np.arange(3, dtype=np.float32)

    write_checkpoint(tmp_path / "c", {"d": DeviceTensor()})
    assert CheckpointReader(tmp_path / "c")["d"].tolist() == [0.0, 1.0, 2.0]


def test_save_counts_and_keeps(tmp_path):
    prefixes = [save(tmp_path, {"step": np.int64(i)}, max_to_keep=2) for i in range(3)]
    assert [os.path.basename(p) for p in prefixes] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3")
    assert sorted(p.name for p in tmp_path.glob("*.index")) == ["ckpt-2.index", "ckpt-3.index"]
    assert not list(tmp_path.glob("ckpt-1.*"))
    assert (tmp_path / "checkpoint").read_text() == ('model_checkpoint_path: "ckpt-3"\n'
                                                     'all_model_checkpoint_paths: "ckpt-2"\n'
                                                     'all_model_checkpoint_paths: "ckpt-3"\n')
    with CheckpointReader(tmp_path) as reader:  # a directory resolves through the state file
        assert reader["step"] == 2


def test_save_with_object_graph_stores_the_counter(tmp_path):
    save(tmp_path, {"w": np.zeros(1)}, object_graph=True)
    prefix = save(tmp_path, {"w": np.ones(1)}, object_graph=True)
    with CheckpointReader(prefix) as reader:
        assert reader["save_counter/.ATTRIBUTES/VARIABLE_VALUE"] == 2
        assert reader["save_counter/.ATTRIBUTES/VARIABLE_VALUE"].shape == ()


@pytest.mark.parametrize("name", ["a", "a.b", "a/b", "..S/.", "\u00e9.\u00e9"])
def test_escape_round_trip(name):
    assert unescape_local_name(escape_local_name(name)) == name
    assert "/" not in escape_local_name(name)


def test_object_graph_structure(tmp_path):
    write_checkpoint(tmp_path / "c", {"model/dense/kernel": np.ones((2, 2), np.float32),
                                      "model/dense/bias": np.zeros(2, np.float32),
                                      object_key(["model", "w", "a/b.c"]): np.arange(2)}, object_graph=True)
    with CheckpointReader(tmp_path / "c") as reader:
        assert reader.tensor_names() == [
            "_CHECKPOINTABLE_OBJECT_GRAPH", "model/dense/bias/.ATTRIBUTES/VARIABLE_VALUE",
            "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE", "model/w/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE",
            "save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
        graph = reader.object_graph()
        paths = graph.paths()
        by_path = {tuple(p): graph.nodes[i] for i, p in paths.items()}
        assert [name for _, name in by_path[()].children] == ["model", "save_counter"]
        assert by_path[("model", "w", "a/b.c")].attributes == [
            ("VARIABLE_VALUE", "model/w/a/b.c", "model/w/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE")]
        assert all(node.has_checkpoint_values for node in graph.nodes)


def test_object_graph_refuses_optimizer_slots(tmp_path):
    with pytest.raises(ValueError, match="OPTIMIZER_SLOT"):
        write_checkpoint(tmp_path / "c", {"v/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE": np.zeros(1)},
                         object_graph=True)


def test_reader_accepts_pathlike_and_writer_returns_nothing(tmp_path):
    assert write_checkpoint(Path(tmp_path) / "c", {"w": np.zeros(1)}) is None
    assert CheckpointReader(Path(tmp_path) / "c").tensor_names() == ["w"]


# -- the entry encoder built in C ------------------------------------------------------------------

def _python_entry(dtype, shape, shard, offset, size, crc):
    """BundleEntryProto by the Python field encoders alone (what encode_entry wrote before the C path)."""
    from fastckpt.formats.tf import proto

    out = bytearray(proto._int_field(1, dtype))
    out += proto._len_field(2, proto.encode_shape(shape))
    out += proto._int_field(3, shard) + proto._int_field(4, offset) + proto._int_field(5, size)
    return bytes(out + proto._tag(6, 5) + crc.to_bytes(4, "little"))


_U64 = [0, 1, 127, 128, 16383, 16384, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]


@pytest.mark.parametrize("seed", range(4))
def test_the_c_entry_encoder_writes_the_python_encoders_bytes(seed):
    import random

    from fastckpt._native.tftable import encode_plain_entry

    from fastckpt.formats.tf.proto import encode_entry

    rng = random.Random(seed)

    def pick():
        return rng.choice(_U64) if rng.random() < 0.5 else rng.randrange(0, 2 ** rng.randrange(1, 64))

    for _ in range(5000):
        args = (pick() % 2**32, tuple(pick() for _ in range(rng.randrange(0, 9))), pick(), pick(), pick(),
                rng.randrange(0, 2**32))
        assert encode_plain_entry(*args) == _python_entry(*args), args
    # the most dimensions it takes; beyond them, and negative values, the Python encoder writes the entry
    assert encode_plain_entry(1, tuple(range(64)), 0, 0, 0, 5) == _python_entry(1, tuple(range(64)), 0, 0, 0, 5)
    with pytest.raises(ValueError):
        encode_plain_entry(1, tuple(range(65)), 0, 0, 0, 5)
    for shape in (tuple(range(65)), (2, -1)):
        assert encode_entry(1, shape, offset=3, size=4, crc32c=7) == _python_entry(1, shape, 0, 3, 4, 7)
