"""save_tree / load_tree: nested dicts of arrays (JAX/Flax/Orbax state) round trip exactly through one file."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_numpy

import fastckpt
from fastckpt.formats.tree import TREE_METADATA_KEY, flatten_tree, load_tree, save_tree


def _flax_like():
    rng = np.random.default_rng(0)
    return {
        "params": {
            "Dense_0": {"kernel": rng.standard_normal((4, 3)).astype(np.float32), "bias": np.zeros(3, np.float32)},
            "Embed_0": {"embedding": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16)},
        },
        "opt_state": {"mu": {"Dense_0": {"kernel": np.ones((4, 3), np.float32)}}, "count": np.array(7, np.int32)},
        "batch_stats": {},
        "step": np.array(12, np.int64),
    }


def _assert_same(got, want, path=""):
    assert isinstance(got, dict) and list(got) == list(want), path  # same keys, same order
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_same(got[key], value, f"{path}/{key}")
        else:
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, f"{path}/{key}"
            assert got[key].tobytes() == value.tobytes(), f"{path}/{key}"


def test_a_nested_state_round_trips_exactly_through_safetensors(tmp_path):
    tree = _flax_like()
    save_tree(tmp_path / "s.safetensors", tree, metadata={"run": "a"})
    back = fastckpt.load_tree(tmp_path / "s.safetensors")
    _assert_same(back, tree)
    assert back["params"]["Dense_0"]["bias"].flags.writeable  # private copies
    # any safetensors reader sees the flat, /-joined names; the tree's shape is in the metadata
    plain = st_numpy.load_file(tmp_path / "s.safetensors")
    assert sorted(plain) == sorted(["params/Dense_0/kernel", "params/Dense_0/bias", "params/Embed_0/embedding",
                                    "opt_state/mu/Dense_0/kernel", "opt_state/count", "step"])
    with fastckpt.open(tmp_path / "s.safetensors") as f:
        assert f.metadata["run"] == "a"
        assert json.loads(f.metadata[TREE_METADATA_KEY])["batch_stats"] == {}


def test_an_npz_keeps_the_order_and_refuses_what_it_cannot_hold(tmp_path):
    tree = _flax_like()
    del tree["batch_stats"]
    tree["params"]["Embed_0"]["embedding"] = tree["params"]["Embed_0"]["embedding"].astype(np.float16)  # .npy: no bf16
    save_tree(tmp_path / "s.npz", tree)
    _assert_same(load_tree(tmp_path / "s.npz"), tree)
    with np.load(tmp_path / "s.npz") as z:
        assert z.files[0] == "params/Dense_0/kernel"
    with pytest.raises(ValueError, match="empty dict at 'batch_stats' would be lost in an NPZ"):
        save_tree(tmp_path / "e.npz", {"batch_stats": {}})
    assert not (tmp_path / "e.npz").exists()


@pytest.mark.parametrize("tree, error, message", [
    ({"a/b": np.zeros(1)}, ValueError, r"tree key 'a/b' \(at the top\): keys cannot hold '/'"),
    ({"a": {"": np.zeros(1)}}, TypeError, r"tree key '' \(at 'a'\): keys must be non-empty strings"),
    ({"a": {1: np.zeros(1)}}, TypeError, r"tree key 1 \(at 'a'\)"),
    ({"a": {"b": object()}}, TypeError, r"tree value 'a/b' \(object\) is not an array of numbers"),
    ([np.zeros(1)], TypeError, "save_tree takes a dict"),
])
def test_what_cannot_round_trip_is_refused_naming_its_path(tmp_path, tree, error, message):
    with pytest.raises(error, match=message):
        save_tree(tmp_path / "t.safetensors", tree)
    assert list(tmp_path.iterdir()) == []


def test_a_flat_file_nests_at_its_slashes(tmp_path):
    fastckpt.save_safetensors(tmp_path / "f.safetensors", {"enc/w": np.zeros(2), "enc/b": np.ones(1), "x": np.ones(3)})
    back = load_tree(tmp_path / "f.safetensors")
    assert set(back) == {"enc", "x"} and set(back["enc"]) == {"w", "b"}
    fastckpt.save_safetensors(tmp_path / "g.safetensors", {"a": np.zeros(1), "a/b": np.zeros(1)})
    with pytest.raises(fastckpt.FormatError, match="'a' is both a tensor and a prefix"):
        load_tree(tmp_path / "g.safetensors")


def test_a_tree_metadata_that_does_not_match_the_file_is_a_format_error(tmp_path):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {"a/b": np.zeros(1)},
                              {TREE_METADATA_KEY: json.dumps({"a": {"c": 0}})})
    with pytest.raises(fastckpt.FormatError, match=r"lists \['a/c'\] that the file does not hold"):
        load_tree(tmp_path / "m.safetensors")


@pytest.mark.parametrize("writer", [fastckpt.save_safetensors, fastckpt.save_npz])
def test_a_nested_dict_given_to_a_writer_points_to_save_tree(tmp_path, writer):
    # It failed with "dtype object has no safetensors equivalent" / "would need pickle": misleading.
    with pytest.raises(TypeError, match=r"a dict is not an array: nested dicts .* fastckpt\.save_tree"):
        writer(tmp_path / "x.bin", {"params": {"w": np.zeros(2)}})
    assert list(tmp_path.iterdir()) == []


def test_flatten_gives_the_names_and_the_shape():
    arrays, shape = flatten_tree({"a": {"b": np.zeros(1), "c": {}}, "d": np.ones(2)})
    assert list(arrays) == ["a/b", "d"] and shape == {"a": {"b": 0, "c": {}}, "d": 0}
