"""The Checkpointable protocol: name an object's arrays by their attribute paths, save and restore them.

Any Python object works; the :class:`Checkpointable` mixin only adds defaults
and two methods. Walking an object gives every *leaf* (a numpy array, or any
object with ``to_host()`` returning one, such as a device tensor) a name made
of the attribute names on the way to it:

- dataclass fields in declaration order, other objects' instance attributes
  (``vars()``, then ``__slots__``), dict keys (``str(key)``), and list/tuple
  elements as ``[k]`` (the same labels the Swift for TensorFlow module used,
  so its checkpoints keep their names); an object reached twice is walked
  once, under its first path;
- joined by a separator: ``"/"`` unless a class sets ``checkpoint_separator``;
  a class's separator applies below it until another class sets its own;
- ``ignored_tensor_paths`` (a set of ``"Type.attribute"`` strings, with the
  unqualified class name) skips attributes; a class's set applies to its whole
  subtree, so a root model can ignore ``"Attention.scale"`` everywhere;
- the root's ``tensor_name_map`` (``identity_map`` by default, or
  ``lookup_map(table)``, or any ``name -> name`` callable given as a
  ``staticmethod``) maps each path to the checkpoint name. Two paths mapping
  to one name is an error, never a silent overwrite.

Restoring regenerates the names and reads each one *by name* (never by
position), so ignored attributes and non-ASCII names work, and reports what
the checkpoint lacks (``missing``), what it has beyond the object
(``unexpected``) and what differs in shape or dtype (``mismatched``). With
``strict=True`` (the default) any of these raises
:class:`~fastckpt.errors.RestoreMismatchError` *before* anything is changed.

>>> import numpy as np, tempfile
>>> from dataclasses import dataclass
>>> @dataclass
... class Dense:
...     weight: np.ndarray
...     bias: np.ndarray
>>> @dataclass
... class LeNet(Checkpointable):
...     conv1: Dense
...     fc: list
>>> model = LeNet(Dense(np.ones((2, 2), np.float32), np.zeros(2, np.float32)),
...               [Dense(np.ones((2, 1), np.float32), np.zeros(1, np.float32))])
>>> sorted(checkpoint_tensors(model))
['conv1/bias', 'conv1/weight', 'fc/[0]/bias', 'fc/[0]/weight']
>>> d = tempfile.mkdtemp()
>>> _ = model.save_checkpoint(d, "LeNet")
>>> model.conv1.weight[...] = 5
>>> model.restore_checkpoint(d, "LeNet").restored[:2]
['conv1/weight', 'conv1/bias']
>>> model.conv1.weight.tolist()
[[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fastckpt.errors import RestoreMismatchError
from fastckpt.formats.tf.reader import OBJECT_GRAPH_KEY, CheckpointReader
from fastckpt.formats.tf.writer import SAVE_COUNTER_KEY, object_key, write_checkpoint

__all__ = [
    "Checkpointable",
    "identity_map",
    "lookup_map",
    "checkpoint_tensors",
    "save_object",
    "restore_object",
    "RestoreResult",
    "default_assign",
]

DEFAULT_SEPARATOR = "/"


class _IdentityMap:
    """The default name map: every generated path is the checkpoint name.

    A callable object, not a function, so that ``tensor_name_map = identity_map``
    in a class body does not become a bound method.

    >>> identity_map("conv1/filter")
    'conv1/filter'
    """

    def __call__(self, name: str) -> str:
        return name

    def __repr__(self):
        return "identity_map"


identity_map = _IdentityMap()


class lookup_map:  # noqa: N801 - reads as the helper function it replaces
    """A name map from a table; names not in the table map to themselves.

    >>> m = lookup_map({"layers/[0]/weight": "model/h0/w"})
    >>> m("layers/[0]/weight"), m("other")
    ('model/h0/w', 'other')
    """

    def __init__(self, table: Mapping):
        self.table = dict(table)

    def __call__(self, name: str) -> str:
        return self.table.get(name, name)

    def __repr__(self):
        return f"lookup_map({len(self.table)} names)"


class Checkpointable:
    """Mixin with the protocol's defaults and ``save_checkpoint`` / ``restore_checkpoint`` methods.

    Override in a subclass: ``checkpoint_separator`` (str),
    ``ignored_tensor_paths`` (set of ``"Type.attribute"``), ``tensor_name_map``
    (``identity_map``, ``lookup_map(table)`` or a ``staticmethod``).

    >>> import numpy as np
    >>> class Encoder(Checkpointable):
    ...     checkpoint_separator = "."
    ...     ignored_tensor_paths = {"Encoder.cache"}
    ...     def __init__(self):
    ...         self.proj = {"w": np.zeros(2)}
    ...         self.cache = np.zeros(8)
    >>> list(checkpoint_tensors(Encoder()))
    ['proj.w']
    """

    checkpoint_separator = DEFAULT_SEPARATOR
    ignored_tensor_paths: frozenset = frozenset()
    tensor_name_map = identity_map

    def save_checkpoint(self, directory, name: str, **options) -> str:
        """Write this object's arrays to ``directory/name`` (see :func:`save_object`)."""
        return save_object(self, directory, name, **options)

    def restore_checkpoint(self, directory, name: str, **options) -> "RestoreResult":
        """Read this object's arrays back from ``directory/name`` (see :func:`restore_object`)."""
        return restore_object(self, directory, name, **options)


