"""File hashes in a forked child: BLAKE3's threads do not survive fork(), and a child forked after the parent hashed on
them hashes on one thread instead of waiting forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The parent hashes on every core (starting BLAKE3's thread pool), saves and verifies a sharded checkpoint, then
# forks; the child hashes again each way fastckpt does: new_hasher, blake3_file, a sharded reader's file check and a
# verified load. Before, the child hung in its first multi-threaded hash.
_CHILD = r"""
import faulthandler, os, sys, tempfile
faulthandler.dump_traceback_later(50, exit=True)
import numpy as np
from fastckpt.formats.hashing import blake3_file, new_hasher
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver

data = np.arange(4 << 20, dtype=np.uint32).tobytes()  # 16 MiB: hashed on several threads
h = new_hasher("blake3"); h.update(data); expected = h.hexdigest()
root = tempfile.mkdtemp()
path = os.path.join(root, "blob"); open(path, "wb").write(data)
table = HashTable(4, np.float32)
table.insert(np.arange(1000), np.ones((1000, 4), np.float32))
out = Saver(path=os.path.join(root, "c"), parallel=1, hashtables={"t": table}, tensors={"w": np.ones(8)}).save()
Loader(out).load()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(40)  # faulthandler's watchdog thread is not forked: SIGALRM ends a hung child
    try:
        h = new_hasher("blake3"); h.update(data)
        assert h.hexdigest() == expected
        assert blake3_file(path) == (expected, len(data))
        with CheckpointReader(out) as reader:
            assert all(reader.file_problem(name) is None for name in reader.files)
        tables, tensors = Loader(out).load()
        assert len(tables["t"]) == 1000 and tensors["w"].tolist() == [1.0] * 8
    except BaseException as exc:
        print("child:", repr(exc), flush=True)
        os._exit(1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork() only")
def test_a_child_forked_after_the_parent_hashed_on_threads_still_hashes():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "child exit 0", out.stdout + out.stderr
