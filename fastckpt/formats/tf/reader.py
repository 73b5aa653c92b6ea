"""Read TensorFlow v2 checkpoints (tensor bundles) without TensorFlow, zero-copy.

``CheckpointReader(prefix)`` opens ``<prefix>.index`` (format in
:mod:`fastckpt.formats.tf.format`), maps every ``<prefix>.data-?????-of-?????`` shard
and serves each tensor as a read-only numpy view of the mapped bytes, after
checking its masked CRC32C (``verify=False`` skips the check). It implements
the reader contract of :mod:`fastckpt.formats.contract` (``fastckpt.open(prefix)``
returns one).

>>> import numpy as np, tempfile, os
>>> from fastckpt.tf import write_checkpoint
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> write_checkpoint(prefix, {"dense/kernel": np.eye(2, dtype=np.float32)})
>>> with CheckpointReader(prefix) as r:
...     r.tensor_names(), r["dense/kernel"].tolist()
(['dense/kernel'], [[1.0, 0.0], [0.0, 1.0]])
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c
import numpy as np

from fastckpt._native.mapped import MappedFile
from fastckpt._native.tftable import decode_entry, decode_string_tensor, mask_crc, read_bundle_index
from fastckpt.errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    FormatError,
    NotZeroCopyWarning,
)
from fastckpt.formats.contract import ReaderMapping, tensor_not_found
from fastckpt.formats.tf import dtypes as _dt
from fastckpt.formats.tf.proto import decode_checkpoint_state, decode_header
from fastckpt.formats.tf.table import IndexTable
from fastckpt.info import TensorInfo, from_checked_fields
from fastckpt.store.snapshot import Snapshot

_PIN_AT_OPEN = 100_000  # data shards pinned when the reader opens (more are pinned as they are first read)

__all__ = ["CheckpointReader", "TFTensorInfo", "resolve_prefix", "latest_checkpoint", "read_checkpoint_state",
           "data_filename", "encode_tensor_name_slice"]

INT32_MAX = 2**31 - 1  # BundleHeaderProto.num_shards is an int32
BUNDLE_VERSION = 1  # kTensorBundleVersion
BUNDLE_MIN_PRODUCER = 0  # kTensorBundleMinProducer
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


# DataType values whose stored bytes are opaque (serialized C++ objects): listed in ``skipped``, never read.
_OPAQUE = {
    _dt.DT_VARIANT: "an opaque value (a tf.data iterator's state, a TensorList ...), readable only by TensorFlow",
    _dt.DT_RESOURCE: "a resource handle, readable only by TensorFlow",
}


def data_filename(prefix, shard: int, num_shards: int) -> str:
    """``<prefix>.data-%05d-of-%05d``, the name of one data shard.

    >>> data_filename("run/ckpt-1", 0, 2)
    'run/ckpt-1.data-00000-of-00002'
    """
    return f"{os.fspath(prefix)}.data-{shard:05d}-of-{num_shards:05d}"


@dataclass(frozen=True)
class TFTensorInfo(TensorInfo):
    """A :class:`~fastckpt.info.TensorInfo` plus what the bundle entry says.

    It is the ``TensorInfo`` of the reader contract for TensorFlow:
    ``offset`` / ``nbytes`` locate the payload in data shard ``shard`` (not in
    one file, so ``offset`` alone does not order tensors across shards);
    ``dtype`` is ``object`` for DT_STRING (``nbytes`` is then the encoded
    size); ``slices`` is non-empty for a partitioned variable (then ``offset``
    and ``nbytes`` are 0 and the values live in hidden slice entries).

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import write_checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "c")
    >>> write_checkpoint(prefix, {"w": np.zeros((2, 3), np.float32)})
    >>> with CheckpointReader(prefix) as reader:
    ...     info = reader.info("w")
    >>> info.shape, info.shard, info.offset, info.nbytes, info.tf_dtype_name
    ((2, 3), 0, 0, 24, 'float32')
    """

    shard: int = 0
    tf_dtype: int = 0
    crc32c: int | None = None
    slices: tuple = ()

    @property
    def tf_dtype_name(self) -> str:
        """TensorFlow's name of the stored type (``"float32"``, ``"string"``, ``"qint8"`` ...)."""
        return _dt.tf_name(self.tf_dtype)


