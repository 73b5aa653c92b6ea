"""The one codec for state trees: a state value to a JSON-safe tree and back, in three dialects.

A *state* is what :func:`fastckpt.state.state_of` returns: dicts, lists,
tuples, strings, numbers, booleans, ``None``, numpy scalars, bytes and arrays,
nested. JSON holds only some of these, so the codec writes the rest as tagged
objects. One walker does the work for every checkpoint in fastckpt; what it
writes for each kind of value is set by a :class:`Dialect`, and each on-disk
format uses exactly one dialect:

=========================  ===================  =====================  ======================
value                      ``TRAIN_TREE``       ``STATEFUL_JSON``      ``PARAM_SIDECAR``
                           (training dirs)      (stateful JSON)        (netcl ``.json``)
=========================  ===================  =====================  ======================
int, ``|i| < 2**53``       itself               itself                 itself
int, larger                ``{"__int__": "d"}``  itself                itself
non-finite float           ``{"__float__": "nan" | "inf" | "-inf"}``   bare ``NaN``/``Infinity``
numpy scalar               ``{"__scalar__":     its Python value (``.item()``; bool, int, float,
                           {dtype, data}}``     str); other kinds refused
tuple                      ``{"__tuple__": []}``  a list               a list
bytes                      refused              ``{"__bytes__": b64}``  refused
bytearray, memoryview      an array (uint8      ``{"__bytes__": b64}``  an array (uint8
                           for raw bytes)                               for raw bytes)
dict, str keys             object (keys may     object; keys           object; key
                           not start ``__``)    ``__ndarray__``,        ``__fastckpt_array__``
                                                ``__bytes__``,          refused
                                                ``__float__`` refused
other dict                 ``{"__dict__":       refused                refused
                           [[k, v], ...]}``
array                      to a tensor file     inline ``__ndarray__``  to the NPZ:
                           (``{"__tensor__":    (:mod:`fastckpt.state.  ``{"__fastckpt_array__":
                           name}``) or inline   arrays`)               "optim_state.<n>"}``
=========================  ===================  =====================  ======================

Every dialect refuses everything else (sets, arbitrary objects, object
arrays, reference cycles) with an error that names the path of the value
inside the state (``model['layers'][0]['fn']``); nothing is ever pickled. A
:class:`StateObject` (the states of :mod:`fastckpt.stateful`'s RNG and
readers) is encoded as the dict it holds.

Decoding recognises exactly the tags of its dialect and refuses malformed
ones with a ``FormatError`` naming where they sit.

>>> import numpy as np
>>> encode({"t": (1, 2**60), "w": np.arange(2, dtype="<i2")}, TRAIN_TREE)
{'t': {'__tuple__': [1, {'__int__': '1152921504606846976'}]}, 'w': {'__ndarray__': 'AAABAA==', 'dtype': '<i2', 'shape': [2]}}
>>> encode({"t": (1, 2**60), "b": b"ok"}, STATEFUL_JSON)
{'t': [1, 1152921504606846976], 'b': {'__bytes__': 'b2s='}}
>>> decode({"__tuple__": [{"__float__": "inf"}]}, TRAIN_TREE)
(inf,)
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fastckpt.errors import FormatError
from fastckpt.state.arrays import ARRAY_TAG, as_numpy, decode_array, dtype_token, encode_array, parse_dtype

__all__ = [
    "Dialect",
    "TRAIN_TREE",
    "STATEFUL_JSON",
    "PARAM_SIDECAR",
    "encode",
    "decode",
    "dumps",
    "StateObject",
    "ArraySink",
    "TensorRefs",
    "NumberedArrays",
]

_MAX_SAFE_INT = 2**53
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(frozen=True)
class Dialect:
    """What the walker writes for the value kinds on which the formats differ (see the module table)."""

    name: str
    tag_big_ints: bool  # |i| >= 2**53 as {"__int__": "<decimal>"}
    tag_nonfinite: bool  # {"__float__": ...}; else bare (json.dumps writes NaN / Infinity)
    tag_numpy_scalars: bool  # {"__scalar__": ...}; else their Python value
    tag_tuples: bool  # {"__tuple__": [...]}; else lists
    tag_bytes: bool  # {"__bytes__": b64}; else refused
    pair_odd_dicts: bool  # dicts with non-str or "__" keys as {"__dict__": pairs}; else refused
    any_mapping: bool  # any collections.abc.Mapping is a dict; else only dict
    reserved_keys: frozenset[str]  # str keys a dict of the state may not use
    reserved_error: type[Exception]  # raised for a reserved key
    tags: frozenset[str]  # the single-key tags decode() resolves (besides the inline array object)
    array_ref: str | None  # the single-key tag of an array stored elsewhere ({tag: name})
    inline_arrays: bool  # decode() reads the inline array object ({"__ndarray__": ..., "dtype", "shape"})


TRAIN_TREE = Dialect(
    "training checkpoint tree", tag_big_ints=True, tag_nonfinite=True, tag_numpy_scalars=True, tag_tuples=True,
    tag_bytes=False, pair_odd_dicts=True, any_mapping=True, reserved_keys=frozenset(), reserved_error=TypeError,
    tags=frozenset(("__int__", "__float__", "__tuple__", "__dict__", "__scalar__")), array_ref="__tensor__",
    inline_arrays=True,
)
STATEFUL_JSON = Dialect(
    "stateful JSON", tag_big_ints=False, tag_nonfinite=True, tag_numpy_scalars=False, tag_tuples=False,
    tag_bytes=True, pair_odd_dicts=False, any_mapping=False,
    reserved_keys=frozenset((ARRAY_TAG, "__bytes__", "__float__")), reserved_error=TypeError,
    tags=frozenset(("__bytes__", "__float__")), array_ref=None, inline_arrays=True,
)
PARAM_SIDECAR = Dialect(
    "parameter checkpoint sidecar", tag_big_ints=False, tag_nonfinite=False, tag_numpy_scalars=False,
    tag_tuples=False, tag_bytes=False, pair_odd_dicts=False, any_mapping=False,
    reserved_keys=frozenset(("__fastckpt_array__",)), reserved_error=ValueError,
    tags=frozenset(), array_ref="__fastckpt_array__", inline_arrays=False,
)


def dumps(tree: Any) -> str:
    """The canonical JSON text of an encoded tree: ASCII, sorted keys, no spaces (the stateful files' form).

    >>> dumps({"b": 1, "a": [1.5, None]})
    '{"a":[1.5,null],"b":1}'
    """
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


# -- where arrays go ------------------------------------------------------------------------------
class ArraySink:
    """Receives the arrays of a state tree; returns what the tree holds in their place.

    The base class writes each array inline (the tagged base64 object of
    :mod:`fastckpt.state.arrays`).
    """

    def put(self, path: tuple, array: np.ndarray, source: Any, where: Callable[[], str]) -> Any:
        return encode_array(array, where())


INLINE = ArraySink()


class TensorRefs(ArraySink):
    """Arrays go to a tensor table under their '.'-joined path: ``{"__tensor__": "layers.0.weight"}``.

    ``table.add(name, array, source)`` stores the array (or records it as an
    alias of one stored before); see :class:`fastckpt.train.format.ArrayTable`.
    """

    def __init__(self, table: Any, tag: str = "__tensor__") -> None:
        self.table, self.tag = table, tag

    def put(self, path: tuple, array: np.ndarray, source: Any, where: Callable[[], str]) -> Any:
        name = ".".join(str(key) for key in path)
        self.table.add(name, array, source)
        return {self.tag: name}


class NumberedArrays(ArraySink):
    """Arrays numbered in depth-first order under a prefix: ``{"__fastckpt_array__": "optim_state.0"}``.

    ``arrays`` receives ``(name, array)`` pairs.
    """

    def __init__(self, prefix: str, arrays: list, tag: str = "__fastckpt_array__") -> None:
        self.prefix, self.arrays, self.tag = prefix, arrays, tag

    def put(self, path: tuple, array: np.ndarray, source: Any, where: Callable[[], str]) -> Any:
        name = f"{self.prefix}.{len(self.arrays)}"
        self.arrays.append((name, array))
        return {self.tag: name}


# -- encoding -------------------------------------------------------------------------------------
def _where(root: str, path: tuple) -> str:
    return root + "".join(f"[{key!r}]" for key in path)


def encode(value: Any, dialect: Dialect, arrays: ArraySink = INLINE, where: str = "state") -> Any:
    """``value`` as a tree that ``json.dumps`` accepts, in ``dialect``; arrays go to ``arrays``.

    Raises ``TypeError`` (``ValueError`` for a reference cycle or a reserved
    key where the dialect says so) naming the path of the first value that
    cannot be stored, ``where`` being the name of the root.

    >>> encode({"x": (1, float("inf")), "b": b"ab"}, STATEFUL_JSON)
    {'x': [1, {'__float__': 'inf'}], 'b': {'__bytes__': 'YWI='}}
    >>> encode({"ok": [1]}, PARAM_SIDECAR, where="config")
    {'ok': [1]}
    >>> encode({"s": {1, 2}}, PARAM_SIDECAR, where="config")
    Traceback (most recent call last):
    TypeError: config['s']: a builtins.set cannot be stored in a parameter checkpoint sidecar (allowed: dict with str keys, list, tuple, str, int, float, bool, None, numpy scalars and arrays)
    """
    return _Encoder(dialect, arrays, where).walk(value, ())


class _Encoder:
    __slots__ = ("d", "arrays", "root", "active")

    def __init__(self, dialect: Dialect, arrays: ArraySink, root: str) -> None:
        self.d, self.arrays, self.root, self.active = dialect, arrays, root, set()

    def where(self, path: tuple) -> str:
        return _where(self.root, path)

    def walk(self, value: Any, path: tuple) -> Any:
        d = self.d
        # numpy scalars first: np.float64 and np.str_ are also float and str, and would lose their type.
        if isinstance(value, np.generic):
            return self.scalar(value, path)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            if d.tag_big_ints and abs(value) >= _MAX_SAFE_INT:
                return {"__int__": str(int(value))}
            return int(value)
        if isinstance(value, float):
            if not d.tag_nonfinite or math.isfinite(value):
                return float(value)
            return {"__float__": repr(float(value))}
        if isinstance(value, (list, tuple)) or isinstance(value, dict if not d.any_mapping else Mapping):
            return self.container(value, path)
        if isinstance(value, StateObject):
            return value._json_tree() if d is STATEFUL_JSON else self.walk(value.to_dict(), path)
        if isinstance(value, (bytes, bytearray, memoryview)):
            if d.tag_bytes:
                return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
            if isinstance(value, bytes):
                raise self.refusal(value, path)
            # Where bytes are refused, a bytearray or memoryview is a buffer: an array, uint8 for raw bytes.
        try:
            array = as_numpy(value)
        except (TypeError, ValueError, RuntimeError, BufferError) as exc:  # a framework dtype numpy has not
            dtype = getattr(value, "dtype", None)
            raise TypeError(f"{self.where(path)}: {type(value).__name__} of dtype {dtype} cannot be stored ({exc}); "
                            "convert it to a dtype numpy or ml_dtypes has (bfloat16, float8 and float16 are kept "
                            "as they are)") from exc
        if array is None:
            raise self.refusal(value, path)
        if array.dtype.hasobject:
            raise TypeError(f"{self.where(path)}: numpy array of dtype {array.dtype!r} cannot be stored (an object "
                            "array; only numeric arrays can be: nothing is pickled)")
        return self.arrays.put(path, array, value, lambda: self.where(path))

    def scalar(self, value: np.generic, path: tuple) -> Any:
        if self.d.tag_numpy_scalars:
            token = dtype_token(value.dtype, self.where(path))
            return {"__scalar__": {"dtype": token, "data": base64.b64encode(value.tobytes()).decode("ascii")}}
        if isinstance(value, np.str_):
            return str(value)
        if isinstance(value, (np.bool_, np.integer, np.floating)):
            return self.walk(value.item(), path)
        raise TypeError(
            f"{self.where(path)}: numpy scalar of type {type(value).__name__} cannot be stored in a {self.d.name}; "
            "wrap it in np.asarray(...)"
        )

    def container(self, value: Any, path: tuple) -> Any:
        if id(value) in self.active:
            raise ValueError(f"{self.where(path)}: the state contains a reference cycle "
                             "(a container that holds itself cannot be stored)")
        self.active.add(id(value))
        try:
            if isinstance(value, list):
                return [self.walk(item, (*path, i)) for i, item in enumerate(value)]
            if isinstance(value, tuple):
                items = [self.walk(item, (*path, i)) for i, item in enumerate(value)]
                return {"__tuple__": items} if self.d.tag_tuples else items
            return self.mapping(value, path)
        finally:
            self.active.discard(id(value))

    def mapping(self, value: Mapping, path: tuple) -> Any:
        d = self.d
        if d.pair_odd_dicts:
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.walk(v, (*path, k)) for k, v in value.items()}
            # A key is written as a value; arrays among keys (hashable tensors) go inline, never to the table.
            keys = _Encoder(d, INLINE, self.root)
            return {"__dict__": [[keys.walk(k, path), self.walk(v, (*path, k))] for k, v in value.items()]}
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{self.where(path)}: dict key {key!r} is a {type(key).__name__}; "
                                f"{d.name} keys must be str")
            if key in d.reserved_keys:
                raise d.reserved_error(f"{self.where(path)}: dict key {key!r} is reserved for the {d.name} encoding")
            out[key] = self.walk(item, (*path, key))
        return out

    def refusal(self, value: Any, path: tuple) -> TypeError:
        allowed = ["dict" if self.d.pair_odd_dicts else "dict with str keys", "list", "tuple", "str", "int", "float", "bool", "None"]
        if self.d.tag_bytes:
            allowed.append("bytes")
        allowed.append("numpy scalars and arrays")
        return TypeError(
            f"{self.where(path)}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in a "
            f"{self.d.name} (allowed: {', '.join(allowed)})"
        )


# -- decoding -------------------------------------------------------------------------------------
def decode(tree: Any, dialect: Dialect, tensor: Callable[[str], np.ndarray] | None = None,
           where: str = "state") -> Any:
    """Invert :func:`encode` on a parsed JSON tree; ``tensor(name)`` supplies arrays stored elsewhere.

    Only ``dialect``'s tags are resolved; a malformed one, or a name ``tensor`` answers with ``KeyError``,
    raises ``FormatError``.

    >>> decode({"__float__": "-inf"}, STATEFUL_JSON)
    -inf
    >>> decode({"m": {"__fastckpt_array__": "optim_state.0"}}, PARAM_SIDECAR, tensor=lambda name: name.upper())
    {'m': 'OPTIM_STATE.0'}
    """
    return _Decoder(dialect, tensor, where).walk(tree, ())


class _Decoder:
    __slots__ = ("d", "tensor", "root")

    def __init__(self, dialect: Dialect, tensor: Callable[[str], np.ndarray] | None, root: str) -> None:
        self.d, self.tensor, self.root = dialect, tensor, root

    def walk(self, tree: Any, path: tuple) -> Any:
        if isinstance(tree, list):
            return [self.walk(v, (*path, i)) for i, v in enumerate(tree)]
        if isinstance(tree, dict):
            if self.d.inline_arrays and ARRAY_TAG in tree:
                return decode_array(tree, _where(self.root, path))
            if len(tree) == 1:
                (tag, body), = tree.items()
                if tag in self.d.tags or tag == self.d.array_ref:
                    return self.tagged(tag, body, path)
            if not self.d.pair_odd_dicts:  # "__" keys are only ever tags: a tag among other keys is malformed
                for tag in self.d.tags:
                    if tag in tree:
                        raise FormatError(f"{_where(self.root, path)}: malformed {tag} object {dumps(tree)[:80]}")
            return {k: self.walk(v, (*path, k)) for k, v in tree.items()}
        if isinstance(tree, float) and self.d.tag_nonfinite and not math.isfinite(tree):
            raise FormatError(
                f"{_where(self.root, path)}: bare non-finite float {tree!r}; they are written as {{'__float__': ...}}"
            )
        return tree

    def tagged(self, tag: str, body: Any, path: tuple) -> Any:
        where = _where(self.root, path)
        try:
            if tag == self.d.array_ref:
                if not isinstance(body, str):
                    raise TypeError(f"the array name must be a string, got {body!r}")
                if self.tensor is None:
                    raise FormatError(f"{where}: a tensor reference {body!r} where none is allowed")
                try:
                    return self.tensor(body)
                except KeyError:
                    raise FormatError(f"{where} refers to array {body!r}, which is not stored") from None
            if tag == "__float__":
                if body not in _NONFINITE:
                    raise ValueError(f"{body!r} is not one of {sorted(_NONFINITE)}")
                return _NONFINITE[body]
            if tag == "__bytes__":
                return _b64(body, where)
            if tag == "__int__":
                if not isinstance(body, str):
                    raise TypeError(f"the integer must be a decimal string, got {body!r}")
                return int(body)
            if tag == "__tuple__":
                return tuple(self.walk(v, (*path, i)) for i, v in enumerate(body))
            if tag == "__dict__":
                return {self.walk(k, path): self.walk(v, (*path, k)) for k, v in body}
            if tag == "__scalar__":
                dtype = parse_dtype(body["dtype"], where)
                raw = _b64(body["data"], where)
                if len(raw) != dtype.itemsize:
                    raise ValueError(f"{len(raw)} bytes of data for a {dtype} scalar of {dtype.itemsize}")
                return np.frombuffer(raw, dtype=dtype)[0]
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: malformed {tag} entry {json.dumps(body)[:120]}: {exc}") from None
        raise AssertionError(tag)  # pragma: no cover - every tag of every dialect is handled above


def _b64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise FormatError(f"{where}: base64 data must be a string, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise FormatError(f"{where}: invalid base64 ({exc})") from None


# -- immutable state values -----------------------------------------------------------------------
class StateObject:
    """An immutable, JSON-safe state snapshot that converts to a string with ``str()``.

    Subclasses (:class:`~fastckpt.stateful.RNGState`,
    :class:`~fastckpt.stateful.ReaderState`) hold their data as canonical JSON
    text in the :data:`STATEFUL_JSON` dialect, so a snapshot cannot change
    after it was taken and two equal states have equal strings.

    >>> from fastckpt.stateful import RNG
    >>> s = RNG(seed=1).get_state()
    >>> type(s).from_string(str(s)) == s
    True
    """

    __slots__ = ("_text",)

    def __init__(self, data: dict):
        if not isinstance(data, dict):
            raise TypeError(f"{type(self).__name__} needs a dict, got {type(data).__name__}")
        # decode() first so that both forms are accepted: to_dict() (numpy arrays) and to_json() (tagged).
        where = type(self).__name__
        tree = encode(decode(data, STATEFUL_JSON, where=where), STATEFUL_JSON, where=where)
        object.__setattr__(self, "_text", dumps(tree))

    @classmethod
    def from_string(cls, text: str):
        """Parse the ``str()`` form back into a state object.

        >>> from fastckpt.stateful import RNG, RNGState
        >>> s = RNG(seed=2).get_state()
        >>> RNGState.from_string(str(s)) == s
        True
        """
        if not isinstance(text, str):
            raise TypeError(f"{cls.__name__}.from_string needs a str, got {type(text).__name__}")
        try:
            tree = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"{cls.__name__}: not valid JSON ({exc}): {text[:80]!r}") from None
        if not isinstance(tree, dict):
            raise FormatError(f"{cls.__name__}: expected a JSON object, got {type(tree).__name__}")
        return cls(decode(tree, STATEFUL_JSON, where=cls.__name__))

    @classmethod
    def coerce(cls, value):
        """Accept a state object, its ``str()`` form, or its ``to_dict()`` / ``to_json()`` form.

        >>> from fastckpt.stateful import RNG, RNGState
        >>> s = RNG(seed=2).get_state()
        >>> RNGState.coerce(str(s)) == RNGState.coerce(s.to_dict()) == s
        True
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_string(value)
        if isinstance(value, dict):
            return cls(value)
        raise TypeError(
            f"expected a {cls.__name__}, its str() form or its to_dict() form, got {type(value).__name__}"
        )

    def to_dict(self) -> dict:
        """A fresh copy of the state (arrays decoded back to numpy).

        >>> from fastckpt.stateful import RNG
        >>> RNG(seed=2, bit_generator="Philox").get_state().to_dict()["state"]["key"].dtype
        dtype('uint64')
        """
        return decode(json.loads(self._text), STATEFUL_JSON)

    def to_json(self) -> dict:
        """A fresh JSON-safe copy of the state (arrays as tagged base64 objects), to embed in other JSON.

        >>> import json
        >>> from fastckpt.stateful import RNG
        >>> s = RNG(seed=2, bit_generator="Philox").get_state()
        >>> type(s)(json.loads(json.dumps(s.to_json()))) == s
        True
        """
        return json.loads(self._text)

    def _json_tree(self):
        return json.loads(self._text)

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        text = self._text if len(self._text) <= 120 else self._text[:117] + "..."
        return f"{type(self).__name__}({text})"

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._text == other._text

    def __hash__(self):
        return hash((type(self).__name__, self._text))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    # Immutable: copies may share; pickling (e.g. to another process) carries only the JSON text.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (type(self).from_string, (self._text,))
