"""Progress reports of long operations: what the ``progress=`` argument of every save and load means.

Every long operation (tensor-file saves, device loads, model files, training
and sharded checkpoints, convert, reshard) takes a keyword-only ``progress=``:

``False`` or ``None`` (the default)
    nothing is reported; the operation pays one attribute test per tensor or file.
``True``
    a `tqdm <https://tqdm.github.io>`_ bar on ``sys.stderr``, in bytes.
a callable
    called as ``callback(done, total, item)`` after each tensor or file: ``done``
    the bytes of tensor payload handled so far (never decreasing), ``total`` the
    bytes the operation will handle (``None`` only where it cannot be known in
    advance: ``save_npz`` given a generator, or values without ``nbytes``), and
    ``item`` the name of the tensor or file just handled. When ``total`` is known
    the last call has ``done == total``. Calls are made one at a time, in order,
    also from operations that work on several threads.
a :class:`Progress`
    an operation's own report, handed to the operations it is made of, so that
    they count towards one bar.

Bytes are tensor payload bytes (``array.nbytes``), not file sizes: headers,
indexes and manifests are not counted, so the total is known before the
first byte is written.

>>> seen = []
>>> with progress_from(lambda done, total, item: seen.append((done, total, item)), 6, "demo") as p:
...     p.advance(2, "a")
...     p.advance(4, "b")
>>> seen
[(2, 6, 'a'), (6, 6, 'b')]
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
from typing import Any, Callable, Union

__all__ = ["Progress", "progress_from", "requested", "ProgressArg", "part_of_a_save", "file_log_level"]

# True while the file saves of this thread (context) are parts of a larger save (see part_of_a_save).
_PART_OF_A_SAVE = contextvars.ContextVar("fastckpt_part_of_a_save", default=False)


@contextlib.contextmanager
def part_of_a_save():
    """Inside, the tensor-file saves of this thread are parts of a larger save (a training or sharded
    checkpoint, a sharded Hugging Face directory, a model file, a conversion) that logs its own INFO line:
    theirs go to DEBUG, so the
    ``fastckpt`` log at INFO shows one line per save the caller made, not the temporary files it is made of.
    (A new thread starts outside; the larger save enters it in each thread it writes from.)

    >>> import logging
    >>> file_log_level() == logging.INFO
    True
    >>> with part_of_a_save():
    ...     file_log_level() == logging.DEBUG
    True
    """
    token = _PART_OF_A_SAVE.set(True)
    try:
        yield
    finally:
        _PART_OF_A_SAVE.reset(token)


def file_log_level() -> int:
    """The level of a tensor-file save's log line: INFO, or DEBUG inside :func:`part_of_a_save`.

    >>> import logging
    >>> logging.getLevelName(file_log_level())
    'INFO'
    """
    return logging.DEBUG if _PART_OF_A_SAVE.get() else logging.INFO

ProgressArg = Union[bool, None, Callable[[int, "int | None", "str | None"], Any], "Progress"]


class Progress:
    """Counts the bytes an operation has handled and reports them to a callback or a tqdm bar.

    Built by :func:`progress_from`; ``advance(nbytes, item)`` may be called from
    any thread. A disabled one (``progress=False``) returns from ``advance`` at
    once. As a context manager it closes its bar on exit.

    >>> p = progress_from(False, 10, "off")
    >>> p.enabled, p.advance(10, "x"), p.done
    (False, None, 0)
    """

    __slots__ = ("enabled", "total", "done", "_callback", "_bar", "_lock", "_parent")

    def __init__(self, total: int | None = None, *, callback=None, bar=None, parent: "Progress | None" = None):
        self.enabled = callback is not None or bar is not None or (parent is not None and parent.enabled)
        self.total = total
        self.done = 0
        self._callback = callback
        self._bar = bar
        self._lock = threading.Lock()
        self._parent = parent

    def advance(self, nbytes: int, item: str | None = None) -> None:
        """Count ``nbytes`` more bytes handled, ``item`` (a tensor or file name) the last of them."""
        if not self.enabled:
            return
        if self._parent is not None:
            self._parent.advance(nbytes, item)
            return
        with self._lock:  # one report at a time, in order: done never decreases between calls
            self.done += nbytes
            if self._bar is not None:
                if item is not None:
                    self._bar.set_postfix_str(str(item), refresh=False)
                self._bar.update(nbytes)
            else:
                self._callback(self.done, self.total, item)

    def child(self) -> "Progress":
        """A report for a part of this operation: it counts towards this one, and closing it closes nothing."""
        return Progress(self.total, parent=self) if self.enabled else _OFF

    def close(self) -> None:
        """Close the bar (a no-op for callbacks, parts and disabled reports)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        if not self.enabled:
            return "<Progress off>"
        return f"<Progress {self.done}/{self.total if self.total is not None else '?'} bytes>"


_OFF = Progress()


def requested(progress: ProgressArg) -> bool:
    """Whether a ``progress=`` argument asks for reports (a callable that is also an empty container does).

    >>> requested(False), requested(None), requested(True), requested([].append)
    (False, False, True, True)
    """
    return progress is not None and progress is not False and (not isinstance(progress, Progress) or progress.enabled)


def progress_from(progress: ProgressArg, total: int | None, desc: str) -> Progress:
    """The :class:`Progress` that a ``progress=`` argument asks for, over ``total`` bytes, ``desc`` naming the work.

    ``False``/``None``: a disabled report; ``True``: a tqdm bar on stderr;
    a callable: called as ``callback(done, total, item)``; a ``Progress``: a
    part of it (see :meth:`Progress.child`). Anything else is a ``TypeError``.

    >>> progress_from(None, 100, "save"), progress_from(print, 100, "save")
    (<Progress off>, <Progress 0/100 bytes>)
    """
    if progress is None or progress is False:
        return _OFF
    if isinstance(progress, Progress):
        return progress.child()
    if progress is True:
        from tqdm import tqdm  # imported only when a bar is asked for

        bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   dynamic_ncols=True)
        return Progress(total, bar=bar)
    if callable(progress):
        return Progress(total, callback=progress)
    raise TypeError(f"progress must be False, True or a callable(done, total, item), got {progress!r}")
