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

Packed sub-byte types (safetensors ``F4``, ``F6_E2M3``, ``F6_E3M2``; PyTorch's
``float4_e2m1fn_x2``) are held as a :class:`PackedArray`: the stored bytes, with the type and
the logical shape recorded. Only a safetensors file holds them; every other writer refuses them
(:class:`PackedTypeError`), naming the tensor.

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
import importlib
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, overload

import numpy as np

__all__ = ["as_numpy", "to_numpy", "to_torch", "PackedArray", "PackedTypeError", "packed_array", "TakenRows"]

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


#: Bits per element of the packed types, by safetensors name, and their ml_dtypes element type.
PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
PACKED_ML_DTYPES = {"F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn"}


class PackedTypeError(TypeError):
    """A packed sub-byte tensor (:class:`PackedArray`) given to a path that cannot hold it."""


class PackedArray(np.ndarray):
    """The stored bytes of a tensor whose elements are narrower than a byte.

    A 1-d ``uint8`` array of the bytes exactly as safetensors stores them:
    ``size * bits / 8`` bytes, the elements back to back in C order across
    rows (a row may end inside a byte). ``packed`` is the safetensors type
    (``"F4"``, ``"F6_E2M3"``, ``"F6_E3M2"``), ``logical_shape`` the shape in
    elements and ``element_dtype`` the ml_dtypes type of one element.
    :meth:`unpack` gives ``F4`` as an ``ml_dtypes.float4_e2m1fn`` array of the
    logical shape (a copy: the first element of each byte is its low nibble,
    as in PyTorch's ``float4_e2m1fn_x2``). safetensors does not say in which
    order 6-bit elements share bytes, so ``F6_*`` stays bytes.

    A reader's ``host()`` returns one for such a tensor; ``save_safetensors``
    writes it back as it was read; ``to_torch`` makes ``F4`` a
    ``float4_e2m1fn_x2`` tensor. Slices and arithmetic give plain arrays of
    the bytes.

    >>> import ml_dtypes
    >>> a = packed_array(np.array([0x21, 0x43], np.uint8), "F4", (4,))
    >>> a.packed, a.logical_shape, a.unpack().astype(np.float32).tolist()
    ('F4', (4,), [0.5, 1.0, 1.5, 2.0])
    """

    packed: str | None
    logical_shape: tuple[int, ...] | None

    def __array_finalize__(self, obj) -> None:
        # A view of the whole (same bytes, same shape) stays packed; anything else is plain bytes.
        same = isinstance(obj, PackedArray) and obj.shape == self.shape and obj.dtype == self.dtype
        self.packed = getattr(obj, "packed", None) if same else None
        self.logical_shape = getattr(obj, "logical_shape", None) if same else None

    def __reduce__(self):
        raise TypeError("a PackedArray is not pickled; save it with fastckpt.save_safetensors")

    @property
    def element_dtype(self) -> np.dtype:
        """The ml_dtypes type of one element (``float4_e2m1fn``, ``float6_e2m3fn``, ``float6_e3m2fn``)."""
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, PACKED_ML_DTYPES[self.packed]))

    def bytes_view(self) -> np.ndarray:
        """The stored bytes as a plain ``uint8`` array (no copy)."""
        return self.view(np.ndarray)

    def unpack(self) -> np.ndarray:
        """``F4`` as an ``ml_dtypes.float4_e2m1fn`` array of the logical shape (one element per byte, a copy).

        >>> packed_array(np.array([0xF1], np.uint8), "F4", (2,)).unpack().astype(np.float32).tolist()
        [0.5, -6.0]
        """
        if self.packed != "F4":
            raise PackedTypeError(f"a packed {self.packed} tensor cannot be unpacked: safetensors does not say in "
                                  "which order 6-bit elements share bytes; .bytes_view() gives the stored bytes")
        raw = self.bytes_view()
        out = np.empty(raw.size * 2, np.uint8)
        out[0::2] = raw & 0x0F
        out[1::2] = raw >> 4
        return out.view(self.element_dtype).reshape(self.logical_shape)


def packed_nbytes(packed: str, shape: tuple[int, ...]) -> int:
    """The stored size of a packed tensor, as safetensors computes it; ValueError where it is not whole bytes."""
    bits = math.prod(shape) * PACKED_BITS[packed]
    if bits % 8:
        raise ValueError(f"{packed}{list(shape)} is {bits} bits, not a whole number of bytes: safetensors stores "
                         f"{packed} only in shapes of {8 // math.gcd(8, PACKED_BITS[packed])} elements or a multiple")
    return bits // 8


