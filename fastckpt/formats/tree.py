"""Nested state (dicts, lists and tuples of arrays and Python values: JAX/Flax/Orbax pytrees) in one tensor file.

:func:`save_tree` stores every array of ``tree`` under the ``/``-joined path of
its keys and list positions (``{"dense": {"kernel": k}}`` -> tensor
``"dense/kernel"``, ``{"layers": [a, b]}`` -> ``"layers/0"``, ``"layers/1"``), in
a safetensors file or an NPZ (the path's suffix says which, as for
``fastckpt convert``); any reader (safetensors, ``np.load``, ``fastckpt.open``)
sees those flat names. :func:`load_tree` gives exactly the structure back: the
same dicts with the same keys in the same order, lists as lists, tuples as
tuples, every array with its dtype, shape and bytes, numpy scalars as numpy
scalars, and Python's ``None``, ``bool``, ``int``, ``float`` and ``str`` as
themselves. What it could not give back is refused by :func:`save_tree`,
naming its path.

Layout (a promise, like every format here; docs/formats/tree.md)
================================================================
A safetensors file made by ``save_tree`` carries two metadata entries beside
the caller's ``metadata``:

``"fastckpt.tree_version"``: ``"2"``
    The version of the encoding below. A file without it is version 1.

``"fastckpt.tree"``
    The tree's structure in JSON, each node encoded as:

    ============================== ===============================================
    node                           JSON
    ============================== ===============================================
    dict (keys: strings)           an object with the same keys in the same order
    array (the tensor at its path) ``0``
    numpy scalar (``np.int32(3)``) ``["scalar"]``; the tensor at its path is its
                                   0-d array
    list / tuple                   ``["list", [nodes]]`` / ``["tuple", [nodes]]``
    None                           ``["none"]``
    bool                           ``["bool", true|false]``
    int                            ``["int", "<decimal>"]`` (any size, exact)
    float                          ``["float", "<repr>"]`` (``repr``, exact;
                                   ``"inf"``, ``"-inf"``, ``"nan"`` too)
    str                            ``["str", "<text>"]``
    ============================== ===============================================

    The tensors of the file are exactly those the structure places (each
    path once); a reader MUST refuse a file where they differ, or a version
    it does not know.

*Version 1* (fastckpt 0.2; still read): no ``"fastckpt.tree_version"``, and a
structure of objects and ``0`` only (dicts of arrays; every leaf a tensor).
A version 2 file of dicts and arrays only has that same structure, so
version 1 readers read it too.

An NPZ has no metadata: its members keep the order, and only dicts (not
empty) of arrays fit there; a tree with anything else (a list, a Python value,
a numpy scalar, an empty dict) is refused for ``.npz``, naming the path. Keys
must be non-empty strings without ``/`` (it joins them); any other value
(an object, a set, ``bytes``, a complex number) is refused, naming its path.
A file that ``save_tree`` did not write is nested by splitting its names at
``/`` (dicts only).

>>> import numpy as np, tempfile, os
>>> tree = {"params": {"dense": {"kernel": np.eye(2, dtype=np.float32), "bias": np.zeros(2, np.float32)}},
...         "layers": [np.ones(2), np.zeros(3)], "opt": (np.ones(1), 0.9), "step": 3, "name": None}
>>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
>>> save_tree(path, tree)
>>> import fastckpt
>>> with fastckpt.open(path) as f:
...     sorted(f.keys())
['layers/0', 'layers/1', 'opt/0', 'params/dense/bias', 'params/dense/kernel']
>>> back = load_tree(path)
>>> list(back["params"]["dense"]), [a.shape for a in back["layers"]], back["opt"][1], back["step"], back["name"]
(['kernel', 'bias'], [(2,), (3,)], 0.9, 3, None)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any, TypeAlias, Union

import numpy as np

from fastckpt.arrays import as_numpy
from fastckpt.errors import FormatError

__all__ = ["save_tree", "load_tree", "flatten_tree", "ArrayTree", "TREE_METADATA_KEY", "TREE_VERSION_KEY",
           "TREE_VERSION", "SEPARATOR"]

TREE_METADATA_KEY = "fastckpt.tree"
TREE_VERSION_KEY = "fastckpt.tree_version"
TREE_VERSION = "2"
SEPARATOR = "/"
_READS = ("1", "2")

# A tree as load_tree gives it back (save_tree takes any mappings, sequences and array-likes).
ArrayTree: TypeAlias = dict[str, Union[np.ndarray, np.generic, "ArrayTree", list[Any], tuple[Any, ...], bool, int,
                                       float, str, None]]
Tree = Mapping[str, object]  # checked as it is walked


def flatten_tree(tree: Tree) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, structure)``: every array of ``tree`` under its ``/``-joined path, in the tree's order, and
    the structure as ``"fastckpt.tree"`` stores it (the module docstring's table).

    >>> flatten_tree({"a": {"b": np.zeros(1)}, "c": {}, "n": [1, None]})
    ({'a/b': array([0.])}, {'a': {'b': 0}, 'c': {}, 'n': ['list', [['int', '1'], ['none']]]})
    >>> flatten_tree({"a/b": np.zeros(1)})
    Traceback (most recent call last):
    ...
    ValueError: tree key 'a/b' (at the top): keys cannot hold '/', which joins them; rename it or nest it
    """
    arrays: dict[str, np.ndarray] = {}

    def walk(value: Any, path: str) -> Any:
        where = f"at {path!r}" if path else "at the top"
        if isinstance(value, Mapping):
            node: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str) or not key:
                    raise TypeError(f"tree key {key!r} ({where}): keys must be non-empty strings")
                if SEPARATOR in key:
                    raise ValueError(f"tree key {key!r} ({where}): keys cannot hold {SEPARATOR!r}, which joins them; "
                                     "rename it or nest it")
                node[key] = walk(item, f"{path}{SEPARATOR}{key}" if path else key)
            return node
        if not path:
            raise TypeError(f"save_tree takes a dict (of dicts, lists, ...) of arrays, got {type(value).__name__}")
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            return [kind, [walk(item, f"{path}{SEPARATOR}{i}") for i, item in enumerate(value)]]
        if value is None:
            return ["none"]
        if isinstance(value, bool):
            return ["bool", value]
        if isinstance(value, int) and type(value) is int:
            return ["int", str(value)]
        if isinstance(value, float) and type(value) is float:
            return ["float", repr(value)]
        if isinstance(value, str) and type(value) is str:
            return ["str", value]
        if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_, np.void, np.object_)):
            arrays[path] = np.asarray(value)
            return ["scalar"]
        if isinstance(value, (bytes, bytearray, complex, set, frozenset, str, list, tuple)):
            raise TypeError(f"tree value {path!r} ({type(value).__name__}) cannot be saved so that it comes back "
                            "as it is: store it as an array (np.frombuffer for bytes) or as a str, int, float, "
                            "bool, None, list, tuple or dict")
        converted = as_numpy(value, name=path, where="a tree")
        if converted is None:
            raise TypeError(f"tree value {path!r} ({type(value).__name__}) is neither a dict, a list, a tuple, a "
                            "Python number, str or None, nor array-like")
        if converted.dtype.hasobject:
            raise TypeError(f"tree value {path!r} ({type(value).__name__}) is not an array of numbers: it holds "
                            "Python objects, which no tensor file holds")
        arrays[path] = converted
        return 0

    structure = walk(tree, "")
    return arrays, structure


