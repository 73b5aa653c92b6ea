"""CheckpointManager: retention, async saves, crash safety (kill -9), and the verify command."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from fastckpt.store.commit import _owner
from fastckpt.errors import CheckpointNotFoundError, FormatError, IntegrityError
from fastckpt.train import asyncsave
from fastckpt.train.asyncsave import AsyncCheckpointer, StagingPool
from fastckpt.train.checkpoint import WEIGHTS_FILE, load_checkpoint, save_checkpoint
from fastckpt.train.manager import LOCK_FILE, RECORD_FILE, CheckpointManager
from fastckpt.train.reference.selfcheck import (
    build_fresh,
    byte_equal,
    capture_full_state,
    first_difference,
    train_n_steps,
)

REPO = Path(__file__).resolve().parents[1]


def save_steps(mgr, steps, losses=None, **kw):
    objs = build_fresh(1)
    for i, step in enumerate(steps):
        metrics = {"loss": losses[i]} if losses is not None else {}
        mgr.save(step, *objs.save_args(), scaler=objs.scaler, metrics=metrics, **kw)
    mgr.wait()
    return objs


# -- retention ------------------------------------------------------------------------------------
LOSSES = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0, 7.0, 8.0, 9.0, 10.0]


@pytest.mark.parametrize("policy, survivors", [
    ({}, list(range(1, 11))),
    ({"max_to_keep": 3}, [8, 9, 10]),
    ({"max_to_keep": 1}, [10]),
    ({"keep_every_n_steps": 4}, [4, 8, 10]),
    ({"keep_every_n_steps": 4, "max_to_keep": 2}, [4, 8, 9, 10]),
    ({"keep_best": ("loss", "min")}, [4, 10]),
    ({"keep_best": ("loss", "min", 2)}, [4, 5, 10]),
    ({"keep_best": ("loss", "max")}, [10]),
    ({"keep_best": ("loss", "min"), "max_to_keep": 2, "keep_every_n_steps": 3}, [3, 4, 6, 9, 10]),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_retention_keeps_exactly_what_the_policy_says(tmp_path, policy, survivors):
    mgr = CheckpointManager(tmp_path, **policy)
    save_steps(mgr, range(1, 11), LOSSES)
    assert mgr.all_steps() == survivors
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOCK_FILE, RECORD_FILE] +
                                                                [f"step-{s:08d}" for s in survivors])
    record = json.loads((tmp_path / RECORD_FILE).read_text())["written"]
    assert record == [f"step-{s:08d}" for s in survivors]


def test_keep_best_ignores_checkpoints_without_the_metric(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_best=("acc", "max"), max_to_keep=1)
    objs = build_fresh(1)
    mgr.save(1, *objs.save_args(), metrics={"acc": 0.5})
    mgr.save(2, *objs.save_args(), metrics={})
    mgr.save(3, *objs.save_args(), metrics={"acc": float("nan")})
    mgr.save(4, *objs.save_args(), metrics={"acc": 0.1})
    assert mgr.all_steps() == [1, 4]


def test_only_checkpoints_it_wrote_are_deleted(tmp_path):
    objs = build_fresh(1)
    save_checkpoint(*objs.save_args(), tmp_path / "step-00000003", step=3)  # copied in by hand
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    for step in (5, 6, 7):
        mgr.save(step, *objs.save_args())
    assert mgr.all_steps() == [3, 7]
    # A new manager over the same directory continues the record.
    mgr2 = CheckpointManager(tmp_path, max_to_keep=1)
    mgr2.save(8, *objs.save_args())
    assert mgr2.all_steps() == [3, 8]


def test_incomplete_directories_do_not_count(tmp_path):
    mgr = CheckpointManager(tmp_path)
    save_steps(mgr, [1, 2])
    (tmp_path / "step-00000002" / "manifest.json").unlink()
    weights = tmp_path / "step-00000001" / WEIGHTS_FILE
    assert mgr.all_steps() == [1] and mgr.latest().name == "step-00000001"
    weights.write_bytes(weights.read_bytes()[:-4])  # wrong size: not complete either
    assert mgr.all_steps() == [] and mgr.latest() is None and mgr.restore_latest(build_fresh(1).model) is None


def test_latest_and_restore_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    objs = build_fresh(2)
    for step in (10, 20, 30):
        train_n_steps(objs, 2)
        mgr.save(step, *objs.save_args(), scaler=objs.scaler, epoch=objs.data_iter.epoch)
    expected = capture_full_state(objs)
    fresh = build_fresh(2)
    state = mgr.restore_latest(*fresh.save_args(), scaler=fresh.scaler)
    assert state.step == 30 and mgr.latest_step() == 30
    assert byte_equal(expected, capture_full_state(fresh))
    with pytest.raises(CheckpointNotFoundError, match="complete steps: \\[20, 30\\]"):
        mgr.restore(10, fresh.model)


def test_restore_latest_verifies_hashes(tmp_path):
    mgr = CheckpointManager(tmp_path)
    save_steps(mgr, [1])
    path = tmp_path / "step-00000001" / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=WEIGHTS_FILE):
        mgr.restore_latest(build_fresh(1).model)


def test_existing_step_needs_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path)
    objs = save_steps(mgr, [1])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        mgr.save(1, *objs.save_args())
    train_n_steps(objs, 1)
    mgr.save(1, *objs.save_args(), overwrite=True)
    assert byte_equal(load_checkpoint(tmp_path / "step-00000001").model_weights, objs.model.state_dict())


def test_corrupt_record_is_reported(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    objs = save_steps(mgr, [1])
    (tmp_path / RECORD_FILE).write_text("{not json")
    with pytest.raises(FormatError, match="delete the file"):
        mgr.save(2, *objs.save_args())


@pytest.mark.parametrize("kwargs, match", [
    ({"max_to_keep": 0}, r"max_to_keep must be a positive int or None, got 0"),
    ({"keep_every_n_steps": 0}, r"keep_every_n_steps must be a positive int or None, got 0"),
    ({"keep_best": ("loss", "up")}, r"keep_best: need \(str metric, 'min'\|'max', positive count\), got \('loss', 'up'\)"),
    ({"keep_best": "loss"}, r"keep_best must be \(metric, mode\) or \(metric, mode, count\), got 'loss'"),
    ({"keep_best": ("loss", "min", 0)}, r"positive count\), got \('loss', 'min', 0\)"),
])
def test_bad_policy_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManager(tmp_path, **kwargs)


def test_stale_partials_swept_by_a_new_manager(tmp_path):
    (tmp_path / f".step-00000005.{_owner()}.999999999.0badc0de.partial").mkdir()
    (tmp_path / f".step-00000006.{_owner()}.999999999.0badc0de.partial").mkdir()
    live = tmp_path / f".step-00000007.{_owner()}.{os.getpid()}.0badc0de.partial"  # a live writer's: kept
    live.mkdir()
    CheckpointManager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


# -- asynchronous saves ---------------------------------------------------------------------------
def test_async_snapshot_is_taken_at_save_time(tmp_path):
    mgr = CheckpointManager(tmp_path)
    objs = build_fresh(4)
    train_n_steps(objs, 5)
    expected = capture_full_state(objs)
    mutated = threading.Event()
    real = asyncsave.write_snapshot

    def write_after_the_trainer_moved_on(*args, **kwargs):
        assert mutated.wait(60)
        return real(*args, **kwargs)

    with mock.patch.object(asyncsave, "write_snapshot", side_effect=write_after_the_trainer_moved_on):
        handle = mgr.save(5, *objs.save_args(), scaler=objs.scaler, blocking=False)
        # Every state machine changes (arrays in place) before the background write starts.
        train_n_steps(objs, 5)
        objs.model.embed.weight.data[...] = 0
        for buffers in objs.optimizer.state:
            for array in buffers.values():
                array[...] = np.nan
        assert not handle.done()
        mutated.set()
        handle.wait()
    fresh = build_fresh(4)
    mgr.restore(5, *fresh.save_args(), scaler=fresh.scaler)
    assert first_difference(expected, capture_full_state(fresh)) is None


@pytest.mark.parametrize("split", [7, 10, 14])
def test_resume_matches_continuous_with_async_saves(tmp_path, split):
    # The trainer saves every step without blocking and goes straight on; the checkpoint of step
    # `split` must resume into exactly the rest of the uninterrupted run (across epoch boundaries:
    # 7 batches per epoch).
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    ref = build_fresh(42, num_tokens=1000)
    losses = []
    for step in range(1, 21):
        losses += train_n_steps(ref, 1)
        mgr.save(step, *ref.save_args(), scaler=ref.scaler, epoch=ref.data_iter.epoch, blocking=False)
    mgr.close()
    assert CheckpointManager(tmp_path).all_steps() == list(range(1, 21))
    resumed = build_fresh(42, num_tokens=1000)
    state = CheckpointManager(tmp_path).restore(split, *resumed.save_args(), scaler=resumed.scaler)
    assert state.step == split and state.epoch == (split - 1) // 7
    assert np.array(losses[split:]).tobytes() == np.array(train_n_steps(resumed, 20 - split)).tobytes()


def test_background_error_surfaces_on_wait(tmp_path):
    saver = AsyncCheckpointer()
    objs = build_fresh(1)
    with mock.patch.object(asyncsave, "write_snapshot", side_effect=OSError(28, "No space left on device")):
        handle = saver.save(tmp_path / "c", *objs.save_args(), step=1)
        with pytest.raises(OSError, match="No space left"):
            handle.wait()
    saver.save(tmp_path / "c", *objs.save_args(), step=2).wait()  # reported once, not again
    assert load_checkpoint(tmp_path / "c").step == 2
    saver.close()


def test_background_error_surfaces_on_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path)
    objs = build_fresh(1)
    with mock.patch.object(asyncsave, "write_snapshot", side_effect=OSError(5, "I/O error")):
        mgr.save(1, *objs.save_args(), blocking=False)
        with pytest.raises(OSError, match="I/O error"):
            mgr.save(2, *objs.save_args(), blocking=False)
    assert mgr.all_steps() == []  # the save that reported the error did not start
    mgr.save(2, *objs.save_args(), blocking=False).wait()
    assert mgr.all_steps() == [2]
    mgr.close()


def test_at_most_one_save_in_flight(tmp_path):
    saver = AsyncCheckpointer()
    objs = build_fresh(1)
    release = threading.Event()
    started = []
    real = asyncsave.write_snapshot

    def slow(snap, path, **kw):
        started.append(path.name)
        release.wait(30)
        return real(snap, path, **kw)

    with mock.patch.object(asyncsave, "write_snapshot", side_effect=slow):
        first = saver.save(tmp_path / "a", *objs.save_args(), step=1)
        second_done = threading.Event()
        t = threading.Thread(target=lambda: (saver.save(tmp_path / "b", *objs.save_args(), step=2), second_done.set()))
        t.start()
        assert not second_done.wait(0.3)  # blocked behind the first save
        assert started == ["a"] and not first.done()
        release.set()
        t.join(30)
        assert second_done.is_set()
        saver.wait()
    assert started == ["a", "b"]
    saver.close()


def test_staging_buffers_are_reused():
    pool = StagingPool()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    staged = pool.stage(a)
    assert staged is not a and not np.shares_memory(staged, a) and np.array_equal(staged, a)
    pool.release([staged])
    again = pool.stage(a[::-1])
    assert again is staged and np.array_equal(again, a[::-1])
    assert pool.stage(np.zeros(3)) is not staged


def test_async_save_of_tied_weights(tmp_path):
    mgr = CheckpointManager(tmp_path)
    objs = build_fresh(1)
    mgr.save(1, *objs.save_args(), blocking=False).wait()
    state = load_checkpoint(mgr.latest())
    assert state.model_weights["lm_head.weight"] is state.model_weights["embed.weight"]


# -- crash safety -------------------------------------------------------------------------------
# One BLAS thread: on a loaded machine OpenBLAS's spinning threads make each step 30x slower.
CHILD_ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

# Saves step 1, then kills itself with SIGKILL just before the crash_at-th step of the save of step 2 (a rename,
# or the open of a file written in place in the staging directory; crash_at 0: never) and otherwise prints how many
# such steps that save made.
KILL_AT_RENAME = r"""
import os, signal, sys
from fastckpt.train import CheckpointManager
from fastckpt.train.reference.selfcheck import build_fresh, train_n_steps
directory, crash_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
objs = build_fresh(1)
mgr = CheckpointManager(directory, max_to_keep=1)
mgr.save(1, *objs.save_args(), scaler=objs.scaler)
train_n_steps(objs, 1)
import fastckpt.store.commit as atomic
real_replace, real_noreplace, renames, inside = os.replace, atomic.rename_noreplace, [], []
def die_at(dst):
    renames.append(dst)
    if len(renames) == crash_at:
        os.kill(os.getpid(), signal.SIGKILL)
