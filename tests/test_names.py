"""The one name rule (fastckpt.store.names) at every writer: what a format cannot read back is refused at save time,
with a message naming the character and its position, writing nothing and leaving the previous commit as it was;
every other odd name round-trips exactly. Also the names read from disk: step directories, part keys, index files.
"""

from __future__ import annotations

import ast
import errno
import io
import os
import re
import threading
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import fastckpt
from fastckpt.formats.hfsharded import save_sharded
from fastckpt.formats.tf.reader import CheckpointReader as TFReader
from fastckpt.formats.tf.writer import save as tf_save
from fastckpt.formats.tf.writer import write_checkpoint
from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.store.names import FILE_NAME, RELATIVE_PATH, NameRule, parse_step, step_name
from fastckpt.train import CheckpointManager, load_checkpoint, save_checkpoint

from _threads import run_in_threads
from _writing import StateModel

PACKAGE = Path(fastckpt.__file__).resolve().parent
VALUE = np.arange(6, dtype=np.float32).reshape(2, 3)
GOOD = "good"


def _table(slots=()) -> HashTable:
    t = HashTable(3, slots=slots)
    t.insert(np.array([1, 2]), VALUE, {s: VALUE + 1 for s in slots})
    return t


def _table_rows(t: HashTable) -> dict:
    ids, values, slots = t.rows()
    order = np.argsort(ids)
    return {"ids": ids[order], "values": values[order], **{s: v[order] for s, v in slots.items()}}


def _open(path) -> dict:
    with fastckpt.open(path) as f:
        return {name: np.array(f.host(name)) for name in f.keys()}


def _tf(path) -> dict:
    with TFReader(path) as r:
        return {name: np.array(r.host(name)) for name in r.keys()}


def _hf(path) -> dict:
    got = _open(path)
    got.pop("pad")
    return got


def _sharded_dense(path) -> dict:
    return Loader(str(path)).load()[1]


def _sharded_tables(path) -> dict:
    return {name: _table_rows(t) for name, t in Loader(str(path)).load()[0].items()}


def _sharded_slots(path) -> dict:
    (table,) = Loader(str(path)).load()[0].values()
    return {slot: _table_rows(table)[slot] for slot in table.slots}


def _train(path) -> dict:
    m = StateModel({})
    fastckpt.train.apply_checkpoint(load_checkpoint(path), model=m)
    return m.state


@dataclass
class Writer:
    save: Callable  # (path, name, overwrite) -> None; stores VALUE under name
    load: Callable  # path -> {name: what was stored}
    bad: list  # (name, what the message must hold: the character's repr, or the reserved name)
    good: list  # names that must round-trip exactly
    expect: Callable = lambda name: {name: VALUE}


PAD = np.zeros(64, np.float32)  # a second tensor: Hugging Face's directory then has two shards
ODD = ["model.layers.0/weight", "a b", "\u00e9\u4e2d", "a.b.c", "x\\y", " a ", "a^b", "a@b"]
FILE_KEYS = ODD + ["a\nb", "a\tb", "\u2028", "../x", "/abs", "a//b", "a\x00b", ""]

