"""Arrays from any framework: the one conversion every writer and the state codec use.

A value is *array-like* when it is one of, checked in this order:

1. a numpy array (taken as it is) or a numpy scalar (``np.int64(9)``: a 0-d array);
2. an object with ``to_host()``: a fastckpt or netcl device tensor (one copy to the host);
3. a DLPack producer (``__dlpack__``: PyTorch, JAX, CuPy): viewed without a copy when it lives
   in host memory, else copied to the host (``.cpu()``) first; a PyTorch tensor that requires
   grad is detached;
4. an object with ``__array__`` (pandas, xarray, PIL images, ...);
5. an object exposing the buffer protocol (``memoryview``, ``array.array``, ``bytearray``,
   ``mmap``): viewed without a copy, its item format giving the dtype (``uint8`` for raw bytes).

``bytes`` and ``str`` are not array-like: numpy reads them as text (``np.asarray(b"ab")`` is a
0-d ``|S2`` array), and the state codec stores them as such. Lists, tuples, Python numbers and
``None`` are not array-like either (:func:`as_numpy` returns None for them); the writers, which
take anything numpy takes, convert them with :func:`to_numpy`.

>>> import array
>>> as_numpy(array.array("h", [1, 2])), as_numpy(bytearray(b"ab")).dtype, as_numpy([1, 2])
(array([1, 2], dtype=int16), dtype('uint8'), None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["as_numpy", "to_numpy"]

_NOT_ARRAYS = (str, bytes, int, float, complex, bool, list, tuple, dict)
# What np.from_dlpack raises for a producer it cannot view (a device tensor, an unsupported dtype).
_DLPACK_ERRORS = (TypeError, RuntimeError, BufferError, ValueError)


def as_numpy(value: Any) -> np.ndarray | None:
    """``value`` as an ndarray when it is array-like (see the module docstring), else None.

    Zero-copy where the source allows (numpy views, CPU DLPack, buffers).

    >>> as_numpy([1, 2]) is None, as_numpy(np.zeros(2)).shape, as_numpy(np.int64(9))
    (True, (2,), array(9))
    >>> as_numpy(memoryview(np.arange(3, dtype=np.float32)))
    array([0., 1., 2.], dtype=float32)
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if value is None or isinstance(value, _NOT_ARRAYS):
        return None
    if hasattr(value, "to_host"):
        return np.asarray(value.to_host())
    if hasattr(value, "__dlpack__"):
        tensor = value.detach() if hasattr(value, "detach") else value
        try:
            return np.from_dlpack(tensor)
        except _DLPACK_ERRORS:
            if hasattr(tensor, "cpu"):  # a device tensor: one copy to host
                tensor = tensor.cpu()
                with contextlib.suppress(*_DLPACK_ERRORS):
                    return np.from_dlpack(tensor)
            return np.asarray(tensor)
    if hasattr(value, "__array__"):
        return np.asarray(value)
    try:
        view = memoryview(value)
    except TypeError:
        return None
    return np.asarray(view)


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as an ndarray for a writer: :func:`as_numpy` for array-likes, ``np.asarray`` for the rest.

    The rest is what numpy itself converts: lists, tuples, Python numbers,
    ``bytes`` and ``str`` (fixed-width text). Whether the result's dtype can be
    stored is the writer's to say.

    A dict is refused (nested state goes through :func:`fastckpt.save_tree`),
    where numpy would make an array of one Python object of it.

    >>> to_numpy([[1, 2]]).shape, to_numpy(bytearray(b"ab")).tolist(), to_numpy(b"ab").dtype
    ((1, 2), [97, 98], dtype('S2'))
    """
    if isinstance(value, Mapping):
        raise TypeError(f"a {type(value).__name__} is not an array: nested dicts of arrays (JAX/Flax/Orbax state) "
                        "are saved by fastckpt.save_tree(path, tree), under '/'-joined names")
    array = as_numpy(value)
    return np.asarray(value) if array is None else array
