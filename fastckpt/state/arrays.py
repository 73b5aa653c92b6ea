"""Arrays inside state trees: from any framework to numpy, and the tagged base64 form JSON states carry.

A state value is an array when :func:`as_numpy` (:mod:`fastckpt.arrays`) says so: a
numpy array, an object with ``to_host()`` (a fastckpt or netcl device tensor), a
DLPack producer (PyTorch, JAX, CuPy), anything with ``__array__`` or the buffer
protocol (``array.array``). Where no tensor file takes it, an array is written
inline as one JSON object::

    {"__ndarray__": "<base64 of the C-order bytes>", "dtype": D, "shape": [n, ...]}

with exactly ``prod(shape) * itemsize`` bytes. ``D`` is the numpy dtype string
with its byte order (kinds ``b i u f c S U``: ``"<f4"``, ``">i2"``, ``"|b1"``)
or the name of an ``ml_dtypes`` type (``"bfloat16"``, ``"float8_e4m3fn"``).
Object, structured and other arrays are refused: nothing is ever pickled.

>>> tree = encode_array(np.arange(3, dtype="<i2"))
>>> tree
{'__ndarray__': 'AAABAAIA', 'dtype': '<i2', 'shape': [3]}
>>> decode_array(tree).tolist()
[0, 1, 2]
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from fastckpt.arrays import as_numpy
from fastckpt.errors import FormatError

__all__ = ["ARRAY_TAG", "as_numpy", "dtype_token", "parse_dtype", "encode_array", "decode_array"]

ARRAY_TAG = "__ndarray__"
_ARRAY_KEYS = frozenset((ARRAY_TAG, "dtype", "shape"))
# Kinds whose bytes mean the same on every machine given dtype.str (byte order included).
_PLAIN_KINDS = frozenset("biufcSU")


def _ml_dtype(name: str) -> np.dtype | None:
    import ml_dtypes

    ext = getattr(ml_dtypes, name, None)
    if ext is None or not isinstance(ext, type) or not issubclass(ext, np.generic):
        return None
    return np.dtype(ext)


def dtype_token(dtype: np.dtype, where: str = "state") -> str:
    """The string a JSON state stores for ``dtype``: ``dtype.str`` or an ml_dtypes name; refuses the rest.

    >>> dtype_token(np.dtype(">i4")), dtype_token(parse_dtype("bfloat16"))
    ('>i4', 'bfloat16')
    """
    # ml_dtypes types first: their dtype.str ('<V2', '<f1') does not name them.
    if dtype.fields is None and _ml_dtype(dtype.name) == dtype and dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.name
    if dtype.kind in _PLAIN_KINDS and np.dtype(dtype.str) == dtype:
        return dtype.str
    raise TypeError(
        f"{where}: numpy array of dtype {dtype!r} cannot be stored in a JSON state "
        "(only bool, integer, float, complex, bytes/str and ml_dtypes arrays; nothing is pickled)"
    )


def parse_dtype(token: Any, where: str = "state") -> np.dtype:
    """Invert :func:`dtype_token`; anything else raises ``FormatError`` (never an object dtype).

    >>> parse_dtype("<f2"), parse_dtype("float8_e4m3fn")
    (dtype('float16'), dtype(float8_e4m3fn))
    """
    if not isinstance(token, str):
        raise FormatError(f"{where}: array dtype must be a string, got {token!r}")
    if token.isidentifier():
        dtype = _ml_dtype(token)
        if dtype is None:
            raise FormatError(f"{where}: unknown array dtype {token!r} (not an ml_dtypes type)")
        return dtype
    try:
        dtype = np.dtype(token)
    except TypeError:
        raise FormatError(f"{where}: unknown array dtype {token!r}") from None
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None:
        raise FormatError(f"{where}: array dtype {token!r} is not allowed (object and structured arrays are refused)")
    return dtype


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise FormatError(f"{where}: invalid base64 ({exc})") from None


def encode_array(array: np.ndarray, where: str = "state") -> dict:
    """The tagged JSON object of one array: its C-order bytes in base64, dtype token and shape.

    >>> encode_array(np.array([[1], [2]], dtype="<u2"))
    {'__ndarray__': 'AQACAA==', 'dtype': '<u2', 'shape': [2, 1]}
    """
    token = dtype_token(array.dtype, where)
    data = np.ascontiguousarray(array).tobytes()
    return {ARRAY_TAG: base64.b64encode(data).decode("ascii"), "dtype": token, "shape": list(array.shape)}


def decode_array(tree: dict, where: str = "state") -> np.ndarray:
    """Invert :func:`encode_array`: a C-contiguous, writable array; a malformed object raises ``FormatError``.

    >>> decode_array({"__ndarray__": "AQACAA==", "dtype": "<u2", "shape": [2, 1]}).tolist()
    [[1], [2]]
    """
    if set(tree) != _ARRAY_KEYS or not isinstance(tree[ARRAY_TAG], str):
        raise FormatError(
            f"{where}: malformed array object with keys {sorted(tree)}; expected exactly {sorted(_ARRAY_KEYS)}"
        )
    dtype = parse_dtype(tree["dtype"], where)
    shape = tree["shape"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise FormatError(f"{where}: array shape must be a list of non-negative integers, got {shape!r}")
    data = _b64(tree[ARRAY_TAG], where)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise FormatError(
            f"{where}: array of dtype {tree['dtype']} and shape {shape} needs {expected} bytes, "
            f"the base64 data holds {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
