"""Reading a cold file: ``read_ahead`` (advice in steps) and ``read_into`` (``preadv`` straight into destinations).

A copy out of a fresh memory mapping of a file that is not in the page cache
takes one page fault per page, each waiting for the kernel's readahead window;
``madvise``/``posix_fadvise(WILLNEED)`` over the whole file does not change
that, as the kernel caps one advice call at its readahead window (one call over
a cold 128 MiB file read 16 MiB of it). :func:`read_ahead` advises a range in
steps of ``READAHEAD_STEP`` bytes, which puts every read of it in the disk's
queue at once; :class:`~fastckpt.formats.reader.TensorFile` uses it to keep a
window of the file read ahead of the views it hands out. :func:`read_into`
reads ``(destination, offset)`` pairs with ``preadv`` from ``threads`` threads,
the route of the staged device loads into pinned buffers. ``docs/reading.md``
has the measurements of both, and of the strategies not taken.

:func:`same_file` opens a mapped file's path again for reading, only where
``fstat`` shows the file the mapping was made of; :func:`read_into` fills
``(destination, file offset)`` pairs from it. A short read (the file was
truncated under the load) is an ``OSError`` naming the file and the offset.

>>> import os, tempfile, numpy as np
>>> fd, p = tempfile.mkstemp(); _ = os.write(fd, bytes(range(10))); os.close(fd)
>>> out = np.zeros(4, np.uint8)
>>> fd = os.open(p, os.O_RDONLY); calls = read_into(fd, [(out, 3)], p); os.close(fd)
>>> out.tolist()
[3, 4, 5, 6]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import threading

import numpy as np

from fastckpt.threads import kept_pool

__all__ = ["cached", "file_cached", "direct_pieces", "open_direct", "raise_if_changed", "read_checked", "read_ahead",
           "read_into", "same_file", "unchanged", "READ_PIECE", "READ_THREADS", "READAHEAD_STEP", "DIRECT_ALIGN",
           "DIRECT_PIECE", "DIRECT_THREADS"]

# One WILLNEED advice call covers at most this many bytes: the kernel reads at most its readahead window
# (read_ahead_kb, 128 KiB by default, 8 MiB on this project's machines) per call, whatever the length asked for,
# so a long range is advised in steps. Each step queues its reads and returns: the disk gets them all at once.
READAHEAD_STEP = 8 * 1024 * 1024

# One preadv reads at most this many bytes: large enough that a thread's reads stay sequential for the kernel's
# readahead, small enough that the pieces spread over the threads (see docs/reading.md for the measurements).
READ_PIECE = 8 * 1024 * 1024
# How many threads read at once: the kernel's readahead needs a reader waiting on each stream of pieces; more
# threads than this measured no faster on a 2-core machine and cost CPU on a shared one.
READ_THREADS = 2

# O_DIRECT reads (read_into's direct_fd): file offsets, memory addresses and lengths in whole blocks of DIRECT_ALIGN
# bytes (4096: every disk's logical block, 512 on most), DIRECT_PIECE bytes a call, DIRECT_THREADS calls at once. A
# direct read waits on the disk and uses next to no CPU, so more threads keep more of the disk's queue busy without
# costing the cores (512 MiB cold on this project's 2-core VM, docs/reading.md: 16 x 16 MiB and 8 x 8 MiB alike).
DIRECT_ALIGN = 4096
DIRECT_PIECE = 8 * 1024 * 1024
DIRECT_THREADS = 8

def _read_piece(fd: int, view: memoryview, offset: int, path: str, buffered: int | None = None) -> None:
    """Read ``len(view)`` bytes at ``offset`` of ``fd`` into ``view``; ``buffered`` is a plain descriptor of the same
    file where ``fd`` was opened ``O_DIRECT``, to fall back to where the file system refuses a direct read."""
    done, n = 0, len(view)
    while done < n:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            if buffered is None or e.errno != errno.EINVAL:
                raise
            fd, buffered = buffered, None  # no O_DIRECT here (tmpfs, some FUSE): the same read, buffered
            continue
        if got == 0:
            raise OSError(f"{path}: the file ended at byte {offset + done} while {n - done} more bytes of tensor "
                          f"data were read from there (was it truncated during the load?)")
        done += got


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def direct_pieces(view: memoryview, offset: int, piece: int, align: int = DIRECT_ALIGN) -> list:
    """``view`` (the destination of the file's bytes from ``offset`` on) cut into ``(view, offset, direct)`` reads:
    where the destination's address and the file offset agree modulo ``align``, the whole ``align`` blocks inside it
    in pieces of ``piece`` bytes at most (``direct``: fit for ``O_DIRECT``), and the unaligned head and tail
    (``align - 1`` bytes at most each) as plain reads; elsewhere plain pieces of ``piece`` bytes.

    >>> import numpy as np
    >>> block = np.zeros(4 * 4096, np.uint8); base = -block.ctypes.data % 4096
    >>> [(len(v), o, d) for v, o, d in direct_pieces(memoryview(block)[base + 100:base + 9000], 100, 4096)]
    [(3996, 100, False), (4096, 4096, True), (808, 8192, False)]
    """
    n = len(view)
    if n >= align and (_address(view) - offset) % align == 0:
        lo = -offset % align
        hi = (offset + n) // align * align - offset
        if hi > lo:
            pieces = [(view[:lo], offset, False)] if lo else []
            pieces += [(view[k:min(k + piece, hi)], offset + k, True) for k in range(lo, hi, piece)]
            if hi < n:
                pieces.append((view[hi:], offset + hi, False))
            return pieces
    return [(view[k:k + piece], offset + k, False) for k in range(0, n, piece)]


def read_into(fd: int, pairs, path: str, *, threads: int = READ_THREADS, piece: int = READ_PIECE,
              direct_fd: int | None = None, done=None) -> int:
    """Fill every ``(destination, offset)`` of ``pairs`` with the bytes of the file ``fd`` at ``offset`` (a
    destination is any writable buffer: a numpy array, a memoryview, a mapped device buffer); returns the number of
    ``preadv`` calls made. Pieces of ``piece`` bytes are read by ``threads`` threads, in file order.

    ``direct_fd`` (the same file opened ``O_DIRECT``: :func:`open_direct`) reads the ``DIRECT_ALIGN`` blocks of
    each destination whose address agrees with its file offset modulo ``DIRECT_ALIGN`` straight from the disk
    into it (no page cache: no copy, little CPU), the unaligned heads and tails through ``fd``
    (:func:`direct_pieces`); a file system that refuses it is read through ``fd``. ``pairs`` may also hold
    ``(destination, offset, fd, direct_fd, path)`` of other files: every file's pieces are read at once.
    ``done(path, offset, length)`` (progress), where given, is called on the reading thread once each piece's
    bytes are in place; an exception from it ends the read as a failed read does.

    >>> import os, tempfile, numpy as np
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, bytes(range(20))); os.close(fd)
    >>> a, b = np.zeros(3, np.uint8), np.zeros(5, np.uint8)
    >>> fd = os.open(p, os.O_RDONLY)
    >>> read_into(fd, [(a, 0), (b, 10)], p, piece=2)
    5
    >>> os.close(fd); a.tolist(), b.tolist()
    ([0, 1, 2], [10, 11, 12, 13, 14])
    """
    if piece < 1 or threads < 1:
        raise ValueError(f"piece and threads must be positive, got piece={piece}, threads={threads}")
    jobs = []
    for pair in pairs:
        destination, offset = pair[0], pair[1]
        fd_, direct_, path_ = (pair[2], pair[3], pair[4]) if len(pair) > 2 else (fd, direct_fd, path)
        view = memoryview(destination).cast("B") if not isinstance(destination, np.ndarray) \
            else memoryview(destination.reshape(-1).view(np.uint8))
        if direct_ is None:
            jobs += [(fd_, view[lo:lo + piece], offset + lo, path_, None) for lo in range(0, len(view), piece)]
        else:
            jobs += [(direct_, v, o, path_, fd_) if direct else (fd_, v, o, path_, None)
                     for v, o, direct in direct_pieces(view, offset, piece)]
    jobs.sort(key=lambda job: job[2])  # file order; several files interleaved, each read from its start
    read = _read_piece if done is None else lambda *job: (_read_piece(*job), done(job[3], job[2], len(job[1])))
    if threads == 1 or len(jobs) < 2:
        for job in jobs:
            read(*job)
        return len(jobs)
    futures = [kept_pool("read", threads).submit(read, *job) for job in jobs]
    concurrent.futures.wait(futures)  # never return while a thread still writes into a destination
    for future in futures:
        future.result()
    return len(jobs)


def read_checked(pairs, files: list, path: str, what: str, done=None) -> int:
    """:func:`read_into` of ``pairs`` (``(destination, offset, descriptor, O_DIRECT descriptor, path)``) with
    ``DIRECT_THREADS`` threads in ``DIRECT_PIECE`` pieces, then every file of ``files`` (``(descriptor, O_DIRECT
    descriptor, mapping)``) checked unchanged: a short read or a file changed meanwhile is the
    :class:`~fastckpt.errors.FormatError` of :func:`raise_if_changed` naming it. Returns the ``preadv`` calls made.
    ``done`` is :func:`read_into`'s (progress, piece by piece).

    >>> import os, tempfile, numpy as np
    >>> from fastckpt._native.mapped import MappedFile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"abcdef"); os.close(fd)
    >>> m = MappedFile(p); fd = same_file(m); out = np.zeros(3, np.uint8)
    >>> read_checked([(out, 2, fd, None, p)], [(fd, None, m)], p, "reading it"), bytes(out)
    (1, b'cde')
    >>> os.close(fd)
    """
    try:
        calls = read_into(files[0][0], pairs, path, threads=DIRECT_THREADS, piece=DIRECT_PIECE, done=done)
    except OSError as exc:  # a short read: which file changed says more than where the read stopped
        for _fd, _direct, mapped in files:
            raise_if_changed(mapped, what, exc)
        raise
    for fd, _direct, mapped in files:
        if not unchanged(fd, mapped.identity):
            raise_if_changed(mapped, what)
    return calls


def open_direct(path: str, identity) -> int | None:
    """A descriptor of ``path`` opened ``O_DIRECT`` (reads that bypass the page cache), or None where the platform
    or file system has no such reads, or ``fstat`` shows another file than ``identity`` (a mapping's
    ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``). The caller closes it.

    >>> import os, tempfile
    >>> fd, p = tempfile.mkstemp(); os.close(fd)
    >>> open_direct(p, (0, 0, 0, 0, 0)) is None     # another identity
    True
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or identity is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except (OSError, TypeError, ValueError):
        return None
    if not unchanged(fd, identity):
        os.close(fd)
        return None
    return fd


