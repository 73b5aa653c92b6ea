"""Arrays from any framework: the one conversion every writer and the state codec use.

A value is *array-like* when it is one of, checked in this order:

1. a numpy array (taken as it is) or a numpy scalar (``np.int64(9)``: a 0-d array);
2. an object with ``to_host()``: a fastckpt or netcl device tensor (one copy to the host);
3. a DLPack producer (``__dlpack__``: PyTorch, JAX, CuPy): viewed without a copy when it lives
   in host memory, else copied to the host (``.cpu()``) first; a PyTorch tensor that requires
   grad is detached. DLPack has no code for PyTorch's bfloat16 and float8 types: their bits are
   viewed as a same-size integer and the array given the ``ml_dtypes`` type of the same name
   (``torch.bfloat16`` -> ``ml_dtypes.bfloat16``), still without a copy;
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
from typing import TYPE_CHECKING, Any, overload

import numpy as np

__all__ = ["as_numpy", "to_numpy", "to_torch"]

_NOT_ARRAYS = (str, bytes, int, float, complex, bool, list, tuple, dict)
# What np.from_dlpack raises for a producer it cannot view (a device tensor, an unsupported dtype).
_DLPACK_ERRORS = (TypeError, RuntimeError, BufferError, ValueError)


# PyTorch dtype -> the ml_dtypes type of the same bits (DLPack, and so np.from_dlpack, has none of these).
_TORCH_TO_ML_DTYPES = {
    "torch.bfloat16": "bfloat16", "torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2",
    "torch.float8_e4m3fnuz": "float8_e4m3fnuz", "torch.float8_e5m2fnuz": "float8_e5m2fnuz",
    "torch.float8_e8m0fnu": "float8_e8m0fnu",
}
_ML_DTYPES_TO_TORCH = {name: torch_name[len("torch."):] for torch_name, name in _TORCH_TO_ML_DTYPES.items()}


def _torch_ml_dtype(tensor) -> np.ndarray | None:
    """A PyTorch bfloat16/float8 ``tensor`` as an ml_dtypes array over the same bytes, else None."""
    name = _TORCH_TO_ML_DTYPES.get(str(getattr(tensor, "dtype", "")))
    if name is None:
        return None
    import sys

    import ml_dtypes

    if not hasattr(ml_dtypes, name):
        raise TypeError(f"a torch {name} tensor needs an ml_dtypes with {name}: pip install -U ml_dtypes")
    torch = sys.modules["torch"]  # a torch tensor: torch is imported
    bits = tensor.view(torch.int16 if tensor.element_size() == 2 else torch.uint8)  # same bytes, same strides
    if bits.device.type != "cpu":
        bits = bits.cpu()
    return np.from_dlpack(bits).view(getattr(ml_dtypes, name))


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
        array = _torch_ml_dtype(tensor)
        if array is not None:
            return array
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


if TYPE_CHECKING:
    import torch


@overload
def to_torch(value: dict[str, Any]) -> dict[str, torch.Tensor]: ...
@overload
def to_torch(value: Any) -> torch.Tensor: ...


def to_torch(value: Any) -> torch.Tensor | dict[str, torch.Tensor]:
    """``value`` (an array, or a dict of them, as the readers return) as PyTorch tensors with the same dtype.

    The way back from what fastckpt reads to PyTorch: ml_dtypes arrays
    (bfloat16, float8) become the PyTorch type of the same name over the same
    bytes, where ``torch.from_numpy`` refuses them; other arrays go through
    ``torch.from_numpy``. No copy is made, so a tensor made from a read-only
    view (a mapped file) is read-only too: PyTorch warns on such a view, and
    writing to it is an error; ``.clone()`` it to change it. A dict is
    converted value by value.

    >>> import ml_dtypes
    >>> t = to_torch(np.array([1.5, -2], dtype=ml_dtypes.bfloat16))  # doctest: +SKIP
    >>> t.dtype, t.tolist()  # doctest: +SKIP
    (torch.bfloat16, [1.5, -2.0])
    """
    import torch

    if isinstance(value, dict):
        return {name: to_torch(item) for name, item in value.items()}
    array = to_numpy(value)
    torch_name = _ML_DTYPES_TO_TORCH.get(array.dtype.name) if array.dtype.type.__module__ == "ml_dtypes" else None
    if torch_name is None:
        return torch.from_numpy(array)
    bits = array.view(np.int16 if array.dtype.itemsize == 2 else np.uint8)
    return torch.from_numpy(bits).view(getattr(torch, torch_name))
