"""RNG: the state round-trips through str/dict/object and the stream continues bit-exactly."""

import json

import numpy as np
import pytest

from fastckpt.errors import FormatError
from fastckpt.stateful import RNG, RNGState
from fastckpt.stateful.rng import BIT_GENERATORS

ALL_BIT_GENERATORS = sorted(BIT_GENERATORS)


def draw(rng: RNG) -> list[np.ndarray]:
    """A mix of draws, including 32-bit ones that leave a buffered half-word in the state."""
    return [
        rng.integers(0, 2**64, size=7, dtype=np.uint64),
        np.atleast_1d(rng.integers(0, 2**32, dtype=np.uint32)),
        rng.random(5),
        rng.normal(size=3),
        rng.permutation(11),
        rng.generator.bit_generator.random_raw(4),
    ]


def assert_same_draws(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert np.array_equal(x, y)


@pytest.mark.parametrize("bit_generator", ALL_BIT_GENERATORS)
@pytest.mark.parametrize("form", ["object", "str", "dict", "json"])
def test_set_state_continues_the_stream_bit_exactly(bit_generator, form):
    rng = RNG(seed=1234, bit_generator=bit_generator)
    draw(rng)
    # An odd number of 32-bit draws leaves half a 64-bit word buffered in the state.
    rng.integers(0, 2**32, dtype=np.uint32)
    state = rng.get_state()
    expected = draw(rng)
    value = {"object": state, "str": str(state), "dict": state.to_dict(), "json": json.loads(json.dumps(state.to_json()))}[form]
    fresh = RNG(seed=99, bit_generator=bit_generator)
    fresh.set_state(value)
    assert_same_draws(draw(fresh), expected)


@pytest.mark.parametrize("bit_generator", ALL_BIT_GENERATORS)
def test_from_state_string_builds_the_right_generator(bit_generator):
    rng = RNG(seed=[3, 4], bit_generator=bit_generator)
    draw(rng)
    text = str(rng.get_state())
    expected = draw(rng)
    restored = RNG.from_state(text)
    assert restored.bit_generator == bit_generator
    assert type(restored.generator.bit_generator) is BIT_GENERATORS[bit_generator]
    assert_same_draws(draw(restored), expected)


def test_seed_matches_numpy_default_rng():
    assert np.array_equal(RNG(seed=42).integers(0, 1 << 40, size=16), np.random.default_rng(42).integers(0, 1 << 40, size=16))


def test_bit_generator_class_is_accepted():
    assert RNG(seed=1, bit_generator=np.random.Philox).bit_generator == "Philox"


def test_state_property_reads_and_assigns():
    rng = RNG(seed=5)
    saved = rng.state
    first = rng.random(3)
    rng.state = str(saved)
    assert np.array_equal(rng.random(3), first)
    assert rng.state == rng.get_state()


def test_pcg64_state_is_plain_json_with_exact_128_bit_ints():
    rng = RNG(seed=7)
    tree = json.loads(str(rng.get_state()))
    numpy_state = rng.generator.bit_generator.state
    assert tree["state"]["state"] == numpy_state["state"]["state"]
    assert tree["state"]["state"] >= 2**64  # a real 128-bit value, kept exactly
    assert tree["state"]["inc"] == numpy_state["state"]["inc"]


@pytest.mark.parametrize("bit_generator, key, dtype, shape", [
    ("Philox", "counter", "<u8", [4]),
    ("SFC64", "state", "<u8", [4]),
    ("MT19937", "key", "<u4", [624]),
])
def test_array_states_are_encoded_as_base64_with_dtype_and_shape(bit_generator, key, dtype, shape):
    rng = RNG(seed=11, bit_generator=bit_generator)
    tree = json.loads(str(rng.get_state()))
    encoded = tree["state"][key]
    assert encoded["dtype"] == dtype and encoded["shape"] == shape
    original = rng.generator.bit_generator.state["state"][key]
    decoded = rng.get_state().to_dict()["state"][key]
    assert decoded.dtype == original.dtype and np.array_equal(decoded, original)


def test_str_is_canonical_and_equal_states_compare_equal():
    a, b = RNG(seed=8).get_state(), RNG(seed=8).get_state()
    assert a == b and hash(a) == hash(b) and str(a) == str(b)
    assert a != RNG(seed=9).get_state()
    assert RNGState.from_string(str(a)) == a
    assert " " not in str(a)


def test_state_snapshot_is_immutable_and_independent_of_later_draws():
    rng = RNG(seed=8)
    state = rng.get_state()
    text = str(state)
    rng.random(10)
    assert str(state) == text
    with pytest.raises(AttributeError, match="immutable"):
        state._text = "{}"


def test_state_of_another_bit_generator_is_refused_with_the_fix():
    rng = RNG(seed=1)
    with pytest.raises(ValueError, match=r"state is for the Philox bit generator but this RNG uses PCG64.*RNG\.from_state"):
        rng.set_state(RNG(seed=1, bit_generator="Philox").get_state())


def test_unknown_bit_generator_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown bit_generator 'Xoshiro'.*PCG64"):
        RNG(bit_generator="Xoshiro")
    with pytest.raises(TypeError, match="bit_generator must be"):
        RNG(bit_generator=np.random.Generator)


def test_garbage_strings_and_dicts_are_refused():
    rng = RNG()
    with pytest.raises(FormatError, match="not valid JSON"):
        rng.set_state("not json")
    with pytest.raises(ValueError, match="not an RNG state"):
        rng.set_state('{"reader": "ArrayReader"}')
    with pytest.raises(TypeError, match="expected a RNGState"):
        rng.set_state(12)


def test_corrupt_state_contents_are_refused_and_the_stream_is_untouched():
    rng = RNG(seed=3, bit_generator="MT19937")
    before = str(rng.get_state())
    bad = rng.get_state().to_dict()
    bad["state"]["key"] = bad["state"]["key"][:10]
    with pytest.raises(ValueError, match="invalid MT19937 state"):
        rng.set_state(bad)
    assert str(rng.get_state()) == before


def test_generator_draws_advance_the_checkpointed_state():
    rng = RNG(seed=2)
    before = rng.get_state()
    rng.generator.random()
    assert rng.get_state() != before


def test_state_objects_survive_copy_and_deepcopy():
    import copy

    state = RNG(seed=1).get_state()
    assert copy.copy(state) is state
    nested = copy.deepcopy({"rng": state, "step": 3})
    assert nested["rng"] == state


def test_the_global_generators_and_pythons_round_trip_through_a_json_checkpoint(tmp_path):
    # JSON gives random.Random's tuples back as lists; its setstate takes tuples only.
    import random

    from fastckpt.stateful import Checkpoint, GlobalRNG

    py = random.Random(2)
    saved = Checkpoint()
    saved.register(py, "py")
    saved.register(GlobalRNG(), "global")
    saved.collect()
    path = saved.save(tmp_path / "s{seq:02d}.json")
    want = (py.random(), random.random(), np.random.random())
    back = random.Random(9)
    restored = Checkpoint()
    restored.register(back, "py")
    restored.register(GlobalRNG(), "global")
    restored.load(path)
    restored.restore()
    assert (back.random(), random.random(), np.random.random()) == want


def test_a_torch_generator_round_trips_through_a_json_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from fastckpt.stateful import Checkpoint, GlobalRNG

    gen = torch.Generator().manual_seed(3)
    saved = Checkpoint()
    saved.register(gen, "gen")
    saved.register(GlobalRNG(), "global")  # torch's default generator too, torch being imported
    saved.collect()
    path = saved.save(tmp_path / "s{seq:02d}.json")
    want = (torch.rand(4, generator=gen), torch.rand(2))
    back = torch.Generator()
    restored = Checkpoint()
    restored.register(back, "gen")
    restored.register(GlobalRNG(), "global")
    restored.load(path)
    restored.restore()
    assert torch.equal(torch.rand(4, generator=back), want[0]) and torch.equal(torch.rand(2), want[1])
    with pytest.raises(ValueError, match="the 'torch' state does not fit"):
        GlobalRNG().set_state({"torch": np.zeros(8, np.uint8)})
