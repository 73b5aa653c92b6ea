"""PyTorch's bfloat16, float16 and float8 tensors are saved exactly by every writer and come back with their dtype."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import fastckpt  # noqa: E402
from fastckpt.arrays import as_numpy, to_torch  # noqa: E402

DTYPES = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]


def _tensor(name: str):
    return (torch.arange(-6, 6, dtype=torch.float32) / 4).reshape(3, 4).to(getattr(torch, name))


def _bits(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _expected_numpy_dtype(name: str):
    return np.dtype(np.float16) if name == "float16" else np.dtype(getattr(ml_dtypes, name))


@pytest.mark.parametrize("name", DTYPES)
def test_as_numpy_views_the_same_bytes_with_the_ml_dtypes_type(name):
    t = _tensor(name)
    arr = as_numpy(t)
    assert arr.dtype == _expected_numpy_dtype(name) and arr.shape == (3, 4)
    assert arr.tobytes() == _bits(t)
    assert np.shares_memory(arr, t.view(torch.uint8).numpy())  # no copy
    assert fastckpt.to_torch is to_torch
    back = to_torch(arr)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    strided = as_numpy(t.T)  # a transposed view keeps its strides
    assert strided.tobytes() == _bits(t.T)


def _write_read_safetensors(tmp_path, tensors):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", tensors)
    with fastckpt.open(tmp_path / "m.safetensors") as f:
        return {n: np.array(f.host(n)) for n in f}


def _write_read_npz(tmp_path, tensors):
    fastckpt.save_npz(tmp_path / "m.npz", tensors)
    with fastckpt.open(tmp_path / "m.npz") as f:
        return {n: np.array(f.host(n)) for n in f}


def _write_read_tf(tmp_path, tensors):
    from fastckpt.tf import CheckpointReader, write_checkpoint

    write_checkpoint(tmp_path / "ckpt-1", tensors)
    with CheckpointReader(tmp_path / "ckpt-1") as r:
        return {n: r.read_tensor(n, copy=True) for n in r}


def _write_read_hf_sharded(tmp_path, tensors):
    fastckpt.save_sharded(tmp_path / "hf", tensors, max_shard_size=100)
    with fastckpt.open(tmp_path / "hf") as f:
        return {n: np.array(f.host(n)) for n in f.keys()}


def _write_read_sharded(tmp_path, tensors):
    from fastckpt.sharded import CheckpointReader, Saver

    Saver(path=str(tmp_path / "sharded"), parallel=1, tensors=tensors).save()
    reader = CheckpointReader(str(tmp_path / "sharded"))
    return {n: np.array(reader.read_tensor(n)) for n in reader.tensor_names()}


WRITERS = {"safetensors": _write_read_safetensors, "npz": _write_read_npz, "tf": _write_read_tf,
           "hf_sharded": _write_read_hf_sharded, "sharded": _write_read_sharded}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_saves_torch_low_precision_exactly(tmp_path, writer):
    tensors = {name: _tensor(name) for name in DTYPES}
    got = WRITERS[writer](tmp_path, tensors)
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == _expected_numpy_dtype(name), (writer, name)
        assert got[name].tobytes() == _bits(t), (writer, name)
        assert to_torch(got[name]).dtype == t.dtype


def test_a_training_checkpoint_of_a_bfloat16_module_resumes_bit_for_bit(tmp_path):
    from fastckpt.train import apply_checkpoint, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    save_checkpoint(model, None, None, None, None, tmp_path / "c", step=1)
    fresh = torch.nn.Linear(4, 3).to(torch.bfloat16)
    apply_checkpoint(load_checkpoint(tmp_path / "c"), fresh)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_training_checkpoint_names_the_tensor_it_cannot_store(tmp_path):
    from fastckpt.train import save_checkpoint

    model = torch.nn.Linear(2, 2)
    model.weight.data = torch.zeros(2, 2, dtype=torch.complex32)
    with pytest.raises(TypeError, match="weight"):
        save_checkpoint(model, None, None, None, None, tmp_path / "c", step=1)
    assert not (tmp_path / "c").exists()
