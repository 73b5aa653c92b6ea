"""Object storage and remote filesystems: ``s3://``, ``gs://``, ``memory://`` and every other fsspec URL.

Every save and load of fastckpt that takes a path also takes a URL (``scheme://...`` with a scheme other than
``file``); :func:`is_url` tells which. The file's or checkpoint's bytes are exactly those of a local save: the
local writers build them (in a temporary file or directory on this machine) and this module moves them. The
filesystem comes from ``fsspec.core.url_to_fs(url, **storage_options)`` (:func:`filesystem`); ``s3://`` needs
``pip install 'fastckpt[s3]'`` (fsspec and s3fs), other schemes their fsspec implementation.

Commit protocol
---------------
Uploads and the commit of a prefix (the manifest last) are :mod:`fastckpt.store.remote`'s; this module
re-exports its names (``put_file``, ``put_directory``, ``committed``, ...) and reads.

Loads
-----
Every byte read from a URL comes through :mod:`fastckpt.formats.stream` (parallel ranged GETs, each piece
delivered straight to its destination; at most ``THREADS x CHUNK`` bytes held; conditional on the object's ETag).
:func:`open` (``fastckpt.open(url)``) reads a tensor file's index with ranged reads (safetensors: bytes ``0..8``
and the header; NPZ: the ZIP end records, the central directory and each member's local and ``.npy``
headers), then fetches only the payloads of the tensors asked for (``names=``; on ``s3://`` and ``http(s)://``
while the caller already reads the first ones) into anonymous memory of the object's size (a ``memfd``: no file
on any filesystem; only what is fetched takes space), which is then mapped:
the reader is the same :class:`~fastckpt.formats.reader.TensorFile` as for a local file, its views zero-copy in
that memory. :func:`open_streamed` reads the index only: the device loads (``load_file(url, ...)``,
``load_model(url)``) stream the payloads into the pooled arena or the tensors' buffers. A prefix holding a
Hugging Face checkpoint opens as :class:`RemoteHFSharded`. Local paths never come here: they keep the mapped
zero-copy path of :func:`fastckpt.open`.

>>> import fastckpt, numpy as np
>>> fastckpt.save_safetensors("memory://doc/remote.safetensors", {"a": np.arange(3, dtype=np.int32),
...                                                             "b": np.ones(2, np.float32)})
>>> with fastckpt.open("memory://doc/remote.safetensors", names=["a"]) as f:
...     f.format, list(f.keys()), f.host("a").tolist()
('safetensors', ['a'], [0, 1, 2])
"""

from __future__ import annotations

import bisect
import builtins
import contextlib
import functools
import os
import shutil
import struct
import tempfile
import threading
from typing import Iterable, Iterator

from fastckpt._native.safetensors import MAX_HEADER_SIZE
from fastckpt.errors import CheckpointNotFoundError, FormatError
from fastckpt.formats.contract import tensor_not_found
from fastckpt.formats.reader import TensorFile, detect_format, open_file, register_url_opener, sniff_length
from fastckpt.formats.stream import Checksums, RemoteObject, Scatter, _crc32, merged, stream
from fastckpt.store.remote import (  # noqa: F401 - the write side, re-exported: one module names both
    clear,
    committed,
    committed_prefixes,
    filesystem,
    is_url,
    join,
    put_directory,
    put_file,
    remove_uncommitted,
    save_file,
)
from fastckpt.store.names import RELATIVE_PATH

__all__ = ["is_url", "filesystem", "join", "put_file", "put_directory", "clear", "get_directory", "committed",
           "committed_prefixes", "remove_uncommitted", "save_file", "local_copy", "open", "open_streamed",
           "streamed_source", "RemoteTensorFile", "StreamedTensorFile", "RemoteHFSharded"]

# Downloads to local files are read in pieces of this size (fastckpt.formats.stream: THREADS at a time).
_RANGE = 16 << 20
_HEAD = 64 << 10


