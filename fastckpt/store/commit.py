"""The one commit: how every save of fastckpt becomes visible, whole or not at all.

A reader must never see a half-written file or a mix of two saves under a checkpoint's name, a failed or
interrupted save must leave the previous commit exactly as it was, and a writer that did not ask to replace a
commit never does. Every writer (single files, TensorFlow prefixes, Hugging Face sharded directories, fastckpt's
sharded and RecIS layouts, training checkpoints, the manager's record) goes through this module, and no other
module of fastckpt renames or fsyncs a checkpoint's files (``tests/test_architecture.py`` checks that).

The protocol (docs/commit.md says the same for users)
    1. **Stage.** Everything is written under a private name in the target's own directory (so that the last
       step stays on one filesystem): a file as
       ``.<name>.@<host>~<pid namespace>.<pid>.<random>.partial``, a set of files or a directory inside a
       staging directory of that name. Nothing under a final name is touched while writing.
    2. **Sync.** Every staged file is ``fsync``\\ ed, and the staging directory too.
    3. **Publish, one atomic step.** Only :meth:`Commit.publish` (or leaving an :func:`atomic_write` /
       :func:`atomic_directory` block *without* an exception) publishes; an error path only ever discards.

       - a file: a rename onto its name;
       - a directory (:func:`atomic_directory`, :class:`Commit` ``kind="directory"``): a rename of the staging
         directory onto the name;
       - a set of files sharing a prefix (TensorFlow's ``<prefix>.index`` + data files, Hugging Face's shards +
         index; :class:`Commit` ``kind="files"``): under an ``flock`` of ``.<name>.commit-lock`` in the
         directory (every writer of that name takes it, so the check and the renames are one step to any other
         writer), every name the layout *claims* is checked (a layout claims each name any save of it could
         publish, so a one-file and a sharded Hugging Face save into one directory conflict); with
         ``overwrite=True`` the previous save's files are moved aside into the staging directory, entry points
         first; then the data files are renamed in and the entry point (index) last. On any failure the files
         renamed in are removed and the previous save's files put back, so the previous commit loads exactly.
         Readers during the step see the previous commit, or (``overwrite=True``, for the few renames of the
         step) no checkpoint at all; never a mix.

       With ``overwrite=False`` the rename refuses an existing name in the same atomic step (Linux's
       ``renameat2(RENAME_NOREPLACE)``; elsewhere ``link`` + ``unlink`` for a file, and for a directory an
       exclusive ``mkdir`` of the name, then the rename over that empty placeholder: :func:`rename_noreplace`),
       so of two writers racing for one name exactly one commits and the other gets :class:`FileExistsError`
       naming the target and leaves nothing. With ``overwrite=True``: ``os.replace`` (a file) or
       ``renameat2(RENAME_EXCHANGE)`` (a directory: the two trade places at once).
    4. **Sync the parent directory**, so that the rename itself is durable. If that fails, the step is taken
       back (the previous directory exchanged back, the files put back): a save that raises has not committed.

On any exception (``OSError``, ``KeyboardInterrupt``, anything) the staging place is removed and the final names
are untouched. An ``OSError`` (``EACCES``, ``ENOSPC``, ``EFBIG``, ``EISDIR``, ``ENOTDIR``, ...) names the target
path (or the file under a target directory); the temporary appears only in the message's detail.

Leftovers (sweeps)
    A temporary left behind by a process that died (``kill -9``, power loss)
    is removed by a later save into the same directory. The owner part of the
    name (host name, and the inode of the writer's pid namespace) decides how:
    a temporary of *this* host and pid namespace is removed once its pid is
    gone; one of another host or pid namespace (a filesystem shared over NFS
    or Lustre, a container) cannot be checked for life, so it is removed only
    when nothing in it changed for :data:`STALE_AFTER` seconds (one hour by
    default; the environment variable ``FASTCKPT_STALE_AFTER`` sets it). The
    pid-only names of fastckpt 0.2 (``.<name>.<pid>.<random>.partial``) say
    nothing of their host and fall under the same age limit. A sweep never
    follows a symbolic link: a link named like a temporary is unlinked, never
    its target. A set-of-files commit killed during its step leaves its lock
    file (the lock itself dies with the process) and the previous save's files
    in its staging directory: the next commit of that name removes the lock file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import IO, Iterator

__all__ = ["Commit", "atomic_write", "atomic_directory", "fsync_directory", "fsync_file", "fsync_open", "write_file",
           "staged_file", "staging_directory", "publish_directory", "abandon_staging", "retire_directory", "remove_temporary", "remove_stale_partials",
           "remove_stale_partials_in", "rename_noreplace", "link_over", "overwrite_flag", "STALE_AFTER"]

_SUFFIX = ".partial"
# Small writes (headers, many small tensors) gather into one write() per 256 KiB; a write at least this
# large goes straight to the file without a copy.
_WRITE_BUFFER = 256 << 10

#: Seconds without a change after which a sweep removes a temporary it cannot check for life (another
#: host's or pid namespace's, or a 0.2 name). Long enough for any save that keeps writing: a sharded
#: staging directory's age is that of its newest file, and every shard file changes as it is written.
STALE_AFTER: float = float(os.environ.get("FASTCKPT_STALE_AFTER", 3600))


@functools.lru_cache(maxsize=4)
def _owner_for(pid: int) -> str:
    """``@<host>~<pid namespace inode>``: who may check this process's pids for life (cached per pid: a fork
    keeps host and namespace, and ``unshare`` needs a fork to take effect)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname() or "unknown")[:64]
    try:
        namespace = f"~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc (macOS, BSD): one pid namespace per host
        namespace = ""
    return f"@{host}{namespace}"


