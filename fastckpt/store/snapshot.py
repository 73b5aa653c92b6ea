"""One pinned commit for every reader of several files, with a bounded number of open descriptors.

A checkpoint of several files (a sharded or RecIS-layout directory, a Hugging Face directory, a TensorFlow
prefix, a training checkpoint, each link of a delta chain) is read through one :class:`Snapshot`:

1. The directory is opened once (``O_DIRECTORY``); every later name is resolved relative to that descriptor,
   so a directory renamed over the path meanwhile (a save with ``overwrite=True``) is not followed.
2. The commit record (``manifest.json``, ``index``, an HF index) is read through it (:meth:`Snapshot.read`), and
   every file the reader will use is *pinned* (:meth:`Snapshot.pin`): its identity (device, inode, size,
   modification time in ns) is recorded at open. Pinning stats; it keeps no descriptor.
3. A file is opened only when it is read, relative to the pinned directory, and checked against its recorded
   identity; descriptors live in one small least-recently-used cache shared by every snapshot of the process
   (:data:`MAX_OPEN`, and never more than an eighth of ``RLIMIT_NOFILE``), so 10,000 files read under
   ``ulimit -n 256``. A mapping made by path (:func:`fastckpt.formats.reader.open_file`) is checked the same way
   (:meth:`Snapshot.check`).
4. A reader whose files live in a directory that is not replaced whole (Hugging Face's, TensorFlow's prefix)
   re-checks its commit record after pinning (:meth:`Snapshot.recheck`): a writer that removes or replaces the
   record before it replaces any other file is then always seen.

Whatever is not the file recorded (another inode, size or time, gone, a link) raises
:class:`~fastckpt.errors.CheckpointChangedError` naming the file and what changed: a reader reads one commit
whole or raises that, never parts of two. A file the commit record lists that is missing while the record is
still the one read is damage, not a change (:meth:`Snapshot.missing` tells them apart).

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> for name, data in (("manifest.json", b'{"n": 1}'), ("a.bin", b"abcd")):
...     _ = open(os.path.join(d, name), "wb").write(data)
>>> with Snapshot(d, record="manifest.json") as snap:
...     meta = snap.read_json("manifest.json"); _ = snap.pin("a.bin", size=4)
...     buf = bytearray(2); snap.read_into("a.bin", buf, 1); bytes(buf), meta
(b'bc', {'n': 1})
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import stat
import threading
from typing import Any, NamedTuple

from fastckpt.errors import CheckpointChangedError, CheckpointNotFoundError, FormatError
from fastckpt.store.manifest import MAX_JSON_BYTES, parse_json, read_bounded

__all__ = ["Snapshot", "Identity", "MAX_OPEN", "open_descriptors"]

#: The most descriptors all snapshots of the process keep open between reads (fewer under a low RLIMIT_NOFILE).
MAX_OPEN = 64

_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


class Identity(NamedTuple):
    """What a pinned file was when the snapshot recorded it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result | tuple) -> Identity:
        """The identity of a ``stat`` result, or of a mapping's ``identity`` tuple (device, inode, size, mtime_ns,
        ...).

        >>> Identity.of((1, 2, 3, 4, 5))
        Identity(device=1, inode=2, size=3, mtime_ns=4)
        """
        if isinstance(st, os.stat_result):
            return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return cls(*st[:4])

    def difference(self, other: Identity) -> str:
        """How ``other`` differs from this identity, in words.

        >>> Identity(1, 2, 3, 4).difference(Identity(1, 9, 5, 4))
        'another file (inode 9, was 2), 5 bytes (were 3)'
        """
        said = []
        if (other.device, other.inode) != (self.device, self.inode):
            said.append(f"another file (inode {other.inode}, was {self.inode})")
        if other.size != self.size:
            said.append(f"{other.size} bytes (were {self.size})")
        if other.mtime_ns != self.mtime_ns and not said:
            said.append("modified")
        return ", ".join(said) or "the same"


