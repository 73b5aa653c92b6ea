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
    ({"a": {"b": object()}}, TypeError, r"tree value 'a/b' \(object\) is neither a dict, a list, a tuple"),
    ({"a": {"b": np.array([{}, 1], dtype=object)}}, TypeError, r"tree value 'a/b' \(ndarray\) is not an array of "
                                                               "numbers"),
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


# -- exact structure (tree version 2) -------------------------------------------------------------
def _same(got, want, path="tree"):
    """Equal in structure, types and bytes, to the last bit."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            _same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{path}[{i}]")
    elif isinstance(want, (np.ndarray, np.generic)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), path
    elif isinstance(want, float):
        assert repr(got) == repr(want), path  # -0.0, nan, inf
    else:
        assert got == want, path


def test_the_issue_tree_comes_back_exactly_not_as_stacked_arrays(tmp_path):
    # It came back as a (2, 2) array, a (2, 3) array and a 0-d array.
    a, b = np.ones(3, np.float32), np.arange(3, dtype=np.int64)
    tree = {"layers": [np.ones(2), np.zeros(2)], "opt": (a, b), "n": 3}
    save_tree(tmp_path / "t.safetensors", tree)
    _same(load_tree(tmp_path / "t.safetensors"), tree)


def test_every_python_value_and_shape_round_trips(tmp_path):
    tree = {
        "ragged": [np.zeros((2, 3)), np.ones(5, ml_dtypes.bfloat16), [np.arange(2), []]],  # numpy refused these
        "pair": (1.5, "adam"), "empty": {}, "nested": {"list": [], "tuple": ()},
        "flags": [True, False, None], "big": 2**80, "neg": -7, "floats": [-0.0, float("inf"), float("nan"), 1e-310],
        "np": {"i": np.int32(-3), "f": np.float16(0.5), "b": np.bool_(True), "bf": ml_dtypes.bfloat16(2.5)},
        "zero_d": np.array(4, np.uint8), "text": "ünïcode / slash",
    }
    save_tree(tmp_path / "t.safetensors", tree)
    back = load_tree(tmp_path / "t.safetensors")
    _same(back, tree)
    assert back["ragged"][0].flags.writeable and type(back["np"]["i"]) is np.int32


@pytest.mark.parametrize("value, kind", [(b"raw", "bytes"), ({1, 2}, "set"), (1 + 2j, "complex"),
                                         (object(), "object")])
def test_a_value_that_would_not_come_back_as_it_is_is_refused_at_save_time_naming_its_path(tmp_path, value, kind):
    with pytest.raises(TypeError, match=rf"tree value 'opt/state/1' \({kind}\)"):
        save_tree(tmp_path / "t.safetensors", {"opt": {"state": [np.zeros(1), value]}})
    assert list(tmp_path.iterdir()) == []


def test_a_namedtuple_is_refused_rather_than_returned_as_a_plain_tuple(tmp_path):
    import collections

    point = collections.namedtuple("Point", "x y")
    with pytest.raises(TypeError, match=r"tree value 'p' \(Point\) cannot be saved so that it comes back"):
        save_tree(tmp_path / "t.safetensors", {"p": point(1, 2)})


@pytest.mark.parametrize("tree, path, kind", [({"layers": [np.zeros(1)]}, "layers", "list"),
                                               ({"a": {"n": 3}}, "a/n", "int"),
                                               ({"s": np.float32(1)}, "s", "numpy scalar"),
                                               ({"o": None}, "o", "None")])
def test_an_npz_refuses_what_it_cannot_record_naming_the_path(tmp_path, tree, path, kind):
    with pytest.raises(ValueError, match=rf"the {kind} at '{path}' would be lost in an NPZ"):
        save_tree(tmp_path / "t.npz", tree)
    assert list(tmp_path.iterdir()) == []


def test_the_on_disk_structure_of_version_2(tmp_path):
    save_tree(tmp_path / "t.safetensors", {"w": {"k": np.zeros(1)}, "l": [1.5, None], "t": (True, "x")})
    with fastckpt.open(tmp_path / "t.safetensors") as f:
        assert f.metadata["fastckpt.tree_version"] == "2"
        assert f.metadata[TREE_METADATA_KEY] == ('{"w":{"k":0},"l":["list",[["float","1.5"],["none"]]],'
                                                 '"t":["tuple",[["bool",true],["str","x"]]]}')
        assert list(f.keys()) == ["w/k"]
    # dicts of arrays only: the very structure version 1 wrote, so that fastckpt 0.2 reads it too
    save_tree(tmp_path / "d.safetensors", {"a": {"b": np.zeros(1)}, "c": {}})
    with fastckpt.open(tmp_path / "d.safetensors") as f:
        assert f.metadata[TREE_METADATA_KEY] == '{"a":{"b":0},"c":{}}'


GOLDEN = __import__("pathlib").Path(__file__).parent / "data" / "tree"


def test_files_of_tree_version_1_written_by_fastckpt_0_2_still_load():
    back = load_tree(GOLDEN / "tree-v1.safetensors")
    _same(back, {"params": {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
                                      "bias": np.array([0.5, -1.0, 2.0], np.float32)},
                            "embed": np.array([[1.5, -2.0]], dtype=ml_dtypes.bfloat16)},
                 "batch_stats": {}, "step": np.array(12, np.int64)})
    with fastckpt.open(GOLDEN / "tree-v1.safetensors") as f:
        assert "fastckpt.tree_version" not in f.metadata and f.metadata["written_by"] == "fastckpt 0.2.0 save_tree"
    _same(load_tree(GOLDEN / "tree-v1.npz"), {"step": np.array(12, np.int64), "w": np.arange(3, dtype=np.int16)})


@pytest.mark.parametrize("meta, message", [
    ({"fastckpt.tree_version": "3", TREE_METADATA_KEY: '{"a":0}'}, r"tree_version' is '3'; this fastckpt reads tree "
                                                                   "versions 1, 2"),
    ({TREE_METADATA_KEY: '{"a":["list",[0]]}'}, r"\(version 1\): the node at 'a' is \['list', \[0\]\]; version 1 "
                                                "has objects and 0 only"),
    ({"fastckpt.tree_version": "2", TREE_METADATA_KEY: '{"a":["int",3]}'}, r"the int at 'a' is 3"),
    ({"fastckpt.tree_version": "2", TREE_METADATA_KEY: '{"a":0,"b":["list",[0]]}'}, r"lists \['b/0'\] that the file "
                                                                                  "does not hold"),
])
def test_a_damaged_or_newer_structure_is_a_format_error(tmp_path, meta, message):
    fastckpt.save_safetensors(tmp_path / "m.safetensors", {"a": np.zeros(1)}, meta)
    with pytest.raises(fastckpt.FormatError, match=message):
        load_tree(tmp_path / "m.safetensors")