def get_directory(url: str, local: str | os.PathLike, marker: str = "manifest.json",
                  storage_options: dict | None = None) -> list[str]:
    """Download the committed checkpoint prefix ``url`` into the local directory ``local``; returns its files.

    Files come in parallel, large ones in parallel ranges. An uncommitted prefix (no ``marker``) is a
    :class:`~fastckpt.errors.CheckpointNotFoundError`.

    >>> import tempfile
    >>> fs, _ = filesystem("memory://doc/got")
    >>> fs.pipe({"/doc/got/manifest.json": b"{}", "/doc/got/sub/a.bin": b"abc"})
    >>> d = tempfile.mkdtemp()
    >>> get_directory("memory://doc/got", d), builtins.open(d + "/sub/a.bin", "rb").read()
    (['manifest.json', 'sub/a.bin'], b'abc')
    """
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    fs.invalidate_cache(path)
    try:
        listing = fs.find(path, withdirs=False, detail=True)
    except FileNotFoundError:
        listing = {}
    base = path.strip("/") + "/"
    sizes = {}
    for key, entry in listing.items():
        rel = key.strip("/")[len(base):]
        RELATIVE_PATH.check(rel, "object key", where=url, error=FormatError)  # never a file outside the copy
        sizes[rel] = int(entry.get("size") or 0)
    if marker not in sizes:
        what = "nothing there" if not sizes else f"{len(sizes)} files but no {marker!r}: a save that did not commit"
        raise CheckpointNotFoundError(f"{url}: no committed checkpoint ({what}); expected {join(url, marker)}")
    local = os.fspath(local)
    ranges = []
    for rel, size in sorted(sizes.items()):
        target = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with builtins.open(target, "wb") as f:
            f.truncate(size)
        ranges.append((f"{path}/{rel}", target, [(0, size)]))
    _fetch_into(fs, url, ranges)
    return sorted(sizes)


def _fetch_into(fs, url: str, plan: list[tuple[str, str, list[tuple[int, int]]]]) -> None:
    """Fetch byte ranges of remote files into local files at the same offsets: every range of every file in one
    pool of parallel ranged reads (:func:`fastckpt.formats.stream.stream`, pieces of ``_RANGE`` bytes).

    ``plan``: (remote path, local file, [(start, end), ...]); the local files exist and are large enough.
    """
    fds: dict[str, int] = {}
    jobs = []
    try:
        for remote, target, spans in plan:
            spans = [(s, e) for s, e in spans if e > s]
            if not spans:
                continue
            if target not in fds:
                fds[target] = os.open(target, os.O_WRONLY)
            obj = RemoteObject(fs.unstrip_protocol(remote), fs=fs, path=remote,
                               info={"size": max(e for _, e in spans)})  # a listing's size: checked by each read
            jobs.append((obj, spans, functools.partial(_pwrite_at, fds[target]), None))
        stream(jobs, chunk=_RANGE, parts=True)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pwrite_at(fd: int, position: int, data) -> None:
    _pwrite_all(fd, data, position)


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


@contextlib.contextmanager
def local_copy(url: str, marker: str = "manifest.json", storage_options: dict | None = None) -> Iterator[str]:
    """A temporary local directory holding the committed checkpoint prefix ``url``; removed on leaving.

    An error raised inside names ``url`` where it named the temporary directory (which is gone by then).

    >>> fs, _ = filesystem("memory://doc/lc")
    >>> fs.pipe({"/doc/lc/manifest.json": b"{}"})
    >>> with local_copy("memory://doc/lc") as d:
    ...     sorted(os.listdir(d))
    ['manifest.json']
    """
    tmp = tempfile.mkdtemp(prefix="fastckpt-down-")
    try:
        with naming_url(tmp, url):
            get_directory(url, tmp, marker, storage_options)
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def naming_url(local: str, url: str) -> Iterator[None]:
    """An error raised inside names ``url`` where its message named ``local``, the local copy of ``url``
    (which is gone by the time the caller reads it).

    >>> with naming_url("/tmp/x", "s3://b/ckpt/"):
    ...     raise ValueError("/tmp/x/manifest.json: bad")
    Traceback (most recent call last):
    ...
    ValueError: s3://b/ckpt/manifest.json: bad
    """
    try:
        yield
    except Exception as e:
        if e.args and isinstance(e.args[0], str) and local in e.args[0]:
            e.args = (e.args[0].replace(local, url.rstrip("/")), *e.args[1:])
        raise


# -- tensor files ----------------------------------------------------------------------------------

