"""RecIS's own checkpoint layout: reading what RecIS's serializer writes, and writing it (``Saver(layout="recis")``).

The layout below is read from RecIS's C++ serializer (``alibaba/RecIS``:
``csrc/serialize/name.cc``, ``save_bundle.cc``, ``table_writer.cc``,
``write_block.cc``, ``index_info.cc``, ``load_bundle.cc``, ``read_block.cc``,
``load_internal.cc``, ``csrc/embedding/slice_info.cc``). Where RecIS's
documentation says otherwise (dense entries ``"dense": false, "dimension":
4``), the code is followed.

RecIS checkpoint layout
=======================

A save by ``shard_num`` ranks (RecIS's shards), each with ``parallel`` writer
threads, is one directory of these files:

Tensor files ``model-%06d-of-%06d.safetensors``
    ``model-{shard_index * parallel + k:06d}-of-{parallel * shard_num:06d}``
    for writer ``k`` of rank ``shard_index``. A rank hands its blocks (below)
    to its writers round robin, the first block to writer 0; only writers
    given a block write a file. Bytes: an unsigned 64-bit little-endian header
    length ``L``, ``L`` bytes of header, then the blocks' bytes back to back
    in header order (no alignment). The header is compact JSON (no spaces, an
    object in block order) ``{key: {"dtype": D, "shape": [...],
    "data_offsets": [begin, end]}}`` (offsets from the end of the header, no
    ``__metadata__``), followed by ``8 - len % 8`` spaces (one to eight). ``D``
    is ``F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL`` (RecIS's reader knows no
    other; its writer writes a bool tensor as ``bool``, which its reader
    rejects, and cannot write unsigned types but ``U8``).

Blocks and their keys
    * a dense tensor ``NAME`` is written whole, by rank 0 only, under the key
      ``NAME^ `` (the name, ``^``, one space);
    * a hashtable ``T`` (a RecIS ``HashTable`` child) writes, on every rank,
      ``T.id/part_i_n`` (int64 ids, shape ``[k]``) then one block per slot in
      the order of its slot group (``WriteBlock::MakeHTWriteBlock``):
      ``T.embedding/part_i_n`` first (shape ``[k, *embedding_shape]``, row
      ``r`` for id ``r``), then the slots appended after it, each of its own
      dtype and shape ``Slot::FullShape(k)``: a filter hook's (RecIS's
      ``GlobalStepFilterHookImpl`` appends ``step_filter``, int64 ``[k, 1]``,
      when the table is made), then the optimizer's (Adam's
      ``sparse_adam_exp_avg`` and ``sparse_adam_exp_avg_sq``, shaped like the
      embedding); ``i``/``n`` are the rank and the rank count. The names ``@``
      and ``^`` are RecIS's separators: no name holds them. A dense name may
      hold ``/`` but not ``/part_``: ``TensorWriteBlock::WriteMeta`` then keys
      the block ``NAME`` while ``index`` names ``NAME^ ``.

``tensorkey.json``
    ``{T.X/part_i_n: "T@X^<slice>"}`` for every hashtable block (dense
    tensors have none): ``X`` is ``id`` or the slot, ``<slice>`` the key-space
    slice of the table that wrote it, ``begin@end@size`` with ``begin`` and
    ``end`` zero-padded to the digits of ``size`` (``00000@32768@65536``;
    ``size`` is the table's key space, 65536 unless the table was made with
    another ``gen_slice(..., slice_size)``).
    nlohmann's ``dump(4)``: keys sorted, four-space indent, no final newline.

``index``
    Compact JSON ``{"block_index": {key: file number}, "file_index": {file
    name: file number}}``, keys sorted; ``key`` is a dense ``NAME^ `` or a
    hashtable's ``T.X/part_i_n``. Each rank numbers its files in the order it
    first uses them (writer 0, 1, ...); rank 0 merges the ranks' numberings in
    rank order, each offset by the files numbered before it.

``torch_rank_weights_embs_table_multi_shard.json``
    ``dump(4)`` of ``{key: description}``, keys sorted. A dense ``NAME^ ``:
    ``{"dense": true, "dimension": 0, "dtype": "float32", "is_hashmap": false,
    "name": "NAME^ ", "shape": [...]}``. A key containing ``.embedding``:
    ``{"dense": false, "dimension": shape[-1], "dtype", "hashmap_key": the key
    with its first ``.embedding`` made ``.id``, "hashmap_key_dtype": "int64",
    "hashmap_value": the key, "is_hashmap": true, "name", "shape"}``. Every
    other key (ids, optimizer slots) keeps its header entry as written:
    ``{"data_offsets", "dense": false, "dtype": "I64", "shape"}``.

No commit record
    RecIS writes no manifest and no hashes: rank 0 merges the per-rank
    ``ckpt-%07d.index`` and ``{rank}tensorkey.json`` files (then deletes them)
    into ``index`` and ``tensorkey.json``. RecIS's loader reads ``index``
    (``"[dir/index] not found"`` without it), ``tensorkey.json`` and the files
    ``file_index`` names, nothing else.

Reading (RecIS's rules)
    A block key of ``index`` is mapped through ``tensorkey.json`` to
    ``TENSOR^SLICE`` (a dense key is one already); a tensor's parts are its
    slices, joined on the first axis in the order of their slice strings. A
    loader of rank ``j`` of ``M`` owns the key-space slice ``gen_slice(j, M,
    size)`` (``size // M`` keys each, the first ``size % M`` one more); it
    reads the parts whose slice has that size and overlaps its own, and keeps
    the ids whose ``uint64(id) % size`` falls in its slice; each slot block it
    reads must be ``FullShape(k)`` of the slot it fills, in its dtype
    (``HTSlotReadBlock``: "shape not match", "dtype not match"). fastckpt
    reads every slot whatever its shape and dtype, and keeps the order of the
    save (tables, slots, dense tensors) from the files' names and headers:
    block ``b`` of rank ``i`` is entry ``b // p`` of file ``i * p + b % p``.

fastckpt's additions (``Saver(layout="recis")``)
    The files above, byte for byte as RecIS's code writes them for the same
    blocks, and ``manifest.json`` written last as the commit record
    (``{"format": "fastckpt.sharded.recis", "format_version": 1, "layout":
    "recis", "world_size", "parallel", "slice_size" (an int, or {table:
    int} where tables differ), "files": {name: {"size",
    "blake3"}}, "tensors", "hashtables", "checksum": {"blake3"}}``: the
    checksum is of the manifest itself less ``checksum``, as in fastckpt's own
    layout, format version 3; RecIS never reads it). A directory with
    ``index`` and this manifest is verified against it: the manifest's
    checksum and the metadata files' hashes when it opens, each tensor file's
    hash when a block of it is first read. One without a manifest (written by
    RecIS) loads with the warning "RecIS checkpoint: no integrity record".

>>> data_file_name(3, 8), gen_slice(1, 3), slice_string(*gen_slice(1, 3))
('model-000003-of-000008.safetensors', (21846, 43691, 65536), '21846@43691@65536')
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import blake3
import numpy as np

from fastckpt.errors import ChecksumMismatchError, CheckpointNotFoundError, FastCkptWarning, FormatError, IntegrityError
from fastckpt.formats.reader import TensorFile, guard, held_guards
from fastckpt.sharded import kept
from fastckpt.sharded.format import WriteBlock, check_seal, commit_directory, dtype_of, owner_mod, rows_of
from fastckpt.sharded.format import SLICE_SIZE, slice_of, slice_positions
from fastckpt.sharded.format import slice_owner as format_slice_owner
from fastckpt.sharded.hashtable import check_holds, table_for
from fastckpt.store.commit import fsync_open
from fastckpt.sharded.reader import CheckpointReader, TensorFiles, register_layout, shared_reader
from fastckpt.store.manifest import expect, is_count, is_shape, parse_json
from fastckpt.store.snapshot import Snapshot
from fastckpt.store.names import FILE_NAME, NameRule

__all__ = ["RecisCheckpointReader", "RecisWarning", "is_recis_directory", "data_file_name", "gen_slice",
           "slice_string", "parse_slice", "slice_owner", "SLICE_SIZE", "FORMAT"]

INDEX_FILE = "index"
TENSORKEY_FILE = "tensorkey.json"
DESCRIPTION_FILE = "torch_rank_weights_embs_table_multi_shard.json"
MANIFEST_FILE = "manifest.json"
FORMAT = "fastckpt.sharded.recis"
FORMAT_VERSION = 1
LAYOUT = "RecIS"
# SLICE_SIZE (imported above) is RecIS's default key space (``gen_slice``'s ``slice_size``): one number with the
# slices of fastckpt's format version 4, which follow RecIS's rule.
DENSE_SUFFIX = "^ "
#: Tensor, table and slot names: RecIS splits its block names on '^' and its table tensors' names on '@', and
#: writes a dense tensor whose name holds '/part_' under a key its index does not name
#: (``TensorWriteBlock::WriteMeta``); any other '/' is kept (``tower/dense/kernel``).
NAMES = NameRule("RecIS's layout", reserved=(("@", "RecIS's layout reserves '@' and '^' as separators"),
                                             ("^", "RecIS's layout reserves '@' and '^' as separators"),
                                             ("/part_", "RecIS's suffix of a stored part")))
NO_INTEGRITY = "RecIS checkpoint: no integrity record"

# RecIS's DeserializeDtype: the header dtypes its reader knows.
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_CODES = {v: k for k, v in _DTYPES.items()}
# SaveBundle::InitTypeMap: the description file's dtype names.
_TYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "U64": "uint64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16", "I8": "int8",
               "U8": "uint8", "BOOL": "bool"}

_warned: set[str] = set()
_log = logging.getLogger(__name__)


class RecisWarning(FastCkptWarning):
    """A RecIS checkpoint read without a fastckpt manifest: nothing records what its bytes should be."""


def is_recis_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory in RecIS's layout (an ``index`` file; no fastckpt ``index.json``).

    >>> is_recis_directory("/nonexistent")
    False
    """
    try:
        d = os.fspath(path)
    except TypeError:
        return False
    return isinstance(d, str) and os.path.isfile(os.path.join(d, INDEX_FILE)) \
        and not os.path.isfile(os.path.join(d, "index.json"))


