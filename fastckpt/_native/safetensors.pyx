"""Validating parser of safetensors headers (the spec is in ``fastckpt/formats/safetensors.py``).

``read_safetensors_index(m)`` reads the 8-byte length, checks the JSON
header byte by byte (bounds, ``{``, JSON-whitespace padding, UTF-8) and
parses it with the standard library's C JSON decoder; then it checks every
entry and the offsets with 64-bit arithmetic that refuses to overflow. Every
byte comes through ``MappedFile.span()``, which is bounds-checked, so a
damaged file raises :class:`fastckpt.errors.FormatError` and is never read
past its end.

The writer's per-tensor work is here too (``plan_tensors``, ``header_text``,
``write_tensors``): a model can have thousands of small tensors, and in
Python these steps cost more than writing their bytes.

The dtype table lives here because the parser is what decides which files
fastckpt can read; ``fastckpt.formats.safetensors`` re-exports it as
``dtype_from_safetensors`` / ``dtype_to_safetensors``.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from "Python.h":
    ctypedef struct PyObject
    PyObject* PyDict_GetItem(object mapping, object key)  # borrowed, NULL when absent; never raises
    bint PyUnicode_IS_ASCII(object text)
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL
    const Py_ssize_t PY_SSIZE_T_MAX

cimport numpy as cnp

import json

import ml_dtypes
import numpy as np

from fastckpt.info import PackedTensorInfo, TensorInfo, from_checked_fields
from fastckpt._native.gather cimport GatherWriter
from fastckpt._native.mapped cimport MappedFile
from fastckpt._native.tensorindex cimport VIEWABLE, TensorIndex
from fastckpt.errors import FormatError

cnp.import_array()

# The safetensors spec caps the JSON header at 100 MB (MAX_HEADER_SIZE in safetensors/src/tensor.rs).
MAX_HEADER_SIZE = 100_000_000
cdef int64_t _MAX_HEADER_SIZE = MAX_HEADER_SIZE
cdef int64_t _INT64_MAX = 0x7FFFFFFFFFFFFFFF

# Every dtype of the reference implementation, in its declaration order. The
# reference writer orders tensors by this rank, descending, then by name;
# fastckpt's writer does the same (see save_safetensors in fastckpt/formats/safetensors.py).
DTYPE_NAMES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
    "C64", "F64", "I64", "U64",
)
DTYPE_RANK = {name: rank for rank, name in enumerate(DTYPE_NAMES)}

# safetensors dtype -> numpy dtype: little-endian (ml_dtypes types are native-order, which is
# little-endian on x86-64 and AArch64 hosts). Each has one element per byte or more.
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "C64": np.dtype("<c8"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}

# Packed types: several elements share a byte, which no numpy dtype can view in place. A tensor of one has
# the ml_dtypes element type (one element per byte in memory) in its PackedTensorInfo, its logical shape,
# and size * bits / 8 stored bytes, which must be whole (as the reference reader checks).
SUB_BYTE_DTYPES = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
PACKED_DTYPES = {
    "F4": np.dtype(ml_dtypes.float4_e2m1fn),
    "F6_E2M3": np.dtype(ml_dtypes.float6_e2m3fn),
    "F6_E3M2": np.dtype(ml_dtypes.float6_e3m2fn),
}


def unsupported_dtype_message(name):
    """Why a safetensors dtype string cannot be read, for error messages."""
    return (f"unknown dtype {name!r}; known: {', '.join(DTYPE_NAMES)}")


class _DuplicateKey(Exception):
    pass


def _pairs_without_duplicates(pairs):
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _refuse_constant(name):
    raise ValueError(f"{name} is not valid JSON")


# The fast decoder builds plain dicts, which silently keep the last of repeated keys; the byte
# scan below counts the pairs in the text so that a repeat is still caught. Only then does the
# slow decoder (a Python hook per object) run again, to name the key.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_DECODER_NAMING_DUPLICATES = json.JSONDecoder(object_pairs_hook=_pairs_without_duplicates,
                                              parse_constant=_refuse_constant)


cdef struct _Scan:
    Py_ssize_t pairs           # ':' outside strings: one per key/value pair in the whole document
    Py_ssize_t negative_zero   # offset in the header of the first -0 outside strings, or -1
    bint surrogate_escape      # a \uD800-\uDFFF escape appears (maybe a lone surrogate)


cdef _Scan _scan(bytes raw):
    """One pass over valid JSON text, outside and inside strings."""
    cdef const unsigned char* q = raw
    cdef Py_ssize_t n = len(raw)
    cdef Py_ssize_t i = 0
    cdef bint in_string = False
    cdef unsigned char c
    cdef _Scan result
    result.pairs = 0
    result.negative_zero = -1
    result.surrogate_escape = False
    while i < n:
        c = q[i]
        if in_string:
            if c == 0x5c:  # backslash: the next byte is escaped
                if i + 5 < n and q[i + 1] == 0x75 and (q[i + 2] | 0x20) == 0x64 and (
                        0x38 <= q[i + 3] <= 0x39 or 0x61 <= (q[i + 3] | 0x20) <= 0x66):
                    result.surrogate_escape = True  # \uD8xx-\uDFxx
                i += 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x3a:
            result.pairs += 1
        elif c == 0x2d and i + 1 < n and q[i + 1] == 0x30 and result.negative_zero < 0:
            result.negative_zero = i
        i += 1
    return result


cdef Py_ssize_t _count_pairs(object value) except -1:
    cdef Py_ssize_t total = 0
    if type(value) is dict:
        total = len(<dict>value)
        for item in (<dict>value).values():
            if type(item) is dict or type(item) is list:
                total += _count_pairs(item)
    elif type(value) is list:
        for item in <list>value:
            if type(item) is dict or type(item) is list:
                total += _count_pairs(item)
    return total


cdef str _int_problem(object v, int64_t limit):
    """None when ``v`` is a JSON integer in [0, limit], else what is wrong with it."""
    if type(v) is not int:  # bool is a subclass of int; JSON true/false are not sizes
        return f"expected a non-negative integer, got {v!r:.80} ({type(v).__name__})"
    if v < 0:
        return f"expected a non-negative integer, got {v!r}"
    if v > limit:
        return f"{v!r} is larger than {limit} (the file has no room for it)"
    return None


cdef int _check_utf8(str text, str path, str what) except -1:
    # Python's JSON decoder lets \ud800-style escapes through as lone surrogates, which are not
    # Unicode text (the reference reader refuses them).
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"{path}: {what} {text!r} is not valid Unicode (a lone surrogate escape)") from None
    return 0


cdef object _utf8_error_offset(bytes raw, Py_ssize_t char_pos):
    return 8 + len(raw.decode("utf-8")[:char_pos].encode("utf-8"))


# -- the fast path: headers in the common shape, without a Python dict per tensor ------------------
# ``_parse_fast`` reads a header of the shape every known writer produces: no escapes in strings,
# integers of at most 18 digits, each entry exactly dtype/shape/data_offsets. It accepts only headers
# the checking parser below accepts and gives the same result; on anything else, a valid header of
# another shape or a damaged one, it returns None and the checking parser runs (and raises the error).
# tests/test_safetensors_fuzz.py compares the two on damaged headers.

# The dtypes of TensorIndex dtype codes: NUMPY_DTYPES in its order.
_INDEX_DTYPES = list(NUMPY_DTYPES.values())
_CODE_NAMES = [name.encode() for name in NUMPY_DTYPES]  # keeps the bytes _CODE_NAME points into
DEF _CODES = 19
assert len(_CODE_NAMES) == _CODES
cdef const char* _CODE_NAME[_CODES]
cdef Py_ssize_t _CODE_LEN[_CODES]
cdef int64_t _CODE_ITEMSIZE[_CODES]
for _k in range(_CODES):
    _CODE_NAME[_k] = _CODE_NAMES[_k]
    _CODE_LEN[_k] = len(_CODE_NAMES[_k])
    _CODE_ITEMSIZE[_k] = _INDEX_DTYPES[_k].itemsize

_NOT_HANDLED = object()


cdef struct _Cursor:
    const uint8_t* q
    Py_ssize_t n
    Py_ssize_t i


cdef inline void _ws(_Cursor* c) noexcept:
    cdef uint8_t ch
    while c.i < c.n:
        ch = c.q[c.i]
        if ch != 0x20 and ch != 0x0a and ch != 0x0d and ch != 0x09:
            return
        c.i += 1


cdef inline bint _is_json_space(uint8_t ch) noexcept:
    return ch == 0x20 or ch == 0x0a or ch == 0x0d or ch == 0x09


cdef inline bint _take(_Cursor* c, uint8_t ch) noexcept:
    if c.i < c.n and c.q[c.i] == ch:
        c.i += 1
        return True
    return False


cdef inline bint _string(_Cursor* c, Py_ssize_t* start, Py_ssize_t* length) noexcept:
    """A string without escapes or control characters: its bytes' span, cursor after it; False if not that."""
    cdef uint8_t ch
    if not _take(c, 0x22):
        return False
    start[0] = c.i
    while c.i < c.n:
        ch = c.q[c.i]
        if ch == 0x22:
            length[0] = c.i - start[0]
            c.i += 1
            return True
        if ch == 0x5c or ch < 0x20:
            return False
        c.i += 1
    return False


