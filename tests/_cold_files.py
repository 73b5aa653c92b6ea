"""Files for the tests of how a cold file is read ahead (tests/test_readinto.py, tests/test_bench_cold.py)."""

import numpy as np

import fastckpt


def eight_tensors(tmp_path, source: str) -> tuple[dict, str]:
    """``(tensors, path)``: 8 float32 tensors of 2 MiB written as one safetensors file (``source`` "file") or as a
    Hugging Face directory of 4 shards of 2 tensors ("hf")."""
    tensors = {f"w{i}": np.full(1 << 19, i, np.float32) for i in range(8)}
    path = str(tmp_path / "m.safetensors") if source == "file" else str(tmp_path / "hf")
    if source == "file":
        fastckpt.save_safetensors(path, tensors)
    else:
        fastckpt.save_sharded(path, tensors, max_shard_size=(4 << 20) + 1)
    return tensors, path
