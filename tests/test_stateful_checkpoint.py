"""Checkpoint: registration and lifecycle rules, the JSON format, files, migrations, current()."""

import doctest
import json
import os
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastckpt.stateful.format as fmtmod
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.state import STATEFUL_JSON
from fastckpt.state import decode as _decode
from fastckpt.state import encode as _encode
from fastckpt.stateful import (
    RNG,
    ArrayReader,
    Checkpoint,
    CheckpointKeyError,
    checkpoint_scope,
    current,
    register_migration,
)


def encode(value, where="state"):
    return _encode(value, STATEFUL_JSON, where=where)


def decode(tree, where="state"):
    return _decode(tree, STATEFUL_JSON, where=where)

RNG_TYPE = "fastckpt.stateful.rng.RNG"
READER_TYPE = "fastckpt.stateful.readers.ArrayReader"


class Counter:
    """A plain object following the get_state/set_state contract."""

    def __init__(self, value=0):
        self.value = value

    def get_state(self):
        return {"value": self.value}

    def set_state(self, state):
        self.value = state["value"]


class Module:
    """A torch-like object with state_dict/load_state_dict holding numpy arrays."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.weights = {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.zeros(2, dtype=">f8")}
        self.step = np.int64(seed)

    def state_dict(self):
        return {"params": self.weights, "step": self.step, "history": (1.5, float("nan"))}

    def load_state_dict(self, state):
        self.weights = state["params"]
        self.step = state["step"]


class OtherCounter(Counter):
    pass


def started_reader(**options):
    reader = ArrayReader(np.arange(10), enable_checkpointing=True, **options)
    it = reader.next_epoch(batch_size=3)
    next(it)
    return reader


# --------------------------------------------------------------- registration


def test_named_and_anonymous_keys():
    ckpt = Checkpoint()
    a, b, c = Counter(), Counter(), Counter()
    assert ckpt.register(a) == "__op_0"
    assert ckpt.register(b, "bee") == "bee"
    assert ckpt.register(c) == "__op_1"
    assert ckpt.names == ["__op_0", "bee", "__op_1"]


def test_the_same_op_twice_returns_its_key():
    ckpt = Checkpoint()
    op = Counter()
    assert ckpt.register(op) == "__op_0"
    assert ckpt.register(op) == "__op_0"
    named = Counter()
    assert ckpt.register(named, "n") == "n"
    assert ckpt.register(named) == "n"
    assert ckpt.register(named, "n") == "n"
    assert ckpt.names == ["__op_0", "n"]


def test_a_name_replaces_the_op_registered_under_it():
    ckpt = Checkpoint()
    old, new = Counter(1), Counter(2)
    ckpt.register(old, "c")
    ckpt.register(new, "c")
    assert ckpt.names == ["c"]
    ckpt.collect()
    assert ckpt.get_state("c") == {"value": 2}
    ckpt.clear()
    assert ckpt.register(old) == "__op_0"  # the replaced op is no longer known under "c"


def test_reserved_prefix_is_refused():
    with pytest.raises(ValueError, match=r"'__op_7' starts with '__op_', which is reserved"):
        Checkpoint().register(Counter(), "__op_7")


@pytest.mark.parametrize("name, error, match", [("", ValueError, "op name '' is empty"), (3, TypeError, "op names must be str")])
def test_bad_names_are_refused(name, error, match):
    with pytest.raises(error, match=match):
        Checkpoint().register(Counter(), name)


def test_one_op_under_two_names_is_refused():
    ckpt = Checkpoint()
    op = Counter()
    ckpt.register(op, "a")
    with pytest.raises(ValueError, match=r"already registered under 'a'"):
        ckpt.register(op, "b")


def test_objects_without_the_contract_are_refused():
    with pytest.raises(TypeError, match=r"builtins.object cannot be checkpointed: it needs state_dict\(\)/load_state_dict"):
        Checkpoint().register(object())


def test_registering_a_reader_enables_checkpointing_before_it_starts():
    reader = ArrayReader(np.arange(6))
    ckpt = Checkpoint()
    ckpt.register(reader, "r")
    assert reader.checkpointing_enabled
    next(reader.next_epoch(batch_size=2))
    ckpt.collect()
    assert ckpt.get_state("r").position == 2


def test_registering_a_started_reader_without_checkpointing_is_refused():
    reader = ArrayReader(np.arange(6))
    reader.next_epoch(batch_size=2)
    ckpt = Checkpoint()
    with pytest.raises(RuntimeError, match="enable_checkpointing=True"):
        ckpt.register(reader, "r")
    assert ckpt.names == []


# ---------------------------------------------------------------- lifecycle


def test_collect_sets_complete_and_refuses_new_registrations_until_clear():
    ckpt = Checkpoint()
    op = Counter(5)
    ckpt.register(op, "c")
    ckpt.collect()
    assert ckpt.is_complete and not ckpt.is_loaded
    with pytest.raises(RuntimeError, match=r"collect\(\) was called.*call clear\(\)"):
        ckpt.register(Counter(), "d")
    with pytest.raises(RuntimeError, match=r"collect\(\) was called"):
        ckpt.register(Counter())
    assert ckpt.register(op, "c") == "c"  # re-registering changes nothing, so it is allowed
    ckpt.clear()
    assert not ckpt.is_complete and ckpt.names == []
    assert ckpt.register(Counter()) == "__op_0"


def test_collect_snapshots_the_state():
    op = Module()
    ckpt = Checkpoint()
    ckpt.register(op, "m")
    ckpt.collect()
    text = ckpt.serialize()
    op.weights["w"][:] = 0  # state_dict handed out a reference; the snapshot must not follow it
    assert ckpt.serialize() == text
    assert np.array_equal(ckpt.get_state("m")["params"]["w"], Module().weights["w"])


def test_collect_is_all_or_nothing():
    class Flaky(Counter):
        failing = False

        def get_state(self):
            if self.failing:
                raise OSError(5, "device gone")
            return super().get_state()

    ckpt = Checkpoint()
    good, flaky = Counter(1), Flaky(2)
    ckpt.register(good, "good")
    ckpt.register(flaky, "flaky")
    ckpt.collect()
    before = ckpt.serialize()
    good.value, flaky.failing = 3, True
    with pytest.raises(OSError, match=r"collecting the state of 'flaky' \(.*Flaky\).*device gone"):
        ckpt.collect()
    assert ckpt.serialize() == before and ckpt.is_complete


def test_collect_of_an_unstarted_reader_names_the_key():
    ckpt = Checkpoint()
    ckpt.register(ArrayReader(np.arange(4), enable_checkpointing=True), "reader")
    with pytest.raises(RuntimeError, match=r"collecting the state of 'reader'.*next_epoch\(\) first"):
        ckpt.collect()


def test_collect_refuses_states_without_ops():
    ckpt = Checkpoint()
    ckpt.set_state("ghost", {"value": 1})
    ckpt.register(Counter(), "c")
    with pytest.raises(RuntimeError, match=r"holds states for \['ghost'\] but no op is registered"):
        ckpt.collect()


def test_states_must_be_json_safe_and_the_error_names_the_path():
    class Weird(Counter):
        def get_state(self):
            return {"ok": [1, 2], "bad": [1, {3, 4}]}

    ckpt = Checkpoint()
    ckpt.register(Weird(), "w")
    with pytest.raises(TypeError, match=r"state of 'w' \(.*Weird\)\['bad'\]\[1\]: a builtins.set cannot be stored"):
        ckpt.collect()


def test_get_state_rules():
    ckpt = Checkpoint()
    with pytest.raises(CheckpointKeyError, match=r"no op is registered under 'x'"):
        ckpt.get_state("x")
    ckpt.register(Counter(), "x")
    with pytest.raises(KeyError, match=r"has no state yet; call collect\(\) first"):
        ckpt.get_state("x")
    ckpt.collect()
    assert ckpt.get_state("x") == {"value": 0}


def test_set_state_is_applied_on_register_and_checks_op_type():
    ckpt = Checkpoint()
    ckpt.set_state("c", {"value": 9}, op_type=Counter)
    op = Counter()
    ckpt.register(op, "c")
    assert op.value == 9
    assert ckpt.get_state("c") == {"value": 9}

    ckpt = Checkpoint()
    ckpt.set_state("c", {"value": 9}, op_type=f"{__name__}.Counter")
    with pytest.raises(TypeError, match=r"belongs to a .*\.Counter but the op registered under 'c' is a .*\.OtherCounter"):
        ckpt.register(OtherCounter(), "c")
    assert ckpt.names == []


def test_set_state_rules():
    ckpt = Checkpoint()
    with pytest.raises(TypeError, match="op_type must be a class or a qualified class name"):
        ckpt.set_state("c", {}, op_type=3)
    ckpt.register(Counter(), "c")
    ckpt.collect()
    with pytest.raises(CheckpointKeyError, match=r"complete .* no op is registered under 'd'"):
        ckpt.set_state("d", {"value": 1})
    ckpt.set_state("c", {"value": 4})  # a registered key is fine after collect
    with pytest.raises(TypeError, match=r"state of 'c'\['value'\]: a builtins.object cannot be stored"):
        ckpt.set_state("c", {"value": object()})


def test_failed_apply_leaves_the_op_unregistered_and_names_the_key():
    class Picky(Counter):
        def set_state(self, state):
            raise ValueError("unexpected layout")

    ckpt = Checkpoint()
    ckpt.set_state("p", {"value": 1})
    with pytest.raises(ValueError, match=r"applying the state under 'p' to a .*Picky: unexpected layout"):
        ckpt.register(Picky(), "p")
    assert ckpt.names == []


def test_set_state_applies_what_would_be_saved():
    ckpt = Checkpoint()
    value = {"value": (1, np.int64(2))}
    ckpt.set_state("c", value)
    value["value"] = "changed later"
    ckpt.register(op := Counter(), "c")
    assert op.value == [1, 2]
    assert json.loads(ckpt.serialize())["entries"]["c"]["state"] == {"value": [1, 2]}


def test_registering_an_op_again_applies_a_state_that_arrived_since():
    ckpt = Checkpoint()
    op = Counter()
    ckpt.register(op, "c")
    ckpt.register(anon := Counter())
    ckpt.deserialize(valid_payload(entries={"c": {"type": None, "state": {"value": 5}},
                                            "__op_0": {"type": None, "state": {"value": 6}}}))
    assert ckpt.register(op, "c") == "c" and op.value == 5
    assert ckpt.register(anon) == "__op_0" and anon.value == 6


def test_errors_whose_type_cannot_be_rebuilt_keep_their_type_and_get_a_note():
    class Odd(Counter):
        def set_state(self, state):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    ckpt = Checkpoint()
    ckpt.set_state("o", {"value": 1})
    with pytest.raises(UnicodeDecodeError) as info:
        ckpt.register(Odd(), "o")
    assert any("applying the state under 'o'" in note for note in info.value.__notes__)


def test_restore_applies_pending_states_and_checks_keys_first():
    ckpt = Checkpoint()
    a, b = Counter(), Counter()
    ckpt.register(a, "a")
    ckpt.register(b, "b")
    ckpt.restore()  # no states: nothing to do
    ckpt.set_state("a", {"value": 1})
    with pytest.raises(RuntimeError, match=r"registered ops with no state: \['b'\]"):
        ckpt.restore()
    assert a.value == 0
    ckpt.set_state("b", {"value": 2})
    ckpt.set_state("c", {"value": 3})
    with pytest.raises(RuntimeError, match=r"states with no registered op: \['c'\]"):
        ckpt.restore()
    ckpt.register(c := Counter(), "c")
    assert c.value == 3  # applied at registration
    ckpt.restore()
    assert (a.value, b.value) == (1, 2)
    a.value = 7
    ckpt.restore()  # states already applied are clean: nothing happens
    assert a.value == 7


def test_restore_checks_every_type_before_applying_any():
    ckpt = Checkpoint()
    a, b = Counter(), OtherCounter()
    ckpt.register(a, "a")
    ckpt.register(b, "b")
    ckpt.set_state("a", {"value": 1}, op_type=Counter)
    ckpt.set_state("b", {"value": 2}, op_type=Counter)
    with pytest.raises(TypeError, match=r"'b' belongs to a .*\.Counter but .* is a .*OtherCounter"):
        ckpt.restore()
    assert (a.value, b.value) == (0, 0)


# ------------------------------------------------------------- load / restore


def save_reader_and_rng(tmp_path, pattern="ckpt_{seq:04d}.json", anonymous=False):
    reader, rng = started_reader(shuffle=True, seed=2), RNG(seed=42)
    rng.random(3)
    ckpt = Checkpoint()
    ckpt.register(reader, None if anonymous else "reader")
    ckpt.register(rng, None if anonymous else "rng")
    ckpt.collect()
    path = ckpt.save(str(tmp_path / pattern))
    expected = (next(reader.next_epoch(batch_size=3)).tolist(), rng.random(4))
    return path, expected


def test_load_and_register_resume_readers_and_rngs(tmp_path):
    path, (batch, draws) = save_reader_and_rng(tmp_path)
    reader, rng = ArrayReader(np.arange(10), shuffle=True, seed=2), RNG()
    ckpt = Checkpoint()
    assert ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json")) == path
    assert ckpt.is_loaded and not ckpt.is_complete
    ckpt.register(reader, "reader")
    ckpt.register(rng, "rng")
    assert next(reader.next_epoch(batch_size=3)).tolist() == batch
    assert np.array_equal(rng.random(4), draws)


def test_load_then_restore_for_ops_registered_before(tmp_path):
    _, (batch, draws) = save_reader_and_rng(tmp_path)
    reader, rng = ArrayReader(np.arange(10), shuffle=True, seed=2), RNG()
    ckpt = Checkpoint()
    ckpt.register(reader, "reader")
    ckpt.register(rng, "rng")
    ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json"))
    ckpt.restore()
    assert next(reader.next_epoch(batch_size=3)).tolist() == batch
    assert np.array_equal(rng.random(4), draws)


def test_anonymous_ops_resume_in_registration_order(tmp_path):
    _, (batch, draws) = save_reader_and_rng(tmp_path, anonymous=True)
    reader, rng = ArrayReader(np.arange(10), shuffle=True, seed=2), RNG()
    ckpt = Checkpoint()
    ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json"))
    assert ckpt.register(reader) == "__op_0"
    assert ckpt.register(rng) == "__op_1"
    assert np.array_equal(rng.random(4), draws)
    with pytest.raises(CheckpointKeyError, match=r"holds 2 anonymous state\(s\) but this is anonymous registration number 3"):
        ckpt.register(Counter())


def test_cross_type_swap_fails_loudly_naming_key_types_and_file(tmp_path):
    path, _ = save_reader_and_rng(tmp_path, anonymous=True)
    ckpt = Checkpoint()
    ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json"))
    rng = RNG()
    before = str(rng.get_state())
    with pytest.raises(TypeError) as info:
        ckpt.register(rng)  # the reader was registered first at save time
    message = str(info.value)
    assert path in message and "'__op_0'" in message and READER_TYPE in message and RNG_TYPE in message
    assert str(rng.get_state()) == before


def test_loaded_checkpoint_refuses_unknown_names(tmp_path):
    save_reader_and_rng(tmp_path)
    ckpt = Checkpoint()
    ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json"))
    with pytest.raises(CheckpointKeyError, match=r"has no state named 'other'; it holds \['reader', 'rng'\]"):
        ckpt.register(RNG(), "other")


def test_registering_fewer_ops_than_saved_is_caught_by_restore_and_collect(tmp_path):
    save_reader_and_rng(tmp_path)
    ckpt = Checkpoint()
    ckpt.load(str(tmp_path / "ckpt_{seq:04d}.json"))
    ckpt.register(RNG(), "rng")
    with pytest.raises(RuntimeError, match=r"states with no registered op: \['reader'\]"):
        ckpt.restore()
    with pytest.raises(RuntimeError, match=r"holds states for \['reader'\]"):
        ckpt.collect()


def test_state_dict_objects_with_arrays_round_trip_exactly(tmp_path):
    source = Module(seed=3)
    ckpt = Checkpoint()
    ckpt.register(source, "m")
    ckpt.collect()
    ckpt.save(str(tmp_path / "m.json"))
    target = Module(seed=0)
    loaded = Checkpoint()
    loaded.load(str(tmp_path / "m.json"))
    loaded.register(target, "m")
    for key in ("w", "b"):
        got, want = target.weights[key], source.weights[key]
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert target.step == 3 and type(target.step) is int  # numpy scalars come back as Python scalars
    history = loaded.get_state("m")["history"]
    assert history[0] == 1.5 and np.isnan(history[1])


# ------------------------------------------------------------------- format


def test_serialize_is_canonical_json():
    ckpt = Checkpoint()
    ckpt.register(Counter(3), "b")
    ckpt.register(Counter(4))
    ckpt.collect()
    assert ckpt.serialize() == (
        '{"entries":{"__op_0":{"state":{"value":4},"type":"' + __name__ + '.Counter"},'
        '"b":{"state":{"value":3},"type":"' + __name__ + '.Counter"}},"format":"fastckpt.stateful","version":1}'
    )


def test_file_is_ascii_json_with_one_trailing_newline(tmp_path):
    ckpt = Checkpoint()
    ckpt.set_state("é", {"text": "naïve ☃"})
    path = ckpt.save(str(tmp_path / "c.json"))
    raw = open(path, "rb").read()
    assert raw.endswith(b"}\n") and raw.count(b"\n") == 1
    raw.decode("ascii")
    assert raw == ckpt.serialize().encode("ascii") + b"\n"
    again = Checkpoint()
    again.load(path)
    op = Counter()
    op.set_state = lambda state: setattr(op, "value", state["text"])
    again.register(op, "é")
    assert op.value == "naïve ☃"


def test_serialize_of_nothing_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="holds no states"):
        Checkpoint().serialize()
    with pytest.raises(RuntimeError, match="holds no states"):
        Checkpoint().save(str(tmp_path / "x_{seq}.json"))
    assert list(tmp_path.iterdir()) == []


def valid_payload(**changes):
    payload = {"format": "fastckpt.stateful", "version": 1, "entries": {"c": {"type": None, "state": {"value": 1}}}}
    payload.update(changes)
    return json.dumps(payload)


@pytest.mark.parametrize("data, match", [
    ("{not json", r"not valid JSON"),
    ("[1, 2]", r"expected a JSON object at the top level, got list"),
    (valid_payload(format="dali"), r"not a fastckpt stateful checkpoint \('format' is 'dali'"),
    (valid_payload(version="1"), r"'version' must be an integer, got '1'"),
    (valid_payload(version=7), r"format version 7 is newer than this fastckpt reads \(version 1\); upgrade fastckpt"),
    (valid_payload(version=0), r"format version 0 cannot be upgraded to version 1: no migration from version 0"),
    (valid_payload(extra=1), r"top-level keys are \['entries', 'extra', 'format', 'version'\]"),
    (valid_payload(entries=[]), r"'entries' must be an object, got list"),
    (valid_payload(entries={"c": {"state": 1}}), r"entry 'c' must be an object with keys 'type' and 'state', got \['state'\]"),
    (valid_payload(entries={"c": {"type": 5, "state": 1}}), r"entry 'c': 'type' must be a string or null, got 5"),
    ('{"format":"fastckpt.stateful","version":1,"entries":{"c":{"type":null,"state":NaN}}}', r"NaN is not allowed"),
    (valid_payload(entries={"c": {"type": None, "state": {"__ndarray__": "AAAA", "dtype": "<f4", "shape": [2]}}}),
     r"state of 'c': array of dtype <f4 and shape \[2\] needs 8 bytes, the base64 data holds 3"),
    (valid_payload(entries={"c": {"type": None, "state": {"__ndarray__": "", "dtype": "|O", "shape": [0]}}}),
     r"array dtype '\|O' is not allowed"),
    (valid_payload(entries={"c": {"type": None, "state": {"__bytes__": "%%"}}}), r"invalid base64"),
])
def test_malformed_payloads_are_refused_and_change_nothing(data, match):
    ckpt = Checkpoint()
    ckpt.set_state("keep", {"value": 1})
    with pytest.raises(FormatError, match=match):
        ckpt.deserialize(data)
    assert not ckpt.is_loaded
    assert json.loads(ckpt.serialize())["entries"] == {"keep": {"type": None, "state": {"value": 1}}}


def test_errors_while_loading_name_the_file(tmp_path):
    path = tmp_path / "ckpt_0003.json"
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(FormatError, match=rf"{path}: not UTF-8"):
        Checkpoint().load(str(tmp_path / "ckpt_{seq:04d}.json"))
    path.write_text(valid_payload(version=9))
    with pytest.raises(FormatError, match=rf"{path}: format version 9 is newer"):
        Checkpoint().load(str(tmp_path / "ckpt_{seq:04d}.json"))


# --------------------------------------------------------------- migrations


@pytest.fixture
def version_3(monkeypatch):
    """Pretend the current format is version 3, with an empty migration table."""
    monkeypatch.setattr(fmtmod, "FORMAT_VERSION", 3)
    monkeypatch.setattr(fmtmod, "_MIGRATIONS", {})


def old_payload(version):
    return json.dumps({"format": "fastckpt.stateful", "version": version, "entries": {"old": {"type": None, "state": {"v": 1}}}})


def test_old_versions_are_upgraded_step_by_step(version_3):
    steps = []

    def one_to_two(payload):
        steps.append(payload["version"])
        payload["entries"] = {k.replace("old", "mid"): v for k, v in payload["entries"].items()}
        return payload

    def two_to_three(payload):
        steps.append(payload["version"])
        payload["entries"]["mid"]["state"]["v"] += 1
        return payload

    register_migration(1, one_to_two)
    register_migration(2, two_to_three)
    ckpt = Checkpoint()
    ckpt.deserialize(old_payload(1))
    assert steps == [1, 2]
    op = Counter()
    op.set_state = lambda state: setattr(op, "value", state["v"])
    ckpt.register(op, "mid")
    assert op.value == 2
    assert json.loads(ckpt.serialize())["version"] == 3


def test_a_version_with_no_path_forward_names_both_versions(version_3):
    register_migration(1, lambda payload: payload)
    with pytest.raises(FormatError, match=r"format version 2 cannot be upgraded to version 3: no migration from version 2"):
        Checkpoint().deserialize(old_payload(1))


def test_a_failing_migration_is_reported(version_3):
    def broken(payload):
        raise KeyError("entries")

    register_migration(2, broken)
    with pytest.raises(FormatError, match=r"migration from format version 2 failed: KeyError\('entries'\)"):
        Checkpoint().deserialize(old_payload(2))


def test_register_migration_rules(version_3):
    register_migration(1, lambda p: p)
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_migration(1, lambda p: p)
    register_migration(1, lambda p: p, replace=True)
    with pytest.raises(ValueError, match="from_version must be an int >= 1"):
        register_migration(0, lambda p: p)
    with pytest.raises(TypeError, match="must be callable"):
        register_migration(2, "not a function")


# -------------------------------------------------------------------- files


def one_state_checkpoint(value=1):
    ckpt = Checkpoint()
    ckpt.set_state("n", {"value": value})
    return ckpt


def test_save_numbers_files_and_never_overwrites(tmp_path):
    pattern = str(tmp_path / "ckpt_{seq:04d}.json")
    (tmp_path / "ckpt_0005.json").write_text("someone else's")
    (tmp_path / "ckpt_9.json").write_text("not this pattern's spelling")
    (tmp_path / "ckpt_0009.json.bak").write_text("not a match")
    ckpt = one_state_checkpoint()
    assert ckpt.save(pattern) == str(tmp_path / "ckpt_0006.json")
    assert ckpt.save(pattern) == str(tmp_path / "ckpt_0007.json")
    assert (tmp_path / "ckpt_0005.json").read_text() == "someone else's"


def test_load_picks_the_highest_number(tmp_path):
    pattern = str(tmp_path / "s{seq}.json")
    for value in range(12):  # "s10" and "s11" sort before "s2" as strings
        one_state_checkpoint(value).save(pattern)
    ckpt = Checkpoint()
    assert ckpt.load(pattern) == str(tmp_path / "s11.json")
    op = Counter()
    ckpt.register(op, "n")
    assert op.value == 11


def test_load_without_a_match_raises_file_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint file matches .*ckpt_\{seq\}\.json"):
        Checkpoint().load(str(tmp_path / "ckpt_{seq}.json"))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file matches .*ckpt\.json' \(looked in .*missing'\)"):
        Checkpoint().load(str(tmp_path / "missing" / "ckpt.json"))


def test_pattern_without_seq_names_one_file_that_is_replaced(tmp_path):
    path = str(tmp_path / "latest.json")
    assert one_state_checkpoint(1).save(path) == path
    assert one_state_checkpoint(2).save(path, overwrite=True) == path
    ckpt = Checkpoint()
    ckpt.load(path)
    ckpt.register(op := Counter(), "n")
    assert op.value == 2


def test_literal_braces_in_the_pattern(tmp_path):
    pattern = str(tmp_path / "{{x}}_{seq}.json")
    assert one_state_checkpoint().save(pattern) == str(tmp_path / "{x}_0.json")
    assert Checkpoint().load(pattern) == str(tmp_path / "{x}_0.json")


@pytest.mark.parametrize("pattern, match", [
    ("ckpt_{step}.json", r"the only placeholder allowed is \{seq\}"),
    ("ckpt_{seq}_{seq}.json", r"may appear only once"),
    ("dir_{seq}/ckpt.json", r"only appear in the file name"),
    ("ckpt_{seq:6d}.json", r"does not write 0 as plain decimal digits"),
    ("ckpt_{seq:x}.json", r"does not write 12345 as plain decimal digits"),
    ("ckpt_{seq!r}.json", r"the only placeholder allowed"),
    ("ckpt_{seq.json", r"not a valid format string"),
])
def test_bad_patterns_are_refused(tmp_path, pattern, match):
    with pytest.raises(ValueError, match=match):
        one_state_checkpoint().save(str(tmp_path / pattern))


def test_keep_removes_only_older_files_this_checkpoint_wrote(tmp_path):
    pattern = str(tmp_path / "c_{seq:03d}.json")
    (tmp_path / "c_000.json").write_text("foreign")
    ckpt = one_state_checkpoint()
    paths = [ckpt.save(pattern, keep=2) for _ in range(4)]
    assert [os.path.basename(p) for p in paths] == ["c_001.json", "c_002.json", "c_003.json", "c_004.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c_000.json", "c_003.json", "c_004.json"]
    # A file this checkpoint wrote but someone replaced since is no longer its own: kept.
    os.replace(ckpt.save(pattern), tmp_path / "moved.json")
    (tmp_path / "c_005.json").write_text("replaced by someone else")
    ckpt.save(pattern, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c_000.json", "c_005.json", "c_006.json", "moved.json"]
    other = one_state_checkpoint()
    other.save(pattern, keep=1)  # another Checkpoint never deletes this one's files
    assert (tmp_path / "c_006.json").exists()


def test_keep_spares_a_file_rewritten_in_place_since(tmp_path):
    # Same name, same inode, other contents: no longer the file this checkpoint wrote.
    pattern = str(tmp_path / "c_{seq}.json")
    ckpt = one_state_checkpoint()
    first = Path(ckpt.save(pattern))
    first.write_text("rewritten in place by someone else")
    ckpt.save(pattern, keep=1)
    assert first.read_text() == "rewritten in place by someone else"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c_0.json", "c_1.json"]


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_bad_keep_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        one_state_checkpoint().save(str(tmp_path / "c{seq}.json"), keep=keep)


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "latest.json")
    one_state_checkpoint(1).save(path)
    before = open(path, "rb").read()

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        one_state_checkpoint(2).save(path, overwrite=True)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


# ------------------------------------------------------------------ current


def test_current_is_one_checkpoint_per_thread():
    mine = current()
    assert current() is mine
    seen = []
    thread = threading.Thread(target=lambda: seen.append(current()))
    thread.start()
    thread.join()
    assert seen[0] is not mine and isinstance(seen[0], Checkpoint)


def test_checkpoint_scope_binds_and_restores():
    outer = current()
    mine = Checkpoint()
    with checkpoint_scope(mine) as bound:
        assert bound is mine and current() is mine
        with checkpoint_scope() as inner:
            assert current() is inner and inner is not mine
        assert current() is mine
    assert current() is outer
    with pytest.raises(TypeError, match="needs a Checkpoint"):
        with checkpoint_scope("nope"):
            pass


def test_code_behind_a_function_call_can_use_current():
    def build_reader():
        reader = ArrayReader(np.arange(4))
        current().register(reader, "reader")
        return reader

    with checkpoint_scope() as ckpt:
        reader = build_reader()
    assert ckpt.names == ["reader"] and reader.checkpointing_enabled


# -------------------------------------------------------------------- codec

DTYPES = ["|b1", "|i1", "<i2", ">i4", "<i8", "|u1", ">u2", "<u4", "<u8", "<f2", ">f4", "<f8", "<c8", ">c16", "|S3", "<U2"]


def sample_array(dtype, shape):
    n = int(np.prod(shape))
    dt = np.dtype(dtype)
    if dt.kind == "S":
        return np.array([b"ab%d" % (i % 10) for i in range(n)], dtype=dt).reshape(shape)
    if dt.kind == "U":
        return np.array(["é%d" % (i % 10) for i in range(n)], dtype=dt).reshape(shape)
    if dt.kind == "b":
        return (np.arange(n) % 3 == 0).reshape(shape).astype(dt)
    values = np.arange(n) - (n // 2 if dt.kind in "ifc" else 0)
    return (values * (1.25 if dt.kind in "fc" else 1)).astype(dt).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4)], ids=str)
def test_arrays_round_trip_bit_exactly(dtype, shape):
    array = sample_array(dtype, shape)
    tree = json.loads(json.dumps(encode({"a": array})))
    back = decode(tree)["a"]
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()
    assert back.flags.writeable and back.flags.c_contiguous


@pytest.mark.parametrize("layout", ["fortran", "strided"])
def test_non_contiguous_arrays_are_stored_in_c_order(layout):
    base = np.arange(24, dtype="<i4").reshape(4, 6)
    array = np.asfortranarray(base) if layout == "fortran" else base[::2, ::3]
    back = decode(encode(array))
    assert np.array_equal(back, array) and back.flags.c_contiguous


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_ml_dtypes_arrays_are_stored_by_name(name):
    array = np.array([0.5, -2.0, 3.0], dtype=getattr(ml_dtypes, name))
    tree = encode(array)
    assert tree["dtype"] == name
    back = decode(tree)
    assert back.dtype == array.dtype and back.tobytes() == array.tobytes()


def test_scalars_bytes_and_non_finite_floats():
    value = {"i": np.int32(-3), "f": np.float32(0.1), "b": np.bool_(True), "raw": b"\x00\xff", "nan": float("nan"),
             "inf": float("inf"), "ninf": -np.inf, "big": 2**100, "t": (1, [2])}
    back = decode(json.loads(json.dumps(encode(value), allow_nan=False)))
    assert back["i"] == -3 and type(back["i"]) is int
    assert back["f"] == float(np.float32(0.1)) and type(back["f"]) is float
    assert back["b"] is True and back["raw"] == b"\x00\xff"
    assert np.isnan(back["nan"]) and back["inf"] == np.inf and back["ninf"] == -np.inf
    assert back["big"] == 2**100 and back["t"] == [1, [2]]


@pytest.mark.parametrize("value, error, match", [
    (np.array([object()], dtype=object), TypeError, r"dtype\('O'\) cannot be stored .*nothing is pickled"),
    (np.zeros(2, dtype=[("a", "<i4")]), TypeError, r"cannot be stored in a JSON state"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), TypeError, r"cannot be stored"),
    ({1: "int key"}, TypeError, r"dict key 1 is a int; stateful JSON keys must be str"),
    ({"__ndarray__": 1}, TypeError, r"dict key '__ndarray__' is reserved"),
    (np.complex64(1j), TypeError, r"wrap it in np.asarray"),
    (1j, TypeError, r"builtins.complex cannot be stored"),
])
def test_values_that_json_cannot_hold_are_refused(value, error, match):
    with pytest.raises(error, match=match):
        encode({"x": [value]})


def test_reference_cycles_are_refused():
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match="reference cycle"):
        encode(loop)
    shared = [1]
    assert encode([shared, shared]) == [[1], [1]]  # shared, not cyclic: fine


def test_docs_carry_the_same_format_spec_as_the_module():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "stateful.md").read_text(encoding="utf-8")
    spec = fmtmod.__doc__[fmtmod.__doc__.index("File format (version 1)"):].rstrip("\n")
    block = docs[docs.index("```text\n", docs.index("## File format")) + len("```text\n"):].rsplit("\n```", 1)[0]
    assert block == spec


@pytest.mark.slow  # a benchmark smoke run
def test_benchmark_runs_every_case():
    import fastckpt.bench.stateful as bench

    result = doctest.testmod(bench, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ fuzzing

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
tag_like = st.fixed_dictionaries(
    {"__ndarray__": st.text(max_size=8), "dtype": st.sampled_from(["<f4", "|O", "bfloat16", "<V2", "x", 3]),
     "shape": st.lists(st.integers(-2, 3), max_size=3)}
) | st.fixed_dictionaries({"__bytes__": st.text(max_size=8)}) | st.fixed_dictionaries({"__float__": st.text(max_size=4)})


@settings(max_examples=150, deadline=None)
@given(json_values.filter(lambda v: "__" not in json.dumps(v)))
def test_plain_json_states_round_trip_unchanged(value):
    ckpt = Checkpoint()
    ckpt.set_state("k", value)
    other = Checkpoint()
    other.deserialize(ckpt.serialize())
    assert json.loads(other.serialize())["entries"]["k"]["state"] == value
    assert decode(encode(value)) == value


@settings(max_examples=150, deadline=None)
@given(st.recursive(json_scalars | tag_like, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=10))
def test_arbitrary_payload_states_load_or_fail_with_format_error(state):
    data = json.dumps({"format": "fastckpt.stateful", "version": 1, "entries": {"k": {"type": None, "state": state}}})
    try:
        Checkpoint().deserialize(data)
    except FormatError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_fail_with_format_error(data):
    with pytest.raises(FormatError):
        Checkpoint().deserialize(data)


def test_deeply_nested_json_is_a_format_error():
    with pytest.raises(FormatError, match="nested too deeply"):
        Checkpoint().deserialize("[" * 100_000 + "]" * 100_000)