def latest_checkpoint(directory) -> str | None:
    """The prefix named by ``directory/checkpoint`` (TensorFlow's ``tf.train.latest_checkpoint``), or None.

    Like TensorFlow, it returns None when the state file is missing or names a
    prefix whose ``.index`` does not exist.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import save
    >>> d = tempfile.mkdtemp()
    >>> latest_checkpoint(d) is None
    True
    >>> prefix = save(d, {"w": np.zeros(1)})
    >>> latest_checkpoint(d) == prefix == os.path.join(d, "ckpt-1")
    True
    """
    directory = Path(directory)
    state = directory / "checkpoint"
    if not state.is_file():
        return None
    latest, _ = read_checkpoint_state(state)
    if not latest:
        return None
    prefix = latest if os.path.isabs(latest) else str(directory / latest)
    return prefix if os.path.isfile(prefix + ".index") else None


def read_checkpoint_state(path) -> tuple:
    """``(model_checkpoint_path, all_model_checkpoint_paths)`` of a ``checkpoint`` state file.

    The file is text-format protobuf (non-ASCII bytes of paths are octal escapes); anything that is
    not UTF-8 is a :class:`~fastckpt.errors.FormatError` naming the file.

    >>> import tempfile, pathlib
    >>> state = pathlib.Path(tempfile.mkdtemp()) / "checkpoint"
    >>> _ = state.write_text('model_checkpoint_path: "ckpt-2"\\nall_model_checkpoint_paths: "ckpt-2"\\n')
    >>> read_checkpoint_state(state)
    ('ckpt-2', ['ckpt-2'])
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: a checkpoint state file is text, but byte {exc.start} is not UTF-8 "
                          f"({raw[exc.start:exc.start + 4]!r}); delete or rewrite the file") from None
    return decode_checkpoint_state(text, str(path))


def resolve_prefix(path) -> str:
    """Turn a prefix, an ``.index`` / data file name or a directory into a checkpoint prefix.

    A directory resolves through its ``checkpoint`` state file, as in TensorFlow.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import write_checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "model")
    >>> write_checkpoint(prefix, {"w": np.zeros(1)})
    >>> resolve_prefix(prefix + ".index") == resolve_prefix(prefix + ".data-00000-of-00001") == prefix
    True
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        prefix = latest_checkpoint(path)
        if prefix is None:
            found = sorted(p.name[: -len(".index")] for p in Path(path).glob("*.index"))
            hint = (f"; it holds {', '.join(found[:5])}: pass {os.path.join(path, found[-1])!r} as the prefix"
                    if found else "")
            raise CheckpointNotFoundError(
                f"{path}: a directory without a usable 'checkpoint' state file (or its index is missing){hint}")
        return prefix
    if path.endswith(".index") and os.path.isfile(path):
        return path[: -len(".index")]
    base, dot, tail = path.rpartition(".data-")
    if dot and tail[:5].isdigit() and os.path.isfile(path):
        return base
    if os.path.isfile(path + ".index"):
        return path
    raise CheckpointNotFoundError(f"{path}: no TensorFlow checkpoint here (expected {path}.index, "
                                  "a directory with a 'checkpoint' file, or the .index file itself)")


# -- partitioned variables: TensorFlow's OrderedCode slice keys (saved_tensor_slice_util.cc) --------


