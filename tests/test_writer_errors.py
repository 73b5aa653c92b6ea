"""Every writer's OSError names the target, never only a temporary, and a failed save leaves nothing it created.

Real failures from the kernel: EFBIG from RLIMIT_FSIZE, ENOSPC from a tiny tmpfs (root only), EACCES from a
child process that gives up root before it writes, ENOTDIR and EISDIR from what is in the way.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fastckpt
from fastckpt.formats.hfsharded import save_sharded
from fastckpt.formats.tf.writer import write_checkpoint
from fastckpt.io.checkpoint import save_params
from fastckpt.sharded import Saver
from fastckpt.stateful import Checkpoint
from fastckpt.train import CheckpointManager, save_checkpoint

from _writing import file_size_limit

REPO = Path(__file__).resolve().parent.parent


def _values() -> np.ndarray:
    return np.arange(65536, dtype=np.float32)  # 256 KiB: past a 64 KiB tmpfs and a 4 KiB RLIMIT_FSIZE


class _Model:
    def state_dict(self):
        return {"w": _values()}

    def load_state_dict(self, state):
        pass


# name -> (write(target), kind): "file" is the target itself, "prefix" a TF prefix (its .index and .data-*),
# "dir" a directory the save makes (an error may name a file in it).
WRITERS = {
    "safetensors": (lambda p: fastckpt.save_safetensors(p, {"w": _values()}), "file"),
    "npz": (lambda p: fastckpt.save_npz(p, {"w": _values()}), "file"),
    "tf": (lambda p: write_checkpoint(p, {"w": _values()}), "prefix"),
    "hf-sharded": (lambda p: save_sharded(p, {"a": _values(), "b": _values()}, max_shard_size=300_000), "dir"),
    "train": (lambda p: save_checkpoint(_Model(), None, None, None, None, p, step=1), "dir"),
    "manager": (lambda p: CheckpointManager(p).save(1, _Model()), "dir"),
    "manager-async": (lambda p: CheckpointManager(p).save(1, _Model(), blocking=False).wait(), "dir"),
    "sharded": (lambda p: Saver(path=p, parallel=1, tensors={"w": _values()}).save(), "dir"),
    "io-params": (lambda p: save_params([_values()], p, names=["w"]), "prefix"),  # writes <p>.npz
    "stateful": (lambda p: _stateful_save(p), "file"),
}


def _stateful_save(path):
    checkpoint = Checkpoint()
    checkpoint.set_state("blob", "x" * 300_000)
    checkpoint.save(path)


def _names_the_target(error: OSError, target: str, kind: str) -> bool:
    name = os.fspath(error.filename)
    if ".partial" in os.path.basename(name):
        return False
    if kind == "prefix":
        return name.startswith(target + ".")
    return name == target or (kind == "dir" and name.startswith(target + os.sep))


def _leftovers(directory: Path, writer: str) -> list[str]:
    """What a failed save left under ``directory``: temporaries, and anything named for the target, except the
    directory a CheckpointManager made (with its record and lock) before its save began."""
    manager = {"model", os.path.join("model", ".fastckpt-manager.json"), os.path.join("model", ".fastckpt-manager.lock")}
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            inner = rel.split(os.sep, 1)[1] if rel.startswith("out" + os.sep) else rel
            if writer.startswith("manager") and inner in manager:
                continue
            if name.endswith(".partial") or inner.startswith("model"):
                found.append(rel)
    return sorted(found)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_file_too_large_names_the_target_and_leaves_nothing(tmp_path, writer):
    write, kind = WRITERS[writer]
    target = str(tmp_path / "out" / "model")
    with file_size_limit(4096), pytest.raises(OSError) as failure:
        write(target)
    assert failure.value.errno == 27, failure.value  # EFBIG
    assert _names_the_target(failure.value, target, kind), failure.value
    assert target in str(failure.value)
    assert _leftovers(tmp_path, writer) == []


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 64 KiB tmpfs at ``tmp_path / "small"`` (root only; skipped where mount is refused)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_disk_full_names_the_target_and_leaves_nothing(tiny_filesystem, writer):
    write, kind = WRITERS[writer]
    target = str(tiny_filesystem / "model")
    with pytest.raises(OSError) as failure:
        write(target)
    assert failure.value.errno == 28, failure.value  # ENOSPC
    assert _names_the_target(failure.value, target, kind), failure.value
    assert _leftovers(tiny_filesystem, writer) == []


# One child for every writer: it saves once as root into a scratch directory (so that every module a save
# imports is loaded), becomes nobody, and then writes into a directory root owns; one JSON line per writer.
AS_NOBODY = textwrap.dedent(r"""
    import json, os, shutil, sys, tempfile
    sys.path.insert(0, sys.argv[2])
    import test_writer_errors as t
    scratch = tempfile.mkdtemp()
    for name, (write, kind) in t.WRITERS.items():
        write(os.path.join(scratch, name))
    shutil.rmtree(scratch)
    os.setgid(65534); os.setuid(65534)
    errors = {}
    for name, (write, kind) in t.WRITERS.items():
        try:
            write(os.path.join(sys.argv[1], name))
            errors[name] = None
        except Exception as e:  # anything but a PermissionError naming the target fails that writer's test
            filename = getattr(e, "filename", None)
            errors[name] = {"type": type(e).__name__, "errno": getattr(e, "errno", None),
                            "filename": None if filename is None else os.fspath(filename), "text": str(e)}
    print(json.dumps(errors))