def data_file_name(number: int, total: int) -> str:
    """RecIS's name of tensor file ``number`` of ``total`` (``DataFileName``).

    >>> data_file_name(0, 2)
    'model-000000-of-000002.safetensors'
    """
    return f"model-{number:06d}-of-{total:06d}.safetensors"


def gen_slice(shard_index: int, shard_num: int, slice_size: int = SLICE_SIZE) -> tuple[int, int, int]:
    """``(begin, end, size)``: the key-space slice of rank ``shard_index`` of ``shard_num`` (RecIS's ``gen_slice``;
    the rule of fastckpt's format version 4 too: :func:`fastckpt.sharded.format.slice_of`).

    >>> [gen_slice(i, 3, 10)[:2] for i in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    return (*slice_of(shard_index, shard_num, slice_size), slice_size)


def slice_string(begin: int, end: int, size: int) -> str:
    """A slice as RecIS writes it in ``tensorkey.json`` (``SliceInfo::ToString``).

    >>> slice_string(0, 32768, 65536)
    '00000@32768@65536'
    """
    width = len(str(size))
    return f"{begin:0{width}d}@{end:0{width}d}@{size}"


def parse_slice(text: str, where: str) -> tuple[int, int, int]:
    """``(begin, end, size)`` of a slice string; a :class:`~fastckpt.errors.FormatError` naming ``where`` else.

    >>> parse_slice("00000@32768@65536", "x")
    (0, 32768, 65536)
    """
    parts = text.split("@")
    try:
        begin, end, size = (int(p) for p in parts)
    except ValueError:
        raise FormatError(f"{where}: slice {text!r} is not 'begin@end@size'") from None
    if not 0 <= begin < end <= size:
        raise FormatError(f"{where}: slice {text!r} needs 0 <= begin < end <= size")
    return begin, end, size


def _slice_positions(ids: np.ndarray, size: int) -> np.ndarray:
    """``uint64(id) % size``, as RecIS's ``MarkIdAcceptable`` computes it (:func:`fastckpt.sharded.format.slice_positions`)."""
    return slice_positions(ids, size)


def slice_owner(ids: np.ndarray, shard_num: int, slice_size: int = SLICE_SIZE) -> np.ndarray:
    """The rank that owns each id under RecIS's slice rule: ``uint64(id) % slice_size`` in ``gen_slice(rank, ...)``
    (:func:`fastckpt.sharded.format.slice_owner`, the default rule of fastckpt's format version 4).

    Pass it as a :class:`~fastckpt.sharded.Loader`'s ``owner`` so that the tables a rank loads can be saved in
    RecIS's layout by that rank. Given so for a directory in RecIS's layout, each table's own slice size is
    used (:func:`owners`), and every part is read: an id saved by a rank whose slice it is not in (which
    RecIS's own loader keeps only where one slice covers it) goes to the rank of its slice.

    >>> slice_owner(np.array([0, 21845, 21846, 65536 + 43691, -1]), 3).tolist()
    [0, 0, 1, 2, 2]
    """
    return format_slice_owner(ids, shard_num, slice_size)


def owners(rule, ids: np.ndarray, shard_num: int, slice_size) -> np.ndarray:
    """The rank of each of a RecIS table's ``ids`` under a Loader's owner ``rule``: :func:`slice_owner` by the
    table's own ``slice_size``, any other rule as it is (``rule(ids, shard_num)``).

    >>> owners(slice_owner, np.array([0, 600]), 2, 1000).tolist()
    [0, 1]
    """
    if rule is slice_owner:
        if not isinstance(slice_size, int):
            raise FormatError(f"the table was saved with slice sizes {slice_size}: slice_owner needs one")
        ranks = slice_owner(ids, shard_num, slice_size)
    else:
        ranks = np.asarray(rule(ids, shard_num))
    if ranks.shape != ids.shape:
        raise ValueError(f"the owner rule returned shape {ranks.shape} for {ids.shape} ids")
    return ranks


def _split_block_name(name: str, where: str, key: str) -> tuple[str, str]:
    """``(tensor, slice)`` of block name ``name`` (of ``key`` in ``where``), as RecIS's TensorNameFromBlockName
    splits it: StrSplit on '^' drops empty tokens and needs exactly two. The error's message is made only where
    the name fails (an index's every block is split when a reader opens).

    >>> _split_block_name("t@id^0@8@65536", "index", "t.id/part_0_1")
    ('t@id', '0@8@65536')
    """
    tokens = name.split("^")
    if len(tokens) != 2 or not tokens[0] or not tokens[1]:
        tokens = [t for t in tokens if t]
        if len(tokens) != 2:
            raise FormatError(f"{where} (key {key!r}): block {name!r} is not 'TENSOR^SLICE' (RecIS's block names)")
    return tokens[0], tokens[1]


def _read_json(snapshot: Snapshot, name: str, manifest: dict | None, missing: str | None = None) -> Any:
    """JSON file ``name`` read through the pinned directory (duplicate keys refused: RecIS's std::map keeps
    one); where ``manifest`` (fastckpt's, beside a ``layout="recis"`` save) lists it, its bytes are checked
    against the size and BLAKE3 recorded there first."""
    path = os.path.join(snapshot.path, name)
    raw = snapshot.read(name, missing=missing)
    entry = None if manifest is None else manifest["files"].get(name)
    if entry is not None:
        digest = blake3.blake3(raw).hexdigest()
        if (len(raw), digest) != (entry["size"], entry["blake3"]):
            raise ChecksumMismatchError(f"{path}: {len(raw)} bytes of BLAKE3 {digest[:16]}..., the manifest says "
                                        f"{entry['size']} bytes of {entry['blake3'][:16]}...: the file was changed "
                                        "or damaged after the commit")
    return parse_json(raw, path, unique_keys=True)


_PART_KEY = re.compile(r"(?P<tensor>.+)/part_(?P<i>\d+)_(?P<n>\d+)")


def _check_key(key: str, tensor: str, piece: tuple[int, int, int], where: str) -> int:
    """A hashtable block's key ``T.X/part_i_n`` against what tensorkey.json maps it to, ``T@X^SLICE``: the same
    table and slot, and the slice of rank ``i`` of ``n`` (RecIS's ``gen_slice``), as RecIS's writer names both.
    Returns ``n``, the number of ranks that saved it."""
    m = _PART_KEY.fullmatch(key)
    if m is None or m.group("tensor") != tensor.replace("@", ".", 1):
        raise FormatError(f"{where}: block {key!r} is mapped to {tensor!r}: a block T.X/part_i_n holds T@X (a "
                          "relabelled block)")
    i, n = int(m.group("i")), int(m.group("n"))
    if not (i < n and piece[:2] == slice_of(i, n, piece[2])):  # the message only where it fails: opening is hot
        raise FormatError(f"{where}: block {key!r} is mapped to slice {piece[0]}@{piece[1]}@{piece[2]}, rank {i} of "
                          f"{n}'s is {'@'.join(map(str, gen_slice(i, n, piece[2]))) if i < n else 'none'}")
    return n


def _data_file_numbers(name: str) -> tuple[int, int] | None:
    """``(number, total)`` of a file named as RecIS names its tensor files (``model-N-of-T.safetensors``, ASCII
    digits), else None.

    >>> _data_file_numbers("model-000003-of-000008.safetensors"), _data_file_numbers("index")
    ((3, 8), None)
    """
    if name.startswith("model-") and name.endswith(".safetensors"):
        number, of, total = name[6:-12].partition("-of-")
        if of and number.isdecimal() and total.isdecimal() and number.isascii() and total.isascii():
            return int(number), int(total)
    return None


