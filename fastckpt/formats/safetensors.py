"""safetensors files: the byte-level format as fastckpt reads and writes it, the writer, and helpers.

Layout
======

A safetensors file is three consecutive parts::

    offset 0        8 bytes    N, the header length, unsigned 64-bit little-endian
    offset 8        N bytes    the header: a UTF-8 JSON object, right-padded with spaces
    offset 8 + N    D bytes    the data section: the bytes of every tensor, back to back

where ``D = file size - 8 - N``.

Header length
-------------
A reader MUST refuse a file shorter than 8 bytes, a length ``N`` larger than
100_000_000 (the cap of the reference implementation), and a length with
``8 + N`` larger than the file.

Header
------
The ``N`` header bytes MUST be valid UTF-8 and hold one JSON object. The
object MAY be preceded and followed by padding, which MUST consist of JSON
whitespace only (space 0x20, tab 0x09, LF 0x0a, CR 0x0d), as the reference
reader takes it (its own tests pad both sides); the first byte after the
leading padding is therefore ``{`` (0x7b) and the last byte before the trailing
padding the object's closing ``}``. Writers SHOULD pad after the object with
spaces (fastckpt does), which fastckpt 0.2 and older readers require. Inside
the object any JSON whitespace is allowed. No object in
the header may repeat a key, and the non-standard constants ``NaN``,
``Infinity`` and ``-Infinity`` MUST NOT appear.

The top-level object maps keys to entries:

``"__metadata__"`` (optional)
    An object whose values MUST all be strings. A reader MAY also accept
    ``null`` here and treat it as absent (the reference reader does;
    fastckpt does). Writers MUST NOT write ``null``.

any other key
    The name of a tensor. Its value MUST be an object with exactly the keys

    - ``"dtype"``: one of the dtype strings in the table below;
    - ``"shape"``: a list of non-negative integers, ``[]`` for a 0-d tensor;
    - ``"data_offsets"``: ``[begin, end]``, integers with ``0 <= begin <= end``,
      counted from the start of the data section.

Integers MUST be JSON integers (``2``, not ``2.0`` or ``true``).

Data section
------------
Sorted by ``(begin, end)``, the tensors MUST tile the data section exactly:
the first begins at 0, each begins where the previous one ends (no holes, no
overlaps) and the last ends at ``D``, so the data ends exactly at the end of
the file. With no tensors, ``D`` MUST be 0. An empty tensor (a zero in its
shape) has ``begin == end``.

For every tensor ``end - begin`` MUST equal ``product(shape) * itemsize``.
A reader MUST compute the product with 64-bit overflow checks, dimension by
dimension from the left, and refuse the file when it overflows (as the
reference does, even when a later dimension is 0).

A tensor's bytes are its elements in C (row-major) order, each
little-endian.

Strictness
----------
These rules are stricter than the reference reader in a few places, each
a file no known writer produces and whose meaning is ambiguous or cannot be
held by numpy: the reference ignores unknown keys in a tensor entry, keeps
the last of repeated keys, accepts any JSON whitespace as padding, and
accepts dimensions up to ``2**64 - 1`` (numpy's limit is ``2**63 - 1``). fastckpt
refuses all of these with a :class:`~fastckpt.errors.FormatError`. Every
file fastckpt accepts, the reference reader accepts with the same tensors.

Dtypes
------
===============  =============================  ========
safetensors      numpy (ml_dtypes)              itemsize
===============  =============================  ========
``BOOL``         ``bool``                       1
``U8``           ``uint8``                      1
``I8``           ``int8``                       1
``F8_E5M2``      ``ml_dtypes.float8_e5m2``      1
``F8_E4M3``      ``ml_dtypes.float8_e4m3fn``    1
``F8_E8M0``      ``ml_dtypes.float8_e8m0fnu``   1
``F8_E4M3FNUZ``  ``ml_dtypes.float8_e4m3fnuz``  1
``F8_E5M2FNUZ``  ``ml_dtypes.float8_e5m2fnuz``  1
``I16``          ``int16``                      2
``U16``          ``uint16``                     2
``F16``          ``float16``                    2
``BF16``         ``ml_dtypes.bfloat16``         2
``I32``          ``int32``                      4
``U32``          ``uint32``                     4
``F32``          ``float32``                    4
``C64``          ``complex64``                  8
``F64``          ``float64``                    8
``I64``          ``int64``                      8
``U64``          ``uint64``                     8
===============  =============================  ========

Packed types
------------
``F4`` (float4 e2m1), ``F6_E2M3`` and ``F6_E3M2`` (float6) pack elements
narrower than a byte back to back, across rows, in C order. A tensor of
``n`` elements of ``b`` bits is stored in ``n * b / 8`` bytes; when
``n * b`` is not a multiple of 8 the file is refused (the reference reader
refuses it too). ``shape`` is the logical shape, in elements: PyTorch's
``float4_e2m1fn_x2`` of shape ``[2, 3]`` (two elements a byte) is recorded
as ``F4`` ``[2, 6]`` in 6 bytes, the first element of each byte in its low
nibble. The format does not say how 6-bit elements share bytes.

No numpy dtype views them in place. Their :class:`~fastckpt.info.PackedTensorInfo`
gives the ml_dtypes element type (``float4_e2m1fn``, ``float6_e2m3fn``,
``float6_e3m2fn``), the logical shape and the stored byte count; ``host()``
gives the stored bytes as a :class:`fastckpt.arrays.PackedArray`
(``.unpack()`` widens ``F4`` to ``ml_dtypes.float4_e2m1fn``).
:func:`save_safetensors` writes a ``PackedArray``, a PyTorch
``float4_e2m1fn_x2`` tensor or an ``ml_dtypes.float4_e2m1fn`` array (packed
two a byte) byte for byte as the reference writer does. Paths that cannot
hold packed bytes (another format, the OpenCL pool) refuse them with a
:class:`~fastckpt.arrays.PackedTypeError` naming the tensor. Any other dtype
string is refused with a :class:`~fastckpt.errors.FormatError` that names it.

What fastckpt's writer adds
===========================
The format leaves these choices open; :func:`save_safetensors` fixes them so
that its output is aligned and byte-for-byte deterministic:

Alignment
    The header is padded with spaces so that the data section starts at a
    multiple of ``alignment`` bytes (default 4096, a power of two >= 8) from
    the start of the file. A mapping of the file starts at a page
    boundary, so the data section lies at an address aligned to
    ``alignment`` (or to the page size, if that is smaller), ready for one
    device copy.

Tensor order
    Tensors are stored by descending dtype rank, then by name (code point
    order, which equals UTF-8 byte order), the order of the reference
    writer. The rank is the dtype's position in ``U64, I64, F64, C64, F32,
    U32, I32, BF16, F16, U16, I16, F8_E5M2FNUZ, F8_E4M3FNUZ, F8_E8M0,
    F8_E4M3, F8_E5M2, I8, U8, BOOL``; itemsizes never increase along it, so
    every tensor's offset in the data section is a multiple of its itemsize,
    and with an aligned data section every tensor is naturally aligned in
    memory.

JSON
    No whitespace (separators ``,`` and ``:``); non-ASCII characters are
    written as UTF-8, not ``\\u`` escapes; ``"__metadata__"`` comes first
    when metadata is given (also when it is empty), its keys sorted; the
    tensors follow in data order, each as ``{"dtype":..,"shape":..,
    "data_offsets":..}`` in that key order. Apart from padding and the order
    of metadata keys, the header is the text the reference writer produces,
    and the data section is byte-identical to the reference writer's.

Byte order
    Big-endian input arrays are converted to little-endian; values are
    unchanged.

Atomicity
    The file is written to a temporary name in the same directory and
    renamed over ``path`` (after ``fsync`` unless ``fsync=False``). Readers
    never see a partial file, a failed save leaves the previous file intact,
    and mappings of the previous file keep seeing its old bytes.

Example: ``save_safetensors(p, {"a": np.array([1, 2], np.uint8)}, alignment=64)``
writes exactly these 66 bytes::

    38 00 00 00 00 00 00 00                                   N = 56
    {"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}     53 bytes of JSON
    20 20 20                                                  3 spaces: 8 + 56 = 64
    01 02                                                     the data section
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from fastckpt._native.gather import GatherWriter
from fastckpt._native.safetensors import (
    DTYPE_RANK,
    MAX_HEADER_SIZE,
    NUMPY_DTYPES,
    PACKED_DTYPES,
    SUB_BYTE_DTYPES,
    header_text,
    plan_tensors,
    read_safetensors_index,
    unsupported_dtype_message,
    write_tensors,
)
from fastckpt.arrays import TakenRows, is_packed, pack_float4, packed_array, to_numpy
from fastckpt.store.commit import atomic_write, overwrite_flag, staged_file
from fastckpt.store.remote import is_url, save_file
from fastckpt.info import TensorInfo
from fastckpt.progress import ProgressArg, file_log_level, progress_from, requested
from fastckpt.store.names import NameRule

_log = logging.getLogger(__name__)

__all__ = [
    "save_safetensors",
    "save_bytes",
    "load_bytes",
    "read_safetensors_index",
    "read_tensor",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "DEFAULT_ALIGNMENT",
]

#: The names safetensors keeps for itself; any other str, '/', '.', newlines and NUL included, reads back exactly.
NAMES = NameRule("safetensors", controls=False, empty=True,
                 whole=(("__metadata__", "the header's metadata entry; pass metadata= instead"),))

DEFAULT_ALIGNMENT = 4096

# Builtin numpy kinds by (kind, itemsize); ml_dtypes types (kind "V") by scalar type.
_NAME_BY_KIND_SIZE = {
    (dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items() if dt.kind != "V"
}
_NAME_BY_ML_TYPE = {dt.type: name for name, dt in NUMPY_DTYPES.items() if dt.kind == "V"}


def dtype_from_safetensors(name: str) -> np.dtype:
    """The numpy dtype (little-endian) that a safetensors dtype string names.

    Raises ``ValueError`` for an unknown string or a packed sub-byte type
    (``F4``, ``F6_E2M3``, ``F6_E3M2``), saying which.

    >>> dtype_from_safetensors("F32")
    dtype('float32')
    >>> dtype_from_safetensors("BF16")
    dtype(bfloat16)
    """
    try:
        return NUMPY_DTYPES[name]
    except (KeyError, TypeError):
        pass
    if isinstance(name, str) and name in PACKED_DTYPES:
        raise ValueError(f"dtype {name!r} packs {SUB_BYTE_DTYPES[name]}-bit elements several to a byte, which no "
                         f"numpy dtype views in place; its element type is {PACKED_DTYPES[name]} and a tensor of it "
                         "is read as a fastckpt.arrays.PackedArray")
    raise ValueError(unsupported_dtype_message(name))


def _tf_quantized(dtype: np.dtype) -> str | None:
    from fastckpt.formats.tf.dtypes import quantized_name

    return quantized_name(dtype)


def dtype_to_safetensors(dtype: Any) -> str:
    """The safetensors dtype string for a numpy dtype (either byte order).

    Raises ``TypeError`` for dtypes safetensors cannot express (object,
    strings, structured, complex128, float128, and the ml_dtypes types
    without a safetensors name), saying what to convert to.

    >>> import numpy as np, ml_dtypes
    >>> dtype_to_safetensors(np.dtype(">i4")), dtype_to_safetensors(ml_dtypes.float8_e4m3fn)
    ('I32', 'F8_E4M3')
    """
    dt = np.dtype(dtype)
    if dt == PACKED_DTYPES["F4"]:
        return "F4"  # stored packed, two elements a byte
    if dt in (PACKED_DTYPES["F6_E2M3"], PACKED_DTYPES["F6_E3M2"]):
        raise TypeError(f"dtype {dt} is safetensors' {'F6_E2M3' if dt == PACKED_DTYPES['F6_E2M3'] else 'F6_E3M2'}, "
                        "stored packed, and safetensors does not say how 6-bit elements share bytes: pack them "
                        "yourself and pass fastckpt.arrays.packed_array(stored_bytes, name, shape)")
    if dt.kind == "V":
        name = _NAME_BY_ML_TYPE.get(dt.type) if dt.fields is None and dt.subdtype is None else None
    else:
        name = _NAME_BY_KIND_SIZE.get((dt.kind, dt.itemsize))
    if name is not None:
        return name
    if dt.kind == "c":
        hint = "safetensors has only C64: convert with .astype(np.complex64), or save real and imaginary parts"
    elif dt.kind == "f":
        hint = "convert with .astype(np.float64)"
    elif dt.fields is not None and _tf_quantized(dt):
        hint = (f"TensorFlow's {_tf_quantized(dt)}, which safetensors has not: store a.view(a.dtype[0]) and record "
                "the type, as fastckpt convert --quantized-as-ints does, or keep it in a TensorFlow checkpoint or NPZ")
    elif dt.kind in "OUSTMm" or dt.fields is not None:
        hint = "safetensors holds numeric tensors only; put strings in metadata, split structured arrays into fields"
    else:
        hint = f"supported: {', '.join(sorted(NUMPY_DTYPES))}"
    raise TypeError(f"dtype {dt} has no safetensors equivalent ({hint})")


def read_tensor(m, info: TensorInfo) -> np.ndarray:
    """A zero-copy, read-only numpy view of one tensor of a mapped safetensors file.

    The view keeps the mapping alive after ``m.close()``.

    >>> import os, tempfile, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> p = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_safetensors(p, {"w": np.arange(6, dtype=np.int16).reshape(2, 3)})
    >>> with MappedFile(p) as m:
    ...     infos, _, _ = read_safetensors_index(m)
    ...     read_tensor(m, infos[0]).tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    if info.packed is not None:
        raw = m.array(info.offset, np.dtype(np.uint8), (info.nbytes,), what=f"tensor {info.name!r}")
        return packed_array(raw, info.packed, info.shape)
    return m.array(info.offset, info.dtype, info.shape, what=f"tensor {info.name!r}")


