"""A script that ends right after ``save(..., blocking=False)`` gets its checkpoint, or a non-zero exit and the error.

Each case runs a child interpreter whose last line starts a background save; the save is slowed down (a large model,
fsync on), so it is still in flight when the script's last line returns.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from fastckpt.train import load_checkpoint

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import numpy as np, sys, time
class Model:
    def __init__(self, value):
        self.w = np.full(24 << 20, value, np.float32)   # 96 MiB: still being written when the script ends
    def state_dict(self):
        return {"w": self.w}
    def load_state_dict(self, state):
        self.w = state["w"]
directory = sys.argv[1]
"""


def _run(body: str, directory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(directory)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_managers_save_in_flight_at_the_end_of_a_script_is_committed(tmp_path):
    done = _run("""
        from fastckpt.train import CheckpointManager
        manager = CheckpointManager(directory)
        manager.save(7, Model(3.0), blocking=False)
        print("script ended", flush=True)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "script ended\n"
    state = load_checkpoint(tmp_path / "step-00000007")
    assert state.manifest["step"] == 7
    assert np.array_equal(state.model_weights["w"], np.full(24 << 20, 3.0, np.float32))


def test_an_async_checkpointers_save_in_flight_at_the_end_of_a_script_is_committed(tmp_path):
    done = _run("""
        import os
        from fastckpt.train import AsyncCheckpointer
        AsyncCheckpointer().save(os.path.join(directory, "c"), Model(5.0), step=1)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(load_checkpoint(tmp_path / "c").model_weights["w"], np.full(24 << 20, 5.0, np.float32))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_save_in_flight_that_fails_at_exit_makes_the_process_fail_with_the_error(tmp_path):
    done = _run("""
        import resource, signal
        from fastckpt.train import CheckpointManager
        manager = CheckpointManager(directory)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        manager.save(7, Model(3.0), blocking=False)   # its tensor file cannot grow past 1 MiB: EFBIG
    """, tmp_path)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "still in flight when the program ended failed" in done.stderr
    assert "File too large" in done.stderr and "step-00000007" in done.stderr
    assert not (tmp_path / "step-00000007").exists()
    assert [n for n in os.listdir(tmp_path) if n.endswith(".partial")] == []
