"""Fault injection at every I/O call of a save, as SQLite tests itself.

``Faults(root)`` patches, for the length of a ``with`` block, every call a save makes on files under ``root``:

=========== ==========================================================================================
kind        calls
=========== ==========================================================================================
open        ``builtins.open``, ``os.open``
write       a Python file's ``write`` / ``flush`` (the writes that reach the kernel), ``os.write``
writev      the native gather writer's ``flush`` (one ``writev`` batch), in safetensors and NPZ
fsync       ``os.fsync``
rename      ``os.rename``, ``os.replace``, ``os.link``
renameat2   the commit's ``renameat2`` (no-replace, exchange)
mkdir       ``os.mkdir`` (``os.makedirs`` calls it)
unlink      ``os.unlink``, ``os.remove``, ``os.rmdir``
close       a Python file's ``close``, ``os.close``
=========== ==========================================================================================

A first run with ``fail_at=None`` records the calls (:attr:`Faults.calls`: ``(kind, path)`` in order). Then
``Faults(root, fail_at=i, error=e)`` makes call ``i`` fail: with ``e`` an errno, it raises ``OSError(e, ...,
path)`` instead of making the call; with ``e`` ``KeyboardInterrupt``, it makes the call and raises that right
after it (an interrupt delivered between call ``i`` and the next; one delivered before the first call changes
nothing). Exactly one call fails per run; later calls (the save's clean-up) run.

(An interrupt can also arrive inside a ``finally`` block just before its ``close()``; the descriptor then stays
open until it is garbage collected. No Python code can close that window; the harness does not model it.)
"""

from __future__ import annotations

import builtins
import errno
import os
import threading

ERRORS = (errno.EMFILE, errno.ENOSPC, errno.EIO, errno.EACCES, KeyboardInterrupt)
KINDS = ("open", "write", "writev", "fsync", "rename", "renameat2", "mkdir", "unlink", "close")


