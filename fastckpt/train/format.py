"""The training-checkpoint directory format: its byte-level specification, tree encoding and readers.

A checkpoint holds the five state machines of a training run — the model
weights, the optimizer, the learning-rate scheduler, the data iterator and the
training RNG — plus, optionally, a dynamic loss scaler, so that a run restored
from it continues with exactly the losses the uninterrupted run would have
produced.

Directory format, schema version 2.0
====================================
A checkpoint is one directory. It MUST contain these regular files and MAY
contain no others that matter (readers MUST ignore unknown files):

``weights.safetensors``
    The model's ``state_dict()``, one safetensors file (see
    ``fastckpt.formats.safetensors`` for the byte layout: 8-byte little-endian header
    length N, N bytes of JSON header padded with spaces, then the data
    section). fastckpt writes it with a data section aligned to 64 bytes,
    tensors ordered by dtype rank then name.

    * Every array of the state dict that is not an alias is one tensor, named
      by its path in the state dict: the keys from the root joined with ``.``
      (``{"fc1": {"weight": w}}`` -> ``fc1.weight``; list indices are
      decimal numbers). Two paths that join to the same name are an error at
      save time.
    * *Aliases (tied weights).* An array that is the very same view as an
      array stored before it (same data address, dtype, shape and strides —
      the same object, or two views of one parameter) MUST NOT be stored
      twice. Its name instead gets the metadata entry
      ``"<name>": "ALIAS(<target>)"`` where ``<target>`` is a stored tensor.
      Readers MUST resolve an alias to the *same array object* as its target.
      Arrays that merely overlap are stored separately.
    * ``__metadata__`` (all values strings) MUST hold
      ``"fastckpt.format": "fastckpt.train.weights"``,
      ``"fastckpt.schema_version": "1.0"`` (the layout of this file, unchanged
      since schema 1.0) and ``"fastckpt.tree"``: the state
      dict as JSON in the *tree encoding* below, each array replaced by
      ``{"__tensor__": "<name>"}``. Metadata keys starting with ``fastckpt.``
      are reserved; a tensor name MUST NOT start with ``fastckpt.``.

``optim.safetensors``
    The optimizer's ``state_dict()``, in the same layout as the weights file
    but with ``"fastckpt.format": "fastckpt.train.optim"``. Every array of the
    optimizer state (per-parameter moments ``m``/``v``, momentum buffers, a
    0-d ``step`` tensor, ...) is a tensor; every scalar (the step count
    ``t``, ``lr``, hyperparameters) lives in the tree. The file is absent when
    the checkpoint was saved without an optimizer.

``extra.json``
    UTF-8 JSON object with ``"format": "fastckpt.train.extra"``,
    ``"schema_version": "1.0"`` and the keys ``"scheduler"``, ``"data_iter"``,
    ``"train_rng"`` and ``"scaler"``: each the state of that object in the tree
    encoding, or ``null`` when it was not saved. Small arrays here (the key of
    an MT19937 generator) are stored inline.

``manifest.json``
    Written last, once every other file is complete. UTF-8 JSON object:

    ==================== ===========================================================
    key                  value
    ==================== ===========================================================
    format               ``"fastckpt.train.checkpoint"``
    schema_version       ``"2.0"``: ``"<major>.<minor>"``. Readers MUST refuse
                         a major version they do not know and SHOULD read a
                         higher minor (ignoring keys they do not know).
    step, epoch          integers given to the save
    metrics              object: the metrics given to the save (tree encoding;
                         numpy numbers are stored as plain JSON numbers)
    seed                 integer or null
    created_utc          ISO 8601 time of the save
    versions             object: ``python``, ``numpy``, ``fastckpt`` (and
                         ``torch`` when it was imported)
    config_hash          ``"sha256:<hex>"`` of the canonical JSON (sorted keys,
                         no spaces) of the config given to the save, or, when
                         none was given, of the derived config (object types,
                         weight names, dtypes and shapes); ``config_source``
                         says which (``"given"`` or ``"derived"``)
    data_manifest_hash   ``"sha256:<hex>"`` of the canonical JSON of the data
                         manifest (given, or ``data_iter.data_manifest()``), or null
    git_commit           ``git rev-parse HEAD`` of the working directory (or
                         ``$FASTCKPT_GIT_COMMIT``), or null
    hardware             object: ``machine``, ``system``, ``processor``, ``cpu_count``
    weights_digest       ``"<algorithm>:<hex>"``: the hash of
                         ``weights.safetensors`` as its ``files`` entry gives it
                         (``"blake3:9c1e..."``): the checkpoint's identity,
                         returned by the save
    files                object: for every other file of the checkpoint, its
                         name -> ``{"<algorithm>": "<hex>", "bytes": <size>}``
    ==================== ===========================================================

    ``<algorithm>`` is ``blake3`` (the default: BLAKE3 with its default 32-byte
    output) or ``sha256`` (``save_checkpoint(..., hash="sha256")``); ``<hex>``
    is the lowercase hex hash of the whole file, as the one key next to
    ``bytes``. fastckpt writes every entry of a manifest with the same
    algorithm, each hash computed from the bytes as they are written (never
    by reading the file back); readers check each entry with the algorithm it
    names.

    A checkpoint without a parseable ``manifest.json`` is incomplete and MUST
    NOT be loaded. A loader SHOULD verify every listed file's size and hash
    before using it (``load_checkpoint`` does unless ``verify=False``), with
    the algorithm the entry names; a reader that does not know an entry's
    algorithm MUST refuse to verify it (it may still load with verification
    off).

    *Schema 1.0* (written by earlier fastckpt releases; still read and verified):
    the same directory, except that the manifest has ``weights_sha256`` (the
    lowercase hex sha256 of ``weights.safetensors``) instead of
    ``weights_digest``, and every ``files`` entry is ``{"sha256": "<hex>",
    "bytes": <size>}``. ``weights.safetensors``, ``optim.safetensors`` and
    ``extra.json`` are the same in both schemas, and say ``"1.0"``.

Tree encoding (JSON-safe, exact)
--------------------------------
State dicts are encoded so that decoding gives back equal values of the same
types, bit for bit (the ``TRAIN_TREE`` dialect of :mod:`fastckpt.state.codec`;
states are taken from objects in the one order of
:mod:`fastckpt.state.protocol`):

* ``null``, ``true``/``false``, strings, lists: themselves.
* integers: themselves when ``|i| < 2**53`` (exact in every JSON reader),
  else ``{"__int__": "<decimal>"}`` (a PCG64 state is 128 bits).
* floats: themselves when finite (Python writes the shortest repr that
  round-trips exactly), else ``{"__float__": "inf" | "-inf" | "nan"}``.
* numpy scalars: ``{"__scalar__": {"dtype": D, "data": "<base64 of its
  itemsize bytes>"}}``, ``D`` as for arrays below.
* tuples: ``{"__tuple__": [...]}``.
* dicts whose keys are all strings not starting with ``__``: a JSON object;
  any other dict: ``{"__dict__": [[key, value], ...]}`` (keys encoded too, so
  PyTorch's integer-keyed optimizer state keeps its keys).
* arrays: ``{"__tensor__": "<name>"}`` in the safetensors files; in
  ``extra.json`` the array object of ``fastckpt.stateful`` (exactly these
  keys): ``{"__ndarray__": "<base64 of the C-order bytes>", "dtype": D,
  "shape": [...]}`` with exactly ``prod(shape) * itemsize`` bytes. ``D`` is a
  numpy dtype string with its byte order (kinds ``b i u f c S U``) or the
  name of an ``ml_dtypes`` type (``"bfloat16"``, ...). Object, structured and
  other arrays are refused (nothing is ever pickled).

The procedure that writes a directory atomically, and the save/load API,
are in :mod:`fastckpt.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastckpt.errors import CheckpointNotFoundError, FormatError, IntegrityError
from fastckpt.formats.hashing import HASH_ALGORITHMS, hash_buffer, hash_file, sha256_file
from fastckpt.state import TRAIN_TREE, decode, encode
from fastckpt.state.codec import INLINE, TensorRefs
from fastckpt.store.manifest import read_json
from fastckpt.store.names import FILE_NAME, NameRule

__all__ = [
    "SCHEMA_VERSION", "CHECKPOINT_FORMAT", "WEIGHTS_FILE", "OPTIM_FILE", "EXTRA_FILE", "MANIFEST_FILE", "ALIGNMENT",
    "ArrayTable", "encode_tree", "decode_tree", "read_manifest", "file_hash", "weights_digest", "sha256_file",
]

SCHEMA_VERSION = "2.0"
# The tensor files and extra.json have not changed since schema 1.0 and still say so.
FILE_SCHEMA_VERSION = "1.0"
DEFAULT_HASH = HASH_ALGORITHMS[0]
CHECKPOINT_FORMAT = "fastckpt.train.checkpoint"
WEIGHTS_FILE = "weights.safetensors"
OPTIM_FILE = "optim.safetensors"
EXTRA_FILE = "extra.json"
MANIFEST_FILE = "manifest.json"
# Small alignment: a training checkpoint is copied on load anyway, and the file
# size should equal the unique parameter bytes plus a header of a few hundred bytes.
ALIGNMENT = 64

#: The names of a table's tensors: any str but the metadata's own (an alias is a metadata entry of its name).
TENSOR_NAMES = NameRule("a training checkpoint's table", controls=False, empty=True,
                        prefixes=(("fastckpt.", "the checkpoint's own metadata keys start with it"),),
                        whole=(("__metadata__", "safetensors' header entry"),))
_ALIAS = re.compile(r"ALIAS\((.*)\)", re.DOTALL)  # fullmatch only: '$' also matches before a final newline
_MAX_SAFE_INT = 2**53
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_MANIFEST_DEPTH = 256  # metrics are trees of the caller's; Python parses this deep in any thread
_MAX_EXTRA_BYTES = 1 << 30  # extra.json: the scheduler, data iterator, RNG and scaler states, arrays inline
_READ_MAJORS = ("1", "2")  # schema 1.0: sha256 entries and weights_sha256


def _view_key(arr: np.ndarray) -> tuple | None:
    if arr.size == 0:
        return None  # empty arrays may share an address without being the same tensor
    return (arr.__array_interface__["data"][0], arr.dtype.str, arr.shape, arr.strides)


# -- the tree encoding --------------------------------------------------------------------------------
class ArrayTable:
    """The tensors of one safetensors file, with tied (aliased) arrays stored once.

    ``take(arr)`` (optional) gives the array to store for a new unique array:
    a staged copy for an asynchronous save, the array itself otherwise.

    >>> t = ArrayTable(); a = np.arange(4.0)
    >>> t.add("a", a); t.add("view", a[:]); t.add("half", a[:2])
    >>> sorted(t.tensors), t.aliases
    (['a', 'half'], {'view': 'a'})
    """

    def __init__(self, take: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.aliases: dict[str, str] = {}
        self._by_view: dict[tuple, str] = {}
        self._by_source: dict[int, str] = {}
        self._sources: list[Any] = []
        self._take = take

    def add(self, name: str, arr: np.ndarray, source: Any = None) -> None:
        """Store ``arr`` under ``name``, or record an alias when it is an array already stored.

        ``source`` is the object ``arr`` was converted from: a device tensor gives a new host
        array on every ``to_host()``, so the same tensor object is recognised by identity.
        """
        if name in self.tensors or name in self.aliases:
            raise ValueError(f"two entries of the state are both named {name!r} once their keys are joined with '.'")
        TENSOR_NAMES.check(name, "state entry")
        if arr.dtype.hasobject:
            raise TypeError(f"state entry {name!r} is an object array; only numeric arrays can be stored (nothing is pickled)")
        if source is not None and source is not arr:
            target = self._by_source.get(id(source))
            if target is not None:
                self.aliases[name] = target
                return
            self._by_source[id(source)] = name
            self._sources.append(source)  # kept alive so that its id is not reused meanwhile
        key = _view_key(arr)
        if key is not None and key in self._by_view:
            self.aliases[name] = self._by_view[key]
            return
        if key is not None:
            self._by_view[key] = name
        self.tensors[name] = self._take(arr) if self._take is not None else arr

    def seal(self) -> None:
        """No more arrays will come: drop the references to their source objects."""
        self._sources.clear()
        self._by_source.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_tree(obj: Any, table: ArrayTable | None, where: str) -> Any:
    """``obj`` in the tree encoding (:data:`fastckpt.state.TRAIN_TREE`); arrays go to ``table``, else inline.

    >>> t = ArrayTable(); w = np.zeros(2, np.float32)
    >>> encode_tree({"w": w, "tied": w, "t": 2**70, "b": (1.5,)}, t, "model")
    {'w': {'__tensor__': 'w'}, 'tied': {'__tensor__': 'tied'}, 't': {'__int__': '1180591620717411303424'}, 'b': {'__tuple__': [1.5]}}
    >>> list(t.tensors), t.aliases
    (['w'], {'tied': 'w'})
    """
    return encode(obj, TRAIN_TREE, INLINE if table is None else TensorRefs(table), where)


def decode_tree(tree: Any, tensor: Callable[[str], np.ndarray] | None, where: str) -> Any:
    """Invert :func:`encode_tree`; ``tensor(name)`` supplies the stored arrays.

    >>> decode_tree({"__tuple__": [{"__float__": "inf"}]}, None, "example")
    (inf,)
    """
    return decode(tree, TRAIN_TREE, tensor, where)


def _canonical_hash(obj: Any) -> str:
    text = json.dumps(encode_tree(obj, None, "config"), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- hashes and integrity ----------------------------------------------------------------------------
def _table_metadata(table: ArrayTable, tree: str, fmt: str) -> dict[str, str]:
    meta = {"fastckpt.format": fmt, "fastckpt.schema_version": FILE_SCHEMA_VERSION, "fastckpt.tree": tree}
    for name, target in table.aliases.items():
        meta[name] = f"ALIAS({target})"
    return meta


def read_manifest(in_dir: str | os.PathLike, *, snapshot=None) -> dict[str, Any]:
    """Parse and check ``manifest.json`` of a checkpoint directory (format, schema version, required keys).

    Raises :class:`~fastckpt.errors.CheckpointNotFoundError` when there is no
    checkpoint (or an incomplete one) and :class:`~fastckpt.errors.FormatError`
    when the manifest is unreadable or of another major version. ``snapshot``:
    the directory pinned by a reader (:class:`~fastckpt.store.snapshot.Snapshot`)
    to read it through, so that it and the files it lists are of one commit.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM, save_checkpoint
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> digest = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=7)
    >>> m = read_manifest(out); m["step"], m["weights_digest"] == digest, sorted(m["files"])
    (7, True, ['extra.json', 'weights.safetensors'])
    """
    d = Path(in_dir)
    path = d / MANIFEST_FILE
    if not d.is_dir():
        raise CheckpointNotFoundError(f"{d}: no such checkpoint directory")
    absent = f"{d}: no {MANIFEST_FILE}; the directory is not a checkpoint, or its save never completed"
    if not path.is_file():
        raise CheckpointNotFoundError(absent)
    # Bounded: at most _MAX_MANIFEST_BYTES read, nesting beyond what a manifest's trees need a FormatError.
    if snapshot is None:
        manifest = read_json(path, limit=_MAX_MANIFEST_BYTES, max_depth=_MAX_MANIFEST_DEPTH)
    else:
        try:
            manifest = snapshot.read_json(MANIFEST_FILE, limit=_MAX_MANIFEST_BYTES, max_depth=_MAX_MANIFEST_DEPTH)
        except FileNotFoundError:
            # Gone from the pinned directory since the check above: an overwrite=True save swapped the directory
            # away and is removing it (CheckpointChangedError), or the checkpoint was deleted.
            raise snapshot.absent(MANIFEST_FILE, absent) from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise FormatError(f"{path}: 'format' is {got!r}, expected {CHECKPOINT_FORMAT!r}")
    version = manifest.get("schema_version")
    major = str(version).split(".")[0]
    if not isinstance(version, str) or major not in _READ_MAJORS:
        raise FormatError(
            f"{path}: schema_version {version!r} is not readable by this fastckpt (reads "
            f"{', '.join(m + '.x' for m in _READ_MAJORS)}); upgrade fastckpt to load it"
        )
    digest_key = "weights_sha256" if major == "1" else "weights_digest"
    missing = [k for k in ("step", "epoch", "files", digest_key) if k not in manifest]
    files = manifest.get("files")
    if missing or not isinstance(files, dict) or WEIGHTS_FILE not in files or EXTRA_FILE not in files:
        raise FormatError(f"{path}: incomplete manifest (missing {missing or 'file entries for ' + WEIGHTS_FILE + '/' + EXTRA_FILE})")
    algorithms = ("sha256",) if major == "1" else HASH_ALGORITHMS
    for name, entry in files.items():
        FILE_NAME.check(name, "files entry", where=str(path), error=FormatError)
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            raise FormatError(f"{path}: malformed files entry {name!r}: {entry!r}")
        named = [a for a in algorithms if a in entry]
        if len(named) != 1 or not isinstance(entry[named[0]], str):
            raise FormatError(
                f"{path}: files entry {name!r} is {entry!r}; schema {version} expects one hash, "
                f"keyed by its algorithm ({' or '.join(repr(a) for a in algorithms)}), next to 'bytes' "
                "(a checkpoint written by a newer fastckpt? upgrade fastckpt to read it)")
    return manifest


def read_extra(in_dir: str | os.PathLike) -> Any:
    """The JSON value of checkpoint ``in_dir``'s ``extra.json``, read bounded as every manifest is
    (:func:`fastckpt.store.manifest.read_json`): a file over 1 GiB, nested deeper than the manifest may be, or
    not UTF-8 JSON is a :class:`~fastckpt.errors.FormatError` naming it; a missing one ``FileNotFoundError``.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM, save_checkpoint
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=7)
    >>> read_extra(out)["format"]
    'fastckpt.train.extra'
    """
    return read_json(Path(in_dir) / EXTRA_FILE, limit=_MAX_EXTRA_BYTES, max_depth=_MAX_MANIFEST_DEPTH)


def file_hash(entry: dict[str, Any]) -> tuple[str, str]:
    """``(algorithm, hex)`` of one ``files`` entry of a manifest that :func:`read_manifest` accepted.

    >>> file_hash({"blake3": "af13", "bytes": 3})
    ('blake3', 'af13')
    """
    for algorithm in HASH_ALGORITHMS:
        if algorithm in entry:
            return algorithm, entry[algorithm]
    raise FormatError(f"files entry {entry!r} names none of the hash algorithms {HASH_ALGORITHMS}")


def weights_digest(manifest: dict[str, Any]) -> str:
    """The checkpoint's identity, ``"<algorithm>:<hex>"`` of ``weights.safetensors``, for either schema.

    Schema 2 stores it as ``weights_digest``; for a schema 1.0 manifest it is
    ``"sha256:" + weights_sha256``. ``save_checkpoint`` returns the same string.

    >>> weights_digest({"schema_version": "1.0", "weights_sha256": "ab12"})
    'sha256:ab12'
    """
    if str(manifest.get("schema_version", "")).split(".")[0] == "1":
        return "sha256:" + manifest["weights_sha256"]
    return manifest["weights_digest"]


def _check_file(d: Path, name: str, entry: dict[str, Any], hashes: bool) -> str | None:
    path = d / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing (the manifest lists it with {entry['bytes']} bytes)"
    if size != entry["bytes"]:
        return f"{path}: {size} bytes, the manifest says {entry['bytes']} (file truncated or replaced?)"
    if hashes:
        algorithm, expected = file_hash(entry)
        digest, _ = hash_file(path, algorithm)
        if digest != expected:
            return f"{path}: {algorithm} mismatch: the manifest expects {expected}, the file has {digest}"
    return None


def _check_view(path: Path, view: memoryview, entry: dict[str, Any], hashes: bool, guard) -> str | None:
    with guard:  # the mapping's guard (MappedFile.guard): a file truncated under the hash is a FormatError
        return _check_mapped_view(path, view, entry, hashes)


def _check_mapped_view(path: Path, view: memoryview, entry: dict[str, Any], hashes: bool) -> str | None:
    size = view.nbytes
    if size != entry["bytes"]:
        return f"{path}: {size} bytes, the manifest says {entry['bytes']} (file truncated or replaced?)"
    if hashes:
        # One call over the whole mapping: BLAKE3 spreads it over the cores, without the GIL, but
        # leaves one to the thread copying the tensors out meanwhile (on few cores, hashing on all
        # of them slows that copy more than it speeds the hash).
        algorithm, expected = file_hash(entry)
        digest = hash_buffer(view, algorithm, spare_cores=1)
        if digest != expected:
            return f"{path}: {algorithm} mismatch: the manifest expects {expected}, the file has {digest}"
    return None


def _integrity_error(problem: str) -> IntegrityError:
    return IntegrityError(
        f"{problem}; the checkpoint was changed or damaged after it was saved — restore it from a copy, "
        "load an earlier checkpoint, or pass verify=False to load it anyway"
    )


class _TensorSource:
    """Copies tensors out of a mapped safetensors file once; aliases resolve to the same copy."""

    def __init__(self, path: Path, expected_format: str) -> None:
        import fastckpt

        self.path = path
        self.file = fastckpt.open(path)
        meta = self.file.metadata or {}
        if meta.get("fastckpt.format") != expected_format:
            self.file.close()
            raise FormatError(f"{path}: metadata 'fastckpt.format' is {meta.get('fastckpt.format')!r}, expected {expected_format!r}")
        self.meta = meta
        self.cache: dict[str, np.ndarray] = {}

    def tree(self) -> Any:
        try:
            return json.loads(self.meta["fastckpt.tree"])
        except (KeyError, ValueError, RecursionError) as e:
            raise FormatError(f"{self.path}: metadata 'fastckpt.tree' missing, not JSON or nested too deeply ({e!r})") from None

    def resolve(self, name: str) -> str:
        if name in self.file:
            return name
        alias = _ALIAS.fullmatch(self.meta.get(name, ""))
        if alias is None:
            raise FormatError(f"{self.path}: the state refers to tensor {name!r}, which is neither stored nor an ALIAS(...) entry")
        target = alias.group(1)
        if target not in self.file:
            raise FormatError(f"{self.path}: {name!r} is ALIAS({target}), but no tensor {target!r} is stored")
        return target

    def __call__(self, name: str) -> np.ndarray:
        target = self.resolve(name)
        arr = self.cache.get(target)
        if arr is None:
            # A private writable copy: the mapped view is read-only and shares the page cache. The caller holds
            # the mapping's guard (MappedFile.guard) over the copies, one for all of them.
            arr = self.cache[target] = np.array(self.file.host(target), copy=True)
        return arr

    def close(self) -> None:
        self.file.close()


def _walk_refs(tree: Any, resolve: Callable[[str], str]) -> None:
    if isinstance(tree, list):
        for v in tree:
            _walk_refs(v, resolve)
    elif isinstance(tree, dict):
        if len(tree) == 1 and "__tensor__" in tree:
            resolve(tree["__tensor__"])
        else:
            for v in tree.values():
                _walk_refs(v, resolve)
