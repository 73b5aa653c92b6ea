"""Training checkpoints: byte-equal round trips, bit-exact resume, tying, atomicity, integrity."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path
from unittest import mock

import blake3
import ml_dtypes
import numpy as np
import pytest

from _writing import record_staged_writes
import fastckpt
from fastckpt.errors import CheckpointNotFoundError, FormatError, IntegrityError
from fastckpt.train.checkpoint import (
    EXTRA_FILE,
    MANIFEST_FILE,
    OPTIM_FILE,
    WEIGHTS_FILE,
    apply_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
    weights_digest,
)
from fastckpt.train.reference.selfcheck import (
    MACHINES,
    build_fresh,
    byte_equal,
    capture_full_state,
    first_difference,
    train_n_steps,
    unique_param_bytes,
)
from fastckpt.store.commit import _owner

OPTIMIZERS = ["sgd", "adam", "adamw"]
SCHEDULERS = ["step", "cosine", "plateau"]


def save(objs, out, step, **kw):
    kw.setdefault("overwrite", True)  # these tests replace on purpose
    return save_checkpoint(*objs.save_args(), out, step=step, epoch=objs.data_iter.epoch, extra_metrics={},
                           scaler=objs.scaler, **kw)


def restore(out, objs, **kw):
    state = load_checkpoint(out, **kw)
    apply_checkpoint(state, *objs.save_args(), scaler=objs.scaler)
    return state


# -- Block D: state equality --------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_byte_equivalent_roundtrip(tmp_path, optimizer, scheduler):
    live = build_fresh(42, optimizer=optimizer, scheduler=scheduler)
    train_n_steps(live, 10)
    before = capture_full_state(live)
    save(live, tmp_path / "ckpt", 10)
    fresh = build_fresh(42, optimizer=optimizer, scheduler=scheduler)
    assert first_difference(before, capture_full_state(fresh)) is not None  # the check can fail
    restore(tmp_path / "ckpt", fresh)
    after = capture_full_state(fresh)
    for key in MACHINES:
        assert first_difference(before[key], after[key]) is None, f"mismatch at {key}"


def test_a_checkpoints_files_are_written_in_place_in_the_staging_directory(tmp_path, monkeypatch):
    """Every file of a checkpoint is opened once under its own name in the staging directory and never renamed:
    the one rename is the directory's publish. Each file is fsynced once, the manifest (whose presence marks the
    directory complete) after the others, then the staging directory before its rename and the parent after."""
    live = build_fresh(42, optimizer="adam", scheduler="step")
    train_n_steps(live, 2)
    seen = record_staged_writes(monkeypatch)
    save(live, tmp_path / "ckpt", 2, overwrite=False)
    files = [WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE, MANIFEST_FILE]
    assert seen.opened == files
    ((staging, final),) = seen.renamed
    assert final == os.fspath(tmp_path / "ckpt") and os.path.dirname(staging) == os.fspath(tmp_path)
    assert sorted(seen.synced[:3]) == sorted(files[:3]), seen.synced  # fsynced in the background
    assert seen.synced[3:] == [MANIFEST_FILE, os.path.basename(staging), tmp_path.name]
    monkeypatch.undo()
    verify_checkpoint(tmp_path / "ckpt")
    fresh = build_fresh(42, optimizer="adam", scheduler="step")
    restore(tmp_path / "ckpt", fresh)
    assert first_difference(capture_full_state(live), capture_full_state(fresh)) is None


def test_a_checkpoint_saved_without_fsync_syncs_nothing(tmp_path, monkeypatch):
    """``fsync=False``: the files are still written in place and only the publish renames, and nothing is
    fsynced (not durable against power loss, still atomic against readers)."""
    live = build_fresh(42, optimizer="sgd", scheduler="step")
    seen = record_staged_writes(monkeypatch)
    save(live, tmp_path / "ckpt", 0, overwrite=False, fsync=False)
    assert seen.opened == [WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE, MANIFEST_FILE]
    assert [dst for _src, dst in seen.renamed] == [os.fspath(tmp_path / "ckpt")] and seen.synced == []


def test_state_machines_actually_moved():
    """The round trip is only meaningful if training changed every machine's state."""
    live = build_fresh(42)
    start = capture_full_state(live)
    train_n_steps(live, 10)
    moved = capture_full_state(live)
    assert [m for m in MACHINES if byte_equal(start[m], moved[m])] == []
    assert live.optimizer.t < 10  # the scaler skipped overflowing steps


