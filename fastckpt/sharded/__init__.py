"""Sharded checkpoints: many ranks save one checkpoint in parallel, any number of ranks load it.

The API of RecIS's serializer:

* :class:`Saver` - ``Saver(shard_index, shard_num, parallel, path, hashtables, tensors, filter_func).save()``;
* :class:`Loader` - ``Loader(checkpoint_path, hashtables, tensors, parallel, filter_func).load()``, resharding
  a checkpoint of N ranks onto M;
* :class:`CheckpointReader` - ``tensor_names()``, ``tensor_shape(name)``, ``tensor_dtype(name)``,
  ``read_tensor(name)``;
* :class:`HashTable` - a sparse table id -> row, with optimizer slots that follow their ids;
* :func:`split_sparse_dense_state_dict`;
* incremental checkpoints: ``Saver(..., incremental=True)`` (or a :class:`DeltaPolicy`) writes only what
  changed since the tables' last checkpoint; :mod:`fastckpt.sharded.chain` follows, folds and prunes chains.

The directory layout is specified in :mod:`fastckpt.sharded.format`; ranks are coordinated by an engine of
:mod:`fastckpt.sharded.engine` (MPI through mpi4py, ``torch.distributed`` under ``torchrun``, threads, or none
for one rank). RecIS's own directory layout (what RecIS's serializer writes and reads) is
read by the same classes and written by ``Saver(..., layout="recis")``: :mod:`fastckpt.sharded.recis`.

>>> import numpy as np, tempfile, os
>>> from fastckpt.sharded import CheckpointReader, HashTable, Saver
>>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> _ = Saver(path=out, parallel=1, tensors={"w": np.ones((2, 2), np.float32)}).save()
>>> CheckpointReader(out).read_tensor("w").sum()
np.float32(4.0)
"""

from fastckpt.sharded.hashtable import HashTable
from fastckpt.sharded.loader import Loader
from fastckpt.sharded.reader import CheckpointReader
from fastckpt.sharded.recis import RecisCheckpointReader  # importing it registers RecIS's layout with CheckpointReader
from fastckpt.sharded.saver import DeltaPolicy, Saver, WriteBlock, split_sparse_dense_state_dict

__all__ = ["Saver", "Loader", "CheckpointReader", "RecisCheckpointReader", "HashTable", "WriteBlock", "DeltaPolicy",
           "split_sparse_dense_state_dict"]