# Planned tensors are tuples (see fastckpt/_native/safetensors.pyx, which plans, describes and writes them):
#   (-rank, name, position, dtype name, shape, nbytes, array or None, source)
_NAME, _DTYPE_NAME, _SHAPE, _NBYTES, _ARRAY, _SOURCE = 1, 3, 4, 5, 6, 7

# The common case, planned in Cython: an exact ndarray of a native (or byte-order-free) dtype.
# dtype -> (safetensors name, -rank). Byte-swapped dtypes are absent and take the general path.
_FAST_DTYPES = {dt: (name, -DTYPE_RANK[name]) for name, dt in NUMPY_DTYPES.items() if dt.isnative}
# Dtypes whose C-contiguous arrays are written as they are: the file's own dtypes.
_DIRECT_DTYPES = frozenset(_FAST_DTYPES)


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} {text!r} cannot be encoded as UTF-8 ({e.reason})") from None


def _checked_metadata(metadata) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str to str, got {type(metadata).__name__}")
    checked = {}
    for key, value in metadata.items():
        if type(key) is not str or type(value) is not str:
            raise TypeError(
                f"metadata must map str to str, got {key!r}: {value!r:.80} ({type(key).__name__}: "
                f"{type(value).__name__}); convert values with str() or json.dumps()")
        _check_utf8(key, "metadata key")
        _check_utf8(value, f"metadata[{key!r}]")
        checked[key] = value
    return dict(sorted(checked.items()))


