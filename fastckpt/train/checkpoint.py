"""Training-state checkpoints that resume byte for byte: the directory format, save, load, apply.

A checkpoint holds the five state machines of a training run — the model
weights, the optimizer, the learning-rate scheduler, the data iterator and the
training RNG — plus, optionally, a dynamic loss scaler, so that a run restored
from it continues with exactly the losses the uninterrupted run would have
produced.

Directory format, schema version 1.0
====================================
A checkpoint is one directory. It MUST contain these regular files and MAY
contain no others that matter (readers MUST ignore unknown files):

``weights.safetensors``
    The model's ``state_dict()``, one safetensors file (see
    ``fastckpt.safetensors`` for the byte layout: 8-byte little-endian header
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
      ``"fastckpt.schema_version": "1.0"`` and ``"fastckpt.tree"``: the state
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
    schema_version       ``"1.0"``: ``"<major>.<minor>"``. Readers MUST refuse
                         another major version and SHOULD read a higher minor
                         (ignoring keys they do not know).
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
    weights_sha256       lowercase hex sha256 of ``weights.safetensors``: the
                         checkpoint's identity (returned by the save)
    files                object: for every other file of the checkpoint, its
                         name -> ``{"sha256": "<hex>", "bytes": <size>}``
    ==================== ===========================================================

    A checkpoint without a parseable ``manifest.json`` is incomplete and MUST
    NOT be loaded. A loader SHOULD verify every listed file's size and sha256
    before using it (``load_checkpoint`` does unless ``verify=False``).

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

Writing
=======
The directory is built under a temporary name in the same parent
(``.<name>.<pid>.<random>.partial``) and renamed into place only when every
file, manifest last, is written and fsynced (each file is itself written to a
temporary name and renamed). Readers therefore see either no checkpoint or a
complete one, never a torn one. Leftovers of a process that died while saving
are removed by the next save into the same parent (only once that process is
gone). Replacing an existing checkpoint directory swaps it out after the new
one is complete; if that final swap fails, the old checkpoint is put back. A
directory that exists and is not a checkpoint (non-empty, no
``manifest.json``) is never replaced.

Example
=======
>>> import numpy as np, tempfile, os
>>> from fastckpt.train import TinyLM, AdamW, StepLR, ShuffledTokenBatches
>>> model = TinyLM(vocab=16, dim=8, hidden=16); opt = AdamW(model.parameters(), lr=1e-2)
>>> sched = StepLR(opt, step_size=10); rng = np.random.default_rng(0)
>>> data = ShuffledTokenBatches(np.arange(400) % 16, batch_size=4, seq_len=8, seed=1)
>>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> digest = save_checkpoint(model, opt, sched, data, rng, out, step=0, epoch=0, extra_metrics={"loss": 2.5})
>>> state = load_checkpoint(out)
>>> state.manifest["weights_sha256"] == digest, state.model_weights["lm_head.weight"] is state.model_weights["embed.weight"]
(True, True)
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastckpt._atomic import atomic_directory, atomic_write, fsync_directory
from fastckpt.errors import CheckpointNotFoundError, FormatError, IntegrityError
from fastckpt.state import TRAIN_TREE, decode, encode, load_state
from fastckpt.state import state_of as _protocol_state_of
from fastckpt.state.codec import INLINE, TensorRefs

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointState",
    "save_checkpoint",
    "load_checkpoint",
    "apply_checkpoint",
    "read_manifest",
    "verify_checkpoint",
]

SCHEMA_VERSION = "1.0"
CHECKPOINT_FORMAT = "fastckpt.train.checkpoint"
WEIGHTS_FILE = "weights.safetensors"
OPTIM_FILE = "optim.safetensors"
EXTRA_FILE = "extra.json"
MANIFEST_FILE = "manifest.json"
# Small alignment: a training checkpoint is copied on load anyway, and the file
# size should equal the unique parameter bytes plus a header of a few hundred bytes.
ALIGNMENT = 64

_ALIAS = re.compile(r"^ALIAS\((.*)\)$", re.DOTALL)
_MAX_SAFE_INT = 2**53
_MAX_MANIFEST_BYTES = 64 << 20


def _view_key(arr: np.ndarray) -> tuple | None:
    if arr.size == 0:
        return None  # empty arrays may share an address without being the same tensor
    return (arr.__array_interface__["data"][0], arr.dtype.str, arr.shape, arr.strides)


# ---------------------------------------------------------------------------------------------
# Tree encoding
# ---------------------------------------------------------------------------------------------
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
        if name.startswith("fastckpt."):
            raise ValueError(f"state key {name!r}: names starting with 'fastckpt.' are reserved for checkpoint metadata")
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


# ---------------------------------------------------------------------------------------------
# Reading state out of objects and back in
# ---------------------------------------------------------------------------------------------
def state_of(obj: Any) -> Any:
    """The state of one state machine (None for None), by the lookup order of :mod:`fastckpt.state.protocol`."""
    return None if obj is None else _protocol_state_of(obj)


def restore_into(obj: Any, state: Any, what: str) -> None:
    """Put ``state`` back into ``obj`` (the inverse of :func:`state_of`); never reseeds an RNG."""
    if obj is None:
        return
    if state is None:
        raise ValueError(f"apply_checkpoint: the checkpoint holds no {what} state, but a {what} was given; pass None for it")
    load_state(obj, state)


# ---------------------------------------------------------------------------------------------
# Snapshot: everything a save writes, taken at one instant
# ---------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """The complete content of one checkpoint, detached from the live objects when staged."""

    weights: ArrayTable
    weights_tree: str
    optim: ArrayTable | None
    optim_tree: str | None
    extra_json: bytes
    manifest: dict[str, Any]


_GIT_COMMIT: list[str | None] = []


def _git_commit() -> str | None:
    if not _GIT_COMMIT:
        commit = os.environ.get("FASTCKPT_GIT_COMMIT")
        if commit is None:
            try:
                out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
                commit = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
            except (OSError, subprocess.SubprocessError):
                commit = None
        _GIT_COMMIT.append(commit)
    return _GIT_COMMIT[0]


def _versions() -> dict[str, str]:
    from fastckpt import __version__

    out = {"python": platform.python_version(), "numpy": np.__version__, "fastckpt": __version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = str(getattr(torch, "__version__", "unknown"))
    return out


def _hardware() -> dict[str, Any]:
    return {"machine": platform.machine(), "system": platform.system(), "processor": platform.processor(),
            "cpu_count": os.cpu_count()}


def _plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    # Metrics are for people and retention policies: numpy numbers become plain JSON numbers
    # (float32 -> float is exact).
    out = {}
    for key, value in dict(metrics or {}).items():
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            value = value.item()
        out[key] = value
    return out


def take_snapshot(model: Any, optimizer: Any, scheduler: Any, data_iter: Any, train_rng: Any, *,
                  step: int, epoch: int, metrics: Mapping[str, Any] | None, scaler: Any = None,
                  seed: int | None = None, config: Any = None, data_manifest: Any = None,
                  stage: Callable[[np.ndarray], np.ndarray] | None = None) -> Snapshot:
    """Capture every piece of state. With ``stage`` (copy arrays) the snapshot no longer depends on the objects."""
    if model is None:
        raise TypeError("save_checkpoint: a model is required")
    if type(step) is not int and not isinstance(step, np.integer):
        raise TypeError(f"save_checkpoint: step must be an int, got {step!r}")
    weights = ArrayTable(stage)
    weights_tree = _dumps(encode_tree(state_of(model), weights, "model"))
    weights.seal()
    optim = optim_tree = None
    if optimizer is not None:
        optim = ArrayTable(stage)
        optim_tree = _dumps(encode_tree(state_of(optimizer), optim, "optimizer"))
        optim.seal()
    # Python state is serialized now: later mutation by the trainer cannot reach the checkpoint.
    extra = {
        "format": "fastckpt.train.extra",
        "schema_version": SCHEMA_VERSION,
        "scheduler": encode_tree(state_of(scheduler), None, "scheduler"),
        "data_iter": encode_tree(state_of(data_iter), None, "data_iter"),
        "train_rng": encode_tree(state_of(train_rng), None, "train_rng"),
        "scaler": encode_tree(state_of(scaler), None, "scaler"),
    }
    extra_json = json.dumps(extra, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")
    if config is None:
        config_source = "derived"
        config = {
            "model": type(model).__qualname__,
            "weights": {k: [v.dtype.str, list(v.shape)] for k, v in weights.tensors.items()},
            "aliases": dict(weights.aliases),
            **{name: (type(o).__qualname__ if o is not None else None)
               for name, o in (("optimizer", optimizer), ("scheduler", scheduler), ("data_iter", data_iter),
                               ("train_rng", train_rng), ("scaler", scaler))},
        }
    else:
        config_source = "given"
    if data_manifest is None and data_iter is not None and hasattr(data_iter, "data_manifest"):
        data_manifest = data_iter.data_manifest()
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "step": int(step),
        "epoch": int(epoch),
        "metrics": encode_tree(_plain_metrics(metrics), None, "metrics"),
        "seed": None if seed is None else int(seed),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "versions": _versions(),
        "config_hash": _canonical_hash(config),
        "config_source": config_source,
        "data_manifest_hash": None if data_manifest is None else _canonical_hash(data_manifest),
        "git_commit": _git_commit(),
        "hardware": _hardware(),
    }
    return Snapshot(weights, weights_tree, optim, optim_tree, extra_json, manifest)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(hex sha256, size)`` of a file (e.g. ``sha256_file("ckpt/weights.safetensors")``).

    Hashes a read-only mapping in one call (hashlib releases the GIL), which
    saves the copy a ``read()`` into a buffer would make; right after a save
    the pages are in the page cache.
    """
    from fastckpt._mapped import MappedFile

    size = os.path.getsize(path)
    if size == 0:
        return hashlib.sha256(b"").hexdigest(), 0
    with MappedFile(path) as m:
        return hashlib.sha256(m.view(0, m.size)).hexdigest(), m.size


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _table_metadata(table: ArrayTable, tree: str, fmt: str) -> dict[str, str]:
    meta = {"fastckpt.format": fmt, "fastckpt.schema_version": SCHEMA_VERSION, "fastckpt.tree": tree}
    for name, target in table.aliases.items():
        meta[name] = f"ALIAS({target})"
    return meta


