"""TensorFlow ``DataType`` enum values and the numpy dtypes their checkpoint bytes decode to.

Numbers from ``tensorflow/core/framework/types.proto``. Quantized types
(``DT_QINT8`` ...) are stored as their plain integer type's bytes and read as
TensorFlow's own numpy form of them: a one-field structured dtype named for
the type (``np.dtype([("qint8", "i1")])``, what ``tf.qint8.as_numpy_dtype``
is), so the type survives a read and a write; a plain integer array is always
written as the plain type.
bfloat16 and the 8/4/2-bit types come from ``ml_dtypes`` (one byte per element
in memory and on disk for the sub-byte integers, as TensorFlow stores them).

>>> numpy_dtype(DT_FLOAT)
dtype('float32')
>>> tf_dtype(numpy_dtype(DT_BFLOAT16)) == DT_BFLOAT16
True
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fastckpt.errors import FormatError

__all__ = ["DT_STRING", "DT_VARIANT", "DT_RESOURCE", "TF_NAMES", "QUANTIZED", "numpy_dtype", "tf_dtype", "tf_name",
           "quantized_name", "quantized_dtype"]

DT_INVALID = 0
DT_FLOAT = 1
DT_DOUBLE = 2
DT_INT32 = 3
DT_UINT8 = 4
DT_INT16 = 5
DT_INT8 = 6
DT_STRING = 7
DT_COMPLEX64 = 8
DT_INT64 = 9
DT_BOOL = 10
DT_QINT8 = 11
DT_QUINT8 = 12
DT_QINT32 = 13
DT_BFLOAT16 = 14
DT_QINT16 = 15
DT_QUINT16 = 16
DT_UINT16 = 17
DT_COMPLEX128 = 18
DT_HALF = 19
DT_RESOURCE = 20
DT_VARIANT = 21
DT_UINT32 = 22
DT_UINT64 = 23
DT_FLOAT8_E5M2 = 24
DT_FLOAT8_E4M3FN = 25
DT_FLOAT8_E4M3FNUZ = 26
DT_FLOAT8_E4M3B11FNUZ = 27
DT_FLOAT8_E5M2FNUZ = 28
DT_INT4 = 29
DT_UINT4 = 30
DT_INT2 = 31
DT_UINT2 = 32
DT_FLOAT4_E2M1FN = 33

# enum -> little-endian numpy dtype of one stored element
_NUMPY = {
    DT_FLOAT: np.dtype("<f4"),
    DT_DOUBLE: np.dtype("<f8"),
    DT_INT32: np.dtype("<i4"),
    DT_UINT8: np.dtype("u1"),
    DT_INT16: np.dtype("<i2"),
    DT_INT8: np.dtype("i1"),
    DT_COMPLEX64: np.dtype("<c8"),
    DT_INT64: np.dtype("<i8"),
    DT_BOOL: np.dtype("?"),
    DT_QINT8: np.dtype([("qint8", "i1")]),
    DT_QUINT8: np.dtype([("quint8", "u1")]),
    DT_QINT32: np.dtype([("qint32", "<i4")]),
    DT_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DT_QINT16: np.dtype([("qint16", "<i2")]),
    DT_QUINT16: np.dtype([("quint16", "<u2")]),
    DT_UINT16: np.dtype("<u2"),
    DT_COMPLEX128: np.dtype("<c16"),
    DT_HALF: np.dtype("<f2"),
    DT_UINT32: np.dtype("<u4"),
    DT_UINT64: np.dtype("<u8"),
    DT_FLOAT8_E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DT_FLOAT8_E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    DT_FLOAT8_E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DT_FLOAT8_E4M3B11FNUZ: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    DT_FLOAT8_E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DT_INT4: np.dtype(ml_dtypes.int4),
    DT_UINT4: np.dtype(ml_dtypes.uint4),
}
# Types that older ml_dtypes releases lack (pyproject allows them): without one, only that dtype is
# unreadable (numpy_dtype says which ml_dtypes is needed); everything else keeps working.
_NEEDS_NEWER_ML_DTYPES = {}
for _enum, _name in ((DT_INT2, "int2"), (DT_UINT2, "uint2"), (DT_FLOAT4_E2M1FN, "float4_e2m1fn")):
    if hasattr(ml_dtypes, _name):
        _NUMPY[_enum] = np.dtype(getattr(ml_dtypes, _name))
    else:
        _NEEDS_NEWER_ML_DTYPES[_enum] = _name

TF_NAMES = {
    DT_INVALID: "invalid", DT_FLOAT: "float32", DT_DOUBLE: "float64", DT_INT32: "int32", DT_UINT8: "uint8",
    DT_INT16: "int16", DT_INT8: "int8", DT_STRING: "string", DT_COMPLEX64: "complex64", DT_INT64: "int64",
    DT_BOOL: "bool", DT_QINT8: "qint8", DT_QUINT8: "quint8", DT_QINT32: "qint32", DT_BFLOAT16: "bfloat16",
    DT_QINT16: "qint16", DT_QUINT16: "quint16", DT_UINT16: "uint16", DT_COMPLEX128: "complex128",
    DT_HALF: "float16", DT_RESOURCE: "resource", DT_VARIANT: "variant", DT_UINT32: "uint32", DT_UINT64: "uint64",
    DT_FLOAT8_E5M2: "float8_e5m2", DT_FLOAT8_E4M3FN: "float8_e4m3fn", DT_FLOAT8_E4M3FNUZ: "float8_e4m3fnuz",
    DT_FLOAT8_E4M3B11FNUZ: "float8_e4m3b11fnuz", DT_FLOAT8_E5M2FNUZ: "float8_e5m2fnuz", DT_INT4: "int4",
    DT_UINT4: "uint4", DT_INT2: "int2", DT_UINT2: "uint2", DT_FLOAT4_E2M1FN: "float4_e2m1fn",
}

# The quantized types: TensorFlow's numpy form of each (a structured dtype whose one field is the plain integer).
QUANTIZED = {TF_NAMES[e]: _NUMPY[e] for e in (DT_QINT8, DT_QUINT8, DT_QINT16, DT_QUINT16, DT_QINT32)}

# numpy dtype (native order) -> enum, for writing; a plain integer is never written as a quantized type.
_FROM_NUMPY = {}
for _enum, _dt in _NUMPY.items():
    _FROM_NUMPY.setdefault(_dt.newbyteorder("="), _enum)


def quantized_name(dtype) -> str | None:
    """``"qint8"`` ... when ``dtype`` is TensorFlow's numpy form of a quantized type, else None.

    >>> quantized_name(np.dtype([("qint8", "i1")])), quantized_name(np.int8)
    ('qint8', None)
    """
    dt = np.dtype(dtype)
    if dt.names is None or len(dt.names) != 1 or dt.names[0] not in QUANTIZED:
        return None
    return dt.names[0] if dt.newbyteorder("=") == QUANTIZED[dt.names[0]].newbyteorder("=") else None


def quantized_dtype(name: str) -> np.dtype:
    """TensorFlow's numpy form of the quantized type ``name`` (``ValueError`` naming the choices otherwise).

    >>> quantized_dtype("quint8")
    dtype([('quint8', 'u1')])
    """
    try:
        return QUANTIZED[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} is not a TensorFlow quantized type; choose one of {', '.join(QUANTIZED)}") from None


def tf_name(enum: int) -> str:
    """TensorFlow's short name for a DataType value (``"float32"``, ``"bfloat16"``, ...)."""
    return TF_NAMES.get(enum, f"DataType({enum})")


