"""fastckpt: fast, exact checkpoints.

Zero-copy readers for NPZ, safetensors and TensorFlow checkpoints behind one
contract (``fastckpt.open`` opens any of them, and training-checkpoint
directories; :class:`fastckpt.formats.contract.TensorReader`), aligned and atomic
writers, and one-copy loads of whole files into OpenCL device memory.

>>> import fastckpt, numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> fastckpt.save_safetensors(path, {"w": np.arange(4, dtype=np.float32)})
>>> with fastckpt.open(path) as f:
...     f.host("w").tolist()
[0.0, 1.0, 2.0, 3.0]

Heavy modules (pyopencl above all) are imported only when first used.
"""

from __future__ import annotations

import importlib
import logging

from fastckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    DestinationError,
    FastCkptError,
    FastCkptWarning,
    FormatError,
    IntegrityError,
    NotZeroCopyWarning,
    RestoreMismatchError,
    TensorNotFoundError,
)

__version__ = "0.2.0"

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
    "save_bytes": "fastckpt.formats.inmemory",
    "load_bytes": "fastckpt.formats.inmemory",
    "HFShardedDirectory": "fastckpt.formats.hfsharded",
    "load_file": "fastckpt.device.load",
    "LoadedTensors": "fastckpt.device.load",
    "PersistentBufferPool": "fastckpt.device.pool",
    "Tensor": "fastckpt.device.tensor",
    "CheckpointManager": "fastckpt.train.manager",
    "to_torch": "fastckpt.arrays",
}

__all__ = [
    "FastCkptError",
    "FormatError",
    "IntegrityError",
    "ChecksumMismatchError",
    "RestoreMismatchError",
    "TensorNotFoundError",
    "CheckpointNotFoundError",
    "DestinationError",
    "FastCkptWarning",
    "NotZeroCopyWarning",
    *_LAZY,
]


def __getattr__(name: str):
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
