"""save_model / load_model: the .netcl single file, the legacy pair, metadata checks, pools and errors."""

from __future__ import annotations

import gc
import json
import os
import secrets
import warnings
import zipfile

import numpy as np
import pytest

pytest.importorskip("pyopencl")

import fastckpt
import fastckpt.nn as nn
from fastckpt.errors import CheckpointNotFoundError, FastCkptWarning, FormatError
from fastckpt.io import load_model, save_model
from fastckpt.io.serialization import META_KEY, MissingWeightsWarning, model_metadata

pytestmark = pytest.mark.device

CONV = {"type": "Conv2d", "args": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "stride": 1, "pad": 1,
                                   "bias": True, "dilation": 1, "groups": 1}}
BN = {"type": "BatchNorm2d", "args": {"num_features": 4, "momentum": 0.1, "eps": 1e-05}}
POOL = {"type": "MaxPool2d", "args": {"kernel_size": 2, "stride": 2}}
FLAT = {"type": "Flatten", "args": {}}


def linear(i, o, bias=True):
    return {"type": "Linear", "args": {"in_features": i, "out_features": o, "bias": bias}}


# One config per layer type (each wrapped so that it runs forward on a (2, 3, 6, 6) or (2, 5) input).
LAYER_CONFIGS = {
    "Conv2d": ([CONV], (2, 3, 6, 6)),
    "Conv2d-nobias-grouped": ([{"type": "Conv2d", "args": {"in_channels": 4, "out_channels": 6, "kernel_size": 2,
                                                            "stride": 2, "pad": 1, "bias": False, "dilation": 1,
                                                            "groups": 2}}], (2, 4, 6, 6)),
    "BatchNorm2d": ([CONV, BN], (2, 3, 6, 6)),
    "Linear": ([linear(5, 3)], (2, 5)),
    "Linear-nobias": ([linear(5, 3, bias=False)], (2, 5)),
    "ReLU": ([linear(5, 3), {"type": "ReLU", "args": {}}], (2, 5)),
    "LeakyReLU": ([linear(5, 3), {"type": "LeakyReLU", "args": {"negative_slope": 0.2}}], (2, 5)),
    "Sigmoid": ([linear(5, 3), {"type": "Sigmoid", "args": {}}], (2, 5)),
    "Tanh": ([linear(5, 3), {"type": "Tanh", "args": {}}], (2, 5)),
    "Dropout": ([{"type": "Dropout", "args": {"p": 0.25, "seed": None}}, linear(5, 3)], (2, 5)),
    "MaxPool2d+Flatten": ([CONV, POOL, FLAT, linear(36, 2)], (2, 3, 6, 6)),
    "Embedding": ([{"type": "Embedding", "args": {"num_embeddings": 7, "embedding_dim": 3}}, linear(3, 2)], None),
}


@pytest.fixture
def rng():
    return np.random.default_rng(secrets.randbits(32))