WRITERS = {
    "safetensors": Writer(lambda p, n, o: fastckpt.save_safetensors(p, {n: VALUE}, overwrite=o), _open,
                          bad=[("__metadata__", "'__metadata__' is reserved")], good=FILE_KEYS),
    "npz": Writer(lambda p, n, o: fastckpt.save_npz(p, {n: VALUE}, overwrite=o), _open,
                  bad=[("a\x00b", r"'\x00' at position 1"), ("x\\y", r"'\\' at position 1"),
                       ("../x", "'..' path component at position 0"), ("a/../x", "'..' path component at position 2"),
                       ("/abs", "starts with '/'"), ("C:w", "starts with 'C:'")],
                  good=[n for n in FILE_KEYS if n not in ("x\\y", "../x", "/abs", "a\x00b")] + ["a/./b", "..a"]),
    "hf-sharded": Writer(lambda p, n, o: save_sharded(p, {n: VALUE, "pad": PAD}, max_shard_size=100, overwrite=o),
                         _hf, bad=[("__metadata__", "'__metadata__' is reserved")],
                         good=[n for n in FILE_KEYS if n != "pad"]),
    "tf": Writer(lambda p, n, o: write_checkpoint(p, {n: VALUE}, overwrite=o), _tf,
                 bad=[("", "'' is reserved"), ("\x00slice", r"starts with '\x00'")],
                 good=[n for n in FILE_KEYS if n != ""] + ["a\x00"]),
    "tf-save": Writer(lambda p, n, o: tf_save(p, {n: VALUE}), lambda p: _tf(p / "ckpt-1"),
                      bad=[("", "'' is reserved"), ("\x00slice", r"starts with '\x00'")], good=["a\nb", "layer/0/w"]),
    "sharded": Writer(lambda p, n, o: Saver(path=str(p), parallel=1, tensors={n: VALUE}, overwrite=o).save(),
                      _sharded_dense,
                      bad=[("layer\nweight", r"'\n' at position 5"), ("a/part_0_1", "'/part_' at position 1"),
                           ("w/part_", "'/part_' at position 1"),
                           ("w\x00", r"'\x00' at position 1"), ("\x7fw", r"'\x7f' at position 0"),
                           ("a\u2028b", r"'\u2028' at position 1"), ("a\x85", r"'\x85' at position 1"),
                           ("", "is empty")],
                      good=ODD + ["..", ".", "tower/dense/kernel", "a/", "/a", "a//b", "a/part"]),
    "sharded-table": Writer(lambda p, n, o: Saver(path=str(p), parallel=1, hashtables={n: _table()}, overwrite=o)
                            .save(), _sharded_tables,
                            bad=[("emb\nuser", r"'\n' at position 3"), ("emb/part_1", "'/part_' at position 3")],
                            good=["emb.user", "\u00e9", "a b", "tower/emb"],
                            expect=lambda n: {n: _table_rows(_table())}),
    "sharded-slot": Writer(lambda p, n, o: Saver(path=str(p), parallel=1, hashtables={"emb": _table((n,))},
                                                 overwrite=o).save(), _sharded_slots,
                           bad=[("m\r", r"'\r' at position 1"), ("adam/part_0", "'/part_' at position 4")],
                           good=["adam.m", "m v", "adam/m"], expect=lambda n: {n: VALUE + 1}),
    "recis": Writer(lambda p, n, o: Saver(path=str(p), parallel=1, tensors={n: VALUE}, overwrite=o, layout="recis")
                    .save(), _sharded_dense,
                    bad=[("a^b", "'^' at position 1"), ("a@b", "'@' at position 1"),
                         ("a/part_0_1", "'/part_' at position 1"), ("a\nb", r"'\n' at position 1")],
                    good=["model.layers.0/weight", "a/b", "a b", "\u00e9", "a.b"]),
    "recis-table": Writer(lambda p, n, o: Saver(path=str(p), parallel=1, hashtables={n: _table()}, overwrite=o,
                                                layout="recis").save(), _sharded_tables,
                          bad=[("t/part_1", "'/part_' at position 1"), ("t@x", "'@' at position 1"),
                               ("t^x", "'^' at position 1"), ("t\tx", r"'\t' at position 1")],
                          good=["emb.user", "a b", "tower/emb"], expect=lambda n: {n: _table_rows(_table())}),
    "train": Writer(lambda p, n, o: save_checkpoint(StateModel({n: VALUE}), None, None, None, None, p, 1, overwrite=o),
                    _train, bad=[("fastckpt.tree", "starts with 'fastckpt.', which is reserved"),
                                 ("__metadata__", "'__metadata__' is reserved")],
                    good=FILE_KEYS + ["fastckpt", "a.fastckpt.b"]),
}
BAD = [(w, n, m) for w, spec in WRITERS.items() for n, m in spec.bad]
GOOD_NAMES = [(w, n) for w, spec in WRITERS.items() for n in spec.good]


def _target(tmp_path, writer: str) -> Path:
    return tmp_path / {"safetensors": "t.safetensors", "npz": "t.npz", "tf": "t/ckpt"}.get(writer, "t")