def _as_array(name: str, value) -> np.ndarray:
    if type(value) is np.ndarray:  # the common case, before the slower checks below
        return value
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(f"tensor {name!r}: safetensors cannot store a mask; pass .filled(value) or .data")
    try:
        return to_numpy(value, packed=True, name=name)
    except Exception as e:
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"while converting tensor {name!r} ({type(value).__name__}) to a numpy array")
        raise


def _plan(name, value, position: int) -> tuple:
    """The planned tuple of one tensor that ``plan_tensors`` does not plan itself; checks everything."""
    NAMES.check(name)
    _check_utf8(name, "tensor name")
    if type(value) is TakenRows and value.dtype in _DIRECT_DTYPES:  # gathered piece by piece as it is written
        dtype_name = dtype_to_safetensors(value.dtype)
        return (-DTYPE_RANK[dtype_name], name, position, dtype_name, value.shape, value.nbytes, None, value)
    arr = _as_array(name, value)
    if is_packed(arr):  # sub-byte elements: the logical shape in the header, the stored bytes as they are
        return (-DTYPE_RANK[arr.packed], name, position, arr.packed, arr.logical_shape, arr.nbytes,
                arr.bytes_view(), value)
    if arr.dtype == PACKED_DTYPES["F4"]:  # ml_dtypes' one-element-a-byte float4: stored packed, as F4
        try:
            arr = pack_float4(arr)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        return (-DTYPE_RANK["F4"], name, position, "F4", arr.logical_shape, arr.nbytes, arr.bytes_view(), value)
    try:
        dtype_name = dtype_to_safetensors(arr.dtype)
    except TypeError as e:
        raise TypeError(f"tensor {name!r}: {e}") from None
    # Keep arrays that share memory with the input; drop ones that np.asarray had to build
    # (lists, lazily materialized array-likes) and rebuild them at write time, so that at most
    # one such copy exists at once.
    owned_copy = arr is not value and arr.flags.owndata
    return (-DTYPE_RANK[dtype_name], name, position, dtype_name, arr.shape, arr.nbytes,
            None if owned_copy else arr, value)