def _described(key: str, desc: dict) -> tuple[np.dtype, tuple, tuple | None]:
    """``(dtype, shape, data_offsets or None)`` of block ``key`` as its description gives them (``data_offsets``
    a tuple of what the list holds: checked by the reader, :meth:`RecisCheckpointReader._read_descriptions`)."""
    offsets = desc.get("data_offsets")
    return dtype_of(_DTYPES.get(desc["dtype"], desc["dtype"]), key), tuple(desc["shape"]), \
        None if offsets is None else tuple(offsets) if isinstance(offsets, list) else (offsets,)


def _header_order(f: TensorFile) -> list[str]:
    """The keys of tensor file ``f``'s header in the order written (the order of its blocks: module docs)."""
    with f.mapped.guard(f"the header of {f.path}"):
        length = int.from_bytes(bytes(f.mapped.view(0, 8)), "little")
        return [k for k in json.loads(bytes(f.mapped.view(8, length)).decode("utf-8")) if k in f.infos]


class RecisTensorFiles(TensorFiles):
    """The tensor files of a directory in RecIS's layout, each opened the first time one of its blocks is used
    (:class:`~fastckpt.sharded.reader.TensorFiles`: pinned at the manifest's size where there is one, mapped,
    checked, kept), with RecIS's checks of its header: a safetensors-like file holding exactly the blocks
    ``index`` places in it (one it does not place there is an orphan block), each of the shape, dtype and
    ``data_offsets`` the description file gives it where there is one.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.sharded import Saver
    >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=2, layout="recis",
    ...             tensors={"a": np.ones(2, np.float32), "b": np.zeros(1, np.float32)}).save()
    >>> r = RecisCheckpointReader(out)
    >>> type(r.files).__name__, list(r.files.opened())
    ('RecisTensorFiles', [])
    >>> r.read_tensor("b").tolist(), list(r.files.opened())
    ([0.0], ['model-000001-of-000002.safetensors'])
    """

    def check(self, f: TensorFile, expected) -> None:
        """Raise a :class:`~fastckpt.errors.FormatError` naming file ``f`` and the block where its header
        disagrees with ``index`` (the blocks ``expected`` there) or the description file.

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, layout="recis",
        ...             tensors={"w": np.ones(2, np.float32)}).save()
        >>> r = RecisCheckpointReader(out); f = r.files["model-000000-of-000001.safetensors"]
        >>> r.files.check(f, ["w^ "])
        >>> r.files.check(f, [])
        Traceback (most recent call last):
        fastckpt.errors.FormatError: ...: holds block 'w^ ', which index does not place there (an orphan block: ...
        """
        if f.format != "safetensors":
            raise FormatError(f"{f.path}: a RecIS tensor file is safetensors-like, this one is {f.format}")
        missing = sorted(set(expected) - set(f.infos))
        if missing:
            raise FormatError(f"{f.path}: holds no tensors {missing[:4]}, which {INDEX_FILE} places there "
                              f"(it holds {sorted(f.infos)[:4]})")
        extra = sorted(set(f.infos) - set(expected))
        if extra:
            raise FormatError(f"{f.path}: holds block {extra[0]!r}, which {INDEX_FILE} does not place there (an "
                              f"orphan block: a damaged or hand-merged checkpoint; {len(extra)} in this file)")
        if not self._descriptions:
            return
        start = None
        for key in expected:
            info, desc = f.infos[key], self._descriptions[key]
            dtype, shape, offsets = _described(key, desc)
            if info.shape != shape or info.dtype != dtype:
                raise FormatError(f"{f.path}: block {key!r} is {info.dtype}{list(info.shape)} in the header, "
                                  f"{DESCRIPTION_FILE} says {desc['dtype']}{list(shape)}")
            if offsets is not None:
                if start is None:
                    start = 8 + int.from_bytes(bytes(f.mapped.read(0, 8, "header length")), "little")
                got = (info.offset - start, info.offset - start + info.nbytes)
                if got != offsets:
                    raise FormatError(f"{f.path}: block {key!r} lies at data_offsets {list(got)} in the header, "
                                      f"{DESCRIPTION_FILE} says {list(offsets)}")


