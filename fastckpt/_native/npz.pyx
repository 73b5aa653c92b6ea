"""Validating parser of NPZ archives, and the writer's member records (the spec is in ``fastckpt/formats/npz.py``).

``read_npz_index(m)`` finds the ZIP end-of-central-directory record (zip64
aware), walks the central directory, checks every member's local header and
``.npy`` header (read by ``fastckpt._native.npy``, which evaluates and unpickles
nothing), and returns one :class:`NpzTensorInfo` per member with the absolute
offset of its payload. ``MemberWriter`` builds each member's local and central
records for ``fastckpt.formats.npz.NpzWriter`` in C, sized exactly before they are
filled.

Archives as fastckpt and numpy write them (stored members, UTF-8 or ASCII names,
members in file order) are first read by a fast path that makes no Python object
per member beyond its name and parses each distinct ``.npy`` header once
(100,000 members in about 30 ms); anything else, damage included, goes to the
checking parser below, which gives every error message. Where the fast path
returns an index it equals the checking parser's (the fuzz tests hold them to it).

Every byte comes through ``MappedFile.span()``/``read()``, which are
bounds-checked; every field read below is preceded by a length check of the
span it comes from, so a damaged file raises
:class:`fastckpt.errors.FormatError` and is never read past its end. Sizes and
offsets are compared as Python integers, which cannot overflow.
"""

cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
cimport cython
from libc.string cimport memcmp, memcpy, memset
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object text)
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL
    object PyMemoryView_FromMemory(char* mem, Py_ssize_t size, int flags)
    int PyByteArray_Resize(object array, Py_ssize_t size) except -1
    char* PyByteArray_AS_STRING(object array)
    int PyBUF_READ
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyUnicode_DecodeASCII(const char* s, Py_ssize_t size, const char* errors)

import dataclasses
import itertools
import sys
import warnings
import zlib

import numpy as np

from fastckpt._native.gather cimport GatherWriter
from fastckpt.info import TensorInfo, from_checked_fields
from fastckpt._native.mapped cimport MappedFile
from fastckpt._native.npy cimport npy_total_length, parse_npy
from fastckpt._native.tensorindex cimport DEFLATE, FORTRAN_ORDER, VIEWABLE, TensorIndex
from fastckpt._native.npy import MAX_HEADER_SIZE
from fastckpt.errors import FormatError, NotZeroCopyWarning

cnp.import_array()

__all__ = ["read_npz_index", "read_npz_table", "NpzTensorInfo", "member_name_problem"]

# The first read of a stored member: it covers most .npy headers (numpy pads them to a multiple
# of 64 bytes, usually 128); a longer one takes a second read.
USUAL_HEADER_NBYTES = 256

cdef uint32_t SIG_LOCAL = 0x04034B50
cdef uint32_t SIG_CENTRAL = 0x02014B50
cdef uint32_t SIG_EOCD = 0x06054B50
cdef uint32_t SIG_ZIP64_EOCD = 0x06064B50
cdef uint32_t SIG_ZIP64_LOCATOR = 0x07064B50
cdef Py_ssize_t EOCD_SIZE = 22
cdef Py_ssize_t ZIP64_LOCATOR_SIZE = 20
cdef Py_ssize_t ZIP64_EOCD_SIZE = 56
cdef Py_ssize_t CENTRAL_SIZE = 46
cdef Py_ssize_t LOCAL_SIZE = 30
cdef Py_ssize_t MAX_COMMENT = 65535
# general-purpose flag bits
cdef uint16_t FLAG_ENCRYPTED = 0x0001
cdef uint16_t FLAG_STRONG_ENCRYPTION = 0x0040
cdef uint16_t FLAG_UTF8 = 0x0800
cdef uint16_t FLAG_MASKED_HEADERS = 0x2000
cdef uint16_t ZIP64_EXTRA_ID = 0x0001
METHOD_STORED = 0
METHOD_DEFLATED = 8