def _check_unique(plan: list[tuple]) -> None:
    seen = set()
    for t in plan:
        if t[_NAME] in seen:
            raise ValueError(f"tensor name {t[_NAME]!r} appears twice; safetensors names must be unique")
        seen.add(t[_NAME])


def _header_bytes(plan: list[tuple], metadata: dict[str, str] | None, alignment: int) -> bytes:
    """The length prefix and the space-padded JSON header of a sorted plan."""
    metadata_json = None
    if metadata is not None:
        metadata_json = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)
    text = header_text(plan, metadata_json)
    padded = len(text) + (-(8 + len(text)) % alignment)
    if padded > MAX_HEADER_SIZE:
        raise ValueError(f"the JSON header would be {padded} bytes, over the safetensors limit of "
                         f"{MAX_HEADER_SIZE}; split the tensors over several files or shorten metadata")
    return padded.to_bytes(8, "little") + text + b" " * (padded - len(text))


def _write_tensor(out: GatherWriter, t: tuple) -> None:
    """Queue a tensor that needs converting first (a non-ndarray, another byte order, a strided view)."""
    name, dtype_name, shape, nbytes, arr = t[_NAME], t[_DTYPE_NAME], t[_SHAPE], t[_NBYTES], t[_ARRAY]
    if arr is None and type(t[_SOURCE]) is TakenRows and t[_SOURCE].dtype in _DIRECT_DTYPES:
        taken = t[_SOURCE]
        source = taken.source
        if source.ndim > 1 and len(source) and not source[0].flags.c_contiguous:
            source = np.ascontiguousarray(source)  # each row's bytes in one run, as the writer gathers them
        # a piece gathered, hashed and written at a time, through one buffer of the writer's
        out.write_rows(source, np.ascontiguousarray(taken.rows), TakenRows.PIECE_BYTES)
        return
    if arr is None:
        arr = _as_array(name, t[_SOURCE])
        if arr.shape != shape or dtype_to_safetensors(arr.dtype) != dtype_name:
            raise ValueError(f"tensor {name!r}: converting it again gave {arr.dtype}{list(arr.shape)} instead "
                             f"of {dtype_name}{list(shape)}; pass a numpy array")
    if nbytes == 0:
        return
    if dtype_name in SUB_BYTE_DTYPES:  # planned as the stored bytes
        out.write(np.ascontiguousarray(arr, dtype=np.uint8))
        out.flush()
        return
    out.write(np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[dtype_name]))
    out.flush()  # a converted copy is freed before the next tensor is converted


