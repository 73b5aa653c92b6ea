"""One suite for every multi-file layout: the same tests run against each entry of LAYOUTS.

A layout is what a multi-file format looks like to a test: how to save version ``v`` of a small checkpoint at a
target (``save(target, v, overwrite, fsync=False)``; fsync off for speed where the writer allows), and how to load what is committed there (``load(target)``, a dict of
name -> numpy array, or an exception when nothing loadable is there). ``expected(v)`` is what version ``v`` holds;
versions differ in every tensor, so a load that mixes two saves cannot match either.

To run a new property against every format, write one test that takes the ``layout`` fixture. To add a format,
add one ``Layout`` entry. The fault-injection suite (tests/test_faults.py) runs over the same entries.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from _threads import run_in_threads

from fastckpt.formats.hfsharded import HFShardedDirectory, save_sharded
from fastckpt.formats.tf.reader import CheckpointReader as TFReader
from fastckpt.formats.tf.writer import write_checkpoint
from fastckpt.sharded import CheckpointReader, Saver
from fastckpt.train import CheckpointManager, load_checkpoint, save_checkpoint


def expected(version: int) -> dict[str, np.ndarray]:
    """Version ``version``'s tensors: every value differs between versions."""
    return {"a": np.full(64, version, np.float32), "b": np.arange(48, dtype=np.float32) + 1000 * version,
            "c": np.full((4, 4), -version, np.float64)}


class _Model:
    """A model whose ``state_dict`` is one version's tensors."""

    def __init__(self, version: int):
        self.tensors = expected(version)

    def state_dict(self):
        return dict(self.tensors)

    def load_state_dict(self, state):
        self.tensors = dict(state)


# -- the layouts ---------------------------------------------------------------------------------------------------

def _tf_save(target, version, overwrite, fsync=False):
    write_checkpoint(target, expected(version), num_shards=2, overwrite=overwrite, fsync=fsync)


def _tf_load(target):
    with TFReader(target) as reader:
        return {name: reader.read_tensor(name, copy=True) for name in reader.tensor_names()}


def _hf_save(target, version, overwrite, fsync=False):
    save_sharded(target, expected(version), max_shard_size=300, overwrite=overwrite, fsync=fsync)


def _hf_mixed_save(target, version, overwrite, fsync=False):
    """Odd versions as one file (model.safetensors), even ones sharded (index + shards): one directory, two shapes."""
    size = 10**9 if version % 2 else 300
    save_sharded(target, expected(version), max_shard_size=size, overwrite=overwrite, fsync=fsync)


def _hf_load(target):
    with HFShardedDirectory(target) as reader:
        return {name: np.array(reader.host(name)) for name in reader.keys()}


def _sharded_save(layout):
    def save(target, version, overwrite, fsync=False):  # a sharded save always fsyncs
        Saver(path=str(target), parallel=2, tensors=expected(version), overwrite=overwrite, layout=layout).save()
    return save


def _sharded_load(target):
    reader = CheckpointReader(target)
    return {name: reader.read_tensor(name) for name in reader.tensor_names()}


def _train_save(target, version, overwrite, fsync=False):
    save_checkpoint(_Model(version), None, None, None, None, target, step=version, overwrite=overwrite, fsync=fsync)


def _train_load(target):
    return dict(load_checkpoint(target).model_weights)


def _manager_save(target, version, overwrite, fsync=False):
    """Every version saves step 1 of one manager directory: the target is that step's checkpoint."""
    CheckpointManager(target.parent, fsync=fsync).save(1, _Model(version), overwrite=overwrite)


def _manager_load(target):
    return dict(load_checkpoint(target).model_weights)


@dataclass(frozen=True)
class Layout:
    name: str
    save: Callable[..., None]
    load: Callable[[Path], dict]
    target: Callable[[Path], Path] = lambda tmp: tmp / "ckpt"

    def __str__(self) -> str:
        return self.name


LAYOUTS = [
    Layout("tf-multishard", _tf_save, _tf_load),
    Layout("hf-sharded", _hf_save, _hf_load),
    Layout("hf-single-vs-sharded", _hf_mixed_save, _hf_load),
    Layout("fastckpt-sharded", _sharded_save("fastckpt"), _sharded_load),
    Layout("recis", _sharded_save("recis"), _sharded_load),
    Layout("training", _train_save, _train_load),
    Layout("manager", _manager_save, _manager_load, lambda tmp: tmp / "run" / "step-00000001"),
]


@pytest.fixture(params=LAYOUTS, ids=str)
def layout(request) -> Layout:
    return request.param


# -- what every test checks ----------------------------------------------------------------------------------------

