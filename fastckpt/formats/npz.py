"""NPZ archives: the byte layout fastckpt writes and reads, the aligned streaming writer, member reads.

Specification
=============

An NPZ file is a ZIP archive (PKWARE APPNOTE 6.3) whose members are ``.npy``
files, one per array, as written by ``numpy.savez``. All integers are
little-endian. Offsets are absolute byte offsets from the start of the file.

What fastckpt writes
--------------------
The file is a sequence of members, then the central directory, then (only when
needed) the zip64 end records, then the end-of-central-directory record:

    [local header 1][.npy member 1] ... [local header N][.npy member N]
    [central directory entry 1] ... [central directory entry N]
    [zip64 end of central directory record][zip64 locator]    (only when needed)
    [end of central directory record]

"Needs zip64" below means a value above 2**31 - 1 (the threshold Python's
``zipfile`` uses, so that readers with signed 32-bit fields stay correct), or,
for the entry count, 65535 or more.

Local header (30 bytes, then the name, then the extra field):

| offset | size | field |
|---|---|---|
| 0 | 4 | signature ``PK\\x03\\x04`` (0x04034B50) |
| 4 | 2 | version needed: 45 when the member or its offset needs zip64, else 20 |
| 6 | 2 | flags: 0, or 0x0800 when the name is not ASCII (then it is UTF-8) |
| 8 | 2 | compression method: 0 (stored). fastckpt never compresses. |
| 10 | 2 | time: 0 (00:00:00) |
| 12 | 2 | date: 0x0021 (1980-01-01). No timestamps: equal input, equal bytes. |
| 14 | 4 | CRC-32 (ZIP polynomial, as ``zlib.crc32``) of the whole ``.npy`` member |
| 18 | 4 | compressed size, or 0xFFFFFFFF when it needs zip64 |
| 22 | 4 | uncompressed size (equal), or 0xFFFFFFFF |
| 26 | 2 | name length ``n`` |
| 28 | 2 | extra field length ``e`` |
| 30 | n | name: ``<key>.npy`` |
| 30+n | e | extra field: [zip64 field] then [alignment field] |

The local header carries the real sizes and CRC: bit 3 of the flags is never
set and no data descriptor follows the data.

zip64 extra field (only when the member's size needs zip64): id 0x0001 (2
bytes), length 16 (2), uncompressed size (8), compressed size (8).

Alignment extra field (zipalign style, always last, absent when the
member's alignment is 1): id 0xD935 (2 bytes), length ``2 + k`` (2), the
member's alignment as a uint16 (2), then ``k`` zero bytes. ``k`` is the
smallest count that puts the first byte of the array payload (not of the
``.npy`` member) at a multiple of the alignment. ZIP readers skip the local
extra field, so the padding is invisible to them; ``np.load`` and netcl 0.4.4
read such files.

Alignment policy. Each member's alignment is chosen by the writer's
``alignment`` argument:

- ``"auto"`` (the default): a payload of 65536 bytes (64 KiB) or more is
  aligned to 4096 (a page: it can be mapped, and handed to a device, in
  place); a smaller one, the empty payload included, to 64 (a cache line),
  because padding a 1 KiB payload to a page would quadruple the file and the
  time to write it. 64 is a multiple of every numeric item size (1 to 16
  bytes), so fastckpt's reader still views such payloads in place.
- an int (a power of two from 1 to 32768): every payload at that multiple.

Writer versions. The file records none; both read the same way.

- Writer 1 (fastckpt releases before the ``"auto"`` policy): default
  alignment 4096 for every payload. ``alignment=4096`` still writes exactly
  these bytes.
- Writer 2 (current): default ``"auto"``. Files whose payloads are all 64 KiB
  or more are byte for byte those of writer 1.

A reader MUST NOT assume either policy: it takes each payload's offset from
the member's records (the field's alignment value is informative only).

The member data is a ``.npy`` file, format 1.0 exactly as
``numpy.lib.format.write_array_header_1_0`` writes it:

- the magic ``\\x93NUMPY``, the version bytes ``\\x01\\x00``, the header
  length ``H`` as a uint16;
- ``H`` bytes of latin-1 text: the repr of the dict
  ``{'descr': <dtype descr>, 'fortran_order': <bool>, 'shape': <tuple>, }``
  (keys sorted, each entry followed by ``", "``), then spaces so that the
  shape's first dimension (last, for Fortran order) could grow to 21 digits,
  then more spaces and a final ``\\n`` so that 10 + ``H`` is a multiple of 64;
- the array's bytes in C order, or in Fortran order when ``fortran_order`` is
  True. ``descr`` is the dtype's string (``'<f4'``, ``'>i8'``, ``'<U7'``,
  ``'|S3'``, ``'<M8[ns]'`` ...) or, for a structured dtype, its ``descr``
  list. The ``ml_dtypes`` types (bfloat16, the float8 types, int4 ...), for
  which numpy writes a lossy ``'<V2'``, are written under their ml_dtypes name
  (``'bfloat16'``, ``'float8_e4m3fn'``): ``np.load`` reads such a member once
  ``ml_dtypes`` is imported (``import ml_dtypes`` before ``np.load``; without it
  numpy says ``descr is not a valid dtype descriptor: 'bfloat16'``), fastckpt's reader always
  (it imports ml_dtypes when a member names one). Files without them are
  unchanged.

Format 2.0 (a uint32 header length; version bytes ``\\x02\\x00``) is used only
when the header does not fit in 65535 bytes, and 3.0 (uint32 length, UTF-8
text) only when the text is not latin-1, both as numpy chooses them.

Central directory entry (46 bytes, then the name, then the extra field), one
per member in the order written:

| offset | size | field |
|---|---|---|
| 0 | 4 | signature ``PK\\x01\\x02`` (0x02014B50) |
| 4 | 2 | version made by: 0x0300 (Unix) + version needed |
| 6 | 2 | version needed (as in the local header) |
| 8 | 2 | flags (as in the local header) |
| 10 | 2 | compression method: 0 |
| 12 | 4 | time, date (as in the local header) |
| 16 | 4 | CRC-32 (as in the local header) |
| 20 | 4 | compressed size, or 0xFFFFFFFF when it needs zip64 |
| 24 | 4 | uncompressed size, or 0xFFFFFFFF |
| 28 | 6 | name length, extra length, comment length (0) |
| 34 | 2 | disk number start: 0 |
| 36 | 2 | internal attributes: 0 |
| 38 | 4 | external attributes: 0o100644 << 16 (a regular rw-r--r-- file) |
| 42 | 4 | local header offset, or 0xFFFFFFFF when it needs zip64 |
| 46 | ... | name, then the extra field: only a zip64 field, holding the 64-bit values of exactly the fields set to 0xFFFFFFFF, in the order uncompressed size, compressed size, local header offset |

When the entry count, the directory's size or its offset needs zip64, the
zip64 end of central directory record (56 bytes: signature ``PK\\x06\\x06``,
record size 44 (8), version made by 45, version needed 45, disk 0 (4), disk of
the directory 0 (4), entries on this disk (8), entries (8), directory size
(8), directory offset (8)) and the zip64 locator (20 bytes: signature
``PK\\x06\\x07``, disk 0 (4), offset of the zip64 record (8), 1 disk (4))
precede the end record, and the end record's fields that do not fit hold
0xFFFF / 0xFFFFFFFF.

End of central directory record (22 bytes): signature ``PK\\x05\\x06``, disk 0
(2), disk of the directory 0 (2), entries on this disk (2), entries (2),
directory size (4), directory offset (4), comment length 0 (2).

Writers
-------
- A writer MUST write the file through a temporary and rename it into place
  (``fastckpt.store.commit``), so that a reader never sees a partial file.
- A writer MUST NOT store object arrays (they need pickle) and MUST NOT store a
  dtype that a ``descr`` cannot name so that it reads back as itself. numpy
  writes ml_dtypes' ``bfloat16`` as ``'<V2'`` (raw void bytes); fastckpt writes
  it, and the other ml_dtypes types, under their own name instead (above).
- Member names MUST be unique, relative, ``/``-separated, without ``..``
  components, backslashes or NUL.

Readers
-------
fastckpt reads any archive ``numpy.savez`` / ``numpy.savez_compressed`` write,
and netcl's ``.netcl`` files. A reader MUST reject, with an error naming the
file, the member and the byte offset:

- a missing end record (searched for in the last 65535 + 22 bytes; its
  comment must end at the end of the file), a bad signature of any record,
  multi-disk archives, entry counts that disagree, a central directory that
  does not end where the (zip64) end records begin, a zip64 locator or record
  that points outside the file or disagrees with its position;
- central directory entries that overrun the directory, extra fields that
  overrun their area, a 0xFFFFFFFF sentinel without the zip64 value it stands
  for, encrypted members, compression methods other than 0 and 8, stored
  members whose two sizes differ;
- member names that are absolute, contain ``..`` components, backslashes or
  NUL, are not valid UTF-8 when flagged so, do not end in ``.npy``, or occur
  twice;
- a local header whose signature, method or name disagree with the central
  directory, member data that runs into the central directory, members whose
  byte ranges (local header through data) overlap;
- ``.npy`` headers with a bad magic, a version other than 1.0, 2.0 and 3.0,
  a header longer than 10000 characters (numpy's cap; ``max_header_size=``
  raises it), text that is not exactly the dict above (read by a literal
  parser: never ``eval``), a shape that is not a tuple of at most 64
  non-negative ints, a dtype holding Python objects, or a payload whose size is
  not the shape's element count times the item size.

Payloads of files that other writers made are often unaligned (numpy's land at
arbitrary offsets); a reader MUST accept them (numpy views unaligned data
correctly) and SHOULD say when it has to copy instead of viewing in place.

Local header sizes are ignored (numpy writes 0xFFFFFFFF there); sizes come
from the central directory and the data starts after the local header's own
name and extra field. DEFLATE members are inflated on read (a
``NotZeroCopyWarning`` says so once per file) straight into their array, 16
MiB at a time, so reading one peaks at about its size; their CRC-32 and size
are checked then. Stored members are viewed in place and their CRC is not checked
on read (that would read every byte); ``verify_member`` checks it.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Mapping
from typing import Any, Iterable, Union

import numpy as np

from fastckpt._native.gather import GatherWriter
from fastckpt._native.mapped import MappedFile
from fastckpt._native.npy import MAX_HEADER_SIZE, _descr_to_dtype, npy_header_length, parse_npy_header
from fastckpt._native.npz import MemberWriter, NpzTensorInfo, _Inflater, read_npz_index
from fastckpt.arrays import as_numpy, to_numpy
from fastckpt.errors import FormatError, IntegrityError
from fastckpt.store.commit import atomic_write, overwrite_flag, staged_file
from fastckpt.store.remote import is_url, save_file
from fastckpt.info import TensorInfo
from fastckpt.progress import ProgressArg, file_log_level, progress_from, requested

__all__ = [
    "save_npz",
    "save_bytes",
    "load_bytes",
    "NpzWriter",
    "read_member",
    "verify_member",
    "npy_header",
    "read_npz_index",
    "parse_npy_header",
    "NpzTensorInfo",
]

_log = logging.getLogger(__name__)

# Values above this go to zip64 fields, as Python's zipfile decides (its ZIP64_LIMIT).
_ZIP64_LIMIT = (1 << 31) - 1
_ZIP_FILECOUNT_LIMIT = 0xFFFF
_MAX_ALIGNMENT = 1 << 15  # the zipalign field stores it as a uint16
# The "auto" alignment policy (the spec's): pages for payloads worth mapping, cache lines for the rest.
AUTO_ALIGNMENT = "auto"
_AUTO_LARGE_ALIGNMENT = 4096
_AUTO_SMALL_ALIGNMENT = 64
_AUTO_SMALL_BELOW = 64 << 10
# ZIP's CRC-32 (not crc32c), and the CRC-32 of two runs of bytes joined (a member checked as its pieces stream in:
# fastckpt.formats.stream.Checksums). zlib-ng's is about 4x faster than the zlib Python links against.
try:
    from zlib_ng.zlib_ng import crc32 as _crc32
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a dependency; stay correct without it
    _crc32 = zlib.crc32

    def _crc32_combine(first: int, second: int, length: int) -> int:
        zeros = bytes(length)  # CRC-32 is affine in its start value: shift `first` over `length` zero bytes
        return _crc32(zeros, first) ^ _crc32(zeros, 0) ^ second


def _zng_crc32_address() -> int:
    """The address of ``zng_crc32`` (zlib-ng's C API) in the ``zlib_ng`` extension, or 0 where it is not there.

    The writer calls it from C for small members, where calling ``_crc32`` from Python costs more than the
    checksum of a 1 KiB payload; it is used only if it gives the CRC-32 check value of b"123456789".

    >>> _zng_crc32_address() > 0
    True
    """
    try:
        import ctypes

        import zlib_ng.zlib_ng as module

        function = ctypes.CDLL(module.__file__).zng_crc32
    except (ImportError, OSError, AttributeError):  # pragma: no cover - another build of zlib-ng
        return 0
    function.restype = ctypes.c_uint32
    function.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32]
    if function(0, b"123456789", 9) != 0xCBF43926:  # pragma: no cover - not the function we know
        return 0
    return ctypes.cast(function, ctypes.c_void_p).value or 0


_ZNG_CRC32 = _zng_crc32_address()
# Payloads at least this large go out in _CRC_PIECE pieces, each checksummed just before it is
# written (the kernel then copies it from the CPU cache); their local headers get the CRC when the
# archive is finished. A helper thread checksumming while the main thread writes was measured 2-3x
# slower at the median on a 2-core machine: the two contend for memory bandwidth.
_LARGE_PAYLOAD = 1 << 22
_CRC_PIECE = 1 << 20

# The members' own records are built by fastckpt._native.npz.MemberWriter; these are the end records.
_SIG_EOCD = 0x06054B50
_SIG_ZIP64_EOCD = 0x06064B50
_SIG_ZIP64_LOCATOR = 0x07064B50
_VERSION_ZIP64 = 45

_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")

_GROWTH_AXIS_MAX_DIGITS = 21  # numpy.lib.format.GROWTH_AXIS_MAX_DIGITS
_ARRAY_ALIGN = 64  # numpy.lib.format.ARRAY_ALIGN

TensorsArg = Union[Mapping, Iterable]


def npy_header(dtype: np.dtype, shape: tuple, fortran_order: bool) -> bytes:
    """The ``.npy`` header numpy writes for an array of ``dtype`` and ``shape`` (format 1.0 when it fits).

    Byte for byte what ``np.save`` writes before the data. Raises ``ValueError``
    for dtypes that ``.npy`` cannot store faithfully (objects, ml_dtypes types).

    >>> npy_header(np.dtype("<f4"), (2, 3), False)[:69]
    b"\\x93NUMPY\\x01\\x00v\\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
    """
    descr = _descr_of(np.dtype(dtype))
    shape = tuple(int(d) for d in shape)
    fields = {"descr": descr, "fortran_order": bool(fortran_order), "shape": shape}
    text = "{" + "".join(f"{key!r}: {value!r}, " for key, value in sorted(fields.items())) + "}"
    if shape:
        text += " " * (_GROWTH_AXIS_MAX_DIGITS - len(repr(shape[-1 if fortran_order else 0])))
    try:
        return _wrap_header(text.encode("latin-1"), 1)
    except UnicodeEncodeError:
        return _wrap_header(text.encode("utf-8"), 3)


def _wrap_header(text: bytes, major: int) -> bytes:
    if major == 1:
        hlen = len(text) + 1
        pad = _ARRAY_ALIGN - ((10 + hlen) % _ARRAY_ALIGN)
        if hlen + pad <= 0xFFFF:
            return b"\x93NUMPY\x01\x00" + struct.pack("<H", hlen + pad) + text + b" " * pad + b"\n"
        major = 2
    hlen = len(text) + 1
    pad = _ARRAY_ALIGN - ((12 + hlen) % _ARRAY_ALIGN)
    return b"\x93NUMPY" + bytes((major, 0)) + struct.pack("<I", hlen + pad) + text + b" " * pad + b"\n"


def _descr_of(dtype: np.dtype):
    """The ``descr`` numpy writes for ``dtype``, after checking that it reads back as the same dtype."""
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects; .npy would need pickle to store it, and fastckpt never "
                         "pickles: convert the array to a numeric or fixed-width string dtype first")
    if not getattr(type(dtype), "_legacy", True):
        raise ValueError(f"dtype {dtype} has no .npy descr (numpy would pickle it)")
    if dtype.type.__module__ == "ml_dtypes":
        # .npy has no descr for these (numpy writes '<V2', which reads back as raw bytes): the ml_dtypes name,
        # which np.load reads once ml_dtypes is imported, and fastckpt's reader always.
        return dtype.name
    descr = dtype.descr if dtype.names is not None else dtype.str
    try:
        back = _descr_to_dtype(descr, "")
    except FormatError:
        back = None
    if back != dtype:
        raise ValueError(
            f"dtype {dtype} cannot be stored in .npy: its descr {descr!r} reads back as {back}, not as itself; "
            "store its fields as arrays of their own (or a.view(np.uint8) and record the dtype yourself)")
    return descr


def _byte_view(arr: np.ndarray) -> memoryview:
    if arr.nbytes == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8))


class NpzWriter:
    """Stream arrays into an aligned NPZ file, one member at a time, replaced atomically on success.

    Each array's bytes go from its own buffer to the file, uncopied (a
    non-contiguous array is copied once), and are written before ``add()``
    returns, so the caller may reuse the array at once. On an
    exception inside the ``with`` block nothing is left behind and an existing
    file at ``path`` is untouched. ``alignment`` is ``"auto"`` (payloads of
    64 KiB or more at multiples of 4096, smaller ones of 64: the policy of the
    module's spec) or a power of two up to 32768, the boundary of every array
    payload; ``fsync=False`` skips the fsyncs (still atomic, not durable).
    An existing file at ``path`` is replaced only with ``overwrite=True``
    (docs/overwrite.md). ``staged=True``: ``path`` is a new file of a staging
    directory that is published whole later
    (:func:`fastckpt.store.commit.staged_file`: written under its own name,
    with no temporary and rename of its own, and ``fsync`` syncs the file only).

    >>> import tempfile, os, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> with NpzWriter(path, alignment=64) as w:
    ...     info = w.add("w", np.arange(4, dtype=np.float32))
    >>> info.offset % 64, np.load(path)["w"].tolist()
    (0, [0.0, 1.0, 2.0, 3.0])
    """

    def __init__(self, path: str | os.PathLike, *, alignment: int | str = "auto", fsync: bool = True,
                 overwrite: bool = False, staged: bool = False):
        self._policy = alignment_policy(alignment)
        self.staged = staged
        self.path = os.fspath(path)
        self.overwrite = overwrite_flag(overwrite)
        self.alignment = alignment
        self.fsync = fsync
        self._context = None
        self._file = None
        self._out = None
        self._members = None
        self._done = False

    def __enter__(self) -> "NpzWriter":
        if self._context is not None or self._done:
            raise RuntimeError("an NpzWriter is entered once")
        self._context = staged_file(self.path, fsync=self.fsync) if self.staged else \
            atomic_write(self.path, fsync=self.fsync, overwrite=self.overwrite)
        self._file = self._context.__enter__()
        # Every byte goes through the gather writer, straight from the arrays' buffers.
        self._out = GatherWriter(self._file.fileno())
        large, small, small_below = self._policy
        self._members = MemberWriter(self._out, large, _ZIP64_LIMIT, _crc32, npy_header,
                                     _large_payload, _LARGE_PAYLOAD, small_alignment=small, small_below=small_below,
                                     crc32_address=_ZNG_CRC32)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        context, self._context = self._context, None
        self._done = True
        try:
            if exc_type is None:
                try:
                    if self._members.broken:
                        raise RuntimeError(f"{self.path}: an add() failed inside this writer; the file is not written")
                    self._finish()
                except BaseException as error:
                    self._out.discard()
                    if not context.__exit__(type(error), error, error.__traceback__):
                        raise
                    return False
            else:
                self._out.discard()
            return bool(context.__exit__(exc_type, exc, tb))
        finally:
            self._file = self._out = self._members = None

    def add(self, name: str, array) -> NpzTensorInfo:
        """Write ``array`` as member ``<name>.npy``; return where its payload landed.

        ``array`` is anything ``np.asarray`` accepts, or an array-like of
        :func:`fastckpt.arrays.as_numpy` (DLPack, buffers). Fortran-ordered arrays are
        stored in Fortran order (``fortran_order`` True), as numpy does.
        """
        arr = to_numpy(array, name=name, where="an NPZ file")
        header_start, header, payload_nbytes, fortran_order, crc = self._add(name, arr)
        self._out.flush()  # the caller may change or reuse the array once add() returns
        return NpzTensorInfo(name, arr.dtype, arr.shape, header_start + len(header), payload_nbytes, fortran_order,
                             None, crc, len(header) + payload_nbytes, len(header))

    def _add(self, name: str, arr: np.ndarray) -> tuple:
        """Write one member; return (header_start, header, payload bytes, fortran_order, crc)."""
        members = self._members
        if members is None:
            raise RuntimeError("NpzWriter.add() needs an open writer: use it inside 'with NpzWriter(path) as w:'")
        if members.broken:
            raise RuntimeError(f"{self.path}: an earlier add() failed while writing; this writer cannot continue")
        return members.add(name, arr)

    def _finish(self) -> None:
        out, members = self._out, self._members
        cd_offset = members.pos
        directory = members.central_directory
        out.write(directory)
        cd_size = len(directory)
        count = members.count
        if count >= _ZIP_FILECOUNT_LIMIT or cd_offset > _ZIP64_LIMIT or cd_size > _ZIP64_LIMIT:
            zip64_offset = cd_offset + cd_size
            out.write(_ZIP64_EOCD.pack(_SIG_ZIP64_EOCD, _ZIP64_EOCD.size - 12, _VERSION_ZIP64, _VERSION_ZIP64, 0, 0,
                                       count, count, cd_size, cd_offset))
            out.write(_ZIP64_LOCATOR.pack(_SIG_ZIP64_LOCATOR, 0, zip64_offset, 1))
            count16 = min(count, 0xFFFF)
            out.write(_EOCD.pack(_SIG_EOCD, 0, 0, count16, count16, min(cd_size, 0xFFFFFFFF),
                                 min(cd_offset, 0xFFFFFFFF), 0))
        else:
            out.write(_EOCD.pack(_SIG_EOCD, 0, 0, count, count, cd_size, cd_offset, 0))
        out.flush()
        # The CRCs of large payloads are known only after their bytes went out: patch the local headers.
        fd = self._file.fileno()
        for position, crc in members.crc_patches:
            _pwrite_all(fd, struct.pack("<I", crc), position)


def alignment_policy(alignment: int | str) -> tuple[int, int, int]:
    """``(alignment, small_alignment, small_below)`` of the writer's ``alignment`` argument.

    Payloads of fewer than ``small_below`` bytes go to multiples of
    ``small_alignment``, the others to multiples of ``alignment``.

    >>> alignment_policy("auto"), alignment_policy(4096)
    ((4096, 64, 65536), (4096, 4096, 0))
    """
    if alignment == AUTO_ALIGNMENT:
        return _AUTO_LARGE_ALIGNMENT, _AUTO_SMALL_ALIGNMENT, _AUTO_SMALL_BELOW
    if (type(alignment) is not int or alignment < 1 or alignment > _MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise ValueError(f"alignment must be {AUTO_ALIGNMENT!r} or a power of two from 1 to {_MAX_ALIGNMENT}, "
                         f"got {alignment!r}")
    return alignment, alignment, 0


def _large_payload(out: GatherWriter, payload: np.ndarray, crc: int) -> int:
    """Write a large payload piece by piece, each checksummed just before; return the CRC-32."""
    view = memoryview(payload.reshape(-1).view(np.uint8))  # C-contiguous, so a view of its bytes (0-d too)
    out.flush()
    for start in range(0, len(view), _CRC_PIECE):
        piece = view[start:start + _CRC_PIECE]
        crc = _crc32(piece, crc)
        out.write(piece)
        out.flush()
    return crc


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


def _refuse_savez_form(tensors, arrays: tuple, named: dict) -> None:
    positional = [tensors, *arrays] if as_numpy(tensors) is not None else list(arrays)
    if not positional:
        raise TypeError(f"save_npz() got unknown keyword(s) {', '.join(map(repr, named))}: the options are "
                        "alignment, fsync, progress, storage_options and overwrite; arrays go in the tensors mapping")
    entries = [f"'arr_{i}': <array {i}>" for i in range(len(positional))] + [f"{k!r}: {k}" for k in named]
    got = []
    if positional:
        got.append(f"{len(positional)} array(s) by position")
    if named:
        got.append(f"keyword(s) {', '.join(map(repr, named))}")
    raise TypeError(f"save_npz(path, tensors) takes one mapping of name -> array, not numpy.savez's "
                    f"savez(file, *arrays, **named) (got {' and '.join(got)}): write "
                    f"save_npz(path, {{{', '.join(entries)}}}) for the names np.savez would give")


def _member_array(value: Any, name: str) -> np.ndarray:
    """A member's array, for MemberWriter.add_items: anything ``to_numpy`` takes; refusals name the member."""
    return to_numpy(value, name=name, where="an NPZ file")


def save_npz(path: str | os.PathLike, tensors: TensorsArg, *arrays: Any, alignment: int | str = "auto",
             fsync: bool = True, progress: ProgressArg = False, storage_options: dict | None = None,
             overwrite: bool = False, staged: bool = False, **named: Any) -> None:
    """Save arrays as an aligned, uncompressed NPZ that ``np.load`` and netcl read; atomically.

    ``tensors`` is a mapping name -> array-like, or an iterable of ``(name,
    array)`` pairs (consumed once, so a generator can produce each array just
    before it is written). Every payload starts at a multiple of
    ``alignment`` bytes, so readers can view it in place: by default
    (``"auto"``) 4096 for payloads of 64 KiB or more and 64 for smaller ones,
    which keeps many small tensors from quadrupling the file; an int fixes
    one alignment for all (``4096``: the layout of earlier releases). Equal
    input gives an identical file. The byte layout is this module's docstring. ``progress``
    (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the arrays' bytes as each is written; its
    total is ``None`` for an iterable of pairs. ``path`` may be a URL
    (``s3://...``, any fsspec URL, with ``storage_options``): written locally,
    then uploaded in one atomic upload (:mod:`fastckpt.formats.remote`).
    An existing file at ``path`` is replaced only with ``overwrite=True``
    (docs/overwrite.md); an
    ``OSError`` names ``path``. ``staged=True``: ``path`` is a new file of a
    staging directory published whole later, written in place (:class:`NpzWriter`).

    >>> import tempfile, os, numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "model.npz")
    >>> save_npz(path, {"w": np.eye(2, dtype=np.float32), "step": np.int64(7)})
    >>> with np.load(path) as z:
    ...     z["w"].tolist(), int(z["step"])
    ([[1.0, 0.0], [0.0, 1.0]], 7)

    numpy's ``savez(file, *arrays, **named)`` form is refused with the
    mapping to write instead (``arrays`` and ``named`` exist only for that
    message): a keyword there would be an array's name, so a misspelt option
    (``fsinc=False``) would be stored as an array without a word.
    """
    if arrays or named or as_numpy(tensors) is not None:
        _refuse_savez_form(tensors, arrays, named)
    if is_url(path):  # object storage and remote filesystems: fastckpt.formats.remote
        return save_file(path, lambda local: save_npz(local, tensors, alignment=alignment, fsync=False,
                                                      progress=progress, overwrite=True), "upload.npz",
                         storage_options, overwrite=overwrite)
    if storage_options is not None:
        raise ValueError(f"storage_options is for URLs (s3://...), not the local path {os.fspath(path)!r}")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    batch = type(tensors) is dict
    started = time.perf_counter()
    total = None
    if requested(progress) and isinstance(tensors, Mapping):
        total = sum(_payload_nbytes(a) for a in tensors.values())
    with progress_from(progress, total, "save npz") as report, \
            NpzWriter(path, alignment=alignment, fsync=fsync, overwrite=overwrite, staged=staged) as writer:
        if report.enabled:  # each array written (not only queued) before it is reported
            items, batch = _reporting(items, report), False
        # A dict's own iteration runs no caller code, so its arrays can be queued and written together, and its
        # keys need no check for repeats one by one while no caller code runs (see MemberWriter.add_items).
        writer._members.add_items(items, batch, _member_array, tensors if batch else None)
        count = writer._members.count
    level = file_log_level()
    if _log.isEnabledFor(level):
        _log.log(level, "saved %s: %d tensors, %d bytes in %.3f s", os.fspath(path), count, os.stat(path).st_size,
                 time.perf_counter() - started)


def _payload_nbytes(value) -> int:
    nbytes = getattr(value, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else to_numpy(value).nbytes


def _reporting(items, report):
    """``items``, reporting each pair's bytes once the writer asks for the next (it has written this one)."""
    last = None
    for item in items:
        if last is not None:
            report.advance(_payload_nbytes(last[1]), last[0])
        try:
            name, value = item
        except (TypeError, ValueError):
            yield item  # the writer refuses it, naming it
            return
        last = (name, value)
        yield last
    if last is not None:
        report.advance(_payload_nbytes(last[1]), last[0])


# -- reading -------------------------------------------------------------------------------------

_INFLATE_PIECE = 1 << 20
# Inflated bytes per decompress call: big enough that the input a call leaves over (copied by zlib into
# unconsumed_tail, at most _INFLATE_PIECE) costs little beside them, small beside any member worth measuring.
_INFLATE_OUT = 16 << 20
# DEFLATE cannot expand more than about 1032:1; a larger declared size is refused before allocating it.
_DEFLATE_MAX_RATIO = 1040


def read_member(m: MappedFile, info: TensorInfo) -> np.ndarray:
    """The array of one NPZ member: a zero-copy view for stored members, a new array for DEFLATE ones.

    A stored member's view is read-only (unless ``m`` was opened copy-on-write)
    and stays valid after ``m.close()``. A DEFLATE member is inflated straight
    into a new, writable array; its size and CRC-32 are checked
    (:class:`~fastckpt.errors.IntegrityError` on a CRC mismatch).

    >>> import tempfile, os, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npz"); save_npz(p, {"x": np.arange(3)})
    >>> m = MappedFile(p); [info] = read_npz_index(m)
    >>> read_member(m, info).tolist()
    [0, 1, 2]
    """
    order = "F" if info.fortran_order else "C"
    if info.compression is None:
        return m.array(info.offset, info.dtype, info.shape, order=order, what=f"tensor {info.name!r}")
    if info.compression != "deflate":
        raise FormatError(f"{m.path}: tensor {info.name!r}: unknown compression {info.compression!r}")
    with m.guard(f"member {info.name + '.npy'!r}"):
        return _inflate_member(m, info, order)


def _inflate_member(m: MappedFile, info: TensorInfo, order: str) -> np.ndarray:
    what = f"{m.path}: member {info.name + '.npy'!r} (DEFLATE data at offset {info.offset})"
    if info.size * info.dtype.itemsize > info.nbytes * _DEFLATE_MAX_RATIO + 2**16:
        raise FormatError(f"{what}: {info.nbytes} compressed bytes cannot inflate to the {info.size * info.dtype.itemsize} "
                          f"bytes of shape {tuple(info.shape)} of {info.dtype} (DEFLATE expands at most ~1032:1)")
    header_nbytes = getattr(info, "header_nbytes", 0)
    if not header_nbytes:  # a plain TensorInfo: learn the header's length from the stream
        head = _Inflater(m, info.offset, info.nbytes, what)
        header_nbytes = npy_header_length(head.prefix(12), what, MAX_HEADER_SIZE)
    expected_crc = info.crc32 if isinstance(info, NpzTensorInfo) else None
    payload_nbytes = info.size * info.dtype.itemsize
    total = header_nbytes + payload_nbytes

    out = np.empty(info.shape, info.dtype, order=order)
    dest = _byte_view(out.T if order == "F" else out)
    header = bytearray()
    z = zlib.decompressobj(-15)
    crc = 0
    produced = 0
    pos, end = info.offset, info.offset + info.nbytes
    while not z.eof:
        if z.unconsumed_tail:
            data = z.unconsumed_tail
        elif pos < end:
            n = min(_INFLATE_PIECE, end - pos)
            data = m.view(pos, n, what)
            pos += n
        else:
            data = b""  # every input byte is in: zlib may still hold output that the size limit held back
        try:
            # At most _INFLATE_OUT bytes a call (one byte more than expected reveals a longer stream): a member
            # that compresses 1000:1 would otherwise inflate whole into one bytes object and be copied from it,
            # a peak of 3x the member; so the peak is the destination array and one piece.
            chunk = z.decompress(data, min(_INFLATE_OUT, total - produced + 1))
        except zlib.error as e:
            raise FormatError(f"{what}: corrupt DEFLATE stream ({e})") from None
        if not chunk and not data and not z.eof:
            raise FormatError(f"{what}: DEFLATE stream ends after {info.nbytes} compressed bytes without its final "
                              f"block; inflated {produced} of {total} bytes (truncated?)")
        if produced + len(chunk) > total:
            raise FormatError(f"{what}: inflates to more than the {total} bytes its header and shape declare")
        crc = _crc32(chunk, crc)
        into_header = max(0, min(len(chunk), header_nbytes - produced))
        if into_header:
            header += chunk[:into_header]
        rest = len(chunk) - into_header
        if rest:
            at = produced + into_header - header_nbytes
            dest[at:at + rest] = memoryview(chunk)[into_header:]
        produced += len(chunk)
    if produced != total:
        raise FormatError(f"{what}: inflates to {produced} bytes; its header and shape declare {total}")
    if z.unused_data or pos < end:
        raise FormatError(f"{what}: {len(z.unused_data) + end - pos} bytes follow the end of the DEFLATE stream "
                          "inside the member's compressed size")
    dtype, shape, fortran_order, _ = parse_npy_header(bytes(header), what, max(MAX_HEADER_SIZE, header_nbytes))
    if (dtype, shape, fortran_order) != (info.dtype, tuple(info.shape), info.fortran_order):
        raise FormatError(f"{what}: npy header says {dtype} {shape} fortran_order={fortran_order}, the index says "
                          f"{info.dtype} {tuple(info.shape)} fortran_order={info.fortran_order} (file changed?)")
    if expected_crc is not None and crc != expected_crc:
        raise IntegrityError(f"{what}: CRC-32 of the inflated member is 0x{crc:08x}, the central directory says "
                             f"0x{expected_crc:08x}: the file is damaged")
    return out


def verify_member(m: MappedFile, info: NpzTensorInfo) -> None:
    """Check one member's CRC-32 against the central directory (reads every byte of a stored member).

    Raises :class:`~fastckpt.errors.IntegrityError` on a mismatch.

    >>> import tempfile, os, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npz"); save_npz(p, {"x": np.arange(3)})
    >>> m = MappedFile(p); verify_member(m, read_npz_index(m)[0])
    """
    if info.compression is not None:
        read_member(m, info)  # inflation checks the CRC
        return
    start = info.offset - info.header_nbytes
    crc = 0
    for at in range(start, start + info.member_nbytes, _INFLATE_PIECE):
        n = min(_INFLATE_PIECE, start + info.member_nbytes - at)
        crc = _crc32(m.view(at, n, f"member {info.name + '.npy'!r}"), crc)
    if crc != info.crc32:
        raise IntegrityError(f"{m.path}: member {info.name + '.npy'!r} (data at offset {start}): CRC-32 is "
                             f"0x{crc:08x}, the central directory says 0x{info.crc32:08x}: the file is damaged")


# -- bytes in memory -----------------------------------------------------------------------------


def save_bytes(tensors: TensorsArg, *, alignment: int | str = "auto") -> bytes:
    """The bytes :func:`save_npz` writes for ``tensors``, as ``bytes``, without a file to keep.

    Byte for byte the file's bytes (:mod:`fastckpt.formats.inmemory` says
    how); ``np.load(io.BytesIO(data))`` and :func:`load_bytes` read them.

    >>> import io
    >>> data = save_bytes({"w": np.arange(3, dtype=np.int16)}, alignment=64)
    >>> len(data), data[:4], np.load(io.BytesIO(data))["w"].tolist()
    (271, b'PK\\x03\\x04', [0, 1, 2])
    """
    from fastckpt.formats.filebytes import written_bytes

    return written_bytes(lambda path: save_npz(path, tensors, alignment=alignment, fsync=False), tensors)


def load_bytes(data, *, max_header_size: int = MAX_HEADER_SIZE) -> dict[str, np.ndarray]:
    """The arrays of NPZ bytes (``bytes``, ``bytearray``, a ``memoryview``): name -> array, in archive order.

    Any archive ``np.savez`` or ``np.savez_compressed`` writes; parsed by the
    file reader's parser, with every check of this module's spec. The arrays
    are writable and independent of ``data``. Bad bytes raise
    :class:`~fastckpt.errors.FormatError` naming the member and offset;
    safetensors bytes are refused, naming
    :func:`fastckpt.formats.safetensors.load_bytes`.

    >>> import io
    >>> buffer = io.BytesIO(); np.savez_compressed(buffer, a=np.arange(3))
    >>> load_bytes(buffer.getvalue())["a"].tolist()
    [0, 1, 2]
    """
    from fastckpt.formats.filebytes import expect_format, mapped_bytes, quietly_parsed

    expect_format(data, "npz", "fastckpt.formats.npz")
    with mapped_bytes(data) as m:
        infos = quietly_parsed(lambda: read_npz_index(m, max_header_size=max_header_size))
        return {info.name: read_member(m, info) for info in infos}