class _Local:
    """The fetched bytes of one object, at their offsets, in anonymous memory of the object's size (a ``memfd``:
    no file on any filesystem; holes take no memory), mapped by the parsers and readers as a file is."""

    def __init__(self, obj: RemoteObject):
        self.obj = obj
        self.have: list[tuple[int, int]] = []
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("fastckpt-open", os.MFD_CLOEXEC)
            self.path, self._unlink = f"/proc/self/fd/{self.fd}", None
        else:  # no memfd (not Linux): an unlinked temporary file
            self.fd, self.path = tempfile.mkstemp(prefix="fastckpt-open-", suffix=".part")
            self._unlink = self.path
        os.ftruncate(self.fd, obj.size)

    def fill(self, spans: list[tuple[int, int]], done=None) -> None:
        """Fetch the parts of ``spans`` not fetched yet, in parallel ranged reads written at their offsets (each
        part of a body by one ``pwrite``: one copy, into the pages the reader maps, with no page faults);
        ``done(start, end)`` once each span is in (:meth:`RemoteObject.stream`)."""
        spans = _missing(spans, self.have)
        self.obj.stream(spans, functools.partial(_pwrite_at, self.fd), parts=True, done=done)
        self.have += spans

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (clipped to the object), fetched first where they are not yet."""
        end = min(end, self.obj.size)
        self.fill([(start, end)])
        return os.pread(self.fd, end - start, start)

    def map(self, **options) -> TensorFile:
        """The reader over what is fetched, errors naming the URL."""
        try:
            return open_file(self.path, **options)
        except FormatError as e:
            raise FormatError(str(e).replace(self.path, self.obj.url)) from None

    def close(self) -> None:
        """Close the descriptor (a mapping made keeps the memory until its reader and views are gone)."""
        os.close(self.fd)
        if self._unlink:
            os.unlink(self._unlink)


class _Stopped(Exception):
    """The reader was closed while its payloads were being fetched."""


class _Filling:
    """The payloads of a reader :func:`open` handed out at once, fetched into its :class:`_Local` on a thread of its
    own: pieces of ``stream.CHUNK`` bytes of ``spans``, each marked as arrived once all of it is in place, so that a
    copy of a tensor waits for that tensor's pieces only (:meth:`wait`), while the rest arrive. The first error of
    the fetch (an object changed or cut short, a failed request) is raised by every wait from then on; :meth:`stop`
    ends the fetch (at the next part of a body) and waits for the thread. The thread closes the local copy's
    descriptor when it ends; the reader's mapping keeps the bytes."""

    def __init__(self, local: _Local, spans: list[tuple[int, int]]):
        from fastckpt.formats import stream as _stream

        chunk = _stream.CHUNK
        self.local = local
        self.pieces = [(lo, min(end, lo + chunk)) for start, end in spans for lo in range(start, end, chunk)]
        self.starts = [lo for lo, _hi in self.pieces]
        self.arrived = [False] * len(self.pieces)
        self.error: BaseException | None = None
        self.finished = self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="fastckpt-open-fill", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            obj, fd = self.local.obj, self.local.fd

            def write(position: int, data) -> None:
                if self.stopped:
                    raise _Stopped()
                _pwrite_all(fd, data, position)

            obj.stream(self.pieces, write, parts=True, done=self._arrive)  # one piece a span
            self.local.have += self.pieces
            obj.check()
        except BaseException as e:  # kept for the waits: the reader's next copy raises it
            with self.cond:
                self.error = _Stopped() if self.stopped else e  # closed: what stopped it is no error of the object
        finally:
            self.local.close()
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def _arrive(self, start: int, _end: int) -> None:
        with self.cond:
            self.arrived[bisect.bisect_left(self.starts, start)] = True
            self.cond.notify_all()

    def wait(self, ranges: Iterable[tuple[int, int]] | None = None) -> None:
        """Return once every byte of ``ranges`` (None: every piece) has arrived; raise the fetch's error once there
        is one."""
        if ranges is None:
            wanted = range(len(self.pieces))
        else:
            wanted = []
            for start, end in ranges:
                i = max(0, bisect.bisect_right(self.starts, start) - 1)
                while i < len(self.pieces) and self.starts[i] < end:
                    if self.pieces[i][1] > start:
                        wanted.append(i)
                    i += 1
        with self.cond:
            while True:
                if self.error is not None and not isinstance(self.error, _Stopped):
                    raise self.error
                if self.finished and self.error is None or all(self.arrived[i] for i in wanted):
                    return
                if self.finished:  # stopped: the reader is closed
                    raise ValueError("the reader is closed: its tensors were not all fetched")
                self.cond.wait()

    def stop(self) -> None:
        """End the fetch (a reader closed before its tensors all arrived) and wait for its thread."""
        self.stopped = True
        self.thread.join()


