"""TorchDistributedEngine with real processes: torch.multiprocessing.spawn, CPU, gloo (tests/_torch_ranks.py).

Skipped without torch (it is not in the test extra: PyPI's torch is the CUDA build, several GB; install the CPU
wheel to run these, e.g. ``pip install torch --index-url https://download.pytorch.org/whl/cpu``). Each process
imports torch (seconds each on a small machine), so all but one case are ``slow``: ``-m slow`` runs them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import _torch_ranks  # noqa: E402
from fastckpt.sharded import CheckpointReader  # noqa: E402


def _spawn(fn, size, *args, tmp_path):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    store = str(tmp_path / "store")
    mp.spawn(fn, args=(size, store, *args, str(out)), nprocs=size, join=True)
    return [json.loads((out / f"rank-{r}.json").read_text()) if (out / f"rank-{r}.json").exists() else None
            for r in range(size)]


@pytest.mark.parametrize("size,layout", [pytest.param(2, "fastckpt", marks=pytest.mark.slow), (2, "recis"),
                                         pytest.param(4, "recis", marks=pytest.mark.slow),
                                         pytest.param(3, "fastckpt", marks=pytest.mark.slow)])
def test_ranks_save_and_load_through_the_default_engine(tmp_path, size, layout):
    path = str(tmp_path / "ckpt")
    results = _spawn(_torch_ranks.save_and_load, size, path, layout, tmp_path=tmp_path)
    ids, values, _ = _torch_ranks._tables(0, size, 0)
    assert {r["engine"] for r in results} == {"TorchDistributedEngine"}  # default_engine picked it
    got = np.concatenate([np.array(r["ids"], np.int64) for r in results])
    assert sorted(got.tolist()) == sorted(ids.tolist())
    row = {int(i): k for k, i in enumerate(ids)}
    for r in results:
        assert np.array_equal(np.array(r["values"], np.float32).reshape(-1, 4), values[[row[i] for i in r["ids"]]])
        assert r["w"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
        assert r["broadcast"] == {"from": 0}
    assert results[0]["gathered"] == [sorted(r["ids"]) for r in results] and results[1]["gathered"] is None
    with CheckpointReader(path, verify=True) as reader:
        assert reader.layout == ("RecIS" if layout == "recis" else "fastckpt")


@pytest.mark.slow  # three processes that each import torch, two saves, a 3 s timeout: ~20 s here
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    size, victim = 3, 2
    results = _spawn(_torch_ranks.killed_mid_save, size, path, victim, tmp_path=tmp_path)
    assert results[0]["error"] == "BarrierTimeoutError" and results[0]["missing"] == [victim]
    assert "rank 2 of 3 did not reach the gather to rank 0" in results[0]["message"]
    assert results[1]["error"] == "BarrierTimeoutError" and results[1]["missing"] == [victim]
    assert results[victim] is None  # it died before reporting
    ids, _, _ = _torch_ranks._tables(0, size, 1)
    with CheckpointReader(path, verify=True) as reader:  # the first save, whole and unchanged
        assert sorted(reader.read_tensor("emb.id").tolist()) == sorted(ids.tolist())
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


@pytest.mark.slow
def test_a_missing_rank_is_named(tmp_path):
    results = _spawn(_torch_ranks.barrier_missing, 3, tmp_path=tmp_path)
    for r in results[:2]:
        assert r["error"] == "BarrierTimeoutError" and r["missing"] == [2], r
    assert "rank 2 of 3 did not reach 'first' within 1 s" in results[0]["message"]


def test_one_rank_group_in_this_process(tmp_path):
    """A group of one: the engine answers at once with the JSON round trip; default_engine refuses a rank count
    the group does not have, naming torch.distributed."""
    import torch.distributed as dist

    from fastckpt.sharded.engine import EngineError, default_engine
    from fastckpt.sharded.engine import TorchDistributedEngine

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        engine = TorchDistributedEngine()
        engine.barrier("one", timeout=5)
        assert engine.broadcast({"shape": (2, 3)}, timeout=5) == {"shape": [2, 3]}
        assert engine.gather("x", timeout=5) == ["x"]
        with pytest.raises(TypeError, match="JSON only"):
            engine.gather(object(), timeout=5)
        with pytest.raises(EngineError, match="rank 0 of 1 of torch.distributed's default group"):
            default_engine(0, 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_out_of_step_calls_and_an_abort(tmp_path):
    first, second = _spawn(_torch_ranks.out_of_step_then_abort, 2, tmp_path=tmp_path)
    for r in (first, second):
        assert r["first"][0] == "EngineError" and "out of step" in r["first"][1]
    name, message, missing, waited = first["second"]
    assert (name, missing) == ("BarrierTimeoutError", [1]) and "aborted" in message and "disk full" in message
    assert waited < 30  # told at once, not after its 60 s timeout


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["recis", "fastckpt"])
def test_a_torchrun_job_saves_and_loads(tmp_path, layout):
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    out = str(tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           os.path.join(here, "_torchrun_job.py"), out, layout], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"ckpt.rank{r}.json").read_text()) for r in range(3)]
    assert {r["engine"] for r in ranks} == {"TorchDistributedEngine"}
    assert sorted(i for r in ranks for i in r["ids"]) == [i * 193 for i in range(1000)]
    assert all(r["ids"] for r in ranks)  # every rank holds a share
    with CheckpointReader(out, verify=True) as reader:
        assert reader.layout == ("RecIS" if layout == "recis" else "fastckpt")
