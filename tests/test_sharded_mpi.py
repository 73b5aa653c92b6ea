"""Sharded saves by real MPI jobs (``mpiexec -n N``, MPICH from PyPI), loaded on M ranks; a rank killed mid-save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec

import numpy as np
import pytest

from fastckpt.sharded import CheckpointReader, HashTable, Loader
from fastckpt.sharded.format import SLICE_SIZE, slice_of, slice_positions

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

# What every rank holds: executed by the ranks and by the test (to know what to expect).
STATE = r'''
import numpy as np
from fastckpt.sharded import HashTable

def rank_state(rank, n):
    ids = np.unique(np.concatenate([np.arange(-40, 40) * 7919, [2**62, -(2**62)]]).astype(np.int64))
    mine = ids[np.mod(ids, n) == rank]
    table = HashTable(4, slots=("m",))
    values = (mine % 1009).astype(np.float32)[:, None] + np.arange(4, dtype=np.float32)
    table.insert(mine, values, {"m": -values})
    dense = {"w": np.arange(60, dtype=np.float32).reshape(15, 4), "step": np.array(7, np.int64)}
    return {"emb": table}, dense
'''

RANK_SCRIPT = STATE + r'''
import os, signal, sys
from mpi4py import MPI
from fastckpt.sharded import Saver

path, scenario = sys.argv[1], sys.argv[2]
rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
tables, dense = rank_state(rank, n)

def die_on_rank_1(blocks):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: rank 0 has made the staging directory
    return blocks

kwargs = {"filter_func": die_on_rank_1, "timeout": 5.0} if scenario == "kill" else {"timeout": 60.0}
Saver(shard_index=rank, shard_num=n, parallel=2, path=path, hashtables=tables, tensors=dense, **kwargs).save()
'''


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory):
    if find_spec("mpi4py") is None:
        pytest.skip('mpi4py is not installed (pip install "fastckpt[mpi]")')
    if not os.path.exists(MPIEXEC):
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install \"fastckpt[mpi]\" installs MPICH's)")
    probe = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-c", "from mpi4py import MPI"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"{MPIEXEC} cannot start a rank here: {(probe.stdout + probe.stderr).strip()[-500:]}")
    script = tmp_path_factory.mktemp("mpi") / "save.py"
    script.write_text(RANK_SCRIPT)

    def run(n: int, path, scenario: str = "save") -> subprocess.CompletedProcess:
        return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script), str(path), scenario],
                              capture_output=True, text=True, timeout=120)

    return run


def expected(n: int):
    scope: dict = {}
    exec(STATE, scope)  # noqa: S102 - the ranks' own definition of their state
    parts = [scope["rank_state"](r, n) for r in range(n)]
    ids = np.concatenate([p[0]["emb"].export()[0] for p in parts])
    values = np.concatenate([p[0]["emb"].export()[1] for p in parts])
    order = np.argsort(ids)
    return ids[order], values[order], parts[0][1]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_an_mpi_job_of_n_ranks_saves_one_checkpoint_that_loads_on_m(tmp_path, run_ranks, n):
    job = run_ranks(n, tmp_path / "ckpt")
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with CheckpointReader(tmp_path / "ckpt", verify=True) as r:
        assert r.manifest["world_size"] == n and len(r.manifest["files"]) == n * 2 + 3
    ids, values, dense = expected(n)
    for m in (1, 3):
        got_ids, got_values = [], []
        for j in range(m):
            tables, tensors = {"emb": HashTable(4, slots=("m",))}, {}
            Loader(str(tmp_path / "ckpt"), hashtables=tables, tensors=tensors, shard_index=j, shard_num=m).load()
            i, v, s = tables["emb"].export()
            begin, end = slice_of(j, m)  # the default rule of format version 4: the rank's key-space slices
            assert np.all((slice_positions(i, SLICE_SIZE) >= begin) & (slice_positions(i, SLICE_SIZE) < end))
            assert s["m"].tobytes() == (-v).tobytes()
            got_ids.append(i)
            got_values.append(v)
            assert all(tensors[k].tobytes() == dense[k].tobytes() for k in dense)
        order = np.argsort(np.concatenate(got_ids))
        assert np.concatenate(got_ids)[order].tobytes() == ids.tobytes()
        assert np.concatenate(got_values)[order].tobytes() == values.tobytes()


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path, run_ranks):
    assert run_ranks(3, tmp_path / "step-1").returncode == 0
    killed = run_ranks(3, tmp_path / "step-2", "kill")
    assert killed.returncode != 0
    left = sorted(os.listdir(tmp_path))
    assert "step-2" not in left  # no checkpoint appeared
    with CheckpointReader(tmp_path / "step-1", verify=True) as r:  # the previous one is intact
        assert r.read_tensor("w").shape == (15, 4)
    job = run_ranks(3, tmp_path / "step-2")
    assert job.returncode == 0, job.stdout + job.stderr
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]  # the leftovers of the killed save are gone
    assert json.loads((tmp_path / "step-2" / "manifest.json").read_text())["world_size"] == 3


LOAD_SCRIPT = r'''
import json, os, sys
from mpi4py import MPI
import fastckpt.sharded.reader as reader_module
from fastckpt.sharded import Loader

mapped = []
real = reader_module.open_file

def counting(path, **options):
    mapped.append(os.path.basename(path))
    return real(path, **options)

reader_module.open_file = counting
comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
tables, tensors = Loader(sys.argv[1], shard_index=rank, shard_num=n, dense="rows").load()
ids, values, _ = tables["emb"].export()
rows = comm.gather({"mapped": mapped, "ids": ids.tolist(), "values": values.tolist(), "w": tensors["w"].tolist()})
if rank == 0:
    print(json.dumps(rows))
'''


@pytest.mark.parametrize("n", [2, 4])
def test_each_mpi_rank_maps_only_the_files_it_reads(tmp_path, run_ranks, n):
    """Until 0.7 every rank (every process) mapped and parsed every tensor file of the checkpoint when it opened:
    here each rank of a job whose tables hold their own key-space slices maps only its own files, once each."""
    from _sharded_edit import save_threads

    from fastckpt.sharded.format import group_rows, rows_of, slice_owner

    # enough ids that each part has a multiple of n slice groups (GROUP_ROWS rows a group), whose bounds then
    # fall on the ranks' slice bounds: a rank reads its own parts alone
    ids = np.unique(np.concatenate([np.arange(-1800, 1800) * 104729, [2**62, -(2**62)]]).astype(np.int64))
    tables = []
    for r in range(n):
        mine = ids[slice_owner(ids, n) == r]
        t = HashTable(4, slots=("m",))
        t.insert(mine, (mine % 1009).astype(np.float32)[:, None] + np.arange(4, dtype=np.float32), {"m": -np.ones(
            (len(mine), 4), np.float32)})
        tables.append({"emb": t})
    w = np.arange(64, dtype=np.float32).reshape(16, 4)
    path = save_threads(tmp_path / "ckpt", tables, {"w": w}, parallel=3)
    with CheckpointReader(path, verify=False) as r:
        # What rank j reads: the parts of the ranks whose dense rows meet its rows, or whose id part has rows in a
        # slice group that meets its slice (the groups the part's description records)
        def reads(j: int) -> set[int]:
            return {i for i in range(n) if i == j or group_rows(
                r.descriptions[f"emb.id/part_{i}_{n}"]["slices"]["rows"], SLICE_SIZE, j, n)[1] > group_rows(
                r.descriptions[f"emb.id/part_{i}_{n}"]["slices"]["rows"], SLICE_SIZE, j, n)[0]}

        own = [sorted({os.path.basename(r.file_of(k).path) for k in r.part_infos for i in reads(j)
                       if k.endswith(f"/part_{i}_{n}")})
               for j in range(n)]
    assert all(len(files) < n * 3 for files in own)  # (on 0.7 each rank mapped all n * 3)
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    run_ranks(1, tmp_path / "probe")  # (the fixture's probe: mpiexec and mpi4py work here)
    job = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script), path], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = json.loads(job.stdout.strip().splitlines()[-1])
    for r, got in enumerate(ranks):
        assert sorted(got["mapped"]) == own[r]  # its own files, each once, and no other
        assert sorted(got["ids"]) == sorted(ids[slice_owner(ids, n) == r].tolist())
        assert got["w"] == w[slice(*rows_of(r, n, 16))].tolist()
