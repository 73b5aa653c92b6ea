"""Gathered writes: many buffers to a file descriptor in one ``writev`` call, without copying them.

A model with thousands of small tensors costs a buffered writer one copy of
every byte into its buffer and a Python call per tensor. ``GatherWriter``
instead holds each buffer until it is written (an array by a reference and
its data pointer, anything else by a buffer export, so that none is freed)
and hands up to ``IOV_MAX`` of them to the kernel in one ``writev(2)``, with
the GIL released. Its users flush before any caller code runs that could
change a queued array's bytes. Partial writes (a signal, a
2 GiB call limit) are resumed where they stopped; errors raise ``OSError``
with the errno.

With ``hasher`` (anything with ``update(buffer)``: a ``blake3.blake3()`` or
``hashlib.sha256()`` object) every byte is also hashed, in file order, from
the buffers as they are written: a file's hash without reading it back.

With ``writeback=n`` the writer asks the kernel to start writing the file's
dirty pages to the disk each time ``n`` more bytes have been written
(Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait for
them), so that the disk works while the caller goes on computing the next
bytes and a later ``fsync`` finds most of the file already written: the
write and the work that feeds it overlap instead of following each other. It
makes nothing durable by itself (``fsync`` still does), and is left out where
the call is missing (other systems) or refused (a pipe).

The writer owns the file position from the descriptor's current offset:
anything written to the descriptor some other way must be flushed before the
writer is used, and the writer flushed before anything else writes.

>>> import os, tempfile
>>> fd, path = tempfile.mkstemp()
>>> with GatherWriter(fd) as out:
...     out.write(b"head ")
...     out.write(memoryview(b"tail"))
>>> os.close(fd); open(path, "rb").read()
b'head tail'
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.memoryview cimport PyMemoryView_FromMemory

cdef extern from "Python.h":
    int PyBUF_READ
from libc.errno cimport EINTR, errno
from libc.string cimport memset

import os

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "<sys/uio.h>" nogil:
    ssize_t writev(int fd, const iovec* iov, int iovcnt)

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    /* Start writing the file's dirty pages back, without waiting (Linux); elsewhere: ENOSYS. */
    static int fastckpt_start_writeback(int fd) {
    #if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
        return sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    #else
        (void)fd;
        errno = ENOSYS;
        return -1;
    #endif
    }
    """
    int fastckpt_start_writeback(int fd) nogil

# Linux's IOV_MAX (UIO_MAXIOV); POSIX guarantees at least 16, glibc and musl say 1024.
DEF _IOV_MAX = 1024
# Pending bytes at which the writer flushes by itself: keeps each call's work bounded.
DEF _FLUSH_BYTES = 64 << 20
DEF _ZERO_BLOCK = 1 << 16
cdef char _ZEROS[_ZERO_BLOCK]  # static storage: all zero, never written


