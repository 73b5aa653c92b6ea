"""No commit is replaced by a writer that did not ask to; sweeps remove only what is safe to; nothing follows a link.

Races are made deterministic: the second writer commits from inside the first one's commit step.
"""

import json
import os
import warnings
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt.store import commit as _atomic
from fastckpt.formats import hfsharded
from fastckpt.store.commit import atomic_directory, atomic_write, remove_stale_partials, remove_stale_partials_in
from fastckpt.formats.tf.writer import write_checkpoint
from fastckpt.sharded import CheckpointReader, Saver
from fastckpt.sharded.chain import prune
from fastckpt.train import CheckpointManager, load_checkpoint, save_checkpoint
from fastckpt.train.manager import RECORD_FILE

from _threads import run_in_threads

REPO = Path(__file__).resolve().parent.parent


class _Model:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"w": np.full(4, self.value, np.float32)}

    def load_state_dict(self, state):
        self.value = float(state["w"][0])


def _partials(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".partial"))


@pytest.fixture(params=["renameat2", "link", "placeholder"])
def rename(request, monkeypatch):
    """Each way a no-replace rename is made: the Linux call, and the two fallbacks of other systems."""
    if request.param == "renameat2":
        if _atomic._renameat2() is None:
            pytest.skip("this C library has no renameat2")
        return request.param
    monkeypatch.setattr(_atomic, "_renameat2", lambda: None)
    if request.param == "placeholder":  # a filesystem without hard links
        def no_link(*args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    return request.param


# -- two writers, one name ----------------------------------------------------------------------------------------

def test_file_writer_that_finds_its_name_taken_at_commit_raises_and_leaves_nothing(tmp_path, rename):
    target = tmp_path / "m.safetensors"
    with pytest.raises(FileExistsError, match="another writer committed it first") as failure:
        with atomic_write(target) as f:
            f.write(b"first writer's bytes")
            fastckpt.save_safetensors(target, {"b": np.arange(3.0)})  # the second writer commits meanwhile
    assert failure.value.filename == str(target)
    with fastckpt.open(target) as r:
        assert r.host("b").tolist() == [0.0, 1.0, 2.0]
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_directory_writer_that_finds_its_name_taken_at_commit_raises_and_leaves_nothing(tmp_path, rename):
    target = tmp_path / "step-1"
    with pytest.raises(FileExistsError) as failure:
        with atomic_directory(target) as d:
            (d / "a").write_bytes(b"first")
            other = target.with_name(".other")
            other.mkdir()
            (other / "b").write_bytes(b"second")
            os.rename(other, target)  # the second writer commits meanwhile
    assert failure.value.filename == str(target)
    assert os.listdir(target) == ["b"] and (target / "b").read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["step-1"]


def test_an_empty_directory_is_taken_too_never_replaced(tmp_path, rename):
    # rename(2) replaces an empty directory without a word; a no-replace commit must not.
    target = tmp_path / "step-1"
    with pytest.raises(FileExistsError):
        with atomic_directory(target) as d:
            (d / "a").write_bytes(b"first")
            target.mkdir()
    assert target.is_dir() and os.listdir(target) == []


def test_two_training_saves_of_one_step_without_overwrite_one_commits(tmp_path, monkeypatch):
    target = tmp_path / "step-10"
    real = _atomic._swap_in
    digests = []

    def other_commits_first(staging, final, **kwargs):
        monkeypatch.setattr(_atomic, "_swap_in", real)
        digests.append(save_checkpoint(_Model(2.0), None, None, None, None, final, step=10, overwrite=False))
        return real(staging, final, **kwargs)

    monkeypatch.setattr(_atomic, "_swap_in", other_commits_first)
    with pytest.raises(FileExistsError) as failure:
        save_checkpoint(_Model(1.0), None, None, None, None, target, step=10, overwrite=False)
    assert failure.value.filename == str(target)
    state = load_checkpoint(target)  # the winner's, whole and verified
    assert state.manifest["weights_digest"] == digests[0] and state.model_weights["w"].tolist() == [2.0] * 4
    assert os.listdir(tmp_path) == ["step-10"]


def test_two_managers_saving_one_step_one_commits(tmp_path, monkeypatch):
    a, b = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    real = _atomic._swap_in

    def b_commits_first(staging, final, **kwargs):
        monkeypatch.setattr(_atomic, "_swap_in", real)
        b.save(10, _Model(2.0))
        return real(staging, final, **kwargs)

    monkeypatch.setattr(_atomic, "_swap_in", b_commits_first)
    with pytest.raises(FileExistsError, match="step-00000010"):
        a.save(10, _Model(1.0), blocking=False).wait()
    assert load_checkpoint(a.path_for(10)).model_weights["w"].tolist() == [2.0] * 4
    assert _partials(tmp_path) == []


def test_two_sharded_saves_of_one_step_without_overwrite_one_commits(tmp_path, monkeypatch):
    target = tmp_path / "step-10"
    real = _atomic._swap_in  # the rename of every directory commit

    def other_commits_first(staging, final, **kwargs):
        monkeypatch.setattr(_atomic, "_swap_in", real)
        Saver(path=str(final), parallel=1, tensors={"theirs": np.arange(3.0)}).save()
        return real(staging, final, **kwargs)

    monkeypatch.setattr(_atomic, "_swap_in", other_commits_first)
    with pytest.raises(FileExistsError) as failure:
        Saver(path=str(target), parallel=1, tensors={"mine": np.ones(2)}).save()
    assert failure.value.filename == str(target)
    assert CheckpointReader(target).tensor_names() == ["theirs"]
    assert os.listdir(tmp_path) == ["step-10"]


def test_two_hf_sharded_saves_without_overwrite_one_commits(tmp_path, monkeypatch):
    real = _atomic.Commit._publish_files
    theirs = {"a": np.full(300, 2.0, np.float32), "b": np.full(300, 2.0, np.float32)}

    def other_commits_first(*args, **kwargs):
        monkeypatch.setattr(_atomic.Commit, "_publish_files", real)
        hfsharded.save_sharded(tmp_path, theirs, max_shard_size=1500)
        return real(*args, **kwargs)

    monkeypatch.setattr(_atomic.Commit, "_publish_files", other_commits_first)
    with pytest.raises(FileExistsError):
        hfsharded.save_sharded(tmp_path, {"a": np.ones(300, np.float32), "b": np.ones(300, np.float32)},
                               max_shard_size=1500, overwrite=False)
    with fastckpt.open(tmp_path) as r:
        assert {n: r.host(n).tolist() for n in r} == {n: v.tolist() for n, v in theirs.items()}
    assert _partials(tmp_path) == []


def test_overwrite_true_still_replaces_in_one_step(tmp_path):
    target = tmp_path / "step-1"
    save_checkpoint(_Model(1.0), None, None, None, None, target, step=1, overwrite=False)
    save_checkpoint(_Model(2.0), None, None, None, None, target, step=1, overwrite=True)
    assert load_checkpoint(target).model_weights["w"].tolist() == [2.0] * 4
    assert os.listdir(tmp_path) == ["step-1"]


@pytest.mark.parametrize("write", [
    lambda p, v: fastckpt.save_npz(p, {"a": v}),
    lambda p, v: fastckpt.save_safetensors(p, {"a": v}),
    lambda p, v: fastckpt.save_sharded(p, {"a": v}),
    lambda p, v: write_checkpoint(p, {"a": v}),
    lambda p, v: save_checkpoint(_Model(v[0]), None, None, None, None, p, step=1),
], ids=["npz", "safetensors", "hf-sharded", "tf", "train"])
def test_left_out_overwrite_refuses_an_existing_target_and_keeps_it(tmp_path, write):
    # 0.2 replaced here and 0.3 replaced with a FutureWarning; 0.4 refuses, as every other writer always did, and
    # the target keeps the first save's values, with nothing of the refused save left beside it.
    target = tmp_path / "m"
    write(target, np.zeros(2, np.float32))
    before = sorted(os.listdir(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning any more: a refusal
        with pytest.raises(FileExistsError, match="pass overwrite=True"):
            write(target, np.ones(2, np.float32))
    assert sorted(os.listdir(tmp_path)) == before
    with fastckpt.open(target) as r:  # the first save's zeros, not the refused save's ones
        values = [float(x) for n in r for x in np.asarray(r.host(n)).reshape(-1)]
    assert values and set(values) == {0.0}


def test_overwrite_takes_only_true_or_false(tmp_path):
    target = tmp_path / "m.npz"
    fastckpt.save_npz(target, {"a": np.zeros(2)})
    for wrong in (None, 1, "yes"):
        with pytest.raises(TypeError, match=r"overwrite must be True or False, got"):
            fastckpt.save_npz(target, {"a": np.ones(2)}, overwrite=wrong)
    fastckpt.save_npz(target, {"a": np.ones(2)}, overwrite=True)
    assert np.load(target)["a"].tolist() == [1.0, 1.0]


# -- the manager's record -------------------------------------------------------------------------------------------

def test_a_managers_save_in_flight_stays_in_the_record_through_another_managers_retention(tmp_path, monkeypatch):
    from fastckpt.train import manager as manager_module

    a, b = CheckpointManager(tmp_path, max_to_keep=1), CheckpointManager(tmp_path, max_to_keep=1)
    real = manager_module.write_snapshot

    def b_saves_meanwhile(*args, **kwargs):  # a recorded step 2 and is writing it; b's retention runs
        monkeypatch.setattr(manager_module, "write_snapshot", real)
        b.save(3, _Model())
        return real(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_snapshot", b_saves_meanwhile)
    a.save(2, _Model())
    b.save(4, _Model())
    assert a.all_steps() == [4]  # step 2 stayed recorded, so retention found and deleted it


def test_two_managers_saving_at_once_lose_no_name(tmp_path):
    managers = [CheckpointManager(tmp_path, max_to_keep=2, fsync=False) for _ in range(2)]

    def run(k):
        for step in range(k, 24, 2):
            managers[k].save(step, _Model(step))

    assert run_in_threads(run, 2, timeout=120) == []
    steps = [int(n[5:]) for n in os.listdir(tmp_path) if n.startswith("step-")]
    record = json.loads((tmp_path / RECORD_FILE).read_text())["written"]
    assert {f"step-{s:08d}" for s in steps} <= set(record)
    CheckpointManager(tmp_path, max_to_keep=2).save(100, _Model())
    assert sorted(int(n[5:]) for n in os.listdir(tmp_path) if n.startswith("step-")) == [23, 100]


# -- sweeps ---------------------------------------------------------------------------------------------------------

def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then), follow_symlinks=False)
    os.utime(path, (then, then), follow_symlinks=False)


def test_another_hosts_live_staging_is_kept_until_it_is_an_hour_old(tmp_path):
    theirs = tmp_path / ".step-10.@host-a~4026531836.4242.0badf00d.partial"
    theirs.mkdir()
    (theirs / "part-0.safetensors").write_bytes(b"in progress")
    Saver(path=str(tmp_path / "step-20"), parallel=1, tensors={"x": np.ones(2)}).save()  # sweeps the directory
    assert theirs.exists()
    _age(theirs, _atomic.STALE_AFTER - 60)
    assert remove_stale_partials_in(tmp_path) == [] and theirs.exists()
    _age(theirs, _atomic.STALE_AFTER + 60)
    (theirs / "part-1.safetensors").write_bytes(b"still written to")  # anything changed inside keeps it
    assert remove_stale_partials_in(tmp_path) == [] and theirs.exists()
    _age(theirs, _atomic.STALE_AFTER + 60)
    assert remove_stale_partials_in(tmp_path) == [theirs] and not theirs.exists()


def test_a_0_2_name_says_no_host_and_waits_for_the_age_limit(tmp_path):
    legacy = tmp_path / ".w.bin.999999999.0badf00d.partial"
    legacy.write_bytes(b"half")
    assert remove_stale_partials(tmp_path / "w.bin") == [] and legacy.exists()
    _age(legacy, _atomic.STALE_AFTER + 1)
    assert remove_stale_partials(tmp_path / "w.bin") == [legacy]


def test_a_dead_writer_of_this_host_is_swept_another_hosts_by_the_same_pid_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "host-a.example.org")
    _atomic._owner_for.cache_clear()
    try:
        assert _atomic._owner().startswith("@host-a_example_org")
        dead_here = tmp_path / f".w.bin.{_atomic._owner()}.999999999.0badf00d.partial"
        dead_here.write_bytes(b"half")
        monkeypatch.setattr("socket.gethostname", lambda: "host-b")
        _atomic._owner_for.cache_clear()
        assert remove_stale_partials(tmp_path / "w.bin") == [] and dead_here.exists()  # host-b cannot know
        monkeypatch.setattr("socket.gethostname", lambda: "host-a.example.org")
        _atomic._owner_for.cache_clear()
        assert remove_stale_partials(tmp_path / "w.bin") == [dead_here]
    finally:
        monkeypatch.undo()
        _atomic._owner_for.cache_clear()


SWEEP_IN_A_NEW_PID_NAMESPACE = r"""
import sys
from fastckpt.store.commit import remove_stale_partials
print([p.name for p in remove_stale_partials(sys.argv[1])], flush=True)
"""


def test_a_writer_in_another_pid_namespace_does_not_sweep_a_live_temporary(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid --fork does not work here: {probe.stderr.decode(errors='replace').strip()}")
    target = tmp_path / "w.bin"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with atomic_write(target) as f:
        f.write(b"a live writer's bytes")
        # Our pid does not exist in the child's namespace: by pid alone it would look dead.
        done = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", SWEEP_IN_A_NEW_PID_NAMESPACE,
                               str(target)], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]"
    assert target.read_bytes() == b"a live writer's bytes"


