"""The exceptions and warnings fastckpt raises.

Every error derives from :class:`FastCkptError`, and each also derives from the
built-in exception it means, so callers can catch ``ValueError``,
``KeyError`` or ``FileNotFoundError`` as they would anywhere else:

>>> from fastckpt.errors import FormatError
>>> issubclass(FormatError, ValueError)
True

Operating-system failures are not wrapped: an ``OSError`` keeps its ``errno``.
"""

from __future__ import annotations

__all__ = [
    "FastCkptError",
    "FormatError",
    "TensorNotFoundError",
    "CheckpointNotFoundError",
    "IntegrityError",
    "ChecksumMismatchError",
    "RestoreMismatchError",
    "DestinationError",
    "CheckpointChangedError",
    "BrokenChainError",
    "MissingIdsError",
    "CheckpointKeyError",
    "BarrierTimeoutError",
    "EngineError",
    "FastCkptWarning",
    "NotZeroCopyWarning",
]


class FastCkptError(Exception):
    """Base class of every error fastckpt raises on purpose."""


class FormatError(FastCkptError, ValueError):
    """A file's bytes do not follow its format.

    The message names the file, the member or tensor, the byte offset where it
    matters, and what was expected against what was found.
    """


class TensorNotFoundError(FastCkptError, KeyError):
    """A tensor name that the file does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(FastCkptError, FileNotFoundError):
    """No file or checkpoint exists at the path given (or at any fallback path)."""


class IntegrityError(FastCkptError, ValueError):
    """Stored bytes fail their checksum or hash: the file was changed or damaged."""

    @classmethod
    def of(cls, where: str, problems: list[str]) -> IntegrityError:
        """The error for a check's list of problems: the first, and how many more.

        >>> str(IntegrityError.of("ckpt", ["a.bin: 3 bytes, the manifest says 4", "b.bin: missing"]))
        'ckpt: a.bin: 3 bytes, the manifest says 4 (and 1 more)'
        """
        return cls(f"{where}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


class ChecksumMismatchError(IntegrityError, FormatError):
    """A block or tensor whose stored checksum does not match its bytes.

    The checksum is TensorFlow's masked CRC32C, or an NPZ member's CRC-32
    (``load_model(..., verify=True)``).

    It is both an :class:`IntegrityError` (stored bytes were changed) and a
    :class:`FormatError` (the file is not a valid checkpoint), so either
    ``except`` clause catches it.

    >>> issubclass(ChecksumMismatchError, IntegrityError) and issubclass(ChecksumMismatchError, FormatError)
    True
    """


class RestoreMismatchError(FastCkptError, ValueError):
    """An object and a checkpoint disagree: missing, unexpected or mismatched tensors.

    ``result`` holds the :class:`~fastckpt.tf.checkpointable.RestoreResult`
    with the full lists (nothing was restored when it is raised).

    >>> RestoreMismatchError("1 missing ('w')").result is None
    True
    """

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class DestinationError(FastCkptError, ValueError):
    """A destination whose format is not stated: an unknown suffix, a directory, or a suffix that contradicts ``to``.

    Raised before anything is written (``fastckpt convert``: see
    :func:`fastckpt.formats.convert.destination_format`).
    """


class CheckpointChangedError(FormatError):
    """A checkpoint of several files changed while it was opened: a save with ``overwrite=True`` replaced it,
    or something removed, truncated or replaced one of its files. The message names what changed; opening it
    again reads the new commit. Every reader of several files (:mod:`fastckpt.store.snapshot`) either reads one
    commit whole or raises this.

    >>> issubclass(CheckpointChangedError, FormatError)
    True
    """


class BrokenChainError(FormatError):
    """A delta checkpoint's chain cannot be followed: a base is missing, uncommitted or altered.

    ``link`` is the directory whose ``base`` could not be followed, ``base`` the directory it names.

    >>> BrokenChainError("no base", link="ckpt/b", base="ckpt/a").base
    'ckpt/a'
    """

    def __init__(self, message: str, link: str, base: str):
        super().__init__(message)
        self.link, self.base = link, base


class MissingIdsError(FastCkptError, KeyError):
    """Ids that a :class:`~fastckpt.sharded.HashTable` does not hold (``update``, ``lookup``, ``lookup_slot``).

    ``ids`` holds the first missing ids (up to 8, in the order given), ``count`` how many distinct ids are missing.

    >>> err = MissingIdsError([3, 9], 2, "user")
    >>> isinstance(err, KeyError), err.count
    (True, 2)
    >>> str(err)
    "2 ids not in hashtable 'user': [3, 9]"
    """

    def __init__(self, ids, count: int, table: str | None = None):
        self.ids = [int(i) for i in ids]
        self.count = int(count)
        where = "the hashtable" if table is None else f"hashtable {table!r}"
        first = "" if self.count <= len(self.ids) else f", the first {len(self.ids)}"
        noun = "id" if self.count == 1 else "ids"
        super().__init__(f"{self.count} {noun} not in {where}{first}: {self.ids}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


class CheckpointKeyError(FastCkptError, KeyError):
    """A key that a :class:`~fastckpt.stateful.Checkpoint` does not hold (no registered op, or no state).

    >>> str(CheckpointKeyError("no op is registered under 'x'; registered: []"))
    "no op is registered under 'x'; registered: []"
    """

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0]) if self.args else ""


class BarrierTimeoutError(FastCkptError, TimeoutError):
    """Ranks did not reach a collective call in time (or one aborted): nobody waits for them any longer.

    ``missing`` holds the ranks that did not arrive, ascending (empty only where no rank can know:
    ``MPIEngine`` when not every rank has made its first engine); ``tag`` names the call (a barrier's tag,
    ``"broadcast"`` or ``"gather"``); ``timeout`` is the wait in seconds; ``size`` the number of ranks.

    >>> error = BarrierTimeoutError("ranks 2, 3 of 4 did not reach 'written' within 30 s",
    ...                             missing=(2, 3), tag="written", timeout=30.0, size=4)
    >>> error.missing, isinstance(error, TimeoutError)
    ((2, 3), True)
    """

    def __init__(self, message: str, *, missing: tuple[int, ...] = (), tag: str | None = None,
                 timeout: float | None = None, size: int | None = None):
        super().__init__(message)
        self.missing = tuple(missing)
        self.tag = tag
        self.timeout = timeout
        self.size = size

    def __str__(self) -> str:  # OSError's __str__ would print the args tuple
        return str(self.args[0]) if self.args else ""


class EngineError(FastCkptError, RuntimeError):
    """The ranks cannot work together: this process is not one of the ranks, or ranks made different calls.

    >>> issubclass(EngineError, RuntimeError)
    True
    """


class FastCkptWarning(UserWarning):
    """Base class of fastckpt's warnings."""


class NotZeroCopyWarning(FastCkptWarning):
    """A tensor could not take the zero-copy path (compressed, misaligned, ...) and was copied."""