def assert_exactly(layout: Layout, target: Path, version: int) -> None:
    """What is committed at ``target`` loads as version ``version``, every tensor exactly."""
    got, want = layout.load(target), expected(version)
    assert sorted(got) == sorted(want), f"{layout}: tensors {sorted(got)}, expected {sorted(want)}"
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=f"{layout}: tensor {name!r}")


def leftovers(directory: Path) -> list[str]:
    """Temporaries, staging directories and commit locks under ``directory`` (a finished save leaves none)."""
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            if name.endswith(".partial") or name.endswith(".commit-lock"):
                found.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(found)


def race(layout: Layout, target: Path, writers: int, overwrite: bool) -> tuple[list[int], list]:
    """``writers`` threads save versions 1..writers at ``target`` at once; returns the versions that returned and
    the exceptions the others raised."""
    start, returned = threading.Barrier(writers), []

    def save(k: int) -> None:
        start.wait()
        layout.save(target, k + 1, overwrite)
        returned.append(k + 1)

    return returned, run_in_threads(save, writers)


def _child(layout_name: str, target: str, version: int, overwrite: bool, start, results) -> None:
    layout = next(entry for entry in LAYOUTS if entry.name == layout_name)
    start.wait()
    try:
        layout.save(Path(target), version, overwrite)
        results.put((version, None, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((version, type(exc).__name__, getattr(exc, "filename", None)))


def race_processes(layout: Layout, target: Path, writers: int, overwrite: bool) -> list:
    """As :func:`race`, with one forked process per writer (truly parallel); returns ``(version, exception type
    name or None, its filename)`` per writer, by version."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(writers), context.Queue()
    children = [context.Process(target=_child, args=(layout.name, str(target), k + 1, overwrite, start, results))
                for k in range(writers)]
    for child in children:
        child.start()
    outcomes = sorted(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(timeout=60)
    return outcomes


# -- the tests -----------------------------------------------------------------------------------------------------

def test_a_save_loads_back_exactly_and_leaves_nothing_else(layout, tmp_path):
    target = layout.target(tmp_path)
    layout.save(target, 1, False)
    assert_exactly(layout, target, 1)
    layout.save(target, 2, True)
    assert_exactly(layout, target, 2)
    assert leftovers(tmp_path) == []


def test_a_second_save_without_overwrite_is_refused_naming_the_target_and_changes_nothing(layout, tmp_path):
    target = layout.target(tmp_path)
    layout.save(target, 1, False)
    with pytest.raises(FileExistsError) as refused:
        layout.save(target, 2, False)
    assert os.fspath(refused.value.filename).startswith(os.fspath(target)), refused.value
    assert_exactly(layout, target, 1)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("writers", [2, 3, 4])
def test_racing_writers_without_overwrite_exactly_one_commits(layout, tmp_path, writers):
    for round_ in range(3):
        root = tmp_path / f"round{round_}"
        target = layout.target(root)
        winners, errors = race(layout, target, writers, overwrite=False)
        assert len(winners) == 1, f"{layout}: winners {winners}, errors {errors!r}"
        for exc in errors:
            assert isinstance(exc, FileExistsError), f"{layout}: a loser raised {exc!r}"
            assert os.fspath(exc.filename).startswith(os.fspath(target)), exc
        assert_exactly(layout, target, winners[0])
        assert leftovers(root) == []


@pytest.mark.parametrize("writers", [2, 4])
def test_racing_writers_with_overwrite_leave_one_whole_save(layout, tmp_path, writers):
    target = layout.target(tmp_path)
    layout.save(target, 9, False)
    winners, errors = race(layout, target, writers, overwrite=True)
    assert errors == [] and len(winners) == writers, f"{layout}: {errors!r}"
    got = layout.load(target)
    versions = [v for v in range(1, writers + 1) if np.array_equal(np.asarray(got["a"]), expected(v)["a"])]
    assert len(versions) == 1, f"{layout}: the result matches no single save"
    assert_exactly(layout, target, versions[0])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("writers", [2, 4])
def test_racing_processes_without_overwrite_exactly_one_commits(layout, tmp_path, writers):
    for round_ in range(2):
        root = tmp_path / f"round{round_}"
        target = layout.target(root)
        outcomes = race_processes(layout, target, writers, overwrite=False)
        winners = [version for version, error, _ in outcomes if error is None]
        assert len(winners) == 1, f"{layout}: winners {winners}, outcomes {outcomes!r}"
        for version, error, filename in outcomes:
            if error is not None:
                assert error == "FileExistsError" and os.fspath(filename).startswith(os.fspath(target)), outcomes
        assert_exactly(layout, target, winners[0])
        assert leftovers(root) == []
