"""JSON-safe encoding of state values, shared by RNG, reader and checkpoint states.

A state is a tree of dicts (string keys), lists, strings, integers, floats,
booleans and ``None``, with three extras that plain JSON cannot carry, each
written as a tagged object:

* a numpy array -> ``{"__ndarray__": <base64 of its C-order bytes>,
  "dtype": <dtype>, "shape": [<int>, ...]}``;
* ``bytes`` -> ``{"__bytes__": <base64>}``;
* a non-finite float -> ``{"__float__": "nan" | "inf" | "-inf"}``.

Nothing is ever pickled: object arrays and other Python objects are refused
with an error naming where in the state they sit. The full byte-level rules are
in :mod:`fastckpt.stateful.checkpoint`.

>>> import numpy as np
>>> tree = encode({"step": 3, "w": np.arange(3, dtype="<i2")})
>>> tree["w"]
{'__ndarray__': 'AAABAAIA', 'dtype': '<i2', 'shape': [3]}
>>> decode(tree)["w"].tolist()
[0, 1, 2]
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import numpy as np

from fastckpt.errors import FormatError

__all__ = [
    "StateObject",
    "encode",
    "decode",
    "dumps",
    "encode_array",
    "decode_array",
    "dtype_token",
    "parse_dtype",
    "ARRAY_TAG",
    "BYTES_TAG",
    "FLOAT_TAG",
]

ARRAY_TAG = "__ndarray__"
BYTES_TAG = "__bytes__"
FLOAT_TAG = "__float__"
_TAGS = (ARRAY_TAG, BYTES_TAG, FLOAT_TAG)
_ARRAY_KEYS = frozenset((ARRAY_TAG, "dtype", "shape"))
# Kinds whose bytes mean the same on every machine given dtype.str (byte order included).
_PLAIN_KINDS = frozenset("biufcSU")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def dumps(tree: Any) -> str:
    """The canonical JSON text of an encoded tree: ASCII, sorted keys, no spaces.

    >>> dumps({"b": 1, "a": [1.5, None]})
    '{"a":[1.5,null],"b":1}'
    """
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


class StateObject:
    """An immutable, JSON-safe state snapshot that converts to a string with ``str()``.

    Subclasses (:class:`~fastckpt.stateful.RNGState`,
    :class:`~fastckpt.stateful.ReaderState`) hold their data as canonical JSON
    text, so a snapshot cannot change after it was taken and two equal states
    have equal strings.

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
        object.__setattr__(self, "_text", dumps(encode(decode(data, where=type(self).__name__))))

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
        return cls(decode(tree, where=cls.__name__))

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
        return decode(json.loads(self._text))

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


def _ml_dtype(name: str) -> np.dtype | None:
    import ml_dtypes

    ext = getattr(ml_dtypes, name, None)
    if ext is None or not isinstance(ext, type) or not issubclass(ext, np.generic):
        return None
    return np.dtype(ext)


def dtype_token(dtype: np.dtype, where: str = "state") -> str:
    """The string a JSON state stores for ``dtype``: ``dtype.str`` or an ml_dtypes name; refuses the rest.

    >>> dtype_token(np.dtype(">i4")), dtype_token(parse_dtype("bfloat16"))
    ('>i4', 'bfloat16')
    """
    # ml_dtypes types first: their dtype.str ('<V2', '<f1') does not name them.
    if dtype.fields is None and _ml_dtype(dtype.name) == dtype and dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.name
    if dtype.kind in _PLAIN_KINDS and np.dtype(dtype.str) == dtype:
        return dtype.str
    raise TypeError(
        f"{where}: numpy array of dtype {dtype!r} cannot be stored in a JSON state "
        "(only bool, integer, float, complex, bytes/str and ml_dtypes arrays; nothing is pickled)"
    )


def parse_dtype(token: Any, where: str = "state") -> np.dtype:
    """Invert :func:`dtype_token`; anything else raises ``FormatError`` (never an object dtype).

    >>> parse_dtype("<f2"), parse_dtype("float8_e4m3fn")
    (dtype('float16'), dtype(float8_e4m3fn))
    """
    if not isinstance(token, str):
        raise FormatError(f"{where}: array dtype must be a string, got {token!r}")
    if token.isidentifier():
        dtype = _ml_dtype(token)
        if dtype is None:
            raise FormatError(f"{where}: unknown array dtype {token!r} (not an ml_dtypes type)")
        return dtype
    try:
        dtype = np.dtype(token)
    except TypeError:
        raise FormatError(f"{where}: unknown array dtype {token!r}") from None
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None:
        raise FormatError(f"{where}: array dtype {token!r} is not allowed (object and structured arrays are refused)")
    return dtype


