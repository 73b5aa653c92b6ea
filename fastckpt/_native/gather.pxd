# Gathered zero-copy writes (see gather.pyx).
cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len


cdef class GatherWriter:
    cdef int _fd
    cdef int _count
    cdef Py_ssize_t _pending
    cdef Py_ssize_t _written
    cdef Py_ssize_t _writeback
    cdef Py_ssize_t _unsent
    cdef Py_buffer* _views
    cdef iovec* _iov
    cdef list _keep
    cdef object _hasher
    cdef char* _piece
    cdef Py_ssize_t _piece_size
    cdef bint _direct
    cdef int _flags
    cdef char* _stage
    cdef Py_ssize_t _stage_size
    cdef Py_ssize_t _fill
    cdef Py_ssize_t _offset
    cdef int _piece_for(self, Py_ssize_t nbytes) except -1
    cdef int _writev(self, int count, Py_ssize_t nbytes) except -1
    cdef int _stage_in(self, const char* data, Py_ssize_t n, bint zeros) except -1
    cdef int _stage_out(self, Py_ssize_t length) except -1
    cdef int _hash_staged(self, Py_ssize_t start, Py_ssize_t n) except -1
    cdef void _direct_off(self) noexcept
    cdef void _release(self) noexcept
    cpdef write(self, obj)
    cpdef write_zeros(self, Py_ssize_t n)
    cpdef flush(self)
