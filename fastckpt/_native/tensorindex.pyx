"""The index of a mapped tensor file held in columns, and the numpy views it makes in one native loop.

A file of 100,000 small tensors costs, per tensor, more in Python objects
(a ``TensorInfo``, its shape tuple, a dict of fields) than in parsing or
viewing. ``TensorIndex`` keeps what the parsers found in C arrays instead:
payload offsets and lengths, dtype codes, the dimensions of every tensor in one
array, flags (Fortran order, DEFLATE, viewable in place), plus the names and
a name -> position dict. :class:`~fastckpt.info.TensorInfo` objects are made
on first access (and kept, so that one name always gives the same object);
``view(name)`` and ``views(names, fallback)`` make numpy arrays over the
mapping straight from the columns.

``TensorIndex`` is a read-only mapping name -> ``TensorInfo`` in index order
(payload-offset order for the file parsers): it is the ``infos`` of
:class:`fastckpt.formats.reader.TensorFile`.

A view is made here only where the parser vouched for it (the ``VIEWABLE``
flag: ``nbytes == product(shape) * itemsize``, no overflow, a dtype of plain
bytes), the file is mapped (not ``backend="pread"``) and still open, and the
payload lies inside the mapping; for anything else ``view`` returns None and
the caller takes its general path, which raises the usual errors.

>>> import os, tempfile, numpy as np
>>> from fastckpt._native.mapped import MappedFile
>>> from fastckpt.info import TensorInfo
>>> p = os.path.join(tempfile.mkdtemp(), "raw.bin")
>>> with open(p, "wb") as f:
...     _ = f.write(np.arange(6, dtype="<i2").tobytes())
>>> index = TensorIndex.from_infos(MappedFile(p), [TensorInfo("w", np.dtype("<i2"), (2, 3), 0, 12)])
>>> list(index), index["w"].shape, index.view("w").tolist(), index.view("nope")
(['w'], (2, 3), [[0, 1, 2], [3, 4, 5]], None)
"""

from collections.abc import ItemsView, KeysView, Mapping, ValuesView

from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp

import numpy as np

from fastckpt._native.mapped cimport MappedFile, _Block, _Descr, _new_array, poisoned
from fastckpt.info import TensorInfo

_new = object.__new__
_set = object.__setattr__

# The bits of the ``flags`` column that :meth:`TensorIndex.columns` returns (tensorindex.pxd).
FLAG_FORTRAN_ORDER = FORTRAN_ORDER
FLAG_DEFLATE = DEFLATE
FLAG_VIEWABLE = VIEWABLE

cnp.import_array()

cdef extern from "Python.h":
    dict _PyDict_NewPresized(Py_ssize_t minused)  # room for minused items without resizing
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL  # no copy for ASCII text

DEF _MAX_DIMS = 32  # as MappedFile.array: more dimensions take its path, which says why not


cdef void* _grown(void* block, Py_ssize_t count, size_t item) except NULL:
    cdef void* p
    if count > (<Py_ssize_t>0x7FFFFFFFFFFFFFFF) // <Py_ssize_t>item // 2:
        raise MemoryError("the tensor index is too large")
    p = PyMem_Realloc(block, <size_t>count * item)
    if p == NULL:
        raise MemoryError()
    return p


cdef inline uint64_t _hash(const char* data, Py_ssize_t n) noexcept:
    """A multiplicative hash of the bytes, eight at a time; low bits pick a slot, high bits are the slot's tag."""
    cdef uint64_t h = 0x9E3779B97F4A7C15ULL ^ <uint64_t>n
    cdef uint64_t word
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        memcpy(&word, data + i, 8)
        h = (h ^ word) * 0xFF51AFD7ED558CCDULL
        h ^= h >> 32
        i += 8
    if i < n:
        word = 0
        memcpy(&word, data + i, <size_t>(n - i))
        h = (h ^ word) * 0xC4CEB9FE1A85EC53ULL
    h ^= h >> 29
    h *= 0xFF51AFD7ED558CCDULL
    return h ^ (h >> 32)


# A name-table slot: the high half of the name's hash (compared before the name), and its position + 1.
cdef uint64_t _TAG = 0xFFFFFFFF00000000ULL
cdef uint64_t _POSITION = 0x00000000FFFFFFFFULL