# -- Block E: continuation ----------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_matches_continuous(tmp_path, optimizer, scheduler):
    ref = build_fresh(42, optimizer=optimizer, scheduler=scheduler)
    losses_ref = train_n_steps(ref, 20)
    first = build_fresh(42, optimizer=optimizer, scheduler=scheduler)
    losses_a = train_n_steps(first, 10)
    save(first, tmp_path / "ckpt", 10)
    second = build_fresh(42, optimizer=optimizer, scheduler=scheduler)
    restore(tmp_path / "ckpt", second)
    losses_b = train_n_steps(second, 10)
    np.testing.assert_array_equal(np.array(losses_ref), np.array(losses_a + losses_b))
    assert np.array(losses_ref).tobytes() == np.array(losses_a + losses_b).tobytes()
    assert byte_equal(capture_full_state(ref), capture_full_state(second))


@pytest.mark.parametrize("split", [7, 10, 14])
def test_resume_across_epoch_boundary(tmp_path, split):
    # 1000 tokens -> 62 windows of 17 -> 7 batches of 8 per epoch; 20 steps cross two boundaries,
    # and split=7 / 14 checkpoints exactly at a boundary (position == batches_per_epoch).
    ref = build_fresh(5, num_tokens=1000)
    losses_ref = train_n_steps(ref, 20)
    assert ref.data_iter.batches_per_epoch == 7 and ref.data_iter.epoch == 2
    first = build_fresh(5, num_tokens=1000)
    losses_a = train_n_steps(first, split)
    save(first, tmp_path / "ckpt", split)
    second = build_fresh(5, num_tokens=1000)
    restore(tmp_path / "ckpt", second)
    losses_b = train_n_steps(second, 20 - split)
    assert np.array(losses_ref).tobytes() == np.array(losses_a + losses_b).tobytes()


@pytest.mark.parametrize("bit_generator", ["PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"])
def test_rng_restored_by_state_not_reseeded(tmp_path, bit_generator):
    first = build_fresh(11, bit_generator=bit_generator)
    train_n_steps(first, 4)
    first.train_rng.random(3)  # leave Philox/MT19937 mid-buffer, not at a draw boundary
    save(first, tmp_path / "ckpt", 4)
    second = build_fresh(11, bit_generator=bit_generator)
    restore(tmp_path / "ckpt", second)
    assert first.train_rng.bytes(64) == second.train_rng.bytes(64)
    assert np.array(train_n_steps(first, 3)).tobytes() == np.array(train_n_steps(second, 3)).tobytes()


def test_fastckpt_stateful_rng_as_train_rng(tmp_path):
    from fastckpt.stateful.rng import RNG

    rng = RNG(seed=3)
    rng.random(7)
    objs = build_fresh(1)
    save_checkpoint(objs.model, None, None, None, rng, tmp_path / "c", step=0)
    other = RNG(seed=99)
    apply_checkpoint(load_checkpoint(tmp_path / "c"), build_fresh(1).model, train_rng=other)
    assert np.array_equal(rng.random(5), other.random(5))


# -- Block F: weight tying ----------------------------------------------------------------------
def test_weight_tying_preserved(tmp_path):
    live = build_fresh(7, tie_weights=True)
    assert id(live.model.embed.weight.data) == id(live.model.lm_head.weight.data)
    train_n_steps(live, 3)
    save(live, tmp_path / "ckpt", 3)
    size = (tmp_path / "ckpt" / WEIGHTS_FILE).stat().st_size
    expected = unique_param_bytes(live.model)
    assert abs(size - expected) < 4096, f"file size {size} != expected {expected}; tying broken?"
    with fastckpt.open(tmp_path / "ckpt" / WEIGHTS_FILE) as f:
        assert f.metadata["lm_head.weight"] == "ALIAS(embed.weight)"
        assert "lm_head.weight" not in f and "embed.weight" in f
        assert f.nbytes == expected
    fresh = build_fresh(7, tie_weights=True)
    state = restore(tmp_path / "ckpt", fresh)
    assert state.model_weights["lm_head.weight"] is state.model_weights["embed.weight"]
    assert id(fresh.model.embed.weight.data) == id(fresh.model.lm_head.weight.data)
    assert np.array_equal(fresh.model.lm_head.weight.data, live.model.embed.weight.data)


