"""fastckpt.io.checkpoint: save_params/load_params and save_netcl_checkpoint/load_netcl_checkpoint, with netcl's
traps fixed."""

from __future__ import annotations

import json
import os
import secrets

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from fastckpt.device.tensor import Tensor
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.npz import save_npz
from fastckpt.io.checkpoint import ARRAY_REF_KEY, load_netcl_checkpoint, load_params, save_netcl_checkpoint, save_params

pytestmark = pytest.mark.device

SHAPES = [(4, 3), (3,), (2, 2, 2)]


@pytest.fixture
def rng():
    return np.random.default_rng(secrets.randbits(32))


def make_params(queue, rng, dtype=np.float32):
    hosts = [rng.standard_normal(s).astype(dtype) + dtype(0.5) for s in SHAPES]
    return [Tensor.from_host(queue, h) for h in hosts], hosts


def blank_params(queue, dtype=np.float32):
    return [Tensor.from_host(queue, np.full(s, 7, dtype)) for s in SHAPES]


def assert_params(params, hosts):
    for p, h in zip(params, hosts):
        got = p.to_host()
        assert got.dtype == h.dtype and got.tobytes() == h.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
def test_params_round_trip_keeps_dtype(tmp_path, queue, rng, dtype):
    params, hosts = make_params(queue, rng, dtype)
    written = save_params(params, tmp_path / "raw" / "iter_1000")
    assert written == str(tmp_path / "raw" / "iter_1000.npz")
    with np.load(written) as z:
        assert sorted(z.files) == ["p0", "p1", "p2"]
    fresh = blank_params(queue, dtype)
    assert load_params(queue, fresh, tmp_path / "raw" / "iter_1000") == ["p0", "p1", "p2"]
    assert_params(fresh, hosts)


def test_named_params_and_a_generator_is_consumed_once(tmp_path, queue, rng):
    params, hosts = make_params(queue, rng)
    names = ["fc1.weight", "fc1.bias", "fc2.weight"]
    save_params((p for p in params), tmp_path / "g.npz", names=names)
    with np.load(tmp_path / "g.npz") as z:
        assert z.files == names
        assert all(z[n].tobytes() == h.tobytes() for n, h in zip(names, hosts))
    fresh = blank_params(queue)
    load_params(queue, (p for p in fresh), tmp_path / "g.npz", names=names)
    assert_params(fresh, hosts)


