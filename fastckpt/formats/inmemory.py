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

import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from fastckpt._native.mapped import MappedFile
from fastckpt.errors import FormatError, NotZeroCopyWarning
from fastckpt.formats.reader import detect_format, sniff_length

__all__ = ["save_bytes", "load_bytes", "detect_bytes_format", "BYTES_PATH", "FORMATS"]

# The name errors give the bytes (there is no file).
BYTES_PATH = "<bytes>"
FORMATS = ("safetensors", "npz")
_MEMORY_DIR = "/dev/shm"


def detect_bytes_format(data) -> str:
    """``"safetensors"`` or ``"npz"``, from the first 9 bytes of ``data``; else a ``FormatError`` at offset 0.

    >>> detect_bytes_format(b"PK\\x05\\x06" + bytes(18))
    'npz'
    >>> detect_bytes_format(b"hello")
    Traceback (most recent call last):
    ...
    fastckpt.errors.FormatError: <bytes>: not safetensors or NPZ bytes: the 5 bytes at offset 0 are b'hello' (expected an 8-byte little-endian header length and '{' at offset 8 for safetensors, or b'PK\\x03\\x04' for NPZ)
    """
    from fastckpt.formats.foreign import SNIFF_BYTES, foreign_file_error

    with memoryview(data) as view:
        flat = view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")
        head = bytes(flat[:9])
        size = view.nbytes
        fmt = detect_format(bytes(flat[:sniff_length(head)]))
        # a torch pickle or Keras file's bytes: say so, not what the NPZ or safetensors parser makes of them
        foreign = foreign_file_error(BYTES_PATH, bytes(flat[:SNIFF_BYTES])) if fmt != "safetensors" else None
    if foreign is not None:
        raise foreign
    if fmt is None:
        raise FormatError(
            f"{BYTES_PATH}: not safetensors or NPZ bytes: the {min(size, 9)} bytes at offset 0 are {head!r} "
            "(expected an 8-byte little-endian header length and '{' at offset 8 for safetensors, or "
            "b'PK\\x03\\x04' for NPZ)")
    return fmt


def expect_format(data, fmt: str, module: str) -> None:
    """Raise a ``FormatError`` when ``data`` holds another format than ``fmt``, naming the call that reads it."""
    found = detect_bytes_format(data)
    if found != fmt:
        raise FormatError(f"{BYTES_PATH}: these are {found} bytes, not {fmt} (offset 0); read them with "
                          f"fastckpt.formats.{found}.load_bytes or fastckpt.load_bytes (which detects the format); "
                          f"{module}.load_bytes reads {fmt} only")


def mapped_bytes(data) -> MappedFile:
    """A :class:`MappedFile` over a private, page-aligned copy of ``data`` (any C-contiguous buffer).

    >>> mapped_bytes(b"abc")
    <MappedFile '<bytes>' size=3 backend='memory' copy_on_write>
    """
    return MappedFile.from_buffer(data, path=BYTES_PATH)


def quietly_parsed(parse: Callable[[], Any]) -> Any:
    """``parse()`` without its ``NotZeroCopyWarning``: bytes in memory are copied whatever their layout."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotZeroCopyWarning)
        return parse()


def _estimated_nbytes(tensors) -> int:
    """The tensors' bytes where their objects say so cheaply (``nbytes``); 0 for the others."""
    if not isinstance(tensors, Mapping):
        return 0
    total = 0
    for value in tensors.values():
        nbytes = getattr(value, "nbytes", 0)
        total += nbytes if isinstance(nbytes, int) else 0
    return total


def _scratch_parent(nbytes: int) -> str:
    try:
        stats = os.statvfs(_MEMORY_DIR)
        if stats.f_bavail * stats.f_frsize >= 2 * nbytes + (16 << 20) and os.access(_MEMORY_DIR, os.W_OK):
            return _MEMORY_DIR
    except OSError:
        pass
    return tempfile.gettempdir()


def written_bytes(write: Callable[[str], None], tensors) -> bytes:
    """Call ``write(path)`` (a file writer) on a private scratch path; return the file's bytes and remove it.

    >>> written_bytes(lambda p: open(p, "wb").write(b"abc"), {})
    b'abc'
    """
    directory = tempfile.mkdtemp(prefix="fastckpt-bytes-", dir=_scratch_parent(_estimated_nbytes(tensors)))
    try:
        path = os.path.join(directory, "tensors")
        write(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return b""
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                return m[:]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


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