def test_untied_weights_stored_twice(tmp_path):
    live = build_fresh(7, tie_weights=False)
    save(live, tmp_path / "ckpt", 0)
    with fastckpt.open(tmp_path / "ckpt" / WEIGHTS_FILE) as f:
        assert "lm_head.weight" in f and "lm_head.weight" not in f.metadata
        assert f.nbytes == unique_param_bytes(live.model)
    state = load_checkpoint(tmp_path / "ckpt")
    assert state.model_weights["lm_head.weight"] is not state.model_weights["embed.weight"]


def test_weights_file_readable_by_reference_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    live = build_fresh(7)
    save(live, tmp_path / "ckpt", 0)
    loaded = st.load_file(str(tmp_path / "ckpt" / WEIGHTS_FILE))
    assert sorted(loaded) == ["embed.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert np.array_equal(loaded["embed.weight"], live.model.embed.weight.data)


class _StateHolder:
    """A minimal object following the state_dict protocol with an arbitrary state tree."""

    def __init__(self, state):
        self.state = state
        self.loaded = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def _roundtrip_model_state(tmp_path, state):
    save_checkpoint(_StateHolder(state), None, None, None, None, tmp_path / "c", step=0)
    return load_checkpoint(tmp_path / "c").model_weights


def test_views_of_one_array_are_aliased_overlaps_are_not(tmp_path):
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {"a": base, "b": base[:], "c": base[1:], "d": base.T}
    back = _roundtrip_model_state(tmp_path, state)
    with fastckpt.open(tmp_path / "c" / WEIGHTS_FILE) as f:
        assert sorted(f) == ["a", "c", "d"]
        assert f.metadata["b"] == "ALIAS(a)"
    assert back["b"] is back["a"]
    assert back["c"] is not back["a"] and np.array_equal(back["c"], base[1:])
    assert np.array_equal(back["d"], base.T)


@pytest.mark.parametrize("value", [
    2**127 + 5, -(2**64), 2**53, float("inf"), float("-inf"), -0.0, 1e-310, 0.1,
    np.float32(1.5), np.float64(-0.0), np.int64(-3), np.bool_(True), np.float16(0.333), np.str_("ü"),
    np.array(-2.5, dtype=ml_dtypes.bfloat16)[()], np.array(0.75, dtype=ml_dtypes.float8_e4m3fn)[()], (1, "a", None),
    {0: "int key", "__x": 1}, [[1, 2], {"t": (3.0,)}], True, None, "ünïcode",
], ids=repr)
def test_tree_values_roundtrip_exactly(tmp_path, value):
    state = {"w": np.ones(2, np.float32), "meta": value}
    back = _roundtrip_model_state(tmp_path, state)
    assert first_difference(state, back) is None


def test_nan_roundtrips(tmp_path):
    back = _roundtrip_model_state(tmp_path, {"x": float("nan")})
    assert back["x"] != back["x"]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool",
                                   ">f4", "bfloat16"])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_array_dtypes_and_shapes_roundtrip(tmp_path, dtype, shape):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    arr = np.array(np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 1.25).astype(dtype)
    assert isinstance(arr, np.ndarray) and arr.shape == shape
    opt = _StateHolder({"moments": [arr, np.asfortranarray(np.ones((2, 3), np.float32))], "t": 3})
    save_checkpoint(_StateHolder({"w": np.zeros(1, np.float32)}), opt, None, None, None, tmp_path / "c", step=0)
    back = load_checkpoint(tmp_path / "c").optim_state
    assert back["t"] == 3
    got = back["moments"][0]
    assert got.shape == arr.shape and got.dtype == np.dtype(dtype).newbyteorder("<")
    assert got.tobytes() == np.ascontiguousarray(arr, dtype=got.dtype).tobytes()
    assert got.flags.writeable and back["moments"][1].flags.c_contiguous