def _ordered_num(value: int) -> bytes:
    body = value.to_bytes((value.bit_length() + 7) // 8, "big") if value else b""
    return bytes([len(body)]) + body


def _ordered_signed(value: int) -> bytes:
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    length = x.bit_length() // 7 + 1
    header = [(0, 0), (0x80, 0), (0xC0, 0), (0xE0, 0), (0xF0, 0), (0xF8, 0), (0xFC, 0), (0xFE, 0), (0xFF, 0),
              (0xFF, 0x80), (0xFF, 0xC0)][length]
    buf = bytearray((value & ((1 << 80) - 1)).to_bytes(10, "big")[10 - length:])
    buf[0] ^= header[0]
    buf[1] ^= header[1]
    return bytes(buf)


def _ordered_string(data: bytes) -> bytes:
    out = bytearray()
    for byte in data:  # 0x00 -> 00 ff, 0xff -> ff 00, then the 00 01 terminator
        out += b"\x00\xff" if byte == 0 else b"\xff\x00" if byte == 0xFF else bytes([byte])
    return bytes(out) + b"\x00\x01"


def encode_tensor_name_slice(name: bytes, extents) -> bytes:
    """TensorFlow's ``EncodeTensorNameSlice``: the hidden key of one slice of a partitioned variable.

    ``extents`` is ``[(start, length)]`` with ``length = -1`` for a full dimension.

    >>> encode_tensor_name_slice(b"emb", [(0, 2), (0, 3)])
    b'\\x00emb\\x00\\x01\\x01\\x02\\x80\\x82\\x80\\x83'
    """
    out = _ordered_num(0) + _ordered_string(name) + _ordered_num(len(extents))
    for start, length in extents:
        out += _ordered_signed(start) + _ordered_signed(length)
    return out


# -- the reader ------------------------------------------------------------------------------------


def _union_length(ranges) -> int:
    """Bytes covered by ``(shard, start, stop)`` ranges, each byte counted once."""
    total = 0
    shard = end = None
    for r_shard, start, stop in sorted(ranges):
        if r_shard != shard or end is None or start >= end:
            shard, end = r_shard, stop
            total += stop - start
        elif stop > end:
            total += stop - end
            end = stop
    return total


class _Entry:
    """``"<index path>: entry <name!r>"``, the start of a bundle entry's error messages, formatted only when one is."""

    __slots__ = ("index_path", "name")

    def __init__(self, index_path: str, name: str):
        self.index_path, self.name = index_path, name

    def __str__(self) -> str:
        return f"{self.index_path}: entry {self.name!r}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _encode_name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


class CheckpointReader(ReaderMapping):
    """A TensorFlow v2 checkpoint opened for reading.

    ``path`` is a prefix (``dir/ckpt-1``), its ``.index`` file, or a directory
    (resolved through its ``checkpoint`` file). ``verify=False`` skips the
    per-tensor CRC32C (block checksums of the index are always checked).
    ``backend="pread"`` reads shards without mmap (network filesystems);
    ``copy_on_write=True`` maps them privately, so views are writable and the
    files never change.

    The reader implements the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`: ``keys()``, ``infos``,
    ``info(name)``, ``host(name)``, ``metadata`` (always None: a bundle has no
    free-form metadata), ``path`` (the prefix), ``format``
    (``"tensorflow"``)) and is a read-only :class:`~collections.abc.Mapping`
    from tensor name to array (``items()``, ``get()`` ...; ``reader[name]`` is
    :meth:`read_tensor`). Names are in index (byte) order. Slice entries of
    partitioned variables are hidden; the variable itself is listed and
    :meth:`read_tensor` assembles it. Opaque entries (DT_VARIANT: a ``tf.data``
    iterator's state; DT_RESOURCE) are not listed either: ``skipped`` maps
    each one's name to why, and the tensors beside them read as usual.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.tf import write_checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
    >>> write_checkpoint(prefix, {"b": np.zeros(3, np.int64), "a": np.float32(2.5)})
    >>> r = CheckpointReader(prefix)
    >>> list(r), r.tensor_shape("b"), r.tensor_dtype("a")
    (['a', 'b'], (3,), dtype('float32'))
    >>> [(name, info.shard, info.offset, info.nbytes) for name, info in r.infos.items()]
    [('a', 0, 24, 4), ('b', 0, 0, 24)]
    >>> r.host("b").flags.writeable, r.metadata
    (False, None)
    >>> r.close()
    """

    format = "tensorflow"
    metadata = None  # the reader contract's metadata: a tensor bundle has none
    snapshot = None  # the pinned directory (fastckpt.store.snapshot), set when the reader opens

    def __init__(self, path, *, verify: bool = True, backend: str = "mmap", copy_on_write: bool = False):
        self.prefix = resolve_prefix(path)
        self.verify = verify
        self.index_path = self.prefix + ".index"
        # Shard index -> mapping, filled on first read as TensorFlow opens them; a dict, so a header
        # claiming two billion shards costs nothing until a tensor names one.
        self._shards: dict = {}
        self._closed = False
        self._backend = backend
        self._copy_on_write = copy_on_write
        self._shard_lock = threading.Lock()  # two threads reading one new shard map it once
        # Entries left out of the listing, name -> why: opaque values (a tf.data iterator's DT_VARIANT, a
        # DT_RESOURCE) have no bytes fastckpt can give meaning to, and must not block the tensors beside them.
        self.skipped: dict = {}
        # One commit: the index and the data shards pinned in their directory (identities recorded now); a shard
        # mapped later must be the one pinned, and the index is checked again once the shards are pinned.
        directory, self._index_name = os.path.split(os.path.abspath(self.index_path))
        self.snapshot = Snapshot(directory, record=self._index_name, what="TensorFlow checkpoint")
        try:
            self._open_index(verify)
        except BaseException:
            self.snapshot.close()
            raise

    def _open_index(self, verify: bool) -> None:
        try:
            mapped = MappedFile(self.index_path, advise=False)
        except FileNotFoundError:
            # No index (anymore): a save with overwrite=True moves the previous files aside before it renames the
            # new ones in, index last, so between the two the prefix holds no checkpoint, and says so.
            raise self.snapshot.absent(self._index_name, f"{self.index_path}: no TensorFlow checkpoint here (no "
                                       "index file)") from None
        with mapped:
            self.snapshot.check(self._index_name, mapped.identity)
            table = IndexTable(mapped)
            self.num_data_blocks = len(table.block_handles)
            # Every entry decoded into the columns of one index, in one native loop: a TFTensorInfo is
            # made when asked for (hidden slice entries, strings and anything unusual go through
            # _make_info, which also gives every error message).
            index, self._entries, self.header, names = read_bundle_index(
                table, self.index_path, self._read_header, self._make_info, self._shard, _dt._NUMPY, TFTensorInfo,
                verify)
        self._names = names
        self._infos = index
        self._view = index.view  # bound once: host() is called once per tensor
        num_shards = self.header.num_shards
        if num_shards < 0 or num_shards > INT32_MAX or (num_shards == 0 and names):
            raise FormatError(f"{self.index_path}: header says num_shards={num_shards} (an int32 of at least 1 "
                              "when there are tensors)")
        self.num_shards = num_shards
        if num_shards <= _PIN_AT_OPEN:  # a header claiming billions of shards pins each when a tensor names it
            for shard in range(num_shards):
                name = os.path.basename(data_filename(self.prefix, shard, num_shards))
                try:
                    self.snapshot.pin(name)
                except FormatError as exc:
                    if isinstance(exc, CheckpointChangedError):
                        raise
                    # missing: said when a tensor of it is read (a checkpoint copied without its data files)
            self.snapshot.recheck(self._index_name)

    def _read_header(self, value: bytes):
        self.header = decode_header(value, f"{self.index_path}: header entry")
        self._check_version()
        return self.header

    def _check_version(self) -> None:
        h = self.header
        if h.producer < BUNDLE_MIN_PRODUCER:
            raise FormatError(f"{self.index_path}: bundle producer version {h.producer} is older than the oldest "
                              f"supported ({BUNDLE_MIN_PRODUCER})")
        if h.min_consumer > BUNDLE_VERSION:
            raise FormatError(f"{self.index_path}: written by a newer TensorFlow: it needs bundle reader version "
                              f"{h.min_consumer}, this reader is version {BUNDLE_VERSION}")
        if BUNDLE_VERSION in h.bad_consumers:
            raise FormatError(f"{self.index_path}: the bundle disallows reader version {BUNDLE_VERSION} "
                              f"(bad_consumers={list(h.bad_consumers)})")

    def _make_info(self, name: str, value: bytes) -> TFTensorInfo:
        what = _Entry(self.index_path, name)  # formatted only for an error message
        dtype, shape, shard, offset, size, crc, slices = decode_entry(value, what)
        if shape is None:
            raise FormatError(f"{what}: shape has unknown rank (a stored tensor needs a full shape)")
        if shape and min(shape) < 0:
            raise FormatError(f"{what}: invalid shape {list(shape)} (negative dimension)")
        if dtype in _OPAQUE:
            if not name.startswith("\x00"):
                self.skipped[name] = f"{_dt.tf_name(dtype)}: {_OPAQUE[dtype]}"
            return None
        if dtype == _dt.DT_STRING:
            np_dtype = np.dtype(object)
        else:
            np_dtype = _dt.numpy_dtype(dtype, what=what)
        count = 1
        for d in shape:
            count *= d
        if not slices:
            if not 0 <= shard < max(self.header.num_shards, 1):
                raise FormatError(f"{what}: shard_id {shard} but the header says num_shards="
                                  f"{self.header.num_shards}")
            if offset < 0 or size < 0:
                raise FormatError(f"{what}: negative offset {offset} or size {size}")
            if dtype != _dt.DT_STRING and size != count * np_dtype.itemsize:
                raise FormatError(f"{what}: invalid size in bundle entry: {size} bytes for shape {list(shape)} of "
                                  f"{_dt.tf_name(dtype)} (expected {count * np_dtype.itemsize})")
        # Checked above: the dataclass's __init__ would cost as much again, once per tensor.
        return from_checked_fields(TFTensorInfo, {
            "name": name, "dtype": np_dtype, "shape": tuple(shape), "offset": offset if not slices else 0,
            "nbytes": size if not slices else 0, "fortran_order": False, "compression": None, "shard": shard,
            "tf_dtype": dtype, "crc32c": crc, "slices": tuple(tuple(e) for e in slices) if slices else ()})

    def mappings(self) -> list:
        """The data shards that hold this checkpoint's tensors, as :class:`MappedFile` handles (opened now if
        not yet): what a copy of its views reads, for :func:`fastckpt.formats.reader.guard`.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.tf import write_checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "m"); write_checkpoint(prefix, {"w": np.ones(2)})
        >>> with CheckpointReader(prefix) as r:
        ...     [os.path.basename(m.path) for m in r.mappings()]
        ['m.data-00000-of-00001']
        """
        shards = {info.shard for info in self.infos.values() if not info.slices}
        shards.update(entry.shard for entry in self._entries.values())
        return [self._shard(shard) for shard in sorted(shards)]

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the shards. Idempotent; arrays already returned stay valid."""
        with self._shard_lock:
            for shard in self._shards.values():
                shard.close()
            self._shards = {}
            self._closed = True
            self._infos.forget_shards()
            if self.snapshot is not None:
                self.snapshot.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run (arrays returned before stay valid)."""
        return self._closed

    @property
    def path(self) -> str:
        """The checkpoint prefix (the reader contract's ``path``)."""
        return self.prefix

    def __repr__(self):
        if self._closed:
            return "<Closed TensorFlow CheckpointReader>"
        return (f"<TensorFlow CheckpointReader {self.prefix!r} tensors={len(self._names)} "
                f"shards={self.header.num_shards}>")

    # -- listing -------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Every tensor name in byte order, without hidden partition slices (object graph included)."""
        return list(self._names)

    def info(self, name: str) -> TFTensorInfo:
        """Where and how tensor ``name`` is stored (``TensorNotFoundError``, a KeyError, naming close matches)."""
        info = self._infos.get(name) if isinstance(name, str) else None
        if info is None:
            raise tensor_not_found(self.prefix, name, self._names)
        return info

    @property
    def infos(self) -> "Mapping[str, TFTensorInfo]":
        """Read-only mapping name -> :class:`TFTensorInfo` of every listed tensor, in name (index) order.

        A :class:`~fastckpt._native.tftable.BundleIndex`: the entries are held in
        columns and each info is made on first access.
        """
        return self._infos

    def has_tensor(self, name: str) -> bool:
        """True if ``name`` is a (listed) tensor of this checkpoint."""
        return isinstance(name, str) and name in self._infos

    def tensor_shape(self, name: str) -> tuple:
        """The shape of ``name`` as a tuple (``()`` for a scalar)."""
        return self.info(name).shape

    def tensor_dtype(self, name: str) -> np.dtype:
        """The numpy dtype of ``name`` (``object`` for strings; native byte order)."""
        return self.info(name).dtype

    def variable_to_shape_map(self) -> dict:
        """``{name: list(shape)}``, like TensorFlow's ``get_variable_to_shape_map``."""
        return self._infos.shape_lists()

    def __iter__(self):
        return iter(self.tensor_names())

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name) -> bool:
        return self.has_tensor(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.read_tensor(name)

    # -- reading -------------------------------------------------------------------------------

    def _shard(self, index: int) -> MappedFile:
        if self._closed:
            raise ValueError(f"{self.prefix}: the checkpoint reader is closed")
        mapped = self._shards.get(index)
        if mapped is not None:
            return mapped
        with self._shard_lock:
            if self._closed:
                raise ValueError(f"{self.prefix}: the checkpoint reader is closed")
            mapped = self._shards.get(index)
            if mapped is None:
                num_shards = self.num_shards
                path = data_filename(self.prefix, index, num_shards)
                try:
                    mapped = MappedFile(path, backend=self._backend, copy_on_write=self._copy_on_write)
                except FileNotFoundError:
                    change = self.snapshot.changed() if self.snapshot is not None else None
                    if change is not None:  # replaced by a save with overwrite=True since the index was read
                        raise self.snapshot.changed_error(os.path.basename(path), f"gone ({change})") from None
                    raise CheckpointNotFoundError(
                        f"{path}: data shard {index} of {num_shards} is missing (the index {self.index_path} "
                        "lists tensors in it; was the checkpoint copied without its data files?)") from None
                try:
                    if self.snapshot is not None:  # the shard of the commit pinned, not one written since
                        self.snapshot.check(os.path.basename(path), mapped.identity)
                except BaseException:
                    mapped.close()
                    raise
                self._shards[index] = mapped
        return mapped

    def host(self, name: str) -> np.ndarray:
        """The value of tensor ``name`` as the reader contract gives it: :meth:`read_tensor`, copying only where needed.

        A zero-copy, read-only view of the mapped data where the bytes allow;
        big-endian tensors and partitioned variables come back as new arrays,
        without :meth:`read_tensor`'s warning; strings as ``object`` arrays of ``bytes``.
        """
        view = self._view(name)  # straight from the index's columns (checksummed), where the tensor allows
        if view is not None:
            return view
        info = self.info(name)
        copy = bool(info.slices) or (self.header.big_endian and info.dtype.itemsize > 1)
        return self.read_tensor(name, copy=copy)

    def read_tensor(self, name: str, *, copy: bool = False) -> np.ndarray:
        """The value of tensor ``name``.

        A zero-copy, read-only view of the mapped data unless ``copy=True``.
        String tensors come back as ``object`` arrays of ``bytes`` (always new
        objects). Big-endian files and partitioned variables need a copy; without
        ``copy=True`` that copy is announced with a
        :class:`~fastckpt.errors.NotZeroCopyWarning`.

        Raises :class:`~fastckpt.errors.TensorNotFoundError` (a KeyError) for an
        unknown name and :class:`~fastckpt.errors.ChecksumMismatchError` when
        the stored CRC32C does not match (``verify=False`` skips the check).
        """
        if not copy:
            view = self._view(name)
            if view is not None:
                return view
        info = self.info(name)
        if info.slices:
            if not copy:
                warnings.warn(f"{self.prefix}: {name!r} is a partitioned variable; its slices are copied into one "
                              "array (pass copy=True to silence this)", NotZeroCopyWarning, stacklevel=2)
            return self._assemble(info)
        return self._read_entry(info, copy=copy, stacklevel=3)

    def hosts(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """``{name: host(name)}`` for every tensor in index order (``names=None``) or for ``names``.

        The views are made in one native loop over the index, each from its
        shard's mapping and checked against its CRC32C when the reader verifies;
        tensors that need more (strings, big-endian bytes, partitioned
        variables, a damaged payload) go through :meth:`host`, which copies or
        raises as it does. Unknown names raise as :meth:`host` does.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.tf import write_checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "m")
        >>> write_checkpoint(prefix, {"b": np.arange(2, dtype=np.int8), "a": np.ones(1, np.float32)})
        >>> with CheckpointReader(prefix) as r:
        ...     {k: v.tolist() for k, v in r.hosts().items()}, list(r.hosts(["b"]))
        ({'a': [1.0], 'b': [0, 1]}, ['b'])
        """
        return self._infos.views(names, self.host)

    def _read_entry(self, info: TFTensorInfo, *, copy: bool, stacklevel: int) -> np.ndarray:
        mapped = self._shard(info.shard)
        what = f"tensor {info.name!r}"
        with mapped.guard(what):  # the checksum and the copies read the mapping: a truncation is a FormatError
            return self._read_mapped(mapped, info, what, copy, stacklevel + 1)

    def _read_mapped(self, mapped, info: TFTensorInfo, what: str, copy: bool, stacklevel: int) -> np.ndarray:
        if info.tf_dtype == _dt.DT_STRING:
            payload = mapped.view(info.offset, info.nbytes, what)
            values, crc = decode_string_tensor(payload, info.size, f"{mapped.path}: {what}", self.verify)
            if self.verify:
                self._check_crc(info, crc, mapped.path)
            out = np.empty(len(values), dtype=object)
            out[:] = values
            return out.reshape(info.shape)
        if self.header.big_endian and info.dtype.itemsize > 1:
            raw = mapped.array(info.offset, np.uint8, (info.nbytes,), what=what)
            if self.verify:
                self._check_crc(info, mask_crc(_crc32c.crc32c(raw)), mapped.path)
            if not copy:
                warnings.warn(f"{self.prefix}: {info.name!r} is stored big-endian and is byte-swapped into a copy "
                              "(pass copy=True to silence this)", NotZeroCopyWarning, stacklevel=stacklevel)
            # reverse the bytes of each scalar unit (each half of a complex number); works for ml_dtypes too
            unit = info.dtype.itemsize // 2 if info.dtype.kind == "c" else info.dtype.itemsize
            swapped = np.ascontiguousarray(raw.reshape(-1, unit)[:, ::-1])
            return swapped.reshape(-1).view(info.dtype).reshape(info.shape)
        arr = mapped.array(info.offset, info.dtype, info.shape, what=what)
        if self.verify:
            self._check_crc(info, mask_crc(_crc32c.crc32c(mapped.view(info.offset, info.nbytes, what))), mapped.path)
        return arr.copy() if copy else arr

    def _check_crc(self, info: TFTensorInfo, actual: int, path: str) -> None:
        if info.crc32c is None:
            raise ChecksumMismatchError(f"{path}: tensor {info.name!r} has no stored crc32c to verify; "
                                        "open with verify=False to read it anyway")
        if actual != info.crc32c:
            raise ChecksumMismatchError(
                f"{path}: tensor {info.name!r} at offset {info.offset} ({info.nbytes} bytes): checksum mismatch "
                f"(stored {info.crc32c:#010x}, computed {actual:#010x}); the data file is damaged or does not "
                "belong to this index (open with verify=False to read it anyway)")

    def _assemble(self, info: TFTensorInfo) -> np.ndarray:
        """Copy every slice of a partitioned variable into one array, checking that they cover it."""
        if info.tf_dtype == _dt.DT_STRING:
            raise FormatError(f"{self.prefix}: partitioned string tensor {info.name!r} is not supported")
        parts = []
        for extents in info.slices:
            what = f"{self.index_path}: slice {list(extents)} of {info.name!r}"
            if len(extents) != len(info.shape):
                raise FormatError(f"{what}: rank {len(extents)} differs from the variable's rank {len(info.shape)}")
            index = []
            for (start, length), dim in zip(extents, info.shape):
                stop = dim if length < 0 else start + length
                if not 0 <= start <= stop <= dim:
                    raise FormatError(f"{what}: extent ({start}, {length}) lies outside dimension {dim}")
                index.append(slice(start, stop))
            key = encode_tensor_name_slice(_encode_name(info.name), extents)
            part = self._entries.get(key)
            if part is None:
                raise FormatError(f"{what}: the slice entry {key!r} is missing from the index")
            expected = tuple(s.stop - s.start for s in index)
            if part.shape != expected or part.dtype != info.dtype or part.slices:
                raise FormatError(f"{what}: slice entry holds {part.dtype}{list(part.shape)}, expected "
                                  f"{info.dtype}{list(expected)}")
            shard = self._shard(part.shard)
            if part.offset + part.nbytes > shard.size:
                raise FormatError(f"{shard.path}: slice {list(extents)} of {info.name!r} needs bytes "
                                  f"[{part.offset}, {part.offset + part.nbytes}) but the file has {shard.size}")
            parts.append((tuple(index), part))
        # Only now is the full array allocated, and only when the slices' own bytes, each byte of the
        # files counted once, make exactly that array: slices that overlap, or many slice entries that
        # point at the same bytes, cannot make an index claim more memory than its files hold.
        needed = info.size * info.dtype.itemsize
        claimed = sum(p.nbytes for _, p in parts)
        distinct = _union_length((p.shard, p.offset, p.offset + p.nbytes) for _, p in parts)
        if claimed != needed or distinct != needed:
            raise FormatError(f"{self.prefix}: the slices of partitioned variable {info.name!r} do not cover its "
                              f"shape {list(info.shape)} exactly ({needed} bytes): they hold {claimed} bytes, "
                              f"{distinct} of them distinct in the data files (slices overlap, leave gaps or share "
                              "data)")
        out = np.zeros(info.shape, dtype=info.dtype)
        covered = np.zeros(info.shape, dtype=bool)
        for index, part in parts:
            with self._shard(part.shard).guard(f"slice {part.name!r}"):
                out[index] = self._read_entry(part, copy=False, stacklevel=4)
            covered[index] = True
        if not covered.all():
            raise FormatError(f"{self.prefix}: the slices of partitioned variable {info.name!r} do not cover its "
                              f"shape {list(info.shape)}")
        return out

    def object_graph(self):
        """The decoded ``_CHECKPOINTABLE_OBJECT_GRAPH`` (:class:`fastckpt.formats.tf.proto.ObjectGraph`), or None."""
        from fastckpt.formats.tf.proto import decode_object_graph

        if not self.has_tensor(OBJECT_GRAPH_KEY):
            return None
        value = self.read_tensor(OBJECT_GRAPH_KEY)
        if value.shape != () or not isinstance(value[()], bytes):
            raise FormatError(f"{self.prefix}: {OBJECT_GRAPH_KEY} is not a scalar string")
        return decode_object_graph(value[()], f"{self.prefix}: {OBJECT_GRAPH_KEY}")
