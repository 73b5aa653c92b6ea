# The columnar tensor index that the parsers fill (see tensorindex.pyx).
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from fastckpt._native.mapped cimport MappedFile

# Bits of TensorIndex.flags[i].
cdef enum:
    FORTRAN_ORDER = 1   # the payload is in Fortran (column-major) order
    DEFLATE = 2         # compressed: info.compression is "deflate", no view in place
    VIEWABLE = 4        # the parser vouches: nbytes == product(shape) * itemsize, no overflow, dtype of plain bytes


from fastckpt._native.mapped cimport _Block


cdef object view_in_block(_Block block, object dtype, int nd, cnp.npy_intp* dims, int64_t offset,
                          bint fortran_order)


cdef class TensorIndex:
    cdef readonly MappedFile mapped
    cdef readonly object info_type
    cdef readonly Py_ssize_t count
    cdef Py_ssize_t capacity
    cdef Py_ssize_t dims_count
    cdef Py_ssize_t dims_capacity
    cdef list names              # str per tensor, in index order
    # name -> position: an open-addressing table over the names' UTF-8 bytes (copied into name_bytes)
    cdef char* name_bytes
    cdef Py_ssize_t name_bytes_count
    cdef Py_ssize_t name_bytes_capacity
    cdef int64_t* name_start
    cdef int64_t* name_len
    cdef uint64_t* hashes
    cdef uint64_t* table         # high half of the hash | position + 1; 0 for an empty slot
    cdef Py_ssize_t table_mask   # table size - 1 (a power of two, at least twice count)
    cdef list dtypes             # the numpy dtypes that dtype_codes number
    cdef list _infos             # TensorInfo made on access (or given), else None
    cdef tuple extra_fields      # names of the info_type's int fields after TensorInfo's (NPZ: crc32, ...)
    cdef Py_ssize_t n_extra
    cdef int64_t* extras         # count x n_extra values of those fields
    cdef int64_t* offsets        # absolute payload offset
    cdef int64_t* nbytes         # stored payload length
    cdef int32_t* dtype_codes
    cdef int64_t* shape_at       # count + 1 entries: tensor i's dimensions are dims[shape_at[i]:shape_at[i + 1]]
    cdef cnp.npy_intp* dims
    cdef uint8_t* flags
    cdef int _setup(self, MappedFile mapped, list dtypes, object info_type, tuple extra_fields=*) except -1
    cdef int keep_info(self, object info) except -1
    cdef int reserve(self, Py_ssize_t tensors, Py_ssize_t dims) except -1
    cdef int add_dim(self, cnp.npy_intp dim) except -1
    cdef Py_ssize_t _probe(self, uint64_t h, const char* utf8, Py_ssize_t n, Py_ssize_t* slot) noexcept
    cdef int add(self, str name, const char* utf8, Py_ssize_t utf8_len, int32_t dtype_code, int64_t offset,
                 int64_t nbytes, uint8_t flags) except -1
    cdef int _index_names(self, Py_ssize_t size) except -1
    cdef int finish(self) except -1
    cdef int reorder(self, list order) except -1
    cdef object view_at(self, Py_ssize_t i)
    cdef object info_at(self, Py_ssize_t i)
    cdef Py_ssize_t position(self, object name) except -2
