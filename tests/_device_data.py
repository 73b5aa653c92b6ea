"""Test data shared by the device tests: every dtype a device tensor must carry, and random bit patterns."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.complex64, np.complex128,
]


def sample(dtype, shape, seed=0) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaN payloads and infinities included), valid booleans."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    return rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)
