"""Checkpoint: collect, save, load and restore the state of readers, RNGs and other stateful objects.

A :class:`Checkpoint` holds a set of registered objects ("ops"), each under a
key, and a dictionary of their states. It works with any object the state
protocol of :mod:`fastckpt.state.protocol` knows, found in its one order: a
``numpy.random.Generator``, then ``state_dict()`` / ``load_state_dict(value)``,
then ``get_state()`` / ``set_state(value)`` (the readers and :class:`RNG` of
this package). States are encoded by :mod:`fastckpt.state.codec` in its
``STATEFUL_JSON`` dialect, whose bytes are specified below.

>>> import numpy as np, tempfile, os
>>> from fastckpt.stateful import ArrayReader, Checkpoint, RNG
>>> pattern = os.path.join(tempfile.mkdtemp(), "ckpt_{seq:04d}.json")
>>> reader, rng = ArrayReader(np.arange(10), enable_checkpointing=True), RNG(seed=42)
>>> ckpt = Checkpoint()
>>> ckpt.register(reader, "reader"), ckpt.register(rng, "rng")
('reader', 'rng')
>>> it = reader.next_epoch(batch_size=4); _ = next(it); _ = rng.random()
>>> ckpt.collect()
>>> os.path.basename(ckpt.save(pattern))
'ckpt_0000.json'
>>> expected = (next(it).tolist(), rng.random())
>>> reader, rng, ckpt = ArrayReader(np.arange(10)), RNG(), Checkpoint()
>>> os.path.basename(ckpt.load(pattern))
'ckpt_0000.json'
>>> ckpt.register(reader, "reader"), ckpt.register(rng, "rng")   # states applied here
('reader', 'rng')
>>> (next(reader.next_epoch(batch_size=4)).tolist(), rng.random()) == expected
True

The file format (version 1) is specified in :mod:`fastckpt.stateful.format`.

Not thread-safe: one Checkpoint (including the one :func:`current` returns)
must not be used from several threads at once, and an op must not be
iterated while its state is collected or applied.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from pathlib import Path
from typing import Any, Iterator

from fastckpt.errors import CheckpointKeyError, CheckpointNotFoundError, FormatError
from fastckpt.store.commit import atomic_write, overwrite_flag
from fastckpt.state import STATEFUL_JSON, StateObject, accessors, dumps
from fastckpt.state import decode as _decode
from fastckpt.state import encode as _encode_state
from fastckpt.stateful.format import (
    _UNSET,
    ANONYMOUS_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    KEYS,
    _Entry,
    parse,
    payload,
    register_migration,
)
from fastckpt.stateful.pattern import _identity, _Pattern

__all__ = [
    "Checkpoint",
    "CheckpointKeyError",
    "current",
    "checkpoint_scope",
    "register_migration",
    "FORMAT",
    "FORMAT_VERSION",
    "ANONYMOUS_PREFIX",
]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _raise_with_context(exc: Exception, message: str):
    """Re-raise ``exc`` as its own type with ``message`` in front, so callers can still catch it by type."""
    try:
        new = type(exc)(f"{message}: {exc}")
    except Exception:  # a type whose constructor wants other arguments: keep it, add a note
        if hasattr(exc, "add_note"):
            exc.add_note(message)
        raise exc
    raise new from exc


class Checkpoint:
    """Aggregates the state of stateful objects (readers, RNGs, ...) for resume.

    Register ops with :meth:`register`; :meth:`collect` captures their states;
    :meth:`save` / :meth:`serialize` write them; :meth:`load` /
    :meth:`deserialize` read them back, and each state is applied when its op
    is registered (or by :meth:`restore`).

    >>> from fastckpt.stateful import RNG
    >>> ckpt = Checkpoint()
    >>> rng = RNG(seed=1)
    >>> ckpt.register(rng)
    '__op_0'
    >>> ckpt.collect()
    >>> text = ckpt.serialize()
    >>> other = Checkpoint(); other.deserialize(text)
    >>> rng2 = RNG(); _ = other.register(rng2)
    >>> rng2.random() == rng.random()
    True
    """

    def __init__(self) -> None:
        self._ops: dict[str, Any] = {}
        self._by_id: dict[int, str] = {}
        self._states: dict[str, _Entry] = {}
        self._counter = 0
        self._complete = False
        self._loaded = False
        self._source: str | None = None
        # pattern text -> [(path, identity)] of the files this checkpoint wrote, oldest first
        self._written: dict[str, list[tuple[Path, tuple[int, int, int, int]]]] = {}

    # ------------------------------------------------------------ properties
    @property
    def names(self) -> list[str]:
        """Keys of all registered ops, in registration order.

        >>> from fastckpt.stateful import RNG
        >>> c = Checkpoint(); _ = c.register(RNG(), "a"); _ = c.register(RNG())
        >>> c.names
        ['a', '__op_0']
        """
        return list(self._ops)

    @property
    def is_complete(self) -> bool:
        """True if :meth:`collect` was the last operation to populate the states (see :meth:`collect`)."""
        return self._complete

    @property
    def is_loaded(self) -> bool:
        """True if :meth:`load` or :meth:`deserialize` populated the states (see :meth:`deserialize`)."""
        return self._loaded

    def _where(self) -> str:
        return f"checkpoint {self._source}" if self._source else "checkpoint"

    # ---------------------------------------------------------- registration
    def register(self, op, name: str | None = None) -> str:
        """Add a stateful op; returns its key.

        With ``name``, the op is stored under that key, replacing any op
        registered there (names must not start with ``"__op_"``). Without it,
        an op already registered keeps its key; otherwise it gets the next
        generated key ``"__op_<n>"``. A state waiting under the key (from
        :meth:`load`, :meth:`deserialize` or :meth:`set_state`) is applied to
        the op at once, after its type is checked. Refused after
        :meth:`collect` until :meth:`clear`; after a load, the key must exist
        in the loaded states.

        Readers built without ``enable_checkpointing=True`` get it enabled
        here if they have not started iterating (``RuntimeError`` if they have).

        >>> from fastckpt.stateful import RNG
        >>> c, rng = Checkpoint(), RNG()
        >>> c.register(rng, "rng"), c.register(rng, "rng"), c.register(rng)
        ('rng', 'rng', 'rng')
        """
        accessors(op)
        existing = self._by_id.get(id(op))
        if existing is not None and name in (None, existing):
            # Already registered here: nothing changes, but a state that arrived since is applied.
            entry = self._states.get(existing)
            if entry is not None and entry.dirty:
                self._check_type(existing, entry, op)
                self._apply(existing, entry, op)
            return existing
        if name is not None:
            KEYS.check(name, "op")
            if existing is not None:
                raise ValueError(
                    f"this {_qualname(type(op))} is already registered under {existing!r}; "
                    f"an op can be registered under one key only"
                )
        if self._complete:
            raise RuntimeError(
                "the checkpoint is complete (collect() was called): new ops cannot be registered; "
                "call clear() to start over"
            )
        key = name if name is not None else f"{ANONYMOUS_PREFIX}{self._counter}"
        if self._loaded and key not in self._states:
            if name is None:
                saved = sum(1 for k in self._states if k.startswith(ANONYMOUS_PREFIX))
                raise CheckpointKeyError(
                    f"{self._where()} holds {saved} anonymous state(s) but this is anonymous registration "
                    f"number {self._counter + 1}: register the same ops, in the same order, as when it was saved "
                    "(or register them by name)"
                )
            raise CheckpointKeyError(
                f"{self._where()} has no state named {key!r}; it holds {sorted(self._states)}"
            )
        prepare = getattr(op, "_prepare_for_checkpoint", None)
        if prepare is not None:
            prepare()
        entry = self._states.get(key)
        if entry is not None and entry.dirty:
            self._check_type(key, entry, op)
            self._apply(key, entry, op)
        replaced = self._ops.get(key)
        if replaced is not None:
            del self._by_id[id(replaced)]
        self._ops[key] = op
        self._by_id[id(op)] = key
        if name is None:
            self._counter += 1
        return key

    # ------------------------------------------------------------ collection
    def collect(self) -> None:
        """Capture the state of every registered op (sets :attr:`is_complete`).

        Every state is encoded (checked JSON-safe) and snapshotted at once, so
        later changes to the op do not leak into it. All or nothing: if one op
        fails, the states are left as they were. Raises ``RuntimeError`` when
        the states hold keys with no registered op (a load whose ops were not
        all registered): register them or :meth:`clear`.

        >>> from fastckpt.stateful import RNG
        >>> c = Checkpoint(); _ = c.register(RNG(seed=0), "rng"); c.collect()
        >>> c.is_complete, c.is_loaded
        (True, False)
        """
        orphans = [key for key in self._states if key not in self._ops]
        if orphans:
            raise RuntimeError(
                f"{self._where()} holds states for {sorted(orphans)} but no op is registered under them; "
                "register those ops, or call clear() to drop the loaded states"
            )
        states = {}
        for key, op in self._ops.items():
            getter, _ = accessors(op)
            try:
                value = getter()
            except Exception as exc:
                _raise_with_context(exc, f"collecting the state of {key!r} ({_qualname(type(op))})")
            encoded = self._encode(key, value, op)
            kept = value if isinstance(value, StateObject) else _UNSET
            states[key] = _Entry(encoded, kept, _qualname(type(op)), dirty=False)
        self._states = states
        self._complete = True
        self._loaded = False
        self._source = None

    @staticmethod
    def _encode(key: str, value: Any, op=None) -> Any:
        owner = f" ({_qualname(type(op))})" if op is not None else ""
        try:
            return _encode_state(value, STATEFUL_JSON, where=f"state of {key!r}{owner}")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc}. States must be JSON-safe; see fastckpt.stateful.checkpoint") from None

    def get_state(self, name: str):
        """The stored state for the op registered under ``name``.

        A state object (the states of readers and RNGs) is returned as it was
        captured or given; any other state as a decoded copy of what
        :meth:`serialize` writes (after a load: the decoded JSON value).
        Raises :class:`CheckpointKeyError` (a ``KeyError``) if no op is
        registered under ``name`` or it has no state yet.

        >>> from fastckpt.stateful import RNG
        >>> c = Checkpoint(); _ = c.register(RNG(seed=0), "rng"); c.collect()
        >>> c.get_state("rng").bit_generator
        'PCG64'
        """
        if name not in self._ops:
            raise CheckpointKeyError(f"no op is registered under {name!r}; registered: {self.names}")
        entry = self._states.get(name)
        if entry is None:
            raise CheckpointKeyError(f"the op registered under {name!r} has no state yet; call collect() first")
        return _decode(entry.encoded, STATEFUL_JSON) if entry.value is _UNSET else entry.value

    def set_state(self, name: str, value: Any, op_type: type | str | None = None) -> None:
        """Set the state for the op under ``name`` (registered now or later); it is marked dirty.

        It is applied when an op is next registered under ``name``, or by
        :meth:`restore`. ``op_type`` (a class or its qualified name) is stored
        and checked against the op before applying. The value must be
        JSON-safe (see the module docs). Raises :class:`CheckpointKeyError` if
        the checkpoint is complete and no op is registered under ``name``, and
        ``TypeError`` if ``op_type`` is neither a type nor a string.

        >>> from fastckpt.stateful import RNG
        >>> c, rng = Checkpoint(), RNG()
        >>> c.set_state("rng", RNG(seed=9).get_state(), op_type=RNG)
        >>> _ = c.register(rng, "rng")
        >>> rng.random() == RNG(seed=9).random()
        True
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"the name must be a non-empty str, got {name!r}")
        if op_type is None:
            type_name = None
        elif isinstance(op_type, type):
            type_name = _qualname(op_type)
        elif isinstance(op_type, str):
            type_name = op_type
        else:
            raise TypeError(f"op_type must be a class or a qualified class name (str), got {type(op_type).__name__}")
        if self._complete and name not in self._ops:
            raise CheckpointKeyError(
                f"the checkpoint is complete (collect() was called) and no op is registered under {name!r}; "
                f"registered: {self.names}"
            )
        encoded = self._encode(name, value)
        # Apply what will be saved (a decoded copy), so a later change to ``value`` cannot split the two.
        kept = value if isinstance(value, StateObject) else _UNSET
        self._states[name] = _Entry(encoded, kept, type_name, dirty=True)

    def restore(self) -> None:
        """Apply every dirty state to its registered op.

        All keys are checked first (and every stored type against its op), so
        nothing is applied when the states and ops do not match: a state with
        no op, or an op with no state, raises ``RuntimeError``; a type
        mismatch raises ``TypeError``. With no states at all it does nothing.

        >>> from fastckpt.stateful import RNG
        >>> c, rng = Checkpoint(), RNG()
        >>> _ = c.register(rng, "rng")
        >>> c.set_state("rng", str(RNG(seed=4).get_state()))
        >>> c.restore(); rng.random() == RNG(seed=4).random()
        True
        """
        if not self._states:
            return
        orphans = sorted(k for k in self._states if k not in self._ops)
        missing = sorted(k for k in self._ops if k not in self._states)
        if orphans or missing:
            parts = []
            if orphans:
                parts.append(f"states with no registered op: {orphans}")
            if missing:
                parts.append(f"registered ops with no state: {missing}")
            raise RuntimeError(
                f"{self._where()} does not match the registered ops ({'; '.join(parts)}); "
                "register the same ops under the same keys as when it was saved"
            )
        dirty = [(key, entry) for key, entry in self._states.items() if entry.dirty]
        for key, entry in dirty:
            self._check_type(key, entry, self._ops[key])
        for key, entry in dirty:
            self._apply(key, entry, self._ops[key])

    def _check_type(self, key: str, entry: _Entry, op) -> None:
        found = _qualname(type(op))
        if entry.type_name is not None and entry.type_name != found:
            raise TypeError(
                f"{self._where()}: the state under {key!r} belongs to a {entry.type_name} but the op "
                f"registered under {key!r} is a {found}; register the matching op under this key "
                "(anonymous keys follow registration order: prefer named registration)"
            )

    def _apply(self, key: str, entry: _Entry, op) -> None:
        _, setter = accessors(op)
        if entry.value is not _UNSET:
            value = entry.value
        elif entry.decoded is not None:
            value, entry.decoded = entry.decoded, None
        else:
            value = _decode(entry.encoded, STATEFUL_JSON, where=f"state of {key!r}")
        try:
            setter(value)
        except Exception as exc:
            _raise_with_context(exc, f"{self._where()}: applying the state under {key!r} to a {_qualname(type(op))}")
        entry.dirty = False

    def clear(self) -> None:
        """Forget all ops and states and reset the flags and the generated-key counter.

        The record of files this checkpoint saved (for ``keep=``) is kept.

        >>> from fastckpt.stateful import RNG
        >>> c = Checkpoint(); _ = c.register(RNG()); c.collect(); c.clear()
        >>> c.names, c.is_complete
        ([], False)
        """
        self._ops.clear()
        self._by_id.clear()
        self._states = {}
        self._counter = 0
        self._complete = False
        self._loaded = False
        self._source = None

    # --------------------------------------------------------- serialization
    def _payload(self) -> dict:
        if not self._states:
            raise RuntimeError("the checkpoint holds no states: register ops and call collect() first")
        entries = {}
        for key, entry in self._states.items():
            type_name = entry.type_name
            if type_name is None and key in self._ops:
                type_name = _qualname(type(self._ops[key]))
            entries[key] = {"type": type_name, "state": entry.encoded}
        return payload(entries)

    def serialize(self) -> str:
        """The states as one JSON string (the file format in the module docs, without the final newline).

        Raises ``RuntimeError`` if there are no states.

        >>> from fastckpt.stateful import RNG
        >>> c = Checkpoint(); c.set_state("n", {"step": 3}); c.serialize()
        '{"entries":{"n":{"state":{"step":3},"type":null}},"format":"fastckpt.stateful","version":1}'
        """
        return dumps(self._payload())

    def deserialize(self, data: str | bytes, *, source: str | None = None) -> None:
        """Replace the states with those in ``data`` (a string from :meth:`serialize`).

        Sets :attr:`is_loaded`, clears :attr:`is_complete`, and marks every
        state dirty, so that :meth:`register` (or :meth:`restore`) applies it.
        Older format versions are upgraded by the registered migrations.
        Malformed data raises :class:`~fastckpt.errors.FormatError` (a
        ``ValueError``) naming ``source`` and what is wrong; nothing changes.

        >>> c = Checkpoint()
        >>> c.deserialize('{"format":"fastckpt.stateful","version":1,"entries":{"n":{"type":null,"state":5}}}')
        >>> c.is_loaded
        True
        """
        where = source or "checkpoint string"
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FormatError(f"{where}: not UTF-8 ({exc})") from None
        if not isinstance(data, str):
            raise TypeError(f"deserialize needs a str, got {type(data).__name__}")

        states = parse(data, where)
        self._states = states
        self._loaded = True
        self._complete = False
        self._source = source

    # ----------------------------------------------------------------- files
    def save(self, pattern: str | os.PathLike, *, keep: int | None = None, fsync: bool = True,
             overwrite: bool = False) -> str:
        """Write :meth:`serialize`'s text to a new file; returns its path.

        ``pattern`` is a file name with an optional ``{seq}`` placeholder
        (format specs such as ``{seq:04d}`` are honoured); ``{seq}`` becomes
        one more than the highest number on disk (0 for the first), so
        existing files are never overwritten: a number another process
        takes meanwhile is refused by the commit's no-replace rename, and the
        save takes the next one. Without ``{seq}`` the one file is replaced
        only with ``overwrite=True`` (docs/overwrite.md). The write is atomic. ``keep=N``
        then deletes the oldest files of this pattern that this Checkpoint
        wrote, so that N of them remain; files it did not write (or that were
        replaced or rewritten since) are never touched. Raises
        ``RuntimeError`` if there are no states.

        >>> import tempfile, os
        >>> c = Checkpoint(); c.set_state("n", 1)
        >>> p = os.path.join(tempfile.mkdtemp(), "s{seq:02d}.json")
        >>> [os.path.basename(c.save(p, keep=2)) for _ in range(3)]
        ['s00.json', 's01.json', 's02.json']
        >>> sorted(os.listdir(os.path.dirname(p)))
        ['s01.json', 's02.json']
        """
        if keep is not None and (type(keep) is not int or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
        overwrite = overwrite_flag(overwrite)
        parsed = _Pattern(pattern)
        text = self.serialize() + "\n"
        if parsed.has_seq:
            for attempt in range(100):
                existing = parsed.existing()
                path = parsed.path(max(existing) + 1 if existing else 0)
                try:
                    with atomic_write(path, fsync=fsync, overwrite=False) as f:
                        f.write(text.encode("ascii"))
                    break
                except FileExistsError:  # another writer took this number first: the next one
                    if attempt == 99:
                        raise
        else:
            path = parsed.path()
            with atomic_write(path, fsync=fsync, overwrite=overwrite) as f:
                f.write(text.encode("ascii"))
        written = self._written.setdefault(parsed.text, [])
        written[:] = [(p, ident) for p, ident in written if p != path]
        written.append((path, _identity(os.stat(path))))
        if keep is not None:
            while len(written) > keep:
                old, ident = written.pop(0)
                try:
                    st_old = os.stat(old)
                except FileNotFoundError:
                    continue
                # Still the file we wrote? A file recreated under the name may reuse a freed inode
                # number, so its size and modification time must match too.
                if _identity(st_old) == ident:
                    os.unlink(old)
        return str(path)

    def load(self, pattern: str | os.PathLike) -> str:
        """Read the file with the highest ``{seq}`` matching ``pattern`` (see :meth:`save`); returns its path.

        The states are marked dirty (see :meth:`deserialize`). Raises
        :class:`~fastckpt.errors.CheckpointNotFoundError` (a
        ``FileNotFoundError``) if no file matches.

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); c = Checkpoint(); c.set_state("n", 1)
        >>> _ = c.save(os.path.join(d, "s{seq}.json")); _ = c.save(os.path.join(d, "s{seq}.json"))
        >>> os.path.basename(Checkpoint().load(os.path.join(d, "s{seq}.json")))
        's1.json'
        """
        parsed = _Pattern(pattern)
        existing = parsed.existing()
        if not existing:
            raise CheckpointNotFoundError(
                f"no checkpoint file matches {parsed.text!r} (looked in {str(parsed.directory)!r})"
            )
        path = existing[max(existing)]
        with open(path, "rb") as f:
            data = f.read()
        self.deserialize(data, source=str(path))
        return str(path)

    def __repr__(self) -> str:
        flags = "complete" if self._complete else ("loaded" if self._loaded else "open")
        return f"<Checkpoint {flags}: {len(self._ops)} op(s), {len(self._states)} state(s)>"


# ---------------------------------------------------------------- current()
_scoped: contextvars.ContextVar[Checkpoint | None] = contextvars.ContextVar("fastckpt_checkpoint", default=None)
_thread_default = threading.local()


def current() -> Checkpoint:
    """The Checkpoint bound to the current context.

    Inside ``with checkpoint_scope(...)`` it is that scope's checkpoint;
    otherwise it is this thread's default one, created on first use and kept
    for the life of the thread: registrations accumulate across unrelated runs
    unless you call ``clear()``.

    >>> current() is current()
    True
    """
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    default = getattr(_thread_default, "checkpoint", None)
    if default is None:
        default = _thread_default.checkpoint = Checkpoint()
    return default


@contextlib.contextmanager
def checkpoint_scope(checkpoint: Checkpoint | None = None) -> Iterator[Checkpoint]:
    """Bind ``checkpoint`` (a new one if omitted) as :func:`current` within the block.

    >>> with checkpoint_scope() as ckpt:
    ...     current() is ckpt
    True
    >>> current() is ckpt
    False
    """
    if checkpoint is None:
        checkpoint = Checkpoint()
    elif not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"checkpoint_scope needs a Checkpoint, got {type(checkpoint).__name__}")
    token = _scoped.set(checkpoint)
    try:
        yield checkpoint
    finally:
        _scoped.reset(token)