def save_tree(path: str | os.PathLike, tree: Tree, *, metadata: Mapping[str, str] | None = None,
              **options: Any) -> None:
    """Save a tree (dicts, lists, tuples of arrays and Python values) to one file (``.npz``: NPZ, else
    safetensors); see the module docstring.

    ``metadata`` (safetensors only) is stored beside ``"fastckpt.tree"``; ``options``
    go to :func:`fastckpt.save_safetensors` / :func:`fastckpt.save_npz` (``fsync``,
    ``progress``, ``storage_options``, ...).

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "opt.npz")
    >>> save_tree(path, {"mu": {"w": np.ones(2, np.float16)}})
    >>> load_tree(path)["mu"]["w"]
    array([1., 1.], dtype=float16)
    >>> save_tree(path, {"mu": [np.ones(2)]})
    Traceback (most recent call last):
    ...
    ValueError: ...opt.npz: the list at 'mu' would be lost in an NPZ (no metadata to record the structure); save the tree as .safetensors
    """
    arrays, structure = flatten_tree(tree)
    if os.fspath(path).endswith(".npz"):
        if metadata:
            raise ValueError(f"{os.fspath(path)}: an NPZ holds no metadata; save the tree as .safetensors to keep "
                             "metadata")
        lost = _first_not_in_npz(structure, "")
        if lost is not None:
            raise ValueError(f"{os.fspath(path)}: the {lost[1]} at {lost[0]!r} would be lost in an NPZ (no metadata "
                             "to record the structure); save the tree as .safetensors")
        from fastckpt.formats.npz import save_npz

        save_npz(path, arrays, **options)
        return
    for key in (TREE_METADATA_KEY, TREE_VERSION_KEY):
        if metadata and key in metadata:
            raise ValueError(f"metadata key {key!r} is save_tree's own (the tree's structure)")
    from fastckpt.formats.safetensors import save_safetensors

    meta = {**(metadata or {}), TREE_VERSION_KEY: TREE_VERSION,
            TREE_METADATA_KEY: json.dumps(structure, separators=(",", ":"), ensure_ascii=False)}
    save_safetensors(path, arrays, meta, **options)