class RecisCheckpointReader(CheckpointReader):
    """A directory in RecIS's layout (see the module docs), through :class:`CheckpointReader`'s interface.

    ``CheckpointReader(path)`` returns one where ``path`` holds an ``index``
    file. :meth:`tensor_names` lists RecIS's names (dense ``"w"``, hashtable
    tensors ``"T@id"``, ``"T@embedding"``, ``"T@SLOT"``); the same tensors may
    be named ``"T.id"``; ``read_tensor`` joins a tensor's slices as RecIS's
    reader does. ``keys()`` are the stored keys of the files (``"w^ "``,
    ``"T.id/part_0_2"``). With fastckpt's ``manifest.json`` beside (a
    ``layout="recis"`` save) each file is checked against its BLAKE3 the
    first time a block of it is read (``verify=True``, the default, as for
    every reader of a checkpoint with a manifest; :meth:`verify` checks all
    at once); without one a :class:`RecisWarning` says once per directory
    that there is no integrity record.

    Opening reads and checks the metadata files alone (and the header of a
    file where they leave the order of the save open: several dense tensors
    in one file). Each tensor file is opened the first time one of its
    blocks is used (:attr:`files`, a :class:`RecisTensorFiles`), its header
    checked first, so a rank maps only the files it reads; a file removed or
    replaced after the reader opened raises
    :class:`~fastckpt.errors.CheckpointChangedError` when first used.
    Checks that need every header (orphan blocks, ids stored twice) run in
    :meth:`verify` (and ``fastckpt verify``, ``inspect``).
    """

    format = "recis"  # what fastckpt.open and inspect call it (the manifest's "format" is FORMAT)
    layout = LAYOUT

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, backend: str = "mmap",
                 copy_on_write: bool = False, max_header_size: int | None = None):
        self.path = os.fspath(path)
        self._verified: set[str] = set()
        self._verify_lock = threading.Lock()
        self.unchecked: list[str] = []
        self.files: dict[str, TensorFile] = {}
        self._closed = False
        self._options = {"backend": backend, "copy_on_write": copy_on_write, "max_header_size": max_header_size}
        d = self.path
        try:
            # One commit: every file read or mapped through the pinned directory, each checked against its identity.
            self.snapshot = Snapshot(d, record=INDEX_FILE, what="RecIS checkpoint")
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"{d}: no RecIS checkpoint here (no '{INDEX_FILE}' file)") from None
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        self.metadata = None
        # With fastckpt's manifest beside (a layout="recis" save) each file is checked against it the first time a
        # block of it is read, as CheckpointReader does; RecIS itself writes none: nothing to check against.
        self._verify = bool(verify) and self.manifest is not None
        if self.manifest is None:
            self.unchecked.append(f"{NO_INTEGRITY}: no manifest.json, so no file's bytes can be checked")
            if d not in _warned:
                _warned.add(d)
                warnings.warn(f"{d}: {NO_INTEGRITY} (no manifest.json: loaded without checking its bytes)",
                              RecisWarning, stacklevel=2)

    def _open(self) -> None:
        """Read and cross-check the metadata (index, tensorkey.json, descriptions, the manifest where there is
        one): no block placed twice, every slice of a tensor once, every table's slots beside its ids (with the
        shapes and dtypes the descriptions give), no tensor file the index does not name. Each tensor file is
        pinned, mapped and its header checked against them the first time one of its blocks is used
        (:class:`RecisTensorFiles`), before a byte of it is used; without a description file (RecIS always
        writes one) the blocks' shapes are known from the headers alone, and every file is opened here."""
        d, snap = self.path, self.snapshot
        self.manifest = self._read_manifest()
        self.integrity = None if self.manifest is None else "manifest"
        try:
            index = _read_json(snap, INDEX_FILE, self.manifest)
        except (FileNotFoundError, IsADirectoryError):
            raise snap.absent(INDEX_FILE, f"{d}: no RecIS checkpoint here (no '{INDEX_FILE}' file)") from None
        tensorkey = _read_json(snap, TENSORKEY_FILE, self.manifest,
                               missing="RecIS's loader needs it (it maps the hashtable blocks to their slices)")
        twhere, iwhere = os.path.join(d, TENSORKEY_FILE), os.path.join(d, INDEX_FILE)
        expect(isinstance(tensorkey, dict) and all(isinstance(v, str) for v in tensorkey.values()), twhere,
               "expected a JSON object of strings")
        expect(isinstance(index, dict) and isinstance(index.get("block_index"), dict)
               and isinstance(index.get("file_index"), dict), iwhere,
               "expected {'block_index': {...}, 'file_index': {...}}")
        file_of_number: dict[int, str] = {}
        for name, number in index["file_index"].items():
            if not is_count(number) or number in file_of_number:  # (messages made only where a check fails)
                raise FormatError(f"{iwhere}: file_index[{name!r}] is {number!r}: file numbers are distinct "
                                  "non-negative integers")
            FILE_NAME.check(name, "file_index file", where=iwhere, error=FormatError)
            file_of_number[number] = name
        self._file_of_number = file_of_number
        orphans = sorted(set(tensorkey) - set(index["block_index"]))
        expect(not orphans, twhere, f"maps blocks {orphans[:4]} that {INDEX_FILE}'s block_index does not place in "
                                    "any file")
        self.tensorkey: Mapping[str, str] = MappingProxyType(dict(tensorkey))
        self._block_index: dict[str, int] = {}
        self._slices: dict[str, tuple[str, str]] = {}  # stored key -> (tensor, slice string)
        self._spans: dict[str, tuple[int, int, int]] = {}  # hashtable block -> its slice (begin, end, size)
        parts: dict[str, list[tuple[str, str]]] = {}
        seen: dict[tuple[str, str], str] = {}
        rank_counts: set[int] = set()  # the n of the blocks' part_i_n: the ranks that saved
        pieces: dict[str, tuple[int, int, int]] = {}  # slice string -> its slice: the blocks of a rank share one
        for key, number in index["block_index"].items():
            if not is_count(number) or number not in file_of_number:
                raise FormatError(f"{iwhere}: block_index[{key!r}] is {number!r}, not a file number of file_index")
            tensor, piece = _split_block_name(tensorkey.get(key, key), iwhere, key)
            if piece != " ":
                if key not in tensorkey:
                    raise FormatError(f"{iwhere}: block {key!r} names slice {piece!r} but {TENSORKEY_FILE} does "
                                      "not map it")
                span = pieces.get(piece)
                if span is None:
                    span = pieces[piece] = parse_slice(piece, f"{twhere} (key {key!r})")
                self._spans[key] = span
                rank_counts.add(_check_key(key, tensor, span, twhere))
            if (tensor, piece) in seen:
                raise FormatError(f"{iwhere}: blocks {seen[tensor, piece]!r} and {key!r} are both {tensor!r}'s "
                                  f"slice {piece!r}: a slice is stored once")
            seen[tensor, piece] = key
            self._block_index[key] = number
            self._slices[key] = (tensor, piece)
            parts.setdefault(tensor, []).append((piece, key))
        self._parts = {name: [k for _, k in sorted(p)] for name, p in sorted(parts.items())}
        self._aliases = {}
        for name in self._parts:  # "T@id" is also "T.id", as fastckpt's own layout names it
            if "@" in name:
                self._aliases.setdefault(name.replace("@", ".", 1), name)
        listed = None if self.manifest is None else self.manifest["files"]
        if listed is not None:
            unlisted = sorted(set(file_of_number.values()) - set(listed))
            if unlisted:
                raise IntegrityError(f"{d}: {unlisted[0]}: in {INDEX_FILE} but not in the manifest")
        self._rank_count = rank_counts.pop() if len(rank_counts) == 1 else 1
        named = set(file_of_number.values())
        orphans = [f"{os.path.join(d, n)}: a tensor file that {INDEX_FILE}'s file_index does not name"
                   for n in sorted(os.listdir(snap.fd)) if n not in named and _data_file_numbers(n) is not None]
        if orphans:
            raise FormatError(f"{orphans[0]} (an orphan block: a damaged or hand-merged checkpoint; "
                              f"{len(orphans)} in all)")
        self.descriptions: Mapping[str, dict] = MappingProxyType(self._read_descriptions())
        # Each file opened, pinned (the manifest's size) and its header checked on first use (TensorFiles).
        self._tensor_files(RecisTensorFiles)
        if not self.descriptions:  # no metadata of the blocks' shapes: every header is read now, as RecIS's loader does
            for name in self.files:
                self.files[name]
            self._blocks = {key: (info.dtype, tuple(info.shape), None) for key in self._block_index
                            for info in (self.part_infos[key],)}
        self._check_parts()
        self._tables = self._find_tables()
        if self.manifest is not None:
            self._check_manifest_counts()

    def _check_parts(self) -> None:
        """Each table's blocks: int64 ids of shape [k]; for every id slice one block of each slot with k rows;
        the slices of one tensor never overlapping."""
        iwhere = os.path.join(self.path, INDEX_FILE)
        int64 = np.dtype(np.int64)
        for name, keys in self._parts.items():  # (each message made only where its check fails)
            if self._slices[keys[0]][1] == " ":
                if len(keys) != 1:
                    raise FormatError(f"{iwhere}: dense tensor {name!r} is stored in {len(keys)} blocks {keys[:4]}")
                continue
            by_size: dict[int, list] = {}
            for k in keys:
                span = self._spans[k]
                by_size.setdefault(span[2], []).append((*span, k))
            for size, group in by_size.items():  # the ranks' slices tile the key space: each position once
                group.sort()
                at = 0
                for begin, end, _, key in group:
                    if begin != at:
                        raise FormatError(
                            f"{iwhere}: tensor {name!r}: block {key!r} holds slice [{begin}, {end}) of {size}, after "
                            f"slices up to {at}: " + ("overlapping slices (a duplicated block)" if begin < at else
                                                      "a slice of the key space is missing (a block was removed)"))
                    at = end
                if at != size:
                    raise FormatError(f"{iwhere}: tensor {name!r}: its slices end at {at} of {size}: the last slice is "
                                      "missing (a block was removed)")
            table, _, slot = name.rpartition("@")
            if slot == "id":
                for k in keys:
                    dtype, shape, _ = self._blocks[k]
                    if dtype != int64 or len(shape) != 1:
                        raise FormatError(f"{iwhere}: block {k!r} holds {table!r}'s ids but is {dtype}{list(shape)}; "
                                          "ids are int64 of shape [k]")
            elif f"{table}@id" in self._parts:
                ids = {self._slices[k][1]: k for k in self._parts[f"{table}@id"]}
                mine = {self._slices[k][1]: k for k in keys}
                if ids.keys() != mine.keys():
                    raise FormatError(f"{iwhere}: hashtable {table!r}: slot {slot!r} has slices {sorted(mine)[:3]}, "
                                      f"its ids {sorted(ids)[:3]}: each id block needs one block of every slot")
                for piece, k in mine.items():
                    rows, want = self._blocks[k][1], self._blocks[ids[piece]][1][:1]  # ([k],) of ids checked 1-d
                    if not rows or (rows[0],) != want:
                        raise FormatError(f"{iwhere}: hashtable {table!r}: block {k!r} has shape {list(rows)}, its "
                                          f"ids {ids[piece]!r} {want[0] if want else list(want)}: a slot holds one "
                                          "row per id")

    def _read_manifest(self) -> dict | None:
        path = os.path.join(self.path, MANIFEST_FILE)
        try:
            raw = self.snapshot.read(MANIFEST_FILE)
        except FileNotFoundError:
            return None
        manifest = parse_json(raw, path, unique_keys=True)
        expect(isinstance(manifest, dict) and manifest.get("format") == FORMAT, path,
               f"'format' is {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected "
               f"{FORMAT!r} beside a RecIS '{INDEX_FILE}'")
        version = manifest.get("format_version")
        expect(is_count(version, 1) and version <= FORMAT_VERSION, path,
               f"format version {version!r}; this fastckpt reads {FORMAT_VERSION}")
        check_seal(manifest, path, raw)  # the manifest's own checksum; its entries then cover every other file
        files = manifest.get("files")
        expect(isinstance(files, dict) and all(
            FILE_NAME.problem(n) is None and isinstance(e, dict) and is_count(e.get("size")) and isinstance(e.get("blake3"), str)
            for n, e in files.items()), path, "'files' must be {name: {'size': int >= 0, 'blake3': str}}")
        for key in ("tensors", "hashtables"):
            expect(isinstance(manifest.get(key, {}), dict), path, f"{key!r} must be an object")
        for name, entry in manifest.get("hashtables", {}).items():  # (messages made only where a check fails)
            if not isinstance(entry, dict) or not is_count(entry.get("ids")):
                raise FormatError(f"{path}: hashtables[{name!r}] must hold 'ids' (an integer >= 0), got {entry!r}")
        for name, entry in manifest.get("tensors", {}).items():
            if not (isinstance(entry, dict) and is_shape(entry.get("shape")) and isinstance(entry.get("dtype"), str)):
                raise FormatError(f"{path}: tensors[{name!r}] must be {{'dtype': str, 'shape': [int >= 0, ...]}}, "
                                  f"got {entry!r}")
        return manifest

    def _check_manifest_counts(self) -> None:
        """The manifest's tables, id counts and dense tensors against the blocks of the index."""
        where = os.path.join(self.path, MANIFEST_FILE)
        listed, tables = self.manifest.get("hashtables", {}), self._tables
        expect(set(listed) == set(tables), where, f"'hashtables' names {sorted(listed)[:4]}, the blocks of "
                                                  f"{INDEX_FILE} hold the tables {sorted(tables)[:4]}")
        for name, entry in listed.items():
            expect(entry["ids"] == tables[name]["ids"], where,
                   f"hashtables[{name!r}] says {entry['ids']} ids, its id blocks hold {tables[name]['ids']}")
        dense = self.dense_tensors()
        expect(self.manifest.get("tensors", {}) == dense, where,
               f"'tensors' does not describe the dense blocks of {INDEX_FILE} "
               f"({sorted(set(self.manifest.get('tensors', {})) ^ set(dense))[:4] or 'shapes or dtypes differ'})")
        metadata = {INDEX_FILE, TENSORKEY_FILE} | ({DESCRIPTION_FILE} if self.descriptions else set())
        extra = sorted(set(self.manifest["files"]) - set(self._file_of_number.values()) - metadata)
        expect(not extra, where, f"lists files {extra[:4]} that {INDEX_FILE} does not name")

    def _read_descriptions(self) -> dict:
        """The description file where present (RecIS's loader never reads it): one entry per block of ``index``,
        each with a shape, a dtype RecIS's reader knows and, where given, ``data_offsets`` as long as the
        block. Each tensor file's header is checked against it when the file is opened (:class:`RecisTensorFiles`)."""
        path = os.path.join(self.path, DESCRIPTION_FILE)
        try:
            descriptions = _read_json(self.snapshot, DESCRIPTION_FILE, self.manifest)
        except FileNotFoundError:
            if self.manifest is not None and DESCRIPTION_FILE in self.manifest["files"]:
                raise self.snapshot.missing(DESCRIPTION_FILE, "the manifest lists it") from None
            return {}
        expect(isinstance(descriptions, dict), path, "expected a JSON object")
        differ = sorted(set(descriptions) ^ set(self._block_index))
        expect(not differ, path, f"describes other blocks than {INDEX_FILE} places: {differ[:4]}")
        blocks = {}
        for key, desc in descriptions.items():  # (each message made only where its check fails)
            if not isinstance(desc, dict) or not is_shape(desc.get("shape")):
                raise FormatError(f"{path}: entry {key!r} must be an object with a 'shape' (list of integers >= 0), "
                                  f"got {desc!r}")
            named = desc.get("dtype")
            if not isinstance(named, str) or not (named in _DTYPES or named in _CODES):
                raise FormatError(f"{path}: entry {key!r} has dtype {named!r}, not one RecIS's reader knows "
                                  f"({sorted(_CODES)})")
            dtype, shape, offsets = blocks[key] = _described(key, desc)
            if offsets is not None:
                nbytes = math.prod(shape) * dtype.itemsize
                if not (len(offsets) == 2 and all(is_count(o) for o in offsets) and offsets[1] - offsets[0] == nbytes):
                    raise FormatError(f"{path}: entry {key!r} has data_offsets {desc['data_offsets']!r}: [begin, "
                                      f"begin + {nbytes}] for its {list(shape)} {dtype}")
        self._blocks = blocks
        return descriptions

    def _block_order(self) -> dict[str, tuple[int, int]]:
        """``{stored key: (rank, place)}``: the order in which each rank made its blocks (module docs: block
        ``b`` of rank ``i`` is entry ``b // p`` of the header of file ``i * p + b % p``), so that tables, slots
        and dense tensors keep the order of the save. It is read from the metadata where they settle it
        (:meth:`_rank_order`: the files' names, ``index``, the blocks' sizes and the ``data_offsets`` of the
        description file); a file's header is read (the file opened) only where they leave its order open. A
        tensor comes where the lowest rank holding it placed it, so the ranks after the first are replayed only
        for tensors it does not hold (none, in what RecIS writes: every rank writes every table). Files not named
        as RecIS names them come after, in file number and header order."""
        n = self._rank_count
        order: dict[str, tuple[int, int]] = {}
        groups: dict[tuple[int, int], dict[int, str]] = {}
        for number, name in sorted(self._file_of_number.items()):
            numbers = _data_file_numbers(name)
            total = numbers[1] if numbers else 0
            p = self.manifest["parallel"] if self.manifest is not None else total // n or 1
            if numbers is None or total % p:
                order.update({k: (1 << 62, number * 1_000_000 + j)
                              for j, k in enumerate(_header_order(self.files[name]))})
                continue
            rank, writer = divmod(numbers[0], p)
            groups.setdefault((rank, p), {})[writer] = name
        placed: set[str] = set()
        for (rank, p), files in sorted(groups.items()):
            tensors = {self._slices[k][0] for name in files.values() for k in self._keys_of.get(name, ())}
            if tensors <= placed:  # each of them comes where a lower rank placed it: this rank's order is not needed
                continue
            placed |= tensors
            places = self._rank_order(files, p)
            if places is None:  # not as RecIS's writer places blocks: each file's header order, as written
                places = {k: j * p + writer for writer, name in files.items()
                          for j, k in enumerate(_header_order(self.files[name]))}
            order.update({k: (rank, place) for k, place in places.items()})
        return order

    def _rank_order(self, files: dict[int, str], p: int) -> dict[str, int] | None:
        """``{stored key: place}`` of one rank's blocks (its files by writer, ``p`` writers), replaying RecIS's
        writer: each table's ids, embedding and slots, then the dense tensors, handed to the writers round
        robin, each file's blocks back to back. The next block of a file is the one candidate whose
        ``data_offsets`` (where described) start where the file's blocks so far end; where several remain (dense
        tensors, which have none; empty blocks) that file's header is read. None where the blocks do not follow
        the rule."""
        left = {w: set(self._keys_of.get(name, ())) for w, name in files.items()}
        tables: dict[str, dict[str, str]] = {}
        dense: set[str] = set()
        for keys in left.values():
            for key in keys:
                tensor, piece = self._slices[key]
                if piece == " ":
                    dense.add(key)
                else:
                    table, _, slot = tensor.partition("@")
                    tables.setdefault(table, {})[slot] = key
        ends, counts = dict.fromkeys(files, 0), dict.fromkeys(files, 0)
        headers: dict[int, list[str]] = {}
        places: dict[str, int] = {}
        # (writer, first data offset, None where undescribed) -> its blocks: the ones that can come next in a file
        # are looked up, not found by a scan of every table's (which made the replay quadratic in the tables)
        starts: dict[tuple[int, int | None], list[str]] = {}
        for w, keys in left.items():
            for key in keys:
                offsets = self._blocks[key][2]
                starts.setdefault((w, None if offsets is None else offsets[0]), []).append(key)

        def fits(key: str, w: int) -> bool:
            offsets = self._blocks[key][2]
            return key in left.get(w, ()) and (offsets is None or offsets[0] == ends[w])

        def fitting(w: int, wanted) -> list[str]:
            """The blocks that fit next in writer ``w``'s file (:func:`fits`) and ``wanted(key)`` accepts."""
            if w not in files:
                return []
            here = left[w]
            return [k for at in (ends[w], None) for k in starts.get((w, at), ()) if k in here and wanted(k)]

        def pick(w: int, candidates: list[str]) -> str | None:
            if len(candidates) == 1:
                return candidates[0]
            if not candidates or w not in files:
                return None
            if w not in headers:
                headers[w] = _header_order(self.files[files[w]])
            done = counts[w]
            return headers[w][done] if done < len(headers[w]) and headers[w][done] in candidates else None

        def place(key: str) -> None:
            w = len(places) % p
            places[key] = len(places)
            left[w].discard(key)
            dtype, shape, _ = self._blocks[key]
            ends[w] += math.prod(shape) * dtype.itemsize
            counts[w] += 1

        while tables:
            w = len(places) % p
            key = pick(w, fitting(w, lambda k: tables.get(self._slices[k][0].partition("@")[0], {}).get("id") == k))
            if key is None:
                return None
            slots = tables.pop(self._slices[key][0].partition("@")[0])
            place(slots.pop("id"))
            if "embedding" not in slots or not fits(slots["embedding"], len(places) % p):
                return None
            place(slots.pop("embedding"))  # the first of RecIS's slot group
            while slots:
                w = len(places) % p
                key = pick(w, [k for k in slots.values() if fits(k, w)])
                if key is None:
                    return None
                slots.pop(self._slices[key][0].partition("@")[2])
                place(key)
        while dense:
            w = len(places) % p
            key = pick(w, fitting(w, dense.__contains__))
            if key is None:
                return None
            dense.discard(key)
            place(key)
        return places if not any(left.values()) else None

    def _find_tables(self) -> dict[str, dict]:
        """``{T: {"dim", "shape", "dtype", "slots", "slot_specs", "ids", "slice_size"}}`` for every ``T@id`` with a
        ``T@embedding``, in the order of the save; ``slots`` in the order RecIS wrote them (its slot group's)."""
        order = self._block_order()
        first_place = lambda tensor: min(order.get(k, (1 << 62, 0)) for k in self._parts[tensor])  # noqa: E731
        tables = {}
        in_order = sorted(self._parts, key=first_place)
        slots_of: dict[str, list[str]] = {}  # T -> the tensors T@SLOT (SLOT without '@') but ids and embedding
        for other in in_order:
            table, at, slot = other.rpartition("@")
            if at and slot not in ("id", "embedding"):
                slots_of.setdefault(table, []).append(other)
        for name in in_order:
            if not name.endswith("@id") or f"{name[:-3]}@embedding" not in self._parts:
                continue
            table = name[:-3]
            first = self._parts[f"{table}@embedding"][0]
            dtype, shape, _ = self._blocks[first]
            dim = math.prod(shape[1:]) if len(shape) >= 2 else 1
            specs = {}
            for other in slots_of.get(table, ()):
                slot_dtype, slot_shape, _ = self._blocks[self._parts[other][0]]
                specs[other[len(table) + 1:]] = {"shape": list(slot_shape[1:]) or [1], "dtype": slot_dtype.name}
            sizes = {self._spans[k][2] for k in self._parts[name]}
            tables[table] = {"dim": dim, "shape": list(shape[1:]) or [1], "dtype": np.dtype(dtype).name,
                             "slots": list(specs), "slot_specs": specs,
                             "ids": sum(self._blocks[k][1][0] for k in self._parts[name]),
                             "slice_size": sizes.pop() if len(sizes) == 1 else sorted(sizes)}
        self._dense_order = [n for n in in_order if self._slices[self._parts[n][0]][1] == " "]
        return tables

    # -- RecIS's API ----------------------------------------------------------------------------------
    def _whole_name(self, name: str) -> str:
        if isinstance(name, str) and name in self._aliases:
            return self._aliases[name]
        return super()._whole_name(name)  # the name itself, or an error naming the closest names

    def _shape(self, key: str) -> list:
        return list(self._blocks[key][1])

    def tensor_shape(self, name: str) -> tuple:
        """A whole tensor's shape (its slices' first axes added, as RecIS's ``TensorShape``) or one block's."""
        if name in self._block_index:
            return tuple(self._shape(name))
        keys = self._parts[self._whole_name(name)]
        shape = self._shape(keys[0])
        if shape:
            shape[0] = sum(self._blocks[k][1][0] for k in keys)
        return tuple(shape)

    def tensor_dtype(self, name: str) -> np.dtype:
        """The numpy dtype of a whole tensor or of one stored block."""
        key = name if name in self._block_index else self._parts[self._whole_name(name)][0]
        return self._blocks[key][0]

    def part_nbytes(self, key: str) -> int:
        """The bytes stored block ``key`` takes in its file, from the metadata (its file is not opened).

        >>> import numpy as np, tempfile, os
        >>> from fastckpt.sharded import Saver
        >>> out = Saver(path=os.path.join(tempfile.mkdtemp(), "c"), parallel=1, layout="recis",
        ...             tensors={"w": np.ones(3, np.float32)}).save()
        >>> r = RecisCheckpointReader(out); r.part_nbytes("w^ "), len(r.files.opened())
        (12, 0)
        """
        dtype, shape, _ = self._blocks[key]
        return math.prod(shape) * dtype.itemsize

    def array(self, key: str) -> np.ndarray:
        """Stored block ``key``: a zero-copy, read-only view of its mapped file."""
        return self.host(key)

    def read_tensor(self, name: str) -> np.ndarray:
        """A whole tensor (a new array: its slices joined on the first axis in slice order) or one stored block
        (a read-only view). An unknown name raises :class:`~fastckpt.errors.TensorNotFoundError`."""
        if name in self._block_index:
            return self.host(name)
        keys = self._parts[self._whole_name(name)]
        with self._guard(keys, f"tensor {name!r}"):  # the copy: a file truncated under it is a FormatError, not SIGBUS
            if len(keys) == 1:
                return np.array(self.host(keys[0]))
            return np.concatenate([self.host(k) for k in keys], axis=0)

    def slice_of(self, key: str) -> tuple[str, tuple[int, int, int] | None]:
        """``(tensor, (begin, end, size))`` of a hashtable block, ``(tensor, None)`` of a dense one."""
        return self._slices[key][0], self._spans.get(key)

    def hashtables(self) -> dict[str, dict]:
        """``{table: {"dim", "shape", "dtype", "slots", "slot_specs", "ids", "slice_size"}}``: the tables with ids
        and an embedding, in the order of the save. ``shape`` is an embedding row's (``dim`` its product),
        ``slots`` every other tensor of the table in RecIS's slot order (optimizer slots, filter slots such as
        the step filter's), ``slot_specs`` each slot's ``{"shape": row shape, "dtype"}``."""
        return {name: {**entry, "shape": list(entry["shape"]), "slots": list(entry["slots"]),
                       "slot_specs": {s: dict(spec) for s, spec in entry["slot_specs"].items()}}
                for name, entry in self._tables.items()}

    def dense_tensors(self) -> dict[str, dict]:
        """``{name: {"dtype", "shape"}}`` of the dense tensors (keys ``NAME^ ``), in the order of the save."""
        return {name: {"dtype": self._blocks[self._parts[name][0]][0].name,
                       "shape": list(self._blocks[self._parts[name][0]][1])} for name in self._dense_order}

    def verify(self, *, progress=False) -> list[str]:
        """Every problem with the files against fastckpt's manifest (sizes, BLAKE3), and every table's ids (each
        stored once over its id blocks); ``[]`` when all is well.

        A directory written by RecIS has no manifest: its bytes cannot be checked (:attr:`integrity` is None and
        a warning said so), but its ids are; its structure was checked when it opened."""
        if self.manifest is None:  # no hashes: every file is still opened and its header checked
            list(self.files.values())
        problems = [] if self.manifest is None else super().verify(progress=progress)
        with guard(self, "its ids to check them"):
            for name in self._parts:
                if name.endswith("@id") and self._slices[self._parts[name][0]][1] != " ":
                    problem = _id_problem(self, name[:-3], self._parts[name])
                    if problem:
                        problems.append(problem)
        return problems

    def __repr__(self) -> str:
        return (f"<fastckpt.sharded.RecisCheckpointReader {self.path!r} files={len(self.files)} "
                f"tensors={len(self._parts)}{' closed' if self._closed else ''}>")