def replace_or_die(src, dst):
    if not inside:  # not the fallback inside a no-replace rename: that counts once
        die_at(dst)
    return real_replace(src, dst)
def noreplace_or_die(src, dst):
    die_at(dst)
    inside.append(dst)
    try:
        return real_noreplace(src, dst)
    finally:
        inside.pop()
real_staged = atomic.staged_file
def staged_or_die(path, **kwargs):
    die_at(path)
    return real_staged(path, **kwargs)
import fastckpt.formats.safetensors as safetensors
os.replace, atomic.rename_noreplace = replace_or_die, noreplace_or_die
atomic.staged_file = safetensors.staged_file = staged_or_die
mgr.save(2, *objs.save_args(), scaler=objs.scaler, blocking=mode == "blocking")
mgr.close()
print(len(renames), flush=True)
"""
# The steps of that save, in order: the manager's record (renamed), the opens of weights, optim, extra and manifest
# (written in place in the staging directory, never renamed), the directory itself (a no-replace rename); then
# retention: step 1 moved aside, the record again.
RENAMES = ["record", "weights", "optim", "extra", "manifest", "directory", "retention", "record-after-delete"]
DIRECTORY_RENAME = RENAMES.index("directory") + 1


@pytest.fixture(scope="module")
def forks():
    """KILL_AT_RENAME's processes: forked from one interpreter that made the script's imports (tests/_forkserver.py),
    each its own process, killed by its own SIGKILL."""
    from _forkserver import ForkServer

    server = ForkServer("\n".join(line for line in KILL_AT_RENAME.splitlines()[:4] if "import" in line), env=CHILD_ENV)
    yield server
    server.close()


def _run_kill_at_rename(forks, directory: Path, crash_at: int, mode: str) -> subprocess.CompletedProcess:
    return forks.run(KILL_AT_RENAME, str(directory), str(crash_at), mode, timeout=300)


def test_the_save_makes_the_renames_the_kill_test_targets(tmp_path, forks):
    proc = _run_kill_at_rename(forks, tmp_path, 0, "blocking")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(RENAMES)
    assert CheckpointManager(tmp_path).all_steps() == [2]


@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize("crash_at", range(1, len(RENAMES) + 1), ids=lambda i: f"before-{RENAMES[i - 1]}")
def test_kill_9_before_each_rename_of_a_save(tmp_path, crash_at, mode, forks):
    proc = _run_kill_at_rename(forks, tmp_path, crash_at, mode)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    # The kill hit the middle of the save: a temporary is left, except right before moving step 1 aside.
    left = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert bool(left) == (RENAMES[crash_at - 1] != "retention"), left
    mgr = CheckpointManager(tmp_path, max_to_keep=1)  # sweeps the dead writer's temporaries
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    # Step 2 counts exactly when its directory was renamed into place; step 1 is there until then.
    assert mgr.latest_step() == (1 if crash_at <= DIRECTORY_RENAME else 2)
    for step in mgr.all_steps():
        assert load_checkpoint(mgr.path_for(step)).step == step  # complete and verified
    # The directory stays usable: the next save, and retention of what the dead process wrote.
    mgr.save(3, *build_fresh(1).save_args())
    assert mgr.all_steps() == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOCK_FILE, RECORD_FILE, "step-00000003"])


# Resumes from the latest checkpoint and saves every step until killed; prints each step whose save
# is known durable (a blocking save returns after the save before it and itself are complete).
KILL_ANY_TIME = r"""
import sys
from fastckpt.train import CheckpointManager
from fastckpt.train.reference.selfcheck import build_fresh, train_n_steps
objs = build_fresh(1, vocab=512, dim=128, hidden=512)
mgr = CheckpointManager(sys.argv[1], max_to_keep=2, keep_every_n_steps=7)
state = mgr.restore_latest(*objs.save_args(), scaler=objs.scaler)
step = state.step if state else 0
while True:
    step += 1
    train_n_steps(objs, 1)
    blocking = step % 2 == 0
    mgr.save(step, *objs.save_args(), scaler=objs.scaler, metrics={"loss": 1.0}, blocking=blocking)
    if blocking:
        print(step, flush=True)