def _files(tmp_path) -> dict:
    return {str(p.relative_to(tmp_path)): p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        if isinstance(value, dict):
            _same(got[name], value)
        else:
            assert got[name].dtype == value.dtype and got[name].shape == value.shape
            assert got[name].tobytes() == value.tobytes()


@pytest.mark.parametrize("writer, name, message", BAD, ids=[f"{w}-{n!r}" for w, n, _ in BAD])
def test_a_name_the_reader_cannot_take_back_is_refused_at_save_time(tmp_path, writer, name, message):
    spec = WRITERS[writer]
    target = _target(tmp_path, writer)
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        spec.save(target, name, False)
    assert repr(name) in str(caught.value)  # the message names the tensor
    assert _files(tmp_path) == {}  # nothing written, not even a directory


@pytest.mark.parametrize("writer, name, message", BAD, ids=[f"{w}-{n!r}" for w, n, _ in BAD])
def test_a_refused_name_leaves_the_previous_commit_as_it_was(tmp_path, writer, name, message):
    spec = WRITERS[writer]
    target = _target(tmp_path, writer)
    spec.save(target, GOOD, False)
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.save(target, name, True)
    assert _files(tmp_path) == before
    _same(spec.load(target), spec.expect(GOOD))


@pytest.mark.parametrize("writer, name", GOOD_NAMES, ids=[f"{w}-{n!r}" for w, n in GOOD_NAMES])
def test_an_odd_name_the_reader_takes_back_round_trips_exactly(tmp_path, writer, name):
    spec = WRITERS[writer]
    target = _target(tmp_path, writer)
    spec.save(target, name, False)
    _same(spec.load(target), spec.expect(name))


def test_every_writer_is_in_the_table():
    # A writer of tensor names added later joins WRITERS, and so its bad and good names are tried.
    assert {w for w, _, _ in BAD} == set(WRITERS)


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".."])
def test_a_tensorflow_checkpoint_name_that_is_no_file_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=re.escape(f"checkpoint name {name!r}")):
        tf_save(tmp_path / "d", {"w": VALUE}, name=name)
    assert _files(tmp_path) == {}


# -- the rule itself ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, problem", [
    ("a\nb", r"holds '\n' at position 1, a control character"),
    ("ab\x1f", r"holds '\x1f' at position 2, a control character"),
    ("\x9f", r"holds '\x9f' at position 0, a control character"),
    ("a\u2029", r"holds '\u2029' at position 1, a control character"),
    ("a/b", "holds '/' at position 1 (sep)"),
    ("", "is empty"),
    ("RES", "is reserved (whole)"),
    ("!x", "starts with '!', which is reserved (lead)"),
])
def test_the_rule_names_the_character_and_its_position(name, problem):
    rule = NameRule("fmt", reserved=(("/", "sep"),), whole=(("RES", "whole"),), prefixes=(("!", "lead"),))
    assert rule.problem(name) == problem
    with pytest.raises(ValueError) as caught:
        rule.check(name, "table")
    assert str(caught.value) == (f"table name {name!r} {problem}: fmt cannot read such a name back; rename the table "
                                 "(for example replace it with '_')")


def test_the_first_reserved_separator_in_the_name_is_the_one_named():
    rule = NameRule("RecIS", reserved=(("@", "at"), ("^", "caret")))
    assert rule.problem("a^b@c") == "holds '^' at position 1 (caret)"


def _every_rule():
    from fastckpt.formats.safetensors import NAMES as safetensors
    from fastckpt.formats.tf.writer import NAMES as tf
    from fastckpt.sharded.format import NAMES as sharded
    from fastckpt.sharded.recis import NAMES as recis
    from fastckpt.train.format import TENSOR_NAMES

    return [safetensors, tf, sharded, recis, TENSOR_NAMES, FILE_NAME, RELATIVE_PATH]


def test_the_quick_look_never_passes_a_name_the_rule_refuses():
    # check() asks problem() only when a quick look finds something suspect: every short combination of the
    # pieces that matter, through every rule, must agree.
    import itertools

    pieces = ["a", "/", ".", "..", "\\", "\x00", "\n", "\x85", "\u2028", "\u200b", "^", "@", "part_", "C:", "fastckpt.",
              "__metadata__"]
    names = ["".join(p) for k in range(4) for p in itertools.product(pieces, repeat=k)]
    refused = 0
    for rule in _every_rule():
        for name in names:
            problem = rule.problem(name)
            refused += problem is not None
            assert rule._suspect(name) or problem is None, (rule.format, name, problem)
    assert refused > len(names)  # the table is not all good names


@pytest.mark.parametrize("name, problem", [
    ("", "is empty"), (".", "is '.', a directory, not a file name"), ("..", "is '..', a directory, not a file name"),
    ("a/b", "holds '/' at position 1 (a file name has no directory separator)"),
    ("a\\b", "holds '\\\\' at position 1 (a path separator on Windows)"),
    ("a\x00", "holds '\\x00' at position 1 (no file name holds NUL)"),
])
def test_file_names(name, problem):
    assert FILE_NAME.problem(name) == problem
    assert FILE_NAME.problem("a\nb") is None  # a newline is a legal file name; the formats' rules refuse it