def load_tree(path: str | os.PathLike, **options: Any) -> ArrayTree:
    """The tree :func:`save_tree` saved, exactly (arrays as private, writable copies).

    A file that ``save_tree`` did not write (any safetensors or NPZ file, or
    another reader :func:`fastckpt.open` takes) is nested by splitting its
    names at ``/`` (dicts only). ``options`` go to :func:`fastckpt.open`.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "flat.safetensors")
    >>> import fastckpt
    >>> fastckpt.save_safetensors(path, {"enc/w": np.zeros(1), "enc/b": np.ones(1)})
    >>> load_tree(path)
    {'enc': {'b': array([1.]), 'w': array([0.])}}
    """
    from fastckpt.formats.reader import copies
    from fastckpt.formats.reader import open as open_reader

    options.setdefault("first_window", False)  # copies() reads a cold file with O_DIRECT, not through its window
    with open_reader(path, **options) as f:
        names = list(f.keys())
        # Every tensor's private copy at once: a cold file is read straight into them, all its tensors together.
        f = _Copied(f, copies(f, names))
        metadata = f.metadata or {}
        text = metadata.get(TREE_METADATA_KEY)
        if text is None:
            structure: dict[str, Any] = {}
            for name in names:
                _insert(structure, name, f"{f.path}: tensor {name!r}")
            return _build(structure, "", f, f"{f.path}")
        version = metadata.get(TREE_VERSION_KEY, "1")
        if version not in _READS:
            raise FormatError(f"{f.path}: metadata {TREE_VERSION_KEY!r} is {version!r}; this fastckpt reads tree "
                              f"versions {', '.join(_READS)} (upgrade fastckpt to read it)")
        try:
            structure = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{f.path}: metadata {TREE_METADATA_KEY!r} is not JSON ({e})") from None
        where = f"{f.path}: metadata {TREE_METADATA_KEY!r} (version {version})"
        if not isinstance(structure, dict):
            raise FormatError(f"{where}: the top is a {type(structure).__name__}, not an object")
        listed: list[str] = []
        _placed(structure, "", version, where, listed)
        if len(set(listed)) != len(listed) or set(listed) != set(names):
            raise FormatError(f"{f.path}: metadata {TREE_METADATA_KEY!r} lists "
                              f"{sorted(set(listed) - set(names))[:3]} that the file does not hold, or the file "
                              f"holds {sorted(set(names) - set(listed))[:3]} that it does not list")
        return _build(structure, "", f, where)