def _owner() -> str:
    return _owner_for(os.getpid())


def _partial_name(final: Path) -> Path:
    return Path(_partial_path(os.fspath(final)))


def _partial_path(final: str) -> str:
    """The temporary name of ``final`` for this process: same directory, hidden, ours by host, pid namespace and pid."""
    head, name = os.path.split(final)
    return os.path.join(head, f".{name}.{_owner()}.{os.getpid()}.{os.urandom(4).hex()}{_SUFFIX}")


def _parse_partial(entry_name: str) -> tuple[str, str | None, int] | None:
    """``(name, owner, pid)`` of a temporary's file name (owner None for a 0.2 name), or None if it is none."""
    if not (entry_name.startswith(".") and entry_name.endswith(_SUFFIX)):
        return None
    core = entry_name[1 : -len(_SUFFIX)]
    parts = core.rsplit(".", 3)
    if len(parts) == 4 and parts[1].startswith("@") and parts[2].isdigit() and _is_hex(parts[3]):
        return parts[0], parts[1], int(parts[2])
    parts = core.rsplit(".", 2)
    if len(parts) == 3 and parts[1].isdigit() and _is_hex(parts[2]):
        return parts[0], None, int(parts[1])
    return None


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


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


def _newest_change(path: str) -> float:
    """The newest ``mtime`` of ``path`` and, for a directory, of anything inside it; links are not followed."""
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path, followlinks=False):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _is_stale(path: str, owner: str | None, pid: int, stale_after: float) -> bool:
    if owner == _owner():
        return not _pid_alive(pid)
    try:
        return time.time() - _newest_change(path) > stale_after
    except FileNotFoundError:
        return False


def remove_stale_partials(final: str | os.PathLike, *, stale_after: float | None = None) -> list[Path]:
    """Remove temporaries of ``final`` left by writers that no longer run.

    Returns the paths removed. Temporaries of this process, or of any live
    process of this host and pid namespace, are kept; those of other hosts
    (or of 0.2, which named no host) only once unchanged for ``stale_after``
    seconds (default :data:`STALE_AFTER`, one hour). Symbolic links are
    removed as links, never followed.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> dead = d / f".w.bin.{_owner()}.999999999.ab12cd34.partial"
    >>> dead.write_bytes(b"half")
    4
    >>> remove_stale_partials(d / "w.bin") == [dead]
    True
    """
    head, name = os.path.split(os.fspath(final))
    return _remove_stale(head or ".", name, stale_after)


def remove_stale_partials_in(directory: str | os.PathLike, *, stale_after: float | None = None) -> list[Path]:
    """Remove the temporaries of any name in ``directory`` left by writers that no longer run.

    The rules of :func:`remove_stale_partials`, for every name at once.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / f".a.{_owner()}.999999999.ab12cd34.partial").mkdir()
    >>> (d / ".b.bin.@elsewhere.999999999.00ff00ff.partial").mkdir()   # another host's: kept for an hour
    >>> [p.name.split(".")[1] for p in remove_stale_partials_in(d)]
    ['a']
    """
    return _remove_stale(os.fspath(directory), None, stale_after)


# Temporaries of this process whose removal failed (an EIO while a failed save cleaned up): this process is alive,
# so no sweep would take them as a dead writer's; every sweep retries them first.
_abandoned: set[str] = set()
_abandoned_lock = threading.Lock()


