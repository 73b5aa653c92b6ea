"""The state_dict protocol, deterministic initialisation and the layer registry of fastckpt.nn."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

pytest.importorskip("pyopencl")

import fastckpt.nn as nn
from fastckpt.device.tensor import Tensor

pytestmark = pytest.mark.device

CNN_CONFIG = [
    {"type": "Conv2d", "args": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "stride": 1, "pad": 1,
                                "bias": True, "dilation": 1, "groups": 1}},
    {"type": "BatchNorm2d", "args": {"num_features": 4, "momentum": 0.1, "eps": 1e-05}},
    {"type": "ReLU", "args": {}}, {"type": "MaxPool2d", "args": {"kernel_size": 2, "stride": 2}},
    {"type": "Flatten", "args": {}}, {"type": "Linear", "args": {"in_features": 12, "out_features": 8, "bias": True}},
]


@pytest.fixture
def rng():
    return np.random.default_rng(secrets.randbits(32))


def host_state(model):
    return {k: v.copy() for k, v in model.state_dict().items()}


def test_state_keys_follow_netcl_layout(queue):
    model = nn.build_sequential(queue, CNN_CONFIG)
    assert list(model.state_dict()) == ["0:weight", "0:bias", "1:gamma", "1:beta", "1:running_mean",
                                        "1:running_var", "5:weight", "5:bias"]
    assert model.state_dict()["5:weight"].shape == (12, 8)  # Linear weight is (in, out)
    assert [nn.layer_to_config(layer) for layer in model] == CNN_CONFIG


def test_same_seed_rebuilds_identical_parameters(queue):
    a = host_state(nn.build_sequential(queue, CNN_CONFIG, seed=7))
    b = host_state(nn.build_sequential(queue, CNN_CONFIG, seed=7))
    c = host_state(nn.build_sequential(queue, CNN_CONFIG, seed=8))
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert a["0:weight"].tobytes() != c["0:weight"].tobytes()
    assert all(v.dtype == np.float32 for v in a.values())


def test_same_shaped_layers_get_different_values(queue):
    model = nn.build_sequential(queue, [{"type": "Linear", "args": {"in_features": 4, "out_features": 4}}] * 2)
    sd = model.state_dict()
    assert sd["0:weight"].tobytes() != sd["1:weight"].tobytes()


def test_load_state_dict_round_trip_exact(queue, rng):
    model = nn.build_sequential(queue, CNN_CONFIG)
    new = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.state_dict().items()}
    assert model.load_state_dict(new) == nn.IncompatibleKeys([], [])
    got = model.state_dict()
    assert all(got[k].tobytes() == new[k].tobytes() for k in new)


def test_shape_mismatch_writes_nothing_and_names_both_shapes(queue, rng):
    model = nn.Sequential(nn.Linear(queue, 3, 2), nn.ReLU(), nn.Linear(queue, 2, 1))
    before = host_state(model)
    bad = {"0:weight": rng.standard_normal((3, 2)).astype(np.float32),  # valid, must not be written
           "2:weight": rng.standard_normal((3, 1)).astype(np.float32)}
    with pytest.raises(ValueError, match=r"'2:weight': stored shape \(3, 1\), model expects \(2, 1\)"):
        model.load_state_dict(bad, strict=False)
    after = host_state(model)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)


def test_strict_names_missing_and_unexpected_keys_and_writes_nothing(queue, rng):
    model = nn.Sequential(nn.Linear(queue, 3, 2))
    before = host_state(model)
    state = {"0:weight": rng.standard_normal((3, 2)).astype(np.float32), "7:junk": np.ones(1, np.float32)}
    with pytest.raises(KeyError, match=r"missing keys \['0:bias'\].*unexpected keys \['7:junk'\].*strict=False"):
        model.load_state_dict(state)
    assert host_state(model)["0:weight"].tobytes() == before["0:weight"].tobytes()
    result = model.load_state_dict(state, strict=False)
    assert result == nn.IncompatibleKeys(["0:bias"], ["7:junk"])
    assert model.state_dict()["0:weight"].tobytes() == state["0:weight"].tobytes()


@pytest.mark.parametrize("key", ["00:weight", "+0:weight", " 0:weight", "\u0660:weight", "0x0:weight"])
def test_non_canonical_layer_index_is_unexpected_not_an_alias(queue, rng, key):
    model = nn.Sequential(nn.Linear(queue, 3, 2))
    before = host_state(model)
    state = {key: rng.standard_normal((3, 2)).astype(np.float32)}
    assert model.load_state_dict(state, strict=False) == nn.IncompatibleKeys(["0:weight", "0:bias"], [key])
    assert host_state(model)["0:weight"].tobytes() == before["0:weight"].tobytes()


def test_squeeze_tolerance_accepts_1_by_c_for_c(queue, rng):
    layer = nn.Linear(queue, 3, 4)
    bias = rng.standard_normal((1, 4)).astype(np.float32)
    layer.load_state_dict({"bias": bias}, strict=False)
    assert layer.bias.shape == (4,) and layer.state_dict()["bias"].tobytes() == bias.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_stored_dtype_is_kept(queue, rng, dtype):
    layer = nn.BatchNorm2d(queue, 5)
    value = (rng.standard_normal(5) * 10).astype(dtype)
    layer.load_state_dict({"running_mean": value}, strict=False)
    got = layer.state_dict()["running_mean"]
    assert got.dtype == np.dtype(dtype) and got.tobytes() == value.tobytes()


def test_device_tensor_is_adopted_without_copy(queue, rng):
    layer = nn.Linear(queue, 2, 3)
    w = Tensor.from_host(queue, rng.standard_normal((2, 3)).astype(np.float32))
    layer.load_state_dict({"weight": w}, strict=False)
    assert layer.weight is w


def test_object_arrays_are_refused(queue):
    layer = nn.Linear(queue, 1, 1)
    with pytest.raises(TypeError, match="'weight': dtype object"):
        layer.load_state_dict({"weight": np.array([[None]], dtype=object)}, strict=False)


# -- registry -----------------------------------------------------------------------------------
def test_config_forms_build_the_same_model(queue):
    with_args = [{"type": "Linear", "args": {"in_features": 4, "out_features": 3}}, {"type": "ReLU", "args": {}}]
    without_args = [{"type": "Linear", "args": {"in_features": 4, "out_features": 3}}, {"type": "ReLU"}]
    flat = {"type": "Sequential", "layers": [{"type": "Linear", "in_features": 4, "out_features": 3},
                                             {"type": "ReLU"}]}
    states = [host_state(nn.build_sequential(queue, c)) for c in (with_args, without_args, flat)]
    assert all(s["0:weight"].tobytes() == states[0]["0:weight"].tobytes() for s in states)
    assert nn.normalize_config(flat) == with_args


@pytest.mark.parametrize(
    "config,match",
    [({"type": "Sequential"}, "neither a 'config' nor a 'layers'"),
     ("nope", "must be a list of layer entries, got str"),
     ([{"args": {}}], r"config\[0\] has no 'type'"),
     ([{"type": "ReLU"}, {"type": "Transformer"}], r"config\[1\]: unknown layer type 'Transformer'.*register_layer"),
     ([{"type": "Linear", "args": {"in_features": 2}}], r"config\[0\] \(Linear\): missing required args \['out_features'\]"),
     ([{"type": "Linear", "args": {"in_features": 2, "out_features": 1, "gain": 3}}], r"config\[0\] \(Linear\): bad args"),
     ([{"type": "ReLU", "args": [1]}], r"'args' must be a dict, got list"),
     ([{"type": "Conv2d", "args": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "groups": 2}}],
      r"config\[0\] \(Conv2d\): Conv2d: groups=2 must divide")],
)
def test_bad_configs_are_named(queue, config, match):
    with pytest.raises(ValueError, match=match):
        nn.build_sequential(queue, config)


def test_parameter_free_layers_ignore_unknown_args_like_netcl(queue):
    model = nn.build_sequential(queue, [{"type": "ReLU", "args": {"inplace": True}},
                                        {"type": "LeakyReLU", "args": {"negative_slope": 0.3, "x": 1}}])
    assert model[1].negative_slope == 0.3


class Scale(nn.Module):
    """A user layer: multiplies by a learned per-feature factor (forward through ReLU's machinery is not needed)."""

    _state_names = ("factor",)

    def __init__(self, queue=None, features=1):
        self.features = features
        self.queue = queue
        self.factor = Tensor.from_host(queue, nn.init_rng().uniform(1, 2, size=features).astype(np.float32))

    def config_args(self):
        return {"features": self.features}


@pytest.fixture
def scale_registered():
    nn.register_layer("Scale", Scale, queue_required=True, required_args=["features"])
    yield
    nn.unregister_layer("Scale")


def test_user_layer_types_register_build_and_describe(queue, scale_registered):
    model = nn.build_sequential(queue, [{"type": "Scale", "args": {"features": 3}}], seed=4)
    again = nn.build_sequential(queue, [{"type": "Scale", "args": {"features": 3}}], seed=4)
    assert model.state_dict()["0:factor"].tobytes() == again.state_dict()["0:factor"].tobytes()
    assert nn.layer_to_config(model[0]) == {"type": "Scale", "args": {"features": 3}}
    with pytest.raises(ValueError, match=r"missing required args \['features'\]"):
        nn.build_sequential(queue, [{"type": "Scale"}])


def test_unregistered_layer_cannot_be_described(queue):
    with pytest.raises(ValueError, match="unsupported layer type Scale"):
        nn.layer_to_config(Scale(queue, 2))


# -- blueprints: the layers of a config, made again for every load -------------------------------------
def test_blueprint_copies_built_in_layers_with_placeholders(queue):
    entries = nn.normalize_config(CNN_CONFIG + [CNN_CONFIG[-1]])
    blueprint = nn.LayerBlueprint(queue, entries)
    assert blueprint.reusable and blueprint.current
    first, second = blueprint.make(), blueprint.make()
    assert [nn.layer_to_config(layer) for layer in first] == entries
    assert all(a is not b and type(a) is type(b) for a, b in zip(first, second))
    assert all(t.buffer is None and t.dtype == np.float32 for layer in first for t in layer.named_tensors().values())
    assert first[1].running_var.shape == (4,) and first[5].weight.shape == (12, 8)
    # Equal entries are built once: their copies start from the same placeholders.
    assert first[5] is not first[6] and first[5].weight is first[6].weight
    first[5].weight = Tensor(None, (12, 8), np.float32)  # what a load does: the copy's own attribute
    assert second[5].weight is second[6].weight and first[6].weight is second[6].weight


def test_blueprint_keeps_int_and_float_args_apart(queue):
    entries = nn.normalize_config([{"type": "Linear", "args": {"in_features": 16, "out_features": 2}},
                                   {"type": "Linear", "args": {"in_features": 16.0, "out_features": 2}}])
    with pytest.raises(ValueError, match=r"config\[1\] \(Linear\).*in_features must be an int >= 1, got 16.0"):
        nn.LayerBlueprint(queue, entries)


def test_blueprint_builds_user_types_and_shared_values_anew(queue):
    built = []

    def scale(queue=None, features=1):
        built.append(features)
        return Scale(queue, features)

    nn.register_layer("Counted", scale, queue_required=True)
    try:
        entries = nn.normalize_config([{"type": "Counted", "args": {"features": 2}}, {"type": "ReLU"}])
        blueprint = nn.LayerBlueprint(queue, entries)
        assert not blueprint.reusable and built == []
        first, second = blueprint.make(), blueprint.make()
        assert built == [2, 2] and first[0] is not second[0] and first[1] is not second[1]
    finally:
        nn.unregister_layer("Counted")
    # A Dropout seed given as a list would be one list shared by every copy: such a layer is built anew, and the
    # blueprint is not kept for another load.
    seeded = nn.LayerBlueprint(queue, nn.normalize_config([{"type": "Dropout", "args": {"p": 0.5, "seed": [1, 2]}}]))
    assert not seeded.reusable
    a, b = seeded.make()[0], seeded.make()[0]
    assert a is not b and a.seed == b.seed == [1, 2]


def test_blueprint_is_stale_once_the_registry_changes(queue):
    blueprint = nn.LayerBlueprint(queue, nn.normalize_config([{"type": "ReLU"}]))
    assert blueprint.current
    nn.register_layer("Temporary", nn.ReLU)
    assert not blueprint.current
    nn.unregister_layer("Temporary")
    assert not blueprint.current, "removing it again does not make the blueprint current: it is rebuilt"
    assert nn.LayerBlueprint(queue, nn.normalize_config([{"type": "ReLU"}])).current
