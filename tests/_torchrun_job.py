"""One rank of a real ``torchrun`` job (tests/test_torch_engine.py starts it): save through the default engine in
the layout of argv[2] to argv[1], load this rank's share back, write its ids to argv[1].rank<R>.json."""

import json
import sys

import numpy as np
import torch.distributed as dist

from fastckpt.sharded import HashTable, Loader, Saver
from fastckpt.sharded.engine import default_engine
from fastckpt.sharded.recis import slice_owner

dist.init_process_group("gloo")  # torchrun's environment: rank, world size, its store
rank, size = dist.get_rank(), dist.get_world_size()
ids = np.arange(1000, dtype=np.int64) * 193  # spread over RecIS's key space
mine = ids[slice_owner(ids, size) == rank]
table = HashTable(2)
table.insert(mine, np.ones((len(mine), 2), np.float32) * mine[:, None])
out, layout = sys.argv[1], sys.argv[2]
Saver(rank, size, 2, out, hashtables={"t": table}, tensors={"w": np.eye(2)}, layout=layout).save()
tables, tensors = Loader(out, shard_index=rank, shard_num=size).load()
got = tables["t"].ids()
assert np.array_equal(tables["t"].lookup(got)[:, 0], got.astype(np.float32)) and np.array_equal(tensors["w"], np.eye(2))
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"engine": type(default_engine(rank, size)).__name__, "ids": sorted(got.tolist())}, f)
dist.destroy_process_group()