"""


def _kill_during_saves(directory: Path, rounds: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    latest = []
    for _ in range(rounds):
        child = subprocess.Popen([sys.executable, "-c", KILL_ANY_TIME, str(directory)], stdout=subprocess.PIPE,
                                 text=True, env=CHILD_ENV)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True)
        reader.start()
        try:
            # Kill only once this round has a durable save of its own, at a random moment after it:
            # the child spends most of its time saving, so the kill lands in a save most rounds.
            durable = [int(lines.get(timeout=300))]
            time.sleep(rnd.uniform(0.0, 0.3))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        reader.join(30)
        while not lines.empty():
            durable.append(int(lines.get()))
        mgr = CheckpointManager(directory)
        assert mgr.latest_step() >= max(durable)  # a save that returned is never lost
        load_checkpoint(mgr.latest())  # verified: complete and uncorrupted
        for step in mgr.all_steps():
            load_checkpoint(mgr.path_for(step))
        latest.append(mgr.latest_step())
    return latest


def test_kill_9_during_saves_never_leaves_a_broken_latest(tmp_path):
    latest = _kill_during_saves(tmp_path, rounds=3, seed=1)
    assert latest == sorted(set(latest))  # each round resumed from the previous one and saved more
    CheckpointManager(tmp_path)  # a new manager sweeps leftovers of the dead writers
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


@pytest.mark.slow
def test_kill_9_during_saves_many_rounds(tmp_path):
    latest = _kill_during_saves(tmp_path, rounds=30, seed=2)
    assert latest == sorted(set(latest))


# -- the verify command -------------------------------------------------------------------------
def _verify(args):
    from fastckpt.cli import main

    return main(["verify", *args])


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_verify_command_ok_and_fail(tmp_path, capsys, algorithm):
    mgr = CheckpointManager(tmp_path, hash=algorithm)
    save_steps(mgr, [1, 2], blocking=False)  # the asynchronous saver hashes with the manager's algorithm too
    digest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())["weights_digest"]
    assert digest.startswith(f"{algorithm}:")
    assert _verify([str(tmp_path / "step-00000001")]) == 0
    assert f"step=1 epoch=0 weights={digest}" in capsys.readouterr().out
    path = tmp_path / "step-00000002" / "optim.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # in the data section: only the hash can notice
    path.write_bytes(bytes(data))
    assert _verify([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "OK" in out and "FAIL" in out and f"optim.safetensors: {algorithm} mismatch" in out
    assert _verify(["--no-hash", str(tmp_path)]) == 0


def test_verify_command_help_names_the_hashes(capsys):
    with pytest.raises(SystemExit):
        _verify(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "file sizes and file hashes (BLAKE3, or sha256 where the manifest names it)" in help_text


def test_verify_command_reports_missing_manifest_and_files(tmp_path, capsys):
    save_checkpoint(build_fresh(1).model, None, None, None, None, tmp_path / "c", step=0)
    (tmp_path / "c" / "extra.json").unlink()
    assert _verify([str(tmp_path / "c")]) == 1
    assert "extra.json: missing" in capsys.readouterr().out
    (tmp_path / "c" / "manifest.json").unlink()
    assert _verify([str(tmp_path / "c")]) == 1
    assert _verify([str(tmp_path / "nowhere")]) == 1


def test_verify_command_through_the_console_script(tmp_path):
    save_checkpoint(build_fresh(1).model, None, None, None, None, tmp_path / "c", step=0)
    proc = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(tmp_path / "c")], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step=0" in proc.stdout
