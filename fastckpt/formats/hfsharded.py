"""Hugging Face sharded safetensors: the directory layout, fastckpt's writer and its reader.

Layout
======

A checkpoint in this layout is a directory that holds either

- one safetensors file, ``model.safetensors``, and no index: the layout
  transformers and huggingface_hub write when every tensor fits in one
  shard; or
- ``N >= 2`` safetensors files, the shards ``model-00001-of-0000N.safetensors``
  to ``model-0000N-of-0000N.safetensors``, and the index
  ``model.safetensors.index.json``.

``model`` is the prefix (transformers writes ``model``, diffusers
``diffusion_pytorch_model``). Shards are numbered from 1; both numbers are
written in decimal, zero-padded to 5 digits (wider only past 99999 shards).
The directory may hold other files (``config.json``, tokenizer files), which
the layout ignores.

Shards
------
Each shard is an ordinary safetensors file (``docs/formats/safetensors.md``)
that can be read on its own. Every tensor of the checkpoint is stored in
exactly one shard.

Index
-----
``model.safetensors.index.json`` is one JSON object, in UTF-8::

    {
      "metadata": {
        "total_size": 76
      },
      "weight_map": {
        "embed.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"
      }
    }

``"weight_map"`` (required)
    An object mapping the name of every tensor of the checkpoint to the name
    of the shard that holds it. A shard name MUST be a plain file name in the
    index's own directory: not empty, not ``.`` or ``..``, and without ``/``,
    ``\\`` or NUL.

``"metadata"`` (optional, MAY be null)
    An object. ``"total_size"`` is the sum of the byte sizes of the tensors
    (``product(shape) * itemsize``: the shards' data sections), not of the
    files. transformers writes ``total_size`` only (some versions add
    ``total_parameters``); other keys are free-form.

Other top-level keys are ignored. No object in the index may repeat a key,
and ``NaN``, ``Infinity`` and ``-Infinity`` MUST NOT appear.

How fastckpt reads it
=====================
``HFShardedDirectory`` (what ``fastckpt.open(directory)`` returns for such a
directory) reads ``model.safetensors`` when the directory has one, as
transformers does, else ``model.safetensors.index.json``, else the
directory's one ``PREFIX.safetensors.index.json`` (diffusers'
``diffusion_pytorch_model``, or ``save_sharded(prefix=...)``; two or more are
an error naming them); given the path of an index file instead (what
``hf_hub_download`` returns: ``fastckpt.open``, ``load_file``, ``inspect`` and
``convert`` take it), it reads that index (any prefix) and finds the shards
beside it.

Opening
    Every shard the index names is opened when the directory is (mapped,
    its header parsed), so every error below is raised by the open, never by
    a later read: a shard that does not exist is a
    :class:`~fastckpt.errors.CheckpointNotFoundError`; an index that is not
    UTF-8 JSON of the shape above, a shard name that could leave the
    directory, a shard that is not a valid safetensors file (truncated,
    damaged) and a tensor the index puts in a shard that does not hold it are
    each a :class:`~fastckpt.errors.FormatError` naming the file. Symbolic
    links in the directory are followed (the Hugging Face cache's snapshot
    directories are links into its blob store).

Tensors the index does not list
    A tensor stored in a shard but absent from the weight map is not part of
    the checkpoint: it is left out of ``keys()``, listed in ``unlisted`` and
    named in a :class:`~fastckpt.errors.FastCkptWarning` at open. (transformers
    loads every tensor of each shard file, so such a directory means different
    things to different readers; fastckpt follows the index.) A file the
    index does not name is not opened at all.

total_size
    Compared with the sum of the listed tensors' sizes; a difference (or a
    value that is not an integer) is a :class:`~fastckpt.errors.FastCkptWarning`,
    not an error: the Hugging Face loaders never read it, and writers differ
    in what they count.

Names and order
    Tensor names are the weight map's keys. ``keys()`` goes file after file,
    in the order each file first appears in the weight map, and within a file
    in weight map order. ``info(name).offset`` is within the tensor's shard.

Metadata
    The index's ``"metadata"`` as ``dict[str, str]``: strings as they are,
    integers in decimal (``total_size``), any other value as compact JSON;
    None when the index has none. In the one-file layout, the file's
    ``__metadata__``.

What fastckpt's writer does
===========================
:func:`save_sharded` fixes what the layout leaves open:

Splitting
    Tensors are put into shards in the order given, greedily: a tensor joins
    the current shard while the shard's tensor bytes stay at most
    ``max_shard_size``, else it starts the next shard; a tensor larger than
    ``max_shard_size`` gets a shard of its own. A tensor is never split.
    Only tensor bytes count: each file is larger by its header and the
    padding that aligns its data section. (huggingface_hub also gives an
    oversized tensor a shard of its own, but keeps filling the shard it had
    open after it, so its shards can hold the tensors out of order.)

max_shard_size
    An int (bytes) or a string as transformers and huggingface_hub accept
    it: a number, then a unit: ``B``; ``KB``, ``MB``, ``GB``, ``TB``
    (powers of 1000: ``"5GB"`` is 5 * 10**9 bytes); ``KiB``, ``MiB``,
    ``GiB``, ``TiB`` (powers of 1024). The prefix letter may be of either
    case; the final ``B`` must be upper case, since transformers reads a
    lower case ``b`` as bits and huggingface_hub as bytes. The default is
    5 GiB (5 * 2**30 bytes); transformers' default is ``"5GB"``: pass that
    for its split.

Shards
    Written by :func:`~fastckpt.formats.safetensors.save_safetensors` (data
    section aligned, deterministic header), each with ``metadata`` as its
    ``__metadata__`` (none when ``metadata`` is None). transformers refuses a
    file that has ``__metadata__`` without a ``"format"`` of ``"pt"``,
    ``"tf"``, ``"flax"`` or ``"mlx"``: pass ``metadata={"format": "pt"}``
    for ``from_pretrained``. With one shard the file is ``model.safetensors``
    and no index is written, as transformers does.

Index
    ``{"metadata": {"total_size": T, ...}, "weight_map": {...}}``: the
    metadata is ``total_size`` followed by the keys of ``metadata`` (sorted;
    ``"total_size"`` is reserved), the weight map lists the tensors in the
    order given. JSON indented by 2 spaces, ASCII only (``\\u`` escapes),
    one final newline.

Atomicity
    One commit (:class:`fastckpt.store.commit.Commit`, ``kind="files"``; the
    protocol is docs/commit.md). The shards are written into a hidden staging
    folder in the directory (``.model.@<host>~<ns>.<pid>.<random>.partial``)
    and fsynced. The commit claims every name a save with this prefix could
    publish: both entry points (``model.safetensors`` and
    ``model.safetensors.index.json``) and every ``model-NNNNN-of-NNNNN.safetensors``.
    With ``overwrite=False`` any of them existing is ``FileExistsError``
    naming it, so a one-file and a sharded save into one directory never both
    succeed. With ``overwrite=True`` the previous save's files are moved aside
    (entry points first), then the shards are renamed in and the index last;
    a failure at any step puts the previous save back. Two writers of one
    prefix take turns (an ``flock`` of ``.model.commit-lock`` while the renames
    run). So at every instant the directory has the previous save, the new
    one, or (for the renames of an ``overwrite=True`` commit) no entry point;
    an index never names a missing, partial or foreign file. A failed save
    leaves nothing it created (nor the directory, if the save created it).
    ``fsync=False`` skips the fsyncs: still atomic for readers, not durable
    across power loss.

Example
=======

>>> import fastckpt, numpy as np, tempfile, os
>>> d = tempfile.mkdtemp()
>>> files = fastckpt.save_sharded(d, {"embed.weight": np.ones((4, 4), np.float32),
...                                   "lm_head.weight": np.zeros((3,), np.float32)}, max_shard_size=64)
>>> files
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
>>> with fastckpt.open(d) as r:
...     r.format, list(r.keys()), r.metadata, r.host("lm_head.weight").tolist()
('hf-sharded', ['embed.weight', 'lm_head.weight'], {'total_size': '76'}, [0.0, 0.0, 0.0])
"""