def link_over(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make ``target`` another name of the file ``source``, in place of what it named: a hard link made under a
    temporary name, then the old ``target`` removed and the link renamed to it. ``OSError`` where no link can be
    made (another file system, ``source`` gone), ``target`` then unchanged. Nothing is fsynced, and for a moment
    ``target`` names nothing: for local copies that no one has open and that need not outlive the process (the
    shares of a load from a URL).

    The link is never renamed over an existing name: on ext4 (``auto_da_alloc``, the default) a rename that
    replaces a file starts writing the renamed file's dirty pages to disk first, as a save's commit wants; for a
    file just fetched into a temporary copy that meant 40-110 ms of writeback for nothing, in the load's path.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> for name, text in (("a", "new"), ("b", "old")):
    ...     _ = Path(d, name).write_text(text)
    >>> link_over(Path(d, "a"), Path(d, "b")); Path(d, "b").read_text(), os.stat(Path(d, "a")).st_nlink
    ('new', 2)
    """
    target = os.fspath(target)
    temporary = f"{target}.link-{os.getpid()}-{threading.get_ident()}"
    os.link(source, temporary)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        os.rename(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def remove_temporary(path: str | os.PathLike) -> None:
    """Remove a staging directory or temporary file of this process; if that fails, every later sweep (of any
    directory) tries again, so a failed clean-up never leaves it for good.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / ".x.partial"; d.mkdir(); remove_temporary(d); d.exists()
    False
    """
    path = os.fspath(path)
    try:
        with contextlib.suppress(OSError):  # rmtree(ignore_errors=True) still raises when a close() fails
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    except BaseException:  # interrupted: the next sweep finishes it
        with _abandoned_lock:
            _abandoned.add(path)
        raise
    if os.path.lexists(path):
        with _abandoned_lock:
            _abandoned.add(path)


def _retry_abandoned() -> None:
    with _abandoned_lock:
        paths = list(_abandoned)
        _abandoned.clear()
    for path in paths:
        remove_temporary(path)


def _remove_stale(parent: str, name: str | None, stale_after: float | None) -> list[Path]:
    """Remove the stale temporaries of ``parent`` (of one NAME, or of any)."""
    _retry_abandoned()
    stale_after = STALE_AFTER if stale_after is None else stale_after
    removed = []
    try:
        entries = os.scandir(parent)  # one directory read, no stat per entry
    except (FileNotFoundError, NotADirectoryError):
        return removed
    with entries:
        for entry in entries:
            parsed = _parse_partial(entry.name)
            if parsed is None or (name is not None and parsed[0] != name):
                continue
            if not _is_stale(entry.path, parsed[1], parsed[2], stale_after):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:  # a file, or a link: the link itself goes, never what it points to
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def overwrite_flag(overwrite: object) -> bool:
    """``overwrite=`` as every writer takes it: ``True`` replaces an existing target, ``False`` (the default
    everywhere) refuses it with :class:`FileExistsError`. Anything else is a :class:`TypeError`, so that a
    misspelt value never decides whether a file is destroyed.

    fastckpt 0.2 and 0.3 replaced an existing target when ``overwrite=`` was left out of ten writers (0.3 with a
    ``FutureWarning``); since 0.4 a left-out ``overwrite=`` is ``False`` for every writer (docs/overwrite.md).

    >>> overwrite_flag(False), overwrite_flag(True)
    (False, True)
    >>> overwrite_flag(None)
    Traceback (most recent call last):
    TypeError: overwrite must be True or False, got None (docs/overwrite.md)
    """
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r} (docs/overwrite.md)")
    return overwrite


def _naming_target(exc: OSError, final: str, tmp: str | None, *, inside: bool = False) -> OSError:
    """``exc`` with the target as its file name, the temporary only in the detail.

    An error that already names another path (a source file read during the
    save) is returned as it is. ``inside``: ``tmp`` is a staging directory and
    the error may name a file within it, which is then named under ``final``.
    """
    name = exc.filename
    if exc.errno is None:
        return exc
    if name is None:
        target = final
    elif tmp is not None and os.fspath(name) == tmp:
        target = final
    elif inside and tmp is not None and os.fspath(name).startswith(tmp + os.sep):
        target = os.path.join(final, os.path.relpath(os.fspath(name), tmp))
    else:
        return exc
    detail = exc.strerror or os.strerror(exc.errno)
    if tmp is not None and " (written through the temporary " not in detail:  # once: an inner commit named it
        detail += f" (written through the temporary {os.path.basename(tmp)!r})"
    try:
        renamed = type(exc)(exc.errno, detail, target)
    except TypeError:
        renamed = OSError(exc.errno, detail, target)
    renamed.__cause__ = exc.__cause__
    renamed.__traceback__ = exc.__traceback__
    return renamed


def _make_parent(parent: str, final: str) -> list[str]:
    """Create ``final``'s parent directory; an ancestor that is a file is ``NotADirectoryError`` naming ``final``.
    Returns the directories made, deepest first (:func:`_remove_made` takes them back after a failed save)."""
    if os.path.isdir(parent):
        return []
    missing = []
    here = os.path.abspath(parent)
    while not os.path.lexists(here):
        missing.append(here)
        here = os.path.dirname(here)
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # makedirs reports a file in the way as either
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}: a part of the parent path "
                                 "is a file, not a directory", final) from None
    return missing


def _remove_made(made: list[str]) -> None:
    """Remove the directories a failed save made (deepest first), as far as they are empty."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            return


# The directories made for a staging directory that is not published yet: removed with it when it is abandoned.
_made_for: dict[str, list[str]] = {}


def abandon_staging(staging: str | os.PathLike) -> None:
    """Remove a staging directory that will not be published, and the directories made for it if they are empty
    again (a failed save leaves nothing it created).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); s = staging_directory(d / "new" / "ckpt", overwrite=False)
    >>> abandon_staging(s); list(d.iterdir())
    []
    """
    staging = os.fspath(staging)
    remove_temporary(staging)
    _remove_made(_made_for.pop(staging, []))


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


def fsync_file(path: str | os.PathLike) -> None:
    """``fsync`` the file ``path`` (written and closed before, by this process or another rank).

    >>> import tempfile, os
    >>> fd, name = tempfile.mkstemp(); os.close(fd); fsync_file(name)
    """
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_open(f) -> None:
    """Flush the open file ``f`` of a staging place (a writer's own stream) and fsync it.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"x"); fsync_open(f)
    """
    f.flush()
    os.fsync(f.fileno())


def write_file(path: str | os.PathLike, data, *, fsync: bool = True) -> None:
    """Write ``data`` to the new file ``path`` and fsync it: a file of a staging place, published with it.

    ``path`` must not exist (it is a staging place's own name). Whoever publishes the staging place fsyncs its
    directory.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.json"; write_file(p, b"{}"); p.read_bytes()
    b'{}'
    """
    with staged_file(path, fsync=fsync) as f:
        view = memoryview(data).cast("B")
        while view:  # an unbuffered write may be short
            view = view[f.write(view):]


@contextlib.contextmanager
def staged_file(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """Open the new file ``path`` of a staging place (a directory published whole: :func:`staging_directory`,
    :func:`publish_directory`) for writing, unbuffered; on leaving the block it is fsynced (unless ``fsync=False``)
    and closed, and on an exception closed and removed (an ``OSError`` of its writes then names ``path``).

    The file is written under its own name, with no temporary and rename of its own (:func:`atomic_write`'s):
    nothing reads a staging place before it is published, and the publish is the one atomic step. ``path`` must
    not exist. Whoever publishes the staging place fsyncs its directory.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.bin"
    >>> with staged_file(p) as f:
    ...     _ = f.write(b"data")
    >>> p.read_bytes()
    b'data'
    """
    f = open(path, "xb", buffering=0)
    try:
        yield f
        if fsync:
            os.fsync(f.fileno())
    except BaseException as e:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # a write's error names the file
            raise _naming_target(e, os.fspath(path), None) from None
        raise
    f.close()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, fsync: bool = True, overwrite: bool = False) -> Iterator[IO[bytes]]:
    """Open a temporary file that becomes ``path`` atomically when the block succeeds.

    An existing ``path`` is an error (:class:`FileExistsError` naming it, at
    the start, or at the commit where another writer got there first) unless
    ``overwrite=True``, which replaces it in one step. ``fsync=False`` skips
    both fsyncs (faster, still atomic against readers, not durable against
    power loss). Parent directories are created. An ``OSError`` names
    ``path``, with the temporary as detail.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.bin"
    >>> with atomic_write(target) as f:
    ...     _ = f.write(b"payload")
    >>> target.read_bytes()
    b'payload'
    >>> with atomic_write(target, overwrite=True) as f:
    ...     _ = f.write(b"second")
    >>> target.read_bytes()
    b'second'
    """
    final = os.fspath(path)
    parent = os.path.dirname(final) or "."
    tmp, made = None, []
    try:
        made = _make_parent(parent, final)
        if not overwrite and os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}; pass overwrite=True to replace it",
                                  final)
        if os.path.isdir(final) and not os.path.islink(final):
            raise IsADirectoryError(errno.EISDIR, f"{os.strerror(errno.EISDIR)}; a file never replaces a directory",
                                    final)
        remove_stale_partials(final)
        tmp = _partial_path(final)
        f = open(tmp, "xb", buffering=_WRITE_BUFFER)
    except BaseException as e:
        if tmp is not None and not isinstance(e, OSError):  # made, then interrupted before it was handed over
            remove_temporary(tmp)
        _remove_made(made)
        if not isinstance(e, OSError):
            raise
        raise _naming_target(e, final, tmp) from None
    try:
        yield f
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        f.close()
        if overwrite:
            os.replace(tmp, final)
        else:
            rename_noreplace(tmp, final)
    except BaseException as e:
        with contextlib.suppress(OSError):  # close() flushes, and fails again where the write did
            f.close()
        remove_temporary(tmp)
        _remove_made(made)
        if isinstance(e, OSError):
            raise _naming_target(e, final, tmp) from None
        raise
    if fsync:
        try:
            fsync_directory(parent)
        except OSError as e:  # the file is in place; whether its rename is durable is not known: say so
            raise type(e)(e.errno, f"{e.strerror} (while making the rename durable; the file is in place)",
                          final) from None


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
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