def test_a_sweep_unlinks_a_link_named_like_a_temporary_never_its_target(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"k")
    managed = tmp_path / "managed"
    managed.mkdir()
    link = managed / f".w.bin.{_atomic._owner()}.999999999.0badf00d.partial"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert remove_stale_partials_in(managed) == [link]
    assert not os.path.lexists(link) and (elsewhere / "keep").read_bytes() == b"k"


# -- prune ----------------------------------------------------------------------------------------------------------

def test_prune_never_follows_a_symlinked_checkpoint_out_of_its_directory(tmp_path):
    outside = tmp_path / "outside" / "step-0"
    Saver(path=str(outside), parallel=1, tensors={"x": np.zeros(2)}).save()  # the oldest commit
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "step-0").symlink_to(outside, target_is_directory=True)
    for step in (1, 2):
        time.sleep(0.01)
        Saver(path=str(ckpts / f"step-{step}"), parallel=1, tensors={"x": np.full(2, step)}).save()
    removed = prune(ckpts, keep_last=1)
    assert removed == [str(ckpts / "step-1")]
    assert (outside / "manifest.json").exists() and CheckpointReader(outside).tensor_names() == ["x"]
    assert sorted(os.listdir(ckpts)) == ["step-0", "step-2"] and (ckpts / "step-0").is_symlink()


