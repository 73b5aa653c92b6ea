"""What each process of the torch.distributed tests runs (tests/test_torch_engine.py): module-level functions,
so that torch.multiprocessing.spawn can start them. Each rank writes what it saw to ``out/rank-R.json``."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import numpy as np


def _init(rank: int, size: int, store: str) -> None:
    # A FileStore: it outlives any one rank, so a rank that dies (or finishes first) takes nothing with it.
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))


def _tables(rank: int, size: int, seed: int):
    from fastckpt.sharded import HashTable
    from fastckpt.sharded.recis import slice_owner

    rng = np.random.default_rng(seed)
    ids = rng.choice(10**6, 400, replace=False).astype(np.int64)
    values = rng.standard_normal((400, 4)).astype(np.float32)
    mine = np.flatnonzero(slice_owner(ids, size) == rank)  # RecIS's routing: valid for both layouts
    table = HashTable(4, name="emb")
    table.insert(ids[mine], values[mine])
    return ids, values, table


def _report(out: str, rank: int, result: dict) -> None:
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)


def save_and_load(rank: int, size: int, store: str, path: str, layout: str, out: str) -> None:
    """Every rank saves its share through the default engine (torch's), then loads its share back."""
    _init(rank, size, store)
    import torch.distributed as dist

    from fastckpt.sharded import Loader, Saver
    from fastckpt.sharded.engine import default_engine

    _, _, table = _tables(rank, size, 0)
    engine = default_engine(rank, size)
    Saver(rank, size, 2, path, hashtables={"emb": table}, tensors={"w": np.arange(6.0).reshape(3, 2)},
          layout=layout, timeout=60).save()
    engine.barrier("saved", timeout=60)
    tables, tensors = Loader(path, shard_index=rank, shard_num=size).load()
    gathered = engine.gather(sorted(tables["emb"].ids().tolist()), root=0, timeout=60)
    value = engine.broadcast({"from": rank} if rank == 0 else None, root=0, timeout=60)
    _report(out, rank, {"engine": type(engine).__name__, "ids": tables["emb"].ids().tolist(),
                        "values": tables["emb"].lookup(tables["emb"].ids()).tolist(), "w": tensors["w"].tolist(),
                        "gathered": gathered, "broadcast": value})
    dist.destroy_process_group()


def killed_mid_save(rank: int, size: int, store: str, path: str, victim: int, out: str) -> None:
    """A first save commits; in a second one (overwrite=True) rank ``victim`` dies after the save began."""
    _init(rank, size, store)
    from fastckpt.sharded import Saver

    _, _, table = _tables(rank, size, 1)
    Saver(rank, size, 2, path, hashtables={"emb": table}, timeout=30).save()

    def die(blocks):
        if rank == victim:
            os._exit(0)  # no exception, no abort: the process is simply gone
        return blocks

    table.insert([rank * 1000 + 1], np.zeros((1, 4), np.float32))  # the second save would store this row
    result = {}
    try:
        Saver(rank, size, 2, path, hashtables={"emb": table}, filter_func=die, overwrite=True, timeout=3).save()
        result["saved"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": type(exc).__name__, "message": str(exc), "missing": list(getattr(exc, "missing", ()))}
    _report(out, rank, result)
    os._exit(0)  # the group cannot be torn down cleanly without the victim


def barrier_missing(rank: int, size: int, store: str, out: str) -> None:
    """The last rank skips a barrier: the others' errors name it."""
    _init(rank, size, store)
    from fastckpt.sharded.engine import TorchDistributedEngine

    engine = TorchDistributedEngine()
    result = {}
    if rank != size - 1:
        try:
            engine.barrier("first", timeout=1.0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"error": type(exc).__name__, "message": str(exc), "missing": list(exc.missing)}
    else:
        engine._shared[0] += 1  # it skips call 0
    _report(out, rank, result)
    os._exit(0)


def out_of_step_then_abort(rank: int, size: int, store: str, out: str) -> None:
    """Rank 0 and rank 1 make different calls (both raise EngineError); then rank 1 aborts while rank 0 waits."""
    import time

    _init(rank, size, store)
    from fastckpt.sharded.engine import TorchDistributedEngine

    engine = TorchDistributedEngine()
    result = {}
    try:
        engine.barrier("a" if rank == 0 else "b", timeout=20)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["first"] = [type(exc).__name__, str(exc)]
    if rank == 1:
        engine.abort("disk full")
    else:
        started = time.monotonic()
        try:
            engine.barrier("c", timeout=60)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result["second"] = [type(exc).__name__, str(exc), list(exc.missing), time.monotonic() - started]
    _report(out, rank, result)
    os._exit(0)
