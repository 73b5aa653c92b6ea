"""Device tensors: a buffer, a byte offset, a shape and a numpy dtype.

A :class:`Tensor` may be a view into a larger buffer (an arena holding a whole
file's tensors), so ``buffer.size`` says nothing about the tensor: every copy
moves exactly ``nbytes`` bytes starting at ``offset``. The dtype is kept as
stored; nothing is cast to float32 behind the caller's back.

A tensor may still be receiving its bytes (a non-blocking copy from a mapped
file). It then holds the copy's event and a reference to the source memory
(SAFETY: the source must stay mapped until the copy completes; dropping the
reference earlier would let the mapping be unmapped under the DMA engine).
:meth:`Tensor.wait` and every read wait on the event first.

>>> import numpy as np                                  # doctest: +SKIP
>>> from fastckpt.device import default                # doctest: +SKIP
>>> q = default().queue                                # doctest: +SKIP
>>> t = Tensor.from_host(q, np.arange(3, dtype=np.int64))  # doctest: +SKIP
>>> t.to_host()                                        # doctest: +SKIP
array([0, 1, 2])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["Tensor", "as_bytes", "contiguous"]


def contiguous(array) -> np.ndarray:
    """``array`` as a C-contiguous ndarray, copied only when needed; 0-d stays 0-d.

    >>> a = np.arange(6).reshape(2, 3)
    >>> contiguous(a) is a, contiguous(a.T).flags.c_contiguous
    (True, True)
    """
    host = np.asarray(array)
    return host if host.flags.c_contiguous else host.copy(order="C")


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for 0-d and ml_dtypes arrays).

    >>> as_bytes(np.array(258, np.uint16)).tolist()
    [2, 1]
    """
    return array.reshape(-1).view(np.uint8)


class Tensor:
    """``nbytes`` bytes at ``offset`` in an OpenCL ``buffer``, read as ``dtype`` with ``shape``.

    >>> from fastckpt.device import default                                # doctest: +SKIP
    >>> q = default().queue                                                # doctest: +SKIP
    >>> t = Tensor.from_host(q, np.arange(6, dtype=np.float16).reshape(2, 3))  # doctest: +SKIP
    >>> t.shape, t.dtype, t.nbytes, t.offset                              # doctest: +SKIP
    ((2, 3), dtype('float16'), 12, 0)
    """

    __slots__ = ("buffer", "offset", "shape", "dtype", "queue", "_event", "_keepalive", "_owner", "__weakref__")

    def __init__(self, buffer, shape, dtype, *, offset: int = 0, queue=None, event=None, keepalive: Any = None, owner: Any = None):
        self.buffer = buffer
        self.offset = int(offset)
        self.shape = tuple(map(int, shape))
        self.dtype = np.dtype(dtype)
        self.queue = queue
        self._event = event
        self._keepalive = keepalive  # source memory of an in-flight copy (see SAFETY above)
        self._owner = owner  # what must outlive this view: an arena lease, a pool handle

    @classmethod
    def _make(cls, buffer, shape: tuple, dtype: np.dtype, offset: int, queue, owner) -> "Tensor":
        """A view from already-validated parts (a parsed TensorInfo): the loader's fast constructor."""
        t = cls.__new__(cls)
        t.buffer = buffer
        t.offset = offset
        t.shape = shape
        t.dtype = dtype
        t.queue = queue
        t._event = None
        t._keepalive = None
        t._owner = owner
        return t

    # -- description -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of data (never the size of the underlying buffer)."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pending(self) -> bool:
        """True while a copy into this tensor may still be running."""
        return self._event is not None

    def __repr__(self) -> str:
        return f"<fastckpt.Tensor shape={self.shape} dtype={self.dtype} offset={self.offset}{' pending' if self.pending else ''}>"

    # -- data movement -------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until any copy into this tensor has finished, then release its source."""
        event = self._event
        if event is not None:
            event.wait()
            self._event = None
            self._keepalive = None

    @classmethod
    def from_host(cls, queue, array, pool=None) -> "Tensor":
        """Copy a host array to a new device tensor (blocking), keeping its dtype.

        With ``pool``, the buffer comes from ``pool(nbytes)`` (a pyopencl-style allocator).
        """
        import pyopencl as cl

        host = contiguous(array)
        nbytes = host.nbytes
        if pool is not None:
            buffer = pool(max(nbytes, 1))
        else:
            buffer = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, size=max(nbytes, 1))
        tensor = cls(buffer, host.shape, host.dtype, queue=queue)
        if nbytes:
            cl.enqueue_copy(queue, buffer, as_bytes(host), is_blocking=True)
        return tensor

    def to_host(self, out: np.ndarray | None = None) -> np.ndarray:
        """Wait for pending copies, then read the tensor into a new (or given) host array."""
        import pyopencl as cl

        self.wait()
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.shape != self.shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {self.dtype}{self.shape}, got {out.dtype}{out.shape}")
        if self.nbytes:
            cl.enqueue_copy(self.queue, as_bytes(out), self.buffer, src_offset=self.offset, is_blocking=True)
        return out

    def write(self, array) -> None:
        """Overwrite the tensor's bytes in place (blocking); shape and dtype must match exactly."""
        import pyopencl as cl

        host = contiguous(array)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError(f"cannot write {host.dtype}{host.shape} into a tensor of {self.dtype}{self.shape}")
        self.wait()
        if self.nbytes:
            cl.enqueue_copy(self.queue, self.buffer, as_bytes(host), dst_offset=self.offset, is_blocking=True)

    def __array__(self, dtype=None, copy=None):
        if copy is False:  # numpy's protocol: refuse rather than copy behind the caller's back
            raise ValueError("a device tensor has no host memory to view: np.asarray(t, copy=False) cannot "
                             "avoid a copy; use t.to_host()")
        host = self.to_host()
        return host if dtype is None else host.astype(dtype)
