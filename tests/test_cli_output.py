"""What the commands print: a closed pipe, fastckpt's warnings, counted nouns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import fastckpt
from fastckpt.words import plural

ROOT = Path(__file__).resolve().parents[1]


def _fastckpt(shell_args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(f"{sys.executable} -m fastckpt {shell_args}", shell=True, executable="/bin/bash",
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_inspect_into_head_ends_without_a_traceback(tmp_path):
    path = tmp_path / "many.safetensors"
    # 3,000 rows, far more than a pipe's buffer: the write after head has gone fails with EPIPE every time
    fastckpt.save_safetensors(path, {f"layer{i:05d}.weight": np.zeros(1, np.float32) for i in range(3000)})
    done = _fastckpt(f"inspect {path} | head -1; echo status=${{PIPESTATUS[0]}}")
    assert done.stdout.splitlines() == [f"{path}: safetensors, 3000 tensors", "status=141"]
    assert done.stderr == ""


def test_a_compressed_npz_gives_one_clean_warning_line(tmp_path):
    path = tmp_path / "c.npz"
    np.savez_compressed(path, w=np.zeros(100, np.float32))
    done = _fastckpt(f"convert {path} {tmp_path / 'c.safetensors'}")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (f"fastckpt: warning: {path}: 1 of 1 members are compressed; they will be inflated on "
                           "read, not viewed in place (re-save with fastckpt.save_npz for zero-copy reads)\n")


def test_counted_nouns():
    assert [plural(n, "tensor") for n in (0, 1, 2)] == ["0 tensors", "1 tensor", "2 tensors"]
    assert [plural(n, "copy") for n in (1, 2)] == ["1 copy", "2 copies"]