def _index(obj: RemoteObject, max_header_size: int | None) -> tuple[_Local, TensorFile]:
    """Fetch the index of the NPZ or safetensors object ``obj`` into a :class:`_Local`; returns it and the
    reader over it (whose payloads are holes: zeros, never to be read)."""
    local = _Local(obj)
    try:
        url = obj.url
        head = local.read(0, _HEAD)
        fmt = detect_format(head[:sniff_length(head[:9])])
        if fmt == "safetensors":
            # At most one byte past the format's cap on the header: the parser then names the bad length.
            local.fill([(0, min(obj.size, 8 + min(int.from_bytes(head[:8], "little"), MAX_HEADER_SIZE + 1)))])
        elif fmt == "npz":
            _fetch_npz_index(local)
        else:
            raise FormatError(f"{url}: not an NPZ (ZIP) or safetensors file: first bytes are {head[:9]!r} "
                              "(expected b'PK\\x03\\x04' for NPZ, or an 8-byte little-endian header length "
                              "followed by '{' for safetensors)")
        return local, local.map(max_header_size=max_header_size)
    except BaseException:
        local.close()
        raise


def _object(url: str, storage_options: dict | None, what: str) -> RemoteObject | None:
    """The object at ``url``; None for a prefix (a directory, or no object but a Hugging Face checkpoint under
    it: an ``http(s)://`` server lists no directories)."""
    try:
        obj = RemoteObject(url, storage_options)
    except CheckpointNotFoundError:
        from fastckpt.formats.hfsharded import INDEX_NAME, SINGLE_NAME

        fs, path = filesystem(url, storage_options)
        if any(fs.exists(f"{path.rstrip('/')}/{name}") for name in (INDEX_NAME, SINGLE_NAME)):
            return None
        raise CheckpointNotFoundError(f"{url}: no such object (expected {what})") from None
    return None if obj.info.get("type") == "directory" else obj


def open(url: str, *, storage_options: dict | None = None, names: Iterable[str] | None = None,  # noqa: A001
         backend: str = "mmap", copy_on_write: bool = False, max_header_size: int | None = None):
    """Open the NPZ or safetensors file at ``url`` (or the Hugging Face sharded checkpoint under the prefix
    ``url``), fetching its index and the tensors ``names`` (None: all).

    ``fastckpt.open(url, ...)`` comes here for a URL. Only the index and the payloads of ``names`` leave the
    store: parallel ranged reads (:mod:`fastckpt.formats.stream`) written straight into the reader's memory
    (anonymous memory of the object's size, of which only the fetched ranges take space; no temporary file), so
    the reader's host arrays are views of the bytes as they arrived; at most ``THREADS x CHUNK`` bytes are held
    besides. The reader holds those tensors only (``keys()`` are ``names``, in file order). A name the file does
    not hold is a :class:`~fastckpt.errors.TensorNotFoundError`; an object replaced or truncated while it is read
    is an error naming it and the offset, never a mix.

    Where every piece is conditional on the object's ETag (``s3://``, ``http(s)://``:
    :attr:`RemoteObject.conditional`), the reader is returned once the index is read, and the payloads arrive on a
    thread of their own (:class:`_Filling`): :meth:`RemoteTensorFile.host` and ``hosts`` wait for their tensors'
    pieces only, so the caller's copies overlap the download; what reads the mapping itself waits for every byte.
    The fetch's error is raised by the next read of a tensor. Other stores, and ``copy_on_write=True`` (a written
    page would keep the zeros of a tensor yet to arrive), get every byte, checked, before this returns.
    ``backend``, ``copy_on_write`` and ``max_header_size`` apply as :func:`fastckpt.open` applies them to a file. A prefix holding ``model.safetensors`` or
    ``model.safetensors.index.json`` opens as a :class:`RemoteHFSharded` (every shard's tensors fetched).

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_npz("memory://doc/open.npz", {"x": np.arange(4, dtype=np.int16), "y": np.zeros(3)})
    >>> with open("memory://doc/open.npz", names=["y"]) as f:
    ...     f.path, list(f), f["y"].tolist()
    ('memory://doc/open.npz', ['y'], [0.0, 0.0, 0.0])
    """
    obj = _object(url, storage_options, "an NPZ or safetensors file")
    if obj is None:
        return RemoteHFSharded(url, storage_options, streamed=False, max_header_size=max_header_size,
                               names=names, backend=backend, copy_on_write=copy_on_write)
    local, index = _index(obj, max_header_size)
    try:
        with index:
            wanted = _select(index, url, names)
        spans = merged((i.offset, i.offset + i.nbytes) for i in wanted)
        if obj.conditional and backend == "mmap" and not copy_on_write:
            # Every piece is of this very object: the reader is handed out now and its tensors as they arrive.
            whole = local.map(backend=backend, max_header_size=max_header_size)
            filling, local = _Filling(local, spans), None  # the filling closes it
            return RemoteTensorFile(whole, url, [i.name for i in wanted], filling)
        local.fill(spans)
        obj.check()  # a store without conditional reads: the ranges came from several requests, one object?
        # Mapped once every byte it serves is in place.
        whole = local.map(backend=backend, copy_on_write=copy_on_write, max_header_size=max_header_size)
    finally:
        if local is not None:
            local.close()  # the mapping keeps the bytes until the reader is closed and its views are gone
    return RemoteTensorFile(whole, url, [i.name for i in wanted])


