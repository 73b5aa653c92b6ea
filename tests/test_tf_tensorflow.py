"""Real TensorFlow reads and restores fastckpt-written checkpoints (skipped without tensorflow)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from fastckpt.tf import CheckpointReader, object_key, save, save_object, write_checkpoint  # noqa: E402

VALUES = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
    "f64": np.array([np.pi, -0.0, 1e-300]),
    "f16": np.array([1.5, -65504], np.float16),
    "bf16": np.array([1.0, -3.140625], ml_dtypes.bfloat16),
    "i8": np.array([-128, 127], np.int8),
    "i16": np.array([-32768, 32767], np.int16),
    "i32": np.array([[-(2**31)], [2**31 - 1]], np.int32),
    "i64": np.array([-(2**63), 2**63 - 1], np.int64),
    "u8": np.array([0, 255], np.uint8),
    "u16": np.array([65535], np.uint16),
    "u32": np.array([2**32 - 1], np.uint32),
    "u64": np.array([2**64 - 1], np.uint64),
    "bool": np.array([True, False]),
    "c64": np.array([1 + 2j], np.complex64),
    "c128": np.array([-1e300j], np.complex128),
    "scalar": np.float32(2.5),
    "empty": np.zeros((0, 4), np.float32),
    "strings": np.array([b"ab", b"", b"xyz" * 50, "gr\u00fc\u00df".encode()], dtype=object),
    "string scalar": np.array(b"\x00\xff", dtype=object),
    "gew\u00e9\u00efght/\u4e2d": np.array([7], np.int32),
}


@pytest.mark.parametrize("num_shards,alignment", [(1, 1), (3, 64)])
def test_tensorflow_reads_every_dtype(tmp_path, num_shards, alignment):
    prefix = str(tmp_path / "ckpt-1")
    write_checkpoint(prefix, VALUES, num_shards=num_shards, data_alignment=alignment)
    assert tf.train.list_variables(prefix) == sorted((n, list(np.shape(v))) for n, v in VALUES.items())
    reader = tf.train.load_checkpoint(prefix)
    for name, value in VALUES.items():
        got = reader.get_tensor(name)
        if np.asarray(value).dtype == object:
            assert np.asarray(got, dtype=object).tolist() == value.tolist(), name
        else:
            assert got.dtype == value.dtype, name
            assert got.shape == np.shape(value), name
            assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), name


def test_tensorflow_reads_a_multi_block_index(tmp_path):
    names = [f"layer_{i:04d}/" + "k" * 1000 for i in range(300)]
    prefix = str(tmp_path / "many")
    write_checkpoint(prefix, {n: np.array([i], np.int32) for i, n in enumerate(names)}, fsync=False)
    reader = tf.train.load_checkpoint(prefix)
    for i in (0, 15, 16, 150, 299):  # get_tensor takes TensorFlow's seek path through the index
        assert reader.get_tensor(names[i]).tolist() == [i]


def test_directory_and_latest_checkpoint(tmp_path):
    save(tmp_path, {"w": np.zeros(2)})
    prefix = save(tmp_path, {"w": np.ones(2)})
    assert tf.train.latest_checkpoint(str(tmp_path)) == prefix
    assert tf.train.load_checkpoint(str(tmp_path)).get_tensor("w").tolist() == [1.0, 1.0]


class _Dense(tf.Module):
    def __init__(self):
        super().__init__()
        self.kernel = tf.Variable(tf.zeros((2, 3)))
        self.bias = tf.Variable(tf.zeros(3))


class _Model(tf.Module):
    def __init__(self):
        super().__init__()
        self.dense = _Dense()
        self.table = {"a/b.c": tf.Variable(tf.zeros(2, tf.int64))}


def test_checkpoint_restore_with_object_graph_consumes_everything(tmp_path):
    kernel = np.arange(6, dtype=np.float32).reshape(2, 3)
    prefix = str(tmp_path / "ckpt-1")
    write_checkpoint(prefix, {"model/dense/kernel": kernel, "model/dense/bias": np.ones(3, np.float32),
                              object_key(["model", "table", "a/b.c"]): np.array([5, -6])}, object_graph=True)
    model = _Model()
    status = tf.train.Checkpoint(model=model).restore(prefix)
    status.assert_consumed()
    assert model.dense.kernel.numpy().tobytes() == kernel.tobytes()
    assert model.table["a/b.c"].numpy().tolist() == [5, -6]


def test_checkpointable_object_restored_by_tensorflow(tmp_path):
    class Dense:
        def __init__(self):
            self.kernel = np.full((2, 3), 4.0, np.float32)
            self.bias = np.array([1, 2, 3], np.float32)

    class Holder:
        def __init__(self):
            self.model = type("M", (), {})()
            self.model.dense = Dense()

    class DenseModel(tf.Module):
        def __init__(self):
            super().__init__()
            self.dense = _Dense()

    save_object(Holder(), tmp_path, "ckpt-1", object_graph=True)
    model = DenseModel()
    tf.train.Checkpoint(model=model).restore(str(tmp_path / "ckpt-1")).assert_consumed()
    assert model.dense.bias.numpy().tolist() == [1.0, 2.0, 3.0]
    assert model.dense.kernel.numpy().tolist() == [[4.0] * 3] * 2


def test_fastckpt_reads_tensorflow_multi_block_index_exactly(tmp_path):
    """A TF-written index with several 256 KiB data blocks, made here rather than stored (it is large)."""
    variables = {f"v{i:03d}_" + "n" * 4000: tf.Variable(np.arange(i, i + 3, dtype=np.float32)) for i in range(140)}
    ckpt = tf.train.Checkpoint(**{name: v for name, v in variables.items()})
    prefix = ckpt.write(str(tmp_path / "tf"))
    tf_reader = tf.train.load_checkpoint(prefix)
    with CheckpointReader(prefix) as reader:
        assert reader.num_data_blocks >= 2
        assert reader.tensor_names() == sorted(tf_reader.get_variable_to_shape_map())
        for name in reader.tensor_names():
            got = reader[name]
            expected = tf_reader.get_tensor(name)
            if got.dtype == object:
                assert got[()] == expected
            else:
                assert got.tobytes() == np.asarray(expected).tobytes()