# -- loading -----------------------------------------------------------------------------------------------

register_layout(is_recis_directory, RecisCheckpointReader)  # CheckpointReader(path) of such a directory


def load_info(loader, reader: RecisCheckpointReader) -> dict[str, Any]:
    """What ``loader`` would load from ``reader`` (before its ``filter_func``): the Loader's own structure."""
    tables, dense = reader.hashtables(), reader.dense_tensors()
    info: dict[str, Any] = {"tensors": {}, "hashtables": {}}
    for name in list(loader.tensors) or list(dense):
        if name not in dense:
            raise KeyError(loader._unknown(reader, "dense tensor", name, dense))
        shape = dense[name]["shape"]
        rows = (0, 0) if not shape else (0, shape[0]) if loader.dense == "replicated" else \
            rows_of(loader.shard_index, loader.shard_num, shape[0])
        info["tensors"][name] = {"dtype": dense[name]["dtype"], "shape": shape, "rows": list(rows)}
    for name in list(loader.hashtables) or list(tables):
        if name not in tables:
            raise KeyError(loader._unknown(reader, "hashtable", name, tables))
        info["hashtables"][name] = tables[name]
    return info


def load(loader) -> tuple[dict, dict]:
    """Run :meth:`fastckpt.sharded.Loader.load` on a directory in RecIS's layout.

    Hashtables follow RecIS's slice rule (module docs) unless the Loader was given another ``owner``; dense
    tensors as the Loader's ``dense`` says (every rank reads only its rows of the one whole block).
    """
    from fastckpt.progress import progress_from

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # One reader between the loads of this process that read the directory now (ranks run as threads): the
        # metadata read and checked, each file opened and hashed once between them. A reader opened before the
        # directory was replaced is not taken.
        path = loader.checkpoint_path
        reader = stack.enter_context(shared_reader(
            ("recis", os.path.realpath(path), bool(loader.verify)),
            lambda: RecisCheckpointReader(path, verify=loader.verify), lambda r: r.snapshot.changed() is None))
        info = loader.filter_func(load_info(loader, reader))
        tables = info.get("hashtables", {})
        rule = None if loader.owner in (None, owner_mod) else loader.owner
        parts = {name: _parts_to_read(loader, reader, name, entry, rule) for name, entry in tables.items()}
        # Every file this rank reads (and no other) opened and checked before a byte is placed, and guarded: a
        # file truncated meanwhile is a FormatError, not SIGBUS.
        dense_keys = [name + DENSE_SUFFIX for name in info.get("tensors", {})]
        table_keys = [_sibling(reader, key, name, slot) for name, entry in tables.items() for key in parts[name]
                      for slot in ("id", "embedding", *entry["slots"])]
        stack.enter_context(reader._guard([*dense_keys, *table_keys], "its blocks to load them"))
        stored = {name: reader.part_nbytes(name + DENSE_SUFFIX) for name in info.get("tensors", {})}
        stored.update({name: sum(reader.part_nbytes(k) for part in ("id", "embedding", *entry["slots"])
                                 for k in reader.part_names(f"{name}@{part}")) for name, entry in tables.items()})
        report = stack.enter_context(progress_from(loader.progress, sum(stored.values()),
                                                   f"load rank {loader.shard_index}"))
        for name, entry in info.get("tensors", {}).items():
            _fill_dense(loader, reader, name, entry["rows"])
            report.advance(stored[name], name)

        def fill(name: str, entry: dict) -> None:
            _fill_table(loader, reader, name, entry, rule, parts[name])
            report.advance(stored[name], name)

        scope = held_guards()  # the fills' threads copy under the guard above too
        with concurrent.futures.ThreadPoolExecutor(min(loader.parallel, max(1, len(tables)))) as pool:
            for future in [pool.submit(scope.run, fill, name, entry) for name, entry in tables.items()]:
                future.result()
    _log.info("loaded %s (RecIS layout, rank %d of %d): %d tensors, %d hashtables, %d stored bytes in %.3f s",
              loader.checkpoint_path, loader.shard_index, loader.shard_num, len(info.get("tensors", {})),
              len(tables), sum(stored.values()), time.perf_counter() - started)
    return loader.hashtables, loader.tensors


