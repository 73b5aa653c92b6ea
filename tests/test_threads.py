"""Kept thread pools in a forked child: the child has none of its parent's threads, so each pool is made again there;
a pool made before the fork would have waited for them forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastckpt.threads import kept_pool

_CHILD = r"""
import os, signal, tempfile, time
import numpy as np
from fastckpt.formats.readinto import read_into
from fastckpt.threads import kept_pool

pool = kept_pool("example", 2)
for f in [pool.submit(time.sleep, 0.02) for _ in range(4)]:  # both of its threads started, then idle
    f.result()
path = os.path.join(tempfile.mkdtemp(), "data")
data = np.arange(1 << 20, dtype=np.uint32)
data.tofile(path)
fd = os.open(path, os.O_RDONLY)
out = np.empty_like(data)
read_into(fd, [(out, 0)], path, threads=4, piece=1 << 20)  # the read threads started
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a child waiting for its parent's threads ends
    ok = kept_pool("example", 2).submit(pow, 2, 10).result() == 1024
    again = np.empty_like(data)
    read_into(fd, [(again, 0)], path, threads=4, piece=1 << 20)
    os._exit(0 if ok and np.array_equal(again, data) else 1)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_one_pool_per_name_and_size_kept():
    assert kept_pool("t-kept", 2) is kept_pool("t-kept", 2) is not kept_pool("t-kept", 3)
    assert kept_pool("t-kept", 3).submit(sum, [1, 2]).result() == 3


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork() only")
def test_a_forked_child_makes_its_own_threads():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "child exit 0", out.stdout + out.stderr