@dataclass
class _Leaf:
    path: str  # generated path, before the name map
    name: str  # checkpoint name
    parent: object
    slot: object  # attribute name (str) for "attr", key/index for "item"
    kind: str  # "attr" or "item"
    value: object


def _is_leaf(value) -> bool:
    return isinstance(value, np.ndarray) or (callable(getattr(value, "to_host", None)) and not isinstance(value, type))


_OPAQUE = (str, bytes, bytearray, int, float, complex, bool, type(None), np.generic, types.ModuleType, type,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _children(obj):
    """``(label, value, slot, kind)`` for each child in a stable order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name), f.name, "attr") for f in dataclasses.fields(obj)
                if hasattr(obj, f.name)]
    if isinstance(obj, Mapping):
        return [(str(k), v, k, "item") for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v, i, "item") for i, v in enumerate(obj)]
    if isinstance(obj, _OPAQUE):  # callable objects (layers with __call__) are walked like any other
        return []
    out = []
    seen = set()
    for name, value in getattr(obj, "__dict__", {}).items():
        out.append((name, value, name, "attr"))
        seen.add(name)
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()) if not isinstance(getattr(cls, "__slots__", ()), str) else \
                (cls.__slots__,):
            if name not in seen and name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.append((name, getattr(obj, name), name, "attr"))
                seen.add(name)
    return out


def _own(cls, attribute: str):
    """``attribute`` as set by ``cls`` or a base other than the mixin itself, else None."""
    for klass in cls.__mro__:
        if klass is Checkpointable or klass is object:
            continue
        if attribute in klass.__dict__:
            return klass.__dict__[attribute]
    return None


def _type_names(obj) -> set:
    cls = type(obj)
    return {cls.__name__, cls.__qualname__}


def _walk(obj, scope, separator, ignored, out, visited, fixed_separator):
    own_sep = None if fixed_separator else _own(type(obj), "checkpoint_separator")
    if own_sep is not None:
        separator = own_sep
    own_ignored = _own(type(obj), "ignored_tensor_paths")
    if own_ignored:
        ignored = ignored | frozenset(own_ignored)
    names = _type_names(obj)
    for label, value, slot, kind in _children(obj):
        if any(f"{t}.{label}" in ignored for t in names):
            continue
        path = label if scope is None else scope + separator + label
        if _is_leaf(value):
            out.append(_Leaf(path, path, obj, slot, kind, value))
        elif id(value) not in visited and not isinstance(value, _OPAQUE):
            # An object reached twice (a shared submodule, a back reference) is walked once, under its
            # first path; this also ends cycles and keeps object webs from exploding.
            visited.add(id(value))
            _walk(value, path, separator, ignored, out, visited, fixed_separator)


def _resolve_map(obj, name_map, name_table) -> Callable:
    if name_map is not None and name_table is not None:
        raise ValueError("pass name_map or name_table, not both")
    if name_table is not None:
        return lookup_map(name_table)
    if name_map is not None:
        return name_map
    return getattr(obj, "tensor_name_map", identity_map)


def _leaves(obj, *, name_map=None, name_table=None, separator=None, ignored=()) -> list:
    root_sep = separator if separator is not None else (_own(type(obj), "checkpoint_separator") or DEFAULT_SEPARATOR)
    out: list = []
    root_ignored = frozenset(ignored) | frozenset(getattr(obj, "ignored_tensor_paths", ()) or ())
    # An explicit separator argument wins over every class's own.
    _walk(obj, None, root_sep, root_ignored, out, {id(obj)}, separator is not None)
    mapping = _resolve_map(obj, name_map, name_table)
    seen: dict = {}
    for leaf in out:
        leaf.name = mapping(leaf.path)
        if not isinstance(leaf.name, str) or not leaf.name:
            raise ValueError(f"the name map turned {leaf.path!r} into {leaf.name!r}; names are non-empty str")
        if leaf.name in seen:
            raise ValueError(f"{seen[leaf.name]!r} and {leaf.path!r} both map to the checkpoint name {leaf.name!r}; "
                             "fix the name map or ignore one of them (ignored_tensor_paths)")
        seen[leaf.name] = leaf.path
    return out


def _host(value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    host = value.to_host()
    if not isinstance(host, np.ndarray):
        raise TypeError(f"{type(value).__name__}.to_host() returned {type(host).__name__}, not a numpy array")
    return host


def checkpoint_tensors(obj, *, name_map=None, name_table=None, separator=None, ignored=()) -> dict:
    """``{checkpoint name: host array}`` for every leaf of ``obj``, in traversal order.

    ``name_map`` / ``name_table`` override the object's ``tensor_name_map``;
    ``separator`` overrides every class's separator; ``ignored`` adds
    ``"Type.attribute"`` entries.

    >>> import numpy as np
    >>> class Fire:
    ...     def __init__(self): self.expand3 = {"filter": np.zeros(1)}
    >>> class SqueezeNet:
    ...     checkpoint_separator = "_"
    ...     def __init__(self): self.fire2 = Fire()
    >>> list(checkpoint_tensors(SqueezeNet()))
    ['fire2_expand3_filter']
    """
    return {leaf.name: _host(leaf.value)
            for leaf in _leaves(obj, name_map=name_map, name_table=name_table, separator=separator, ignored=ignored)}


def save_object(obj, directory, name: str, *, name_map=None, name_table=None, separator=None, ignored=(),
                object_graph: bool = False, **write_options) -> str:
    """Write the arrays of ``obj`` as the TensorFlow checkpoint ``directory/name``; returns the prefix.

    ``write_options`` go to :func:`fastckpt.tf.write_checkpoint`
    (``num_shards``, ``data_alignment``, ``fsync``). With ``object_graph=True``
    the checkpoint uses TensorFlow's object-based keys (names split at ``/``).

    >>> import numpy as np, tempfile, os
    >>> class Model:
    ...     def __init__(self): self.w = np.arange(2.0)
    >>> os.path.basename(save_object(Model(), tempfile.mkdtemp(), "model"))
    'model'
    """
    tensors = checkpoint_tensors(obj, name_map=name_map, name_table=name_table, separator=separator, ignored=ignored)
    prefix = os.path.join(os.fspath(directory), name)
    write_checkpoint(prefix, tensors, object_graph=object_graph, **write_options)
    return prefix


@dataclass
class RestoreResult:
    """What :func:`restore_object` did: names restored, missing from the file, unexpected in it, mismatched.

    ``mismatched`` holds ``(name, expected, found)`` with ``"dtype[shape]"``
    strings. ``ok`` is true when all three problem lists are empty.

    >>> result = RestoreResult(restored=["w"], missing=["b"])
    >>> result.ok, result.summary()
    (False, "1 restored; 1 missing ('b')")
    """

    restored: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        parts = [f"{len(self.restored)} restored"]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(map(repr, names[:8])) + (" ..." if len(names) > 8 else "")
                parts.append(f"{len(names)} {label} ({shown})")
        if self.mismatched:
            shown = ", ".join(f"{n!r}: object has {e}, checkpoint has {f}" for n, e, f in self.mismatched[:8])
            parts.append(f"{len(self.mismatched)} mismatched ({shown})")
        return "; ".join(parts)


def default_assign(current, array: np.ndarray):
    """Put ``array`` into the leaf ``current``; returns a replacement leaf, or None when done in place.

    In order: ``current.write(array)`` if it has one (device tensors); a
    writable numpy array is overwritten in place (other references to it see
    the new values); ``type(current).from_host(array)`` if that exists;
    otherwise a new numpy array (a copy, never a view of the file).

    >>> current = np.zeros(2)
    >>> default_assign(current, np.array([1.0, 2.0])) is None, current.tolist()
    (True, [1.0, 2.0])
    """
    if callable(getattr(current, "write", None)) and not isinstance(current, np.ndarray):
        current.write(array)
        return None
    if isinstance(current, np.ndarray):
        if current.flags.writeable:
            np.copyto(current, array)
            return None
        return np.array(array)
    from_host = getattr(type(current), "from_host", None)
    if callable(from_host):
        return from_host(array)
    return np.array(array)


def _describe(dtype, shape) -> str:
    return f"{np.dtype(dtype)}{list(shape)}"


def _leaf_signature(value):
    if isinstance(value, np.ndarray):
        return value.dtype, value.shape
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    try:
        return np.dtype(dtype), tuple(shape)
    except TypeError:
        return None


def restore_object(obj, directory, name: str, *, strict: bool = True, name_map=None, name_table=None,
                   separator=None, ignored=(), assign: Callable | None = None, verify: bool = True) -> RestoreResult:
    """Restore the arrays of ``obj`` from the checkpoint ``directory/name``, matching by name.

    Every leaf's checkpoint name (see the module docstring) is looked up as
    stored, then as its object-based key (``name/.ATTRIBUTES/VARIABLE_VALUE``)
    so that checkpoints written with ``object_graph=True`` restore too. Shapes
    and dtypes must match exactly. With ``strict=True`` any missing,
    unexpected or mismatched tensor raises
    :class:`~fastckpt.errors.RestoreMismatchError` before the object is
    touched; with ``strict=False`` the matching tensors are restored and the
    :class:`RestoreResult` lists the rest. Every tensor is read and verified
    before any is assigned: a checksum failure changes nothing.
    ``assign(current, array)`` replaces :func:`default_assign` (return the new
    leaf, or None if it updated in place).

    >>> import tempfile
    >>> class Model:
    ...     def __init__(self, v): self.w = np.full(2, v)
    >>> d = tempfile.mkdtemp()
    >>> _ = save_object(Model(3.0), d, "m")
    >>> model = Model(0.0)
    >>> restore_object(model, d, "m").restored, model.w.tolist()
    (['w'], [3.0, 3.0])
    """
    assign = assign or default_assign
    leaves = _leaves(obj, name_map=name_map, name_table=name_table, separator=separator, ignored=ignored)
    prefix = os.path.join(os.fspath(directory), name)
    result = RestoreResult()
    with CheckpointReader(prefix, verify=verify) as reader:
        has_graph = reader.has_tensor(OBJECT_GRAPH_KEY)
        consumed = set()
        plan = []
        for leaf in leaves:
            key = leaf.name
            if not reader.has_tensor(key):
                try:
                    alt = object_key(key)
                except ValueError:
                    alt = None
                if alt is not None and reader.has_tensor(alt):
                    key = alt
                else:
                    result.missing.append(leaf.name)
                    continue
            consumed.add(key)
            info = reader.info(key)
            signature = _leaf_signature(leaf.value)
            if signature is not None and (signature[0] != info.dtype or tuple(signature[1]) != info.shape):
                result.mismatched.append((leaf.name, _describe(*signature), _describe(info.dtype, info.shape)))
                continue
            plan.append((leaf, key))
        bookkeeping = {OBJECT_GRAPH_KEY, SAVE_COUNTER_KEY} if has_graph else set()
        result.unexpected = [n for n in reader.tensor_names() if n not in consumed and n not in bookkeeping]
        if strict and not result.ok:
            raise RestoreMismatchError(f"{prefix}: the checkpoint does not match the object: {result.summary()} "
                                       "(restore_object(..., strict=False) restores what matches)", result)
        # Every tensor is read (and its checksum verified) before the first one is assigned, so a damaged
        # file leaves the object as it was rather than half restored. Reads are views of the mapping.
        arrays = [reader.read_tensor(key, copy=bool(reader.info(key).slices)) for _leaf, key in plan]
        if assign is default_assign:  # what default_assign must replace, it cannot replace inside a tuple
            for leaf, _key in plan:
                if isinstance(leaf.parent, tuple) and not _assigned_in_place(leaf.value):
                    _replace(leaf, None)  # raises the TypeError that names the leaf, before any change
        for (leaf, _key), array in zip(plan, arrays):
            replacement = assign(leaf.value, array)
            if replacement is not None:
                _replace(leaf, replacement)
            result.restored.append(leaf.name)
    return result


def _assigned_in_place(value) -> bool:
    """True when :func:`default_assign` updates ``value`` itself rather than returning a replacement."""
    if isinstance(value, np.ndarray):
        return value.flags.writeable
    return callable(getattr(value, "write", None))


def _replace(leaf: _Leaf, value) -> None:
    if leaf.kind == "attr":
        setattr(leaf.parent, leaf.slot, value)
    elif isinstance(leaf.parent, tuple):
        raise TypeError(f"{leaf.path!r} lives in a tuple and its array cannot be replaced; use a list, or a writable "
                        "array that can be updated in place")
    else:
        leaf.parent[leaf.slot] = value