def _id_problem(reader: RecisCheckpointReader, table: str, keys: list[str]) -> str | None:
    """What is wrong with the ids of ``table``'s id blocks ``keys``: an id stored twice (in one block, or in two,
    where a load of every slice would take both); None when each id is stored once."""
    ids = [reader.host(key) for key in keys]
    values, counts = np.unique(np.concatenate(ids) if ids else np.empty(0, np.int64), return_counts=True)
    twice = np.flatnonzero(counts > 1)
    if not len(twice):
        return None
    dup = int(values[twice[0]])
    holders = [key for key, part in zip(keys, ids) if np.any(part == dup)]
    return (f"{reader.path}: hashtable {table!r}: {len(twice)} ids are stored more than once (id {dup} in "
            f"{holders[:3]}): a duplicated or orphan id block")


def _fill_dense(loader, reader: RecisCheckpointReader, name: str, rows: list) -> None:
    key = name + DENSE_SUFFIX
    view = reader.host(key)  # (its file's hash checked first where the reader verifies)
    if view.ndim == 0:
        out = np.array(view)
    else:  # this rank's rows read from the page cache (preadv), not copied through the mapping
        out = kept.empty((rows[1] - rows[0], *view.shape[1:]), view.dtype)
        if out.nbytes:
            reader.read_into(key, out, rows[0] * view[:1].nbytes)
    target = loader.tensors.get(name)
    if isinstance(target, np.ndarray) and target.shape == out.shape and target.dtype == out.dtype \
            and target.flags.writeable:
        target[...] = out
    else:
        loader.tensors[name] = out


