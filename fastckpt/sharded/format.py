"""The sharded checkpoint directory: its byte-level specification, names, and reading its metadata.

A checkpoint saved by ``world_size`` ranks, each writing ``parallel`` files,
is one directory. Every JSON file below is UTF-8, ``json.dumps(obj, indent=1,
sort_keys=True, ensure_ascii=False)`` followed by one newline.

Sharded checkpoint format, versions 1 and 2
===========================================

Version 1 is the full checkpoint described first; version 2 adds delta
checkpoints and encoded tables (below). A full checkpoint without encoding is
still written as version 1, byte for byte, so every reader of version 1 reads
it; only a delta or an encoded checkpoint says version 2.

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
      (same shape and order as the embedding);
    * in a delta checkpoint, also ``T.deleted/part_i_n`` (int64, shape
      ``[d]``, ascending, distinct): the ids rank ``i`` deleted since the
      base (see below).

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
    ``{"format": "fastckpt.sharded", "format_version": 1, "world_size": n,
    "parallel": p, "files": {file name: {"size": bytes, "blake3": hex}},
    "tensors": {name: {"dtype", "shape"}}, "hashtables": {T: {"dim", "dtype",
    "slots", "ids"}}}``. ``files`` lists every other file of the directory
    (the tensor files and the three JSON files above).

Writing
    Every rank writes its files into one staging directory
    (``.NAME.PID.HEX.partial`` beside the checkpoint, made by rank 0) and
    fsyncs them; rank 0 collects every rank's report (a timeout names the
    ranks that did not report), writes ``index.json``, ``tensorkey.json``, the
    description file and ``manifest.json`` last, fsyncs, renames the staging
    directory to the checkpoint's name and fsyncs the parent. A directory
    without ``manifest.json`` is not a checkpoint; a staging directory left by
    a failed save is removed by rank 0 at once, or by a later save in the same
    parent once its process is gone.

Reading
    Readers check the manifest (format, version), that every file it lists
    exists with its size (and, on request, its BLAKE3 hash: 32 bytes, 64 hex
    digits, of the whole file), and that the three
    JSON files agree with each other.

Delta checkpoints (version 2)
    A delta holds what changed since another committed checkpoint, its
    *base* (full or itself a delta). The layout is that of a full checkpoint,
    and its ``manifest.json`` has ``"format_version": 2`` and three more keys:
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
      a row of zeros).

    With ``"shuffle": k > 1`` the payload's bytes are regrouped: byte ``j``
    of every ``k``-byte element, for ``j = 0 .. k-1``. ``"codec"`` is
    ``"zstd"`` (one Zstandard frame), ``"lz4"`` (one LZ4 frame) or ``null``
    (the payload as is). The manifest's table entry adds ``"encoding":
    {"compression", "quantize", "max_abs_error"}``: the largest absolute
    difference between any stored value and the value it restores to (0.0
    when lossless); a quantized checkpoint's manifest also has ``"lossy":
    true``, and readers load it only when asked to (it is for serving, not
    for resuming training).

>>> part_key("w", 1, 4), rows_of(1, 4, 10), parse_part_key("T.id/part_2_3")
('w/part_1_4', (2, 5), ('T.id', 2, 3))
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from fastckpt.errors import CheckpointNotFoundError, FormatError

__all__ = [
    "FORMAT", "FORMAT_VERSION", "FULL_VERSION", "DELTA_VERSION", "INDEX_FILE", "TENSORKEY_FILE", "DESCRIPTION_FILE", "MANIFEST_FILE",
    "tensor_file_name", "part_key", "parse_part_key", "rows_of", "dumps", "read_metadata",
]

FORMAT = "fastckpt.sharded"
FORMAT_VERSION = 2  # the newest version read; full checkpoints are written as FULL_VERSION
FULL_VERSION = 1
DELTA_VERSION = 2
INDEX_FILE = "index.json"
TENSORKEY_FILE = "tensorkey.json"
DESCRIPTION_FILE = "torch_rank_weights_embs_table_multi_shard.json"
MANIFEST_FILE = "manifest.json"
ROLES = ("id", "embedding", "slot", "deleted")

_PART = re.compile(r"^(?P<name>.+)/part_(?P<i>\d+)_(?P<n>\d+)$")
_FILE = re.compile(r"^model-(\d{5})-(\d{3})\.safetensors$")


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
    m = _PART.match(key)
    return (m.group("name"), int(m.group("i")), int(m.group("n"))) if m else None


def rows_of(i: int, n: int, rows: int) -> tuple[int, int]:
    """``[start, end)``: the rows part ``i`` of ``n`` holds of a tensor of ``rows`` rows.

    >>> [rows_of(i, 3, 10) for i in range(3)]
    [(0, 3), (3, 6), (6, 10)]
    """
    return i * rows // n, (i + 1) * rows // n


def dumps(obj: Any) -> bytes:
    """The bytes of one of the directory's JSON files.

    >>> dumps({"b": 1, "a": [1]})
    b'{\\n "a": [\\n  1\\n ],\\n "b": 1\\n}\\n'
    """
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _load_json(directory: str, name: str) -> Any:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; the checkpoint's {MANIFEST_FILE} lists it") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from None


def _expect(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise FormatError(f"{where}: {message}")


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's four JSON files, parsed and checked against each other.

    Returns ``{"manifest", "index", "tensorkey", "descriptions"}``. A directory
    without ``manifest.json`` raises
    :class:`~fastckpt.errors.CheckpointNotFoundError`; any disagreement a
    :class:`~fastckpt.errors.FormatError` naming the file and the entry.

    >>> read_metadata("/nonexistent")
    Traceback (most recent call last):
    fastckpt.errors.CheckpointNotFoundError: /nonexistent: no sharded checkpoint here (no manifest.json: a save that did not finish leaves none)
    """
    d = os.fspath(directory)
    if not os.path.isfile(os.path.join(d, MANIFEST_FILE)):
        raise CheckpointNotFoundError(
            f"{d}: no sharded checkpoint here (no {MANIFEST_FILE}: a save that did not finish leaves none)")
    manifest = _load_json(d, MANIFEST_FILE)
    where = os.path.join(d, MANIFEST_FILE)
    _expect(isinstance(manifest, dict), where, f"expected a JSON object, got {type(manifest).__name__}")
    _expect(manifest.get("format") == FORMAT, where,
            f"'format' is {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    _expect(type(version) is int, where, f"'format_version' must be an integer, got {version!r}")
    _expect(version <= FORMAT_VERSION, where,
            f"format version {version} is newer than this fastckpt reads ({FORMAT_VERSION}); upgrade fastckpt")
    for key in ("world_size", "parallel"):
        _expect(type(manifest.get(key)) is int and manifest[key] >= 1, where,
                f"{key!r} must be a positive integer, got {manifest.get(key)!r}")
    files = manifest.get("files")
    _expect(isinstance(files, dict), where, "'files' must be an object")
    for name, entry in files.items():
        _expect("/" not in name and "\\" not in name and name not in (".", ".."), where,
                f"file name {name!r} is not a plain name in the directory")
        _expect(isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("blake3"), str),
                where, f"files[{name!r}] must be {{'size': int, 'blake3': str}}, got {entry!r}")
    expected_files = {tensor_file_name(r, k) for r in range(manifest["world_size"]) for k in range(manifest["parallel"])}
    missing = sorted(expected_files - set(files))
    _expect(not missing, where, f"lists no entry for the tensor files {missing[:4]} (world_size "
                                f"{manifest['world_size']} x parallel {manifest['parallel']} files expected)")
    for name in (INDEX_FILE, TENSORKEY_FILE, DESCRIPTION_FILE):
        _expect(name in files, where, f"lists no entry for {name}")
    kind = manifest.get("kind", "full")
    _expect(kind in ("full", "delta"), where, f"'kind' must be 'delta' (or absent: a full checkpoint), got {kind!r}")
    if kind == "delta":
        base = manifest.get("base")
        _expect(version >= DELTA_VERSION, where, f"a delta checkpoint needs format_version {DELTA_VERSION}, "
                                                 f"got {version}")
        _expect(isinstance(base, dict) and isinstance(base.get("path"), str) and base["path"]
                and isinstance(base.get("manifest_blake3"), str), where,
                f"'base' must be {{'path': str, 'manifest_blake3': str}}, got {base!r}")
        _expect(type(manifest.get("chain_length")) is int and manifest["chain_length"] >= 1, where,
                f"'chain_length' must be a positive integer, got {manifest.get('chain_length')!r}")

    index = _load_json(d, INDEX_FILE)
    iwhere = os.path.join(d, INDEX_FILE)
    _expect(isinstance(index, dict) and set(index) == {"block_index", "file_index"}, iwhere,
            "expected exactly the keys 'block_index' and 'file_index'")
    file_index, block_index = index["file_index"], index["block_index"]
    _expect(isinstance(file_index, dict) and isinstance(block_index, dict), iwhere, "both keys must hold objects")
    by_number = {}
    for name, number in file_index.items():
        _expect(name in expected_files and type(number) is int, iwhere, f"file_index entry {name!r}: {number!r}")
        by_number[number] = name
    _expect(len(by_number) == len(file_index) == len(expected_files), iwhere,
            f"file_index must number the {len(expected_files)} tensor files once each")
    descriptions = _load_json(d, DESCRIPTION_FILE)
    tensorkey = _load_json(d, TENSORKEY_FILE)
    dwhere, twhere = os.path.join(d, DESCRIPTION_FILE), os.path.join(d, TENSORKEY_FILE)
    _expect(isinstance(descriptions, dict), dwhere, "expected a JSON object")
    _expect(isinstance(tensorkey, dict), twhere, "expected a JSON object")
    _expect(set(block_index) == set(descriptions) == set(tensorkey), iwhere,
            f"block_index, {TENSORKEY_FILE} and {DESCRIPTION_FILE} must name the same stored keys "
            f"(differences: {sorted(set(block_index) ^ set(descriptions) ^ set(tensorkey))[:4]})")
    for key, number in block_index.items():
        _expect(number in by_number, iwhere, f"block_index[{key!r}] is {number!r}, not a file number of file_index")
        desc = descriptions[key]
        _expect(isinstance(desc, dict) and desc.get("name") == key and isinstance(desc.get("shape"), list)
                and isinstance(desc.get("dtype"), str) and isinstance(desc.get("part"), list), dwhere,
                f"entry {key!r} must hold at least name (the key itself), dtype, shape and part")
        if "encoding" in desc:
            enc = desc["encoding"]
            _expect(version >= DELTA_VERSION, where, f"encoded tensors need format_version {DELTA_VERSION}, got "
                                                     f"{version}")
            _expect(isinstance(enc, dict) and isinstance(enc.get("shape"), list) and isinstance(enc.get("dtype"), str)
                    and desc["dtype"] == "uint8" and len(desc["shape"]) == 1, dwhere,
                    f"entry {key!r}: an encoded tensor is stored as 1-D uint8 and its encoding names the shape and "
                    f"dtype it holds, got dtype {desc['dtype']!r}, shape {desc['shape']}, encoding {enc!r}")
        parsed = parse_part_key(key)
        _expect(parsed is not None and parsed[0] == tensorkey[key] == desc.get("tensor")
                and [parsed[1], parsed[2]] == desc["part"], dwhere,
                f"entry {key!r}: its name, 'tensor', 'part' and {TENSORKEY_FILE} disagree")
    return {"manifest": manifest, "index": {"block_index": block_index, "file_index": file_index,
                                            "files": by_number},
            "tensorkey": tensorkey, "descriptions": descriptions}
