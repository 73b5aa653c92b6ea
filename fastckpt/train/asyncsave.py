"""Asynchronous checkpoint saves: snapshot now, write in the background, at most one in flight.

``AsyncCheckpointer.save`` blocks the trainer only while it takes a
consistent snapshot of every piece of state — each array copied into a staging
buffer, every Python state serialized to JSON — and then returns a
:class:`SaveHandle`; a background thread writes the checkpoint directory
(atomically, as :func:`fastckpt.train.checkpoint.save_checkpoint` does). The
trainer may change weights, optimizer moments, scheduler, data iterator and RNG
the moment ``save`` returns: the checkpoint holds the state of that instant,
never a torn or mixed-step one.

At most one save is in flight: the next ``save`` first waits for the previous
one. A save still in flight when the program ends is finished before the
interpreter shuts its thread pools down (a hook that runs at the start of the
interpreter's shutdown, before ``atexit`` and before ``concurrent.futures``
refuses new work) and committed; if it fails there, its error is printed and
the process exits with status 1, never 0 without its checkpoint. A failure in the background is raised by ``handle.wait()`` or, if nobody
waited, by the next ``save`` or ``wait`` (once); a ``save`` that raises an
earlier save's error saves nothing itself, so call it again.

Staging buffers are kept and reused by the next snapshot of the same shapes:
copying into memory already touched is several times faster than into fresh
pages, so only the first asynchronous save pays for page faults. This holds
one extra copy of the training state in host memory; ``release_buffers()``
frees it.

>>> import numpy as np, tempfile, os
>>> from fastckpt.train import TinyLM, SGD
>>> model = TinyLM(vocab=8, dim=4, hidden=8); opt = SGD(model.parameters(), lr=0.1)
>>> saver = AsyncCheckpointer()
>>> handle = saver.save(os.path.join(tempfile.mkdtemp(), "c"), model, opt, step=5)
>>> model.embed.weight.data[:] = 0          # safe: the snapshot was taken already
>>> handle.wait()[:7]                        # the checkpoint's digest, "blake3:<hex>"
'blake3:'
>>> saver.close()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastckpt.store.commit import overwrite_flag
from fastckpt.threads import kept_pool
from fastckpt.train.checkpoint import check_hash, write_snapshot
from fastckpt.train.format import DEFAULT_HASH
from fastckpt.train.snapshot import take_snapshot

__all__ = ["SaveHandle", "AsyncCheckpointer", "StagingPool"]


# Every checkpointer that may have a save in flight; the exit hook waits for each.
_live: weakref.WeakSet = weakref.WeakSet()
_live_lock = threading.Lock()
_exit_hook_installed = False


def _finish_saves_at_exit() -> None:
    """Wait for every save in flight and commit it; a failure is printed and the process exits with status 1.

    Runs first in the interpreter's shutdown (``threading._register_atexit``, after the program's last line and
    before ``concurrent.futures`` refuses new work, which a save's fsync pool needs)."""
    with _live_lock:
        savers = list(_live)
    failed = []
    for saver in savers:
        last = saver._last
        try:
            saver.wait()
        except BaseException as exc:  # noqa: BLE001 - reported below, then the exit status says so
            failed.append((last, exc))
    if not failed:
        return
    for last, exc in failed:
        where = f" of {os.fspath(last.path)} (step {last.step})" if last is not None else ""
        print(f"fastckpt: the checkpoint save{where} still in flight when the program ended failed; "
              f"no checkpoint was committed:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(1)


def _watch(saver: "AsyncCheckpointer") -> None:
    """Have the exit hook wait for ``saver``'s saves (the hook installed once, after concurrent.futures' own, so
    that it runs before that one: the interpreter runs them last registered first)."""
    global _exit_hook_installed
    with _live_lock:
        _live.add(saver)
        if _exit_hook_installed:
            return
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is not None:
                register(_finish_saves_at_exit)
            else:  # an interpreter without it: atexit, which runs after the pools stop taking work
                import atexit

                atexit.register(_finish_saves_at_exit)
            _exit_hook_installed = True
        except RuntimeError:  # the interpreter is shutting down already
            pass


_SPLIT_MIN = 8 << 20  # below this a second thread costs more than it saves


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``; a large contiguous copy is split over two threads.

    The trainer is blocked for as long as the snapshot copies take, and numpy
    releases the GIL while copying, so two cores halve the wait.
    """
    if src.nbytes < _SPLIT_MIN or not src.flags.c_contiguous or (os.cpu_count() or 1) < 2:
        np.copyto(dst, src)
        return
    d, s = dst.reshape(-1), src.reshape(-1)
    mid = d.size // 2
    half = kept_pool("stage", 1).submit(np.copyto, d[:mid], s[:mid])
    try:
        np.copyto(d[mid:], s[mid:])
    finally:
        half.result()  # never return while the other half still writes into dst


class StagingPool:
    """Host buffers for snapshots, reused across saves with the same shapes and dtypes.

    >>> pool = StagingPool(); a = np.arange(3.0)
    >>> b = pool.stage(a); b is a, np.array_equal(a, b)
    (False, True)
    >>> pool.release([b]); pool.stage(a) is b
    True
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def stage(self, arr: np.ndarray) -> np.ndarray:
        """A C-contiguous private copy of ``arr`` in a reused buffer when one fits."""
        key = (arr.dtype.str, arr.shape)
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
        if buf is None:
            buf = np.empty(arr.shape, dtype=arr.dtype)
        _copy(buf, arr)
        return buf

    def release(self, arrays) -> None:
        """Give buffers back for the next snapshot."""
        with self._lock:
            for a in arrays:
                self._free.setdefault((a.dtype.str, a.shape), []).append(a)

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for bufs in self._free.values() for a in bufs)


