"""Errors specific to TensorFlow checkpoints and the Checkpointable protocol."""

from __future__ import annotations

from fastckpt.errors import FastCkptError, FormatError, IntegrityError

__all__ = ["ChecksumMismatchError", "RestoreMismatchError"]


class ChecksumMismatchError(IntegrityError, FormatError):
    """A block or tensor whose masked CRC32C does not match its bytes.

    It is both an :class:`~fastckpt.errors.IntegrityError` (stored bytes were
    changed) and a :class:`~fastckpt.errors.FormatError` (the file is not a
    valid checkpoint), so either ``except`` clause catches it.
    """


class RestoreMismatchError(FastCkptError, ValueError):
    """An object and a checkpoint disagree: missing, unexpected or mismatched tensors.

    ``result`` holds the :class:`~fastckpt.tf.checkpointable.RestoreResult`
    with the full lists (what was restored before the check failed).
    """

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result