cdef bytes _utf8_of(str name):
    """The UTF-8 bytes of ``name``; a lone surrogate (never in a parsed file, maybe in a caller's name) kept as is."""
    return name.encode("utf-8", "surrogatepass")


cdef object view_in_block(_Block block, object dtype, int nd, cnp.npy_intp* dims, int64_t offset,
                          bint fortran_order):
    """An array of ``dtype`` and shape ``dims[:nd]`` over ``block``'s bytes from ``offset``, writable where the
    mapping is. The caller has checked that the block holds the array's bytes there."""
    cdef int array_flags = cnp.NPY_ARRAY_F_CONTIGUOUS if fortran_order else cnp.NPY_ARRAY_C_CONTIGUOUS
    if block.fault_message is not None or block.cell != NULL:
        poisoned(block)  # a guarded read met a truncation: a view made now would read zeros as the file's bytes
    if block.writable:
        array_flags |= cnp.NPY_ARRAY_WRITEABLE
    # SAFETY: the array points into the mapping, which the caller checked holds its bytes; its base holds the
    # block that owns the mapping, so the pages stay mapped for as long as the array (or any view of it) lives.
    Py_INCREF(dtype)  # PyArray_NewFromDescr steals a reference to the descriptor
    arr = _new_array(<PyTypeObject*>np.ndarray, <_Descr*>dtype, nd, dims, NULL, <void*>(block.ptr + offset),
                     array_flags, NULL)
    cnp.set_array_base(arr, block)
    return arr


