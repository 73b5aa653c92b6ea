"""Memory for the large arrays a sharded load fills, kept when they are dropped for the next load of the same size.

A load reads every byte it places into new arrays (a table's ids, rows and slots, a rank's dense rows). New memory
costs the kernel a page fault and the zeroing of every page on its first write, inside the read: measured on a
4-rank load of 255 MiB, the kernel's zeroing (``clear_page``) took 31% of the load's CPU, as much as the copy from
the page cache itself. Memory a process freed and allocates again costs neither (glibc keeps some of what it frees,
which is why a plain ``readinto`` of the same bytes into ``np.empty`` buffers, load after load, does not pay it).

:func:`empty` returns an array like ``np.empty``'s. From :data:`MIN_BYTES` on its memory is the process's kept
memory (:func:`fastckpt._native.mapped.kept_take`, the one list the id index's buckets use too): a private anonymous
mapping of its own (a multiple of 2 MiB, huge pages advised as numpy advises its large arrays) or one a dropped
array of the same mapped size left. When the last array or view of it is collected, the mapping is kept (its pages
given to the kernel with ``MADV_FREE``: taken back under memory pressure, then they read as zeros and fault again)
for the next buffer of the same mapped size, up to :func:`fastckpt._native.mapped.kept_limit` bytes in all (512 MiB
unless set; 0 keeps none); beyond, and with :func:`release`, it is unmapped. Where a mapping cannot be had,
:func:`empty` is ``np.empty``.

>>> release()
>>> a = empty((1 << 20, 4), np.float32); a.shape, a.dtype, a.flags.c_contiguous, a.flags.writeable
((1048576, 4), dtype('float32'), True, True)
>>> del a; kept_bytes()
16777216
>>> b = empty((1 << 20, 4), np.float32); kept_bytes()  # the same mapping again
0
>>> del b; release(); kept_bytes()
0
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from fastckpt._native.mapped import KEPT_MIN_BYTES, kept_bytes, kept_give, kept_release, kept_take

__all__ = ["empty", "kept_bytes", "release", "MIN_BYTES"]

#: Arrays from this size on are on kept memory; smaller ones come from ``np.empty`` (malloc keeps those itself).
MIN_BYTES = KEPT_MIN_BYTES


def empty(shape, dtype) -> np.ndarray:
    """An uninitialized, writeable, C-contiguous array of ``shape`` and ``dtype`` (as ``np.empty``), on memory a
    dropped array of the same mapped size left where there is some (see the module docs).

    >>> empty((3,), np.int64).shape
    (3,)
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    address = kept_take(nbytes)
    if not address:
        return np.empty(shape, dtype)
    # SAFETY: the memory lives until `holder` is collected, which every array and view made from it keeps alive
    # (their base); then kept_give keeps or unmaps it, and no view of it is left.
    holder = (ctypes.c_char * nbytes).from_address(address)
    # not at exit: arrays still in use then (an exit handler saving a table) must keep their pages as they are
    weakref.finalize(holder, kept_give, address, nbytes).atexit = False
    return np.frombuffer(holder, np.uint8, count=nbytes).view(dtype).reshape(shape)


def release() -> None:
    """Unmap every kept mapping, the id index's too (the arrays still in use are not touched).

    >>> release(); kept_bytes()
    0
    """
    kept_release()