@pytest.mark.parametrize("value", [
    np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16),
    np.array([[0.5], [-4.0]], dtype=ml_dtypes.float8_e5m2),
    np.arange(6, dtype=">i2").reshape(2, 3),
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    np.zeros((0, 2), dtype=np.complex64),
    np.array(["ab", "ü"]),
], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_arrays_inline_in_extra_json_roundtrip_exactly(tmp_path, value):
    # Scheduler, data-iterator and RNG states live in extra.json, arrays inline as base64.
    save_checkpoint(_StateHolder({"w": np.zeros(1, np.float32)}), None, _StateHolder({"v": value}), None, None,
                    tmp_path / "c", step=0)
    extra = json.loads((tmp_path / "c" / EXTRA_FILE).read_text())
    assert set(extra["scheduler"]["v"]) == {"__ndarray__", "dtype", "shape"}
    back = load_checkpoint(tmp_path / "c").scheduler_state["v"]
    assert back.dtype == value.dtype and back.shape == value.shape and back.flags.c_contiguous
    assert back.tobytes() == np.ascontiguousarray(value).tobytes()


def _replace_file(directory: Path, name: str, data: bytes) -> None:
    """Write ``name`` and record its new size and hash in the manifest, as a forger would."""
    (directory / name).write_bytes(data)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"blake3": blake3.blake3(data).hexdigest(), "bytes": len(data)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("bad, match", [
    ({"__ndarray__": "AAAAAA==", "dtype": "<f4", "shape": [-1]}, r"shape must be a list of non-negative integers"),
    ({"__ndarray__": "AAAAAAAAAAA=", "dtype": "<f4", "shape": [3]}, r"needs 12 bytes, the base64 data holds 8"),
    ({"__ndarray__": "", "dtype": "|O", "shape": [0]}, r"array dtype '\|O' is not allowed"),
    ({"__ndarray__": "", "dtype": "<f4", "shape": [0], "extra": 1}, r"malformed array object"),
    ({"__scalar__": {"dtype": "<f4", "data": "AAAAAAAAAAA="}}, r"8 bytes of data for a float32 scalar of 4"),
    ({"__scalar__": {"dtype": "<M8[D]", "data": "AAAAAAAAAAA="}}, r"array dtype '<M8\[D\]' is not allowed"),
])
def test_malformed_values_in_extra_json_are_format_errors(tmp_path, bad, match):
    out = tmp_path / "c"
    save_checkpoint(_StateHolder({"w": np.zeros(1, np.float32)}), None, _StateHolder({"v": 1}), None, None, out, step=0)
    extra = json.loads((out / EXTRA_FILE).read_text())
    extra["scheduler"] = {"v": bad}
    _replace_file(out, EXTRA_FILE, json.dumps(extra).encode())
    with pytest.raises(FormatError, match=match) as err:
        load_checkpoint(out)
    assert str(out / EXTRA_FILE) in str(err.value)


@pytest.mark.parametrize("damage", ["deep", "huge", "not-json"])
def test_a_hostile_extra_json_is_a_format_error_naming_it(tmp_path, damage, monkeypatch):
    # extra.json was read with a plain json.loads: a 100,000-deep one raised RecursionError, and nothing bounded
    # its size. It is read through fastckpt.store.manifest now, as every manifest is.
    import fastckpt.train.format as train_format

    out = tmp_path / "c"
    save_checkpoint(_StateHolder({"w": np.zeros(1, np.float32)}), None, _StateHolder({"v": 1}), None, None, out, step=0)
    extra = json.loads((out / EXTRA_FILE).read_text())
    if damage == "deep":
        extra["scheduler"] = {"v": 0}
        data = json.dumps(extra).encode().replace(b'{"v": 0}', b"[" * 100_000 + b"]" * 100_000)
        match = "nested deeper than 256 levels"
    elif damage == "huge":
        data = json.dumps(extra).encode() + b" " * 4096  # over the limit below: refused before it is read
        monkeypatch.setattr(train_format, "_MAX_EXTRA_BYTES", 1024)
        match = "more than the 1024 a checkpoint's metadata file may have"
    else:
        data = b'{"format": "fastckpt.train.extra",'
        match = "not valid JSON"
    _replace_file(out, EXTRA_FILE, data)
    with pytest.raises(FormatError, match=match) as err:
        load_checkpoint(out)
    assert str(out / EXTRA_FILE) in str(err.value)
    problems = verify_checkpoint(out)
    assert any(str(out / EXTRA_FILE) in p and re.search(match, p) for p in problems), problems


