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
    cdef void _release(self) noexcept
    cpdef write(self, obj)
    cpdef write_zeros(self, Py_ssize_t n)
    cpdef flush(self)
