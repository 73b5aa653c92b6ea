"""The Checkpointable protocol: names from attribute paths, separators, ignores, name maps, restore by name."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from fastckpt.tf import (
    Checkpointable,
    CheckpointReader,
    RestoreMismatchError,
    checkpoint_tensors,
    identity_map,
    lookup_map,
    restore_object,
    save_object,
    write_checkpoint,
)


@dataclass
class Conv2D:
    filter: np.ndarray
    bias: np.ndarray


@dataclass
class Dense:
    weight: np.ndarray
    bias: np.ndarray


@dataclass
class LeNet(Checkpointable):
    conv1: Conv2D = field(default_factory=lambda: Conv2D(np.ones((5, 5, 1, 6), np.float32), np.zeros(6, np.float32)))
    conv2: Conv2D = field(default_factory=lambda: Conv2D(np.ones((5, 5, 6, 16), np.float32), np.zeros(16, np.float32)))
    fc1: Dense = field(default_factory=lambda: Dense(np.ones((400, 120), np.float32), np.zeros(120, np.float32)))
    fc2: Dense = field(default_factory=lambda: Dense(np.ones((120, 84), np.float32), np.zeros(84, np.float32)))
    fc3: Dense = field(default_factory=lambda: Dense(np.ones((84, 10), np.float32), np.zeros(10, np.float32)))
    activation: str = "relu"  # not an array: not saved
    dropout: float = 0.5


def filled(model, start=0.0):
    """Give every leaf distinct values so restores are checked element by element."""
    for i, value in enumerate(checkpoint_tensors(model).values()):
        value[...] = np.arange(value.size, dtype=value.dtype).reshape(value.shape) + start + 1000 * i
    return model


def test_lenet_names_like_swift():
    names = list(checkpoint_tensors(LeNet()))
    assert names == ["conv1/filter", "conv1/bias", "conv2/filter", "conv2/bias", "fc1/weight", "fc1/bias",
                     "fc2/weight", "fc2/bias", "fc3/weight", "fc3/bias"]


def test_lists_dicts_and_plain_objects():
    class Block:
        def __init__(self, n):
            self.scale = np.full(2, n, np.float32)
            self.name = f"block{n}"

    class Model:
        def __init__(self):
            self.blocks = [Block(0), Block(1)]
            self.heads = {"cls": Dense(np.zeros(1), np.zeros(1))}
            self.pair = (np.zeros(1), np.ones(1))

    assert list(checkpoint_tensors(Model())) == ["blocks/[0]/scale", "blocks/[1]/scale", "heads/cls/weight",
                                                 "heads/cls/bias", "pair/[0]", "pair/[1]"]


def test_slots_and_cycles():
    class Slotted:
        __slots__ = ("w", "parent")

        def __init__(self):
            self.w = np.zeros(1)
            self.parent = None

    class Root:
        def __init__(self):
            self.child = Slotted()
            self.child.parent = self  # a cycle back to the root is not followed

    assert list(checkpoint_tensors(Root())) == ["child/w"]


def test_separator_from_the_root_applies_below():
    @dataclass
    class Fire(Checkpointable):
        squeeze: Conv2D
        expand3: Conv2D

    @dataclass
    class SqueezeNet(Checkpointable):
        checkpoint_separator = "_"
        fire2: Fire

    conv = Conv2D(np.zeros(1), np.zeros(1))
    net = SqueezeNet(Fire(conv, Conv2D(np.zeros(1), np.zeros(1))))
    assert list(checkpoint_tensors(net)) == ["fire2_squeeze_filter", "fire2_squeeze_bias", "fire2_expand3_filter",
                                             "fire2_expand3_bias"]


def test_a_class_can_set_its_own_separator():
    class Inner:
        checkpoint_separator = "."

        def __init__(self):
            self.layer = {"w": np.zeros(1)}

    class Outer:
        def __init__(self):
            self.inner = Inner()

    assert list(checkpoint_tensors(Outer())) == ["inner.layer.w"]  # joins below Inner use its separator
    assert list(checkpoint_tensors(Outer(), separator=":")) == ["inner:layer:w"]


def test_ignored_tensor_paths_on_root_and_on_a_class():
    @dataclass
    class Attention:
        wqkv: Dense
        scale: np.ndarray

    @dataclass
    class GPT(Checkpointable):
        ignored_tensor_paths = {"Attention.scale"}
        layers: list

    def attention():
        return Attention(Dense(np.zeros(2), np.zeros(2)), np.ones(()))

    gpt = GPT([attention(), attention()])
    assert list(checkpoint_tensors(gpt)) == ["layers/[0]/wqkv/weight", "layers/[0]/wqkv/bias",
                                             "layers/[1]/wqkv/weight", "layers/[1]/wqkv/bias"]

    class SelfIgnoring:
        ignored_tensor_paths = {"SelfIgnoring.cache"}

        def __init__(self):
            self.w = np.zeros(1)
            self.cache = np.zeros(1)

    assert list(checkpoint_tensors({"a": SelfIgnoring()})) == ["a/w"]
    assert list(checkpoint_tensors({"a": SelfIgnoring()}, ignored={"SelfIgnoring.w"})) == []


def test_name_maps():
    table = {"fc3/weight": "logits/kernel", "fc3/bias": "logits/bias"}
    names = list(checkpoint_tensors(LeNet(), name_table=table))
    assert names[-2:] == ["logits/kernel", "logits/bias"] and names[0] == "conv1/filter"
    assert list(checkpoint_tensors(LeNet(), name_map=str.upper))[0] == "CONV1/FILTER"
    assert identity_map("x") == "x" and lookup_map({"a": "b"})("a") == "b"

    @dataclass
    class Mapped(Checkpointable):
        tensor_name_map = lookup_map({"w": "model/w"})
        w: np.ndarray = field(default_factory=lambda: np.zeros(1))

    @dataclass
    class MappedByMethod(Checkpointable):
        w: np.ndarray = field(default_factory=lambda: np.zeros(1))

        def tensor_name_map(self, name):
            return "m/" + name

    assert list(checkpoint_tensors(Mapped())) == ["model/w"]
    assert list(checkpoint_tensors(MappedByMethod())) == ["m/w"]
    with pytest.raises(ValueError, match="both map to"):
        checkpoint_tensors(LeNet(), name_map=lambda n: "same")
    with pytest.raises(ValueError, match="name_map or name_table"):
        checkpoint_tensors(LeNet(), name_map=str.upper, name_table={})


def test_save_and_restore_round_trip(tmp_path):
    model = filled(LeNet())
    prefix = model.save_checkpoint(tmp_path, "LeNet")
    assert CheckpointReader(prefix).tensor_names() == sorted(checkpoint_tensors(model))
    fresh = LeNet()
    alias = fresh.fc1.weight
    result = fresh.restore_checkpoint(tmp_path, "LeNet")
    assert result.ok and len(result.restored) == 10
    for name, value in checkpoint_tensors(model).items():
        assert np.array_equal(checkpoint_tensors(fresh)[name], value)
    assert alias is fresh.fc1.weight  # updated in place: other references see the restored values


def test_restore_is_by_name_not_position(tmp_path):
    model = filled(LeNet())
    tensors = checkpoint_tensors(model)
    write_checkpoint(tmp_path / "shuffled", dict(reversed(list(tensors.items()))))
    fresh = LeNet()
    restore_object(fresh, tmp_path, "shuffled")
    assert np.array_equal(fresh.conv1.bias, model.conv1.bias)
    assert np.array_equal(fresh.fc3.weight, model.fc3.weight)


def test_restore_with_ignored_paths(tmp_path):
    @dataclass
    class Attention(Checkpointable):
        ignored_tensor_paths = {"Attention.scale"}
        w: np.ndarray = field(default_factory=lambda: np.zeros(3, np.float32))
        scale: np.ndarray = field(default_factory=lambda: np.full((), 0.125, np.float32))

    src = Attention(np.arange(3, dtype=np.float32))
    save_object(src, tmp_path, "attn")
    dst = Attention()
    result = restore_object(dst, tmp_path, "attn")
    assert result.restored == ["w"] and result.ok
    assert dst.w.tolist() == [0.0, 1.0, 2.0] and dst.scale == np.float32(0.125)


def test_non_ascii_names(tmp_path):
    class Modell:
        def __init__(self, v):
            self.gewéïcht = np.full(2, v, np.float32)
            self.schicht = {"\u4e2d\u6587": np.full(1, v, np.int64), "\U0001f600": np.full(1, v, np.int8)}

    save_object(Modell(3), tmp_path, "m\u00e9")
    assert CheckpointReader(tmp_path / "m\u00e9").tensor_names() == sorted(
        ["gew\u00e9\u00efcht", "schicht/\u4e2d\u6587", "schicht/\U0001f600"], key=str.encode)
    dst = Modell(0)
    assert restore_object(dst, tmp_path, "m\u00e9").ok
    assert dst.gewéïcht.tolist() == [3.0, 3.0] and dst.schicht["\U0001f600"].tolist() == [3]


def test_missing_and_unexpected_are_reported(tmp_path):
    model = filled(LeNet())
    tensors = checkpoint_tensors(model)
    del tensors["fc3/bias"]
    tensors["extra/thing"] = np.zeros(1)
    write_checkpoint(tmp_path / "partial", tensors)

    fresh = LeNet()
    before = fresh.conv1.filter.copy()
    with pytest.raises(RestoreMismatchError, match="1 missing.*fc3/bias.*1 unexpected.*extra/thing") as err:
        restore_object(fresh, tmp_path, "partial")
    assert err.value.result.missing == ["fc3/bias"]
    assert np.array_equal(fresh.conv1.filter, before)  # strict mode changes nothing

    result = restore_object(fresh, tmp_path, "partial", strict=False)
    assert result.missing == ["fc3/bias"] and result.unexpected == ["extra/thing"]
    assert len(result.restored) == 9
    assert np.array_equal(fresh.conv1.filter, model.conv1.filter)


def test_damaged_checkpoint_changes_nothing(tmp_path):
    import re
    from pathlib import Path

    from fastckpt.errors import ChecksumMismatchError

    prefix = filled(LeNet()).save_checkpoint(tmp_path, "LeNet")
    with CheckpointReader(prefix) as reader:
        last = max(reader.infos.values(), key=lambda info: info.offset)  # the tensor a restore reaches last
    data = Path(prefix + ".data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[last.offset] ^= 0x01
    data.write_bytes(bytes(raw))
    fresh = LeNet()
    before = {name: value.copy() for name, value in checkpoint_tensors(fresh).items()}
    with pytest.raises(ChecksumMismatchError, match=re.escape(repr(last.name))):
        restore_object(fresh, tmp_path, "LeNet", strict=False)
    after = checkpoint_tensors(fresh)
    assert all(after[name].tobytes() == value.tobytes() for name, value in before.items())


def test_shape_and_dtype_mismatches(tmp_path):
    tensors = checkpoint_tensors(LeNet())
    tensors["fc3/bias"] = np.zeros(11, np.float32)
    tensors["fc2/bias"] = np.zeros(84, np.float64)
    write_checkpoint(tmp_path / "bad", tensors)
    with pytest.raises(RestoreMismatchError, match="2 mismatched"):
        restore_object(LeNet(), tmp_path, "bad")
    result = restore_object(LeNet(), tmp_path, "bad", strict=False)
    assert result.mismatched == [("fc2/bias", "float32[84]", "float64[84]"), ("fc3/bias", "float32[10]", "float32[11]")]


def test_object_graph_checkpoints_restore_by_name(tmp_path):
    model = filled(LeNet())
    save_object(model, tmp_path, "obj", object_graph=True)
    assert "conv1/filter/.ATTRIBUTES/VARIABLE_VALUE" in CheckpointReader(tmp_path / "obj")
    fresh = LeNet()
    assert restore_object(fresh, tmp_path, "obj").ok
    assert np.array_equal(fresh.fc2.weight, model.fc2.weight)


class DeviceTensor:
    """Stands in for a device tensor: to_host() for saving, write() for restoring."""

    def __init__(self, array):
        self.data = np.array(array)
        self.shape = self.data.shape
        self.dtype = self.data.dtype

    def to_host(self):
        return self.data.copy()

    def write(self, array):
        self.data[...] = array


class Immutable:
    """A leaf without write(): restored through from_host."""

    def __init__(self, array):
        self.data = np.array(array)

    def to_host(self):
        return self.data

    @classmethod
    def from_host(cls, array):
        return cls(np.array(array) * 1)


def test_pluggable_leaves(tmp_path):
    class Model:
        def __init__(self, v):
            self.dev = DeviceTensor(np.full(3, v, np.float32))
            self.imm = Immutable(np.full(2, v, np.int32))
            self.frozen = np.full(2, v, np.int16)
            self.frozen.flags.writeable = False

    save_object(Model(7), tmp_path, "m")
    dst = Model(0)
    dev = dst.dev
    restore_object(dst, tmp_path, "m")
    assert dst.dev is dev and dev.data.tolist() == [7, 7, 7]
    assert isinstance(dst.imm, Immutable) and dst.imm.data.tolist() == [7, 7]
    assert dst.frozen.tolist() == [7, 7] and dst.frozen.flags.writeable  # replaced by a copy

    calls = []
    restore_object(Model(0), tmp_path, "m", assign=lambda cur, arr: calls.append(arr.tolist()))
    assert sorted(calls) == [[7, 7], [7, 7], [7.0, 7.0, 7.0]]


def test_tuple_leaf_that_cannot_be_updated_in_place(tmp_path):
    class Model:
        def __init__(self, v):
            self.first = np.full(2, v)
            self.pair = (np.full(1, v),)

    save_object(Model(1.0), tmp_path, "t")
    dst = Model(0.0)
    dst.pair[0].flags.writeable = False
    with pytest.raises(TypeError, match=r"'pair/\[0\]' lives in a tuple"):
        restore_object(dst, tmp_path, "t")
    assert dst.first.tolist() == [0.0, 0.0]  # refused before anything was assigned


def test_callable_layers_are_walked():
    class Layer:
        def __init__(self):
            self.w = np.zeros(2)

        def __call__(self, x):
            return x @ self.w

    class Net:
        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.activation = np.tanh  # a ufunc: callable, not walked, not a leaf

    assert list(checkpoint_tensors(Net())) == ["layers/[0]/w", "layers/[1]/w"]


def test_shared_submodule_is_named_once_under_its_first_path():
    class Embedding:
        def __init__(self):
            self.table = np.zeros((4, 2))

    class Tied:
        def __init__(self):
            self.embed = Embedding()
            self.head = self.embed  # weight tying

    assert list(checkpoint_tensors(Tied())) == ["embed/table"]


@pytest.mark.device
def test_fastckpt_nn_modules_round_trip_through_a_tf_checkpoint(tmp_path):
    pytest.importorskip("pyopencl")
    import fastckpt.nn as nn
    from fastckpt.device import default

    queue = default().queue
    config = [{"type": "Linear", "args": {"in_features": 3, "out_features": 4}}, {"type": "ReLU"},
              {"type": "BatchNorm2d", "args": {"num_features": 4}}]
    source = nn.build_sequential(queue, config, seed=1)
    state = {k: np.random.default_rng(2).uniform(0.5, 1.5, v.shape).astype(v.dtype)
             for k, v in source.state_dict().items()}
    source.load_state_dict(state)
    save_object(source, tmp_path, "seq")
    assert CheckpointReader(tmp_path / "seq").tensor_names() == [
        "layers/[0]/bias", "layers/[0]/weight", "layers/[2]/beta", "layers/[2]/gamma", "layers/[2]/running_mean",
        "layers/[2]/running_var"]
    target = nn.build_sequential(queue, config, seed=3)
    assert restore_object(target, tmp_path, "seq").ok
    assert all(target.state_dict()[k].tobytes() == v.tobytes() for k, v in state.items())
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    assert target(x).to_host().tobytes() == source(x).to_host().tobytes()
