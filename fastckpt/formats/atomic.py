"""Atomic, durable writes of files and directories.

A reader must never see a half-written file under its final name, and a crash
must never destroy the previous good copy. Every save in fastckpt therefore:

1. writes to a temporary name in the *same* directory
   (``.<name>.<pid>.<random>.partial``), so that the rename below stays on one
   filesystem;
2. flushes and ``fsync``\\ s the temporary file (or every file of a temporary
   directory);
3. ``os.replace``\\ s it onto the final name (atomic on POSIX);
4. ``fsync``\\ s the parent directory, so that the rename itself is durable.

On any exception the temporary is removed and the final name is untouched.
A temporary left behind by a process that died (``kill -9``, power loss) is
removed by the next save of the same target, but only when the process that
made it is gone, so two live writers never delete each other's work.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write", "atomic_directory", "fsync_directory", "remove_stale_partials", "remove_stale_partials_in"]

_SUFFIX = ".partial"
# Small writes (headers, many small tensors) gather into one write() per 256 KiB; a write at least this
# large goes straight to the file without a copy.
_WRITE_BUFFER = 256 << 10


def _partial_name(final: Path) -> Path:
    return Path(_partial_path(os.fspath(final)))


def _partial_path(final: str) -> str:
    """The temporary name of ``final`` for this process: same directory, hidden, ours by pid."""
    head, name = os.path.split(final)
    return os.path.join(head, f".{name}.{os.getpid()}.{os.urandom(4).hex()}{_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_partials(final: str | os.PathLike) -> list[Path]:
    """Remove temporaries of ``final`` left by writers that no longer run.

    Returns the paths removed. Temporaries of this process, or of any live
    process, are kept.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / ".w.bin.999999999.ab12cd34.partial").write_bytes(b"half")
    4
    >>> [p.name for p in remove_stale_partials(d / "w.bin")]
    ['.w.bin.999999999.ab12cd34.partial']
    """
    head, name = os.path.split(os.fspath(final))
    return _remove_stale(head or ".", name)


def remove_stale_partials_in(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of any name in ``directory`` left by writers that no longer run.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / ".a.999999999.ab12cd34.partial").mkdir(); (d / ".b.bin.999999999.00ff00ff.partial").mkdir()
    >>> sorted(p.name for p in remove_stale_partials_in(d))
    ['.a.999999999.ab12cd34.partial', '.b.bin.999999999.00ff00ff.partial']
    """
    return _remove_stale(os.fspath(directory), None)


def _remove_stale(parent: str, name: str | None) -> list[Path]:
    """Remove ``.NAME.PID.HEX.partial`` entries of ``parent`` whose PID is gone (of one NAME, or of any)."""
    removed = []
    try:
        entries = os.scandir(parent)  # one directory read, no stat per entry
    except (FileNotFoundError, NotADirectoryError):
        return removed
    with entries:
        for entry in entries:
            entry_name = entry.name
            if not (entry_name.startswith(".") and entry_name.endswith(_SUFFIX)):
                continue
            parts = entry_name[1 : -len(_SUFFIX)].rsplit(".", 2)
            if len(parts) != 3 or not parts[1].isdigit() or (name is not None and parts[0] != name):
                continue
            if _pid_alive(int(parts[1])):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def fsync_directory(path: str | os.PathLike) -> None:
    """``fsync`` a directory so that renames and creations inside it are durable.

    >>> import tempfile
    >>> fsync_directory(tempfile.mkdtemp())
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """Open a temporary file that replaces ``path`` atomically when the block succeeds.

    ``fsync=False`` skips both fsyncs (faster, still atomic against readers, not
    durable against power loss). Parent directories are created.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.bin"
    >>> with atomic_write(target) as f:
    ...     _ = f.write(b"payload")
    >>> target.read_bytes()
    b'payload'
    """
    final = os.fspath(path)
    parent = os.path.dirname(final) or "."
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    remove_stale_partials(final)
    tmp = _partial_path(final)
    f = open(tmp, "xb", buffering=_WRITE_BUFFER)
    try:
        yield f
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_directory(parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=None)
def _renameat2():
    """glibc's ``renameat2`` (Linux 3.15+, glibc 2.28+), or None where the C library lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step; False where the system or filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` onto ``final``; an existing ``final`` directory is replaced.

    Where Linux's ``renameat2(RENAME_EXCHANGE)`` works, the two directories trade
    places in one atomic step, so ``final`` always names a complete directory,
    even if the process dies right after; the old one, now under the temporary
    name, is then removed (or swept as a dead writer's leftover). Elsewhere the
    old one is moved aside first, and put back if the second rename fails.
    """
    if not final.exists():
        os.replace(tmp, final)
        return
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = _partial_name(final)
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, fsync: bool = True, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` when the block succeeds.

    Everything written inside is fsynced before the rename. An existing ``path``
    is an error unless ``overwrite=True`` (then the old directory is replaced
    after the new one is complete).

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "step-1"
    >>> with atomic_directory(target) as tmp:
    ...     _ = (tmp / "a.txt").write_text("x")
    >>> sorted(p.name for p in target.iterdir())
    ['a.txt']
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists; pass overwrite=True to replace it")
    tmp = _partial_name(final)
    tmp.mkdir()
    try:
        yield tmp
        if fsync:
            for root, _dirs, files in os.walk(tmp):
                for name in files:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                fsync_directory(root)
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_directory(final.parent)