cdef inline bint _integer(_Cursor* c, int64_t* value) noexcept:
    """A JSON non-negative integer of at most 18 digits (below 2**63); False if not that."""
    cdef int64_t v = 0
    cdef int digits = 0
    if c.i < c.n and c.q[c.i] == 0x30:  # "0"; a digit after it is not JSON, and fails at the next delimiter
        c.i += 1
        value[0] = 0
        return True
    while c.i < c.n and 0x30 <= c.q[c.i] <= 0x39:
        digits += 1
        if digits > 18:
            return False
        v = v * 10 + (c.q[c.i] - 0x30)
        c.i += 1
    value[0] = v
    return digits > 0


cdef object _text(_Cursor* c, Py_ssize_t start, Py_ssize_t length):
    """The string at ``start`` as str, or None when it is not UTF-8."""
    try:
        return PyUnicode_DecodeUTF8(<const char*>c.q + start, length, NULL)
    except UnicodeDecodeError:
        return None


cdef object _fast_metadata(_Cursor* c):
    """``null`` -> None, an object of strings -> dict, anything else -> _NOT_HANDLED."""
    cdef Py_ssize_t start, length, before
    cdef dict out
    if c.i + 4 <= c.n and memcmp(c.q + c.i, b"null", 4) == 0:
        c.i += 4
        return None
    if not _take(c, 0x7b):
        return _NOT_HANDLED
    out = {}
    _ws(c)
    if _take(c, 0x7d):
        return out
    while True:
        if not _string(c, &start, &length):
            return _NOT_HANDLED
        key = _text(c, start, length)
        _ws(c)
        if key is None or not _take(c, 0x3a):
            return _NOT_HANDLED
        _ws(c)
        if not _string(c, &start, &length):
            return _NOT_HANDLED
        value = _text(c, start, length)
        if value is None:
            return _NOT_HANDLED
        before = len(out)
        out[key] = value
        if len(out) == before:  # a repeated key
            return _NOT_HANDLED
        _ws(c)
        if _take(c, 0x2c):
            _ws(c)
            continue
        if _take(c, 0x7d):
            return out
        return _NOT_HANDLED


