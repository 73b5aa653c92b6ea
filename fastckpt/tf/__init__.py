"""TensorFlow v2 checkpoints (tensor bundles) without TensorFlow: read, write, name, convert.

- :class:`CheckpointReader`: zero-copy, checksum-verified reads of any
  TensorFlow 1.x/2.x bundle (``.index`` + ``.data-*`` shards).
- :func:`write_checkpoint` / :class:`CheckpointWriter` / :func:`save`: files
  that ``tf.train.load_checkpoint`` reads and, with ``object_graph=True``,
  ``tf.train.Checkpoint.restore`` restores.
- :func:`save_object` / :func:`restore_object`: the Checkpointable protocol,
  naming an object's arrays by their attribute paths.
- :func:`describe` / :func:`is_tf_checkpoint`: what ``fastckpt inspect`` shows.

The byte layout is specified in :mod:`fastckpt.formats.tf.format`.

>>> import numpy as np, tempfile, os
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> write_checkpoint(prefix, {"w": np.arange(3, dtype=np.float32)})
>>> with CheckpointReader(prefix) as r:
...     r["w"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

from fastckpt.errors import ChecksumMismatchError, RestoreMismatchError  # defined with the others, re-exported here
from fastckpt.formats.tf.describe import describe, is_tf_checkpoint
from fastckpt.formats.tf.reader import CheckpointReader, TFTensorInfo, latest_checkpoint, resolve_prefix
from fastckpt.formats.tf.writer import CheckpointWriter, escape_local_name, object_key, save, write_checkpoint
from fastckpt.tf.checkpointable import (
    Checkpointable,
    RestoreResult,
    checkpoint_tensors,
    identity_map,
    lookup_map,
    restore_object,
    save_object,
)

__all__ = [
    "CheckpointReader",
    "TFTensorInfo",
    "CheckpointWriter",
    "write_checkpoint",
    "save",
    "latest_checkpoint",
    "resolve_prefix",
    "escape_local_name",
    "object_key",
    "Checkpointable",
    "RestoreResult",
    "checkpoint_tensors",
    "save_object",
    "restore_object",
    "identity_map",
    "lookup_map",
    "describe",
    "is_tf_checkpoint",
    "ChecksumMismatchError",
    "RestoreMismatchError",
]