@pytest.mark.parametrize("name, problem", [
    ("/a", "is an absolute path; expected a relative one"), ("C:/a", "is an absolute path; expected a relative one"),
    ("a//b", "has an empty path component at position 2"), ("a/./b", "has a '.' path component at position 2"),
    ("x/../../y", "has a '..' path component at position 2"),
])
def test_relative_paths(name, problem):
    assert RELATIVE_PATH.problem(name) == problem
    assert RELATIVE_PATH.problem("a/b\\c/d.safetensors") is None


def test_a_reader_check_names_the_file_and_raises_the_readers_error():
    with pytest.raises(fastckpt.errors.FormatError) as caught:
        FILE_NAME.check("../x", "shard file", where="/c/index.json", error=fastckpt.errors.FormatError)
    assert str(caught.value) == ("/c/index.json: shard file name '../x' holds '/' at position 2 (a file name has no "
                                 "directory separator): not a plain file name; refusing to use it")
    with pytest.raises(TypeError, match="tensor names must be str, got 3 \\(int\\)"):
        FILE_NAME.check(3)


# -- step directories ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, step", [("step-5", 5), ("step-00000005", 5), ("step-5\n", None), ("step-5 ", None),
                                        ("step-\u0665", None), ("step-", None), ("xstep-5", None), ("step--5", None)])
def test_parse_step(name, step):
    assert parse_step(name) == step


@pytest.mark.parametrize("step", [-1, True, 1.0, "3", None])
def test_step_name_refuses_what_is_not_a_step(step):
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        step_name(step)
    assert step_name(np.int64(7)) == "step-00000007"


@pytest.mark.parametrize("odd", ["step-5\n", "step-\u0665"])
def test_a_directory_named_like_a_step_but_not_one_is_no_step(tmp_path, odd):
    m = CheckpointManager(tmp_path, fsync=False)
    m.save(3, StateModel({"w": VALUE}))
    os.rename(m.path_for(3), tmp_path / odd)  # a complete checkpoint under a name that is no step's
    m.save(1, StateModel({"w": VALUE}))
    assert CheckpointManager(tmp_path, fsync=False).all_steps() == [1]
    out = io.StringIO()
    from fastckpt.cli import verify

    assert verify.run(Namespace(directory=str(tmp_path), no_hash=False, quiet=False), out) == 0
    assert "step-00000001" in out.getvalue() and repr(odd)[1:-1] not in out.getvalue()


@pytest.mark.parametrize("odd", ["step-5\n", "step-\u0665"])
def test_fastckpt_open_does_not_take_an_odd_name_for_a_step(tmp_path, odd):
    m = CheckpointManager(tmp_path / "run", fsync=False)
    m.save(5, StateModel({"w": VALUE}))
    os.rename(m.path_for(5), tmp_path / "run" / odd)
    with pytest.raises(fastckpt.errors.CheckpointNotFoundError) as caught:
        fastckpt.open(tmp_path / "run")
    assert "CheckpointManager directory of" not in str(caught.value)


# -- names read from disk -----------------------------------------------------------------------------------------

def test_an_old_sharded_checkpoint_with_a_newline_name_loads_exactly(tmp_path, monkeypatch):
    # Saves before the one rule stored such names; their part keys are read whole now ('.' once missed the newline).
    import fastckpt.sharded.saver as saver

    from fastckpt.cli import verify

    monkeypatch.setattr(saver, "NAMES", NameRule("old", controls=False))
    Saver(path=str(tmp_path / "c"), parallel=1, tensors={"layer\nweight": VALUE}, hashtables={"e\nmb": _table()}).save()
    monkeypatch.undo()
    _same(_sharded_dense(tmp_path / "c"), {"layer\nweight": VALUE})
    _same(_sharded_tables(tmp_path / "c"), {"e\nmb": _table_rows(_table())})
    out = io.StringIO()
    assert verify.run(Namespace(directory=str(tmp_path / "c"), no_hash=False, quiet=False), out) == 0, out.getvalue()


def test_a_part_key_with_a_final_newline_is_no_part_key():
    from fastckpt.sharded.format import parse_part_key

    assert parse_part_key("w/part_0_1\n") is None
    assert parse_part_key("a\nb/part_1_2") == ("a\nb", 1, 2)
    assert parse_part_key("w/part_\u0661_2") is None