def _existing_is_replaceable(out: Path) -> bool:
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir()}
    return not names or MANIFEST_FILE in names


def write_snapshot(snap: Snapshot, out_dir: str | os.PathLike, *, overwrite: bool, fsync: bool = True) -> str:
    """Write ``snap`` as a checkpoint directory at ``out_dir`` (atomically); returns the weights sha256."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: a checkpoint already exists here; pass overwrite=True to replace it")
    if not _existing_is_replaceable(out):
        raise FileExistsError(
            f"{out}: exists and is not a fastckpt checkpoint (no {MANIFEST_FILE}); refusing to replace it — "
            "choose an empty or new directory"
        )
    digest = _write_directory(snap, out, fsync)
    if fsync:
        fsync_directory(out.parent)
    return digest


def _write_directory(snap: Snapshot, out: Path, fsync: bool) -> str:
    from fastckpt.safetensors import save_safetensors

    with concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="fastckpt-save") as pool, \
            atomic_directory(out, fsync=False, overwrite=True) as tmp:
        hashes: dict[str, concurrent.futures.Future] = {}
        syncs: list[concurrent.futures.Future] = []

        def finished(name: str) -> None:
            # Hash and fsync each file in the background while the next one is written.
            hashes[name] = pool.submit(sha256_file, tmp / name)
            if fsync:
                syncs.append(pool.submit(_fsync_file, tmp / name))

        save_safetensors(tmp / WEIGHTS_FILE, snap.weights.tensors,
                         _table_metadata(snap.weights, snap.weights_tree, "fastckpt.train.weights"),
                         alignment=ALIGNMENT, fsync=False)
        finished(WEIGHTS_FILE)
        if snap.optim is not None:
            save_safetensors(tmp / OPTIM_FILE, snap.optim.tensors,
                             _table_metadata(snap.optim, snap.optim_tree, "fastckpt.train.optim"),
                             alignment=ALIGNMENT, fsync=False)
            finished(OPTIM_FILE)
        with atomic_write(tmp / EXTRA_FILE, fsync=False) as f:
            f.write(snap.extra_json)
        finished(EXTRA_FILE)
        files = {}
        for name, fut in hashes.items():
            digest, size = fut.result()
            files[name] = {"sha256": digest, "bytes": size}
        for fut in syncs:
            fut.result()
        manifest = dict(snap.manifest, weights_sha256=files[WEIGHTS_FILE]["sha256"], files=files)
        # The manifest goes last: its presence marks the directory complete (atomic_write fsyncs
        # it and the temporary directory when fsync is on).
        with atomic_write(tmp / MANIFEST_FILE, fsync=fsync) as f:
            f.write(json.dumps(manifest, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    return files[WEIGHTS_FILE]["sha256"]


def save_checkpoint(model: Any, optimizer: Any, scheduler: Any, data_iter: Any, train_rng: Any,
                    out_dir: str | os.PathLike, step: int, epoch: int = 0,
                    extra_metrics: Mapping[str, Any] | None = None, *, scaler: Any = None,
                    seed: int | None = None, config: Any = None, data_manifest: Any = None,
                    overwrite: bool = True, fsync: bool = True) -> str:
    """Save the whole training state to the directory ``out_dir``; returns the sha256 of ``weights.safetensors``.

    Any of ``optimizer``, ``scheduler``, ``data_iter``, ``train_rng`` and
    ``scaler`` may be None. Objects follow the ``state_dict()`` /
    ``load_state_dict()`` protocol (a ``numpy.random.Generator`` is saved
    through ``bit_generator.state``); arrays may be numpy arrays, fastckpt
    Tensors (``to_host()``), PyTorch tensors or anything with DLPack or
    ``__array__``. ``config`` and ``data_manifest`` (JSON-like) are hashed into
    the manifest. An existing checkpoint at ``out_dir`` is replaced, after the
    new one is complete, unless ``overwrite=False``; a directory that is not
    a checkpoint is never replaced.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM, SGD
    >>> m = TinyLM(vocab=8, dim=4, hidden=8); out = os.path.join(tempfile.mkdtemp(), "c")
    >>> len(save_checkpoint(m, SGD(m.parameters(), lr=0.1), None, None, None, out, step=1))
    64
    """
    snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, step=step, epoch=epoch,
                         metrics=extra_metrics, scaler=scaler, seed=seed, config=config, data_manifest=data_manifest)
    return write_snapshot(snap, out_dir, overwrite=overwrite, fsync=fsync)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
@dataclass
class CheckpointState:
    """Everything :func:`load_checkpoint` read, ready for :func:`apply_checkpoint`.

    Arrays are private writable copies; tied weights are one array object under
    each of their names.

    >>> CheckpointState({}, None, None, None, None, {}).scaler_state is None
    True
    """

    model_weights: Any
    optim_state: Any
    scheduler_state: Any
    data_iter_state: Any
    train_rng_state: Any
    manifest: dict[str, Any]
    scaler_state: Any = None
    path: Path | None = field(default=None, compare=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def epoch(self) -> int:
        return int(self.manifest["epoch"])

    @property
    def metrics(self) -> dict[str, Any]:
        return decode_tree(self.manifest.get("metrics", {}), None, "manifest metrics")


def read_manifest(in_dir: str | os.PathLike) -> dict[str, Any]:
    """Parse and check ``manifest.json`` of a checkpoint directory (format, schema version, required keys).

    Raises :class:`~fastckpt.errors.CheckpointNotFoundError` when there is no
    checkpoint (or an incomplete one) and :class:`~fastckpt.errors.FormatError`
    when the manifest is unreadable or of another major version.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> digest = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=7)
    >>> m = read_manifest(out); m["step"], m["weights_sha256"] == digest, sorted(m["files"])
    (7, True, ['extra.json', 'weights.safetensors'])
    """
    d = Path(in_dir)
    path = d / MANIFEST_FILE
    if not d.is_dir():
        raise CheckpointNotFoundError(f"{d}: no such checkpoint directory")
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{d}: no {MANIFEST_FILE}; the directory is not a checkpoint, or its save never completed"
        )
    size = path.stat().st_size
    if size > _MAX_MANIFEST_BYTES:
        raise FormatError(f"{path}: {size} bytes, over the {_MAX_MANIFEST_BYTES}-byte limit for a manifest")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: not valid UTF-8 JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise FormatError(f"{path}: 'format' is {got!r}, expected {CHECKPOINT_FORMAT!r}")
    version = manifest.get("schema_version")
    major = str(version).split(".")[0]
    if not isinstance(version, str) or major != SCHEMA_VERSION.split(".")[0]:
        raise FormatError(
            f"{path}: schema_version {version!r} is not readable by this fastckpt (reads {SCHEMA_VERSION.split('.')[0]}.x); "
            "upgrade fastckpt to load it"
        )
    missing = [k for k in ("step", "epoch", "files", "weights_sha256") if k not in manifest]
    files = manifest.get("files")
    if missing or not isinstance(files, dict) or WEIGHTS_FILE not in files or EXTRA_FILE not in files:
        raise FormatError(f"{path}: incomplete manifest (missing {missing or 'file entries for ' + WEIGHTS_FILE + '/' + EXTRA_FILE})")
    for name, entry in files.items():
        if (not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not isinstance(entry, dict)
                or not isinstance(entry.get("sha256"), str) or not isinstance(entry.get("bytes"), int)):
            raise FormatError(f"{path}: malformed files entry {name!r}: {entry!r}")
    return manifest


def _check_file(d: Path, name: str, entry: dict[str, Any], hashes: bool) -> str | None:
    path = d / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing (the manifest lists it with {entry['bytes']} bytes)"
    if size != entry["bytes"]:
        return f"{path}: {size} bytes, the manifest says {entry['bytes']} (file truncated or replaced?)"
    if hashes:
        digest, _ = sha256_file(path)
        if digest != entry["sha256"]:
            return f"{path}: sha256 mismatch: the manifest expects {entry['sha256']}, the file has {digest}"
    return None


def _check_view(path: Path, view: memoryview, entry: dict[str, Any], hashes: bool) -> str | None:
    size = view.nbytes
    if size != entry["bytes"]:
        return f"{path}: {size} bytes, the manifest says {entry['bytes']} (file truncated or replaced?)"
    if hashes and size:
        digest = hashlib.sha256(view).hexdigest()
        if digest != entry["sha256"]:
            return f"{path}: sha256 mismatch: the manifest expects {entry['sha256']}, the file has {digest}"
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
        alias = _ALIAS.match(self.meta.get(name, ""))
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
            # A private writable copy: the mapped view is read-only and shares the page cache.
            arr = self.cache[target] = np.array(self.file.host(target), copy=True)
        return arr

    def close(self) -> None:
        self.file.close()


def _read_table_file(path: Path, expected_format: str) -> Any:
    src = _TensorSource(path, expected_format)
    try:
        return decode_tree(src.tree(), src, str(path))
    finally:
        src.close()


def load_checkpoint(in_dir: str | os.PathLike, *, verify: bool = True) -> CheckpointState:
    """Read a checkpoint directory: manifest first, then every file, hashes checked unless ``verify=False``.

    Raises :class:`~fastckpt.errors.CheckpointNotFoundError` for a missing or
    incomplete checkpoint, :class:`~fastckpt.errors.FormatError` for a bad
    manifest or file, :class:`~fastckpt.errors.IntegrityError` (naming the
    file, the expected and the actual hash) when a file changed.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=3)
    >>> load_checkpoint(out).step
    3
    """
    d = Path(in_dir)
    manifest = read_manifest(d)
    files = manifest["files"]
    tables = {WEIGHTS_FILE: "fastckpt.train.weights", OPTIM_FILE: "fastckpt.train.optim"}
    decoded: dict[str, Any] = {}
    extra: Any = None
    read_error: BaseException | None = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(files)), thread_name_prefix="fastckpt-verify") as pool:
        # Each safetensors file is mapped once: a background thread hashes the mapping while this
        # thread copies the tensors out of it, so verification costs one extra pass over memory
        # that is already resident, not a second read of the file.
        checks = []
        sources = {}
        for name, entry in files.items():
            if name in tables and read_error is None:
                try:
                    sources[name] = _TensorSource(d / name, tables[name])
                except (FormatError, OSError) as e:
                    read_error = e
                else:
                    # SAFETY: the view is taken here, before the source is closed below, and keeps
                    # the mapping alive until the hashing thread drops it; a view requested after
                    # close() would raise instead.
                    mapped = sources[name].file.mapped
                    checks.append(pool.submit(_check_view, sources[name].path, mapped.view(0, mapped.size), entry, verify))
                    continue
            checks.append(pool.submit(_check_file, d, name, entry, verify))
        try:
            if read_error is None:
                for name, src in sources.items():
                    try:
                        decoded[name] = decode_tree(src.tree(), src, str(src.path))
                    except RecursionError:
                        raise FormatError(f"{src.path}: the state tree is nested too deeply") from None
                extra_path = d / EXTRA_FILE
                try:
                    extra = json.loads(extra_path.read_bytes().decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    raise FormatError(f"{extra_path}: not valid UTF-8 JSON ({e})") from None
        except (FormatError, OSError) as e:
            read_error = e
        finally:
            for src in sources.values():
                src.close()  # the views handed to the hashing threads stay valid
        problems = [p for p in (f.result() for f in checks) if p]
    weights = decoded.get(WEIGHTS_FILE)
    optim = decoded.get(OPTIM_FILE)
    if problems:
        raise _integrity_error(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if read_error is not None:
        raise read_error
    if not isinstance(extra, dict) or extra.get("format") != "fastckpt.train.extra":
        raise FormatError(f"{d / EXTRA_FILE}: not a fastckpt extra.json ('format' is {extra.get('format') if isinstance(extra, dict) else None!r})")
    ex = lambda key: decode_tree(extra.get(key), None, f"{d / EXTRA_FILE}[{key!r}]")  # noqa: E731
    return CheckpointState(
        model_weights=weights,
        optim_state=optim,
        scheduler_state=ex("scheduler"),
        data_iter_state=ex("data_iter"),
        train_rng_state=ex("train_rng"),
        manifest=manifest,
        scaler_state=ex("scaler"),
        path=d,
    )


def apply_checkpoint(state: CheckpointState, model: Any, optimizer: Any = None, scheduler: Any = None,
                     data_iter: Any = None, train_rng: Any = None, *, scaler: Any = None) -> None:
    """Restore every given state machine in place, in the order model, optimizer, scheduler, data, RNG, scaler.

    An RNG is restored through ``bit_generator.state`` (it continues the saved
    stream; it is never reseeded). Pass None for an object you do not restore.
    Each object validates its own state; when one refuses, the ones before it
    are already restored, so start again from fresh objects.

    >>> import numpy as np, tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c"); rng = np.random.default_rng(1); _ = rng.random(5)
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, rng, out, step=0)
    >>> rng2 = np.random.default_rng(99); apply_checkpoint(load_checkpoint(out), TinyLM(vocab=8, dim=4, hidden=8), train_rng=rng2)
    >>> rng2.random() == rng.random()
    True
    """
    for obj, value, what in ((model, state.model_weights, "model"), (optimizer, state.optim_state, "optimizer"),
                             (scheduler, state.scheduler_state, "scheduler"),
                             (data_iter, state.data_iter_state, "data_iter"),
                             (train_rng, state.train_rng_state, "train_rng"), (scaler, state.scaler_state, "scaler")):
        try:
            restore_into(obj, value, what)
        except Exception as exc:
            # The object's own message says what does not fit; the note says which checkpoint.
            exc.add_note(f"while applying the {what} state of checkpoint {state.path or '(not from a directory)'}")
            raise


# ---------------------------------------------------------------------------------------------
# Verification without loading
# ---------------------------------------------------------------------------------------------
def verify_checkpoint(in_dir: str | os.PathLike, *, hashes: bool = True) -> list[str]:
    """Every problem found in a checkpoint directory, as sentences naming the file (empty: all good).

    Checks the manifest, every listed file's size and (unless ``hashes=False``)
    sha256, and that the safetensors trees and aliases resolve.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> out = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = save_checkpoint(TinyLM(vocab=8, dim=4, hidden=8), None, None, None, None, out, step=0)
    >>> verify_checkpoint(out)
    []
    """
    d = Path(in_dir)
    try:
        manifest = read_manifest(d)
    except (FormatError, CheckpointNotFoundError, OSError) as e:
        return [str(e)]
    problems = []
    files = manifest["files"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
        for p in pool.map(lambda item: _check_file(d, item[0], item[1], hashes), files.items()):
            if p:
                problems.append(p)
    if files[WEIGHTS_FILE]["sha256"] != manifest["weights_sha256"]:
        problems.append(f"{d / MANIFEST_FILE}: weights_sha256 {manifest['weights_sha256']} differs from the files "
                        f"entry of {WEIGHTS_FILE} ({files[WEIGHTS_FILE]['sha256']})")
    if problems:
        return problems
    for name, fmt in ((WEIGHTS_FILE, "fastckpt.train.weights"), (OPTIM_FILE, "fastckpt.train.optim")):
        if name not in files:
            continue
        try:
            src = _TensorSource(d / name, fmt)
            try:
                _walk_refs(src.tree(), src.resolve)
            finally:
                src.close()
        except (FormatError, OSError) as e:
            problems.append(str(e))
    try:
        extra = json.loads((d / EXTRA_FILE).read_bytes().decode("utf-8"))
        if not isinstance(extra, dict) or extra.get("format") != "fastckpt.train.extra":
            problems.append(f"{d / EXTRA_FILE}: not a fastckpt extra.json")
        else:
            for key in ("scheduler", "data_iter", "train_rng", "scaler"):
                decode_tree(extra.get(key), None, f"{d / EXTRA_FILE}[{key!r}]")
    except (UnicodeDecodeError, ValueError, OSError) as e:
        problems.append(f"{d / EXTRA_FILE}: unreadable ({e})")
    return problems


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
