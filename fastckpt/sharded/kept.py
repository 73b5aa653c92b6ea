"""Memory for the large arrays a sharded load fills, kept when they are dropped for the next load of the same size.

A load reads every byte it places into new arrays (a table's ids, rows and slots, a rank's dense rows). New memory
costs the kernel a page fault and the zeroing of every page on its first write, inside the read: measured on a
4-rank load of 255 MiB, the kernel's zeroing (``clear_page``) took 31% of the load's CPU, as much as the copy from
the page cache itself. Memory a process freed and allocates again costs neither (glibc keeps some of what it frees,
which is why a plain ``readinto`` of the same bytes into ``np.empty`` buffers, load after load, does not pay it).

:func:`empty` returns an array like ``np.empty``'s. From :data:`MIN_BYTES` on it is a private anonymous mapping of
its own (a multiple of 2 MiB, huge pages advised as numpy advises its large arrays); when the last array or view
of it is collected, the mapping is kept (its pages given to the kernel with ``MADV_FREE``: taken back under
memory pressure, then they read as zeros and fault again) for the next :func:`empty` of the same mapped size, up
to :data:`MAX_KEPT_BYTES` in all; beyond, and with :func:`release`, it is unmapped. Where the platform has no
``MADV_FREE`` or the mapping fails, :func:`empty` is ``np.empty``.

>>> a = empty((1 << 20, 4), np.float32); a.shape, a.dtype, a.flags.c_contiguous, a.flags.writeable
((1048576, 4), dtype('float32'), True, True)
>>> del a; kept_bytes() >= 4 << 20
True
>>> b = empty((1 << 20, 4), np.float32); kept_bytes() == 0  # the same mapping again
True
>>> del b; release(); kept_bytes()
0
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import numpy as np

__all__ = ["empty", "kept_bytes", "release", "MIN_BYTES", "MAX_KEPT_BYTES"]

#: Arrays from this size on are mapped and kept; smaller ones come from ``np.empty`` (malloc keeps those itself).
MIN_BYTES = 2 << 20
#: The most bytes of dropped mappings kept at once (the rest are unmapped).
MAX_KEPT_BYTES = 512 << 20
_ROUND = 2 << 20  # mapped sizes are multiples of a huge page, so that loads of slightly other sizes reuse them

# Re-entrant: a garbage collection, which can start at any allocation, may run _give_back on a thread that holds it.
# Nothing the collector tracks is allocated while it is held.
_lock = threading.RLock()
_kept: dict[int, list[int]] = {}  # mapped size -> addresses of kept mappings of that size
_kept_total = [0]


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_C = _libc() if hasattr(mmap, "MADV_FREE") and hasattr(mmap, "MAP_ANONYMOUS") else None
_FAILED = ctypes.c_void_p(-1).value


def _map(size: int) -> int | None:
    addr = _C.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == _FAILED:
        return None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _C.madvise(addr, size, mmap.MADV_HUGEPAGE)  # as numpy advises its arrays from 4 MiB on
    return addr


def _give_back(addr: int, size: int) -> None:
    """The last view of a mapping was collected: keep it for the next array of its size, or unmap it."""
    fresh: list[int] = []  # (made before the lock is taken)
    with _lock:
        if _kept_total[0] + size <= MAX_KEPT_BYTES:
            _C.madvise(addr, size, mmap.MADV_FREE)
            _kept.setdefault(size, fresh).append(addr)
            _kept_total[0] += size
            return
    _C.munmap(addr, size)


def empty(shape, dtype) -> np.ndarray:
    """An uninitialized, writeable, C-contiguous array of ``shape`` and ``dtype`` (as ``np.empty``), on memory a
    dropped array of the same mapped size left where there is one (see the module docs).

    >>> empty((3,), np.int64).shape
    (3,)
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if _C is None or nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    size = -(-nbytes // _ROUND) * _ROUND
    with _lock:
        free = _kept.get(size)
        addr = free.pop() if free else None
        if addr is not None:
            _kept_total[0] -= size
    if addr is None:
        addr = _map(size)
        if addr is None:
            return np.empty(shape, dtype)
    # SAFETY: the mapping lives until `holder` is collected, which every array and view made from it keeps alive
    # (their base); then _give_back keeps or unmaps it, and no view of it is left.
    holder = (ctypes.c_char * size).from_address(addr)
    # not at exit: arrays still in use then (an exit handler saving a table) must keep their pages as they are
    weakref.finalize(holder, _give_back, addr, size).atexit = False
    return np.frombuffer(holder, np.uint8, count=nbytes).view(dtype).reshape(shape)


def kept_bytes() -> int:
    """The bytes of dropped mappings kept now for later arrays.

    >>> kept_bytes() >= 0
    True
    """
    with _lock:
        return _kept_total[0]


def release() -> None:
    """Unmap every kept mapping (the arrays still in use are not touched).

    >>> release(); kept_bytes()
    0
    """
    global _kept
    fresh: dict[int, list[int]] = {}
    with _lock:
        taken, _kept = _kept, fresh
        _kept_total[0] = 0
    for size, addrs in taken.items():
        for addr in addrs:
            _C.munmap(addr, size)