def _parts_to_read(loader, reader: RecisCheckpointReader, name: str, entry: dict, rule) -> list[str]:
    """The id blocks of table ``name`` the Loader's rank reads: under RecIS's slice rule (``rule`` None) those
    whose slice meets its own (RecIS's loader reads no other), under another ``rule`` every one."""
    keys = reader.part_names(f"{name}@id")
    if rule is not None:
        return keys
    if not isinstance(entry["slice_size"], int):
        raise FormatError(f"{reader.path}: hashtable {name!r} was saved with slice sizes {entry['slice_size']}; "
                          "RecIS's loader takes only the parts of its own size: pass the Loader an owner rule")
    begin, end, _ = gen_slice(loader.shard_index, loader.shard_num, entry["slice_size"])
    return [key for key in keys if (piece := reader.slice_of(key)[1])[0] < end and begin < piece[1]]


def _fill_table(loader, reader: RecisCheckpointReader, name: str, entry: dict, rule, keys: list[str]) -> None:
    """This rank's rows of table ``name`` from its id blocks ``keys`` (:func:`_parts_to_read`): RecIS's slice
    rule (``rule`` None) or ``rule(ids, M)``."""
    table = loader.hashtables.get(name)
    if table is None:
        table = loader.hashtables[name] = table_for(entry, name)
    check_holds(table, entry, name, reader.path)
    j, m = loader.shard_index, loader.shard_num
    mine_slice = gen_slice(j, m, entry["slice_size"]) if rule is None else None
    picked: list[tuple[np.ndarray, str, np.ndarray]] = []
    for key in keys:
        ids = reader.host(key)
        if rule is None:
            begin, end, size = mine_slice
            pos = _slice_positions(ids, size)
            mine = np.flatnonzero((pos >= begin) & (pos < end))
        else:
            mine = np.flatnonzero(owners(rule, ids, m, entry["slice_size"]) == j)
        picked.append((ids, key, mine))
    total = sum(len(mine) for *_, mine in picked)
    # On memory a dropped load's arrays left where there is some (fastckpt.sharded.kept), as fastckpt's layout's
    # loads: no new page to fault and zero on the first write.
    ids_out = kept.empty(total, np.int64)
    values_out = kept.empty((total, *table.shape), table.dtype)
    slots_out = {slot: kept.empty((total, *shape), dtype) for slot, (shape, dtype) in table.slot_specs.items()}
    at = 0
    for ids, key, mine in picked:
        end = at + len(mine)
        whole = len(mine) == len(ids)  # every id of the block is this rank's (a load on the ranks that saved)
        if whole:
            ids_out[at:end] = ids
        else:
            np.take(ids, mine, out=ids_out[at:end])
        for slot, out in (("embedding", values_out), *slots_out.items()):
            block = _sibling(reader, key, name, slot)
            rows = reader.host(block)
            if rows.shape != (len(ids), *out.shape[1:]) or rows.dtype != out.dtype:  # RecIS's "shape not match"
                raise FormatError(f"{reader.path}: hashtable {name!r}: block {block!r} is {rows.dtype}"
                                  f"{list(rows.shape)}, expected {out.dtype}{[len(ids), *out.shape[1:]]} (one row of "
                                  f"{list(out.shape[1:])} for each of its {len(ids)} ids {key!r})")
            if whole and out[at:end].nbytes:  # read from the page cache (preadv), not through the mapping: no
                reader.read_into(block, out[at:end])           # page of it faulted
            else:
                np.take(rows, mine, axis=0, out=out[at:end])
        at = end
    try:
        table.adopt(ids_out, values_out, slots_out)
    except ValueError as exc:
        raise FormatError(f"{reader.path}: hashtable {name!r}: {str(exc).removeprefix('adopt: ')} across its id "
                          f"parts {reader.part_names(f'{name}@id')}") from None


def _sibling(reader: RecisCheckpointReader, id_key: str, table: str, slot: str) -> str:
    """The stored key of ``slot``'s block written with id block ``id_key`` (same rank, same slice)."""
    _, piece = reader._slices[id_key]
    for key in reader._parts.get(f"{table}@{slot}", ()):
        if reader._slices[key][1] == piece:
            return key
    raise FormatError(f"{reader.path}: hashtable {table!r}: no block of {table}@{slot} for the slice {piece!r} of "
                      f"its ids {id_key!r}")


# -- writing -----------------------------------------------------------------------------------------------

def slice_sizes(saver) -> dict[str, int]:
    """``{table: slice size}`` of a ``layout="recis"`` Saver: its ``slice_size`` (an int for every table, or
    ``{table: int}``; default :data:`SLICE_SIZE`).

    >>> from fastckpt.sharded import HashTable, Saver
    >>> slice_sizes(Saver(hashtables={"a": HashTable(1), "b": HashTable(1)}, layout="recis", slice_size={"a": 1000}))
    {'a': 1000, 'b': 65536}
    """
    given = getattr(saver, "slice_size", None)
    sizes = {name: SLICE_SIZE if given is None else given.get(name, SLICE_SIZE) if isinstance(given, Mapping)
             else given for name in saver.hashtables}
    for name, size in sizes.items():
        if type(size) is not int or not saver.shard_num <= size < 1 << 62:
            raise ValueError(f"hashtable {name!r}: slice_size must be an int from shard_num ({saver.shard_num}) up, "
                             f"got {size!r} (RecIS's gen_slice gives each rank slice_size // shard_num keys)")
    return sizes


def _code(array: np.ndarray, what: str) -> str:
    code = _CODES.get(array.dtype.name)
    if code is None or array.dtype.byteorder == ">":
        raise TypeError(f"{what} is {array.dtype}: RecIS's reader knows only little-endian "
                        f"{sorted(_CODES)}")
    return code