class SaveHandle:
    """A background save: ``wait()`` returns the checkpoint's digest or raises the save's error.

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> with AsyncCheckpointer() as saver:
    ...     handle = saver.save(os.path.join(tempfile.mkdtemp(), "c"), TinyLM(vocab=8, dim=4, hidden=8), step=1)
    ...     handle.wait()[:7], handle.done(), handle.step
    ('blake3:', True, 1)
    """

    def __init__(self, future: concurrent.futures.Future, path: Path, step: int) -> None:
        self._future = future
        self.path = path
        self.step = step
        self._reported = False

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is on disk; returns its digest (``"blake3:<hex>"``) or raises the save's error."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except BaseException:
            self._reported = True
            raise

    def _unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        exc = self._future.exception()
        if exc is not None:
            self._reported = True
        return exc

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "done")
        return f"<SaveHandle step={self.step} {state} {str(self.path)!r}>"


class AsyncCheckpointer:
    """Writes checkpoints in one background thread, at most one at a time.

    ``before_write`` and ``after_write`` callables run in the background
    thread around the write (the manager records and prunes there).
    ``hash`` is the file hash of the manifests (``"blake3"`` or ``"sha256"``).

    >>> import tempfile, os
    >>> from fastckpt.train import TinyLM
    >>> root, model = tempfile.mkdtemp(), TinyLM(vocab=8, dim=4, hidden=8)
    >>> with AsyncCheckpointer(fsync=False) as saver:
    ...     first = saver.save(os.path.join(root, "a"), model, step=1)
    ...     second = saver.save(os.path.join(root, "b"), model, step=2)   # waits for the first
    ...     first.done(), second.wait() == first.wait()
    (True, True)
    """

    def __init__(self, *, fsync: bool = True, hash: str = DEFAULT_HASH) -> None:
        self.fsync = fsync
        self.hash = check_hash(hash)
        self.pool = StagingPool()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastckpt-async-save")
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()
        _watch(self)

    def _settle_previous(self) -> None:
        last = self._last
        if last is None:
            return
        concurrent.futures.wait([last._future])
        exc = last._unreported_error()
        if exc is not None:
            raise exc

    def wait(self) -> str | None:
        """Wait for the save in flight; raise its error unless already raised. Returns its digest (or None)."""
        with self._lock:
            self._settle_previous()
            last = self._last
            return None if last is None or last._future.exception() else last._future.result()

    def save(self, out_dir: str | os.PathLike, model: Any, optimizer: Any = None, scheduler: Any = None,
             data_iter: Any = None, train_rng: Any = None, *, step: int, epoch: int = 0,
             metrics: dict | None = None, scaler: Any = None, seed: int | None = None, config: Any = None,
             data_manifest: Any = None, overwrite: bool = False,
             before_write: Callable[[], None] | None = None,
             after_write: Callable[[], None] | None = None, progress=False) -> SaveHandle:
        """Snapshot every state now and write it to ``out_dir`` in the background; see the module docstring.

        ``progress`` (:mod:`fastckpt.progress`) reports the write from the background thread.
        An existing ``out_dir`` is replaced only with ``overwrite=True``
        (docs/overwrite.md); the
        refusal of a checkpoint committed meanwhile comes from ``wait()``.
        """
        overwrite = overwrite_flag(overwrite)
        with self._lock:
            self._settle_previous()
            snap = take_snapshot(model, optimizer, scheduler, data_iter, train_rng, step=step, epoch=epoch,
                                 metrics=metrics, scaler=scaler, seed=seed, config=config,
                                 data_manifest=data_manifest, stage=self.pool.stage)
            staged = list(snap.weights.tensors.values()) + (list(snap.optim.tensors.values()) if snap.optim else [])
            path = Path(out_dir)

            def job() -> str:
                try:
                    if before_write is not None:
                        before_write()
                    digest = write_snapshot(snap, path, overwrite=overwrite, fsync=self.fsync, hash=self.hash,
                                            progress=progress)
                    if after_write is not None:
                        after_write()
                    return digest
                finally:
                    self.pool.release(staged)

            self._last = SaveHandle(self._executor.submit(job), path, int(step))
            return self._last

    def release_buffers(self) -> None:
        """Free the staging buffers kept for the next snapshot."""
        self.pool.clear()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self.pool.clear()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