cdef class TensorIndex:
    """The columns of a tensor file's index; a read-only mapping name -> ``TensorInfo`` made on access.

    Made by the parsers (``fastckpt._native.safetensors.read_safetensors_table``)
    or from a list of infos with :meth:`from_infos`.

    >>> import os, tempfile, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> from fastckpt.formats.safetensors import save_safetensors
    >>> from fastckpt._native.safetensors import read_safetensors_table
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_safetensors(p, {"a": np.ones(2, np.float32), "b": np.zeros((1, 2), np.int8)}, alignment=64)
    >>> index, metadata, data_start = read_safetensors_table(MappedFile(p))
    >>> len(index), index["b"].shape, index["b"].offset, index.data_region(), index.total_nbytes()
    (2, (1, 2), 136, (128, 138), 10)
    >>> {k: v.tolist() for k, v in index.views(None, None).items()}
    {'a': [1.0, 1.0], 'b': [[0, 0]]}
    """

    def __cinit__(self):
        self.offsets = NULL
        self.nbytes = NULL
        self.dtype_codes = NULL
        self.shape_at = NULL
        self.dims = NULL
        self.flags = NULL
        self.name_bytes = NULL
        self.name_start = NULL
        self.name_len = NULL
        self.hashes = NULL
        self.table = NULL
        self.table_mask = -1
        self.extras = NULL
        self.n_extra = 0
        self.extra_fields = ()
        self.count = self.capacity = self.dims_count = self.dims_capacity = 0
        self.name_bytes_count = self.name_bytes_capacity = 0

    def __init__(self):
        raise TypeError("TensorIndex objects are made by the parsers, or with TensorIndex.from_infos(mapped, infos)")

    def __dealloc__(self):
        PyMem_Free(self.offsets)
        PyMem_Free(self.nbytes)
        PyMem_Free(self.dtype_codes)
        PyMem_Free(self.shape_at)
        PyMem_Free(self.dims)
        PyMem_Free(self.flags)
        PyMem_Free(self.name_bytes)
        PyMem_Free(self.name_start)
        PyMem_Free(self.name_len)
        PyMem_Free(self.hashes)
        PyMem_Free(self.table)
        PyMem_Free(self.extras)

    # -- building (the parsers) -------------------------------------------------------------------

    cdef int _setup(self, MappedFile mapped, list dtypes, object info_type, tuple extra_fields=()) except -1:
        self.mapped = mapped
        self.dtypes = dtypes
        self.info_type = info_type
        self.extra_fields = extra_fields
        self.n_extra = len(extra_fields)
        self.names = []
        self._infos = []
        self.reserve(16, 16)
        self.shape_at[0] = 0
        self._index_names(32)
        return 0

    cdef int reserve(self, Py_ssize_t tensors, Py_ssize_t dims) except -1:
        """Room for ``tensors`` more tensors and ``dims`` more dimensions."""
        cdef Py_ssize_t want
        if self.count + tensors > self.capacity:
            want = max(2 * self.capacity, self.count + tensors)
            self.offsets = <int64_t*>_grown(self.offsets, want, sizeof(int64_t))
            self.nbytes = <int64_t*>_grown(self.nbytes, want, sizeof(int64_t))
            self.dtype_codes = <int32_t*>_grown(self.dtype_codes, want, sizeof(int32_t))
            self.shape_at = <int64_t*>_grown(self.shape_at, want + 1, sizeof(int64_t))
            self.flags = <uint8_t*>_grown(self.flags, want, sizeof(uint8_t))
            self.name_start = <int64_t*>_grown(self.name_start, want, sizeof(int64_t))
            self.name_len = <int64_t*>_grown(self.name_len, want, sizeof(int64_t))
            self.hashes = <uint64_t*>_grown(self.hashes, want, sizeof(uint64_t))
            if self.n_extra:
                self.extras = <int64_t*>_grown(self.extras, want * self.n_extra, sizeof(int64_t))
            self.capacity = want
        if self.dims_count + dims > self.dims_capacity:
            want = max(2 * self.dims_capacity, self.dims_count + dims)
            self.dims = <cnp.npy_intp*>_grown(self.dims, want, sizeof(cnp.npy_intp))
            self.dims_capacity = want
        return 0

    cdef int add_dim(self, cnp.npy_intp dim) except -1:
        """One more dimension of the tensor that the next ``add`` adds."""
        if self.dims_count == self.dims_capacity:
            self.reserve(0, 1)
        self.dims[self.dims_count] = dim
        self.dims_count += 1
        return 0

    cdef int _index_names(self, Py_ssize_t size) except -1:
        """(Re)build the name table with ``size`` slots (a power of two) from the hashes of the names."""
        cdef Py_ssize_t i, slot
        cdef uint64_t* table = <uint64_t*>_grown(NULL, size, sizeof(uint64_t))
        memset(table, 0, <size_t>size * sizeof(uint64_t))
        PyMem_Free(self.table)
        self.table, self.table_mask = table, size - 1
        for i in range(self.count):
            slot = <Py_ssize_t>(self.hashes[i] & <uint64_t>self.table_mask)
            while table[slot]:
                slot = (slot + 1) & self.table_mask
            table[slot] = (self.hashes[i] & _TAG) | <uint64_t>(i + 1)
        return 0

    cdef Py_ssize_t _probe(self, uint64_t h, const char* utf8, Py_ssize_t n, Py_ssize_t* slot) noexcept:
        """The position of the name of hash ``h`` and UTF-8 bytes ``utf8[:n]``, or -1 when it is not in; ``slot``
        gets its slot in the name table, or the empty slot where it would go."""
        cdef uint64_t entry
        cdef Py_ssize_t j
        cdef Py_ssize_t s = <Py_ssize_t>(h & <uint64_t>self.table_mask)
        while self.table[s]:
            entry = self.table[s]
            j = <Py_ssize_t>(entry & _POSITION) - 1
            if (entry & _TAG) == (h & _TAG) and self.name_len[j] == n and memcmp(
                    self.name_bytes + self.name_start[j], utf8, <size_t>n) == 0:
                slot[0] = s
                return j
            s = (s + 1) & self.table_mask
        slot[0] = s
        return -1

    cdef int add(self, str name, const char* utf8, Py_ssize_t utf8_len, int32_t dtype_code, int64_t offset,
                 int64_t nbytes, uint8_t flags) except -1:
        """Add a tensor (``utf8``: its name's UTF-8 bytes) whose dimensions ``add_dim`` gave; 1 (and nothing
        added) when ``name`` is already in."""
        cdef uint64_t h = _hash(utf8, utf8_len)
        cdef Py_ssize_t slot, want
        if self.count >= 0x7FFFFFFE:
            raise MemoryError("a tensor index holds fewer than 2**31 tensors")
        if 2 * (self.count + 1) > self.table_mask + 1:
            self._index_names(2 * (self.table_mask + 1))
        if self._probe(h, utf8, utf8_len, &slot) >= 0:
            self.dims_count = self.shape_at[self.count]  # drop the dimensions given for it
            return 1
        if self.count == self.capacity:
            self.reserve(1, 0)
        if utf8_len > self.name_bytes_capacity - self.name_bytes_count:
            want = max(2 * self.name_bytes_capacity, self.name_bytes_count + utf8_len, 256)
            self.name_bytes = <char*>_grown(self.name_bytes, want, 1)
            self.name_bytes_capacity = want
        memcpy(self.name_bytes + self.name_bytes_count, utf8, <size_t>utf8_len)
        self.name_start[self.count] = self.name_bytes_count
        self.name_len[self.count] = utf8_len
        self.name_bytes_count += utf8_len
        self.hashes[self.count] = h
        self.table[slot] = (h & _TAG) | <uint64_t>(self.count + 1)
        self.names.append(name)
        self._infos.append(None)
        self.offsets[self.count] = offset
        self.nbytes[self.count] = nbytes
        self.dtype_codes[self.count] = dtype_code
        self.flags[self.count] = flags
        self.count += 1
        self.shape_at[self.count] = self.dims_count
        return 0

    cdef int finish(self) except -1:
        """Called by a parser when every tensor is in (nothing left to do: kept for the parsers' symmetry)."""
        return 0

    cdef int keep_info(self, object info) except -1:
        """Give the last tensor added its info object: ``index[name]`` returns it (a shape the columns cannot
        hold, say)."""
        self._infos[self.count - 1] = info
        return 0

    cdef int reorder(self, list order) except -1:
        """Put the tensors in the order of ``order`` (a permutation of their positions)."""
        cdef Py_ssize_t n = self.count, i, j, k, at = 0
        cdef int64_t* offsets = NULL
        cdef int64_t* nbytes = NULL
        cdef int64_t* shape_at = NULL
        cdef int32_t* codes = NULL
        cdef uint8_t* flags = NULL
        cdef cnp.npy_intp* dims = NULL
        cdef int64_t* name_start = NULL
        cdef int64_t* name_len = NULL
        cdef uint64_t* hashes = NULL
        cdef int64_t* extras = NULL
        if len(order) != n:
            raise ValueError(f"reorder needs {n} positions, got {len(order)}")
        try:
            offsets = <int64_t*>_grown(NULL, max(n, 1), sizeof(int64_t))
            nbytes = <int64_t*>_grown(NULL, max(n, 1), sizeof(int64_t))
            shape_at = <int64_t*>_grown(NULL, n + 1, sizeof(int64_t))
            codes = <int32_t*>_grown(NULL, max(n, 1), sizeof(int32_t))
            flags = <uint8_t*>_grown(NULL, max(n, 1), sizeof(uint8_t))
            dims = <cnp.npy_intp*>_grown(NULL, max(self.dims_count, 1), sizeof(cnp.npy_intp))
            name_start = <int64_t*>_grown(NULL, max(n, 1), sizeof(int64_t))
            name_len = <int64_t*>_grown(NULL, max(n, 1), sizeof(int64_t))
            hashes = <uint64_t*>_grown(NULL, max(n, 1), sizeof(uint64_t))
            if self.n_extra:
                extras = <int64_t*>_grown(NULL, max(n, 1) * self.n_extra, sizeof(int64_t))
            names = []
            infos = []
            shape_at[0] = 0
            for i in range(n):
                j = order[i]
                if j < 0 or j >= n:
                    raise ValueError(f"reorder: position {j} out of range")
                offsets[i], nbytes[i], codes[i], flags[i] = (self.offsets[j], self.nbytes[j], self.dtype_codes[j],
                                                             self.flags[j])
                name_start[i], name_len[i], hashes[i] = self.name_start[j], self.name_len[j], self.hashes[j]
                for k in range(self.n_extra):
                    extras[i * self.n_extra + k] = self.extras[j * self.n_extra + k]
                infos.append(self._infos[j])
                for k in range(self.shape_at[j], self.shape_at[j + 1]):
                    dims[at] = self.dims[k]
                    at += 1
                shape_at[i + 1] = at
                names.append(self.names[j])
            self.offsets, offsets = offsets, self.offsets
            self.nbytes, nbytes = nbytes, self.nbytes
            self.shape_at, shape_at = shape_at, self.shape_at
            self.dtype_codes, codes = codes, self.dtype_codes
            self.flags, flags = flags, self.flags
            self.dims, dims = dims, self.dims
            self.name_start, name_start = name_start, self.name_start
            self.name_len, name_len = name_len, self.name_len
            self.hashes, hashes = hashes, self.hashes
            if self.n_extra:
                self.extras, extras = extras, self.extras
            self.capacity = max(n, 1)
            self.dims_capacity = max(self.dims_count, 1)
            self.names = names
            self._infos = infos
            self._index_names(self.table_mask + 1)
        finally:
            PyMem_Free(offsets)
            PyMem_Free(nbytes)
            PyMem_Free(shape_at)
            PyMem_Free(codes)
            PyMem_Free(flags)
            PyMem_Free(dims)
            PyMem_Free(name_start)
            PyMem_Free(name_len)
            PyMem_Free(hashes)
            PyMem_Free(extras)
        return 0

    @staticmethod
    def from_infos(MappedFile mapped not None, infos):
        """The index of ``infos`` (``TensorInfo`` objects, unique names) as they are ordered, over ``mapped``.

        The infos themselves are kept: ``index[name]`` returns the very object.
        """
        cdef TensorIndex index = TensorIndex.__new__(TensorIndex)
        cdef dict codes = {}
        cdef Py_ssize_t nbytes, dim
        cdef uint8_t flags
        cdef bint fits
        index._setup(mapped, [], TensorInfo)
        for info in infos:
            dtype = info.dtype
            code = codes.get(dtype)
            if code is None:
                code = codes[dtype] = len(index.dtypes)
                index.dtypes.append(dtype)
            shape = info.shape
            fits = not dtype.hasobject and type(shape) is tuple and len(shape) <= _MAX_DIMS
            nbytes = dtype.itemsize
            if fits:
                for d in shape:
                    if type(d) is not int or d < 0 or d > 0x7FFFFFFFFFFFFFFF:
                        fits = False
                        break
                    dim = d
                    if dim != 0 and nbytes > 0x7FFFFFFFFFFFFFFF // dim:
                        fits = False
                        break
                    nbytes *= dim
                    index.add_dim(dim)
            if not fits:
                index.dims_count = index.shape_at[index.count]
            flags = FORTRAN_ORDER if info.fortran_order else 0
            if info.compression is not None:
                flags |= DEFLATE
            elif fits and nbytes == info.nbytes and 0 <= info.offset <= 0x7FFFFFFFFFFFFFFF and info.packed is None:
                flags |= VIEWABLE
            name = info.name
            utf8 = _utf8_of(name)
            if index.add(name, utf8, len(utf8), code, info.offset if flags & VIEWABLE else 0,
                         info.nbytes if flags & VIEWABLE else 0, flags):
                raise ValueError(f"{mapped.path}: tensor {info.name!r} is listed twice")
            index.keep_info(info)
        return index

    # -- reading ----------------------------------------------------------------------------------

    cdef Py_ssize_t position(self, object name) except -2:
        """The position of ``name``, or -1 when it is not in (or not a str at all)."""
        cdef const char* utf8
        cdef Py_ssize_t n, slot
        if not isinstance(name, str):
            return -1
        try:
            utf8 = PyUnicode_AsUTF8AndSize(name, &n)
        except UnicodeEncodeError:  # a lone surrogate
            encoded = _utf8_of(name)
            utf8, n = encoded, len(encoded)
        return self._probe(_hash(utf8, n), utf8, n, &slot)

    cdef object view_at(self, Py_ssize_t i):
        """The array of tensor ``i`` over the mapping, or None where the general path must make it."""
        cdef MappedFile m = self.mapped
        cdef _Block block = m._block  # None once closed, and for the pread backend
        cdef uint8_t f = self.flags[i]
        cdef int64_t offset = self.offsets[i]
        cdef int64_t nbytes = self.nbytes[i]
        cdef int64_t start = self.shape_at[i]
        cdef int nd = <int>(self.shape_at[i + 1] - start)
        if block is None or block.ptr == NULL or not (f & VIEWABLE) or nd > _MAX_DIMS:
            return None
        if offset < 0 or nbytes < 0 or offset > block.size or nbytes > block.size - offset:
            return None
        # SAFETY: checked above: the mapping holds the tensor's nbytes (product of dims times itemsize, vouched
        # for by the parser)
        return view_in_block(block, self.dtypes[self.dtype_codes[i]], nd, self.dims + start, offset,
                             f & FORTRAN_ORDER)

    cdef object info_at(self, Py_ssize_t i):
        cdef Py_ssize_t k
        info = self._infos[i]
        if info is None:
            shape = tuple([self.dims[k] for k in range(self.shape_at[i], self.shape_at[i + 1])])
            info = _new(self.info_type)  # fastckpt.info.from_checked_fields, without its call
            _set(info, "__dict__", {
                "name": self.names[i], "dtype": self.dtypes[self.dtype_codes[i]], "shape": shape,
                "offset": self.offsets[i], "nbytes": self.nbytes[i],
                "fortran_order": bool(self.flags[i] & FORTRAN_ORDER),
                "compression": "deflate" if self.flags[i] & DEFLATE else None})
            for k in range(self.n_extra):
                info.__dict__[self.extra_fields[k]] = self.extras[i * self.n_extra + k]
            self._infos[i] = info
        return info

    def view(self, name):
        """A numpy array of tensor ``name`` over the mapping, or None (unknown name, or not viewable here)."""
        cdef Py_ssize_t i = self.position(name)
        return None if i < 0 else self.view_at(i)

    def views(self, names, fallback):
        """``{name: array}`` for ``names`` (every tensor, in index order, when None).

        Arrays are made over the mapping in one loop; a tensor that cannot be
        viewed here, or an unknown name, is ``fallback(name)`` (which raises
        for an unknown name).
        """
        cdef dict out
        cdef Py_ssize_t i
        cdef list all_names = self.names
        if names is None:
            out = _PyDict_NewPresized(self.count)
            for i in range(self.count):
                arr = self.view_at(i)
                if arr is None:
                    arr = fallback(all_names[i])
                out[all_names[i]] = arr
            return out
        if isinstance(names, (str, bytes)):
            raise TypeError(f"names must be a collection of tensor names, got the single name {names!r}; "
                            f"pass [{names!r}]")
        out = {}
        for name in names:
            i = self.position(name)
            arr = None if i < 0 else self.view_at(i)
            if arr is None:
                arr = fallback(name)
            out[name] = arr
        return out

    def columns(self):
        """The index's columns, copied into numpy arrays (index order): a dict of

        ``offsets``, ``nbytes`` (int64: each payload's absolute offset and stored
        length), ``flags`` (uint8: the bits ``FLAG_FORTRAN_ORDER``, ``FLAG_DEFLATE``,
        ``FLAG_VIEWABLE``), ``dtype_codes`` (int32, numbering ``dtypes``, a list of
        numpy dtypes), ``shape_at`` (int64, one more than the tensors) and ``dims``
        (intp): tensor ``i``'s shape is ``dims[shape_at[i]:shape_at[i + 1]]``.
        Where ``FLAG_VIEWABLE`` is not set, offset and length are 0 and the shape
        may be missing: ask the info (``index[name]``). A load plans 100,000
        tensors from these without a ``TensorInfo`` for any, and without holding
        the index (or its mapping) afterwards.

        >>> import os, tempfile
        >>> from fastckpt._native.mapped import MappedFile
        >>> from fastckpt.info import TensorInfo
        >>> p = os.path.join(tempfile.mkdtemp(), "raw.bin")
        >>> with open(p, "wb") as f:
        ...     _ = f.write(bytes(16))
        >>> index = TensorIndex.from_infos(MappedFile(p), [TensorInfo("a", np.dtype("<i2"), (3,), 2, 6),
        ...                                                TensorInfo("b", np.dtype("u1"), (2, 2), 8, 4)])
        >>> c = index.columns()
        >>> [c[k].tolist() for k in ("offsets", "nbytes", "flags", "dtype_codes", "shape_at", "dims")]
        [[2, 8], [6, 4], [4, 4], [0, 1], [0, 1, 3], [3, 2, 2]]
        >>> c["dtypes"]
        [dtype('int16'), dtype('uint8')]
        """
        cdef Py_ssize_t n = self.count
        offsets = np.empty(n, np.int64)
        nbytes = np.empty(n, np.int64)
        flags = np.empty(n, np.uint8)
        codes = np.empty(n, np.int32)
        shape_at = np.empty(n + 1, np.int64)
        dims = np.empty(self.dims_count, np.intp)
        cdef int64_t[::1] o = offsets
        cdef int64_t[::1] b = nbytes
        cdef uint8_t[::1] f = flags
        cdef int32_t[::1] c = codes
        cdef int64_t[::1] at = shape_at
        cdef cnp.npy_intp[::1] d = dims
        if n:
            memcpy(&o[0], self.offsets, <size_t>n * sizeof(int64_t))
            memcpy(&b[0], self.nbytes, <size_t>n * sizeof(int64_t))
            memcpy(&f[0], self.flags, <size_t>n * sizeof(uint8_t))
            memcpy(&c[0], self.dtype_codes, <size_t>n * sizeof(int32_t))
        memcpy(&at[0], self.shape_at, <size_t>(n + 1) * sizeof(int64_t))
        if self.dims_count:
            memcpy(&d[0], self.dims, <size_t>self.dims_count * sizeof(cnp.npy_intp))
        return {"offsets": offsets, "nbytes": nbytes, "flags": flags, "dtype_codes": codes, "shape_at": shape_at,
                "dims": dims, "dtypes": list(self.dtypes)}

    def info_list(self):
        """Every ``TensorInfo``, in index order."""
        cdef Py_ssize_t i
        return [self.info_at(i) for i in range(self.count)]

    def data_region(self):
        """``(start, end)``: the smallest byte range holding every uncompressed payload; ``(0, 0)`` if none."""
        cdef Py_ssize_t i
        cdef int64_t start = 0, end = 0
        cdef bint any_ = False
        for i in range(self.count):
            if self.flags[i] & DEFLATE:
                continue
            if not (self.flags[i] & VIEWABLE):  # columns left empty: ask the info
                info = self.info_at(i)
                s, e = info.offset, info.offset + info.nbytes
            else:
                s, e = self.offsets[i], self.offsets[i] + self.nbytes[i]
            if not any_ or s < start:
                start = s
            if not any_ or e > end:
                end = e
            any_ = True
        return (start, end)

    def total_nbytes(self):
        """The sum of every payload's stored length."""
        cdef Py_ssize_t i
        cdef object total = 0
        cdef int64_t run = 0
        for i in range(self.count):
            if self.flags[i] & VIEWABLE:
                if run > 0x3FFFFFFFFFFFFFFF - self.nbytes[i]:
                    total += run
                    run = 0
                run += self.nbytes[i]
            else:
                total += self.info_at(i).nbytes
        return total + run

    # -- the mapping name -> TensorInfo ------------------------------------------------------------

    def __getitem__(self, name):
        cdef Py_ssize_t i = self.position(name)
        if i < 0:
            hash(name)  # an unhashable key raises TypeError, as a dict's lookup does
            raise KeyError(name)
        return self.info_at(i)

    def get(self, name, default=None):
        cdef Py_ssize_t i = self.position(name)
        if i < 0:
            hash(name)
            return default
        return self.info_at(i)

    def __contains__(self, name):
        if self.position(name) >= 0:
            return True
        hash(name)
        return False

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return self.count

    def keys(self):
        return KeysView(self)

    def values(self):
        return _Values(self)

    def items(self):
        return _Items(self)

    def __eq__(self, other):
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None

    def __reduce__(self):
        raise TypeError("a TensorIndex holds a mapped file and cannot be pickled; pickle dict(index) instead")

    def __repr__(self):
        return f"<TensorIndex of {self.count} tensors>"


Mapping.register(TensorIndex)


class _Values(ValuesView):
    """``index.values()``: iterated by the index's own loop (a Python generator per info costs as much as the info)."""

    __slots__ = ()

    def __iter__(self):
        return iter(self._mapping.info_list())


class _Items(ItemsView):
    """``index.items()``, iterated as ``_Values``."""

    __slots__ = ()

    def __iter__(self):
        return zip(iter(self._mapping), self._mapping.info_list())