def encode(value: Any, where: str = "state") -> Any:
    """Turn a state into a tree that ``json.dumps(..., allow_nan=False)`` accepts.

    Tuples become lists; numpy integer/float/bool scalars become Python
    scalars of the same value. Raises ``TypeError`` (or ``ValueError`` for a
    reference cycle) naming the path of the first value that cannot be stored.

    >>> encode({"x": (1, float("inf")), "b": b"ab"})
    {'x': [1, {'__float__': 'inf'}], 'b': {'__bytes__': 'YWI='}}
    """
    return _encode(value, where, set())


def _encode(value: Any, where: str, active: set) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {FLOAT_TAG: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, StateObject):
        return value._json_tree()
    if isinstance(value, np.ndarray):
        return encode_array(value, where)
    if isinstance(value, np.generic):
        if isinstance(value, (np.bool_, np.integer, np.floating)) and not isinstance(value, np.timedelta64):
            return _encode(value.item(), where, active)
        raise TypeError(
            f"{where}: numpy scalar of type {type(value).__name__} cannot be stored; wrap it in np.asarray(...)"
        )
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (dict, list, tuple)):
        if id(value) in active:
            raise ValueError(f"{where}: the state contains a reference cycle")
        active.add(id(value))
        try:
            if isinstance(value, dict):
                out = {}
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise TypeError(
                            f"{where}: dict key {key!r} is a {type(key).__name__}; JSON states need str keys"
                        )
                    if key in _TAGS:
                        raise TypeError(f"{where}: dict key {key!r} is reserved for the JSON state encoding")
                    out[key] = _encode(item, f"{where}[{key!r}]", active)
                return out
            return [_encode(item, f"{where}[{i}]", active) for i, item in enumerate(value)]
        finally:
            active.discard(id(value))
    raise TypeError(
        f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in a JSON state "
        "(allowed: dict with str keys, list, tuple, str, int, float, bool, None, bytes, numpy arrays and scalars)"
    )


def decode(tree: Any, where: str = "state") -> Any:
    """Invert :func:`encode` on a parsed JSON tree; malformed tags raise ``FormatError``.

    >>> decode({"__float__": "-inf"})
    -inf
    """
    if isinstance(tree, dict):
        if ARRAY_TAG in tree:
            return decode_array(tree, where)
        if BYTES_TAG in tree:
            if set(tree) != {BYTES_TAG} or not isinstance(tree[BYTES_TAG], str):
                raise FormatError(f"{where}: malformed bytes object {dumps(tree)[:80]}")
            return _b64(tree[BYTES_TAG], where)
        if FLOAT_TAG in tree:
            token = tree[FLOAT_TAG]
            if set(tree) != {FLOAT_TAG} or token not in _NONFINITE:
                raise FormatError(f"{where}: malformed non-finite float {dumps(tree)[:80]}")
            return _NONFINITE[token]
        return {key: decode(item, f"{where}[{key!r}]") for key, item in tree.items()}
    if isinstance(tree, list):
        return [decode(item, f"{where}[{i}]") for i, item in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        raise FormatError(f"{where}: bare non-finite float {tree!r}; they are written as {{{FLOAT_TAG!r}: ...}}")
    return tree


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise FormatError(f"{where}: invalid base64 ({exc})") from None


def encode_array(array: np.ndarray, where: str = "state") -> dict:
    """The tagged JSON object of one array: its C-order bytes in base64, dtype token and shape.

    >>> encode_array(np.array([[1], [2]], dtype="<u2"))
    {'__ndarray__': 'AQACAA==', 'dtype': '<u2', 'shape': [2, 1]}
    """
    token = dtype_token(array.dtype, where)
    data = np.ascontiguousarray(array).tobytes()
    return {ARRAY_TAG: base64.b64encode(data).decode("ascii"), "dtype": token, "shape": list(array.shape)}


def decode_array(tree: dict, where: str = "state") -> np.ndarray:
    """Invert :func:`encode_array`: a C-contiguous, writable array; a malformed object raises ``FormatError``.

    >>> decode_array({"__ndarray__": "AQACAA==", "dtype": "<u2", "shape": [2, 1]}).tolist()
    [[1], [2]]
    """
    if set(tree) != _ARRAY_KEYS or not isinstance(tree[ARRAY_TAG], str):
        raise FormatError(
            f"{where}: malformed array object with keys {sorted(tree)}; expected exactly {sorted(_ARRAY_KEYS)}"
        )
    dtype = parse_dtype(tree["dtype"], where)
    shape = tree["shape"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise FormatError(f"{where}: array shape must be a list of non-negative integers, got {shape!r}")
    data = _b64(tree[ARRAY_TAG], where)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise FormatError(
            f"{where}: array of dtype {tree['dtype']} and shape {shape} needs {expected} bytes, "
            f"the base64 data holds {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