def test_link_over_never_renames_onto_a_name_that_exists(tmp_path, monkeypatch):
    """A load from a URL links a file another rank fetched over its own placeholder. A rename that replaces a file
    has ext4 (auto_da_alloc) write the renamed file's dirty pages out first: 40-110 ms a file in a 1 -> 4 verified
    load, for a temporary copy. The old name is removed first; the file is the source's, the source unchanged."""
    source, target = tmp_path / "fetched", tmp_path / "placeholder"
    source.write_bytes(b"fetched bytes")
    with open(target, "wb") as f:
        f.truncate(13)  # a share's sparse placeholder
    renames = []
    real_rename, real_replace = os.rename, os.replace

    def rename(a, b, *args, **kw):
        renames.append(os.path.lexists(b))
        return real_rename(a, b, *args, **kw)

    def replace(a, b, *args, **kw):
        renames.append(os.path.lexists(b))
        return real_replace(a, b, *args, **kw)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    _atomic.link_over(source, target)
    assert renames == [False]
    assert target.read_bytes() == b"fetched bytes" and os.stat(source).st_ino == os.stat(target).st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fetched", "placeholder"]  # no temporary left


def test_link_over_that_cannot_link_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "placeholder"
    target.write_bytes(b"old")
    with pytest.raises(FileNotFoundError):
        _atomic.link_over(tmp_path / "gone", target)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["placeholder"]
