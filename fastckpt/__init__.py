"""fastckpt: fast, exact checkpoints. Which call do I want? docs/which-call.md: one row per task.

The usual calls, all directly under ``fastckpt``: ``open(path)`` reads any tensor file (safetensors, NPZ,
``.netcl``, TensorFlow checkpoint, HF sharded or training-checkpoint directory) with one contract;
``save_safetensors``, ``save_npz``, ``save_sharded`` and ``save_tree`` (pytrees) write atomically;
``load_file(path, queue, pool=...)`` loads into OpenCL device memory; ``load_torch(path)`` gives a
PyTorch state_dict to train (``to_torch`` converts what was read); ``CheckpointManager(directory)``
keeps training checkpoints. The commands: ``python -m fastckpt --help``.

>>> import fastckpt, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> fastckpt.save_safetensors(path, {"w": np.arange(4, dtype=np.float32)})
>>> with fastckpt.open(path) as f:
...     f.host("w").tolist()
[0.0, 1.0, 2.0, 3.0]

Below are only these entry points (``__all__``). Everything else keeps its full API in its module, and the
names users reach for are attributes here too:

* errors (``fastckpt.FormatError``, ``FastCkptError``, ...): ``fastckpt.errors``
* what ``open`` returns (``TensorFile``, ``TensorInfo``, ``TensorReader``, ``register_opener``):
  ``fastckpt.formats.reader``, ``fastckpt.info``, ``fastckpt.formats.contract``
* formats: ``fastckpt.formats.safetensors``, ``.npz`` (``NpzWriter``), ``.hfsharded``, ``.tree``, ``.tf``
* device memory (``PersistentBufferPool``, ``Tensor``, ``LoadedTensors``): ``fastckpt.device``
* training checkpoints: ``fastckpt.train``; sharded embedding tables (RecIS): ``fastckpt.sharded``
* arrays from any framework, packed fp4/fp6 (``PackedArray``): ``fastckpt.arrays``
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from fastckpt.errors import (  # `X as X`: re-exported for type checkers, though not in __all__
    BarrierTimeoutError as BarrierTimeoutError,
    BrokenChainError as BrokenChainError,
    CheckpointChangedError as CheckpointChangedError,
    CheckpointKeyError as CheckpointKeyError,
    CheckpointNotFoundError as CheckpointNotFoundError,
    ChecksumMismatchError as ChecksumMismatchError,
    DestinationError as DestinationError,
    EngineError as EngineError,
    FastCkptError as FastCkptError,
    FastCkptWarning as FastCkptWarning,
    FormatError as FormatError,
    IntegrityError as IntegrityError,
    MissingIdsError as MissingIdsError,
    NotZeroCopyWarning as NotZeroCopyWarning,
    RestoreMismatchError as RestoreMismatchError,
    TensorNotFoundError as TensorNotFoundError,
)

__version__ = "0.10.0"

# Heavy modules (pyopencl above all) are imported only when first used: the names of _LAZY below.

# Silent unless the application configures logging: records of every load and save go to the
# "fastckpt" logger's children (INFO: one per file or checkpoint; DEBUG: the details).
logging.getLogger("fastckpt").addHandler(logging.NullHandler())

# name -> module that defines it; resolved on first access (PEP 562).
_LAZY = {
    "open": "fastckpt.formats.reader",
    "register_opener": "fastckpt.formats.reader",
    "TensorFile": "fastckpt.formats.reader",
    "CheckpointDirectory": "fastckpt.train.directory",
    "TensorReader": "fastckpt.formats.contract",
    "TensorInfo": "fastckpt.info",
    "MappedFile": "fastckpt._native.mapped",
    "save_npz": "fastckpt.formats.npz",
    "NpzWriter": "fastckpt.formats.npz",
    "save_safetensors": "fastckpt.formats.safetensors",
    "save_sharded": "fastckpt.formats.hfsharded",
    "save_tree": "fastckpt.formats.tree",
    "load_tree": "fastckpt.formats.tree",
    "save_bytes": "fastckpt.formats.inmemory",
    "load_bytes": "fastckpt.formats.inmemory",
    "HFShardedDirectory": "fastckpt.formats.hfsharded",
    "load_file": "fastckpt.device.load",
    "LoadedTensors": "fastckpt.device.load",
    "PersistentBufferPool": "fastckpt.device.pool",
    "Tensor": "fastckpt.device.tensor",
    "CheckpointManager": "fastckpt.train.manager",
    "to_torch": "fastckpt.arrays",
    "load_torch": "fastckpt.formats.torchload",
}

if TYPE_CHECKING:  # the lazy names above as type checkers see them (`X as X`: re-exported)
    from fastckpt._native.mapped import MappedFile as MappedFile
    from fastckpt.arrays import to_torch as to_torch
    from fastckpt.device.load import LoadedTensors as LoadedTensors, load_file as load_file
    from fastckpt.device.pool import PersistentBufferPool as PersistentBufferPool
    from fastckpt.device.tensor import Tensor as Tensor
    from fastckpt.formats.contract import TensorReader as TensorReader
    from fastckpt.formats.hfsharded import HFShardedDirectory as HFShardedDirectory, save_sharded as save_sharded
    from fastckpt.formats.inmemory import load_bytes as load_bytes, save_bytes as save_bytes
    from fastckpt.formats.npz import NpzWriter as NpzWriter, save_npz as save_npz
    from fastckpt.formats.reader import TensorFile as TensorFile, open as open, register_opener as register_opener  # noqa: A004
    from fastckpt.formats.safetensors import save_safetensors as save_safetensors
    from fastckpt.formats.torchload import load_torch as load_torch
    from fastckpt.formats.tree import load_tree as load_tree, save_tree as save_tree
    from fastckpt.info import TensorInfo as TensorInfo
    from fastckpt.train.directory import CheckpointDirectory as CheckpointDirectory
    from fastckpt.train.manager import CheckpointManager as CheckpointManager

# The entry points: what ``from fastckpt import *`` binds and ``help(fastckpt)`` documents. Every other name
# above (the exceptions, _LAZY's classes) stays an attribute of the package, documented in its module.
__all__ = [
    "open",
    "load_file",
    "load_torch",
    "to_torch",
    "save_safetensors",
    "save_npz",
    "save_sharded",
    "save_tree",
    "load_tree",
    "save_bytes",
    "load_bytes",
    "CheckpointManager",
]

# dir(fastckpt): the entry points, the exceptions (imported already, so listing them costs nothing) and the
# module's own dunder names (__version__ among them); not the other lazy names, which would import pyopencl for a tab completion or help().
_DIR = sorted({*__all__, *(name for name, value in globals().items()
                           if name.startswith("__") or isinstance(value, type) and issubclass(value, Warning | Exception))})


def __getattr__(name: str):
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return list(_DIR)