def _renameat2_flags(a: str | os.PathLike, b: str | os.PathLike, flags: int) -> bool:
    """``renameat2(a, b, flags)``: True if done, False where the system or filesystem cannot; else OSError."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    if err == errno.EEXIST:
        raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)} (another writer committed it first); "
                              "pass overwrite=True to replace it", os.fspath(b))
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step; False where the system or filesystem cannot."""
    return _renameat2_flags(a, b, _RENAME_EXCHANGE)


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists, in one atomic step: :class:`FileExistsError` naming ``dst``.

    Linux's ``renameat2(RENAME_NOREPLACE)`` where the kernel and filesystem
    have it. Elsewhere (NFS, macOS, older kernels) the claim on ``dst`` is an
    operation that fails on an existing name: a file is hard-linked to
    ``dst`` and ``src`` unlinked; a directory (or a file on a filesystem
    without hard links) first creates ``dst`` empty with ``O_EXCL`` or
    ``mkdir``, then renames ``src`` over that placeholder. Of two writers
    racing for ``dst`` exactly one wins either way; during the fallback's two
    steps a reader can see an empty ``dst``, never a partial one.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a").write_text("1"), (d / "b").write_text("2")
    >>> rename_noreplace(d / "a", d / "c"); sorted(p.name for p in d.iterdir())
    ['b', 'c']
    >>> rename_noreplace(d / "c", d / "b")
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists (another writer committed it first); pass overwrite=True to replace it: '...b'
    """
    if _renameat2_flags(src, dst, _RENAME_NOREPLACE):
        return
    exists = FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)} (another writer committed it first); "
                             "pass overwrite=True to replace it", os.fspath(dst))
    is_dir = os.path.isdir(src) and not os.path.islink(src)
    if not is_dir:
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            raise exists from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                raise
        else:
            os.unlink(src)
            return
    try:  # the placeholder: creating it is the exclusive claim
        if is_dir:
            os.mkdir(dst)
        else:
            os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise exists from None
    try:
        os.replace(src, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            (os.rmdir if is_dir else os.unlink)(dst)
        raise


def _identity(path) -> tuple | None:
    """``(device, inode)`` of ``path`` itself (links not followed), or None if nothing is there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _swap_in(tmp: Path, final: Path, *, overwrite: bool = True, aside: Path | None = None) -> None:
    """Rename the directory ``tmp`` onto ``final``; an existing ``final`` is replaced only with ``overwrite``.

    A ``final`` that does not exist is taken by a no-replace rename, so of two
    writers racing for it exactly one wins. An existing one, with
    ``overwrite``: where Linux's ``renameat2(RENAME_EXCHANGE)`` works, the two
    directories trade places in one atomic step, so ``final`` always names a
    complete directory, even if the process dies right after (the old one is
    then under ``tmp``). Elsewhere the old one is moved to ``aside`` first, and
    put back if the second rename fails.
    """
    try:
        rename_noreplace(tmp, final)
        return
    except FileExistsError:
        if not overwrite:
            raise
    if _exchange(tmp, final):
        return
    aside = aside or _partial_name(final)
    os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(aside, final)
        raise