class _Copied:
    """The reader ``load_tree`` builds from: ``host(name)`` is the tensor's copy (made by ``reader.copies``)."""

    def __init__(self, reader, arrays: dict):
        self.path, self.metadata, self._arrays = reader.path, reader.metadata, arrays

    def host(self, name: str):
        return self._arrays[name]


def _insert(structure: dict, name: str, where: str) -> None:
    node = structure
    *parents, leaf = name.split(SEPARATOR)
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise FormatError(f"{where}: {part!r} is both a tensor and a prefix of this name; it cannot nest")
        node = child
    if leaf in node:
        raise FormatError(f"{where}: a tensor and a group share this name; it cannot nest")
    node[leaf] = 0


def _join(prefix: str, key: str | int) -> str:
    return f"{prefix}{SEPARATOR}{key}" if prefix else str(key)


def _tag(node: Any, path: str, where: str) -> str:
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise FormatError(f"{where}: the node at {path!r} is {node!r}, not an object, 0 or a tagged list")
    return node[0]


_SHAPES = {"scalar": 1, "none": 1, "bool": 2, "int": 2, "float": 2, "str": 2, "list": 2, "tuple": 2}


def _placed(node: Any, path: str, version: str, where: str, out: list[str]) -> None:
    """Check ``node``'s encoding and collect the tensor paths it places into ``out``."""
    if isinstance(node, dict):
        for key, child in node.items():
            _placed(child, _join(path, key), version, where, out)
        return
    if node == 0 and type(node) is int:
        out.append(path)
        return
    tag = _tag(node, path, where) if version != "1" else None
    if tag not in _SHAPES or len(node) != _SHAPES[tag]:
        raise FormatError(f"{where}: the node at {path!r} is {node!r}; version {version} has "
                          + ("objects and 0 only" if version == "1" else "objects, 0 and the tagged lists "
                             f"{sorted(_SHAPES)}"))
    if tag == "scalar":
        out.append(path)
    elif tag in ("list", "tuple"):
        if not isinstance(node[1], list):
            raise FormatError(f"{where}: the {tag} at {path!r} holds {node[1]!r}, not a list")
        for i, child in enumerate(node[1]):
            _placed(child, _join(path, i), version, where, out)
    elif tag != "none" and not isinstance(node[1], {"bool": bool, "int": str, "float": str, "str": str}[tag]):
        raise FormatError(f"{where}: the {tag} at {path!r} is {node[1]!r}")


def _build(node: Any, path: str, reader: Any, where: str) -> Any:
    if isinstance(node, dict):
        return {key: _build(child, _join(path, key), reader, where) for key, child in node.items()}
    if node == 0 and type(node) is int:
        return reader.host(path)  # a private copy already (load_tree)
    tag, *payload = node
    if tag == "scalar":
        array = reader.host(path)
        if array.ndim != 0:
            raise FormatError(f"{where}: the numpy scalar at {path!r} is stored with shape {list(array.shape)}")
        return array[()].copy()
    if tag in ("list", "tuple"):
        items = [_build(child, _join(path, i), reader, where) for i, child in enumerate(payload[0])]
        return items if tag == "list" else tuple(items)
    if tag == "none":
        return None
    if tag == "bool":
        return payload[0]
    try:
        if tag == "int":
            return int(payload[0])
        if tag == "float":
            value = float(payload[0])
            if not math.isfinite(value) and payload[0] not in ("inf", "-inf", "nan"):
                raise ValueError(payload[0])
            return value
    except ValueError:
        raise FormatError(f"{where}: the {tag} at {path!r} is {payload[0]!r}") from None
    return payload[0]  # str


def _first_not_in_npz(node: Any, path: str) -> tuple[str, str] | None:
    """The path and kind of the first node an NPZ cannot record (only non-empty dicts of arrays fit)."""
    if isinstance(node, dict):
        if not node and path:
            return path, "empty dict"
        for key, child in node.items():
            found = _first_not_in_npz(child, _join(path, key))
            if found is not None:
                return found
        return None
    if node == 0 and type(node) is int:
        return None
    return path, {"scalar": "numpy scalar", "none": "None"}.get(node[0], node[0])