def raise_if_changed(mapped, what: str, cause: BaseException | None = None) -> None:
    """:class:`~fastckpt.errors.FormatError` naming the file of ``mapped`` (a
    :class:`~fastckpt._native.mapped.MappedFile`) where ``stat`` of its path no longer shows the file that was
    mapped (truncated, written to, replaced, gone): bytes read from it while ``what`` (``"reading its tensors"``)
    may not be the file that was opened. Nothing where it is unchanged, or has no identity (bytes in memory).

    >>> import os, tempfile
    >>> from fastckpt._native.mapped import MappedFile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"abc"); os.close(fd)
    >>> m = MappedFile(p); raise_if_changed(m, "reading it")
    >>> os.truncate(p, 1); raise_if_changed(m, "reading it")
    Traceback (most recent call last):
    ...
    fastckpt.errors.FormatError: ...: the file was truncated or replaced while reading it (it now holds 1 bytes, ...
    """
    identity = getattr(mapped, "identity", None)
    if identity is None:
        return
    try:
        st = os.stat(mapped.path)
    except OSError:
        st = None
    if st is not None and _identity(st) == tuple(identity):
        return
    from fastckpt.errors import FormatError

    now = "is gone" if st is None else f"now holds {st.st_size} bytes, opened with {identity[2]}" \
        if st.st_size != identity[2] else "was written to or replaced"
    raise FormatError(f"{mapped.path}: the file was truncated or replaced while {what} (it {now}); open it "
                      "again") from cause


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def unchanged(fd: int, identity) -> bool:
    """Whether ``fstat(fd)`` still shows the file of ``identity`` (``(st_dev, st_ino, st_size, st_mtime_ns,
    st_ctime_ns)``, a mapping's): a read from ``fd`` that ends with this True read that file's bytes, as they
    were (a write or truncation changes ``st_mtime_ns``/``st_ctime_ns``).

    >>> import os, tempfile
    >>> fd, p = tempfile.mkstemp(); st = os.fstat(fd)
    >>> unchanged(fd, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    True
    >>> os.close(fd)
    """
    try:
        return _identity(os.fstat(fd)) == tuple(identity)
    except OSError:
        return False