NpzTensorInfo = dataclasses.make_dataclass(
    "NpzTensorInfo",
    [("crc32", int, 0), ("member_nbytes", int, 0), ("header_nbytes", int, 0)],
    bases=(TensorInfo,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": """A :class:`~fastckpt.TensorInfo` of an NPZ member, with what the reader needs to check it.

    ``crc32`` is the member's CRC-32 from the central directory (over the whole
    ``.npy`` member: header and payload), ``member_nbytes`` the member's
    uncompressed size and ``header_nbytes`` the length of its ``.npy`` header.
    For a DEFLATE member ``offset``/``nbytes`` are those of the compressed
    stream.
    """,
    },
)


cdef inline uint16_t _u16(const uint8_t* p) noexcept nogil:
    return <uint16_t>p[0] | (<uint16_t>p[1] << 8)


cdef inline uint32_t _u32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _u64(const uint8_t* p) noexcept nogil:
    return <uint64_t>_u32(p) | (<uint64_t>_u32(p + 4) << 32)


def _sig(uint32_t value):
    return "PK" + "".join(f"\\x{b:02x}" for b in value.to_bytes(4, "little")[2:])


# -- ZIP -----------------------------------------------------------------------------------------


cdef tuple _find_end_records(MappedFile m):
    """Locate the end records; return (cd_offset, cd_size, count, cd_end) with zip64 values applied."""
    cdef Py_ssize_t size = m.size
    cdef Py_ssize_t tail
    cdef Py_ssize_t base
    cdef Py_ssize_t i
    cdef Py_ssize_t eocd = -1
    cdef const uint8_t* p
    path = m.path
    if size < EOCD_SIZE:
        raise FormatError(f"{path}: file is {size} bytes; a ZIP (NPZ) archive has at least {EOCD_SIZE} "
                          "(its end-of-central-directory record)")
    tail = min(size, EOCD_SIZE + MAX_COMMENT)
    base = size - tail
    p = m.span(base, tail, "ZIP end-of-central-directory search")
    i = tail - EOCD_SIZE
    while i >= 0:
        # The record's comment must run exactly to the end of the file.
        if _u32(p + i) == SIG_EOCD and i + EOCD_SIZE + _u16(p + i + 20) == tail:
            eocd = base + i
            break
        i -= 1
    if eocd < 0:
        raise FormatError(f"{path}: no ZIP end-of-central-directory record ({_sig(SIG_EOCD)}) in the last {tail} "
                          "bytes: not an NPZ/ZIP file, or truncated")
    p = m.span(eocd, EOCD_SIZE, "ZIP end-of-central-directory record")
    disk, cd_disk = _u16(p + 4), _u16(p + 6)
    count_disk, count = _u16(p + 8), _u16(p + 10)
    cd_size, cd_offset = _u32(p + 12), _u32(p + 16)
    cd_end = eocd

    if eocd >= ZIP64_LOCATOR_SIZE and _u32(m.span(eocd - ZIP64_LOCATOR_SIZE, 4, "zip64 locator")) == SIG_ZIP64_LOCATOR:
        loc = eocd - ZIP64_LOCATOR_SIZE
        p = m.span(loc, ZIP64_LOCATOR_SIZE, "zip64 end-of-central-directory locator")
        rec_disk, rec_offset, disks = _u32(p + 4), _u64(p + 8), _u32(p + 16)
        if rec_disk != 0 or disks > 1:
            raise FormatError(f"{path}: zip64 locator at offset {loc} describes a multi-disk archive "
                              f"(record on disk {rec_disk}, {disks} disks); expected one disk")
        if rec_offset + ZIP64_EOCD_SIZE > loc:
            raise FormatError(f"{path}: zip64 locator at offset {loc} points at a zip64 end record at offset "
                              f"{rec_offset}, expected at most {loc - ZIP64_EOCD_SIZE} (the record is "
                              f"{ZIP64_EOCD_SIZE} bytes and precedes the locator)")
        p = m.span(rec_offset, ZIP64_EOCD_SIZE, "zip64 end-of-central-directory record")
        if _u32(p) != SIG_ZIP64_EOCD:
            raise FormatError(f"{path}: bad zip64 end-of-central-directory signature at offset {rec_offset}: "
                              f"expected {_sig(SIG_ZIP64_EOCD)}, got {m.read(rec_offset, 4)!r}")
        rec_size = _u64(p + 4)
        if rec_offset + 12 + rec_size != loc:
            raise FormatError(f"{path}: zip64 end record at offset {rec_offset} declares {rec_size} bytes after its "
                              f"first 12, so it ends at {rec_offset + 12 + rec_size}; expected it to end at the "
                              f"locator at offset {loc}")
        disk, cd_disk = _u32(p + 16), _u32(p + 20)
        count_disk, count = _u64(p + 24), _u64(p + 32)
        cd_size, cd_offset = _u64(p + 40), _u64(p + 48)
        cd_end = rec_offset

    if disk != 0 or cd_disk != 0:
        raise FormatError(f"{path}: multi-disk ZIP archive (this disk {disk}, central directory on disk {cd_disk}); "
                          "expected a single-file archive")
    if count_disk != count:
        raise FormatError(f"{path}: end record counts {count_disk} entries on this disk but {count} in total; "
                          "expected equal counts (single-disk archive)")
    if cd_offset + cd_size != cd_end:
        raise FormatError(f"{path}: central directory at offset {cd_offset} with {cd_size} bytes ends at "
                          f"{cd_offset + cd_size}; expected it to end where the end record begins, at offset {cd_end}")
    if count * CENTRAL_SIZE > cd_size:
        raise FormatError(f"{path}: end record counts {count} entries, which need at least {count * CENTRAL_SIZE} "
                          f"bytes of central directory; got {cd_size}")
    return cd_offset, cd_size, count, cd_end


@cython.no_gc  # holds only strings and an int: never part of a cycle, and one per member need not be traversed
cdef class _Where:
    """Names a member for error messages; formatted only when a message is built (most never are)."""

    cdef object path, name, kind
    cdef object offset  # a Python int: a damaged zip64 field may hold any 64-bit value

    def __cinit__(self, path, name, kind, offset):
        self.path = path
        self.name = name
        self.kind = kind
        self.offset = offset

    def __str__(self):
        return f"{self.path}: member {self.name!r} ({self.kind} at offset {self.offset})"

    def __format__(self, spec):
        return format(str(self), spec)


def member_name_problem(str name):
    """What makes ``name`` unsafe as an NPZ member name, or None: the one rule the reader and the writer share.

    >>> member_name_problem("layer/w.npy") is None, member_name_problem("../w.npy")
    (True, "name has a '..' path component at position 0")
    """
    return _member_problem(name)


def _check_member_name(path, str name, Py_ssize_t where):
    problem = member_name_problem(name)
    if problem is not None:
        raise FormatError(f"{path}: member {name!r} (central directory entry at offset {where}): {problem}")


cdef list _read_central_directory(MappedFile m, uint64_t cd_offset, uint64_t cd_size, uint64_t count):
    """One tuple per entry: (name, name_bytes, flags, method, crc, csize, usize, local_offset, entry_offset)."""
    cdef const uint8_t* p
    cdef const uint8_t* e
    cdef const uint8_t* q
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t n = <Py_ssize_t>cd_size
    cdef Py_ssize_t nlen, elen, clen, epos, fsize, need
    cdef uint64_t k
    path = m.path
    p = m.span(<Py_ssize_t>cd_offset, n, "ZIP central directory")
    entries = []
    seen = set()
    for k in range(count):
        at = cd_offset + pos
        if pos + CENTRAL_SIZE > n:
            raise FormatError(f"{path}: central directory entry {k} at offset {at} needs {CENTRAL_SIZE} bytes, "
                              f"only {n - pos} remain in the central directory")
        if _u32(p + pos) != SIG_CENTRAL:
            raise FormatError(f"{path}: bad central directory signature at offset {at} (entry {k}): expected "
                              f"{_sig(SIG_CENTRAL)}, got {(<const char*>p)[pos:pos + 4]!r}")
        flags = _u16(p + pos + 8)
        method = _u16(p + pos + 10)
        crc = _u32(p + pos + 16)
        csize = _u32(p + pos + 20)
        usize = _u32(p + pos + 24)
        nlen = _u16(p + pos + 28)
        elen = _u16(p + pos + 30)
        clen = _u16(p + pos + 32)
        disk = _u16(p + pos + 34)
        local = _u32(p + pos + 42)
        if pos + CENTRAL_SIZE + nlen + elen + clen > n:
            raise FormatError(f"{path}: central directory entry {k} at offset {at} declares a {nlen}-byte name, "
                              f"{elen}-byte extra field and {clen}-byte comment that run past the central "
                              f"directory's end at offset {cd_offset + n}")
        raw_name = (<const char*>p)[pos + CENTRAL_SIZE:pos + CENTRAL_SIZE + nlen]
        if flags & FLAG_UTF8:
            try:
                name = raw_name.decode("utf-8")
            except UnicodeDecodeError:
                raise FormatError(f"{path}: central directory entry {k} at offset {at}: name {raw_name!r} is "
                                  "flagged UTF-8 but is not valid UTF-8") from None
        elif raw_name.isascii():
            name = raw_name.decode("ascii")  # cp437 agrees with ASCII below 0x80, and decodes far slower
        else:
            name = raw_name.decode("cp437")
        _check_member_name(path, name, at)
        if name in seen:
            raise FormatError(f"{path}: member {name!r} appears twice in the central directory (again at offset "
                              f"{at}); expected unique names")
        seen.add(name)
        what = _Where(path, name, "central directory entry", at)
        if flags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION | FLAG_MASKED_HEADERS):
            raise FormatError(f"{what}: encrypted (flags 0x{flags:04x}); fastckpt reads unencrypted archives only")
        if method != METHOD_STORED and method != METHOD_DEFLATED:
            raise FormatError(f"{what}: compression method {method}; expected 0 (stored) or 8 (deflate)")

        # zip64 extra field: the 64-bit values of exactly those fields that hold the 0xFFFFFFFF sentinel.
        wanted = None
        if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or local == 0xFFFFFFFF or disk == 0xFFFF:
            wanted = [f for f, v in (("uncompressed size", usize), ("compressed size", csize),
                                     ("local header offset", local)) if v == 0xFFFFFFFF]
            if disk == 0xFFFF:
                wanted.append("disk number")
        if wanted:
            e = p + pos + CENTRAL_SIZE + nlen
            epos = 0
            found = False
            while epos + 4 <= elen:
                fsize = _u16(e + epos + 2)
                if epos + 4 + fsize > elen:
                    raise FormatError(f"{what}: extra field 0x{_u16(e + epos):04x} declares {fsize} bytes, "
                                      f"only {elen - epos - 4} remain in the {elen}-byte extra area")
                if _u16(e + epos) == ZIP64_EXTRA_ID:
                    need = 8 * len(wanted) - (4 if "disk number" in wanted else 0)
                    if fsize < need:
                        raise FormatError(f"{what}: zip64 extra field has {fsize} bytes; expected {need} for "
                                          f"{', '.join(wanted)}")
                    q = e + epos + 4
                    if usize == 0xFFFFFFFF:
                        usize = _u64(q)
                        q += 8
                    if csize == 0xFFFFFFFF:
                        csize = _u64(q)
                        q += 8
                    if local == 0xFFFFFFFF:
                        local = _u64(q)
                        q += 8
                    if disk == 0xFFFF:
                        disk = _u32(q)
                    found = True
                    break
                epos += 4 + fsize
            if not found:
                raise FormatError(f"{what}: {', '.join(wanted)} hold the zip64 sentinel 0xFFFFFFFF but the entry "
                                  "has no zip64 extra field (0x0001)")
        if disk != 0:
            raise FormatError(f"{what}: member starts on disk {disk}; expected 0 (single-disk archive)")
        if method == METHOD_STORED and csize != usize:
            raise FormatError(f"{what}: stored member has compressed size {csize} but uncompressed size {usize}; "
                              "expected equal sizes")
        entries.append((name, raw_name, flags, method, crc, csize, usize, local, at))
        pos += CENTRAL_SIZE + nlen + elen + clen
    if pos != n:
        raise FormatError(f"{path}: central directory has {n - pos} bytes after its {count} entries (at offset "
                          f"{cd_offset + pos}); expected none")
    return entries


class _Inflater:
    """Inflates a DEFLATE member's prefix on demand, reading the compressed bytes in pieces."""

    PIECE = 1 << 16

    def __init__(self, MappedFile m, start, length, what):
        self.m = m
        self.pos = start
        self.end = start + length
        self.what = what
        self.z = zlib.decompressobj(-15)
        self.out = b""

    def prefix(self, want):
        """The first ``want`` bytes of the inflated member (fewer if the stream ends first)."""
        z = self.z
        # Stop at the stream's end: zlib keeps a stale unconsumed_tail after it, and feeding that again
        # would loop for ever.
        while len(self.out) < want and not z.eof:
            if z.unconsumed_tail:
                piece = z.unconsumed_tail
            elif self.pos < self.end:
                n = min(self.PIECE, self.end - self.pos)
                piece = self.m.read(self.pos, n, self.what)
                self.pos += n
            else:
                break
            try:
                self.out += z.decompress(piece, want - len(self.out))
            except zlib.error as e:
                raise FormatError(f"{self.what}: corrupt DEFLATE stream ({e})") from None
        return self.out[:want]


def _member_header(MappedFile m, name, method, Py_ssize_t data_start, csize, usize, max_header_size, what,
                   dict parsed):
    """(dtype, shape, fortran_order, header_nbytes) of one member's .npy header.

    ``parsed`` maps header bytes already parsed in this archive to their result: members of one
    model share a few headers, and parsing is a pure function of the bytes.
    """
    if method == METHOD_STORED:
        head = m.read(data_start, min(csize, USUAL_HEADER_NBYTES), what)  # one read covers numpy's usual header
        total = npy_total_length(head[:12], what, max_header_size)
        if total > csize:
            raise FormatError(f"{what}: npy header needs {total} bytes but the member holds {csize}")
        header = head[:total] if total <= len(head) else m.read(data_start, total, what)
        result = parsed.get(header)
        if result is None:
            result = parsed[header] = parse_npy(header, total, what, max_header_size)
        return result
    inflater = _Inflater(m, data_start, csize, what)
    total = npy_total_length(inflater.prefix(12), what, max_header_size)
    if total > usize:
        raise FormatError(f"{what}: npy header needs {total} bytes but the member inflates to {usize}")
    return parse_npy(inflater.prefix(total), total, what, max_header_size)


def _user_stacklevel():
    """stacklevel for warnings.warn that points at the first frame outside fastckpt."""
    level = 1
    frame = sys._getframe(0)  # the innermost Python frame: this module's code runs without frames of its own
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fastckpt."):
        frame = frame.f_back
        level += 1
    return level


def read_npz_index(MappedFile m, *, max_header_size=MAX_HEADER_SIZE):
    """Parse and check an NPZ archive's index; return one :class:`NpzTensorInfo` per member.

    Names are member names without ``.npy``; for stored members ``offset`` and
    ``nbytes`` locate the array payload in the file (view it in place with
    ``m.array``). DEFLATE members (``np.savez_compressed``) are described by their
    compressed stream, and a :class:`~fastckpt.errors.NotZeroCopyWarning` is
    issued once for the archive. Anything that does not follow the format raises
    :class:`~fastckpt.errors.FormatError` naming the file, member and offset.
    ``max_header_size`` is the cap on each ``.npy`` header (numpy's is 10000).

    >>> import numpy as np, tempfile, os
    >>> from fastckpt._native.mapped import MappedFile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npz"); np.savez(p, w=np.arange(3.0))
    >>> [(i.name, i.shape, str(i.dtype)) for i in read_npz_index(MappedFile(p))]
    [('w', (3,), 'float64')]
    """
    return _read_npz(m, max_header_size).info_list()


def read_npz_table(MappedFile m, *, max_header_size=MAX_HEADER_SIZE):
    """:func:`read_npz_index`, as a columnar :class:`~fastckpt._native.tensorindex.TensorIndex` in payload-offset
    order (the infos, :class:`NpzTensorInfo`, are made when asked for).

    >>> import numpy as np, tempfile, os
    >>> from fastckpt._native.mapped import MappedFile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npz"); np.savez(p, w=np.arange(3.0), b=np.ones((1, 2), "<i2"))
    >>> index = read_npz_table(MappedFile(p))
    >>> list(index), index["b"].shape, index["b"].header_nbytes, index.view("w").tolist()
    (['w', 'b'], (1, 2), 128, [0.0, 1.0, 2.0])
    """
    cdef TensorIndex index = _read_npz(m, max_header_size)
    cdef Py_ssize_t i
    cdef bint in_order = True
    for i in range(1, index.count):
        if index.offsets[i] < index.offsets[i - 1]:
            in_order = False
            break
    if not in_order:  # a stable sort by offset, as TensorFile sorts a list of infos
        index.reorder(sorted(range(index.count), key=lambda i: index.offsets[i]))
    return index


_NPZ_EXTRA_FIELDS = ("crc32", "member_nbytes", "header_nbytes")
_INT64_MAX = 0x7FFFFFFFFFFFFFFF


cdef inline bint _is_plain_member_name(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    """True if the name bytes pass every rule of _member_problem without doubt: no NUL, no backslash, not
    absolute, no ``..`` component, ending in ``.npy``. False only means "let the checking parser decide"."""
    cdef Py_ssize_t i
    if n < 4 or s[0] == b'/':
        return False
    if s[n - 4] != b'.' or s[n - 3] != b'n' or s[n - 2] != b'p' or s[n - 1] != b'y':
        return False
    # a drive letter ("C:"): a ':' as the second character, which starts 1 to 4 bytes in (UTF-8); in bounds, as
    # the name ends in ".npy": a non-ASCII s[0] is not one of those 4 bytes, so n >= 5
    i = 1 if s[0] < 0x80 else 2 if s[0] < 0xE0 else 3 if s[0] < 0xF0 else 4
    if s[i] == b':':
        return False
    return _plain_components(s, n, True)


cdef inline bint _plain_components(const uint8_t* s, Py_ssize_t n, bint last_too) noexcept nogil:
    """No NUL, no backslash and no ``..`` component among the '/'-separated components of ``s[:n]`` (the last
    one checked for ``..`` only if ``last_too``)."""
    cdef Py_ssize_t i
    cdef Py_ssize_t seg = 0  # start of the current component
    for i in range(n + 1):
        if i == n or s[i] == b'/':
            if (i < n or last_too) and i - seg == 2 and s[seg] == b'.' and s[seg + 1] == b'.':
                return False
            seg = i + 1
        elif s[i] == 0 or s[i] == b'\\':
            return False
    return True


cdef inline bint _is_ascii(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if s[i] >= 0x80:
            return False
    return True


@cython.final
@cython.no_gc
cdef class _HeaderSpec:
    """What one distinct ``.npy`` header says, in the form the fast path adds to the index."""
    cdef int32_t code
    cdef int ndim
    cdef cnp.npy_intp dims[32]
    cdef int64_t expected      # payload bytes: product(shape) * itemsize
    cdef uint8_t flags         # FORTRAN_ORDER | VIEWABLE
    cdef Py_ssize_t header_nbytes


cdef TensorIndex _read_npz_fast(MappedFile m, uint64_t cd_offset, uint64_t cd_size, uint64_t count,
                                object max_header_size):
    """The index of an archive as fastckpt and numpy write them, without a Python object per member beyond its
    name; None where anything is unusual (the pread backend, DEFLATE, a name or record the checking parser
    should judge, overlapping or unordered members, any damage), so that ``_read_npz``'s checking parser gives
    the result or the error. Where this returns an index it equals the checking parser's, field for field:
    every check that parser makes is made here, or its input sends the archive there."""
    cdef object keep_mapping = m._block  # SAFETY: keeps the pointer below valid (see _read_npz)
    cdef const uint8_t* base
    cdef const uint8_t* p
    cdef const uint8_t* e
    cdef const uint8_t* h
    cdef Py_ssize_t size = m.size
    cdef Py_ssize_t pos, cd_end, nlen, elen, clen, epos, fsize, fixed, total, limit
    cdef int64_t local, csize, usize, data_start, data_end, prev_end = 0
    cdef uint64_t k
    cdef uint16_t flags
    cdef uint32_t crc, hlen
    cdef bint zip64
    cdef _HeaderSpec spec = None
    cdef const uint8_t* last_header = NULL
    cdef Py_ssize_t last_total = 0
    cdef TensorIndex index
    cdef dict specs = {}
    cdef dict codes = {}
    cdef int i
    cdef str key
    if keep_mapping is None or cd_offset > <uint64_t>size or cd_size > <uint64_t>size - cd_offset:
        return None
    if type(max_header_size) is not int or not 0 <= max_header_size <= 0x10000000:
        return None
    limit = max_header_size
    base = m.span(0, size, "NPZ archive")
    index = TensorIndex.__new__(TensorIndex)
    index._setup(m, [], NpzTensorInfo, _NPZ_EXTRA_FIELDS)
    index.reserve(<Py_ssize_t>min(count, <uint64_t>(cd_size // CENTRAL_SIZE)), 0)
    pos = <Py_ssize_t>cd_offset
    cd_end = <Py_ssize_t>(cd_offset + cd_size)
    for k in range(count):
        # -- central directory entry
        if pos + CENTRAL_SIZE > cd_end or _u32(base + pos) != SIG_CENTRAL:
            return None
        p = base + pos
        flags = _u16(p + 8)
        if flags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION | FLAG_MASKED_HEADERS) or _u16(p + 10) != 0:
            return None  # encrypted, or not stored (DEFLATE: the checking parser warns)
        crc = _u32(p + 16)
        csize = _u32(p + 20)
        usize = _u32(p + 24)
        nlen = _u16(p + 28)
        elen = _u16(p + 30)
        clen = _u16(p + 32)
        local = _u32(p + 42)
        if _u16(p + 34) != 0 or pos + CENTRAL_SIZE + nlen + elen + clen > cd_end:
            return None
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF or local == 0xFFFFFFFF:
            # the zip64 extra field holds, in this order, exactly the fields that hold the sentinel
            e = p + CENTRAL_SIZE + nlen
            epos = 0
            zip64 = False
            while epos + 4 <= elen:
                fsize = _u16(e + epos + 2)
                if epos + 4 + fsize > elen:
                    return None
                if _u16(e + epos) == ZIP64_EXTRA_ID:
                    h = e + epos + 4
                    if 8 * ((usize == 0xFFFFFFFF) + (csize == 0xFFFFFFFF) + (local == 0xFFFFFFFF)) > fsize:
                        return None
                    if usize == 0xFFFFFFFF:
                        usize = <int64_t>_u64(h)
                        h += 8
                    if csize == 0xFFFFFFFF:
                        csize = <int64_t>_u64(h)
                        h += 8
                    if local == 0xFFFFFFFF:
                        local = <int64_t>_u64(h)
                    zip64 = True
                    break
                epos += 4 + fsize
            if not zip64 or usize < 0 or csize < 0 or local < 0:
                return None
        if csize != usize or not _is_plain_member_name(p + CENTRAL_SIZE, nlen):
            return None
        if not (flags & FLAG_UTF8) and not _is_ascii(p + CENTRAL_SIZE, nlen):
            return None  # cp437: the checking parser decodes it
        # -- local header: same name and method, data before the central directory, members in order
        if local < prev_end or local > <int64_t>cd_offset - LOCAL_SIZE:
            return None
        h = base + local
        if _u32(h) != SIG_LOCAL or _u16(h + 6) & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION) or _u16(h + 8) != 0:
            return None
        if _u16(h + 26) != nlen or local + LOCAL_SIZE + nlen > <int64_t>cd_offset or memcmp(
                h + LOCAL_SIZE, p + CENTRAL_SIZE, <size_t>nlen) != 0:
            return None
        data_start = local + LOCAL_SIZE + nlen + _u16(h + 28)
        if csize > <int64_t>cd_offset or data_start > <int64_t>cd_offset - csize:
            return None
        data_end = data_start + csize
        prev_end = data_end
        # -- the .npy header: its length from the first 10 or 12 bytes, the rest parsed once per distinct header
        if csize < 12:
            return None
        h = base + data_start
        if memcmp(h, b"\x93NUMPY", 6) != 0 or h[7] != 0:
            return None
        if h[6] == 1:
            fixed, hlen = 10, _u16(h + 8)
        elif h[6] == 2 or h[6] == 3:
            fixed, hlen = 12, _u32(h + 8)
        else:
            return None
        if hlen > <uint32_t>(limit * (4 if h[6] == 3 else 1)):
            return None
        total = fixed + hlen
        if total > csize:
            return None
        # consecutive members often share a header (a stack of equal layers): compare with the last one first
        if spec is None or total != last_total or memcmp(h, last_header, <size_t>total) != 0:
            header = PyBytes_FromStringAndSize(<const char*>h, total)
            spec = specs.get(header)
        last_header, last_total = h, total
        if spec is None:
            try:
                dtype, shape, fortran_order, header_nbytes = parse_npy(header, total, "", max_header_size)
            except FormatError:
                return None
            expected = dtype.itemsize
            for d in shape:
                expected *= d
            if len(shape) > 32 or expected > _INT64_MAX or dtype.hasobject or any(d > _INT64_MAX for d in shape):
                return None
            spec = _HeaderSpec.__new__(_HeaderSpec)
            code = codes.get(dtype)
            if code is None:
                code = codes[dtype] = len(index.dtypes)
                index.dtypes.append(dtype)
            spec.code = code
            spec.ndim = len(shape)
            for i, d in enumerate(shape):
                spec.dims[i] = d
            spec.expected = expected
            spec.flags = VIEWABLE | (FORTRAN_ORDER if fortran_order else 0)
            spec.header_nbytes = header_nbytes
            specs[header] = spec
        if usize - spec.header_nbytes != spec.expected:
            return None
        # -- into the index: the key is the name without ".npy"
        try:
            key = (PyUnicode_DecodeUTF8(<const char*>p + CENTRAL_SIZE, nlen - 4, NULL) if flags & FLAG_UTF8 else
                   PyUnicode_DecodeASCII(<const char*>p + CENTRAL_SIZE, nlen - 4, NULL))
        except UnicodeDecodeError:
            return None
        for i in range(spec.ndim):
            index.add_dim(spec.dims[i])
        if index.add(key, <const char*>p + CENTRAL_SIZE, nlen - 4, spec.code, data_start + spec.header_nbytes,
                     spec.expected, spec.flags):
            return None  # a repeated name
        index.extras[(index.count - 1) * 3] = crc
        index.extras[(index.count - 1) * 3 + 1] = usize
        index.extras[(index.count - 1) * 3 + 2] = spec.header_nbytes
        pos += CENTRAL_SIZE + nlen + elen + clen
    if pos != cd_end:
        return None
    index.finish()
    return index


def _read_npz_checking(MappedFile m, *, max_header_size=MAX_HEADER_SIZE):
    """:func:`read_npz_index` through the checking parser alone (the tests hold the fast path to it)."""
    return _read_npz(m, max_header_size, False).info_list()


def _read_npz_fast_only(MappedFile m, *, max_header_size=MAX_HEADER_SIZE):
    """:func:`read_npz_index` through the fast path alone: the infos, or None where it leaves the archive to the
    checking parser (errors of the end records, which both share, propagate)."""
    cd_offset, cd_size, count, cd_end = _find_end_records(m)
    index = _read_npz_fast(m, cd_offset, cd_size, count, max_header_size)
    return None if index is None else index.info_list()


cdef TensorIndex _read_npz(MappedFile m, max_header_size, bint fast=True):
    """The members of the archive mapped by ``m`` as a TensorIndex of NpzTensorInfo, in central-directory order:
    through the fast path (``_read_npz_fast``) where it takes the archive, else the checking parser below."""
    cdef const uint8_t* p
    cdef Py_ssize_t local
    cdef Py_ssize_t nlen, elen
    # SAFETY: the span() pointers below point into this block; holding it keeps the mapping alive
    # should another thread close m while the parse runs Python code.
    cdef object keep_mapping = m._block
    cdef TensorIndex index
    cdef dict codes = {}
    cdef bint fits
    cdef uint8_t index_flags
    cdef bytes utf8
    path = m.path
    cd_offset, cd_size, count, cd_end = _find_end_records(m)
    if fast:
        index = _read_npz_fast(m, cd_offset, cd_size, count, max_header_size)
        if index is not None:
            return index
    index = TensorIndex.__new__(TensorIndex)
    entries = _read_central_directory(m, cd_offset, cd_size, count)
    index._setup(m, [], NpzTensorInfo, _NPZ_EXTRA_FIELDS)
    ranges = []  # (local header offset, data end, name): the byte range each member owns
    members = []
    compressed = 0
    parsed = {}
    for name, raw_name, flags, method, crc, csize, usize, local_offset, at in entries:
        what = _Where(path, name, "local header", local_offset)
        if local_offset + LOCAL_SIZE > cd_offset:
            raise FormatError(f"{what}: local header would end at {local_offset + LOCAL_SIZE}, inside or past the "
                              f"central directory at offset {cd_offset}")
        local = local_offset
        p = m.span(local, LOCAL_SIZE, what)
        if _u32(p) != SIG_LOCAL:
            raise FormatError(f"{what}: bad local header signature: expected {_sig(SIG_LOCAL)}, got "
                              f"{(<const char*>p)[0:4]!r}")
        lflags, lmethod = _u16(p + 6), _u16(p + 8)
        nlen, elen = _u16(p + 26), _u16(p + 28)
        if lflags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION):
            raise FormatError(f"{what}: local header flags 0x{lflags:04x} mark the member encrypted")
        if lmethod != method:
            raise FormatError(f"{what}: local header says compression method {lmethod}, central directory says "
                              f"{method}")
        if nlen != len(raw_name) or memcmp(m.span(local + LOCAL_SIZE, nlen, what), <const char*>raw_name, nlen) != 0:
            raise FormatError(f"{what}: local header names {m.read(local + LOCAL_SIZE, nlen, what)!r}, central "
                              f"directory names {raw_name!r}")
        data_start = local + LOCAL_SIZE + nlen + elen
        data_end = data_start + csize
        if data_end > cd_offset:
            raise FormatError(f"{what}: data [{data_start}, {data_end}) runs past the start of the central "
                              f"directory at offset {cd_offset}")
        ranges.append((local_offset, data_end, name))
        members.append((name, method, crc, csize, usize, data_start, what))
    ranges.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(ranges, ranges[1:]):
        if s1 < e0:
            raise FormatError(f"{path}: members {n0!r} [{s0}, {e0}) and {n1!r} [{s1}, {e1}) overlap; expected "
                              "disjoint byte ranges")

    for name, method, crc, csize, usize, data_start, what in members:
        dtype, shape, fortran_order, header_nbytes = _member_header(
            m, name, method, data_start, csize, usize, max_header_size, what, parsed)
        count_items = 1
        for d in shape:
            count_items *= d  # Python ints: no overflow
        expected = count_items * dtype.itemsize
        payload = usize - header_nbytes
        if payload != expected:
            raise FormatError(f"{what}: shape {shape} of {dtype} needs {expected} payload bytes, the member holds "
                              f"{payload} after its {header_nbytes}-byte npy header")
        key = name[:len(name) - 4]  # wraparound is off: no negative indices
        code = codes.get(dtype)
        if code is None:
            code = codes[dtype] = len(index.dtypes)
            index.dtypes.append(dtype)
        # Columns hold values below 2**63 (a larger dimension, possible beside a 0, or the declared size of a
        # DEFLATE member keeps its info object).
        fits = len(shape) <= 32 and usize <= _INT64_MAX and all(d <= _INT64_MAX for d in shape)
        if fits:
            for d in shape:
                index.add_dim(d)
        index_flags = FORTRAN_ORDER if fortran_order else 0
        if method != METHOD_STORED:
            compressed += 1
            index_flags |= DEFLATE
        elif fits and not dtype.hasobject:
            index_flags |= VIEWABLE  # expected == product(shape) * itemsize, checked above
        utf8 = key.encode("utf-8", "surrogatepass")
        stored = method == METHOD_STORED
        if index.add(key, utf8, len(utf8), code, data_start + header_nbytes if stored else data_start,
                     expected if stored else csize, index_flags):
            raise FormatError(f"{path}: member {name!r} appears twice")  # the central directory refuses this first
        index.extras[(index.count - 1) * 3] = crc
        index.extras[(index.count - 1) * 3 + 1] = usize if fits else 0
        index.extras[(index.count - 1) * 3 + 2] = header_nbytes
        if not fits:
            index.keep_info(from_checked_fields(NpzTensorInfo, {
                "name": key, "dtype": dtype, "shape": shape,
                "offset": data_start + header_nbytes if method == METHOD_STORED else data_start,
                "nbytes": expected if method == METHOD_STORED else csize, "fortran_order": fortran_order,
                "compression": None if method == METHOD_STORED else "deflate",
                "crc32": crc, "member_nbytes": usize, "header_nbytes": header_nbytes}))
    index.finish()
    if compressed:
        warnings.warn(f"{path}: {compressed} of {index.count} members are compressed; they will be inflated on read, "
                      "not viewed in place (re-save with fastckpt.save_npz for zero-copy reads)",
                      NotZeroCopyWarning, stacklevel=_user_stacklevel())
    return index


# -- writing: member records ------------------------------------------------------------------------
# The writer (fastckpt.formats.npz.NpzWriter) spends most of a small tensor's time building the member's
# ZIP records; here they are built in C, and the bytes go out through a GatherWriter uncopied.

cdef uint16_t ALIGN_EXTRA_ID = 0xD935  # zipalign's extra field: uint16 alignment, then zero padding
cdef uint16_t VERSION = 20
cdef uint16_t VERSION_ZIP64 = 45
cdef uint16_t MADE_BY_UNIX = 3 << 8
cdef uint32_t EXTERNAL_ATTR = 0o100644 << 16
cdef uint16_t DOS_TIME = 0
cdef uint16_t DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
# Alignment padding up to this long is copied into the member's record; longer padding is queued
# from the GatherWriter's static zeros, uncopied.
cdef int64_t _INLINE_PAD = 512


cdef inline void _put16(uint8_t* p, uint16_t v) noexcept nogil:
    p[0] = <uint8_t>v
    p[1] = <uint8_t>(v >> 8)


cdef inline void _put32(uint8_t* p, uint32_t v) noexcept nogil:
    _put16(p, <uint16_t>v)
    _put16(p + 2, <uint16_t>(v >> 16))


cdef inline void _put64(uint8_t* p, uint64_t v) noexcept nogil:
    _put32(p, <uint32_t>v)
    _put32(p + 4, <uint32_t>(v >> 32))


cdef str _member_problem(str member):
    # The messages name the character and its position, as fastckpt.store.names does for every other format.
    cdef Py_ssize_t at = member.find("\x00")
    if at >= 0:
        return f"name holds '\\x00' at position {at}, a NUL byte"
    at = member.find("\\")
    if at >= 0:
        return f"name holds '\\\\' at position {at}, a backslash; ZIP names use '/' only"
    if member.startswith("/") or (len(member) >= 2 and member[1] == ":" and member[0].isalpha()):
        start = member[:2] if member[1:2] == ":" else "/"
        return f"absolute name (it starts with {start!r}); expected a relative '<key>.npy'"
    if ".." in member:
        at = 0
        for part in member.split("/"):
            if part == "..":
                return f"name has a '..' path component at position {at}"
            at += len(part) + 1
    if not member.endswith(".npy"):
        return "name does not end in '.npy'; every NPZ member is '<key>.npy'"
    return None


cdef inline bint _is_plain_key(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    """True if member ``<s>.npy`` (``s``: ASCII) surely passes _member_problem; False: let it decide."""
    if n > 0 and s[0] == b'/':
        return False
    if n > 1 and s[1] == b':':
        return False
    return _plain_components(s, n, False)  # the last component gets ".npy": it cannot be ".."


cdef int _check_key(str name) except -1:
    member = name + ".npy"
    problem = _member_problem(member)
    if problem is not None:
        raise ValueError(f"tensor name {name!r}: member {member!r}: {problem}; readers refuse such ZIP member "
                         "names: rename the tensor, or save it as safetensors, which stores any name")
    return 0


ctypedef uint32_t (*_crc32_fn)(uint32_t crc, const uint8_t* data, uint32_t length) noexcept nogil


cdef class MemberWriter:
    """The members of an NPZ being written: each one's local record and payload go to ``out``.

    ``add(name, array)`` writes member ``<name>.npy`` at the current position
    (``pos``) with its payload aligned to ``alignment``, and keeps its
    central-directory record (``central_directory``: the records of the ``count``
    members so far); ``fastckpt.formats.npz.NpzWriter`` writes those and the end records. The byte layout is the spec in
    ``fastckpt/formats/npz.py``. ``crc32(data, value)`` is ZIP's CRC-32,
    ``npy_header(dtype, shape, fortran_order)`` builds ``.npy`` headers, and
    payloads of at least ``large_min`` bytes go through
    ``large_payload(out, payload, crc) -> crc``, which computes their CRC
    while writing them; their local headers get the CRC later, from
    ``crc_patches`` (file offset, crc). Values above ``zip64_limit`` go to
    zip64 fields. With ``small_alignment``, payloads of fewer than
    ``small_below`` bytes are aligned to it instead (the ``"auto"`` policy of
    the spec: padding to a page costs a small member more than it saves).
    ``broken`` is set while a member is being written, and stays set if
    writing it failed. ``crc32_address``, where not 0, is the address of a C
    function computing what ``crc32`` does (zlib-ng's ``zng_crc32``: ``crc``,
    pointer, 32-bit length), called directly for payloads below ``large_min``.
    """
    cdef GatherWriter _out
    cdef readonly int64_t pos
    cdef int64_t _zip64_limit
    cdef int64_t _large_min
    cdef Py_ssize_t _alignment
    cdef Py_ssize_t _small_alignment
    cdef int64_t _small_below
    cdef set _names
    cdef list _deferred_names    # names add_items wrote without recording them in _names
    cdef dict _headers
    # the header of the last member, by its dtype object, dimensions and order: a model's consecutive tensors
    # often share one, and comparing these costs less than the dict lookup by (dtype, shape, order)
    cdef object _last_descr
    cdef int _last_ndim
    cdef bint _last_fortran
    cdef cnp.npy_intp _last_dims[32]
    cdef tuple _last_header
    cdef bytearray _central      # the central-directory records, in member order
    cdef readonly Py_ssize_t count
    cdef readonly list crc_patches
    cdef object _crc32, _npy_header, _large_payload
    cdef _crc32_fn _c_crc32  # zlib-ng's zng_crc32 where given (crc32_address), for payloads below large_min
    cdef readonly bint broken

    def __init__(self, GatherWriter out not None, Py_ssize_t alignment, int64_t zip64_limit, crc32, npy_header,
                 large_payload, int64_t large_min, Py_ssize_t small_alignment=0, int64_t small_below=0,
                 size_t crc32_address=0):
        if small_alignment == 0:
            small_alignment = alignment
        for value in (alignment, small_alignment):
            if value < 1 or value > 0x8000 or value & (value - 1):
                raise ValueError(f"alignment must be a power of two from 1 to 32768, got {value}")
        self._out = out
        self.pos = 0
        self._alignment = alignment
        self._small_alignment = small_alignment
        self._small_below = small_below
        self._zip64_limit = zip64_limit
        self._large_min = large_min
        self._names = set()
        self._headers = {}
        self._last_descr = None
        self._last_header = None
        self._central = bytearray()
        self.count = 0
        self.crc_patches = []
        self._crc32 = crc32
        self._npy_header = npy_header
        self._large_payload = large_payload
        self._c_crc32 = <_crc32_fn>crc32_address if crc32_address and large_min <= 0xFFFFFFFF else NULL
        self.broken = False

    def add_items(self, items, bint batch, as_array, dict unique_names=None):
        """``add(name, as_array(array, name))`` for each ``(name, array)`` pair of ``items``, in order.

        ``unique_names``: the dict whose ``items()`` ``items`` is. Its keys are
        distinct as long as no caller code runs, so while every name is an
        exact ``str`` and every value an exact numpy array (nothing to
        convert), the names are not checked for repeats one by one; from the
        first that is not (before its conversion runs), the names written are
        recorded and the rest checked. Later ``add`` calls are always checked.

        Queued arrays must not change before they are written, and the caller's
        code may change them: a generator refilling one buffer, an
        ``__array__`` reusing one. So whenever caller code is about to run
        (converting a value, and, unless ``batch``, fetching the next item) the
        queue is written first. ``batch`` is for items that only a dict's own
        iteration produces.
        """
        cdef dict unchecked = unique_names if self.count == 0 and self._deferred_names is None else None
        cdef Py_ssize_t first = self.count
        try:
            for item in items:
                try:
                    name, array = item
                except (TypeError, ValueError):
                    raise TypeError(f"tensors must be a mapping or an iterable of (name, array) pairs; got item "
                                    f"{item!r}") from None
                if unchecked is not None and (type(name) is not str or not cnp.PyArray_CheckExact(array)):
                    # caller code may run from here on (a conversion, a str subclass's methods): the names so
                    # far, in the dict's order, are recorded now, and the rest are checked
                    self._names.update(itertools.islice(unchecked, self.count - first))
                    unchecked = None
                if not cnp.PyArray_CheckExact(array):
                    self._out.flush()
                    array = as_array(array, name)
                self._add(name, <cnp.ndarray?>array, False, unchecked is None)
                if not batch:
                    self._out.flush()
        except BaseException:
            if unchecked is not None:  # the names written are taken; the others stay free
                self._names.update(itertools.islice(unchecked, self.count - first))
            raise
        if unchecked is not None:
            self._deferred_names = list(unchecked)  # every name of the dict: joins _names if add() is called again

    def add(self, name, cnp.ndarray arr not None):
        """Write one member; return (header_start, npy header, payload bytes, fortran_order, crc)."""
        return self._add(name, arr, True, True)

    @property
    def central_directory(self):
        """The central-directory records of the members written so far, in order (``count`` of them).

        >>> import os, tempfile, numpy as np
        >>> from fastckpt._native.gather import GatherWriter
        >>> import fastckpt.formats.npz as npz
        >>> with open(os.path.join(tempfile.mkdtemp(), "m.bin"), "wb") as f:
        ...     out = GatherWriter(f.fileno())
        ...     members = MemberWriter(out, 64, npz._ZIP64_LIMIT, npz._crc32, npz.npy_header, npz._large_payload,
        ...                            npz._LARGE_PAYLOAD)
        ...     _ = members.add("w", np.zeros(2))
        ...     out.flush()
        >>> members.count, len(members.central_directory), members.central_directory[:4]
        (1, 51, b'PK\\x01\\x02')
        """
        return bytes(self._central)

    cdef object _add(self, name, cnp.ndarray arr, bint report, bint check_name):
        """``add``; the tuple it returns is built only when ``report``; ``check_name`` False: the name is known
        to be new (add_items' ``unique_names``)."""
        cdef bytes raw_name = None, header, record
        cdef const char* utf8
        cdef Py_ssize_t utf8_len
        cdef tuple known
        cdef uint32_t header_crc
        cdef uint16_t flags = 0, version
        cdef int64_t nbytes, size, local_offset, header_start, pad = 0
        cdef Py_ssize_t name_len, extra_len, cd_extra_len, at, ndim
        cdef bint zip64_size, zip64_offset, fortran_order, inline_tail
        cdef uint32_t crc, size32
        cdef uint8_t* p
        cdef int kind
        cdef Py_ssize_t alignment
        if type(name) is not str:
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
            name = str(name)  # np.str_, StrEnum: stored (and read back) as the plain text
        # The reader's own rule (_member_problem), so that it reads back what we write: checked in C for an
        # ASCII name, by _member_problem itself where that check has doubts (it is conservative) or for others.
        if PyUnicode_IS_ASCII(name):
            utf8 = PyUnicode_AsUTF8AndSize(name, &utf8_len)  # an ASCII str's own bytes: no copy
            if not _is_plain_key(<const uint8_t*>utf8, utf8_len):
                _check_key(name)
        else:
            _check_key(name)
            raw_name, flags = (<str>name).encode("utf-8"), FLAG_UTF8  # fails on lone surrogates, as it should
            utf8, utf8_len = PyBytes_AS_STRING(raw_name), len(raw_name)
        name_len = utf8_len + 4  # the member is "<name>.npy"
        if name_len > 0xFFFF:
            raise ValueError(f"tensor name of {name_len} bytes is too long for a ZIP member name (65531 at most)")
        if check_name:
            if self._deferred_names is not None:
                self._names.update(self._deferred_names)
                self._deferred_names = None
            if name in self._names:
                raise ValueError(f"tensor name {name!r} given twice; NPZ member names must be unique")

        # The payload: the array's own bytes in C order, or, for a Fortran-ordered array, those of its
        # transpose (numpy's fortran_order); any other layout is copied once.
        if cnp.PyArray_IS_C_CONTIGUOUS(arr):
            data, fortran_order = arr, False
        elif cnp.PyArray_IS_F_CONTIGUOUS(arr):
            data, fortran_order = arr.T, True
        else:
            data, fortran_order = np.ascontiguousarray(arr), False
        ndim = cnp.PyArray_NDIM(arr)
        descr = <object>cnp.PyArray_DESCR(arr)
        if (descr is self._last_descr and ndim == self._last_ndim and fortran_order == self._last_fortran and
                memcmp(cnp.PyArray_DIMS(arr), self._last_dims, ndim * sizeof(cnp.npy_intp)) == 0):
            known = self._last_header
        else:
            key = (descr, (<object>arr).shape, fortran_order)
            known = self._headers.get(key)
            if known is None:  # a model's tensors share a few headers; building one costs ~20 µs
                try:
                    header = self._npy_header(*key)
                except ValueError as e:
                    raise ValueError(f"tensor {name!r}: {e}") from None
                known = self._headers[key] = (header, self._crc32(header))
            if ndim <= 32 and not cnp.PyDataType_HASFIELDS(<cnp.dtype>descr):  # field names can be renamed in place
                self._last_descr, self._last_ndim, self._last_fortran, self._last_header = (
                    descr, ndim, fortran_order, known)
                memcpy(self._last_dims, cnp.PyArray_DIMS(arr), ndim * sizeof(cnp.npy_intp))
        header, header_crc = known
        kind = cnp.PyArray_TYPE(<cnp.ndarray>data)
        if kind == cnp.NPY_DATETIME or kind == cnp.NPY_TIMEDELTA:  # older numpy will not export these
            data = data.reshape(-1).view(np.uint8)
        nbytes = cnp.PyArray_NBYTES(<cnp.ndarray>data)
        size = len(header) + nbytes

        local_offset = self.pos
        zip64_size = size > self._zip64_limit
        zip64_offset = local_offset > self._zip64_limit
        version = VERSION_ZIP64 if zip64_size or zip64_offset else VERSION
        extra_len = 20 if zip64_size else 0
        header_start = local_offset + LOCAL_SIZE + name_len + extra_len
        alignment = self._alignment if nbytes >= self._small_below else self._small_alignment
        if alignment > 1:
            pad = -(header_start + 6 + len(header)) % alignment  # the field's own 6 bytes, then the header
            extra_len += 6 + pad
            header_start += 6 + pad
        size32 = 0xFFFFFFFF if zip64_size else <uint32_t>size

        self.broken = True  # until this member is complete: a failed write leaves the writer unusable
        large = nbytes >= self._large_min
        # The member's CRC covers its .npy header and payload; the local header gets it now, or later
        # (crc_patches) for a large payload, whose CRC is computed while it is written.
        if large:
            crc = header_crc
        elif self._c_crc32 != NULL:  # nbytes < large_min <= 2**32 - 1: a uint32 length
            crc = self._c_crc32(header_crc, <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>data), <uint32_t>nbytes)
        else:  # (a memoryview of the bytes: numpy's own buffer export would describe the dtype first)
            crc = self._crc32(PyMemoryView_FromMemory(<char*>cnp.PyArray_DATA(<cnp.ndarray>data), nbytes,
                                                      PyBUF_READ), header_crc)
        # The local record up to the alignment field's padding: the padding comes from the writer's
        # zeros and the .npy header is the cached object, so neither is built again for every member.
        # Short padding is copied into the record with the .npy header (one buffer instead of three).
        inline_tail = pad <= _INLINE_PAD
        record = PyBytes_FromStringAndSize(NULL, LOCAL_SIZE + name_len + extra_len - pad
                                           + (pad + len(header) if inline_tail else 0))
        p = <uint8_t*>PyBytes_AS_STRING(record)
        _put32(p, SIG_LOCAL)
        _put16(p + 4, version)
        _put16(p + 6, flags)
        _put16(p + 8, 0)  # stored
        _put16(p + 10, DOS_TIME)
        _put16(p + 12, DOS_DATE)
        _put32(p + 14, 0 if large else crc)
        _put32(p + 18, size32)
        _put32(p + 22, size32)
        _put16(p + 26, <uint16_t>name_len)
        _put16(p + 28, <uint16_t>extra_len)
        memcpy(p + LOCAL_SIZE, utf8, utf8_len)
        memcpy(p + LOCAL_SIZE + utf8_len, b".npy", 4)
        at = LOCAL_SIZE + name_len
        if zip64_size:
            _put16(p + at, ZIP64_EXTRA_ID)
            _put16(p + at + 2, 16)
            _put64(p + at + 4, <uint64_t>size)
            _put64(p + at + 12, <uint64_t>size)
            at += 20
        if alignment > 1:
            _put16(p + at, ALIGN_EXTRA_ID)
            _put16(p + at + 2, <uint16_t>(2 + pad))
            _put16(p + at + 4, <uint16_t>alignment)
            at += 6
        if inline_tail:
            memset(p + at, 0, pad)
            memcpy(p + at + pad, PyBytes_AS_STRING(header), len(header))
            self._out.write(record)
        else:
            self._out.write(record)
            self._out.write_zeros(pad)
            self._out.write(header)
        if large:
            crc = self._large_payload(self._out, data, crc)
            self.crc_patches.append((local_offset + 14, crc))
        else:
            self._out.write(data)

        cd_extra_len = (16 if zip64_size else 0) + (8 if zip64_offset else 0)
        if cd_extra_len:
            cd_extra_len += 4
        at = len(self._central)
        PyByteArray_Resize(self._central, at + CENTRAL_SIZE + name_len + cd_extra_len)  # grows geometrically
        p = <uint8_t*>PyByteArray_AS_STRING(self._central) + at
        _put32(p, SIG_CENTRAL)
        _put16(p + 4, MADE_BY_UNIX | version)
        _put16(p + 6, version)
        _put16(p + 8, flags)
        _put16(p + 10, 0)
        _put16(p + 12, DOS_TIME)
        _put16(p + 14, DOS_DATE)
        _put32(p + 16, crc)
        _put32(p + 20, size32)
        _put32(p + 24, size32)
        _put16(p + 28, <uint16_t>name_len)
        _put16(p + 30, <uint16_t>cd_extra_len)
        _put16(p + 32, 0)  # comment length
        _put16(p + 34, 0)  # disk number
        _put16(p + 36, 0)  # internal attributes
        _put32(p + 38, EXTERNAL_ATTR)
        _put32(p + 42, 0xFFFFFFFF if zip64_offset else <uint32_t>local_offset)
        memcpy(p + CENTRAL_SIZE, utf8, utf8_len)
        memcpy(p + CENTRAL_SIZE + utf8_len, b".npy", 4)
        at = CENTRAL_SIZE + name_len
        if cd_extra_len:
            _put16(p + at, ZIP64_EXTRA_ID)
            _put16(p + at + 2, <uint16_t>(cd_extra_len - 4))
            at += 4
            if zip64_size:
                _put64(p + at, <uint64_t>size)
                _put64(p + at + 8, <uint64_t>size)
                at += 16
            if zip64_offset:
                _put64(p + at, <uint64_t>local_offset)
        self.count += 1
        self.pos = header_start + size
        if check_name:
            self._names.add(name)
        self.broken = False  # only now: a member written but missing from the index would be lost
        if report:
            return header_start, header, nbytes, fortran_order, crc
        return None