def blocks(saver) -> list:
    """A ``layout="recis"`` Saver's blocks, in RecIS's order: each table's ids and slots, then (rank 0) the
    dense tensors whole. A table holding ids outside the rank's slice raises (RecIS would drop them)."""
    from fastckpt.state import as_numpy

    i, n = saver.shard_index, saver.shard_num
    sizes = slice_sizes(saver)
    out = []
    for table_name, table in saver.hashtables.items():
        begin, end, size = gen_slice(i, n, sizes[table_name])
        piece = slice_string(begin, end, size)
        ids, values, slots = table.rows()
        pos = _slice_positions(ids, size)
        outside = np.flatnonzero((pos < begin) | (pos >= end))
        if len(outside):
            raise ValueError(
                f"hashtable {table_name!r}: {len(outside)} of rank {i}'s {len(ids)} ids lie outside its RecIS slice "
                f"[{begin}, {end}) of {size} (id {int(ids[outside[0]])} is at {int(pos[outside[0]])}); RecIS's loader "
                "would drop them. Give each rank the ids of its slice: Loader(..., owner=fastckpt.sharded.recis."
                f"slice_owner){'' if size == SLICE_SIZE else f' with slice_size={size}'}, or save with the default "
                "layout")
        for slot, array in (("id", ids), ("embedding", values), *slots.items()):
            key = f"{table_name}.{slot}/part_{i}_{n}"
            _code(array, f"hashtable {table_name!r} {slot}")
            out.append(WriteBlock(key, f"{table_name}@{slot}^{piece}", "slot" if slot not in ("id", "embedding")
                                  else slot, array, table_name, {"dense": False}))
    if i == 0:
        for name, value in saver.tensors:
            array = as_numpy(value)
            if array is None or array.dtype.hasobject:
                raise TypeError(f"tensors[{name!r}] is a {type(value).__name__}, not an array of numbers")
            _code(array, f"tensor {name!r}")
            out.append(WriteBlock(name + DENSE_SUFFIX, name, "dense", array, None, {"dense": True}))
    return out


def header_bytes(entries: list[tuple[str, str, list, int]]) -> bytes:
    """A tensor file's first bytes as RecIS's ``TableWriter::SaveMeta`` writes them, for ``(key, dtype code,
    shape, nbytes)`` in order: the length, the compact JSON, one to eight spaces (eight where it is a multiple of 8).

    >>> header_bytes([("w^ ", "F32", [1], 4)])
    b'@\\x00\\x00\\x00\\x00\\x00\\x00\\x00{"w^ ":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}        '
    """
    meta, offset = {}, 0
    for key, code, shape, nbytes in entries:
        meta[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (8 - len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_files(saver, staging: Path, blocks_: list) -> dict:
    """Write this rank's tensor files into ``staging`` (round robin over ``parallel`` writers, RecIS's bytes);
    returns the rank's report for :func:`commit`."""
    i, n, p = saver.shard_index, saver.shard_num, saver.parallel
    writers: list[list] = [[] for _ in range(p)]
    for k, block in enumerate(blocks_):
        writers[k % p].append(block)
    names = [data_file_name(i * p + k, p * n) for k in range(p)]

    from fastckpt.progress import progress_from

    total = sum(np.asarray(b.array).nbytes for b in blocks_)

    def write(k: int) -> tuple[str, dict, dict]:
        arrays = [np.asarray(b.array) for b in writers[k]]
        arrays = [a if a.flags.c_contiguous else a.copy(order="C") for a in arrays]  # 0-d stays 0-d
        codes = [_code(a, f"tensor {b.key!r}") for a, b in zip(arrays, writers[k])]
        head = header_bytes([(b.key, c, list(a.shape), a.nbytes) for b, c, a in zip(writers[k], codes, arrays)])
        hasher = blake3.blake3()
        entries, offset = {}, 0
        with open(staging / names[k], "wb") as f:
            f.write(head)
            hasher.update(head)
            for b, a in zip(writers[k], arrays):
                chunk = memoryview(a.reshape(-1).view(np.uint8))
                f.write(chunk)
                hasher.update(chunk)
                report.advance(a.nbytes, b.key)
            fsync_open(f)
        for b, c, a in zip(writers[k], codes, arrays):
            entries[b.key] = {"dtype": c, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes],
                              "dense": b.kind == "dense"}
            offset += a.nbytes
        return names[k], {"size": len(head) + offset, "blake3": hasher.hexdigest()}, entries

    used = [k for k in range(p) if writers[k]]
    with progress_from(saver.progress, total, f"save rank {i}") as report, \
            concurrent.futures.ThreadPoolExecutor(max(1, len(used)), thread_name_prefix="fastckpt-recis") as pool:
        written = list(pool.map(write, used))
    tables = {name: {"dim": t.dim, "dtype": np.dtype(t.dtype).name, "slots": list(t.slots), "ids": len(t)}
              for name, t in saver.hashtables.items() if any(b.table == name for b in blocks_)}
    sizes = slice_sizes(saver)
    tensors = {b.tensor: {"dtype": b.array.dtype.name, "shape": list(np.shape(b.array))}
               for b in blocks_ if b.kind == "dense"}
    return {"rank": i, "shard_num": n, "parallel": p,
            "files": {name: entry for name, entry, _ in written},
            "order": [name for name, _, _ in written],  # the order of first use: RecIS's file numbers
            "blocks": {key: name for name, _, entries in written for key in entries},
            "entries": {key: e for _, _, entries in written for key, e in entries.items()},
            "tensorkey": {b.key: b.tensor for b in blocks_ if b.kind != "dense"},
            "tables": tables, "tensors": tensors,
            "slice_size": {name: sizes[name] for name in tables}}


def describe(entries: Mapping[str, dict]) -> dict:
    """The description file's content from the tensor files' header entries (each with ``"dense"``), as
    RecIS's ``SaveBundle::MergeTorchRankJson`` builds it (module docs).

    >>> describe({"w^ ": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "dense": True}})["w^ "]
    {'dtype': 'float32', 'shape': [2], 'dense': True, 'name': 'w^ ', 'dimension': 0, 'is_hashmap': False}
    """
    out = {}
    for key, entry in entries.items():
        v = dict(entry)
        if v["dense"]:
            del v["data_offsets"]
            v.update(name=key, dtype=_TYPE_NAMES.get(v["dtype"]), dimension=0, is_hashmap=False)
        elif ".embedding" in key:
            del v["data_offsets"]
            v.update(name=key, dtype=_TYPE_NAMES.get(v["dtype"]), dimension=v["shape"][-1],
                     hashmap_key=key.replace(".embedding", ".id", 1), hashmap_key_dtype="int64",
                     hashmap_value=key, is_hashmap=True)
        out[key] = v
    return out


def recis_json(obj: Any, indent: int | None = None) -> bytes:
    """nlohmann's ``dump()`` (compact) or ``dump(4)`` of ``obj`` with sorted keys, UTF-8, no final newline.

    >>> recis_json({"b": 1, "a": [1]})
    b'{"a":[1],"b":1}'
    """
    if indent is None:
        return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode("utf-8")
    return json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False).encode("utf-8")


def _one_or_each(sizes: dict[str, int]) -> int | dict[str, int]:
    """The manifest's ``slice_size``: one int where every table has it (or there is none), else ``{table: int}``."""
    distinct = set(sizes.values())
    return distinct.pop() if len(distinct) == 1 else dict(sorted(sizes.items())) if distinct else SLICE_SIZE


def commit(saver, staging: Path, final: Path, reports: list[dict]) -> str:
    """Rank 0: ``index``, ``tensorkey.json``, the descriptions, then ``manifest.json`` last; rename into place.
    Returns the manifest's BLAKE3."""

    files, block_index, file_index, tensorkey, entries, tables, tensors, sizes = {}, {}, {}, {}, {}, {}, {}, {}
    for r in sorted(reports, key=lambda r: r["rank"]):
        if (r["shard_num"], r["parallel"]) != (saver.shard_num, saver.parallel):
            raise ValueError(f"rank {r['rank']} saved with shard_num {r['shard_num']} and parallel {r['parallel']}; "
                             f"rank 0 with {saver.shard_num} and {saver.parallel}")
        offset = len(file_index)  # IndexInfo::MergeFrom: each rank's numbers after those merged before it
        local = {name: offset + k for k, name in enumerate(r["order"])}
        file_index.update(local)
        block_index.update({key: local[name] for key, name in r["blocks"].items()})
        files.update(r["files"])
        tensorkey.update(r["tensorkey"])
        entries.update(r["entries"])
        tensors.update(r["tensors"])
        sizes.update(r.get("slice_size", {}))
        for name, t in r["tables"].items():
            entry = tables.setdefault(name, {**t, "ids": 0})
            if {k: v for k, v in entry.items() if k != "ids"} != {k: v for k, v in t.items() if k != "ids"}:
                raise ValueError(f"hashtable {name!r} differs between ranks (dim, dtype or slots)")
            entry["ids"] += t["ids"]
    metadata = [(INDEX_FILE, recis_json({"block_index": block_index, "file_index": file_index})),
                (TENSORKEY_FILE, recis_json(tensorkey, 4)), (DESCRIPTION_FILE, recis_json(describe(entries), 4))]
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "layout": "recis", "world_size": saver.shard_num,
                "parallel": saver.parallel, "slice_size": _one_or_each(sizes), "files": files, "tensors": tensors,
                "hashtables": tables}
    return commit_directory(staging, final, metadata, manifest, overwrite=saver.overwrite)