def _take_back(tmp: Path, final: Path, aside: Path, new: tuple | None) -> None:
    """Undo whatever part of :func:`_swap_in` was done, by what is where (``new``: the identity of the staged
    directory); a ``final`` that is not ours is another writer's and stays."""
    if new is None or _identity(final) != new:
        return  # nothing of ours was published
    if _identity(tmp) is not None:  # exchanged: the replaced directory is under our staging name
        if not _exchange(tmp, final):
            raise OSError(errno.ENOTSUP, "the exchange that published it cannot be undone", os.fspath(final))
    elif _identity(aside) is not None:  # the replaced one moved aside first
        os.rename(final, tmp)
        os.rename(aside, final)
    else:
        os.rename(final, tmp)


def staging_directory(final: str | os.PathLike, overwrite: bool, sweep=None) -> Path:
    """A new, empty staging directory beside ``final`` (its parents made, ``sweep()`` run first; by default the
    stale temporaries of ``final`` are swept). An existing ``final`` is ``FileExistsError`` unless
    ``overwrite``. An ``OSError`` names ``final``. :func:`publish_directory` makes it ``final``.

    >>> import tempfile, pathlib
    >>> s = staging_directory(pathlib.Path(tempfile.mkdtemp()) / "ckpt", overwrite=False)
    >>> s.name.startswith(".ckpt.@"), list(s.iterdir())
    (True, [])
    """
    final = Path(final)
    staging, made = None, []
    try:
        made = _make_parent(os.fspath(final.parent), os.fspath(final))
        (sweep or (lambda: remove_stale_partials(final)))()
        if os.path.lexists(final) and not overwrite:
            raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}; pass overwrite=True to replace it",
                                  os.fspath(final))
        staging = _partial_name(final)
        staging.mkdir()
    except BaseException as e:
        if staging is not None and not isinstance(e, OSError):  # made, then interrupted before it was handed
            with contextlib.suppress(OSError):  # over: it goes (it is empty)
                os.rmdir(staging)
        _remove_made(made)
        if isinstance(e, OSError):
            raise _naming_target(e, os.fspath(final), None if staging is None else os.fspath(staging)) from None
        raise
    if made:
        _made_for[os.fspath(staging)] = made
    return staging