cdef int _last_code = 0  # a file's tensors share a few dtypes: try the last one first


cdef int _fast_entry(_Cursor* c, TensorIndex index, str name, Py_ssize_t name_at, Py_ssize_t name_len) except -1:
    """One tensor entry, added to ``index`` with its data_offsets begin as offset and end as nbytes;
    1 when it is not of the common shape (or the name is repeated)."""
    global _last_code
    cdef Py_ssize_t start, length
    cdef int seen = 0, code = -1, k
    cdef int64_t begin = 0, end = 0, dim
    if not _take(c, 0x7b):
        return 1
    _ws(c)
    while True:
        if not _string(c, &start, &length):
            return 1
        _ws(c)
        if not _take(c, 0x3a):
            return 1
        _ws(c)
        if length == 5 and memcmp(c.q + start, b"dtype", 5) == 0:
            if seen & 1 or not _string(c, &start, &length):
                return 1
            seen |= 1
            if _CODE_LEN[_last_code] == length and memcmp(c.q + start, _CODE_NAME[_last_code], length) == 0:
                code = _last_code
            else:
                for k in range(_CODES):
                    if _CODE_LEN[k] == length and memcmp(c.q + start, _CODE_NAME[k], length) == 0:
                        code = _last_code = k
                        break
                if code < 0:
                    return 1
        elif length == 5 and memcmp(c.q + start, b"shape", 5) == 0:
            if seen & 2 or not _take(c, 0x5b):
                return 1
            seen |= 2
            _ws(c)
            if not _take(c, 0x5d):
                while True:
                    if not _integer(c, &dim):
                        return 1
                    index.add_dim(dim)
                    _ws(c)
                    if _take(c, 0x2c):
                        _ws(c)
                        continue
                    if _take(c, 0x5d):
                        break
                    return 1
        elif length == 12 and memcmp(c.q + start, b"data_offsets", 12) == 0:
            if seen & 4 or not _take(c, 0x5b):
                return 1
            seen |= 4
            _ws(c)
            if not _integer(c, &begin):
                return 1
            _ws(c)
            if not _take(c, 0x2c):
                return 1
            _ws(c)
            if not _integer(c, &end):
                return 1
            _ws(c)
            if not _take(c, 0x5d):
                return 1
        else:
            return 1
        _ws(c)
        if _take(c, 0x2c):
            _ws(c)
            continue
        if _take(c, 0x7d):
            break
        return 1
    if seen != 7:
        return 1
    return index.add(name, <const char*>c.q + name_at, name_len, code, begin, end, VIEWABLE)


