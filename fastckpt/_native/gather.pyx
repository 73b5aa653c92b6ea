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
the buffers as they are written: a file's hash without reading it back. The
bytes go out a MiB at a time, each step hashed just before its ``writev``, so
that the kernel's copy reads what the hash has just brought into the cache
(one pass through memory, not two).

``write_rows(source, rows)`` writes ``source[rows]`` (rows of an array in another order, a
hashtable's rows in key-space slice order) without that copy: it gathers about a MiB of rows at a time into
one buffer of its own, without the GIL and fetching the rows a few ahead, hashes the piece and writes it while
its bytes are still in the CPU's cache, then takes the next rows into the same buffer.

With ``writeback=n`` the writer asks the kernel to start writing the file's
dirty pages to the disk each time ``n`` more bytes have been written
(Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait for
them), so that the disk works while the caller goes on computing the next
bytes and a later ``fsync`` finds most of the file already written: the
write and the work that feeds it overlap instead of following each other. It
makes nothing durable by itself (``fsync`` still does), and is left out where
the call is missing (other systems) or refused (a pipe).

With ``direct=True`` (a new file, written from its start) the writer writes past the page cache where the
file system takes it (Linux's ``O_DIRECT``, set on the descriptor while the writer works): each buffer is
copied into one aligned stage of its own (4 MiB) as it is given, a table's rows gathered straight into it,
hashed there while in the CPU's cache, and the stage written whole. The kernel then copies nothing into the
page cache (the copy, and the write-back of those pages, that a buffered write costs: about a fifth of a
sharded save's CPU), and the file's bytes are not left in the page cache. The last stage is written padded
to the alignment and the file cut back to its length; the writer must be left through its ``with`` block
(or :meth:`finish`). Where the file system refuses direct writes (tmpfs, some network file systems), or a
direct write comes back short, the writer goes on through the page cache: the bytes are the same.

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

Rows in another order, past the page cache where the file system takes it:

>>> import numpy as np
>>> fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
>>> with GatherWriter(fd, direct=True) as out:
...     out.write_rows(np.arange(6, dtype=np.uint8).reshape(3, 2), np.array([2, 0], np.intp))
>>> os.close(fd); open(path, "rb").read()
b'\\x04\\x05\\x00\\x01'
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdlib cimport free, malloc
from cpython.memoryview cimport PyMemoryView_FromMemory

cdef extern from "Python.h":
    int PyBUF_READ
from libc.errno cimport EINTR, EINVAL, errno
from libc.string cimport memcpy, memset

import os

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "<sys/uio.h>" nogil:
    ssize_t writev(int fd, const iovec* iov, int iovcnt)

cdef extern from "<unistd.h>" nogil:
    ssize_t pwrite(int fd, const void* buf, size_t count, long offset)
    int ftruncate(int fd, long length)
    long lseek(int fd, long offset, int whence)

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <stdlib.h>
    /* Set O_DIRECT on fd; returns its flags before, or -1 with errno (ENOSYS where there is no O_DIRECT). */
    static int fastckpt_direct_on(int fd) {
    #ifdef O_DIRECT
        int flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_DIRECT) < 0) return -1;
        return flags;
    #else
        (void)fd;
        errno = ENOSYS;
        return -1;
    #endif
    }
    static int fastckpt_set_flags(int fd, int flags) { return fcntl(fd, F_SETFL, flags); }
    static char* fastckpt_aligned(size_t alignment, size_t size) {
        void* p = NULL;
        return posix_memalign(&p, alignment, size) == 0 ? (char*)p : NULL;
    }
    """
    int fastckpt_direct_on(int fd) nogil
    int fastckpt_set_flags(int fd, int flags) nogil
    char* fastckpt_aligned(size_t alignment, size_t size) nogil

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

cdef extern from *:
    """
    #include <string.h>
    /* Rows rows[0..n) of src (a row every `stride` bytes, its `size` bytes contiguous) copied to dst, one after
       another. Returns -1, or the first i whose row is outside [0, count) (nothing of it copied). The rows lie
       anywhere in the source: each is asked for from memory FASTCKPT_AHEAD rows ahead of its copy, so that the
       misses overlap; a row of a common size is copied as a constant size, without a call.
       The prefetch brings both ends of the row (a 64-byte row of an array that is not 64-byte aligned spans two
       cache lines) into the L2 cache and below (locality 2, prefetcht1), 64 rows ahead. A prefetch into L1
       (locality 3) holds one of L1's few fill buffers until its line arrives, so with rows in random order the
       copies stalled on the prefetches themselves at about 16 misses in flight; into L2, 64 rows ahead, more
       misses overlap. Measured on a random order of 250,000 and 1,000,000 rows of 64 bytes from 2 MiB pages,
       caches evicted first: 7.3 and 8.7 ns a row, where L1 at 16 rows ahead (before) took 10.1 and 12.1 and no
       prefetch 11.0 and 12.5; rows 16 bytes off alignment 11.6 against 13.3. Earlier: a non-temporal prefetch of
       the first line only was slower than none. */
    #define FASTCKPT_AHEAD 64
    #define FASTCKPT_ROWS(SIZE) \
        for (i = 0; i < n; i++) { \
            if (i + FASTCKPT_AHEAD < n && (size_t)rows[i + FASTCKPT_AHEAD] < (size_t)count) { \
                __builtin_prefetch(src + rows[i + FASTCKPT_AHEAD] * stride, 0, 2); \
                __builtin_prefetch(src + rows[i + FASTCKPT_AHEAD] * stride + (SIZE) - 1, 0, 2); \
            } \
            if ((size_t)rows[i] >= (size_t)count) return i; \
            memcpy(dst + i * (SIZE), src + rows[i] * stride, (SIZE)); \
        }
    static Py_ssize_t fastckpt_take_rows(const char* src, Py_ssize_t count, Py_ssize_t stride, Py_ssize_t size,
                                         const Py_ssize_t* rows, Py_ssize_t n, char* dst) {
        Py_ssize_t i;
        switch (size) {
        case 4: FASTCKPT_ROWS(4) break;
        case 8: FASTCKPT_ROWS(8) break;
        case 16: FASTCKPT_ROWS(16) break;
        case 32: FASTCKPT_ROWS(32) break;
        case 64: FASTCKPT_ROWS(64) break;
        case 128: FASTCKPT_ROWS(128) break;
        default: FASTCKPT_ROWS(size) break;
        }
        return -1;
    }
    """
    Py_ssize_t fastckpt_take_rows(const char* src, Py_ssize_t count, Py_ssize_t stride, Py_ssize_t size,
                                  const Py_ssize_t* rows, Py_ssize_t n, char* dst) nogil

# Linux's IOV_MAX (UIO_MAXIOV); POSIX guarantees at least 16, glibc and musl say 1024.
DEF _IOV_MAX = 1024
# Pending bytes at which the writer flushes by itself: keeps each call's work bounded.
DEF _FLUSH_BYTES = 64 << 20
DEF _ZERO_BLOCK = 1 << 16
# A direct writer's stage, and the alignment of its address, length and file offset (every block size Linux
# file systems use for direct writes divides it).
DEF _STAGE_BYTES = 4 << 20
DEF _DIRECT_ALIGN = 4096
# Bytes copied into the stage between hasher updates: a step is hashed while still in the cache.
DEF _HASH_STEP = 1 << 20
cdef char _ZEROS[_ZERO_BLOCK]  # static storage: all zero, never written


cdef class GatherWriter:
    """Collect buffers and write them to ``fd`` in order, ``IOV_MAX`` per ``writev`` call.

    ``writeback``: start the kernel's write-out of the file every that many bytes (0: never; module docs).
    ``direct``: write past the page cache where the file system takes it (module docs); ``fd`` must be a new
    file at offset 0 (or any multiple of 4096), which ends where the writer's bytes end.

    ``write(obj)`` takes a C-contiguous numpy array of any dtype, or
    anything else with the buffer protocol (bytes, memoryview), and holds it,
    uncopied, until the next ``flush()``, which happens by itself every
    1024 buffers or 64 MiB. The caller must not change a buffer's contents
    before it is flushed. As a context manager it flushes on success and drops
    what is pending on an exception.
    """

    def __cinit__(self, int fd, hasher=None, Py_ssize_t writeback=0, bint direct=False):
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
        self._piece = NULL
        self._piece_size = 0
        self._direct = False
        self._stage = NULL
        self._fill = 0
        if direct:
            self._offset = lseek(fd, 0, 1)  # SEEK_CUR
            if self._offset >= 0 and self._offset % _DIRECT_ALIGN == 0:
                self._flags = fastckpt_direct_on(fd)
                self._direct = self._flags >= 0  # else: not offered here, the page cache as ever
            if self._direct:
                self._stage = fastckpt_aligned(_DIRECT_ALIGN, _STAGE_BYTES)
                if self._stage == NULL:
                    self._direct_off()
                    raise MemoryError()
                self._stage_size = _STAGE_BYTES
        self._views = <Py_buffer*>PyMem_Malloc(_IOV_MAX * sizeof(Py_buffer))
        self._iov = <iovec*>PyMem_Malloc(_IOV_MAX * sizeof(iovec))
        if self._views == NULL or self._iov == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self._views != NULL:
            self._release()
            PyMem_Free(self._views)
        PyMem_Free(self._iov)
        free(self._piece)
        free(self._stage)

    @property
    def written(self):
        """Bytes written to the descriptor so far (pending buffers, and a direct writer's stage, not included)."""
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
        cdef Py_buffer staged
        cdef Py_ssize_t n
        if self._stage != NULL:  # copied into the stage now: the caller may change obj once this returns
            if type(obj) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj):
                self._stage_in(<const char*>cnp.PyArray_DATA(<cnp.ndarray>obj), cnp.PyArray_NBYTES(<cnp.ndarray>obj),
                               False)
            else:
                PyObject_GetBuffer(obj, &staged, PyBUF_SIMPLE)
                try:
                    self._stage_in(<const char*>staged.buf, staged.len, False)
                finally:
                    PyBuffer_Release(&staged)
            return
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
        if self._stage != NULL:
            self._stage_in(NULL, n, True)
            return
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
        """Write every queued buffer, in order, then let them go. A direct writer holds no buffer of the caller's
        (each is copied as it is given): its stage is written when full, and by :meth:`finish`.

        With a hasher the bytes go out a step (about a MiB, :data:`_HASH_STEP`) at a time, each step hashed just
        before its ``writev``: the kernel's copy then reads bytes the hash has just brought into the cache, where
        hashing everything queued first (up to 64 MiB) read each byte from memory twice. Without one, one
        ``writev`` takes up to ``IOV_MAX`` buffers of any size. With ``writeback``, the write-out is started
        after each ``writeback`` bytes of a flush, not only at its end."""
        cdef int i = 0, count = self._count, n
        cdef Py_ssize_t offset = 0, step, batch, take
        if count == 0:
            return
        step = _HASH_STEP if self._hasher is not None else self._writeback if self._writeback else _FLUSH_BYTES
        try:
            while i < count:
                # the next step: whole buffers and pieces of large ones, at most IOV_MAX of them
                n, batch = 0, 0
                while i < count and n < _IOV_MAX and batch < step:
                    take = min(self._views[i].len - offset, step - batch) if self._hasher is not None \
                        else self._views[i].len - offset
                    self._iov[n].iov_base = <char*>self._views[i].buf + offset
                    self._iov[n].iov_len = <size_t>take
                    n += 1
                    batch += take
                    offset += take
                    if offset == self._views[i].len:
                        i += 1
                        offset = 0
                if self._hasher is not None:  # the bytes about to go out, in order (read-only views, no copy)
                    for k in range(n):
                        self._hasher.update(PyMemoryView_FromMemory(<char*>self._iov[k].iov_base,
                                                                    <Py_ssize_t>self._iov[k].iov_len, PyBUF_READ))
                self._writev(n, batch)
        finally:
            self._release()

    cdef int _writev(self, int count, Py_ssize_t nbytes) except -1:
        """Write ``self._iov[0:count]`` (``nbytes`` in all) whole, resuming short writes; then start the write-out
        where ``writeback`` bytes went out since it was last started."""
        cdef int start = 0
        cdef ssize_t done
        cdef int err = 0
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
                raise OSError(f"writev wrote nothing with {nbytes} bytes to write")
            self._written += done
            self._unsent += done
            nbytes -= done
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
        if self._writeback and self._unsent >= self._writeback:
            self._unsent = 0
            with nogil:
                done = fastckpt_start_writeback(self._fd)
            if done != 0:  # not offered here (ENOSYS), or not for this kind of file (ESPIPE, EINVAL): stop asking
                self._writeback = 0
        return 0

    def write_rows(self, source, rows, Py_ssize_t piece_bytes=1 << 20):
        """Write ``source[rows]`` (the rows of ``source``, an array whose rows each hold their bytes contiguously,
        in the order of ``rows``, a 1-d array of intp) after everything queued before, ``piece_bytes`` at a time
        (at least one row): each piece is gathered into the writer's own buffer (a direct writer's stage), hashed
        and written before the next is taken. A row outside ``source`` raises ``IndexError``; the pieces before
        its own are written (a direct writer's: staged, written if it is finished)."""
        cdef cnp.ndarray src, taken
        cdef Py_ssize_t count, stride, size, per, start, n, bad, k
        cdef char* base
        cdef char* into
        cdef const Py_ssize_t* index
        if type(source) is not np.ndarray or (<cnp.ndarray>source).ndim == 0:
            raise TypeError(f"source must be a numpy array of at least one axis, got {type(source).__name__}")
        src = <cnp.ndarray>source
        if type(rows) is not np.ndarray or (<cnp.ndarray>rows).ndim != 1 or (<cnp.ndarray>rows).dtype != np.intp \
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>rows):
            raise TypeError("rows must be a contiguous 1-d numpy array of intp")
        taken = <cnp.ndarray>rows
        count, stride = src.shape[0], src.strides[0]
        size = src.itemsize
        for k in range(1, src.ndim):
            size *= src.shape[k]
        n = taken.shape[0]
        if n == 0 or size == 0:
            return
        if src.ndim > 1 and count and not src[0].flags.c_contiguous:
            raise ValueError(f"each row of source must hold its bytes contiguously (strides {source.strides})")
        self.flush()
        per = min(n, max(1, piece_bytes // size))
        base = <char*>cnp.PyArray_DATA(src)
        index = <const Py_ssize_t*>cnp.PyArray_DATA(taken)
        start = 0
        while start < n:
            k = min(per, n - start)
            if self._stage != NULL:
                k = min(k, (self._stage_size - self._fill) // size)
                into = self._stage + self._fill
                if k == 0:  # the stage ends inside the next row: that row through the piece buffer
                    k = 1
                    self._piece_for(size)
                    into = self._piece
            else:
                self._piece_for(k * size)
                into = self._piece
            with nogil:
                bad = fastckpt_take_rows(base, count, stride, size, index + start, k, into)
            if bad >= 0:
                raise IndexError(f"row {index[start + bad]} of rows[{start + bad}] is outside the source's "
                                 f"{count} rows")
            if into == self._piece:
                if self._stage != NULL:
                    self._stage_in(into, size, False)
                else:
                    # SAFETY: the view is queued uncopied and written by the flush below, before the buffer is
                    # reused; the buffer lives as long as the writer
                    self.write(PyMemoryView_FromMemory(into, k * size, PyBUF_READ))
                    self.flush()
            else:  # gathered straight into the stage
                self._hash_staged(self._fill, k * size)
                self._fill += k * size
                if self._fill == self._stage_size:
                    self._stage_out(self._stage_size)
            start += k

    cdef int _piece_for(self, Py_ssize_t nbytes) except -1:
        """Make the piece buffer hold at least ``nbytes``."""
        if self._piece_size < nbytes:
            free(self._piece)
            self._piece_size = 0
            self._piece = <char*>malloc(nbytes)
            if self._piece == NULL:
                raise MemoryError()
            self._piece_size = nbytes
        return 0

    cdef int _hash_staged(self, Py_ssize_t start, Py_ssize_t n) except -1:
        if self._hasher is not None and n:
            self._hasher.update(PyMemoryView_FromMemory(self._stage + start, n, PyBUF_READ))
        return 0

    cdef int _stage_in(self, const char* data, Py_ssize_t n, bint zeros) except -1:
        """Copy ``n`` bytes (zeros if ``zeros``) into the stage, hashing each step there, writing it when full."""
        cdef Py_ssize_t step
        while n > 0:
            step = min(n, self._stage_size - self._fill, _HASH_STEP)
            with nogil:
                if zeros:
                    memset(self._stage + self._fill, 0, step)
                else:
                    memcpy(self._stage + self._fill, data, step)
                    data += step
            self._hash_staged(self._fill, step)
            self._fill += step
            n -= step
            if self._fill == self._stage_size:
                self._stage_out(self._stage_size)
        return 0

    cdef int _stage_out(self, Py_ssize_t length) except -1:
        """Write the stage's first ``length`` bytes at the writer's offset and empty it (``length`` a multiple of
        the alignment while the writer is direct)."""
        cdef Py_ssize_t done = 0
        cdef ssize_t got
        cdef int err = 0
        while done < length:
            with nogil:
                got = pwrite(self._fd, self._stage + done, length - done, self._offset + done)
                if got < 0:
                    err = errno
            if got < 0:
                if err == EINTR:
                    PyErr_CheckSignals()
                    continue
                if err == EINVAL and self._direct:  # no direct writes here after all: through the page cache
                    self._direct_off()
                    continue
                raise OSError(err, os.strerror(err))
            if got == 0:
                raise OSError(f"pwrite wrote nothing with {length - done} bytes to write")
            done += got
            if self._direct and got % _DIRECT_ALIGN:  # a short direct write: the rest, unaligned, through the cache
                self._direct_off()
        self._offset += length
        self._written += length
        self._fill = 0
        return 0

    cdef void _direct_off(self) noexcept:
        if self._direct:
            fastckpt_set_flags(self._fd, self._flags)
            self._direct = False

    def finish(self):
        """Write what is queued; a direct writer writes its stage (padded to the alignment, the file then cut back
        to the bytes written), gives the descriptor its flags back and leaves its offset at the end. Leaving the
        ``with`` block without an exception calls it."""
        cdef Py_ssize_t length, end, pad
        self.flush()
        if self._stage == NULL:
            return
        length = self._fill
        end = self._offset + length
        if length:
            pad = -length % _DIRECT_ALIGN if self._direct else 0
            if pad:
                memset(self._stage + length, 0, pad)
            self._stage_out(length + pad)
            self._written -= pad
            if pad and ftruncate(self._fd, end) != 0:
                raise OSError(errno, os.strerror(errno))
        self._offset = end
        self._direct_off()
        if lseek(self._fd, end, 0) < 0:  # SEEK_SET: the offset a writer on the descriptor continues from
            raise OSError(errno, os.strerror(errno))
        free(self._stage)
        self._stage = NULL

    def discard(self):
        """Drop every queued buffer (and a direct writer's stage) without writing it."""
        self._release()
        self._fill = 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self._release()
            self._direct_off()
        return False
