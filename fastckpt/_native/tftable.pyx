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

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from fastckpt._native.mapped cimport MappedFile

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


cdef int _varint(const uint8_t[::1] buf, Py_ssize_t end, Py_ssize_t* pos, int max_bytes,
                 uint64_t* out, object what) except -1:
    """Decode a LEB128 varint at ``pos[0]`` (advancing it) that must end before ``end``."""
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef int count = 0
    cdef uint8_t b
    cdef Py_ssize_t start = pos[0]
    while True:
        if pos[0] >= end:
            raise FormatError(f"{what}: truncated varint at byte {start} (the data ends at byte {end})")
        if count >= max_bytes:
            raise FormatError(f"{what}: varint at byte {start} is longer than {max_bytes} bytes")
        b = buf[pos[0]]
        pos[0] += 1
        count += 1
        if shift == 63 and (b & 0x7E):
            raise FormatError(f"{what}: varint at byte {start} overflows 64 bits")
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not (b & 0x80):
            break
        shift += 7
    if max_bytes == 5 and result > 0xFFFFFFFFu:
        raise FormatError(f"{what}: varint32 at byte {start} overflows 32 bits")
    out[0] = result
    return 0


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


def decode_block(data, what="block"):
    """Parse one uncompressed block into ``(keys, values, restarts)``.

    ``keys`` and ``values`` are lists of ``bytes`` in stored order, ``restarts``
    the list of restart offsets. Every entry's shared prefix must fit the
    previous key and every length must fit the block; the restart array must
    fit too. Restart *offsets* are not required to point at entries (iteration
    does not use them; :func:`block_seek` checks them when it does).

    >>> decode_block(bytes.fromhex("00010061" "00000000" "01000000"))
    ([b'a'], [b''], [0])
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
    restarts_start = _restarts_start(buf, &num_restarts, what)
    for i in range(num_restarts):
        restarts.append(_fixed32(buf, restarts_start + 4 * i))
    pos = 0
    while pos < restarts_start:
        key = _entry_key(buf, restarts_start, &pos, prev, &value_len, what)
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
    if offset > <uint64_t>mapped.size or size > <uint64_t>mapped.size:
        raise FormatError(f"{mapped.path}: {what} at offset {offset} with {size} bytes lies outside the file "
                          f"({mapped.size} bytes)")
    raw = mapped.read(<Py_ssize_t>offset, <Py_ssize_t>size + BLOCK_TRAILER_SIZE, what)
    kind = raw[size]
    if verify:
        stored = int.from_bytes(raw[size + 1:size + 5], "little")
        actual = mask_crc(_crc32c.crc32c(raw[:size + 1]))
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
