"""The one state protocol (lookup order) and the one codec (three dialects) that every checkpoint uses."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fastckpt.errors import FormatError
from fastckpt.state import (
    LOOKUP_ORDER,
    PARAM_SIDECAR,
    STATEFUL_JSON,
    TRAIN_TREE,
    Stateful,
    StateObject,
    accessors,
    as_stateful,
    decode,
    encode,
    is_stateful,
    load_state,
    state_of,
)
from fastckpt.state.codec import NumberedArrays, TensorRefs


class Both:
    """Has both pairs: the protocol must take state_dict()."""

    def __init__(self):
        self.via = None

    def state_dict(self):
        return {"via": "state_dict"}

    def load_state_dict(self, state):
        self.via = ("load_state_dict", state)

    def get_state(self):
        return {"via": "get_state"}

    def set_state(self, state):
        self.via = ("set_state", state)


class HalfTorch:
    """state_dict() without load_state_dict(): an incomplete pair, so get_state()/set_state() is used."""

    def state_dict(self):
        return {"via": "state_dict"}

    def get_state(self):
        return {"via": "get_state"}

    def set_state(self, state):
        self.got = state


def test_the_lookup_order_is_generator_then_state_dict_then_get_state():
    assert LOOKUP_ORDER[0].startswith("numpy.random.Generator")
    assert state_of(Both()) == {"via": "state_dict"}
    both = Both()
    load_state(both, {"x": 1})
    assert both.via == ("load_state_dict", {"x": 1})
    assert state_of(HalfTorch()) == {"via": "get_state"}
    g = np.random.default_rng(11)
    saved = state_of(g)
    assert saved == g.bit_generator.state
    first = g.random(3)
    load_state(g, saved)
    assert g.random(3).tobytes() == first.tobytes()  # restored, never reseeded


def test_an_object_with_neither_pair_is_refused_naming_its_type_and_the_way_out():
    with pytest.raises(TypeError, match=r"a builtins.object cannot be checkpointed: it needs "
                                        r"state_dict\(\)/load_state_dict\(state\) or get_state\(\)/set_state\(state\)"):
        accessors(object())
    assert not is_stateful(object()) and is_stateful(HalfTorch())


def test_as_stateful_adapts_every_shape_to_the_protocol():
    both = Both()
    assert as_stateful(both) is both
    adapted = as_stateful(HalfTorch())
    assert isinstance(adapted, Stateful) and adapted.state_dict() == {"via": "get_state"}
    adapted.load_state_dict({"n": 2})
    assert adapted.target.got == {"n": 2}
    g = np.random.default_rng(1)
    assert isinstance(as_stateful(g), Stateful) and as_stateful(g).state_dict() == g.bit_generator.state


def test_training_and_stateful_checkpoints_take_the_same_state_from_the_same_object(tmp_path):
    from fastckpt.stateful import Checkpoint
    from fastckpt.train import TinyLM, load_checkpoint, save_checkpoint

    ckpt = Checkpoint()
    ckpt.register(Both(), "both")
    ckpt.collect()
    assert ckpt.get_state("both") == {"via": "state_dict"}
    save_checkpoint(TinyLM(vocab=4, dim=2, hidden=2), None, Both(), None, None, tmp_path / "c", step=0)
    assert load_checkpoint(tmp_path / "c").scheduler_state == {"via": "state_dict"}


# -- the codec ----------------------------------------------------------------------------------------
CORNERS = {
    "big": 2**60,
    "nan": math.nan,
    "i8": np.int8(-3),
    "pair": (1, "a"),
}


def test_each_dialect_writes_the_value_kinds_as_its_format_says():
    train = encode(CORNERS, TRAIN_TREE)
    assert train == {"big": {"__int__": str(2**60)}, "nan": {"__float__": "nan"},
                     "i8": {"__scalar__": {"dtype": "|i1", "data": "/Q=="}}, "pair": {"__tuple__": [1, "a"]}}
    stateful = encode(CORNERS, STATEFUL_JSON)
    assert stateful == {"big": 2**60, "nan": {"__float__": "nan"}, "i8": -3, "pair": [1, "a"]}
    sidecar = encode(CORNERS, PARAM_SIDECAR)
    assert sidecar["big"] == 2**60 and math.isnan(sidecar["nan"]) and sidecar["i8"] == -3
    assert sidecar["pair"] == [1, "a"]
    assert json.dumps(sidecar) == '{"big": 1152921504606846976, "nan": NaN, "i8": -3, "pair": [1, "a"]}'


def test_odd_dict_keys_are_pairs_in_training_trees_and_refused_elsewhere():
    tree = encode({1: "one", "__x": 2}, TRAIN_TREE)
    assert tree == {"__dict__": [[1, "one"], ["__x", 2]]}
    assert decode(tree, TRAIN_TREE) == {1: "one", "__x": 2}
    with pytest.raises(TypeError, match=r"state: dict key 1 is a int; stateful JSON keys must be str"):
        encode({1: "one"}, STATEFUL_JSON)
    with pytest.raises(TypeError, match=r"stateful JSON encoding"):
        encode({"__bytes__": 1}, STATEFUL_JSON)
    with pytest.raises(ValueError, match=r"'__fastckpt_array__' is reserved"):
        encode({"__fastckpt_array__": 1}, PARAM_SIDECAR)


def test_bytes_only_where_the_format_has_a_tag_for_them():
    assert decode(encode({"b": b"\x00\xff"}, STATEFUL_JSON), STATEFUL_JSON) == {"b": b"\x00\xff"}
    for dialect in (TRAIN_TREE, PARAM_SIDECAR):
        with pytest.raises(TypeError, match=r"state\['b'\]: a builtins.bytes cannot be stored"):
            encode({"b": b"x"}, dialect)


@pytest.mark.parametrize("dialect", [TRAIN_TREE, STATEFUL_JSON, PARAM_SIDECAR])
def test_refusals_name_the_path_inside_the_state(dialect):
    with pytest.raises(TypeError, match=r"opt\['groups'\]\[1\]\['fn'\]: a builtins.builtin_function_or_method "
                                        r"cannot be stored"):
        encode({"groups": [{}, {"fn": print}]}, dialect, where="opt")
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match=r"opt\['l'\]\[0\]: the state contains a reference cycle"):
        encode({"l": loop}, dialect, where="opt")
    shared = [1]
    assert encode([shared, shared], dialect) == [[1], [1]]  # shared, not cyclic
    with pytest.raises(TypeError, match=r"state\[0\]: numpy array of dtype dtype\('O'\) cannot be stored"):
        encode([np.array([object()])], dialect)


def test_arrays_go_where_the_sink_sends_them():
    w = np.arange(4, dtype=np.float32)

    class Table:
        def __init__(self):
            self.added = []

        def add(self, name, array, source):
            self.added.append((name, array is w, source is w))

    table = Table()
    assert encode({"layer": [w]}, TRAIN_TREE, TensorRefs(table)) == {"layer": [{"__tensor__": "layer.0"}]}
    assert table.added == [("layer.0", True, True)]
    arrays: list = []
    tree = encode({"m": [w, w]}, PARAM_SIDECAR, NumberedArrays("optim_state", arrays))
    assert tree == {"m": [{"__fastckpt_array__": "optim_state.0"}, {"__fastckpt_array__": "optim_state.1"}]}
    assert [name for name, _ in arrays] == ["optim_state.0", "optim_state.1"]
    back = decode(tree, PARAM_SIDECAR, dict(arrays).__getitem__)
    assert back["m"][1] is w
    inline = encode({"w": w.astype(">i2")}, STATEFUL_JSON)
    assert inline == {"w": {"__ndarray__": "AAAAAQACAAM=", "dtype": ">i2", "shape": [4]}}
    out = decode(inline, STATEFUL_JSON)["w"]
    assert out.dtype == np.dtype(">i2") and out.tolist() == [0, 1, 2, 3]


def test_a_missing_array_is_a_format_error_naming_the_path():
    with pytest.raises(FormatError, match=r"ck: state\['m'\] refers to array 'optim_state.4', which is not stored"):
        decode({"m": {"__fastckpt_array__": "optim_state.4"}}, PARAM_SIDECAR, {}.__getitem__, where="ck: state")


def test_decoding_resolves_only_the_dialects_own_tags():
    # A user dict shaped like another format's tag stays a dict.
    assert decode({"__int__": "5"}, STATEFUL_JSON) == {"__int__": "5"}
    assert decode({"__ndarray__": "AA==", "dtype": "|u1", "shape": [1]}, PARAM_SIDECAR)["dtype"] == "|u1"
    assert decode({"__int__": "5"}, TRAIN_TREE) == 5
    for tree, dialect in [({"__float__": "1.5"}, STATEFUL_JSON), ({"__float__": "x"}, TRAIN_TREE),
                          ({"__bytes__": "!!"}, STATEFUL_JSON), ({"__bytes__": "AA==", "x": 1}, STATEFUL_JSON),
                          ({"__scalar__": {"dtype": "<f4", "data": "AA=="}}, TRAIN_TREE),
                          ({"__int__": 5}, TRAIN_TREE), ([math.inf], STATEFUL_JSON)]:
        with pytest.raises(FormatError):
            decode(tree, dialect)
    assert decode([math.inf], PARAM_SIDECAR) == [math.inf]  # netcl's JSON writes bare Infinity


def test_round_trips_are_exact_in_every_dialect():
    value = {"f": [0.1, -0.0, 1e308], "i": [-(2**53), 2**53 - 1], "s": "é", "n": None, "t": True}
    for dialect in (TRAIN_TREE, STATEFUL_JSON, PARAM_SIDECAR):
        back = decode(json.loads(json.dumps(encode(value, dialect))), dialect)
        assert json.dumps(back) == json.dumps(value)
        assert math.copysign(1, back["f"][1]) == -1
    scalars = {"h": np.float16(1.5), "u": np.uint64(2**64 - 1), "b": np.bool_(True)}
    back = decode(json.loads(json.dumps(encode(scalars, TRAIN_TREE))), TRAIN_TREE)
    assert {k: (type(v), v.tobytes()) for k, v in back.items()} == {k: (type(v), v.tobytes()) for k, v in scalars.items()}


def test_a_state_object_is_stored_as_the_dict_it_holds():
    from fastckpt.stateful import RNG

    state = RNG(seed=3, bit_generator="Philox").get_state()
    assert isinstance(state, StateObject)
    assert encode(state, STATEFUL_JSON) == state.to_json()
    train = decode(encode(state, TRAIN_TREE), TRAIN_TREE)
    assert type(state).coerce(train) == state