cdef object _parse_fast(const uint8_t* q, Py_ssize_t n, MappedFile m, int64_t data_start, int64_t data_len):
    """``(TensorIndex, metadata)`` of the ``n`` header bytes at ``q`` (up to the closing brace), or None."""
    cdef _Cursor c
    cdef Py_ssize_t start, length, i, k
    cdef TensorIndex index = TensorIndex.__new__(TensorIndex)
    cdef bint seen_metadata = False, in_order = True
    cdef int64_t expected = 0, begin, end, count, dim, itemsize
    c.q, c.n, c.i = q, n, 0
    index._setup(m, _INDEX_DTYPES, TensorInfo)
    metadata = None
    if not _take(&c, 0x7b):
        return None
    _ws(&c)
    if not _take(&c, 0x7d):
        while True:
            if not _string(&c, &start, &length):
                return None
            if length == 12 and memcmp(q + start, b"__metadata__", 12) == 0:
                _ws(&c)
                if seen_metadata or not _take(&c, 0x3a):
                    return None
                _ws(&c)
                seen_metadata = True
                metadata = _fast_metadata(&c)
                if metadata is _NOT_HANDLED:
                    return None
            else:
                name = _text(&c, start, length)
                _ws(&c)
                if name is None or not _take(&c, 0x3a):
                    return None
                _ws(&c)
                if _fast_entry(&c, index, name, start, length):
                    return None
            _ws(&c)
            if _take(&c, 0x2c):
                _ws(&c)
                continue
            if _take(&c, 0x7d):
                break
            return None
    if c.i != n:
        return None

    # The checks of the checking parser, in 64-bit; offsets hold data_offsets begin, nbytes the end.
    for i in range(index.count):
        if index.nbytes[i] < index.offsets[i]:
            return None
        if i and (index.offsets[i] < index.offsets[i - 1] or (
                index.offsets[i] == index.offsets[i - 1] and index.nbytes[i] <= index.nbytes[i - 1])):
            in_order = False
    if not in_order:  # sorted by (begin, end), then name, as the checking parser sorts
        keys = [(index.offsets[i], index.nbytes[i], index.names[i], i) for i in range(index.count)]
        keys.sort()
        index.reorder([key[3] for key in keys])
    for i in range(index.count):
        begin, end = index.offsets[i], index.nbytes[i]
        if begin != expected or end > data_len:
            return None
        count = 1
        for k in range(index.shape_at[i], index.shape_at[i + 1]):
            dim = index.dims[k]
            if dim != 0 and count > _INT64_MAX // dim:
                return None
            count *= dim
        itemsize = _CODE_ITEMSIZE[index.dtype_codes[i]]
        if count > _INT64_MAX // itemsize or end - begin != count * itemsize:
            return None
        index.offsets[i] = data_start + begin
        index.nbytes[i] = end - begin
        expected = end
    if expected != data_len:
        return None
    index.finish()
    return index, metadata


cdef enum:  # which parsers _read_index runs
    _CHECKING = 0
    _FAST_THEN_CHECKING = 1
    _FAST_ONLY = 2


def read_safetensors_index(MappedFile m not None):
    """Parse and check the header of the safetensors file mapped by ``m``.

    Returns ``(tensors, metadata, data_start)``: a list of
    :class:`~fastckpt.info.TensorInfo` in data-offset order (``offset`` is
    absolute), the ``__metadata__`` dict or None, and the absolute offset of
    the data section. Any deviation from the spec raises
    :class:`~fastckpt.errors.FormatError` naming the file, the tensor, the byte
    offset and what was expected.

    >>> import os, tempfile, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> from fastckpt.formats.safetensors import save_safetensors
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_safetensors(p, {"w": np.zeros((2, 3), np.float32)}, alignment=64)
    >>> with MappedFile(p) as m:
    ...     infos, meta, start = read_safetensors_index(m)
    >>> infos[0].name, infos[0].shape, infos[0].offset, infos[0].nbytes, meta, start
    ('w', (2, 3), 128, 24, None, 128)
    """
    return _read_index(m, False, _FAST_THEN_CHECKING)


def read_safetensors_table(MappedFile m not None):
    """:func:`read_safetensors_index`, with the tensors as a columnar
    :class:`~fastckpt._native.tensorindex.TensorIndex` (in data-offset order) instead of a list.

    Returns ``(index, metadata, data_start)``. A header in the common shape
    (no escapes in strings, integers below 10**18, tensors listed or not in
    data order) is parsed here without a dict per tensor; any other header
    goes through the same checks as :func:`read_safetensors_index` and raises
    the same errors.

    >>> import os, tempfile, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> from fastckpt.formats.safetensors import save_safetensors
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_safetensors(p, {"w": np.zeros((2, 3), np.float32)}, metadata={"k": "v"}, alignment=64)
    >>> with MappedFile(p) as m:
    ...     index, meta, start = read_safetensors_table(m)
    ...     list(index), index["w"].offset, index.view("w").shape, meta, start
    (['w'], 128, (2, 3), {'k': 'v'}, 128)
    """
    return _read_index(m, True, _FAST_THEN_CHECKING)


def _read_index_checking(MappedFile m not None):
    """:func:`read_safetensors_index` through the checking parser only (no fast path): the tests compare the two."""
    return _read_index(m, False, _CHECKING)


