"""Compact storage of hashtable tensors, opt-in: lossless compression, and row-wise quantization for serving.

A sharded save with ``compression=`` or ``quantize=`` stores each of a
hashtable's tensors (ids, embedding, slots, deleted ids) as one ``uint8``
tensor: the *payload* below, after an optional byte shuffle and codec. Its
description entry says how, under ``"encoding"`` (specified byte for byte in
:mod:`fastckpt.sharded.format`):

* ids (``T.id``, ``T.deleted``): stored sorted ascending (the rows of the
  embedding and slots in the same order); the payload is the first id and then
  each difference to the previous one, all as little-endian uint64 (wrapping),
  which are small numbers for ids that cluster; ``"transform": "delta"``;
* values (``T.embedding``, slots) without quantization: their little-endian bytes;
* values quantized (``"transform": "int8"`` or ``"int16"``): per row ``r`` a
  float32 scale ``s[r] = max|x[r]| / Q`` (``Q`` = 127 or 32767; 0 for a row of
  zeros) and ``q[r] = round(x[r] / s[r])`` as int8 / int16; the payload is every
  scale (float32, little-endian) then every ``q``; a reader gives back
  ``q * s`` in float32, cast to the table's dtype. The save measures the
  largest absolute error this gives and writes it in the manifest.

Then ``"shuffle": k`` (the payload's element size, or 1) regroups the bytes:
byte ``j`` of every element first, ``j = 0 .. k-1`` (floats and small ids
compress better so), and ``"codec"`` is ``"zstd"`` (Zstandard frame),
``"lz4"`` (LZ4 frame) or ``null`` (stored as is), through ``cramjam``.

>>> ids = np.array([900, 3, 7, 2**62])
>>> stored, encoding = encode_ids(np.sort(ids), "zstd")
>>> decode(stored, encoding).tolist()
[3, 7, 900, 4611686018427387904]
>>> values = np.array([[0.5, -1.0], [0.0, 0.0]], np.float32)
>>> stored, encoding, error = encode_values(values, None, "int8")
>>> restored = decode(stored, encoding)
>>> restored[1].tolist(), bool(np.abs(restored - values).max() == error <= 1 / 254)  # half a step of row 0
([0.0, 0.0], True)
"""

from __future__ import annotations

import cramjam
import numpy as np

from fastckpt.errors import FormatError
from fastckpt.sharded.format import dtype_of
from fastckpt.store.manifest import expect

__all__ = ["CODECS", "QUANTIZE", "encode_ids", "encode_values", "decode", "check_options"]

CODECS = ("zstd", "lz4")
QUANTIZE = {"int8": (np.dtype("<i1"), 127), "int16": (np.dtype("<i2"), 32767)}
_ZSTD_LEVEL = 3


def check_options(compression, quantize) -> None:
    """Raise for a codec or quantization this module does not know.

    >>> check_options("zstd", None); check_options(None, "int4")
    Traceback (most recent call last):
    ValueError: quantize must be None, 'int8' or 'int16', got 'int4'
    """
    if compression is not None and compression not in CODECS:
        raise ValueError(f"compression must be None, 'zstd' or 'lz4', got {compression!r}")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be None, 'int8' or 'int16', got {quantize!r}")


def _pack(payload: np.ndarray, itemsize: int, codec: str | None) -> tuple[np.ndarray, int]:
    raw = payload.reshape(-1).view(np.uint8)
    shuffle = itemsize if codec is not None and itemsize > 1 and len(raw) % itemsize == 0 else 1
    if shuffle > 1:
        raw = raw.reshape(-1, shuffle).T.copy().reshape(-1)
    if codec == "zstd":
        data = cramjam.zstd.compress(raw, level=_ZSTD_LEVEL)
    elif codec == "lz4":
        data = cramjam.lz4.compress(raw)
    else:
        data = raw
    return np.frombuffer(bytes(data), np.uint8) if codec else np.ascontiguousarray(raw), shuffle


def encode_ids(ids: np.ndarray, codec: str | None) -> tuple[np.ndarray, dict]:
    """``(stored uint8, encoding)`` of ascending int64 ``ids``: first id, then differences, shuffled and coded."""
    deltas = ids.astype("<i8").view("<u8").copy()
    deltas[1:] -= deltas[:-1].copy()  # uint64 arithmetic wraps: exact for any int64 ids
    stored, shuffle = _pack(deltas, 8, codec)
    return stored, {"transform": "delta", "codec": codec, "shuffle": shuffle, "dtype": "int64",
                    "shape": [len(ids)], "payload_nbytes": deltas.nbytes}


