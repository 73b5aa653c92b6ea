"""The sharded checkpoint directory: its byte-level specification, names, and reading its metadata.

A checkpoint saved by ``world_size`` ranks, each writing ``parallel`` files,
is one directory. Every JSON file below is UTF-8, ``json.dumps(obj, indent=1,
sort_keys=True, ensure_ascii=False)`` followed by one newline.

Sharded checkpoint format, versions 1 to 6
==========================================

Version 1 is the full checkpoint described first; version 2 adds delta
checkpoints and encoded tables (below); version 3 adds the manifest's own
checksum (``checksum``, below); version 4 stores each table part in
key-space slice order with its slice groups' row offsets recorded, and
records each table's partition (*Slice order*, below); version 5 records
each table's row shapes and each slot's dtype (*Row shapes*, below);
version 6 lets tensor, table and slot names hold ``'/'`` (*Names with '/'*,
below). A save writes the oldest version that holds it: version 6 where a
name holds ``'/'``, else version 5 where a table's embedding rows have more
than one axis or a slot has a row shape or dtype of its own, else version
4, full or delta, encoded or not (so that readers of versions up to 4 read
it). fastckpt 0.2.0 wrote version 1 for a full checkpoint and 2 for a delta
or an encoded one, fastckpt 0.3 version 3, fastckpt 0.4 and 0.5 version 4,
fastckpt 0.6 version 4 or 5; readers read all six.

Tensor files
    ``model-RRRRR-KKK.safetensors`` for rank ``R`` (0 <= R < world_size) and
    writer ``K`` (0 <= K < parallel), five and three decimal digits: exactly
    ``world_size * parallel`` files, every one present even when it holds no
    tensor. Each is an ordinary safetensors file (fastckpt's aligned writer,
    payloads on 4096-byte boundaries) whose ``__metadata__`` is
    ``{"fastckpt.format": "fastckpt.sharded"}``. Its tensors are named by
    *stored keys*:

    * a dense tensor ``NAME`` of R rows is split by rows over the ranks:
      rank ``i`` of ``n`` stores rows ``[i*R//n, (i+1)*R//n)`` as
      ``NAME/part_i_n`` (a 0-d tensor is stored whole by rank 0 as
      ``NAME/part_0_1``);
    * a hashtable ``T`` (ids -> rows of ``dim`` values, optimizer slots that
      follow their ids) stores rank ``i``'s rows as ``T.id/part_i_n`` (int64,
      shape ``[k]``, distinct, in the table's row order), ``T.embedding/part_i_n``
      (shape ``[k, dim]``, row ``r`` belongs to id ``r``) and one ``T.SLOT/part_i_n`` per slot
      (same shape and order as the embedding); in version 5 the embedding
      is ``[k, *shape]`` and each slot ``[k, *its shape]`` of its own dtype
      (*Row shapes*, below);
    * in a delta checkpoint, also ``T.deleted/part_i_n`` (int64, shape
      ``[d]``, ascending, distinct): the ids rank ``i`` deleted since the
      base (see below).

    Names (``NAME``, ``T``, ``SLOT``) MUST be non-empty and MUST NOT hold
    ``'/part_'`` or a control character (U+0000-U+001F, U+007F-U+009F,
    U+2028, U+2029); in versions 1 to 5 they MUST NOT hold ``'/'`` at all
    (version 6 allows it: *Names with '/'*, below). A save refuses them
    (:data:`NAMES`, :mod:`fastckpt.store.names`). A reader splits a stored
    key at its last ``/part_<i>_<n>``, which MUST end the key (a key of an
    older save whose name holds a newline reads whole).

``index.json``
    ``{"block_index": {stored key: file number}, "file_index": {file name:
    file number}}``; the file number of ``model-R-K`` is ``R * parallel + K``.
    Every stored key is in exactly one file.

``tensorkey.json``
    ``{stored key: original name}``: ``"w/part_0_2": "w"``, ``"T.id/part_1_2":
    "T.id"``.

``torch_rank_weights_embs_table_multi_shard.json``
    ``{stored key: description}``, each description holding ``name`` (the
    stored key), ``dense`` (true for a dense tensor's part, false for the
    tensors of a hashtable), ``dimension`` (values per row: the product of
    ``shape[1:]``, 1 for 0-d and 1-d tensors), ``dtype`` (numpy's name:
    ``"float32"``, ``"int64"``, ``"bfloat16"``), ``shape`` (of the stored
    part), ``is_hashmap``; for the tensors of a hashtable ``hashmap_key`` and
    ``hashmap_value`` (the stored keys of its id and embedding parts); and
    fastckpt's additions: ``tensor`` (the original name), ``part`` (``[i,
    n]``), for a dense part ``row_start`` and ``global_shape``, for a
    hashtable's tensors ``table`` and ``role`` (``"id"``, ``"embedding"``,
    ``"slot"`` with ``slot`` naming it, or in a delta ``"deleted"``).

``manifest.json`` (written last: its presence is the commit)
    ``{"format": "fastckpt.sharded", "format_version": 4, "world_size": n,
    "parallel": p, "files": {file name: {"size": bytes, "blake3": hex}},
    "tensors": {name: {"dtype", "shape"}}, "hashtables": {T: {"dim", "dtype",
    "slots", "ids", "partition", "shape", "slot_specs"}}, "checksum":
    {"blake3": hex}}`` (``partition``: version 4, *Slice order* below;
    ``shape`` and ``slot_specs``: version 5, *Row shapes* below). ``files`` lists every
    other file of the directory (the tensor files and the three JSON files
    above): ``world_size * parallel + 3`` entries. ``checksum`` (version 3)
    is the BLAKE3 of the bytes the manifest would have without it (the
    layout above applied to the manifest less ``checksum``); with ``files``
    recording every other file's size and hash, it covers the checkpoint's
    metadata and, through the hashes, every byte. A manifest of version 1 or
    2 has no ``checksum``.

Writing
    Every rank writes its files into one staging directory
    (``.NAME.@HOST~PIDNS.PID.HEX.partial`` beside the checkpoint, made by rank
    0: its host, pid namespace and pid, and a random part) and fsyncs them;
    rank 0 collects every rank's report (a timeout names the ranks that did
    not report), writes ``index.json``, ``tensorkey.json``, the description
    file and ``manifest.json`` last, fsyncs, renames the staging directory to
    the checkpoint's name and fsyncs the parent. Without ``overwrite=True`` the
    rename refuses an existing name in the same step
    (``renameat2(RENAME_NOREPLACE)``, or a placeholder claimed with ``mkdir``
    where that call is missing), so a checkpoint committed meanwhile by another
    writer is never replaced: that save raises ``FileExistsError`` on every
    rank. A directory without ``manifest.json`` is not a checkpoint; a staging
    directory left by a failed save is removed by rank 0 at once, or by a
    later save in the same parent once its process is gone (on this host; one
    of another host or pid namespace only after an hour without change:
    ``fastckpt.store.commit.STALE_AFTER``, docs/overwrite.md).

Reading
    Readers open the checkpoint's directory once and every file relative to
    it, so that all of them come from one commit: a tensor file that is not
    the one of that directory (the checkpoint replaced or removed meanwhile)
    or not of the size the manifest lists is an error saying the checkpoint
    changed while it was opened. Opening a reader reads and checks the
    metadata files (the first three points below); a tensor file is pinned,
    mapped and its header checked (the last point) the first time a part of
    it is used, so that a rank opens only the files holding parts it reads
    (a damaged file of another rank does not stop its load). Before any byte
    of a tensor is placed they check:

    * the manifest: format, version, its ``checksum`` (version 3), every
      value of the type given above, ``world_size * parallel + 3`` entries in
      ``files`` (so that absurd counts fail before any name is made), each
      named as a file of this checkpoint;
    * the three JSON files: size and BLAKE3 (32 bytes, 64 hex digits, of the
      whole file) against the manifest, then against each other;
    * the descriptions against the manifest: the parts ``part_0_n`` ..
      ``part_(n-1)_n`` of each dense tensor store its rows in rank order,
      each row exactly once, with its ``global_shape`` and ``dtype``; each
      table of ``hashtables``, and no other, has its id, embedding, slot (and
      in a delta deleted) tensors in every part: ``[k]`` int64 ids, ``[k,
      dim]`` rows of its dtype (version 5: the embedding ``[k, *shape]`` of
      its dtype, each slot ``[k, *its shape]`` of its dtype), ``[d]`` int64
      deleted ids, and the parts' counts add up to ``ids`` (in a delta to
      ``written`` and ``deleted``);
    * each tensor file's safetensors header against the descriptions (the
      keys the index places in it, their shapes and dtypes).

    Loads then check every tensor file they read against its BLAKE3 (unless
    asked not to); a reader of single tensors checks a file the first time
    it reads a part of it. In versions 1 and 2 nothing checks the manifest's
    own bytes: everything else is checked, and ``fastckpt verify`` says so.

Delta checkpoints (version 2)
    A delta holds what changed since another committed checkpoint, its
    *base* (full or itself a delta). The layout is that of a full checkpoint,
    and its ``manifest.json`` has a ``"format_version"`` of 2 or more and
    three more keys:
    ``"kind": "delta"`` (a manifest without ``kind`` is a full checkpoint),
    ``"base": {"path": P, "manifest_blake3": H}`` (``P`` the base directory
    relative to the delta's own directory, ``/``-separated, e.g.
    ``"../step-100"``; ``H`` the BLAKE3 of the base's ``manifest.json``
    bytes) and ``"chain_length"`` (1 on a full base, the base's plus 1 on a
    delta). Each ``hashtables`` entry adds ``"written"`` and ``"deleted"``
    (how many ids the delta stores in each way); its ``"ids"`` counts the ids
    the table holds after the delta.

    A table's ``T.id``, ``T.embedding`` and slot parts hold only the rows
    inserted or updated since the base (the whole row and every slot row),
    and ``T.deleted`` the ids deleted since the base and absent at the save.
    An id is in at most one rank's parts and never both written and deleted.
    Dense tensors are stored whole, as in a full checkpoint.

    The state at a delta is its base's state with, for each table of the
    delta's manifest, the deleted ids removed and then the written rows
    upserted; the state at a full checkpoint is its content. Readers follow
    ``base`` links to a full checkpoint and check each one: the directory
    exists, is a committed checkpoint, and its ``manifest.json`` hashes to
    ``manifest_blake3`` (otherwise the error names the link). Dense tensors
    come from the head of the chain alone. A delta is readable only with its
    whole chain: tools that remove checkpoints keep every base a kept
    checkpoint needs, and ``fastckpt compact`` folds a chain into one full
    checkpoint.

Slice order (version 4)
    Each entry of the manifest's ``hashtables`` adds ``"partition": {"rule":
    "slice", "slice_size": S}`` (``S`` = 65536, RecIS's key space, unless the
    save chose another, ``Saver(slice_size=)``, or a reshard kept a RecIS
    table's own; a reader takes any ``S`` from 64 to 2**32). An id's *position* is ``uint64(id) %
    S`` (a negative id as its two's complement). The rows of every plain
    (not encoded) table part (``T.id``, ``T.embedding``, each slot; full or
    delta) are in ascending position order, rows of equal position in the
    order of the saving table (a stable sort). The part is cut into ``G``
    *slice groups* (``G`` = ceil(k / 256), from 1 to 64, for a part of
    ``k`` rows; a reader takes 1 to min(S, 4096)): group ``g`` holds the
    rows whose position lies in ``[g*S//G, (g+1)*S//G)``. The description of
    the ``T.id`` part adds ``"slices": {"groups": G, "rows": [r_0, ...,
    r_G]}``: group ``g`` is rows ``[r_g, r_(g+1))``, so ``r_0 = 0``, ``r_G =
    k``, never decreasing. Its bytes in each tensor of the part are ``[r_g *
    row_bytes, r_(g+1) * row_bytes)`` from the tensor's first byte (the
    header's ``data_offsets``; ``row_bytes``: 8 for ids, the values of a row
    (``dim``; in version 5 the product of the tensor's row shape) x the
    tensor's itemsize for the embedding and each slot). A ``T.deleted`` part and an
    encoded part (rows in id order for the codec) have no ``slices``. Which
    rank saved an id does not matter to the layout: every part holds any ids.

    Loads: the default owner rule of a version-4 table is RecIS's slice rule:
    rank ``j`` of ``M`` owns the positions ``[b_j, e_j)`` of ``gen_slice(j,
    M, S)`` (``S // M`` positions each, the first ``S % M`` ranks one more:
    :func:`slice_of`). Its ids of a part are one run of rows. It reads the
    ids of the groups that meet its positions (at most one partial group at
    each end), finds the run, and reads exactly those rows of the embedding
    and of each slot. Every id it reads must lie in the group its row is
    recorded in, in ascending order (else a ``FormatError`` naming the file,
    the tensor, the row and its byte offset, before anything is placed). A
    load given another rule (``owner=``) reads every id part and picks rows as
    in versions 1-3, whose default rule stays ``id mod M``.

    Verification: the manifest's hashes stay those of whole files. A verified
    load (the default) hashes every file it reads a part of, whole, in the
    background, as in versions 1-3, so its ranged reads check against the
    manifest only what the whole files do; ``verify=False`` reads only the
    ranges. A URL loaded with ``verify=True`` is fetched whole.

Encoded tables (version 2)
    A save with compression or quantization (opt-in, never the default)
    stores each tensor of a hashtable (``T.id``, ``T.embedding``, slots,
    ``T.deleted``) as a 1-D ``uint8`` tensor whose description has
    ``"dtype": "uint8"``, ``"shape": [stored bytes]`` and ``"encoding":
    {"transform", "codec", "shuffle", "dtype", "shape", "payload_nbytes"}``
    (``dtype`` and ``shape`` those of the tensor it holds). The rows of each
    part are then in ascending id order. The *payload* (``payload_nbytes``
    bytes) is, by ``transform``:

    * ``"delta"`` (ids): the first id, then each id less the one before it,
      every value a little-endian uint64 (arithmetic modulo 2**64);
    * ``null`` (values): the rows' little-endian bytes;
    * ``"int8"`` / ``"int16"`` (values, lossy): ``n`` float32 scales, then
      ``n * dim`` int8 / int16 ``q``, all little-endian; row ``r`` holds
      ``float32(q[r]) * scale[r]`` cast to ``dtype``; ``scale[r] =
      max|x[r]| / 127`` (or ``/ 32767``) and ``q = round(x / scale)`` (0 for
      a row of zeros). In version 5 ``shape`` is ``[n, *row shape]`` and
      ``dim`` its row's values (one scale a row); a slot of its own integer
      or bool dtype is never quantized (``"transform": null``).

    With ``"shuffle": k > 1`` the payload's bytes are regrouped: byte ``j``
    of every ``k``-byte element, for ``j = 0 .. k-1``. ``"codec"`` is
    ``"zstd"`` (one Zstandard frame), ``"lz4"`` (one LZ4 frame) or ``null``
    (the payload as is). The manifest's table entry adds ``"encoding":
    {"compression", "quantize", "max_abs_error"}``: the largest absolute
    difference between any stored value and the value it restores to (0.0
    when lossless); a quantized checkpoint's manifest also has ``"lossy":
    true``, and readers load it only when asked to (it is for serving, not
    for resuming training).

Row shapes (version 5)
    Each entry of the manifest's ``hashtables`` adds ``"shape"``, the row
    shape of the embedding (1 to 32 integers >= 1 whose product is ``dim``:
    ``[2, 3]`` for a ``dim`` of 6), and ``"slot_specs"``, ``{slot: {"shape":
    row shape, "dtype": numpy's name}}`` for exactly the names of ``slots``
    (RecIS's step filter: ``{"shape": [1], "dtype": "int64"}``). Every entry
    of a version-5 manifest has both, a table of ``[dim]`` rows too. The
    embedding part of ``k`` rows is ``[k, *shape]`` of the table's
    ``dtype``, each slot part ``[k, *slot_specs[SLOT]["shape"]]`` of its
    ``dtype``; the description's ``dimension`` is the product of the row
    shape. A save writes version 5 only where some table needs it (a row
    shape other than ``[dim]``, or a slot whose row shape or dtype is not the
    embedding's); a manifest of version 4 or older has neither key (a reader
    refuses one that has them), and its rows are ``[dim]`` of the table's
    dtype. Readers check, before placing a byte: ``shape`` and
    ``slot_specs`` against ``dim`` and ``slots``, each description against
    them (the error names the description file, the entry, what it holds,
    what the manifest says and where), and each tensor file's header against
    the descriptions. A Loader builds a new table with these row shapes and
    dtypes and every slot; a table it is given must have the checkpoint's
    row shape and dtype, and each of its slots the checkpoint's shape and
    dtype for that slot (else a ``ValueError`` saying how to declare it).
    A reader of version 4 or older (fastckpt 0.5) refuses a version-5
    manifest before reading anything else: "format version 5 is newer than
    this fastckpt reads (4); upgrade fastckpt". ``fastckpt reshard``
    writes any version as the version a save of its tables writes. A
    version-6 manifest has ``shape`` and ``slot_specs`` as version 5 does.

Names with '/' (version 6)
    A version-6 checkpoint is laid out as one of version 5; only its names
    differ: a dense tensor, a table or a slot may be named with ``'/'``
    (RecIS's ``tower/dense/kernel``, a table ``tower/user``, a slot
    ``adam/m``), anywhere in the name, repeated or last (``a//b/``), but
    never followed by ``part_`` (``'/part_'`` is refused in every version,
    as RecIS's layout refuses it). Stored keys are formed as above:
    ``tower/dense/kernel/part_0_2``, ``tower/user.id/part_1_2``,
    ``tower/user.adam/m/part_1_2``. A reader takes the name as everything
    before the key's last ``/part_<i>_<n>`` (which ends the key), checks it
    against ``tensorkey.json`` and the description's ``tensor``, and takes a
    table's and a slot's names from the description's ``table`` and ``slot``
    (the tensor being ``TABLE.SLOT``), never by splitting at a ``'/'``. A
    save writes version 6 only where some name holds ``'/'``. A manifest of
    version 5 or older whose ``tensors``, ``hashtables`` or ``slots`` hold a
    name with ``'/'`` is refused (a ``FormatError`` naming the name and its
    position). A reader of version 5 or older (fastckpt 0.6) refuses a
    version-6 manifest before reading anything else: "format version 6 is
    newer than this fastckpt reads (5); upgrade fastckpt" (fastckpt 0.4 and
    0.5 say "(4)").

>>> part_key("w", 1, 4), rows_of(1, 4, 10), parse_part_key("T.id/part_2_3")
('w/part_1_4', (2, 5), ('T.id', 2, 3))
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from fastckpt._native.idindex import slice_order as radix_slice_order
from fastckpt._native.idindex import slice_run_check
from fastckpt.arrays import TakenRows
from fastckpt.errors import ChecksumMismatchError, FormatError
from fastckpt.sharded.workers import Lane
from fastckpt.store.commit import publish_directory, write_file
from fastckpt.store.manifest import expect, is_count, is_shape, parse_json
from fastckpt.store.snapshot import Snapshot
from fastckpt.store.names import NameRule

__all__ = [
    "FORMAT", "FORMAT_VERSION", "FULL_VERSION", "DELTA_VERSION", "CHECKSUM_VERSION", "INDEX_FILE", "TENSORKEY_FILE",
    "DESCRIPTION_FILE", "MANIFEST_FILE", "NAMES",
    "tensor_file_name", "part_key", "parse_part_key", "rows_of", "owner_mod", "WriteBlock", "write_synced", "dumps",
    "dtype_of", "manifest_checksum", "seal", "check_seal", "commit_directory",
    "read_metadata", "SLICE_VERSION", "SLICE_SIZE", "slice_positions", "slice_of", "slice_owner", "slice_groups", "group_bounds",
    "group_span", "group_rows", "slice_order", "slice_run", "SliceRowError", "ROWS_VERSION", "row_specs",
    "version_for", "NAMES_VERSION",
]

FORMAT = "fastckpt.sharded"
FORMAT_VERSION = 6  # the newest version read (a save writes the oldest version that holds it: version_for)
FULL_VERSION = 1  # the first version
DELTA_VERSION = 2  # the first version with deltas and encoded tables
CHECKSUM_VERSION = 3  # the first version whose manifest carries its own checksum
SLICE_VERSION = 4  # the first version whose table parts are grouped by key-space slice, their row ranges recorded
ROWS_VERSION = 5  # the first version whose tables record their row shape and each slot's shape and dtype
NAMES_VERSION = 6  # the first version whose tensor, table and slot names may hold '/' (``tower/dense/kernel``)
SLICE_SIZE = 65536  # the key space of a version-4 table's slices: RecIS's default, which recis.py imports
GROUP_ROWS = 256  # a version-4 save makes one slice group per this many rows of a part ...
MAX_GROUPS = 64  # ... and at most this many (the metadata of a part is bounded)
MAX_SLICE_SIZE = 2**32  # the largest slice size a reader accepts (positions fit uint32)
INDEX_FILE = "index.json"
TENSORKEY_FILE = "tensorkey.json"
DESCRIPTION_FILE = "torch_rank_weights_embs_table_multi_shard.json"
MANIFEST_FILE = "manifest.json"
ROLES = ("id", "embedding", "slot", "deleted")

#: The names this layout stores and reads back: a reader splits a stored key at its last ``/part_<i>_<n>``, so a
#: name may hold '/' (``tower/dense/kernel``, from format version 6 on: :func:`version_for`), but not '/part_', the
#: suffix itself, which RecIS's layout (:data:`fastckpt.sharded.recis.NAMES`) breaks on as well.
NAMES = NameRule("fastckpt's sharded layout", refusal="{format} does not store such a name",
                 reserved=(("/part_", ("the suffix of every stored part, '/part_<i>_<n>', which RecIS's layout "
                                       "breaks on")),))

# Matched with fullmatch only: '$' would also match before a final newline.
_PART = re.compile(r"(?P<name>.+)/part_(?P<i>[0-9]+)_(?P<n>[0-9]+)", re.DOTALL)
_FILE = re.compile(r"model-([0-9]{5})-([0-9]{3})\.safetensors")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def tensor_file_name(rank: int, writer: int) -> str:
    """The name of writer ``writer``'s file of rank ``rank``.

    >>> tensor_file_name(3, 1)
    'model-00003-001.safetensors'
    """
    return f"model-{rank:05d}-{writer:03d}.safetensors"


def part_key(name: str, i: int, n: int) -> str:
    """The stored key of part ``i`` of ``n`` of ``name``.

    >>> part_key("emb.id", 0, 2)
    'emb.id/part_0_2'
    """
    return f"{name}/part_{i}_{n}"


def parse_part_key(key: str) -> tuple[str, int, int] | None:
    """``(name, i, n)`` of a stored key, or None when ``key`` is not one.

    >>> parse_part_key("w/part_1_2"), parse_part_key("w")
    (('w', 1, 2), None)
    """
    m = _PART.fullmatch(key)
    return (m.group("name"), int(m.group("i")), int(m.group("n"))) if m else None


def rows_of(i: int, n: int, rows: int) -> tuple[int, int]:
    """``[start, end)``: the rows part ``i`` of ``n`` holds of a tensor of ``rows`` rows.

    >>> [rows_of(i, 3, 10) for i in range(3)]
    [(0, 3), (3, 6), (6, 10)]
    """
    return i * rows // n, (i + 1) * rows // n


def part_rows(row_start: int, shape, lo: int, hi: int) -> tuple[int, int] | None:
    """The rows of ``[lo, hi)`` of a dense tensor that its part (of ``shape``, from the tensor's row ``row_start``)
    holds, counted from the part's first row: ``(a, b)`` with ``a < b``; None where it holds none of them. A scalar
    part (``shape`` ``[]``) is held whole: ``(0, 1)``.

    >>> part_rows(8, [4, 2], 9, 20), part_rows(8, [4, 2], 0, 8), part_rows(0, [], 5, 6)
    ((1, 4), None, (0, 1))
    """
    if not shape:
        return 0, 1
    a, b = max(lo, row_start), min(hi, row_start + shape[0])
    return (a - row_start, b - row_start) if a < b else None


def owner_mod(ids: np.ndarray, shard_num: int) -> np.ndarray:
    """The default owner rule of a load (:class:`~fastckpt.sharded.loader.Loader`): ``id mod shard_num`` (numpy's ``%``: non-negative for negative ids).

    >>> owner_mod(np.array([-3, 0, 5]), 4).tolist()
    [1, 0, 1]
    """
    if shard_num & (shard_num - 1) == 0:  # a power of two: the low bits are the same values (two's complement),
        return np.bitwise_and(ids, shard_num - 1)  # about 15x faster than numpy's integer mod here
    return np.mod(ids, shard_num)


def slice_positions(ids: np.ndarray, size: int) -> np.ndarray:
    """Each id's position in the key space of ``size`` slices: ``uint64(id) % size`` (RecIS's ``MarkIdAcceptable``;
    a negative id counts as its two's complement).

    >>> slice_positions(np.array([0, 65537, -1]), 65536).tolist()
    [0, 1, 65535]
    """
    positions = np.asarray(ids, np.int64).view(np.uint64)
    if size & (size - 1) == 0:  # a power of two (65536): the low bits, several times faster than the mod
        return np.bitwise_and(positions, np.uint64(size - 1))
    return positions % np.uint64(size)


def slice_of(shard_index: int, shard_num: int, size: int = SLICE_SIZE) -> tuple[int, int]:
    """``[begin, end)``: the positions rank ``shard_index`` of ``shard_num`` owns in a version-4 checkpoint's key
    space of ``size`` (RecIS's ``gen_slice``: ``size // shard_num`` each, the first ``size % shard_num`` ranks one
    more).

    >>> [slice_of(j, 3, 10) for j in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(size, shard_num)
    begin = shard_index * base + min(shard_index, extra)
    return begin, begin + base + (1 if shard_index < extra else 0)


def slice_owner(ids: np.ndarray, shard_num: int, size: int = SLICE_SIZE) -> np.ndarray:
    """The rank of ``shard_num`` that owns each id by the slice rule (format version 4's default, RecIS's): the rank
    ``j`` whose :func:`slice_of` holds ``uint64(id) % size``.

    >>> slice_owner(np.array([0, 21845, 21846, 65536 + 43691, -1]), 3).tolist()
    [0, 0, 1, 2, 2]
    """
    ends = np.array([slice_of(r, shard_num, size)[1] for r in range(shard_num)], np.uint64)
    return np.searchsorted(ends, slice_positions(ids, size), side="right").astype(np.int64)


def slice_groups(rows: int) -> int:
    """How many slice groups a version-4 save makes of a table part of ``rows`` rows: one per :data:`GROUP_ROWS`
    rows, at least 1, at most :data:`MAX_GROUPS`.

    >>> slice_groups(0), slice_groups(700), slice_groups(10**6)
    (1, 3, 64)
    """
    return max(1, min(MAX_GROUPS, -(-rows // GROUP_ROWS)))


def group_bounds(groups: int, size: int) -> list[int]:
    """The first position of each of ``groups`` slice groups of a key space of ``size``, and ``size``: group ``g``
    holds the positions ``[g*size//groups, (g+1)*size//groups)``.

    >>> group_bounds(3, 10)
    [0, 3, 6, 10]
    """
    return [g * size // groups for g in range(groups + 1)]


def slice_order(ids: np.ndarray, size: int) -> tuple[np.ndarray | None, list[int]]:
    """``(order, rows)``: the stable order of a table part's rows by slice position (what a version-4 save writes),
    None where the rows are in that order already (a table loaded from a version-4 part, say), and the part's slice
    group row offsets (``slices.rows`` of its id description): ``rows[g]`` ids lie at positions below group ``g``'s
    first (:func:`slice_groups` groups of the part's rows, :func:`group_bounds`). One radix sort in C, without the
    GIL, and nothing in proportion to ``size`` (:func:`fastckpt._native.idindex.slice_order`).

    >>> order, rows = slice_order(np.array([65537, 3, 1, 65536]), 65536); order.tolist(), rows
    ([3, 0, 2, 1], [0, 4])
    >>> slice_order(np.array([65536, 1, 65539]), 65536)[0] is None
    True
    >>> slice_order(np.arange(700) * 97, 1000)[1]
    [0, 233, 467, 700]
    """
    ids = np.ascontiguousarray(ids, np.int64)
    bounds = np.array(group_bounds(slice_groups(len(ids)), size), np.int64)
    order, rows = radix_slice_order(ids, size, bounds)
    return order, rows.tolist()


def group_span(rows: list[int], size: int, begin: int, end: int) -> tuple[int, int]:
    """``(first, last)``: the groups (``rows``: a part's recorded group row offsets, ``len(groups) + 1`` of them)
    that hold positions of ``[begin, end)``, as the range ``[first, last)`` of group numbers; their rows are
    ``[rows[first], rows[last])``.

    >>> group_span([0, 4, 4, 9], 10, 4, 7), group_span([0, 4, 4, 9], 10, 0, 3)
    ((1, 3), (0, 1))
    """
    import bisect

    bounds = group_bounds(len(rows) - 1, size)
    first = bisect.bisect_right(bounds, begin) - 1
    last = bisect.bisect_left(bounds, end)
    return first, max(first, last)


def group_rows(rows: list[int], size: int, shard_index: int, shard_num: int) -> tuple[int, int]:
    """``(first, last)``: the rows of a version-4 part (``rows``: its recorded group offsets) in the slice groups
    that meet rank ``shard_index`` of ``shard_num``'s slice: what the rank reads of the part (nothing where they
    are equal).

    >>> group_rows([0, 4, 4, 9], 10, 1, 2)
    (4, 9)
    """
    first, last = group_span(rows, size, *slice_of(shard_index, shard_num, size))
    return rows[first], rows[last]


class SliceRowError(ValueError):
    """An id that is not where a version-4 part's slice offsets place it; ``row``: its row in the part."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


def slice_run(ids: np.ndarray, first_row: int, rows: list[int], size: int, own: tuple[int, int]) -> tuple[int, int]:
    """``(lo, hi)``: the rows of a version-4 id part whose positions lie in ``own`` (``[begin, end)``), given the
    ids ``ids`` of its rows from ``first_row`` on (the slice groups that meet ``own``, :func:`group_span`) and the
    part's recorded group offsets ``rows``.

    Each id must lie in the group its row is recorded in, in ascending slice order; otherwise
    :class:`SliceRowError` names the first row that does not (the offsets or the ids are damaged or forged).

    >>> slice_run(np.array([0, 1, 5, 9]), 0, [0, 2, 4], 10, (1, 6))
    (1, 3)
    """
    begin, end = own
    run = slice_run_check(np.ascontiguousarray(ids, np.int64), first_row, np.asarray(rows, np.int64), size, begin,
                          end)  # one pass in C without the GIL
    if run is not None:
        return run
    # Something is out of place: find the first row that is, row by row, to name it.
    positions = slice_positions(ids, size)
    bounds = np.array(group_bounds(len(rows) - 1, size), np.uint64)
    where = np.arange(first_row, first_row + len(ids))
    recorded = np.searchsorted(np.asarray(rows), where, side="right") - 1  # the group each row is recorded in
    actual = np.searchsorted(bounds, positions, side="right") - 1  # the group each id's position is in
    bad = np.flatnonzero((recorded != actual) | np.concatenate([[False], positions[1:] < positions[:-1]]))
    if len(bad):
        b, g = int(bad[0]), int(recorded[bad[0]])
        raise SliceRowError(first_row + b, f"id {int(ids[b])} is at slice position {int(positions[b])}, expected a "
                                           f"position in [{int(bounds[g])}, {int(bounds[g + 1])}) (slice group {g}, "
                                           f"rows {rows[g]}..{rows[g + 1]} by the recorded slices.rows), in "
                                           "ascending order")
    return (first_row + int(np.searchsorted(positions, np.uint64(begin))),
            first_row + int(np.searchsorted(positions, np.uint64(end))))


class WriteBlock:
    """One tensor a rank is about to write: its stored key, the original name, its kind and the array.

    ``kind`` is ``"dense"``, ``"id"``, ``"embedding"``, ``"slot"`` or (in a delta) ``"deleted"``; ``table``
    names the hashtable of the last four; ``description`` is the entry the description file will hold.

    ``array`` is the tensor as it will be stored. A hashtable's tensors are stored in another order than the
    table keeps its rows (key-space slice order, or in a delta the rows changed): such a block is made of the
    table's storage (``source``) and the rows to store, in order (``rows``), and its ``array`` is
    ``source[rows]``, gathered on first use (a copy, kept with the block). A save whose ``filter_func`` does not
    read ``array`` makes no such copy: each writer thread gathers the rows a piece at a time as it writes them
    (:meth:`payload`). ``shape``, ``dtype`` and ``nbytes`` need no copy. Without ``rows``, ``source`` is
    ``array``. A block cannot be changed.

    >>> block = WriteBlock("t.id/part_0_1", "t.id", "id", np.array([7, 5, 9]), "t", {}, rows=np.array([1, 0]))
    >>> block.shape, block.nbytes, block.array.tolist(), block.source.tolist()
    ((2,), 16, [5, 7], [7, 5, 9])
    """

    __slots__ = ("_array", "description", "key", "kind", "rows", "source", "table", "tensor")

    def __init__(self, key: str, tensor: str, kind: str, array: np.ndarray, table: str | None, description: dict,
                 rows: np.ndarray | None = None):
        for name, value in (("key", key), ("tensor", tensor), ("kind", kind), ("source", array), ("table", table),
                            ("description", description), ("rows", rows),
                            ("_array", array if rows is None else None)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: a WriteBlock cannot be changed")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}: a WriteBlock cannot be changed")

    def __repr__(self) -> str:
        taken = "" if self.rows is None else f", {len(self.rows)} of {len(self.source)} rows"
        return (f"WriteBlock(key={self.key!r}, tensor={self.tensor!r}, kind={self.kind!r}, table={self.table!r}, "
                f"{self.dtype}{list(self.shape)}{taken})")

    @property
    def array(self) -> np.ndarray:
        """The tensor as it will be stored (``source[rows]`` gathered on first use where the block has ``rows``)."""
        if self._array is None:
            object.__setattr__(self, "_array", np.take(self.source, self.rows, axis=0))
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.source)) if self.rows is None else (len(self.rows), *np.shape(self.source)[1:])

    @property
    def dtype(self) -> np.dtype:
        return np.asarray(self.source).dtype if self.rows is None else self.source.dtype

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return np.asarray(self.source).nbytes
        return int(np.prod(self.shape, dtype=np.int64)) * self.source.dtype.itemsize

    def payload(self) -> np.ndarray | TakenRows:
        """What a writer writes: ``array`` where it is at hand, else the rows still to gather
        (:class:`~fastckpt.arrays.TakenRows`, which ``save_safetensors`` gathers a piece at a time). The rows are
        not scanned first: a table's blocks share them (a slice order, a delta's changed rows, made by the saver),
        and the gather refuses any row outside the source as it takes it."""
        return self._array if self._array is not None else TakenRows(self.source, self.rows, checked=True)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to the new file ``path`` and fsync it (a file of a staging directory, renamed into place
    with the directory): :func:`fastckpt.store.commit.write_file`."""
    write_file(path, data)


def dumps(obj: Any) -> bytes:
    """The bytes of one of the directory's JSON files.

    >>> dumps({"b": 1, "a": [1]})
    b'{\\n "a": [\\n  1\\n ],\\n "b": 1\\n}\\n'
    """
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


# dtypes a description may name: numpy's numeric types and ml_dtypes' (names as numpy spells them)
_NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                 "float32", "float64", "complex64", "complex128")
_ML_DTYPES = ("bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
              "int2", "int4", "uint2", "uint4")
_dtypes: dict[str, np.dtype] = {}


def dtype_of(name: Any, where: str) -> np.dtype:
    """The numpy dtype a description's ``dtype`` names (numpy's or ml_dtypes' name); anything else is a FormatError.

    >>> dtype_of("bfloat16", "x").name, dtype_of("float32", "x").itemsize
    ('bfloat16', 4)
    >>> dtype_of("object", "d.json: entry 'w'")
    Traceback (most recent call last):
    fastckpt.errors.FormatError: d.json: entry 'w': unknown dtype 'object'
    """
    if not _dtypes:
        import ml_dtypes

        found = {n: np.dtype(n) for n in _NUMPY_DTYPES}
        found.update((n, np.dtype(getattr(ml_dtypes, n))) for n in _ML_DTYPES if hasattr(ml_dtypes, n))
        _dtypes.update(found)
    dtype = _dtypes.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise FormatError(f"{where}: unknown dtype {name!r}")
    return dtype


def row_specs(entry: dict) -> tuple[list[int], str, dict[str, tuple[list[int], str]]]:
    """``(row shape, dtype, {slot: (row shape, dtype)})`` of a manifest's ``hashtables`` entry: what one row of the
    embedding and of each slot is. Version 5 records them (``shape``, ``slot_specs``); in versions 1-4 every row
    is ``[dim]`` of the table's dtype.

    >>> row_specs({"dim": 2, "dtype": "float32", "slots": ["m"]})
    ([2], 'float32', {'m': ([2], 'float32')})
    >>> row_specs({"dim": 6, "dtype": "float32", "slots": ["step_filter"], "shape": [2, 3],
    ...            "slot_specs": {"step_filter": {"shape": [1], "dtype": "int64"}}})
    ([2, 3], 'float32', {'step_filter': ([1], 'int64')})
    """
    shape = list(entry.get("shape", [entry["dim"]]))
    specs = entry.get("slot_specs")
    slots = {s: (list(specs[s]["shape"]), specs[s]["dtype"]) if specs is not None else (shape, entry["dtype"])
             for s in entry["slots"]}
    return shape, entry["dtype"], slots


def version_for(tables: dict, tensors: Iterable[str] = ()) -> int:
    """The format version a save writes for its manifest's ``hashtables`` entries ``tables`` (each with ``shape``
    and ``slot_specs``) and its dense tensors' names ``tensors``: the oldest version that holds them, so that older
    readers read every checkpoint they can.

    * :data:`NAMES_VERSION` (6) where a dense tensor, a table or a slot is named with a '/' (``tower/dense/kernel``):
      readers of version 5 and older (fastckpt 0.6 and older) were never given such a name;
    * else :data:`ROWS_VERSION` (5) where an embedding row has more than one axis, or a slot a row shape or dtype of
      its own, which only a reader of version 5 can place;
    * else :data:`SLICE_VERSION` (4), which fastckpt 0.4 and up read: every row of every table, embedding and
      slots, is ``[dim]`` values of the table's dtype.

    >>> plain = {"dim": 2, "dtype": "float32", "shape": [2], "slot_specs": {"m": {"shape": [2], "dtype": "float32"}}}
    >>> version_for({"t": plain}), version_for({"t": {**plain, "dim": 6, "shape": [2, 3], "slot_specs": {}}})
    (4, 5)
    >>> version_for({"t": {**plain, "slot_specs": {"step_filter": {"shape": [1], "dtype": "int64"}}}})
    5
    >>> version_for({"t": plain}, ["tower/dense/kernel"]), version_for({"tower/t": plain}), version_for({"t": {
    ...     **plain, "slot_specs": {"adam/m": {"shape": [2], "dtype": "float32"}}}})
    (6, 6, 6)
    """
    if any("/" in name for name, _ in _names(tables, tensors)):
        return NAMES_VERSION
    plain = all(entry["shape"] == [entry["dim"]] and all(spec == {"shape": [entry["dim"]], "dtype": entry["dtype"]}
                                                         for spec in entry["slot_specs"].values())
                for entry in tables.values())
    return SLICE_VERSION if plain else ROWS_VERSION


def _names(tables: dict, tensors: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Every name a checkpoint stores, as ``(name, what)``: its dense tensors', its tables' and their slots'
    (``slot_specs`` where an entry has them, else ``slots``)."""
    for name in tensors:
        yield name, "tensor"
    for name, entry in tables.items():
        yield name, "hashtable"
        for slot in entry.get("slot_specs", entry.get("slots", ())):
            yield slot, f"hashtable {name!r} slot"


def manifest_checksum(manifest: dict) -> str:
    """The BLAKE3 (hex) a version-3 manifest records of itself: of :func:`dumps` of the manifest less ``checksum``.

    >>> m = seal({"format": FORMAT}); m["checksum"]["blake3"] == manifest_checksum(m)
    True
    """
    return blake3.blake3(dumps({k: v for k, v in manifest.items() if k != "checksum"})).hexdigest()


def seal(manifest: dict) -> dict:
    """``manifest`` with its ``checksum`` (:func:`manifest_checksum`) added: what a version-3 save writes.

    >>> sorted(seal({"format": FORMAT}))
    ['checksum', 'format']
    """
    return {**manifest, "checksum": {"blake3": manifest_checksum(manifest)}}


def check_seal(manifest: dict, where: str, raw: bytes | None = None) -> None:
    """Raise unless ``manifest`` carries a well-formed ``checksum`` that matches it (:func:`seal`): a
    :class:`~fastckpt.errors.FormatError`, or :class:`~fastckpt.errors.ChecksumMismatchError` naming ``where``.

    ``raw``: the bytes ``manifest`` was parsed from. Where they are :func:`dumps` of the sealed manifest (as every
    save writes it: the checksum its first key), the bytes the seal hashed are those bytes less the checksum's
    lines, hashed as they are; the manifest is serialized again (about 0.1 ms of CPU a manifest, more for large
    ones) only where they are not, or their hash differs. Both ways accept and refuse the same manifests: bytes
    whose hash is the recorded one are the bytes the save hashed, and they parse to ``manifest`` less its checksum.

    >>> check_seal(seal({"format": FORMAT}), "manifest.json")
    >>> check_seal(seal({"format": FORMAT}), "manifest.json", dumps(seal({"format": FORMAT})))
    >>> check_seal({**seal({"format": FORMAT}), "world_size": 2}, "manifest.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fastckpt.errors.ChecksumMismatchError: manifest.json: its contents hash to BLAKE3 ...
    """
    checksum = manifest.get("checksum")
    expect(isinstance(checksum, dict) and isinstance(checksum.get("blake3"), str)
            and _HEX64.fullmatch(checksum["blake3"]) is not None, where,
            f"'checksum' must be {{'blake3': 64 hex digits}}, got {checksum!r}")
    if raw is not None:
        head = b'{\n "checksum": {\n  "blake3": "' + checksum["blake3"].encode("ascii") + b'"\n },\n'
        if raw.startswith(head) and blake3.blake3(b"{\n" + raw[len(head):]).hexdigest() == checksum["blake3"]:
            return
    actual = manifest_checksum(manifest)
    if actual != checksum["blake3"]:
        raise ChecksumMismatchError(f"{where}: its contents hash to BLAKE3 {actual[:16]}..., its 'checksum' "
                                    f"says {checksum['blake3'][:16]}...: the manifest was edited or damaged after "
                                    "the commit")


def commit_directory(staging: Path, final: Path, metadata: list[tuple[str, bytes]], manifest: dict, *,
                     overwrite: bool) -> str:
    """Rank 0's commit of a checkpoint staged in ``staging``; returns the manifest's BLAKE3 (hex).

    Each metadata file ``(name, content)`` has its size and BLAKE3 added to ``manifest["files"]``; they and the
    manifest, sealed (:func:`seal`), are written and fsynced (side by side); then the staging directory is
    fsynced and renamed to ``final`` (a no-replace rename unless ``overwrite``: a checkpoint another writer
    committed meanwhile stays, and this raises ``FileExistsError`` naming it), and ``final``'s parent fsynced.
    """
    files = manifest["files"]

    def write(name: str, content: bytes) -> None:
        try:
            write_synced(staging / name, content)
        except OSError as e:  # the file of the checkpoint, never the staging directory
            raise type(e)(e.errno, e.strerror, os.fspath(final / name)) from None

    for name, content in metadata:
        files[name] = {"size": len(content), "blake3": blake3.blake3(content).hexdigest()}
    data = dumps(seal(manifest))  # the checksum covers the manifest, whose entries cover every other file
    # Nothing in the staging directory is read before it is published, so the files are written and fsynced at once,
    # a thread each: their fsyncs share the journal's commits, where one after another each waited for its own.
    # on threads kept between commits (fastckpt.sharded.workers), not four started for each
    with Lane("commit", len(metadata) + 1) as pool:
        for done in [pool.submit(write, name, content) for name, content in [*metadata, (MANIFEST_FILE, data)]]:
            done.result()
    # every rank fsynced its own files: the one commit syncs the directory, renames it and syncs the parent
    publish_directory(staging, final, overwrite=overwrite)
    return blake3.blake3(data).hexdigest()


def _rows(shape: list) -> int:
    return shape[0] if shape else 1


def _check_manifest(manifest: Any, where: str, raw: bytes | None = None) -> list[str]:
    """The checks of ``manifest.json`` on its own (:func:`read_metadata`; ``raw``: its bytes, :func:`check_seal`);
    returns what its version leaves unchecked."""
    expect(isinstance(manifest, dict), where, f"expected a JSON object, got {type(manifest).__name__}")
    expect(manifest.get("format") == FORMAT, where,
            f"'format' is {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    expect(is_count(version, 1), where, f"'format_version' must be a positive integer, got {version!r}")
    expect(version <= FORMAT_VERSION, where,
            f"format version {version} is newer than this fastckpt reads ({FORMAT_VERSION}); upgrade fastckpt")
    unchecked = []
    if version >= CHECKSUM_VERSION:
        check_seal(manifest, where, raw)
    else:
        unchecked.append(f"{MANIFEST_FILE}: format version {version} carries no checksum of its own (version "
                         f"{CHECKSUM_VERSION} does); its values were checked against the other files only")
    for key in ("world_size", "parallel"):
        expect(is_count(manifest.get(key), 1), where, f"{key!r} must be a positive integer, got {manifest.get(key)!r}")
    files = manifest.get("files")
    expect(isinstance(files, dict), where, "'files' must be an object")
    world_size, parallel = manifest["world_size"], manifest["parallel"]
    # Bounded by what the manifest lists before any name is made: a world_size of 10**12 fails here, at once.
    expect(world_size * parallel + 3 == len(files), where,
            f"world_size {world_size} x parallel {parallel} tensor files and the 3 metadata files make "
            f"{world_size * parallel + 3} files, 'files' lists {len(files)}")
    expected_files = set()
    for name, entry in files.items():
        m = _FILE.fullmatch(name)
        expect(name in (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE)
                or (m is not None and int(m.group(1)) < world_size and int(m.group(2)) < parallel), where,
                f"files[{name!r}]: not a file of a checkpoint of world_size {world_size} x parallel {parallel}")
        expect(isinstance(entry, dict) and is_count(entry.get("size")) and isinstance(entry.get("blake3"), str)
                and _HEX64.fullmatch(entry["blake3"]) is not None, where,
                f"files[{name!r}] must be {{'size': int >= 0, 'blake3': 64 hex digits}}, got {entry!r}")
        if m is not None:
            expected_files.add(name)
    for name in (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE):
        expect(name in files, where, f"lists no entry for {name}")
    kind = manifest.get("kind", "full")
    expect(kind in ("full", "delta"), where, f"'kind' must be 'delta' (or absent: a full checkpoint), got {kind!r}")
    if kind == "delta":
        base = manifest.get("base")
        expect(version >= DELTA_VERSION, where, f"a delta checkpoint needs format_version {DELTA_VERSION}, "
                                                 f"got {version}")
        expect(isinstance(base, dict) and isinstance(base.get("path"), str) and base["path"]
                and isinstance(base.get("manifest_blake3"), str), where,
                f"'base' must be {{'path': str, 'manifest_blake3': str}}, got {base!r}")
        expect(is_count(manifest.get("chain_length"), 1), where,
                f"'chain_length' must be a positive integer, got {manifest.get('chain_length')!r}")
    _check_manifest_entries(manifest, where, delta=kind == "delta", version=version)
    return unchecked


# Manifests whose every check passed in this process, by the BLAKE3 of their bytes: the checks are a function of
# those bytes and of the metadata files' bytes, which the manifest hashes and every reading compares, so a reading of
# the same bytes (another rank of a load run as threads, a chain resolved and then opened) parses them and skips the
# checks. Bounded: the oldest entry goes first.
_checked: dict[str, dict] = {}
_checked_lock = threading.Lock()
_CHECKED_MAX = 64


def read_metadata(directory: str | os.PathLike, *, snapshot: Snapshot | None = None,
                  manifest_only: bool = False) -> dict[str, Any]:
    """The checkpoint's four JSON files, parsed, checked against the manifest's hashes and against each other.

    Returns ``{"manifest", "manifest_blake3", "index", "tensorkey", "descriptions", "unchecked"}``
    (``manifest_blake3``: the BLAKE3 of ``manifest.json``'s bytes; ``unchecked``: what this version of the
    format gives no means to check). A directory without ``manifest.json`` raises
    :class:`~fastckpt.errors.CheckpointNotFoundError`; a metadata file whose bytes are not the ones the
    manifest records (or a version-3 manifest that fails its own checksum) an
    :class:`~fastckpt.errors.ChecksumMismatchError`; any malformed value or disagreement a
    :class:`~fastckpt.errors.FormatError` naming the file and the key; a checkpoint replaced while it is read a
    :class:`~fastckpt.errors.CheckpointChangedError`. ``snapshot``: the pinned directory
    (:class:`~fastckpt.store.snapshot.Snapshot`) to read through, so that every file comes from one commit
    (one is opened for the call without it).

    ``manifest_only=True`` is for a caller that wants the manifest alone and opens the checkpoint afterwards
    (:func:`~fastckpt.sharded.chain.resolve_chain` for a load, whose readers read and check all four files): where
    this process checked the same manifest bytes before, with the files they hash, only ``manifest.json`` is read
    (the result then holds ``manifest``, ``manifest_blake3`` and ``unchecked``); otherwise everything is read and
    checked, as without it.

    >>> read_metadata("/nonexistent")
    Traceback (most recent call last):
    fastckpt.errors.CheckpointNotFoundError: /nonexistent: no sharded checkpoint here (not a directory)
    """
    if snapshot is None:
        with Snapshot(directory, record=MANIFEST_FILE, what="sharded checkpoint") as snapshot:
            return read_metadata(directory, snapshot=snapshot, manifest_only=manifest_only)
    d = os.fspath(directory)
    where = os.path.join(d, MANIFEST_FILE)
    try:
        raw = snapshot.read(MANIFEST_FILE)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise snapshot.absent(MANIFEST_FILE, f"{d}: no sharded checkpoint here (no {MANIFEST_FILE}: a save that did "
                                             "not finish leaves none)") from None
    manifest_hash = blake3.blake3(raw).hexdigest()
    known = _checked.get(manifest_hash)  # these bytes were checked before, with the files they hash
    manifest = parse_json(raw, where)
    unchecked = list(known["unchecked"]) if known is not None else _check_manifest(manifest, where, raw)
    if manifest_only and known is not None:  # the other files are read and checked by whoever opens it next
        change = snapshot.changed()  # replaced while the manifest was read: said here, as the next file's read would
        if change is not None:
            raise snapshot.changed_error(MANIFEST_FILE, change)
        return {"manifest": manifest, "manifest_blake3": manifest_hash, "unchecked": unchecked}
    files = manifest["files"]
    loaded = {}
    for name in (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE):
        path, entry = os.path.join(d, name), files[name]
        # as many bytes as the file holds (bounded), never as many as the manifest says: its sizes size no buffer
        data = snapshot.read(name, missing=f"the checkpoint's {MANIFEST_FILE} lists it")
        if len(data) != entry["size"]:
            raise ChecksumMismatchError(f"{path}: {len(data)} bytes, the manifest says {entry['size']}: the file was "
                                        "changed after the commit (or the checkpoint changed while it was opened)")
        digest = blake3.blake3(data).hexdigest()
        if digest != entry["blake3"]:
            raise ChecksumMismatchError(f"{path}: BLAKE3 {digest[:16]}..., the manifest says "
                                        f"{entry['blake3'][:16]}...: the file was changed or damaged after the commit")
        loaded[name] = parse_json(data, path)

    if known is not None:  # the same bytes as a checked reading: parsed anew (the caller may change them), not checked
        index = loaded[INDEX_FILE]
        return {"manifest": manifest, "manifest_blake3": manifest_hash,
                "index": {"block_index": index["block_index"], "file_index": index["file_index"],
                          "files": dict(known["files"])},
                "tensorkey": loaded[TENSORKEY_FILE], "descriptions": loaded[DESCRIPTION_FILE], "unchecked": unchecked}
    parallel = manifest["parallel"]
    kind, version = manifest.get("kind", "full"), manifest["format_version"]
    expected_files = {name for name in files if _FILE.fullmatch(name) is not None}
    index = loaded[INDEX_FILE]
    iwhere = os.path.join(d, INDEX_FILE)
    expect(isinstance(index, dict) and set(index) == {"block_index", "file_index"}, iwhere,
            "expected exactly the keys 'block_index' and 'file_index'")
    file_index, block_index = index["file_index"], index["block_index"]
    expect(isinstance(file_index, dict) and isinstance(block_index, dict), iwhere, "both keys must hold objects")
    by_number = {}
    for name, number in file_index.items():
        m = _FILE.fullmatch(name)
        expect(name in expected_files and m is not None
                and number == int(m.group(1)) * parallel + int(m.group(2)) and type(number) is int, iwhere,
                f"file_index[{name!r}] is {number!r}: expected a tensor file of the manifest and its number "
                "(rank * parallel + writer)")
        by_number[number] = name
    expect(len(by_number) == len(expected_files), iwhere,
            f"file_index must number the {len(expected_files)} tensor files once each, it numbers {len(by_number)}")
    descriptions, tensorkey = loaded[DESCRIPTION_FILE], loaded[TENSORKEY_FILE]
    dwhere, twhere = os.path.join(d, DESCRIPTION_FILE), os.path.join(d, TENSORKEY_FILE)
    expect(isinstance(descriptions, dict), dwhere, "expected a JSON object")
    expect(isinstance(tensorkey, dict), twhere, "expected a JSON object")
    expect(set(block_index) == set(descriptions) == set(tensorkey), iwhere,
            f"block_index, {TENSORKEY_FILE} and {DESCRIPTION_FILE} must name the same stored keys "
            f"(differences: {sorted(set(block_index) ^ set(descriptions) ^ set(tensorkey))[:4]})")
    for key, number in block_index.items():
        expect(isinstance(tensorkey[key], str), twhere, f"[{key!r}] must be the tensor's name, got {tensorkey[key]!r}")
        expect(type(number) is int and number in by_number, iwhere,
                f"block_index[{key!r}] is {number!r}, not a file number of file_index")
        _check_description(key, descriptions[key], tensorkey[key], dwhere, version)
    _check_layout(manifest, descriptions, where, dwhere, delta=kind == "delta", version=version)
    with _checked_lock:
        while len(_checked) >= _CHECKED_MAX:
            _checked.pop(next(iter(_checked)))
        _checked[manifest_hash] = {"unchecked": tuple(unchecked), "files": tuple(by_number.items())}
    return {"manifest": manifest, "manifest_blake3": manifest_hash,
            "index": {"block_index": block_index, "file_index": file_index, "files": by_number},
            "tensorkey": tensorkey, "descriptions": descriptions, "unchecked": unchecked}


def _check_manifest_entries(manifest: dict, where: str, *, delta: bool, version: int) -> None:
    """The manifest's ``tensors`` and ``hashtables``: each value of the types the format gives it."""
    tensors, tables = manifest.get("tensors", {}), manifest.get("hashtables", {})
    expect(isinstance(tensors, dict), where, f"'tensors' must be an object, got {type(tensors).__name__}")
    expect(isinstance(tables, dict), where, f"'hashtables' must be an object, got {type(tables).__name__}")
    expect(type(manifest.get("lossy", False)) is bool, where, f"'lossy' must be true or false, got "
                                                                 f"{manifest.get('lossy')!r}")
    for name, entry in tensors.items():
        expect(isinstance(entry, dict) and is_shape(entry.get("shape")), where,
                f"tensors[{name!r}] must be {{'dtype': str, 'shape': [int >= 0, ...]}}, got {entry!r}")
        dtype_of(entry.get("dtype"), f"{where}: tensors[{name!r}]")
    for name, entry in tables.items():
        w = f"{where}: hashtables[{name!r}]"
        expect(isinstance(entry, dict), w, f"must be an object, got {entry!r}")
        expect(is_count(entry.get("dim"), 1), w, f"'dim' must be a positive integer, got {entry.get('dim')!r}")
        dtype_of(entry.get("dtype"), w)
        slots = entry.get("slots")
        expect(isinstance(slots, list) and all(isinstance(s, str) and s for s in slots)
                and len(set(slots)) == len(slots) and not {"id", "embedding", "deleted"} & set(slots), w,
                f"'slots' must be distinct names (not id, embedding or deleted), got {slots!r}")
        for key in ("ids", "written", "deleted") if delta else ("ids",):
            expect(is_count(entry.get(key)), w, f"{key!r} must be an integer >= 0, got {entry.get(key)!r}")
        if version >= ROWS_VERSION:
            _check_row_shapes(entry, w)
        else:
            expect("shape" not in entry and "slot_specs" not in entry, w,
                    f"'shape' and 'slot_specs' need format_version {ROWS_VERSION}, got {version}")
        partition = entry.get("partition")
        if version >= SLICE_VERSION:
            expect(isinstance(partition, dict) and set(partition) == {"rule", "slice_size"}
                    and partition["rule"] == "slice" and is_count(partition["slice_size"], MAX_GROUPS)
                    and partition["slice_size"] <= MAX_SLICE_SIZE, w,
                    f"'partition' must be {{'rule': 'slice', 'slice_size': int from {MAX_GROUPS} to "
                    f"{MAX_SLICE_SIZE}}} (format version {version}), got {partition!r}")
        else:
            expect(partition is None, w, f"'partition' needs format_version {SLICE_VERSION}, got {version}")
        encoding = entry.get("encoding")
        expect(encoding is None or (isinstance(encoding, dict) and type(encoding.get("max_abs_error", 0.0))
                                     in (int, float)), w, f"'encoding' must be an object with a number "
                                                          f"'max_abs_error', got {encoding!r}")
    if version < NAMES_VERSION:  # what a reader of that version was promised: no name holds '/'
        for name, what in _names(tables, tensors):
            expect("/" not in name, where, f"{what} name {name!r} holds '/' at position {name.find('/')}: names "
                                           f"holding '/' need format_version {NAMES_VERSION}, got {version}")


_MAX_ROW_AXES = 32  # a row shape's axes (numpy's limit is 64 for a whole array)


def _is_row_shape(shape: Any) -> bool:
    return isinstance(shape, list) and 1 <= len(shape) <= _MAX_ROW_AXES and all(is_count(d, 1) for d in shape)


def _check_row_shapes(entry: dict, w: str) -> None:
    """A version-5 table entry's ``shape`` (the embedding's row shape, whose product is ``dim``) and
    ``slot_specs`` (``{slot: {"shape", "dtype"}}`` for exactly its ``slots``)."""
    shape = entry.get("shape")
    expect(_is_row_shape(shape), w, f"'shape' must be the embedding's row shape, a list of 1 to {_MAX_ROW_AXES} "
                                    f"integers >= 1, got {shape!r}")
    expect(int(np.prod(shape, dtype=object)) == entry["dim"], w,
            f"'shape' {shape} holds {int(np.prod(shape, dtype=object))} values a row, 'dim' says {entry['dim']}")
    specs = entry.get("slot_specs")
    expect(isinstance(specs, dict) and set(specs) == set(entry["slots"]), w,
            f"'slot_specs' must be {{slot: {{'shape', 'dtype'}}}} for exactly the slots {entry['slots']}, got "
            f"{str(specs)[:200]}")
    for slot, spec in specs.items():
        expect(isinstance(spec, dict) and set(spec) == {"shape", "dtype"} and _is_row_shape(spec["shape"]), w,
                f"slot_specs[{slot!r}] must be {{'shape': [int >= 1, ...], 'dtype': str}}, got {spec!r}")
        dtype_of(spec["dtype"], f"{w}: slot_specs[{slot!r}]")


def _check_description(key: str, desc: Any, original: Any, dwhere: str, version: int) -> None:
    """One description entry: every field the loaders use, of its type."""
    w = f"{dwhere}: entry {key!r}"
    expect(isinstance(desc, dict), w, f"must be an object, got {type(desc).__name__}")
    expect(desc.get("name") == key, w, f"'name' must be the key itself, got {desc.get('name')!r}")
    expect(is_shape(desc.get("shape")), w, f"'shape' must be a list of integers >= 0, got {desc.get('shape')!r}")
    dtype_of(desc.get("dtype"), w)
    part = desc.get("part")
    expect(isinstance(part, list) and len(part) == 2 and is_count(part[0]) and is_count(part[1], 1)
            and part[0] < part[1], w, f"'part' must be [i, n] with 0 <= i < n, got {part!r}")
    expect(type(desc.get("dense")) is bool, w, f"'dense' must be true or false, got {desc.get('dense')!r}")
    parsed = parse_part_key(key)
    expect(parsed is not None and isinstance(original, str) and parsed[0] == original == desc.get("tensor")
            and [parsed[1], parsed[2]] == part, w,
            f"its name, 'tensor' ({desc.get('tensor')!r}), 'part' and {TENSORKEY_FILE} ({original!r}) disagree")
    if desc["dense"]:
        expect(is_count(desc.get("row_start")) and is_shape(desc.get("global_shape")), w,
                f"a dense part needs 'row_start' (int >= 0) and 'global_shape' (list of int >= 0), got "
                f"{desc.get('row_start')!r} and {desc.get('global_shape')!r}")
        expect("encoding" not in desc, w, "a dense part is never encoded")
        return
    role = desc.get("role")
    expect(role in ROLES and isinstance(desc.get("table"), str), w,
            f"a hashtable's tensor needs 'table' (str) and 'role' (one of {ROLES}), got {desc.get('table')!r} and "
            f"{role!r}")
    suffix = desc.get("slot") if role == "slot" else role
    expect(isinstance(suffix, str) and original == f"{desc['table']}.{suffix}", w,
            f"tensor {original!r} is not {desc['table']!r}'s {role} tensor (slot {desc.get('slot')!r})")
    if "encoding" in desc:
        enc = desc["encoding"]
        expect(version >= DELTA_VERSION, w, f"encoded tensors need format_version {DELTA_VERSION}, got {version}")
        expect(isinstance(enc, dict) and is_shape(enc.get("shape")) and desc["dtype"] == "uint8"
                and len(desc["shape"]) == 1 and is_count(enc.get("payload_nbytes")), w,
                f"an encoded tensor is stored as 1-D uint8 and its encoding names the shape, dtype and payload_nbytes "
                f"it holds, got dtype {desc['dtype']!r}, shape {desc['shape']}, encoding {enc!r}")
        dtype_of(enc.get("dtype"), f"{w}: encoding")


def _logical(desc: dict) -> tuple[list, str]:
    """The shape and dtype name of the tensor a stored part holds (an encoded part's decoded ones)."""
    enc = desc.get("encoding")
    return (enc["shape"], enc["dtype"]) if enc is not None else (desc["shape"], desc["dtype"])


def _check_layout(manifest: dict, descriptions: dict, where: str, dwhere: str, *, delta: bool, version: int) -> None:
    """The descriptions against the manifest: every dense row stored exactly once, in rank order, with the shape and
    dtype the manifest records; every hashtable's tensors present in every part, with matching row counts that
    add up to the manifest's counts."""
    dense: dict[str, dict[int, dict]] = {}
    tables: dict[str, dict[str, dict[int, dict]]] = {}
    for key, desc in descriptions.items():
        i, n = desc["part"]
        if desc["dense"]:
            group = dense.setdefault(desc["tensor"], {})
        else:
            group = tables.setdefault(desc["table"], {}).setdefault(desc["tensor"], {})
        expect(n == (next(iter(group.values()))["part"][1] if group else n) and i not in group, dwhere,
                f"entry {key!r}: tensor {desc['tensor']!r} has parts of different counts, or part {i} twice")
        group[i] = desc
    tensors = manifest.get("tensors", {})
    expect(set(dense) == set(tensors), where,
            f"'tensors' and the dense parts of {DESCRIPTION_FILE} name different tensors: "
            f"{sorted(set(dense) ^ set(tensors))[:4]}")
    for name, parts in dense.items():
        shape, dtype = tensors[name]["shape"], tensors[name]["dtype"]
        n = parts[min(parts)]["part"][1]
        expect(len(parts) == n, dwhere, f"tensor {name!r}: {len(parts)} of its {n} parts are described")
        row = 0
        for i in range(n):
            desc = parts[i]
            w = f"{dwhere}: entry {desc['name']!r}"
            expect(desc["global_shape"] == shape and desc["dtype"] == dtype, w,
                    f"global_shape {desc['global_shape']} {desc['dtype']}, the manifest says {shape} {dtype}")
            if not shape:
                expect(n == 1 and desc["shape"] == [] and desc["row_start"] == 0, w,
                        "a 0-d tensor is stored whole as part 0 of 1, shape [], row_start 0")
                continue
            expect(len(desc["shape"]) == len(shape) and desc["shape"][1:] == shape[1:] and desc["row_start"] == row,
                    w, f"rows [{desc['row_start']}, {desc['row_start'] + _rows(desc['shape'])}) of shape "
                       f"{desc['shape']}: expected rows from {row} (each row of {name!r} {shape} stored once, in "
                       "rank order)")
            row += desc["shape"][0]
        if shape:
            expect(row == shape[0], dwhere, f"tensor {name!r}: its parts hold {row} rows, its shape {shape} has "
                                             f"{shape[0]}")
    entries = manifest.get("hashtables", {})
    expect(set(tables) == set(entries), where,
            f"'hashtables' and {DESCRIPTION_FILE} name different tables: {sorted(set(tables) ^ set(entries))[:4]}")
    for name, by_tensor in tables.items():
        entry = entries[name]
        roles = ["id", "embedding", *entry["slots"], *(["deleted"] if delta else [])]
        expected = {f"{name}.{r}" for r in roles}
        expect(set(by_tensor) == expected, dwhere,
                f"hashtable {name!r} has the tensors {sorted(by_tensor)}, its manifest entry needs {sorted(expected)}")
        ids = by_tensor[f"{name}.id"]
        n = ids[min(ids)]["part"][1]
        counts = {"ids": 0, "deleted": 0}
        for tensor, parts in by_tensor.items():
            expect(len(parts) == n and parts[min(parts)]["part"][1] == n, dwhere,
                    f"hashtable {name!r}: {tensor!r} has {len(parts)} parts, {name}.id has {n}")
        shape, dtype, slot_rows = row_specs(entry)
        rows_of_role = {"embedding": (shape, dtype), **slot_rows}
        for i in range(n):
            k = _logical(ids[i])[0]
            expect(len(k) == 1 and _logical(ids[i])[1] == "int64", dwhere,
                    f"entry {ids[i]['name']!r}: ids are int64 of shape [k], got {_logical(ids[i])}")
            counts["ids"] += k[0]
            _check_slices(ids[i], k[0], entry, dwhere, version)
            for role in roles[1:]:
                desc = by_tensor[f"{name}.{role}"][i]
                got, got_dtype = _logical(desc)
                want = ([None], "int64") if role == "deleted" else \
                    ([k[0], *rows_of_role[role][0]], rows_of_role[role][1])
                what = "" if role == "deleted" or version < ROWS_VERSION else \
                    f"; {MANIFEST_FILE}: hashtables[{name!r}]." + ("shape" if role == "embedding" else
                                                                   f"slot_specs[{role!r}]")
                expect(len(got) == len(want[0]) and (role == "deleted" or got == want[0]) and got_dtype == want[1],
                        dwhere, f"entry {desc['name']!r}: {got_dtype}{got}, expected {want[1]}"
                                f"{['d'] if role == 'deleted' else want[0]} (table {name!r}, part {i} of {n}"
                                f"{what})")
                if role == "deleted":
                    counts["deleted"] += got[0]
        if delta:
            expect(counts["ids"] == entry["written"] and counts["deleted"] == entry["deleted"], where,
                    f"hashtables[{name!r}] says {entry['written']} ids written and {entry['deleted']} deleted, the "
                    f"parts hold {counts['ids']} and {counts['deleted']}")
        else:
            expect(counts["ids"] == entry["ids"], where,
                    f"hashtables[{name!r}] says {entry['ids']} ids, the parts hold {counts['ids']}")


def _check_slices(desc: dict, k: int, entry: dict, dwhere: str, version: int) -> None:
    """A version-4 id part's ``slices``: ``groups`` (1 to :data:`MAX_GROUPS` ... bounded) and ``rows``, the
    ``groups + 1`` row offsets of its groups, from 0, never decreasing, to the part's ``k`` rows. Absent from an
    encoded part and from older versions."""
    w = f"{dwhere}: entry {desc['name']!r}"
    slices = desc.get("slices")
    if version < SLICE_VERSION or "encoding" in desc:
        expect(slices is None, w, f"'slices' is for the plain id parts of format_version {SLICE_VERSION} and up")
        return
    size = entry["partition"]["slice_size"]
    expect(isinstance(slices, dict) and set(slices) == {"groups", "rows"} and is_count(slices["groups"], 1)
            and slices["groups"] <= min(size, 4096) and isinstance(slices["rows"], list), w,
            f"'slices' must be {{'groups': int from 1 to {min(size, 4096)}, 'rows': [groups + 1 row offsets]}}, "
            f"got {str(slices)[:200]}")
    rows, groups = slices["rows"], slices["groups"]
    expect(len(rows) == groups + 1, w, f"'slices' has {len(rows)} row offsets for {groups} groups, expected "
                                       f"{groups + 1}")
    previous = 0
    for g, row in enumerate(rows):
        expect(type(row) is int, w, f"slices.rows[{g}] must be an integer, got {row!r}")
        expected = "0" if g == 0 else f"{k}, the part's rows" if g == groups else f"from {previous} to {k}"
        expect((row == 0) if g == 0 else (row == k) if g == groups else previous <= row <= k, w,
                f"slices.rows[{g}] (row offset of slice group {g}, byte offset {row * 8} of its ids) is {row}, "
                f"expected {expected}: the slice offsets are damaged or forged")
        previous = row