def read_ahead(mapped, start: int, end: int, step: int = READAHEAD_STEP, *, check: bool = True) -> int:
    """Ask the kernel to read bytes ``[start, end)`` of the file ``mapped`` maps (a
    :class:`~fastckpt._native.mapped.MappedFile`) into the page cache now, ahead of the copies that will read them
    (``madvise(MADV_WILLNEED)`` in steps of ``step`` bytes); returns the number of calls made: none where
    ``SAMPLES`` pages spread over the range are all in the page cache already (:func:`cached`, unless ``check`` is
    False: the advice would only look every page up again, 2-3 ms per 512 MiB). Advice only: a failure, or a mapping that is no mapping (the
    pread backend), changes nothing but the speed.

    >>> import os, tempfile
    >>> from fastckpt._native.mapped import MappedFile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"x" * 5000); os.close(fd)
    >>> read_ahead(MappedFile(p), 0, 5000, step=4096) in (0, 2)  # 0 where the pages are cached already
    True
    """
    calls = 0
    if end <= start or (check and cached(mapped, start, end)):
        return 0
    try:
        for lo in range(start, end, step):
            mapped.advise("willneed", lo, min(step, end - lo))
            calls += 1
    except (OSError, ValueError, AttributeError):
        pass
    return calls


SAMPLES = 2  # pages cached() asks about: the first and the last (about 2 us each)


