"""fastckpt: fast, exact checkpoints.

Zero-copy readers for NPZ, safetensors and TensorFlow checkpoints behind one
contract (``fastckpt.open`` opens any of them, and training-checkpoint
directories; :class:`fastckpt.contract.TensorReader`), aligned and atomic
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

from fastckpt.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    FastCkptError,
    FastCkptWarning,
    FormatError,
    IntegrityError,
    NotZeroCopyWarning,
    RestoreMismatchError,
    TensorNotFoundError,
)

__version__ = "0.1.0"

# name -> module that defines it; resolved on first access (PEP 562).
_LAZY = {
    "open": "fastckpt.reader",
    "register_opener": "fastckpt.reader",
    "TensorFile": "fastckpt.reader",
    "CheckpointDirectory": "fastckpt.reader",
    "TensorReader": "fastckpt.contract",
    "TensorInfo": "fastckpt._info",
    "MappedFile": "fastckpt._mapped",
    "save_npz": "fastckpt.npz",
    "NpzWriter": "fastckpt.npz",
    "save_safetensors": "fastckpt.safetensors",
    "load_file": "fastckpt.load",
    "LoadedTensors": "fastckpt.load",
    "PersistentBufferPool": "fastckpt.pool",
    "Tensor": "fastckpt.tensor",
    "CheckpointManager": "fastckpt.train.manager",
}

__all__ = [
    "FastCkptError",
    "FormatError",
    "IntegrityError",
    "ChecksumMismatchError",
    "RestoreMismatchError",
    "TensorNotFoundError",
    "CheckpointNotFoundError",
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
