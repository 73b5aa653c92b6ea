# The .npy header parser's entry points for the NPZ parser (see _npy.pyx). They are C calls: the
# NPZ parser makes one for every member, where a Python-level call would cost a good part of the
# member's few microseconds.

# The header's total length (magic included) from its first 10 or 12 bytes; checks the magic,
# the version and the size cap. Raises FormatError, its message prefixed by where.
cdef Py_ssize_t npy_total_length(bytes data, where, max_header_size) except -1

# (dtype, shape, fortran_order, total) of the header at the start of data, whose total length
# npy_total_length gave. Raises FormatError, its message prefixed by where.
cdef tuple parse_npy(bytes data, Py_ssize_t total, where, max_header_size)
