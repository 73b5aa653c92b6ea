"""Tensor files as bytes in memory: ``save_bytes`` / ``load_bytes`` for safetensors and NPZ.

``save_bytes`` returns exactly the bytes the file writer writes for the same
input (``save_safetensors`` / ``save_npz`` with the same tensors, metadata and
alignment), because it *is* the file writer: it writes the file into a private
directory on a memory filesystem (``/dev/shm`` when it exists and has room for
the tensors twice over, else the system's temporary directory), reads it back
in one copy and removes it. There is no second encoder to drift from the first.

``load_bytes`` parses the bytes with the file readers' own parsers, through
:meth:`fastckpt.MappedFile.from_buffer` (a private, page-aligned copy that the
parsers read as they read a mapped file). The arrays it returns are writable,
independent of ``data`` (they share that one copy, which lives as long as any
of them) and exact in dtype and shape; damaged bytes raise
:class:`~fastckpt.errors.FormatError` naming ``<bytes>`` and the byte offset.

>>> import numpy as np
>>> data = save_bytes({"w": np.arange(3, dtype=np.int16)}, {"step": "7"})
>>> len(data), data[:8], detect_bytes_format(data)
(4102, b'\\xf8\\x0f\\x00\\x00\\x00\\x00\\x00\\x00', 'safetensors')
>>> load_bytes(data)
{'w': array([0, 1, 2], dtype=int16)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fastckpt.formats.filebytes import BYTES_PATH, detect_bytes_format

__all__ = ["save_bytes", "load_bytes", "detect_bytes_format", "BYTES_PATH", "FORMATS"]

FORMATS = ("safetensors", "npz")


def save_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *,
               format: str = "safetensors", alignment: int | str | None = None) -> bytes:  # noqa: A002
    """The bytes of a safetensors file (default) or an NPZ archive (``format="npz"``) holding ``tensors``.

    Exactly the bytes ``save_safetensors`` / ``save_npz`` write for the same
    arguments (``alignment`` defaults to theirs: 4096 for safetensors,
    ``"auto"`` for NPZ). ``metadata`` (str ->
    str) is safetensors' only: NPZ has no place for it. Values may be any
    array-like (:mod:`fastckpt.arrays`: numpy, DLPack, ``__array__``, buffers).

    >>> import numpy as np
    >>> data = save_bytes({"x": np.ones(2, np.float32)}, format="npz", alignment=64)
    >>> data[:4], load_bytes(data)["x"].tolist()
    (b'PK\\x03\\x04', [1.0, 1.0])
    """
    options = {} if alignment is None else {"alignment": alignment}
    if format == "safetensors":
        from fastckpt.formats import safetensors

        return safetensors.save_bytes(tensors, metadata, **options)
    if format == "npz":
        if metadata is not None:
            raise ValueError("NPZ archives have no metadata; pass metadata=None, or use format='safetensors'")
        from fastckpt.formats import npz

        return npz.save_bytes(tensors, **options)
    raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")


def load_bytes(data) -> dict[str, np.ndarray]:
    """The arrays held in safetensors or NPZ bytes (detected from the bytes), name -> array, in file order.

    ``data`` is ``bytes``, ``bytearray``, a C-contiguous ``memoryview`` or any
    such buffer. The arrays are writable and independent of ``data``. Bad
    bytes raise :class:`~fastckpt.errors.FormatError` naming the offset.

    >>> import numpy as np
    >>> load_bytes(save_bytes({"a": np.eye(2, dtype=np.uint8)}))["a"].tolist()
    [[1, 0], [0, 1]]
    >>> load_bytes(save_bytes({"a": np.eye(2)})[:100])
    Traceback (most recent call last):
    ...
    fastckpt.errors.FormatError: <bytes>: header length at byte 0 says 4088 bytes of JSON, but only 92 bytes follow it (file size 100; file seems truncated?)
    """
    if detect_bytes_format(data) == "npz":
        from fastckpt.formats import npz

        return npz.load_bytes(data)
    from fastckpt.formats import safetensors

    return safetensors.load_bytes(data)