_staging_directory = staging_directory  # the name sharded savers of 0.3's first commits used


def _fsync_tree(root: Path, files: bool) -> None:
    """fsync every directory under ``root`` (deepest first) and, with ``files``, every file."""
    for here, _dirs, names in os.walk(root, topdown=False):
        if files:
            for name in names:
                fsync_file(os.path.join(here, name))
        fsync_directory(here)


def publish_directory(staging: str | os.PathLike, final: str | os.PathLike, *, overwrite: bool, fsync: bool = True,
                      sync_files: bool = False) -> None:
    """The one atomic step of a directory commit: ``staging`` (complete) becomes ``final``.

    With ``fsync``: the staging tree's directories (and with ``sync_files`` its files) are fsynced first, then
    the rename (no-replace unless ``overwrite``: a checkpoint another writer committed meanwhile stays, and this
    raises ``FileExistsError`` naming it), then ``final``'s parent; if that last fsync fails the rename is taken
    back, so a call that raises has published nothing. The caller removes ``staging`` when this raises.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); s = staging_directory(d / "c", overwrite=False)
    >>> _ = (s / "x").write_bytes(b"1"); publish_directory(s, d / "c", overwrite=False); sorted(p.name for p in d.iterdir())
    ['c']
    """
    staging, final = Path(staging), Path(final)
    aside = _partial_name(final)
    new = _identity(staging)
    try:
        if fsync:
            _fsync_tree(staging, sync_files)
        _swap_in(staging, final, overwrite=overwrite, aside=aside)
        if fsync:
            try:
                fsync_directory(final.parent)
            except OSError as e:  # the directory's error is the checkpoint's
                raise type(e)(e.errno, e.strerror, os.fspath(final)) from None
    except BaseException as e:
        # Whatever step failed (or was interrupted right after it), what was published is taken back.
        with contextlib.suppress(OSError):
            _take_back(staging, final, aside, new)
        if isinstance(e, OSError):
            raise _naming_target(e, os.fspath(final), os.fspath(staging), inside=True) from None
        raise
    _made_for.pop(os.fspath(staging), None)  # published: the directories made for it are the checkpoint's
    for replaced in (staging, aside):  # the directory replaced, under one of our two private names
        if os.path.lexists(replaced):
            remove_temporary(replaced)


