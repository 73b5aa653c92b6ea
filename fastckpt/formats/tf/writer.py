"""Write TensorFlow v2 checkpoints that TensorFlow itself reads and restores.

``write_checkpoint(prefix, tensors)`` writes ``<prefix>.data-00000-of-00001``
and ``<prefix>.index`` (format in :mod:`fastckpt.formats.tf.format`) into a
staging directory, then commits them as one set
(:class:`fastckpt.store.commit.Commit`, ``kind="files"``): data files renamed in
first, the index last, the previous checkpoint at that prefix (its index and
every ``<prefix>.data-*-of-*``) claimed, so a reader never sees a half-written
file or a mix of two saves, and a failed save leaves the previous one exactly. ``save(directory, tensors)`` picks the next
``ckpt-N`` and updates the directory's ``checkpoint`` state file the way
``tf.train.CheckpointManager`` does.

With ``object_graph=True`` the names are object paths (``model/dense/kernel``):
they are stored under TensorFlow's object-based keys
(``model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE``, each path component
escaped) together with ``save_counter`` and a ``_CHECKPOINTABLE_OBJECT_GRAPH``,
so that ``tf.train.Checkpoint(model=...).restore(prefix).assert_consumed()``
succeeds.

>>> import numpy as np, tempfile, os
>>> from fastckpt.tf import CheckpointReader
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
>>> write_checkpoint(prefix, {"model/w": np.ones(2, np.float32)}, object_graph=True)
>>> CheckpointReader(prefix).tensor_names()
['_CHECKPOINTABLE_OBJECT_GRAPH', 'model/w/.ATTRIBUTES/VARIABLE_VALUE', 'save_counter/.ATTRIBUTES/VARIABLE_VALUE']
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
from pathlib import Path

import crc32c as _crc32c
import numpy as np

from fastckpt._native.tftable import mask_crc
from fastckpt.arrays import to_numpy
from fastckpt.store.commit import Commit, atomic_write, overwrite_flag, write_file
from fastckpt.formats.tf import dtypes as _dt
from fastckpt.formats.tf.proto import (
    BundleHeader,
    GraphNode,
    ObjectGraph,
    encode_checkpoint_state,
    encode_entry,
    encode_header,
    encode_object_graph,
    encode_varint,
)
from fastckpt.formats.tf.reader import OBJECT_GRAPH_KEY, data_filename, read_checkpoint_state
from fastckpt.formats.tf.table import TableBuilder
from fastckpt.store.names import FILE_NAME, NameRule

__all__ = ["CheckpointWriter", "write_checkpoint", "save", "escape_local_name", "unescape_local_name",
           "object_key", "SAVE_COUNTER_KEY"]

# Small writes gather into one write() per 256 KiB (the buffer atomic_write gives the single-file writers).
_WRITE_BUFFER = 256 << 10
#: The keys a bundle keeps for itself; any other str (newlines, '/', '.' and NUL inside included) reads back.
NAMES = NameRule("TensorFlow's bundle", controls=False, empty=True,
                 whole=(("", "the empty key holds the bundle's header"),),
                 prefixes=(("\x00", "keys starting with NUL hold partitioned variables' slices"),))

ATTRIBUTES_MARKER = "/.ATTRIBUTES/"
VARIABLE_VALUE = "VARIABLE_VALUE"
SAVE_COUNTER_KEY = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"


def escape_local_name(name: str) -> str:
    """TensorFlow's ``escape_local_name``: ``.`` -> ``..``, then ``/`` -> ``.S``.

    >>> escape_local_name("a/b.c")
    'a.Sb..c'
    """
    return name.replace(".", "..").replace("/", ".S")


def unescape_local_name(escaped: str) -> str:
    """Inverse of :func:`escape_local_name`; raises ValueError on a lone ``.``.

    >>> unescape_local_name("a.Sb..c")
    'a/b.c'
    """
    out = []
    i = 0
    while i < len(escaped):
        ch = escaped[i]
        if ch == ".":
            nxt = escaped[i + 1 : i + 2]
            if nxt == ".":
                out.append(".")
            elif nxt == "S":
                out.append("/")
            else:
                raise ValueError(f"{escaped!r} is not an escaped TensorFlow object name ('.' at {i} not followed "
                                 "by '.' or 'S')")
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def object_key(path, attribute: str = VARIABLE_VALUE) -> str:
    """The object-based checkpoint key of the variable at object ``path``.

    ``path`` is a list of local names, or a ``/``-separated string.

    >>> object_key("model/dense/kernel")
    'model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE'
    >>> object_key(["model", "w", "a/b.c"])
    'model/w/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE'
    """
    parts = path.split("/") if isinstance(path, str) else list(path)
    if not parts or any(p == "" for p in parts):
        raise ValueError(f"object path {path!r} has an empty component")
    return "/".join(escape_local_name(p) for p in parts) + "/.ATTRIBUTES/" + escape_local_name(attribute)


def _split_object_key(key: str):
    """``(local names, attribute)`` of an object-based key, or None when ``key`` is not one."""
    path, marker, attribute = key.partition(ATTRIBUTES_MARKER)
    if not marker or not path or "/" in attribute:
        return None
    try:
        return [unescape_local_name(p) for p in path.split("/")], unescape_local_name(attribute)
    except ValueError:
        return None


def _as_array(name: str, value) -> np.ndarray:
    if hasattr(value, "to_host") and not isinstance(value, np.ndarray):
        value = value.to_host()
    if isinstance(value, (bytes, str)):
        arr = np.empty((), dtype=object)
        arr[()] = value
        return arr
    arr = to_numpy(value, name=name, where="a TensorFlow checkpoint")
    if arr.dtype.kind == "V" and arr.dtype.names is not None and _dt.quantized_name(arr.dtype) is None:
        raise TypeError(f"tensor {name!r}: structured arrays cannot be stored in a TensorFlow checkpoint (the "
                        "one-field forms of the quantized types, np.dtype([('qint8', 'i1')]) ..., are stored as "
                        "DT_QINT8 ...)")
    return arr


def _string_payload(name: str, arr: np.ndarray):
    """DT_STRING layout: varint lengths, masked length CRC, bytes; returns (payload, masked crc)."""
    pieces = []
    for item in arr.reshape(-1):
        if isinstance(item, np.ndarray):
            item = item.item()
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif isinstance(item, (np.bytes_, bytes, bytearray, memoryview)):
            item = bytes(item)
        else:
            raise TypeError(f"tensor {name!r}: a string tensor holds only bytes or str, found {type(item).__name__}")
        pieces.append(item)
    lengths = bytearray()
    crc = 0
    for piece in pieces:
        n = len(piece)
        lengths += encode_varint(n)
        crc = _crc32c.crc32c(n.to_bytes(8 if n > 0xFFFFFFFF else 4, "little"), crc)
    length_crc = mask_crc(crc).to_bytes(4, "little")
    crc = _crc32c.crc32c(length_crc, crc)
    for piece in pieces:
        crc = _crc32c.crc32c(piece, crc)
    return bytes(lengths) + length_crc + b"".join(pieces), mask_crc(crc)


class CheckpointWriter:
    """Stream tensors into a new checkpoint at ``prefix``; the index is written by :meth:`close`.

    Tensor bytes go to the data shard(s) as they are added (memory stays
    bounded by the largest tensor), in the order added; the index lists them
    sorted by name as UTF-8 bytes. ``num_shards`` data files are written;
    ``add(..., shard=i)`` picks one, otherwise the emptiest shard is used.
    ``data_alignment`` pads after each tensor with zeros so that every tensor
    starts at a multiple of it (TensorFlow's default and ours is 1: packed).
    Leaving the ``with`` block by an exception discards everything. An
    existing checkpoint at ``prefix`` (its ``.index``) is replaced only with
    ``overwrite=True`` (docs/overwrite.md); without it no file of another writer's checkpoint
    committed meanwhile is replaced either.

    >>> import numpy as np, tempfile, os
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> with CheckpointWriter(prefix, data_alignment=64) as w:
    ...     _ = w.add("b", np.arange(3, dtype=np.int32))
    ...     _ = w.add("a", "some text")
    >>> sorted(os.listdir(os.path.dirname(prefix)))
    ['ckpt.data-00000-of-00001', 'ckpt.index']
    """

    def __init__(self, prefix, *, num_shards: int = 1, data_alignment: int = 1, object_graph: bool = False,
                 save_counter: int = 1, fsync: bool = True, overwrite: bool = False):
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if data_alignment < 1:
            raise ValueError(f"data_alignment must be at least 1, got {data_alignment}")
        self.prefix = os.fspath(prefix)
        self.num_shards = num_shards
        self.data_alignment = data_alignment
        self.object_graph = object_graph
        self.save_counter = save_counter
        self.fsync = fsync
        self.overwrite = overwrite_flag(overwrite)
        if not self.overwrite and os.path.lexists(self.prefix + ".index"):
            raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}; pass overwrite=True to replace it",
                                  self.prefix + ".index")
        self._entries: dict = {}  # key bytes -> (key str, encoded BundleEntryProto fields)
        self._paths: dict = {}  # key -> (object path, attribute) when object_graph
        self._offsets = [0] * num_shards
        self._files: list = []
        self._done = False
        self._failed = False  # an add() failed mid-write: close() must not report success
        name = os.path.basename(self.prefix)
        # Every file of this prefix is one commit: staged, then renamed in with the index last. It claims the
        # index and the data files of any shard count, so a previous save's are replaced (or refused) whole.
        self._commit = Commit(self.prefix, kind="files", overwrite=self.overwrite, fsync=fsync,
                              entry_points=[name + ".index"], claims=[name + ".index"],
                              replaces=re.compile(re.escape(name) + r"\.data-[0-9]{5}-of-[0-9]{5}"))
        try:
            for shard in range(num_shards):
                path = self._commit.staging / os.path.basename(data_filename(self.prefix, shard, num_shards))
                self._files.append(open(path, "xb", buffering=_WRITE_BUFFER))
        except BaseException as exc:
            self._discard()
            if isinstance(exc, OSError):
                raise self._commit._naming(exc) from None
            raise

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort(exc_type, exc, tb)
        return False

    def _key_for(self, name: str) -> str:
        if not self.object_graph or name == OBJECT_GRAPH_KEY:
            return name
        split = _split_object_key(name)
        if split is None:
            if "/.OPTIMIZER_SLOT/" in name:
                raise ValueError(f"tensor {name!r}: optimizer slot keys need slot references in the object graph, "
                                 "which fastckpt does not build; write them with object_graph=False")
            key = object_key(name)
            split = _split_object_key(key)
        else:
            key = name
        if "/.OPTIMIZER_SLOT/" in key or ".OPTIMIZER_SLOT" in split[0]:
            raise ValueError(f"tensor {name!r}: optimizer slot keys need slot references in the object graph, "
                             "which fastckpt does not build; write them with object_graph=False")
        self._paths[key] = split
        return key

    def add(self, name: str, value, *, shard: int | None = None) -> str:
        """Store ``value`` (array-like, ``bytes``/``str``, or anything with ``to_host()``) as ``name``.

        Returns the key it is stored under (``name`` itself unless the writer
        builds an object graph).
        """
        if self._done:
            if self._failed:
                raise RuntimeError(f"{self.prefix}: an earlier add() failed while writing; this writer cannot "
                                   "continue and nothing was written")
            raise ValueError(f"{self.prefix}: the checkpoint writer is already closed")
        NAMES.check(name)
        if self.object_graph and name == OBJECT_GRAPH_KEY:
            raise ValueError(f"{OBJECT_GRAPH_KEY} is built by the writer when object_graph=True; leave it out")
        key = self._key_for(name)
        key_bytes = key.encode("utf-8", "surrogateescape")
        if key_bytes in self._entries:
            raise ValueError(f"tensor {name!r} is added twice (as key {key!r})")
        if shard is None:
            shard = min(range(self.num_shards), key=lambda i: self._offsets[i])
        elif not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range for {self.num_shards} shards")
        arr = _as_array(name, value)
        try:
            tf_dtype = _dt.tf_dtype(arr.dtype)
        except TypeError as exc:
            raise TypeError(f"tensor {name!r}: {exc}") from None
        if tf_dtype == _dt.DT_STRING:
            payload, crc = _string_payload(name, arr)
            data = payload
        else:
            little = arr.dtype.newbyteorder("<")
            arr = np.asarray(arr, dtype=little, order="C")  # ascontiguousarray would make 0-d arrays 1-d
            data = arr.reshape(-1).view(np.uint8)
            crc = mask_crc(_crc32c.crc32c(data))
        f = self._files[shard]
        offset = self._offsets[shard]
        size = len(data)
        end = offset + size
        pad = (-end) % self.data_alignment
        try:
            f.write(data)
            if pad:
                f.write(bytes(pad))
        except BaseException as exc:
            # Part of the bytes may be in the file: every later offset would be wrong. Nothing is kept.
            self._failed = True
            self.abort(type(exc), exc, exc.__traceback__)
            if isinstance(exc, OSError):
                raise self._commit._naming(exc, os.path.basename(f.name)) from None
            raise
        self._offsets[shard] = end + pad
        self._entries[key_bytes] = encode_entry(tf_dtype, arr.shape, shard_id=shard, offset=offset, size=size,
                                                crc32c=crc)
        return key

    def _object_graph(self) -> bytes:
        nodes = [GraphNode(has_checkpoint_values=True)]
        index = {(): 0}
        for key, (path, attribute) in sorted(self._paths.items()):
            parent = 0
            for depth in range(1, len(path) + 1):
                sub = tuple(path[:depth])
                node = index.get(sub)
                if node is None:
                    node = len(nodes)
                    nodes.append(GraphNode(has_checkpoint_values=True))
                    index[sub] = node
                    nodes[parent].children.append((node, path[depth - 1]))
                parent = node
            nodes[parent].attributes.append((attribute, "/".join(path), key))
        return encode_object_graph(ObjectGraph(nodes))

    def close(self) -> None:
        """Finish: object graph (if asked), data files, then the index. Idempotent.

        Raises ``RuntimeError`` when an earlier :meth:`add` failed while writing (nothing was kept).
        """
        if self._failed:
            raise RuntimeError(f"{self.prefix}: an add() failed while writing; the checkpoint was not written")
        if self._done:
            return
        try:
            if self.object_graph:
                if SAVE_COUNTER_KEY not in self._paths:
                    self.add(SAVE_COUNTER_KEY, np.int64(self.save_counter), shard=0)
                graph = self._object_graph()
                self.object_graph = False  # the graph itself is a plain key
                self.add(OBJECT_GRAPH_KEY, graph, shard=0)
            # The index is built before any data file is renamed: a failure up to here keeps every
            # previous file at this prefix (data and index) as it was.
            index = io.BytesIO()
            builder = TableBuilder(index)
            builder.add(b"", encode_header(BundleHeader(num_shards=self.num_shards)))
            for key in sorted(self._entries):
                builder.add(key, self._entries[key])
            builder.finish()
        except BaseException as exc:
            self.abort(type(exc), exc, exc.__traceback__)
            raise
        try:
            for f in self._files:  # the commit fsyncs every staged file before it renames one
                f.close()
            write_file(self._commit.staging / os.path.basename(self.prefix + ".index"), index.getbuffer(),
                       fsync=False)
        except BaseException as exc:
            self.abort(type(exc), exc, exc.__traceback__)
            if isinstance(exc, OSError):
                raise self._commit._naming(exc) from None
            raise
        self._done = True
        self._commit.publish()

    def _discard(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):  # close() flushes, and fails again where a write did
                f.close()
        self._commit.discard()

    def abort(self, exc_type=None, exc=None, tb=None) -> None:
        """Discard everything written so far (the staging directory is removed; nothing is published)."""
        if self._done:
            return
        self._done = True
        self._discard()


def write_checkpoint(prefix, tensors, *, num_shards: int = 1, data_alignment: int = 1, object_graph: bool = False,
                     fsync: bool = True, overwrite: bool = False) -> None:
    """Write ``tensors`` (a mapping of name to array-like) as a TensorFlow checkpoint at ``prefix``.

    See :class:`CheckpointWriter` for the options. TensorFlow reads the result
    with ``tf.train.load_checkpoint(prefix)``; with ``object_graph=True`` also
    with ``tf.train.Checkpoint.restore``. An existing checkpoint at ``prefix``
    is replaced only with ``overwrite=True`` (docs/overwrite.md).

    >>> import numpy as np, tempfile, os
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
    >>> write_checkpoint(prefix, {"global_step": np.int64(7), "w": np.zeros((2, 2))}, num_shards=2)
    >>> sorted(os.listdir(os.path.dirname(prefix)))
    ['ckpt-1.data-00000-of-00002', 'ckpt-1.data-00001-of-00002', 'ckpt-1.index']
    """
    items = list(tensors.items() if hasattr(tensors, "items") else tensors)
    for name, _ in items:  # every name before the first file or directory is made
        NAMES.check(name)
    with CheckpointWriter(prefix, num_shards=num_shards, data_alignment=data_alignment,
                          object_graph=object_graph, fsync=fsync, overwrite=overwrite) as writer:
        for name, value in items:
            writer.add(name, value)


def _checkpoint_number(name: str, base: str):
    match = re.fullmatch(re.escape(base) + r"-([0-9]+)", name)
    return int(match.group(1)) if match else None


def save(directory, tensors, *, name: str = "ckpt", max_to_keep: int | None = None, object_graph: bool = False,
         num_shards: int = 1, data_alignment: int = 1, fsync: bool = True) -> str:
    """Write ``tensors`` as ``directory/<name>-N`` (N one more than the newest) and update ``checkpoint``.

    Returns the new prefix. ``max_to_keep`` deletes the oldest checkpoints
    listed in the state file beyond that many (None keeps all). With
    ``object_graph=True`` the stored ``save_counter`` is N, as TensorFlow's
    ``Checkpoint.save`` does. ``tf.train.latest_checkpoint(directory)`` then
    finds the new checkpoint.

    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.path.basename(save(d, {"w": np.zeros(2)})), os.path.basename(save(d, {"w": np.ones(2)}))
    ('ckpt-1', 'ckpt-2')
    >>> print(Path(d, "checkpoint").read_text(), end="")
    model_checkpoint_path: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-1"
    all_model_checkpoint_paths: "ckpt-2"
    """
    FILE_NAME.check(name, "checkpoint")  # the prefix's last part: never a path out of the directory
    items = list(tensors.items() if hasattr(tensors, "items") else tensors)
    for tensor_name, _ in items:  # every name before the directory is made
        NAMES.check(tensor_name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / "checkpoint"
    kept: list = []
    if state_path.is_file():
        _, kept = read_checkpoint_state(state_path)
    numbers = [n for n in (_checkpoint_number(os.path.basename(p), name) for p in kept) if n is not None]
    numbers += [n for n in (_checkpoint_number(p.name[: -len(".index")], name) for p in directory.glob("*.index"))
                if n is not None]
    number = max(numbers, default=0) + 1
    rel = f"{name}-{number}"
    prefix = str(directory / rel)
    with CheckpointWriter(prefix, num_shards=num_shards, data_alignment=data_alignment, object_graph=object_graph,
                          save_counter=number, fsync=fsync, overwrite=False) as writer:
        for tensor_name, value in items:
            writer.add(tensor_name, value)
    kept = [p for p in kept if p != rel] + [rel]
    removed = []
    if max_to_keep is not None and max_to_keep > 0 and len(kept) > max_to_keep:
        removed, kept = kept[:-max_to_keep], kept[-max_to_keep:]
    with atomic_write(state_path, fsync=fsync, overwrite=True) as f:
        f.write(encode_checkpoint_state(rel, kept).encode("utf-8"))
    for old in removed:  # after the state file no longer names them
        old_prefix = old if os.path.isabs(old) else str(directory / old)
        for path in [old_prefix + ".index", *Path(old_prefix).parent.glob(Path(old_prefix).name + ".data-*-of-*")]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return prefix