class Faults:
    def __init__(self, root, *, fail_at: int | None = None, error=errno.EIO):
        self.root = os.fspath(root).rstrip(os.sep) + os.sep
        self.fail_at, self.error = fail_at, error
        self.calls: list[tuple[str, str]] = []
        self.failed: tuple[str, str] | None = None  # the call that was made to fail
        self._fds: dict[int, tuple[str, tuple]] = {}  # descriptor -> (path, identity when opened)
        self._lock = threading.Lock()
        self._saved: list = []

    # -- the decision -----------------------------------------------------------------------------------------------
    def _ours(self, path) -> bool:
        try:
            return (os.path.abspath(os.fsdecode(path)) + os.sep).startswith(self.root)
        except TypeError:  # a descriptor given as a path
            return False

    def _track(self, fd: int, path) -> None:
        st = os.fstat(fd)
        self._fds[fd] = (os.fsdecode(path), (st.st_dev, st.st_ino))

    def _path_of(self, fd: int, forget: bool = False) -> str | None:
        """The path ``fd`` was opened with, if it is one of ours and still that file (numbers are reused)."""
        entry = self._fds.pop(fd, None) if forget else self._fds.get(fd)
        if entry is None:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        return entry[0] if (st.st_dev, st.st_ino) == entry[1] else None

    def _call(self, kind: str, path) -> bool:
        """Count the call; raise the fault if it is the one. True: raise KeyboardInterrupt once the call is made."""
        with self._lock:
            index = len(self.calls)
            self.calls.append((kind, os.fsdecode(path)))
            if index != self.fail_at:
                return False
            self.failed = (kind, os.fsdecode(path))
        if self.error is KeyboardInterrupt:
            return True
        raise OSError(self.error, f"{os.strerror(self.error)} (injected at {kind})", os.fsdecode(path))

    def _made(self, interrupt: bool, result):
        """After the call: the KeyboardInterrupt due after it, else its result."""
        if interrupt:
            raise KeyboardInterrupt(f"injected after {self.failed[0]} of {self.failed[1]}")
        return result

    # -- the patches ------------------------------------------------------------------------------------------------
    def _patch(self, owner, name, make):
        real = getattr(owner, name)
        self._saved.append((owner, name, real))
        setattr(owner, name, make(real))

    def __enter__(self) -> "Faults":
        faults = self

        def by_path(kind):
            def make(real):
                def call(path, *args, **kwargs):
                    interrupt = faults._ours(path) and kwargs.get("dir_fd") is None and faults._call(kind, path)
                    return faults._made(interrupt, real(path, *args, **kwargs))
                return call
            return make

        def two_paths(kind):
            def make(real):
                def call(src, dst, *args, **kwargs):
                    interrupt = (faults._ours(dst) or faults._ours(src)) and faults._call(kind, dst)
                    return faults._made(interrupt, real(src, dst, *args, **kwargs))
                return call
            return make

        def by_fd(kind):
            def make(real):
                def call(fd, *args, **kwargs):
                    path = faults._path_of(fd)
                    interrupt = path is not None and faults._call(kind, path)
                    return faults._made(interrupt, real(fd, *args, **kwargs))
                return call
            return make

        def os_close(real):
            def call(fd):
                path = faults._path_of(fd, forget=True)
                if path is None:
                    return real(fd)
                try:
                    interrupt = faults._call("close", path)
                except OSError:  # a failed close(2) still frees the descriptor
                    real(fd)
                    raise
                return faults._made(interrupt, real(fd))
            return call

        def os_open(real):
            def call(path, flags, *args, **kwargs):
                ours = faults._ours(path) and kwargs.get("dir_fd") is None
                interrupt = ours and faults._call("open", path)
                fd = real(path, flags, *args, **kwargs)
                if ours:
                    faults._track(fd, path)
                if interrupt:  # the descriptor is lost to the caller, as a real interrupt there loses it
                    real_close(fd)
                return faults._made(interrupt, fd)
            return call

        def builtin_open(real):
            def call(file, mode="r", *args, **kwargs):
                if isinstance(file, int) or not faults._ours(file):
                    return real(file, mode, *args, **kwargs)
                interrupt = faults._call("open", file)
                opened = real(file, mode, *args, **kwargs)
                if interrupt:  # the file object is lost to the caller, as a real interrupt there loses it
                    opened.close()
                    faults._made(interrupt, None)
                return _File(opened, faults, os.fsdecode(file))
            return call

        real_close = os.close
        self._patch(builtins, "open", builtin_open)
        self._patch(os, "open", os_open)
        self._patch(os, "write", by_fd("write"))
        self._patch(os, "fsync", by_fd("fsync"))
        self._patch(os, "close", os_close)
        for name in ("rename", "replace", "link"):
            self._patch(os, name, two_paths("rename"))
        self._patch(os, "mkdir", by_path("mkdir"))
        for name in ("unlink", "remove", "rmdir"):
            self._patch(os, name, by_path("unlink"))

        from fastckpt.store import commit

        self._patch(commit, "_renameat2_flags", two_paths("renameat2"))

        from fastckpt._native.gather import GatherWriter
        from fastckpt.formats import npz, safetensors

        class CountedGather(GatherWriter):
            def flush(self):
                path = faults._path_of(self._fd_for_faults)
                interrupt = path is not None and faults._call("writev", path)
                return faults._made(interrupt, super().flush())

        def gather(real):
            def make_writer(fd, *args, **kwargs):
                writer = CountedGather(fd, *args, **kwargs)
                writer._fd_for_faults = fd
                return writer
            return make_writer

        for module in (npz, safetensors):
            self._patch(module, "GatherWriter", gather)
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            owner, name, real = self._saved.pop()
            setattr(owner, name, real)


class _File:
    """A file object of a save: its writes, flushes and close are counted calls."""

    def __init__(self, file, faults: Faults, path: str):
        self._file, self._faults, self._path = file, faults, path
        faults._track(file.fileno(), path)

    def write(self, data):
        interrupt = self._faults._call("write", self._path)
        return self._faults._made(interrupt, self._file.write(data))

    def flush(self):
        interrupt = self._faults._call("write", self._path)
        return self._faults._made(interrupt, self._file.flush())

    def close(self):
        if self._file.closed:
            return None
        self._faults._path_of(self._file.fileno(), forget=True)
        try:
            interrupt = self._faults._call("close", self._path)
        except OSError:  # a failed close(2) still frees the descriptor
            self._file.close()
            raise
        return self._faults._made(interrupt, self._file.close())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __iter__(self):
        return iter(self._file)