def _limit() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_OPEN
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return MAX_OPEN
    return max(2, min(MAX_OPEN, soft // 8))


# The descriptors every snapshot keeps open, least recently used first: (snapshot token, name) -> [fd, users].
_cache: collections.OrderedDict[tuple[int, str], list] = collections.OrderedDict()
_cache_lock = threading.Lock()
_tokens = itertools.count()  # a snapshot's key in the cache (never reused, unlike id())
# Tokens of snapshots collected while the lock was held (a collection can run inside any allocation): their
# descriptors are closed by the next call that holds the lock.
_orphans: list[int] = []


def open_descriptors() -> int:
    """How many file descriptors the snapshots of this process hold open between reads (not counting each
    snapshot's directory).

    >>> open_descriptors() >= 0
    True
    """
    with _cache_lock:
        return len(_cache)


def _evict_locked(keep: int) -> list[int]:
    """Drop the least recently used idle entries until at most ``keep`` remain, and every entry of a snapshot
    collected meanwhile; returns the fds to close."""
    closing = []
    while _orphans:
        token = _orphans.pop()
        closing += [_cache.pop(key)[0] for key in [k for k in _cache if k[0] == token]]
    if len(_cache) <= keep:
        return closing
    for key in list(_cache):
        if len(_cache) - len(closing) <= keep:
            break
        entry = _cache[key]
        if entry[1] == 0:
            closing.append(entry[0])
            del _cache[key]
    return closing


class Snapshot:
    """One commit of the directory ``path``, pinned (see the module docs).

    ``record`` names the commit record (the file whose presence is the commit: ``manifest.json``, an index):
    :meth:`changed` compares it and the directory itself against what the snapshot saw. ``what`` names the
    kind of checkpoint in errors. ``follow_links``: the files may be symbolic links (a Hugging Face hub cache
    links each file to its blob; the identity is then the target's); a checkpoint of fastckpt's own has none. A path that is not a directory raises
    :class:`~fastckpt.errors.CheckpointNotFoundError`.

    >>> import tempfile
    >>> Snapshot(tempfile.mkdtemp()).pinned()
    {}
    """

    def __init__(self, path: str | os.PathLike, *, record: str | None = None, what: str = "checkpoint",
                 follow_links: bool = False):
        self.path = os.fspath(path)
        self.follow_links = follow_links
        self._flags = _O_READ & ~getattr(os, "O_NOFOLLOW", 0) if follow_links else _O_READ
        self.record = record
        self.what = what
        self._pins: dict[str, Identity] = {}
        self._closed = True
        self._token = next(_tokens)
        try:
            self._dir = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{self.path}: no {what} here (not a directory)") from None
        self._closed = False
        self._self = Identity.of(os.fstat(self._dir))

    @property
    def fd(self) -> int:
        """The pinned directory's descriptor (``os.listdir(snapshot.fd)`` lists that commit's directory)."""
        return self._dir

    # -- pinning -----------------------------------------------------------------------------------
    def _where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def changed_error(self, name: str, detail: str) -> CheckpointChangedError:
        """The CheckpointChangedError for file ``name``, ``detail`` saying what changed.

        >>> import tempfile
        >>> str(Snapshot(tempfile.mkdtemp()).changed_error("a.bin", "gone")).endswith("open it again")
        True
        """
        return CheckpointChangedError(f"{self._where(name)}: {detail}; the checkpoint changed while it was opened "
                                      "(replaced by a save with overwrite=True, removed or truncated): open it again")

    def _adopt(self, name: str, identity: Identity) -> Identity:
        known = self._pins.setdefault(name, identity)
        if known != identity:
            raise self.changed_error(name, f"now {known.difference(identity)}")
        return identity

    def pin(self, name: str, *, size: int | None = None) -> Identity:
        """Record plain file ``name``'s identity (stat relative to the pinned directory; no descriptor kept) and
        return it. ``size``: the size the commit record gives it; another size is a
        :class:`~fastckpt.errors.CheckpointChangedError` (the file was truncated or replaced after the commit). A
        missing file raises as :meth:`missing` says; a link or another kind of file is a FormatError."""
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=self.follow_links)
        except FileNotFoundError:
            raise self.missing(name) from None
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a plain file"
            raise FormatError(f"{self._where(name)}: {kind}; the files of a {self.what} are plain files of its "
                              "directory")
        identity = self._adopt(name, Identity.of(st))
        if size is not None and identity.size != size:
            raise CheckpointChangedError(f"{self._where(name)}: {identity.size} bytes, the commit record says {size}: "
                                         "the file was truncated or replaced after the commit, or the "
                                         f"{self.what} changed while it was opened")
        return identity

    def pinned(self) -> dict[str, Identity]:
        """``{name: identity}`` of every file pinned so far."""
        return dict(self._pins)

    def check(self, name: str, identity: tuple | os.stat_result) -> None:
        """Raise :class:`~fastckpt.errors.CheckpointChangedError` unless ``identity`` (a mapping's ``identity``,
        a ``stat`` result) is the one pinned for ``name``: how a file mapped by its path is tied to the commit.

        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "a"), "wb").write(b"x")
        >>> s = Snapshot(d); s.check("a", os.stat(os.path.join(d, "a")))
        """
        self._adopt(name, Identity.of(identity))

    def recheck(self, name: str) -> None:
        """Raise :class:`~fastckpt.errors.CheckpointChangedError` unless ``name`` (the commit record, after every
        other file was pinned) is still the file pinned: the last step of opening a checkpoint whose directory is
        not replaced whole."""
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=self.follow_links)
        except FileNotFoundError:
            raise self.changed_error(name, "gone") from None
        self.check(name, st)

    def changed(self) -> str | None:
        """What changed since the snapshot was taken, in words, or None: the path names another directory (or
        none), or the commit record is gone or another file."""
        try:
            here = Identity.of(os.stat(self.path))
        except OSError:
            return f"{self.path} is gone"
        if (here.device, here.inode) != (self._self.device, self._self.inode):
            return f"{self.path} is another directory now"
        if self.record is not None and self.record in self._pins:
            try:
                now = Identity.of(os.stat(self.record, dir_fd=self._dir, follow_symlinks=self.follow_links))
            except OSError:
                return f"its {self.record} is gone"
            if now != self._pins[self.record]:
                return f"its {self.record} is {self._pins[self.record].difference(now)}"
        return None

    def missing(self, name: str, detail: str | None = None) -> FormatError:
        """The error for file ``name``, which the commit record lists, not being there: a
        :class:`~fastckpt.errors.CheckpointChangedError` when the checkpoint changed meanwhile (:meth:`changed`),
        else a FormatError (damage: ``detail`` says what lists it)."""
        change = self.changed()
        if change is not None:
            return self.changed_error(name, f"gone ({change})")
        return FormatError(f"{self._where(name)}: missing; {detail or f'the {self.what} lists it'}")

    def absent(self, name: str, message: str) -> FormatError | CheckpointNotFoundError:
        """The error for commit record ``name`` not being there: CheckpointNotFoundError ``message`` (no checkpoint
        in this directory), or CheckpointChangedError when the directory pinned is no longer the one at the path
        (a save with ``overwrite=True`` swapped it away and is removing it).

        >>> import tempfile
        >>> Snapshot(tempfile.mkdtemp()).absent("manifest.json", "no checkpoint here")
        CheckpointNotFoundError('no checkpoint here')
        """
        change = self.changed()
        if change is not None:
            return self.changed_error(name, f"gone ({change})")
        return CheckpointNotFoundError(message)

    # -- reading ----------------------------------------------------------------------------------------
    def read(self, name: str, *, limit: int = MAX_JSON_BYTES, missing: str | None = None) -> bytes:
        """The bytes of small file ``name`` (a commit record, a metadata file), read through the pinned directory
        and pinned as read; at most ``limit`` bytes (a FormatError beyond), never more than the file holds.
        A missing file raises ``FileNotFoundError`` when ``missing`` is None, else as :meth:`missing` (``missing``
        says what lists it)."""
        try:
            fd = os.open(name, self._flags, dir_fd=self._dir)
        except FileNotFoundError:
            if missing is None:
                raise
            raise self.missing(name, missing) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FormatError(f"{self._where(name)}: a symbolic link; the files of a {self.what} are plain "
                                  "files of its directory") from None
            raise
        try:
            self._adopt(name, Identity.of(os.fstat(fd)))
            data = read_bounded(fd, limit, self._where(name))
        finally:
            os.close(fd)
        if len(data) != self._pins[name].size:
            raise self.changed_error(name, f"{len(data)} bytes read, {self._pins[name].size} when opened")
        return data

    def read_json(self, name: str, *, limit: int = MAX_JSON_BYTES, missing: str | None = None,
                  **options: Any) -> Any:
        """:meth:`read` then :func:`~fastckpt.store.manifest.parse_json` (``options`` as there)."""
        return parse_json(self.read(name, limit=limit, missing=missing), self._where(name), **options)

    def _acquire(self, name: str) -> int:
        key = (self._token, name)
        with _cache_lock:
            entry = _cache.get(key)
            if entry is not None:
                entry[1] += 1
                _cache.move_to_end(key)
                return entry[0]
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")
        try:
            fd = os.open(name, self._flags, dir_fd=self._dir)
        except FileNotFoundError:
            raise self.changed_error(name, "gone") from None
        try:
            self.check(name, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        with _cache_lock:
            entry = _cache.get(key)
            if entry is not None:  # another thread opened it meanwhile: use that one
                closing = [fd]
                entry[1] += 1
            else:
                entry = _cache[key] = [fd, 1]
                closing = _evict_locked(_limit())
            fd = entry[0]
        for other in closing:
            os.close(other)
        return fd

    def _release(self, name: str) -> None:
        with _cache_lock:
            entry = _cache.get((self._token, name))
            if entry is not None:
                entry[1] -= 1
            closing = _evict_locked(_limit())
        for fd in closing:
            os.close(fd)

    def read_into(self, name: str, buffer, offset: int, what: str = "bytes") -> None:
        """Fill ``buffer`` (a writable buffer) with the bytes of pinned file ``name`` from byte ``offset`` on
        (``preadv`` from a descriptor of the pinned file, opened on demand and cached); a file that ends first is
        a FormatError naming it and ``what``."""
        view = memoryview(buffer).cast("B")
        fd = self._acquire(name)
        try:
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if not got:
                    raise FormatError(f"{self._where(name)}: ends inside {what} (read {done} of {len(view)} bytes at "
                                      f"offset {offset}); the file was truncated after it was opened")
                done += got
        finally:
            self._release(name)

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the directory and every cached descriptor of this snapshot (idempotent)."""
        self._close(blocking=True)

    def _close(self, blocking: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if _cache_lock.acquire(blocking=blocking):
            try:
                closing = [_cache.pop(key)[0] for key in [k for k in _cache if k[0] == self._token]]
            finally:
                _cache_lock.release()
            for fd in closing:
                os.close(fd)
        else:  # collected while this thread (or another) holds the lock: the next holder closes them
            _orphans.append(self._token)
        os.close(self._dir)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._close(blocking=False)  # never wait for the lock: a collection may run while it is held

    def __repr__(self) -> str:
        return f"<fastckpt.store.Snapshot {self.path!r} pinned={len(self._pins)}{' closed' if self._closed else ''}>"