def encode_values(values: np.ndarray, codec: str | None, quantize: str | None) -> tuple[np.ndarray, dict, float]:
    """``(stored uint8, encoding, largest absolute error)`` of ``(n, *row shape)`` rows (error 0.0 when lossless);
    a quantized row's scale covers all its values."""
    shape = [int(d) for d in values.shape]
    dtype = values.dtype
    n, dim = shape[0], int(np.prod(shape[1:], dtype=np.int64))
    values = values.reshape(n, dim)
    encoding = {"transform": quantize, "codec": codec, "dtype": dtype.name, "shape": shape}
    if quantize is None:
        payload = np.ascontiguousarray(values).astype(dtype.newbyteorder("<"), copy=False)
        stored, shuffle = _pack(payload, dtype.itemsize, codec)
        return stored, {**encoding, "shuffle": shuffle, "payload_nbytes": payload.nbytes}, 0.0
    qtype, levels = QUANTIZE[quantize]
    x = values.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("quantize needs finite values: the rows hold NaN or infinity")
    scale = (np.abs(x).max(axis=1) / np.float32(levels)).astype(np.float32) if dim else np.zeros(n, np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(x / safe[:, None]), -levels, levels).astype(qtype)
    error = float(np.abs(_dequantize(scale, q) - x).max()) if x.size else 0.0
    payload = np.concatenate([scale.astype("<f4").view(np.uint8), q.reshape(-1).view(np.uint8)])
    stored, shuffle = _pack(payload, 1, codec)
    return stored, {**encoding, "shuffle": shuffle, "payload_nbytes": payload.nbytes}, error


def _dequantize(scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]


def decode(stored: np.ndarray, encoding: dict, where: str = "encoded tensor") -> np.ndarray:
    """The array an encoded tensor holds (a new array); a damaged one raises a ``FormatError`` naming ``where``."""
    codec, shuffle, nbytes = encoding.get("codec"), encoding.get("shuffle", 1), encoding.get("payload_nbytes")
    expect(codec in (None, *CODECS) and type(shuffle) is int and 1 <= shuffle <= 16 and type(nbytes) is int
            and nbytes >= 0, where, f"unknown encoding {encoding!r} (shuffle: an element's size, 1 to 16 bytes)")
    data = memoryview(np.ascontiguousarray(stored).reshape(-1).view(np.uint8))
    if codec is None:
        raw = np.frombuffer(bytes(data), np.uint8)
    else:
        # Into an array numpy allocates: a claimed size no memory can hold is a MemoryError here, where the
        # codec's own allocation of output_len would abort the process.
        try:
            raw = np.empty(nbytes, np.uint8)
        except (MemoryError, ValueError):
            raise FormatError(f"{where}: its encoding claims {nbytes} payload bytes, more than memory holds; the "
                              "file is damaged") from None
        try:
            got = getattr(cramjam, codec).decompress_into(data, raw)
        except Exception as exc:  # noqa: BLE001 - cramjam raises its own DecompressionError
            raise FormatError(f"{where}: its {codec} data does not decompress into the {nbytes} payload bytes its "
                              f"encoding says ({exc}); the file is damaged") from None
        raw = raw[:got]
    expect(len(raw) == nbytes and nbytes % shuffle == 0, where,
            f"holds {len(raw)} payload bytes, its encoding says {nbytes}; the file is damaged")
    if shuffle > 1:
        raw = raw.reshape(shuffle, -1).T.copy().reshape(-1)
    shape = tuple(encoding.get("shape", ()))
    transform = encoding.get("transform")
    if transform == "delta":
        expect(len(shape) == 1 and nbytes == 8 * shape[0], where, f"delta ids of shape {shape} in {nbytes} bytes")
        return np.cumsum(raw.view("<u8"), dtype=np.uint64).view(np.int64)  # wraps back to the ids
    dtype = dtype_of(encoding.get("dtype", ""), where)
    expect(len(shape) >= 2, where, f"rows of shape {shape}: expected (rows, *row shape)")
    n, dim = shape[0], int(np.prod(shape[1:], dtype=object))
    if transform is None:
        expect(nbytes == n * dim * dtype.itemsize, where, f"{nbytes} bytes for {shape} {dtype}")
        return raw.view(dtype.newbyteorder("<")).reshape(shape).astype(dtype)
    expect(transform in QUANTIZE, where, f"unknown transform {transform!r}")
    qtype, _ = QUANTIZE[transform]
    expect(nbytes == n * 4 + n * dim * qtype.itemsize, where, f"{nbytes} bytes for {shape} quantized {transform}")
    scale = raw[: 4 * n].view("<f4")
    q = raw[4 * n:].view(qtype).reshape(n, dim)
    return _dequantize(scale, q).astype(dtype).reshape(shape)
