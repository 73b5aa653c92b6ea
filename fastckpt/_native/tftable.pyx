"""Bounds-checked parsing of tensorflow::table (the LevelDB SSTable variant of TF's ``.index`` files).

This module turns untrusted bytes into Python values: varints, blocks of
prefix-compressed entries, block trailers (masked CRC32C, optional Snappy),
the 48-byte footer, ``BundleEntryProto`` values and DT_STRING tensor payloads.
The byte layouts are specified in :mod:`fastckpt.formats.tf.format`.

Every read is checked against the end of its buffer (typed memoryviews with
``boundscheck`` on, plus explicit limits that give readable messages), and every
loop consumes at least one byte per step, so no input can crash, read out of
bounds or loop forever. Every failure is a :class:`fastckpt.errors.FormatError`
naming the file, the block and the byte offset.
"""

from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

cimport numpy as cnp

from fastckpt._native.mapped cimport MappedFile, _Block, guard_check, guard_enter, guard_exit
from fastckpt._native.tensorindex cimport VIEWABLE, TensorIndex, view_in_block

import weakref

import cramjam
import crc32c as _crc32c

from fastckpt.errors import ChecksumMismatchError, FormatError

FOOTER_SIZE = 48
TABLE_MAGIC = 0xDB4775248B80FB57
BLOCK_TRAILER_SIZE = 5
NO_COMPRESSION = 0
SNAPPY_COMPRESSION = 1
MASK_DELTA = 0xA282EAD8

# Snappy expands at most 64 output bytes per 3 input bytes (a copy-2 tag),
# so a larger declared length can only come from a corrupt preamble.
_SNAPPY_MAX_RATIO = 22

cdef uint32_t _MASK_DELTA = 0xA282EAD8u

cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    #include <string.h>
    /* CRC32C (Castagnoli, reflected 0x82F63B78), as the crc32c package computes it: SSE4.2 where the CPU
       has it, else slicing-by-8 tables. */
    static uint32_t fastckpt_crc32c_table[8][256];
    static int fastckpt_crc32c_hw = 0;
    static void fastckpt_crc32c_init(void) {
        uint32_t i, c;
        int k;
        for (i = 0; i < 256; i++) {
            c = i;
            for (k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            fastckpt_crc32c_table[0][i] = c;
        }
        for (i = 0; i < 256; i++)
            for (k = 1; k < 8; k++)
                fastckpt_crc32c_table[k][i] = (fastckpt_crc32c_table[k - 1][i] >> 8)
                    ^ fastckpt_crc32c_table[0][fastckpt_crc32c_table[k - 1][i] & 0xFF];
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        fastckpt_crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    #endif
    }
    static uint32_t fastckpt_crc32c_sw(uint32_t crc, const uint8_t* p, size_t n) {
        uint32_t (*t)[256] = fastckpt_crc32c_table;
        crc = ~crc;
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        while (n >= 8) {
            uint64_t w;
            uint32_t hi;
            memcpy(&w, p, 8);
            crc ^= (uint32_t)w;
            hi = (uint32_t)(w >> 32);
            crc = t[7][crc & 0xFF] ^ t[6][(crc >> 8) & 0xFF] ^ t[5][(crc >> 16) & 0xFF] ^ t[4][crc >> 24]
                ^ t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
            p += 8;
            n -= 8;
        }
    #endif
        while (n--) crc = t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        return ~crc;
    }
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __attribute__((target("sse4.2"))) static uint32_t fastckpt_crc32c_sse(uint32_t crc, const uint8_t* p, size_t n) {
        uint64_t c = (uint32_t)~crc;
        uint32_t c32;
        while (n >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            c = __builtin_ia32_crc32di(c, w);
            p += 8;
            n -= 8;
        }
        c32 = (uint32_t)c;
        while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
        return ~c32;
    }
    #endif
    static uint32_t fastckpt_crc32c(uint32_t crc, const uint8_t* p, size_t n) {
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        if (fastckpt_crc32c_hw) return fastckpt_crc32c_sse(crc, p, n);
    #endif
        return fastckpt_crc32c_sw(crc, p, n);
    }
    """
    void fastckpt_crc32c_init() noexcept nogil
    uint32_t fastckpt_crc32c(uint32_t crc, const uint8_t* p, size_t n) noexcept nogil

fastckpt_crc32c_init()


cpdef uint32_t mask_crc(uint32_t crc):
    """LevelDB's CRC mask: rotate right by 15 bits and add a constant.

    >>> hex(mask_crc(0))
    '0xa282ead8'
    """
    return ((crc >> 15) | (crc << 17)) + _MASK_DELTA


cpdef uint32_t unmask_crc(uint32_t masked):
    """Inverse of :func:`mask_crc`.

    >>> unmask_crc(mask_crc(0x12345678)) == 0x12345678
    True
    """
    cdef uint32_t rot = masked - _MASK_DELTA
    return (rot >> 17) | (rot << 15)


cdef inline int _rv(const uint8_t* p, Py_ssize_t end, Py_ssize_t* pos, int max_bytes, uint64_t* out) noexcept nogil:
    """``_varint`` without its errors: 1 with the value (``pos`` advanced), 0 where ``_varint`` would raise."""
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef int count = 0
    cdef uint8_t b
    cdef Py_ssize_t at = pos[0]
    while True:
        if at >= end or count >= max_bytes:
            return 0
        b = p[at]
        at += 1
        count += 1
        if shift == 63 and (b & 0x7E):
            return 0
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
    if max_bytes == 5 and result > 0xFFFFFFFFu:
        return 0
    pos[0] = at
    out[0] = result
    return 1


cdef int _varint(const uint8_t[::1] buf, Py_ssize_t end, Py_ssize_t* pos, int max_bytes,
                 uint64_t* out, object what) except -1:
    """Decode a LEB128 varint at ``pos[0]`` (advancing it) that must end before ``end``: ``_rv``, and where it
    refuses the bytes, an error saying why."""
    cdef Py_ssize_t start = pos[0]
    cdef Py_ssize_t at = start
    cdef int count = 0
    cdef uint8_t b
    if end > buf.shape[0]:
        end = buf.shape[0]
    if start < 0:
        raise FormatError(f"{what}: varint at byte {start}, before the start of the data")
    if start < end and _rv(&buf[0], end, pos, max_bytes, out):
        return 0
    while True:  # the bytes again, for the reason
        if at >= end:
            raise FormatError(f"{what}: truncated varint at byte {start} (the data ends at byte {end})")
        if count >= max_bytes:
            raise FormatError(f"{what}: varint at byte {start} is longer than {max_bytes} bytes")
        b = buf[at]
        at += 1
        count += 1
        if count == 10 and (b & 0x7E):  # the 10th byte holds bit 63 only
            raise FormatError(f"{what}: varint at byte {start} overflows 64 bits")
        if not (b & 0x80):
            raise FormatError(f"{what}: varint32 at byte {start} overflows 32 bits")


cdef inline uint32_t _fixed32(const uint8_t[::1] buf, Py_ssize_t at):
    return (<uint32_t>buf[at]) | (<uint32_t>buf[at + 1] << 8) | (<uint32_t>buf[at + 2] << 16) | (<uint32_t>buf[at + 3] << 24)


def decode_varint(data, Py_ssize_t pos=0, what="varint"):
    """Decode one varint64 from ``data`` at ``pos``; returns ``(value, next_pos)``.

    >>> decode_varint(b"\\x96\\x01")
    (150, 2)
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef uint64_t value
    if pos < 0:
        raise ValueError(f"negative position {pos}")
    _varint(buf, buf.shape[0], &pos, 10, &value, what)
    return value, pos


cdef const uint8_t[::1] _as_view(data):
    cdef const uint8_t[::1] v
    if isinstance(data, memoryview) and (<object>data).format != "B":
        data = (<object>data).cast("B")
    v = data
    return v


_EMPTY = b""


cdef Py_ssize_t _restarts_start(const uint8_t[::1] buf, uint32_t* num_restarts, object what) except -1:
    """Where a block's restart array starts (its entries end there); sets ``num_restarts[0]``.

    The trailing restart count and the array it announces must fit in the block.
    """
    cdef Py_ssize_t n = buf.shape[0]
    if n < 4:
        raise FormatError(f"{what}: a block needs at least 4 bytes (the restart count), got {n}")
    num_restarts[0] = _fixed32(buf, n - 4)
    if num_restarts[0] > (n - 4) // 4:
        raise FormatError(f"{what}: restart count {num_restarts[0]} needs {4 * (<uint64_t>num_restarts[0]) + 4} "
                          f"bytes but the block has {n}")
    return n - 4 - 4 * <Py_ssize_t>num_restarts[0]


cdef bytes _entry_key(const uint8_t[::1] buf, Py_ssize_t restarts_start, Py_ssize_t* pos, bytes prev,
                      uint64_t* value_len, object what):
    """The key of the entry at ``pos[0]`` (``prev`` is the previous key); leaves ``pos[0]`` at its value.

    The shared prefix must fit ``prev`` and the key and value must end before the restart array.
    """
    cdef Py_ssize_t entry_at = pos[0]
    cdef uint64_t shared, non_shared
    cdef bytes key
    _varint(buf, restarts_start, pos, 5, &shared, what)
    _varint(buf, restarts_start, pos, 5, &non_shared, what)
    _varint(buf, restarts_start, pos, 5, value_len, what)
    if shared > <uint64_t>len(prev):
        raise FormatError(f"{what}: entry at byte {entry_at} shares {shared} bytes with a previous key "
                          f"of {len(prev)} bytes")
    if non_shared + value_len[0] > <uint64_t>(restarts_start - pos[0]):
        raise FormatError(f"{what}: entry at byte {entry_at} needs {non_shared + value_len[0]} bytes of key and "
                          f"value but only {restarts_start - pos[0]} remain before the restart array")
    key = prev[:shared] + bytes(buf[pos[0]:pos[0] + <Py_ssize_t>non_shared])
    pos[0] += <Py_ssize_t>non_shared
    return key


def decode_block(data, what="block", Py_ssize_t max_key_bytes=-1):
    """Parse one uncompressed block into ``(keys, values, restarts)``.

    ``keys`` and ``values`` are lists of ``bytes`` in stored order, ``restarts``
    the list of restart offsets. Every entry's shared prefix must fit the
    previous key and every length must fit the block; the restart array must
    fit too. Restart *offsets* are not required to point at entries (iteration
    does not use them; :func:`block_seek` checks them when it does). With
    ``max_key_bytes`` >= 0, keys that decode to more bytes in all are a
    :class:`~fastckpt.errors.FormatError` (see ``KEY_EXPANSION``).

    >>> decode_block(bytes.fromhex("00010061" "00000000" "01000000"))
    ([b'a'], [b''], [0])
    >>> decode_block(bytes.fromhex("00010061" "01010062" "00000000" "01000000"), "b", max_key_bytes=2)
    Traceback (most recent call last):
    ...
    fastckpt.errors.FormatError: b: the keys of the first 2 entries decode to more than 2 bytes (entry at byte 4 has a key of 2 bytes...
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t restarts_start, pos, i
    cdef uint32_t num_restarts
    cdef uint64_t value_len
    cdef list keys = []
    cdef list values = []
    cdef list restarts = []
    cdef bytes prev = _EMPTY
    cdef bytes key
    cdef Py_ssize_t key_bytes = 0, entry_at
    restarts_start = _restarts_start(buf, &num_restarts, what)
    for i in range(num_restarts):
        restarts.append(_fixed32(buf, restarts_start + 4 * i))
    pos = 0
    while pos < restarts_start:
        entry_at = pos
        key = _entry_key(buf, restarts_start, &pos, prev, &value_len, what)
        key_bytes += len(key)
        if max_key_bytes >= 0 and key_bytes > max_key_bytes:
            _too_many_key_bytes(what, len(keys) + 1, max_key_bytes, entry_at, len(key))
        keys.append(key)
        values.append(bytes(buf[pos:pos + <Py_ssize_t>value_len]))
        pos += <Py_ssize_t>value_len
        prev = key
    return keys, values, restarts


cdef bytes _restart_key(const uint8_t[::1] buf, Py_ssize_t restarts_start, Py_ssize_t idx, object what):
    """The key of the entry at restart point ``idx``, which must share nothing with its predecessor."""
    cdef Py_ssize_t at = _fixed32(buf, restarts_start + 4 * idx)
    cdef Py_ssize_t p = at
    cdef uint64_t s, ns, vl
    if p >= restarts_start:
        raise FormatError(f"{what}: bad entry in block: restart {idx} points at byte {p}, "
                          f"past the entries (which end at byte {restarts_start})")
    _varint(buf, restarts_start, &p, 5, &s, what)
    _varint(buf, restarts_start, &p, 5, &ns, what)
    _varint(buf, restarts_start, &p, 5, &vl, what)
    if s != 0 or ns + vl > <uint64_t>(restarts_start - p):
        raise FormatError(f"{what}: bad entry in block: restart {idx} (byte {at}) has shared={s} "
                          "(a restart entry must share nothing) or overruns the block")
    return bytes(buf[p:p + <Py_ssize_t>ns])


def block_seek(data, bytes target, what="block"):
    """TensorFlow's ``Block::Iter::Seek``: the first ``(key, value)`` with ``key >= target``, or None.

    Binary search over the restart points, then a linear scan, exactly as
    ``block.cc`` does it. A restart point must hold an entry with ``shared == 0``
    ("bad entry in block" otherwise), so this also checks that a writer's
    restart array is usable for point lookups.
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t restarts_start, pos
    cdef uint32_t num
    cdef uint64_t value_len
    cdef Py_ssize_t left, right, mid
    cdef bytes prev = _EMPTY
    cdef bytes key
    restarts_start = _restarts_start(buf, &num, what)
    if num == 0 or restarts_start == 0:
        return None
    left = 0
    right = num - 1
    while left < right:
        mid = (left + right + 1) // 2
        if _restart_key(buf, restarts_start, mid, what) < target:
            left = mid
        else:
            right = mid - 1
    _restart_key(buf, restarts_start, left, what)  # validates the starting entry
    pos = _fixed32(buf, restarts_start + 4 * left)
    while pos < restarts_start:
        key = _entry_key(buf, restarts_start, &pos, prev, &value_len, what)
        if key >= target:
            return key, bytes(buf[pos:pos + <Py_ssize_t>value_len])
        pos += <Py_ssize_t>value_len
        prev = key
    return None


def decode_handle(data, what="block handle"):
    """Decode a BlockHandle (``varint64 offset, varint64 size``); returns ``(offset, size)``."""
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t pos = 0
    cdef uint64_t offset, size
    _varint(buf, buf.shape[0], &pos, 10, &offset, what)
    _varint(buf, buf.shape[0], &pos, 10, &size, what)
    return offset, size


def decode_footer(data, what="footer"):
    """Check the magic and decode the two handles of a 48-byte footer.

    Returns ``(metaindex_offset, metaindex_size, index_offset, index_size)``.
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t pos = 0
    cdef uint64_t mo, ms, io, isz
    if buf.shape[0] != FOOTER_SIZE:
        raise FormatError(f"{what}: expected {FOOTER_SIZE} bytes, got {buf.shape[0]}")
    magic = _fixed32(buf, 40) | (<uint64_t>_fixed32(buf, 44) << 32)
    if magic != TABLE_MAGIC:
        raise FormatError(f"{what}: not an sstable (bad magic number {magic:#018x}, expected {TABLE_MAGIC:#018x}); "
                          "is this a TensorFlow .index file?")
    _varint(buf, 40, &pos, 10, &mo, what)
    _varint(buf, 40, &pos, 10, &ms, what)
    _varint(buf, 40, &pos, 10, &io, what)
    _varint(buf, 40, &pos, 10, &isz, what)
    return mo, ms, io, isz


def snappy_uncompressed_length(data, what="snappy block"):
    """The uncompressed length a raw Snappy block declares in its preamble."""
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t pos = 0
    cdef uint64_t n
    _varint(buf, buf.shape[0], &pos, 5, &n, what)
    return n


def decompress_snappy(data, what="snappy block"):
    """Decompress a raw (unframed) Snappy block, refusing impossible declared lengths."""
    declared = snappy_uncompressed_length(data, what)
    if declared > _SNAPPY_MAX_RATIO * len(data) + 64:
        raise FormatError(f"{what}: declares {declared} uncompressed bytes from {len(data)} compressed bytes, "
                          "more than Snappy can encode (corrupt preamble)")
    try:
        out = bytes(cramjam.snappy.decompress_raw(bytes(data)))
    except Exception as exc:  # cramjam raises its own DecompressionError
        raise FormatError(f"{what}: invalid Snappy data ({exc})") from None
    if len(out) != declared:
        raise FormatError(f"{what}: Snappy data decompressed to {len(out)} bytes, the preamble says {declared}")
    return out


def read_block(MappedFile mapped, uint64_t offset, uint64_t size, what, bint verify=True):
    """Read the block at ``(offset, size)`` plus its 5-byte trailer; returns its uncompressed bytes.

    The trailer's masked CRC32C covers the stored bytes and the type byte and
    is checked unless ``verify`` is false. Type 1 blocks are Snappy-decompressed.
    """
    return _read_block(mapped, offset, size, what, verify, True)


cdef object _read_block(MappedFile mapped, uint64_t offset, uint64_t size, what, bint verify, bint copy):
    """``read_block``; with ``copy`` false, an uncompressed block of a mapped file is a memoryview of the
    mapping."""
    cdef const uint8_t[::1] raw_view
    if offset > <uint64_t>mapped.size or size > <uint64_t>mapped.size:
        raise FormatError(f"{mapped.path}: {what} at offset {offset} with {size} bytes lies outside the file "
                          f"({mapped.size} bytes)")
    if copy:
        raw = mapped.read(<Py_ssize_t>offset, <Py_ssize_t>size + BLOCK_TRAILER_SIZE, what)
    else:
        raw = mapped.view(<Py_ssize_t>offset, <Py_ssize_t>size + BLOCK_TRAILER_SIZE, what)
    kind = raw[size]
    if verify:
        stored = int.from_bytes(raw[size + 1:size + 5], "little")
        raw_view = raw
        actual = mask_crc(fastckpt_crc32c(0, &raw_view[0], <size_t>size + 1))
        if stored != actual:
            raise ChecksumMismatchError(
                f"{mapped.path}: {what} at offset {offset}: block checksum mismatch (stored {stored:#010x}, "
                f"computed {actual:#010x}); the file is damaged")
    contents = raw[:size]
    if kind == NO_COMPRESSION:
        return contents
    if kind == SNAPPY_COMPRESSION:
        return decompress_snappy(contents, f"{mapped.path}: {what} at offset {offset}")
    raise FormatError(f"{mapped.path}: {what} at offset {offset}: unknown block compression type {kind} "
                      "(0 = none and 1 = Snappy are defined)")


# -- protobuf values ---------------------------------------------------------------------------

cdef int _skip_field(const uint8_t[::1] buf, Py_ssize_t end, Py_ssize_t* pos, uint64_t wire, object what) except -1:
    cdef uint64_t length
    if wire == 0:
        _varint(buf, end, pos, 10, &length, what)
    elif wire == 1:
        if end - pos[0] < 8:
            raise FormatError(f"{what}: truncated fixed64 at byte {pos[0]}")
        pos[0] += 8
    elif wire == 2:
        _varint(buf, end, pos, 10, &length, what)
        if length > <uint64_t>(end - pos[0]):
            raise FormatError(f"{what}: field of {length} bytes at byte {pos[0]} overruns the message")
        pos[0] += <Py_ssize_t>length
    elif wire == 5:
        if end - pos[0] < 4:
            raise FormatError(f"{what}: truncated fixed32 at byte {pos[0]}")
        pos[0] += 4
    else:
        raise FormatError(f"{what}: unsupported protobuf wire type {wire} at byte {pos[0]}")
    return 0


cdef int _expect_wire(uint64_t wire, uint64_t expected, int field, object what) except -1:
    if wire != expected:
        raise FormatError(f"{what}: field {field} has wire type {wire}, expected {expected}")
    return 0


cdef int _sub_end(const uint8_t[::1] buf, Py_ssize_t end, Py_ssize_t* pos, Py_ssize_t* sub_end, object what) except -1:
    cdef uint64_t length
    _varint(buf, end, pos, 10, &length, what)
    if length > <uint64_t>(end - pos[0]):
        raise FormatError(f"{what}: sub-message of {length} bytes at byte {pos[0]} overruns its parent")
    sub_end[0] = pos[0] + <Py_ssize_t>length
    return 0


cdef object _decode_shape(const uint8_t[::1] buf, Py_ssize_t pos, Py_ssize_t end, object what):
    """TensorShapeProto -> tuple of ints, or None for unknown rank."""
    cdef uint64_t tag, value
    cdef Py_ssize_t dim_end
    cdef list dims = []
    cdef bint unknown_rank = False
    cdef int64_t size
    while pos < end:
        _varint(buf, end, &pos, 10, &tag, what)
        if (tag >> 3) == 2:
            _expect_wire(tag & 7, 2, 2, what)
            _sub_end(buf, end, &pos, &dim_end, what)
            size = 0
            while pos < dim_end:
                _varint(buf, dim_end, &pos, 10, &tag, what)
                if (tag >> 3) == 1 and (tag & 7) == 0:
                    _varint(buf, dim_end, &pos, 10, &value, what)
                    size = <int64_t>value
                else:
                    _skip_field(buf, dim_end, &pos, tag & 7, what)
            dims.append(size)
        elif (tag >> 3) == 3 and (tag & 7) == 0:
            _varint(buf, end, &pos, 10, &value, what)
            unknown_rank = value != 0
        else:
            _skip_field(buf, end, &pos, tag & 7, what)
    if unknown_rank:
        return None
    return tuple(dims)


cdef list _decode_slice(const uint8_t[::1] buf, Py_ssize_t pos, Py_ssize_t end, object what):
    """TensorSliceProto -> list of (start, length) with length -1 for a full extent."""
    cdef uint64_t tag, value
    cdef Py_ssize_t ext_end
    cdef list extents = []
    cdef int64_t start, length
    while pos < end:
        _varint(buf, end, &pos, 10, &tag, what)
        if (tag >> 3) == 1:
            _expect_wire(tag & 7, 2, 1, what)
            _sub_end(buf, end, &pos, &ext_end, what)
            start = 0
            length = -1
            while pos < ext_end:
                _varint(buf, ext_end, &pos, 10, &tag, what)
                if (tag >> 3) == 1 and (tag & 7) == 0:
                    _varint(buf, ext_end, &pos, 10, &value, what)
                    start = <int64_t>value
                elif (tag >> 3) == 2 and (tag & 7) == 0:
                    _varint(buf, ext_end, &pos, 10, &value, what)
                    length = <int64_t>value
                else:
                    _skip_field(buf, ext_end, &pos, tag & 7, what)
            extents.append((start, length))
        else:
            _skip_field(buf, end, &pos, tag & 7, what)
    return extents


cdef inline Py_ssize_t _put_varint(uint8_t* out, uint64_t value) noexcept nogil:
    cdef Py_ssize_t n = 0
    while value >= 0x80:
        out[n] = <uint8_t>((value & 0x7F) | 0x80)
        value >>= 7
        n += 1
    out[n] = <uint8_t>value
    return n + 1


def encode_plain_entry(uint64_t dtype, shape, uint64_t shard_id, uint64_t offset, uint64_t size, uint32_t crc32c):
    """The BundleEntryProto of a tensor without slices, with a checksum: the bytes
    ``fastckpt.formats.tf.proto.encode_entry`` writes for it (TensorFlow's field order, zeros omitted), built
    in C. Values must be non-negative; shapes of at most 64 dimensions (else ``ValueError``: the Python
    encoder takes the rest).

    >>> encode_plain_entry(1, (2, 3), 0, 195, 24, 0x173DDBC0).hex(" ")
    '08 01 12 08 12 02 08 02 12 02 08 03 20 c3 01 28 18 35 c0 db 3d 17'
    """
    cdef uint8_t buf[64 * 13 + 64]
    cdef uint8_t dim_buf[64 * 13]
    cdef Py_ssize_t n = 0, m = 0, ndim
    cdef uint64_t d
    cdef uint8_t dn
    ndim = len(shape)
    if ndim > 64:
        raise ValueError(f"{ndim} dimensions: more than this encoder takes")
    for value in shape:
        d = value  # OverflowError for a negative dimension: the caller's encoder takes it
        dim_buf[m] = 0x12  # dim: field 2, length-delimited
        if d == 0:
            dim_buf[m + 1] = 0
            m += 2
        else:
            dim_buf[m + 2] = 0x08  # size: field 1, varint
            dn = <uint8_t>(1 + _put_varint(dim_buf + m + 3, d))
            dim_buf[m + 1] = dn
            m += 2 + dn
    if dtype:
        buf[n] = 0x08
        n += 1 + _put_varint(buf + n + 1, dtype)
    buf[n] = 0x12  # shape: field 2, length-delimited
    n += 1 + _put_varint(buf + n + 1, <uint64_t>m)
    memcpy(buf + n, dim_buf, <size_t>m)
    n += m
    if shard_id:
        buf[n] = 0x18
        n += 1 + _put_varint(buf + n + 1, shard_id)
    if offset:
        buf[n] = 0x20
        n += 1 + _put_varint(buf + n + 1, offset)
    if size:
        buf[n] = 0x28
        n += 1 + _put_varint(buf + n + 1, size)
    buf[n] = 0x35  # crc32c: field 6, fixed32
    buf[n + 1] = <uint8_t>crc32c
    buf[n + 2] = <uint8_t>(crc32c >> 8)
    buf[n + 3] = <uint8_t>(crc32c >> 16)
    buf[n + 4] = <uint8_t>(crc32c >> 24)
    n += 5
    return (<char*>buf)[:n]


def decode_entry(data, what="bundle entry"):
    """Decode a ``BundleEntryProto``.

    Returns ``(dtype, shape, shard_id, offset, size, crc32c, slices)``: ``shape``
    is a tuple (None for unknown rank), ``crc32c`` the stored masked value or
    None when absent, ``slices`` a list of extent lists. Unknown fields are
    skipped; fields may come in any order.

    >>> decode_entry(bytes.fromhex("0801120812020802120208032087012818"))
    (1, (2, 3), 0, 135, 24, None, [])
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t end = buf.shape[0]
    cdef Py_ssize_t pos = 0, sub_end
    cdef uint64_t tag, value
    cdef int64_t dtype = 0, shard_id = 0, offset = 0, size = 0
    shape = ()
    crc = None
    cdef list slices = []
    while pos < end:
        _varint(buf, end, &pos, 10, &tag, what)
        field = tag >> 3
        wire = tag & 7
        if field == 1 and wire == 0:
            _varint(buf, end, &pos, 10, &value, what)
            dtype = <int64_t>value
        elif field == 2:
            _expect_wire(wire, 2, 2, what)
            _sub_end(buf, end, &pos, &sub_end, what)
            shape = _decode_shape(buf, pos, sub_end, what)
            pos = sub_end
        elif field == 3 and wire == 0:
            _varint(buf, end, &pos, 10, &value, what)
            shard_id = <int64_t>value
        elif field == 4 and wire == 0:
            _varint(buf, end, &pos, 10, &value, what)
            offset = <int64_t>value
        elif field == 5 and wire == 0:
            _varint(buf, end, &pos, 10, &value, what)
            size = <int64_t>value
        elif field == 6:
            _expect_wire(wire, 5, 6, what)
            if end - pos < 4:
                raise FormatError(f"{what}: truncated crc32c at byte {pos}")
            crc = _fixed32(buf, pos)
            pos += 4
        elif field == 7:
            _expect_wire(wire, 2, 7, what)
            _sub_end(buf, end, &pos, &sub_end, what)
            slices.append(_decode_slice(buf, pos, sub_end, what))
            pos = sub_end
        else:
            _skip_field(buf, end, &pos, wire, what)
    return dtype, shape, shard_id, offset, size, crc, slices


def iter_fields(data, what="message"):
    """Split a protobuf message into ``[(field, wire, value)]``.

    ``value`` is an int for varint (0), fixed64 (1) and fixed32 (5) fields and
    ``bytes`` for length-delimited (2) ones.
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t end = buf.shape[0]
    cdef Py_ssize_t pos = 0, sub_end
    cdef uint64_t tag, value
    cdef list out = []
    while pos < end:
        _varint(buf, end, &pos, 10, &tag, what)
        field = tag >> 3
        wire = tag & 7
        if field == 0:
            raise FormatError(f"{what}: field number 0 at byte {pos}")
        if wire == 0:
            _varint(buf, end, &pos, 10, &value, what)
            out.append((field, 0, value))
        elif wire == 2:
            _sub_end(buf, end, &pos, &sub_end, what)
            out.append((field, 2, bytes(buf[pos:sub_end])))
            pos = sub_end
        elif wire == 5:
            if end - pos < 4:
                raise FormatError(f"{what}: truncated fixed32 at byte {pos}")
            out.append((field, 5, _fixed32(buf, pos)))
            pos += 4
        elif wire == 1:
            if end - pos < 8:
                raise FormatError(f"{what}: truncated fixed64 at byte {pos}")
            out.append((field, 1, _fixed32(buf, pos) | (<uint64_t>_fixed32(buf, pos + 4) << 32)))
            pos += 8
        else:
            raise FormatError(f"{what}: unsupported protobuf wire type {wire} at byte {pos}")
    return out


# -- DT_STRING payloads ------------------------------------------------------------------------

def decode_string_tensor(data, Py_ssize_t count, what="string tensor", bint verify=True):
    """Decode a DT_STRING payload of ``count`` elements; returns ``(list_of_bytes, crc32c)``.

    Layout: ``count`` varint64 lengths, a fixed32 masked CRC32C of the lengths
    (each as uint32 LE, or uint64 LE when it exceeds 0xFFFFFFFF), then the bytes.
    The returned ``crc32c`` is the masked running checksum TensorFlow stores in
    the entry (lengths, the stored length checksum, then the bytes). The length
    checksum is checked when ``verify`` is true.
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    cdef Py_ssize_t end = buf.shape[0]
    cdef Py_ssize_t pos = 0, i
    cdef uint64_t length, total = 0
    cdef list lengths = []
    cdef list out = []
    if count < 0:
        raise FormatError(f"{what}: negative element count {count}")
    if count > end:  # each element needs at least its one-byte length
        raise FormatError(f"{what}: {count} elements need at least {count} bytes of lengths, the payload has {end}")
    crc = 0
    for i in range(count):
        _varint(buf, end, &pos, 10, &length, what)
        lengths.append(length)
        total += length
        if total > <uint64_t>end:
            raise FormatError(f"{what}: element {i} ends past the payload ({end} bytes)")
        if verify:
            crc = _crc32c.crc32c((<object>length).to_bytes(8 if length > 0xFFFFFFFFu else 4, "little"), crc)
    if end - pos < 4:
        raise FormatError(f"{what}: truncated length checksum at byte {pos}")
    stored_length_crc = _fixed32(buf, pos)
    if verify and stored_length_crc != mask_crc(crc):
        raise ChecksumMismatchError(f"{what}: length checksum mismatch (stored {stored_length_crc:#010x}, "
                                    f"computed {mask_crc(crc):#010x})")
    if verify:
        crc = _crc32c.crc32c(bytes(buf[pos:pos + 4]), crc)
    pos += 4
    if <uint64_t>(end - pos) != total:
        raise FormatError(f"{what}: the lengths add up to {total} bytes but {end - pos} bytes follow them")
    for length in lengths:
        piece = bytes(buf[pos:pos + <Py_ssize_t>length])
        if verify:
            crc = _crc32c.crc32c(piece, crc)
        out.append(piece)
        pos += <Py_ssize_t>length
    return out, (mask_crc(crc) if verify else None)


# -- the columnar bundle index -----------------------------------------------------------------
#
# read_bundle_index walks every data block of an opened IndexTable and decodes each BundleEntryProto
# straight into the columns of a BundleIndex (a TensorIndex whose infos are TFTensorInfo, made on
# access). Only the common entry (a listed, numeric, checksummed tensor) takes the native path; any
# other entry, and any entry the native decoder does not accept as is, goes through the reader's own
# per-entry decoder, which gives it the same info or raises the same error as ever.

cnp.import_array()

cdef extern from "Python.h":
    str _decode_utf8 "PyUnicode_DecodeUTF8" (const char* s, Py_ssize_t size, const char* errors)


DEF _MAX_DIMS = 32  # as TensorIndex and MappedFile.array
DEF _DTYPE_TABLE = 128  # DataType values the native path knows (a larger one takes the per-entry path)
_BUNDLE_EXTRA_FIELDS = ("shard", "tf_dtype", "crc32c")
# A payload from this size on is checksummed by the crc32c package (several streams at once) rather than here.
_LARGE_CRC = 1 << 16
_new = object.__new__
_set = object.__setattr__


def crc32c_of(data, uint32_t crc=0):
    """The CRC32C of ``data`` (a bytes-like object) continuing from ``crc``, as ``crc32c.crc32c`` computes it;
    the checksum the bundle index verifies views with.

    >>> hex(crc32c_of(b"123456789"))
    '0xe3069283'
    """
    cdef const uint8_t[::1] buf = _as_view(data)
    if buf.shape[0] == 0:
        return crc
    return fastckpt_crc32c(crc, &buf[0], <size_t>buf.shape[0])


cdef inline int _skip(const uint8_t* p, Py_ssize_t end, Py_ssize_t* pos, uint64_t wire) noexcept nogil:
    """``_skip_field`` without its errors: 1 with ``pos`` past the field, 0 where it would raise."""
    cdef uint64_t length
    if wire == 0:
        return _rv(p, end, pos, 10, &length)
    if wire == 1:
        if end - pos[0] < 8:
            return 0
        pos[0] += 8
        return 1
    if wire == 2:
        if not _rv(p, end, pos, 10, &length) or length > <uint64_t>(end - pos[0]):
            return 0
        pos[0] += <Py_ssize_t>length
        return 1
    if wire == 5:
        if end - pos[0] < 4:
            return 0
        pos[0] += 4
        return 1
    return 0


cdef struct _Plain:
    int64_t dtype
    int64_t shard
    int64_t offset
    int64_t size
    uint32_t crc
    int ndims
    int64_t dims[_MAX_DIMS]


cdef int _plain_shape(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, _Plain* e) noexcept nogil:
    """``_decode_shape`` for a known shape of at most 32 non-negative dimensions; 0 for anything else."""
    cdef uint64_t tag, value, length
    cdef Py_ssize_t dim_end
    cdef int64_t size
    e.ndims = 0
    while pos < end:
        if not _rv(p, end, &pos, 10, &tag):
            return 0
        if (tag >> 3) == 2:
            if (tag & 7) != 2 or not _rv(p, end, &pos, 10, &length) or length > <uint64_t>(end - pos):
                return 0
            dim_end = pos + <Py_ssize_t>length
            size = 0
            while pos < dim_end:
                if not _rv(p, dim_end, &pos, 10, &tag):
                    return 0
                if (tag >> 3) == 1 and (tag & 7) == 0:
                    if not _rv(p, dim_end, &pos, 10, &value):
                        return 0
                    size = <int64_t>value
                elif not _skip(p, dim_end, &pos, tag & 7):
                    return 0
            if size < 0 or e.ndims == _MAX_DIMS:
                return 0
            e.dims[e.ndims] = size
            e.ndims += 1
        elif (tag >> 3) == 3 and (tag & 7) == 0:
            if not _rv(p, end, &pos, 10, &value) or value != 0:  # unknown rank
                return 0
        elif not _skip(p, end, &pos, tag & 7):
            return 0
    return 1


cdef int _plain_entry(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, _Plain* e) noexcept nogil:
    """``decode_entry`` for an entry without slices, with a crc32c and a shape ``_plain_shape`` takes; 0 (leave it
    to ``decode_entry``) for anything else. Fields are taken as ``decode_entry`` takes them: any order, the last
    one wins, unknown ones skipped."""
    cdef uint64_t tag, value, length
    cdef uint64_t field, wire
    cdef bint has_crc = False
    e.dtype = e.shard = e.offset = e.size = 0
    e.ndims = 0
    while pos < end:
        if not _rv(p, end, &pos, 10, &tag):
            return 0
        field = tag >> 3
        wire = tag & 7
        if field == 1 and wire == 0:
            if not _rv(p, end, &pos, 10, &value):
                return 0
            e.dtype = <int64_t>value
        elif field == 2:
            if wire != 2 or not _rv(p, end, &pos, 10, &length) or length > <uint64_t>(end - pos):
                return 0
            if not _plain_shape(p, pos, pos + <Py_ssize_t>length, e):
                return 0
            pos += <Py_ssize_t>length
        elif field == 3 and wire == 0:
            if not _rv(p, end, &pos, 10, &value):
                return 0
            e.shard = <int64_t>value
        elif field == 4 and wire == 0:
            if not _rv(p, end, &pos, 10, &value):
                return 0
            e.offset = <int64_t>value
        elif field == 5 and wire == 0:
            if not _rv(p, end, &pos, 10, &value):
                return 0
            e.size = <int64_t>value
        elif field == 6:
            if wire != 5 or end - pos < 4:
                return 0
            e.crc = (<uint32_t>p[pos]) | (<uint32_t>p[pos + 1] << 8) | (<uint32_t>p[pos + 2] << 16) | (
                <uint32_t>p[pos + 3] << 24)
            has_crc = True
            pos += 4
        elif field == 7:  # a slice: a partitioned variable
            return 0
        elif not _skip(p, end, &pos, wire):
            return 0
    return has_crc


cdef inline int _key_cmp(const char* a, Py_ssize_t na, const char* b, Py_ssize_t nb) noexcept nogil:
    cdef int c = 0
    if na and nb:
        c = memcmp(a, b, <size_t>(na if na < nb else nb))
    if c:
        return c
    return (na > nb) - (na < nb)


cdef class _Keys:
    """The keys and value locations of a table's entries, in table order (C arrays, freed with the object)."""
    cdef char* arena
    cdef Py_ssize_t arena_count, arena_capacity
    cdef int64_t* key_at
    cdef int64_t* key_len
    cdef int64_t* value_at
    cdef int64_t* value_len
    cdef int32_t* block
    cdef Py_ssize_t count, capacity
    cdef Py_ssize_t max_key_bytes  # the most the keys may decode to (KEY_EXPANSION), checked by _walk_block
    cdef Py_ssize_t index_size

    def __cinit__(self):
        self.max_key_bytes = 0x7FFFFFFFFFFFFFFF
        self.index_size = 0
        self.arena = NULL
        self.key_at = self.key_len = self.value_at = self.value_len = NULL
        self.block = NULL
        self.arena_count = self.arena_capacity = self.count = self.capacity = 0

    def __dealloc__(self):
        PyMem_Free(self.arena)
        PyMem_Free(self.key_at)
        PyMem_Free(self.key_len)
        PyMem_Free(self.value_at)
        PyMem_Free(self.value_len)
        PyMem_Free(self.block)

    cdef int grow(self, Py_ssize_t key_bytes) except -1:
        """Room for one more entry whose key has ``key_bytes`` bytes."""
        cdef Py_ssize_t want
        if self.count == self.capacity:
            want = max(2 * self.capacity, 1024)
            self.key_at = <int64_t*>_realloc(self.key_at, want, sizeof(int64_t))
            self.key_len = <int64_t*>_realloc(self.key_len, want, sizeof(int64_t))
            self.value_at = <int64_t*>_realloc(self.value_at, want, sizeof(int64_t))
            self.value_len = <int64_t*>_realloc(self.value_len, want, sizeof(int64_t))
            self.block = <int32_t*>_realloc(self.block, want, sizeof(int32_t))
            self.capacity = want
        if key_bytes > self.arena_capacity - self.arena_count:
            want = max(2 * self.arena_capacity, self.arena_count + key_bytes, 4096)
            self.arena = <char*>_realloc(self.arena, want, 1)
            self.arena_capacity = want
        return 0

    cdef bytes key(self, Py_ssize_t j):
        return self.arena[self.key_at[j]:self.key_at[j] + self.key_len[j]]



cdef void* _realloc(void* block, Py_ssize_t count, size_t item) except NULL:
    cdef void* p
    if count > (<Py_ssize_t>0x7FFFFFFFFFFFFFFF) // <Py_ssize_t>item // 2:
        raise MemoryError(f"a bundle index of {count} entries is more than this machine can address")
    p = PyMem_Realloc(block, <size_t>count * item)
    if p == NULL:
        raise MemoryError(f"could not allocate {count * item} bytes for the columns of a bundle index of {count} "
                          "entries")
    return p


# The keys of an index may decode to at most KEY_EXPANSION times its size (plus KEY_BYTES_FLOOR): keys that share
# a prefix with the one before are stored as their new bytes only, so an index of n keys each one byte longer
# than the last would decode to n**2 / 2 bytes (held several times over, as keys, names and infos); TensorFlow
# stores a whole key every 16 entries, which keeps real indexes well below 16x (the reference files: <= 2x).
KEY_EXPANSION = 64
KEY_BYTES_FLOOR = 1 << 20


def max_key_bytes(Py_ssize_t index_size):
    """The most bytes the keys of a ``index_size``-byte index may decode to: ``KEY_EXPANSION`` times it, plus
    ``KEY_BYTES_FLOOR``.

    >>> max_key_bytes(1000) == 64 * 1000 + (1 << 20)
    True
    """
    return KEY_EXPANSION * index_size + KEY_BYTES_FLOOR


cdef int _too_many_key_bytes(what, Py_ssize_t count, Py_ssize_t limit, Py_ssize_t entry_at,
                             uint64_t key_len) except -1:
    raise FormatError(
        f"{what}: the keys of the first {count} entries decode to more than {limit} bytes (entry at byte "
        f"{entry_at} has a key of {key_len} bytes, most of them repeated from the key before): not an index "
        f"TensorFlow writes (a whole key every 16 entries keeps its keys within 16x the index's size; the limit is "
        f"{KEY_EXPANSION}x plus {KEY_BYTES_FLOOR} bytes), refused rather than decoded into memory quadratic in "
        "the index's size")


cdef int _walk_block(_Keys keys, const uint8_t[::1] buf, int32_t block_no, object what) except -1:
    """``decode_block`` of one data block into ``keys``: the same checks and messages, no object per entry."""
    cdef uint32_t num_restarts
    cdef Py_ssize_t restarts_start = _restarts_start(buf, &num_restarts, what)
    cdef const uint8_t* p = &buf[0]  # a block has at least its 4-byte restart count
    cdef Py_ssize_t pos = 0, entry_at
    cdef uint64_t shared, non_shared, value_len
    cdef int64_t prev_at = 0, prev_len = 0  # the block's previous key; none yet
    cdef Py_ssize_t at
    while pos < restarts_start:
        entry_at = pos
        if not (_rv(p, restarts_start, &pos, 5, &shared) and _rv(p, restarts_start, &pos, 5, &non_shared)
                and _rv(p, restarts_start, &pos, 5, &value_len)):
            pos = entry_at  # _varint says why
            _varint(buf, restarts_start, &pos, 5, &shared, what)
            _varint(buf, restarts_start, &pos, 5, &non_shared, what)
            _varint(buf, restarts_start, &pos, 5, &value_len, what)
            raise AssertionError(f"{what}: entry at byte {entry_at}: varints decoded only on the second try")
        if shared > <uint64_t>prev_len:
            raise FormatError(f"{what}: entry at byte {entry_at} shares {shared} bytes with a previous key "
                              f"of {prev_len} bytes")
        if non_shared + value_len > <uint64_t>(restarts_start - pos):
            raise FormatError(f"{what}: entry at byte {entry_at} needs {non_shared + value_len} bytes of key and "
                              f"value but only {restarts_start - pos} remain before the restart array")
        if shared + non_shared > <uint64_t>(keys.max_key_bytes - keys.arena_count):
            _too_many_key_bytes(what, keys.count + 1, keys.max_key_bytes, entry_at, shared + non_shared)
        keys.grow(<Py_ssize_t>(shared + non_shared))
        at = keys.arena_count
        if shared:
            memcpy(keys.arena + at, keys.arena + prev_at, <size_t>shared)
        if non_shared:
            memcpy(keys.arena + at + <Py_ssize_t>shared, p + pos, <size_t>non_shared)
        pos += <Py_ssize_t>non_shared
        keys.key_at[keys.count] = at
        keys.key_len[keys.count] = <int64_t>(shared + non_shared)
        keys.value_at[keys.count] = pos
        keys.value_len[keys.count] = <int64_t>value_len
        keys.block[keys.count] = block_no
        keys.count += 1
        keys.arena_count = at + <Py_ssize_t>(shared + non_shared)
        prev_at, prev_len = at, <int64_t>(shared + non_shared)
        pos += <Py_ssize_t>value_len
    return 0


cdef bytes _value(_Keys keys, list blocks, Py_ssize_t j):
    """The value of entry ``j``."""
    cdef Py_ssize_t at = keys.value_at[j]
    return bytes(blocks[keys.block[j]][at:at + keys.value_len[j]])


cdef class _ShardRef:
    """A shard number and its mapping, swapped in as one object (threads that view tensors of different
    shards never pair one's number with the other's file)."""
    cdef int64_t shard
    cdef MappedFile file


cdef class BundleIndex(TensorIndex):
    """The listed tensors of a TensorFlow bundle: a :class:`~fastckpt._native.tensorindex.TensorIndex` whose infos
    are ``TFTensorInfo`` (made on access) and whose views come from each tensor's data shard, checksummed when
    the reader verifies.

    Made by :func:`read_bundle_index`; it is ``CheckpointReader.infos``.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import CheckpointReader, write_checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
    >>> write_checkpoint(prefix, {"w": np.arange(3, dtype=np.int16)})
    >>> with CheckpointReader(prefix) as reader:
    ...     index = reader.infos
    ...     type(index).__name__, index["w"].shard, index["w"].crc32c == reader.info("w").crc32c, index.view("w")
    ('BundleIndex', 0, True, array([0, 1, 2], dtype=int16))
    """
    cdef object _shard_of   # a weak reference to the reader's method shard number -> MappedFile
    cdef bint _verify
    cdef _ShardRef _cached  # the shard of the last view, or None
    cdef Py_ssize_t _loops  # views() loops running: they checked the SIGBUS handler once for all their tensors

    def views(self, names, fallback):
        """``{name: array}`` as :meth:`TensorIndex.views <fastckpt._native.tensorindex.TensorIndex.views>`; the
        checksums' guards check that the SIGBUS handler is in place once for the loop, not once a tensor.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.tf import CheckpointReader, write_checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
        >>> write_checkpoint(prefix, {"w": np.arange(3, dtype=np.int16)})
        >>> with CheckpointReader(prefix) as reader:
        ...     reader.infos.views(None, reader.host)
        {'w': array([0, 1, 2], dtype=int16)}
        """
        if self._verify:
            guard_check()
        self._loops += 1
        try:
            return TensorIndex.views(self, names, fallback)
        finally:
            self._loops -= 1

    cdef object info_at(self, Py_ssize_t i):
        cdef Py_ssize_t k
        cdef int64_t* extra
        info = self._infos[i]
        if info is None:
            extra = self.extras + 3 * i
            info = _new(self.info_type)  # fastckpt.info.from_checked_fields, as the reader's per-entry path
            _set(info, "__dict__", {
                "name": self.names[i], "dtype": self.dtypes[self.dtype_codes[i]],
                "shape": tuple([self.dims[k] for k in range(self.shape_at[i], self.shape_at[i + 1])]),
                "offset": self.offsets[i], "nbytes": self.nbytes[i], "fortran_order": False, "compression": None,
                "shard": extra[0], "tf_dtype": extra[1], "crc32c": extra[2], "slices": ()})
            self._infos[i] = info
        return info

    cdef object view_at(self, Py_ssize_t i):
        """The view of tensor ``i`` over its shard's mapping (checksummed when verifying), or None where the
        reader's general path must read it (and says why, if anything is wrong)."""
        cdef int64_t shard = self.extras[3 * i]
        cdef MappedFile m
        cdef _ShardRef ref = self._cached
        cdef _Block block
        cdef int64_t offset = self.offsets[i]
        cdef int64_t nbytes = self.nbytes[i]
        cdef int64_t start = self.shape_at[i]
        cdef int nd = <int>(self.shape_at[i + 1] - start)
        cdef uint32_t crc
        cdef void* hold
        if not (self.flags[i] & VIEWABLE) or nd > _MAX_DIMS:
            return None
        if ref is None or ref.shard != shard:
            shard_of = self._shard_of()
            if shard_of is None:
                return None
            ref = _ShardRef.__new__(_ShardRef)
            ref.shard = shard
            ref.file = shard_of(shard)  # raises as reading would: missing shard, closed reader
            self._cached = ref
        m = ref.file
        block = m._block  # None once closed, and for the pread backend
        if block is None or block.ptr == NULL:
            return None
        if offset < 0 or nbytes < 0 or offset > block.size or nbytes > block.size - offset:
            return None
        if self._verify:
            # The checksum reads the mapping: a shard truncated under it is a FormatError, not SIGBUS.
            guard_enter(block, m.path, self.names[i], &hold, 0 if self._loops else -1)
            try:
                if nbytes >= _LARGE_CRC:
                    crc = _crc32c.crc32c(memoryview(block)[offset:offset + nbytes])
                else:
                    crc = fastckpt_crc32c(0, block.ptr + offset, <size_t>nbytes)
            finally:
                guard_exit(block, hold, m.path, self.names[i])
            if mask_crc(crc) != <uint32_t>self.extras[3 * i + 2]:
                return None  # the general path raises ChecksumMismatchError
        # SAFETY: checked above: the shard's mapping holds the tensor's nbytes (product of dims times itemsize,
        # checked by read_bundle_index)
        return view_in_block(block, self.dtypes[self.dtype_codes[i]], nd, self.dims + start, offset, False)

    def forget_shards(self):
        """Drop the shard mapping kept for the last view (the reader calls this when it closes).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.tf import CheckpointReader, write_checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
        >>> write_checkpoint(prefix, {"w": np.arange(3, dtype=np.int16)})
        >>> reader = CheckpointReader(prefix)
        >>> reader.infos.view("w").tolist()
        [0, 1, 2]
        >>> reader.infos.forget_shards()   # the next view maps its shard again through the reader
        >>> reader.infos.view("w").tolist()
        [0, 1, 2]
        >>> reader.close()
        """
        self._cached = None

    def shape_lists(self):
        """``{name: list(shape)}`` of every tensor, in index order, without making its info.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.tf import CheckpointReader, write_checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
        >>> write_checkpoint(prefix, {"a": np.zeros((2, 3)), "b": np.float32(1)})
        >>> with CheckpointReader(prefix) as reader:
        ...     reader.infos.shape_lists()
        {'a': [2, 3], 'b': []}
        """
        cdef dict out = {}
        cdef Py_ssize_t i, k
        for i in range(self.count):
            info = self._infos[i]
            if info is None:
                out[self.names[i]] = [self.dims[k] for k in range(self.shape_at[i], self.shape_at[i + 1])]
            else:
                out[self.names[i]] = list(info.shape)
        return out

    def __repr__(self):
        return f"<BundleIndex of {self.count} tensors>"


def read_bundle_index(table, str index_path, header_of, make_info, shard_of, dict numpy_dtypes, info_type,
                      bint verify):
    """Walk every data block of ``table`` (an opened ``IndexTable`` of the bundle index ``index_path``) into
    columns.

    ``header_of(value)`` decodes and checks the header entry (the first, under
    the empty key) and returns the header; ``make_info(name, value)`` is the
    reader's per-entry decoder, used for hidden entries (keys starting with
    ``\\x00``), strings, partitioned variables and anything unusual (it returns
    None for an entry that is left out of the index: an opaque variant);
    ``shard_of(shard)`` returns a shard's ``MappedFile`` (the index holds a
    weak reference to it); ``numpy_dtypes`` maps DataType values to numpy dtypes.
    Blocks are checked as ``IndexTable.items`` checks them (trailer checksums,
    structure, strictly increasing keys), with the same messages, and every
    entry as ``make_info`` checks it.

    Returns ``(index, hidden, header, names)``: a :class:`BundleIndex` of the
    listed tensors in table order, ``{key bytes: info}`` of the hidden entries,
    the header and the list of listed names (``CheckpointReader`` opens a
    checkpoint with it).

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import CheckpointReader, write_checkpoint
    >>> from fastckpt._native.mapped import MappedFile
    >>> from fastckpt.formats.tf import dtypes
    >>> from fastckpt.formats.tf.table import IndexTable
    >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
    >>> write_checkpoint(prefix, {"w": np.zeros((2, 3), np.float32), "s": np.array([b"x"], dtype=object)})
    >>> reader = CheckpointReader(prefix)
    >>> with MappedFile(prefix + ".index") as mapped:
    ...     index, hidden, header, names = read_bundle_index(
    ...         IndexTable(mapped), prefix + ".index", reader._read_header, reader._make_info, reader._shard,
    ...         dtypes._NUMPY, type(reader.info("w")), True)
    >>> names, index["w"].shape, index["w"].nbytes, index["s"].dtype, hidden, header.num_shards
    (['s', 'w'], (2, 3), 24, dtype('O'), {}, 1)
    >>> index.view("w").shape, index.view("s")  # a string tensor is read by the reader's general path
    ((2, 3), None)
    >>> reader.close()
    """
    cdef _Keys keys = _Keys()
    cdef list blocks = []
    cdef Py_ssize_t i, j, n_blocks = len(table.block_handles)
    cdef Py_ssize_t first_of_block, table_size
    cdef const uint8_t[::1] buf
    cdef const uint8_t* p = NULL
    cdef BundleIndex index
    cdef _Plain e
    cdef int32_t code_of[_DTYPE_TABLE]
    cdef int64_t itemsize_of[_DTYPE_TABLE]
    cdef int64_t max_shard, n_items
    cdef int64_t i64_max = 0x7FFFFFFFFFFFFFFF
    cdef int32_t code, block_no
    cdef bint ascii, fits, big_endian
    cdef int k
    cdef Py_ssize_t name_len
    cdef const char* name_ptr
    cdef dict hidden = {}
    cdef dict codes = {}
    cdef str name
    cdef bytes utf8
    path = table.path
    keys.index_size = table.mapped.size
    keys.max_key_bytes = max_key_bytes(keys.index_size)
    for i in range(n_blocks):  # IndexTable.items, without a tuple per entry
        off, size = table.block_handles[i]
        data = _read_block(table.mapped, off, size, f"data block {i}", table.verify, False)  # IndexTable.block
        blocks.append(data)
        first_of_block = keys.count
        _walk_block(keys, _as_view(data), <int32_t>i, f"{path}: data block {i} at offset {off}")
        for j in range(max(first_of_block, 1), keys.count):
            if _key_cmp(keys.arena + keys.key_at[j], keys.key_len[j], keys.arena + keys.key_at[j - 1],
                        keys.key_len[j - 1]) <= 0:
                raise FormatError(f"{path}: data block {i}: key {keys.key(j)!r} does not sort after "
                                  f"{keys.key(j - 1)!r} (keys must be strictly increasing)")

    if keys.count == 0 or keys.key_len[0] != 0:
        raise FormatError(f"{index_path}: the first key must be the empty header key, got "
                          f"{keys.key(0) if keys.count else None!r} (not a tensor bundle?)")
    header = header_of(_value(keys, blocks, 0))
    max_shard = max(header.num_shards, 1) if -2**63 <= header.num_shards < 2**63 else 2**63 - 1
    big_endian = bool(header.big_endian)

    index = BundleIndex.__new__(BundleIndex)
    index._setup(None, [], info_type, _BUNDLE_EXTRA_FIELDS)
    index._shard_of = weakref.WeakMethod(shard_of)
    index._verify = verify
    for k in range(_DTYPE_TABLE):
        code_of[k] = -1
        itemsize_of[k] = 0
    for enum, dtype in numpy_dtypes.items():
        if 0 <= enum < _DTYPE_TABLE and not dtype.hasobject:
            code_of[enum] = len(index.dtypes)
            itemsize_of[enum] = dtype.itemsize
            index.dtypes.append(dtype)
            codes.setdefault(dtype, code_of[enum])
    index.reserve(keys.count, keys.count)
    table_size = 32
    while table_size < 2 * (keys.count + 1):
        table_size *= 2
    index._index_names(table_size)  # the name table at its final size: no rehash on the way

    block_no = -1
    for j in range(1, keys.count):
        if keys.block[j] != block_no:
            block_no = keys.block[j]
            buf = _as_view(blocks[block_no])
            p = &buf[0]
        name_ptr = keys.arena + keys.key_at[j]
        name_len = keys.key_len[j]
        name = _decode_utf8(name_ptr, name_len, "surrogateescape")
        if name_len and name_ptr[0] == 0:  # a hidden entry: a slice of a partitioned variable
            info = make_info(name, _value(keys, blocks, j))
            if info is not None:
                hidden[keys.key(j)] = info
            continue
        ascii = True
        for k in range(name_len):
            if <uint8_t>name_ptr[k] >= 0x80:
                ascii = False
                break
        utf8 = None if ascii else name.encode("utf-8", "surrogatepass")  # what TensorIndex.position hashes
        fits = _plain_entry(p, keys.value_at[j], keys.value_at[j] + keys.value_len[j], &e) and (
            0 <= e.dtype < _DTYPE_TABLE and code_of[e.dtype] >= 0 and 0 <= e.shard < max_shard
            and e.offset >= 0 and e.size >= 0)
        if fits:  # size == count * itemsize, with no partial product past 2**63 (as MappedFile.array needs)
            n_items = itemsize_of[e.dtype]
            for k in range(e.ndims):
                if e.dims[k] != 0 and n_items > i64_max // e.dims[k]:
                    fits = False
                    break
                n_items *= e.dims[k]
            fits = fits and n_items == e.size
        if fits:
            for k in range(e.ndims):
                index.add_dim(<cnp.npy_intp>e.dims[k])
            if index.add(name, name_ptr if ascii else <const char*>utf8, name_len if ascii else len(utf8),
                         code_of[e.dtype], e.offset, e.size,
                         VIEWABLE if not (big_endian and itemsize_of[e.dtype] > 1) else 0):
                raise FormatError(f"{path}: tensor {name!r} is listed twice")  # keys increase: never
            index.extras[3 * index.count - 3] = e.shard
            index.extras[3 * index.count - 2] = e.dtype
            index.extras[3 * index.count - 1] = e.crc
            continue
        info = make_info(name, _value(keys, blocks, j))  # the per-entry path: its errors, or an info kept as made
        if info is None:  # an opaque entry (a tf.data iterator's variant ...): make_info listed it as skipped
            continue
        code = codes.get(info.dtype, -1)
        if code < 0:
            code = codes[info.dtype] = len(index.dtypes)
            index.dtypes.append(info.dtype)
        if utf8 is None:
            utf8 = name_ptr[:name_len]
        if index.add(name, utf8, len(utf8), code, 0, 0, 0):
            raise FormatError(f"{path}: tensor {name!r} is listed twice")
        index.extras[3 * index.count - 3] = info.shard
        index.extras[3 * index.count - 2] = info.tf_dtype
        index.extras[3 * index.count - 1] = -1 if info.crc32c is None else info.crc32c
        index.keep_info(info)
    index.finish()
    return index, hidden, header, index.names