def test_loaded_arrays_are_private_copies(tmp_path):
    live = build_fresh(1)
    save(live, tmp_path / "ckpt", 0)
    state = load_checkpoint(tmp_path / "ckpt")
    w = state.model_weights["fc1.weight"]
    w += 1  # writable, and must not touch the file
    assert load_checkpoint(tmp_path / "ckpt").model_weights["fc1.weight"].tobytes() != w.tobytes()


class _ToHost:
    def __init__(self, arr):
        self.arr = arr

    def to_host(self):
        return self.arr


class _ArrayLike:
    def __init__(self, arr):
        self.arr = arr

    def __array__(self, dtype=None, copy=None):
        return self.arr


class _DLPackOnly:
    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


@pytest.mark.parametrize("wrap", [_ToHost, _ArrayLike, _DLPackOnly])
def test_foreign_tensor_types_are_saved(tmp_path, wrap):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    back = _roundtrip_model_state(tmp_path, {"w": wrap(arr), "tied": wrap(arr)})
    assert np.array_equal(back["w"], arr) and back["tied"] is back["w"]


def test_object_arrays_are_refused(tmp_path):
    with pytest.raises(TypeError, match="object array"):
        save_checkpoint(_StateHolder({"w": np.array([object()])}), None, None, None, None, tmp_path / "c", step=0)
    assert not (tmp_path / "c").exists()


def test_unsupported_state_value_names_the_path(tmp_path):
    opt = _StateHolder({"groups": [{"fn": print}]})
    with pytest.raises(TypeError, match=r"optimizer\['groups'\]\[0\]\['fn'\]: a builtins"):
        save_checkpoint(_StateHolder({"w": np.zeros(1)}), opt, None, None, None, tmp_path / "c", step=0)


def test_colliding_joined_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="a.b"):
        _roundtrip_model_state(tmp_path, {"a.b": np.zeros(1), "a": {"b": np.ones(1)}})