def retire_directory(path: str | os.PathLike, *, fsync: bool = True) -> None:
    """Remove a committed directory so that no reader ever sees a part of it: it leaves its name in one rename
    (to a temporary name a later sweep also removes), then its files go.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "step-1").mkdir(); retire_directory(d / "step-1"); list(d.iterdir())
    []
    """
    path = Path(path)
    trash = _partial_name(path)
    os.replace(path, trash)
    if fsync:
        fsync_directory(path.parent)
    remove_temporary(trash)


@contextlib.contextmanager
def _name_lock(directory: str, name: str, target: str) -> Iterator[None]:
    """Hold ``.<name>.commit-lock`` in ``directory`` (an ``flock``; its file removed on release): every commit
    of a set of files named ``name`` takes it, so its check of the claimed names and its renames are one step to
    every other such commit. A lock file whose holder died is taken at once (the kernel dropped the lock)."""
    import fcntl

    path = os.path.join(directory, f".{name}.commit-lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise _naming_target(OSError(e.errno, e.strerror, None), target, None) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the holder before us removed this file on release: take the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


_ASIDE = ".replaced"


class Commit:
    """One save's staging place and its one atomic step (the module docstring is the protocol).

    ``kind="directory"``: ``target`` is the directory a save makes; :attr:`staging` is an empty directory
    beside it that becomes ``target`` in one rename. ``kind="files"``: ``target`` is a prefix
    ``<directory>/<name>`` of a set of files (a TensorFlow prefix, a Hugging Face directory and file prefix);
    the files written into :attr:`staging` are renamed into ``<directory>``, the ``entry_points`` last, in
    their order. ``claims`` are the names (in ``<directory>``) any save of the layout could publish as entry
    points, and ``replaces`` a pattern of the names of its other files: with ``overwrite=False`` an existing
    one is :class:`FileExistsError` naming it; with ``overwrite=True`` they are the previous save, replaced.

    Nothing is published but by :meth:`publish`; :meth:`discard` (and leaving a ``with`` block by an
    exception) removes the staging place. Both are final: a commit publishes at most once.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with Commit(os.path.join(d, "ckpt"), kind="files", overwrite=False, entry_points=["ckpt.index"],
    ...             claims=["ckpt.index"]) as c:
    ...     write_file(c.staging / "ckpt.data", b"tensor bytes"); write_file(c.staging / "ckpt.index", b"index")
    >>> sorted(os.listdir(d))
    ['ckpt.data', 'ckpt.index']
    >>> Commit(os.path.join(d, "ckpt"), kind="files", overwrite=False, claims=["ckpt.index"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    FileExistsError: [Errno 17] File exists: a checkpoint is committed under this name; pass overwrite=True to replace it: '...ckpt.index'
    """

    def __init__(self, target: str | os.PathLike, *, overwrite: bool, fsync: bool = True, kind: str = "directory",
                 entry_points=(), claims=(), replaces: re.Pattern | None = None, sync_files: bool = True,
                 sweep=None) -> None:
        if kind not in ("directory", "files"):
            raise ValueError(f"kind must be 'directory' or 'files', got {kind!r}")
        self.target = Path(target)
        self.kind, self.overwrite, self.fsync, self.sync_files = kind, overwrite, fsync, sync_files
        self.entry_points, self.claims, self.replaces = list(entry_points), list(claims), replaces
        self._done = False
        self.directory = os.fspath(self.target.parent)
        if kind == "directory":
            self.staging = staging_directory(self.target, overwrite, sweep)
            return
        if not overwrite:  # refused at the start too, not only at the commit
            taken = self._taken()
            if taken:
                raise self._exists(taken[0])
        try:
            self.staging = staging_directory(self.target, overwrite=True, sweep=sweep)
        except OSError as e:  # a prefix names no file: the error names the entry point
            raise self._naming(e) from None

    def _taken(self) -> list[str]:
        """The names of the previous save in the directory: claimed entry points first, then its other files."""
        directory = os.fspath(self.target.parent)
        taken = [n for n in dict.fromkeys(self.claims + self.entry_points)
                 if os.path.lexists(os.path.join(directory, n))]
        if self.replaces is not None and os.path.isdir(directory):
            with os.scandir(directory) as entries:
                taken += sorted(e.name for e in entries if self.replaces.fullmatch(e.name) and e.name not in taken)
        return taken

    def _exists(self, name: str) -> FileExistsError:
        return FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)}: a checkpoint is committed under this "
                               "name; pass overwrite=True to replace it", os.path.join(self.target.parent, name))

    def __enter__(self) -> Commit:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.publish()
            return False
        self.discard()
        if isinstance(exc, OSError):
            raise self._naming(exc) from None
        return False

    def _naming(self, exc: OSError, file: str | None = None) -> OSError:
        """``exc`` naming the target: the directory (or the file under it) a directory commit makes; for a set
        of files the file under its directory, ``file`` (a name of the set) or else its entry point."""
        staging = getattr(self, "staging", None)
        staging = None if staging is None else os.fspath(staging)
        if self.kind == "directory":
            return _naming_target(exc, os.fspath(self.target), staging, inside=True)
        if exc.errno is None:
            return exc
        failed = None if exc.filename is None else os.fspath(exc.filename)
        ours = failed is None or failed in (os.fspath(self.target), self.directory) \
            or os.path.dirname(failed) == self.directory \
            or (staging is not None and (failed + os.sep).startswith(staging + os.sep))
        if not ours:
            return exc  # a source the save read, or another path it was given
        # a prefix names no file: the error names the file of the set, or else its entry point
        base = file or (os.path.basename(failed) if failed is not None else "")
        if not base.startswith(self.target.name) or base == self.target.name or base.endswith(_SUFFIX):
            base = self.entry_points[0] if self.entry_points else self.target.name
        return _naming_target(type(exc)(exc.errno, exc.strerror), os.path.join(self.directory, base), staging)

    def discard(self) -> None:
        """Remove the staging place and everything in it, and the directories the save made if they are empty
        again; nothing is published. Idempotent."""
        self._done = True
        abandon_staging(self.staging)

    def publish(self) -> None:
        """The atomic step: make what was staged visible under its final names, or raise and publish nothing."""
        if self._done:
            raise RuntimeError(f"{self.target}: this commit was already published or discarded")
        self._done = True
        try:
            if self.kind == "directory":
                publish_directory(self.staging, self.target, overwrite=self.overwrite, fsync=self.fsync,
                                  sync_files=self.sync_files)
            else:
                self._publish_files()
        except BaseException as e:
            self.discard()
            if isinstance(e, OSError):
                raise self._naming(e) from None
            raise
        _made_for.pop(os.fspath(self.staging), None)  # published: the directories made are the checkpoint's
        remove_temporary(self.staging)

    def _publish_files(self) -> None:
        directory, staging = self.directory, self.staging
        names = sorted(n for n in os.listdir(staging) if n != _ASIDE)
        order = [n for n in names if n not in self.entry_points] + [n for n in self.entry_points if n in names]
        if self.fsync:
            _fsync_tree(staging, self.sync_files)
        staged = {name: _identity(staging / name) for name in order}
        with _name_lock(directory, self.target.name, os.fspath(self.target)):
            taken = self._taken()
            taken += [n for n in order if n not in taken and os.path.lexists(os.path.join(directory, n))]
            if taken and not self.overwrite:
                raise self._exists(taken[0])
            aside = staging / _ASIDE
            try:
                if taken:
                    os.mkdir(aside)
                for name in taken:  # the previous save leaves, its entry points first
                    os.rename(os.path.join(directory, name), aside / name)
                for name in order:  # the data files, the entry points last
                    rename_noreplace(staging / name, os.path.join(directory, name))
                if self.fsync:
                    try:
                        fsync_directory(directory)
                    except OSError as e:
                        raise type(e)(e.errno, e.strerror, os.path.join(directory, order[-1])) from None
            except BaseException:
                # Taken back by what is where (a step interrupted right after it was made counts): the files
                # of this save leave, entry points first; the previous save's come back, entry points last.
                for name in reversed(order):
                    if _identity(os.path.join(directory, name)) == staged[name]:
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(directory, name))
                for name in reversed(taken):
                    if os.path.lexists(aside / name):
                        with contextlib.suppress(OSError):
                            os.rename(aside / name, os.path.join(directory, name))
                if self.fsync:
                    with contextlib.suppress(OSError):
                        fsync_directory(directory)
                raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, fsync: bool = True, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` when the block succeeds (a :class:`Commit`).

    Everything written inside is fsynced before the rename. An existing
    ``path`` is an error unless ``overwrite=True`` (then the old directory is
    replaced after the new one is complete): checked at the start, and again
    by the commit's no-replace rename, so a writer that finds ``path`` taken
    by another writer meanwhile raises :class:`FileExistsError` naming it and
    leaves no temporary. An ``OSError`` from inside names the file under
    ``path``, with the temporary as detail.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "step-1"
    >>> with atomic_directory(target) as tmp:
    ...     _ = (tmp / "a.txt").write_text("x")
    >>> sorted(p.name for p in target.iterdir())
    ['a.txt']
    """
    with Commit(path, overwrite=overwrite, fsync=fsync) as commit:
        yield commit.staging
