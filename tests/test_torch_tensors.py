"""PyTorch tensors from what fastckpt reads can be trained: no in-place write crashes the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastckpt  # noqa: E402


def _model_file(tmp_path):
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {"0.weight": np.full((3, 4), 0.5, np.float32), "0.bias": np.zeros(3, np.float32),
                                     "e": np.array([1.5, -2, 3], dtype=ml_dtypes.bfloat16)})
    return path


def test_in_place_writes_to_to_torch_tensors_and_a_training_step_do_not_kill_the_process(tmp_path):
    # Both killed the process with SIGSEGV (exit 139): the tensors wrapped read-only mapped memory.
    path = _model_file(tmp_path)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import warnings; warnings.simplefilter("error")  # and no "not writable" warning either
        import fastckpt, torch
        f = fastckpt.open({str(path)!r})
        t = fastckpt.to_torch(f.host("0.bias")).add_(1)
        assert t.tolist() == [1.0, 1.0, 1.0], t
        sd = fastckpt.to_torch(f.hosts())
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        model.load_state_dict({{k: v for k, v in sd.items() if k != "e"}}, assign=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert model[0].bias.tolist() == torch.full((3,), -0.2).tolist(), model[0].bias  # float32 -0.2
        print("trained")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == "trained"
    assert path.read_bytes() == before  # the file never changes


def test_copy_false_gives_a_read_only_tensor_whose_writes_raise(tmp_path):
    with fastckpt.open(_model_file(tmp_path)) as f:
        t = fastckpt.to_torch(f.host("0.weight"), copy=False)
        view = t[1:]
        for write in (lambda: t.add_(1), lambda: view.mul_(2), lambda: t.__setitem__(0, 3.0),
                      lambda: torch.add(t, 1, out=t), lambda: torch._foreach_add_([t], 1), lambda: t.copy_(t * 2)):
            with pytest.raises(RuntimeError, match="read-only view of a mapped file"):
                write()
        assert not t.numpy().flags.writeable and not np.asarray(view).flags.writeable  # numpy's way in is closed
        assert float((t + 1).sum()) == 18.0  # reading is free
        assert type(t + 1) is torch.Tensor and type(t.clone().add_(1)) is torch.Tensor
        assert f.host("0.weight").tolist() == np.full((3, 4), 0.5).tolist()
        # zero-copy: the tensor is the mapped bytes themselves
        assert t.data_ptr() == f.host("0.weight").__array_interface__["data"][0]
        model = torch.nn.Linear(4, 3)
        model.load_state_dict({"weight": t, "bias": fastckpt.to_torch(f.host("0.bias"), copy=False)})  # copies in
        assert model.weight.sum().item() == 6.0
        # assign=True makes the read-only tensors the parameters: the optimizer's step is refused, not a crash
        model.load_state_dict({"weight": t, "bias": fastckpt.to_torch(f.host("0.bias"), copy=False)}, assign=True)
        assert model.weight.requires_grad  # requires_grad_ and other metadata-only in-place calls are allowed
        model(torch.ones(2, 4)).sum().backward()
        for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters(), lr=0.1)):
            with pytest.raises(RuntimeError, match="read-only view of a mapped file"):
                opt.step()
        assert f.host("0.weight").tolist() == np.full((3, 4), 0.5).tolist()


def test_to_torch_copies_only_what_is_read_only():
    writable = np.arange(3, dtype=np.float32)
    assert fastckpt.to_torch(writable).data_ptr() == writable.ctypes.data  # shared
    assert fastckpt.to_torch(writable, copy=True).data_ptr() != writable.ctypes.data
    locked = np.arange(3, dtype=np.float32)
    locked.flags.writeable = False
    t = fastckpt.to_torch(locked)
    assert t.data_ptr() != locked.ctypes.data and t.add_(1).tolist() == [1, 2, 3] and locked.tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        fastckpt.to_torch(writable, copy="yes")


def test_load_torch_gives_a_state_dict_to_train_mapped_copy_on_write(tmp_path):
    path = _model_file(tmp_path)
    before = path.read_bytes()
    sd = fastckpt.load_torch(path)
    assert list(sd) == ["0.bias", "0.weight", "e"] or set(sd) == {"0.bias", "0.weight", "e"}
    assert sd["e"].dtype == torch.bfloat16 and sd["e"].tolist() == [1.5, -2.0, 3.0]
    assert all(type(t) is torch.Tensor for t in sd.values())
    # zero-copy: the tensors lie in one mapping, as far apart as their bytes in the file
    with fastckpt.open(path) as f:
        offsets = {name: f.info(name).offset for name in sd}
    assert {n: sd[n].data_ptr() - sd["0.bias"].data_ptr() for n in sd} == \
           {n: offsets[n] - offsets["0.bias"] for n in sd}
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model.load_state_dict({k: v for k, v in sd.items() if k != "e"}, assign=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert model[0].weight.data_ptr() == sd["0.weight"].data_ptr() and float(model[0].weight[0, 0].detach()) != 0.5
    assert path.read_bytes() == before
    assert list(fastckpt.load_torch(path, names=["e"])) == ["e"]
    with pytest.raises(ValueError, match="maps files copy-on-write"):
        fastckpt.load_torch(path, copy_on_write=False)


def test_load_torch_of_an_npz_and_of_a_compressed_npz(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.ones(2)}
    fastckpt.save_npz(tmp_path / "p.npz", arrays)
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    for name in ("p.npz", "c.npz"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fastckpt.NotZeroCopyWarning)  # the compressed one is inflated
            sd = fastckpt.load_torch(tmp_path / name)
        assert {k: v.tolist() for k, v in sd.items()} == {k: v.tolist() for k, v in arrays.items()}
        sd["a"].add_(1)
