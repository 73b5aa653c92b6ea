"""The stateful checkpoint file: its byte-level specification, version migrations and parsing.

:class:`fastckpt.stateful.Checkpoint` writes and reads these files; the
values inside ``"state"`` are encoded by :mod:`fastckpt.state.codec` in its
``STATEFUL_JSON`` dialect.

>>> parse('{"format":"fastckpt.stateful","version":1,"entries":{"n":{"type":null,"state":5}}}', "example")["n"].encoded
5

File format (version 1)
=======================

A checkpoint file (and the string :meth:`Checkpoint.serialize` returns) is one
JSON text (RFC 8259).

Encoding
    The file MUST be UTF-8 without a byte order mark. Writers emit ASCII only
    (every other character escaped as ``\\uXXXX``), object keys sorted by code
    point, no insignificant whitespace, and a file ends with one line feed
    (0x0A); ``serialize()`` returns the same text without it. Readers MUST
    accept any valid JSON whitespace and key order. The literals ``NaN``,
    ``Infinity`` and ``-Infinity`` MUST NOT appear.

Top level
    An object with exactly these keys:

    ``"format"``
        MUST be the string ``"fastckpt.stateful"``.
    ``"version"``
        An integer, the format version; this text describes version ``1``.
    ``"entries"``
        An object mapping each key to an entry. Keys beginning with
        ``"__op_"`` are the generated keys of anonymous registrations
        (``"__op_0"``, ``"__op_1"``, ... in registration order); other keys
        are the names the user gave.

    Readers MUST refuse a file with another ``format``, a missing key, or a
    ``version`` they cannot read (below).

Entry
    An object with exactly two keys:

    ``"type"``
        The qualified type name (``module.QualName``) of the op whose state
        this is, e.g. ``"fastckpt.stateful.rng.RNG"``, or ``null`` when the
        state was set without a type. Before a state is applied, a non-null
        type MUST equal the qualified type name of the op it is applied to.
    ``"state"``
        The state, a JSON value in the value encoding below.

Value encoding
    Dicts (string keys only), lists, strings, booleans and ``null`` are
    written as JSON. Integers are written exactly, of any size (PCG64 states
    hold 128-bit integers): readers MUST NOT round them through a double.
    Finite floats are written in the shortest form that reads back to the
    same IEEE 754 double. Tuples are written as lists and read back as lists;
    numpy integer, float and bool scalars are written as the Python scalar of
    the same value. Three values are written as tagged objects, recognised by
    their key; a user dict MUST NOT use any of these keys:

    ``{"__ndarray__": B, "dtype": D, "shape": S}`` (exactly these keys)
        A numpy array. ``D`` is a numpy dtype string with its byte order
        (``"<f4"``, ``">i8"``, ``"|b1"``, ``"<U3"``, ...; kinds ``b i u f c S
        U`` only) or the name of an ``ml_dtypes`` type (``"bfloat16"``,
        ``"float8_e4m3fn"``, ...; little-endian). ``S`` is the list of
        dimensions (``[]`` for 0-d). ``B`` is the standard base64 (RFC 4648,
        with padding) of the array's elements in C order, exactly
        ``prod(S) * itemsize`` bytes. Object, structured and other dtypes are
        refused: nothing is ever pickled. Arrays read back C-contiguous and
        writable.
    ``{"__bytes__": B}``
        A ``bytes`` value; ``B`` is its base64.
    ``{"__float__": "nan" | "inf" | "-inf"}``
        A non-finite float (the sign and payload of a NaN are not kept).

Versioning
    A file whose ``version`` is older than the current one is upgraded, one
    version at a time, by the migration functions registered with
    :func:`register_migration`; a file is refused (``FormatError`` naming
    both versions) when a step has no migration or when its version is newer
    than this fastckpt reads. The states inside carry their own layout
    versions (e.g. ``"version"`` in a reader state), checked by the op that
    applies them.

Files
    :meth:`Checkpoint.save` writes through :func:`fastckpt.store.commit.atomic_write`
    (a temporary in the same directory, fsync, rename, directory fsync), so a
    reader of the file name sees either the previous file or the complete new
    one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from fastckpt.errors import FormatError
from fastckpt.state import STATEFUL_JSON
from fastckpt.state import decode as _decode
from fastckpt.store.names import NameRule

__all__ = ["FORMAT", "FORMAT_VERSION", "ANONYMOUS_PREFIX", "register_migration", "payload", "parse", "parse_payload"]

#: Value of the top-level ``"format"`` key.
FORMAT = "fastckpt.stateful"
#: The format version this module writes.
FORMAT_VERSION = 1
#: Prefix of the keys generated for anonymous registrations; refused in user names.
ANONYMOUS_PREFIX = "__op_"
#: The keys of ``ops``: any non-empty str (a JSON key reads back exactly) that does not start with the prefix above.
KEYS = NameRule("a stateful checkpoint", controls=False, prefixes=((ANONYMOUS_PREFIX, "the generated keys' prefix"),),
                refusal="{format} generates such keys itself", way_out="choose another name or omit it")

# from_version -> function(payload dict at from_version) -> payload dict at from_version + 1
_MIGRATIONS: dict[int, Callable[[dict], dict]] = {}


def register_migration(from_version: int, fn: Callable[[dict], dict], *, replace: bool = False) -> None:
    """Register ``fn`` to upgrade a payload from ``from_version`` to ``from_version + 1``.

    ``fn`` receives the parsed top-level JSON object (a dict with ``format``,
    ``version`` and ``entries``) and returns the upgraded object; its
    ``"version"`` is then set to ``from_version + 1``. Older payloads go
    through every step up to :data:`FORMAT_VERSION`.

    >>> def v1_to_v2(payload):
    ...     for entry in payload["entries"].values():
    ...         entry["type"] = entry["type"].replace("oldpkg.", "newpkg.")
    ...     return payload
    >>> register_migration(1, v1_to_v2)     # doctest: +SKIP
    """
    if type(from_version) is not int or from_version < 1:
        raise ValueError(f"from_version must be an int >= 1, got {from_version!r}")
    if not callable(fn):
        raise TypeError(f"a migration must be callable, got {type(fn).__name__}")
    if from_version in _MIGRATIONS and not replace:
        raise ValueError(
            f"a migration from format version {from_version} is already registered; pass replace=True to replace it"
        )
    _MIGRATIONS[from_version] = fn


@dataclass
class _Entry:
    encoded: Any  # JSON-safe tree: what serialize() writes
    value: Any  # what get_state() returns and set_state()/load_state_dict() receives; _UNSET: decode(encoded)
    type_name: str | None
    dirty: bool
    # Decoded while validating a loaded payload; handed to the first apply so big arrays decode once.
    decoded: Any = None


_UNSET = object()


def payload(entries: dict[str, dict]) -> dict:
    """The top-level object of a file holding ``entries`` (key -> ``{"type", "state"}``), at this version.

    >>> payload({})
    {'format': 'fastckpt.stateful', 'version': 1, 'entries': {}}
    """
    return {"format": FORMAT, "version": FORMAT_VERSION, "entries": entries}


def parse(data: str, where: str) -> dict[str, _Entry]:
    """The entries of a checkpoint file's text, upgraded to :data:`FORMAT_VERSION` and validated.

    >>> parse('{"format":"fastckpt.stateful","version":1,"entries":{}}', "example")
    {}
    """
    def refuse_constant(token):
        raise FormatError(f"{where}: {token} is not allowed; non-finite floats are written as tagged objects")

    try:
        payload = json.loads(data, parse_constant=refuse_constant)
        states = parse_payload(payload, where)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply to read") from None
    return states


def parse_payload(payload: Any, where: str) -> dict[str, _Entry]:
    if not isinstance(payload, dict):
        raise FormatError(f"{where}: expected a JSON object at the top level, got {type(payload).__name__}")
    if payload.get("format") != FORMAT:
        raise FormatError(
            f"{where}: not a fastckpt stateful checkpoint ('format' is {payload.get('format')!r}, "
            f"expected {FORMAT!r})"
        )
    version = payload.get("version")
    if type(version) is not int:
        raise FormatError(f"{where}: 'version' must be an integer, got {version!r}")
    current_version = FORMAT_VERSION
    if version > current_version:
        raise FormatError(
            f"{where}: format version {version} is newer than this fastckpt reads (version {current_version}); "
            "upgrade fastckpt to load it"
        )
    while version < current_version:
        migrate = _MIGRATIONS.get(version)
        if migrate is None:
            raise FormatError(
                f"{where}: format version {version} cannot be upgraded to version {current_version}: "
                f"no migration from version {version} is registered (see register_migration)"
            )
        try:
            payload = migrate(payload)
        except Exception as exc:
            raise FormatError(f"{where}: migration from format version {version} failed: {exc!r}") from exc
        if not isinstance(payload, dict):
            raise FormatError(f"{where}: migration from format version {version} returned {type(payload).__name__}, not a dict")
        version += 1
        payload["version"] = version
    expected_keys = {"format", "version", "entries"}
    if set(payload) != expected_keys:
        raise FormatError(f"{where}: top-level keys are {sorted(payload)}, expected {sorted(expected_keys)}")
    entries = payload["entries"]
    if not isinstance(entries, dict):
        raise FormatError(f"{where}: 'entries' must be an object, got {type(entries).__name__}")
    states = {}
    for key, item in entries.items():
        if not isinstance(item, dict) or set(item) != {"type", "state"}:
            shown = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise FormatError(f"{where}: entry {key!r} must be an object with keys 'type' and 'state', got {shown}")
        type_name = item["type"]
        if type_name is not None and not isinstance(type_name, str):
            raise FormatError(f"{where}: entry {key!r}: 'type' must be a string or null, got {type_name!r}")
        decoded = _decode(item["state"], STATEFUL_JSON, where=f"{where}: state of {key!r}")  # validate now, not at apply time
        states[key] = _Entry(item["state"], _UNSET, type_name, dirty=True, decoded=decoded)
    return states
