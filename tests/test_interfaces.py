"""The interfaces a new user reaches for: any array-like into every writer, PyTorch tensors, ``os.PathLike``
paths, ``fastckpt.open`` on a directory it cannot read, and netcl's module API (``eval``, ``train``, ``parameters``)."""

from __future__ import annotations

import array
import importlib
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt.arrays import as_numpy, to_numpy
from fastckpt.errors import CheckpointNotFoundError

from _writing import StateModel

# -- array-likes -----------------------------------------------------------------------------------


class ArrayOnly:
    """Only ``__array__`` (as pandas, xarray and PIL objects)."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


class DLPackOnly:
    """Only the DLPack protocol (as JAX and CuPy arrays): ``np.asarray`` alone would make an object array of it."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


# kind -> (make the value, the array every writer must store for it)
KINDS = {
    "memoryview": (lambda: memoryview(np.arange(4, dtype=np.float32)), np.arange(4, dtype=np.float32)),
    "memoryview 2-d": (lambda: memoryview(np.arange(6, dtype=np.int16).reshape(2, 3)),
                       np.arange(6, dtype=np.int16).reshape(2, 3)),
    "array.array": (lambda: array.array("i", [1, -2, 3]), np.array([1, -2, 3], np.int32)),
    "bytearray": (lambda: bytearray(b"abc"), np.array([97, 98, 99], np.uint8)),
    "numpy scalar": (lambda: np.int64(9), np.array(9, np.int64)),
    "__array__": (lambda: ArrayOnly(np.array([[0.5, 1.5]])), np.array([[0.5, 1.5]])),
    "DLPack": (lambda: DLPackOnly(np.arange(3, dtype=np.uint16)), np.arange(3, dtype=np.uint16)),
}