def test_missing_name_is_a_key_error_naming_index_and_key_and_writes_nothing(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    save_params(params, tmp_path / "r.npz", names=["a", "b", "c"])
    fresh = blank_params(queue)
    with pytest.raises(KeyError, match=r"params\[2\] \('zz'\) is not in the file"):
        load_params(queue, fresh, tmp_path / "r.npz", names=["a", "b", "zz"])
    assert all((p.to_host() == 7).all() for p in fresh)  # params[0] and [1] were valid but not written


def test_shape_mismatch_is_a_value_error_naming_index_and_key(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    save_params(params, tmp_path / "r.npz")
    fresh = blank_params(queue)
    fresh[1] = Tensor.from_host(queue, np.zeros((1, 3), np.float32))  # exact shapes: no squeeze tolerance here
    with pytest.raises(ValueError, match=r"params\[1\] \('p1'\): stored shape \(3,\), parameter shape \(1, 3\)"):
        load_params(queue, fresh, tmp_path / "r.npz")
    assert (fresh[0].to_host() == 7).all()


def test_dtype_mismatch_is_refused_not_cast(tmp_path, queue, rng):
    params, _ = make_params(queue, rng, np.float16)
    save_params(params, tmp_path / "h.npz")
    with pytest.raises(ValueError, match=r"params\[0\] \('p0'\): stored dtype float16, parameter dtype float32"):
        load_params(queue, blank_params(queue), tmp_path / "h.npz")


@pytest.mark.parametrize("names,match", [(["a", "b"], "2 names for 3 params"), (["a", "a", "b"], "'a' is used twice"),
                                         (["a", "", "b"], r"names\[1\] must be a non-empty str")])
def test_bad_names_write_nothing(tmp_path, queue, rng, names, match):
    params, _ = make_params(queue, rng)
    with pytest.raises(ValueError, match=match):
        save_params(params, tmp_path / "x.npz", names=names)
    assert os.listdir(tmp_path) == []


def test_numpy_arrays_work_as_params(tmp_path, rng):
    arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    save_params(arrays, tmp_path / "n")
    out = [np.zeros(s, np.float32) for s in SHAPES]
    load_params(None, out, tmp_path / "n")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(arrays, out))


# -- checkpoints --------------------------------------------------------------------------------------
def test_dotted_path_keeps_its_suffix(tmp_path, queue, rng):
    params, hosts = make_params(queue, rng)
    paths = save_netcl_checkpoint(params, tmp_path / "run.v1", config={"step": 3})
    assert paths == (str(tmp_path / "run.v1.npz"), str(tmp_path / "run.v1.json"))
    assert sorted(os.listdir(tmp_path)) == ["run.v1.json", "run.v1.npz"]
    fresh = blank_params(queue)
    assert load_netcl_checkpoint(queue, fresh, tmp_path / "run.v1") == {"optim_state": {}, "config": {"step": 3}}
    assert_params(fresh, hosts)


def test_json_without_arrays_is_exactly_netcls(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    optim, config = {"lr": 0.001, "betas": [0.9, 0.999]}, {"step": 1000, "scheduler": {"best": 0.5}}
    save_netcl_checkpoint(params, tmp_path / "c", optim_state=optim, config=config)
    assert (tmp_path / "c.json").read_text() == json.dumps({"optim_state": optim, "config": config})
    with np.load(tmp_path / "c.npz") as z:
        assert z.files == ["p0", "p1", "p2"]


def test_optimizer_moments_are_stored_as_array_references(tmp_path, queue, rng):
    params, hosts = make_params(queue, rng)
    moments = [(rng.standard_normal(s).astype(np.float32), rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
    velocity = [Tensor.from_host(queue, rng.standard_normal(s)) for s in SHAPES]  # float64 device tensors
    rng_state = np.random.RandomState(5).get_state()
    optim = {"t": 12, "moments": moments, "sgd": {"velocity": velocity}, "scale": np.float32(1024.0)}
    config = {"step": 12, "numpy_rng": rng_state, "lr_history": np.linspace(0, 1, 5)}
    save_netcl_checkpoint(params, tmp_path / "adam", optim_state=optim, config=config, names=["w", "b", "k"])

    doc = json.loads((tmp_path / "adam.json").read_text())
    assert doc["optim_state"]["moments"][0][0] == {ARRAY_REF_KEY: "optim_state.0"}
    assert doc["optim_state"]["sgd"]["velocity"][2] == {ARRAY_REF_KEY: "optim_state.8"}
    assert doc["optim_state"]["scale"] == 1024.0
    assert doc["config"]["numpy_rng"][1] == {ARRAY_REF_KEY: "config.0"}

    fresh = blank_params(queue)
    state = load_netcl_checkpoint(queue, fresh, tmp_path / "adam", names=["w", "b", "k"])
    assert_params(fresh, hosts)
    got = state["optim_state"]
    assert got["t"] == 12
    for (m, v), (gm, gv) in zip(moments, got["moments"]):
        assert gm.dtype == m.dtype and gm.tobytes() == m.tobytes() and gv.tobytes() == v.tobytes()
    for t, g in zip(velocity, got["sgd"]["velocity"]):
        assert g.dtype == np.float64 and g.tobytes() == t.to_host().tobytes()
    restored_rng = state["config"]["numpy_rng"]
    assert restored_rng[0] == "MT19937" and restored_rng[1].tobytes() == rng_state[1].tobytes()
    assert restored_rng[1].dtype == rng_state[1].dtype and restored_rng[2:] == list(rng_state[2:])
    np.random.RandomState().set_state(tuple(restored_rng))  # accepted back as a numpy RNG state
    assert state["config"]["lr_history"].tobytes() == np.linspace(0, 1, 5).tobytes()


@pytest.mark.parametrize(
    "optim,config,error,match",
    [({"m": {1, 2}}, None, TypeError, r"optim_state\['m'\]: a builtins.set cannot be stored"),
     ({1: np.zeros(2)}, None, TypeError, "dict key 1 is a int; parameter checkpoint sidecar keys must be str"),
     (None, {"fn": print}, TypeError, r"config\['fn'\]: a builtins.builtin_function_or_method cannot be stored"),
     ({ARRAY_REF_KEY: "x"}, None, ValueError, "reserved for the parameter checkpoint sidecar encoding"),
     ({"o": np.array([object()])}, None, TypeError, "an object array")],
)
def test_unstorable_state_writes_nothing(tmp_path, queue, rng, optim, config, error, match):
    params, hosts = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck", config={"step": 1})
    before = {n: (tmp_path / n).read_bytes() for n in ("ck.npz", "ck.json")}
    other, _ = make_params(queue, rng)
    with pytest.raises(error, match=match):
        save_netcl_checkpoint(other, tmp_path / "ck", optim_state=optim, config=config)
    assert sorted(os.listdir(tmp_path)) == ["ck.json", "ck.npz"]
    assert all((tmp_path / n).read_bytes() == b for n, b in before.items())


def test_circular_state_is_named_and_writes_nothing(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"optim_state\['loop'\]\[0\]: the state contains a reference cycle"):
        save_netcl_checkpoint(params, tmp_path / "ck", optim_state={"loop": loop})
    assert os.listdir(tmp_path) == []


def test_shared_but_not_circular_state_is_stored_twice(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    shared = [1, 2]
    save_netcl_checkpoint(params, tmp_path / "ck", config={"a": shared, "b": shared})
    assert load_netcl_checkpoint(queue, params, tmp_path / "ck")["config"] == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("fail_at", ["param", "npz_replace", "json_replace"])
def test_any_error_leaves_the_previous_pair_untouched(tmp_path, queue, rng, monkeypatch, fail_at):
    import fastckpt.store.commit as atomic

    params, hosts = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck", optim_state={"m": [np.ones(2)]}, config={"step": 1})
    before = {n: (tmp_path / n).read_bytes() for n in ("ck.npz", "ck.json")}
    other, _ = make_params(queue, rng)
    if fail_at == "param":
        class Lost:
            shape, dtype = (3,), np.dtype(np.float32)

            def to_host(self):
                raise RuntimeError("device lost")

        other[1] = Lost()
    else:
        real_replace, real_noreplace = os.replace, atomic.rename_noreplace
        target = "ck.npz" if fail_at == "npz_replace" else "ck.json"

        def failing(real):
            def rename(src, dst):  # the file's rename out of its temporary or staging place
                if os.fspath(dst).endswith(target) and ".partial" in os.fspath(src):
                    raise OSError(28, "No space left on device")
                return real(src, dst)
            return rename

        monkeypatch.setattr(atomic.os, "replace", failing(real_replace))
        monkeypatch.setattr(atomic, "rename_noreplace", failing(real_noreplace))
    with pytest.raises((RuntimeError, OSError), match="device lost|No space left"):
        save_netcl_checkpoint(other, tmp_path / "ck", optim_state={"m": [np.zeros(2), np.zeros(3)]},
                              config={"step": 2}, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck.json", "ck.npz"]
    assert all((tmp_path / n).read_bytes() == b for n, b in before.items())
    fresh = blank_params(queue)
    state = load_netcl_checkpoint(queue, fresh, tmp_path / "ck")
    assert state["config"] == {"step": 1} and state["optim_state"]["m"][0].tobytes() == np.ones(2).tobytes()
    assert_params(fresh, hosts)


def test_the_pair_is_written_in_place_in_the_staging_directory(tmp_path, queue, rng, monkeypatch):
    """The JSON and the NPZ are each opened once under their own names in the staging directory and never renamed
    there: the only renames are the publish's, into the directory, the NPZ last. Each is fsynced once (by the
    publish), then the directory. The NPZ's bytes are those of save_npz on its own."""
    from _writing import record_staged_writes

    params, hosts = make_params(queue, rng)
    seen = record_staged_writes(monkeypatch)
    save_netcl_checkpoint(params, tmp_path / "out" / "ck", config={"step": 1})
    assert seen.opened == ["ck.json", "ck.npz"]
    assert [dst for _src, dst in seen.renamed] == [os.fspath(tmp_path / "out" / n) for n in ("ck.json", "ck.npz")]
    assert sorted(seen.synced[:2]) == ["ck.json", "ck.npz"] and seen.synced[-1] == "out", seen.synced
    monkeypatch.undo()
    with np.load(tmp_path / "out" / "ck.npz") as z:  # its members in their order: the parameters
        members = {name: z[name] for name in z.files}
    assert [m.tobytes() for m in members.values()] == [h.tobytes() for h in hosts]
    save_npz(tmp_path / "alone.npz", members, alignment=4096)
    assert (tmp_path / "out" / "ck.npz").read_bytes() == (tmp_path / "alone.npz").read_bytes()


def test_new_pair_replaces_an_old_one_and_leaves_no_temporaries(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck", config={"step": 1})
    other, hosts = make_params(queue, rng)
    save_netcl_checkpoint(other, tmp_path / "ck", config={"step": 2}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck.json", "ck.npz"]
    fresh = blank_params(queue)
    assert load_netcl_checkpoint(queue, fresh, tmp_path / "ck")["config"] == {"step": 2}
    assert_params(fresh, hosts)


def deepest_json_list() -> int:
    """The deepest ``[[...]]`` json.loads parses from here (a binary search)."""
    lo, hi = 1, 200_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            json.loads("[" * mid + "]" * mid)
            lo = mid
        except RecursionError:
            hi = mid - 1
    return lo


def test_the_deepest_parse_exceeds_a_walk_of_one_frame_per_level():
    # The premise of the "parses, too deep to walk back" case below.
    import sys

    assert deepest_json_list() * 9 // 10 > sys.getrecursionlimit() / (2 if sys.version_info < (3, 12) else 1)


@pytest.mark.parametrize("nesting", ["parses, too deep to walk back", "too deep to parse"])
def test_deeply_nested_sidecar_is_a_format_error(tmp_path, queue, rng, nesting):
    # How deep json.loads parses differs between versions: on 3.11 one level of the recursion limit per list, from
    # 3.12 a C limit of its own (about 1,500 on 3.12, 10,000 on 3.13) whatever the Python stack. Walking the
    # lists back takes at least one Python frame per level (two before 3.12, when a comprehension was a frame of
    # its own). So nine tenths of what parses here still parses a few frames deeper, inside load_checkpoint,
    # and is deeper than the recursion limit lets the walk go, on every version.
    depth = deepest_json_list() * 9 // 10 if nesting.startswith("parses") else 100_000
    params, _ = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck")
    (tmp_path / "ck.json").write_text('{"config": ' + "[" * depth + "]" * depth + "}")
    fresh = blank_params(queue)
    message = "nests too deeply to restore" if nesting.startswith("parses") else "is not valid JSON"
    with pytest.raises(FormatError, match=f"ck.json: checkpoint sidecar {message}"):
        load_netcl_checkpoint(queue, fresh, tmp_path / "ck")
    assert all((p.to_host() == 7).all() for p in fresh)


def test_sidecar_that_is_not_an_object_is_a_format_error(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck")
    (tmp_path / "ck.json").write_text("[1, 2]")
    with pytest.raises(FormatError, match=r"ck.json: checkpoint sidecar must be a JSON object .*got list"):
        load_netcl_checkpoint(queue, blank_params(queue), tmp_path / "ck")


def test_param_names_colliding_with_state_arrays_are_refused(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    with pytest.raises(ValueError, match=r"\['optim_state.0'\] collide"):
        save_netcl_checkpoint(params, tmp_path / "ck", optim_state={"m": np.zeros(1)},
                              names=["optim_state.0", "b", "c"])
    assert os.listdir(tmp_path) == []


def test_checkpoint_without_sidecar_returns_empty_dict(tmp_path, queue, rng):
    params, hosts = make_params(queue, rng)
    save_params(params, tmp_path / "only")
    fresh = blank_params(queue)
    assert load_netcl_checkpoint(queue, fresh, tmp_path / "only") == {}
    assert_params(fresh, hosts)


def test_dangling_reference_is_a_format_error_before_any_write(tmp_path, queue, rng):
    params, _ = make_params(queue, rng)
    save_netcl_checkpoint(params, tmp_path / "ck")
    (tmp_path / "ck.json").write_text(json.dumps({"optim_state": {"m": {ARRAY_REF_KEY: "optim_state.4"}}, "config": {}}))
    fresh = blank_params(queue)
    with pytest.raises(FormatError, match=r"state\['optim_state'\]\['m'\] refers to array 'optim_state.4'"):
        load_netcl_checkpoint(queue, fresh, tmp_path / "ck")
    assert all((p.to_host() == 7).all() for p in fresh)


def test_missing_checkpoint(tmp_path, queue):
    with pytest.raises(CheckpointNotFoundError, match="ck.npz' does not exist"):
        load_netcl_checkpoint(queue, [], tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError, match="no parameter file"):
        load_params(queue, [], tmp_path / "ck")


def test_the_netcl_names_went_in_0_4_and_the_error_names_the_new_ones():
    # fastckpt.train.load_checkpoint reads a training checkpoint; the netcl pair has its own names (0.3 warned).
    import fastckpt.io.checkpoint as io_checkpoint

    with pytest.raises(AttributeError, match=r"save_checkpoint is save_netcl_checkpoint .*fastckpt\.train\.save_checkpoint"):
        io_checkpoint.save_checkpoint
    with pytest.raises(AttributeError, match=r"load_checkpoint is load_netcl_checkpoint"):
        io_checkpoint.load_checkpoint
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        io_checkpoint.nothing
    assert "save_checkpoint" not in io_checkpoint.__all__ and "load_checkpoint" not in io_checkpoint.__all__
