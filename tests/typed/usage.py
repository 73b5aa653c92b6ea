"""A typed program using fastckpt's public API: tests/test_typing.py runs mypy over it (never executed).

Each ``assert_type`` fails type checking when the call's type is not the one named, and an ``Any`` is never the one
named; with ``--disallow-any-expr`` any expression of type ``Any`` is an error too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import assert_type

import numpy as np
import pyopencl as cl

import fastckpt
from fastckpt import MappedFile, TensorInfo, TensorReader
from fastckpt.device.load import LoadedTensors
from fastckpt.device.pool import PersistentBufferPool
from fastckpt.device.tensor import Tensor
from fastckpt.formats.tree import ArrayTree
from fastckpt.io import load_model, save_model
from fastckpt.io.serialization import ModelLoadReport
from fastckpt.nn import Sequential
from fastckpt.stateful import Checkpoint
from fastckpt.tf import CheckpointReader, write_checkpoint
from fastckpt.train import CheckpointManager, CheckpointState, load_checkpoint

tensors: dict[str, np.ndarray] = {"w": np.zeros(3, np.float32)}

assert_type(fastckpt.save_safetensors("m.safetensors", tensors, metadata={"k": "v"}), None)
assert_type(fastckpt.save_npz("m.npz", tensors), None)
assert_type(fastckpt.save_bytes(tensors), bytes)
assert_type(fastckpt.load_bytes(b""), dict[str, np.ndarray])
assert_type(fastckpt.save_tree("t.safetensors", {"params": {"w": tensors["w"]}}), None)
tree = fastckpt.load_tree("t.safetensors")
assert_type(tree, ArrayTree)
branch = tree["params"]
if isinstance(branch, dict):
    assert_type(branch, ArrayTree)

with fastckpt.open("m.safetensors") as f:
    assert_type(f, TensorReader)
    assert_type(f.host("w"), np.ndarray)
    assert_type(f.info("w"), TensorInfo)
    assert_type(f.infos, Mapping[str, TensorInfo])
    assert_type(f.keys(), Iterable[str])
    assert_type(f.metadata, dict[str, str] | None)
    assert_type(f.info("w").shape, tuple[int, ...])
    assert_type(f.info("w").offset, int)
    # The reader is a read-only mapping, as the docs use it (len(f), f.hosts(), f[name]).
    assert_type(f.hosts(), dict[str, np.ndarray])
    assert_type(f.hosts(["w"]), dict[str, np.ndarray])
    assert_type(len(f), int)
    assert_type(f["w"], np.ndarray)
    assert_type("w" in f, bool)
    assert_type(list(f), list[str])

assert_type(fastckpt.save_sharded("hf", tensors), list[str])
with fastckpt.HFShardedDirectory("hf") as shards:
    assert_type(shards, fastckpt.HFShardedDirectory)
    assert_type(shards.host("w"), np.ndarray)
write_checkpoint("tf/model", tensors)
with CheckpointReader("tf/model") as tf_reader:
    assert_type(tf_reader, CheckpointReader)
    assert_type(tf_reader.tensor_names(), list[str])
    assert_type(tf_reader.read_tensor("w"), np.ndarray)

reader = fastckpt.open("m.npz")
assert_type(reader, TensorReader)
reader.close()

with MappedFile("m.safetensors") as mapped:
    assert_type(mapped, MappedFile)
    assert_type(mapped.size, int)
    assert_type(mapped.read(0, 8), bytes)


def device_loads(queue: cl.CommandQueue, pool: PersistentBufferPool) -> None:
    loaded = fastckpt.load_file("m.safetensors", queue, pool=pool)
    assert_type(loaded, LoadedTensors)
    assert_type(loaded["w"], Tensor)
    assert_type(loaded["w"].to_host(), np.ndarray)
    model = load_model("model.netcl", queue, pool)
    assert isinstance(model, Sequential)
    assert_type(model.load_report, ModelLoadReport)
    assert_type(model.load_report.missing_keys, list[str])
    assert_type(save_model(model, "model.netcl"), None)


stateful_checkpoint = Checkpoint()
assert_type(stateful_checkpoint, Checkpoint)

state = load_checkpoint("runs/c")
assert_type(state, CheckpointState)
assert_type(state.step, int)
manager = CheckpointManager("runs/exp1", max_to_keep=3)
assert_type(manager.all_steps(), list[int])
