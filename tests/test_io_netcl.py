"""Compatibility with real netcl 0.4.4 (skipped when netcl is not importable): both directions, byte-exact weights."""

from __future__ import annotations

import json
import secrets

import numpy as np
import pytest

pytest.importorskip("pyopencl")
netcl_io = pytest.importorskip("netcl.io")

import fastckpt.nn as nn
from fastckpt.device.tensor import Tensor
from fastckpt.io import load_model, save_model
from fastckpt.io.checkpoint import load_netcl_checkpoint, save_netcl_checkpoint

pytestmark = pytest.mark.device

# Every layer type netcl can store, in one model, with the args netcl writes.
CONFIG = [
    {"type": "Conv2d", "args": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "stride": 1, "pad": 1,
                                "bias": True, "dilation": 1, "groups": 1}},
    {"type": "BatchNorm2d", "args": {"num_features": 4, "momentum": 0.1, "eps": 1e-05}},
    {"type": "LeakyReLU", "args": {"negative_slope": 0.05}},
    {"type": "MaxPool2d", "args": {"kernel_size": 2, "stride": 2}},
    {"type": "Flatten", "args": {}},
    {"type": "Dropout", "args": {"p": 0.2, "seed": None}},
    {"type": "Linear", "args": {"in_features": 36, "out_features": 10, "bias": True}},
    {"type": "Tanh", "args": {}},
    {"type": "Linear", "args": {"in_features": 10, "out_features": 6, "bias": False}},
    {"type": "Sigmoid", "args": {}},
    {"type": "Linear", "args": {"in_features": 6, "out_features": 3, "bias": True}},
    {"type": "ReLU", "args": {}},
]


@pytest.fixture(scope="module")
def netcl_queue():
    from netcl.core.device import manager

    handle = manager.default("auto")
    if handle is None or getattr(handle, "backend", "cl") == "cpu":
        pytest.skip("netcl found no OpenCL device")
    return handle.queue


@pytest.fixture
def rng():
    return np.random.default_rng(secrets.randbits(32))


def netcl_arrays(model) -> dict:
    """The "{i}:{k}" arrays of a netcl Sequential, as its save_model selects them."""
    out = {}
    for i, layer in enumerate(model.layers):
        for key, value in layer.state_dict().items():
            if isinstance(value, np.ndarray):
                out[f"{i}:{key}"] = value
    return out


def netcl_randomize(model, rng) -> dict:
    for layer in model.layers:
        sd = layer.state_dict()
        arrays = {k: v for k, v in sd.items() if isinstance(v, np.ndarray)}
        if arrays:
            new = {k: rng.uniform(0.2, 1.0, v.shape).astype(np.float32) for k, v in arrays.items()}
            layer.load_state_dict({**sd, **new})
    return netcl_arrays(model)


def test_fastckpt_reads_a_model_netcl_saved(tmp_path, netcl_queue, rng):
    from netcl.nn import build_sequential as netcl_build

    model = netcl_build(netcl_queue, CONFIG)
    expected = netcl_randomize(model, rng)
    netcl_io.save_model(model, str(tmp_path / "netcl_model.netcl"))

    ours = load_model(tmp_path / "netcl_model.netcl")
    assert [nn.layer_to_config(layer) for layer in ours] == CONFIG
    got = ours.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == np.float32 and got[key].tobytes() == value.tobytes(), key

    # Same layouts and semantics: the forward passes agree (netcl's own kernels accumulate in float32).
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    from netcl.core.tensor import Tensor as NetclTensor

    theirs = model(NetclTensor.from_host(netcl_queue, x)).to_host()
    np.testing.assert_allclose(ours(x).to_host(), theirs, rtol=1e-4, atol=1e-6)


def test_netcl_loads_a_model_fastckpt_saved(tmp_path, netcl_queue, rng):
    from fastckpt.device import default

    ours = nn.build_sequential(default().queue, CONFIG, seed=secrets.randbits(31))
    state = {k: rng.uniform(0.2, 1.0, v.shape).astype(np.float32) for k, v in ours.state_dict().items()}
    ours.load_state_dict(state)
    save_model(ours, tmp_path / "ours.netcl")

    theirs = netcl_io.load_model(str(tmp_path / "ours.netcl"), queue=netcl_queue)
    got = netcl_arrays(theirs)
    assert list(got) == list(state)
    for key, value in state.items():
        assert got[key].tobytes() == value.tobytes(), key
    from netcl.nn.factory import layer_to_config

    assert [layer_to_config(layer) for layer in theirs.layers] == CONFIG


def test_netcl_rejects_a_fastckpt_file_with_an_embedding(tmp_path, netcl_queue):
    ours = nn.Sequential(nn.Embedding(5, 4), nn.Linear(None, 4, 2))
    save_model(ours, tmp_path / "emb.netcl")
    with pytest.raises(ValueError, match="Unknown layer type Embedding"):
        netcl_io.load_model(str(tmp_path / "emb.netcl"), queue=netcl_queue)
    assert isinstance(load_model(tmp_path / "emb.netcl")[0], nn.Embedding)  # fastckpt reads its own file


def test_checkpoints_cross_both_ways(tmp_path, netcl_queue, rng):
    from netcl.core.tensor import Tensor as NetclTensor
    from netcl.io import checkpoint as netcl_ckpt

    from fastckpt.device import default

    q = default().queue
    hosts = [rng.standard_normal(s).astype(np.float32) for s in [(4, 3), (3,)]]
    optim = {"t": 3, "moments": [(hosts[0] * 2, hosts[0] * 3), (hosts[1] * 2, hosts[1] * 3)]}

    # fastckpt writes (with array references), netcl reads the params and the JSON
    save_netcl_checkpoint([Tensor.from_host(q, h) for h in hosts], tmp_path / "ours", optim_state=optim,
                          config={"step": 3})
    theirs = [NetclTensor.from_host(netcl_queue, np.zeros_like(h)) for h in hosts]
    meta = netcl_ckpt.load_checkpoint(netcl_queue, theirs, str(tmp_path / "ours"))
    assert all(t.to_host().tobytes() == h.tobytes() for t, h in zip(theirs, hosts))
    assert meta["config"] == {"step": 3} and meta["optim_state"]["t"] == 3

    # netcl writes, fastckpt reads
    netcl_ckpt.save_checkpoint([NetclTensor.from_host(netcl_queue, h) for h in hosts], str(tmp_path / "theirs"),
                               config={"lr": 0.01})
    fresh = [Tensor.from_host(q, np.zeros_like(h)) for h in hosts]
    assert load_netcl_checkpoint(q, fresh, tmp_path / "theirs") == {"optim_state": {}, "config": {"lr": 0.01}}
    assert all(t.to_host().tobytes() == h.tobytes() for t, h in zip(fresh, hosts))
    assert json.loads((tmp_path / "theirs.json").read_text()) == {"optim_state": {}, "config": {"lr": 0.01}}
