"""Write the golden TensorFlow checkpoints under tests/data/tf/ with real TensorFlow.

Needs ``pip install tensorflow-cpu==2.21.0`` (not a project dependency). Run from
the repository root::

    python tools/make_tf_fixtures.py [--out tests/data/tf]

Each fixture directory gets the files TensorFlow wrote plus ``expected.json``:
for every tensor TensorFlow's own reader lists, its dtype, shape and the exact
little-endian bytes of its values (``hex``), or for string tensors the hex of
each element, all taken from ``tf.train.load_checkpoint(...).get_tensor``.
The tests compare fastckpt's reads with these bytes, so they check values to
the last bit without TensorFlow installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


def _expected(prefix: str) -> dict:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    out = {}
    for name in sorted(shapes):
        value = reader.get_tensor(name)
        dtype = dtypes[name]
        entry = {"tf_dtype": dtype.name, "shape": list(shapes[name])}
        if dtype == tf.string:
            arr = np.asarray(value, dtype=object)
            entry["strings"] = [bytes(x).hex() for x in arr.reshape(-1)]
        else:
            arr = np.ascontiguousarray(np.asarray(value))
            entry["dtype"] = str(arr.dtype)
            entry["hex"] = arr.astype(arr.dtype.newbyteorder("<")).tobytes().hex()
        out[name] = entry
    return out


def object_based(root: Path) -> str:
    """tf.train.Checkpoint of a tf.Module: object keys, escaping, many dtypes, scalar, zero-size, strings."""
    import tensorflow as tf

    class Dense(tf.Module):
        def __init__(self):
            super().__init__()
            self.kernel = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) / 7, name="kernel")
            self.bias = tf.Variable(np.array([0.5, -1.25, 3e-8], np.float32), name="bias")

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.dense = Dense()
            self.f64 = tf.Variable(np.array([np.pi, -0.0, 1e300]), name="f64")
            self.f16 = tf.Variable(np.array([1.5, -2.0, 65504.0], np.float16), name="f16")
            self.bf16 = tf.Variable(tf.constant([1.0, -3.140625, 1e30], tf.bfloat16), name="bf16")
            self.i8 = tf.Variable(np.array([-128, 0, 127], np.int8), name="i8")
            self.i16 = tf.Variable(np.array([-32768, 1, 32767], np.int16), name="i16")
            self.i32 = tf.Variable(np.array([[-(2**31), 7], [2**31 - 1, 0]], np.int32), name="i32")
            self.i64 = tf.Variable(np.array([-(2**63), 2**63 - 1], np.int64), name="i64")
            self.u8 = tf.Variable(np.array([0, 200, 255], np.uint8), name="u8")
            self.flag = tf.Variable(np.array([True, False, True]), name="flag")
            self.c64 = tf.Variable(np.array([1 + 2j, -0.5j], np.complex64), name="c64")
            self.scalar = tf.Variable(np.float32(42.0), name="scalar")
            self.empty = tf.Variable(np.zeros((0, 4), np.float32), name="empty")
            self.text = tf.Variable(tf.constant([b"ab", b"", b"xyz" * 50, "gr\u00fc\u00df".encode()]), name="text")
            self.table = {"a/b.c": tf.Variable(np.array([1, 2], np.int64), name="w")}

    directory = root / "object_based"
    ckpt = tf.train.Checkpoint(model=Model())
    return ckpt.save(str(directory / "ckpt"))


def name_based(root: Path) -> str:
    """tf.compat.v1.train.Saver: plain variable names, an Adam step, a partitioned variable."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        kernel = v1.get_variable("dense/kernel", initializer=np.arange(6, dtype=np.float32).reshape(2, 3))
        bias = v1.get_variable("dense/bias", initializer=np.array([1.0, 2.0, 3.0], np.float32))
        emb_value = np.arange(15, dtype=np.float32).reshape(5, 3)
        emb = v1.get_variable("emb", shape=[5, 3], initializer=v1.zeros_initializer(),
                              partitioner=v1.fixed_size_partitioner(2))
        parts, start = [], 0
        for part in emb:  # rows 0-2 and 3-4: write the full value slice by slice
            rows = part.shape[0]
            parts.append(part.assign(emb_value[start:start + rows]))
            start += rows
        step = v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(tf.matmul(tf.ones((1, 2)), kernel) + bias) + tf.reduce_sum(emb.as_tensor())
        train = v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        saver = v1.train.Saver()
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(parts)
            sess.run(train)
            directory = root / "name_based"
            directory.mkdir(parents=True, exist_ok=True)
            return saver.save(sess, str(directory / "model"), write_meta_graph=False)


def sharded(root: Path) -> str:
    """Two data shards: variables on two devices, saved with Saver(sharded=True)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            a = v1.get_variable("a", initializer=np.arange(4, dtype=np.int32))
        with tf.device("/cpu:1"):
            b = v1.get_variable("b", initializer=np.linspace(0, 1, 5).astype(np.float64))
        del a, b
        saver = v1.train.Saver(sharded=True)
        config = v1.ConfigProto(device_count={"CPU": 2})
        with v1.Session(graph=graph, config=config) as sess:
            sess.run(v1.global_variables_initializer())
            directory = root / "sharded"
            directory.mkdir(parents=True, exist_ok=True)
            return saver.save(sess, str(directory / "model"), write_meta_graph=False)


FIXTURES = {"object_based": object_based, "name_based": name_based, "sharded": sharded}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/tf", type=Path)
    args = parser.parse_args(argv)
    import tensorflow as tf

    expected = {"tensorflow": tf.__version__}
    for name, make in FIXTURES.items():
        directory = args.out / name
        if directory.exists():
            shutil.rmtree(directory)
        prefix = make(args.out)
        for extra in directory.glob("*.meta"):
            extra.unlink()
        rel = os.path.relpath(prefix, args.out)
        expected[name] = {"prefix": rel, "files": sorted(p.name for p in directory.iterdir()),
                          "tensors": _expected(prefix)}
        print(f"{name}: {rel} ({len(expected[name]['tensors'])} tensors)", file=sys.stderr)
    (args.out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