def open_streamed(url: str, *, storage_options: dict | None = None, max_header_size: int | None = None):
    """A reader of the NPZ or safetensors file at ``url`` (or of the Hugging Face sharded prefix ``url``) that
    holds only the index: its tensors stream from the store when read, each straight into its destination.

    :func:`~fastckpt.device.load.load_file` and :func:`~fastckpt.io.load_model` of a URL read through one:
    the pooled arena or each tensor's device buffer is written by the parallel ranged reads
    (:func:`streamed_source` tells them where the bytes are). ``host(name)`` and ``hosts(names)`` fetch into
    new arrays (every call reads the store again). A file with compressed NPZ members is fetched whole instead
    (:func:`open`): inflating needs the member's bytes in one place.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/lazy.safetensors", {"a": np.arange(3.0), "b": np.ones(2)})
    >>> with open_streamed("memory://doc/lazy.safetensors") as f:
    ...     f.hosts()["a"].tolist(), f.remote.stats.requests
    ([0.0, 1.0, 2.0], 2)
    """
    obj = _object(url, storage_options, "an NPZ or safetensors file")
    if obj is None:
        return RemoteHFSharded(url, storage_options, streamed=True, max_header_size=max_header_size)
    local, index = _index(obj, max_header_size)
    local.close()
    if any(i.compression is not None for i in index.infos.values()):
        index.close()
        return open(url, storage_options=storage_options, max_header_size=max_header_size)
    return StreamedTensorFile(index, url, obj)


def streamed_source(mapped) -> RemoteObject | None:
    """The object whose payloads ``mapped`` (the mapping of an :func:`open_streamed` reader's index) stands
    for, or None for a mapping that holds its bytes. The device loads stream from it instead of copying from
    the mapping.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/src.safetensors", {"a": np.arange(3.0)})
    >>> f = open_streamed("memory://doc/src.safetensors")
    >>> streamed_source(f.mapped) is f.remote, streamed_source(fastckpt.open("memory://doc/src.safetensors").mapped)
    (True, None)
    """
    entry = _STREAMED.get(id(mapped))
    return entry[1] if entry is not None and entry[0] is mapped else None


_STREAMED: dict[int, tuple] = {}  # id(mapping) -> (mapping, RemoteObject), while its StreamedTensorFile is open


def _select(whole, url: str, names):
    if names is None:
        return list(whole.infos.values())
    if isinstance(names, str):
        raise TypeError(f"names must be a list of tensor names, got the string {names!r}; use names=[{names!r}]")
    names = list(dict.fromkeys(names))
    for n in names:
        if n not in whole.infos:
            raise tensor_not_found(url, n, whole.infos)
    chosen = set(names)
    return [i for i in whole.infos.values() if i.name in chosen]


_merged = merged  # sorted byte ranges, neighbours closer than 64 KiB joined (fastckpt.sharded.remote's name)


