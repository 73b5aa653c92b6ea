"""A tensor file's bytes in memory: their format told from the magic, a private mapping to parse, a writer's
output captured.

The shared half of :mod:`fastckpt.formats.inmemory` (``save_bytes`` / ``load_bytes``) and of each format's own
``save_bytes`` / ``load_bytes``; it imports no format module, so every one of them can use it.

>>> detect_format(b"PK\\x03\\x04"), detect_bytes_format(b"PK\\x05\\x06" + bytes(18))
('npz', 'npz')
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any, Callable

from fastckpt._native.mapped import MappedFile
from fastckpt.errors import FormatError, NotZeroCopyWarning

__all__ = ["detect_format", "sniff_length", "detect_bytes_format", "expect_format", "mapped_bytes", "quietly_parsed",
           "written_bytes", "BYTES_PATH"]

# The name errors give the bytes (there is no file).
BYTES_PATH = "<bytes>"
_MEMORY_DIR = "/dev/shm"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x06\x06")


_JSON_SPACE = b" \t\n\r"
# How far a safetensors header's leading padding is followed to its "{" when the format is sniffed.
SNIFF_PADDING = 1 << 16


def sniff_length(head: bytes) -> int:
    """How many of a file's first bytes :func:`detect_format` needs, given its first 9: 9, or more when byte 8 is
    JSON whitespace (safetensors allows it before the header's ``{``), up to the header's end or
    ``8 + SNIFF_PADDING``.

    >>> sniff_length((2).to_bytes(8, "little") + b"{}"), sniff_length((70).to_bytes(8, "little") + b"  ")
    (9, 78)
    """
    if len(head) < 9 or head[8] not in _JSON_SPACE:
        return 9
    return 8 + min(int.from_bytes(head[:8], "little"), SNIFF_PADDING)


def detect_format(head: bytes) -> str | None:
    """Name the format of a file from its first bytes (:func:`sniff_length` says how many): ``"npz"``,
    ``"safetensors"`` or None.

    >>> detect_format(b"PK\\x03\\x04")
    'npz'
    >>> detect_format((2).to_bytes(8, "little") + b"{}")
    'safetensors'
    >>> detect_format((4).to_bytes(8, "little") + b"\\n\\t{}")   # whitespace before the header's "{"
    'safetensors'
    """
    # safetensors first: a header length of 0x04034B50 starts with the ZIP magic, while no ZIP
    # start has "{" at byte 8 (there a local header's compression method, 123, does not exist).
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:4] in _ZIP_MAGICS:
        return "npz"
    if len(head) >= 10 and head[8] in _JSON_SPACE:
        header = head[8:8 + int.from_bytes(head[:8], "little")]
        if header.lstrip(_JSON_SPACE)[:1] == b"{":
            return "safetensors"
    return None


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