def packed_array(data: Any, packed: str, shape: tuple[int, ...] | list[int]) -> PackedArray:
    """A :class:`PackedArray` of the stored bytes ``data`` (bytes, a buffer or a ``uint8`` array; not copied
    where it is an array) of a ``packed`` tensor of the logical ``shape``; checks the byte count.

    ``F4`` can also be built from its elements: ``pack_float4(a)`` of an
    ``ml_dtypes.float4_e2m1fn`` array.

    >>> packed_array(b"\\x00" * 3, "F6_E2M3", (4,)).nbytes
    3
    """
    if packed not in PACKED_BITS:
        raise ValueError(f"packed must be one of {sorted(PACKED_BITS)}, got {packed!r}")
    shape = tuple(int(d) for d in shape)
    raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data)
    if raw.dtype != np.uint8:
        raise TypeError(f"the stored bytes of a packed {packed} tensor must be uint8, got {raw.dtype}")
    want = packed_nbytes(packed, shape)
    if raw.size != want:
        raise ValueError(f"{packed}{list(shape)} is stored in {want} bytes, got {raw.size}")
    out = raw.reshape(-1).view(PackedArray)
    out.packed, out.logical_shape = packed, shape
    return out


def pack_float4(elements: np.ndarray) -> PackedArray:
    """An ``ml_dtypes.float4_e2m1fn`` array as ``F4`` (two elements a byte, the first in the low nibble).

    >>> import ml_dtypes
    >>> pack_float4(np.array([0.5, -6.0], ml_dtypes.float4_e2m1fn)).tolist()
    [241]
    """
    codes = np.ascontiguousarray(elements).view(np.uint8).reshape(-1) & 0x0F
    shape = tuple(elements.shape)
    packed_nbytes("F4", shape)
    return packed_array((codes[0::2] | (codes[1::2] << 4)).astype(np.uint8), "F4", shape)


class TakenRows:
    """The rows ``rows`` of ``source``, in that order (``source[rows]``), not yet copied.

    ``save_safetensors`` writes one piece by piece: its writer
    (``GatherWriter.write_rows``) gathers about :attr:`PIECE_BYTES` of rows
    into one buffer, hashes and writes them, and takes the next rows into the
    same buffer. A tensor stored in another order than the one its rows are
    kept in (a hashtable's rows in key-space slice order) then costs no copy
    of the whole tensor, and each piece is written while its bytes are still
    in the CPU's cache. Any other writer converts it with
    ``np.asarray`` (``__array__``: the whole copy). ``source`` must not change
    until it is written.

    >>> t = TakenRows(np.arange(6).reshape(3, 2), np.array([2, 0]))
    >>> t.shape, t.dtype.name, t.nbytes, np.asarray(t).tolist()
    ((2, 2), 'int64', 32, [[4, 5], [0, 1]])
    >>> TakenRows(np.zeros(3), np.array([3]))
    Traceback (most recent call last):
    IndexError: rows must be in [0, 3) (the rows of the source), got 3

    ``checked=True`` skips that scan of ``rows`` (two passes over them), for rows their maker knows to lie in the
    source (a sharded save's slice order, a permutation): the gather still refuses a row outside the source, with
    an ``IndexError`` naming it, before any byte of it is copied.
    """

    #: Bytes of rows gathered and written at a time: a piece stays in the cache from its gather to its write.
    PIECE_BYTES = 1 << 20

    __slots__ = ("dtype", "nbytes", "rows", "shape", "source")

    def __init__(self, source: np.ndarray, rows: np.ndarray, *, checked: bool = False):
        if not isinstance(source, np.ndarray) or source.ndim == 0:
            raise TypeError(f"source must be a numpy array of at least one axis, got {type(source).__name__}")
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise TypeError(f"rows must be a 1-d array of integers, got {rows.dtype} of shape {rows.shape}")
        rows = rows.astype(np.intp, copy=False)
        if rows.size and not checked:
            low, high = int(rows.min()), int(rows.max())
            if low < 0 or high >= len(source):
                raise IndexError(f"rows must be in [0, {len(source)}) (the rows of the source), got "
                                 f"{low if low < 0 else high}")
        self.source, self.rows = source, rows
        self.shape = (len(rows), *source.shape[1:])
        self.dtype = source.dtype
        self.nbytes = math.prod(self.shape) * source.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"TakenRows({len(self.rows)} of {len(self.source)} rows, {self.dtype}{list(self.shape)})"

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.take(self.source, self.rows, axis=0)
        return out if dtype is None else out.astype(dtype, copy=False)


def is_packed(value: Any) -> bool:
    """True for a :class:`PackedArray` that still describes its bytes."""
    return isinstance(value, PackedArray) and value.packed is not None


def _refuse_packed(array: PackedArray, name: str | None, where: str | None) -> None:
    what = f"tensor {name!r}" if name is not None else "a tensor"
    raise PackedTypeError(
        f"{what} is packed {array.packed} ({PACKED_BITS[array.packed]}-bit elements, logical shape "
        f"{list(array.logical_shape)}), which {where or 'this path'} cannot hold: only safetensors stores packed "
        "types (fastckpt.save_safetensors writes it as safetensors does); "
        + ("to keep the values elsewhere, widen them first: fastckpt.arrays.to_numpy(t, packed=True).unpack()"
           ".astype(np.float32)" if array.packed == "F4"
           else "to keep the bytes elsewhere, store a.bytes_view() as uint8 and record the type and shape"))


