"""Parameter-list checkpoints in netcl's file shapes: a raw NPZ of parameters plus a JSON sidecar.

Files
-----
- ``save_params(params, path)`` writes one NPZ at ``path`` (``.npz`` appended
  unless ``path`` already ends with it). Entries are named ``p0 .. pN`` in
  ``params`` order, or by ``names``. Payloads are 4096-byte aligned, dtypes are
  kept as held.
- ``save_netcl_checkpoint(params, path, optim_state, config)`` writes ``<path>.npz``
  (the parameters, plus any arrays found inside ``optim_state``/``config``) and
  ``<path>.json``: ``{"optim_state": {...}, "config": {...}}``. The suffix is
  *appended*, never substituted: ``run.v1`` gives ``run.v1.npz`` and
  ``run.v1.json`` (netcl 0.4.4 wrote ``run.json`` next to ``run.v1.npz``). A
  ``path`` ending in ``.npz`` names the same pair.

Arrays inside the JSON state (array references)
-----------------------------------------------
JSON cannot hold arrays, and netcl 0.4.4 failed with a half-written file when
``optim_state`` held optimizer moments. fastckpt stores every numpy array or
device Tensor found anywhere in ``optim_state`` or ``config`` (inside dicts,
lists and tuples, at any depth) as an NPZ entry named ``optim_state.<n>`` or
``config.<n>`` (``n`` counts from 0 in depth-first order) and puts a
reference in its place in the JSON::

    {"__fastckpt_array__": "optim_state.0"}

(This is the ``PARAM_SIDECAR`` dialect of :mod:`fastckpt.state.codec`.) An
object with exactly this one key is a reference; a state dict that itself
uses the key ``"__fastckpt_array__"`` is refused when saving. On load every
reference becomes a numpy array again (a copy, with its stored dtype and
shape). Tuples come back as lists (JSON has no tuples), numpy scalars are stored
as their exact Python value, dict keys must be strings. A state with no arrays
gives exactly the JSON netcl writes, and netcl's ``load_checkpoint`` reads
fastckpt's files (it ignores the extra NPZ entries and returns references as
plain dicts).

Nothing is half-written: names, shapes and JSON-serialisability are checked
before any file is touched; the pair is one commit (:class:`fastckpt.store.commit.Commit`,
docs/commit.md): both staged and fsynced, then the JSON renamed in and the NPZ
last, and an error at any step (a parameter that cannot be read, a full disk, a
failed rename) leaves the previous pair exactly as it was. Only a crash during
the renames can leave the pair without its NPZ (the previous files are then in
the staging directory), never a new NPZ beside the previous JSON.

Names: netcl calls this pair ``save_checkpoint`` / ``load_checkpoint``, which in fastckpt are the training-state
checkpoints of :mod:`fastckpt.train`; here they are ``save_netcl_checkpoint`` / ``load_netcl_checkpoint``. The
netcl spellings worked in 0.3 with a ``DeprecationWarning``; since 0.4 they are an ``AttributeError`` that names
the new spelling.

>>> from fastckpt.io.checkpoint import save_netcl_checkpoint, load_netcl_checkpoint    # doctest: +SKIP
>>> save_netcl_checkpoint(model.parameters(), "ckpt/iter_1000",
...                 optim_state={"t": 10, "moments": [(m0, v0), (m1, v1)]},
...                 config={"lr": 1e-3, "step": 1000})                     # doctest: +SKIP
>>> state = load_netcl_checkpoint(queue, model.parameters(), "ckpt/iter_1000")   # doctest: +SKIP
>>> state["optim_state"]["moments"][0][0].dtype                            # doctest: +SKIP
dtype('float32')
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np

from fastckpt.arrays import as_numpy
from fastckpt.errors import FormatError
from fastckpt.formats.reader import guard
from fastckpt.state import PARAM_SIDECAR, decode, encode
from fastckpt.state.codec import NumberedArrays

__all__ = ["save_params", "load_params", "save_netcl_checkpoint", "load_netcl_checkpoint", "ARRAY_REF_KEY"]

ARRAY_REF_KEY = "__fastckpt_array__"


def _npz_path(path) -> str:
    p = os.fspath(path)
    return p if p.endswith(".npz") else p + ".npz"


def _base_path(path) -> str:
    p = os.fspath(path)
    return p[:-4] if p.endswith(".npz") else p


def _param_list(params) -> list:
    if params is None:
        raise TypeError("params must be an iterable of tensors, got None")
    return list(params)  # a generator is consumed exactly once, here


def _names(params: list, names) -> list[str]:
    if names is None:
        return [f"p{i}" for i in range(len(params))]
    names = list(names)
    if len(names) != len(params):
        raise ValueError(f"{len(names)} names for {len(params)} params; give one name per parameter")
    seen = set()
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names[{i}] must be a non-empty str, got {name!r}")
        if name in seen:
            raise ValueError(f"names[{i}] {name!r} is used twice")
        seen.add(name)
    return names


def _to_host(value, where: str) -> np.ndarray:
    from fastckpt.device.tensor import Tensor

    if isinstance(value, Tensor):
        return value.to_host()
    host = as_numpy(value)  # netcl and other device tensors (to_host), DLPack, __array__, buffers
    if host is None:
        raise TypeError(f"{where}: expected a fastckpt Tensor or an array (numpy, DLPack, __array__, a buffer), "
                        f"got {type(value).__name__}")
    if host.dtype.hasobject:
        raise TypeError(f"{where}: object arrays cannot be stored (nothing is ever pickled)")
    return host


def _shape_of(param) -> tuple[int, ...]:
    return tuple(int(s) for s in param.shape)


def _dtype_of(param):
    dtype = getattr(param, "dtype", None)
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def save_params(params: Iterable, path, names=None, *, fsync: bool = True, overwrite: bool = False) -> str:
    """Write ``params`` (Tensors or arrays) to a raw NPZ; returns the path written.

    An existing file is replaced only with ``overwrite=True``
    (docs/overwrite.md).

    >>> save_params(model.parameters(), "raw/iter_1000.npz", names=["fc1.weight", "fc1.bias"])  # doctest: +SKIP
    'raw/iter_1000.npz'
    """
    from fastckpt.store.commit import overwrite_flag
    from fastckpt.formats.npz import save_npz

    overwrite = overwrite_flag(overwrite)
    params = _param_list(params)
    names = _names(params, names)
    target = _npz_path(path)

    def entries():
        for i, (name, param) in enumerate(zip(names, params)):
            yield name, _to_host(param, f"params[{i}] ({name!r})")

    save_npz(target, entries(), alignment=4096, fsync=fsync, overwrite=overwrite)
    return target


def _check_params(path: str, tf, params: list, names: list[str]) -> None:
    for i, (name, param) in enumerate(zip(names, params)):
        if name not in tf.infos:
            shown = ", ".join(repr(n) for n in list(tf.infos)[:8]) + (", ..." if len(tf.infos) > 8 else "")
            raise KeyError(f"{path}: params[{i}] ({name!r}) is not in the file ({len(tf.infos)} entries: {shown}); "
                           "pass names= matching the saved names")
        info = tf.infos[name]
        shape = _shape_of(param)
        if tuple(info.shape) != shape:
            raise ValueError(f"{path}: params[{i}] ({name!r}): stored shape {tuple(info.shape)}, parameter shape {shape}")
        dtype = _dtype_of(param)
        if dtype is not None and info.dtype != dtype:
            raise ValueError(
                f"{path}: params[{i}] ({name!r}): stored dtype {info.dtype}, parameter dtype {dtype}; "
                "dtypes are kept as stored, so convert the parameter (or the saved model) first"
            )


def _write_param(param, host: np.ndarray) -> None:
    from fastckpt.device.tensor import Tensor

    if isinstance(param, Tensor):
        param.write(host)
    elif isinstance(param, np.ndarray):
        np.copyto(param, host)
    else:
        param.write(np.ascontiguousarray(host))


def load_params(queue, params: Iterable, path, names=None) -> list[str]:
    """Fill existing ``params`` from a raw NPZ; returns the names read.

    ``path`` is used as given if it exists, else ``path + ".npz"``. Every name and shape is
    checked before anything is written: a missing name raises ``KeyError``, a shape or dtype
    mismatch ``ValueError``, each naming the parameter index and key. ``queue`` is accepted
    for netcl compatibility; fastckpt Tensors write through their own queue.

    >>> load_params(queue, model.parameters(), "raw/iter_1000.npz")   # doctest: +SKIP
    ['p0', 'p1']
    """
    import fastckpt

    params = _param_list(params)
    names = _names(params, names)
    p = os.fspath(path)
    target = p if os.path.isfile(p) else _npz_path(p)
    if not os.path.isfile(target):
        from fastckpt.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"no parameter file at {p!r} (tried {p!r} and {target!r})")
    with fastckpt.open(target) as tf, guard(tf, "the parameters"):
        _check_params(target, tf, params, names)
        for name, param in zip(names, params):
            _write_param(param, tf.host(name))
    return names


# -- JSON state with array references ---------------------------------------------------------------
# The sidecar is the PARAM_SIDECAR dialect of fastckpt.state.codec: netcl's plain JSON, arrays numbered into the NPZ.
def _extract(value, prefix: str, arrays: list) -> Any:
    """``value`` with every array replaced by a reference; ``(name, array)`` pairs are appended to ``arrays``."""
    return encode(value, PARAM_SIDECAR, NumberedArrays(prefix, arrays, ARRAY_REF_KEY), where=prefix)


def _restore(doc: dict, tf) -> Any:
    def array(key: str) -> np.ndarray:
        if key not in tf.infos:
            raise KeyError(key)
        return np.array(tf.host(key))  # a copy: the mapping is closed after loading

    return decode(doc, PARAM_SIDECAR, array, where=f"{tf.path}: state")


def save_netcl_checkpoint(params: Iterable, path, optim_state=None, config=None, names=None, *,
                          fsync: bool = True, overwrite: bool = False) -> tuple[str, str]:
    """Write ``<path>.npz`` (parameters and state arrays) and ``<path>.json``; returns both paths.

    An existing pair is replaced only with ``overwrite=True``
    (docs/overwrite.md).

    >>> save_netcl_checkpoint(params, "ckpt/run.v1", optim_state={"velocity": [v0]},
    ...                       config={"step": 3})  # doctest: +SKIP
    ('ckpt/run.v1.npz', 'ckpt/run.v1.json')
    """
    from fastckpt.store.commit import Commit, overwrite_flag, write_file
    from fastckpt.formats.npz import save_npz

    params = _param_list(params)
    names = _names(params, names)
    base = _base_path(path)
    optim_arrays: list = []
    config_arrays: list = []
    doc = {
        "optim_state": _extract(optim_state if optim_state is not None else {}, "optim_state", optim_arrays),
        "config": _extract(config if config is not None else {}, "config", config_arrays),
    }
    arrays = optim_arrays + config_arrays
    clash = sorted(set(names) & {k for k, _ in arrays})
    if clash:
        raise ValueError(f"parameter names {clash} collide with the state array entries; rename them")
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:  # _extract admits only JSON values; kept as a last guard
        raise TypeError(f"checkpoint state is not JSON-serialisable: {exc}") from None

    def entries():
        for i, (name, param) in enumerate(zip(names, params)):
            yield name, _to_host(param, f"params[{i}] ({name!r})")
        yield from arrays

    npz_path, json_path = base + ".npz", base + ".json"
    overwrite = overwrite_flag(overwrite)
    # The pair is one commit (fastckpt.store.commit): both staged and fsynced, then the JSON renamed in and the
    # NPZ last; an error at any step leaves the old pair as it was, never a new NPZ beside an old JSON.
    name = os.path.basename(base)
    with Commit(base, kind="files", overwrite=overwrite, fsync=fsync, entry_points=[name + ".npz"],
                claims=[name + ".npz", name + ".json"]) as commit:
        write_file(commit.staging / (name + ".json"), text.encode("utf-8"), fsync=False)
        save_npz(commit.staging / (name + ".npz"), entries(), alignment=4096, fsync=False, staged=True)
    return npz_path, json_path


def load_netcl_checkpoint(queue, params: Iterable, path, names=None) -> dict:
    """Fill ``params`` from ``<path>.npz`` and return the sidecar ``{"optim_state", "config"}`` (``{}`` without one).

    Array references in the JSON come back as numpy arrays. The JSON and every reference
    are checked before any parameter is written.

    >>> state = load_netcl_checkpoint(queue, model.parameters(), "ckpt/iter_1000")   # doctest: +SKIP
    >>> state["config"]["step"]                                                 # doctest: +SKIP
    1000
    """
    import fastckpt

    params = _param_list(params)
    names = _names(params, names)
    base = _base_path(path)
    npz_path, json_path = base + ".npz", base + ".json"
    if not os.path.isfile(npz_path):
        from fastckpt.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"no checkpoint at {os.fspath(path)!r}: {npz_path!r} does not exist")
    with fastckpt.open(npz_path) as tf, guard(tf, "the checkpoint"):
        state: dict = {}
        if os.path.isfile(json_path):
            try:
                with open(json_path, "rb") as f:
                    doc = json.loads(f.read().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise FormatError(f"{json_path}: checkpoint sidecar is not valid JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise FormatError(f"{json_path}: checkpoint sidecar must be a JSON object "
                                  f'({{"optim_state": ..., "config": ...}}), got {type(doc).__name__}')
            try:
                state = _restore(doc, tf)
            except RecursionError:
                raise FormatError(f"{json_path}: checkpoint sidecar nests too deeply to restore") from None
        _check_params(npz_path, tf, params, names)
        for name, param in zip(names, params):
            _write_param(param, tf.host(name))
    return state


_RENAMED = {"save_checkpoint": "save_netcl_checkpoint", "load_checkpoint": "load_netcl_checkpoint"}


def __getattr__(name: str):
    """netcl's names of this pair, gone since 0.4 (0.3 warned), answered with the name to use."""
    if name in _RENAMED:
        raise AttributeError(f"fastckpt.io.checkpoint.{name} is {_RENAMED[name]} since fastckpt 0.3 (the netcl "
                             f"spelling went in 0.4; fastckpt.train.{name} is the training-state checkpoint)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