from __future__ import annotations

import errno
import json
import logging
import numbers
import os
import re
import time
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from fastckpt.arrays import PACKED_BITS, is_packed, packed_nbytes, to_numpy
from fastckpt.errors import CheckpointChangedError, CheckpointNotFoundError, FastCkptWarning, FormatError
from fastckpt.store.commit import Commit, overwrite_flag, write_file
from fastckpt.formats.contract import MultiFileReader, tensor_not_found
from fastckpt.formats.reader import TensorFile, open_file
from fastckpt.formats.safetensors import (
    DEFAULT_ALIGNMENT,
    NAMES,
    _checked_metadata,
    dtype_to_safetensors,
    save_safetensors,
)
from fastckpt.info import TensorInfo
from fastckpt.progress import part_of_a_save, progress_from
from fastckpt.store.manifest import MAX_JSON_BYTES, parse_json, read_bounded
from fastckpt.store.snapshot import Snapshot
from fastckpt.store.names import FILE_NAME

_log = logging.getLogger(__name__)

__all__ = ["save_sharded", "HFShardedDirectory", "read_index", "plan_shards", "shard_names", "parse_size",
           "DEFAULT_MAX_SHARD_SIZE", "INDEX_NAME", "SINGLE_NAME"]

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_INDEX_SUFFIX = ".safetensors.index.json"

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size string as transformers and huggingface_hub accept it (``"5GB"``, ``"500MiB"``).

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB``
    powers of 1024, ``B`` bytes; the number may have a fraction (rounded down
    to whole bytes). The prefix letter may be of either case, the final ``B``
    must be upper case (transformers reads ``"5Gb"`` as bits, huggingface_hub
    as bytes: refused rather than guessed). The result must be at least 1.

    >>> parse_size("5GB"), parse_size("5GiB"), parse_size("1.5kB"), parse_size(4096)
    (5000000000, 5368709120, 1500, 4096)
    >>> parse_size("5Gb")
    Traceback (most recent call last):
    ...
    ValueError: max_shard_size '5Gb': a lower-case 'b' means bits to transformers and bytes to huggingface_hub; write 'B' (bytes)
    """
    if isinstance(size, bool) or not isinstance(size, (numbers.Integral, str)):
        raise TypeError(f"max_shard_size must be an int (bytes) or a string such as '5GB', got {size!r}")
    if not isinstance(size, str):
        value = int(size)
    else:
        match = _SIZE.fullmatch(size)
        unit = match.group(2) if match else ""
        if unit.endswith("b"):
            raise ValueError(f"max_shard_size {size!r}: a lower-case 'b' means bits to transformers and bytes to "
                             "huggingface_hub; write 'B' (bytes)")
        multiplier = _UNITS.get(unit[:-1].upper()) if unit.endswith("B") else None
        if match is None or multiplier is None:
            raise ValueError(f"max_shard_size {size!r}: expected an int or a number followed by B, KB, MB, GB, TB "
                             "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), as in '5GB'")
        number = match.group(1)
        if "." in number:
            whole, _, fraction = number.partition(".")
            value = (int(whole or "0") * 10**len(fraction) + int(fraction or "0")) * multiplier // 10**len(fraction)
        else:
            value = int(number) * multiplier
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def _tensor_nbytes(name, value) -> int:
    """The stored size of one tensor, checking (as the writer will) that safetensors can hold it."""
    NAMES.check(name)
    arr = value if type(value) is np.ndarray else to_numpy(value, packed=True, name=name)
    if is_packed(arr):
        return arr.nbytes
    try:
        stored = dtype_to_safetensors(arr.dtype)
    except TypeError as e:
        raise TypeError(f"tensor {name!r}: {e}") from None
    return packed_nbytes(stored, arr.shape) if stored in PACKED_BITS else arr.nbytes


def plan_shards(tensors: Mapping[str, Any], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[list[str]]:
    """The tensor names of each shard :func:`save_sharded` writes: greedy, in the order given, never splitting one.

    A tensor joins the current shard while its tensor bytes stay at most
    ``max_shard_size`` (see :func:`parse_size`), else starts the next; a larger
    tensor gets a shard of its own. No tensors: one empty shard.

    >>> import numpy as np
    >>> t = {n: np.zeros(k, np.uint8) for n, k in [("a", 6), ("b", 6), ("c", 2), ("big", 20), ("d", 1)]}
    >>> plan_shards(t, 10)
    [['a'], ['b', 'c'], ['big'], ['d']]
    """
    return _split(tensors, parse_size(max_shard_size))[0]


def _split(tensors: Mapping[str, Any], limit: int) -> tuple[list[list[str]], int]:
    """``(shards, total tensor bytes)``: :func:`plan_shards` and what the index's ``total_size`` says."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name to array, got {type(tensors).__name__}")
    shards: list[list[str]] = []
    current: list[str] = []
    size = total = 0
    for name, value in tensors.items():
        nbytes = _tensor_nbytes(name, value)
        total += nbytes
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        if size > limit:  # an oversized tensor alone: close its shard at once
            shards.append(current)
            current, size = [], 0
    if current or not shards:
        shards.append(current)
    return shards, total