# -- the small errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["save_checkpoint", "manager", "manager-async"])
def test_the_losers_file_exists_error_names_the_target(tmp_path, how):
    model = StateModel({"w": VALUE})
    if how == "save_checkpoint":
        target = tmp_path / "c"

        def save():
            save_checkpoint(model, None, None, None, None, target, 1, overwrite=False)
    else:
        m = CheckpointManager(tmp_path / "run", fsync=False)
        target = m.path_for(1)

        def save():
            if how == "manager":
                m.save(1, model, overwrite=False)
            else:
                m.save(1, model, overwrite=False, blocking=False).wait()
    save()
    with pytest.raises(FileExistsError) as caught:
        save()
    assert caught.value.errno == errno.EEXIST and caught.value.filename == str(target)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_that_loses_at_the_commit_names_the_target(tmp_path, monkeypatch, blocking):
    import shutil

    import fastckpt.train.checkpoint as checkpoint

    save_checkpoint(StateModel({"w": VALUE}), None, None, None, None, tmp_path / "other", 1)
    real = checkpoint._existing_is_replaceable

    def another_writer_commits_first(out):
        shutil.copytree(tmp_path / "other", out)
        return real(out)

    monkeypatch.setattr(checkpoint, "_existing_is_replaceable", another_writer_commits_first)
    m = CheckpointManager(tmp_path / "run", fsync=False)
    with pytest.raises(FileExistsError) as caught:
        handle = m.save(1, StateModel({"w": VALUE + 1}), overwrite=False, blocking=blocking)
        if not blocking:
            handle.wait()
    assert caught.value.errno == errno.EEXIST and caught.value.filename == str(m.path_for(1))
    _same(_train(m.path_for(1)), {"w": VALUE})  # the winner's checkpoint, untouched


def test_racing_savers_lose_with_the_target_named(tmp_path):
    target = tmp_path / "c"
    start = threading.Barrier(4)

    def save(k):
        start.wait()
        save_checkpoint(StateModel({"w": VALUE + k}), None, None, None, None, target, 1, overwrite=False, fsync=False)

    errors = run_in_threads(save, 4)
    assert len(errors) == 3 and all(isinstance(e, FileExistsError) for e in errors), errors
    assert {e.filename for e in errors} == {str(target)}


DESCRIPTION = "torch_rank_weights_embs_table_multi_shard.json"


@pytest.mark.parametrize("layout, lost, said", [
    ("fastckpt", DESCRIPTION, f"{DESCRIPTION}: missing"), ("fastckpt", "index.json", "index.json: missing"),
    ("recis", "index", "no 'index' file"),
], ids=["fastckpt-description", "fastckpt-index", "recis-index"])
def test_verify_of_a_sharded_checkpoint_that_lost_a_file_says_which(tmp_path, layout, lost, said):
    from fastckpt.cli import verify

    Saver(path=str(tmp_path / "c"), parallel=1, tensors={"w": VALUE}, layout=layout).save()
    os.unlink(tmp_path / "c" / lost)
    out = io.StringIO()
    assert verify.run(Namespace(directory=str(tmp_path / "c"), no_hash=False, quiet=False), out) == 1
    assert said in out.getvalue()
    assert "expected 'fastckpt." not in out.getvalue()  # not taken for another format


# -- no pattern in the package lets '$' accept a final newline ------------------------------------------------------

def _patterns(source: str):
    """(line, pattern) of every call re.<function>("<constant pattern>", ...) in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def test_the_pattern_finder_sees_a_dollar():
    assert list(_patterns('import re\nX = re.compile(r"^step-(\\d+)$")')) == [(2, r"^step-(\d+)$")]


def test_no_regular_expression_in_the_package_ends_with_a_dollar():
    # '$' matches before a final '\n': 'step-5\n' matched '^step-(\d+)$'. Patterns use fullmatch or '\Z'.
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {pattern!r}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, pattern in _patterns(path.read_text(encoding="utf-8"))
             if pattern.endswith("$") and not pattern.endswith("\\$")]
    assert not found, "\n".join(found)
    # The Cython modules are not Python to parse: no '$"' closes a string there.
    assert not [p.name for p in PACKAGE.rglob("*.pyx") if re.search(r"""\$['"]""", p.read_text(encoding="utf-8"))]