cdef class GatherWriter:
    """Collect buffers and write them to ``fd`` in order, ``IOV_MAX`` per ``writev`` call.

    ``writeback``: start the kernel's write-out of the file every that many bytes (0: never; module docs).

    ``write(obj)`` takes a C-contiguous numpy array of any dtype, or
    anything else with the buffer protocol (bytes, memoryview), and holds it,
    uncopied, until the next ``flush()``, which happens by itself every
    1024 buffers or 64 MiB. The caller must not change a buffer's contents
    before it is flushed. As a context manager it flushes on success and drops
    what is pending on an exception.
    """

    def __cinit__(self, int fd, hasher=None, Py_ssize_t writeback=0):
        if writeback < 0:
            raise ValueError(f"writeback must be 0 (never) or a number of bytes, got {writeback}")
        self._fd = fd
        self._hasher = hasher
        self._writeback = writeback
        self._unsent = 0
        self._count = 0
        self._pending = 0
        self._written = 0
        self._keep = []
        self._views = <Py_buffer*>PyMem_Malloc(_IOV_MAX * sizeof(Py_buffer))
        self._iov = <iovec*>PyMem_Malloc(_IOV_MAX * sizeof(iovec))
        if self._views == NULL or self._iov == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self._views != NULL:
            self._release()
            PyMem_Free(self._views)
        PyMem_Free(self._iov)

    @property
    def written(self):
        """Bytes written to the descriptor so far (pending buffers not included)."""
        return self._written

    cdef void _release(self) noexcept:
        cdef int i
        for i in range(self._count):
            PyBuffer_Release(&self._views[i])
        self._count = 0
        self._pending = 0
        if self._keep is not None:
            self._keep.clear()

    cpdef write(self, obj):
        """Queue ``obj``'s bytes after everything queued before; flushes when the queue is full."""
        cdef Py_buffer* view
        cdef Py_ssize_t n
        if self._count == _IOV_MAX:
            self.flush()
        view = &self._views[self._count]
        if type(obj) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj):
            # An array's bytes, held by a reference rather than a buffer export: numpy's export
            # builds a format description (and refuses some dtypes) that a byte copy never needs.
            n = cnp.PyArray_NBYTES(<cnp.ndarray>obj)
            if n == 0:
                return
            memset(view, 0, sizeof(Py_buffer))  # obj NULL: PyBuffer_Release lets go of nothing
            view.buf = cnp.PyArray_DATA(<cnp.ndarray>obj)
            view.len = n
            self._keep.append(obj)
        else:
            PyObject_GetBuffer(obj, view, PyBUF_SIMPLE)
            if view.len == 0:
                PyBuffer_Release(view)
                return
        self._count += 1
        self._pending += view.len
        if self._pending >= _FLUSH_BYTES:
            self.flush()

    cpdef write_zeros(self, Py_ssize_t n):
        """Queue ``n`` zero bytes (padding), taken from one static zero block rather than a new buffer."""
        cdef Py_buffer* view
        cdef Py_ssize_t piece
        if n < 0:
            raise ValueError(f"cannot write {n} zero bytes")
        while n > 0:
            if self._count == _IOV_MAX:
                self.flush()
            piece = min(n, _ZERO_BLOCK)
            view = &self._views[self._count]
            memset(view, 0, sizeof(Py_buffer))  # obj NULL: PyBuffer_Release lets go of nothing
            view.buf = <void*>_ZEROS
            view.len = piece
            self._count += 1
            self._pending += piece
            n -= piece
        if self._pending >= _FLUSH_BYTES:
            self.flush()

    cpdef flush(self):
        """Write every queued buffer, in order, then let them go."""
        cdef int i, start = 0, count = self._count
        cdef ssize_t done
        cdef int err = 0
        if count == 0:
            return
        for i in range(count):
            self._iov[i].iov_base = self._views[i].buf
            self._iov[i].iov_len = <size_t>self._views[i].len
        if self._hasher is not None:  # the bytes about to go out, in order (read-only views, no copy)
            for i in range(count):
                self._hasher.update(PyMemoryView_FromMemory(<char*>self._views[i].buf, self._views[i].len, PyBUF_READ))
        try:
            while start < count:
                with nogil:
                    done = writev(self._fd, &self._iov[start], count - start)
                    if done < 0:
                        err = errno
                if done < 0:
                    if err == EINTR:
                        PyErr_CheckSignals()  # Ctrl-C raises KeyboardInterrupt, as in Python's own writes
                        continue
                    raise OSError(err, os.strerror(err))
                if done == 0:
                    raise OSError(f"writev wrote nothing with {self._pending} bytes pending")
                self._written += done
                self._unsent += done
                # Skip what went out; resume a buffer that went out in part.
                while start < count and <size_t>done >= self._iov[start].iov_len:
                    done -= self._iov[start].iov_len
                    start += 1
                if start < count:
                    if done > 0:
                        self._iov[start].iov_base = <char*>self._iov[start].iov_base + done
                        self._iov[start].iov_len -= <size_t>done
                    # A short write may mean a signal arrived: run its handler (Ctrl-C raises) before
                    # blocking again, as Python's own buffered writer does.
                    PyErr_CheckSignals()
        finally:
            self._release()
        if self._writeback and self._unsent >= self._writeback:
            self._unsent = 0
            with nogil:
                done = fastckpt_start_writeback(self._fd)
            if done != 0:  # not offered here (ENOSYS), or not for this kind of file (ESPIPE, EINVAL): stop asking
                self._writeback = 0

    def discard(self):
        """Drop every queued buffer without writing it."""
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.flush()
        else:
            self._release()
        return False