def _torch_ml_dtype(tensor) -> np.ndarray | None:
    """A PyTorch bfloat16/float8 ``tensor`` as an ml_dtypes array over the same bytes, else None."""
    name = _TORCH_TO_ML_DTYPES.get(str(getattr(tensor, "dtype", "")))
    if name is None:
        if str(getattr(tensor, "dtype", "")) == "torch.float4_e2m1fn_x2":
            return _torch_float4(tensor)
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


def _torch_float4(tensor) -> PackedArray:
    """A PyTorch ``float4_e2m1fn_x2`` tensor (two elements a byte) as ``F4``: the logical shape doubles the last
    dimension, as safetensors records it."""
    import sys

    torch = sys.modules["torch"]
    bits = tensor.view(torch.uint8)
    if bits.device.type != "cpu":
        bits = bits.cpu()
    raw = np.ascontiguousarray(np.from_dlpack(bits))
    shape = tuple(tensor.shape)
    logical = (*shape[:-1], shape[-1] * 2) if shape else (2,)
    return packed_array(raw.reshape(-1), "F4", logical)


def as_numpy(value: Any, *, packed: bool = False, name: str | None = None, where: str | None = None) -> \
        np.ndarray | None:
    """``value`` as an ndarray when it is array-like (see the module docstring), else None.

    Zero-copy where the source allows (numpy views, CPU DLPack, buffers).
    A packed sub-byte tensor (:class:`PackedArray`, a torch
    ``float4_e2m1fn_x2`` tensor) is returned as a :class:`PackedArray` only
    with ``packed=True`` (a safetensors writer); otherwise it raises
    :class:`PackedTypeError` naming ``name`` and ``where``.

    >>> as_numpy([1, 2]) is None, as_numpy(np.zeros(2)).shape, as_numpy(np.int64(9))
    (True, (2,), array(9))
    >>> as_numpy(memoryview(np.arange(3, dtype=np.float32)))
    array([0., 1., 2.], dtype=float32)
    """
    if isinstance(value, np.ndarray):
        if type(value) is PackedArray and value.packed is not None and not packed:
            _refuse_packed(value, name, where)
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
            if type(array) is PackedArray and not packed:
                _refuse_packed(array, name, where)
            return array
        try:
            return np.from_dlpack(tensor)
        except _DLPACK_ERRORS:
            if hasattr(tensor, "cpu"):  # a device tensor: one copy to host
                tensor = tensor.cpu()
                with contextlib.suppress(*_DLPACK_ERRORS):
                    return np.from_dlpack(tensor)
            try:
                return np.asarray(tensor)
            except _DLPACK_ERRORS as e:
                what = f"tensor {name!r}" if name is not None else "a tensor"
                raise TypeError(f"{what} ({type(value).__name__} of dtype {getattr(value, 'dtype', '?')}) has no numpy "
                                f"form ({e}); convert it to a numpy-supported dtype first, "
                                "e.g. .to(torch.float32)") from None
    if hasattr(value, "__array__"):
        return np.asarray(value)
    try:
        view = memoryview(value)
    except TypeError:
        return None
    return np.asarray(view)


def to_numpy(value: Any, *, packed: bool = False, name: str | None = None, where: str | None = None) -> np.ndarray:
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
    array = as_numpy(value, packed=packed, name=name, where=where)
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
    importlib.import_module("torch")  # PyTorch is required: without it, ImportError here, before any work

    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"to_torch: copy must be None, True or False, got {copy!r}")
    if isinstance(value, dict):
        return {name: _to_torch(item, copy, name) for name, item in value.items()}
    return _to_torch(value, copy, None)


def _to_torch(value: Any, copy: bool | None, name: str | None) -> torch.Tensor:
    import torch

    array = to_numpy(value, packed=True, name=name)
    if type(array) is PackedArray and array.packed is not None:
        return _packed_to_torch(array, copy, name)
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


def _packed_to_torch(array: PackedArray, copy: bool | None, name: str | None) -> torch.Tensor:
    """``F4`` as PyTorch's ``float4_e2m1fn_x2`` (two elements a byte: the last dimension halves)."""
    import torch

    what = f"tensor {name!r}" if name is not None else "a tensor"
    shape = array.logical_shape
    if array.packed != "F4" or not hasattr(torch, "float4_e2m1fn_x2"):
        raise PackedTypeError(f"{what} is packed {array.packed}, which this PyTorch has no type for; "
                              "a.bytes_view() gives its stored bytes as uint8")
    if not shape or shape[-1] % 2:
        raise PackedTypeError(f"{what} is F4 of shape {list(shape)}: PyTorch's float4_e2m1fn_x2 packs two "
                              "elements of one row a byte, so the last dimension must be even; "
                              "a.unpack() gives the elements as ml_dtypes.float4_e2m1fn")
    raw = array.bytes_view()
    if copy or (copy is None and not raw.flags.writeable):
        raw = raw.copy()
    if not raw.flags.writeable:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.from_numpy(raw)
    else:
        tensor = torch.from_numpy(raw)
    tensor = tensor.view(torch.float4_e2m1fn_x2).reshape(*shape[:-1], shape[-1] // 2)
    return tensor.as_subclass(_read_only_class()) if not raw.flags.writeable else tensor


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