def save_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    fsync: bool = True,
    hasher=None,
    progress: ProgressArg = False,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    writeback: int = 0,
    direct: bool = False,
    staged: bool = False,
) -> None:
    """Write ``tensors`` (name -> array-like) to a safetensors file at ``path``, atomically.

    The file follows the module's spec: data section aligned to ``alignment``
    bytes (a power of two >= 8), tensors in the reference writer's order,
    compact deterministic JSON, little-endian data (big-endian input is
    converted). ``metadata`` must map str to str. Each tensor's bytes go
    straight from its buffer to the file; a non-contiguous or big-endian
    tensor is copied, one at a time; a :class:`~fastckpt.arrays.TakenRows`
    (rows of an array in another order) is gathered and written a piece at a
    time through one buffer of about a MiB. ``fsync=False`` skips the fsyncs (still
    atomic for readers, not durable across power loss). ``hasher`` (an object
    with ``update``, e.g. ``blake3.blake3()``) receives every byte of the file
    in order as it is written, so the file's hash needs no second read.
    ``progress`` (``True`` for a bar, or ``callback(done, total, item)``:
    :mod:`fastckpt.progress`) counts the tensors' bytes as they are written.
    ``writeback=n`` starts the kernel writing the file to the disk every ``n``
    bytes written, without waiting (:class:`~fastckpt._native.gather.GatherWriter`),
    so that the disk works while later bytes are prepared and a following
    fsync has less left to wait for. ``direct=True`` writes the file past the
    page cache where the file system takes it (``O_DIRECT``: the kernel copies
    none of it, and none of it stays cached; the same bytes either way), for a
    large file that is not read back soon. ``staged=True``: ``path`` is a new file of a staging directory
    that is published whole later (:func:`fastckpt.store.commit.staged_file`: written under its own name, with
    no temporary and rename of its own, and ``fsync`` syncs the file only); a sharded save's tensor files are
    written so. An existing file at ``path`` is replaced only with ``overwrite=True``
    (docs/overwrite.md); another writer's file committed meanwhile is never
    replaced without it. An ``OSError`` names ``path``.

    Raises ``TypeError`` for a dtype safetensors cannot store (object,
    strings, complex128, ...) or non-string metadata, naming the tensor or key.

    ``path`` may be a URL (``s3://bucket/model.safetensors``, any fsspec URL,
    with ``storage_options`` for its filesystem): the same bytes are written
    to a local temporary file, then uploaded in one atomic upload
    (:mod:`fastckpt.formats.remote`).

    >>> import os, tempfile, numpy as np
    >>> p = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_safetensors(p, {"w": np.ones((2, 2), np.float32)}, {"step": "10"})
    >>> os.path.getsize(p)
    4112
    """
    if is_url(path):  # object storage and remote filesystems: fastckpt.formats.remote
        return save_file(path, partial(save_safetensors, tensors=tensors, metadata=metadata, alignment=alignment,
                                       fsync=False, hasher=hasher, progress=progress, overwrite=True),
                         "upload.safetensors", storage_options, overwrite=overwrite)
    if storage_options is not None:
        raise ValueError(f"storage_options is for URLs (s3://...), not the local path {os.fspath(path)!r}")
    if type(alignment) is not int or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 8, got {alignment!r}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name to array, got {type(tensors).__name__}")
    checked_metadata = _checked_metadata(metadata)
    plan = plan_tensors(tensors, _FAST_DTYPES, _plan)
    if type(tensors) is not dict:  # a dict's keys are unique; another mapping's items() might repeat one
        _check_unique(plan)
    plan.sort()  # dtype rank descending, then name: the reference writer's order
    prefix = _header_bytes(plan, checked_metadata, alignment)
    overwrite = overwrite_flag(overwrite)
    count, started = len(plan), time.perf_counter()
    total = sum(t[_NBYTES] for t in plan) if requested(progress) else None
    opened = staged_file(path, fsync=fsync) if staged else atomic_write(path, fsync=fsync, overwrite=overwrite)
    with progress_from(progress, total, "save safetensors") as report, opened as f, \
            GatherWriter(f.fileno(), hasher, writeback, direct) as out:
        out.write(prefix)
        if report.enabled:
            _write_reporting(out, plan, report)
        else:
            write_tensors(out, plan, _DIRECT_DTYPES, partial(_write_tensor, out))
    _log.log(file_log_level(), "saved %s: %d tensors, %d bytes in %.3f s", os.fspath(path), count, out.written,
             time.perf_counter() - started)