def randomize(model, rng):
    """Random, nonzero values for every weight (fresh per test), so that nothing passes by coincidence."""
    state = {k: (rng.uniform(0.1, 1.0, v.shape) * rng.choice([-1, 1], v.shape)).astype(v.dtype)
             for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("running_var"):
            state[k] = np.abs(state[k])
    model.load_state_dict(state)
    return state


def model_input(rng, config_name):
    shape = LAYER_CONFIGS[config_name][1]
    if shape is None:
        return rng.integers(0, 7, size=(2, 4))
    return rng.standard_normal(shape).astype(np.float32)


def assert_same_state(model, expected: dict):
    got = model.state_dict()
    assert list(got) == list(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


def payload_offsets(path):
    with fastckpt.open(path) as tf:
        return {name: info.offset for name, info in tf.infos.items()}


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("use_pool", [False, True], ids=["buffers", "pool"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_round_trip_exact_weights_and_forward(tmp_path, device, rng, name, use_pool):
    from fastckpt.device.pool import PersistentBufferPool

    model = nn.build_sequential(device.queue, LAYER_CONFIGS[name][0], seed=secrets.randbits(31))
    state = randomize(model, rng)
    x = model_input(rng, name)
    before = model(x).to_host()
    path = tmp_path / "model.netcl"
    save_model(model, path)
    pool = PersistentBufferPool(device.context, device.queue) if use_pool else None
    loaded = load_model(path, pool=pool)
    assert [nn.layer_to_config(layer) for layer in loaded] == [nn.layer_to_config(layer) for layer in model]
    assert_same_state(loaded, state)
    assert loaded(x).to_host().tobytes() == before.tobytes()
    assert loaded.load_report.missing_keys == [] and loaded.load_report.unexpected_keys == []
    if use_pool:  # all weights: one copy into one arena, and the parameters are views of it
        assert loaded.load_report.file_report.copies == 1
        assert len({t.buffer.int_ptr for t in loaded.named_tensors().values()}) == 1
    else:  # plain buffers, one per weight
        assert len({t.buffer.int_ptr for t in loaded.named_tensors().values()}) == len(state)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
@pytest.mark.parametrize("use_pool", [False, True], ids=["buffers", "pool"])
def test_stored_dtype_is_kept(tmp_path, device, rng, dtype, use_pool):
    from fastckpt.device.pool import PersistentBufferPool

    model = nn.build_sequential(device.queue, [CONV, BN, FLAT, linear(144, 3)])
    randomize(model, rng)
    model.astype(dtype)
    state = model.state_dict()
    assert all(v.dtype == dtype for v in state.values())
    save_model(model, tmp_path / "m.netcl")
    pool = PersistentBufferPool(device.context, device.queue) if use_pool else None
    loaded = load_model(tmp_path / "m.netcl", pool=pool)
    assert_same_state(loaded, state)
    with pytest.raises(TypeError, match=r"model.astype\(np.float32\)"):
        loaded(rng.standard_normal((1, 3, 6, 6)))


# -- the file itself -------------------------------------------------------------------------------
def test_file_layout_matches_netcl(tmp_path, queue, rng):
    config = [CONV, BN, {"type": "ReLU", "args": {}}, POOL, FLAT, linear(36, 8)]
    model = nn.build_sequential(queue, config)
    randomize(model, rng)
    path = tmp_path / "sub" / "dir" / "mnist_mlp.netcl"  # parents are created; the name is kept as given
    save_model(model, path)
    assert sorted(os.listdir(tmp_path / "sub" / "dir")) == ["mnist_mlp.netcl"]
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == [
            "0:weight.npy", "0:bias.npy", "1:gamma.npy", "1:beta.npy", "1:running_mean.npy", "1:running_var.npy",
            "5:weight.npy", "5:bias.npy", f"{META_KEY}.npy"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    expected_meta = json.dumps({"type": "Sequential", "config": config, "version": 2, "format": "netcl.single-file"})
    with np.load(path, allow_pickle=False) as z:
        meta = z[META_KEY]
        assert meta.shape == () and meta.dtype == np.dtype(f"<U{len(expected_meta)}")
        assert meta.tobytes() == np.array(expected_meta).tobytes()
        for k, v in model.state_dict().items():
            assert z[k].tobytes() == v.tobytes()
    assert all(off % 4096 == 0 for off in payload_offsets(path).values())


def test_same_model_gives_identical_bytes(tmp_path, queue, rng):
    model = nn.build_sequential(queue, [linear(6, 4), {"type": "Tanh"}, linear(4, 2)])
    randomize(model, rng)
    save_model(model, tmp_path / "a.netcl")
    save_model(model, tmp_path / "b.netcl")
    save_model(load_model(tmp_path / "a.netcl"), tmp_path / "c.netcl")
    a = (tmp_path / "a.netcl").read_bytes()
    assert a == (tmp_path / "b.netcl").read_bytes() == (tmp_path / "c.netcl").read_bytes()


def test_failed_save_leaves_the_old_file_untouched(tmp_path, queue):
    class Odd(nn.Module):
        pass

    path = tmp_path / "m.netcl"
    save_model(nn.Sequential(nn.ReLU()), path)
    old = path.read_bytes()
    with pytest.raises(ValueError, match="layer 1: unsupported layer type Odd"):
        save_model(nn.Sequential(nn.ReLU(), Odd()), path, overwrite=True)
    assert path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["m.netcl"]


def test_error_while_streaming_leaves_the_old_file_untouched(tmp_path, queue):
    class Broken:
        shape, dtype = (2,), np.dtype(np.float32)

        def to_host(self):
            raise RuntimeError("device lost")

    class Half(nn.Module):
        _state_names = ("a", "b")

        def __init__(self):
            from fastckpt.device.tensor import Tensor

            self.a = Tensor.from_host(queue, np.ones(4096, np.float32))
            self.b = Broken()

    nn.register_layer("Half", Half)
    try:
        path = tmp_path / "m.netcl"
        save_model(nn.Sequential(nn.ReLU()), path)
        old = path.read_bytes()
        with pytest.raises(RuntimeError, match="device lost"):
            save_model(nn.Sequential(Half()), path, overwrite=True)
        assert path.read_bytes() == old
        assert sorted(os.listdir(tmp_path)) == ["m.netcl"]
    finally:
        nn.unregister_layer("Half")


def test_non_sequential_is_refused(tmp_path, queue):
    with pytest.raises(TypeError, match=r"wrap a single layer as Sequential\(layer\)"):
        save_model(nn.Linear(queue, 2, 2), tmp_path / "m.netcl")


# -- reading other writers' files ------------------------------------------------------------------
def netcl_style_file(path, arrays: dict, meta, *, compressed=False, meta_bytes=False):
    """Write a file the way netcl 0.4.4 does: one np.savez call on an open file (unaligned payloads)."""
    entries = dict(arrays)
    text = json.dumps(meta)
    entries[META_KEY] = np.array(text.encode("utf-8")) if meta_bytes else np.array(text, dtype=np.str_)
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, **entries)


@pytest.mark.parametrize("use_pool", [False, True], ids=["buffers", "pool"])
def test_hand_written_np_savez_file_with_unaligned_payloads_loads(tmp_path, device, rng, use_pool):
    from fastckpt.device.pool import PersistentBufferPool

    config = [CONV, BN, {"type": "ReLU", "args": {}}, POOL, FLAT, linear(36, 8)]
    source = nn.build_sequential(device.queue, config)
    state = randomize(source, rng)
    path = tmp_path / "netcl_written.netcl"
    netcl_style_file(path, state, {"type": "Sequential", "config": config, "version": 2,
                                   "format": "netcl.single-file"})
    assert any(off % 4 for off in payload_offsets(path).values())  # the case under test: misaligned float32
    pool = PersistentBufferPool(device.context, device.queue) if use_pool else None
    model = load_model(path, pool=pool)
    assert_same_state(model, state)
    if use_pool:  # kernels index elements: misaligned arena views were moved to an aligned arena
        assert model.load_report.realigned_keys
        assert all(t.offset % 4 == 0 for t in model.named_tensors().values())
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    assert model(x).to_host().tobytes() == source(x).to_host().tobytes()


def test_compressed_file_and_bytes_metadata_load(tmp_path, queue, rng):
    config = [linear(4, 3), {"type": "Sigmoid"}]
    state = randomize(nn.build_sequential(queue, config), rng)
    path = tmp_path / "c.netcl"
    netcl_style_file(path, state, {"type": "Sequential", "config": config}, compressed=True, meta_bytes=True)
    with pytest.warns(fastckpt.NotZeroCopyWarning):
        model = load_model(path)
    assert_same_state(model, state)


# -- verify=True: the members' CRC-32 ----------------------------------------------------------------
@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflate"])
def test_verify_checks_every_member_crc_and_names_the_tensor(tmp_path, queue, rng, compressed):
    from fastckpt.errors import ChecksumMismatchError, IntegrityError

    config = [linear(5, 3), {"type": "ReLU", "args": {}}, linear(3, 2)]
    model = nn.build_sequential(queue, config)
    state = randomize(model, rng)
    path = tmp_path / "m.netcl"
    if compressed:  # np.savez_compressed: DEFLATE members, inflated and checked
        netcl_style_file(path, state, {"type": "Sequential", "config": config}, compressed=True)
    else:
        save_model(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastckpt.NotZeroCopyWarning)
        assert_same_state(load_model(path, verify=True), state)
        with fastckpt.open(path) as f:
            info = f.info("2:weight")
        data = bytearray(path.read_bytes())
        if compressed:  # the recorded CRC-32 in its central directory entry (a changed stream fails to inflate)
            data[data.rfind(b"2:weight.npy") - 46 + 16] ^= 0x01
        else:
            data[info.offset + info.nbytes - 1] ^= 0x01  # the last stored byte of that tensor
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatchError) as err:
            load_model(path, verify=True)
        msg = str(err.value)
        assert msg.startswith(f"{path}: member '2:weight.npy'") and "(tensor '2:weight')" in msg
        assert "CRC-32" in msg and "verify=False" in msg and isinstance(err.value, IntegrityError)
        if not compressed:  # unverified, the damaged bytes load as they are (stored members are not checked)
            got = load_model(path).state_dict()["2:weight"]
            assert got.tobytes() != state["2:weight"].tobytes()
            assert got.tobytes()[:-1] == state["2:weight"].tobytes()[:-1]


def test_verify_needs_a_file_with_member_checksums(tmp_path, queue, rng):
    config = [linear(5, 3)]
    state = randomize(nn.build_sequential(queue, config), rng)
    path = tmp_path / "m.safetensors"
    fastckpt.save_safetensors(path, {**state, META_KEY: np.frombuffer(b"x", np.uint8)})
    expected = r"m.safetensors: verify=True checks the CRC-32 of NPZ members, and this safetensors file keeps none"
    with fastckpt.open(path) as f, pytest.raises(ValueError, match=expected):
        load_model(f, verify=True)


def test_legacy_two_file_layout(tmp_path, queue, rng):
    # version-1 configs lack Conv2d bias/dilation/groups and BatchNorm momentum/eps
    config = [{"type": "Conv2d", "args": {"in_channels": 3, "out_channels": 4, "kernel_size": 3, "stride": 1, "pad": 1}},
              {"type": "BatchNorm2d", "args": {"num_features": 4}}, FLAT, linear(144, 2)]
    state = randomize(nn.build_sequential(queue, config), rng)
    base = tmp_path / "old_export"
    (tmp_path / "old_export.json").write_text(json.dumps({"type": "Sequential", "config": config, "version": 1}))
    np.savez(str(base) + ".npz", **state)
    model = load_model(base)
    assert_same_state(model, state)
    assert model.load_report.layout == "legacy" and model.load_report.version == 1
    assert nn.layer_to_config(model[1]) == BN


def test_oldest_flat_layers_config(tmp_path, queue, rng):
    flat = [{"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
            {"type": "Dropout", "p": 0.1}, {"type": "Linear", "in_features": 3, "out_features": 1, "bias": False}]
    config = [linear(4, 3), {"type": "ReLU"}, {"type": "Dropout", "args": {"p": 0.1}}, linear(3, 1, bias=False)]
    state = randomize(nn.build_sequential(queue, config), rng)
    netcl_style_file(tmp_path / "flat.netcl", state, {"type": "Sequential", "layers": flat})
    model = load_model(tmp_path / "flat.netcl")
    assert_same_state(model, state)
    assert nn.layer_to_config(model[2]) == {"type": "Dropout", "args": {"p": 0.1, "seed": None}}


def test_dot_netcl_suffix_fallback(tmp_path, queue):
    save_model(nn.Sequential(nn.Linear(queue, 2, 2)), tmp_path / "m.netcl")
    assert load_model(tmp_path / "m").load_report.path == str(tmp_path / "m.netcl")


def test_missing_file_lists_every_path_tried(tmp_path):
    p = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="tried: ") as info:
        load_model(p)
    msg = str(info.value)
    assert all(s in msg for s in (repr(p), f"{p}.json + {p}.npz", f"{p}.netcl"))
    assert isinstance(info.value, FileNotFoundError)


# -- metadata errors ------------------------------------------------------------------------------
def write_meta(path, meta_text, arrays=None):
    entries = dict(arrays or {"0:weight": np.ones((2, 2), np.float32)})
    if meta_text is not None:
        entries[META_KEY] = np.array(meta_text)
    with open(path, "wb") as f:
        np.savez(f, **entries)


GOOD_CONFIG = [linear(2, 2)]


@pytest.mark.parametrize(
    "meta_text,match",
    [(None, "missing NetCL metadata.*load_params"),
     ("{not json", "'__netcl_meta__' is not valid JSON"),
     ("[" * 100_000 + "]" * 100_000, "'__netcl_meta__' is not valid JSON"),
     ("[1, 2]", "must be a JSON object, got list"),
     (json.dumps({"type": "ResNet", "config": GOOD_CONFIG}), "model type 'ResNet' is not supported"),
     (json.dumps({"type": "Sequential", "config": GOOD_CONFIG, "version": 3}),
      "version 3 is newer than this fastckpt supports.*needs a fastckpt that supports version 3"),
     (json.dumps({"type": "Sequential", "config": GOOD_CONFIG, "version": "2"}), "'version' must be a positive int"),
     (json.dumps({"type": "Sequential", "config": GOOD_CONFIG, "format": "netcl.sharded"}), "'format' is 'netcl.sharded'"),
     (json.dumps({"type": "Sequential"}), "neither a 'config' nor a 'layers' list"),
     (json.dumps({"type": "Sequential", "config": {"a": 1}}), "'config' must be a list, got dict"),
     (json.dumps({"type": "Sequential", "config": [{"type": "GELU"}]}),
      r"cannot rebuild the model: config\[0\]: unknown layer type 'GELU'"),
     (json.dumps({"type": "Sequential", "config": [{"type": "Linear", "args": {"in_features": 2}}]}),
      r"missing required args \['out_features'\]")],
)
def test_bad_metadata_is_a_clear_format_error(tmp_path, queue, meta_text, match):
    path = tmp_path / "bad.netcl"
    write_meta(path, meta_text)
    with pytest.raises(FormatError, match=match) as info:
        load_model(path, queue)
    assert str(path) in str(info.value)


def test_non_string_metadata_array_is_refused(tmp_path, queue):
    path = tmp_path / "bad.netcl"
    with open(path, "wb") as f:
        np.savez(f, **{META_KEY: np.arange(3)})
    with pytest.raises(FormatError, match="must be a 0-d string array holding JSON, got int64"):
        load_model(path, queue)


# -- weights that do not match ----------------------------------------------------------------------
def test_missing_weights_keep_seeded_values_and_are_reported(tmp_path, queue, rng):
    config = [linear(3, 4), {"type": "ReLU"}, linear(4, 2)]
    state = randomize(nn.build_sequential(queue, config), rng)
    partial = {k: v for k, v in state.items() if k != "2:bias"}
    netcl_style_file(tmp_path / "p.netcl", partial, {"type": "Sequential", "config": config})
    with pytest.warns(MissingWeightsWarning, match=r"1 weights are not in the file.*\['2:bias'\]") as rec:
        model = load_model(tmp_path / "p.netcl")
    assert issubclass(rec[0].category, FastCkptWarning)
    assert model.load_report.missing_keys == ["2:bias"]
    fresh = nn.build_sequential(queue, config).state_dict()["2:bias"]  # what load_model built: seed 0
    assert model.state_dict()["2:bias"].tobytes() == fresh.tobytes()
    assert model.state_dict()["2:weight"].tobytes() == state["2:weight"].tobytes()


def test_unexpected_entries_raise_unless_not_strict(tmp_path, device, rng):
    from fastckpt.device.pool import PersistentBufferPool

    config = [linear(3, 2)]
    state = randomize(nn.build_sequential(device.queue, config), rng)
    extra = {**state, "9:junk": np.ones(3, np.float32), "adam.m": np.zeros(2, np.float32)}
    netcl_style_file(tmp_path / "x.netcl", extra, {"type": "Sequential", "config": config})
    with pytest.raises(KeyError, match=r"2 entries match no model weight: \['9:junk', 'adam.m'\].*strict=False"):
        load_model(tmp_path / "x.netcl")
    for pool in (None, PersistentBufferPool(device.context, device.queue)):
        model = load_model(tmp_path / "x.netcl", pool=pool, strict=False)
        assert sorted(model.load_report.unexpected_keys) == ["9:junk", "adam.m"]
        assert_same_state(model, state)


def test_non_canonical_index_in_a_file_is_an_unexpected_entry(tmp_path, queue, rng):
    config = [linear(3, 2)]
    state = randomize(nn.build_sequential(queue, config), rng)
    entries = {**state, "00:weight": np.zeros((3, 2), np.float32)}  # int("00") == 0, yet it names no weight
    netcl_style_file(tmp_path / "n.netcl", entries, {"type": "Sequential", "config": config})
    with pytest.raises(KeyError, match=r"1 entries match no model weight: \['00:weight'\]"):
        load_model(tmp_path / "n.netcl")
    model = load_model(tmp_path / "n.netcl", strict=False)
    assert model.load_report.unexpected_keys == ["00:weight"]
    assert_same_state(model, state)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path, queue, rng):
    config = [linear(3, 2)]
    netcl_style_file(tmp_path / "s.netcl", {"0:weight": np.ones((2, 3), np.float32), "0:bias": np.ones(2, np.float32)},
                     {"type": "Sequential", "config": config})
    with pytest.raises(ValueError, match=r"'0:weight': stored shape \(2, 3\), model expects \(3, 2\)"):
        load_model(tmp_path / "s.netcl")


@pytest.mark.parametrize("use_pool", [False, True], ids=["buffers", "pool"])
def test_squeeze_tolerance_1_by_c_bias(tmp_path, device, rng, use_pool):
    from fastckpt.device.pool import PersistentBufferPool

    config = [linear(3, 4)]
    w = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((1, 4)).astype(np.float32)
    netcl_style_file(tmp_path / "q.netcl", {"0:weight": w, "0:bias": b}, {"type": "Sequential", "config": config})
    pool = PersistentBufferPool(device.context, device.queue) if use_pool else None
    model = load_model(tmp_path / "q.netcl", pool=pool)
    assert model[0].bias.shape == (4,) and model.state_dict()["0:bias"].tobytes() == b.tobytes()


# -- pools ----------------------------------------------------------------------------------------
def test_loading_twice_through_one_pool_allocates_nothing(tmp_path, device, rng):
    from fastckpt.device.pool import PersistentBufferPool

    model = nn.build_sequential(device.queue, [CONV, BN, FLAT, linear(144, 16), {"type": "ReLU"}, linear(16, 3)])
    state = randomize(model, rng)
    save_model(model, tmp_path / "m.netcl")
    pool = PersistentBufferPool(device.context, device.queue)
    first = load_model(tmp_path / "m.netcl", pool=pool)
    assert_same_state(first, state)
    misses, allocated = pool.stats.misses, pool.stats.bytes_allocated
    assert misses == 1
    del first
    gc.collect()
    second = load_model(tmp_path / "m.netcl", pool=pool)
    assert pool.stats.misses == misses and pool.stats.bytes_allocated == allocated
    assert second.load_report.file_report.pool_hits == 1 and second.load_report.file_report.copies == 1
    assert_same_state(second, state)


def test_reloading_a_realigned_np_savez_file_through_one_pool_allocates_nothing(tmp_path, device, rng):
    from fastckpt.device.pool import PersistentBufferPool

    config = [CONV, BN, FLAT, linear(144, 5)]
    source = nn.build_sequential(device.queue, config)
    state = randomize(source, rng)
    netcl_style_file(tmp_path / "odd.netcl", state, {"type": "Sequential", "config": config})
    pool = PersistentBufferPool(device.context, device.queue)
    first = load_model(tmp_path / "odd.netcl", pool=pool)
    assert first.load_report.realigned_keys  # the file's payloads sit at odd offsets: a second arena is used
    misses, allocated = pool.stats.misses, pool.stats.bytes_allocated
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    expected = first(x).to_host()
    del first
    gc.collect()
    second = load_model(tmp_path / "odd.netcl", pool=pool)
    assert (pool.stats.misses, pool.stats.bytes_allocated) == (misses, allocated)
    assert second.load_report.file_report.pool_misses == 0
    assert_same_state(second, state)
    assert second(x).to_host().tobytes() == expected.tobytes()


def count_calls(monkeypatch, name):
    """Count the calls of fastckpt.nn's ``name`` made through the package (load_model looks it up there)."""
    calls = []
    original = getattr(nn, name)
    monkeypatch.setattr(nn, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_reload_through_a_pool_reuses_the_open_file_and_its_plan(tmp_path, device, rng, monkeypatch):
    from fastckpt.device.pool import PersistentBufferPool

    config = [CONV, BN, FLAT, linear(144, 16), {"type": "ReLU"}, linear(16, 16), linear(16, 16)]
    state = randomize(nn.build_sequential(device.queue, config), rng)
    partial = {k: v for k, v in state.items() if k != "6:bias"}  # one weight missing: seeded on every load
    netcl_style_file(tmp_path / "r.netcl", partial, {"type": "Sequential", "config": config})
    seeded_bias = nn.build_sequential(device.queue, config).state_dict()["6:bias"]
    normalize = count_calls(monkeypatch, "normalize_config")
    pool = PersistentBufferPool(device.context, device.queue)
    models = []
    # Every model is kept, and a few of the first one's weights still live in its buffer (the others were realigned
    # out of it): the reloads cannot reuse that buffer, and the pool says so once.
    with pytest.warns(FastCkptWarning, match=r"buffer of an earlier load of .*r\.netcl is still held by its tensors"):
        for _ in range(3):
            with pytest.warns(MissingWeightsWarning, match=r"\['6:bias'\]"):
                models.append(load_model(tmp_path / "r.netcl", pool=pool))
    assert pool.stats.blocked_misses >= 1
    assert len(normalize) == 1, "the reloads used the plan of the first load"
    assert [m.load_report.file_report.file_reused for m in models] == [False, True, True]
    first, second, third = models
    for model in models:
        assert model.load_report.missing_keys == ["6:bias"] and model.load_report.realigned_keys
        assert_same_state(model, {**partial, "6:bias": seeded_bias})
        assert [nn.layer_to_config(layer) for layer in model] == [{"args": {}, **entry} for entry in config]
    # New layer objects every time, and layers of equal configs hold their own weights.
    assert all(a is not b and a.__dict__ is not b.__dict__ for a, b in zip(first, second))
    assert second[5] is not second[6] and second[5].weight is not second[6].weight
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    assert first(x).to_host().tobytes() == third(x).to_host().tobytes()


def test_reload_through_a_pool_sees_a_replaced_or_rewritten_file(tmp_path, device, rng):
    from fastckpt.device.pool import PersistentBufferPool

    pool = PersistentBufferPool(device.context, device.queue)
    path = tmp_path / "m.netcl"
    a = nn.build_sequential(device.queue, [linear(3, 4), {"type": "ReLU"}])
    state_a = randomize(a, rng)
    save_model(a, path)
    assert_same_state(load_model(path, pool=pool), state_a)
    b = nn.build_sequential(device.queue, [linear(5, 2), {"type": "Tanh"}, linear(2, 2, bias=False)])
    state_b = randomize(b, rng)
    save_model(b, path, overwrite=True)  # replaced: a new inode
    loaded = load_model(path, pool=pool)
    assert not loaded.load_report.file_report.file_reused
    assert [type(layer).__name__ for layer in loaded] == ["Linear", "Tanh", "Linear"]
    assert_same_state(loaded, state_b)
    state_c = {k: v + 1 for k, v in state_b.items()}
    netcl_style_file(path, state_c, model_metadata(b))  # rewritten in place: the same inode
    loaded = load_model(path, pool=pool)
    assert not loaded.load_report.file_report.file_reused
    assert_same_state(loaded, state_c)


def test_reload_after_a_layer_type_is_registered_plans_again(tmp_path, device, rng, monkeypatch):
    from fastckpt.device.pool import PersistentBufferPool

    model = nn.build_sequential(device.queue, [linear(3, 2)])
    state = randomize(model, rng)
    save_model(model, tmp_path / "m.netcl")
    pool = PersistentBufferPool(device.context, device.queue)
    normalize = count_calls(monkeypatch, "normalize_config")
    load_model(tmp_path / "m.netcl", pool=pool)
    load_model(tmp_path / "m.netcl", pool=pool)
    assert len(normalize) == 1
    nn.register_layer("Unrelated", nn.ReLU)
    try:
        assert_same_state(load_model(tmp_path / "m.netcl", pool=pool), state)
    finally:
        nn.unregister_layer("Unrelated")
    assert len(normalize) == 2, "a registration since the first load: the config is read and built again"


def test_user_layer_type_saves_and_loads(tmp_path, queue, rng):
    from fastckpt.device.tensor import Tensor

    class Scale(nn.Module):
        _state_names = ("factor",)

        def __init__(self, queue=None, features=1):
            self.features, self.queue = features, queue
            self.factor = Tensor.from_host(queue, nn.init_rng().uniform(1, 2, features).astype(np.float32))

        def config_args(self):
            return {"features": self.features}

    nn.register_layer("Scale", Scale, queue_required=True)
    try:
        model = nn.Sequential(nn.Linear(queue, 2, 3), Scale(queue, 3))
        state = randomize(model, rng)
        save_model(model, tmp_path / "u.netcl")
        loaded = load_model(tmp_path / "u.netcl")
        assert isinstance(loaded[1], Scale)
        assert_same_state(loaded, state)
    finally:
        nn.unregister_layer("Scale")
    with pytest.raises(FormatError, match="unknown layer type 'Scale'"):
        load_model(tmp_path / "u.netcl")


def test_format_page_has_the_same_text_as_the_module_docstring():
    import pathlib

    import fastckpt.io.serialization as module

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "formats" / "netcl.md").read_text()
    spec = module.__doc__[: module.__doc__.index(">>>")].strip()
    assert spec in page


def test_demo_model_section_round_trips_through_a_pool(tmp_path, capsys):
    from fastckpt.cli.demo import _model_demo

    _model_demo(str(tmp_path), 32)
    out = capsys.readouterr().out
    assert "(1 copy)" in out and "allocations since the first load: 0)" in out
    assert out.rstrip().endswith("forward output bytes identical after the round trip: True")


# -- fuzzing the metadata: any JSON document either loads or fails with a FormatError ----------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.floats(allow_nan=False) | st.sampled_from(
        ["Sequential", "Linear", "ReLU", "netcl.single-file", "in_features", "out_features", "args", "type"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "args", "config", "layers", "version", "format", "in_features", "out_features",
                         "bias", "p"]), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=_json_values)
def test_arbitrary_metadata_never_escapes_as_an_unexpected_error(tmp_path, queue, meta):
    path = tmp_path / "fuzz.netcl"
    write_meta(path, json.dumps(meta), arrays={})
    try:
        load_model(path, queue, strict=False)
    except FormatError:
        pass