def test_torch_module_and_optimizer(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(10)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    save_checkpoint(model, opt, None, None, None, tmp_path / "c", step=3)
    with fastckpt.open(tmp_path / "c" / WEIGHTS_FILE) as f:
        assert f.metadata["1.weight"] == "ALIAS(0.weight)"
    model2 = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model2[1].weight = model2[0].weight
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    apply_checkpoint(load_checkpoint(tmp_path / "c"), model2, opt2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert opt.state_dict()["param_groups"] == opt2.state_dict()["param_groups"]


# -- Block G: atomic writes ---------------------------------------------------------------------
def _failing_step(monkeypatch, fail_at: int | None) -> list[str]:
    """From now on, the ``fail_at``-th step of a save (0-based; None: none) raises KeyboardInterrupt. Its steps:
    each open of a file written in place in the staging directory, and each ``os.replace``. Returns the list the
    steps' paths are appended to."""
    import fastckpt.formats.safetensors as safetensors_module
    from fastckpt.store import commit as _atomic

    calls = []

    def step(path):
        calls.append(os.fspath(path))
        if len(calls) - 1 == fail_at:
            raise KeyboardInterrupt

    real_open, real_replace = _atomic.staged_file, os.replace

    def staged_file(path, **kwargs):
        step(path)
        return real_open(path, **kwargs)

    def replace(src, dst):
        step(dst)
        return real_replace(src, dst)

    for module in (_atomic, safetensors_module):
        monkeypatch.setattr(module, "staged_file", staged_file)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_atomic_write_failure_resilience(tmp_path):
    live = build_fresh(3)
    out = tmp_path / "ckpt"
    # interrupted at the one atomic step: the no-replace rename that publishes the directory
    with mock.patch("fastckpt.store.commit.rename_noreplace", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            save(live, out, 0)
    assert not out.exists()
    assert not (out / WEIGHTS_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the temporary went with the exception
    save(live, out, 0)
    assert (out / WEIGHTS_FILE).exists() and (out / MANIFEST_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("fail_at", range(6))
def test_interrupted_overwrite_keeps_previous_checkpoint(tmp_path, fail_at, monkeypatch):
    # Interrupt each step of a save in turn: the opens of weights, optim, extra and manifest (written in place in
    # the staging directory), then the two directory renames of a replacement (the old one aside, the new one
    # in). Where renameat2 can exchange the directories no second rename exists; this test takes the
    # two-rename path everywhere. A new directory is committed by a no-replace rename, not os.replace: a first
    # save makes the 4 opens only.
    from fastckpt.store import commit as _atomic

    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    with monkeypatch.context() as counting:
        calls = _failing_step(counting, None)
        save(build_fresh(3), tmp_path / "count", 0)
    assert [os.path.basename(c) for c in calls] == [WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE, MANIFEST_FILE]
    old = build_fresh(3)
    out = tmp_path / "ckpt"
    old_digest = save(old, out, 0)
    new = build_fresh(3)
    train_n_steps(new, 2)
    calls = _failing_step(monkeypatch, fail_at)
    with pytest.raises(KeyboardInterrupt):
        save(new, out, 2)
    monkeypatch.undo()
    assert len(calls) > fail_at  # the step interrupted was reached (after it: the put-back of a replacement)
    state = load_checkpoint(out)  # the old checkpoint, whole and verified
    assert state.step == 0 and state.manifest["weights_digest"] == old_digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "count"]


def test_leftover_of_a_dead_process_is_cleaned_by_next_save(tmp_path):
    live = build_fresh(3)
    stale = tmp_path / f".ckpt.{_owner()}.999999999.deadbeef.partial"
    stale.mkdir()
    (stale / WEIGHTS_FILE).write_bytes(b"half a file")
    save(live, tmp_path / "ckpt", 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a fastckpt checkpoint"):
        save(build_fresh(1), out, 0)
    assert (out / "todo.txt").read_text() == "keep me"


def test_overwrite_false_refuses_existing(tmp_path):
    save(build_fresh(1), tmp_path / "c", 0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save(build_fresh(1), tmp_path / "c", 1, overwrite=False)


def test_empty_existing_directory_is_used(tmp_path):
    save(build_fresh(1), tmp_path, 0)  # pytest's tmp_path exists and is empty
    assert (tmp_path / MANIFEST_FILE).exists()


# -- integrity ----------------------------------------------------------------------------------
HASHES = {"blake3": lambda data: blake3.blake3(data).hexdigest(),
          "sha256": lambda data: hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("algorithm", sorted(HASHES))
@pytest.mark.parametrize("where", [-2, 12], ids=["payload", "header"])
@pytest.mark.parametrize("name", [WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE])
def test_hash_mismatch_detected(tmp_path, name, where, algorithm):
    live = build_fresh(1)
    save(live, tmp_path / "c", 0, hash=algorithm)
    path = tmp_path / "c" / name
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01  # one bit: in the data section or the JSON header / text
    path.write_bytes(bytes(data))
    expected = read_manifest(tmp_path / "c")["files"][name][algorithm]
    with pytest.raises(IntegrityError) as err:
        load_checkpoint(tmp_path / "c")
    msg = str(err.value)
    assert f"{name}: {algorithm} mismatch" in msg and expected in msg and HASHES[algorithm](bytes(data)) in msg
    assert "verify=False" in msg
    problems = verify_checkpoint(tmp_path / "c")
    assert len(problems) == 1 and f"{name}: {algorithm} mismatch" in problems[0]


@pytest.mark.parametrize("algorithm", sorted(HASHES))
def test_every_file_is_hashed_as_written_with_the_chosen_algorithm(tmp_path, algorithm, monkeypatch):
    from fastckpt.formats import hashing

    def no_reading_back(*args):
        raise AssertionError("a file was read back to hash it")

    monkeypatch.setattr(hashing, "sha256_file", no_reading_back)
    monkeypatch.setattr(hashing, "blake3_file", no_reading_back)
    digest = save(build_fresh(1), tmp_path / "c", 0, hash=algorithm)
    monkeypatch.undo()
    m = read_manifest(tmp_path / "c")
    assert m["schema_version"] == "2.0" and set(m["files"]) == {WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE}
    for name, entry in m["files"].items():
        data = (tmp_path / "c" / name).read_bytes()
        assert entry == {algorithm: HASHES[algorithm](data), "bytes": len(data)}, name
    weights = (tmp_path / "c" / WEIGHTS_FILE).read_bytes()
    assert digest == m["weights_digest"] == f"{algorithm}:{HASHES[algorithm](weights)}"
    assert weights_digest(m) == digest and verify_checkpoint(tmp_path / "c") == []


def test_unknown_hash_is_refused(tmp_path):
    expected = r"hash='md5': training checkpoints hash their files with one of 'blake3', 'sha256'"
    with pytest.raises(ValueError, match=expected):
        save(build_fresh(1), tmp_path / "c", 0, hash="md5")
    assert not (tmp_path / "c").exists()


def test_entry_with_an_unknown_algorithm_is_a_format_error(tmp_path):
    save(build_fresh(1), tmp_path / "c", 0)
    path = tmp_path / "c" / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    entry = manifest["files"][EXTRA_FILE]
    manifest["files"][EXTRA_FILE] = {"xxh3": entry["blake3"], "bytes": entry["bytes"]}
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"files entry 'extra.json' .* expects one hash, keyed by its algorithm "
                                          r"\('blake3' or 'sha256'\)"):
        load_checkpoint(tmp_path / "c")


def test_hashing_may_start_after_the_files_are_closed(tmp_path, monkeypatch):
    # The loader hashes each mapped file on a pool thread while it copies the tensors out; a thread
    # that starts only once the files are closed must still hash them (and still catch a change).
    from fastckpt.train import checkpoint

    live = build_fresh(1)
    save(live, tmp_path / "c", 0)
    closed, all_closed = [], threading.Event()
    real_close, real_check = checkpoint._TensorSource.close, checkpoint._check_view

    def close(self):
        real_close(self)
        closed.append(self.path.name)
        if len(closed) == 2:
            all_closed.set()

    def check_once_closed(*args):
        assert all_closed.wait(60)
        return real_check(*args)

    monkeypatch.setattr(checkpoint._TensorSource, "close", close)
    monkeypatch.setattr(checkpoint, "_check_view", check_once_closed)
    assert byte_equal(load_checkpoint(tmp_path / "c").model_weights, live.model.state_dict())
    assert sorted(closed) == [OPTIM_FILE, WEIGHTS_FILE]
    path = tmp_path / "c" / OPTIM_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    closed.clear()
    all_closed.clear()
    with pytest.raises(IntegrityError, match=f"{OPTIM_FILE}: blake3 mismatch"):
        load_checkpoint(tmp_path / "c")


def test_verify_false_skips_hashing(tmp_path):
    live = build_fresh(1)
    save(live, tmp_path / "c", 0)
    path = tmp_path / "c" / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80  # the sign bit of the last float32 of the data section
    path.write_bytes(bytes(data))
    state = load_checkpoint(tmp_path / "c", verify=False)
    assert first_difference(state.model_weights, live.model.state_dict()) is not None


def test_truncated_file_detected(tmp_path):
    save(build_fresh(1), tmp_path / "c", 0)
    path = tmp_path / "c" / OPTIM_FILE
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(IntegrityError, match="bytes, the manifest says"):
        load_checkpoint(tmp_path / "c", verify=False)


def test_missing_manifest_is_not_a_checkpoint(tmp_path):
    save(build_fresh(1), tmp_path / "c", 0)
    (tmp_path / "c" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointNotFoundError, match="never completed"):
        load_checkpoint(tmp_path / "c")
    with pytest.raises(CheckpointNotFoundError, match=r"nothing: no such checkpoint directory"):
        load_checkpoint(tmp_path / "nothing")


@pytest.mark.parametrize("version, ok", [("2.0", True), ("2.9", True), ("3.0", False), ("0.1", False), (1, False)])
def test_schema_version_checked(tmp_path, version, ok):
    save(build_fresh(1), tmp_path / "c", 0)
    path = tmp_path / "c" / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["schema_version"] = version
    path.write_text(json.dumps(manifest))
    if ok:
        assert load_checkpoint(tmp_path / "c").manifest["schema_version"] == version
    else:
        with pytest.raises(FormatError, match="schema_version"):
            load_checkpoint(tmp_path / "c")


def test_manifest_contents(tmp_path):
    live = build_fresh(1)
    train_n_steps(live, 2)
    digest = save_checkpoint(*live.save_args(), tmp_path / "c", step=2, epoch=0,
                             extra_metrics={"loss": np.float32(2.5), "acc": 0.5}, seed=1,
                             config={"lr": 0.01, "layers": [1, 2]})
    m = read_manifest(tmp_path / "c")
    weights = (tmp_path / "c" / WEIGHTS_FILE).read_bytes()
    assert m["weights_digest"] == digest == "blake3:" + blake3.blake3(weights).hexdigest()
    assert set(m["files"]) == {WEIGHTS_FILE, OPTIM_FILE, EXTRA_FILE}
    for name, entry in m["files"].items():
        assert entry["bytes"] == (tmp_path / "c" / name).stat().st_size
    assert m["metrics"] == {"loss": 2.5, "acc": 0.5} and m["seed"] == 1 and m["step"] == 2
    assert m["config_source"] == "given" and m["config_hash"].startswith("sha256:")
    assert m["data_manifest_hash"].startswith("sha256:")
    assert {"python", "numpy", "fastckpt"} <= set(m["versions"]) and "machine" in m["hardware"]
    assert "git_commit" in m
    # The same config in another key order hashes the same.
    save_checkpoint(*live.save_args(), tmp_path / "d", step=2, config={"layers": [1, 2], "lr": 0.01})
    assert read_manifest(tmp_path / "d")["config_hash"] == m["config_hash"]


def test_save_without_git_still_works(tmp_path, monkeypatch):
    from fastckpt.train import snapshot

    monkeypatch.setattr(snapshot, "_GIT_COMMIT", [])
    monkeypatch.delenv("FASTCKPT_GIT_COMMIT", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    save(build_fresh(1), tmp_path / "c", 0)
    assert read_manifest(tmp_path / "c")["git_commit"] is None


def test_apply_refuses_missing_state(tmp_path):
    live = build_fresh(1)
    save_checkpoint(live.model, None, None, None, None, tmp_path / "c", step=0)
    with pytest.raises(ValueError, match="no optimizer state"):
        apply_checkpoint(load_checkpoint(tmp_path / "c"), build_fresh(1).model, build_fresh(1).optimizer)


def test_restore_onto_other_data_is_refused(tmp_path):
    live = build_fresh(1)
    save(live, tmp_path / "c", 0)
    other = build_fresh(1, num_tokens=2000)
    with pytest.raises(ValueError, match="same data"):
        apply_checkpoint(load_checkpoint(tmp_path / "c"), *other.save_args())


@pytest.mark.device
def test_fastckpt_device_tensors_are_saved(tmp_path):
    from fastckpt.device import default
    from fastckpt.device.tensor import Tensor

    dev = default()
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_host(dev.queue, host)
    back = _roundtrip_model_state(tmp_path, {"w": t, "tied": t, "b": Tensor.from_host(dev.queue, host[0])})
    assert np.array_equal(back["w"], host) and back["tied"] is back["w"]
    assert np.array_equal(back["b"], host[0]) and back["b"] is not back["w"]


def test_hostile_deep_tree_is_a_format_error(tmp_path):
    import fastckpt as fc

    save_checkpoint(_StateHolder({"w": np.zeros(1, np.float32)}), None, None, None, None, tmp_path / "c", step=0)
    path = tmp_path / "c" / WEIGHTS_FILE
    deep = "[" * 100000 + "]" * 100000
    fc.save_safetensors(path, {"w": np.zeros(1, np.float32)},
                        {"fastckpt.format": "fastckpt.train.weights", "fastckpt.tree": deep}, alignment=64,
                        overwrite=True)
    manifest_path = tmp_path / "c" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][WEIGHTS_FILE]["bytes"] = path.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="nested too deeply"):
        load_checkpoint(tmp_path / "c", verify=False)


def test_a_loaded_state_repr_is_a_short_summary(tmp_path):
    # It printed every array (91,142 characters for a small model); now where it is from and how much it holds.
    from fastckpt.train import AdamW, TinyLM

    lm = TinyLM(vocab=256, dim=64, hidden=256, seed=0)
    opt = AdamW(lm.parameters(), lr=1e-2)
    save_checkpoint(lm, opt, None, None, None, tmp_path / "c", step=7, extra_metrics={"loss": 1.5})
    state = load_checkpoint(tmp_path / "c")
    text = repr(state)
    assert len(text) < 300, text
    assert text.startswith("CheckpointState(step=7, epoch=0, path=") and str(tmp_path / "c") in text
    weights = {id(v): v.nbytes for v in state.model_weights.values()}  # tied weights count once
    assert f"model_weights {len(weights)}" in text and "metrics={'loss': 1.5}" in text
