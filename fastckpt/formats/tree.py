"""Nested state (dicts of dicts of arrays, the shape of JAX/Flax/Orbax parameters) in one tensor file.

:func:`save_tree` stores every array of ``tree`` under the ``/``-joined path of
its keys (``{"dense": {"kernel": k}}`` -> tensor ``"dense/kernel"``), in a
safetensors file or an NPZ (the path's suffix says which, as for
``fastckpt convert``); any reader (safetensors, ``np.load``, ``fastckpt.open``)
sees those flat names. :func:`load_tree` gives the same nesting back, the
same keys in the same order and every array with its dtype, shape and bytes.

Layout (a promise, like every format here): a safetensors file made by
``save_tree`` carries the metadata entry ``"fastckpt.tree"``: the tree in JSON
with every array replaced by ``0`` (``{"dense": {"kernel": 0}}``), which keeps
the order of the keys and the empty dicts; the caller's ``metadata`` sits
beside it. An NPZ has no metadata: its members keep the order, and a tree with
an empty dict is refused there. Keys must be non-empty strings without ``/``
(they are the separators); a value that is neither a dict nor array-like is
refused, naming its path.

>>> import numpy as np, tempfile, os
>>> tree = {"params": {"dense": {"kernel": np.eye(2, dtype=np.float32), "bias": np.zeros(2, np.float32)}},
...         "step": np.array(3)}
>>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
>>> save_tree(path, tree)
>>> import fastckpt
>>> with fastckpt.open(path) as f:
...     sorted(f.keys())
['params/dense/bias', 'params/dense/kernel', 'step']
>>> back = load_tree(path)
>>> list(back["params"]["dense"]), back["params"]["dense"]["kernel"].tolist(), int(back["step"])
(['kernel', 'bias'], [[1.0, 0.0], [0.0, 1.0]], 3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypeAlias, Union

import numpy as np

from fastckpt.arrays import to_numpy
from fastckpt.errors import FormatError

__all__ = ["save_tree", "load_tree", "flatten_tree", "ArrayTree", "TREE_METADATA_KEY", "SEPARATOR"]

TREE_METADATA_KEY = "fastckpt.tree"
SEPARATOR = "/"

# A nested state as load_tree gives it back (save_tree takes any mappings of array-likes).
ArrayTree: TypeAlias = dict[str, Union[np.ndarray, "ArrayTree"]]
Tree = Mapping[str, object]  # dicts of dicts of array-likes, checked as they are walked


def flatten_tree(tree: Tree) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, shape)``: every array of ``tree`` under its ``/``-joined path, in the tree's order, and the
    tree with each array replaced by ``0`` (what ``"fastckpt.tree"`` stores).

    >>> flatten_tree({"a": {"b": np.zeros(1)}, "c": {}})
    ({'a/b': array([0.])}, {'a': {'b': 0}, 'c': {}})
    >>> flatten_tree({"a/b": np.zeros(1)})
    Traceback (most recent call last):
    ...
    ValueError: tree key 'a/b' (at the top): keys cannot hold '/', which joins them; rename it or nest it
    """
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Mapping, prefix: str) -> dict[str, Any]:
        shape: dict[str, Any] = {}
        for key, value in node.items():
            where = f"at {prefix[:-1]!r}" if prefix else "at the top"
            if not isinstance(key, str) or not key:
                raise TypeError(f"tree key {key!r} ({where}): keys must be non-empty strings")
            if SEPARATOR in key:
                raise ValueError(f"tree key {key!r} ({where}): keys cannot hold {SEPARATOR!r}, which joins them; "
                                 "rename it or nest it")
            path = prefix + key
            if isinstance(value, Mapping):
                shape[key] = walk(value, path + SEPARATOR)
                continue
            try:
                arrays[path] = to_numpy(value)
            except Exception as e:
                raise TypeError(f"tree value {path!r} ({type(value).__name__}) is neither a dict nor array-like: "
                                f"{e}") from e
            if arrays[path].dtype == object:
                raise TypeError(f"tree value {path!r} ({type(value).__name__}) is not an array of numbers: numpy "
                                "made it an array of Python objects, which no tensor file holds")
            shape[key] = 0
        return shape

    if not isinstance(tree, Mapping):
        raise TypeError(f"save_tree takes a dict (of dicts) of arrays, got {type(tree).__name__}")
    return arrays, walk(tree, "")