def _read_table_fast_only(MappedFile m not None):
    """:func:`read_safetensors_table` through the fast path only: None where it leaves the header to the
    checking parser (for the tests, which check which headers it takes)."""
    return _read_index(m, True, _FAST_ONLY)


cdef object _read_index(MappedFile m, bint table, int parsers):
    cdef str path = str(m.path)
    cdef int64_t size = m.size
    cdef const uint8_t* p
    cdef uint64_t n = 0
    cdef int64_t header_len, data_start, data_len, j, i, ndim
    cdef int64_t begin, end, expected_begin, count, dim, itemsize, nbytes
    cdef int k, bits
    cdef _Scan scan
    # SAFETY: the span() pointers below point into this block; holding it keeps the mapping alive
    # should another thread close m while the parse runs Python code.
    cdef object keep_mapping = m._block

    # -- fixed part: 8-byte little-endian length, then the header --------------------------------
    if size < 8:
        raise FormatError(f"{path}: not a safetensors file: it has {size} bytes, expected at least 8 "
                          "(the little-endian u64 header length) (file seems truncated?)")
    p = m.span(0, 8, "safetensors header length")
    for k in range(7, -1, -1):
        n = (n << 8) | p[k]
    if n > <uint64_t>_MAX_HEADER_SIZE:
        raise FormatError(f"{path}: header length at byte 0 is {n}, larger than the safetensors limit of "
                          f"{MAX_HEADER_SIZE} bytes (not a safetensors file, or damaged)")
    header_len = <int64_t>n
    if header_len > size - 8:
        raise FormatError(f"{path}: header length at byte 0 says {header_len} bytes of JSON, but only "
                          f"{size - 8} bytes follow it (file size {size}; file seems truncated?)")
    if header_len < 2:
        raise FormatError(f"{path}: header length at byte 0 is {header_len}; the JSON header needs at least "
                          "2 bytes ('{}')")
    data_start = 8 + header_len
    data_len = size - data_start

    p = m.span(8, header_len, "safetensors JSON header")
    # Padding: JSON whitespace (space, tab, LF, CR) may come before and after the object, as the reference reader
    # (serde_json::from_str) allows; writers pad the header to align the data.
    i = 0
    while i < header_len and _is_json_space(p[i]):
        i += 1
    if i == header_len:
        raise FormatError(f"{path}: JSON header (bytes [8, {data_start})) holds only JSON whitespace; it must hold "
                          "a JSON object ('{' ... '}')")
    if p[i] != ord("{"):
        raise FormatError(f"{path}: JSON header must start with '{{' (0x7b), after JSON whitespace (0x20, 0x09, "
                          f"0x0a, 0x0d) if any; byte at offset {8 + i} is 0x{p[i]:02x} (header bytes [8, {data_start}))")
    j = header_len
    while j > i and _is_json_space(p[j - 1]):
        j -= 1
    if p[j - 1] != ord("}"):
        raise FormatError(
            f"{path}: JSON header must end with '}}' followed only by JSON whitespace (0x20, 0x09, 0x0a, 0x0d) as "
            f"padding; byte at offset {8 + j - 1} is 0x{p[j - 1]:02x} (header bytes [8, {data_start}))")
    fast = _parse_fast(p + i, j - i, m, data_start, data_len) if parsers != _CHECKING else None
    if fast is not None:
        index, metadata = fast
        return (index if table else index.info_list()), metadata, data_start
    if parsers == _FAST_ONLY:
        return None
    raw = (<const char*>p)[:j]  # a copy: span() memory is only valid until the next span() call

    # -- JSON ----------------------------------------------------------------------------------
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: JSON header is not valid UTF-8: byte at offset {8 + e.start} "
                          f"(0x{raw[e.start]:02x}): {e.reason}") from None
    try:
        header, end_pos = _DECODER.raw_decode(text, i)  # the leading padding is ASCII: character i is byte i
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: JSON header is not valid JSON at byte offset "
                          f"{_utf8_error_offset(raw, e.pos)}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # NaN/Infinity, ints past str->int limits, deep nesting
        raise FormatError(f"{path}: JSON header (bytes [8, {data_start})) cannot be parsed: {e}") from None
    if end_pos != len(text):
        raise FormatError(f"{path}: JSON header has extra data after the top-level object at byte offset "
                          f"{_utf8_error_offset(raw, end_pos)}; only JSON whitespace (0x20, 0x09, 0x0a, 0x0d) may pad it")
    scan = _scan(raw)
    if scan.pairs != _count_pairs(header):
        try:
            _DECODER_NAMING_DUPLICATES.raw_decode(text, 0)
        except _DuplicateKey as e:
            raise FormatError(f"{path}: JSON header has the key {e.args[0]!r} more than once; "
                              "safetensors headers must not repeat keys") from None
        raise AssertionError("pair count and parse disagree without a repeated key")  # unreachable
    if scan.negative_zero >= 0:
        # Python reads -0 as the int 0; the reference sees a float and refuses it.
        raise FormatError(f"{path}: JSON header has the number -0 at byte offset {8 + scan.negative_zero}; "
                          "sizes and offsets must be non-negative integers")

    # -- __metadata__ --------------------------------------------------------------------------
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if type(metadata) is not dict:
            raise FormatError(f"{path}: __metadata__ must be a JSON object of strings, got "
                              f"{type(metadata).__name__} {metadata!r:.80}")
        for key, value in metadata.items():
            if type(value) is not str:
                raise FormatError(f"{path}: __metadata__[{key!r}] must be a string, got "
                                  f"{type(value).__name__} {value!r:.80}")
            if scan.surrogate_escape:
                _check_utf8(key, path, "__metadata__ key")
                _check_utf8(value, path, f"__metadata__[{key!r}]")

    # -- tensor entries ------------------------------------------------------------------------
    # Messages are built only on failure: headers can hold 100k+ tensors.
    entries = []
    for name, entry in header.items():
        if scan.surrogate_escape:
            _check_utf8(name, path, "tensor name")
        if type(entry) is not dict:
            raise FormatError(f"{path}: tensor {name!r}: expected an object with dtype, shape and data_offsets, "
                              f"got {type(entry).__name__} {entry!r:.80}")
        if len(<dict>entry) != 3 or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
            raise FormatError(f"{path}: tensor {name!r}: expected exactly the keys ['data_offsets', 'dtype', "
                              f"'shape'], got {sorted(entry)!r}")
        dtype_name = entry["dtype"]
        dtype = NUMPY_DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None and type(dtype_name) is str:
            dtype = PACKED_DTYPES.get(dtype_name)
        if dtype is None:
            if type(dtype_name) is not str:
                raise FormatError(f"{path}: tensor {name!r}: dtype must be a string, got {dtype_name!r:.80}")
            raise FormatError(f"{path}: tensor {name!r}: {unsupported_dtype_message(dtype_name)}")
        shape_json = entry["shape"]
        if type(shape_json) is not list:
            raise FormatError(f"{path}: tensor {name!r}: shape must be a list of non-negative integers, got "
                              f"{shape_json!r:.80}")
        offsets = entry["data_offsets"]
        if type(offsets) is not list or len(<list>offsets) != 2:
            raise FormatError(f"{path}: tensor {name!r}: data_offsets must be a list [begin, end], got "
                              f"{offsets!r:.80}")
        for k in range(2):
            problem = _int_problem(offsets[k], _INT64_MAX)
            if problem is not None:
                raise FormatError(f"{path}: tensor {name!r}: data_offsets[{k}]: {problem}")
        begin = offsets[0]
        end = offsets[1]
        if end < begin:
            raise FormatError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] end before they begin")
        entries.append((begin, end, name, dtype_name, dtype, shape_json))

    # -- offsets, sizes ------------------------------------------------------------------------
    # Sorted by (begin, end) as the reference reader does; names are unique, so ties end there.
    entries.sort()
    tensors = []
    expected_begin = 0
    for begin, end, name, dtype_name, dtype, shape_json in entries:
        if begin != expected_begin:
            kind = "a hole" if begin > expected_begin else "an overlap"
            raise FormatError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] leave {kind} in the data section: "
                f"expected begin {expected_begin} (absolute byte {data_start + expected_begin}), got {begin} "
                f"(absolute byte {data_start + begin}); tensors must be contiguous from 0 without holes or overlaps")
        if end > data_len:
            raise FormatError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] reach absolute byte {data_start + end}, "
                f"past the end of the file ({size} bytes; the data section has {data_len}) (file seems truncated?)")
        # Element count with overflow checks in 64-bit, as the reference does with usize.
        ndim = len(<list>shape_json)
        count = 1
        for i in range(ndim):
            value = (<list>shape_json)[i]
            problem = _int_problem(value, _INT64_MAX)
            if problem is not None:
                raise FormatError(f"{path}: tensor {name!r}: shape[{i}]: {problem}")
            dim = value
            if dim != 0 and count > _INT64_MAX // dim:
                raise FormatError(f"{path}: tensor {name!r}: shape {shape_json!r:.200} overflows a 64-bit element "
                                  f"count at shape[{i}]")
            count *= dim
        bits = SUB_BYTE_DTYPES.get(dtype_name, 0)
        itemsize = bits if bits else dtype.itemsize  # bits per element for a packed type
        if count > _INT64_MAX // itemsize:
            raise FormatError(f"{path}: tensor {name!r}: shape {shape_json!r:.200} of {dtype_name} overflows a "
                              "64-bit byte count")
        nbytes = count * itemsize
        if bits:
            if nbytes % 8:
                raise FormatError(
                    f"{path}: tensor {name!r}: shape {shape_json!r:.200} of {dtype_name} ({bits}-bit elements) is "
                    f"{nbytes} bits, not a whole number of bytes (absolute bytes [{data_start + begin}, "
                    f"{data_start + end})); safetensors refuses it too (a packed tensor must end on a byte boundary)")
            nbytes //= 8
        if end - begin != nbytes:
            raise FormatError(
                f"{path}: tensor {name!r}: shape {shape_json!r:.200} of {dtype_name} needs {nbytes} bytes, but "
                f"data_offsets [{begin}, {end}] hold {end - begin} (absolute bytes [{data_start + begin}, "
                f"{data_start + end}))")
        if bits:
            tensors.append(from_checked_fields(PackedTensorInfo, {
                "name": name, "dtype": dtype, "shape": tuple(shape_json), "offset": data_start + begin,
                "nbytes": nbytes, "fortran_order": False, "compression": None, "packed": dtype_name}))
        else:
            tensors.append(from_checked_fields(TensorInfo, {
                "name": name, "dtype": dtype, "shape": tuple(shape_json), "offset": data_start + begin,
                "nbytes": nbytes, "fortran_order": False, "compression": None}))
        expected_begin = end
    if expected_begin != data_len:
        raise FormatError(
            f"{path}: the tensors end at absolute byte {data_start + expected_begin} but the file has {size} "
            f"bytes: {data_len - expected_begin} unexpected trailing bytes after the data section (the last "
            "data_offsets end must be the end of the file)")
    if table:
        return TensorIndex.from_infos(m, tensors), metadata, data_start
    return tensors, metadata, data_start