def _check(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def _read(path, name: str) -> np.ndarray:
    with fastckpt.open(path) as reader:
        return np.array(reader.host(name))


def _save_safetensors(tmp_path, value):
    fastckpt.save_safetensors(tmp_path / "t.safetensors", {"x": value})
    return _read(tmp_path / "t.safetensors", "x")


def _save_npz(tmp_path, value):
    fastckpt.save_npz(tmp_path / "t.npz", {"x": value})
    return _read(tmp_path / "t.npz", "x")


def _npz_writer(tmp_path, value):
    with fastckpt.NpzWriter(tmp_path / "w.npz") as w:
        w.add("x", value)
    return _read(tmp_path / "w.npz", "x")


def _tf_write_checkpoint(tmp_path, value):
    from fastckpt.tf import write_checkpoint

    write_checkpoint(tmp_path / "ckpt-1", {"x": value})
    return _read(tmp_path / "ckpt-1", "x")


def _save_sharded(tmp_path, value):
    fastckpt.save_sharded(tmp_path / "hf", {"x": value})
    return _read(tmp_path / "hf", "x")


def _save_bytes(fmt):
    def save(tmp_path, value):
        return fastckpt.load_bytes(fastckpt.save_bytes({"x": value}, format=fmt))["x"]
    return save


def _train_save_checkpoint(tmp_path, value):
    from fastckpt.train import load_checkpoint, save_checkpoint

    save_checkpoint(StateModel({"x": value}), None, None, None, None, tmp_path / "c", step=1)
    got = load_checkpoint(tmp_path / "c").model_weights["x"]
    return np.asarray(got)  # a numpy scalar stays one in a training tree (its JSON tag); the others are arrays


def _sharded_saver(tmp_path, value):
    from fastckpt.sharded import CheckpointReader, Saver

    Saver(path=tmp_path / "s", parallel=1, tensors={"x": value}).save()
    return CheckpointReader(tmp_path / "s").read_tensor("x")


def _io_save_params(tmp_path, value):
    from fastckpt.io.checkpoint import save_params

    save_params([value], tmp_path / "p.npz")
    return _read(tmp_path / "p.npz", "p0")


WRITERS = {
    "save_safetensors": _save_safetensors,
    "save_npz": _save_npz,
    "NpzWriter.add": _npz_writer,
    "tf.write_checkpoint": _tf_write_checkpoint,
    "save_sharded": _save_sharded,
    "save_bytes safetensors": _save_bytes("safetensors"),
    "save_bytes npz": _save_bytes("npz"),
    "train.save_checkpoint": _train_save_checkpoint,
    "sharded Saver": _sharded_saver,
    "io.save_params": _io_save_params,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_takes_every_kind_of_array(tmp_path, writer, kind):
    make, expected = KINDS[kind]
    _check(WRITERS[writer](tmp_path, make()), expected)


def test_train_checkpoint_keeps_a_numpy_scalar_a_scalar(tmp_path):
    from fastckpt.train import load_checkpoint, save_checkpoint

    save_checkpoint(StateModel({"n": np.int64(9), "w": bytearray(b"\x01")}), None, None, None, None, tmp_path / "c",
                    step=1)
    weights = load_checkpoint(tmp_path / "c").model_weights
    assert type(weights["n"]) is np.int64 and weights["n"] == 9
    _check(weights["w"], np.array([1], np.uint8))


@pytest.mark.parametrize("value", [b"ab", "ab", [1, 2], 3, 2.5, None, {"a": 1}, object()])
def test_as_numpy_leaves_what_is_not_array_like(value):
    assert as_numpy(value) is None


def test_to_numpy_converts_the_rest_as_numpy_does():
    _check(to_numpy([[1, 2]]), np.array([[1, 2]]))
    _check(to_numpy(b"ab"), np.array(b"ab"))
    view = memoryview(np.arange(6, dtype=np.float64))[::2]  # a strided buffer: viewed, not copied
    converted = to_numpy(view)
    _check(converted, np.array([0.0, 2.0, 4.0]))
    assert converted.strides == (16,)


def test_a_strided_buffer_is_written_in_order(tmp_path):
    value = memoryview(np.arange(6, dtype=np.int32))[::2]
    _check(_save_safetensors(tmp_path, value), np.array([0, 2, 4], np.int32))
    _check(_save_npz(tmp_path, value), np.array([0, 2, 4], np.int32))


# -- PyTorch -----------------------------------------------------------------------------------------


def test_torch_tensors_into_safetensors_and_npz(tmp_path):
    torch = pytest.importorskip("torch")
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    _check(_save_safetensors(tmp_path, weight), np.arange(6, dtype=np.float32).reshape(2, 3))
    _check(_save_npz(tmp_path, weight.detach().T), np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_torch_state_dict_through_train_save_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from fastckpt.train import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    expected = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    save_checkpoint(model, None, None, None, None, tmp_path / "c", step=1)
    weights = load_checkpoint(tmp_path / "c").model_weights
    assert sorted(weights) == ["bias", "weight"]
    for key, value in expected.items():
        _check(np.asarray(weights[key]), value)


def test_torch_state_dict_through_the_sharded_saver(tmp_path):
    torch = pytest.importorskip("torch")
    from fastckpt.sharded import CheckpointReader, Saver

    state = torch.nn.Linear(4, 2).state_dict()
    Saver(path=tmp_path / "s", parallel=1, tensors=dict(state)).save()
    reader = CheckpointReader(tmp_path / "s")
    for key, value in state.items():
        _check(reader.read_tensor(key), value.numpy())


# -- os.PathLike everywhere --------------------------------------------------------------------------

T = {"w": np.arange(4, dtype=np.float32)}


def _path_npz_writer(d: Path):
    with fastckpt.NpzWriter(d / "w.npz") as w:
        w.add("w", T["w"])
    return _read(str(d / "w.npz"), "w")


def _path_tf(d: Path):
    from fastckpt.tf import CheckpointReader, latest_checkpoint, save, write_checkpoint

    write_checkpoint(d / "tf" / "ckpt-1", T)
    save(d / "tf2", T)
    assert latest_checkpoint(d / "tf2") == str(d / "tf2" / "ckpt-1")
    with CheckpointReader(d / "tf" / "ckpt-1") as reader:
        return reader.host("w")


def _path_convert(d: Path):
    from fastckpt.convert import convert

    fastckpt.save_npz(d / "a.npz", T)
    convert(d / "a.npz", d / "b.safetensors")
    return _read(d / "b.safetensors", "w")


def _path_train(d: Path):
    from fastckpt.train import CheckpointManager, load_checkpoint, save_checkpoint

    save_checkpoint(StateModel(dict(T)), None, None, None, None, d / "c", step=1)
    assert load_checkpoint(d / "c").step == 1
    manager = CheckpointManager(d / "m")
    manager.save(3, StateModel(dict(T)))
    manager.wait()
    assert manager.latest() == d / "m" / "step-00000003"
    manager.close()
    return _read(d / "c", "weights/w")


def _path_sharded(d: Path):
    from fastckpt.sharded import CheckpointReader, Loader, Saver
    from fastckpt.sharded.reshard import reshard

    Saver(path=d / "s", parallel=1, tensors=dict(T)).save()
    reshard(d / "s", d / "s2", 2)
    _check(Loader(d / "s2").load()[1]["w"], T["w"])
    return CheckpointReader(d / "s2").read_tensor("w")


def _path_open_file(d: Path):
    from fastckpt.formats.reader import open_file

    fastckpt.save_safetensors(d / "a.safetensors", T)
    with open_file(d / "a.safetensors") as f:
        return np.array(f.host("w"))


def _path_mapped(d: Path):
    fastckpt.save_npz(d / "a.npz", T)
    with fastckpt.MappedFile(d / "a.npz") as m:
        assert m.path == str(d / "a.npz")
    return _read(d / "a.npz", "w")


def _path_stateful(d: Path):
    from fastckpt.stateful import Checkpoint

    checkpoint = Checkpoint()
    checkpoint.register(StateModel(dict(T)), "model")
    checkpoint.collect()
    assert checkpoint.save(d / "state{seq}.json") == str(d / "state0.json")
    loaded, target = Checkpoint(), StateModel({})
    assert loaded.load(d / "state{seq}.json") == str(d / "state0.json")
    loaded.register(target, "model")  # a loaded state is applied on registration
    return target.state["w"]


PATH_ENTRY_POINTS = {
    "save_safetensors + open": lambda d: (fastckpt.save_safetensors(d / "a.safetensors", T),
                                          _read(d / "a.safetensors", "w"))[1],
    "save_npz + open": lambda d: (fastckpt.save_npz(d / "a.npz", T), _read(d / "a.npz", "w"))[1],
    "NpzWriter": _path_npz_writer,
    "save_sharded + open": lambda d: (fastckpt.save_sharded(d / "hf", T), _read(d / "hf", "w"))[1],
    "open_file": _path_open_file,
    "MappedFile": _path_mapped,
    "tf": _path_tf,
    "convert": _path_convert,
    "train": _path_train,
    "sharded": _path_sharded,
    "stateful": _path_stateful,
}


@pytest.mark.parametrize("entry_point", PATH_ENTRY_POINTS)
def test_every_entry_point_takes_a_pathlib_path(tmp_path, entry_point):
    _check(np.asarray(PATH_ENTRY_POINTS[entry_point](tmp_path)), T["w"])


# -- fastckpt.open on a directory it cannot read -----------------------------------------------------


def _open_error(path) -> str:
    with pytest.raises(CheckpointNotFoundError) as e:
        fastckpt.open(path)
    return str(e.value)


def test_open_on_an_empty_directory_says_it_is_empty(tmp_path):
    message = _open_error(tmp_path)
    assert message.startswith(f"{tmp_path}: a directory fastckpt.open cannot read: it holds nothing (an empty "
                              "directory). fastckpt.open reads a fastckpt.train checkpoint (manifest.json), ")
    (tmp_path / ".w.npz.123.ab12cd34.partial").write_bytes(b"")
    assert _open_error(tmp_path).startswith(f"{tmp_path}: a directory fastckpt.open cannot read: it holds only the "
                                            "temporary files (*.partial) of an interrupted save. fastckpt.open reads ")


def test_open_on_a_manager_directory_names_its_latest_checkpoint(tmp_path):
    from fastckpt.train import CheckpointManager

    manager = CheckpointManager(tmp_path / "run")
    for step in (10, 20):
        manager.save(step, StateModel(dict(T)))
    manager.wait()
    manager.close()
    latest = tmp_path / "run" / "step-00000020"
    assert _open_error(tmp_path / "run") == (
        f"{tmp_path / 'run'}: a directory fastckpt.open cannot read: it is a fastckpt.train.CheckpointManager "
        f"directory of 2 checkpoint(s) (step-00000010, step-00000020): open one checkpoint, as "
        f"fastckpt.open({str(latest)!r}) (the latest), or restore with "
        f"CheckpointManager({str(tmp_path / 'run')!r}).restore_latest(model, ...)")
    with fastckpt.open(latest) as reader:  # and what the message says works
        _check(np.array(reader.host("weights/w")), T["w"])


def test_open_on_a_manager_directory_without_checkpoints_says_so(tmp_path):
    from fastckpt.train import CheckpointManager

    manager = CheckpointManager(tmp_path / "run", max_to_keep=1)
    manager.save(1, StateModel(dict(T)))
    manager.wait()
    for step in manager.all_steps():
        shutil.rmtree(manager.path_for(step))
    manager.close()
    assert sorted(os.listdir(tmp_path / "run")) == [".fastckpt-manager.json", ".fastckpt-manager.lock"]
    assert _open_error(tmp_path / "run") == (
        f"{tmp_path / 'run'}: a directory fastckpt.open cannot read: it is a fastckpt.train.CheckpointManager "
        f"directory that holds no checkpoint yet: save one with "
        f"CheckpointManager({str(tmp_path / 'run')!r}).save(step, model, ...)")


def test_open_on_a_directory_of_tensor_files_names_one(tmp_path):
    fastckpt.save_npz(tmp_path / "a.npz", T)
    fastckpt.save_safetensors(tmp_path / "b.safetensors", T)
    assert _open_error(tmp_path) == (
        f"{tmp_path}: a directory fastckpt.open cannot read: it holds 2 tensor file(s) (a.npz, b.safetensors) but "
        f"no index or manifest that makes them one checkpoint: open each file, as "
        f"fastckpt.open({str(tmp_path / 'a.npz')!r})")


def test_open_on_a_directory_with_a_model_file_names_load_model(tmp_path):
    fastckpt.save_npz(tmp_path / "m.netcl", T)
    assert _open_error(tmp_path).endswith(
        f"; a .netcl model loads with fastckpt.io.load_model({str(tmp_path / 'm.netcl')!r})")


def test_open_on_a_directory_of_checkpoints_names_one(tmp_path):
    from fastckpt.train import save_checkpoint

    save_checkpoint(StateModel(dict(T)), None, None, None, None, tmp_path / "run-a", step=1)
    assert _open_error(tmp_path) == (
        f"{tmp_path}: a directory fastckpt.open cannot read: its subdirectories run-a are checkpoints: open one, "
        f"as fastckpt.open({str(tmp_path / 'run-a')!r})")


def test_open_on_another_directory_lists_what_it_holds(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "data").mkdir()
    message = _open_error(tmp_path)
    assert message.startswith(f"{tmp_path}: a directory fastckpt.open cannot read: it holds data, notes.txt, none "
                              "of them a tensor file or checkpoint marker. fastckpt.open reads ")


# -- netcl's module interface ------------------------------------------------------------------------


def _model(queue):
    import fastckpt.nn as nn

    return nn.Sequential(nn.Linear(queue, 4, 3), nn.BatchNorm2d(queue, 3), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(queue, 3, 2, bias=False))


def test_eval_returns_the_model_and_training_is_false(queue):
    model = _model(queue)
    assert model.training is False
    assert model.eval() is model
    assert model.train(False) is model
    assert all(layer.training is False and layer.eval() is layer for layer in model)
    model.training = False  # netcl's setter spelling
    assert model.training is False


def test_train_true_raises_naming_the_layers(queue):
    model = _model(queue)
    with pytest.raises(NotImplementedError, match=re.escape(
            "Sequential(Linear, BatchNorm2d, ReLU, Dropout) is inference-only: fastckpt's layers have no training "
            "mode, so train(True) cannot be honoured. Call model.eval() or model.train(False)")):
        model.train()
    with pytest.raises(NotImplementedError, match=r"^Dropout is inference-only: "):
        model[3].train(True)
    with pytest.raises(NotImplementedError, match=r"^BatchNorm2d is inference-only: "):
        model[1].training = True


def test_parameters_are_netcls_no_buffers(queue):
    model = _model(queue)
    params = model.parameters()
    linear, bn, _, _, last = model
    assert [id(p) for p in params] == [id(linear.weight), id(linear.bias), id(bn.gamma), id(bn.beta),
                                       id(last.weight)]
    assert [p.shape for p in params] == [(4, 3), (3,), (3,), (3,), (3, 2)]
    assert bn.parameters() == [bn.gamma, bn.beta]
    assert list(model.state_dict()) == ["0:weight", "0:bias", "1:gamma", "1:beta", "1:running_mean", "1:running_var",
                                        "4:weight"]


def test_netcl_code_runs_unchanged_on_a_loaded_model(queue, tmp_path):
    from fastckpt.io import save_model

    built = _model(queue)
    p = str(tmp_path / "model.netcl")
    save_model(built, p)
    q = queue
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    expected = built(x).to_host()

    # netcl's code, with its imports changed from netcl to fastckpt:
    from fastckpt.io.serialization import load_model
    from fastckpt.tensor import Tensor

    model = load_model(p, queue=q); model.eval(); y = model(Tensor.from_host(q, x)).to_host()  # noqa: E702

    assert y.dtype == np.float32 and y.shape == (5, 2)
    np.testing.assert_array_equal(y, expected)
    assert len(model.parameters()) == 5


def test_device_entry_points_take_a_pathlib_path(queue, tmp_path):
    from fastckpt.device.load import load_file
    from fastckpt.io import load_model, save_model
    from fastckpt.io.checkpoint import load_netcl_checkpoint, load_params, save_netcl_checkpoint, save_params

    model = _model(queue)
    save_model(model, tmp_path / "m.netcl")
    loaded = load_model(tmp_path / "m.netcl", queue=queue)
    assert list(loaded.state_dict()) == list(model.state_dict())
    save_params(model.parameters(), tmp_path / "p.npz")
    assert load_params(queue, loaded.parameters(), tmp_path / "p.npz") == ["p0", "p1", "p2", "p3", "p4"]
    save_netcl_checkpoint(model.parameters(), tmp_path / "ck", config={"step": 1})
    assert load_netcl_checkpoint(queue, loaded.parameters(), tmp_path / "ck")["config"] == {"step": 1}
    fastckpt.save_npz(tmp_path / "a.npz", T)
    _check(load_file(tmp_path / "a.npz", queue)["w"].to_host(), T["w"])
    assert os.path.isfile(tmp_path / "ck.json")


@pytest.mark.parametrize("loader", ["fastckpt.train.checkpoint.load_checkpoint", "fastckpt.train.remote.load_checkpoint",
                                    "fastckpt.train.manager.CheckpointManager.restore",
                                    "fastckpt.train.manager.CheckpointManager.restore_latest",
                                    "fastckpt.train.directory.CheckpointDirectory",
                                    "fastckpt.sharded.reader.CheckpointReader", "fastckpt.sharded.loader.Loader"])
def test_every_loader_of_a_checkpoint_with_a_manifest_checks_it_by_default(loader):
    # One default for one keyword: the sharded reader and loader did not check their manifest unless asked.
    import inspect

    module, _, name = loader.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:
        module, _, cls = module.rpartition(".")
        target = getattr(getattr(importlib.import_module(module), cls), name)
    if isinstance(target, type):  # a class: its __init__'s keyword (CheckpointReader has a __new__ of its own)
        target = target.__init__
    assert inspect.signature(target).parameters["verify"].default is True


def test_a_changed_file_is_refused_by_open_and_the_sharded_loader_unless_told(tmp_path):
    from fastckpt.errors import IntegrityError
    from fastckpt.sharded import Loader, Saver
    from fastckpt.train import save_checkpoint

    save_checkpoint(StateModel({"w": np.arange(4.0)}), None, None, None, None, tmp_path / "t", step=1)
    Saver(path=str(tmp_path / "s"), parallel=1, tensors={"w": np.arange(4.0)}).save()
    for directory, pattern in ((tmp_path / "t", "weights.safetensors"), (tmp_path / "s", "*.safetensors")):
        changed = next(directory.glob(pattern))
        data = bytearray(changed.read_bytes())
        data[-1] ^= 1  # a payload byte: every header still parses
        changed.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=changed.name):
            with fastckpt.open(directory) as reader:  # a training directory is checked as it opens, a sharded
                reader.host(next(iter(reader.keys())))  # one file by file, as the first part of each is read
    with pytest.raises(IntegrityError, match="safetensors"):
        Loader(str(tmp_path / "s"), tensors={"w": np.zeros(4)}).load()
    out = {"w": np.zeros(4)}
    Loader(str(tmp_path / "s"), tensors=out, verify=False).load()
    assert out["w"][:3].tolist() == [0.0, 1.0, 2.0]