def save_tree(path: str | os.PathLike, tree: Tree, *, metadata: Mapping[str, str] | None = None,
              **options: Any) -> None:
    """Save nested dicts of arrays to one file (``.npz``: NPZ, else safetensors); see the module docstring.

    ``metadata`` (safetensors only) is stored beside ``"fastckpt.tree"``; ``options``
    go to :func:`fastckpt.save_safetensors` / :func:`fastckpt.save_npz` (``fsync``,
    ``progress``, ``storage_options``, ...).

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "opt.npz")
    >>> save_tree(path, {"mu": {"w": np.ones(2, np.float16)}})
    >>> load_tree(path)["mu"]["w"]
    array([1., 1.], dtype=float16)
    """
    arrays, shape = flatten_tree(tree)
    if os.fspath(path).endswith(".npz"):
        if metadata:
            raise ValueError(f"{os.fspath(path)}: an NPZ holds no metadata; save the tree as .safetensors to keep "
                             "metadata")
        empty = _first_empty(shape)
        if empty is not None:
            raise ValueError(f"{os.fspath(path)}: the empty dict at {empty!r} would be lost in an NPZ (no metadata "
                             "to record it); save the tree as .safetensors")
        from fastckpt.formats.npz import save_npz

        save_npz(path, arrays, **options)
        return
    if metadata and TREE_METADATA_KEY in metadata:
        raise ValueError(f"metadata key {TREE_METADATA_KEY!r} is save_tree's own (the tree's shape)")
    from fastckpt.formats.safetensors import save_safetensors

    meta = {**(metadata or {}), TREE_METADATA_KEY: json.dumps(shape, separators=(",", ":"), ensure_ascii=False)}
    save_safetensors(path, arrays, meta, **options)


def load_tree(path: str | os.PathLike, **options: Any) -> ArrayTree:
    """The nested dicts of arrays :func:`save_tree` saved (private, writable copies), keys in their order.

    A file that ``save_tree`` did not write (any safetensors or NPZ file, or
    another reader :func:`fastckpt.open` takes) is nested by splitting its
    names at ``/``. ``options`` go to :func:`fastckpt.open`.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "flat.safetensors")
    >>> import fastckpt
    >>> fastckpt.save_safetensors(path, {"enc/w": np.zeros(1), "enc/b": np.ones(1)})
    >>> load_tree(path)
    {'enc': {'b': array([1.]), 'w': array([0.])}}
    """
    from fastckpt.formats.reader import open as open_reader

    with open_reader(path, **options) as f:
        names = list(f.keys())
        text = (f.metadata or {}).get(TREE_METADATA_KEY)
        if text is None:
            shape: dict[str, Any] = {}
            for name in names:
                _insert(shape, name, f"{f.path}: tensor {name!r}")
        else:
            try:
                shape = json.loads(text)
            except ValueError as e:
                raise FormatError(f"{f.path}: metadata {TREE_METADATA_KEY!r} is not JSON ({e})") from None
            listed = dict.fromkeys(_paths(shape, "", f.path))
            if set(listed) != set(names):
                raise FormatError(f"{f.path}: metadata {TREE_METADATA_KEY!r} lists "
                                  f"{sorted(set(listed) - set(names))[:3]} that the file does not hold, or the file "
                                  f"holds {sorted(set(names) - set(listed))[:3]} that it does not list")
        return _fill(shape, "", f)


def _insert(shape: dict, name: str, where: str) -> None:
    node = shape
    *parents, leaf = name.split(SEPARATOR)
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise FormatError(f"{where}: {part!r} is both a tensor and a prefix of this name; it cannot nest")
        node = child
    if leaf in node:
        raise FormatError(f"{where}: a tensor and a group share this name; it cannot nest")
    node[leaf] = 0


def _paths(shape: Any, prefix: str, where: str) -> list[str]:
    if not isinstance(shape, dict):
        raise FormatError(f"{where}: metadata {TREE_METADATA_KEY!r} is not a tree of dicts and 0s")
    out = []
    for key, value in shape.items():
        if value == 0 and not isinstance(value, (dict, bool)):
            out.append(prefix + key)
        else:
            out += _paths(value, prefix + key + SEPARATOR, where)
    return out


def _fill(shape: dict, prefix: str, reader: Any) -> ArrayTree:
    return {key: _fill(value, prefix + key + SEPARATOR, reader) if isinstance(value, dict)
            else np.array(reader.host(prefix + key), copy=True) for key, value in shape.items()}


def _first_empty(shape: dict, prefix: str = "") -> str | None:
    for key, value in shape.items():
        if isinstance(value, dict):
            if not value:
                return prefix + key
            found = _first_empty(value, prefix + key + SEPARATOR)
            if found is not None:
                return found
    return None
