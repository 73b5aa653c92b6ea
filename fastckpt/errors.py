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


class FastCkptWarning(UserWarning):
    """Base class of fastckpt's warnings."""


class NotZeroCopyWarning(FastCkptWarning):
    """A tensor could not take the zero-copy path (compressed, misaligned, ...) and was copied."""