def numpy_dtype(enum: int, *, what: str = "tensor") -> np.dtype:
    """The little-endian numpy dtype of one stored element of ``enum`` (not for DT_STRING)."""
    try:
        return _NUMPY[enum]
    except KeyError:
        if enum in _NEEDS_NEWER_ML_DTYPES:
            detail = (f"the installed ml_dtypes {ml_dtypes.__version__} has no {_NEEDS_NEWER_ML_DTYPES[enum]}; "
                      "pip install -U ml_dtypes")
        elif enum >= 100:
            detail = "a reference type, which never appears in a checkpoint"
        elif enum in (DT_STRING, DT_VARIANT, DT_RESOURCE):
            detail = "not a fixed-size type"
        else:
            detail = "unknown to this version of fastckpt"
        raise FormatError(f"{what}: dtype {tf_name(enum)} ({enum}) has no numpy equivalent ({detail})") from None


def tf_dtype(dtype) -> int:
    """The DataType value to store a numpy dtype as; object/bytes/str arrays are DT_STRING.

    >>> tf_dtype(np.dtype(">i8"))
    9
    """
    dt = np.dtype(dtype)
    if dt.kind in "OSU":
        return DT_STRING
    try:
        return _FROM_NUMPY[dt.newbyteorder("=")]
    except KeyError:
        raise TypeError(f"numpy dtype {dt} has no TensorFlow equivalent") from None