""")


@pytest.fixture(scope="module")
def permission_errors():
    """``(locked directory, writer -> the error it raised as nobody)``."""
    if os.geteuid() != 0:
        pytest.skip("the child drops root's privileges to meet a real EACCES")
    locked = Path(tempfile.mkdtemp(prefix="fastckpt-locked-"))  # outside pytest's 0700 folder: nobody reaches it
    os.chmod(locked, 0o755)  # root's: nobody may not create anything in it
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OPENBLAS_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-c", AS_NOBODY, str(locked), str(Path(__file__).parent)],
                              capture_output=True, text=True, env=env, timeout=300, cwd="/")
        assert done.returncode == 0, done.stderr
        yield locked, json.loads(done.stdout.splitlines()[-1]), sorted(os.listdir(locked))
    finally:
        shutil.rmtree(locked, ignore_errors=True)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_permission_denied_names_the_target(permission_errors, writer):
    locked, errors, left = permission_errors
    _, kind = WRITERS[writer]
    error = errors[writer]
    assert error is not None and error["type"] == "PermissionError" and error["errno"] == 13, error
    assert _names_the_target(PermissionError(13, "", error["filename"]), str(locked / writer), kind), error
    assert left == []


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_file_in_the_way_of_the_parent_is_not_a_directory_naming_the_target(tmp_path, writer):
    write, kind = WRITERS[writer]
    (tmp_path / "file").write_bytes(b"keep")
    target = str(tmp_path / "file" / "model")
    with pytest.raises(NotADirectoryError) as failure:
        write(target)
    assert _names_the_target(failure.value, target, kind) or failure.value.filename == os.path.dirname(target), \
        failure.value
    assert sorted(os.listdir(tmp_path)) == ["file"] and (tmp_path / "file").read_bytes() == b"keep"


@pytest.mark.parametrize("writer", ["safetensors", "npz"])
def test_a_directory_in_the_way_is_a_directory_naming_the_target(tmp_path, writer):
    write = {"safetensors": fastckpt.save_safetensors, "npz": fastckpt.save_npz}[writer]
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    with pytest.raises(FileExistsError) as refused:  # refused as any existing target is, without overwrite=True
        write(str(target), {"w": _values()})
    with pytest.raises(IsADirectoryError) as failure:  # asked to replace: a directory is never replaced by a file
        write(str(target), {"w": _values()}, overwrite=True)
    assert refused.value.filename == failure.value.filename == str(target)
    assert sorted(os.listdir(tmp_path)) == ["model"] and (target / "keep").read_bytes() == b"k"


def test_a_failed_hf_sharded_save_leaves_no_folder_it_made(tmp_path):
    target = tmp_path / "new" / "model-dir"
    with pytest.raises(TypeError, match="object"):
        save_sharded(target, {"a": np.zeros(3), "b": np.array([None], dtype=object)}, max_shard_size=8)
    assert not (tmp_path / "new" / "model-dir").exists()
    with file_size_limit(4096), pytest.raises(OSError):
        save_sharded(target, {"a": _values()})
    assert not target.exists()
