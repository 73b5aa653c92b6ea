# Declarations shared by the Cython parsers: they read a file through
# MappedFile.span(), which bounds-checks every request.
from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport uint8_t

cimport numpy as cnp


# numpy's array constructor over memory it does not own (the views of mapped.pyx and tensorindex.pyx), declared
# with raw pointers: the call steals a reference to ``descr``, which callers take by hand.
cdef extern from "numpy/arrayobject.h":
    ctypedef struct _Descr "PyArray_Descr":
        pass
    object _new_array "PyArray_NewFromDescr" (PyTypeObject* subtype, _Descr* descr, int nd,
                                             cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                             int flags, PyObject* obj)


cdef class _Block:
    cdef uint8_t* ptr
    cdef Py_ssize_t size
    cdef bint is_mmap
    cdef bint writable
    cdef void* cell            # the SIGBUS guard's record of the mapping while guards > 0, else NULL
    cdef Py_ssize_t guards     # guards open over the mapping, in every thread (MappedFile.guard)
    cdef Py_ssize_t fault_offset  # the first byte a guarded read found gone from the file, else -1
    cdef object fault_message  # the FormatError's text once a guarded read met a truncation, else None
    cdef object fault_path     # the path the mapping's guards name


# The truncation guard of MappedFile.guard() for native loops that read a mapping: enter (``hold`` receives this
# thread's hold), read, exit (which raises FormatError where the file was truncated under the reads).
cdef int guard_check() except -1
cdef int guard_enter(_Block b, object path, object what, void** hold, int check=*) except -1
cdef int guard_exit(_Block b, void* hold, object path, object what) except -1
# Raises the mapping's FormatError once a guarded read met a truncation in it: every view made after that.
cdef int poisoned(_Block b) except -1


cdef class MappedFile:
    cdef readonly object path
    cdef readonly str backend
    cdef readonly bint copy_on_write
    cdef readonly Py_ssize_t size
    cdef readonly tuple identity
    cdef _Block _block
    cdef int _fd
    cdef uint8_t* _scratch
    cdef Py_ssize_t _scratch_cap
    cdef bint _closed
    cdef Py_ssize_t _reads_in_flight
    cdef void _release_fd(self) noexcept
    cdef int _check(self, Py_ssize_t offset, Py_ssize_t length, object what) except -1
    cdef int _pread_into(self, uint8_t* dst, Py_ssize_t offset, Py_ssize_t length, object what) except -1
    # The pointer stays valid, for the mmap backend, while the caller holds a reference to _block
    # (close() in another thread drops only the handle's own), and, for the pread backend, until the
    # next span() call: parsers use it from one thread at a time.
    cdef const uint8_t* span(self, Py_ssize_t offset, Py_ssize_t length, object what) except NULL


# Kept memory (see mapped.pyx): buffers from 2 MiB on kept when freed for the next of their size, one list for the
# process. Both hold the GIL, which guards the list. ``zero``: every byte of the buffer zero.
cdef void* kept_alloc(size_t nbytes, bint zero) noexcept
cdef void kept_free(void* p, size_t nbytes) noexcept
