"""Bounded JSON reading and the schema checks every manifest parser uses.

Every JSON file a checkpoint carries (the sharded layouts' ``manifest.json``, ``index.json`` / ``index``,
``tensorkey.json`` and descriptions, a training checkpoint's ``manifest.json``, a Hugging Face index) is read
through :func:`parse_json` (or :func:`read_json`), which

* reads at most ``limit`` bytes (:data:`MAX_JSON_BYTES` unless told): a larger file is a
  :class:`~fastckpt.errors.FormatError`, never a read of whatever size a file or a manifest claims;
* refuses nesting deeper than ``max_depth`` (:data:`MAX_DEPTH`) with a FormatError naming the file, where
  Python's parser would raise ``RecursionError`` (a 100,000-deep ``[[[...]]]``);
* turns every decoding problem (not UTF-8, not JSON, a repeated key where ``unique_keys``, NaN or Infinity
  where ``constants=False``) into a FormatError naming the file.

The checks (:func:`expect`, :func:`is_count`, :func:`is_shape`) are the ones the parsers share: a failed check
is a FormatError naming the file and the key. A size a manifest states never sizes a
buffer: :func:`read_bounded` reads what the file holds (``fstat``), and the callers compare that with the
manifest afterwards.

>>> parse_json(b'{"a": [1, 2]}', "m.json")
{'a': [1, 2]}
>>> parse_json(b"[" * 100_000 + b"]" * 100_000, "m.json")  # doctest: +ELLIPSIS
Traceback (most recent call last):
fastckpt.errors.FormatError: m.json: JSON nested deeper than 64 levels ...
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastckpt.errors import FormatError

__all__ = ["MAX_JSON_BYTES", "MAX_DEPTH", "parse_json", "read_json", "read_bounded", "expect", "is_count",
           "is_shape"]

#: The largest JSON file read (a manifest of 100,000 files is about 20 MiB).
MAX_JSON_BYTES = 1 << 30
#: The deepest nesting a checkpoint's JSON may have (fastckpt writes at most 5; state trees use their own).
MAX_DEPTH = 64


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth_over(obj: Any, max_depth: int) -> bool:
    """Whether ``obj`` nests containers more than ``max_depth`` deep (iterative: no recursion of its own). One
    level at a time, each in two comprehensions: a description file of thousands of entries is walked in half
    the time a stack of (value, depth) pairs took.

    >>> _depth_over({"a": [1, {"b": 2}]}, 3), _depth_over({"a": [1, {"b": 2}]}, 2), _depth_over(7, 0)
    (False, True, False)
    """
    level, depth = [obj], 0
    while level:
        depth += 1
        containers = [value for value in level if isinstance(value, (dict, list))]
        if not containers:
            return False
        if depth > max_depth:
            return True
        level = [child for value in containers for child in (value.values() if isinstance(value, dict) else value)]
    return False


def parse_json(data: bytes, where: str, *, max_depth: int = MAX_DEPTH, unique_keys: bool = False,
               constants: bool = True, what: str = "") -> Any:
    """The JSON value of ``data`` (UTF-8); a :class:`~fastckpt.errors.FormatError` naming ``where`` for bytes
    that are not UTF-8 JSON, nest deeper than ``max_depth``, repeat a key in one object (``unique_keys``) or
    hold NaN / Infinity (``constants=False``). ``what`` names the file in the message (``"the index"``).

    >>> parse_json(b'{"a": 1, "a": 2}', "i.json", unique_keys=True, what="the index")
    Traceback (most recent call last):
    fastckpt.errors.FormatError: i.json: the index repeats the key 'a' in one object
    >>> parse_json(b"\\xff", "i.json")
    Traceback (most recent call last):
    fastckpt.errors.FormatError: i.json: not UTF-8 (byte 0: invalid start byte)
    """
    label = f"{what} is " if what else ""
    bad = f"{what} is not JSON" if what else "not valid JSON"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: {label}not UTF-8 (byte {e.start}: {e.reason})") from None
    deep = FormatError(f"{where}: JSON nested deeper than {max_depth} levels (a checkpoint's JSON files nest a few "
                       "levels; this one is damaged or hostile)")
    kwargs: dict[str, Any] = {}
    if unique_keys:
        kwargs["object_pairs_hook"] = _unique_keys
    if not constants:
        kwargs["parse_constant"] = _refuse_constant
    try:
        value = json.loads(text, **kwargs)
    except _RepeatedKey as e:
        raise FormatError(f"{where}: {what + ' ' if what else ''}repeats the key {e.args[0]!r} in one object") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{where}: {bad}: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})") from None
    except RecursionError:
        raise deep from None
    except ValueError as e:
        raise FormatError(f"{where}: {bad}: {e}") from None
    if _depth_over(value, max_depth):
        raise deep
    return value


def read_bounded(fd: int, limit: int, where: str) -> bytes:
    """The bytes of open file ``fd`` from its start: at most what ``fstat`` says it holds, and a
    :class:`~fastckpt.errors.FormatError` naming ``where`` when that is more than ``limit``. No buffer is sized by
    anything but the file itself.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"{}"); f.flush(); read_bounded(f.fileno(), 10, "x")
    b'{}'
    """
    size = os.fstat(fd).st_size
    if size > limit:
        raise FormatError(f"{where}: {size} bytes, more than the {limit} a checkpoint's metadata file may have")
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, max(size - offset, 0) + 1, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        if offset > limit:
            raise FormatError(f"{where}: grew past {limit} bytes while it was read")
    return b"".join(chunks)


def read_json(path: str | os.PathLike, *, dir_fd: int | None = None, limit: int = MAX_JSON_BYTES,
              where: str | None = None, **options: Any) -> Any:
    """The JSON value of the file ``path`` (relative to ``dir_fd`` where given), read with :func:`read_bounded`
    and parsed with :func:`parse_json` (``options`` as there). A missing file raises ``FileNotFoundError``.

    >>> import tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "m.json"); _ = open(p, "w").write('{"n": 1}')
    >>> read_json(p)
    {'n': 1}
    """
    where = where or os.fspath(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    try:
        data = read_bounded(fd, limit, where)
    finally:
        os.close(fd)
    return parse_json(data, where, **options)


def expect(cond: Any, where: str, message: str) -> None:
    """A :class:`~fastckpt.errors.FormatError` ``"where: message"`` unless ``cond``.

    >>> expect(False, "manifest.json", "'world_size' must be a positive integer, got -1")
    Traceback (most recent call last):
    fastckpt.errors.FormatError: manifest.json: 'world_size' must be a positive integer, got -1
    """
    if not cond:
        raise FormatError(f"{where}: {message}")


def is_count(value: Any, lo: int = 0) -> bool:
    """Whether ``value`` is an ``int`` (not a bool) of at least ``lo``.

    >>> is_count(3), is_count(True), is_count(-1), is_count(0, 1)
    (True, False, False, False)
    """
    return type(value) is int and value >= lo


def is_shape(value: Any, max_rank: int = 64) -> bool:
    """Whether ``value`` is a list of at most ``max_rank`` counts: a tensor shape.

    >>> is_shape([2, 3]), is_shape([2, -1]), is_shape((2,))
    (True, False, False)
    """
    return isinstance(value, list) and len(value) <= max_rank and all(is_count(x) for x in value)