# -- writing -------------------------------------------------------------------------------------
# A planned tensor is a tuple that sorts into the reference writer's order: dtype rank descending,
# then name (then the input position, so that sorting never compares arrays):
#   (-rank, name, position, dtype name, shape, nbytes, array or None, source)
# ``shape`` is None where ``array`` is the caller's own ndarray: its dimensions are read from it.
# ``array`` is None when the caller's value had to be converted into a new array; it is converted
# again at write time, so that at most one such copy exists at once (see fastckpt.formats.safetensors).

cdef inline bint _plain_json_string(str s):
    """True when ``json.dumps(s, ensure_ascii=False)`` is ``s`` between quotes: nothing to escape."""
    cdef Py_UCS4 c
    for c in s:
        if c < 0x20 or c == 0x22 or c == 0x5C:  # control characters, '"', backslash
            return False
    return True


cdef inline tuple _plan_one(name, value, Py_ssize_t position, dict fast_dtypes, slow_plan, list last):
    # ``last`` is [descr, known] of the previous fast tensor: a model's arrays share a few dtype
    # objects, and an identity test is cheaper than hashing the dtype again.
    cdef PyObject* known
    cdef object descr
    if type(value) is np.ndarray and type(name) is str and PyUnicode_IS_ASCII(name) and name != "__metadata__":
        descr = <object>cnp.PyArray_DESCR(<cnp.ndarray>value)
        if descr is last[0]:
            known = <PyObject*>last[1]
        else:
            known = PyDict_GetItem(fast_dtypes, descr)
            if known is not NULL:
                last[0], last[1] = descr, <object>known
        if known is not NULL:
            # shape None: header_text reads the dimensions from the array itself.
            return ((<tuple>known)[1], name, position, (<tuple>known)[0], None,
                    cnp.PyArray_NBYTES(<cnp.ndarray>value), value, value)
    return slow_plan(name, value, position)