_PAGE = mmap.PAGESIZE
_flag = threading.local()  # cached(): the byte mincore writes its answer into, one a thread
_mincore_fn = None  # libc's mincore through ctypes, made at the first call; False where there is none


def _mincore():
    global _mincore_fn
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _mincore_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)(
            ("mincore", libc))
    except (OSError, AttributeError):
        _mincore_fn = False
    return _mincore_fn


def cached(mapped, start: int, end: int, samples: int = SAMPLES, centred: bool = False) -> bool:
    """Whether ``samples`` pages spread evenly over bytes ``[start, end)`` of the mapping are all in the page cache
    (``mincore``, about 1.5 us a page): a cheap guess that the range is warm. The first and the last page are among
    them, or (``centred``) the pages in the middle of ``samples`` equal parts of the range: pages away from the
    places a parser reads (the file's ends, the headers of evenly sized members). False where it cannot be asked
    (no mapping, no ``mincore``).

    >>> import os, tempfile
    >>> from fastckpt._native.mapped import MappedFile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"x" * 8192); os.close(fd)
    >>> m = MappedFile(p); _ = bytes(m.view(0, 8192))
    >>> cached(m, 0, 8192)
    True
    """
    address = mapped.address
    fn = _mincore_fn if _mincore_fn is not None else _mincore()
    if address is None or end <= start or not fn:
        return False
    try:  # mincore writes here: a byte of this thread's own, made once (an open asks about its first page)
        vec, out = _flag.byte
    except AttributeError:
        vec = ctypes.c_ubyte()
        out = ctypes.addressof(vec)
        _flag.byte = (vec, out)
    base = address - address % _PAGE  # the mapping starts on a page; the file offset 0 is there
    first, last = start // _PAGE, (end - 1) // _PAGE
    for k in range(samples):
        index = first + ((last - first) * (2 * k + 1) // (2 * samples) if centred else
                         (last - first) * k // max(1, samples - 1))
        if fn(base + index * _PAGE, _PAGE, out) != 0 or not vec.value & 1:
            return False
    return True


def file_cached(fd: int, offsets) -> bool:
    """Whether the pages of the file ``fd`` holding each byte of ``offsets`` are all in the page cache (a page of
    the file mapped for a moment and asked with ``mincore``: nothing is read). False where it cannot be asked.

    >>> import os, tempfile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"x" * 5000); _ = os.pread(fd, 5000, 0)
    >>> file_cached(fd, [0, 4999])
    True
    >>> os.close(fd)
    """
    fn = _mincore_fn if _mincore_fn is not None else _mincore()
    if not fn:
        return False
    vec = bytearray(1)
    holder = (ctypes.c_char * 1).from_buffer(vec)
    try:
        size = os.fstat(fd).st_size
    except OSError:
        return False
    for offset in offsets:
        start = offset - offset % _PAGE
        try:  # (Python's mmap refuses to map past the file's end: the last page is mapped as far as it goes)
            page = mmap.mmap(fd, min(_PAGE, size - start), prot=mmap.PROT_READ, offset=start)
        except (OSError, ValueError):
            return False
        try:
            view = np.frombuffer(page, np.uint8)
            ok = fn(view.ctypes.data, _PAGE, ctypes.addressof(holder)) == 0 and vec[0] & 1
            del view
        finally:
            page.close()
        if not ok:
            return False
    return True


def same_file(mapped) -> int | None:
    """A new read-only descriptor of the file ``mapped`` (a :class:`~fastckpt._native.mapped.MappedFile`) was made
    of, or None where the path now names another file (``fstat`` differs from the mapping's ``identity``), cannot be
    opened, or the mapping has no identity (bytes in memory). The caller closes it.

    >>> import os, tempfile
    >>> from fastckpt._native.mapped import MappedFile
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"abc"); os.close(fd)
    >>> fd = same_file(MappedFile(p)); fd is not None
    True
    >>> os.close(fd)
    """
    identity = getattr(mapped, "identity", None)
    if identity is None:
        return None
    try:
        fd = os.open(mapped.path, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, TypeError, ValueError):
        return None
    try:
        if _identity(os.fstat(fd)) == tuple(identity):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None
