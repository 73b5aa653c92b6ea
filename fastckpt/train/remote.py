"""Training checkpoints at a URL (``s3://bucket/run/step-10``, any fsspec URL): save, load, and the manager.

A checkpoint is built by the local writer in a temporary directory on this machine, byte for byte what
:func:`~fastckpt.train.checkpoint.save_checkpoint` writes locally, then uploaded by
:func:`fastckpt.formats.remote.put_directory`: the tensor files and ``extra.json`` in parallel, then
``manifest.json`` alone, last. The manifest is the commit marker: a prefix without one is an uncommitted save
(cut short by a crash or a dropped connection); :func:`load_checkpoint` refuses it,
:class:`RemoteCheckpointManager` does not count it, and its next save removes it. Loading downloads the
committed prefix into a temporary directory (files and 16 MiB ranges in parallel) and reads it there, hashes
checked as for a local checkpoint.

``fastckpt.train.save_checkpoint``, ``load_checkpoint`` and ``CheckpointManager`` come here for a URL.

>>> from fastckpt.train import TinyLM, CheckpointManager
>>> model = TinyLM(vocab=8, dim=4, hidden=8)
>>> mgr = CheckpointManager("memory://doc/train-run", max_to_keep=2)
>>> for step in (10, 20, 30):
...     _ = mgr.save(step, model)
>>> mgr.all_steps(), mgr.latest()
([20, 30], 'memory://doc/train-run/step-00000030')
>>> mgr.restore_latest(TinyLM(vocab=8, dim=4, hidden=8)).step
30
"""

from __future__ import annotations

from fastckpt.train.checkpoint import load_checkpoint_from_url as load_checkpoint
from fastckpt.train.checkpoint import write_snapshot_to_url as write_snapshot
from fastckpt.train.manager import RemoteCheckpointManager

__all__ = ["write_snapshot", "load_checkpoint", "RemoteCheckpointManager"]