def shard_names(count: int, prefix: str = "model") -> list[str]:
    """The file names of ``count`` shards: ``<prefix>.safetensors`` for one, else numbered from 1.

    >>> shard_names(1), shard_names(2, "diffusion_pytorch_model")
    (['model.safetensors'], ['diffusion_pytorch_model-00001-of-00002.safetensors', 'diffusion_pytorch_model-00002-of-00002.safetensors'])
    """
    FILE_NAME.check(prefix, "prefix")
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def _index_bytes(weight_map: dict[str, str], total_size: int, metadata: dict[str, str] | None) -> bytes:
    index = {"metadata": {"total_size": total_size, **(metadata or {})}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def save_sharded(
    directory: str | os.PathLike,
    tensors: Mapping[str, Any],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    prefix: str = "model",
    fsync: bool = True,
    alignment: int = DEFAULT_ALIGNMENT,
    progress=False,
    overwrite: bool = False,
) -> list[str]:
    """Write ``tensors`` (name -> array-like) into ``directory`` as Hugging Face sharded safetensors, atomically.

    The module docstring specifies the result: shards filled greedily in the
    order given up to ``max_shard_size`` tensor bytes (an int, or a string
    such as ``"5GB"`` or ``"2GiB"``: :func:`parse_size`), each written with
    :func:`~fastckpt.formats.safetensors.save_safetensors` (``alignment``,
    ``metadata`` as every file's ``__metadata__``), then the index
    ``<prefix>.safetensors.index.json`` last, its metadata ``total_size`` plus
    ``metadata``; one shard is ``<prefix>.safetensors`` with no index. A
    crash never leaves an index naming missing or partial files (the module
    docstring's Atomicity says exactly what a crash leaves). The directory is
    created if needed; its other files are kept, except the files of a
    previous save with the same prefix. Returns the names of the files
    written, the index last. ``progress`` (``True`` for a bar, or
    ``callback(done, total, item)``: :mod:`fastckpt.progress`) counts the
    tensors' bytes over all shards. A previous save with the same prefix is
    replaced only with ``overwrite=True`` (docs/overwrite.md). An ``OSError`` names the
    file under ``directory`` (the staging folder only as detail); a failed
    save leaves nothing it created.

    Raises ``TypeError`` for a dtype safetensors cannot store or metadata that
    is not str -> str, ``ValueError`` for a bad size or prefix, or metadata
    with the reserved key ``"total_size"``; nothing is changed then.

    >>> import fastckpt, numpy as np, tempfile, json, os
    >>> d = tempfile.mkdtemp()
    >>> save_sharded(d, {"a": np.zeros(8, np.float32), "b": np.ones(8, np.float32)}, max_shard_size="32B",
    ...              metadata={"format": "pt"})
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    >>> with open(os.path.join(d, "model.safetensors.index.json")) as f:
    ...     json.load(f)
    {'metadata': {'total_size': 64, 'format': 'pt'}, 'weight_map': {'a': 'model-00001-of-00002.safetensors', 'b': 'model-00002-of-00002.safetensors'}}
    >>> save_sharded(d, {"a": np.zeros(8, np.float32)}, overwrite=True)   # one shard: replaces the two above
    ['model.safetensors']
    >>> sorted(os.listdir(d))
    ['model.safetensors']
    """
    FILE_NAME.check(prefix, "prefix")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name to array, got {type(tensors).__name__}")
    user = _checked_metadata(metadata)
    if user is not None and "total_size" in user:
        raise ValueError("metadata key 'total_size' is reserved: the index's total_size is computed")
    shards, total = _split(tensors, parse_size(max_shard_size))
    names = shard_names(len(shards), prefix)
    index_name = f"{prefix}{_INDEX_SUFFIX}"
    single = len(names) == 1
    weight_map = {tensor: file for shard, file in zip(shards, names) for tensor in shard}
    index = None if single else _index_bytes(weight_map, total, user)

    directory = os.fspath(directory)
    overwrite = overwrite_flag(overwrite)
    started = time.perf_counter()
    entry = index_name if index is not None else names[0]
    with Commit(os.path.join(directory, prefix), kind="files", overwrite=overwrite, fsync=fsync,
                entry_points=[entry], claims=[index_name, f"{prefix}.safetensors"],
                replaces=re.compile(re.escape(prefix) + r"-[0-9]{5,}-of-[0-9]{5,}\.safetensors")) as commit:
        with progress_from(progress, total, "save sharded") as report, part_of_a_save():
            for shard, file in zip(shards, names):
                # a file of the staging directory: written in place, the commit fsyncs and publishes it
                save_safetensors(commit.staging / file, {name: tensors[name] for name in shard}, user,
                                 alignment=alignment, fsync=False, progress=report, staged=True)
        if index is not None:
            write_file(commit.staging / index_name, index, fsync=False)
    _log.info("saved %s: %d tensors, %d tensor bytes in %d files in %.3f s", directory, len(weight_map), total,
              len(names), time.perf_counter() - started)
    return names + ([index_name] if index is not None else [])


# -- reading -------------------------------------------------------------------------------------


def read_index(path: str | os.PathLike) -> tuple[dict[str, str], dict | None]:
    """``(weight_map, metadata)`` of an index file, checked: tensor name -> shard file name, and the raw
    ``"metadata"`` object (None when absent or null).

    Raises :class:`~fastckpt.errors.FormatError` naming the file for anything
    the module docstring's Index section forbids (not UTF-8 JSON, no weight
    map, a value that is not a string, a shard name that could leave the
    directory, a repeated key).

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "model.safetensors.index.json")
    >>> _ = open(p, "w").write('{"metadata": {"total_size": 4}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    >>> read_index(p)
    ({'w': 'model-00001-of-00001.safetensors'}, {'total_size': 4})
    >>> _ = open(p, "w").write('{"weight_map": {"w": "../secret.safetensors"}}')
    >>> read_index(p)
    Traceback (most recent call last):
    ...
    fastckpt.errors.FormatError: ...: tensor 'w': the weight map's shard file name '../secret.safetensors' holds '/' at position 2 (a file name has no directory separator): not a plain file name; refusing to use it
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = read_bounded(f.fileno(), MAX_JSON_BYTES, path)
    return parse_index(raw, path)


def parse_index(raw: bytes, path: str) -> tuple[dict[str, str], dict | None]:
    """:func:`read_index` of the index's bytes ``raw`` (``path`` names it in errors).

    >>> parse_index(b'{"weight_map": {"w": "a.safetensors"}}', "i.json")
    ({'w': 'a.safetensors'}, None)
    """
    index = parse_json(raw, path, unique_keys=True, constants=False, what="the index")
    if not isinstance(index, dict):
        raise FormatError(f"{path}: the index must be a JSON object, got {type(index).__name__}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        found = "no 'weight_map'" if "weight_map" not in index else f"a {type(weight_map).__name__}"
        raise FormatError(f"{path}: the index needs a 'weight_map' object (tensor name -> shard file), found {found}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise FormatError(f"{path}: the weight map puts tensor {name!r} in {file!r}, not a file name (a string)")
        FILE_NAME.check(file, "the weight map's shard file", where=f"{path}: tensor {name!r}", error=FormatError)
    metadata = index.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise FormatError(f"{path}: the index's 'metadata' must be an object or null, got {type(metadata).__name__}")
    return weight_map, metadata


def _metadata_strings(metadata: dict) -> dict[str, str]:
    out = {}
    for key, value in metadata.items():
        if isinstance(value, str):
            out[key] = value
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = str(value)
        else:
            out[key] = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return out


def _shown(names, limit: int = 5) -> str:
    names = list(names)
    return ", ".join(map(repr, names[:limit])) + (", ..." if len(names) > limit else "")


def _only_index_in(directory: str) -> str:
    """The directory's one ``PREFIX.safetensors.index.json`` (diffusers' ``diffusion_pytorch_model``, a
    ``save_sharded(prefix=...)``), for a directory without ``model.safetensors`` or its index."""
    try:
        found = sorted(e.name for e in os.scandir(directory) if e.name.endswith(_INDEX_SUFFIX) and e.is_file())
    except OSError:
        found = []
    if len(found) == 1:
        return os.path.join(directory, found[0])
    if found:
        raise FormatError(f"{directory}: holds {len(found)} Hugging Face indexes ({', '.join(found)}); open the one "
                          f"meant by its path: fastckpt.open({os.path.join(directory, found[0])!r})")
    raise CheckpointNotFoundError(
        errno.ENOENT, f"{os.strerror(errno.ENOENT)}: a Hugging Face safetensors directory needs {SINGLE_NAME}, "
                      f"{INDEX_NAME} or one PREFIX{_INDEX_SUFFIX}", directory)


class HFShardedDirectory(MultiFileReader):
    """A Hugging Face safetensors checkpoint directory (sharded, or one ``model.safetensors``) as one reader.

    Obtain one with :func:`fastckpt.open` on the directory, or construct it
    with a directory or the path of an index file (any prefix:
    ``diffusion_pytorch_model.safetensors.index.json``) and the options of
    :func:`fastckpt.open`. It implements the reader contract
    (:class:`~fastckpt.formats.contract.TensorReader`); the module docstring
    says what it checks and refuses. Every shard is opened (mapped, header
    parsed) by the constructor:

    - tensor names are the weight map's, file after file (each file where the
      weight map first names it), each file's in weight map order;
      ``info(name).offset`` is within the tensor's own file;
    - ``host(name)`` is the shard's zero-copy, read-only view;
    - ``metadata``: the index's metadata as ``dict[str, str]`` (``total_size``
      in decimal), or the one file's ``__metadata__``;
    - ``files``: shard file name -> :class:`~fastckpt.formats.reader.TensorFile`,
      in that order; ``parts()``: ``(file, names)`` pairs, what
      :func:`~fastckpt.device.load.load_file` copies into one pooled arena;
    - ``weight_map`` (name -> file), ``total_size`` (the index's, or None),
      ``index_path`` (None for one file), ``unlisted`` (file -> tensors it
      holds that the index does not list), ``close()``.

    >>> import fastckpt, numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"b": np.arange(4, dtype=np.int32), "a": np.ones(2, np.float16)}, max_shard_size=8)
    >>> with fastckpt.open(d) as r:
    ...     list(r), list(r.files), r.info("a").offset, r.host("b").tolist(), r.total_size
    (['b', 'a'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'], 4096, [0, 1, 2, 3], 20)
    """

    format = "hf-sharded"
    takes_first_window = True  # fastckpt.open passes its first_window= on (formats.reader._open_with)

    def __init__(self, path: str | os.PathLike, *, backend: str = "mmap", copy_on_write: bool = False,
                 max_header_size: int | None = None, first_window: bool = True):
        self.path = os.fspath(path)
        self._closed = False
        self.files: dict[str, TensorFile] = {}
        self.unlisted: dict[str, list[str]] = {}
        options = {"backend": backend, "copy_on_write": copy_on_write, "max_header_size": max_header_size}
        try:
            self._open(options)
        except BaseException:
            self.close()
            raise
        self._parts = tuple((self.files[file], tuple(names)) for file, names in self._by_file.items())
        order = list(self.files)
        self._following = {file: self.files[later] for file, later in zip(order, order[1:])}
        if first_window:  # False: the caller reads the bytes itself (fastckpt.open's first_window)
            for f in self.files.values():  # now that every index is parsed (none of them waits behind these reads)
                f.advise_first_window()

    def _open(self, options: dict) -> None:
        if os.path.isdir(self.path):
            self.directory = self.path
            single = os.path.join(self.path, SINGLE_NAME)
            if os.path.isfile(single):
                self._open_single(single, options)
                return
            self.index_path = os.path.join(self.path, INDEX_NAME)
            if not os.path.isfile(self.index_path):
                self.index_path = _only_index_in(self.path)
        else:
            self.directory = os.path.dirname(self.path) or "."
            self.index_path = self.path
            if not os.path.exists(self.path):
                raise CheckpointNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)}: no index file", self.path)
        where = self.index_path
        # One commit: the index and every shard through the pinned directory, each shard's identity recorded;
        # the index is checked again once every shard is pinned (a save replacing the directory's files removes
        # or replaces the index first, so a reader never takes the old index with a new shard).
        record = os.path.basename(where)
        snap = self.snapshot = Snapshot(self.directory, record=record, what="Hugging Face checkpoint",
                                        follow_links=True)  # a hub cache links every file to its blob
        try:
            raw = snap.read(record)
        except FileNotFoundError:  # there a moment ago: a save is replacing the checkpoint
            raise snap.changed_error(record, "gone (it was there when the directory was opened)") from None
        weight_map, raw_metadata = parse_index(raw, where)
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            try:
                snap.pin(file)
            except FormatError as exc:
                if isinstance(exc, CheckpointChangedError) or os.path.lexists(os.path.join(self.directory, file)):
                    raise
                full = os.path.join(self.directory, file)
                raise CheckpointNotFoundError(
                    errno.ENOENT, f"{where}: the index puts {len(names)} tensor(s) ({_shown(names)}) in {file!r}, "
                                  "which does not exist", full) from None
        infos: dict[str, TensorInfo] = {}
        for file, names in by_file.items():  # each shard checked as it opens: its problem is the one reported
            try:
                f = self.files[file] = open_file(os.path.join(self.directory, file), **options, first_window=False)
            except FileNotFoundError:
                raise snap.missing(file, f"the index {where} lists it") from None
            snap.check(file, f.mapped.identity)
            self._take_shard(where, file, names, infos)
        snap.recheck(record)
        self._take_index(where, weight_map, by_file, infos, raw_metadata, stacklevel=5)

    # The index's side of opening, shared by a local directory and a URL prefix (formats.remote.RemoteHFSharded),
    # whose shards are opened each its own way into self.files first.
    def _take_shard(self, where: str, file: str, names: list[str], infos: dict[str, TensorInfo], *,
                     unlisted: bool = True) -> None:
        """Add to ``infos`` the info of each of ``names``, the tensors the index ``where`` puts in the opened shard
        ``self.files[file]``; a shard that is not safetensors, or that lacks one of them, is a
        :class:`FormatError`. ``unlisted``: record the tensors the shard holds beyond those in ``self.unlisted``."""
        f = self.files[file]
        if f.format != "safetensors":
            raise FormatError(f"{f.path}: a shard must be a safetensors file, this one is {f.format}")
        for name in names:
            info = f.infos.get(name)
            if info is None:
                raise FormatError(f"{where}: the index puts tensor {name!r} in {file!r}, which holds no such "
                                  f"tensor ({tensor_not_found(f.path, name, f.infos).args[0]})")
            infos[name] = info
        if unlisted and len(f.infos) > len(names):
            listed = set(names)
            self.unlisted[file] = [n for n in f.infos if n not in listed]

    def _take_index(self, where: str, weight_map: dict[str, str], by_file: dict[str, list[str]],
                    infos: dict[str, TensorInfo], raw_metadata: dict | None, *, stacklevel: int) -> None:
        """Hold the index ``where`` read (its weight map and metadata) and the shards' ``infos``; warn (at
        ``stacklevel`` of this call's caller's caller) of tensors left out of the index and of a ``total_size``
        that its tensors contradict."""
        if self.unlisted:
            count = sum(map(len, self.unlisted.values()))
            shown = "; ".join(f"{file}: {_shown(names)}" for file, names in self.unlisted.items())
            warnings.warn(FastCkptWarning(
                f"{where}: {count} tensor(s) stored in the shards are not in the index and are left out ({shown})"),
                stacklevel=stacklevel)
        self.weight_map: Mapping[str, str] = MappingProxyType(weight_map)
        self.infos: Mapping[str, TensorInfo] = MappingProxyType(infos)
        self._by_file = by_file
        self.metadata = None if raw_metadata is None else _metadata_strings(raw_metadata)
        total = None if raw_metadata is None else raw_metadata.get("total_size")
        self.total_size = total if isinstance(total, int) and not isinstance(total, bool) else None
        actual = sum(i.nbytes for i in infos.values())
        if raw_metadata is not None and "total_size" in raw_metadata and self.total_size != actual:
            warnings.warn(FastCkptWarning(
                f"{where}: the index's total_size is {total!r}, but its tensors hold {actual} bytes; "
                "the index is read as it is (total_size is informative only)"), stacklevel=stacklevel)

    def _open_single(self, single: str, options: dict) -> None:
        self._take_single(open_file(single, **options, first_window=False))

    def _take_single(self, f) -> None:
        """Hold ``f``, the one safetensors file of a checkpoint without an index, as the checkpoint."""
        self.files[SINGLE_NAME] = f
        if f.format != "safetensors":
            raise FormatError(f"{f.path}: must be a safetensors file, this one is {f.format}")
        self.index_path = None
        self.infos = f.infos
        self.weight_map = MappingProxyType(dict.fromkeys(f.infos, SINGLE_NAME))
        self._by_file = {SINGLE_NAME: list(f.infos)}
        self.metadata = f.metadata
        self.total_size = None

    # -- data ------------------------------------------------------------------------------------
    def host(self, name: str) -> np.ndarray:
        """The tensor as a zero-copy, read-only numpy view of its shard's mapping (a copy with ``backend="pread"``).

        >>> import numpy as np, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = save_sharded(d, {"w": np.eye(2, dtype=np.float32)})
        >>> HFShardedDirectory(d).host("w").tolist()
        [[1.0, 0.0], [0.0, 1.0]]
        """
        try:
            file = self.weight_map[name]
        except (KeyError, TypeError):
            raise tensor_not_found(self.path, name, self.infos) from None
        f = self.files[file]
        view = f.host(name)
        if f._ahead >= f._size:  # this shard is read ahead to its end: the next one starts (reads several at once)
            following = self._following.get(file)
            if following is not None:
                following.read_ahead_start()
        return view

    def parts(self) -> tuple[tuple[TensorFile, tuple[str, ...]], ...]:
        """``(file, names)`` for each shard: its :class:`~fastckpt.formats.reader.TensorFile` and the reader's
        tensors stored in it (their ``info(name).offset`` is within that file), in ``keys()`` order.

        :func:`~fastckpt.device.load.load_file` copies each file's region into one pooled arena through this.

        >>> import numpy as np, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = save_sharded(d, {"a": np.zeros(4, np.uint8), "b": np.zeros(4, np.uint8)}, max_shard_size=4)
        >>> [(f.path.rsplit("/", 1)[1], names) for f, names in HFShardedDirectory(d).parts()]
        [('model-00001-of-00002.safetensors', ('a',)), ('model-00002-of-00002.safetensors', ('b',))]
        """
        return self._parts

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every shard and the pinned directory (idempotent); views already made stay valid."""
        snapshot = getattr(self, "snapshot", None)
        if snapshot is not None:
            snapshot.close()
        super().close()

    def __repr__(self) -> str:
        if self._closed:
            return "<Closed fastckpt.HFShardedDirectory>"
        return f"<fastckpt.HFShardedDirectory {self.path!r} files={len(self.files)} tensors={len(self)}>"