def plan_tensors(tensors, dict fast_dtypes, slow_plan):
    """Planned tuples of a mapping's ``(name, value)`` pairs, in its order.

    The common case, an exact ``ndarray`` under an ASCII name with a dtype in
    ``fast_dtypes`` (dtype -> (safetensors name, -rank)), is planned here;
    every other pair goes to ``slow_plan(name, value, position)``, which
    checks it and raises the user-facing errors.
    """
    cdef list plan = []
    cdef list last = [None, None]
    if type(tensors) is dict:  # walked with PyDict_Next: no (name, value) tuple per item
        for name, value in (<dict>tensors).items():
            plan.append(_plan_one(name, value, len(plan), fast_dtypes, slow_plan, last))
    else:
        for name, value in tensors.items():
            plan.append(_plan_one(name, value, len(plan), fast_dtypes, slow_plan, last))
    return plan


cdef struct _Text:
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _reserve(_Text* text, Py_ssize_t more) except -1:
    """Make room for ``more`` bytes after ``text.size``; every write below reserves first."""
    cdef Py_ssize_t capacity
    cdef char* grown
    if more > PY_SSIZE_T_MAX // 4 - text.size:
        raise MemoryError("the safetensors header text is too large")
    if text.size + more <= text.capacity:
        return 0
    capacity = max(2 * text.capacity, text.size + more, 4096)
    grown = <char*>PyMem_Realloc(text.data, capacity)
    if grown == NULL:
        raise MemoryError()
    text.data, text.capacity = grown, capacity
    return 0