# Bytes written between progress reports: the gather writer's own flush size, so reporting adds no
# write calls to speak of.
_REPORT_BYTES = 64 << 20


def _write_reporting(out: GatherWriter, plan: list[tuple], report) -> None:
    """``write_tensors`` in runs of about ``_REPORT_BYTES``, each written, then reported tensor by tensor."""
    start = 0
    while start < len(plan):
        stop, run = start, 0
        while stop < len(plan) and (stop == start or run + plan[stop][_NBYTES] <= _REPORT_BYTES):
            run += plan[stop][_NBYTES]
            stop += 1
        done = [(t[_NAME], t[_NBYTES]) for t in plan[start:stop]]  # write_tensors empties the plan
        write_tensors(out, plan[start:stop], _DIRECT_DTYPES, partial(_write_tensor, out))
        out.flush()
        plan[start:stop] = [None] * (stop - start)
        for name, nbytes in done:
            report.advance(nbytes, name)
        start = stop


# -- bytes in memory -----------------------------------------------------------------------------


def save_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *,
               alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """The bytes :func:`save_safetensors` writes for ``tensors`` and ``metadata``, as ``bytes``, without a file to keep.

    Byte for byte the file's bytes (:mod:`fastckpt.formats.inmemory` says
    how); read them back with :func:`load_bytes` or ``safetensors.numpy.load``.

    >>> import numpy as np
    >>> data = save_bytes({"a": np.array([1, 2], np.uint8)}, alignment=64)
    >>> len(data), data[8:61], data[-2:]
    (66, b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b'\\x01\\x02')
    """
    from fastckpt.formats.filebytes import written_bytes

    return written_bytes(
        lambda path: save_safetensors(path, tensors, metadata, alignment=alignment, fsync=False), tensors)


def load_bytes(data) -> dict[str, np.ndarray]:
    """The tensors of safetensors bytes (``bytes``, ``bytearray``, a ``memoryview``): name -> array, in data order.

    Parsed by the file reader's parser, with every check of this module's
    spec; the arrays are writable and independent of ``data``. Bad bytes
    raise :class:`~fastckpt.errors.FormatError` naming the offset; NPZ bytes
    are refused, naming :func:`fastckpt.formats.npz.load_bytes`.

    >>> import numpy as np
    >>> out = load_bytes(save_bytes({"w": np.arange(4, dtype=np.float32).reshape(2, 2)}))
    >>> out["w"].tolist(), out["w"].flags.writeable
    ([[0.0, 1.0], [2.0, 3.0]], True)
    """
    from fastckpt.formats.filebytes import expect_format, mapped_bytes

    expect_format(data, "safetensors", "fastckpt.formats.safetensors")
    with mapped_bytes(data) as m:
        infos, _metadata, _data_start = read_safetensors_index(m)
        return {info.name: read_tensor(m, info) for info in sorted(infos, key=lambda info: info.offset)}