def _missing(spans: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` not inside any range of ``have`` (bytes already fetched are not fetched again).

    >>> _missing([(0, 100), (200, 300)], [(50, 250)])
    [(0, 50), (250, 300)]
    """
    out = []
    for start, end in spans:
        for h_start, h_end in sorted(have):
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"


def _fetch_npz_index(local: _Local) -> None:
    """Fetch what the NPZ parser reads besides payloads: the end records, the central directory, each member's
    local header and ``.npy`` header (the first 64 KiB of each member, or all of a smaller one)."""
    url, size = local.obj.url, local.obj.size
    tail_start = max(0, size - _HEAD - 22)
    tail = local.read(tail_start, size)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise FormatError(f"{url}: no ZIP end-of-central-directory record in the last {len(tail)} bytes "
                          "(file truncated?)")
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _ZIP64_LOCATOR:
            raise FormatError(f"{url}: ZIP64 sizes without a ZIP64 locator before the end record at offset "
                              f"{tail_start + at}")
        (record,) = struct.unpack_from("<Q", tail, loc + 8)
        cd_size, cd_offset = struct.unpack_from("<QQ", local.read(record, record + 56), 40)
    if cd_offset + cd_size > size:
        raise FormatError(f"{url}: central directory at offset {cd_offset} ({cd_size} bytes) runs past the end of "
                          f"the {size}-byte file (truncated?)")
    local.fill([(cd_offset, tail_start)] if cd_offset < tail_start else [])
    import zipfile

    try:
        with zipfile.ZipFile(local.path) as z:
            starts = sorted(i.header_offset for i in z.infolist())
    except zipfile.BadZipFile as e:
        raise FormatError(f"{url}: bad ZIP central directory at offset {cd_offset}: {e}") from e
    ends = starts[1:] + [cd_offset]
    local.fill(merged([(s, min(e, s + _HEAD)) for s, e in zip(starts, ends)]))


class RemoteTensorFile(TensorFile):
    """The reader of a tensor file opened from a URL: a :class:`~fastckpt.formats.reader.TensorFile` over a
    private local copy of the index and the tensors fetched, holding only those tensors.

    It implements the reader contract (:class:`~fastckpt.formats.contract.TensorReader`); ``path`` is the URL.

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/rtf.safetensors", {"w": np.eye(2, dtype=np.float32)})
    >>> f = fastckpt.open("memory://doc/rtf.safetensors")
    >>> f, f.info("w").shape
    (<fastckpt.RemoteTensorFile 'memory://doc/rtf.safetensors' format=safetensors tensors=1>, (2, 2))
    >>> f.close(); f
    <Closed fastckpt.RemoteTensorFile>
    """

    def __init__(self, whole: TensorFile, url: str, names: list[str], filling: _Filling | None = None):
        self._filling = filling  # the payloads still arriving (None: all in place)
        chosen = set(names)
        super().__init__(whole.mapped, whole.format, [i for i in whole.infos.values() if i.name in chosen],
                         whole.metadata)
        self.url = url
        self._size = 0  # all in memory: nothing for the kernel to read ahead

    @property
    def mapped(self):
        """The mapping of the fetched bytes, once every tensor's bytes are in place (a caller of the mapping itself
        waits for all of them; :meth:`host` and :meth:`hosts` wait for their tensors' only)."""
        filling = self._filling  # close() may drop it meanwhile
        if filling is not None:
            filling.wait()
        return self._mapped

    @mapped.setter
    def mapped(self, value) -> None:
        self._mapped = value

    def _arrived(self, names) -> None:
        filling = self._filling  # close() may drop it meanwhile
        if filling is not None:
            infos = [self.infos.get(n) for n in names]
            filling.wait([(i.offset, i.offset + i.nbytes) for i in infos if i is not None and i.nbytes])

    def host(self, name: str):
        """The tensor, as :meth:`~fastckpt.formats.reader.TensorFile.host`, once its bytes have arrived (its
        copy goes on while the next tensors arrive); an error of the fetch (the object changed or was cut short
        meanwhile) is raised here."""
        self._arrived((name,))
        return super().host(name)

    def hosts(self, names: Iterable[str] | None = None) -> dict:
        """``{name: host(name)}``, as :meth:`~fastckpt.formats.reader.TensorFile.hosts`, once their bytes have
        arrived."""
        if isinstance(names, str):
            raise TypeError(f"names must be a list of tensor names, got the string {names!r}; use names=[{names!r}]")
        names = None if names is None else list(names)
        self._arrived(self.infos if names is None else names)
        return super().hosts(names)

    def close(self) -> None:
        """Stop fetching what has not arrived (idempotent); views already made stay valid."""
        filling, self._filling = self._filling, None
        if filling is not None:
            filling.stop()
        self._mapped.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._mapped.closed

    @property
    def path(self) -> str:
        """The URL the file was opened from."""
        return self.url

    def __repr__(self) -> str:
        if self.closed:
            return "<Closed fastckpt.RemoteTensorFile>"
        return f"<fastckpt.RemoteTensorFile {self.url!r} format={self.format} tensors={len(self)}>"


class StreamedTensorFile(TensorFile):
    """The reader :func:`open_streamed` returns: the index of a tensor file at a URL, its payloads read from the
    store when asked for, each straight into its destination (see :func:`open_streamed`). ``remote`` is its
    :class:`~fastckpt.formats.stream.RemoteObject` (``remote.stats`` counts what was fetched).

    >>> import fastckpt, numpy as np
    >>> fastckpt.save_safetensors("memory://doc/stf.safetensors", {"w": np.eye(2, dtype=np.float32)})
    >>> f = open_streamed("memory://doc/stf.safetensors")
    >>> f, f.host("w").tolist()
    (<fastckpt.StreamedTensorFile 'memory://doc/stf.safetensors' format=safetensors tensors=1>, [[1.0, 0.0], [0.0, 1.0]])
    >>> f.close()
    """

    def __init__(self, index: TensorFile, url: str, obj: RemoteObject):
        super().__init__(index.mapped, index.format, index.infos, index.metadata)
        self.url = url
        self.remote = obj
        _STREAMED[id(index.mapped)] = (index.mapped, obj)

    @property
    def path(self) -> str:
        """The URL the file was opened from."""
        return self.url

    def host(self, name: str):
        """The tensor in a new array, fetched from the store now (parallel ranged reads)."""
        return self.hosts([name])[name]

    def hosts(self, names: Iterable[str] | None = None) -> dict:
        """``{name: array}`` for ``names`` (None: every tensor, in file order), fetched now in one round of
        parallel ranged reads straight into the new arrays (a read may span several tensors)."""
        import numpy as np

        if isinstance(names, str):
            raise TypeError(f"names must be a list of tensor names, got the string {names!r}; use names=[{names!r}]")
        infos = _select(self, self.url, None if names is None else list(names))
        out, targets = {}, []
        for info in infos:
            raw = np.empty(info.nbytes, np.uint8)
            out[info.name] = raw.view(info.dtype).reshape(info.shape, order="F" if info.fortran_order else "C")
            if info.nbytes:
                targets.append((info.offset, info.nbytes, functools.partial(_copy_into, raw)))
        scatter = Scatter(targets)
        self.remote.stream(scatter.spans(), scatter, parts=True)
        self.remote.check()
        return out if names is None else {name: out[name] for name in dict.fromkeys(names)}

    def check_as_read(self) -> Checksums:
        """From now on, check the CRC-32 of every NPZ member whose bytes are read (``load_model(url, verify=True)``):
        as the pieces stream to their destinations, each member's bytes are checked against the central directory
        once all of them have arrived (:class:`~fastckpt.formats.stream.Checksums`; the ``.npy`` header, read
        with the index, counts from here). A mismatch is a :class:`~fastckpt.errors.ChecksumMismatchError` raised
        from the stream, naming the URL, the member, its offset and both CRC-32s. Returns the checks
        (:meth:`check_the_rest` reads the members not read by then). A file with no such checksums (safetensors)
        is a ``ValueError``.

        >>> import fastckpt, numpy as np
        >>> fastckpt.save_npz("memory://doc/crc.npz", {"w": np.arange(5.0)})
        >>> f = open_streamed("memory://doc/crc.npz")
        >>> checks = f.check_as_read(); f.host("w").tolist(), checks.checked, checks.unchecked()
        ([0.0, 1.0, 2.0, 3.0, 4.0], 1, [])
        """
        from fastckpt.formats.npz import NpzTensorInfo

        infos = list(self.infos.values())
        if not all(isinstance(i, NpzTensorInfo) for i in infos):
            raise ValueError(f"{self.url}: verify=True checks the CRC-32 of NPZ members, and this {self.format} "
                             "file keeps none; load it with verify=False")
        members, seeds = [], {}
        with self.mapped.guard("the members' .npy headers for their CRC-32"):
            for i in infos:
                head = i.offset - i.header_nbytes
                seed = _crc32(self.mapped.view(head, i.header_nbytes, f"member {i.name + '.npy'!r}"), 0)
                members.append((i.name + ".npy", i.offset, i.offset + i.nbytes, i.crc32, seed))
                seeds[i.name + ".npy"] = i.header_nbytes
        self.remote.checksums = Checksums(self.url, members, seeds)
        return self.remote.checksums

    def check_the_rest(self) -> None:
        """Stream the members :meth:`check_as_read` has not seen whole yet through the check only (into no
        destination; at most ``THREADS x CHUNK`` bytes held), so that every member was checked."""
        checks = self.remote.checksums
        if checks is not None and checks.unchecked():
            self.remote.stream(checks.unchecked(), lambda _at, _data: None, parts=True)

    def close(self) -> None:
        """Forget the index (idempotent); arrays already fetched stay valid."""
        entry = _STREAMED.get(id(self.mapped))
        if entry is not None and entry[0] is self.mapped:
            del _STREAMED[id(self.mapped)]
        super().close()

    def __repr__(self) -> str:
        if self.closed:
            return "<Closed fastckpt.StreamedTensorFile>"
        return f"<fastckpt.StreamedTensorFile {self.url!r} format={self.format} tensors={len(self)}>"


def _copy_into(raw, at: int, data) -> None:
    import numpy as np

    raw[at:at + len(data)] = np.frombuffer(data, np.uint8)


def _hf_base():
    from fastckpt.formats.hfsharded import HFShardedDirectory

    return HFShardedDirectory


class RemoteHFSharded(_hf_base()):  # type: ignore[misc]
    """A Hugging Face safetensors checkpoint under a prefix at a URL (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards), as :class:`~fastckpt.formats.hfsharded.HFShardedDirectory`
    reads a local one: :func:`open` fetches every shard's tensors (or ``names``) with parallel ranged reads,
    :func:`open_streamed` only their indexes (device loads stream each shard into the pooled arena).

    >>> import fastckpt, numpy as np, tempfile
    >>> from fastckpt.formats.hfsharded import save_sharded
    >>> d = tempfile.mkdtemp()
    >>> _ = save_sharded(d, {"a": np.arange(4, dtype=np.int32), "b": np.ones(2)}, max_shard_size=16)
    >>> _ = put_directory(d, "memory://doc/hf", marker="model.safetensors.index.json")
    >>> with fastckpt.open("memory://doc/hf") as r:
    ...     r.format, list(r), list(r.files), r.host("a").tolist()
    ('hf-sharded', ['a', 'b'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'], [0, 1, 2, 3])
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, streamed: bool,
                 names: Iterable[str] | None = None, backend: str = "mmap", copy_on_write: bool = False,
                 max_header_size: int | None = None):
        self._remote = (storage_options, streamed, None if names is None else list(names))
        super().__init__(url.rstrip("/"), backend=backend, copy_on_write=copy_on_write,
                         max_header_size=max_header_size)

    def _open(self, options: dict) -> None:
        from fastckpt.formats.hfsharded import INDEX_NAME, SINGLE_NAME, parse_index

        url, (storage_options, streamed, names) = self.path, self._remote
        self.directory, self.unlisted = url, {}
        fs, path = filesystem(url, storage_options)

        def shard(name: str, wanted=None):
            shard_url = join(url, name)
            if streamed:
                return open_streamed(shard_url, storage_options=storage_options,
                                     max_header_size=options["max_header_size"])
            return open(shard_url, storage_options=storage_options, names=wanted, **options)

        try:
            raw = fs.cat_file(f"{path}/{INDEX_NAME}")
        except FileNotFoundError:
            raw = None
        if raw is None:
            try:
                f = shard(SINGLE_NAME, names)
            except CheckpointNotFoundError:
                raise CheckpointNotFoundError(
                    f"{url}: a prefix with neither {SINGLE_NAME} nor {INDEX_NAME}; fastckpt.open reads one NPZ or "
                    "safetensors file, or a Hugging Face checkpoint, from a URL (checkpoints: "
                    "fastckpt.train.load_checkpoint(url), fastckpt.sharded.Loader)") from None
            self._take_single(f)
            return
        self.index_path = join(url, INDEX_NAME)
        weight_map, raw_metadata = parse_index(raw, self.index_path)
        if names is not None:
            for n in names:
                if n not in weight_map:
                    raise tensor_not_found(self.index_path, n, weight_map)
            weight_map = {n: weight_map[n] for n in weight_map if n in set(names)}
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(8, max(1, len(by_file))), thread_name_prefix="fastckpt-shard") as ex:
            # Each shard's index takes a few requests in turn: the shards' go in parallel.
            futures = {file: ex.submit(shard, file, listed) for file, listed in by_file.items()}
        errors = []
        for file, future in futures.items():  # every one that opened is kept, so that close() closes it
            if future.exception() is None:
                self.files[file] = future.result()
            else:
                errors.append(future.exception())
        if errors:
            raise errors[0]
        # A shard opened for some of its tensors (names=) holds only those: nothing to say of the rest.
        infos: dict = {}
        for file, listed in by_file.items():
            self._take_shard(self.index_path, file, listed, infos, unlisted=names is None)
        self._take_index(self.index_path, weight_map, by_file, infos, raw_metadata, stacklevel=7)

    def __repr__(self) -> str:
        if self._closed:
            return "<Closed fastckpt.RemoteHFSharded>"
        return f"<fastckpt.RemoteHFSharded {self.path!r} files={len(self.files)} tensors={len(self)}>"


register_url_opener(open)  # fastckpt.open(url) comes here