cdef int _put(_Text* text, const char* data, Py_ssize_t n) except -1:
    _reserve(text, n)
    memcpy(text.data + text.size, data, n)
    text.size += n
    return 0


cdef int _put_str(_Text* text, str s) except -1:
    cdef Py_ssize_t n
    cdef const char* utf8 = PyUnicode_AsUTF8AndSize(s, &n)  # no copy for ASCII text
    return _put(text, utf8, n)


cdef inline Py_ssize_t _digits(char* out, uint64_t value) noexcept:
    """Write ``value`` in decimal at ``out`` (room for 20 digits); return how many digits."""
    cdef char tmp[20]
    cdef int n = 0, i
    while True:
        tmp[19 - n] = <char>(48 + value % 10)
        value //= 10
        n += 1
        if value == 0:
            break
    for i in range(n):
        out[i] = tmp[20 - n + i]
    return n


def header_text(list plan, str metadata_json):
    """The compact JSON header of a sorted ``plan``, as UTF-8: the bytes ``json.dumps`` writes.

    ``json.dumps(header, separators=(",", ":"), ensure_ascii=False)`` of the
    nested dicts costs about 1.5 µs per tensor; this costs a twentieth of
    that. ``metadata_json`` is the ``__metadata__`` object already in JSON,
    or None. Sizes and dimensions are non-negative and below 2**63 (numpy's
    limits); names are unique (the caller checks).
    """
    cdef _Text text
    cdef uint64_t offset = 0, nbytes
    cdef tuple t, shape
    cdef str name
    cdef Py_ssize_t i, ndim, name_len, dtype_len
    cdef const char* name_utf8
    cdef const char* dtype_utf8
    cdef cnp.npy_intp* dims = NULL
    cdef char* q
    text.data, text.size, text.capacity = NULL, 0, 0
    try:
        _put(&text, "{", 1)
        if metadata_json is not None:
            _put(&text, '"__metadata__":', 15)
            _put_str(&text, metadata_json)
        for t in plan:
            name = t[1]
            if _plain_json_string(name):
                name_utf8 = PyUnicode_AsUTF8AndSize(name, &name_len)  # no copy for ASCII text
            else:
                escaped = json.dumps(name, ensure_ascii=False)
                escaped = escaped[1:len(escaped) - 1]  # without its quotes, written below
                name_utf8 = PyUnicode_AsUTF8AndSize(escaped, &name_len)
            dtype_utf8 = PyUnicode_AsUTF8AndSize(t[3], &dtype_len)
            shape = t[4]
            if shape is None:
                ndim = cnp.PyArray_NDIM(<cnp.ndarray>t[6])
                dims = cnp.PyArray_DIMS(<cnp.ndarray>t[6])
            else:
                ndim = len(shape)
            # Room for the whole entry: its text parts, and 20 digits and a comma per number.
            _reserve(&text, name_len + dtype_len + 64 + 21 * (ndim + 2))
            q = text.data + text.size
            if text.size > 1:
                q[0] = b","
                q += 1
            q[0] = b'"'
            memcpy(q + 1, name_utf8, name_len)
            q += 1 + name_len
            memcpy(q, '":{"dtype":"', 12)
            memcpy(q + 12, dtype_utf8, dtype_len)
            q += 12 + dtype_len
            memcpy(q, '","shape":[', 11)
            q += 11
            for i in range(ndim):
                if i:
                    q[0] = b","
                    q += 1
                q += _digits(q, <uint64_t>(dims[i] if shape is None else <int64_t>shape[i]))
            memcpy(q, '],"data_offsets":[', 18)
            q += 18
            nbytes = <uint64_t>(<int64_t>t[5])
            q += _digits(q, offset)
            q[0] = b","
            q += 1
            offset += nbytes
            q += _digits(q, offset)
            memcpy(q, "]}", 2)
            q += 2
            text.size = q - text.data
        _put(&text, "}", 1)
        return PyBytes_FromStringAndSize(text.data, text.size)
    finally:
        PyMem_Free(text.data)


def write_tensors(GatherWriter out, list plan, frozenset direct_dtypes, write_one):
    """Queue the bytes of every planned tensor, in order, on ``out``; empty ``plan`` as it goes.

    A C-contiguous array of a dtype in ``direct_dtypes`` (the file's own
    dtypes, little-endian) goes to ``out`` as it is, uncopied; any other goes
    to ``write_one(t)``, which converts it, after what is queued is written.
    """
    cdef Py_ssize_t i
    cdef tuple t
    for i in range(len(plan)):
        t = plan[i]
        arr = t[6]
        if (type(arr) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>arr)
                and <object>cnp.PyArray_DESCR(<cnp.ndarray>arr) in direct_dtypes):
            out.write(arr)
        else:
            out.flush()  # converting runs caller code, which must not find queued arrays unwritten
            write_one(t)
        plan[i] = None
