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
import warnings
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
def to_torch(value: dict[str, Any], *, copy: bool | None = None) -> dict[str, torch.Tensor]: ...
@overload
def to_torch(value: Any, *, copy: bool | None = None) -> torch.Tensor: ...


def to_torch(value: Any, *, copy: bool | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """``value`` (an array, or a dict of them, as the readers return) as PyTorch tensors with the same dtype.

    The way back from what fastckpt reads to PyTorch: ml_dtypes arrays
    (bfloat16, float8) become the PyTorch type of the same name over the same
    bytes, where ``torch.from_numpy`` refuses them; other arrays go through
    ``torch.from_numpy``. A dict is converted value by value.

    ``copy`` says what happens to the memory:

    * ``None`` (the default): a writable array is shared (no copy); a
      read-only one (a view of a mapped file) is copied into private memory,
      so every tensor returned can be trained in place. For no copy at all,
      open the file with ``copy_on_write=True`` (its views are writable and
      private) or use :func:`fastckpt.load_torch`, which does.
    * ``True``: always a private copy.
    * ``False``: never a copy. A read-only array then gives a read-only
      tensor (:class:`ReadOnlyTensor`): every in-place operation on it or on
      a view of it (``add_``, ``copy_``, ``x[i] = v``, ``out=``, the
      optimizers' ``_foreach_*_``) raises ``RuntimeError`` before it touches
      memory, where writing to the read-only mapping would kill the process.

    >>> import ml_dtypes
    >>> t = to_torch(np.array([1.5, -2], dtype=ml_dtypes.bfloat16))  # doctest: +SKIP
    >>> t.dtype, t.tolist()  # doctest: +SKIP
    (torch.bfloat16, [1.5, -2.0])
    """
    import torch

    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"to_torch: copy must be None, True or False, got {copy!r}")
    if isinstance(value, dict):
        return {name: to_torch(item, copy=copy) for name, item in value.items()}
    array = to_numpy(value)
    read_only = not array.flags.writeable
    if copy or (copy is None and read_only):
        array = np.array(array, copy=True, order="K")
        read_only = False
    torch_name = _ML_DTYPES_TO_TORCH.get(array.dtype.name) if array.dtype.type.__module__ == "ml_dtypes" else None
    if torch_name is not None:
        array = array.view(np.int16 if array.dtype.itemsize == 2 else np.uint8)
    if read_only:
        with warnings.catch_warnings():  # torch's "not writable" warning: the ReadOnlyTensor below is the guard
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.from_numpy(array)
    else:
        tensor = torch.from_numpy(array)
    if torch_name is not None:
        tensor = tensor.view(getattr(torch, torch_name))
    return tensor.as_subclass(_read_only_class()) if read_only else tensor


_READ_ONLY: list[type] = []
# Tensor methods that write into their first argument without a trailing underscore in their name.
_WRITING = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
            "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
# In-place methods that change only a tensor's metadata (or give it new memory), never its bytes.
_METADATA_ONLY = {"requires_grad_", "detach_", "retain_grad", "rename_", "refine_names", "as_strided_", "squeeze_",
                  "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "set_", "resize_", "resize_as_",
                  "share_memory_", "pin_memory", "record_stream"}


def _read_only_class() -> type:
    """:class:`ReadOnlyTensor`, made on first use (torch is imported only then)."""
    if not _READ_ONLY:
        import torch

        class ReadOnlyTensor(torch.Tensor):
            """A tensor over read-only memory (``to_torch(..., copy=False)``): in-place writes raise.

            Every torch operation passes through ``__torch_function__``: one that would
            write into a read-only tensor (an in-place method, ``x[i] = v``, ``out=`` one,
            ``torch._foreach_*_`` over a list holding one) raises ``RuntimeError`` before
            it runs; results that share its memory (views, and the numpy arrays of
            ``.numpy()`` and ``np.asarray``) are read-only too, any other result is a
            plain tensor. ``.clone()`` gives a writable copy. The guard is torch's Python
            API (``__torch_function__``): code that takes the raw memory (``data_ptr()``,
            DLPack, a C++ extension) is not guarded.
            """

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                targets = []
                if ((name.endswith("_") and not name.endswith("__")) or name in _WRITING) and name not in _METADATA_ONLY:
                    first = args[0] if args else None
                    targets = list(first) if isinstance(first, (list, tuple)) else [first]
                out = kwargs.get("out")
                targets += list(out) if isinstance(out, (list, tuple)) else [out]
                for target in targets:
                    if isinstance(target, cls):
                        raise RuntimeError(
                            f"{name}: this tensor is a read-only view of a mapped file (to_torch(..., copy=False)); "
                            "writing to it would crash the process. Use .clone(), to_torch(array) (a private copy) "
                            "or fastckpt.load_torch(path) (a private copy-on-write mapping)")
                with torch._C.DisableTorchFunctionSubclass():
                    result = func(*args, **kwargs)
                    shared = {a.untyped_storage().data_ptr() for a in args if isinstance(a, cls)}
                    return _rewrap(result, shared, cls, torch)

        ReadOnlyTensor.__module__ = __name__
        ReadOnlyTensor.__qualname__ = "ReadOnlyTensor"
        _READ_ONLY.append(ReadOnlyTensor)
    return _READ_ONLY[0]


def _rewrap(result: Any, shared: set[int], cls: type, torch: Any) -> Any:
    """``result`` with each tensor over one of the ``shared`` storages made a ``cls`` again (a view stays
    read-only)."""
    if isinstance(result, torch.Tensor):
        if type(result) is torch.Tensor and shared and result.untyped_storage().data_ptr() in shared:
            return result.as_subclass(cls)
        return result
    if isinstance(result, np.ndarray) and shared:  # .numpy(), np.asarray(t): the same memory, read-only again
        result.flags.writeable = False
        return result
    if isinstance(result, (list, tuple)) and any(isinstance(r, torch.Tensor) for r in result):
        items = [_rewrap(r, shared, cls, torch) for r in result]
        return type(result)(items) if type(result) in (list, tuple) else type(result)(*items)
    return result


def __getattr__(name: str) -> Any:
    if name == "ReadOnlyTensor":  # fastckpt.arrays.ReadOnlyTensor: needs torch, so made on first use
        return _read_only_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
